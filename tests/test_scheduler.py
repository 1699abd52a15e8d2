"""Scheduler: exact chunks per step, FCFS order, budgets, preemption and recovery."""

from __future__ import annotations

import pytest

from common.config import SchedulerConfig
from common.engine.block_pool import BlockPool
from common.engine.kv_cache_manager import KVCacheManager
from common.engine.request import FinishReason, Request, SeqStatus
from common.engine.scheduler import Scheduler
from common.sampling_params import SamplingParams

BS = 4


def make(num_blocks=16, budget=16, max_seqs=8, chunked=True, caching=True,
         prefill_cap=None) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, caching), BS)
    return Scheduler(SchedulerConfig(max_seqs, budget, chunked, prefill_cap), kv)


def seq(rid: str, length: int, first_token: int = 0):
    tokens = [first_token + i for i in range(length)]
    return Request(rid, tokens, SamplingParams(), max_tokens=64).seqs[0]


def run_step(s: Scheduler, token: int = 7):
    """Schedule, pretend the model ran, append a token to every sampling sequence."""
    out = s.schedule()
    s.advance(out)
    for c in out.chunks:
        if c.samples:
            c.seq.token_ids.append(token)
    return [(c.seq.seq_id, c.start, c.num_new_tokens) for c in out.chunks], out


def test_chunked_prefill_mixes_with_decodes_under_the_budget():
    s = make(budget=10)
    a, b = seq("a", 6), seq("b", 12, 100)
    s.add(a)
    s.add(b)
    chunks, _ = run_step(s)
    assert chunks == [("a", 0, 6), ("b", 0, 4)]
    chunks, _ = run_step(s)
    assert chunks == [("a", 6, 1), ("b", 4, 8)]  # a decodes, b finishes its prompt
    chunks, _ = run_step(s)
    assert chunks == [("a", 7, 1), ("b", 12, 1)]


def test_a_prefill_cap_chunks_prompts_small_and_never_holds_back_decodes():
    """A decode worker's cap: prompt chunks share ``prefill_cap`` tokens per step, running
    decodes take the rest of the budget, even those behind a capped prompt."""
    s = make(num_blocks=32, budget=16, prefill_cap=3)
    a, b, c = seq("a", 2), seq("b", 7, 100), seq("c", 2, 200)
    for x in (a, b, c):
        s.add(x)
    chunks, _ = run_step(s)
    assert chunks == [("a", 0, 2), ("b", 0, 1)]  # the cap: 2 + 1 prompt tokens
    chunks, _ = run_step(s)
    assert chunks == [("a", 2, 1), ("b", 1, 3)]  # a decodes outside the cap
    chunks, _ = run_step(s)
    assert chunks == [("a", 3, 1), ("b", 4, 3)]  # b's prompt is done: it samples
    chunks, _ = run_step(s)
    assert chunks == [("a", 4, 1), ("b", 7, 1), ("c", 0, 2)]
    assert s.stats.computed_tokens == 3 + 4 + 4 + 4


def test_a_prefill_cap_skips_a_running_prompt_but_serves_the_decode_behind_it():
    s = make(num_blocks=32, budget=16, prefill_cap=2)
    a, b = seq("a", 6), seq("b", 1, 100)
    s.add(a)
    s.add(b)
    assert run_step(s)[0] == [("a", 0, 2)]  # b waits: the cap is spent
    s.config = SchedulerConfig(8, 16, True, 3)  # a has 4 left: 3 this step, b's 1 does not fit
    assert run_step(s)[0] == [("a", 2, 3)]
    assert run_step(s)[0] == [("a", 5, 1), ("b", 0, 1)]
    assert run_step(s)[0] == [("a", 6, 1), ("b", 1, 1)]  # both decode


def test_a_prefill_cap_needs_chunked_prefill():
    with pytest.raises(ValueError, match="chunked"):
        SchedulerConfig(8, 16, False, 4)
    with pytest.raises(ValueError, match=">= 1"):
        SchedulerConfig(8, 16, True, 0)


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    s = make(budget=10, chunked=False)
    a, b = seq("a", 6), seq("b", 8, 100)
    s.add(a)
    s.add(b)
    chunks, _ = run_step(s)
    assert chunks == [("a", 0, 6)]  # b (8) does not fit in the 4 left
    chunks, _ = run_step(s)
    assert chunks == [("a", 6, 1), ("b", 0, 8)]


def test_fcfs_and_max_num_seqs():
    s = make(budget=100, max_seqs=2)
    for rid in "abc":
        s.add(seq(rid, 3, ord(rid) * 10))
    chunks, _ = run_step(s)
    assert [c[0] for c in chunks] == ["a", "b"]
    s.finish(s.running[0], FinishReason.STOP)
    chunks, _ = run_step(s)
    assert [c[0] for c in chunks] == ["b", "c"]


def test_preemption_frees_the_latest_and_it_recovers_first():
    s = make(num_blocks=4, budget=32)
    a, b = seq("a", 8), seq("b", 8, 100)  # 2 blocks each: the cache is full
    s.add(a)
    s.add(b)
    run_step(s)
    assert s.kv.pool.num_free_blocks == 0
    chunks, out = run_step(s)  # a needs a third block at position 8: b is preempted
    assert chunks == [("a", 8, 1)]
    assert out.preempted == [b] and b.status is SeqStatus.WAITING and b.num_computed_tokens == 0
    assert list(s.waiting) == [b] and s.num_preemptions == 1
    s.finish(a, FinishReason.STOP)
    chunks, _ = run_step(s)
    # b comes back to recompute prompt + sampled token. a's new block evicted b's second
    # block (freed tail first, so first out), but the first is still a cache hit.
    assert chunks == [("b", 4, 5)]
    assert b.num_computed_tokens == 9


def test_preempting_itself_when_alone_does_not_schedule_it():
    s = make(num_blocks=2, budget=32, caching=False)
    a = seq("a", 8)
    s.add(a)
    run_step(s)
    chunks, out = run_step(s)  # position 8 needs a third block: nothing else to evict
    assert chunks == [] and out.preempted == [a]


def test_no_newcomers_in_a_step_that_preempted():
    s = make(num_blocks=4, budget=32)
    a, b = seq("a", 8), seq("b", 8, 100)
    s.add(a)
    s.add(b)
    run_step(s)
    s.add(seq("c", 2, 200))
    chunks, out = run_step(s)
    assert [c[0] for c in chunks] == ["a"] and out.preempted == [b]


def test_finishing_frees_every_block():
    s = make()
    seqs = [seq(r, 9, i * 50) for i, r in enumerate("abc")]
    for x in seqs:
        s.add(x)
    for _ in range(3):
        run_step(s)
    for x in seqs:
        s.finish(x, FinishReason.LENGTH)
    assert not s.has_work
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks
