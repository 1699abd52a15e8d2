"""The gateway's OpenAI API without HTTP: request validation (``parsing``, ``prompts``)
and response shapes (``responses``)."""

from __future__ import annotations

import json
import random

import pytest

from common.errors import PromptTooLongError
from common.model.loader import resolve_model
from common.model.tokenizer import Tokenizer
from services.gateway.errors import APIError
from services.gateway.parsing import ParsedRequest, parse_chat, parse_completion
from services.gateway.responses import (
    SSE_DONE,
    ChoiceResult,
    ChunkFormatter,
    LogprobEntry,
    chat_completion,
    models_list,
    sse,
    text_completion,
    usage,
)

MODEL = "SmolLM2-135M-Instruct"
MAX_LEN = 256
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(resolve_model(None).directory)


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": HI, **fields}


def comp(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", **fields}


def parse(kind: str, body, tok: Tokenizer, max_len: int = MAX_LEN) -> ParsedRequest:
    fn = parse_chat if kind == "chat" else parse_completion
    return fn(body, tok, MODEL, max_len)


LONG = "hello " * 300  # about 300 tokens, more than MAX_LEN
BAD = [
    # (kind, body, status, param, message substring)
    ("chat", [], 400, None, "JSON object"),
    ("chat", "hi", 400, None, "JSON object"),
    ("completion", None, 400, None, "JSON object"),
    ("chat", {"model": MODEL}, 400, "messages", "Missing required parameter"),
    ("chat", chat(messages=[]), 400, "messages", "at least one"),
    ("chat", chat(messages="hi"), 400, "messages", "must be an array"),
    ("chat", chat(messages=["hi"]), 400, "messages.[0]", "must be an object"),
    ("chat", chat(messages=[{"content": "x"}]), 400, "messages.[0].role", "Missing"),
    ("chat", chat(messages=[*HI, {"role": "bot", "content": "x"}]), 400, "messages.[1].role",
     "supported values"),
    ("chat", chat(messages=[{"role": ["user"], "content": "x"}]), 400, "messages.[0].role",
     "invalid value"),
    ("chat", chat(messages=[{"role": "user"}]), 400, "messages.[0].content", "string or an array"),
    ("chat", chat(messages=[{"role": "user", "content": 5}]), 400, "messages.[0].content",
     "string or an array"),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]), 400,
     "messages.[0].content.[0]", "text part"),
    ("chat", chat(messages=[{"role": "user", "content": ["hi"]}]), 400,
     "messages.[0].content.[0]", "text part"),
    ("chat", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400,
     "messages.[0].content.[0]", "not supported"),
    ("chat", chat(messages=[{"role": "user", "content": "\ud800"}]), 400,
     "messages.[0].content", "surrogate"),
    ("chat", chat(model="gpt-4"), 404, "model", "does not exist"),
    ("chat", chat(model=3), 400, "model", "must be a string"),
    ("completion", comp(model="other"), 404, "model", "`other`"),
    ("completion", {"model": MODEL}, 400, "prompt", "Missing required parameter"),
    ("completion", comp(prompt=["a", "b"]), 400, "prompt", "not supported yet"),
    ("completion", comp(prompt=[[1, 2], [3]]), 400, "prompt", "not supported yet"),
    ("completion", comp(prompt=[]), 400, "prompt", "must not be empty"),
    ("completion", comp(prompt=""), 400, "prompt", "must not be empty"),
    ("completion", comp(prompt=[1, True]), 400, "prompt", "must be an integer"),
    ("completion", comp(prompt=[1, 2.0]), 400, "prompt", "must be an integer"),
    ("completion", comp(prompt=[1, -1]), 400, "prompt", "[0, 49152)"),
    ("completion", comp(prompt=[49152]), 400, "prompt", "[0, 49152)"),
    ("completion", comp(prompt={"text": "x"}), 400, "prompt", "string or an array"),
    ("completion", comp(prompt=5), 400, "prompt", "string or an array"),
    ("chat", chat(temperature="hot"), 400, "temperature", "must be a number"),
    ("chat", chat(temperature=3000), 400, "temperature", "[0, 100]"),
    ("completion", comp(top_p=0), 400, "top_p", "(0, 1]"),
    ("chat", chat(presence_penalty=[1]), 400, "presence_penalty", "must be a number"),
    ("chat", chat(frequency_penalty=5), 400, "frequency_penalty", "[-2, 2]"),
    ("chat", chat(max_tokens=0), 400, "max_tokens", ">= 1"),
    ("chat", chat(max_tokens="10"), 400, "max_tokens", "must be an integer"),
    ("chat", chat(max_completion_tokens=1.5), 400, "max_completion_tokens", "must be an integer"),
    ("chat", chat(max_completion_tokens=8, max_tokens=-1), 400, "max_tokens", ">= 1"),
    ("completion", comp(max_tokens=True), 400, "max_tokens", "must be an integer"),
    ("chat", chat(n=0), 400, "n", "[1, 128]"),
    ("chat", chat(n=129), 400, "n", "[1, 128]"),
    ("completion", comp(n="2"), 400, "n", "must be an integer"),
    ("chat", chat(stream="yes"), 400, "stream", "must be a boolean"),
    ("chat", chat(stream_options={"include_usage": True}), 400, "stream_options",
     "only allowed when stream is true"),
    ("chat", chat(stream=True, stream_options=[1]), 400, "stream_options", "must be an object"),
    ("completion", comp(stream=True, stream_options={"include_usage": 1}), 400,
     "stream_options.include_usage", "must be a boolean"),
    ("chat", chat(logprobs=1), 400, "logprobs", "must be a boolean"),
    ("chat", chat(top_logprobs=3), 400, "top_logprobs", "requires logprobs"),
    ("chat", chat(logprobs=False, top_logprobs=3), 400, "top_logprobs", "requires logprobs"),
    ("chat", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "[0, 20]"),
    ("chat", chat(logprobs=True, top_logprobs="5"), 400, "top_logprobs", "must be an integer"),
    ("completion", comp(logprobs=6), 400, "logprobs", "[0, 5]"),
    ("completion", comp(logprobs=True), 400, "logprobs", "must be an integer"),
    ("completion", comp(echo="true"), 400, "echo", "must be a boolean"),
    ("completion", comp(prompt_logprobs=21), 400, "prompt_logprobs", "[0, 20]"),
    ("completion", comp(prompt_logprobs=True), 400, "prompt_logprobs", "must be an integer"),
    ("chat", chat(prompt_logprobs=1), 400, "prompt_logprobs", "not supported"),
    ("chat", chat(user=42), 400, "user", "must be a string"),
    ("chat", chat(stop=5), 400, "stop", "string or a list"),
    ("chat", chat(stop=["a", 1]), 400, "stop", "string or a list"),
    ("chat", chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", "at most 4"),
    ("completion", comp(stop=""), 400, "stop", "non-empty"),
    ("chat", chat(seed="1"), 400, "seed", "must be an integer"),
    ("chat", chat(seed=2**64), 400, "seed", "64 bits"),
    ("chat", chat(top_k=1.5), 400, "top_k", "must be an integer"),
    ("chat", chat(top_k=-2), 400, "top_k", "-1, 0"),
    ("chat", chat(min_p=2), 400, "min_p", "[0, 1]"),
    ("chat", chat(repetition_penalty=0), 400, "repetition_penalty", "(0, 2]"),
    ("chat", chat(ignore_eos="no"), 400, "ignore_eos", "true or false"),
    ("chat", chat(stop_token_ids=5), 400, "stop_token_ids", "list of token ids"),
    ("chat", chat(stop_token_ids=[10**6]), 400, "stop_token_ids", "not a token id"),
    ("chat", chat(min_tokens=10, max_tokens=5), 400, "min_tokens", "must not exceed max_tokens"),
    ("chat", chat(skip_special_tokens=0), 400, "skip_special_tokens", "true or false"),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}), 400, "response_format.json_schema.schema",
     "invalid json_schema"),
    ("completion", comp(structured_outputs={"regex": "[a-"}), 400, "structured_outputs.regex",
     "unclosed character class"),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "no spaces"}}]), 400,
     "tools.[0].function.name", "letters, digits"),  # more in test_tool_calls
    ("chat", chat(functions=[{"name": "f"}]), 400, "functions", "not supported"),
    ("chat", chat(logit_bias={"50256": -100}), 400, "logit_bias", "not a token id"),
    ("completion", comp(logit_bias={"49152": 1}), 400, "logit_bias", "vocabulary size 49152"),
    ("chat", chat(logit_bias={"x": 1}), 400, "logit_bias", "not a token id"),
    ("chat", chat(logit_bias={"-1": 1}), 400, "logit_bias", ">= 0"),
    ("chat", chat(logit_bias={"5": 101}), 400, "logit_bias", "[-100, 100]"),
    ("chat", chat(logit_bias={"5": "1"}), 400, "logit_bias", "must be a number"),
    ("chat", chat(logit_bias=[5]), 400, "logit_bias", "must be an object"),
    ("chat", chat(logit_bias={str(i): 1 for i in range(1025)}), 400, "logit_bias", "at most 1024"),
    ("chat", chat(priority="1"), 400, "priority", "must be an integer"),
    ("chat", chat(priority=2**40), 400, "priority", "32 bits"),
    ("chat", chat(include_stop_str_in_output=1), 400, "include_stop_str_in_output", "true or false"),
    ("completion", comp(suffix="end"), 400, "suffix", "not supported"),
    ("completion", comp(best_of=3), 400, "best_of", "not supported"),
    ("chat", chat(messages=[{"role": "user", "content": LONG}]), 400, "messages",
     "maximum context length is 256 tokens"),
    ("chat", chat(max_tokens=250), 400, "messages", "(31 in the messages, 250 in the completion)"),
    ("chat", chat(max_completion_tokens=250, max_tokens=10), 400, "messages", "250 in the"),
    ("completion", comp(prompt=[1] * MAX_LEN), 400, "prompt", "leaves no room"),
    ("completion", comp(prompt=[1] * 200, max_tokens=57), 400, "prompt",
     "you requested 257 tokens (200 in the prompt, 57 in the completion)"),
    ("completion", comp(prompt=[1] * 200, min_tokens=100), 400, "min_tokens", "must not exceed"),
]


