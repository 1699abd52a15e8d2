"""Conditional disaggregation and role-aware decode capacity: the rule's exact choices,
the decode policy's exact picks, the heartbeat's new fields, the worker's rate averages,
and a real router (fake workers over real sockets) sending short prompts to the decode
worker without a handoff and long ones to the prefill worker."""

from __future__ import annotations

import asyncio
import math

import pytest

from common.protocol import (
    Admitted,
    Finished,
    Heartbeat,
    ProtocolError,
    Submit,
    Task,
    Tokens,
    decode,
    encode,
)
from common.sampling_params import SamplingParams
from services.router.disagg import (
    DEFAULT_PREFILL_S_PER_TOKEN,
    DEFAULT_TRANSFER_S_PER_TOKEN,
    Decision,
    DisaggMode,
    DisaggRule,
    PrefillCosts,
    Where,
    default_costs,
)
from services.router.policies import decode_policy
from services.worker_rates import LINK_WINDOW, WorkRates
from tests.test_router import BS, Cluster, ManualClock, placed, router, worker

LOCAL, REMOTE = Where.LOCAL, Where.REMOTE
RULE = DisaggRule(max_local_prefill=256, prefill_queue_tokens=1000)


def costs(prompt=2000, local=None, local_queue=0, remote=None, queue=0,
          transfer=2e-5, prefill=1e-3) -> PrefillCosts:
    """A prompt with nothing cached anywhere unless told otherwise."""
    return PrefillCosts(prompt, prompt if local is None else local, local_queue,
                        prompt if remote is None else remote, queue, transfer, prefill)


# ---- the rule -------------------------------------------------------------------------

@pytest.mark.parametrize("c, expected", [
    (costs(prompt=256), Decision(LOCAL, "short")),  # at the threshold
    (costs(prompt=257), Decision(REMOTE, "long")),  # one over
    (costs(prompt=2000, local=200), Decision(LOCAL, "short")),  # the decode worker's cache
    (costs(prompt=256, local_queue=1), Decision(REMOTE, "long")),  # the prefill worker is idler
    (costs(prompt=256, local_queue=300, queue=300), Decision(LOCAL, "short")),  # as busy: local
    (costs(prompt=256, local_queue=300, queue=299), Decision(REMOTE, "long")),
    (costs(prompt=2000, remote=100), Decision(REMOTE, "long")),  # the prefill worker's cache
    (costs(queue=1000), Decision(REMOTE, "long")),  # a queue at the threshold is not over it
    (costs(queue=1001), Decision(LOCAL, "queue")),  # over it: the decode worker starts sooner
    (costs(queue=1001, local_queue=1002), Decision(REMOTE, "long")),  # not sooner there
    (costs(queue=1001, local_queue=1001), Decision(LOCAL, "queue")),  # as soon: local
    (costs(queue=5000, remote=0, local_queue=3001), Decision(REMOTE, "long")),  # cached remotely
    (costs(transfer=1e-3), Decision(LOCAL, "link")),  # moving costs as much as computing
    (costs(transfer=0.99e-3), Decision(REMOTE, "long")),
    (costs(prompt=1000, local=500, transfer=0.5e-3), Decision(LOCAL, "link")),  # 1000×0.5 ≥ 500×1
    (costs(prompt=1000, local=501, transfer=0.5e-3), Decision(REMOTE, "long")),
    (PrefillCosts(4000, 4000, 0, None, 0, 2e-5, 1e-3), Decision(LOCAL, "busy")),  # none can take it
])
def test_auto_rule_exact_choices(c, expected):
    assert RULE.decide(c) == expected


def test_modes_ignore_the_costs():
    for c in (costs(prompt=1), costs(prompt=4000, queue=10**6), costs(transfer=1.0)):
        assert DisaggRule(DisaggMode.ALWAYS).decide(c) == Decision(REMOTE, "mode")
        assert DisaggRule("never").decide(c) == Decision(LOCAL, "mode")


def test_zero_threshold_sends_only_fully_cached_prompts_local():
    rule = DisaggRule(max_local_prefill=0, prefill_queue_tokens=1000)
    assert rule.decide(costs(prompt=64, local=0)) == Decision(LOCAL, "short")
    # one uncached token is cheaper to compute (1 ms) than 64 tokens' KV to move (1.28 ms)
    assert rule.decide(costs(prompt=64, local=1)) == Decision(LOCAL, "link")
    assert rule.decide(costs(prompt=64, local=2)) == Decision(REMOTE, "long")


def test_the_defaults_split_the_mixed_benchmark():
    """``mixed``: 256-token prompts prefill locally, 2,000-token ones remotely while the
    prefill queue holds at most one of them."""
    rule = DisaggRule()
    assert rule.decide(costs(prompt=256)).where is LOCAL
    assert rule.decide(costs(prompt=2000)).where is REMOTE
    assert rule.decide(costs(prompt=2000, queue=2000)).where is REMOTE
    assert rule.decide(costs(prompt=2000, queue=4000)).where is LOCAL


