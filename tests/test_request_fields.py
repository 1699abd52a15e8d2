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


def test_logit_bias_entries_are_bounded_where_params_are_built():
    SamplingParams(logit_bias=tuple((t, 1.0) for t in range(1024)))
    with pytest.raises(ValueError, match="at most 1024"):  # a peer's message too, not only HTTP
        SamplingParams(logit_bias=tuple((t, 1.0) for t in range(1025)))


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
        return Submit.of(request_id, PROMPT, SamplingParams(max_tokens=8, priority=priority),
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


# ---- prompt logprobs: the engine against Hugging Face --------------------------------------


_HF_MODELS: dict = {}


def hf_prompt_logprobs(directory, prompt: list[int]) -> torch.Tensor:
    """log_softmax of HF transformers' logits over the prompt: [len - 1, vocab], row j
    scoring prompt token j + 1."""
    from transformers import AutoModelForCausalLM

    if str(directory) not in _HF_MODELS:
        _HF_MODELS[str(directory)] = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32).eval()
    model = _HF_MODELS[str(directory)]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def assert_prompt_logprobs_match(records, reference: torch.Tensor, prompt: list[int], k: int):
    assert [r.token_id for r in records] == prompt[1:]
    for j, r in enumerate(records):
        row = reference[j]
        assert r.logprob == pytest.approx(float(row[prompt[j + 1]]), abs=1e-4)
        assert r.rank == int((row > row[prompt[j + 1]]).sum()) + 1 or abs(
            float(row.sort(descending=True).values[r.rank - 1]) - r.logprob) < 1e-4  # a near tie
        best = row.topk(k)
        assert [t for t, _ in r.top] == best.indices.tolist() or k == 0
        assert [v for _, v in r.top] == pytest.approx(best.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget,caching", [(2048, True), (8, True), (8, False)],
                         ids=["one-pass", "chunked", "chunked-no-cache"])
def test_prompt_logprobs_equal_hf_whole_chunked_and_after_a_prefix_hit(tiny_model_dir, budget, caching):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=budget, enable_prefix_caching=caching)
    prompt = [(37 * i + 11) % 40000 + 3 for i in range(40)]  # 2 full blocks + 8 tokens
    reference = hf_prompt_logprobs(tiny_model_dir, prompt)
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY)
    [warm] = engine.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))  # cache the prefix
    [out] = engine.generate([prompt], params)
    assert out.num_cached_tokens == 0  # asking for prompt logprobs bypasses the prefix cache
    assert out.choices[0].token_ids == warm.choices[0].token_ids
    assert len(out.prompt_logprobs) == len(prompt) - 1
    assert_prompt_logprobs_match(out.prompt_logprobs, reference, prompt, 3)
    [again] = engine.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))
    assert again.prompt_logprobs is None
    assert again.num_cached_tokens == (32 if caching else 0)  # the cache still serves others


def test_prompt_logprobs_zero_alternatives_and_n_choices(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = list(range(500, 521))
    [out] = engine.generate([prompt], SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=3,
                                                     prompt_logprobs=0, ignore_eos=True))
    assert len(out.prompt_logprobs) == 20 and all(r.top == () for r in out.prompt_logprobs)
    assert_prompt_logprobs_match(out.prompt_logprobs, hf_prompt_logprobs(tiny_model_dir, prompt),
                                 prompt, 0)


def test_prompt_logprobs_travel_once_on_choice_0s_first_update(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=8)
    prompt = list(range(700, 720))
    rid = engine.add_request(prompt, SamplingParams(max_tokens=3, n=2, prompt_logprobs=1, **GREEDY))
    updates = []
    while engine.has_unfinished:
        updates.extend(engine.step())
        engine.finished_output(rid)
    carrying = [(u.choice, u.index) for u in updates if u.prompt_logprobs is not None]
    assert carrying == [(0, 0)]
    first = next(u for u in updates if u.prompt_logprobs is not None)
    assert [r.token_id for r in first.prompt_logprobs] == prompt[1:]