@pytest.mark.parametrize(("kind", "body", "status", "param", "message"), BAD,
                         ids=[f"{i}-{c[0]}-{c[3]}" for i, c in enumerate(BAD)])
def test_bad_input(tok, kind, body, status, param, message):
    with pytest.raises(APIError) as info:
        parse(kind, body, tok)
    e = info.value
    assert (e.status, e.param) == (status, param), e.message
    assert message in e.message
    expected_type = "not_found_error" if status == 404 else "invalid_request_error"
    assert e.body() == {"error": {"message": e.message, "type": expected_type, "param": param,
                                  "code": e.code}}
    if "context length" in message or "in the" in message or "no room" in message:
        assert e.code == "context_length_exceeded"
    if status == 404:
        assert e.code == "model_not_found"


def test_error_types():
    assert APIError.invalid_api_key().body()["error"] == {
        "message": "Incorrect API key provided.", "type": "authentication_error", "param": None,
        "code": "invalid_api_key"}
    assert APIError.rate_limited("slow down").type == "rate_limit_error"
    assert APIError.unavailable("no workers").type == "service_unavailable_error"
    assert APIError.server_error().status == 500
    assert APIError.server_error().type == "server_error"
    e = APIError.from_invalid_request(PromptTooLongError("too long", "messages"))
    assert (e.status, e.param, e.code) == (400, "messages", "context_length_exceeded")


