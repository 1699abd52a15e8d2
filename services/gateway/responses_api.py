"""A stateless subset of OpenAI's Responses API: ``POST /v1/responses``.

A Responses body becomes a chat request — ``instructions`` a system message first, then
``input`` (a string is one user message; a list holds message items whose content is a
string or ``input_text`` / ``output_text`` parts) — and goes the chat path from there
(``parse_chat``, the router, ``RequestRun``); only the answer's shape differs: a
``response`` object, or its stream of typed events (``responses_events``).

Served: ``model``, ``input``, ``instructions``, ``max_output_tokens``, ``temperature``,
``top_p``, ``stream``, ``user``, ``metadata`` (echoed back), ``store: false``;
``parallel_tool_calls``, ``prompt_cache_key``, ``safety_identifier``, ``stream_options``
and ``service_tier`` ``auto``/``default`` are accepted and change nothing (other unknown
fields are ignored, as on the chat route). Left out, each
a 400 naming the field (``UNSUPPORTED``): stored state (``store: true``,
``previous_response_id``, ``conversation``, ``background``, and the GET / DELETE / cancel
routes of a stored response), tools (``tools``, ``tool_choice`` beyond ``auto``/``none``,
``max_tool_calls``), ``reasoning``, ``include``, ``text.format`` other than ``text``,
``truncation: auto``, ``prompt`` templates, ``top_logprobs``, and input items other than
messages (function calls and their outputs, reasoning, item references) or content other
than text (images, files, audio).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from services.gateway import generation, openapi
from services.gateway.errors import APIError, shown, unicode_text
from services.gateway.parsing import ParsedRequest
from services.gateway.responses_events import ResponsesStream, response_object

if TYPE_CHECKING:
    from services.gateway.app import Gateway

ROLES = ("user", "assistant", "system", "developer")
PARTS = ("input_text", "output_text")  # output_text: an earlier answer sent back as input
# Fields that ask for what this server does not do, and the values that ask for nothing.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None,), "conversation": (None,), "store": (None, False),
    "background": (None, False), "tools": (None, []), "tool_choice": (None, "auto", "none"),
    "max_tool_calls": (None,), "reasoning": (None, {}), "include": (None, []),
    "truncation": (None, "disabled"), "prompt": (None,), "top_logprobs": (None, 0),
    "service_tier": (None, "auto", "default"),
}
# parse_chat names chat fields; a client of this route sent these instead.
_RENAMED = {"messages": "input", "max_tokens": "max_output_tokens"}


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A Responses body: the chat request it runs as, and what its answer echoes back."""

    parsed: ParsedRequest  # request_id "resp_..."
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    item_id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)


def install(app: FastAPI, gw: Gateway) -> None:
    doc = openapi.responses_operation(gw.model_name, gw.spec.vocab_size, ROLES, PARTS)

    @app.post("/v1/responses", openapi_extra=doc)
    async def create_response(request: Request) -> Response:
        body = await generation.read_json(gw, request)
        if generation.client_left(body):
            return generation.nobody()
        req = parse_responses(body, gw)
        run = await generation.start_run(gw, request, req.parsed)
        if run is None:
            return generation.nobody()
        if req.parsed.stream:
            return generation.event_stream(gw, run.sse(request, ResponsesStream(req)))
        body = await run.collect(request, lambda _, choices, usage: response_object(
            req, choices[0].text, choices[0].finish_reason, usage))
        return generation.answer(gw, body)

    @app.api_route("/v1/responses/{response_id:path}", methods=["GET", "DELETE", "POST"],
                   include_in_schema=False)
    async def stored_response(response_id: str) -> Response:
        raise APIError(404, f"No response found with id {shown(response_id)}: this server "
                       "does not store responses (store is not supported)",
                       param="response_id")


