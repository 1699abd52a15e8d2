"""The OpenAI API of the gateway, without the web framework.

This module owns three things and nothing else (no sockets, no FastAPI app):

* ``APIError``: every error a client sees, as OpenAI's ``{"error": {...}}`` body.
* ``parse_chat`` / ``parse_completion``: a raw JSON body (whatever the client sent)
  becomes a ``ParsedRequest`` (prompt token ids, validated ``SamplingParams``, stream
  flags) or an ``APIError``. Nothing a client sends raises anything else.
* Response shapes: full responses, stream chunks (``StreamFormatter`` keeps the little
  per-choice state a stream needs), the usage chunk, ``/v1/models`` and SSE framing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from common.errors import InvalidRequestError
from common.model.tokenizer import ChatTemplateError, Tokenizer
from common.sampling_params import SamplingError, SamplingParams

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_STOP = 4  # OpenAI's limit (SamplingParams allows more for the CLI)
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# Sampling fields handed to SamplingParams.from_dict as sent: OpenAI's, then vLLM's extras.
_SAMPLING_KEYS = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty",
                  "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
                  "ignore_eos", "stop_token_ids", "skip_special_tokens")
_UNSUPPORTED_PARTS = ("image_url", "input_audio", "file", "image", "audio", "video")
_INT64 = 2**63  # params cross the P/D wire as msgpack, which cannot carry larger ints
# Deeper than any body this API reads (messages.[i].content.[j].text is 5 levels): a cap
# well below the interpreter's recursion limit, so nothing that walks a value can overflow.
MAX_JSON_DEPTH = 32


class APIError(Exception):
    """An error to send to the client; ``type`` follows from ``status`` unless given."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds, sent as Retry-After (429/503)
        self.status = status
        self.message = message
        self.type = type or _ERROR_TYPES.get(status, "server_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str | None = None) -> APIError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def from_invalid_request(cls, e: InvalidRequestError) -> APIError:
        """The engine's and SamplingParams' client errors (e.g. PromptTooLongError)."""
        return cls(400, e.message, param=e.param, code=e.code)

    @classmethod
    def model_not_found(cls, model: str) -> APIError:
        return cls(404, f"The model `{model}` does not exist or you do not have access to it.",
                   param="model", code="model_not_found")

    @classmethod
    def invalid_api_key(cls) -> APIError:
        return cls(401, "Incorrect API key provided.", code="invalid_api_key")

    @classmethod
    def rate_limited(cls, message: str) -> APIError:
        return cls(429, message, code="rate_limit_exceeded")

    @classmethod
    def unavailable(cls, message: str, retry_after: float | None = None) -> APIError:
        return cls(503, message, retry_after=retry_after)

    @classmethod
    def server_error(cls, message: str = "The server had an error while processing your request.") -> APIError:
        return cls(500, message)


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
    logprobs_mode: Literal["chat", "completion"] | None = None
    user: str | None = None
    prompt_text: str = ""  # completions with echo: the prompt as text
    request_id: str = ""  # "chatcmpl-..." / "cmpl-..."
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.request_id:
            object.__setattr__(self, "request_id", _new_id(self.kind))


# ---------------------------------------------------------------- parsing


def parse_json(raw: bytes) -> Any:
    """The request body as JSON; any bytes at all become a value or an APIError."""
    try:
        value = json.loads(raw)
    except RecursionError:  # json's C parser recurses per level of nesting
        raise APIError.invalid(f"the request body is nested more than {MAX_JSON_DEPTH} "
                               "levels deep") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, over-long integers
        raise APIError.invalid(f"the request body is not valid JSON: {e}") from None
    if _depth_exceeds(value, MAX_JSON_DEPTH):
        raise APIError.invalid(f"the request body is nested more than {MAX_JSON_DEPTH} "
                               "levels deep")
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
               *, vocab_size: int | None = None) -> ParsedRequest:
    """Validate a /v1/chat/completions body and apply the chat template."""
    body = _object(body)
    model = _model(body, served_model)
    _reject_unsupported(body, ("tools", "functions", "response_format", "logit_bias"))
    stream, include_usage = _stream(body)
    user = _optional(body, "user", str, "a string")
    logprobs = _chat_logprobs(body)
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    vocab = _vocab(tokenizer, vocab_size)
    params = _sampling(body, max_tokens, logprobs, vocab, max_model_len)
    messages = _messages(body.get("messages"))
    if tokenizer is None:
        raise APIError.invalid("this model has no tokenizer: use /v1/completions with token ids",
                               "messages")
    try:
        ids = tokenizer.apply_chat_template(messages)
    except ChatTemplateError as e:
        raise APIError.invalid(str(e), "messages") from e
    params = _fit_context(params, max_tokens, len(ids), max_model_len, "messages")
    return ParsedRequest("chat", model, ids, params, stream=stream, include_usage=include_usage,
                         logprobs_mode=None if logprobs is None else "chat", user=user)


