"""Structured outputs in one process: spec checks, masks against llguidance's own answer,
rollback, the accepting state, failures, and the engine paths (n > 1, chunked prefill,
prefix hits, preemption, speculative decoding, a P/D handoff) on a tiny random model
whose junk the mask must force into shape."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import numpy as np
import pytest
import torch

from common.config import SpeculativeConfig
from common.engine.constraints import Constraints, apply_masks, forbidden_tokens, unpack_bitmask
from common.engine.request import Request
from common.grammar import (
    GrammarError,
    check,
    grammar_of,
    ll_tokenizer,
    structured_from_choices,
    structured_from_json_schema,
)
from common.sampling_params import SamplingParams
from common.structured import StructuredKind, StructuredOutput
from tests.conftest import loaded_model, make_engine
from tests.test_handoff import over_the_wire

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
# Bounded, so even greedy decoding of a random model must close the object.
BOUNDED = {"type": "object", "additionalProperties": False, "required": ["n", "tag", "flags"],
           "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                          "tag": {"enum": ["red", "green"]},
                          "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}
EOS = 2


def json_params(schema=BOUNDED, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 64)
    kw.setdefault("temperature", 0.0)
    return SamplingParams(structured=structured_from_json_schema(schema), **kw)


def texts(results) -> list[str]:
    return [c.text for r in results for c in r.choices]


# ---- checking specs -----------------------------------------------------------------

@pytest.mark.parametrize(("structured", "param", "words"), [
    (StructuredOutput(StructuredKind.JSON, "{"), "json_schema", "not valid JSON"),
    (StructuredOutput(StructuredKind.JSON, '{"type": "foo"}'), "json_schema", "type"),
    (StructuredOutput(StructuredKind.JSON, "[1]"), "json_schema", "must be a JSON object"),
    (StructuredOutput(StructuredKind.REGEX, "[a-"), "regex", "unclosed character class"),
    (StructuredOutput(StructuredKind.REGEX, ""), "regex", "empty"),
    (StructuredOutput(StructuredKind.CHOICE, "[]"), "choice", "empty"),
    (StructuredOutput(StructuredKind.CHOICE, '["a", 1]'), "choice", "list of strings"),
    (StructuredOutput(StructuredKind.GRAMMAR, "start: foo"), "grammar", 'unknown name: "foo"'),
    (StructuredOutput(StructuredKind.GRAMMAR, "  "), "grammar", "empty"),
])
def test_a_bad_spec_is_an_error_naming_the_problem(structured, param, words):
    with pytest.raises(GrammarError) as e:
        check(structured)
    assert e.value.param == param and words in e.value.message, e.value.message


@pytest.mark.parametrize("schema", [
    {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    {"oneOf": [{"const": "x"}, {"type": "object", "properties": {"y": {"type": "number"}}}]},
    {"enum": [1, "two", None]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "boolean"}}},
     "minItems": 1},
    {"type": "object", "properties": {"name": {"type": "string", "description": "who"},
                                      "args": {"type": "object"}}, "required": ["name"]},
])
def test_tool_call_shaped_schemas_compile(schema):
    check(StructuredOutput(StructuredKind.JSON, json.dumps(schema)))


def test_strict_refuses_keywords_it_cannot_enforce():
    schema = {"type": "string", "format": "no-such-format"}
    check(structured_from_json_schema(schema))  # best effort: ignored
    with pytest.raises(GrammarError, match="no-such-format"):
        check(structured_from_json_schema(schema, strict=True))


def test_helpers_refuse_what_is_not_a_schema_or_a_choice_list():
    with pytest.raises(GrammarError):
        structured_from_json_schema(["not", "an", "object"])
    with pytest.raises(GrammarError):
        structured_from_choices("yes")
    assert json.loads(structured_from_choices(["a", "b"]).spec) == ["a", "b"]


def test_lark_and_gbnf_grammars_are_accepted():
    check(StructuredOutput(StructuredKind.GRAMMAR, 'start: "yes" | "no"'))
    check(StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "a" [0-9]+'))


# ---- masks --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return loaded_model(tiny_model_dir)


@pytest.fixture
def constraints(tiny) -> Constraints:
    return Constraints(tiny.tokenizer, tiny.spec.vocab_size, (EOS,), num_threads=1)


def reference_mask(tiny, structured: StructuredOutput, tokens: list[int]) -> np.ndarray:
    """llguidance's own answer: a fresh matcher fed ``tokens``, as bools per token."""
    matcher = llguidance.LLMatcher(ll_tokenizer(tiny.tokenizer, tiny.spec.vocab_size, (EOS,)),
                                   grammar_of(structured))
    assert matcher.consume_tokens(tokens), matcher.get_error()
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(words, bitorder="little")[: tiny.spec.vocab_size].astype(bool)


