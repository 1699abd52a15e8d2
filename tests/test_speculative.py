"""N-gram speculative decoding: greedy output identical to decoding without it on every
engine path, the rejection rule's distribution, the switch-offs, the flag.

The tiny model here has a 256-token vocabulary and small weights, so its greedy output
runs in repeated tokens: prompt lookup drafts often, and both accepts (inside a run) and
rejects (where a run changes). Every equality test also asserts that both happened.
"""

from __future__ import annotations

import pytest
import torch

from common.config import SpeculativeConfig
from common.engine.request import Request
from common.engine.sampler import Sampler
from common.engine.speculative import Speculator, propose_ngram, verify
from common.sampling_params import SamplingParams
from tests.conftest import make_engine, write_tiny_model
from tests.test_handoff import over_the_wire

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 3, list(range(10, 50)), [11, 12, 13] * 10, list(range(100, 140)) * 2]


@pytest.fixture(scope="module")
def repeat_dir(tmp_path_factory, smollm2_dir):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-repeat"), smollm2_dir, vocab_size=256,
                            initializer_range=0.1)


def outputs(results) -> list[list[list[int]]]:
    return [[c.token_ids for c in r.choices] for r in results]


def run_both(model_dir, prompts, params, spec=SPEC, **kw):
    """(outputs without speculation, outputs with it, the speculative engine)."""
    off = make_engine(model_dir, **kw).generate(prompts, params)
    engine = make_engine(model_dir, speculative=spec, **kw)
    on = engine.generate(prompts, params)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "a block leaked"
    return off, on, engine


def assert_accepted_and_rejected(engine) -> None:
    s = engine.stats()
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens, (s.num_accepted_tokens, s.num_draft_tokens)


# ---- the proposer and the acceptance rule -------------------------------------------


def test_propose_takes_the_most_recent_longest_match():
    #            0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    assert propose_ngram(tokens, 2, max_n=3) == [9, 2]  # "1 2 3" at 0..2, then 9 2
    assert propose_ngram(tokens, 2, max_n=2) == [8, 7]  # "2 3" most recently at 4..5
    assert propose_ngram(tokens, 5, max_n=1) == [8, 7, 1, 2, 3][:5]
    assert propose_ngram(tokens, 2, max_n=3, min_n=3) == [9, 2]
    assert propose_ngram([4, 5, 6], 2, max_n=3) == []  # 6 never occurred before
    assert propose_ngram([4, 5, 4, 6], 3, max_n=3, min_n=2) == []
    # A continuation that runs into the end repeats the span from the match to the end.
    assert propose_ngram([7, 7, 7], 4, max_n=2) == [7, 7, 7, 7]
    assert propose_ngram([5, 1, 2, 3, 1, 2, 3], 5, max_n=2) == [1, 2, 3, 1, 2]  # period 3
    assert propose_ngram([5, 1, 2, 3, 1, 2, 3], 2, max_n=2) == [1, 2]  # within the text
    assert propose_ngram([1, 2, 9, 1, 2], 4, max_n=2) == [9, 1, 2, 9]  # period 3 from "1 2"


def seq_with(params: SamplingParams):
    return Request("r", [1, 2, 3], params, max_tokens=100).seqs[0]


