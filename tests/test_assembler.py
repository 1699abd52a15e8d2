"""ResponseAssembler in process: order across two workers, stop strings, bare finishes."""

from __future__ import annotations

import pytest

from common.model.loader import resolve_model
from common.model.tokenizer import Tokenizer
from common.outputs import FinishReason
from common.protocol import Tokens
from common.sampling_params import SamplingParams
from services.gateway.assembler import ResponseAssembler

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(resolve_model(None).directory)


def tokens(index: int, ids: list[int], choice: int = 0, finish: str | None = None) -> Tokens:
    return Tokens("r", choice, index, ids, finish_reason=FinishReason(finish) if finish else None)


def assembler(tok: Tokenizer, **params) -> ResponseAssembler:
    return ResponseAssembler(tok, PROMPT, SamplingParams(max_tokens=16, **params))


def test_tokens_that_overtake_the_first_wait_for_it(tok):
    ids = tok.encode(" one two three")
    a = assembler(tok)
    assert a.feed(tokens(1, ids[1:], finish="length")) == []  # the decode worker was faster
    [first] = a.feed(tokens(0, ids[:1]))  # the prefill worker's first token releases all
    assert first.text == " one two three" and first.finish_reason == "length"
    assert [t.token_id for t in first.tokens] == ids
    assert a.finished and a.num_completion_tokens == len(ids) and a.num_prompt_tokens == 3


def test_a_stop_string_cuts_the_text_and_ends_the_choice(tok):
    ids = tok.encode(" red. blue")
    a = assembler(tok, stop=["."])
    deltas = a.feed(tokens(0, ids))
    assert "".join(d.text for d in deltas) == " red" and deltas[-1].finish_reason == "stop"
    assert a.finished
    assert a.feed(tokens(len(ids), tok.encode(" more"))) == []  # the workers had not heard


def test_choices_finish_apart_and_a_bare_finish_ends_one(tok):
    a = assembler(tok, n=2, temperature=1.0)
    a.feed(tokens(0, tok.encode(" a"), choice=0, finish="stop"))
    assert not a.finished
    [bare] = a.feed(tokens(0, [], choice=1, finish="length"))
    assert bare.tokens == [] and bare.finish_reason == "length" and a.finished
    assert a.feed(tokens(0, [5], choice=2)) == []  # no such choice: ignored, not a crash