def seq_with_output(structured: StructuredOutput, output: list[int], n: int = 1):
    request = Request("r", [1, 5, 9], SamplingParams(structured=structured, n=n), 100)
    seq = request.seqs[0]
    seq.token_ids.extend(output)
    return seq


def allowed_of(seq) -> np.ndarray:
    return unpack_bitmask(seq.constraint.mask, seq.constraint.mask.shape[1] * 32)[0].numpy()


def test_masks_equal_llguidance_at_every_position(tiny, constraints):
    structured = structured_from_json_schema(BOUNDED)
    text = '{"n":42,"tag":"red","flags":[true,false]}'
    tokens = tiny.tokenizer.hf.encode(text, add_special_tokens=False)
    seq = seq_with_output(structured, [])
    for i in range(len(tokens) + 1):
        constraints.prepare([seq], [])
        got = allowed_of(seq)[: tiny.spec.vocab_size]
        assert np.array_equal(got, reference_mask(tiny, structured, tokens[:i])), i
        if i < len(tokens):
            seq.token_ids.append(tokens[i])
    assert np.flatnonzero(got).tolist() == [EOS]  # the object is closed: only EOS may follow
    assert seq.constraint.matcher.is_accepting()


def test_apply_masks_sets_forbidden_tokens_to_minus_infinity(tiny, constraints):
    structured = StructuredOutput(StructuredKind.CHOICE, '["yes", "no"]')
    constrained, free = seq_with_output(structured, []), Request("f", [1], SamplingParams(), 9).seqs[0]
    constraints.prepare([constrained, free], [])
    logits = torch.randn(2, tiny.spec.vocab_size)
    out = apply_masks(logits, [constrained, free])
    allowed = reference_mask(tiny, structured, [])
    assert torch.equal(out[1], logits[1])  # an unconstrained row is untouched
    assert torch.equal(out[0][torch.from_numpy(allowed)], logits[0][torch.from_numpy(allowed)])
    assert torch.isinf(out[0][torch.from_numpy(~allowed)]).all() and 0 < allowed.sum() < 10


def test_unpack_bitmask_matches_numpy():
    words = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32)
    expected = np.unpackbits(words.numpy().view(np.uint8), bitorder="little").reshape(3, -1)
    assert np.array_equal(unpack_bitmask(words, 150).numpy(), expected[:, :150].astype(bool))
    assert torch.equal(forbidden_tokens(words, 150, torch.device("cpu")), ~unpack_bitmask(words, 150))


def test_a_batch_of_only_constrained_rows_is_masked_in_one_pass(tiny, constraints):
    structured = StructuredOutput(StructuredKind.CHOICE, '["yes", "no"]')
    seqs = [seq_with_output(structured, []), seq_with_output(structured, [])]
    constraints.prepare(seqs, [])
    logits = torch.randn(2, tiny.spec.vocab_size)
    out = apply_masks(logits, seqs)
    allowed = torch.from_numpy(reference_mask(tiny, structured, []))
    assert torch.isfinite(out).eq(allowed).all() and torch.equal(out[:, allowed], logits[:, allowed])


def test_a_rewound_output_rolls_the_matcher_back(tiny, constraints):
    structured = structured_from_json_schema(SCHEMA)
    first = tiny.tokenizer.hf.encode('{"a":123', add_special_tokens=False)
    other = tiny.tokenizer.hf.encode('{"a":-', add_special_tokens=False)
    seq = seq_with_output(structured, first)
    constraints.prepare([seq], [])
    del seq.token_ids[seq.num_prompt_tokens:]
    seq.token_ids.extend(other)
    constraints.prepare([seq], [])
    assert seq.constraint.consumed == other
    assert np.array_equal(allowed_of(seq)[: tiny.spec.vocab_size],
                          reference_mask(tiny, structured, other))


def test_draft_rows_are_the_states_after_each_draft_prefix(tiny, constraints):
    structured = structured_from_json_schema(SCHEMA)
    done = tiny.tokenizer.hf.encode('{"a"', add_special_tokens=False)
    draft = tiny.tokenizer.hf.encode(':7}', add_special_tokens=False)
    seq = seq_with_output(structured, done)
    constraints.prepare([], [(seq, tuple(draft))])
    assert seq.constraint.mask.shape[0] == 1 + len(draft)
    for j in range(len(draft) + 1):
        rows = unpack_bitmask(seq.constraint.mask[j : j + 1], seq.constraint.mask.shape[1] * 32)
        assert np.array_equal(rows[0].numpy()[: tiny.spec.vocab_size],
                              reference_mask(tiny, structured, done + draft[:j])), j
    assert seq.constraint.consumed == done  # the draft was rolled back
    # verify's rows: the same sequence 1 + k times takes its mask rows in order
    logits = apply_masks(torch.zeros(1 + len(draft), tiny.spec.vocab_size), [seq] * (1 + len(draft)))
    assert all(torch.isfinite(logits[j, t]) for j, t in enumerate(draft))


