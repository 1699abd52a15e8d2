"""The router process: one ROUTER socket that gateways and workers connect to.

It owns the placement of every request (which prefill worker, which decode worker) and
the admission queue; it never touches tokens or KV: a ``Submit``'s header (prompt length,
block hashes, priority) is all placement reads, and its ``Job`` goes on to the worker
unopened. A request's life here:
submit → queued (``Queued`` to the gateway) or placed (``Task`` to the prefill worker, or
to the decode worker itself when ``DisaggRule`` says its prompt is better prefilled there;
``Admitted`` to the gateway)
→ ``Finished(prefill)`` → ``Finished(request)``. A dead worker's requests are failed
back to their gateways at once, and the surviving side is told to abort them.

A worker that shuts down says ``Draining``: it gets no new work from then on but stays
registered while it finishes what it holds; once nothing the router placed on it is
left, the router answers ``Drained``, and the worker's ``Deregister`` takes it out (what
it still held then is failed back as retryable, as for a dead worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.errors import InvalidRequestError
from common.hashing import BlockHash, hash_prefix_blocks
from common.metrics import LATENCY_BUCKETS, MetricsServer, ServiceHealth
from common.protocol import (
    Abort,
    Admitted,
    Deregister,
    Drained,
    Draining,
    Finished,
    Heartbeat,
    KVEvents,
    Message,
    Ping,
    ProtocolError,
    Queued,
    Register,
    Registered,
    Rejected,
    Reregister,
    Roster,
    Status,
    Submit,
    Survey,
    Task,
    Tokens,
    decode,
    encode,
)
from common.roles import FinishStage, WorkerRole
from common.rules import check_context, check_not_empty, decode_blocks_needed
from services.router.admission import AdmissionQueue, Refusal
from services.router.disagg import (
    CostGauges,
    DisaggMode,
    DisaggRule,
    PrefillCosts,
    Where,
    default_costs,
)
from services.router.ledger import LoadLedger
from services.router.policies import (
    Candidate,
    Candidates,
    PlacementRequest,
    RoutingPolicy,
    decode_policy,
    place,
    prefill_policy,
    prefix_shortlist,
    within_token_budget,
)
from services.router.prefix_index import PrefixIndex
from services.router.registry import Registry, WorkerInfo

log = logging.getLogger("tandem.router")
NO_PREFILL = Refusal(503, "no prefill worker is available", 2.0)
RECV_BATCH = 256  # messages handled between two turns of the event loop
ENDED_KEPT = 16384  # ended request ids remembered (seconds of them at thousands a second)
WORKERS_KEPT = 4096  # worker ids remembered as declared dead, or as asked to register again
# An unknown worker's heartbeats are answered with ``Reregister`` at most this often: a
# restarted router gets a burst of the beats buffered while it was down, and each
# ``Register`` after the first would read as the worker restarting (its requests failed).
REREGISTER_EVERY_S = 1.0
# A router behind on its socket judges heartbeats by the last moment it had read everything
# (a beat still queued is not a silence), but never by a moment older than this: a router
# that stays behind still finds a dead worker, this much later.
BEHIND_AT_MOST_S = 30.0
MESSAGE_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 0.1, 1.0)


def _remember(table: OrderedDict, key, value, keep: int) -> None:
    """Set ``table[key]``, forgetting the oldest entries past ``keep``."""
    table[key] = value
    while len(table) > keep:
        table.popitem(last=False)


@dataclass(frozen=True, slots=True)
class RouterSettings:
    bind: str = "tcp://127.0.0.1:7100"
    policy: RoutingPolicy = RoutingPolicy.PREFIX
    token_budget: int = 8192  # outstanding prompt tokens per prefill worker
    load_weight: float = 1.0  # prefix policy: outstanding tokens that cancel one cached token
    max_queue: int = 256
    queue_timeout: float = 60.0
    # Silence after which a worker is declared dead: four of its 0.25 s heartbeats, so one
    # late beat on a loaded machine is not a death, and a killed worker's requests move on
    # within a second.
    heartbeat_timeout: float = 1.0
    # A router that has just started holds requests (rather than a 503) until its first
    # prefill-capable worker registers, for at most this long: on a fresh start the workers
    # are still loading the model (5-8 s for SmolLM2 on 2 cores, minutes for a large one);
    # after a router restart they register again within a heartbeat or two.
    startup_grace: float = 60.0
    disagg: DisaggRule = field(default_factory=DisaggRule)  # where each prompt is prefilled
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", RoutingPolicy(self.policy))
        if self.token_budget < 1 or self.max_queue < 0 or self.load_weight < 0:
            raise ValueError("token_budget must be >= 1, max_queue and load_weight >= 0")
        if self.queue_timeout <= 0 or self.heartbeat_timeout <= 0:
            raise ValueError("queue_timeout and heartbeat_timeout must be > 0")
        if self.startup_grace < 0:
            raise ValueError("startup_grace must be >= 0")


@dataclass(slots=True, eq=False)
class Routed:
    submit: Submit
    gateway: bytes
    arrival: float
    hashes: dict[int, list[BlockHash]] = field(default_factory=dict)  # other block sizes

    def block_hashes(self, block_size: int) -> list[BlockHash]:
        """The prompt's block hashes in ``block_size``: the gateway's, or (when it hashed in
        another size, or not at all) our own, from the opened job."""
        if block_size == self.submit.block_size:
            return self.submit.block_hashes
        if block_size not in self.hashes:
            try:
                tokens = self.submit.open().prompt_token_ids
                self.hashes[block_size] = hash_prefix_blocks(tokens, block_size)
            except (ValueError, OverflowError) as e:  # a ProtocolError is a ValueError
                raise InvalidRequestError(f"the request cannot be read: {e}", "prompt") from None
        return self.hashes[block_size]


class RouterService:
    def __init__(self, settings: RouterSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock  # every timestamp (heartbeats, queue waits); tests move it by hand
        self.registry = Registry(settings.heartbeat_timeout)
        self.index = PrefixIndex()
        self.queue: AdmissionQueue[Routed] = AdmissionQueue(settings.max_queue, settings.queue_timeout)
        self.requests: dict[str, Routed] = {}
        self.ledger = LoadLedger(self.registry.workers)
        # Workers declared dead (their work was failed), with their role and when: while a
        # prefill-capable one is expected back, requests wait in the queue instead of a 503.
        self._started = clock()
        self._had_prefill = False  # a prefill-capable worker has registered: the grace is over
        self._declared_dead: OrderedDict[str, tuple[WorkerRole, float]] = OrderedDict()
        self._unreleased: set[str] = set()  # draining workers not yet told ``Drained``
        # Requests that ended here lately, by id → their gateway: a Submit the gateway sends
        # again while it waits for its verdict (it resends a queued one) may arrive after
        # the request ran and ended, and must be answered, not placed a second time.
        self._ended: OrderedDict[str, bytes] = OrderedDict()
        self._asked: OrderedDict[str, float] = OrderedDict()  # unknown worker → last Reregister
        self._serving = False  # the loop is reading the socket (``/ready``)
        self._caught_up = clock()  # when the socket last had nothing waiting to be read
        self._prefill_steps = prefill_policy(settings.policy, self.index, settings.token_budget,
                                             settings.load_weight)
        # Among many workers the prefix policy's steps run over its possible winners only.
        self._prefill_shortlist = (
            prefix_shortlist(self.index, self.registry.prefill_position)
            if settings.policy is RoutingPolicy.PREFIX and settings.load_weight > 0 else None)
        self._decode_steps = decode_policy()
        self._queue_shown = 0  # the queue length gauge's value
        self._local_budget = within_token_budget(settings.token_budget)  # a decode worker's own prompts
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker reclaims its identity
        self.sock.bind(settings.bind)
        self._io = zmq.Socket.shadow(self.sock.underlying)  # the same socket, without asyncio
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._metrics_registry = CollectorRegistry()
        self._init_metrics()
        self.metrics = MetricsServer(self._metrics_registry, settings.metrics_host,
                                     settings.metrics_port, self._health, self._ready)

    # ---- lifecycle ----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self.metrics.start()
        log.info("router on %s (policy %s), metrics on :%d", self.address, self.settings.policy,
                 self.metrics.port)
        maintenance = asyncio.create_task(self._maintain(stop))
        self._serving = True
        try:
            while not stop.is_set():
                if not await self.sock.poll(200):
                    self._caught_up = self._clock()
                    continue
                await self._handle_waiting()
                await asyncio.sleep(0)  # a ready poll does not yield: let maintenance run
        finally:
            self._serving = False
            maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await maintenance
            self.metrics.close()
            self.sock.close(linger=0)
            self._ctx.term()

    async def _handle_waiting(self) -> None:
        """Handle the messages already waiting, in order, up to ``RECV_BATCH`` of them.

        They are read without the event loop (one ``await`` per message cost more than
        most handlers): the loop is only asked to wake the router when there are some."""
        for _ in range(RECV_BATCH):
            try:
                frames = self._io.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                self._caught_up = self._clock()
                return
            started = time.perf_counter()
            identity, msg = self._decoded(frames)
            if msg is not None:
                await self._dispatch(identity, msg)
                if len(self.queue) != self._queue_shown:  # exact, not only every 0.25 s
                    self._queue_shown = len(self.queue)
                    self._queue_len.set(self._queue_shown)
                self._message_seconds(msg.TAG).observe(time.perf_counter() - started)

    def _decoded(self, frames: list[bytes]) -> tuple[bytes, Message | None]:
        if len(frames) != 2:
            log.warning("dropping a message of %d frames", len(frames))
            return frames[0], None
        try:
            return frames[0], decode(frames[1])
        except ProtocolError as e:
            log.warning("dropping a bad message: %s", e)
            return frames[0], None

    async def _send(self, identity: bytes, msg: Message) -> None:
        # A ROUTER socket never blocks a send (past a peer's high-water mark it drops), so
        # the send needs no event loop either.
        self._io.send_multipart([identity, encode(msg)])

    async def _maintain(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(0.25)
            await self._maintain_once()

    async def _maintain_once(self) -> None:
        """Expire silent workers and queued requests, place what can be, refresh gauges."""
        now = self._clock()
        for worker in self.registry.expire(self._heard_until(now)):
            log.warning("worker %s missed its heartbeats: failing its requests", worker.worker_id)
            await self._worker_gone(worker)
        for routed in self.queue.expired(now):
            await self._refuse(routed, self.queue.refusal_for_timeout())
        if not self.registry.prefill_workers() and not self._prefill_expected_back():
            for routed in list(self.queue.waiting()):  # nobody is coming to serve them
                self.queue.remove(routed)
                await self._refuse(routed, NO_PREFILL)
        await self._drain_queue()
        await self._release_drained()
        self._update_gauges()

    def _heard_until(self, now: float) -> float:
        """The time up to which the router has read what its peers sent: when its socket
        last had nothing waiting (within the loop's 0.2 s poll when idle).

        Silence is measured up to then. An overloaded router reads heartbeats seconds
        late; judged by the clock alone it declared live workers dead by the hundred (256
        simulated workers at 1,850 placements/s: 459 in 30 s), failing their requests and
        indexing their snapshots again when they registered anew, which overloaded it more.
        (Asking the socket here whether anything waits would reset its edge-triggered
        descriptor under the loop's own poll.)
        """
        return max(self._caught_up, now - BEHIND_AT_MOST_S)

    # ---- messages -----------------------------------------------------------------

    async def _dispatch(self, identity: bytes, msg: Message) -> None:
        handler = {
            Submit: self._on_submit, Abort: self._on_abort, Ping: self._on_ping,
            Register: self._on_register, Heartbeat: self._on_heartbeat,
            KVEvents: self._on_kv_events, Finished: self._on_finished,
            Draining: self._on_draining, Deregister: self._on_deregister,
            Survey: self._on_survey,
        }.get(type(msg))
        if handler is None:
            log.warning("unexpected %s from %r", msg.TAG, identity)
            return
        try:
            await handler(identity, msg)
            if self._unreleased:  # whatever ended a request may have freed a draining worker
                await self._release_drained()
        except Exception:  # one peer's bad message must not take the router down
            log.exception("failed to handle %s from %r", msg.TAG, identity)

    async def _on_submit(self, identity: bytes, msg: Submit) -> None:
        known = self.requests.get(msg.request_id)
        if known is not None and known.gateway == identity:  # a resend: its ack was lost
            queued = known in self.queue.waiting()
            await self._send(identity, Queued(msg.request_id) if queued else Admitted(msg.request_id))
            return
        if known is not None:
            await self._send(identity, Rejected(msg.request_id, 400, "duplicate request id"))
            return
        if self._ended.get(msg.request_id) == identity:  # a late resend of one that ran
            await self._send(identity, Admitted(msg.request_id))
            return
        routed = Routed(msg, identity, self._clock())
        problem = self._unservable(msg)
        if problem is not None:
            await self._refuse(routed, problem)
        elif self.queue or not await self._try_place(routed):
            refusal = self.queue.offer(routed, routed.arrival, msg.priority)
            if refusal is not None:
                await self._refuse(routed, refusal)
            else:
                self.requests[msg.request_id] = routed
                await self._send(identity, Queued(msg.request_id))

    def _unservable(self, msg: Submit) -> Refusal | None:
        """Why no worker could ever serve this request now (the same rules as the engine)."""
        if not self.registry.prefill_workers() and not self._prefill_expected_back():
            return NO_PREFILL
        try:
            check_not_empty(msg.num_prompt_tokens)
            limit = self.registry.max_model_len()
            if limit is not None:
                check_context(msg.num_prompt_tokens, msg.max_tokens, limit)
        except InvalidRequestError as e:
            return Refusal(400, e.message, 0.0)
        return None

    def _prefill_expected_back(self) -> bool:
        """A prefill-capable worker died within the queue timeout: a supervisor (tandem up,
        compose, Kubernetes) is likely restarting it, so queued requests may still be served.
        Likewise just after this router started, until its first prefill-capable worker
        registers: on a fresh start the workers are loading the model; on a restart they
        register again on their next heartbeat."""
        if not self._had_prefill and self._clock() - self._started < self.settings.startup_grace:
            return True
        if any(w.can_prefill for w in self.registry.draining_workers()):
            return True  # draining: most likely being replaced (a rolling restart)
        horizon = self._clock() - self.settings.queue_timeout
        return any(role.can_prefill and since > horizon
                   for role, since in self._declared_dead.values())

    async def _on_abort(self, identity: bytes, msg: Abort) -> None:
        routed = self.requests.pop(msg.request_id, None)
        if routed is None:
            return
        if self.queue.remove(routed):
            return
        for worker_id in self.ledger.release(msg.request_id):
            await self._send(worker_id.encode(), msg)

    async def _on_ping(self, identity: bytes, msg: Ping) -> None:
        reg = self.registry
        prefill = reg.prefill_workers()
        await self._send(identity, Status(msg.nonce, len(prefill), len(reg.decode_workers()),
                                          len(self.queue), reg.max_model_len(),
                                          self.settings.queue_timeout,
                                          prefill[0].block_size if prefill else None))

    async def _on_survey(self, identity: bytes, msg: Survey) -> None:
        await self._send(identity, Roster(msg.nonce, self.registry.views(self._clock()),
                                          len(self.queue)))

    async def _on_register(self, identity: bytes, msg: Register) -> None:
        self._declared_dead.pop(msg.worker_id, None)
        self._asked.pop(msg.worker_id, None)
        old = self.registry.remove(msg.worker_id)
        if old is not None:  # a restart: whatever it held is gone
            await self._worker_gone(old)
        if msg.heartbeat_interval * 2 > self.settings.heartbeat_timeout:
            log.warning("worker %s: --heartbeat-timeout %g must span at least two of its "
                        "--heartbeat-interval %g", msg.worker_id, self.settings.heartbeat_timeout,
                        msg.heartbeat_interval)
        self.registry.register(msg, self._clock())
        self._had_prefill = self._had_prefill or msg.role.can_prefill
        self._unreleased.discard(msg.worker_id)  # a fresh record: draining again only if it says so
        await self._send(identity, Registered(msg.worker_id))
        self.index.drop_worker(msg.worker_id)
        self.index.apply(KVEvents(msg.worker_id, stored=msg.cached_blocks))
        log.info("registered %s worker %s (%d blocks, %d cached)", msg.role.value, msg.worker_id,
                 msg.num_blocks, len(msg.cached_blocks))
        await self._drain_queue()

    async def _on_heartbeat(self, identity: bytes, msg: Heartbeat) -> None:
        if self.registry.heartbeat(msg, self._clock()) is not None:
            await self._drain_queue()
        else:  # declared dead earlier (its requests are failed already), or we are new
            now = self._clock()
            if now - self._asked.get(msg.worker_id, now - REREGISTER_EVERY_S) < REREGISTER_EVERY_S:
                return  # asked already: its Register is on the way
            _remember(self._asked, msg.worker_id, now, WORKERS_KEPT)
            lost = msg.worker_id in self._declared_dead
            await self._send(msg.worker_id.encode(), Reregister(msg.worker_id, lost_work=lost))

    async def _on_draining(self, identity: bytes, msg: Draining) -> None:
        if self.registry.drain(msg.worker_id) is None:
            log.warning("draining from unregistered worker %s: ignored", msg.worker_id)
            return
        log.info("worker %s is draining: no new work is placed on it", msg.worker_id)
        self._unreleased.add(msg.worker_id)

    async def _release_drained(self) -> None:
        """Tell each draining worker with nothing of the router's left that it may go."""
        for worker_id in list(self._unreleased):
            if worker_id not in self.registry.workers:
                self._unreleased.discard(worker_id)
            elif not self.ledger.requests_on(worker_id):
                self._unreleased.discard(worker_id)
                await self._send(worker_id.encode(), Drained(worker_id))

    async def _on_deregister(self, identity: bytes, msg: Deregister) -> None:
        worker = self.registry.remove(msg.worker_id)
        self._unreleased.discard(msg.worker_id)
        if worker is None:
            return
        left = self.ledger.requests_on(msg.worker_id)
        log.info("worker %s left%s", msg.worker_id,
                 f", handing {len(left)} requests back to their gateways" if left else "")
        await self._worker_gone(worker)  # expected back for a while, as a dead one is

    async def _on_kv_events(self, identity: bytes, msg: KVEvents) -> None:
        if msg.worker_id in self.registry.workers:
            self.index.apply(msg)

    async def _on_finished(self, identity: bytes, msg: Finished) -> None:
        if msg.request_id not in self.requests:
            return
        if msg.error:
            log.warning("request %s failed on %s: %s", msg.request_id, msg.worker_id, msg.error)
        if msg.stage is FinishStage.PREFILL and not msg.error:
            self.ledger.prefill_done(msg.request_id)
        else:
            routed = self.requests.pop(msg.request_id)
            _remember(self._ended, msg.request_id, routed.gateway, ENDED_KEPT)
            holders = self.ledger.release(msg.request_id)
            if msg.error:
                for worker_id in holders - {msg.worker_id}:
                    await self._send(worker_id.encode(), Abort(msg.request_id, "peer failed"))
        await self._drain_queue()

    # ---- placement ----------------------------------------------------------------

    async def _try_place(self, routed: Routed) -> bool:
        """Place ``routed`` now if a worker can take it; False leaves it where it was. A
        request that can never be placed (its job unreadable) is refused, and counts as
        handled (True)."""
        prefill_workers = self.registry.prefill_workers()
        if not prefill_workers:
            return False
        block_size = prefill_workers[0].block_size
        try:
            hashes = routed.block_hashes(block_size)
        except InvalidRequestError as e:  # done with: refused, so out of the queue too
            await self._refuse(routed, Refusal(400, e.message, 0.0))
            return True
        req = PlacementRequest(routed.submit.request_id, routed.submit.num_prompt_tokens,
                               hashes, block_size)
        chosen = await place(req, prefill_workers, self._prefill_steps, self._prefill_shortlist)
        if chosen is not None and chosen.worker.role is not WorkerRole.PREFILL:
            return await self._assign(routed, req, chosen.worker, chosen.cached_tokens, None)
        decode = await place(req, self.registry.decode_workers(), self._decode_steps)
        if decode is None:
            return False
        # Only a decode worker prefills "locally": a colocated one is a prefill worker too,
        # already passed over (or over its budget) above.
        if decode.worker.role is WorkerRole.DECODE and await self._where(req, chosen, decode) is Where.LOCAL:
            return await self._assign(routed, req, decode.worker, decode.cached_tokens, decode.worker)
        if chosen is None:
            return False
        return await self._assign(routed, req, chosen.worker, chosen.cached_tokens, decode.worker)

    async def _where(self, req: PlacementRequest, chosen: Candidate | None, decode: Candidate) -> Where:
        """Prefill on ``chosen`` (remote) or on the decode worker itself (local)."""
        rule = self.settings.disagg
        if rule.mode is DisaggMode.ALWAYS:
            return Where.REMOTE  # no costs to gather
        decode.cached_tokens = req.cached_tokens(
            self.index.matched_blocks(decode.worker.worker_id, req.block_hashes))
        if rule.mode is DisaggMode.AUTO and not await self._local_budget(
                req, Candidates([decode.worker], cached=[decode.cached_tokens])):
            # It holds a prefill worker's budget of prompts already: no more, or a flood
            # would pass the admission queue by.
            self._prefill_choices.labels(Where.REMOTE.value, "budget").inc()
            return Where.REMOTE
        transfer, prefill = default_costs(chosen.worker if chosen else None)
        decision = rule.decide(PrefillCosts(
            req.num_prompt_tokens, req.num_prompt_tokens - decode.cached_tokens,
            decode.worker.outstanding_tokens,
            None if chosen is None else req.num_prompt_tokens - chosen.cached_tokens,
            chosen.worker.outstanding_tokens if chosen else 0, transfer, prefill))
        self._prefill_choices.labels(decision.where.value, decision.reason).inc()
        return decision.where

    async def _assign(self, routed: Routed, req: PlacementRequest, runner: WorkerInfo,
                      cached: int, decode: WorkerInfo | None) -> bool:
        """Charge and send the task: ``runner`` prefills; ``decode`` (if any) decodes, and is
        ``runner`` itself for a prompt prefilled locally (a Task without handoff)."""
        tokens = max(req.num_prompt_tokens - cached, 1)
        blocks = decode_blocks_needed(req.num_prompt_tokens, req.block_size)
        self.ledger.charge(req.request_id, runner, tokens, decode, blocks)
        submit = routed.submit
        handoff = decode.kv_addr if decode is not None and decode is not runner else None
        await self._send(runner.worker_id.encode(), Task(submit.request_id, submit.reply_to,
                                                          submit.job, handoff))
        await self._send(routed.gateway, Admitted(submit.request_id))
        self.requests[submit.request_id] = routed
        self._placements.labels(runner.worker_id).inc()
        self._queue_time.observe(self._clock() - routed.arrival)
        return True

    async def _drain_queue(self) -> None:
        for routed in list(self.queue.waiting()):
            if not await self._try_place(routed):
                break  # nobody overtakes the head of the queue (priority, then FCFS)
            self.queue.remove(routed)

    async def _refuse(self, routed: Routed, refusal: Refusal) -> None:
        self.requests.pop(routed.submit.request_id, None)
        self._rejections.labels(str(refusal.status)).inc()
        await self._send(routed.gateway, Rejected(routed.submit.request_id, refusal.status,
                                                  refusal.reason, refusal.retry_after))

    async def _worker_gone(self, worker: WorkerInfo) -> None:
        self.index.drop_worker(worker.worker_id)
        _remember(self._declared_dead, worker.worker_id, (worker.role, self._clock()), WORKERS_KEPT)
        for request_id in self.ledger.requests_on(worker.worker_id):
            routed = self.requests.pop(request_id, None)
            holders = self.ledger.release(request_id)
            if routed is None:
                continue
            await self._send(routed.gateway, Tokens(request_id, 0, 0, [], error=(
                f"worker {worker.worker_id} failed while serving the request"), retryable=True))
            for other in holders - {worker.worker_id}:
                await self._send(other.encode(), Abort(request_id, "peer failed"))

    # ---- metrics ------------------------------------------------------------------

    def _init_metrics(self) -> None:
        r = self._metrics_registry
        self._queue_len = Gauge("tandem:router_queue_length", "Requests waiting for a worker", registry=r)
        self._workers = Gauge("tandem:router_workers", "Live workers", ["role"], registry=r)
        self._draining = Gauge("tandem:router_workers_draining", "Workers shutting down (given "
                               "no new work)", ["role"], registry=r)
        self._in_flight = Gauge("tandem:router_requests_in_flight", "Requests placed or queued "
                                "and not yet finished", registry=r)
        self._charged = Gauge("tandem:router_ledger_charges", "The load ledger's open charges: "
                              "prompt tokens not yet prefilled, decode blocks reserved for KV "
                              "not yet arrived", ["kind"], registry=r)
        self._rejections = Counter("tandem:router_rejections", "Requests refused", ["status"], registry=r)
        self._placements = Counter("tandem:router_placements", "Requests placed", ["worker"], registry=r)
        self._prefill_choices = Counter(
            "tandem:router_prefill_choices", "Where disaggregated requests were prefilled, and why",
            ["where", "reason"], registry=r)
        self._costs = CostGauges(r)
        self._queue_time = Histogram("tandem:request_queue_time_seconds", "Time before placement",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self._index_blocks = Gauge("tandem:router_prefix_index_blocks",
                                   "Block hashes in the prefix index, over all workers", registry=r)
        handling = Histogram("tandem:router_message_seconds",
                             "Time to decode and handle one message, by message tag",
                             ["message"], buckets=MESSAGE_BUCKETS, registry=r)
        self._message_seconds = functools.cache(handling.labels)  # one child per tag

    def _update_gauges(self) -> None:
        self._queue_shown = len(self.queue)
        self._queue_len.set(self._queue_shown)
        self._index_blocks.set(self.index.total_blocks())
        for role in WorkerRole:
            self._workers.labels(role.value).set(
                sum(w.role is role for w in self.registry.workers.values()))
            self._draining.labels(role.value).set(
                sum(w.role is role for w in self.registry.draining_workers()))
        self._costs.update(self.registry.prefill_workers())
        self._in_flight.set(len(self.requests))
        workers = self.registry.workers.values()
        self._charged.labels("tokens").set(sum(w.outstanding_tokens for w in workers))
        self._charged.labels("blocks").set(sum(w.reserved_blocks for w in workers))

    def _health(self) -> ServiceHealth:
        reg = self.registry
        return ServiceHealth(True, {"status": "ok", "prefill_workers": len(reg.prefill_workers()),
                                    "decode_workers": len(reg.decode_workers()),
                                    "queue_length": len(self.queue)})

    def _ready(self) -> ServiceHealth:
        if not self._serving:
            return ServiceHealth(False, {"status": "not ready", "reason": "not serving"})
        return ServiceHealth(True, {"status": "ready", "address": self.address})