FUZZ_VALUES = [None, True, False, 0, -1, 1, 7, 2**70, -(2**70), 0.5, -3.5, float("inf"),
               float("nan"), "", "x", "\ud800", "user", [], [1], [-1], ["a"], [None], [[1]],
               [{"type": "text", "text": "a"}], [{"role": "user", "content": "a"}],
               [{"role": "user", "content": None}], {}, {"a": 1}, {"include_usage": True},
               {"type": "text"}]
FUZZ_KEYS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
             "top_p", "n", "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs",
             "echo", "user", "presence_penalty", "frequency_penalty", "top_k", "min_p",
             "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
             "skip_special_tokens", "tools", "functions", "response_format", "best_of", "suffix",
             "logit_bias", "priority", "include_stop_str_in_output", "prompt_logprobs",
             "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"]


def test_fuzz_only_api_errors(tok):
    """Random junk in every field: a ParsedRequest or an APIError, never another exception."""
    rng = random.Random(0)
    for _ in range(3000):
        kind = rng.choice(["chat", "completion"])
        body = chat() if kind == "chat" else comp()
        for key in rng.sample(FUZZ_KEYS, rng.randint(1, 4)):
            body[key] = rng.choice(FUZZ_VALUES)
        try:
            req = parse(kind, body, tok)
        except APIError as e:
            assert e.status in (400, 404)
            json.dumps(e.body())
        else:
            assert req.params.max_tokens is not None
            assert len(req.prompt_token_ids) + req.params.max_tokens <= MAX_LEN


