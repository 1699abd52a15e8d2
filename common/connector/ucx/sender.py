"""``UcxSender``: the prefill side of the UCX transport.

One endpoint per receiver address, dialled on the first transfer to it; transfers to
one address are sent in order, each as ``length | header | blocks | COMMIT`` (see
``framing``): ``COMMIT`` only once every block's send completed, and never for a transfer
``abandon`` was called for before then, so a receiver never delivers blocks freed under it.
The caller's thread only queues work for the process's UCX loop; acks come back through
a thread-safe queue that ``poll_acks`` drains.

When a connection dies, every transfer on it that was not acked yet is nacked locally
(reason starting ``ucx:``). The sender can no longer learn what the receiver did with
them, so treat such a nack like an expired lease: free the blocks. The next transfer to
that address dials a new connection.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.connector.failures import ErrorHook, FailureLog, TransferFailure, log
from common.connector.ucx.framing import (
    COMMIT,
    FRAME_TIMEOUT_S,
    Malformed,
    as_bytes_view,
    close_endpoint,
    describe,
    framed,
    parse_address,
    recv_message,
    send_in_order,
)
from common.connector.ucx.loop import TaskSet, UcxLoop, ucxx
from common.protocol import MAX_MESSAGE_BYTES, KVAck, KVHandoff, KVPiece, encode

# ucxx's default. Dialling a dead port usually fails at once, but ucxx sometimes misses
# the endpoint error and waits out this whole timeout instead.
CONNECT_TIMEOUT_S = 5.0


@dataclass(slots=True)
class _Outgoing:
    transfer_id: str
    messages: list[Any]  # length, header, blocks: held until their sends complete
    abandons: int  # the address's abandon() count when queued: a later one cancels the commit
    commit: bool = True  # False only for tests' hand-made transfers


@dataclass(slots=True)
class _Link:
    """The sender's connection to one receiver address (loop thread only)."""

    addr: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    unacked: dict[str, None] = field(default_factory=dict)  # queued, in flight or sent
    ep: Any = None
    dead: bool = False
    tasks: TaskSet = field(default_factory=TaskSet)


