"""Incremental detokenization and stop strings, on SmolLM2's real tokenizer."""

from __future__ import annotations

import pytest

from common.model.tokenizer import Detokenizer, Tokenizer
from common.sampling_params import SamplingParams
from tests.conftest import make_engine


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer(smollm2_dir)


def stream_all(tok, text, stop=()):
    ids = tok.encode(text)
    stream = Detokenizer(tok, prompt_ids=[1, 2, 3], stop=stop)
    deltas = []
    for t in ids:
        d = stream.push(t)
        deltas.append(d.text)
        if d.stop:
            break
    deltas.append(stream.finish().text)
    return ids, deltas, stream


def test_deltas_add_up_to_the_decoded_text_with_multibyte_characters(tok):
    text = "Café ☕ costs 3€ — 北京欢迎你! 🙂🙂 done"
    ids, deltas, stream = stream_all(tok, text)
    assert "".join(deltas) == tok.decode(ids) == stream.text
    assert all("\ufffd" not in d for d in deltas)


def test_a_character_cut_off_by_the_end_shows_as_hf_decodes_it(tok):
    ids = tok.encode("price 北")
    assert len(ids) == 4  # "price", " " + two byte pieces: "北" spans three tokens
    cut = ids[:-1]  # ends one byte short of the character
    stream = Detokenizer(tok, prompt_ids=[1, 2, 3])
    shown = "".join(stream.push(t).text for t in cut)
    assert "\ufffd" not in shown  # held back while it could still complete
    shown += stream.finish().text
    assert shown == stream.text == tok.decode(cut) and shown.endswith("\ufffd")


def test_stop_string_across_token_boundaries_is_cut_and_never_shown(tok):
    text = "Hello world, this is a test of stopping."
    ids, deltas, stream = stream_all(tok, text, stop=("ld, th",))
    assert len(tok.encode("ld, th", )) > 1  # the stop string spans tokens
    assert stream.stopped == "ld, th"
    assert "".join(deltas) == stream.text == "Hello wor"
    assert not any("ld" in d for d in deltas)


def test_earliest_of_several_stop_strings_wins(tok):
    _, deltas, stream = stream_all(tok, "one two three four", stop=("four", "two"))
    assert stream.stopped == "two" and "".join(deltas) == "one "


def test_text_that_might_start_a_stop_string_is_held_back_then_released(tok):
    stream = Detokenizer(tok, prompt_ids=[], stop=("xyz!",))
    shown = ""
    for t in tok.encode("abc xy"):
        shown += stream.push(t).text
    assert "xy" not in shown  # could still become "xyz!"
    assert shown + stream.finish().text == "abc xy"


def test_engine_stops_on_a_string_and_reports_it(smollm2_dir):
    engine = make_engine(smollm2_dir, num_blocks=64)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    [full] = engine.generate([prompt], greedy)
    text = full.choices[0].text
    assert len(text) > 12
    stop = text[5:12]
    [cut] = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]))
    choice = cut.choices[0]
    assert choice.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert len(choice.token_ids) < len(full.choices[0].token_ids)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
