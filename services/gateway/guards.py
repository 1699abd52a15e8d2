"""What every HTTP request to the gateway passes through, whatever its route.

* The API key: with ``--api-key`` set, every path but ``/health`` and ``/ready`` (which
  load balancers, Kubernetes and the launcher probe without credentials) needs ``Authorization: Bearer KEY``,
  compared in constant time.
* Error bodies: every error a client sees has OpenAI's ``{"error": {...}}`` shape —
  our own ``APIError``s, Starlette's 404/405, FastAPI's validation errors, and any
  unexpected exception (a 500). Starlette's own last-resort handler re-raises after
  answering, which makes uvicorn drop the connection; ours answers and returns, so a
  keep-alive connection outlives a bug in one request.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import APIError

log = logging.getLogger("tandem.gateway")

Respond = Callable[[APIError], Response]  # an APIError as the response that carries it
# Probes need no key, nor the dashboard's page (it holds no data: its polls send the key).
OPEN_PATHS = frozenset({"/health", "/ready", "/dashboard"})


def install_guards(app: FastAPI, api_key: str | None, respond: Respond) -> None:
    """Error handlers and the two middlewares; call once, before the app serves."""

    async def api_error(request: Request, e: APIError) -> Response:
        return respond(e)

    async def http_error(request: Request, e: HTTPException) -> Response:
        message = e.detail if isinstance(e.detail, str) else "the request cannot be served"
        where = f"{request.method} {request.url.path}"
        if e.status_code == 404:  # no such route: OpenAI's words for it
            message = f"Invalid URL ({where})"
        elif e.status_code == 405:
            allowed = (e.headers or {}).get("Allow", "")
            message = f"Method Not Allowed ({where}); this route takes {allowed}"
        response = respond(APIError(e.status_code, message))
        response.headers.update(e.headers or {})  # 405 says which methods are allowed
        return response

    async def validation_error(request: Request, e: RequestValidationError) -> Response:
        # Routes read their bodies themselves, so this only guards routes added later.
        return respond(APIError.invalid(f"the request is not valid: {e.errors()}"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    # add_middleware puts each one outside the previous: the 500 guard wraps the key check.
    app.add_middleware(RequireAPIKey, api_key=api_key, respond=respond)
    app.add_middleware(AnswerUnexpectedErrors, respond=respond)


def key_matches(header: bytes | None, api_key: str) -> bool:
    """Constant-time, so the time to refuse does not tell how much of a guess was right."""
    return hmac.compare_digest(header or b"", f"Bearer {api_key}".encode())


class RequireAPIKey:
    """401 before any route runs when the key is wrong; nothing at all without a key."""

    def __init__(self, app: ASGIApp, api_key: str | None, respond: Respond) -> None:
        self.app, self.api_key, self.respond = app, api_key, respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key and scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization")
            if not key_matches(header, self.api_key):
                await self.respond(APIError.invalid_api_key())(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AnswerUnexpectedErrors:
    """An exception no handler took becomes a 500 OpenAI body, if nothing was sent yet."""

    def __init__(self, app: ASGIApp, respond: Respond) -> None:
        self.app, self.respond = app, respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            if started:  # half a response is out: only closing the connection can end it
                raise
            log.exception("unexpected error on %s", scope.get("path"))
            await self.respond(APIError.server_error())(scope, receive, send)


MAX_BODY_BYTES = 16 * 1024 * 1024  # a 100k-token prompt is under 1 MB of JSON


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refused with 413 before more than ``limit`` bytes are held."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body of {declared} bytes exceeds {limit}")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)