def test_a_preempted_prompt_keeps_its_scored_positions(tiny_model_dir):
    """Preempted in the middle of its chunked prompt: recomputed from 0, each prompt token
    still scored once, and the same as an undisturbed run."""
    prompt = list(range(900, 948))  # 3 blocks
    params = SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY)
    [alone] = make_engine(tiny_model_dir).generate([prompt], params)
    engine = make_engine(tiny_model_dir, num_blocks=4, max_num_batched_tokens=16)
    other = list(range(2000, 2015))  # 1 block, then a second at its 17th token
    ids = [engine.add_request(other, SamplingParams(max_tokens=20, **GREEDY)),
           engine.add_request(prompt, params)]
    results = {}
    while engine.has_unfinished:
        for u in engine.step():
            if u.finish_reason is not None and (out := engine.finished_output(u.request_id)):
                results[u.request_id] = out
    assert engine.scheduler.num_preemptions >= 1
    out = results[ids[1]]
    assert [r.token_id for r in out.prompt_logprobs] == prompt[1:]
    for got, want in zip(out.prompt_logprobs, alone.prompt_logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert abs(got.rank - want.rank) <= want.rank // 100  # deep ranks: fp32 near-ties
    assert out.choices[0].token_ids == alone.choices[0].token_ids


# ---- the gateway: parsing and response shapes ----------------------------------------------

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def tok():
    from common.model.loader import resolve_model
    from common.model.tokenizer import Tokenizer

    return Tokenizer(resolve_model(None).directory)


def _completion(tok, **fields):
    from services.gateway.parsing import parse_completion

    return parse_completion({"model": MODEL, "prompt": "Once upon a time", **fields}, tok, MODEL, 256)


def test_parsing_carries_the_new_fields(tok):
    from services.gateway.parsing import parse_chat

    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"7": -100, "12": 5},
                       "priority": -3, "include_stop_str_in_output": True,
                       "skip_special_tokens": False}, tok, MODEL, 256)
    p = chat.params
    assert (p.logit_bias, p.priority, p.include_stop_str_in_output, p.skip_special_tokens) == (
        ((7, -100.0), (12, 5.0)), -3, True, False)
    assert p.prompt_logprobs is None
    assert _completion(tok).params.prompt_logprobs is None
    asked = _completion(tok, prompt_logprobs=2)
    assert (asked.prompt_logprobs, asked.params.prompt_logprobs) == (2, 2)
    echoed = _completion(tok, echo=True, logprobs=3)
    assert (echoed.prompt_logprobs, echoed.params.prompt_logprobs, echoed.params.logprobs) == (None, 3, 3)
    both = _completion(tok, echo=True, logprobs=1, prompt_logprobs=4)
    assert (both.prompt_logprobs, both.params.prompt_logprobs) == (4, 4)
    assert _completion(tok, logprobs=3).params.prompt_logprobs is None  # no echo: no prompt


def _records(ids: list[int]) -> list:
    from common.outputs import TokenLogprob

    # token j scored -j/10, rank j, alternatives: token 5 then the token itself
    return [TokenLogprob(t, -j / 10, ((5, -0.01), (t, -j / 10)), j) for j, t in enumerate(ids[1:], 1)]


def test_vllm_prompt_logprobs_shape(tok):
    from services.gateway.prompt_logprobs import prompt_logprobs_for
    from services.gateway.responses import ChoiceResult, text_completion, usage

    req = _completion(tok, prompt_logprobs=1)
    ids = req.prompt_token_ids
    prompt = prompt_logprobs_for(req, _records(ids), tok.token_text)
    body = text_completion(req, [ChoiceResult(0, " there", "length")], usage(len(ids), 1), prompt)
    field = body["choices"][0]["prompt_logprobs"]
    assert field[0] is None and len(field) == len(ids)
    assert field[1] == {str(ids[1]): {"logprob": -0.1, "rank": 1, "decoded_token": tok.token_text(ids[1])},
                        "5": {"logprob": -0.01, "rank": 1, "decoded_token": tok.token_text(5)}}
    assert list(field[2]) == [str(ids[2]), "5"]  # the prompt token first, then the top k
    assert body["choices"][0]["logprobs"] is None and body["choices"][0]["text"] == " there"
    plain = text_completion(_completion(tok), [ChoiceResult(0, "x", "length")], usage(1, 1))
    assert "prompt_logprobs" not in plain["choices"][0]