# ---------------------------------------------------------------- happy paths


def test_chat_system_and_user(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    req = parse_chat({"messages": messages, "temperature": 0, "user": "u1"}, tok, MODEL, MAX_LEN)
    assert req.kind == "chat" and req.model == MODEL  # model defaults to the served one
    assert req.prompt_token_ids == tok.apply_chat_template(messages)
    assert req.params.greedy and req.user == "u1"
    assert req.params.max_tokens == MAX_LEN - len(req.prompt_token_ids)
    assert (req.stream, req.include_usage, req.echo, req.logprobs_mode) == (False, False, False, None)
    assert req.request_id.startswith("chatcmpl-") and req.created > 0


def test_chat_content_parts_are_joined(tok):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    req = parse_chat(chat(messages=[{"role": "user", "content": parts, "name": "x"}]), tok,
                     MODEL, MAX_LEN)
    assert req.prompt_token_ids == tok.apply_chat_template(
        [{"role": "user", "content": "Hello\nworld"}])


def test_chat_roles_developer_and_tool(tok):
    msgs = [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}]
    assert parse_chat(chat(messages=msgs), tok, MODEL, MAX_LEN).prompt_token_ids


def test_max_completion_tokens_wins(tok):
    req = parse_chat(chat(max_tokens=50, max_completion_tokens=7), tok, MODEL, MAX_LEN)
    assert req.params.max_tokens == 7
    assert parse_chat(chat(max_tokens=50), tok, MODEL, MAX_LEN).params.max_tokens == 50


def test_context_exactly_full_is_allowed(tok):
    n = len(tok.apply_chat_template(HI))
    assert parse_chat(chat(max_tokens=MAX_LEN - n), tok, MODEL, MAX_LEN).params.max_tokens == MAX_LEN - n


def test_chat_logprobs_and_stream(tok):
    req = parse_chat(chat(logprobs=True, top_logprobs=3, stream=True,
                          stream_options={"include_usage": True}), tok, MODEL, MAX_LEN)
    assert (req.params.logprobs, req.logprobs_mode) == (3, "chat")
    assert (req.stream, req.include_usage) == (True, True)
    assert parse_chat(chat(logprobs=True), tok, MODEL, MAX_LEN).params.logprobs == 0
    assert parse_chat(chat(logprobs=False), tok, MODEL, MAX_LEN).params.logprobs is None


def test_nulls_and_unknown_fields_are_ignored(tok):
    body = chat(temperature=None, stop=None, stream_options=None, tools=[], tool_choice="auto",
                response_format={"type": "text"}, metadata={"a": 1}, store=False,
                parallel_tool_calls=True, service_tier="auto")
    req = parse_chat(body, tok, MODEL, MAX_LEN)
    assert req.params.temperature == 1.0 and req.params.stop == ()


def test_completion_text_and_token_ids(tok):
    text = parse_completion(comp(max_tokens=5, echo=True), tok, MODEL, MAX_LEN)
    assert text.kind == "completion" and text.request_id.startswith("cmpl-")
    assert text.prompt_token_ids == tok.encode("Once upon a time")
    assert (text.params.max_tokens, text.echo, text.prompt_text) == (5, True, "Once upon a time")
    ids = tok.encode("Once upon a time")
    for prompt in (ids, [ids], ["Once upon a time"]):
        req = parse_completion(comp(prompt=prompt), tok, MODEL, MAX_LEN)
        assert req.prompt_token_ids == ids
        assert req.params.max_tokens == MAX_LEN - len(ids)
    echoed = parse_completion(comp(prompt=ids, echo=True), tok, MODEL, MAX_LEN)
    assert echoed.prompt_text == "Once upon a time"


