"""Sampling: seeded reproducibility, top-k/top-p/min-p, penalties, min_tokens, logprobs, n>1."""

from __future__ import annotations

import math

import pytest
import torch

from common.engine.request import Request
from common.engine.sampler import Sampler
from common.sampling_params import SamplingError, SamplingParams
from tests.conftest import make_engine

VOCAB = 8
EOS = 2


def seq_with(params: SamplingParams, prompt=(0, 1), output=()):
    s = Request("r", list(prompt), params, max_tokens=16).seqs[0]
    s.token_ids.extend(output)
    return s


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def sample_many(params_fn, probs, trials=200):
    sampler = Sampler([EOS], seed=0)
    logits = logits_from_probs(probs)
    return {sampler(logits, [seq_with(params_fn(i))]).token_ids[0] for i in range(trials)}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = [0.05, 0.55, 0.3, 0.1, 0, 0, 0, 0]
    assert sample_many(lambda i: SamplingParams(temperature=1.0, top_p=0.5, seed=i), probs) == {1}
    assert sample_many(lambda i: SamplingParams(temperature=1.0, top_p=0.8, seed=i), probs) == {1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = [0.5, 0.4, 0.1, 0, 0, 0, 0, 0]
    assert sample_many(lambda i: SamplingParams(temperature=1.0, min_p=0.5, seed=i), probs) == {0, 1}


def test_top_k_limits_the_candidates():
    probs = [0.3, 0.25, 0.2, 0.15, 0.1, 0, 0, 0]
    assert sample_many(lambda i: SamplingParams(temperature=1.0, top_k=2, seed=i), probs) == {0, 1}


def test_unrestricted_sampling_reaches_every_likely_token():
    probs = [0.3, 0.25, 0.2, 0.15, 0.1, 0, 0, 0]
    assert sample_many(lambda i: SamplingParams(temperature=1.0, seed=i), probs) == {0, 1, 2, 3, 4}


def test_draws_follow_the_distribution_and_never_take_a_zero():
    """20,000 draws from an unnormalised row: each token's count within 5 standard
    deviations of its expectation (a wrong draw, e.g. an off-by-one in the running total,
    moves a count by thousands), and the zero-probability tokens never drawn."""
    weights = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 5.5, 0.0]])  # sums to 10
    sampler, seq = Sampler([EOS], seed=1), seq_with(SamplingParams(temperature=1.0))
    trials = 20_000
    counts = torch.bincount(torch.cat([sampler.draw(weights, [seq]) for _ in range(trials)]),
                            minlength=VOCAB)
    expected = weights[0] / weights.sum() * trials
    for token in range(VOCAB):
        p = float(weights[0, token] / weights.sum())
        assert abs(float(counts[token]) - float(expected[token])) <= 5 * math.sqrt(trials * p * (1 - p)), token
    assert all(int(counts[t]) == 0 for t in (0, 2, 5, 7))


def test_a_row_with_no_mass_gets_its_argmax_not_an_index_past_the_vocabulary():
    sampler = Sampler([EOS], seed=0)
    seqs = [seq_with(SamplingParams(temperature=1.0)) for _ in range(2)]
    probs = torch.tensor([[0.0] * VOCAB, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    assert sampler.draw(probs, seqs).tolist() == [0, 7]


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0, 0.0, 0.0, 0.0]])
    alone = [int(Sampler([EOS], seed=s).draw(probs, [seq_with(SamplingParams(seed=7))])[0])
             for s in range(3)]
    crowded = []
    for s in range(3):
        seqs = [seq_with(SamplingParams()), seq_with(SamplingParams(seed=7)), seq_with(SamplingParams())]
        crowded.append(int(Sampler([EOS], seed=s).draw(probs.repeat(3, 1), seqs)[1]))
    assert alone == crowded and len(set(alone)) == 1


def test_frequency_and_presence_penalties_move_the_argmax():
    logits = torch.tensor([[0.0, 0.0, -9.0, 1.0, 0.8, -9.0, -9.0, -9.0]])
    sampler = Sampler([EOS])
    plain = seq_with(SamplingParams(temperature=0.0), output=[3, 3])
    assert sampler(logits, [plain]).token_ids == [3]
    freq = seq_with(SamplingParams(temperature=0.0, frequency_penalty=0.2), output=[3, 3])
    assert sampler(logits, [freq]).token_ids == [4]  # 1.0 - 2 * 0.2 < 0.8
    pres = seq_with(SamplingParams(temperature=0.0, presence_penalty=0.1), output=[3, 3])
    assert sampler(logits, [pres]).token_ids == [3]  # 1.0 - 0.1 > 0.8


