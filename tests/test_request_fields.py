"""Issue 12's request fields below HTTP: logit_bias in the sampler and the engine,
priority in the engine scheduler and the router's admission queue, prompt logprobs in
the engine, and the detokenizer's stop-string and special-token options."""

from __future__ import annotations

import pytest
import torch

from common.engine.request import Request
from common.engine.sampler import Sampler
from common.errors import InvalidRequestError
from common.outputs import FinishReason
from common.sampling_params import SamplingParams
from tests.conftest import make_engine

PROMPT = list(range(100, 130))
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _seq(params: SamplingParams):
    return Request("r", [0, 1], params, max_tokens=8).seqs[0]


# ---- logit_bias ------------------------------------------------------------------------


def test_logit_bias_is_added_before_penalties_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0], [0.0, 3.0, 1.0, 0.0]])
    plain = _seq(SamplingParams(temperature=0.0))
    biased = _seq(SamplingParams(temperature=0.0, logit_bias=((2, 2.5), (3, -1.0))))
    adjusted = Sampler([9]).adjust(logits, [plain, biased])
    assert adjusted.tolist() == [[0.0, 3.0, 1.0, 0.0], [0.0, 3.0, 3.5, -1.0]]
    assert logits[1].tolist() == [0.0, 3.0, 1.0, 0.0]  # the caller's tensor is untouched
    assert Sampler([9])(logits, [plain, biased]).token_ids == [1, 2]


def test_logit_bias_beyond_the_logits_is_skipped_not_indexed():
    seq = _seq(SamplingParams(temperature=0.0, logit_bias=((1, 5.0), (10, 100.0))))
    assert Sampler([9]).adjust(torch.zeros(1, 4), [seq]).tolist() == [[0.0, 5.0, 0.0, 0.0]]


