"""The decode worker's KV intake: what arrives through the KV receiver, and how it joins
the engine.

Each tick ``take`` polls the receiver (a layout or KV dtype that does not match is nacked
at once and fails the request), files what arrived, and acks it only once its blocks are
copied — into the cache, or out to buffers of its own while it waits: a shared-memory
transfer's blocks are the sender's until the ack (``common.connector.shm``). Then:

- a whole transfer waits, if need be, for room (``IncomingTransfers``) and is added in one
  step (``Engine.add_prefilled``);
- a stream's pieces and final transfer are filed per request (``IncomingStreams``). When
  its first transfer arrives the engine *reserves* the whole prompt's blocks (or, with no
  room, the pieces are held until there is); each piece is then copied into its blocks as
  it lands, and the request is *committed* — joins the running batch — only when the
  final transfer and every piece are in. Whole or not at all: any failure releases the
  reservation.

A newer stream or a whole transfer for the same request replaces an older stream (the
sender gave up on it); pieces of an ended stream are dropped. An abort drops everything
the request holds here; an incomplete stream silent for the lease is dropped too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from common.connector.base import KVReceiver, ReceivedTransfer
from common.connector.streams import Assembly, IncomingStreams
from common.connector.transfers import IncomingTransfers
from common.engine.engine import Engine
from common.engine.handoff import from_wire
from common.errors import InvalidRequestError
from common.metrics import EngineMetrics
from common.protocol import KVPiece
from services.worker_requests import RequestClock

log = logging.getLogger("tandem.worker")

Guard = Callable[..., None]  # the worker's ``_guarded(what, request_id, reply_to, work)``
Fail = Callable[[str, str, str], None]  # the worker's ``_fail(request_id, reply_to, error)``


class KVInbox:
    def __init__(self, engine: Engine, receiver: KVReceiver, *, idle_seconds: float,
                 clock: RequestClock, metrics: EngineMetrics, guarded: Guard, fail: Fail) -> None:
        self.engine, self.receiver = engine, receiver
        self.incoming = IncomingTransfers()
        self.streams = IncomingStreams(idle_seconds)
        self._clock, self._metrics, self._guarded, self._fail = clock, metrics, guarded, fail
        self._scheme = receiver.address.partition("://")[0]  # how frames come: tcp, ipc, ucx

    def __len__(self) -> int:
        """Requests whose KV has arrived, or is arriving, but that do not run yet."""
        return len(self.incoming) + len(self.streams)

    def abort(self, request_id: str) -> None:
        """Drop what the request holds here (the caller's ``Engine.abort`` frees its
        reservation), and whatever of it arrives later."""
        self.incoming.abort(request_id)
        self.streams.end(request_id)

    def clear(self) -> None:
        self.incoming.clear()
        for a in self.streams.clear():
            self.engine.abort(a.request_id)

    def take(self) -> None:
        accepted = []
        for transfer in self.receiver.poll(0):
            if self._accept(transfer):
                accepted.append(transfer)
                if not self.incoming.was_aborted(transfer.header.request_id):
                    self._file(transfer)
        for a in self.streams.assemblies():
            self._progress(a)
        self.incoming.admit(self._admit)
        self.incoming.own_borrowed()
        self.streams.own_borrowed()
        self._settle(accepted)
        for a in self.streams.expired():
            self.engine.abort(a.request_id)
            self._metrics.kv_failures.labels("stream_expired").inc()
            log.warning("KV stream %s for %s went silent before it was complete: dropped",
                        a.stream_id, a.request_id)

    def _settle(self, accepted: list[ReceivedTransfer]) -> None:
        """Ack what was copied. A shared-memory copy that ended after its loan may hold
        blocks the sender had already reused: that request's KV is discarded here, and the
        nack is moot (the sender's lease ended first, so it resends, or fails the request)."""
        now = time.monotonic()
        for transfer in accepted:
            if transfer.borrowed and now > transfer.lent_until:
                self._discard(transfer.header.request_id)
                self.receiver.ack(transfer, ok=False, reason="the copy ended after the loan")
                self._metrics.kv_failures.labels("loan_expired").inc()
            else:
                self.receiver.ack(transfer, ok=True)

    def _discard(self, request_id: str) -> None:
        """Forget the request's KV here without refusing a resend of it."""
        self.incoming.discard(request_id)
        self._drop(request_id)
        if self.engine.abort(request_id):
            self._clock.forget(request_id)
        log.warning("%s: a shared-memory KV copy ended after its loan: discarded", request_id)

    def _accept(self, transfer: ReceivedTransfer) -> bool:
        h = transfer.header
        problem = self.engine.kv_layout.mismatch(h.layout, h.kv_dtype)
        if problem is not None:
            self.receiver.ack(transfer, ok=False, reason=problem)
            self._metrics.kv_failures.labels("layout").inc()
            self._drop(h.request_id)
            self._fail(h.request_id, h.reply_to, problem)
            return False
        self._metrics.kv_bytes.labels("received").inc(h.num_blocks * h.block_nbytes)
        self._metrics.kv_received.labels("shm" if transfer.borrowed else self._scheme).inc()
        if isinstance(h, KVPiece):
            self._metrics.kv_pieces.labels("received").inc()
        return True

    def _file(self, transfer: ReceivedTransfer) -> None:
        h = transfer.header
        if h.stream_id is None:  # whole: it replaces any stream of the request
            self._drop(h.request_id)
            self.incoming.arrive(transfer)
            return
        if self.engine.has_request(h.request_id):
            log.info("KV stream %s: %s already runs here, dropped", h.stream_id, h.request_id)
            return
        assembly, replaced = self.streams.arrive(transfer)
        if replaced is not None:
            self.engine.abort(replaced.request_id)  # its reservation goes

    def _drop(self, request_id: str) -> None:
        if self.streams.end(request_id) is not None:
            self.engine.abort(request_id)

    def _progress(self, a: Assembly) -> None:
        """Reserve, copy in what arrived, commit when all has: one step as far as it goes."""
        def work() -> None:
            try:
                self._advance(a)
            except BaseException:
                self._drop(a.request_id)
                raise
        self._guarded("handoff", a.request_id, a.reply_to, work)

    def _advance(self, a: Assembly) -> None:
        e = self.engine
        if not a.reserved:
            if not e.reserve_prefilled(a.request_id, a.num_prompt_tokens):
                return  # no room yet: running requests will free blocks
            a.reserved = True
        for piece in a.waiting:
            if piece.header.piece in a.filled:
                raise InvalidRequestError(f"KV stream {a.stream_id}: piece {piece.header.piece} arrived twice")
            e.fill_prefilled(a.request_id, piece.header.first_block, piece.blocks)
            a.filled.add(piece.header.piece)
        a.waiting.clear()
        if not a.arrived:
            return
        h = a.final.header
        e.commit_prefilled(from_wire(h), h.first_block, a.final.blocks)
        self.streams.end(a.request_id)
        self._clock.start(h.request_id, h.reply_to, len(h.prompt_token_ids),
                          cached=h.num_cached_tokens, first_token_seen=True)

    def _admit(self, transfer: ReceivedTransfer) -> bool:
        """True when the transfer is done with (admitted or failed), False to keep waiting."""
        h = transfer.header
        waiting = False

        def admit() -> None:
            nonlocal waiting
            if not self.engine.add_prefilled(from_wire(h), transfer.blocks):
                waiting = True  # no room yet: running requests will free blocks
                return
            self._clock.start(h.request_id, h.reply_to, len(h.prompt_token_ids),
                              cached=h.num_cached_tokens, first_token_seen=True)

        self._guarded("handoff", h.request_id, h.reply_to, admit)
        return not waiting