def test_echo_with_logprobs_leads_with_the_prompt_tokens(tok):
    from services.gateway.prompt_logprobs import prompt_logprobs_for
    from services.gateway.responses import (
        ChoiceResult,
        ChunkFormatter,
        LogprobEntry,
        text_completion,
        usage,
    )

    req = _completion(tok, echo=True, logprobs=1)
    ids = req.prompt_token_ids
    prompt = prompt_logprobs_for(req, _records(ids), tok.token_text)
    out = [LogprobEntry(9, tok.token_text(9), -0.5, ((9, tok.token_text(9), -0.5),))]
    body = text_completion(req, [ChoiceResult(0, tok.token_text(9), "length", out)], usage(4, 1), prompt)
    choice = body["choices"][0]
    assert choice["text"] == "Once upon a time" + tok.token_text(9)
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.token_text(t) for t in ids] + [tok.token_text(9)]
    assert lp["token_logprobs"] == [None] + [-j / 10 for j in range(1, len(ids))] + [-0.5]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {tok.token_text(5): -0.01, tok.token_text(ids[1]): -0.1}  # k = 1
    assert lp["text_offset"][0] == 0 and lp["text_offset"][-1] == sum(len(t) for t in lp["tokens"][:-1])
    assert "prompt_logprobs" not in choice  # not asked for
    fmt = ChunkFormatter(req)
    first = fmt.chunk(0, tok.token_text(9), out, None, prompt)["choices"][0]
    assert first["text"] == choice["text"] and first["logprobs"] == lp
    later = fmt.chunk(0, "y", out, "length", prompt)["choices"][0]
    assert later["logprobs"]["token_logprobs"] == [-0.5]  # the prompt only leads the first


# ---- include_stop_str_in_output, skip_special_tokens: the detokenizer ----------------------


def _stream(tok, ids, **kw):
    from common.model.tokenizer import Detokenizer

    d = Detokenizer(tok, [1, 2, 3], **kw)
    deltas = []
    for t in ids:
        delta = d.push(t)
        deltas.append(delta.text)
        if delta.stop:
            break
    deltas.append(d.finish().text)
    return "".join(deltas), d.stopped


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_tokens_is_cut_or_kept_whole(tok, include):
    ids = tok.encode("The cat sat on the mat and slept")
    stop = "t on th"  # spans several tokens
    text, stopped = _stream(tok, ids, stop=(stop, "never"), include_stop=include)
    assert stopped == stop
    assert text == ("The cat sat on th" if include else "The cat sa")


def test_special_tokens_stay_in_the_text_unless_skipped(tok):
    ids = tok.encode("hello") + [tok.eos_token_ids[0]] + tok.encode(" world")
    special = tok.token_text(tok.eos_token_ids[0])
    assert special.startswith("<|")
    assert _stream(tok, ids)[0] == "hello world"
    assert _stream(tok, ids, skip_special_tokens=False)[0] == f"hello{special} world"


def test_prompt_logprobs_that_would_overflow_one_message_are_a_400(tok):
    from services.gateway.errors import APIError
    from services.gateway.parsing import MAX_PROMPT_LOGPROB_ENTRIES, parse_completion

    long_prompt = [5] * 20000
    body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 1}
    assert parse_completion({**body, "prompt_logprobs": 5}, tok, MODEL, 32768).params.prompt_logprobs == 5
    with pytest.raises(APIError) as e:
        parse_completion({**body, "prompt_logprobs": 20}, tok, MODEL, 32768)
    assert e.value.param == "prompt_logprobs" and str(MAX_PROMPT_LOGPROB_ENTRIES) in e.value.message