class UcxSender:
    """``KVSender`` over UCX: one endpoint per receiver address, transfers sent in order."""

    def __init__(self, frame_timeout_s: float = FRAME_TIMEOUT_S,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, *, on_error: ErrorHook | None = None) -> None:
        self._loop = UcxLoop.get()
        self.frame_timeout_s = frame_timeout_s  # for the rest of an ack once its length arrived
        self._connect_timeout = connect_timeout_s
        self._failures = FailureLog(on_error)
        self._acks: queue.SimpleQueue[KVAck] = queue.SimpleQueue()
        self._links: dict[str, _Link] = {}  # loop thread only
        # abandon() calls per address: bumped on the caller's thread before abandon returns
        # (the caller frees the blocks right after), read on the loop thread before a
        # commit. One dict operation each side, atomic under the GIL.
        self._abandons: dict[str, int] = {}
        self._closed = False

    def send(self, addr: str, header: KVHandoff | KVPiece, blocks: Sequence[memoryview]) -> None:
        head = encode(header)
        if len(head) > MAX_MESSAGE_BYTES:
            raise ValueError(f"header of {len(head)} bytes exceeds {MAX_MESSAGE_BYTES}")
        self.send_encoded(addr, header.transfer_id, head, blocks)

    def send_encoded(self, addr: str, transfer_id: str, head: bytes, blocks: Sequence[memoryview]) -> None:
        self._send_raw(addr, transfer_id, [*framed(head), *blocks])

    def poll_acks(self) -> list[KVAck]:
        acks = []
        while True:
            try:
                acks.append(self._acks.get_nowait())
            except queue.Empty:
                break
        self._failures.flush()
        return acks

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.shut_down(type(self).__name__, self._shutdown())

    def abandon(self, addr: str) -> None:
        if not self._closed:
            self._abandons[addr] = self._abandons.get(addr, 0) + 1  # first: see _abandons
            self._loop.call(self._abandon, addr)

    def _send_raw(self, addr: str, transfer_id: str, messages: Sequence[Any], commit: bool = True) -> None:
        """Queue raw messages as one transfer (``send`` builds them; tests craft bad ones)."""
        if self._closed:
            raise RuntimeError("sender is closed")
        parse_address(addr)  # a bad address is the caller's bug: say so now
        item = _Outgoing(transfer_id, [as_bytes_view(m) for m in messages], self._abandons.get(addr, 0), commit)
        self._loop.call(self._enqueue, addr, item)

    def _abandoned_since(self, addr: str, item: _Outgoing) -> bool:
        return self._abandons.get(addr, 0) != item.abandons

    # -- loop thread --

    def _abandon(self, addr: str) -> None:
        link = self._links.get(addr)
        if link is not None:  # closing the endpoint stops UCX reading the blocks
            link.tasks.spawn(self._fail(link, TransferFailure.PEER_LOST, _abandoned(addr)))

    def _enqueue(self, addr: str, item: _Outgoing) -> None:
        if self._closed:
            return
        link = self._links.get(addr)
        if link is None:
            link = self._links[addr] = _Link(addr)
            link.tasks.spawn(self._write(link))
        link.unacked[item.transfer_id] = None
        link.queue.put_nowait(item)

    async def _write(self, link: _Link) -> None:
        try:
            host, port = parse_address(link.addr)
            link.ep = await ucxx.create_endpoint(host, port, connect_timeout=self._connect_timeout)
            link.tasks.spawn(self._read_acks(link))
            while True:
                item: _Outgoing = await link.queue.get()
                await send_in_order(link.ep, item.messages)
                item.messages.clear()  # sent: the caller's blocks are no longer referenced
                if self._abandoned_since(link.addr, item):  # its blocks may be reused already
                    await self._fail(link, TransferFailure.PEER_LOST, _abandoned(link.addr))
                    return
                if item.commit:
                    await send_in_order(link.ep, [COMMIT])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # any failure ends this connection
            await self._fail(link, TransferFailure.PEER_LOST, f"ucx: connection to {link.addr} failed: {describe(e)}")

    async def _read_acks(self, link: _Link) -> None:
        try:
            while True:
                ack = self._failures.decode_ack(memoryview(await recv_message(link.ep, self.frame_timeout_s)),
                                                link.addr)
                if ack is not None:
                    link.unacked.pop(ack.transfer_id, None)
                    self._acks.put(ack)
        except asyncio.CancelledError:
            raise
        except Malformed as e:  # the ack stream's framing is lost: so is the connection
            await self._fail(link, TransferFailure.BAD_ACK, f"ucx: bad ack from {link.addr}: {e.reason}")
        except Exception as e:  # any failure ends this connection
            await self._fail(link, TransferFailure.PEER_LOST, f"ucx: connection to {link.addr} lost: {describe(e)}")

    async def _fail(self, link: _Link, kind: TransferFailure, reason: str) -> None:
        """End a connection: nack what it still owed, forget it so the next send reconnects.

        Reported as a failure when transfers were owed or the peer misbehaved; a peer
        that leaves owing nothing (a receiver restarting) is only logged.
        """
        if link.dead:
            return
        link.dead = True
        if self._links.get(link.addr) is link:
            del self._links[link.addr]
        if link.ep is not None:
            # Closing cancels the sends still posted, so UCX stops reading the caller's
            # blocks before the nacks below let the caller free them.
            await close_endpoint(link.ep)
        link.tasks.cancel_others()
        while not link.queue.empty():
            link.queue.get_nowait().messages.clear()
        if not self._closed:
            for transfer_id in link.unacked:
                self._acks.put(KVAck(transfer_id, False, reason))
            if link.unacked or kind is not TransferFailure.PEER_LOST:
                self._failures.report(kind, f"{reason} ({len(link.unacked)} transfers nacked)")
            else:
                log.info("%s (no transfers owed)", reason)
        link.unacked.clear()

    async def _shutdown(self) -> None:
        links = list(self._links.values())
        self._links.clear()
        for link in links:
            link.dead = True
            if link.ep is not None:
                await close_endpoint(link.ep)  # first: stops UCX reading the blocks
            await link.tasks.cancel_all()


def _abandoned(addr: str) -> str:
    return f"ucx: transfers to {addr} abandoned (lease expired)"
