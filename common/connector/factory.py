"""Builds a transport's sender or receiver from its ``KVTransport`` kind.

Transports are imported only when asked for, so a process that uses ZeroMQ never loads
ucxx (or its loop thread). Same-host shared memory rides on the zmq transport: a sender
given a ``SharedKV`` lends blocks from that segment, a receiver built with ``shm=True``
maps its peers' segments (``common.connector.shm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.connector.base import KVReceiver, KVSender, KVTransport, ShmMode
from common.connector.failures import ErrorHook
from common.connector.faults import FaultPlan, FaultySender

if TYPE_CHECKING:  # the segment module loads with the shm transport only
    from common.shared_memory import SharedSegment


@dataclass(frozen=True, slots=True)
class SharedKV:
    """What a sender needs to lend blocks in place: the segment they lie in, the
    ``--kv-shm`` mode (auto or on) and the worker's lease (a loan ends with it)."""

    segment: SharedSegment
    mode: ShmMode
    lease_seconds: float


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
                frame_timeout_s: float | None = None, faults: FaultPlan | None = None,
                shm: SharedKV | None = None) -> KVSender:
    """A sender; ``frame_timeout_s`` None keeps the transport's default (zmq has none).
    ``shm``: lend blocks of that segment through shared memory (zmq only).
    ``faults`` (TEST ONLY, see ``common.connector.faults``) wraps it in a ``FaultySender``."""
    sender = _transport_sender(transport(kind), on_error, frame_timeout_s, shm)
    if faults is None:
        return sender
    return FaultySender(sender, faults)


def _transport_sender(kind: KVTransport, on_error: ErrorHook | None,
                      frame_timeout_s: float | None, shm: SharedKV | None) -> KVSender:
    if kind is KVTransport.UCX:
        if shm is not None:
            raise ValueError("same-host shared memory needs --kv-transport zmq")
        from common.connector.ucx import FRAME_TIMEOUT_S, UcxSender

        return UcxSender(_frame_timeout(frame_timeout_s, FRAME_TIMEOUT_S), on_error=on_error)
    from common.connector.zmq import ZmqSender

    if shm is None:
        return ZmqSender(on_error=on_error)
    from common.connector.shm import ShmSender

    return ShmSender(ZmqSender(on_error=on_error), shm.segment, shm.mode, shm.lease_seconds)


def make_receiver(kind: KVTransport | str, address: str, *, on_error: ErrorHook | None = None,
                  frame_timeout_s: float | None = None, shm: bool = False) -> KVReceiver:
    """A receiver bound at ``address``; ``frame_timeout_s`` as for ``make_sender``;
    ``shm``: take transfers from same-host senders' segments (zmq only)."""
    if transport(kind) is KVTransport.UCX:
        from common.connector.ucx import FRAME_TIMEOUT_S, UcxReceiver

        return UcxReceiver(address, _frame_timeout(frame_timeout_s, FRAME_TIMEOUT_S), on_error=on_error)
    from common.connector.zmq import ZmqReceiver
    from common.shared_memory import PeerSegments

    return ZmqReceiver(address, on_error=on_error, segments=PeerSegments() if shm else None)
