"""The gateway's small endpoints, in vLLM's shapes: ``/tokenize``, ``/detokenize``,
``/version`` and ``/v1/models/{id}``.

None of them reaches a worker: the gateway's own tokenizer answers. ``/tokenize`` takes
a completions ``prompt`` or chat ``messages`` (rendered exactly as a chat request's are)
and does not refuse a prompt longer than the context (``count`` next to
``max_model_len`` is how a client checks that); only inputs past a fixed size are
refused, so one request cannot hold the event loop for long. Every bad field is a 400
naming it.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from common.errors import InvalidRequestError
from common.rules import check_token_ids
from services.gateway import openapi, responses
from services.gateway.errors import APIError, shown, unicode_text
from services.gateway.guards import read_body
from services.gateway.parsing import parse_json
from services.gateway.prompts import parse_messages, render_chat
from services.gateway.tool_parsers import rendering_parser
from services.gateway.tools import parse_tools

if TYPE_CHECKING:
    from services.gateway.app import Gateway

# Tokenizing runs on the event loop (the tokenizer is not safe to share with threads), so a
# request is capped: 1M characters is some 250k tokens, more than any context here.
MAX_TEXT_CHARS = 1024 * 1024
MAX_TOKEN_IDS = 1024 * 1024
_UNSUPPORTED_CHAT = ("chat_template", "chat_template_kwargs", "mm_processor_kwargs")


def package_version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


def install(app: FastAPI, gw: Gateway) -> None:
    """Register the routes on the gateway's app."""
    vocab, model = gw.spec.vocab_size, gw.model_name

    @app.post("/tokenize", openapi_extra=openapi.tokenize_operation(model, vocab))
    async def tokenize_route(request: Request) -> Response:
        body = await _read(request)
        if body is None:
            return Response(status_code=204)  # the client left: nobody reads it
        return _ok(gw, tokenize(gw, body))

    @app.post("/detokenize", openapi_extra=openapi.detokenize_operation(model, vocab))
    async def detokenize_route(request: Request) -> Response:
        body = await _read(request)
        if body is None:
            return Response(status_code=204)
        return _ok(gw, detokenize(gw, body))

    @app.get("/version", openapi_extra=openapi.simple_operation(openapi.VERSION))
    async def version() -> JSONResponse:
        return _ok(gw, {"version": package_version()})

    @app.get("/v1/models/{model_id:path}", openapi_extra=openapi.simple_operation(openapi.MODEL))
    async def model_route(model_id: str) -> JSONResponse:
        if model_id != gw.model_name:
            raise APIError.model_not_found(model_id)
        return _ok(gw, responses.model_card(gw.model_name, gw.max_model_len, gw.created))


def _ok(gw: Gateway, body: dict[str, Any]) -> JSONResponse:
    gw.http_requests.labels("200").inc()
    return JSONResponse(body)


async def _read(request: Request) -> Any:
    """The JSON body; None when the client left before sending it all."""
    try:
        raw = await read_body(request)
    except ClientDisconnect:
        return None
    return parse_json(raw)


def tokenize(gw: Gateway, body: Any) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse`` for a ``{prompt}`` or a ``{messages}`` body."""
    body = _object(body)
    check_model(body, gw.model_name)
    chat = body.get("messages") is not None
    if chat and body.get("prompt") is not None:
        raise APIError.invalid("send either prompt or messages, not both", "messages")
    # vLLM's defaults: a chat's template writes the special tokens, a prompt gets them added.
    special = _flag(body, "add_special_tokens", default=not chat)
    ids = _chat_ids(gw, body, special) if chat else _prompt_ids(gw, body, special)
    pieces = gw.tokenizer.hf.convert_ids_to_tokens(ids) if _flag(body, "return_token_strs") else None
    return {"count": len(ids), "max_model_len": gw.max_model_len, "tokens": ids,
            "token_strs": pieces}


def _prompt_ids(gw: Gateway, body: Mapping[str, Any], special: bool) -> list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError.invalid("Missing required parameter: 'prompt' (or 'messages').", "prompt")
    if not isinstance(prompt, str):
        raise APIError.invalid(f"prompt must be a string, got {shown(prompt)}", "prompt")
    _check_size(len(prompt), "prompt")
    return gw.tokenizer.encode(unicode_text(prompt, "prompt"), add_special_tokens=special)


def _chat_ids(gw: Gateway, body: Mapping[str, Any], special: bool) -> list[int]:
    for name in _UNSUPPORTED_CHAT:
        if body.get(name) not in (None, [], {}):
            raise APIError.invalid(f"{name} is not supported by this server", name)
    if _flag(body, "continue_final_message"):
        raise APIError.invalid("continue_final_message is not supported by this server",
                               "continue_final_message")
    messages = parse_messages(body.get("messages"))  # 400s naming messages.[i]...
    _check_size(sum(len(m["content"]) for m in messages), "messages")
    tools = parse_tools(body)  # rendered as a chat request with them would be
    return render_chat(messages, gw.tokenizer, tools.rendered if tools else (),
                       rendering_parser(gw.settings.tool_call_parser),
                       add_generation_prompt=_flag(body, "add_generation_prompt", default=True),
                       add_special_tokens=special)


def detokenize(gw: Gateway, body: Any) -> dict[str, Any]:
    """vLLM's ``DetokenizeResponse``: the text of ``tokens``, special tokens included."""
    body = _object(body)
    check_model(body, gw.model_name)
    tokens = body.get("tokens")
    if tokens is None:
        raise APIError.invalid("Missing required parameter: 'tokens'.", "tokens")
    if not isinstance(tokens, list):
        raise APIError.invalid(f"tokens must be an array of token ids, got {shown(tokens)}",
                               "tokens")
    if not tokens:
        return {"prompt": ""}
    if len(tokens) > MAX_TOKEN_IDS:
        raise APIError.invalid(f"tokens holds {len(tokens)} ids; at most {MAX_TOKEN_IDS} "
                               "are detokenized at once", "tokens")
    try:
        check_token_ids(tokens, gw.spec.vocab_size, "tokens")
    except InvalidRequestError as e:
        raise APIError.from_invalid_request(e) from None
    return {"prompt": gw.tokenizer.decode(tokens, skip_special_tokens=False)}


def check_model(body: Mapping[str, Any], served: str) -> None:
    """As the generation routes: ``model`` may be left out; another name is a 404."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError.invalid(f"model must be a string, got {shown(model)}", "model")
    if model is not None and model != served:
        raise APIError.model_not_found(model)


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise APIError.invalid("the request body must be a JSON object")
    return body


def _flag(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError.invalid(f"{name} must be a boolean, got {shown(value)}", name)
    return value


def _check_size(chars: int, where: str) -> None:
    if chars > MAX_TEXT_CHARS:
        raise APIError.invalid(f"{where} holds {chars} characters; at most {MAX_TEXT_CHARS} "
                               "are tokenized at once", where)
