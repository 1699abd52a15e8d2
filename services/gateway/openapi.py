"""The OpenAPI description of the routes that read a body: what ``parsing`` accepts (the
two generation routes), and ``extras``' and ``responses_api``'s bodies and answers.

The routes read their bodies themselves (so that every bad body becomes an OpenAI error,
see ``parsing``), which leaves FastAPI nothing to describe; these JSON schemas say what
``parse_chat`` / ``parse_completion`` and ``SamplingParams`` accept, field by field, and
which answers may come back. What a schema cannot say — rules across fields, such as a
prompt plus ``max_tokens`` within the context, ``min_tokens`` at most ``max_tokens``,
``top_logprobs`` only with ``logprobs``, ``stream_options`` only with ``stream``, a
``tool_choice`` naming one of the ``tools``, each tool's ``parameters`` a valid JSON schema — is a
400 with an OpenAI error body. Keep this in step with ``parsing`` and ``prompts``: the
schemathesis test sends what these schemas allow and checks the answers against them.
"""

from __future__ import annotations

from typing import Any

from common.sampling_params import MAX_LOGIT_BIAS, MAX_N
from services.gateway.parsing import (
    MAX_CHAT_TOP_LOGPROBS,
    MAX_COMPLETION_LOGPROBS,
    MAX_PROMPT_LOGPROBS,
    MAX_STOP,
)
from services.gateway.prompts import ROLES
from services.gateway.tools import MAX_TOOLS

Schema = dict[str, Any]
_INT64 = 2**63


def _nullable(schema: Schema) -> Schema:
    """Every optional field may also be sent as null (parsing treats null as absent)."""
    return {"anyOf": [schema, {"type": "null"}]}


def _number(lo: float, hi: float, *, exclusive_lo: bool = False) -> Schema:
    bound = {"exclusiveMinimum": lo} if exclusive_lo else {"minimum": lo}
    return _nullable({"type": "number", **bound, "maximum": hi})


def _integer(lo: int, hi: int | None = None) -> Schema:
    return _nullable({"type": "integer", "minimum": lo, **({"maximum": hi} if hi is not None else {})})


def _boolean() -> Schema:
    return _nullable({"type": "boolean"})


def _token_ids(vocab_size: int, min_items: int) -> Schema:
    return {"type": "array", "minItems": min_items,
            "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}


def _common_fields(model: str, vocab_size: int) -> dict[str, Schema]:
    """Fields both routes read: the model, streaming, and the sampling parameters."""
    stop_string = {"type": "string", "minLength": 1}
    return {
        "model": _nullable({"type": "string", "enum": [model]}),
        "stream": _boolean(),
        "stream_options": _nullable({"type": "object", "properties": {
            "include_usage": _boolean()}}),
        "user": _nullable({"type": "string"}),
        "max_tokens": _integer(1),
        "temperature": _number(0, 100),
        "top_p": _number(0, 1, exclusive_lo=True),
        "top_k": _integer(-1, _INT64 - 1),
        "min_p": _number(0, 1),
        "seed": _integer(-_INT64, 2 * _INT64 - 1),
        "n": _integer(1, MAX_N),
        "presence_penalty": _number(-2, 2),
        "frequency_penalty": _number(-2, 2),
        "repetition_penalty": _number(0, 2, exclusive_lo=True),
        "min_tokens": _integer(0),
        "stop": _nullable({"anyOf": [stop_string, {"type": "array", "maxItems": MAX_STOP,
                                                   "items": stop_string}]}),
        "stop_token_ids": _nullable(_token_ids(vocab_size, 0)),
        "ignore_eos": _boolean(),
        "skip_special_tokens": _boolean(),
        **_request_field_schemas(vocab_size),
        **_structured_fields(),
    }


def _request_field_schemas(vocab_size: int) -> dict[str, Schema]:
    """logit_bias (token ids as string keys, each below the vocabulary size, else a 400),
    priority (vLLM's: lower is served earlier), include_stop_str_in_output."""
    return {
        "logit_bias": _nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                 "propertyNames": {"pattern": "^(0|[1-9][0-9]{0,9})$"},
                                 "additionalProperties": {"type": "number", "minimum": -100,
                                                          "maximum": 100}}),
        "priority": _integer(-2**31, 2**31 - 1),
        "include_stop_str_in_output": _boolean(),
    }


