"""Prefill in one engine, decode in another: the same tokens as one engine doing both.

The handoff goes through the wire exactly as between two workers: ``to_wire`` → msgpack
→ ``decode`` (which validates) → ``from_wire``, with the blocks as separate buffers.
"""

from __future__ import annotations

import pytest

from common.engine.handoff import Handoff, from_wire, to_wire
from common.protocol import decode as decode_message
from common.protocol import encode
from common.sampling_params import SamplingParams
from tests.conftest import make_engine


def over_the_wire(prefill, h: Handoff) -> tuple[Handoff, list[memoryview]]:
    header = to_wire(h, f"t-{h.request_id}", "tcp://gw:1", prefill.kv_layout, prefill.block_nbytes)
    blocks = [memoryview(bytes(b)) for b in prefill.export_blocks(h.block_ids)]  # a copy, as sent
    return from_wire(decode_message(encode(header))), blocks


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
            assert decode.add_prefilled(*over_the_wire(prefill, h))
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
    assert decode.add_prefilled(*over_the_wire(prefill, a))
    assert decode.pool.num_free_blocks == 1
    assert not decode.add_prefilled(*over_the_wire(prefill, b))
    assert decode.pool.num_free_blocks == 1 and decode.num_running == 1
    for rid in ("a", "b"):
        prefill.abort(rid)
    assert prefill.pool.num_free_blocks == 16


def test_a_choice_that_stopped_at_its_first_token_stays_stopped_after_the_wire(tiny_model_dir):
    """n=2, seeded, no ignore_eos: one choice's first token is a stop token. The decode
    side must not revive it (it used to be rebuilt as unfinished and run to max_tokens)."""
    prompt = list(range(60, 90))
    probe = SamplingParams(max_tokens=12, temperature=8.0, seed=5, n=2)
    firsts = [c.token_ids[0] for c in make_engine(tiny_model_dir).generate([prompt], probe)[0].choices]
    assert firsts[0] != firsts[1], "pick another seed: both choices start alike"
    params = SamplingParams(max_tokens=12, temperature=8.0, seed=5, n=2, stop_token_ids=(firsts[0],))
    [expected] = make_engine(tiny_model_dir).generate([prompt], params)
    assert [len(c.token_ids) for c in expected.choices][0] == 1
    [got] = run_disaggregated(tiny_model_dir, [prompt], params)
    assert got == [c.token_ids for c in expected.choices]
    assert len(got[0]) == 1 and len(got[1]) > 1


def test_a_bad_payload_leaves_the_decode_engine_holding_nothing(tiny_model_dir):
    prefill = make_engine(tiny_model_dir, num_blocks=16)
    decode = make_engine(tiny_model_dir, num_blocks=16)
    prefill.add_request(list(range(40)), SamplingParams(max_tokens=4, temperature=0.0), "r",
                        prefill_only=True)
    handoffs = []
    while not handoffs:
        prefill.step()
        handoffs = prefill.take_handoffs()
    h, blocks = over_the_wire(prefill, handoffs[0])
    with pytest.raises(ValueError, match="KV blocks sent"):
        decode.add_prefilled(h, blocks[:-1])
    assert decode.pool.num_free_blocks == 16 and not decode.has_unfinished
    assert decode.add_prefilled(h, blocks)  # the same handoff, whole, is taken