def test_completion_logprobs(tok):
    req = parse_completion(comp(logprobs=2), tok, MODEL, MAX_LEN)
    assert (req.params.logprobs, req.logprobs_mode) == (2, "completion")
    # top_logprobs is the chat spelling; completions ignore it like OpenAI does.
    assert parse_completion(comp(top_logprobs=3), tok, MODEL, MAX_LEN).params.logprobs is None


def test_vllm_extras_pass_through(tok):
    req = parse_completion(comp(top_k=40, min_p=0.05, repetition_penalty=1.1, min_tokens=2,
                                ignore_eos=True, stop_token_ids=[2, 7],
                                skip_special_tokens=False, seed=1234, n=3, stop=["\n", "END"],
                                presence_penalty=0.5, frequency_penalty=-0.5, top_p=0.9),
                           tok, MODEL, MAX_LEN)
    p = req.params
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens) == (40, 0.05, 1.1, 2)
    assert (p.ignore_eos, p.stop_token_ids, p.skip_special_tokens) == (True, (2, 7), False)
    assert (p.seed, p.n, p.stop, p.top_p) == (1234, 3, ("\n", "END"), 0.9)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)


def test_best_of_equal_to_n_is_accepted(tok):
    assert parse_completion(comp(best_of=2, n=2), tok, MODEL, MAX_LEN).params.n == 2
    assert parse_completion(comp(best_of=1), tok, MODEL, MAX_LEN).params.n == 1


def test_without_tokenizer_only_token_ids():
    req = parse_completion(comp(prompt=[5, 6]), None, MODEL, 64, vocab_size=10)
    assert req.prompt_token_ids == [5, 6]
    with pytest.raises(APIError, match=r"\[0, 10\)"):
        parse_completion(comp(prompt=[10]), None, MODEL, 64, vocab_size=10)
    with pytest.raises(APIError, match="no tokenizer"):
        parse_completion(comp(), None, MODEL, 64)
    with pytest.raises(APIError, match="no tokenizer"):
        parse_chat(chat(), None, MODEL, 64)


# ---------------------------------------------------------------- formatting

ENTRY = LogprobEntry(42, "Hi", -0.25, ((42, "Hi", -0.25), (7, " Hello", -1.5)))
INF = LogprobEntry(3, "é", float("-inf"), ())


@pytest.fixture()
def chat_req(tok) -> ParsedRequest:
    return parse_chat(chat(), tok, MODEL, MAX_LEN)


def _stream_req(tok, kind: str, include_usage: bool, **extra) -> ParsedRequest:
    body = (chat if kind == "chat" else comp)(stream=True, **extra)
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return parse(kind, body, tok)


def test_chat_completion_shape(chat_req):
    out = chat_completion(chat_req, [ChoiceResult(0, "Hello!", "stop", [ENTRY, INF]),
                                     ChoiceResult(1, "Hey", "length")], usage(31, 2))
    assert set(out) == {"id", "object", "created", "model", "choices", "usage"}
    assert (out["object"], out["id"], out["model"]) == ("chat.completion", chat_req.request_id, MODEL)
    c0, c1 = out["choices"]
    assert set(c0) == {"index", "message", "logprobs", "finish_reason"}
    assert c0["message"] == {"role": "assistant", "content": "Hello!"}
    assert c0["finish_reason"] == "stop" and c1["logprobs"] is None and c1["index"] == 1
    assert c0["logprobs"] == {"content": [
        {"token": "Hi", "logprob": -0.25, "bytes": [72, 105],
         "top_logprobs": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
                          {"token": " Hello", "logprob": -1.5, "bytes": list(b" Hello")}]},
        {"token": "é", "logprob": -9999.0, "bytes": [0xC3, 0xA9], "top_logprobs": []}]}
    assert out["usage"] == {"prompt_tokens": 31, "completion_tokens": 2, "total_tokens": 33}
    json.loads(json.dumps(out, allow_nan=False))


