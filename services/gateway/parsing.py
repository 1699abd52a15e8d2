"""Requests to the gateway's OpenAI API, validated, without the web framework.

A raw body (whatever the client sent: ``parse_json``) becomes a ``ParsedRequest`` —
prompt token ids, validated ``SamplingParams``, stream flags — or an ``APIError``;
nothing a client sends raises anything else. The prompt shapes themselves live in
``prompts``, shared with ``tandem generate``; this module owns the rest of a body.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from common.errors import InvalidRequestError
from common.model.tokenizer import Tokenizer
from common.rules import check_context, check_logit_bias
from common.sampling_params import MAX_LOGIT_BIAS, SamplingError, SamplingParams
from services.gateway.errors import APIError, shown
from services.gateway.prompts import chat_prompt, parse_prompt
from services.gateway.structured import parse_structured
from services.gateway.tool_parsers import DEFAULT_PARSER, ToolParser, rendering_parser
from services.gateway.tools import parse_tools

MAX_STOP = 4  # OpenAI's limit (SamplingParams allows more for the CLI)
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_PROMPT_LOGPROBS = 20  # vLLM's default max_logprobs
# Scored prompt tokens times (1 + alternatives): their records travel in one Tokens message,
# which must stay well inside the wire's bound (about 22 bytes an entry at worst).
MAX_PROMPT_LOGPROB_ENTRIES = 2**18
# Sampling fields handed to SamplingParams.from_dict as sent: OpenAI's, then vLLM's extras.
_SAMPLING_KEYS = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty",
                  "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
                  "ignore_eos", "stop_token_ids", "skip_special_tokens", "logit_bias",
                  "priority", "include_stop_str_in_output")
_INT64 = 2**63  # params cross the P/D wire as msgpack, which cannot carry larger ints
# Deeper than any body this API reads (messages.[i].content.[j].text is 5 levels): a cap
# well below the interpreter's recursion limit, so nothing that walks a value can overflow.
MAX_JSON_DEPTH = 32


def _new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: Literal["chat", "completion"]
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens is always set (defaulted to the rest of the context)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    echo: bool = False  # completions: the prompt text comes back before the completion
    prompt_logprobs: int | None = None  # completions: vLLM's prompt_logprobs field, as asked
    logprobs_mode: Literal["chat", "completion"] | None = None
    user: str | None = None
    prompt_text: str = ""  # completions with echo: the prompt as text
    request_id: str = ""  # "chatcmpl-..." / "cmpl-..."
    tool_parser: ToolParser | None = None  # chat with tools: reads calls out of the text
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.request_id:
            object.__setattr__(self, "request_id", _new_id(self.kind))




def parse_json(raw: bytes | str) -> Any:
    """A request body (or a JSONL line) as JSON; any bytes become a value or an APIError."""
    try:
        value = json.loads(raw)
    except RecursionError:  # json's C parser recurses per level of nesting
        raise APIError.invalid(f"invalid JSON: nested more than {MAX_JSON_DEPTH} levels "
                               "deep") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, over-long integers
        raise APIError.invalid(f"invalid JSON: {e}") from None
    if _depth_exceeds(value, MAX_JSON_DEPTH):
        raise APIError.invalid(f"invalid JSON: nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Iterative, so the check itself cannot recurse too deeply."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                pending.append((child, depth + 1))
    return False


def parse_chat(body: Any, tokenizer: Tokenizer | None, served_model: str, max_model_len: int,
               *, vocab_size: int | None = None,
               tool_call_parser: str = DEFAULT_PARSER) -> ParsedRequest:
    """Validate a /v1/chat/completions body and apply the chat template."""
    body = _object(body)
    model = _model(body, served_model)
    _reject_unsupported(body, ("functions",))
    _reject_unsupported(body, ("prompt_logprobs",))  # a completions field here
    tools = parse_tools(body)
    stream, include_usage = _stream(body)
    user = _optional(body, "user", str, "a string")
    logprobs = _chat_logprobs(body)
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    vocab = _vocab(tokenizer, vocab_size)
    params = _sampling(body, max_tokens, logprobs, vocab, max_model_len)
    listed, rendering = (tools.rendered, rendering_parser(tool_call_parser)) if tools else ((), None)
    ids = chat_prompt(body.get("messages"), tokenizer, listed, rendering)
    params = _fit_context(params, max_tokens, len(ids), max_model_len, "messages")
    if tools:
        params = tools.constrain(params)
    return ParsedRequest("chat", model, ids, params, stream=stream, include_usage=include_usage,
                         logprobs_mode=None if logprobs is None else "chat", user=user,
                         tool_parser=tools.parser(tool_call_parser) if tools else None)


def parse_completion(body: Any, tokenizer: Tokenizer | None, served_model: str,
                     max_model_len: int, *, vocab_size: int | None = None) -> ParsedRequest:
    """Validate a /v1/completions body and tokenize its prompt."""
    body = _object(body)
    model = _model(body, served_model)
    _reject_unsupported(body, ("suffix",))
    _reject_best_of(body)
    stream, include_usage = _stream(body)
    user = _optional(body, "user", str, "a string")
    echo = bool(_optional(body, "echo", bool, "a boolean"))
    logprobs = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    prompt_logprobs = _int(body, "prompt_logprobs", 0, MAX_PROMPT_LOGPROBS)
    max_tokens = _max_tokens(body, ("max_tokens",))
    vocab = _vocab(tokenizer, vocab_size)
    params = _sampling(body, max_tokens, logprobs, vocab, max_model_len)
    params = _with_prompt_logprobs(params, prompt_logprobs, logprobs if echo else None)
    prompt = parse_prompt(body.get("prompt"), tokenizer, vocab)
    ids, text = prompt.token_ids, prompt.text
    params = _fit_context(params, max_tokens, len(ids), max_model_len, "prompt")
    _check_prompt_scoring(params, len(ids))
    if echo and text is None:
        text = tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else ""
    return ParsedRequest("completion", model, ids, params, stream=stream,
                         include_usage=include_usage, echo=echo, prompt_logprobs=prompt_logprobs,
                         logprobs_mode=None if logprobs is None else "completion", user=user,
                         prompt_text=text or "")


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise APIError.invalid("the request body must be a JSON object")
    return body


def _model(body: Mapping[str, Any], served_model: str) -> str:
    model = body.get("model")
    if model is None:
        return served_model  # one model per deployment: naming it is optional
    if not isinstance(model, str):
        raise APIError.invalid(f"model must be a string, got {shown(model)}", "model")
    if model != served_model:
        raise APIError.model_not_found(model)
    return model


def _reject_unsupported(body: Mapping[str, Any], names: Iterable[str]) -> None:
    """Fields OpenAI honours that we cannot: ignoring them would silently change the output."""
    for name in names:
        value = body.get(name)
        # Empty values and response_format {"type": "text"} (OpenAI's default) ask for nothing.
        if value in (None, [], {}, "") or (name == "response_format" and value == {"type": "text"}):
            continue
        raise APIError.invalid(f"{name} is not supported by this server", name)


def _reject_best_of(body: Mapping[str, Any]) -> None:
    best_of, n = body.get("best_of"), body.get("n")
    if best_of is not None and best_of != (1 if n is None else n):
        raise APIError.invalid("best_of is not supported (only best_of equal to n)", "best_of")


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = bool(_optional(body, "stream", bool, "a boolean"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise APIError.invalid("stream_options is only allowed when stream is true",
                               "stream_options")
    if not isinstance(options, Mapping):
        raise APIError.invalid(f"stream_options must be an object, got {shown(options)}",
                               "stream_options")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise APIError.invalid(f"include_usage must be a boolean, got {shown(include)}",
                               "stream_options.include_usage")
    return stream, bool(include)


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """SamplingParams.logprobs from the chat spelling: logprobs=true plus top_logprobs=k."""
    wanted = _optional(body, "logprobs", bool, "a boolean")
    top = _int(body, "top_logprobs", 0, MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise APIError.invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    return (top or 0) if wanted else None


def _max_tokens(body: Mapping[str, Any], names: Sequence[str]) -> int | None:
    """The first of ``names`` given wins; each one given must be valid."""
    values = [_int(body, name, 1, None) for name in names]
    return next((v for v in values if v is not None), None)


def _sampling(body: Mapping[str, Any], max_tokens: int | None, logprobs: int | None,
              vocab: int | None, max_model_len: int) -> SamplingParams:
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP:
        raise APIError.invalid(f"stop allows at most {MAX_STOP} sequences, got {len(stop)}", "stop")
    bias = body.get("logit_bias")
    if isinstance(bias, Mapping) and len(bias) > MAX_LOGIT_BIAS:
        raise APIError.invalid(f"logit_bias allows at most {MAX_LOGIT_BIAS} entries, got "
                               f"{len(bias)}", "logit_bias")
    raw = {k: body[k] for k in _SAMPLING_KEYS if k in body}
    # A placeholder max_tokens until the prompt length is known (see _fit_context).
    raw["max_tokens"] = max_tokens if max_tokens is not None else max_model_len
    raw["logprobs"] = logprobs
    try:
        params = SamplingParams.from_dict(raw)
    except SamplingError as e:
        raise APIError.from_invalid_request(e) from e
    except OverflowError:  # an integer too large for a float field (e.g. temperature 1e400)
        raise APIError.invalid("a sampling field holds a number too large to use") from None
    if params.seed is not None and not -_INT64 <= params.seed < 2 * _INT64:
        raise APIError.invalid("seed must fit in 64 bits", "seed")
    if params.top_k >= _INT64:
        raise APIError.invalid("top_k is too large", "top_k")
    if (structured := parse_structured(body)) is not None:  # response_format and vLLM's spellings
        params = dataclasses.replace(params, structured=structured)
    for t in params.stop_token_ids:
        if vocab is not None and t >= vocab:
            raise APIError.invalid(f"stop_token_ids: {t} is not a token id (vocabulary size "
                                   f"{vocab})", "stop_token_ids")
    try:
        check_logit_bias(params.logit_bias, vocab)
    except InvalidRequestError as e:
        raise APIError.from_invalid_request(e) from e
    return params


def _with_prompt_logprobs(params: SamplingParams, asked: int | None,
                          echoed: int | None) -> SamplingParams:
    """The engine scores the prompt once for both uses: vLLM's ``prompt_logprobs`` and
    OpenAI's echo with logprobs (the prompt's tokens lead the logprobs)."""
    wanted = [k for k in (asked, echoed) if k is not None]
    return dataclasses.replace(params, prompt_logprobs=max(wanted)) if wanted else params


def _check_prompt_scoring(params: SamplingParams, prompt_len: int) -> None:
    k = params.prompt_logprobs
    if k is not None and (prompt_len - 1) * (k + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise APIError.invalid(f"prompt_logprobs: {prompt_len} prompt tokens with {k} "
                               f"alternatives each exceed {MAX_PROMPT_LOGPROB_ENTRIES} entries; "
                               "ask for fewer alternatives or a shorter prompt",
                               "prompt_logprobs")


def _fit_context(params: SamplingParams, max_tokens: int | None, prompt_len: int,
                 max_model_len: int, where: str) -> SamplingParams:
    """Reject what cannot fit; an absent max_tokens takes the rest of the context."""
    try:
        budget = check_context(prompt_len, max_tokens, max_model_len, where)
        return dataclasses.replace(params, max_tokens=budget)
    except InvalidRequestError as e:  # too long, or min_tokens above what is left
        raise APIError.from_invalid_request(e) from e


def _vocab(tokenizer: Tokenizer | None, vocab_size: int | None) -> int | None:
    return vocab_size if vocab_size is not None else tokenizer.vocab_size if tokenizer else None


def _optional(body: Mapping[str, Any], name: str, kind: type, what: str) -> Any:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise APIError.invalid(f"{name} must be {what}, got {shown(value)}", name)
    return value


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError.invalid(f"{name} must be an integer, got {shown(value)}", name)
    if value < lo or (hi is not None and value > hi):
        bounds = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise APIError.invalid(f"{name} must be {bounds}, got {value}", name)
    return value
