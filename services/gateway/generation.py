"""One generation request over HTTP, whatever API it came through.

The chat, completions and Responses routes differ only in how a body becomes a
``ParsedRequest`` and how the answer is written; between those two steps each goes the
same way: ``read_json`` (503 while draining, 413 over the limit, ``client_left`` when the
client went before its body arrived) → ``start_run`` (submit to the router and wait for
admission, 429/503 with ``Retry-After`` when refused, ``None`` when the client left while
queued) → a ``RequestRun`` whose ``collect`` or ``sse`` the route answers with
(``answer`` / ``event_stream``).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from common.protocol import Rejected, Tokens
from services.gateway.assembler import ResponseAssembler
from services.gateway.disconnect import ClientGone, ClientWatch
from services.gateway.errors import APIError
from services.gateway.guards import read_body
from services.gateway.parsing import ParsedRequest, parse_json
from services.gateway.router_link import RouterUnavailable
from services.gateway.run import RequestRun

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from services.gateway.app import Gateway

ROUTER_RETRY_AFTER = 2.0  # seconds a client waits before retrying while the router is away
DRAIN_RETRY_AFTER = 1.0  # a draining gateway's clients retry (another gateway) at once
_GONE = object()  # read_json's answer when the client left before its body arrived


def nobody() -> Response:
    """What a route returns once its client has left: nobody reads it."""
    return Response(status_code=204)


async def read_json(gw: Gateway, request: Request) -> Any:
    """The body as JSON (an ``APIError`` when it is not), or a value ``client_left``
    recognises when the client went before sending it all."""
    if gw.drain.draining:
        raise APIError.unavailable("the server is shutting down: retry the request",
                                   retry_after=DRAIN_RETRY_AFTER)
    try:
        raw = await read_body(request)
    except ClientDisconnect:  # gone before its body arrived: nothing to abort upstream
        gw.metrics.success.labels("abort").inc()
        return _GONE
    return parse_json(raw)


def client_left(body: Any) -> bool:
    return body is _GONE


async def start_run(gw: Gateway, request: Request, parsed: ParsedRequest) -> RequestRun | None:
    """Admit the request and set up its run; None when the client left while queued."""
    watch = ClientWatch(request.receive)  # from here on a client that leaves is seen at once
    trace = gw.timeline.start(parsed.request_id)  # its row on /dashboard
    try:
        channel = await watch.race(admit(gw, parsed))
    except ClientGone:  # left while queued: the router must forget the request
        watch.close()
        gw.timeline.end(trace, "abort")
        gw.metrics.success.labels("abort").inc()
        await asyncio.shield(gw.link.abort(parsed.request_id))
        return None
    except BaseException:
        watch.close()
        gw.timeline.end(trace, "rejected")
        raise
    trace.admitted = time.monotonic()
    assembler = ResponseAssembler(gw.tokenizer, parsed.prompt_token_ids, parsed.params)
    return RequestRun(gw, parsed, assembler, channel, watch, trace)


def event_stream(gw: Gateway, events: AsyncIterator[bytes]) -> StreamingResponse:
    gw.http_requests.labels("200").inc()
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def answer(gw: Gateway, body: dict) -> JSONResponse:
    gw.http_requests.labels("200").inc()
    return JSONResponse(body)


async def admit(gw: Gateway, parsed: ParsedRequest) -> asyncio.Queue[Tokens]:
    try:
        admission = await gw.link.submit(parsed.request_id, parsed.prompt_token_ids,
                                         parsed.params, gw.settings.admission_timeout)
    except RouterUnavailable as e:
        raise APIError.unavailable(f"the service is not available: {e}",
                                   retry_after=ROUTER_RETRY_AFTER) from None
    refused = admission.verdict
    if isinstance(refused, Rejected):
        raise APIError(refused.status, refused.reason, retry_after=refused.retry_after,
                       code="rate_limit_exceeded" if refused.status == 429 else None)
    return admission.channel
