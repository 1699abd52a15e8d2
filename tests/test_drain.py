"""Graceful drain and readiness: SIGTERM makes a process stop taking work, finish what it
holds, and leave without losing a request.

In process: the drain's decisions (``DrainState``, a hand-moved clock); the router, which
places nothing on a draining worker, releases it once its placements are done, and fails
back what a leaving worker still held; one worker's ``/ready`` through registration and
drain, and its hand-over at the deadline. Over real processes (one prefill and one decode
worker, under ``tandem up``'s supervisor): a rolling restart of every worker under a steady load of streaming and non-streaming requests loses none of them
(greedy: the same text as an undisturbed run) and leaves no charge or block behind; a
draining gateway refuses new requests and finishes its open stream.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator

import httpx
import pytest

from common.connector import make_receiver
from common.protocol import (
    Abort,
    Admitted,
    Deregister,
    Drained,
    Draining,
    Finished,
    Heartbeat,
    Queued,
    Registered,
    Task,
    Tokens,
)
from common.roles import FinishStage, WorkerRole
from common.sampling_params import SamplingParams
from services.worker_drain import DrainState, Leave
from tests.cluster import Cluster, wait_for
from tests.conftest import ManualClock, write_tiny_model
from tests.test_router import PROMPT, register, serve, submit
from tests.test_router import Cluster as RouterPeers
from tests.test_worker import Harness

# ---- the drain's decisions ----------------------------------------------------------------


def test_a_drain_leaves_once_released_and_idle_and_hands_over_at_the_deadline():
    clock = ManualClock(100.0)
    d = DrainState(10.0, clock)
    assert not d.start() and d.decide(idle=True, registered=True) is Leave.STAY  # not asked
    d.ask()
    assert d.start() and not d.start()  # begins once
    assert d.decide(idle=True, registered=True) is Leave.STAY  # the router has not released it
    assert d.decide(idle=True, registered=False) is Leave.NOW  # no router knows it: nothing to wait for
    d.released = True
    assert d.decide(idle=False, registered=True) is Leave.STAY  # still serving
    assert d.decide(idle=True, registered=True) is Leave.NOW
    d.rejoined()  # registered again (a new router): it must release us again
    assert d.decide(idle=True, registered=True) is Leave.STAY
    clock.now += 10.0
    assert d.decide(idle=False, registered=True) is Leave.HAND_OVER


def test_a_second_signal_hands_over_at_once():
    d = DrainState(30.0, ManualClock(100.0))
    d.ask()
    d.start()
    assert d.decide(idle=False, registered=True) is Leave.STAY
    d.ask()
    assert d.decide(idle=False, registered=True) is Leave.HAND_OVER
    with pytest.raises(ValueError):
        DrainState(-1.0)


# ---- the router -------------------------------------------------------------------------


@serve()
async def test_the_router_places_nothing_on_a_draining_worker_and_releases_it_when_done(c: RouterPeers):
    w1, w2 = await c.worker("w1"), await c.worker("w2")
    gw = await c.gateway()
    await gw.send(submit("r1"))
    assert (await w1.expect(Task)).request_id == "r1"  # a tie goes to the first
    await gw.expect(Admitted)
    await w1.send(Draining("w1"))
    await c.status(w1)  # handled, and w1 is not released: r1 is still there
    assert (await c.status(gw)).prefill_workers == 1  # only w2 can take new work
    await gw.send(submit("r2"))
    assert (await w2.expect(Task)).request_id == "r2"
    await gw.expect(Admitted)
    await w1.send(Heartbeat("w1", 1, 0, 90, 100))  # a draining worker stays registered
    await c.assert_quiet(w1)  # no task for it
    await w1.send(Finished("r1", "w1", FinishStage.REQUEST))
    assert await w1.expect(Drained) == Drained("w1")
    await w1.send(Deregister("w1"))
    await c.status(w1)
    assert set(c.service.registry.workers) == {"w2"}


@serve()
async def test_what_a_leaving_worker_still_held_fails_back_as_retryable(c: RouterPeers):
    p, d = await c.worker("p1", "prefill"), await c.worker("d1", "decode")
    gw = await c.gateway()
    await gw.send(submit("r1"))
    await p.expect(Task)
    await gw.expect(Admitted)
    await d.send(Draining("d1"))  # r1's KV is still on its way to d1: not released
    await c.assert_quiet(d)
    await d.send(Deregister("d1"))  # the deadline came first
    lost = await gw.expect(Tokens)
    assert (lost.request_id, lost.retryable) == ("r1", True) and lost.error
    assert (await p.expect(Abort)).request_id == "r1"  # the prefill side lets it go
    assert c.service.requests == {} and c.service.ledger.requests_on("p1") == []


@serve(queue_timeout=30.0)
async def test_while_the_only_prefill_worker_drains_requests_queue_for_its_successor(c: RouterPeers):
    p = await c.worker("p1", "prefill")
    await c.worker("d1", "decode")
    gw = await c.gateway()
    await p.send(Draining("p1"))
    assert await p.expect(Drained) == Drained("p1")  # it held nothing
    await gw.send(submit("r1"))
    assert await gw.expect(Queued) == Queued("r1")  # not a 503: a replacement is likely
    await p.send(Deregister("p1"))
    await c.status(p)
    fresh = c.peer("p1")  # the restarted worker, same id
    await fresh.send(register("p1", "prefill"))
    assert await fresh.expect(Registered) == Registered("p1")
    assert (await fresh.expect(Task)).request_id == "r1"
    assert await gw.expect(Admitted) == Admitted("r1")


# ---- one worker's readiness and drain, in process -------------------------------------------


def ready(h: Harness) -> tuple[int, dict]:
    r = httpx.get(f"http://127.0.0.1:{h.worker.http.port}/ready", timeout=10)
    return r.status_code, r.json()


def deregistered(h: Harness) -> bool:
    """The worker's last word to the router so far is its ``Deregister``."""
    return bool(h.from_worker) and isinstance(h.from_worker[-1], Deregister)


