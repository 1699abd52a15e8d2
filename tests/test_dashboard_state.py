"""``/dashboard``'s data, in process: the timeline's phases, the state assembled from
rosters (KV usage, prefix-hit rate, MB/s, health, lost workers, a router that is away),
the router's answer to a ``Survey``, and the gateway link's bounded wait for it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from common.protocol import Heartbeat, Roster, Survey, WorkerView
from common.roles import WorkerRole
from services.gateway.dashboard import LOST_S, DashboardState
from services.gateway.router_link import RouterLink, RouterUnavailable
from services.gateway.settings import GatewaySettings
from services.gateway.timeline import Timeline
from tests.conftest import ManualClock
from tests.test_router import Cluster, serve, submit


def view(worker_id: str, role: WorkerRole = WorkerRole.DECODE, *, free: int = 75, total: int = 100,
         queries: int = 0, hits: int = 0, sent: int = 0, received: int = 0, age: float = 0.1,
         draining: bool = False, running: int = 2, waiting: int = 1) -> WorkerView:
    return WorkerView(worker_id, role, draining, age, running, waiting, free, total, 16, 4,
                      queries, hits, sent, received, 0.02)


# ---- the timeline ---------------------------------------------------------------------

def test_a_disaggregated_request_has_all_four_phases_in_order():
    clock = ManualClock(100.0)
    tl = Timeline(clock=clock)
    t = tl.start("r1")
    clock.now += 0.5
    t.admitted = clock.now
    t.saw_tokens("prefill-0", 1, clock.now + 0.25)  # first token from the prefill worker
    t.saw_tokens("decode-0", 1, clock.now + 0.75)  # then the decode worker's first
    t.saw_tokens("decode-0", 3, clock.now + 1.0)
    clock.now += 2.0
    tl.end(t, "length")
    assert t.durations(clock.now) == pytest.approx(
        {"queue": 0.5, "prefill": 0.25, "transfer": 0.5, "decode": 1.25})
    assert (t.phase(), t.workers, t.output_tokens) == ("length", ["prefill-0", "decode-0"], 5)
    assert tl.recent() == [t]


def test_a_colocated_request_has_no_transfer_phase():
    clock = ManualClock(100.0)
    tl = Timeline(clock=clock)
    t = tl.start("r1")
    t.admitted = clock.now
    t.saw_tokens("worker-0", 1, clock.now + 1.0)
    t.saw_tokens("worker-0", 1, clock.now + 1.5)
    clock.now += 3.0
    tl.end(t, "stop")
    assert t.durations(clock.now) == pytest.approx({"queue": 0.0, "prefill": 1.0, "decode": 2.0})


def test_open_phases_run_until_now():
    clock = ManualClock(100.0)
    tl = Timeline(clock=clock)
    t = tl.start("r1")
    clock.now += 1.0
    assert (t.phase(), t.durations(clock.now)) == ("queue", {"queue": 1.0})
    t.admitted = clock.now
    clock.now += 2.0
    assert (t.phase(), t.durations(clock.now)) == ("prefill", {"queue": 1.0, "prefill": 2.0})
    t.saw_tokens("prefill-0", 1, clock.now)
    clock.now += 0.5
    # From a prefill-only worker: the decode worker's first token is still to come.
    assert t.phase(awaiting_handoff=True) == "transfer"
    assert t.durations(clock.now, awaiting_handoff=True) == pytest.approx(
        {"queue": 1.0, "prefill": 2.0, "transfer": 0.5})
    assert t.phase() == "decode"


def test_the_timeline_keeps_open_requests_and_the_last_finished_ones():
    tl = Timeline(capacity=2, clock=ManualClock(100.0))
    traces = [tl.start(f"r{i}") for i in range(4)]
    for t in traces[:3]:
        tl.end(t, "stop")
    tl.end(traces[0], "abort")  # a second end changes nothing
    assert [t.request_id for t in tl.recent()] == ["r3", "r2", "r1"]
    assert traces[0].outcome == "stop"


# ---- the state ------------------------------------------------------------------------

def test_state_reports_each_worker_with_usage_hit_rate_and_transfer_rate():
    clock = ManualClock(100.0)
    state = DashboardState(Timeline(clock=clock), "tiny", clock=clock)
    first = state.assemble(Roster(1, [view("prefill-0", WorkerRole.PREFILL, queries=100, hits=25,
                                           sent=1_000_000),
                                      view("decode-0", free=40, received=1_000_000)], 0))
    assert first["router"] == {"reachable": True, "error": None, "queue_length": 0}
    p, d = first["workers"]
    assert (p["worker_id"], p["role"], p["health"], p["kv_usage"]) == ("prefill-0", "prefill", "ok", 0.25)
    assert (p["prefix_hit_rate"], d["prefix_hit_rate"]) == (0.25, None)  # no lookups: no rate
    assert (d["kv_usage"], d["running"], d["waiting"]) == (0.6, 2, 1)
    assert p["transfer_mb_s"] is None  # one sample: no rate yet
    clock.now += 2.0
    second = state.assemble(Roster(2, [view("prefill-0", WorkerRole.PREFILL, queries=100, hits=25,
                                            sent=5_000_000),
                                       view("decode-0", free=40, received=3_000_000)], 3))
    p, d = second["workers"]
    assert (p["transfer_mb_s"], d["transfer_mb_s"]) == (2.0, 1.0)
    assert second["router"]["queue_length"] == 3


def test_state_shows_late_draining_and_lost_workers():
    clock = ManualClock(100.0)
    state = DashboardState(Timeline(clock=clock), "tiny", clock=clock)
    state.assemble(Roster(1, [view("a"), view("b"), view("c")], 0))
    clock.now += 1.0
    out = state.assemble(Roster(2, [view("a", age=0.9), view("b", draining=True)], 0))
    assert {w["worker_id"]: w["health"] for w in out["workers"]} == {
        "a": "late", "b": "draining", "c": "lost"}
    clock.now += LOST_S + 1
    out = state.assemble(Roster(3, [view("a"), view("b")], 0))
    assert [w["worker_id"] for w in out["workers"]] == ["a", "b"]


def test_an_unreachable_router_still_gives_a_state_with_the_last_workers_seen():
    clock = ManualClock(100.0)
    state = DashboardState(Timeline(clock=clock), "tiny", clock=clock)
    state.assemble(Roster(1, [view("a")], 0))
    clock.now += 3.0
    out = state.assemble(None, "the router is not reachable")
    assert out["router"] == {"reachable": False, "error": "the router is not reachable",
                             "queue_length": None}
    [a] = out["workers"]
    assert a["health"] == "unknown" and a["heartbeat_age"] == pytest.approx(3.1)


def test_a_restarted_worker_starts_its_rate_again():
    clock = ManualClock(100.0)
    state = DashboardState(Timeline(clock=clock), "tiny", clock=clock)
    state.assemble(Roster(1, [view("a", sent=9_000_000)], 0))
    clock.now += 1.0
    out = state.assemble(Roster(2, [view("a", sent=1_000)], 0))  # its totals began again
    assert out["workers"][0]["transfer_mb_s"] is None  # never a negative rate


def test_state_rows_mark_a_request_waiting_for_its_decode_worker_as_in_transfer():
    clock = ManualClock(100.0)
    tl = Timeline(clock=clock)
    state = DashboardState(tl, "tiny", clock=clock)
    t = tl.start("r1")
    t.admitted = clock.now
    t.saw_tokens("prefill-0", 1, clock.now + 0.5)
    clock.now += 1.0
    out = state.assemble(Roster(1, [view("prefill-0", WorkerRole.PREFILL), view("decode-0")], 0))
    [row] = out["requests"]
    assert row["phase"] == "transfer"
    assert row["phases"] == pytest.approx({"queue": 0.0, "prefill": 0.5, "transfer": 0.5})
    assert row["workers"] == ["prefill-0"]


# ---- the router's answer, and the link's bounded wait ---------------------------------

@serve()
async def test_the_router_answers_a_survey_with_every_worker(c: Cluster):
    p = await c.worker("p1", "prefill", num_blocks=100)
    await c.worker("d1", "decode", num_blocks=200)
    await p.send(Heartbeat("p1", 1, 2, 60, 100, 0.01, None, None, 400, 100, 7_000, 0))
    await c.status(p)  # the heartbeat was handled
    gw = await c.gateway()
    await gw.send(submit("r1"))  # placed: the ledger charges p1's prompt tokens
    await gw.send(Survey(5))
    roster = None
    while roster is None:
        msg = await gw.recv()
        roster = msg if isinstance(msg, Roster) else None
    assert roster.nonce == 5 and roster.queue_length == 0
    p1, d1 = roster.workers
    assert (p1.worker_id, p1.role, d1.worker_id, d1.role) == ("p1", WorkerRole.PREFILL,
                                                               "d1", WorkerRole.DECODE)
    assert (p1.num_running, p1.num_waiting, p1.free_blocks, p1.total_blocks) == (1, 2, 60, 100)
    assert (p1.prefix_queries, p1.prefix_hits, p1.kv_bytes_sent) == (400, 100, 7_000)
    assert p1.outstanding_tokens > 0 and d1.reserved_blocks > 0
    assert not p1.draining and p1.heartbeat_age >= 0


def test_a_survey_of_a_router_that_is_not_there_fails_within_its_timeout():
    async def main():
        link = RouterLink("tcp://127.0.0.1:9", "tcp://127.0.0.1:0")  # nobody listens on 9
        link.start()
        try:
            with pytest.raises(RouterUnavailable):  # a hang would be wait_for's TimeoutError
                await asyncio.wait_for(link.survey(timeout=0.3), 30)
        finally:
            await link.close()

    asyncio.run(main())


# ---- the gateway's routes, with no router at all --------------------------------------

@pytest.fixture(scope="module")
def lonely(tiny_model_dir):
    from tests.test_gateway_http import ServedGateway, nobody_listens

    settings = GatewaySettings(router=nobody_listens(), model=str(tiny_model_dir), api_key="sekret")
    with ServedGateway(settings) as gw:
        yield gw


def test_without_a_router_the_state_still_answers_and_says_so(lonely):
    with httpx.Client(base_url=lonely.url, timeout=20,  # a hang fails here, not a 200
                      headers={"Authorization": "Bearer sekret"}) as client:
        r = client.get("/dashboard/state")
    assert r.status_code == 200, r.text
    state = r.json()
    assert state["router"]["reachable"] is False and "router" in state["router"]["error"]
    assert state["workers"] == [] and state["requests"] == []
    assert state["model"] == lonely.app.state.gateway.model_name


def test_the_page_needs_no_key_but_its_state_does(lonely):
    with httpx.Client(base_url=lonely.url, timeout=20) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert "/dashboard/state" in page.text and "<script src" not in page.text
        assert client.get("/dashboard/state").status_code == 401