def _structured_fields() -> dict[str, Schema]:
    """Output constraints (``services.gateway.structured``): one of them at most, and each
    spec must compile (a bad schema, regex or grammar is a 400 naming the field)."""
    string, schema = {"type": "string"}, {"type": "object"}
    choices = {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}
    json_schema = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "description": string, "schema": schema,
        "strict": _boolean()}}
    return {
        "response_format": _nullable({"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": json_schema}}),
        "structured_outputs": _nullable({"type": "object", "properties": {
            "json": {"anyOf": [schema, string]}, "regex": string, "choice": choices,
            "grammar": string, "json_object": {"type": "boolean"}}}),
        "guided_json": _nullable({"anyOf": [schema, string]}),
        "guided_regex": _nullable(string),
        "guided_choice": _nullable(choices),
        "guided_grammar": _nullable(string),
    }


def chat_request(model: str, vocab_size: int) -> Schema:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    call = {"type": "object", "required": ["function"], "properties": {
        "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "minLength": 1},
            "arguments": {"type": "string"}}}}}  # a JSON object, as text
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": list(ROLES)},
        # (an assistant message with tool_calls may also send null)
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]},
        "tool_calls": {"type": "array", "items": call},  # assistant messages
        "tool_call_id": {"type": "string"}}}  # tool messages
    return {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "minItems": 1, "items": message},
        **_tool_fields(),
        **_common_fields(model, vocab_size),
        "max_completion_tokens": _integer(1),  # wins over max_tokens when both are given
        "logprobs": _boolean(),
        "top_logprobs": _integer(0, MAX_CHAT_TOP_LOGPROBS),
    }}


def _tool_fields() -> dict[str, Schema]:
    """``tools``: function names unique, parameters a JSON schema (``services.gateway.tools``)."""
    function = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": {"type": "string"},
        "parameters": {"type": "object"}}}
    tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]}, "function": function}}
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string"}}}}}  # one of the tools
    return {
        "tools": _nullable({"type": "array", "maxItems": MAX_TOOLS, "items": tool}),
        "tool_choice": _nullable({"anyOf": [
            {"type": "string", "enum": ["none", "auto", "required"]}, named]}),
        "parallel_tool_calls": _boolean(),
    }


def completion_request(model: str, vocab_size: int) -> Schema:
    text = {"type": "string", "minLength": 1}
    ids = _token_ids(vocab_size, 1)
    prompt = {"anyOf": [text, ids, {"type": "array", "minItems": 1, "maxItems": 1, "items": text},
                        {"type": "array", "minItems": 1, "maxItems": 1, "items": ids}]}
    return {"type": "object", "required": ["prompt"], "properties": {
        "prompt": prompt,
        **_common_fields(model, vocab_size),
        "echo": _boolean(),  # with logprobs, the prompt's tokens lead the logprobs
        "logprobs": _integer(0, MAX_COMPLETION_LOGPROBS),
        "prompt_logprobs": _integer(0, MAX_PROMPT_LOGPROBS),  # vLLM's
        "best_of": _integer(1, MAX_N),  # only equal to n
    }}


_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before trying again",
                                "schema": {"type": "string"}}}
_ERRORS = {
    "400": "the body is not a valid request (named in error.param)",
    "401": "a wrong or missing API key (with --api-key)",
    "404": "the model named is not served here",
    "429": "the router's queue is full",
    "500": "a bug in the gateway",
    "503": "no worker can serve it now, or it failed",
}


def _responses(kind: str) -> Schema:
    required = ["id", "object", "created", "model", "choices", "usage"]
    body = {"type": "object", "required": required,
            "properties": {"object": {"type": "string", "enum": [kind]},
                           "choices": {"type": "array", "minItems": 1}}}
    out: Schema = {"200": {"description": "the completion, or with stream: server-sent events",
                           "content": {"application/json": {"schema": body},
                                       "text/event-stream": {"schema": _SSE_EVENT}}}}
    for status, why in _ERRORS.items():
        out[status] = {"description": why, "content": {"application/json": {"schema": _ERROR}}}
        if status in ("429", "503"):
            out[status]["headers"] = _RETRY_AFTER
    return out


