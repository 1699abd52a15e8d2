"""``UcxReceiver``: the decode side of the UCX transport.

Listens on ``ucx://HOST:PORT`` and serves each sender's endpoint in its own task on the
process's UCX loop, which hands complete, checked transfers to the caller's thread
through a queue (``poll``) and pokes a zmq pipe so an idle worker can sleep in its poller.

A rejected or broken transfer leaves the stream's framing unknown, so the receiver nacks
it (when the peer can still hear) and closes that connection; the sender reconnects on
its next transfer. A partial transfer's buffers die with the task's frame. Blocks land in
buffers that are reused once the caller drops every view of them (``buffers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from common.connector.base import (
    MAX_BLOCK_FRAME_BYTES,
    KVHeader,
    ReceivedTransfer,
    check_transfer,
    decode_header,
)
from common.connector.failures import ErrorHook, FailureLog, TransferFailure, log
from common.connector.ucx.buffers import ReceiveBuffers
from common.connector.ucx.framing import (
    FRAME_TIMEOUT_S,
    Malformed,
    close_endpoint,
    describe,
    framed,
    parse_address,
    recv_blocks,
    recv_commit,
    recv_length_prefix,
    recv_message_body,
    send_in_order,
)
from common.connector.ucx.loop import TaskSet, UcxLoop, ucxx
from common.protocol import KVAck, ProtocolError, encode

_WAKE_NAMES = itertools.count()  # inproc wake-up pipe names, one per receiver


@dataclass(slots=True, eq=False)  # identity: kept in a set
class _Connection:
    """One sender's endpoint on the receiver side; ``ReceivedTransfer.peer`` is this."""

    ep: Any
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # a reply's 2 messages stay together
    mid_transfer: bool = False  # a transfer's first message has come, its last not yet