@pytest.fixture
def one_thread():
    """Tiny tensors: with two threads each softmax waits on a busy machine's second core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8, seed=5),
    SamplingParams(temperature=1.0, min_p=0.1),
])
def test_rejection_sampling_emits_the_target_distribution(params, one_thread):
    """Over many verifications with a fixed seed, the first token's frequencies match the
    sampler's processed distribution p1 (accepted or not), and after an accepted draft the
    second token's match p2 — within 5 standard errors (a wrong rule, e.g. accepting with
    probability 1/2 or drawing the replacement from all of p, is off by far more)."""
    torch.manual_seed(0)
    vocab, n = 6, 4000
    logits = torch.randn(3, vocab) * 1.5
    sampler = Sampler(eos_token_ids=(), seed=1)
    seq = seq_with(params)
    target = sampler.target_probs(logits, [seq] * 3)
    target = target / target.sum(dim=-1, keepdim=True)
    draft = (int(target[0].argsort()[-2]), int(target[1].argmax()))  # a likely, not the likeliest
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(n):
        tokens = verify(sampler, seq, draft, logits).token_ids
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            second[tokens[1]] += 1
    accepted = float(second.sum())
    for freq, p, count in ((first / n, target[0], n), (second / accepted, target[1], accepted)):
        bound = 5 * (p * (1 - p) / count).sqrt() + 1e-9
        assert ((freq - p).abs() <= bound).all(), (freq, p)
    assert accepted == pytest.approx(n * float(target[0, draft[0]]), rel=0.1)


def test_greedy_rule_accepts_the_matching_prefix_and_corrects():
    sampler = Sampler(eos_token_ids=())
    seq = seq_with(SamplingParams(temperature=0.0))
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate((3, 4, 6, 1)):
        logits[row, best] = 5.0
    assert verify(sampler, seq, (3, 4, 5), logits).token_ids == [3, 4, 6]
    assert verify(sampler, seq, (3, 4, 6), logits).token_ids == [3, 4, 6, 1]  # the bonus token
    assert verify(sampler, seq, (2, 4, 6), logits).token_ids == [3]


# ---- greedy equality on every path --------------------------------------------------


def test_greedy_equal_with_logprobs_and_both_outcomes(repeat_dir):
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=3)
    off, on, engine = run_both(repeat_dir, PROMPTS, params)
    assert outputs(on) == outputs(off)
    assert_accepted_and_rejected(engine)
    for a, b in zip(off, on, strict=True):
        for x, y in zip(a.choices[0].logprobs, b.choices[0].logprobs, strict=True):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_a_stop_token_inside_an_accepted_run_ends_there(repeat_dir):
    base = make_engine(repeat_dir).generate(PROMPTS[:1], GREEDY)[0].choices[0].token_ids
    stop = base[30]  # within the output's repeated runs
    params = SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=(stop,))
    off, on, engine = run_both(repeat_dir, PROMPTS[:1], params)
    assert outputs(on) == outputs(off) and on[0].choices[0].token_ids[-1] == stop
    assert engine.stats().num_accepted_tokens > 0


def test_chunked_prefill_under_a_tiny_budget(repeat_dir):
    """Budget 6: the 80-token prompt takes 14 steps and drafts are cut to fit (5 + 1)."""
    off, on, engine = run_both(repeat_dir, PROMPTS[3:], GREEDY, max_num_batched_tokens=6)
    assert outputs(on) == outputs(off)
    assert_accepted_and_rejected(engine)


def test_prefix_cache_hits_including_blocks_filled_by_accepted_drafts(repeat_dir):
    engine = make_engine(repeat_dir, speculative=SPEC)
    first = engine.generate(PROMPTS, GREEDY)
    again = [r.prompt_token_ids + r.choices[0].token_ids[:40] for r in first]  # prompt + output
    expected = outputs(make_engine(repeat_dir).generate(again, GREEDY))
    hits = engine.stats().prefix_hits
    assert outputs(engine.generate(again, GREEDY)) == expected
    s = engine.stats()
    assert s.prefix_hits - hits >= sum(len(p) // 16 * 16 for p in again) - 16 * len(again)
    assert s.num_free_blocks == s.num_blocks
    assert_accepted_and_rejected(engine)


def test_preemption_with_a_tiny_cache(repeat_dir):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    off, on, engine = run_both(repeat_dir, PROMPTS, params, num_blocks=36, block_size=4)
    assert outputs(on) == outputs(off)
    assert engine.stats().num_preemptions > 0
    assert_accepted_and_rejected(engine)


def test_n_choices_share_the_prompt_and_draft_each(repeat_dir):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=3)
    off, on, engine = run_both(repeat_dir, PROMPTS[:2], params, block_size=4)
    assert outputs(on) == outputs(off)
    assert_accepted_and_rejected(engine)


def test_decode_engine_speculates_on_handed_off_requests(repeat_dir):
    prefill = make_engine(repeat_dir, num_blocks=64, speculative=SPEC)
    decode = make_engine(repeat_dir, num_blocks=64, speculative=SPEC)
    ids = [prefill.add_request(p, GREEDY, request_id=f"r{i}", prefill_only=True)
           for i, p in enumerate(PROMPTS)]
    first, outs = {}, {}
    while prefill.has_unfinished:
        for u in prefill.step():
            first[u.request_id] = u.token_ids
        for h in prefill.take_handoffs():
            assert decode.add_prefilled(*over_the_wire(prefill, h))
            prefill.abort(h.request_id)
    assert prefill.stats().num_draft_tokens == 0  # a prefill engine never drafts
    while decode.has_unfinished:
        for u in decode.step():
            if u.finish_reason is not None and (done := decode.finished_output(u.request_id)):
                outs[done.request_id] = done.choices[0].token_ids
    assert [first[i] + outs[i][1:] for i in ids] == [o[0] for o in outputs(
        make_engine(repeat_dir).generate(PROMPTS, GREEDY))]
    assert decode.stats().num_free_blocks == decode.stats().num_blocks
    assert_accepted_and_rejected(decode)


def test_smollm2_copying_a_passage(smollm2_dir):
    """The real model asked to repeat a text: most drafts are accepted, output unchanged."""
    from tests.conftest import loaded_model

    loaded = loaded_model(smollm2_dir)
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat."
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat the following text exactly: {text}"}])
    params = SamplingParams(max_tokens=24, temperature=0.0)
    off, on, engine = run_both(smollm2_dir, [prompt], params, loaded=loaded)
    assert outputs(on) == outputs(off)
    s = engine.stats()
    assert s.num_accepted_tokens > s.num_draft_tokens / 2


# ---- sampling, switch-offs, the flag ------------------------------------------------


def test_seeded_sampling_with_speculation_is_reproducible(repeat_dir):
    params = SamplingParams(max_tokens=40, temperature=0.3, seed=7, ignore_eos=True, n=2)
    runs = []
    for _ in range(2):
        engine = make_engine(repeat_dir, speculative=SPEC)
        runs.append(outputs(engine.generate(PROMPTS[:2], params)))
        assert engine.stats().num_accepted_tokens > 0
    assert runs[0] == runs[1]


def test_no_drafts_in_a_step_with_more_decodes_than_the_limit(repeat_dir):
    spec = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=3)
    engine = make_engine(repeat_dir, speculative=spec)
    engine.generate(PROMPTS, GREEDY)  # four decoding at once, all the way
    assert engine.stats().num_draft_tokens == 0
    engine.generate(PROMPTS[:3], GREEDY)
    assert engine.stats().num_draft_tokens > 0


def test_a_request_with_low_acceptance_backs_off_then_probes_again():
    spec = SpeculativeConfig(num_speculative_tokens=2, min_acceptance_rate=0.5,
                             acceptance_smoothing=0.5, backoff_steps=3)
    speculator = Speculator(spec, max_num_batched_tokens=64, max_model_len=100)
    seq = seq_with(SamplingParams(temperature=0.0))
    seq.token_ids += [1, 2, 3]  # "1 2 3" repeats: a draft is always found
    seq.num_computed_tokens = seq.num_tokens - 1
    drafted = []
    for _ in range(8):
        draft = speculator.propose([seq]).get(seq)
        drafted.append(draft is not None)
        if draft:
            speculator.observe(seq, len(draft), 0)
    # rate 1 → 0.5 (still drafts) → 0.25: off for 3 steps, then one probe, off again
    assert drafted == [True, True, False, False, False, True, False, False]
    assert speculator.stats.num_draft_tokens == 6 and speculator.stats.num_accepted_tokens == 0


def test_penalties_and_min_tokens_do_not_draft():
    speculator = Speculator(SPEC, max_num_batched_tokens=64, max_model_len=100)
    for params in (SamplingParams(repetition_penalty=1.2), SamplingParams(min_tokens=5)):
        seq = seq_with(params)
        seq.token_ids += [1, 2, 3]
        seq.num_computed_tokens = seq.num_tokens - 1
        assert speculator.propose([seq]) == {}


def test_speculative_config_from_json_and_flags():
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (3, 4, 2)
    c = SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "prompt_lookup_max": 1}')
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (1, 1)
    c = SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "prompt_lookup_min": 1}')
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (3, 1)
    bad = ['{"method": "eagle", "num_speculative_tokens": 3}', '{"num_speculative_tokens": 3, "x": 1}',
           '{"prompt_lookup_max": 3}', '{"num_speculative_tokens": "3"}', '[1]', '{nope',
           '{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}']
    for text in bad:
        with pytest.raises(ValueError):
            SpeculativeConfig.from_json(text)

    from cli.main import build_parser
    from common.flags import engine_config
    from services import launcher

    flag = '{"method": "ngram", "num_speculative_tokens": 2}'
    args = build_parser().parse_args(["up", "--speculative-config", flag])
    assert engine_config(args).speculative == SpeculativeConfig(num_speculative_tokens=2)
    workers = [c for c in launcher.plan(args) if c.name.startswith(("prefill", "decode"))]
    assert workers and all(c.argv[c.argv.index("--speculative-config") + 1] == flag for c in workers)
    assert engine_config(build_parser().parse_args(["up"])).speculative is None
