"""Builds a transport's sender or receiver from its ``KVTransport`` kind.

Transports are imported only when asked for, so a process that uses ZeroMQ never loads
ucxx (or its loop thread).
"""

from __future__ import annotations

from common.connector.base import KVReceiver, KVSender, KVTransport
from common.connector.failures import ErrorHook
from common.connector.faults import FaultPlan, FaultySender


def transport(kind: KVTransport | str) -> KVTransport:
    """``kind`` as a ``KVTransport``; raises ValueError for an unknown one."""
    try:
        return KVTransport(kind)
    except ValueError:
        known = ", ".join(t.value for t in KVTransport)
        raise ValueError(f"unknown KV transport {kind!r} (one of {known})") from None


def _frame_timeout(frame_timeout_s: float | None, default: float) -> float:
    if frame_timeout_s is None:
        return default
    if not frame_timeout_s > 0:
        raise ValueError(f"frame_timeout_s must be > 0, got {frame_timeout_s}")
    return frame_timeout_s


def make_sender(kind: KVTransport | str, *, on_error: ErrorHook | None = None,
                frame_timeout_s: float | None = None, faults: FaultPlan | None = None) -> KVSender:
    """A sender; ``frame_timeout_s`` None keeps the transport's default (zmq has none).
    ``faults`` (TEST ONLY, see ``common.connector.faults``) wraps it in a ``FaultySender``."""
    sender = _transport_sender(transport(kind), on_error, frame_timeout_s)
    if faults is None:
        return sender
    return FaultySender(sender, faults)


def _transport_sender(kind: KVTransport, on_error: ErrorHook | None,
                      frame_timeout_s: float | None) -> KVSender:
    if kind is KVTransport.UCX:
        from common.connector.ucx import FRAME_TIMEOUT_S, UcxSender

        return UcxSender(_frame_timeout(frame_timeout_s, FRAME_TIMEOUT_S), on_error=on_error)
    from common.connector.zmq import ZmqSender

    return ZmqSender(on_error=on_error)


def make_receiver(kind: KVTransport | str, address: str, *, on_error: ErrorHook | None = None,
                  frame_timeout_s: float | None = None) -> KVReceiver:
    """A receiver bound at ``address``; ``frame_timeout_s`` as for ``make_sender``."""
    if transport(kind) is KVTransport.UCX:
        from common.connector.ucx import FRAME_TIMEOUT_S, UcxReceiver

        return UcxReceiver(address, _frame_timeout(frame_timeout_s, FRAME_TIMEOUT_S), on_error=on_error)
    from common.connector.zmq import ZmqReceiver

    return ZmqReceiver(address, on_error=on_error)