class UcxReceiver:
    """``KVReceiver`` over UCX: listens on ``ucx://HOST:PORT`` (port 0 picks a free one)."""

    def __init__(self, address: str, frame_timeout_s: float = FRAME_TIMEOUT_S, *,
                 on_error: ErrorHook | None = None) -> None:
        self._loop = UcxLoop.get()
        host, port = parse_address(address)
        self.frame_timeout_s = frame_timeout_s  # a transfer stalled this long is nacked
        self._failures = FailureLog(on_error)
        self._buffers = ReceiveBuffers()
        self._ready: queue.SimpleQueue[ReceivedTransfer] = queue.SimpleQueue()
        self._tasks = TaskSet()  # replies
        self._serving: set[asyncio.Task] = set()  # one per connection
        self._connections: set[_Connection] = set()
        self._closed = False
        # A zmq pipe the loop thread pokes per ready transfer, so a worker can sleep in
        # its zmq poller instead of polling this receiver on a timer.
        # Never a name used before: a closed socket's inproc name stays bound until
        # ZeroMQ's reaper gets to it, and a new receiver may get the old one's id().
        wake = f"inproc://tandem-ucx-wakeup-{next(_WAKE_NAMES)}"
        self._wake_rx = zmq.Context.instance().socket(zmq.PULL)
        self._wake_rx.bind(wake)
        self._wake_tx: zmq.Socket | None = None  # loop thread only
        self._listener = self._loop.run(self._listen(port, wake))
        # UCX listens on every interface; HOST is what senders should dial.
        self.address = f"ucx://{host}:{self._listener.port}"

    @property
    def wakeup_socket(self) -> zmq.Socket:
        """Readable while a transfer may be waiting; ``poll`` empties it."""
        return self._wake_rx

    def poll(self, timeout_ms: int = 0) -> list[ReceivedTransfer]:
        # Drain the wake-ups before taking transfers: one arriving in between leaves a
        # spare wake-up (a harmless extra poll), never a transfer nobody is woken for.
        with contextlib.suppress(zmq.Again):
            while True:
                self._wake_rx.recv(zmq.NOBLOCK)
        self._failures.flush()
        try:
            first = self._ready.get(timeout=timeout_ms / 1000) if timeout_ms > 0 else self._ready.get_nowait()
        except queue.Empty:
            return []
        out = [first]
        while True:
            try:
                out.append(self._ready.get_nowait())
            except queue.Empty:
                return out

    def ack(self, transfer: ReceivedTransfer, ok: bool, reason: str = "") -> None:
        if self._closed:
            return
        reply = KVAck(transfer.header.transfer_id, ok, reason)
        self._loop.call(self._spawn_reply, transfer.peer, reply)
        self._failures.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.shut_down(type(self).__name__, self._shutdown())
        self._wake_rx.close(linger=0)

    # -- loop thread --

    async def _listen(self, port: int, wake: str) -> Any:
        self._wake_tx = zmq.Context.instance().socket(zmq.PUSH)
        self._wake_tx.connect(wake)
        return ucxx.create_listener(self._serve, port=port)

    def _deliver(self, transfer: ReceivedTransfer) -> None:
        self._ready.put(transfer)
        # Full pipe (a worker not polling): it is readable already, so dropping is fine.
        with contextlib.suppress(zmq.Again):
            self._wake_tx.send(b"", zmq.NOBLOCK)

    async def _serve(self, ep: Any) -> None:
        """Receive transfers from one sender until it leaves or sends garbage."""
        task = asyncio.current_task()
        conn = _Connection(ep)
        self._serving.add(task)
        self._connections.add(conn)
        try:
            while not self._closed:
                self._deliver(await self._receive_transfer(conn))
        except Malformed as e:
            # The framing is lost: nack, then drop the connection (the sender reconnects).
            self._failures.report(TransferFailure.BAD_TRANSFER, f"transfer {e.transfer_id!r}: {e.reason}")
            await self._reply(conn, KVAck(e.transfer_id, False, e.reason))
        except asyncio.CancelledError:
            pass  # closing
        except Exception as e:  # the sender went away: nobody left to nack
            if conn.mid_transfer:
                self._failures.report(TransferFailure.PEER_LOST, f"sender left mid-transfer: {describe(e)}")
            else:
                log.info("ucx: a sender left between transfers: %s", describe(e))
        finally:
            # Partial transfers die with _receive_transfer's frame: their buffers are freed.
            self._connections.discard(conn)
            self._serving.discard(task)
            await close_endpoint(ep)

    async def _receive_transfer(self, conn: _Connection) -> ReceivedTransfer:
        ep = conn.ep
        nbytes = await recv_length_prefix(ep)  # waits, unbounded, for a sender to begin
        conn.mid_transfer = True
        header = self._decode_header(await recv_message_body(ep, nbytes, self.frame_timeout_s))
        tid = header.transfer_id
        if header.block_nbytes > MAX_BLOCK_FRAME_BYTES or header.num_blocks < 0:
            raise Malformed(tid, check_transfer(header, []) or f"bad num_blocks {header.num_blocks}")
        blocks = await recv_blocks(ep, header, self.frame_timeout_s, self._buffers)
        problem = check_transfer(header, blocks)
        if problem:
            raise Malformed(tid, problem)
        await recv_commit(ep, self.frame_timeout_s, tid)  # the sender freed nothing we read
        conn.mid_transfer = False
        return ReceivedTransfer(header, blocks, conn)

    @staticmethod
    def _decode_header(head: np.ndarray) -> KVHeader:
        try:
            return decode_header(memoryview(head))
        except ProtocolError as e:
            raise Malformed("", str(e)) from e

    def _spawn_reply(self, conn: _Connection, reply: KVAck) -> None:
        if conn in self._connections:
            self._tasks.spawn(self._reply(conn, reply))
        else:  # the sender left after the transfer arrived; its lease will expire
            self._failures.report(TransferFailure.REPLY_FAILED,
                                  f"ack for {reply.transfer_id!r}: the sender's connection is gone")

    async def _reply(self, conn: _Connection, reply: KVAck) -> None:
        body = encode(reply)
        try:
            async with conn.send_lock:
                await send_in_order(conn.ep, framed(body))
        except Exception as e:  # the sender is gone; its lease will expire
            self._failures.report(TransferFailure.REPLY_FAILED, f"ack for {reply.transfer_id!r}: {describe(e)}")

    async def _shutdown(self) -> None:
        await self._tasks.cancel_all()
        serving = list(self._serving)
        for task in serving:
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)
        self._listener.close()
        self._wake_tx.close(linger=0)
