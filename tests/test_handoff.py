"""Prefill in one engine, decode in another: the same tokens as one engine doing both."""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from tests.conftest import make_engine


def run_disaggregated(model_dir, prompts, params, decode_blocks=64):
    prefill = make_engine(model_dir, num_blocks=64)
    decode = make_engine(model_dir, num_blocks=decode_blocks)
    ids = [prefill.add_request(p, params, request_id=f"r{i}", prefill_only=True)
           for i, p in enumerate(prompts)]
    first: dict[str, dict[int, list[int]]] = {i: {} for i in ids}
    while prefill.has_unfinished:
        for u in prefill.step():
            first[u.request_id].setdefault(u.choice, []).extend(u.token_ids)
            if u.finish_reason is not None:
                prefill.finished_output(u.request_id)
        for h in prefill.take_handoffs():
            assert decode.add_prefilled(h, prefill.runner.block_views(h.block_ids))
            prefill.abort(h.request_id)  # the transfer is done: release the blocks
    assert prefill.pool.num_free_blocks == prefill.pool.num_blocks
    outs = {}
    while decode.has_unfinished:
        for u in decode.step():
            if u.finish_reason is not None and (done := decode.finished_output(u.request_id)):
                outs[done.request_id] = done
    assert decode.pool.num_free_blocks == decode.pool.num_blocks
    return [[first[i][c.index] + c.token_ids[1:] if i in outs else first[i][c.index]
             for c in outs[i].choices] for i in ids]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=3, ignore_eos=True),
])
def test_disaggregated_equals_colocated(tiny_model_dir, params):
    prompts = [list(range(50, 50 + n)) for n in (5, 16, 37)]
    colocated = make_engine(tiny_model_dir).generate(prompts, params)
    expected = [[c.token_ids for c in out.choices] for out in colocated]
    assert run_disaggregated(tiny_model_dir, prompts, params) == expected


def test_decode_engine_refuses_when_full_and_keeps_nothing(tiny_model_dir):
    prefill = make_engine(tiny_model_dir, num_blocks=16)
    decode = make_engine(tiny_model_dir, num_blocks=4)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for rid in ("a", "b"):
        prefill.add_request(list(range(40)), params, request_id=rid, prefill_only=True)
    handoffs = []
    while len(handoffs) < 2:
        prefill.step()
        handoffs += prefill.take_handoffs()
    a, b = handoffs
    assert len(a.block_ids) == 3
    assert decode.add_prefilled(a, prefill.runner.block_views(a.block_ids))
    assert decode.pool.num_free_blocks == 1
    assert not decode.add_prefilled(b, prefill.runner.block_views(b.block_ids))
    assert decode.pool.num_free_blocks == 1 and decode.num_running == 1
    for rid in ("a", "b"):
        prefill.abort(rid)
    assert prefill.pool.num_free_blocks == 16