@pytest.fixture
def harness(tiny_model_dir) -> Iterator[Harness]:
    h = Harness(tiny_model_dir, WorkerRole.COLOCATED)
    yield h
    h.close()


def test_a_worker_is_ready_once_registered_and_not_while_draining(harness: Harness):
    h, wid = harness, harness.worker.s.worker_id
    status, body = ready(h)
    assert (status, body["reason"]) == (503, "not registered with the router")
    h.send(Registered(wid))
    h.run_until(lambda: ready(h)[0] == 200)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    h.send(Task.of("r", PROMPT, params, h.reply_to))
    h.run_until(lambda: h.output("r"))  # running
    h.worker.request_drain()
    assert ready(h) == (503, {"status": "not ready", "reason": "draining", "role": "colocated",
                              "worker_id": wid})
    h.run_until(lambda: h.finished("r") is not None)  # it finishes what it holds
    assert len(h.output("r")) == 24 and not h.errors("r")
    assert any(isinstance(m, Draining) for m in h.from_worker)
    assert not h.worker.left  # the router has not released it
    h.send(Drained(wid))
    h.run_until(lambda: deregistered(h))
    assert h.worker.left
    h.assert_idle()


def test_at_the_deadline_a_worker_hands_its_requests_over_as_retryable(tiny_model_dir):
    h = Harness(tiny_model_dir, WorkerRole.COLOCATED, drain_timeout=0.0)
    try:
        h.send(Registered(h.worker.s.worker_id))
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        h.send(Task.of("long", PROMPT, params, h.reply_to))
        h.run_until(lambda: h.output("long"))
        h.worker.request_drain()
        h.run_until(lambda: deregistered(h) and any(t.error for t in h.tokens))
        assert h.worker.left
        [failed] = [t for t in h.tokens if t.error]
        assert (failed.request_id, failed.retryable) == ("long", True)
        done = h.finished("long")  # before the Deregister: the same socket keeps the order
        assert done is not None and done.error
        h.assert_idle()
    finally:
        h.close()


def test_a_transfer_whose_receiver_died_does_not_hold_up_the_drain(tiny_model_dir):
    """A prefill worker's KV went to a decode worker that died before acking it: the router
    aborts the request, and the transfer is cancelled but keeps its blocks lent until its
    lease ends (the transport may still read them). Leaving ends that too, so the drain
    does not wait out the lease (40 s by default: ``tandem up`` took 30 s to stop after a
    decode worker was killed)."""
    h = Harness(tiny_model_dir, WorkerRole.PREFILL, lease_seconds=600.0, drain_timeout=600.0)
    peer = make_receiver("zmq", "tcp://127.0.0.1:0")  # reads the transfer, never acks it
    try:
        wid = h.worker.s.worker_id
        h.send(Registered(wid))
        h.send(Task.of("r", PROMPT, SamplingParams(max_tokens=4, temperature=0.0), h.reply_to,
                       handoff_addr=peer.address))
        got: list = []
        h.run_until(lambda: bool(got.extend(peer.poll(0)) or got))
        h.send(Abort("r", "peer failed"))  # the router declared the decode worker dead
        h.run_until(lambda: not h.worker.clock.get("r"))
        assert len(h.worker.outgoing) == 1 and h.worker.outgoing.wanted == 0  # still lent
        h.worker.request_drain()
        h.run_until(lambda: any(isinstance(m, Draining) for m in h.from_worker))
        h.send(Drained(wid))
        h.run_until(lambda: deregistered(h))  # well before the lease or the drain deadline
        assert h.worker.left and not h.errors("r")  # nothing handed over
    finally:
        peer.close()
        h.close()


# ---- a rolling restart under load, over real processes ----------------------------------------