def test_bad_settings_and_inputs_are_value_errors():
    with pytest.raises(ValueError):
        DisaggRule("sometimes")
    with pytest.raises(ValueError):
        DisaggRule(max_local_prefill=-1)
    with pytest.raises(ValueError):
        costs(prompt=10, local=11)
    with pytest.raises(ValueError):
        costs(prefill=0.0)
    with pytest.raises(ValueError):
        costs(queue=-1)


def test_default_costs_prefer_the_workers_measurements():
    w = worker("p1", "prefill")
    assert default_costs(None) == (DEFAULT_TRANSFER_S_PER_TOKEN, DEFAULT_PREFILL_S_PER_TOKEN)
    assert default_costs(w) == (DEFAULT_TRANSFER_S_PER_TOKEN, DEFAULT_PREFILL_S_PER_TOKEN)
    w.transfer_s_per_token, w.prefill_s_per_token = 3e-5, 2e-3
    assert default_costs(w) == (3e-5, 2e-3)
    w.prefill_s_per_token = 0.0  # never a free prefill: every prompt would look "link"-bound
    assert default_costs(w) == (3e-5, DEFAULT_PREFILL_S_PER_TOKEN)


# ---- role-aware decode choice ---------------------------------------------------------

def decoder(worker_id: str, free: int, step: float | None):
    w = worker(worker_id, "decode", free=free, num_blocks=100)
    w.step_seconds = step
    return w


@pytest.mark.parametrize("workers, expected", [
    ([decoder("a", 50, None), decoder("b", 90, None)], "b"),  # unmeasured: free KV decides
    ([decoder("a", 50, 0.02), decoder("b", 90, 0.10)], "a"),  # 0.5-0.2 beats 0.9-1.0
    ([decoder("a", 50, 0.05), decoder("b", 90, 0.10)], "a"),  # 0.5-0.5 vs 0.9-1.0
    ([decoder("a", 50, 0.09), decoder("b", 90, 0.10)], "b"),  # 0.5-0.9 vs 0.9-1.0
    ([decoder("a", 100, 0.10), decoder("b", 50, 0.05)], "a"),  # tie (0 and 0): the first
    ([decoder("a", 3, 0.01), decoder("b", 90, 0.10)], "b"),  # a has no room for the prompt
])
def test_decode_choice_weighs_free_kv_and_step_time(workers, expected):
    assert placed(decode_policy(), workers) == expected


def test_decode_step_weight_zero_is_free_kv_alone():
    ws = [decoder("a", 50, 0.01), decoder("b", 90, 0.10)]
    assert placed(decode_policy(step_weight=0.0), ws) == "b"


# ---- the heartbeat and the worker's averages ------------------------------------------

def test_heartbeat_carries_and_validates_the_rates():
    beat = Heartbeat("w", 1, 0, 5, 10, 0.03, 1e-3, 2e-5)
    assert decode(encode(beat)) == beat
    assert decode(encode(Heartbeat("w", 1, 0, 5, 10))).step_seconds is None
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ProtocolError):
            Heartbeat("w", 1, 0, 5, 10, step_seconds=bad)
        with pytest.raises(ProtocolError):
            Heartbeat("w", 1, 0, 5, 10, transfer_s_per_token=bad)


def test_work_rates_average_and_price_only_prefill_steps():
    r = WorkRates()
    r.observe_step(0.5, 0, prefill_only=True)  # an empty step measures nothing
    assert (r.step_seconds, r.prefill_s_per_token) == (None, None)
    r.observe_step(0.5, 500, prefill_only=True)
    assert (r.step_seconds, r.prefill_s_per_token) == (0.5, 1e-3)
    r.observe_step(1.5, 500, prefill_only=True)  # the newest weighs 0.2
    assert r.step_seconds == pytest.approx(0.7)
    assert r.prefill_s_per_token == pytest.approx(1.4e-3)
    r.observe_step(0.1, 8, prefill_only=False)  # a decode step: no prefill price
    assert r.prefill_s_per_token == pytest.approx(1.4e-3)
    r.observe_transfer(0.01, 46_080_000, 46_080.0)  # 1,000 tokens in 10 ms
    assert r.transfer_s_per_token == pytest.approx(1e-5)
    r.observe_transfer(0.5, 46_080_000, 46_080.0)  # an ack that waited for a decode step
    assert r.transfer_s_per_token == pytest.approx(1e-5)  # the link is as quick as it was
    for _ in range(LINK_WINDOW):  # until the quick one leaves the window
        r.observe_transfer(0.02, 46_080_000, 46_080.0)
    assert r.transfer_s_per_token == pytest.approx(2e-5)


