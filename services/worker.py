"""A worker process: the engine in one of three roles, driven by one synchronous loop.

- ``prefill``: runs prompts (chunked, prefix-cached), sends each first token straight to
  the gateway, ships the KV to the decode worker the router chose, and frees it on ack.
- ``decode``: takes prefilled requests from the KV receiver into its running batch and
  streams the remaining tokens to the gateway.
- ``colocated``: both, in one engine, no transfer (the baseline, and small deployments).

The loop: read control messages → take arrived KV → step the engine → send tokens →
settle transfers → report to the router. The engine is touched by this thread only.
Sockets: a DEALER to the router (identity = worker id), PUSH sockets to gateways, and
the KV connector's sender or receiver.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq
from prometheus_client import CollectorRegistry

from common.addresses import reachable
from common.connector import ReceivedTransfer, make_receiver, make_sender
from common.connector.lease import LeaseTable
from common.engine.engine import Engine, SeqUpdate
from common.engine.handoff import Handoff, check_layout
from common.errors import InvalidRequestError
from common.metrics import EngineMetrics, MetricsServer
from common.protocol import (
    Abort,
    Finished,
    Heartbeat,
    KVEvents,
    KVHandoff,
    Message,
    ProtocolError,
    Register,
    Reregister,
    Task,
    Tokens,
    decode,
    encode,
    params_from_wire,
    params_to_wire,
)
from services.worker_streams import (
    GatewayStreams,
    RequestClock,
    logprobs_from_wire,
    logprobs_to_wire,
)

log = logging.getLogger("tandem.worker")

HEARTBEAT_SECONDS = 0.25
IDLE_WAIT_MS = 100  # an idle loop sleeps in poll(); any message wakes it at once
IDLE_POLL_MS = 5  # for a receiver that cannot wake the poller (UCX's own thread)


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    role: str  # prefill | decode | colocated
    router: str
    worker_id: str = field(default_factory=lambda: f"worker-{uuid.uuid4().hex[:8]}")
    kv_transport: str = "zmq"
    kv_bind: str | None = None  # decode/colocated: where the KV receiver binds
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    advertise_host: str = "127.0.0.1"
    lease_seconds: float = 30.0

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"unknown worker role {self.role!r}")


class Heartbeater:
    """Heartbeats from their own thread and socket: an engine step can take seconds (a
    2,048-token prefill chunk on one core), and a busy worker is not a dead one. It goes
    quiet when the loop itself stops ticking for ``stall_seconds`` — a hung worker."""

    def __init__(self, ctx: zmq.Context, router: str, worker_id: str, stall_seconds: float = 300.0) -> None:
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt_string(zmq.IDENTITY, f"{worker_id}/heartbeat")
        self._sock.connect(router)
        self._stall = stall_seconds
        self.snapshot: Heartbeat | None = None  # replaced whole by the loop, read here
        self.last_tick = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)

    def _run(self) -> None:
        while not self._done.wait(HEARTBEAT_SECONDS):
            beat = self.snapshot
            if beat is not None and time.monotonic() - self.last_tick < self._stall:
                self._sock.send(encode(beat))


class WorkerService:
    def __init__(self, settings: WorkerSettings, engine: Engine) -> None:
        self.s = settings
        self.engine = engine
        self._ctx = zmq.Context()
        self.router = self._ctx.socket(zmq.DEALER)
        self.router.setsockopt_string(zmq.IDENTITY, settings.worker_id)
        self.router.connect(settings.router)
        self.streams = GatewayStreams(self._ctx)
        self.clock = RequestClock()
        self.sender = make_sender(settings.kv_transport) if settings.role == "prefill" else None
        self.receiver = None
        if settings.role in ("decode", "colocated"):
            self.receiver = make_receiver(settings.kv_transport, settings.kv_bind or "tcp://127.0.0.1:0")
        self.leases = LeaseTable(settings.lease_seconds)
        self._in_flight: dict[str, tuple[str, float, int]] = {}  # transfer -> (request, start, bytes)
        self._pending: list[ReceivedTransfer] = []  # arrived KV waiting for free blocks
        self._aborted: OrderedDict[str, None] = OrderedDict()  # late handoffs to drop
        self._registry = CollectorRegistry()
        self.metrics = EngineMetrics(self._registry)
        self.http = MetricsServer(self._registry, settings.metrics_host, settings.metrics_port, self._health)
        self.heartbeat = Heartbeater(self._ctx, settings.router, settings.worker_id)
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        wakeup = getattr(self.receiver, "wakeup_socket", None)
        if wakeup is not None:
            self._poller.register(wakeup, zmq.POLLIN)
        self._wakeable = self.receiver is None or wakeup is not None
        self._stats_seen = (0, 0, 0)
        self._stopping = False

    # ---- lifecycle ------------------------------------------------------------------

    def run(self) -> None:
        self.http.start()
        self._register()
        self.heartbeat.start()
        log.info("%s worker %s up: router %s, kv %s, metrics :%d", self.s.role, self.s.worker_id,
                 self.s.router, self.kv_address, self.http.port)
        try:
            while not self._stopping:
                self._tick()
        finally:
            self.close()

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        for closer in (self.sender, self.receiver):
            if closer is not None:
                closer.close()
        self.heartbeat.close()
        self.streams.close()
        self.router.close(linger=0)
        self.http.close()
        self._ctx.term()

    @property
    def kv_address(self) -> str | None:
        """Where prefill workers reach this one (a wildcard bind is replaced by our name)."""
        if self.receiver is None:
            return None
        return reachable(self.receiver.address, self.s.advertise_host)

    def _tick(self) -> None:
        busy = self.engine.has_unfinished or self._pending or len(self.leases)
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

    # ---- control messages -----------------------------------------------------------

    def _read_control(self) -> None:
        while self.router.poll(0):
            try:
                msg = decode(self.router.recv())
            except ProtocolError as e:
                log.warning("bad message from the router: %s", e)
                continue
            if isinstance(msg, Task):
                self._on_task(msg)
            elif isinstance(msg, Abort):
                self._on_abort(msg.request_id)
            elif isinstance(msg, Reregister):
                self._rejoin()

    def _on_task(self, task: Task) -> None:
        try:
            params = params_from_wire(task.params)
            self.engine.add_request(task.prompt_token_ids, params, task.request_id,
                                    prefill_only=task.handoff_addr is not None)
        except (ProtocolError, ValueError, TypeError) as e:  # a bad task fails alone
            self._fail(task.request_id, task.reply_to, str(e))
            return
        self.clock.start(task.request_id, task.reply_to, len(task.prompt_token_ids),
                         (task.handoff_worker, task.handoff_addr))

    def _on_abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.leases.cancel(request_id)
        self.clock.forget(request_id)
        self._pending = [t for t in self._pending if t.header.request_id != request_id]
        self._aborted[request_id] = None
        while len(self._aborted) > 10_000:
            self._aborted.popitem(last=False)

    def _rejoin(self) -> None:
        """The router gave us up for dead and failed our requests: drop them, register anew."""
        log.warning("the router lost track of this worker: dropping in-flight work, registering again")
        for request_id in self.engine.request_ids():
            self._on_abort(request_id)
        self._pending.clear()
        self._register()

    def _fail(self, request_id: str, reply_to: str, error: str) -> None:
        self.streams.send(reply_to, Tokens(request_id, 0, 0, [], error=error))
        self._send_router(Finished(request_id, self.s.worker_id, "request", error=error))
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
            self.streams.send(meta.reply_to, Tokens(
                u.request_id, u.choice, u.index, u.token_ids, logprobs_to_wire(u.logprobs),
                u.finish_reason.value if u.finish_reason else None, meta.num_prompt_tokens,
                u.num_cached_tokens))
            if u.finish_reason is not None:
                ended.append(u.request_id)
        for request_id in dict.fromkeys(ended):  # a request ends when its last choice does
            out = self.engine.finished_output(request_id)
            if out is not None:
                reason = out.choices[0].finish_reason or "stop"
                self.clock.finish(self.clock.get(request_id), now, reason, self.metrics)
                self._send_router(Finished(request_id, self.s.worker_id, "request"))

    # ---- prefill side: shipping KV ----------------------------------------------------

    def _ship_handoffs(self) -> None:
        for h in self.engine.take_handoffs():
            meta = self.clock.get(h.request_id)
            if meta is None or meta.handoff[1] is None:
                self.engine.abort(h.request_id)
                continue
            transfer_id = f"{h.request_id}:{uuid.uuid4().hex[:8]}"
            blocks = self.engine.runner.block_views(h.block_ids)
            header = self._handoff_header(transfer_id, h, meta.reply_to, blocks)
            self.sender.send(meta.handoff[1], header, blocks)
            self.leases.open(transfer_id, h.request_id)
            self._in_flight[transfer_id] = (h.request_id, time.monotonic(), sum(b.nbytes for b in blocks))

    def _handoff_header(self, transfer_id: str, h: Handoff, reply_to: str, blocks) -> KVHandoff:
        return KVHandoff(
            transfer_id, h.request_id, h.prompt_token_ids, h.first_tokens,
            [logprobs_to_wire([lp])[0] if lp else None for lp in h.first_logprobs],
            h.generator_states, params_to_wire(h.params), reply_to, h.num_cached_tokens,
            len(blocks), self.engine.runner.block_nbytes, self.engine.runner.layout)

    def _settle_transfers(self) -> None:
        for ack in self.sender.poll_acks():
            lease = self.leases.settle(ack)
            if lease is not None:
                self._end_transfer(ack.transfer_id, lease.request_id, None if ack.ok else ack.reason)
        for lease in self.leases.expired():
            self._end_transfer(lease.transfer_id, lease.request_id, "KV transfer lease expired")

    def _end_transfer(self, transfer_id: str, request_id: str, error: str | None) -> None:
        _, started, nbytes = self._in_flight.pop(transfer_id, (request_id, time.monotonic(), 0))
        meta = self.clock.get(request_id)
        self.engine.abort(request_id)  # frees the blocks: they stay in the prefix cache
        self.clock.forget(request_id)
        if error is None:
            self.metrics.kv_bytes.labels("sent").inc(nbytes)
            self.metrics.kv_seconds.observe(time.monotonic() - started)
            self._send_router(Finished(request_id, self.s.worker_id, "prefill"))
            return
        self.metrics.kv_failures.labels("send").inc()
        log.warning("KV transfer of %s failed: %s", request_id, error)
        if meta is not None:
            self.streams.send(meta.reply_to, Tokens(request_id, 0, 1, [], error=f"KV transfer failed: {error}"))
        self._send_router(Finished(request_id, self.s.worker_id, "prefill", error=error))

    # ---- decode side: taking KV in ----------------------------------------------------

    def _take_transfers(self) -> None:
        if self.receiver is None:
            return
        for transfer in self.receiver.poll(0):
            problem = check_layout(transfer.header.layout, self.engine.runner.layout)
            self.receiver.ack(transfer, ok=problem is None, reason=problem or "")
            if problem is None:
                self.metrics.kv_bytes.labels("received").inc(transfer.header.num_blocks *
                                                             transfer.header.block_nbytes)
                self._pending.append(transfer)
            else:
                self.metrics.kv_failures.labels("layout").inc()
        self._pending = [t for t in self._pending if not self._admit(t)]

    def _admit(self, transfer: ReceivedTransfer) -> bool:
        """True when the transfer is done with (admitted or dropped)."""
        h = transfer.header
        if h.request_id in self._aborted:
            return True
        try:
            first_logprobs = [logprobs_from_wire(lp, t) for lp, t in zip(h.first_logprobs, h.first_tokens,
                                                                          strict=True)]
            handoff = Handoff(h.request_id, h.prompt_token_ids, params_from_wire(h.params), [],
                              h.first_tokens, first_logprobs,
                              h.generator_states, [False] * len(h.first_tokens), h.num_cached_tokens)
            if not self.engine.add_prefilled(handoff, transfer.blocks):
                return False
        except (ProtocolError, InvalidRequestError) as e:
            self._fail(h.request_id, h.reply_to, f"bad KV handoff: {e}")
            return True
        self.clock.start(h.request_id, h.reply_to, len(h.prompt_token_ids), (None, None),
                         cached=h.num_cached_tokens, first_token_seen=True)
        return True

    # ---- reporting ------------------------------------------------------------------

    def _register(self) -> None:
        e = self.engine
        self._send_router(Register(self.s.worker_id, self.s.role, self.kv_address,
                                   f"http://{self.s.advertise_host}:{self.http.port}/metrics",
                                   e.pool.num_blocks, e.config.cache.block_size, e.max_model_len,
                                   e.loaded.name))
        self._send_router(KVEvents(self.s.worker_id, cleared=True))

    def _report(self) -> None:
        """KV events, metrics and the heartbeat's snapshot, after every tick (all cheap)."""
        events = self.engine.take_kv_events()
        if events:
            self._send_router(KVEvents(self.s.worker_id, [ev.block_hash for ev in events if ev.stored],
                                       [ev.block_hash for ev in events if not ev.stored]))
        self._update_gauges()
        e = self.engine
        self.heartbeat.snapshot = Heartbeat(self.s.worker_id, e.num_running, e.num_waiting,
                                            e.pool.num_free_blocks, e.pool.num_blocks)
        self.heartbeat.last_tick = time.monotonic()

    def _update_gauges(self) -> None:
        e, m = self.engine, self.metrics
        m.running.set(e.num_running)
        m.waiting.set(e.num_waiting + len(self._pending))
        m.kv_usage.set(e.pool.usage)
        stats = e.scheduler.stats
        seen = (stats.prefix_queries, stats.prefix_hits, e.scheduler.num_preemptions)
        m.prefix_queries.inc(seen[0] - self._stats_seen[0])
        m.prefix_hits.inc(seen[1] - self._stats_seen[1])
        m.preemptions.inc(seen[2] - self._stats_seen[2])
        self._stats_seen = seen

    def _send_router(self, msg: Message) -> None:
        self.router.send(encode(msg))

    def _health(self) -> tuple[bool, dict]:
        e = self.engine
        return True, {"status": "ok", "role": self.s.role, "worker_id": self.s.worker_id,
                      "running": e.num_running, "waiting": e.num_waiting,
                      "kv_cache_usage": e.pool.usage}
