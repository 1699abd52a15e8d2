"""The prefill worker's KV shipping: what leaves through the KV sender, and when a shipped
request's blocks are freed.

Each tick, after the engine's step:

- ``ship_pieces`` (streaming on): every prefill-only request still computing its prompt
  ships its newly computed full blocks as a ``KVPiece`` (a chunk's KV goes out while the
  next chunk is computed);
- ``ship_handoffs``: a request whose first token is sampled ships the rest — the final
  ``KVHandoff`` of its stream, or one whole transfer when it streamed nothing (a prompt of
  one chunk, streaming off) or its stream broke;
- ``settle``: acks, nacks and expired leases end transfers (``OutgoingTransfers``).

Every transfer *lends* the blocks it reads (``Engine.lend_blocks``): they cannot be reused
until it ends, whatever becomes of the request meanwhile (preempted, aborted), and are
given back when it does. A request is done with when its whole transfer, or every
transfer of its stream, is acked; a failure breaks the stream, and the request goes once
more as one whole transfer while attempts are left, else it fails clearly.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from common.connector.base import KVSender
from common.connector.streams import OutgoingStream, OutgoingStreams, PiecePlan
from common.connector.transfers import OutgoingTransfers, TransferOutcome
from common.engine.engine import Engine
from common.engine.handoff import Handoff, to_wire
from common.metrics import EngineMetrics
from common.protocol import Finished, KVPiece, Message, Tokens
from common.roles import FinishStage
from services.worker_rates import WorkRates
from services.worker_requests import GatewayPushers, RequestClock

log = logging.getLogger("tandem.worker")

Guard = Callable[..., None]  # the worker's ``_guarded(what, request_id, reply_to, work, abort)``


@dataclass(frozen=True, slots=True)
class Shipment:
    """What one transfer carries, kept with it until it ends (``TransferOutcome.resend``)."""

    block_ids: list[int]  # lent to the transfer
    handoff: Handoff | None  # None: a piece
    streamed: bool  # a piece or a stream's final transfer (not a whole transfer)


def new_stream_id(request_id: str) -> str:
    return f"{request_id}:{uuid.uuid4().hex[:8]}"


class KVOutbox:
    def __init__(self, engine: Engine, sender: KVSender, outgoing: OutgoingTransfers, *,
                 stream: bool, clock: RequestClock, pushers: GatewayPushers,
                 metrics: EngineMetrics, send_router: Callable[[Message], None],
                 guarded: Guard, worker_id: str, rates: WorkRates | None = None) -> None:
        self.engine, self.sender, self.outgoing = engine, sender, outgoing
        self.stream = stream
        self.streams = OutgoingStreams(new_stream_id)
        self._clock, self._pushers, self._metrics = clock, pushers, metrics
        self._send_router, self._guarded, self._worker_id = send_router, guarded, worker_id
        self._rates = rates  # the link cost the router's disaggregation rule weighs

    def cancel(self, request_id: str) -> None:
        """An aborted request: its transfers end as usual, unretried, each then giving back
        the blocks it was lent; the caller may free the request's own at once."""
        self.outgoing.cancel(request_id)
        self.streams.forget(request_id)

    # ---- shipping ----------------------------------------------------------------------

    def ship_pieces(self) -> None:
        if not self.stream:
            return
        for request_id, block_ids in self.engine.prefilling_blocks():
            meta = self._clock.get(request_id)
            if meta is None or meta.handoff_addr is None:
                continue
            plan = self.streams.next_piece(request_id, len(block_ids))
            if plan is not None:
                self._guarded("ship", request_id, meta.reply_to,
                              lambda r=request_id, p=plan, b=block_ids, m=meta: self._send_piece(r, p, b, m),
                              abort=True)

    def ship_handoffs(self) -> None:
        for h in self.engine.take_handoffs():
            meta = self._clock.get(h.request_id)
            if meta is None or meta.handoff_addr is None:
                self.engine.abort(h.request_id)
                self.streams.forget(h.request_id)
                continue
            stream = self.streams.get(h.request_id)
            attempt = 1 if stream is None or stream.failed is None else 2
            if attempt > self.outgoing.max_attempts:
                self._fail_stream(h.request_id, stream)
                continue
            self._guarded("ship", h.request_id, meta.reply_to,
                          lambda h=h, a=attempt: self._ship(h, a), abort=True)

    def _send_piece(self, request_id: str, plan: PiecePlan, block_ids: list[int], meta) -> None:
        blocks = block_ids[plan.first_block: plan.first_block + plan.num_blocks]
        e = self.engine
        header = KVPiece(plan.transfer_id, plan.stream_id, request_id, plan.piece, plan.first_block,
                         plan.num_blocks, meta.num_prompt_tokens, e.block_nbytes,
                         e.kv_layout.as_list(), e.kv_layout.kv_dtype, meta.reply_to)
        self._send(meta.handoff_addr, header, request_id, Shipment(blocks, None, True), 1)
        self._metrics.kv_pieces.labels("sent").inc()

    def _ship(self, h: Handoff, attempt: int) -> None:
        """The final transfer of the request's stream, or the whole request."""
        meta = self._clock.get(h.request_id)
        stream = self.streams.final(h.request_id, h) if attempt == 1 else None
        e = self.engine
        if stream is None:
            transfer_id, first, count = new_stream_id(h.request_id), 0, 0
            stream_id = None
        else:
            transfer_id, first, count = f"{stream.stream_id}/final", stream.shipped, stream.pieces
            stream_id = stream.stream_id
        header = to_wire(h, transfer_id, meta.reply_to, e.kv_layout, e.block_nbytes,
                         stream_id=stream_id, first_block=first, num_pieces=count)
        self._send(meta.handoff_addr, header, h.request_id,
                   Shipment(h.block_ids[first:], h, stream is not None), attempt)

    def _send(self, addr: str, header, request_id: str, shipment: Shipment, attempt: int) -> None:
        self.engine.lend_blocks(shipment.block_ids)
        try:
            blocks = self.engine.export_blocks(shipment.block_ids)
            self.sender.send(addr, header, blocks)
        except BaseException:
            self.engine.return_blocks(shipment.block_ids)
            raise
        self.outgoing.open(header.transfer_id, request_id, sum(b.nbytes for b in blocks),
                           attempt=attempt, resend=shipment, addr=addr)

    # ---- settling ----------------------------------------------------------------------

    def settle(self) -> None:
        for outcome in self.outgoing.settle(self.sender.poll_acks()):
            self._end_transfer(outcome)
        expired = self.outgoing.expire()
        # They may still sit in the transport's queue: drop them there before their blocks
        # are given back or resent (all first, so a resend is not dropped with them), so no
        # stale copy of reused blocks is ever delivered.
        for addr in dict.fromkeys(outcome.addr for outcome in expired):
            self.sender.abandon(addr)
        for outcome in expired:
            self._end_transfer(outcome)

    def _end_transfer(self, t: TransferOutcome) -> None:
        shipment: Shipment = t.resend
        self.engine.return_blocks(shipment.block_ids)
        if t.cancelled:
            return
        if t.ok:
            self._metrics.kv_bytes.labels("sent").inc(t.nbytes)
            self._metrics.kv_seconds.observe(t.seconds)
            if self._rates is not None:
                e = self.engine
                self._rates.observe_transfer(t.seconds, t.nbytes, e.block_nbytes / e.block_size)
        if shipment.streamed:
            self._end_streamed(t)
        elif t.retry and self._clock.get(t.request_id) is not None:
            self._metrics.kv_failures.labels("retried").inc()
            log.warning("KV transfer %s failed (%s): sending it again", t.transfer_id, t.error)
            meta = self._clock.get(t.request_id)
            self._guarded("ship", t.request_id, meta.reply_to,
                          lambda: self._ship(shipment.handoff, t.attempt + 1), abort=True)
        else:
            self._done(t.request_id, t.error, t.attempt)

    def _end_streamed(self, t: TransferOutcome) -> None:
        broken_before = (s := self.streams.get(t.request_id)) is not None and s.failed is not None
        stream = self.streams.ended(t.request_id, t.transfer_id, t.error)
        if stream is None:
            return
        if stream.succeeded:
            self._done(t.request_id, None, 1)
        elif stream.failed is not None and not broken_before:
            self._stream_broke(t.request_id, stream)

    def _stream_broke(self, request_id: str, stream: OutgoingStream) -> None:
        """The first failure of a stream: go again whole, now if the first token is out
        (else when it is), or fail the request with no attempt left."""
        if self.outgoing.max_attempts < 2:
            self._fail_stream(request_id, stream)
            return
        self._metrics.kv_failures.labels("retried").inc()
        log.warning("KV stream %s failed (%s): sending the request again whole",
                    stream.stream_id, stream.failed)
        meta = self._clock.get(request_id)
        if stream.final_sent and meta is not None:  # else ship_handoffs sends it, later
            self._guarded("ship", request_id, meta.reply_to,
                          lambda: self._ship(stream.resend, 2), abort=True)

    def _fail_stream(self, request_id: str, stream: OutgoingStream | None) -> None:
        self._done(request_id, stream.failed if stream else "KV stream failed", 1)

    def _done(self, request_id: str, error: str | None, attempt: int) -> None:
        """The request leaves this worker: its blocks are freed (they stay in the prefix
        cache); the router hears how its prefill stage ended."""
        meta = self._clock.get(request_id)
        self.engine.abort(request_id)
        self._clock.forget(request_id)
        self.streams.forget(request_id)
        if error is None:
            self._send_router(Finished(request_id, self._worker_id, FinishStage.PREFILL))
            return
        self._metrics.kv_failures.labels("send").inc()
        text = f"KV transfer failed (attempt {attempt} of {self.outgoing.max_attempts}): {error}"
        log.warning("%s: %s", request_id, text)
        if meta is not None:
            self._pushers.send(meta.reply_to, Tokens(request_id, 0, 1, [], error=text,
                                                     worker_id=self._worker_id))
        self._send_router(Finished(request_id, self._worker_id, FinishStage.PREFILL, error=error))
