"""A worker process: the engine in one of three roles, driven by one synchronous loop.

- ``prefill``: runs prompts (chunked, prefix-cached), sends each first token straight to
  the gateway, ships the KV to the decode worker the router chose, and frees it on ack.
- ``decode``: takes prefilled requests from the KV receiver into its running batch and
  streams the remaining tokens to the gateway; a task without a handoff (the router chose
  to prefill it here: conditional disaggregation) it runs whole, its prompt in small chunks
  (``--decode-prefill-budget``), and reports ``Finished(prefill)`` at its first token.
- ``colocated``: both, in one engine, no transfer (the baseline, and small deployments).

The loop: read control messages → take arrived KV → step the engine → send tokens →
settle transfers → report to the router. The engine is touched by this thread only.
Sockets: a DEALER to the router (identity = worker id), PUSH sockets to gateways, and
the KV connector's sender or receiver. Shipping KV out lives in ``services.kv_outbox``
(pieces of a long prompt while it computes, then the rest), taking it in in
``services.kv_inbox``; their bookkeeping in ``common.connector.transfers`` and
``streams``. Every handler runs guarded: a bad message or a failing
request fails that request alone, is logged and counted, and the loop goes on.

Shutdown (``services.worker_drain``): SIGTERM drains — the router hears ``Draining`` at
once and places nothing new here, the worker finishes what it holds (a prefill worker
its outgoing KV transfers too), and leaves when the router answers ``Drained``; at the
drain deadline, or on a second signal, what is left is handed over (failed back to the
gateways as retryable, so they continue it on other workers). ``/ready`` answers 200 only
while the worker is registered (the router answered its latest ``Register``) and not
draining.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq
from prometheus_client import CollectorRegistry

from common.addresses import reachable
from common.connector import make_receiver, make_sender
from common.connector.transfers import OutgoingTransfers
from common.engine.engine import Engine, SeqUpdate
from common.errors import InvalidRequestError
from common.metrics import EngineMetrics, MetricsServer, ServiceHealth
from common.protocol import (
    Abort,
    Deregister,
    Drained,
    Draining,
    Finished,
    Heartbeat,
    KVEvents,
    Message,
    ProtocolError,
    Register,
    Registered,
    Reregister,
    Task,
    Tokens,
    decode,
    encode,
)
from common.roles import FinishStage, WorkerRole
from services.heartbeat import Heartbeater
from services.kv_inbox import KVInbox
from services.kv_outbox import KVOutbox
from services.worker_drain import DrainState, Leave
from services.worker_rates import WorkRates
from services.worker_requests import GatewayPushers, RequestClock
from services.worker_settings import WorkerSettings, check_lease, shared_kv, warn_faults

log = logging.getLogger("tandem.worker")

IDLE_WAIT_MS = 100  # an idle loop sleeps in poll(); any message wakes it at once
IDLE_POLL_MS = 5  # for a receiver that cannot wake the poller (UCX's own thread)
# Acks of outgoing transfers do not wake the poller either: with transfers out and nothing
# to compute (the prefilled requests only wait for their KV to land), the loop looks again
# this often. Spinning took a core from the decode worker beside it: at c16 on 2 vCPUs the
# prefill worker burnt 27-36 s of CPU in a 50-s run, and P/D served 0.4-0.5x colocated.
ACK_POLL_MS = 1
# A Reregister that arrives while our Register, sent less than this ago, is unanswered was
# sent before the router read that Register (the router answers ``Registered`` first, on the
# same connection): it is ignored. A worker frozen past its heartbeat timeout woke to one
# Reregister per second of its frozen heartbeats and registered once for each; to the router
# each Register after the first is a restart, so it failed what it had placed in between
# (under `loadtest/chaos.py`: three in a row, two streams failed). Unanswered for longer,
# the Register went to a router that died: the next Reregister is obeyed.
REGISTER_ANSWER_S = 5.0


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
        self.metrics = EngineMetrics(self._registry, engine.loaded.name)
        self.sender = self.receiver = self.outbox = self.inbox = None
        self.rates = WorkRates()
        warn_faults(settings)
        self.outgoing = OutgoingTransfers(settings.lease_seconds,
                                          max_attempts=settings.kv_transfer_attempts)
        if settings.role is WorkerRole.PREFILL:
            self.sender = make_sender(settings.kv_transport, on_error=self._connector_error,
                                      faults=settings.kv_faults,
                                      shm=shared_kv(settings, engine.kv_segment))
            check_lease(settings.lease_seconds, self.sender.frame_timeout_s)
            self.outbox = KVOutbox(engine, self.sender, self.outgoing,
                                   stream=settings.kv_stream_chunks, clock=self.clock,
                                   pushers=self.pushers, metrics=self.metrics,
                                   send_router=self._send_router, guarded=self._guarded,
                                   worker_id=settings.worker_id, rates=self.rates)
        else:
            self.receiver = make_receiver(settings.kv_transport,
                                          settings.kv_bind or "tcp://127.0.0.1:0",
                                          on_error=self._connector_error, shm=settings.maps_peer_kv)
            self.inbox = KVInbox(engine, self.receiver, idle_seconds=settings.lease_seconds,
                                 clock=self.clock, metrics=self.metrics, guarded=self._guarded,
                                 fail=self._fail)
        self.http = MetricsServer(self._registry, settings.metrics_host, settings.metrics_port,
                                  self._health, self._ready)
        self.heartbeat = Heartbeater(self._ctx, settings.router, settings.worker_id,
                                     settings.heartbeat_interval)
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        wakeup = getattr(self.receiver, "wakeup_socket", None)
        if wakeup is not None:
            self._poller.register(wakeup, zmq.POLLIN)
        self._wakeable = self.receiver is None or wakeup is not None
        self._stats_seen = (0, 0, 0, 0, 0, 0.0)
        self._stopping = False
        self.drain = DrainState(settings.drain_timeout)
        self._registered = False  # the router answered our latest Register
        self._register_sent = 0.0  # when we sent it (time.monotonic)
        self._left = False  # Deregister sent: flush the socket on close

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
        """Stop the loop at once (no drain: the router finds out from the silence)."""
        self._stopping = True

    def request_drain(self) -> None:
        """SIGTERM / SIGINT: the first drains, a second hands over and leaves at once.
        Only counts (a signal handler may call it): the loop acts on its next tick."""
        self.drain.ask()

    def close(self) -> None:
        for closer in (self.sender, self.receiver):
            if closer is not None:
                closer.close()
        self.heartbeat.close()
        self.pushers.close()
        self.router.close(linger=1000 if self._left else 0)  # a Deregister must get out
        self.http.close()
        self._ctx.term()
        self.engine.close()

    @property
    def kv_address(self) -> str | None:
        """Where prefill workers reach this one (a wildcard bind is replaced by our name)."""
        if self.receiver is None:
            return None
        return reachable(self.receiver.address, self.s.advertise_host)

    def tick(self) -> None:
        """One turn of the loop (``run`` repeats it; tests drive it directly)."""
        if not (self.engine.has_work or self.num_arriving):
            # Requests detached for a handoff and transfers in flight wait for acks only.
            self.engine.rest()
            waiting_acks = len(self.outgoing) or self.engine.has_unfinished
            idle_ms = IDLE_WAIT_MS if self._wakeable else IDLE_POLL_MS
            self._poller.poll(ACK_POLL_MS if waiting_acks else idle_ms)
        elif self.engine.stalled and not self.num_arriving:
            # Its requests wait for blocks that only an ack (not a poller event) or an
            # abort frees: stepping again at once would only burn a CPU the peer needs.
            self._poller.poll(ACK_POLL_MS)
        self._read_control()
        if self.inbox is not None:
            self.inbox.take()
        if self.engine.has_unfinished:
            self._send_updates(self._timed_step())
        if self.outbox is not None:
            self.outbox.ship_pieces()  # this step's chunks go out while the next computes
            self.outbox.ship_handoffs()
            self.outbox.settle()
        self._report()
        if self.drain.asked:
            self._advance_drain()

    @property
    def incoming(self):
        """Whole transfers waiting for room (decode side; None on a prefill worker)."""
        return None if self.inbox is None else self.inbox.incoming

    @property
    def num_arriving(self) -> int:
        """Requests whose KV has arrived or is arriving but that do not run yet."""
        return 0 if self.inbox is None else len(self.inbox)

    def _timed_step(self) -> list[SeqUpdate]:
        before, start = self.engine.num_computed_tokens, time.monotonic()
        updates = self.engine.step()
        tokens = self.engine.num_computed_tokens - before
        self.rates.observe_step(time.monotonic() - start, tokens,
                                prefill_only=self.s.role is WorkerRole.PREFILL)
        if tokens:  # a step that computed nothing (all waiting for blocks) is no iteration
            self.metrics.iteration_tokens.observe(tokens)
        return updates

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
            if self.outbox is not None:
                self.outbox.cancel(request_id)
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
                if self._register_pending():
                    log.info("a Reregister sent before the router read our Register: ignored")
                    continue
                self._guarded("reregister", None, None, lambda m=msg: self._rejoin(m.lost_work))
            elif isinstance(msg, Registered):
                self._registered = msg.worker_id == self.s.worker_id
            elif isinstance(msg, Drained):
                self.drain.released = self.drain.started
            else:
                log.warning("unexpected %s from the router", msg.TAG)

    def _on_task(self, task: Task) -> None:
        if task.handoff_addr is not None and self.sender is None:
            raise ProtocolError("a prefill-only task sent to a worker that cannot ship KV")
        job = task.open()
        self.engine.add_request(job.prompt_token_ids, job.params, task.request_id,
                                prefill_only=task.handoff_addr is not None)
        self.clock.start(task.request_id, task.reply_to, len(job.prompt_token_ids),
                         task.handoff_addr)

    def _on_abort(self, request_id: str) -> None:
        if self.outbox is not None:  # its transfers keep the blocks they read until they end
            self.outbox.cancel(request_id)
        self.engine.abort(request_id)  # its own blocks, or its reservation of arriving KV
        if self.inbox is not None:
            self.inbox.abort(request_id)
        self.clock.forget(request_id)

    def _rejoin(self, lost_work: bool) -> None:
        """Register anew. ``lost_work``: the router gave us up for dead and failed our
        requests, so drop them; otherwise the router restarted and they go on."""
        if lost_work:
            log.warning("the router declared this worker dead: dropping in-flight work")
            for request_id in self.engine.request_ids():
                self._on_abort(request_id)
            if self.inbox is not None:
                self.inbox.clear()
        else:
            log.info("the router is new: registering again, keeping %d requests",
                     len(self.engine.request_ids()))
        self._register()

    def _fail(self, request_id: str, reply_to: str, error: str, retryable: bool = False) -> None:
        self.pushers.send(reply_to, Tokens(request_id, 0, 0, [], error=error, retryable=retryable,
                                                  worker_id=self.s.worker_id))
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
            if u.error is not None:  # the engine ended it (a structured-output matcher failed)
                self._on_abort(u.request_id)  # its transfers and arriving KV too
                self._fail(u.request_id, meta.reply_to, u.error)
                continue
            first = meta.first_token is None
            self.clock.observe_token(meta, u, now, self.metrics)
            if first and self.s.role is WorkerRole.DECODE:  # a prompt prefilled here is done
                self._send_router(Finished(u.request_id, self.s.worker_id, FinishStage.PREFILL))
            self.pushers.send(meta.reply_to, Tokens(
                u.request_id, u.choice, u.index, u.token_ids, u.logprobs or None,
                u.finish_reason, meta.num_prompt_tokens, u.num_cached_tokens,
                prompt_logprobs=u.prompt_logprobs, worker_id=self.s.worker_id))
            if u.finish_reason is not None:
                ended.append(u.request_id)
        for request_id in dict.fromkeys(ended):  # a request ends when its last choice does
            out = self.engine.finished_output(request_id)
            if out is not None:
                reason = out.choices[0].finish_reason or "stop"
                self.clock.finish(self.clock.get(request_id), now, reason, self.metrics)
                self._send_router(Finished(request_id, self.s.worker_id, FinishStage.REQUEST))

    # ---- reporting ------------------------------------------------------------------

    def _register_pending(self) -> bool:
        """Our latest Register is unanswered and recent (see REGISTER_ANSWER_S)."""
        return not self._registered and time.monotonic() - self._register_sent < REGISTER_ANSWER_S

    def _register(self) -> None:
        e = self.engine
        self._registered = False  # until the router answers this one
        self._register_sent = time.monotonic()
        self._send_router(Register(
            self.s.worker_id, self.s.role, self.kv_address,
            f"http://{self.s.advertise_host}:{self.http.port}/metrics", e.stats().num_blocks,
            e.block_size, e.max_model_len, e.loaded.name, self.s.heartbeat_interval,
            e.cached_block_hashes()))
        e.take_kv_events()  # the snapshot above already holds them
        if self.drain.started:  # a new router (or record) must hear it again
            self.drain.rejoined()
            self._send_router(Draining(self.s.worker_id))
        # Beat from now on, not from the end of the first tick: a restarted worker's first
        # step (the requests moved off a dead one, all at once) can outlast the router's
        # heartbeat timeout, which then declared the new worker dead too.
        self._report()

    # ---- drain ----------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Nothing is left here: no request, no KV arriving, no transfer out in flight that
        its request still wants. A cancelled one (its request aborted: the client left, or
        its decode worker died) holds its blocks only against reuse, which leaving ends,
        so a drain does not wait out the lease of a transfer to a dead receiver."""
        return not (len(self.clock) or self.engine.has_unfinished or self.num_arriving
                    or self.outgoing.wanted)

    @property
    def left(self) -> bool:
        """The drain is over: ``Deregister`` was sent and the loop ends."""
        return self._left

    def _advance_drain(self) -> None:
        if self._left:
            return
        if self.drain.start():
            log.info("draining: no new work; finishing %d requests within %g s",
                     len(self.clock), self.drain.timeout)
            self._send_router(Draining(self.s.worker_id))
        leave = self.drain.decide(self.idle, self._registered)
        if leave is Leave.STAY:
            return
        if leave is Leave.HAND_OVER:
            self._hand_over()
        self.heartbeat.close()  # no beat may follow the Deregister
        self._send_router(Deregister(self.s.worker_id))
        self._left = self._stopping = True
        log.info("drained: leaving")

    def _hand_over(self) -> None:
        """Fail every request still here back to its gateway as retryable (the gateway
        continues it on another worker with the tokens already delivered)."""
        metas = self.clock.requests()
        log.warning("drain deadline: handing %d requests over to other workers", len(metas))
        for meta in metas:
            self._on_abort(meta.request_id)
            self._fail(meta.request_id, meta.reply_to,
                       f"worker {self.s.worker_id} shut down while serving the request",
                       retryable=True)

    def _report(self) -> None:
        """KV events, metrics and the heartbeat's snapshot, after every tick (all cheap)."""
        events = self.engine.take_kv_events()
        if events:
            self._send_router(KVEvents(self.s.worker_id, [ev.block_hash for ev in events if ev.stored],
                                       [ev.block_hash for ev in events if not ev.stored]))
        stats = self.engine.stats()
        self._update_gauges(stats)
        r = self.rates
        self.heartbeat.snapshot = Heartbeat(self.s.worker_id, stats.num_running, stats.num_waiting,
                                            stats.num_free_blocks, stats.num_blocks, r.step_seconds,
                                            r.prefill_s_per_token, r.transfer_s_per_token,
                                            stats.prefix_queries, stats.prefix_hits,
                                            self.metrics.kv_bytes_total("sent"),
                                            self.metrics.kv_bytes_total("received"))
        self.heartbeat.last_tick = time.monotonic()

    def _update_gauges(self, stats) -> None:
        m = self.metrics
        m.running.set(stats.num_running)
        m.waiting.set(stats.num_waiting + self.num_arriving)
        m.kv_usage.set(stats.kv_usage)
        m.step_threads.set(stats.step_threads)
        seen = (stats.prefix_queries, stats.prefix_hits, stats.num_preemptions,
                stats.num_draft_tokens, stats.num_accepted_tokens, stats.cpu_wait_seconds)
        counters = (m.prefix_queries, m.prefix_hits, m.preemptions, m.spec_draft_tokens,
                    m.spec_accepted_tokens, m.cpu_wait)
        for counter, now, before in zip(counters, seen, self._stats_seen, strict=True):
            counter.inc(now - before)
        self._stats_seen = seen

    def _send_router(self, msg: Message) -> None:
        self.router.send(encode(msg))

    def _ready(self) -> ServiceHealth:
        """Readiness: the model is loaded (this server runs), the router knows us, and we
        are not draining."""
        reason = ("draining" if self.drain.asked else
                  None if self._registered else "not registered with the router")
        detail = {"status": "ready" if reason is None else "not ready",
                  "role": self.s.role.value, "worker_id": self.s.worker_id}
        if reason is not None:
            detail["reason"] = reason
        return ServiceHealth(reason is None, detail)

    def _health(self) -> ServiceHealth:
        stats = self.engine.stats()
        return ServiceHealth(True, {"status": "ok", "role": self.s.role.value,
                                    "worker_id": self.s.worker_id, "kv_address": self.kv_address,
                                    "running": stats.num_running, "waiting": stats.num_waiting,
                                    "kv_cache_usage": stats.kv_usage})
