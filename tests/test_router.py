"""Router: prefix index, placement policies, admission, registry, and the service end to end."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from dataclasses import replace

import pytest
import zmq
import zmq.asyncio

from common.hashing import hash_prefix_blocks
from common.protocol import (
    Abort,
    Admitted,
    Deregister,
    Finished,
    Heartbeat,
    KVEvents,
    Message,
    Ping,
    Queued,
    Register,
    Registered,
    Rejected,
    Reregister,
    Status,
    Submit,
    Task,
    Tokens,
    decode,
    encode,
)
from common.roles import WorkerRole
from common.sampling_params import SamplingParams
from services.router.admission import AdmissionQueue
from services.router.disagg import DisaggMode, DisaggRule
from services.router.policies import (
    PlacementRequest,
    decode_policy,
    place,
    prefill_policy,
    prefix_shortlist,
)
from services.router.prefix_index import PrefixIndex
from services.router.registry import Registry, WorkerInfo
from services.router.service import BEHIND_AT_MOST_S, RouterService, RouterSettings

BS = 4
PROMPT = list(range(100, 116))  # 16 tokens: four full blocks of BS
HASHES = hash_prefix_blocks(PROMPT, BS)


# ---- factories ------------------------------------------------------------------------

def worker(worker_id: str, role: str = "colocated", outstanding: int = 0, free: int = 100,
           num_blocks: int = 100, reserved: int = 0, waiting: int = 0, running: int = 0,
           max_model_len: int = 1024, last_seen: float = 0.0) -> WorkerInfo:
    return WorkerInfo(worker_id, WorkerRole(role), f"tcp://{worker_id}:7300", f"http://{worker_id}/metrics",
                      num_blocks, BS, max_model_len, last_seen, num_running=running,
                      num_waiting=waiting, free_blocks=free, outstanding_tokens=outstanding,
                      reserved_blocks=reserved)


def events(worker_id: str, stored=(), evicted=(), cleared: bool = False) -> KVEvents:
    return KVEvents(worker_id, list(stored), list(evicted), cleared)


def request(tokens: list[int] = PROMPT, request_id: str = "r") -> PlacementRequest:
    return PlacementRequest(request_id, len(tokens), hash_prefix_blocks(tokens, BS), BS)


def index_with(**held: int) -> PrefixIndex:
    """An index where each named worker holds the first ``n`` blocks of PROMPT."""
    index = PrefixIndex()
    for worker_id, n in held.items():
        index.apply(events(worker_id, stored=HASHES[:n]))
    return index


def register(worker_id: str, role: str = "colocated", num_blocks: int = 100,
             max_model_len: int = 1024) -> Register:
    kv_addr = None if role == "prefill" else f"tcp://{worker_id}:7300"
    return Register(worker_id, WorkerRole(role), kv_addr, f"http://{worker_id}/metrics",
                    num_blocks, BS, max_model_len, "tiny", heartbeat_interval=0.25)


def placed(steps, workers, req=None) -> str | None:
    chosen = asyncio.run(place(req or request(), workers, steps))
    return None if chosen is None else chosen.worker.worker_id


# ---- prefix index ---------------------------------------------------------------------

def test_matched_blocks_counts_only_the_leading_run():
    index = PrefixIndex()
    index.apply(events("a", stored=[HASHES[0], HASHES[2], HASHES[3]]))
    assert index.matched_blocks("a", HASHES) == 1
    index.apply(events("a", stored=[HASHES[1]]))
    assert index.matched_blocks("a", HASHES) == 4
    assert index.matched_blocks("a", HASHES[:2]) == 2
    assert index.matched_blocks("a", []) == 0
    assert index.matched_blocks("nobody", HASHES) == 0
    # a different first block: nothing matches, even though later blocks are held
    other = hash_prefix_blocks([7] + PROMPT[1:], BS)
    assert index.matched_blocks("a", other) == 0


def test_eviction_removes_blocks():
    index = index_with(a=4)
    index.apply(events("a", evicted=[HASHES[2]]))
    assert index.matched_blocks("a", HASHES) == 2
    assert index.num_blocks("a") == 3
    index.apply(events("a", evicted=[HASHES[0]]))
    assert index.matched_blocks("a", HASHES) == 0


def test_cleared_forgets_everything_before_the_stored_blocks_of_the_same_event():
    index = index_with(a=4)
    index.apply(events("a", cleared=True))
    assert index.num_blocks("a") == 0
    assert index.matched_blocks("a", HASHES) == 0
    index = index_with(a=4)
    index.apply(events("a", stored=HASHES[:1], cleared=True))
    assert index.num_blocks("a") == 1
    assert index.matched_blocks("a", HASHES) == 1


def test_drop_worker_only_drops_that_worker():
    index = index_with(a=3, b=2)
    index.drop_worker("a")
    index.drop_worker("never-seen")
    assert index.matched_blocks("a", HASHES) == 0
    assert index.num_blocks("a") == 0
    assert index.matched_blocks("b", HASHES) == 2


def test_matches_asked_again_sees_every_change_in_between():
    index = index_with(a=2)
    assert index.matches(HASHES) == {"a": 2}
    assert index.matches(HASHES) == {"a": 2}  # the same question, answered again
    index.apply(events("b", stored=HASHES[:3]))
    assert index.matches(HASHES) == {"a": 2, "b": 3}
    index.drop_worker("a")
    assert index.matches(HASHES) == {"b": 3}
    assert index.matches(HASHES[:1]) == {"b": 1}


# ---- prefill policies -----------------------------------------------------------------

def test_prefix_policy_picks_the_longest_cached_prefix():
    index = index_with(a=1, b=3, c=0)
    steps = prefill_policy("prefix", index, token_budget=1000)
    workers = [worker("a"), worker("b"), worker("c")]
    chosen = asyncio.run(place(request(), workers, steps))
    assert chosen.worker.worker_id == "b"
    assert chosen.cached_tokens == 3 * BS
    assert chosen.score == 3 * BS


def test_the_prefix_shortlist_picks_exactly_what_the_steps_over_every_worker_pick():
    """Many workers: the steps run over the prefix holders and the least loaded other only.
    Random fleets (ties in load, the least loaded holding the prefix, holders that are no
    candidates, budgets every worker fails) must give the same worker, score and cached
    tokens as the steps over all of them."""
    rng = random.Random(7)
    shortcuts = 0
    for case in range(600):
        ids = [f"w{i}" for i in range(rng.randrange(16, 40))]
        workers = [worker(w, outstanding=rng.choice([0, 0, 4, 12, 50, 200, 1000, 5000])) for w in ids]
        index = PrefixIndex()
        for holder in rng.sample(ids, rng.randrange(0, 6)) + ["decode-only"] * rng.randrange(2):
            index.apply(events(holder, stored=HASHES[:rng.randrange(1, 5)]))
        prompt = PROMPT[:rng.randrange(1, 17)] if rng.random() < 0.8 else [7] + PROMPT[1:]
        steps = prefill_policy("prefix", index, token_budget=rng.choice([8, 20, 100, 1000, 8192]),
                               load_weight=rng.choice([0.25, 1.0, 3.0]))
        rows = {w.worker_id: i for i, w in enumerate(workers)}
        shortlist = prefix_shortlist(index, rows.get)
        req = request(prompt, f"r{case}")
        shortcuts += len(shortlist(req, workers)) < len(workers)
        want = asyncio.run(place(req, workers, steps))
        got = asyncio.run(place(req, workers, steps, shortlist))
        assert (got is None) == (want is None), case
        if want is not None:
            assert (got.worker, got.score, got.cached_tokens) == (want.worker, want.score, want.cached_tokens), case
    assert shortcuts > 500  # the short way was taken, not the fallback to every worker


def test_the_prefix_shortlist_takes_no_shortcut_with_few_workers_or_a_foreign_list():
    index = index_with(b=2)
    workers = [worker(f"w{i}", outstanding=i) for i in range(20)] + [worker("b", outstanding=9)]
    rows = {w.worker_id: i for i, w in enumerate(workers)}
    shortlist = prefix_shortlist(index, rows.get)
    assert [w.worker_id for w in shortlist(request(), workers)] == ["w0", "b"]
    assert shortlist(request(), workers[:10]) == workers[:10]  # too few to bother
    reordered = workers[::-1]  # not the list the positions index
    assert shortlist(request(), reordered) == reordered


def test_prefix_policy_cached_tokens_never_exceed_the_prompt():
    index = index_with(a=4)
    chosen = asyncio.run(place(request(), [worker("a")], prefill_policy("prefix", index, 1000)))
    assert chosen.cached_tokens == len(PROMPT)


@pytest.mark.parametrize(("load_weight", "outstanding", "expected"), [
    (1.0, 11, "hot"),  # 12 cached - 11 queued > 0: the prefix still wins
    (1.0, 13, "idle"),  # 12 - 13 < 0: past cached/load_weight, the idle worker wins
    (2.0, 5, "hot"),  # 12 - 10 > 0
    (2.0, 7, "idle"),  # 12 - 14 < 0
])
def test_a_hot_prefix_does_not_pile_up(load_weight, outstanding, expected):
    index = index_with(hot=3)
    steps = prefill_policy("prefix", index, token_budget=1000, load_weight=load_weight)
    workers = [worker("hot", outstanding=outstanding), worker("idle")]
    assert placed(steps, workers) == expected


def test_token_budget_filters_busy_workers():
    steps = prefill_policy("prefix", PrefixIndex(), token_budget=100)
    req = request()  # 16 tokens
    assert placed(steps, [worker("busy", outstanding=85), worker("ok", outstanding=84)], req) == "ok"
    assert placed(steps, [worker("busy", outstanding=85)], req) is None
    # exactly at the budget still fits
    assert placed(steps, [worker("full", outstanding=84)], req) == "full"


def test_token_budget_counts_only_uncached_tokens():
    index = index_with(a=3)  # 12 of the 16 tokens are cached on a
    steps = prefill_policy("prefix", index, token_budget=100)
    assert placed(steps, [worker("a", outstanding=96)]) == "a"  # 96 + 16 - 12 = 100
    assert placed(steps, [worker("a", outstanding=97)]) is None


def test_an_idle_worker_always_qualifies_even_for_a_prompt_over_the_budget():
    long_prompt = list(range(1000, 1500))
    for policy in ("prefix", "round_robin", "least_loaded"):
        steps = prefill_policy(policy, PrefixIndex(), token_budget=100)
        workers = [worker("busy", outstanding=1), worker("idle")]
        assert placed(steps, workers, request(long_prompt)) == "idle", policy


def test_ties_go_to_the_first_candidate():
    for policy in ("prefix", "least_loaded"):
        steps = prefill_policy(policy, PrefixIndex(), token_budget=1000)
        assert placed(steps, [worker("b"), worker("a"), worker("c")]) == "b"
        assert placed(steps, [worker("c"), worker("a"), worker("b")]) == "c"
    index = index_with(b=2, a=2)
    steps = prefill_policy("prefix", index, token_budget=1000)
    assert placed(steps, [worker("b"), worker("a")]) == "b"
    assert placed(steps, [worker("a"), worker("b")]) == "a"


def test_round_robin_cycles_in_sorted_id_order_and_ignores_the_cache():
    index = index_with(c=4)  # would attract everything under the prefix policy
    steps = prefill_policy("round_robin", index, token_budget=1000)
    workers = [worker("c"), worker("a"), worker("b")]
    picks = [placed(steps, workers) for _ in range(7)]
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]
    # load is ignored too
    steps = prefill_policy("round_robin", index, token_budget=1000)
    workers = [worker("a", outstanding=500, running=9), worker("b")]
    assert [placed(steps, workers) for _ in range(4)] == ["a", "b", "a", "b"]


def test_each_round_robin_policy_has_its_own_turn():
    first = prefill_policy("round_robin", PrefixIndex(), token_budget=1000)
    second = prefill_policy("round_robin", PrefixIndex(), token_budget=1000)
    workers = [worker("a"), worker("b")]
    assert placed(first, workers) == "a"
    assert placed(first, workers) == "b"
    assert placed(second, workers) == "a"


def test_least_loaded_picks_the_lowest_outstanding_plus_waiting_plus_running():
    steps = prefill_policy("least_loaded", index_with(a=4), token_budget=1000)
    workers = [
        worker("a", outstanding=10),  # 10 (and the whole prompt cached: ignored)
        worker("b", waiting=3, running=4),  # 7
        worker("c", outstanding=2, running=6),  # 8
    ]
    chosen = asyncio.run(place(request(), workers, steps))
    assert chosen.worker.worker_id == "b"
    assert chosen.score == -7
    workers.append(worker("d", running=6))
    assert placed(steps, workers) == "d"


def test_unknown_policy_is_a_value_error():
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        prefill_policy("fastest", PrefixIndex(), 1000)


# ---- decode placement -----------------------------------------------------------------

def test_decode_placement_needs_room_for_the_prompt_plus_one_block():
    steps = decode_policy()
    req = request()  # 16 tokens = 4 blocks, + 1 for the next token = 5
    assert placed(steps, [worker("d", role="decode", free=4)], req) is None
    assert placed(steps, [worker("d", role="decode", free=5)], req) == "d"
    # reserved blocks are promised to handoffs in flight: not available
    assert placed(steps, [worker("d", role="decode", free=10, reserved=6)], req) is None
    assert placed(steps, [worker("d", role="decode", free=10, reserved=5)], req) == "d"
    # a partial block rounds up: 17 tokens need 5 + 1
    assert placed(steps, [worker("d", role="decode", free=5)], request(PROMPT + [1])) is None
    assert placed(steps, [worker("d", role="decode", free=6)], request(PROMPT + [1])) == "d"


def test_decode_placement_prefers_the_most_free_fraction():
    steps = decode_policy()
    workers = [
        worker("big", role="decode", num_blocks=1000, free=500),  # 0.5
        worker("small", role="decode", num_blocks=10, free=8),  # 0.8
        worker("reserved", role="decode", num_blocks=100, free=100, reserved=30),  # 0.7
    ]
    chosen = asyncio.run(place(request(), workers, steps))
    assert chosen.worker.worker_id == "small"
    assert chosen.score == pytest.approx(0.8)
    workers[2].reserved_blocks = 10  # now 0.9
    assert placed(steps, workers) == "reserved"


def _by_the_rules(workers: list[WorkerInfo], req: PlacementRequest, index: PrefixIndex,
                  budget: int, load_weight: float, decode: bool) -> str | None:
    """The policies' rules, one worker at a time in plain loops (the oracle of ``place``)."""
    best, best_score = None, None
    scored = []
    for w in workers:
        if decode:
            if w.free_blocks - w.reserved_blocks < -(-req.num_prompt_tokens // req.block_size) + 1:
                continue
            scored.append((w, (w.free_blocks - w.reserved_blocks) / w.num_blocks))
        else:
            cached = min(index.matched_blocks(w.worker_id, req.block_hashes) * req.block_size,
                         req.num_prompt_tokens)
            if w.outstanding_tokens and w.outstanding_tokens + req.num_prompt_tokens - cached > budget:
                continue
            scored.append((w, cached - load_weight * w.outstanding_tokens))
    slowest = max((w.step_seconds or 0.0 for w, _ in scored), default=0.0)
    for w, score in scored:
        if decode and slowest > 0:
            score -= (w.step_seconds or 0.0) / slowest
        if best_score is None or score > best_score:
            best, best_score = w.worker_id, score
    return best


@pytest.mark.parametrize("decode", [False, True])
def test_placement_among_many_workers_follows_the_rules(decode: bool):
    # Many workers in random states: ``place`` (columns) picks what the rules pick.
    rng = random.Random(7)
    prompts = [list(range(100 + 4 * g, 116 + 4 * g)) for g in range(6)]
    for case in range(150):
        index = PrefixIndex()
        workers = []
        for i in range(rng.randrange(1, 40)):
            w = worker(f"w{i:02d}", role="decode" if decode else "prefill",
                       outstanding=rng.choice([0, 0, 4, 8, 30, 90, 200]),
                       num_blocks=rng.choice([50, 100]), free=rng.randrange(0, 50),
                       reserved=rng.randrange(0, 8))
            w.step_seconds = rng.choice([None, 0.01, 0.02, 0.05])
            workers.append(w)
            held = prompts[rng.randrange(len(prompts))]
            index.apply(events(w.worker_id, hash_prefix_blocks(held, BS)[: rng.randrange(0, 5)]))
        req = request(prompts[rng.randrange(len(prompts))] + [rng.randrange(99)] * rng.randrange(0, 9))
        budget, load_weight = rng.choice([40, 100, 1000]), rng.choice([0.0, 0.5, 1.0, 2.0])
        steps = decode_policy() if decode else prefill_policy("prefix", index, budget, load_weight)
        want = _by_the_rules(workers, req, index, budget, load_weight, decode)
        assert placed(steps, workers, req) == want, case


# ---- admission ------------------------------------------------------------------------

def test_admission_queue_is_fcfs():
    q: AdmissionQueue[str] = AdmissionQueue(max_queue=3, timeout=10.0)
    for i, item in enumerate(["a", "b", "c"]):
        assert q.offer(item, now=float(i)) is None
    assert len(q) == 3
    assert list(q.waiting()) == ["a", "b", "c"]


def test_admission_queue_refuses_when_full():
    q: AdmissionQueue[str] = AdmissionQueue(max_queue=2, timeout=10.0)
    assert q.offer("a", 0.0) is None
    assert q.offer("b", 0.0) is None
    refusal = q.offer("c", 0.0)
    assert refusal is not None
    assert refusal.status == 429
    assert refusal.retry_after == 1.0
    assert "2 requests already queued" in refusal.reason
    assert list(q.waiting()) == ["a", "b"]
    assert AdmissionQueue(max_queue=0, timeout=1.0).offer("x", 0.0).status == 429
    with pytest.raises(ValueError):
        AdmissionQueue(max_queue=-1, timeout=1.0)


def test_admission_queue_expires_after_the_timeout():
    q: AdmissionQueue[str] = AdmissionQueue(max_queue=10, timeout=10.0)
    q.offer("a", now=100.0)
    q.offer("b", now=105.0)
    assert q.expired(now=110.0) == []  # exactly the timeout: not yet
    assert q.expired(now=110.5) == ["a"]
    assert list(q.waiting()) == ["b"]
    assert q.expired(now=115.0) == []
    assert q.expired(now=200.0) == ["b"]
    assert len(q) == 0
    refusal = q.refusal_for_timeout()
    assert refusal.status == 503 and refusal.retry_after == 2.0


def test_admission_queue_remove():
    q: AdmissionQueue[str] = AdmissionQueue(max_queue=10, timeout=10.0)
    for i, item in enumerate(["a", "b", "c"]):
        q.offer(item, float(i))
    assert q.remove("b") is True
    assert q.remove("b") is False
    assert q.remove("zzz") is False
    assert list(q.waiting()) == ["a", "c"]
    assert q.expired(now=100.0) == ["a", "c"]


def test_admission_queue_remove_ignores_an_equal_item_that_is_not_queued():
    q: AdmissionQueue[list] = AdmissionQueue(max_queue=10, timeout=10.0)
    a = ["x"]
    q.offer(a, 0.0)
    assert q.remove(["x"]) is False
    assert list(q.waiting()) == [a]


def test_admission_queue_remove_takes_out_the_very_item_given():
    q: AdmissionQueue[list] = AdmissionQueue(max_queue=10, timeout=10.0)
    a, b = ["x"], ["x"]  # equal, not identical, queued at the same time
    q.offer(a, 0.0)
    q.offer(b, 0.0)
    assert q.remove(b) is True
    assert [item is a for item in q.waiting()] == [True]


# ---- registry -------------------------------------------------------------------------

def test_registry_register_heartbeat_expire():
    reg = Registry(heartbeat_timeout=5.0)
    info = reg.register(register("w1", "decode", num_blocks=64), now=0.0)
    assert info.last_seen == 0.0 and info.free_blocks == 64 and info.num_blocks == 64
    assert info.can_decode and not info.can_prefill
    reg.register(register("w2", "prefill"), now=0.0)

    assert reg.heartbeat(Heartbeat("ghost", 1, 1, 1, 1), now=1.0) is None
    assert "ghost" not in reg.workers
    hb = reg.heartbeat(Heartbeat("w1", 2, 3, 40, 64), now=3.0)
    assert hb is info
    assert (info.num_running, info.num_waiting, info.free_blocks, info.last_seen) == (2, 3, 40, 3.0)

    assert reg.expire(now=5.0) == []  # w2 silent for exactly the timeout
    assert [w.worker_id for w in reg.expire(now=5.5)] == ["w2"]
    assert reg.expire(now=8.0) == []  # w1 was seen at 3.0
    assert [w.worker_id for w in reg.expire(now=8.1)] == ["w1"]
    assert reg.workers == {}


def test_registry_reregister_starts_a_fresh_record():
    reg = Registry(heartbeat_timeout=5.0)
    old = reg.register(register("w"), now=0.0)
    old.outstanding_tokens, old.reserved_blocks = 50, 3
    new = reg.register(register("w"), now=1.0)
    assert new is not old and reg.workers["w"] is new
    assert (new.outstanding_tokens, new.reserved_blocks) == (0, 0)
    assert reg.remove("w") is new
    assert reg.remove("w") is None


def test_registry_roles():
    reg = Registry(heartbeat_timeout=5.0)
    for worker_id, role in [("p", "prefill"), ("d", "decode"), ("c", "colocated")]:
        reg.register(register(worker_id, role), now=0.0)
    assert sorted(w.worker_id for w in reg.prefill_workers()) == ["c", "p"]
    assert sorted(w.worker_id for w in reg.decode_workers()) == ["c", "d"]


def test_registry_max_model_len_is_the_minimum():
    reg = Registry(heartbeat_timeout=5.0)
    assert reg.max_model_len() is None
    reg.register(register("a", max_model_len=4096), now=0.0)
    assert reg.max_model_len() == 4096
    reg.register(register("b", "decode", max_model_len=2048), now=0.0)
    reg.register(register("c", "prefill", max_model_len=8192), now=0.0)
    assert reg.max_model_len() == 2048
    reg.remove("b")
    assert reg.max_model_len() == 4096


# ---- the service, in process ----------------------------------------------------------

TIMEOUT = 5.0


class Peer:
    """A DEALER playing a gateway or a worker (identity = worker id)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, identity: str | None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.connect(address)
        self.id = identity

    async def send(self, msg: Message) -> None:
        await self.sock.send(encode(msg))

    async def recv(self) -> Message:
        return decode(await asyncio.wait_for(self.sock.recv(), timeout=TIMEOUT))

    async def expect(self, kind: type[Message]) -> Message:
        msg = await self.recv()
        assert isinstance(msg, kind), msg
        return msg


class Cluster:
    def __init__(self, service: RouterService, ctx: zmq.asyncio.Context) -> None:
        self.service = service
        self._ctx = ctx
        self._nonce = itertools.count(1)
        self.peers: list[Peer] = []
        self.task: asyncio.Task | None = None  # the router's run()

    def peer(self, identity: str | None = None) -> Peer:
        p = Peer(self._ctx, self.service.address, identity)
        self.peers.append(p)
        return p

    async def gateway(self) -> Peer:
        gw = self.peer()
        await self.status(gw)  # connected and heard
        return gw

    async def status(self, peer: Peer) -> Status:
        nonce = next(self._nonce)
        await peer.send(Ping(nonce))
        status = await peer.expect(Status)
        assert status.nonce == nonce
        return status

    async def assert_quiet(self, peer: Peer) -> None:
        """Nothing was sent to ``peer`` so far: a Ping from it now must be answered before
        anything else reaches it, since the router's messages to one peer arrive in order
        (``status`` fails on any other message first)."""
        await self.status(peer)

    async def worker(self, worker_id: str, role: str = "colocated", **kw) -> Peer:
        """Register a worker: the router answers ``Registered``, then a Ping on the same
        socket is answered after whatever the registration set off."""
        w = self.peer(worker_id)
        await w.send(register(worker_id, role, **kw))
        assert await w.expect(Registered) == Registered(worker_id)
        await self.status(w)
        return w


@contextlib.asynccontextmanager
async def router(**overrides):
    # The classic P/D path unless a test says otherwise: these tests are about it (the
    # per-request choice has its own tests in test_router_disagg.py).
    settings = dict(bind="tcp://127.0.0.1:0", metrics_port=0, heartbeat_timeout=60.0, startup_grace=0.0,
                    disagg=DisaggRule(DisaggMode.ALWAYS))
    settings.update(overrides)
    clock = settings.pop("clock", time.monotonic)
    service = RouterService(RouterSettings(**settings), clock=clock)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    ctx = zmq.asyncio.Context()
    cluster = Cluster(service, ctx)
    cluster.task = task
    try:
        yield cluster
    finally:
        for p in cluster.peers:
            p.sock.close(linger=0)
        ctx.term()
        stop.set()
        await asyncio.wait_for(task, timeout=TIMEOUT)  # re-raises if the router crashed


def serve(**overrides):
    """Run ``body(cluster)`` against a fresh router."""

    def wrap(body):
        def test():
            async def main():
                async with router(**overrides) as cluster:
                    await body(cluster)

            asyncio.run(main())

        test.__name__ = body.__name__
        return test

    return wrap


def submit(request_id: str, tokens: list[int] = PROMPT) -> Submit:
    return Submit.of(request_id, tokens, SamplingParams(max_tokens=8), "tcp://gateway:7201")


@serve()
async def test_submit_without_workers_is_rejected_503(c: Cluster):
    gw = await c.gateway()
    await gw.send(submit("r1"))
    msg = await gw.expect(Rejected)
    assert (msg.request_id, msg.status) == ("r1", 503)
    assert msg.retry_after == 2.0
    assert c.service.requests == {}


@serve()
async def test_colocated_worker_gets_the_task_and_the_gateway_is_admitted(c: Cluster):
    w = await c.worker("w1")
    gw = await c.gateway()
    await gw.send(submit("r1"))
    task = await w.expect(Task)
    assert task == Task.of("r1", PROMPT, SamplingParams(max_tokens=8), "tcp://gateway:7201", None)
    assert await gw.expect(Admitted) == Admitted("r1")
    info = c.service.registry.workers["w1"]
    assert info.outstanding_tokens == len(PROMPT)
    assert c.service.ledger.requests_on("w1") == ["r1"]

    await w.send(Finished("r1", "w1", "request"))
    await c.status(w)  # the Finished before it has been handled
    assert info.outstanding_tokens == 0
    assert c.service.ledger.requests_on("w1") == []
    assert c.service.requests == {}


@serve()
async def test_duplicate_request_id_is_rejected_400(c: Cluster):
    w = await c.worker("w1")
    gw, other = await c.gateway(), await c.gateway()
    await gw.send(submit("r1"))
    await w.expect(Task)
    await gw.expect(Admitted)
    await other.send(submit("r1"))
    msg = await other.expect(Rejected)
    assert (msg.request_id, msg.status) == ("r1", 400)


@serve(token_budget=4)
async def test_a_resent_submit_is_answered_with_the_requests_state(c: Cluster):
    """The gateway sends a Submit again when its acknowledgement is late (it may have been
    lost with a dying router): the router answers with where the request stands and does
    not place it twice."""
    w = await c.worker("w1")
    gw = await c.gateway()
    await gw.send(submit("r1"))
    await w.expect(Task)
    await gw.expect(Admitted)
    await gw.send(submit("r2"))  # over budget: queued
    assert await gw.expect(Queued) == Queued("r2")
    await gw.send(submit("r1"))
    await gw.send(submit("r2"))
    assert [await gw.expect(Message) for _ in "12"] == [Admitted("r1"), Queued("r2")]
    assert (await c.status(gw)).queue_length == 1
    await c.assert_quiet(w)  # no second Task


@serve()
async def test_a_resend_that_arrives_after_its_request_ended_is_not_placed_again(c: Cluster):
    """The gateway resends a Submit while it waits for the verdict; one that arrives after
    the request already ran to its end is answered Admitted, not run a second time. From
    another gateway the id is simply new."""
    w = await c.worker("w1")
    gw, other = await c.gateway(), await c.gateway()
    await gw.send(submit("r1"))
    await w.expect(Task)
    await gw.expect(Admitted)
    await w.send(Finished("r1", "w1", "request"))
    await c.status(w)  # the Finished handled
    assert c.service.requests == {}
    await gw.send(submit("r1"))
    assert await gw.expect(Admitted) == Admitted("r1")
    await c.assert_quiet(w)  # no second Task
    await other.send(submit("r1"))
    assert (await w.expect(Task)).request_id == "r1"


@serve()
async def test_prompt_at_the_model_limit_is_rejected_400(c: Cluster):
    await c.worker("w1", max_model_len=16)
    gw = await c.gateway()
    await gw.send(submit("r1", PROMPT))  # 16 tokens leave no room for an output token
    msg = await gw.expect(Rejected)
    assert (msg.request_id, msg.status) == ("r1", 400)
    assert "maximum context length is 16 tokens" in msg.reason


@serve()
async def test_prefill_and_decode_task_carries_the_handoff(c: Cluster):
    p = await c.worker("p1", "prefill")
    d = await c.worker("d1", "decode", num_blocks=50)
    gw = await c.gateway()
    await gw.send(submit("r1"))
    task = await p.expect(Task)
    assert (task.request_id, task.handoff_addr) == ("r1", "tcp://d1:7300")
    await gw.expect(Admitted)
    await c.assert_quiet(d)  # the decode worker hears from the prefill worker, not us
    reg = c.service.registry.workers
    assert reg["d1"].reserved_blocks == len(PROMPT) // BS + 1
    assert reg["p1"].outstanding_tokens == len(PROMPT)

    await p.send(Finished("r1", "p1", "prefill"))
    await c.status(p)
    assert reg["d1"].reserved_blocks == 0
    assert reg["p1"].outstanding_tokens == 0
    ledger = c.service.ledger
    assert ledger.requests_on("p1") == [] and ledger.requests_on("d1") == ["r1"]

    await d.send(Finished("r1", "d1", "request"))
    await c.status(d)
    assert ledger.requests_on("d1") == []
    assert c.service.requests == {}


@serve()
async def test_prefill_worker_without_a_decode_worker_queues(c: Cluster):
    p = await c.worker("p1", "prefill")
    gw = await c.gateway()
    await gw.send(submit("r1"))
    assert await gw.expect(Queued) == Queued("r1")
    assert (await c.status(gw)).queue_length == 1
    d = await c.worker("d1", "decode")  # registering drains the queue
    task = await p.expect(Task)
    assert task.handoff_addr == "tcp://d1:7300"
    await gw.expect(Admitted)
    await c.assert_quiet(d)


@serve(max_queue=1, token_budget=4)
async def test_queue_then_429_then_placement_when_prefill_finishes(c: Cluster):
    w = await c.worker("w1")
    gw = await c.gateway()
    await gw.send(submit("r1"))  # the idle worker takes it despite the tiny budget
    assert (await w.expect(Task)).request_id == "r1"
    await gw.expect(Admitted)

    await gw.send(submit("r2"))  # over budget: queued
    assert await gw.expect(Queued) == Queued("r2")
    await gw.send(submit("r3"))  # the queue is full
    msg = await gw.expect(Rejected)
    assert (msg.request_id, msg.status, msg.retry_after) == ("r3", 429, 1.0)
    assert (await c.status(gw)).queue_length == 1
    await c.assert_quiet(w)

    await w.send(Finished("r1", "w1", "prefill"))
    assert (await w.expect(Task)).request_id == "r2"
    assert await gw.expect(Admitted) == Admitted("r2")
    assert (await c.status(gw)).queue_length == 0


@serve(max_queue=4, token_budget=4)
async def test_abort_of_a_queued_request_takes_it_out_of_the_queue(c: Cluster):
    w = await c.worker("w1")
    gw = await c.gateway()
    await gw.send(submit("r1"))
    await w.expect(Task)
    await gw.expect(Admitted)
    await gw.send(submit("r2"))
    await gw.send(submit("r3"))
    assert [await gw.expect(Queued) for _ in "23"] == [Queued("r2"), Queued("r3")]
    await gw.send(Abort("r2"))
    assert (await c.status(gw)).queue_length == 1
    await w.send(Finished("r1", "w1", "request"))
    assert (await w.expect(Task)).request_id == "r3"  # r2 never reaches the worker
    assert await gw.expect(Admitted) == Admitted("r3")


@serve()
async def test_abort_is_forwarded_to_the_colocated_worker(c: Cluster):
    w = await c.worker("w1")
    gw = await c.gateway()
    await gw.send(submit("r1"))
    await w.expect(Task)
    await gw.expect(Admitted)
    await gw.send(Abort("r1"))
    assert await w.expect(Abort) == Abort("r1", "client")
    await c.status(gw)
    assert c.service.requests == {}
    assert c.service.registry.workers["w1"].outstanding_tokens == 0


@serve()
async def test_abort_is_forwarded_to_both_prefill_and_decode_workers(c: Cluster):
    p = await c.worker("p1", "prefill")
    d = await c.worker("d1", "decode")
    gw = await c.gateway()
    await gw.send(submit("r1"))
    await p.expect(Task)
    await gw.expect(Admitted)
    await gw.send(Abort("r1"))
    assert await p.expect(Abort) == Abort("r1", "client")
    assert await d.expect(Abort) == Abort("r1", "client")
    await c.status(gw)
    assert c.service.registry.workers["d1"].reserved_blocks == 0


async def placed_on_prefill_and_decode(c: Cluster) -> tuple[Peer, Peer]:
    """A prefill and a decode worker, and r1 placed on them (the gateway admitted)."""
    p = await c.worker("p1", "prefill")
    d = await c.worker("d1", "decode")
    gw = await c.gateway()
    await gw.send(submit("r1"))
    await p.expect(Task)
    await gw.expect(Admitted)
    return p, d


@serve()
async def test_failed_prefill_aborts_the_decode_side(c: Cluster):
    p, d = await placed_on_prefill_and_decode(c)
    await p.send(Finished("r1", "p1", "prefill", error="out of memory"))
    assert await d.expect(Abort) == Abort("r1", "peer failed")
    await c.status(p)
    assert c.service.requests == {}


@serve()
async def test_a_decode_side_failure_aborts_the_prefill_side(c: Cluster):
    p, d = await placed_on_prefill_and_decode(c)
    await d.send(Finished("r1", "d1", "request", error="bad KV handoff"))
    assert await p.expect(Abort) == Abort("r1", "peer failed")
    await c.assert_quiet(d)  # the failing side is not told again
    assert c.service.requests == {} and c.service.ledger.requests_on("p1") == []
    assert c.service.registry.workers["p1"].outstanding_tokens == 0
    assert c.service.registry.workers["d1"].reserved_blocks == 0


@serve()
async def test_a_worker_that_reregisters_brings_its_cache_into_the_index(c: Cluster):
    w = c.peer("w1")
    await w.send(replace(register("w1"), cached_blocks=HASHES[:3]))
    await w.expect(Registered)
    assert c.service.index.matched_blocks("w1", HASHES) == 3


class ManualClock:
    """The router's clock: time moves only when the test moves it, however loaded the
    machine is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def test_a_silent_worker_fails_its_requests_back_to_the_gateway(clock):
    @serve(heartbeat_timeout=5.0, clock=clock.monotonic)
    async def body(c: Cluster):
        w = await c.worker("w1")
        gw = await c.gateway()
        await gw.send(submit("r1"))
        await w.expect(Task)
        await gw.expect(Admitted)
        assert (await c.status(gw)).prefill_workers == 1  # no time has passed: still there
        clock.now += 5.5  # past the timeout, without a heartbeat
        msg = await gw.expect(Tokens)  # from the next maintenance pass
        assert msg.request_id == "r1"
        assert msg.error and "w1" in msg.error
        assert msg.token_ids == []
        status = await c.status(gw)
        assert (status.prefill_workers, status.decode_workers) == (0, 0)
        assert c.service.requests == {}
        await w.send(Heartbeat("w1", 1, 0, 90, 100))  # alive after all: its work is gone
        assert await w.expect(Reregister) == Reregister("w1", lost_work=True)

    body()


def test_a_burst_of_heartbeats_from_an_unknown_worker_gets_one_reregister(clock):
    """A restarted router reads at once the heartbeats a worker sent while it was down:
    one Reregister for all of them (each Register after the first would read as the
    worker restarting and fail its requests); another once a second has passed unheard."""
    @serve(clock=clock.monotonic)
    async def body(c: Cluster):
        w = c.peer("w9")
        for _ in range(4):
            await w.send(Heartbeat("w9", 0, 0, 100, 100))
        assert await w.expect(Reregister) == Reregister("w9", lost_work=False)
        await c.assert_quiet(w)
        clock.now += 1.0
        await w.send(Heartbeat("w9", 0, 0, 100, 100))
        assert await w.expect(Reregister) == Reregister("w9", lost_work=False)

    body()


def test_a_heartbeat_keeps_a_worker_past_the_timeout(clock):
    @serve(heartbeat_timeout=5.0, queue_timeout=6.0, clock=clock.monotonic)
    async def body(c: Cluster):
        p = await c.worker("p1", "prefill")
        gw = await c.gateway()
        await gw.send(submit("r0"))  # no decode worker: it waits in the queue
        assert await gw.expect(Queued) == Queued("r0")
        assert (await c.status(gw)).queue_length == 1
        clock.now += 4.0
        await p.send(Heartbeat("p1", 0, 0, 100, 100))
        await c.status(p)  # the heartbeat has been handled
        clock.now += 4.0  # 8 s after registering, 4 s after the heartbeat
        # The queued request times out in the same maintenance pass that checks heartbeats:
        # its refusal proves that pass ran with the new time.
        assert (await gw.expect(Rejected)).request_id == "r0"
        assert (await c.status(gw)).prefill_workers == 1

    body()


def test_heartbeats_still_unread_are_not_silence(clock):
    """A router behind on its socket (overloaded) measures silence up to when it last had
    read everything, not up to now: it used to declare live workers dead by the hundred
    while their heartbeats waited in its queue. Never more than ``BEHIND_AT_MOST_S`` back,
    so a router that stays behind still finds the dead."""
    async def main():
        service = RouterService(RouterSettings(bind="tcp://127.0.0.1:0", metrics_port=0,
                                               heartbeat_timeout=5.0, startup_grace=0.0),
                                clock=clock.monotonic)
        ctx = zmq.asyncio.Context()
        w1, w2 = Peer(ctx, service.address, "w1"), Peer(ctx, service.address, "w2")

        async def read_waiting() -> None:  # what the router's loop does when its poll wakes
            assert await service.sock.poll(TIMEOUT * 1000)
            await service._handle_waiting()

        def alive() -> set[str]:
            return set(service.registry.workers)

        try:
            for w in (w1, w2):
                await w.send(register(w.id))
                await read_waiting()
                assert await w.expect(Registered) == Registered(w.id)
            await w1.send(Heartbeat("w1", 0, 0, 100, 100))  # left unread: the router is busy
            clock.now += 6.0
            await service._maintain_once()
            assert alive() == {"w1", "w2"}  # 6 s by the clock, but the router is behind
            await read_waiting()  # caught up: w1's beat is read, and w2 has sent nothing
            await service._maintain_once()
            assert alive() == {"w1"}
            await w1.send(Heartbeat("w1", 0, 0, 100, 100))  # unread again ...
            clock.now += BEHIND_AT_MOST_S + 4.0
            await service._maintain_once()
            assert alive() == {"w1"}  # judged as of 30 s ago: 4 s after its beat was read
            clock.now += 2.0
            await service._maintain_once()
            assert alive() == set()  # ... and now 6 s: behind for too long, it is dead
        finally:
            for w in (w1, w2):
                w.sock.close(linger=0)
            ctx.term()
            service.sock.close(linger=0)
            service._ctx.term()

    asyncio.run(main())


@serve()
async def test_a_heartbeat_from_an_unknown_worker_asks_it_to_register(c: Cluster):
    w = c.peer("w9")
    await w.send(Heartbeat("w9", 0, 0, 100, 100))
    # Never declared dead here: this router is new (restarted), so the worker keeps its work.
    assert await w.expect(Reregister) == Reregister("w9", lost_work=False)
    assert "w9" not in c.service.registry.workers


@serve()
async def test_reregistering_worker_fails_what_it_held(c: Cluster):
    w = await c.worker("w1")
    gw = await c.gateway()
    await gw.send(submit("r1"))
    await w.expect(Task)
    await gw.expect(Admitted)
    await w.send(register("w1"))  # it restarted
    msg = await gw.expect(Tokens)
    assert msg.request_id == "r1" and msg.error


@serve()
async def test_ping_reports_worker_counts(c: Cluster):
    gw = await c.gateway()
    status = await c.status(gw)
    assert (status.prefill_workers, status.decode_workers) == (0, 0)
    assert (status.queue_length, status.max_model_len, status.block_size) == (0, None, None)
    await c.worker("p1", "prefill", max_model_len=4096)
    await c.worker("d1", "decode", max_model_len=2048)
    await c.worker("d2", "decode", max_model_len=8192)
    await c.worker("c1", "colocated", max_model_len=3072)
    status = await c.status(gw)
    assert (status.prefill_workers, status.decode_workers) == (2, 3)
    assert (status.queue_length, status.max_model_len, status.block_size) == (0, 2048, BS)


@serve()
async def test_prefix_routing_follows_kv_events(c: Cluster):
    a = await c.worker("a")
    b = await c.worker("b")
    await b.send(KVEvents("b", stored=HASHES[:3]))
    await c.status(b)
    gw = await c.gateway()
    await gw.send(submit("r1"))
    assert (await b.expect(Task)).request_id == "r1"
    await gw.expect(Admitted)
    assert c.service.registry.workers["b"].outstanding_tokens == len(PROMPT) - 3 * BS
    await c.assert_quiet(a)


@serve()
async def test_bad_frames_are_dropped_and_the_router_keeps_serving(c: Cluster):
    gw = await c.gateway()
    await gw.sock.send(b"\xc1garbage")
    await gw.sock.send_multipart([b"two", b"frames"])
    await gw.send(Task.of("r", [1], SamplingParams(), "x"))  # a valid message the router does not take
    assert (await c.status(gw)).queue_length == 0


@pytest.mark.parametrize("tokens", [[-1] * BS, [2**32] * BS], ids=["negative", "over-uint32"])
def test_out_of_range_token_ids_do_not_kill_the_router(tokens):
    @serve()
    async def body(c: Cluster):
        await c.worker("w1")
        gw = await c.gateway()
        await gw.send(submit("bad", tokens))  # not hashed by the gateway: the router opens it
        await gw.send(Ping(99))
        answer = asyncio.ensure_future(gw.expect(Rejected))
        done, _ = await asyncio.wait({answer, c.task}, timeout=TIMEOUT,
                                     return_when=asyncio.FIRST_COMPLETED)
        assert c.task not in done, "the router stopped"
        assert (answer.result().request_id, answer.result().status) == ("bad", 400)
        assert c.service.requests == {} and not c.service.queue

    body()


async def _b_caches_three_blocks(c: Cluster):
    """Workers ``a`` and ``b``, ``b`` holding the prompt's first three blocks; a gateway."""
    a = await c.worker("a")
    b = await c.worker("b")
    await b.send(KVEvents("b", stored=HASHES[:3]))
    return a, b, await c.gateway()


@serve()
async def test_the_router_places_on_the_gateways_hashes_and_never_opens_the_job(c: Cluster):
    a, b, gw = await _b_caches_three_blocks(c)
    assert (await c.status(gw)).block_size == BS  # what the gateway hashes in
    hashed = Submit.of("r1", PROMPT, SamplingParams(max_tokens=8), "tcp://gateway:7201", BS)
    unreadable = replace(hashed, job=b"\xc1 not a job")
    await gw.send(unreadable)
    task = await b.expect(Task)  # placed by the header's hashes alone
    assert (task.request_id, task.job) == ("r1", unreadable.job)  # passed on as it came
    await gw.expect(Admitted)
    assert c.service.registry.workers["b"].outstanding_tokens == len(PROMPT) - 3 * BS
    await c.assert_quiet(a)


@serve()
async def test_a_submit_hashed_in_another_block_size_is_hashed_by_the_router(c: Cluster):
    a, b, gw = await _b_caches_three_blocks(c)
    await gw.send(Submit.of("r1", PROMPT, SamplingParams(max_tokens=8), "tcp://gateway:7201", BS * 2))
    assert (await b.expect(Task)).request_id == "r1"
    assert c.service.registry.workers["b"].outstanding_tokens == len(PROMPT) - 3 * BS
    await c.assert_quiet(a)


def test_while_a_dead_prefill_worker_is_expected_back_requests_queue(clock):
    @serve(heartbeat_timeout=1.0, queue_timeout=20.0, clock=clock.monotonic)
    async def body(c: Cluster):
        p = await c.worker("p1", "prefill")
        await c.worker("d1", "decode")
        gw = await c.gateway()
        clock.now += 1.5  # p1 falls silent (d1 too, but it heartbeats below)
        d = c.peers[1]
        await d.send(Heartbeat("d1", 0, 0, 100, 100))
        wait = time.monotonic() + 10
        while (await c.status(gw)).prefill_workers:  # the next maintenance pass drops p1
            assert time.monotonic() < wait
        await gw.send(submit("r1"))
        assert await gw.expect(Queued) == Queued("r1")  # queued, not refused: p1 may return
        assert (await c.status(gw)).queue_length == 1
        await p.send(register("p1", "prefill"))  # restarted
        await p.expect(Registered)
        assert (await p.expect(Task)).request_id == "r1"
        assert await gw.expect(Admitted) == Admitted("r1")

    body()


def test_a_prefill_worker_lost_longer_ago_than_the_queue_timeout_means_503(clock):
    @serve(heartbeat_timeout=1.0, queue_timeout=5.0, clock=clock.monotonic)
    async def body(c: Cluster):
        await c.worker("p1", "prefill")
        d = await c.worker("d1", "decode")
        gw = await c.gateway()
        clock.now += 1.5
        await d.send(Heartbeat("d1", 0, 0, 100, 100))
        wait = time.monotonic() + 10
        while (await c.status(gw)).prefill_workers:
            assert time.monotonic() < wait
        clock.now += 6.0  # p1 was declared dead over 5 s (the queue timeout) ago
        fresh = await c.worker("d2", "decode")  # a live decode worker, whatever became of d1
        await c.status(fresh)
        await gw.send(submit("r1"))
        refusal = await gw.expect(Rejected)
        assert (refusal.status, refusal.reason) == (503, "no prefill worker is available")

    body()


def test_a_router_just_started_queues_until_workers_register(clock):
    """After a router restart the workers register again within a heartbeat: meanwhile a
    request waits instead of a 503, and once the grace has passed with no worker, the
    queue is refused."""
    @serve(startup_grace=5.0, queue_timeout=60.0, clock=clock.monotonic)
    async def body(c: Cluster):
        gw = await c.gateway()
        await gw.send(submit("r1"))
        assert await gw.expect(Queued) == Queued("r1")
        w = c.peer("w1")
        await w.send(register("w1", "colocated"))  # registering drains the queue
        assert await w.expect(Registered) == Registered("w1")
        assert (await w.expect(Task)).request_id == "r1"
        assert await gw.expect(Admitted) == Admitted("r1")

    body()


def test_a_router_whose_workers_never_come_refuses_its_queue_after_the_grace(clock):
    @serve(startup_grace=5.0, queue_timeout=60.0, clock=clock.monotonic)
    async def body(c: Cluster):
        gw = await c.gateway()
        await gw.send(submit("r1"))
        assert await gw.expect(Queued) == Queued("r1")
        clock.now += 5.5
        refusal = await gw.expect(Rejected)  # refused by the next maintenance pass
        assert (refusal.request_id, refusal.status) == ("r1", 503)
        await gw.send(submit("r2"))
        assert (await gw.expect(Rejected)).status == 503

    body()


def test_a_router_holds_requests_for_decode_workers_alone_but_its_grace_ends_with_the_first_prefill_worker(clock):
    """A fresh router holds requests while the workers load (a decode worker alone serves
    none); once a prefill-capable worker has registered, the grace is over: with that
    worker gone longer than the queue timeout, a request is refused at once."""
    @serve(startup_grace=60.0, queue_timeout=5.0, clock=clock.monotonic)
    async def body(c: Cluster):
        gw = await c.gateway()
        d = await c.worker("d1", "decode")
        await c.status(d)
        await gw.send(submit("r1"))
        assert await gw.expect(Queued) == Queued("r1")  # a decode worker alone: still waiting
        p = c.peer("p1")
        await p.send(register("p1", "prefill"))
        assert await p.expect(Registered) == Registered("p1")
        assert (await p.expect(Task)).request_id == "r1"
        assert await gw.expect(Admitted) == Admitted("r1")
        await p.send(Deregister("p1"))  # it leaves, and r1 goes back to its gateway
        failed = await gw.expect(Tokens)
        assert failed.request_id == "r1" and failed.error
        clock.now += 6.0  # past the queue timeout, well inside the 60 s grace
        await gw.send(submit("r2"))
        refusal = await gw.expect(Rejected)
        assert (refusal.request_id, refusal.status) == ("r2", 503)

    body()
