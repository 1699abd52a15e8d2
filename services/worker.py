"""A worker process: the engine in one of three roles, driven by one synchronous loop.

- ``prefill``: runs prompts (chunked, prefix-cached), sends each first token straight to
  the gateway, ships the KV to the decode worker the router chose, and frees it on ack.
- ``decode``: takes prefilled requests from the KV receiver into its running batch and
  streams the remaining tokens to the gateway.
- ``colocated``: both, in one engine, no transfer (the baseline, and small deployments).

The loop: read control messages → take arrived KV → step the engine → send tokens →
settle transfers → report to the router. The engine is touched by this thread only.
Sockets: a DEALER to the router (identity = worker id), PUSH sockets to gateways, and
the KV connector's sender or receiver. Transfer bookkeeping lives in
``common.connector.transfers``; converting a handoff to the wire in
``common.engine.handoff``. Every handler runs guarded: a bad message or a failing
request fails that request alone, is logged and counted, and the loop goes on.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import zmq
from prometheus_client import CollectorRegistry

from common.addresses import reachable
from common.connector import ReceivedTransfer, make_receiver, make_sender
from common.connector.transfers import IncomingTransfers, OutgoingTransfers, TransferOutcome
from common.engine.engine import Engine, SeqUpdate
from common.engine.handoff import Handoff, from_wire, to_wire
from common.errors import InvalidRequestError
from common.metrics import EngineMetrics, MetricsServer, ServiceHealth
from common.protocol import (
    Abort,
    Finished,
    Heartbeat,
    KVEvents,
    Message,
    ProtocolError,
    Register,
    Reregister,
    Task,
    Tokens,
    decode,
    encode,
)
from common.roles import FinishStage, WorkerRole
from services.heartbeat import Heartbeater
from services.worker_requests import GatewayPushers, RequestClock
from services.worker_settings import WorkerSettings, check_lease, shared_kv, warn_faults

log = logging.getLogger("tandem.worker")

IDLE_WAIT_MS = 100  # an idle loop sleeps in poll(); any message wakes it at once
IDLE_POLL_MS = 5  # for a receiver that cannot wake the poller (UCX's own thread)


class WorkerService:
    def __init__(self, settings: WorkerSettings, engine: Engine) -> None:
        self.s = settings
        self.engine = engine
        self._ctx = zmq.Context()
        self.router = self._ctx.socket(zmq.DEALER)
        self.router.setsockopt_string(zmq.IDENTITY, settings.worker_id)
        self.router.connect(settings.router)
        self.pushers = GatewayPushers(self._ctx)
        self.clock = RequestClock()
        self._registry = CollectorRegistry()
        self.metrics = EngineMetrics(self._registry)
        self.sender = self.receiver = None
        warn_faults(settings)
        if settings.role is WorkerRole.PREFILL:
            self.sender = make_sender(settings.kv_transport, on_error=self._connector_error,
                                      faults=settings.kv_faults,
                                      shm=shared_kv(settings, engine.kv_segment))
            check_lease(settings.lease_seconds, self.sender.frame_timeout_s)
        else:
            self.receiver = make_receiver(settings.kv_transport,
                                          settings.kv_bind or "tcp://127.0.0.1:0",
                                          on_error=self._connector_error, shm=settings.maps_peer_kv)
        self.outgoing = OutgoingTransfers(settings.lease_seconds,
                                          max_attempts=settings.kv_transfer_attempts)
        self.incoming = IncomingTransfers()
        self.http = MetricsServer(self._registry, settings.metrics_host, settings.metrics_port,
                                  self._health)
        self.heartbeat = Heartbeater(self._ctx, settings.router, settings.worker_id,
                                     settings.heartbeat_interval)
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        wakeup = getattr(self.receiver, "wakeup_socket", None)
        if wakeup is not None:
            self._poller.register(wakeup, zmq.POLLIN)
        self._wakeable = self.receiver is None or wakeup is not None
        self._stats_seen = (0, 0, 0, 0, 0)
        self._stopping = False

    def _connector_error(self, kind: str, detail: str) -> None:
        """The connector logged a failure; count it (called on this loop's thread)."""
        self.metrics.kv_failures.labels(kind).inc()

    # ---- lifecycle ------------------------------------------------------------------

    def run(self) -> None:
        self.http.start()
        self._register()
        self.heartbeat.start()
        log.info("%s worker %s up: router %s, kv %s, metrics :%d", self.s.role.value,
                 self.s.worker_id, self.s.router, self.kv_address, self.http.port)
        try:
            while not self._stopping:
                self.tick()
        finally:
            self.close()

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        for closer in (self.sender, self.receiver):
            if closer is not None:
                closer.close()
        self.heartbeat.close()
        self.pushers.close()
        self.router.close(linger=0)
        self.http.close()
        self._ctx.term()

    @property
    def kv_address(self) -> str | None:
        """Where prefill workers reach this one (a wildcard bind is replaced by our name)."""
        if self.receiver is None:
            return None
        return reachable(self.receiver.address, self.s.advertise_host)

    def tick(self) -> None:
        """One turn of the loop (``run`` repeats it; tests drive it directly)."""
        busy = self.engine.has_unfinished or len(self.incoming) or len(self.outgoing)
        if not busy:
            self._poller.poll(IDLE_WAIT_MS if self._wakeable else IDLE_POLL_MS)
        self._read_control()
        self._take_transfers()
        if self.engine.has_unfinished:
            self._send_updates(self.engine.step())
        if self.sender is not None:
            self._ship_handoffs()
            self._settle_transfers()
        self._report()

    def _guarded(self, what: str, request_id: str | None, reply_to: str | None,
                 work: Callable[[], object], abort: bool = False) -> None:
        """Run one handler; a failure fails its request (if any), never the process.

        ``abort``: the handler may fail halfway with the request in the engine, so drop it
        (handlers that either add a request whole or not at all leave this off, so a
        duplicate id cannot take down the request that already holds it).
        """
        try:
            work()
        except (InvalidRequestError, ProtocolError) as e:  # the sender's fault: one line
            log.warning("%s refused%s: %s", what, f" for {request_id}" if request_id else "", e)
            self._handler_failed(what, request_id, reply_to, e, abort)
        except Exception as e:  # ours: the whole story, and the loop goes on
            log.exception("%s failed%s", what, f" for {request_id}" if request_id else "")
            self._handler_failed(what, request_id, reply_to, e, abort)

    def _handler_failed(self, what: str, request_id: str | None, reply_to: str | None,
                        e: Exception, abort: bool) -> None:
        self.metrics.handler_errors.labels(what).inc()
        if request_id is None:
            return
        if abort:
            self.engine.abort(request_id)
            self.clock.forget(request_id)
        if reply_to is not None:
            self._fail(request_id, reply_to, f"{what} failed: {e}")

    # ---- control messages -----------------------------------------------------------

    def _read_control(self) -> None:
        while self.router.poll(0):
            try:
                msg = decode(self.router.recv())
            except ProtocolError as e:
                log.warning("bad message from the router: %s", e)
                self.metrics.handler_errors.labels("decode").inc()
                continue
            if isinstance(msg, Task):
                self._guarded("task", msg.request_id, msg.reply_to, lambda m=msg: self._on_task(m))
            elif isinstance(msg, Abort):
                self._guarded("abort", None, None, lambda m=msg: self._on_abort(m.request_id))
            elif isinstance(msg, Reregister):
                self._guarded("reregister", None, None, lambda m=msg: self._rejoin(m.lost_work))
            else:
                log.warning("unexpected %s from the router", msg.TAG)

    def _on_task(self, task: Task) -> None:
        if task.handoff_addr is not None and self.sender is None:
            raise ProtocolError("a prefill-only task sent to a worker that cannot ship KV")
        self.engine.add_request(task.prompt_token_ids, task.params, task.request_id,
                                prefill_only=task.handoff_addr is not None)
        self.clock.start(task.request_id, task.reply_to, len(task.prompt_token_ids),
                         task.handoff_addr)

    def _on_abort(self, request_id: str) -> None:
        if not self.outgoing.cancel(request_id):  # else the blocks stay lent until it ends
            self.engine.abort(request_id)
        self.incoming.abort(request_id)
        self.clock.forget(request_id)

    def _rejoin(self, lost_work: bool) -> None:
        """Register anew. ``lost_work``: the router gave us up for dead and failed our
        requests, so drop them; otherwise the router restarted and they go on."""
        if lost_work:
            log.warning("the router declared this worker dead: dropping in-flight work")
            for request_id in self.engine.request_ids():
                self._on_abort(request_id)
            self.incoming.clear()
        else:
            log.info("the router is new: registering again, keeping %d requests",
                     len(self.engine.request_ids()))
        self._register()

    def _fail(self, request_id: str, reply_to: str, error: str) -> None:
        self.pushers.send(reply_to, Tokens(request_id, 0, 0, [], error=error))
        self._send_router(Finished(request_id, self.s.worker_id, FinishStage.REQUEST, error=error))
        self.metrics.success.labels("error").inc()

    # ---- tokens ---------------------------------------------------------------------

    def _send_updates(self, updates: list[SeqUpdate]) -> None:
        now = time.monotonic()
        ended: list[str] = []
        for u in updates:
            meta = self.clock.get(u.request_id)
            if meta is None:
                continue
            self.clock.observe_token(meta, u, now, self.metrics)
            self.pushers.send(meta.reply_to, Tokens(
                u.request_id, u.choice, u.index, u.token_ids, u.logprobs or None,
                u.finish_reason, meta.num_prompt_tokens, u.num_cached_tokens))
            if u.finish_reason is not None:
                ended.append(u.request_id)
        for request_id in dict.fromkeys(ended):  # a request ends when its last choice does
            out = self.engine.finished_output(request_id)
            if out is not None:
                reason = out.choices[0].finish_reason or "stop"
                self.clock.finish(self.clock.get(request_id), now, reason, self.metrics)
                self._send_router(Finished(request_id, self.s.worker_id, FinishStage.REQUEST))

    # ---- prefill side: shipping KV ----------------------------------------------------

    def _ship_handoffs(self) -> None:
        for h in self.engine.take_handoffs():
            meta = self.clock.get(h.request_id)
            if meta is None or meta.handoff_addr is None:
                self.engine.abort(h.request_id)
                continue
            self._guarded("ship", h.request_id, meta.reply_to,
                          lambda h=h, meta=meta: self._ship(h, meta.reply_to, meta.handoff_addr),
                          abort=True)

    def _ship(self, h: Handoff, reply_to: str, addr: str, attempt: int = 1) -> None:
        """Send the request's blocks; they stay lent (allocated) until the transfer ends."""
        transfer_id = f"{h.request_id}:{uuid.uuid4().hex[:8]}"
        blocks = self.engine.export_blocks(h.block_ids)
        header = to_wire(h, transfer_id, reply_to, self.engine.kv_layout, self.engine.block_nbytes)
        self.sender.send(addr, header, blocks)
        self.outgoing.open(transfer_id, h.request_id, sum(b.nbytes for b in blocks),
                           attempt=attempt, resend=h, addr=addr)

    def _settle_transfers(self) -> None:
        for outcome in self.outgoing.settle(self.sender.poll_acks()):
            self._end_transfer(outcome)
        for outcome in self.outgoing.expire():
            # It may still sit in the transport's queue: drop it there before the blocks
            # are freed or resent, so no stale copy of reused blocks is ever delivered.
            self.sender.abandon(outcome.addr)
            self._end_transfer(outcome)

    def _end_transfer(self, t: TransferOutcome) -> None:
        if t.cancelled:  # aborted while in flight: the transport is done with the blocks now
            self.engine.abort(t.request_id)
            return
        if t.retry and self._retry_transfer(t):
            return
        meta = self.clock.get(t.request_id)
        self.engine.abort(t.request_id)  # frees the blocks: they stay in the prefix cache
        self.clock.forget(t.request_id)
        if t.ok:
            self.metrics.kv_bytes.labels("sent").inc(t.nbytes)
            self.metrics.kv_seconds.observe(t.seconds)
            self._send_router(Finished(t.request_id, self.s.worker_id, FinishStage.PREFILL))
            return
        self.metrics.kv_failures.labels("send").inc()
        error = f"KV transfer failed (attempt {t.attempt} of {self.outgoing.max_attempts}): {t.error}"
        log.warning("%s: %s", t.request_id, error)
        if meta is not None:
            self.pushers.send(meta.reply_to, Tokens(t.request_id, 0, 1, [], error=error))
        self._send_router(Finished(t.request_id, self.s.worker_id, FinishStage.PREFILL,
                                   error=t.error))

    def _retry_transfer(self, t: TransferOutcome) -> bool:
        """Send a failed transfer's blocks again under a new id; False when the request is
        gone (then the failure simply ends it)."""
        meta = self.clock.get(t.request_id)
        if meta is None or meta.handoff_addr is None:
            return False
        self.metrics.kv_failures.labels("retried").inc()
        log.warning("KV transfer %s failed (%s): sending it again", t.transfer_id, t.error)
        self._guarded("ship", t.request_id, meta.reply_to,
                      lambda: self._ship(t.resend, meta.reply_to, meta.handoff_addr, t.attempt + 1),
                      abort=True)
        return True

    # ---- decode side: taking KV in ----------------------------------------------------

    def _take_transfers(self) -> None:
        """Acks go out only once each transfer's blocks are copied (admitted, or owned while
        it waits): a shared-memory transfer's blocks are the sender's until its ack."""
        if self.receiver is None:
            return
        arrived = []
        for transfer in self.receiver.poll(0):
            problem = self.engine.kv_layout.mismatch(transfer.header.layout, transfer.header.kv_dtype)
            if problem is not None:
                self.receiver.ack(transfer, ok=False, reason=problem)
                self.metrics.kv_failures.labels("layout").inc()
                self._fail(transfer.header.request_id, transfer.header.reply_to, problem)
                continue
            h = transfer.header
            self.metrics.kv_bytes.labels("received").inc(h.num_blocks * h.block_nbytes)
            self.incoming.arrive(transfer)
            arrived.append(transfer)
        self.incoming.admit(self._admit)
        self.incoming.own_borrowed()
        for transfer in arrived:
            self.receiver.ack(transfer, ok=True)

    def _admit(self, transfer: ReceivedTransfer) -> bool:
        """True when the transfer is done with (admitted or failed), False to keep waiting."""
        h = transfer.header
        waiting = False

        def admit() -> None:
            nonlocal waiting
            if not self.engine.add_prefilled(from_wire(h), transfer.blocks):
                waiting = True  # no room yet: running requests will free blocks
                return
            self.clock.start(h.request_id, h.reply_to, len(h.prompt_token_ids),
                             cached=h.num_cached_tokens, first_token_seen=True)

        self._guarded("handoff", h.request_id, h.reply_to, admit)
        return not waiting

    # ---- reporting ------------------------------------------------------------------

    def _register(self) -> None:
        e = self.engine
        self._send_router(Register(
            self.s.worker_id, self.s.role, self.kv_address,
            f"http://{self.s.advertise_host}:{self.http.port}/metrics", e.stats().num_blocks,
            e.block_size, e.max_model_len, e.loaded.name, self.s.heartbeat_interval,
            e.cached_block_hashes()))
        e.take_kv_events()  # the snapshot above already holds them

    def _report(self) -> None:
        """KV events, metrics and the heartbeat's snapshot, after every tick (all cheap)."""
        events = self.engine.take_kv_events()
        if events:
            self._send_router(KVEvents(self.s.worker_id, [ev.block_hash for ev in events if ev.stored],
                                       [ev.block_hash for ev in events if not ev.stored]))
        stats = self.engine.stats()
        self._update_gauges(stats)
        self.heartbeat.snapshot = Heartbeat(self.s.worker_id, stats.num_running, stats.num_waiting,
                                            stats.num_free_blocks, stats.num_blocks)
        self.heartbeat.last_tick = time.monotonic()

    def _update_gauges(self, stats) -> None:
        m = self.metrics
        m.running.set(stats.num_running)
        m.waiting.set(stats.num_waiting + len(self.incoming))
        m.kv_usage.set(stats.kv_usage)
        seen = (stats.prefix_queries, stats.prefix_hits, stats.num_preemptions,
                stats.num_draft_tokens, stats.num_accepted_tokens)
        counters = (m.prefix_queries, m.prefix_hits, m.preemptions, m.spec_draft_tokens,
                    m.spec_accepted_tokens)
        for counter, now, before in zip(counters, seen, self._stats_seen, strict=True):
            counter.inc(now - before)
        self._stats_seen = seen

    def _send_router(self, msg: Message) -> None:
        self.router.send(encode(msg))

    def _health(self) -> ServiceHealth:
        stats = self.engine.stats()
        return ServiceHealth(True, {"status": "ok", "role": self.s.role.value,
                                    "worker_id": self.s.worker_id,
                                    "running": stats.num_running, "waiting": stats.num_waiting,
                                    "kv_cache_usage": stats.kv_usage})
