"""ZeroMQ transport for KV transfers (tcp:// or ipc://).

One multipart message per transfer: ``[header, block 0, ..., block n-1]``. ZeroMQ
delivers a multipart message atomically, so a transfer is whole or absent. The sender
passes the cache blocks' memory with ``copy=False``: the bytes go from the KV cache to
the socket without an intermediate copy (the lease keeps the blocks alive meanwhile).
The receiver binds a ROUTER socket; acks go back on it to the sender's DEALER.

A transfer to a receiver that has gone away waits in the DEALER until one binds the
address again (its lease expires meanwhile); other addresses are not held up. Each
address has a context of its own, so ``abandon`` can wait for ZeroMQ's teardown (which
runs on its I/O threads) to end: when it returns, no queued transfer can still be sent to
a receiver that binds the address later, nor read the blocks it lent.

Same-host shared memory (``common.connector.shm`` sends it): a one-frame
``KVShmHandoff`` in place of header + blocks. A receiver given ``PeerSegments`` maps the
sender's segment and hands out borrowed views of the blocks (``lent_until`` set); one
without, or one that cannot map it, nacks with a reason starting ``SHM_UNAVAILABLE`` so
the sender sends that transfer again as frames.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import zmq

from common.connector.base import (
    MAX_BLOCK_FRAME_BYTES,
    KVHeader,
    ReceivedTransfer,
    check_transfer,
    decode_header,
)
from common.connector.failures import ErrorHook, FailureLog, TransferFailure
from common.protocol import KVAck, KVShmHandoff, ProtocolError, encode
from common.shared_memory import PeerSegments, ShmUnavailable

SHM_UNAVAILABLE = "shm unavailable: "  # a nack's reason: send this transfer as frames
# Borrowed blocks due back sooner are refused: the copy (milliseconds, in the same worker
# tick as the receive) must end first; one that still ends late is discarded by the worker.
MIN_LOAN_LEFT_S = 0.5


class ZmqSender:
    frame_timeout_s: float | None = None  # a multipart message arrives whole or not at all

    def __init__(self, *, on_error: ErrorHook | None = None) -> None:
        self._sockets: dict[str, zmq.Socket] = {}  # a socket per address, in a context of its own
        self._failures = FailureLog(on_error)

    def send(self, addr: str, header: KVHeader, blocks: Sequence[memoryview]) -> None:
        self.send_encoded(addr, header.transfer_id, encode(header), blocks)

    def send_encoded(self, addr: str, transfer_id: str, head: bytes, blocks: Sequence[memoryview]) -> None:
        self._socket(addr).send_multipart([head, *blocks], copy=False)

    def poll_acks(self) -> list[KVAck]:
        acks = []
        for addr, sock in self._sockets.items():
            while sock.poll(0):
                ack = self._failures.decode_ack(sock.recv(), addr)
                if ack is not None:
                    acks.append(ack)
        self._failures.flush()
        return acks

    def abandon(self, addr: str) -> None:
        """Discard what is queued for ``addr``; the next send reconnects."""
        sock = self._sockets.pop(addr, None)
        if sock is not None:
            _discard(sock)

    def close(self) -> None:
        for sock in self._sockets.values():
            _discard(sock)
        self._sockets.clear()

    def _socket(self, addr: str) -> zmq.Socket:
        sock = self._sockets.get(addr)
        if sock is None:
            sock = zmq.Context(io_threads=1).socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop a transfer; leases bound the backlog
            sock.connect(addr)
            self._sockets[addr] = sock
        return sock


def _discard(sock: zmq.Socket) -> None:
    """Close ``sock`` dropping its queue, and wait until ZeroMQ has: closing alone only
    asks its I/O thread to, which may first connect to a new receiver and send."""
    ctx = sock.context
    sock.close(linger=0)
    ctx.term()


class ZmqReceiver:
    frame_timeout_s: float | None = None  # a multipart message arrives whole or not at all

    def __init__(self, address: str, context: zmq.Context | None = None, *,
                 on_error: ErrorHook | None = None, segments: PeerSegments | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self._failures = FailureLog(on_error)
        self._segments = segments  # None: shared-memory transfers are refused (--kv-shm off)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an ack nobody can take raises, not vanishes
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_BLOCK_FRAME_BYTES)  # per frame
        self._sock.setsockopt(zmq.RCVHWM, 0)
        if address.startswith("tcp://") and address.endswith(":0"):
            self._sock.bind(address)
            address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._sock.bind(address)
        self.address = address

    @property
    def wakeup_socket(self) -> zmq.Socket:
        """Readable when a transfer has arrived: a worker can sleep on it in a poller."""
        return self._sock

    def poll(self, timeout_ms: int = 0) -> list[ReceivedTransfer]:
        out: list[ReceivedTransfer] = []
        wait = timeout_ms
        while self._sock.poll(wait):
            wait = 0
            identity, head, *frames = self._sock.recv_multipart(copy=False)
            transfer = self._accept(identity.bytes, head.buffer, [f.buffer.toreadonly() for f in frames])
            if transfer is not None:
                out.append(transfer)
        if self._segments is not None:
            self._segments.sweep()
        self._failures.flush()
        return out

    def ack(self, transfer: ReceivedTransfer, ok: bool, reason: str = "") -> None:
        self._reply(transfer.peer, transfer.header.transfer_id, ok, reason)
        self._failures.flush()

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._segments is not None:
            self._segments.close()

    def _accept(self, identity: bytes, head: memoryview, frames: list[memoryview]) -> ReceivedTransfer | None:
        try:
            header = decode_header(head, shm=True)
        except ProtocolError as e:
            return self._reject(identity, "", str(e))
        if isinstance(header, KVShmHandoff):
            return self._accept_shm(identity, header, len(frames))
        problem = check_transfer(header, frames)
        if problem:
            return self._reject(identity, header.transfer_id, problem)
        return ReceivedTransfer(header, frames, identity)

    def _accept_shm(self, identity: bytes, msg: KVShmHandoff, num_frames: int) -> ReceivedTransfer | None:
        header = msg.header
        if self._segments is None:
            return self._refuse_shm(identity, header.transfer_id, "this receiver runs with --kv-shm off")
        if num_frames:
            return self._reject(identity, header.transfer_id, f"{num_frames} frames after kv_shm_handoff")
        if msg.lent_until - time.monotonic() < MIN_LOAN_LEFT_S:
            return self._reject(identity, header.transfer_id, "lent blocks are due back before a copy could end")
        try:
            blocks = self._segments.blocks(msg.segment, msg.offsets, header.block_nbytes)
        except ShmUnavailable as e:
            return self._refuse_shm(identity, header.transfer_id, str(e))
        except ValueError as e:
            return self._reject(identity, header.transfer_id, str(e))
        problem = check_transfer(header, blocks)
        if problem:
            return self._reject(identity, header.transfer_id, problem)
        return ReceivedTransfer(header, blocks, identity, msg.lent_until)

    def _refuse_shm(self, identity: bytes, transfer_id: str, reason: str) -> None:
        """Not a failure: the sender sends it again as frames (``--kv-shm auto``)."""
        self._reply(identity, transfer_id, False, SHM_UNAVAILABLE + reason)

    def _reject(self, identity: bytes, transfer_id: str, reason: str) -> None:
        self._failures.report(TransferFailure.BAD_TRANSFER, f"transfer {transfer_id!r}: {reason}")
        self._reply(identity, transfer_id, False, reason)

    def _reply(self, identity: bytes, transfer_id: str, ok: bool, reason: str) -> None:
        try:
            self._sock.send_multipart([identity, encode(KVAck(transfer_id, ok, reason))], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the sender is gone (or not reading): its lease will expire
            self._failures.report(TransferFailure.REPLY_FAILED, f"ack for {transfer_id!r}: {e}")
