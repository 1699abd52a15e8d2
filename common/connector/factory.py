"""Builds a transport's sender or receiver from its ``KVTransport`` kind.

Transports are imported only when asked for, so a process that uses ZeroMQ never loads
ucxx (or its loop thread).
"""

from __future__ import annotations

from common.connector.base import KVReceiver, KVSender, KVTransport


def transport(kind: KVTransport | str) -> KVTransport:
    """``kind`` as a ``KVTransport``; raises ValueError for an unknown one."""
    try:
        return KVTransport(kind)
    except ValueError:
        known = ", ".join(t.value for t in KVTransport)
        raise ValueError(f"unknown KV transport {kind!r} (one of {known})") from None


def make_sender(kind: KVTransport | str) -> KVSender:
    if transport(kind) is KVTransport.UCX:
        from common.connector.ucx import UcxSender

        return UcxSender()
    from common.connector.zmq import ZmqSender

    return ZmqSender()


def make_receiver(kind: KVTransport | str, address: str) -> KVReceiver:
    if transport(kind) is KVTransport.UCX:
        from common.connector.ucx import UcxReceiver

        return UcxReceiver(address)
    from common.connector.zmq import ZmqReceiver

    return ZmqReceiver(address)
