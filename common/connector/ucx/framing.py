"""How transfers and acks are laid out on a UCX endpoint, and the coroutines that read
and write them (loop thread only).

Wire format, per transfer, on one endpoint (messages on the endpoint's own tag, which
UCX delivers in order)::

    8-byte little-endian header length | msgpack KVHandoff or KVPiece | block 0 | ... | block n-1 | COMMIT

and acks travel back on the same endpoint as ``length | msgpack KVAck``. UCX does not
report how many bytes a receive got, so the receiver probes each message's length
before receiving it: a header or block of the wrong size is rejected (``Malformed``)
before any memory is allocated for it.

Why ``COMMIT``: the receiver may read the blocks straight out of the sender's memory
(cma), and a sender whose lease expired frees them at once. UCX completes a block's send
only once its bytes have been taken, so the sender posts ``COMMIT`` only after every
block's send completed and only if the transfer was not abandoned meanwhile; the
receiver delivers nothing before ``COMMIT``. Bytes read from freed blocks are never
delivered.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from common.connector.failures import log
from common.connector.ucx.buffers import ReceiveBuffers
from common.connector.ucx.loop import ucxx
from common.protocol import MAX_MESSAGE_BYTES, KVHandoff, KVPiece

_LEN = struct.Struct("<Q")
FRAME_TIMEOUT_S = 30.0  # longest wait for the next frame of a transfer already begun
COMMIT = b"KVCOMMIT"  # a transfer's last message: every block was taken before any was freed
_PROBE_MAX_SLEEP_S = 0.001  # probing backs off to this; frames of a transfer come in bursts


def parse_address(addr: str) -> tuple[str, int]:
    """``ucx://HOST:PORT`` (HOST may be ``[v6]``) as (host, port)."""
    if not addr.startswith("ucx://"):
        raise ValueError(f"not a ucx:// address: {addr!r}")
    host, sep, port = addr[len("ucx://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"ucx address must be ucx://HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def framed(body: bytes) -> list[bytes]:
    """``body`` as the two messages ``length | body``."""
    return [_LEN.pack(len(body)), body]


class Malformed(Exception):
    """The peer sent something that is not a well-formed transfer or ack."""

    def __init__(self, transfer_id: str, reason: str) -> None:
        super().__init__(reason)
        self.transfer_id = transfer_id
        self.reason = reason


async def _next_length(ep: Any, timeout: float, what: str, transfer_id: str) -> int:
    """Size of the next message on ``ep``, probed without receiving it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    sleep = 0.0
    while True:
        probe = ep.tag_probe()
        if probe.matched:
            return probe.length
        if ep.closed:
            raise ConnectionError("peer closed the connection")
        if loop.time() > deadline:
            raise Malformed(transfer_id, f"{what} did not arrive within {timeout:g} s")
        # Frames of a begun transfer are already on their way: start with plain yields
        # and back off to a short sleep so a stalled peer costs little CPU.
        await asyncio.sleep(sleep)
        sleep = min(max(sleep * 2, 1e-5), _PROBE_MAX_SLEEP_S)


async def _recv_exact(ep: Any, nbytes: int, timeout: float, what: str, transfer_id: str = "") -> np.ndarray:
    """Receive the next message, which must have exactly ``nbytes`` bytes."""
    got = await _next_length(ep, timeout, what, transfer_id)
    if got != nbytes:
        raise Malformed(transfer_id, f"{what} has {got} bytes, expected {nbytes}")
    buf = np.empty(nbytes, dtype=np.uint8)
    await ep.recv(buf)  # matches the probed message: the first queued one on this tag
    return buf


async def recv_blocks(ep: Any, header: KVHandoff | KVPiece, timeout: float,
                      buffers: ReceiveBuffers) -> list[memoryview]:
    """The transfer's block frames, each size-checked before its bytes are taken.

    Receives overlap: a frame is taken off the matching queue once probed, so the next
    one can be probed and posted while earlier ones are still streaming in.
    """
    tid, nbytes = header.transfer_id, header.block_nbytes
    bufs, receives = [], []
    try:
        for i in range(header.num_blocks):
            got = await _next_length(ep, timeout, f"block frame {i}", tid)
            if got != nbytes:
                raise Malformed(tid, f"block frame {i} has {got} bytes, expected {nbytes}")
            handle = ep.tag_probe(remove=True)  # the same message: nobody else reads this tag
            bufs.append(memoryview(buffers.take(nbytes)))
            receives.append(asyncio.ensure_future(ep.recv_with_handle(bufs[-1], handle)))
        await asyncio.gather(*receives)
    except BaseException:
        for r in receives:
            r.cancel()
        await asyncio.gather(*receives, return_exceptions=True)
        raise
    return [b.toreadonly() for b in bufs]


async def recv_commit(ep: Any, timeout: float, transfer_id: str) -> None:
    """The ``COMMIT`` that ends a transfer; anything else is ``Malformed``."""
    got = await _next_length(ep, timeout, "commit", transfer_id)
    if got != len(COMMIT):
        raise Malformed(transfer_id, f"expected the commit, got a {got}-byte message")
    buf = np.empty(len(COMMIT), dtype=np.uint8)
    await ep.recv(buf)
    if buf.tobytes() != COMMIT:
        raise Malformed(transfer_id, "expected the commit, got other bytes")


async def recv_length_prefix(ep: Any) -> int:
    """Wait (no deadline, no polling) for the 8-byte length that starts a message."""
    buf = np.zeros(_LEN.size, dtype=np.uint8)  # zeros: a shorter message fills only part
    try:
        await ep.recv(buf)
    except ucxx.exceptions.UCXMessageTruncatedError as e:
        raise Malformed("", "expected an 8-byte length prefix") from e
    return _LEN.unpack(buf.tobytes())[0]


async def recv_message(ep: Any, frame_timeout: float, transfer_id: str = "") -> np.ndarray:
    """One ``length | bytes`` message of at most MAX_MESSAGE_BYTES."""
    return await recv_message_body(ep, await recv_length_prefix(ep), frame_timeout, transfer_id)


async def recv_message_body(ep: Any, nbytes: int, frame_timeout: float, transfer_id: str = "") -> np.ndarray:
    """The ``bytes`` of a message whose length prefix said ``nbytes``."""
    if not 0 < nbytes <= MAX_MESSAGE_BYTES:
        raise Malformed(transfer_id, f"message length {nbytes} outside 1..{MAX_MESSAGE_BYTES}")
    return await _recv_exact(ep, nbytes, frame_timeout, "message", transfer_id)


async def send_in_order(ep: Any, messages: Sequence[Any]) -> None:
    """Post every message at once (UCX keeps their order on one tag) and wait for all."""
    # gather starts the coroutines in list order and each posts its send before its
    # first await, so the posting order is the list order.
    results = await asyncio.gather(*(ep.send(m) for m in messages), return_exceptions=True)
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        raise error


async def close_endpoint(ep: Any) -> None:
    try:
        await ep.close()
    except Exception as e:  # a dying endpoint may fail to close: gone either way
        log.debug("ucx: closing an endpoint failed: %s", describe(e))


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def as_bytes_view(block: memoryview | bytes | np.ndarray) -> memoryview:
    """A flat byte view of a block; raises for non-contiguous memory (it cannot be sent in place)."""
    view = memoryview(block)
    if not view.c_contiguous:
        raise ValueError("KV blocks must be contiguous to be sent in place")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