def test_usage_with_cached_tokens():
    assert usage(10, 5, cached_tokens=8) == {
        "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 8}}


def test_text_completion_shape(tok):
    req = parse_completion(comp(echo=True), tok, MODEL, MAX_LEN)
    out = text_completion(req, [ChoiceResult(0, " there", "length")], usage(5, 1))
    assert set(out) == {"id", "object", "created", "model", "choices", "usage"}
    assert out["object"] == "text_completion"
    assert out["choices"] == [{"index": 0, "text": "Once upon a time there", "logprobs": None,
                               "finish_reason": "length"}]
    req = parse_completion(comp(logprobs=1), tok, MODEL, MAX_LEN)
    out = text_completion(req, [ChoiceResult(0, "Hi Hi", "stop", [ENTRY, ENTRY])], usage(5, 2))
    assert out["choices"][0]["logprobs"] == {
        "tokens": ["Hi", "Hi"], "token_logprobs": [-0.25, -0.25],
        "top_logprobs": [{"Hi": -0.25, " Hello": -1.5}] * 2, "text_offset": [0, 2]}


def test_chat_stream_chunks(tok):
    req = _stream_req(tok, "chat", include_usage=True)
    f = ChunkFormatter(req)
    first, second, last = f.chunk(0, "Hel"), f.chunk(0, "lo"), f.chunk(0, "", finish_reason="stop")
    other = f.chunk(1, "")
    for ch in (first, second, last, other):
        assert set(ch) == {"id", "object", "created", "model", "choices", "usage"}
        assert ch["object"] == "chat.completion.chunk" and ch["usage"] is None
        assert ch["id"] == req.request_id
        assert set(ch["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert second["choices"][0]["delta"] == {"content": "lo"}
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert other["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # its own first
    end = f.usage_chunk(usage(31, 2))
    assert end == {"id": req.request_id, "object": "chat.completion.chunk", "created": req.created,
                   "model": MODEL, "choices": [],
                   "usage": {"prompt_tokens": 31, "completion_tokens": 2, "total_tokens": 33}}


def test_stream_without_usage_has_no_usage_key(tok):
    f = ChunkFormatter(_stream_req(tok, "chat", include_usage=False))
    assert "usage" not in f.chunk(0, "x")
    assert f.usage_chunk(usage(1, 1)) is None
    c = ChunkFormatter(_stream_req(tok, "completion", include_usage=False)).chunk(0, "x")
    assert set(c) == {"id", "object", "created", "model", "choices"}


def test_completion_stream_chunks(tok):
    req = _stream_req(tok, "completion", include_usage=True, echo=True)
    f = ChunkFormatter(req)
    first = f.chunk(0, " there")
    assert set(first) == {"id", "object", "created", "model", "choices", "usage"}
    assert first["object"] == "text_completion" and first["usage"] is None
    assert first["choices"] == [{"index": 0, "text": "Once upon a time there", "logprobs": None,
                                 "finish_reason": None}]
    assert f.chunk(0, " was", finish_reason="length")["choices"][0]["text"] == " was"
    assert f.usage_chunk(usage(4, 2))["choices"] == []

    f = ChunkFormatter(_stream_req(tok, "completion", include_usage=False, logprobs=1))
    f.chunk(0, "Hi", [ENTRY])
    lp = f.chunk(0, "Hi", [ENTRY])["choices"][0]["logprobs"]
    assert lp["text_offset"] == [2] and lp["tokens"] == ["Hi"]


def test_models_list():
    body = models_list([MODEL], 2048, 1700000000)
    assert body == {"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "tandem",
         "max_model_len": 2048}]}


def test_sse_framing():
    assert sse({"a": "é", "b": None}) == 'data: {"a":"é","b":null}\n\n'.encode()
    assert sse("[DONE]") == SSE_DONE == b"data: [DONE]\n\n"
    assert json.loads(sse(APIError.invalid("bad", "x").body())[6:]) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "x", "code": None}}