def parse_responses(body: Any, gw: Gateway) -> ResponsesRequest:
    """Validate a /v1/responses body and run it through the chat request parser."""
    if not isinstance(body, Mapping):
        raise APIError.invalid("the request body must be a JSON object")
    _reject_unsupported(body)
    instructions = _optional_str(body, "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions is not None else [])
    messages += _input_messages(body.get("input"))
    chat = {"messages": messages, "max_tokens": body.get("max_output_tokens"),
            **{k: body.get(k) for k in ("model", "stream", "temperature", "top_p", "user")}}
    try:
        parsed = gw.parse("chat", chat)
    except APIError as e:
        raise responses_error(e, instructions is not None, isinstance(body.get("input"), str)) from None
    parsed = replace(parsed, request_id="resp_" + uuid.uuid4().hex)
    return ResponsesRequest(parsed, instructions, body.get("max_output_tokens"),
                            _metadata(body.get("metadata")))


def _reject_unsupported(body: Mapping[str, Any]) -> None:
    for name, neutral in UNSUPPORTED.items():
        value = body.get(name)
        if not any(value == v and type(value) is type(v) for v in neutral):
            raise APIError.invalid(f"{name} {shown(value)} is not supported by this server "
                                   "(it serves a stateless subset of the Responses API)", name)
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if text is not None and (not isinstance(text, Mapping) or fmt not in (None, {"type": "text"})):
        raise APIError.invalid("text.format other than {\"type\": \"text\"} is not supported "
                               "by this server", "text.format")


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise APIError.invalid("Missing required parameter: 'input'.", "input")
    if isinstance(value, str):
        return [{"role": "user", "content": unicode_text(value, "input")}]
    if not isinstance(value, list) or not value:
        raise APIError.invalid(f"input must be a string or a non-empty array of message "
                               f"items, got {shown(value)}", "input")
    return [_item(i, item) for i, item in enumerate(value)]


def _item(i: int, item: Any) -> dict[str, Any]:
    where = f"input.[{i}]"
    if not isinstance(item, Mapping):
        raise APIError.invalid(f"{where} must be a message item, got {shown(item)}", where)
    kind = item.get("type", "message")
    if kind != "message":
        raise APIError.invalid(f"{where}.type: items of type {shown(kind)} are not supported "
                               "(only messages)", f"{where}.type")
    role = item.get("role")
    if role not in ROLES:  # a list or dict is "not in" as well, never a TypeError
        raise APIError.invalid(f"{where}.role: invalid value {shown(role)}; supported values "
                               f"are {', '.join(ROLES)}", f"{where}.role")
    return {"role": role, "content": _content(item.get("content"), f"{where}.content")}


def _content(value: Any, where: str) -> str | list[dict[str, str]]:
    """A string, or the text parts as chat text parts (the chat parser checks the text)."""
    if isinstance(value, str):
        return unicode_text(value, where)
    if not isinstance(value, list):
        raise APIError.invalid(f"{where} must be a string or an array of input_text parts, "
                               f"got {shown(value)}", where)
    parts = []
    for j, part in enumerate(value):
        at = f"{where}.[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in PARTS or not isinstance(part.get("text"), str):
            raise APIError.invalid(f"{at} must be a text part {{\"type\": \"input_text\", "
                                   f"\"text\": \"...\"}}, got {shown(kind or part)}", at)
        parts.append({"type": "text", "text": unicode_text(part["text"], at)})
    return parts


def _optional_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise APIError.invalid(f"{name} must be a string, got {shown(value)}", name)
    return value if value is None else unicode_text(value, name)


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
        raise APIError.invalid("metadata must be an object of strings", "metadata")
    return dict(value)


def responses_error(e: APIError, has_instructions: bool, input_is_text: bool) -> APIError:
    """A chat parser's error with the field names this route's client used: a message's
    index counts from ``input``'s first item (``instructions`` became message 0)."""
    param = e.param or ""
    head, dot, rest = param.partition(".")
    if head == "messages" and (m := re.match(r"\[(\d+)\]", rest)):
        index = int(m.group(1)) - has_instructions
        tail = rest[m.end():]
        param = ("instructions" if index < 0 else "input" if input_is_text  # the one string
                 else f"input.[{index}]{tail}")
    elif head in _RENAMED:
        param = _RENAMED[head] + dot + rest
    message = e.message.replace("max_tokens", "max_output_tokens")
    return APIError(e.status, message, param=param or None, code=e.code, type=e.type,
                    retry_after=e.retry_after)