def test_the_openapi_schemas_describe_the_new_fields():
    import jsonschema

    from services.gateway import openapi

    chat, comp = openapi.chat_request(MODEL, 49152), openapi.completion_request(MODEL, 49152)
    ok = {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"12": -100, "7": 2.5},
          "priority": -5, "include_stop_str_in_output": True, "skip_special_tokens": False}
    jsonschema.validate(ok, chat)
    jsonschema.validate({"prompt": "a", "echo": True, "logprobs": 2, "prompt_logprobs": 20}, comp)
    assert "prompt_logprobs" not in chat["properties"]
    for bad in [{"logit_bias": {"x": 1}}, {"logit_bias": {"1": 101}}, {"priority": 2**31},
                {"include_stop_str_in_output": "yes"}]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**ok, **bad}, chat)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"prompt": "a", "prompt_logprobs": 21}, comp)


def test_an_engine_with_one_seat_serves_a_later_urgent_request_before_earlier_ones(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_seqs=1)
    order = []
    ids = {engine.add_request(list(range(10, 20)), SamplingParams(max_tokens=3, **GREEDY)): "first"}
    engine.step()  # "first" holds the only seat
    for name, prio in [("low", 5), ("default", 0), ("urgent", -1)]:
        ids[engine.add_request(list(range(30, 40)), SamplingParams(max_tokens=3, priority=prio,
                                                                   **GREEDY))] = name
    while engine.has_unfinished:
        for u in engine.step():
            if u.finish_reason is not None and engine.finished_output(u.request_id):
                order.append(ids[u.request_id])
    assert order == ["first", "urgent", "default", "low"]


def test_the_eos_or_stop_token_that_ends_a_choice_has_no_text_unless_included(tok):
    from common.protocol import Tokens
    from services.gateway.assembler import ResponseAssembler

    ids = tok.encode(" red blue")
    eos = tok.eos_token_ids[0]
    for stop_ids, include, want in [((), False, " red blue"), ((), True, " red blue<|im_end|>")]:
        a = ResponseAssembler(tok, [1, 2, 3], SamplingParams(
            max_tokens=8, skip_special_tokens=False, include_stop_str_in_output=include,
            stop_token_ids=stop_ids))
        deltas = a.feed(Tokens("r", 0, 0, [*ids, eos], finish_reason=FinishReason.STOP))
        assert "".join(d.text for d in deltas) == want
        assert [t.token_id for d in deltas for t in d.tokens] == [*ids, eos]  # still counted
    blue = ids[-1]
    a = ResponseAssembler(tok, [1, 2, 3], SamplingParams(max_tokens=8, stop_token_ids=(blue,)))
    assert "".join(d.text for d in a.feed(Tokens("r", 0, 0, ids, finish_reason=FinishReason.STOP))) == " red"
    a = ResponseAssembler(tok, [1, 2, 3], SamplingParams(max_tokens=2, skip_special_tokens=False))
    text = a.feed(Tokens("r", 0, 0, [ids[0], eos], finish_reason=FinishReason.LENGTH))[0].text
    assert text == " red<|im_end|>"  # ended by length (ignore_eos): the token is shown
    a = ResponseAssembler(tok, [1, 2, 3], SamplingParams(max_tokens=8))
    deltas = a.feed(Tokens("r", 0, 0, ids, finish_reason=FinishReason.STOP))  # not a stop token
    assert "".join(d.text for d in deltas) == " red blue"


def test_a_sequence_past_its_first_token_scores_nothing_and_may_use_the_prefix_cache():
    from common.engine.prompt_logprobs import needs_prompt_logprobs, wanted_positions

    seq = Request("r", list(range(10)), SamplingParams(prompt_logprobs=1), max_tokens=4).seqs[0]
    assert needs_prompt_logprobs(seq) and wanted_positions(seq, 0, 10) == range(0, 9)
    assert wanted_positions(seq, 4, 6) == range(4, 6)
    seq.token_ids.append(5)  # e.g. a fork, or a request prefilled on another worker
    assert not needs_prompt_logprobs(seq) and wanted_positions(seq, 0, 11) == range(0)
    plain = Request("p", list(range(10)), SamplingParams(), max_tokens=4).seqs[0]
    assert not needs_prompt_logprobs(plain) and wanted_positions(plain, 0, 10) == range(0)