MAX_TOKENS = 24
PROMPTS = [list(range(200 + 37 * i, 230 + 37 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm2_dir) -> Iterator[Cluster]:
    model = write_tiny_model(tmp_path_factory.mktemp("tiny-drain"), smollm2_dir)
    # The heartbeat timeout outlasts the decode worker's pause in the last test (nothing
    # here kills a worker: each one leaves by draining, and says so).
    extra = ("--num-kv-blocks", "256", "--drain-timeout", "20", "--heartbeat-timeout", "60")
    # One worker of each role, the cheapest cluster that still covers P/D: while either is
    # away, requests wait in the router's queue for its successor.
    with Cluster(str(model), prefill=1, decode=1, extra=extra, supervise=True) as c:
        yield c


def complete(c: Cluster, prompt: list[int], stream: bool) -> tuple[int, str, str | None]:
    """Status, text and finish reason of one greedy request (streamed: every event parsed)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        r = httpx.post(f"{c.url}/v1/completions", json=body, timeout=120)
        if r.status_code != 200:
            return r.status_code, r.text, None
        choice = r.json()["choices"][0]
        return 200, choice["text"], choice["finish_reason"]
    text, finish, done = [], None, False
    with httpx.stream("POST", f"{c.url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return 500, json.dumps(event), None
                for choice in event["choices"]:
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
        return (r.status_code if done else 599), "".join(text), finish


def router_gauge(c: Cluster, name: str, **labels: str) -> float:
    return c.metric(c.router, name, **labels)


def test_a_rolling_restart_of_every_worker_under_load_loses_no_request(cluster: Cluster):
    c = cluster
    reference = {tuple(p): complete(c, p, stream=False) for p in PROMPTS}
    assert all(status == 200 and finish == "length" for status, _, finish in reference.values())
    results: list[tuple[tuple[int, ...], bool, tuple[int, str, str | None]]] = []
    stop = threading.Event()

    def load(n: int) -> None:
        i = n
        while not stop.is_set():
            prompt, stream = PROMPTS[i % len(PROMPTS)], i % 2 == 0
            try:
                outcome = complete(c, prompt, stream)
            except httpx.HTTPError as e:  # a refused or broken connection is a lost request
                outcome = (0, repr(e), None)
            results.append((tuple(prompt), stream, outcome))
            i += 1

    threads = [threading.Thread(target=load, args=(n,), daemon=True) for n in range(3)]
    for t in threads:
        t.start()
    try:
        statuses = c.local.rolling_restart(c.workers(), timeout=120)
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    assert statuses == {w.name: 0 for w in c.workers()}  # each drained and exited cleanly
    assert all(c.supervisor.policy.restarts(w.name) == 0 for w in c.workers())  # no crash
    assert results and all(not t.is_alive() for t in threads)
    for prompt, stream, (status, text, finish) in results:
        assert (status, finish) == (200, "length"), (stream, status, text)
        assert text == reference[prompt][1], (stream, text)
    assert {c.health(w)["status"] for w in c.workers()} == {"ok"}
    wait_for(lambda: router_gauge(c, "tandem:router_requests_in_flight") == 0
             and router_gauge(c, "tandem:router_ledger_charges") == 0, "the ledger to empty")
    wait_for(lambda: all(c.health(w)["kv_cache_usage"] == 0 and c.health(w)["running"] == 0
                         for w in c.workers()), "every worker to hold no KV")
    assert router_gauge(c, "tandem:router_workers", role="prefill") == 1
    assert router_gauge(c, "tandem:router_workers", role="decode") == 1
    assert router_gauge(c, "tandem:router_workers_draining") == 0


def test_a_draining_gateway_refuses_new_requests_and_finishes_its_open_stream(cluster: Cluster):
    """Last in this module: the gateway does not come back."""
    c = cluster
    # The decode worker is paused (SIGSTOP) as soon as the stream has begun (600 tokens:
    # far more than it makes in the moment that takes), so the stream is still open,
    # however fast the machine, while the gateway is told to stop and asked for more; it
    # resumes after.
    body = {"prompt": PROMPTS[0], "max_tokens": 600, "temperature": 0, "ignore_eos": True,
            "stream": True}
    gateway, [decode] = c.child("gateway"), c.workers("decode")
    events: list[str] = []
    with httpx.stream("POST", f"{c.url}/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: ")))  # it streams
        decode.proc.send_signal(signal.SIGSTOP)
        try:
            c.local.retiring.add("gateway")  # the supervisor must not bring it back
            gateway.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: httpx.get(f"{c.url}/ready", timeout=10).status_code == 503,
                     "the gateway to say it is draining")
            assert httpx.get(f"{c.url}/health", timeout=10).json()["status"] == "draining"
            refused = httpx.post(f"{c.url}/v1/completions", json={**body, "stream": False},
                                 timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["type"]
            assert int(refused.headers["retry-after"]) >= 1
        finally:
            decode.proc.send_signal(signal.SIGCONT)
        events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert not any("error" in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert gateway.proc.wait(60) == 0