# ---- a real router --------------------------------------------------------------------

SHORT = list(range(100, 108))  # 8 tokens: two blocks
LONG = list(range(200, 240))  # 40 tokens: ten blocks


def disagg_router(**kw):
    return router(disagg=DisaggRule(max_local_prefill=16, prefill_queue_tokens=1000), **kw)


def submit(request_id: str, tokens: list[int]) -> Submit:
    return Submit.of(request_id, tokens, SamplingParams(max_tokens=8), "tcp://gateway:7201")


async def pd(c: Cluster):
    p = await c.worker("p1", "prefill")
    d = await c.worker("d1", "decode", num_blocks=50)
    return p, d, await c.gateway()


def test_short_prompt_prefills_on_the_decode_worker_and_long_on_the_prefill_worker():
    async def main():
        async with disagg_router() as c:
            p, d, gw = await pd(c)
            await gw.send(submit("short", SHORT))
            task = await d.expect(Task)
            assert (task.request_id, task.handoff_addr) == ("short", None)
            await c.assert_quiet(p)
            reg = c.service.registry.workers
            assert reg["d1"].outstanding_tokens == len(SHORT)  # its local prefill is charged
            assert reg["d1"].reserved_blocks == len(SHORT) // BS + 1
            assert reg["p1"].outstanding_tokens == 0

            await gw.send(submit("long", LONG))
            task = await p.expect(Task)
            assert (task.request_id, task.handoff_addr) == ("long", "tcp://d1:7300")
            assert reg["p1"].outstanding_tokens == len(LONG)

            await d.send(Finished("short", "d1", "prefill"))  # its first token
            await c.status(d)
            assert (reg["d1"].outstanding_tokens, reg["d1"].reserved_blocks) == (0, len(LONG) // BS + 1)
            assert c.service.ledger.requests_on("d1") == ["short", "long"]
            await d.send(Finished("short", "d1", "request"))
            await c.status(d)
            assert c.service.ledger.requests_on("d1") == ["long"]

    asyncio.run(main())


def test_a_long_queue_on_the_prefill_worker_sends_long_prompts_local():
    async def main():
        rule = DisaggRule(max_local_prefill=16, prefill_queue_tokens=30)
        async with router(disagg=rule, token_budget=100) as c:
            p, d, gw = await pd(c)
            await gw.send(submit("a", LONG))  # the queue was empty: remote
            assert (await p.expect(Task)).handoff_addr == "tcp://d1:7300"
            await gw.send(submit("b", [t + 1000 for t in LONG]))  # 40 queued > 30: local
            assert (await d.expect(Task)).handoff_addr is None
            await gw.send(submit("c", [t + 2000 for t in LONG]))  # d has 40 of its own now: tie
            assert (await d.expect(Task)).request_id == "c"
            # d would hold 120 > the token budget of 100: remote, though p is as busy
            await gw.send(submit("d", [t + 3000 for t in LONG]))
            assert (await p.expect(Task)).request_id == "d"
            reg = c.service.registry.workers
            assert (reg["p1"].outstanding_tokens, reg["d1"].outstanding_tokens) == (80, 80)

    asyncio.run(main())


def test_mode_never_keeps_the_prefill_worker_idle_and_always_uses_it():
    async def main():
        for mode, to_decode in (("never", True), ("always", False)):
            async with router(disagg=DisaggRule(mode)) as c:
                p, d, gw = await pd(c)
                await gw.send(submit("r", LONG if to_decode else SHORT))
                task = await (d if to_decode else p).expect(Task)
                assert (task.handoff_addr is None) == to_decode
                await c.assert_quiet(p if to_decode else d)

    asyncio.run(main())


def test_a_decode_worker_that_dies_fails_its_locally_prefilled_request_back():
    """Like any other request: the gateway hears ``retryable`` (and continues it elsewhere)
    and the decode worker's charge for the local prefill is gone with it."""
    clock = ManualClock()

    async def main():
        async with disagg_router(clock=clock.monotonic, heartbeat_timeout=5.0) as c:
            p, d, gw = await pd(c)
            await gw.send(submit("short", SHORT))
            assert (await d.expect(Task)).handoff_addr is None
            await gw.expect(Admitted)
            clock.now += 4.0
            await p.send(Heartbeat("p1", 0, 0, 100, 100))
            await c.status(p)
            clock.now += 2.0  # d1 silent for 6 s, p1 for 2 s
            msg = await gw.expect(Tokens)
            assert (msg.request_id, msg.retryable) == ("short", True)
            assert "d1" in msg.error
            assert list(c.service.registry.workers) == ["p1"]
            assert "short" not in c.service.ledger and c.service.requests == {}
            await c.assert_quiet(p)  # p1 never held it: nothing to abort there

    asyncio.run(main())