def test_a_broken_matcher_fails_its_sequence_with_eos_only(tiny, constraints):
    structured = structured_from_json_schema(SCHEMA)
    bad = tiny.tokenizer.hf.encode("hello", add_special_tokens=False)
    broken, fine = seq_with_output(structured, bad), seq_with_output(structured, [])
    constraints.prepare([broken, fine], [])
    [(seq, reason)] = constraints.take_failures()
    assert seq is broken and "structured output failed" in reason
    assert np.flatnonzero(allowed_of(broken)).tolist() == [EOS]
    assert allowed_of(fine).sum() > 0 and constraints.take_failures() == []


def test_min_tokens_yields_to_a_complete_grammar(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(max_tokens=30, temperature=0.0, min_tokens=25,
                            structured=structured_from_choices(["yes", "no"]))
    [out] = engine.generate([[1, 2, 3]], params)
    assert out.choices[0].text in ("yes", "no") and out.choices[0].finish_reason == "stop"


# ---- the engine's paths -------------------------------------------------------------

PROMPTS = [list(range(60, 60 + n)) for n in (3, 20, 45)]


def assert_valid(outputs: list[str], schema=BOUNDED) -> None:
    for text in outputs:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("kw", [
    {},  # plain
    {"max_num_batched_tokens": 8},  # chunked prefill
    {"num_blocks": 36, "block_size": 4},  # preemption by recompute
])
def test_engine_output_is_schema_valid(tiny_model_dir, kw):
    engine = make_engine(tiny_model_dir, **kw)
    results = engine.generate(PROMPTS, json_params(n=2, temperature=1.0, seed=3))
    assert all(c.finish_reason == "stop" for r in results for c in r.choices)
    assert_valid(texts(results))
    assert len(set(texts(results))) > 1  # sampled choices differ, each valid
    if "num_blocks" in kw:
        assert engine.stats().num_preemptions > 0
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_a_prefix_hit_resumes_nothing_it_should_not(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = list(range(100, 140))
    first = engine.generate([prompt], json_params())
    hits = engine.stats().prefix_hits
    again = engine.generate([prompt], json_params())
    assert engine.stats().prefix_hits > hits
    assert texts(again) == texts(first)
    assert_valid(texts(again))


def test_regex_and_choice_outputs_match(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    pattern = r"[a-c]{2}-[0-9]{1,3}"
    regex = SamplingParams(max_tokens=20, temperature=1.0, seed=5, n=3,
                           structured=StructuredOutput(StructuredKind.REGEX, pattern))
    choice = SamplingParams(max_tokens=20, temperature=1.0, seed=5, n=3,
                            structured=structured_from_choices(["alpha", "beta gamma", "δ"]))
    for text in texts(engine.generate(PROMPTS, regex)):
        assert re.fullmatch(pattern, text), text
    for text in texts(engine.generate(PROMPTS, choice)):
        assert text in ("alpha", "beta gamma", "δ"), text


def run_failing(engine) -> tuple[dict, dict]:
    """Step to the end as a worker does: (errors by request, finished outputs by request);
    a request the engine ended with an error is aborted, as the worker aborts it."""
    errors, done = {}, {}
    while engine.has_unfinished:
        for u in engine.step():
            if u.error is not None:
                errors[u.request_id] = u.error
                engine.abort(u.request_id)
            elif u.finish_reason is not None and (out := engine.finished_output(u.request_id)):
                done[u.request_id] = out
    return errors, done


def test_a_grammar_that_fails_in_the_worker_fails_only_its_request(tiny_model_dir, monkeypatch):
    from common.grammar import GrammarCache

    engine = make_engine(tiny_model_dir)
    real = GrammarCache.new_matcher

    def refuse(self, structured):
        if structured.kind is StructuredKind.REGEX:
            raise GrammarError(structured.kind, "too complex for this tokenizer")
        return real(self, structured)

    monkeypatch.setattr(GrammarCache, "new_matcher", refuse)
    bad = engine.add_request([1, 2, 3], SamplingParams(
        max_tokens=8, structured=StructuredOutput(StructuredKind.REGEX, "a+")))
    good = engine.add_request([1, 2, 3], json_params())
    errors, done = run_failing(engine)
    assert "too complex" in errors[bad] and list(done) == [good]
    assert_valid(texts(done.values()))
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


@pytest.mark.parametrize("spec", ["[" * 50000, '{"type": "string", "minLength": 99999999999999999999}'])
def test_a_spec_no_gateway_checked_fails_only_its_request(tiny_model_dir, spec):
    """A peer may send what the gateway would have refused: that request ends with an
    error, the step and the other request go on, and every block comes back."""
    engine = make_engine(tiny_model_dir)
    bad = engine.add_request([1, 2, 3], SamplingParams(
        max_tokens=8, structured=StructuredOutput(StructuredKind.JSON, spec)))
    good = engine.add_request([1, 2, 3], json_params())
    errors, done = run_failing(engine)
    assert "cannot be compiled" in errors[bad] and list(done) == [good]
    assert_valid(texts(done.values()))
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_structured_needs_a_tokenizer(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine.constraints.tokenizer = None
    with pytest.raises(Exception, match="tokenizer"):
        engine.add_request([1, 2], json_params())


def test_speculative_decoding_keeps_output_valid_and_unchanged(tiny_model_dir, tiny):
    # A prompt holding JSON of the schema's shape: prompt lookup drafts from it.
    sample = '{"n":12,"tag":"green","flags":[true,true]} {"n":12,"tag":"green","flags":[true]}'
    prompt = tiny.tokenizer.hf.encode(sample, add_special_tokens=False) * 2
    prompts = [prompt, prompt[5:], PROMPTS[1]]
    params = json_params(n=2)
    off = make_engine(tiny_model_dir).generate(prompts, params)
    spec = make_engine(tiny_model_dir, speculative=SpeculativeConfig(num_speculative_tokens=4))
    on = spec.generate(prompts, params)
    assert texts(on) == texts(off)
    assert_valid(texts(on))
    s = spec.stats()
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens, (s.num_accepted_tokens, s.num_draft_tokens)
    sampled = spec.generate(prompts, json_params(n=2, temperature=1.0, seed=9))
    assert_valid(texts(sampled))


def test_a_handoff_resumes_the_matcher_from_the_first_token(tiny_model_dir):
    prefill = make_engine(tiny_model_dir, num_blocks=64)
    decode = make_engine(tiny_model_dir, num_blocks=64)
    params = json_params(n=2, temperature=1.0, seed=4)
    prefill.add_request(PROMPTS[2], params, request_id="r", prefill_only=True)
    first = {}
    while prefill.has_unfinished:
        for u in prefill.step():
            first[u.choice] = u.token_ids
        for h in prefill.take_handoffs():
            assert decode.add_prefilled(*over_the_wire(prefill, h))
            prefill.abort(h.request_id)
    out = None
    while decode.has_unfinished:
        for u in decode.step():
            if u.finish_reason is not None:
                out = decode.finished_output(u.request_id) or out
    tokenizer = decode.tokenizer
    full = [tokenizer.decode(first[c.index] + c.token_ids[1:]) for c in out.choices]
    assert_valid(full)
    colocated = make_engine(tiny_model_dir).generate([PROMPTS[2]], params)
    assert full == texts(colocated)  # seeded: the same tokens as one engine doing both


def test_a_moved_request_resumes_from_the_output_in_its_prompt(tiny_model_dir, tiny):
    """The gateway continues a request elsewhere with the delivered tokens in the prompt
    (``services.gateway.resume``): the matcher reads them first."""
    from dataclasses import replace

    from services.gateway.parsing import ParsedRequest
    from services.gateway.resume import Attempt, continuations

    delivered = tiny.tokenizer.hf.encode('{"n":4', add_special_tokens=False)
    parsed = ParsedRequest("completion", "m", [1, 2, 3], json_params(n=2))
    [moved] = continuations(parsed, Attempt("r", 1), lambda choice: delivered, [1])
    assert moved.params.structured.num_output_in_prompt == len(delivered)
    assert moved.prompt_token_ids == [1, 2, 3] + delivered
    [out] = make_engine(tiny_model_dir).generate([moved.prompt_token_ids], moved.params)
    assert_valid(['{"n":4' + out.choices[0].text])
    with pytest.raises(Exception, match="exceeds the prompt"):
        structured = replace(moved.params.structured, num_output_in_prompt=99)
        make_engine(tiny_model_dir).add_request([1, 2], replace(moved.params, structured=structured))


def test_ignore_eos_goes_on_with_eos_after_the_grammar_ends(tiny_model_dir):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                            structured=structured_from_choices(["yes", "no"]))
    [out] = make_engine(tiny_model_dir).generate([[1, 2, 3]], params)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.token_ids[1:] == [EOS] * 5