def test_plus_100_forces_a_token_and_minus_100_bans_the_greedy_one(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    [plain] = engine.generate([PROMPT], SamplingParams(max_tokens=8, **GREEDY))
    greedy = plain.choices[0].token_ids
    forced_id = 4321
    assert forced_id not in greedy
    [forced] = engine.generate([PROMPT], SamplingParams(
        max_tokens=8, logit_bias=((forced_id, 100.0),), **GREEDY))
    assert forced.choices[0].token_ids == [forced_id] * 8
    [banned] = engine.generate([PROMPT], SamplingParams(
        max_tokens=8, logit_bias=((greedy[0], -100.0),), **GREEDY))
    assert banned.choices[0].token_ids[0] != greedy[0]
    assert greedy[0] not in banned.choices[0].token_ids


def test_the_engine_refuses_a_bias_on_a_token_outside_the_vocabulary(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(PROMPT, SamplingParams(logit_bias=((49152, 1.0),)))
    assert e.value.param == "logit_bias" and "49152" in e.value.message
    assert not engine.has_unfinished


# ---- priority: the engine scheduler -----------------------------------------------------

BS = 4


def _scheduler(num_blocks=16, budget=64, max_seqs=8):
    from common.config import SchedulerConfig
    from common.engine.block_pool import BlockPool
    from common.engine.kv_cache_manager import KVCacheManager
    from common.engine.scheduler import Scheduler

    kv = KVCacheManager(BlockPool(num_blocks, False), BS)
    return Scheduler(SchedulerConfig(max_seqs, budget, True, None), kv)


def _prio_seq(rid: str, length: int, priority: int, arrival: float):
    r = Request(rid, [10 + i for i in range(length)], SamplingParams(priority=priority),
                max_tokens=64, arrival_time=arrival)
    return r.seqs[0]


def _step(s, token=7):
    out = s.schedule()
    s.advance(out)
    for c in out.chunks:
        if c.samples:
            c.seq.token_ids.append(token)
    return [c.seq.seq_id for c in out.chunks], out


def test_waiting_sequences_are_admitted_by_priority_then_arrival():
    s = _scheduler(max_seqs=2)
    for rid, prio, arrival in [("late-low", 5, 1.0), ("early", 0, 2.0), ("urgent", -3, 3.0),
                               ("later", 0, 4.0)]:
        s.add(_prio_seq(rid, 3, prio, arrival))
    assert [q.seq_id for q in s.waiting] == ["urgent", "early", "later", "late-low"]
    ids, _ = _step(s)
    assert ids == ["urgent", "early"]  # max_seqs 2: the others wait in order
    s.finish(s.running[0], FinishReason.STOP)
    ids, _ = _step(s)
    assert ids == ["early", "later"]


def test_a_running_batch_is_served_in_priority_order():
    s = _scheduler()
    low, high = _prio_seq("low", 3, 1, 1.0), _prio_seq("high", 3, 0, 2.0)
    s.add(low)
    _step(s)  # low is running alone
    s.add(high)
    ids, _ = _step(s)
    assert ids == ["low", "high"]  # this step: running first, then the admission
    assert [q.seq_id for q in s.running] == ["high", "low"]
    ids, _ = _step(s)
    assert ids == ["high", "low"]


def test_preemption_takes_the_lowest_priority_running_sequence_not_the_latest():
    s = _scheduler(num_blocks=6)
    low = _prio_seq("low", 8, 2, 1.0)  # arrived first, lowest priority
    mid = _prio_seq("mid", 8, 1, 2.0)
    high = _prio_seq("high", 7, 0, 3.0)  # arrived last, 2 blocks, a third at position 8
    for q in (low, mid, high):
        s.add(q)
    _step(s)  # 2 + 2 + 2 blocks: the cache is full
    assert s.kv.pool.num_free_blocks == 0 and [q.seq_id for q in s.running] == ["high", "mid", "low"]
    ids, out = _step(s)  # mid and low need a third block each, high fits its 8th token
    assert out.preempted[0] is low  # FCFS would have picked high, the latest arrival
    assert low.num_computed_tokens == 0 and low in s.waiting and "high" in ids


def test_equal_priorities_preempt_the_latest_arrival():
    s = _scheduler(num_blocks=4)
    a, b = _prio_seq("a", 8, 0, 1.0), _prio_seq("b", 8, 0, 2.0)
    s.add(b)
    s.add(a)  # added second but arrived first
    _step(s)
    _, out = _step(s)
    assert out.preempted == [b] and [q.seq_id for q in s.running] == ["a"]


# ---- priority: the router's admission queue -----------------------------------------------


def test_admission_queue_serves_lower_priority_values_first_then_fcfs():
    from services.router.admission import AdmissionQueue

    q: AdmissionQueue[str] = AdmissionQueue(max_queue=8, timeout=10.0)
    for i, (item, prio) in enumerate([("a", 0), ("b", 3), ("c", -2), ("d", 0), ("e", -2)]):
        assert q.offer(item, float(i), prio) is None
    assert list(q.waiting()) == ["c", "e", "a", "d", "b"]
    assert q.remove("a") and list(q.waiting()) == ["c", "e", "d", "b"]
    assert q.expired(now=12.5) == ["c", "b"]  # offered at 2.0 and 1.0, in serving order
    assert list(q.waiting()) == ["e", "d"]


def _router_test(**overrides):
    from tests.test_router import serve

    return serve(**overrides)


@_router_test(max_queue=8, token_budget=4)
async def test_router_admits_a_high_priority_request_ahead_of_queued_low_priority_ones(c):
    from common.protocol import Admitted, Finished, Queued, Submit, Task
    from tests.test_router import PROMPT

    def submit(request_id: str, priority: int) -> Submit:
        return Submit(request_id, PROMPT, SamplingParams(max_tokens=8, priority=priority),
                      "tcp://gateway:7201")

    w = await c.worker("w1")
    gw = await c.gateway()
    await gw.send(submit("busy", 0))  # the idle worker takes it; the budget is then spent
    assert (await w.expect(Task)).request_id == "busy"
    assert await gw.expect(Admitted) == Admitted("busy")
    for rid, prio in [("low-1", 5), ("low-2", 5), ("high", -1), ("default", 0)]:
        await gw.send(submit(rid, prio))
        assert await gw.expect(Queued) == Queued(rid)
    admitted = []
    previous = "busy"
    for _ in range(4):  # each finish frees the budget for exactly one more
        await w.send(Finished(previous, "w1", "request"))
        previous = (await w.expect(Task)).request_id
        assert await gw.expect(Admitted) == Admitted(previous)
        admitted.append(previous)
    assert admitted == ["high", "default", "low-1", "low-2"]