def parse_completion(body: Any, tokenizer: Tokenizer | None, served_model: str,
                     max_model_len: int, *, vocab_size: int | None = None) -> ParsedRequest:
    """Validate a /v1/completions body and tokenize its prompt."""
    body = _object(body)
    model = _model(body, served_model)
    _reject_unsupported(body, ("suffix", "logit_bias"))
    _reject_best_of(body)
    stream, include_usage = _stream(body)
    user = _optional(body, "user", str, "a string")
    echo = bool(_optional(body, "echo", bool, "a boolean"))
    logprobs = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if echo and logprobs is not None:
        # OpenAI would add the prompt's logprobs; the engine does not compute them.
        raise APIError.invalid("echo together with logprobs is not supported", "echo")
    max_tokens = _max_tokens(body, ("max_tokens",))
    vocab = _vocab(tokenizer, vocab_size)
    params = _sampling(body, max_tokens, logprobs, vocab, max_model_len)
    ids, text = _completion_prompt(body.get("prompt"), tokenizer, vocab)
    params = _fit_context(params, max_tokens, len(ids), max_model_len, "prompt")
    if echo and text is None:
        text = tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else ""
    return ParsedRequest("completion", model, ids, params, stream=stream,
                         include_usage=include_usage, echo=echo,
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
        raise APIError.invalid(f"model must be a string, got {_show(model)}", "model")
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
        raise APIError.invalid(f"stream_options must be an object, got {_show(options)}",
                               "stream_options")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise APIError.invalid(f"include_usage must be a boolean, got {_show(include)}",
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
    for t in params.stop_token_ids:
        if vocab is not None and t >= vocab:
            raise APIError.invalid(f"stop_token_ids: {t} is not a token id (vocabulary size "
                                   f"{vocab})", "stop_token_ids")
    return params


def _fit_context(params: SamplingParams, max_tokens: int | None, prompt_len: int,
                 max_model_len: int, where: str) -> SamplingParams:
    """Reject what cannot fit; an absent max_tokens takes the rest of the context."""
    limit = f"This model's maximum context length is {max_model_len} tokens."
    if prompt_len >= max_model_len:
        raise APIError.invalid(
            f"{limit} However, your {where} resulted in {prompt_len} tokens, which leaves no "
            f"room for the completion. Please reduce the length of the {where}.",
            where, "context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise APIError.invalid(
            f"{limit} However, you requested {prompt_len + max_tokens} tokens ({prompt_len} in "
            f"the {where}, {max_tokens} in the completion). Please reduce the length of the "
            f"{where} or completion.", where, "context_length_exceeded")
    try:
        rest = max_model_len - prompt_len
        return dataclasses.replace(params, max_tokens=rest if max_tokens is None else max_tokens)
    except SamplingError as e:  # min_tokens above what is left of the context
        raise APIError.from_invalid_request(e) from e


def _messages(value: Any) -> list[dict[str, str]]:
    """Messages reduced to role and text: all the chat template needs, nothing unchecked."""
    if value is None:
        raise APIError.invalid("Missing required parameter: 'messages'.", "messages")
    if not isinstance(value, list):
        raise APIError.invalid(f"messages must be an array, got {_show(value)}", "messages")
    if not value:
        raise APIError.invalid("messages must contain at least one message", "messages")
    return [_message(i, m) for i, m in enumerate(value)]


def _message(i: int, m: Any) -> dict[str, str]:
    where = f"messages.[{i}]"
    if not isinstance(m, Mapping):
        raise APIError.invalid(f"{where} must be an object, got {_show(m)}", where)
    role = m.get("role")
    if role is None:
        raise APIError.invalid(f"Missing required parameter: '{where}.role'.", f"{where}.role")
    if role not in ROLES:  # a list or dict role is "not in" as well, never a TypeError
        raise APIError.invalid(f"{where}.role: invalid value {_show(role)}; supported values "
                               f"are {', '.join(ROLES)}", f"{where}.role")
    return {"role": role, "content": _content(m.get("content"), f"{where}.content")}


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return _utf8(value, where)
    if not isinstance(value, list):
        raise APIError.invalid(f"{where} must be a string or an array of text parts, got "
                               f"{_show(value)}", where)
    texts = []
    for j, part in enumerate(value):
        at = f"{where}.[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _UNSUPPORTED_PARTS:
            raise APIError.invalid(f"{at}: content parts of type '{kind}' are not supported "
                                   "(this model reads text only)", at)
        if kind != "text" or not isinstance(part.get("text"), str):
            raise APIError.invalid(f"{at} must be a text part {{\"type\": \"text\", \"text\": "
                                   "\"...\"}", at)
        texts.append(_utf8(part["text"], at))
    return "\n".join(texts)  # how vLLM joins text parts


def _completion_prompt(value: Any, tokenizer: Tokenizer | None,
                       vocab: int | None) -> tuple[list[int], str | None]:
    """Token ids and, for a text prompt, the text: a string, [string], ids or [ids]."""
    if value is None:
        raise APIError.invalid("Missing required parameter: 'prompt'.", "prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, list) and any(isinstance(v, str | list) for v in value):
        raise APIError.invalid("several prompts in one request are not supported yet; send one "
                               "prompt per request", "prompt")
    if isinstance(value, list):
        return _token_ids(value, vocab), None
    if not isinstance(value, str):
        raise APIError.invalid(f"prompt must be a string or an array of token ids, got "
                               f"{_show(value)}", "prompt")
    if tokenizer is None:
        raise APIError.invalid("this model has no tokenizer: send the prompt as token ids",
                               "prompt")
    ids = tokenizer.encode(_utf8(value, "prompt"))
    if not ids:
        raise APIError.invalid("prompt must not be empty", "prompt")
    return ids, value


def _token_ids(value: list[Any], vocab: int | None) -> list[int]:
    if not value:
        raise APIError.invalid("prompt must not be empty", "prompt")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise APIError.invalid(f"prompt token {i} must be an integer, got {_show(t)}", "prompt")
        if t < 0 or (vocab is not None and t >= vocab):
            bound = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise APIError.invalid(f"prompt token {i} ({t}) is not a token id: ids are {bound}",
                                   "prompt")
    return list(value)


def _vocab(tokenizer: Tokenizer | None, vocab_size: int | None) -> int | None:
    return vocab_size if vocab_size is not None else tokenizer.vocab_size if tokenizer else None


def _optional(body: Mapping[str, Any], name: str, kind: type, what: str) -> Any:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise APIError.invalid(f"{name} must be {what}, got {_show(value)}", name)
    return value


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError.invalid(f"{name} must be an integer, got {_show(value)}", name)
    if value < lo or (hi is not None and value > hi):
        bounds = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise APIError.invalid(f"{name} must be {bounds}, got {value}", name)
    return value


def _utf8(text: str, where: str) -> str:
    # JSON may carry lone surrogates ("\ud800"); the tokenizer raises TypeError on them.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError.invalid(f"{where} is not valid Unicode text (unpaired surrogate)",
                               where) from e
    return text


def _show(value: Any) -> str:
    """A client value in an error message, cut short: it may be huge."""
    if isinstance(value, list):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    if not isinstance(value, str | int | float | bool):
        return type(value).__name__
    # ensure_ascii keeps a lone surrogate printable; a long value is cut.
    text = json.dumps(value[:80] if isinstance(value, str) else value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------- responses


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """One output token's logprob and its alternatives, with their text."""

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (id, text, logprob), best first

    @classmethod
    def from_engine(cls, lp: Any, token_text: Callable[[int], str]) -> LogprobEntry:
        """From the engine's TokenLogprob (token_id, logprob, top=((id, logprob), ...))."""
        return cls(lp.token_id, token_text(lp.token_id), lp.logprob,
                   tuple((t, token_text(t), v) for t, v in lp.top))


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    """What a finished choice gives a full (non-streaming) response."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: Sequence[LogprobEntry] | None = None


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def _finite(logprob: float) -> float:
    # JSON has no -Infinity; a token the sampler could never pick gets vLLM's -9999.
    return logprob if math.isfinite(logprob) else -9999.0


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(entries: Sequence[LogprobEntry]) -> dict[str, Any]:
    return {"content": [
        {"token": e.token, "logprob": _finite(e.logprob), "bytes": _token_bytes(e.token),
         "top_logprobs": [{"token": t, "logprob": _finite(v), "bytes": _token_bytes(t)}
                          for _, t, v in e.top]}
        for e in entries]}


def completion_logprobs(entries: Sequence[LogprobEntry], text_offset: int = 0) -> dict[str, Any]:
    """The legacy shape; ``text_offset`` is where the first token starts in the choice text."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [_top_dict(e) for e in entries],
            "text_offset": offsets}


def _top_dict(e: LogprobEntry) -> dict[str, float]:
    # OpenAI always lists the sampled token too; texts can repeat, so the best one wins.
    top: dict[str, float] = {}
    for _, text, lp in (*e.top, (e.token_id, e.token, e.logprob)):
        top.setdefault(text, _finite(lp))
    return top


def chat_completion(req: ParsedRequest, choices: Sequence[ChoiceResult],
                    usage_: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": req.request_id, "object": "chat.completion", "created": req.created,
            "model": req.model,
            "choices": [{"index": c.index,
                         "message": {"role": "assistant", "content": c.text},
                         "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs),
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": dict(usage_)}


def text_completion(req: ParsedRequest, choices: Sequence[ChoiceResult],
                    usage_: Mapping[str, Any]) -> dict[str, Any]:
    prefix = req.prompt_text if req.echo else ""
    return {"id": req.request_id, "object": "text_completion", "created": req.created,
            "model": req.model,
            "choices": [{"index": c.index, "text": prefix + c.text,
                         "logprobs": None if c.logprobs is None
                         else completion_logprobs(c.logprobs, len(prefix)),
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": dict(usage_)}


def _chunk(req: ParsedRequest, choices: list[dict[str, Any]]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    out = {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
           "choices": choices}
    if req.include_usage:
        out["usage"] = None  # OpenAI: null on every chunk but the last
    return out


def chat_chunk(req: ParsedRequest, index: int, *, role: str | None = None,
               content: str | None = None, logprobs: Sequence[LogprobEntry] | None = None,
               finish_reason: str | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return _chunk(req, [{"index": index, "delta": delta,
                         "logprobs": None if logprobs is None else chat_logprobs(logprobs),
                         "finish_reason": finish_reason}])


def completion_chunk(req: ParsedRequest, index: int, text: str,
                     logprobs: Sequence[LogprobEntry] | None = None,
                     finish_reason: str | None = None, text_offset: int = 0) -> dict[str, Any]:
    return _chunk(req, [{"index": index, "text": text,
                         "logprobs": None if logprobs is None
                         else completion_logprobs(logprobs, text_offset),
                         "finish_reason": finish_reason}])


def usage_chunk(req: ParsedRequest, usage_: Mapping[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage."""
    return {**_chunk(req, []), "usage": dict(usage_)}


class StreamFormatter:
    """Chunks of one streamed request: the first chunk of each choice carries the role
    (chat) or the echoed prompt (completions); completion text offsets run on."""

    def __init__(self, req: ParsedRequest) -> None:
        self.req = req
        self._sent: dict[int, int] = {}  # choice -> characters of text sent so far

    def chunk(self, index: int, text: str, logprobs: Sequence[LogprobEntry] | None = None,
              finish_reason: str | None = None) -> dict[str, Any]:
        first = index not in self._sent
        sent = self._sent.get(index, 0)
        if self.req.kind == "chat":
            self._sent[index] = sent + len(text)
            # OpenAI's first delta is {"role": "assistant", "content": ""}; later ones omit
            # content when there is none (the finishing chunk has an empty delta).
            return chat_chunk(self.req, index, role="assistant" if first else None,
                              content=text if text or first else None, logprobs=logprobs,
                              finish_reason=finish_reason)
        offset = sent  # where this chunk's first token starts in the choice's text
        if first and self.req.echo:
            text = self.req.prompt_text + text
            offset = len(self.req.prompt_text)
        self._sent[index] = sent + len(text)
        return completion_chunk(self.req, index, text, logprobs, finish_reason, offset)

    def usage_chunk(self, usage_: Mapping[str, Any]) -> dict[str, Any] | None:
        """None when the client did not ask for usage."""
        return usage_chunk(self.req, usage_) if self.req.include_usage else None


def model_card(name: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "tandem",
            "max_model_len": max_model_len}


def models_list(names: Sequence[str], max_model_len: int, created: int) -> dict[str, Any]:
    """The /v1/models body."""
    return {"object": "list", "data": [model_card(n, max_model_len, created) for n in names]}


def sse(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: ``sse(chunk)`` or ``sse("[DONE]")``."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                            separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")