# One server-sent event, as SSE clients (and schemathesis) parse the stream: each `data:`
# line is a JSON chunk, or `[DONE]` last.
_SSE_EVENT: Schema = {"type": "object", "required": ["data"],
                      "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                     "id": {"type": "string"}, "retry": {"type": "integer"}}}


def operation(request: Schema, kind: str) -> Schema:
    """``openapi_extra`` for a route: its request body and its answers."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": request}}},
            "responses": _responses(kind)}


# ---- the small endpoints (``extras``) and /v1/responses (``responses_api``) ---------------

def _answers(ok: Schema, statuses: tuple[str, ...], streams: bool = False) -> Schema:
    content: Schema = {"application/json": {"schema": ok}}
    if streams:
        content["text/event-stream"] = {"schema": _SSE_EVENT}
    out: Schema = {"200": {"description": "the answer", "content": content}}
    for status in statuses:
        out[status] = {"description": _ERRORS.get(status, "the request cannot be served"),
                       "content": {"application/json": {"schema": _ERROR}}}
        if status in ("429", "503"):
            out[status]["headers"] = _RETRY_AFTER
    return out


def _body_operation(request: Schema, ok: Schema, statuses: tuple[str, ...],
                    streams: bool = False) -> Schema:
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": request}}},
            "responses": _answers(ok, statuses, streams)}


def simple_operation(ok: Schema) -> Schema:
    """A GET route's answers: its body, or an error."""
    return {"responses": _answers(ok, ("401", "404", "500"))}


VERSION: Schema = {"type": "object", "required": ["version"],
                   "properties": {"version": {"type": "string"}}}
MODEL: Schema = {"type": "object", "required": ["id", "object", "created", "owned_by"],
                 "properties": {"id": {"type": "string"}, "object": {"enum": ["model"]},
                                "created": {"type": "integer"}, "owned_by": {"type": "string"},
                                "max_model_len": {"type": "integer"}}}
_TOKENIZED: Schema = {"type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"],
                      "properties": {"count": {"type": "integer", "minimum": 0},
                                     "max_model_len": {"type": "integer"},
                                     "tokens": {"type": "array", "items": {"type": "integer"}},
                                     "token_strs": {"type": ["array", "null"],
                                                    "items": {"type": "string"}}}}
_SMALL_ERRORS = ("400", "401", "404", "413", "500")


def tokenize_operation(model: str, vocab_size: int) -> Schema:
    """vLLM's two /tokenize bodies: a completions prompt, or chat messages."""
    common = {"model": _common_fields(model, vocab_size)["model"],
              "add_special_tokens": _boolean(), "return_token_strs": _boolean()}
    prompt = {"type": "object", "required": ["prompt"],
              "properties": {"prompt": {"type": "string"}, **common}}
    messages = chat_request(model, vocab_size)["properties"]["messages"]
    chat = {"type": "object", "required": ["messages"],
            "properties": {"messages": messages, "add_generation_prompt": _boolean(),
                           "tools": _tool_fields()["tools"], **common}}
    return _body_operation({"oneOf": [prompt, chat]}, _TOKENIZED, _SMALL_ERRORS)


def detokenize_operation(model: str, vocab_size: int) -> Schema:
    request = {"type": "object", "required": ["tokens"],
               "properties": {"model": _common_fields(model, vocab_size)["model"],
                              "tokens": _token_ids(vocab_size, 0)}}
    ok = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
    return _body_operation(request, ok, _SMALL_ERRORS)


def responses_operation(model: str, vocab_size: int, roles: tuple[str, ...],
                        parts: tuple[str, ...]) -> Schema:
    """The stateless /v1/responses subset ``responses_api`` serves."""
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"enum": list(parts)}, "text": {"type": "string"}}}
    item = {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"enum": ["message"]}, "role": {"enum": list(roles)},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}}}
    fields = _common_fields(model, vocab_size)
    request = {"type": "object", "required": ["input"], "properties": {
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": item}]},
        "instructions": _nullable({"type": "string"}),
        "max_output_tokens": _integer(1),
        **{k: fields[k] for k in ("model", "stream", "temperature", "top_p", "user")},
        "store": _nullable({"enum": [False]}),
        "metadata": _nullable({"type": "object", "additionalProperties": {"type": "string"}}),
    }}
    ok = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
          "properties": {"object": {"enum": ["response"]},
                         "status": {"enum": ["completed", "incomplete"]},
                         "output": {"type": "array"}}}
    return _body_operation(request, ok, tuple(_ERRORS), streams=True)
