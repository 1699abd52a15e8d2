"""Same-host shared memory for KV transfers: a sender that lends its blocks in place.

A prefill worker whose KV cache lives in a ``SharedSegment`` sends a transfer as one small
``KVShmHandoff`` message over the zmq socket it would use anyway: the header, the segment,
the byte offset of each block and the deadline of the loan. Nothing is copied or
serialised on this side; the decode worker maps the segment once and copies the blocks
into its cache (``common.connector.zmq``'s receiver, ``common.shared_memory.PeerSegments``).
Acks come back as for frames, and the rules do not change: the blocks stay lent until the
ack, the nack or the lease's end (``lent_until`` is that end, so the receiver never copies
after it).

Choosing the path, per destination: ``auto`` tries shared memory first; a receiver that
cannot map the segment (another host or container, or ``--kv-shm off``) nacks with
``SHM_UNAVAILABLE``, and then this sender sends that same transfer again as frames (same id,
its lease running on) and remembers to send frames to that address from then on. ``on``
never falls back: the nack fails the transfer. The local check is the receiver's (host
identity and segment token, see ``common.shared_memory``), never an address comparison.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from common.connector.base import KVHeader, ShmMode
from common.connector.zmq import SHM_UNAVAILABLE, ZmqSender
from common.protocol import KVAck, KVShmHandoff, encode
from common.shared_memory import SharedSegment

log = logging.getLogger("tandem.connector.shm")


class Route(str, Enum):
    SHM = "shm"  # a receiver took a transfer from the segment
    FRAMES = "frames"  # a receiver could not map it: block frames from now on


@dataclass(frozen=True, slots=True)
class _Lent:
    addr: str
    header: KVHeader
    blocks: Sequence[memoryview]


class ShmSender:
    """A ``KVSender`` (see ``common.connector.base``) over a ``ZmqSender``'s sockets.

    ``lease_seconds`` must be the worker's lease: a loan ends when the lease does, so
    blocks freed after an expired lease are never read by a late receiver.
    """

    frame_timeout_s: float | None = None  # one zmq message per transfer, as for frames

    def __init__(self, inner: ZmqSender, segment: SharedSegment, mode: ShmMode,
                 lease_seconds: float) -> None:
        if mode is ShmMode.OFF:
            raise ValueError("a shared-memory sender with --kv-shm off")
        self._inner, self._segment, self._mode = inner, segment, mode
        self._lease = lease_seconds
        self._lent: dict[str, _Lent] = {}  # shm transfers not acked yet, by transfer id
        self._routes: dict[str, Route] = {}

    def route(self, addr: str) -> Route | None:
        """How transfers to ``addr`` go; None until a receiver there has answered one."""
        return self._routes.get(addr)

    def send(self, addr: str, header: KVHeader, blocks: Sequence[memoryview]) -> None:
        offsets = None if self._routes.get(addr) is Route.FRAMES else self._offsets(header, blocks)
        if offsets is None:
            if self._mode is ShmMode.ON:
                raise ValueError("--kv-shm on, but the blocks are not in the shared KV segment")
            self._inner.send(addr, header, blocks)
            return
        msg = KVShmHandoff.of(header, self._segment.ref, offsets, time.monotonic() + self._lease)
        self._lent[header.transfer_id] = _Lent(addr, header, blocks)
        self._inner.send_encoded(addr, header.transfer_id, encode(msg), [])

    def send_encoded(self, addr: str, transfer_id: str, head: bytes, blocks: Sequence[memoryview]) -> None:
        self._inner.send_encoded(addr, transfer_id, head, blocks)  # hand-made: as given, frames

    def poll_acks(self) -> list[KVAck]:
        out = []
        for ack in self._inner.poll_acks():
            lent = self._lent.pop(ack.transfer_id, None)
            if lent is None:
                out.append(ack)
            elif ack.ok:
                self._routes[lent.addr] = Route.SHM
                out.append(ack)
            elif ack.reason.startswith(SHM_UNAVAILABLE) and self._mode is ShmMode.AUTO:
                self._fall_back(lent, ack.reason)
            else:
                out.append(ack)
        return out

    def abandon(self, addr: str) -> None:
        self._lent = {t: lent for t, lent in self._lent.items() if lent.addr != addr}
        self._inner.abandon(addr)

    def close(self) -> None:
        self._lent.clear()
        self._inner.close()

    def _fall_back(self, lent: _Lent, reason: str) -> None:
        if self._routes.get(lent.addr) is not Route.FRAMES:
            log.warning("KV to %s goes as frames from now on (%s)", lent.addr, reason)
        self._routes[lent.addr] = Route.FRAMES
        self._inner.send(lent.addr, lent.header, lent.blocks)  # same id: its lease runs on

    def _offsets(self, header: KVHeader, blocks: Sequence[memoryview]) -> list[int] | None:
        """Each block's offset in the segment, or None when one lies elsewhere."""
        offsets = []
        for block in blocks:
            offset = self._segment.offset_of(block, header.block_nbytes)
            if offset is None or block.nbytes != header.block_nbytes:
                return None
            offsets.append(offset)
        return offsets
