"""Issue 12's request fields below HTTP: logit_bias in the sampler and the engine,
priority in the engine scheduler and the router's admission queue, prompt logprobs in
the engine, and the detokenizer's stop-string and special-token options."""

from __future__ import annotations

import pytest
import torch

from common.engine.request import Request
from common.engine.sampler import Sampler
from common.errors import InvalidRequestError
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