def test_repetition_penalty_covers_prompt_tokens():
    logits = torch.tensor([[2.0, 1.5, -9.0, -9.0, -9.0, -9.0, -9.0, -9.0]])
    s = seq_with(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[0])
    assert Sampler([EOS])(logits, [s]).token_ids == [1]  # 2.0 / 1.5 < 1.5


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.tensor([[0.0, 0.0, 5.0, 4.0, 1.0, 0.0, 0.0, 0.0]])
    early = seq_with(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,)))
    late = seq_with(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,)), output=[4, 4])
    assert Sampler([EOS])(logits.repeat(2, 1), [early, late]).token_ids == [4, 2]


def test_logprobs_are_the_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    s = seq_with(SamplingParams(temperature=0.5, logprobs=2, seed=1))
    out = Sampler([EOS])(logits, [s])
    lp = out.logprobs[0]
    expected = torch.log_softmax(logits[0], -1)
    assert lp.token_id == out.token_ids[0]
    assert math.isclose(lp.logprob, float(expected[lp.token_id]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [2, 1]


def test_top_k_one_equals_greedy(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = list(range(100, 130))
    [greedy] = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    [top1] = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.9, top_k=1,
                                                      ignore_eos=True))
    assert top1.choices[0].token_ids == greedy.choices[0].token_ids


def test_seed_gives_the_same_tokens_whatever_the_batch(tiny_model_dir):
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    prompt = list(range(200, 237))
    [alone] = make_engine(tiny_model_dir).generate([prompt], seeded)
    others = [list(range(300, 310)), list(range(400, 480)), list(range(500, 503))]
    mix = [SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True),
           SamplingParams(max_tokens=5, temperature=0.7, seed=9, ignore_eos=True),
           SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
    outs = make_engine(tiny_model_dir, max_num_batched_tokens=24).generate(
        [others[0], prompt, others[1], others[2]], [mix[0], seeded, mix[1], mix[2]])
    assert outs[1].choices[0].token_ids == alone.choices[0].token_ids
    other_seed = SamplingParams(max_tokens=24, temperature=1.0, seed=4321, ignore_eos=True)
    [different] = make_engine(tiny_model_dir).generate([prompt], other_seed)
    assert different.choices[0].token_ids != alone.choices[0].token_ids


def test_n_choices_share_prompt_blocks_and_differ(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=32)
    prompt = list(range(600, 640))  # 2 full blocks + 8 tokens in a shared partial block
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    request_id = engine.add_request(prompt, params)
    engine.step()  # prefill, fork, three first tokens
    seqs = engine._requests[request_id].request.seqs
    tables = [engine.kv.block_ids(s) for s in seqs]
    assert tables[0] == tables[1] == tables[2]
    assert [engine.pool.blocks[b].ref_cnt for b in tables[0]] == [3, 3, 3]
    engine.step()  # each choice writes its own token: the partial block is copied twice
    tables = [engine.kv.block_ids(s) for s in seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    while engine.has_unfinished:
        engine.step()
        if (out := engine.finished_output(request_id)) is not None:
            break
    texts = [tuple(c.token_ids) for c in out.choices]
    assert len(set(texts)) == 3
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    [again] = make_engine(tiny_model_dir, num_blocks=32).generate([prompt], params)
    assert [tuple(c.token_ids) for c in again.choices] == texts


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2), ("n", 0),
    ("max_tokens", 0), ("presence_penalty", 3), ("repetition_penalty", 0), ("logprobs", 21),
    ("temperature", "hot"), ("max_tokens", 1.5), ("stop", 5), ("stop_token_ids", "x"),
    ("ignore_eos", "yes"), ("seed", True), ("min_tokens", -1),
])
def test_invalid_sampling_values_name_their_field(field, value):
    with pytest.raises(SamplingError) as err:
        SamplingParams.from_dict({field: value})
    assert err.value.param == field
