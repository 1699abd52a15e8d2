"""The gateway: the OpenAI-compatible HTTP front door (FastAPI).

One request's path: parse and validate (``parsing``) → submit to the router and wait
for admission (429/503 with ``Retry-After`` when refused) → gather tokens from whichever
workers produce them (``ResponseAssembler`` orders, detokenizes and applies stop strings) →
answer as JSON or as server-sent events (``responses``); ``generation`` holds those steps
for every generation route (chat, completions, and ``responses_api``'s /v1/responses). A
client that goes away, a stop string, or a timeout aborts the request on every service,
so its KV blocks are freed. ``extras`` serves the small endpoints (/tokenize, ...).
Every error body, and the API key, are ``guards``' business; shutting down without
cutting a stream is ``drain``'s (SIGTERM: new requests get 503, ``/ready`` 503, open
ones finish).
"""

from __future__ import annotations

import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.metrics import GatewayMetrics
from common.model.loader import resolve_model
from common.model.spec import ModelSpec
from common.model.tokenizer import Tokenizer
from services.gateway import extras, generation, openapi, responses, responses_api
from services.gateway.dashboard import install_dashboard
from services.gateway.drain import GatewayDrain, OpenRequests
from services.gateway.errors import APIError
from services.gateway.guards import install_guards
from services.gateway.parsing import ParsedRequest, parse_chat, parse_completion
from services.gateway.router_link import RouterLink
from services.gateway.settings import GatewaySettings
from services.gateway.timeline import Timeline
from services.timeouts import check_admission

log = logging.getLogger("tandem.gateway")


class Gateway:
    """What the routes share: settings, tokenizer, the router link, metrics."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        source = resolve_model(settings.model)
        self.spec = ModelSpec.from_hf_config(source.hf_config())
        self.tokenizer = Tokenizer(source.directory)
        self.model_name = settings.served_model_name or source.name
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry, self.model_name)
        self.migrations = Counter("tandem:request_migrations", "Requests moved to another "
                                  "worker after theirs died", registry=self.registry)
        self.http_requests = Counter("tandem:http_requests", "HTTP responses", ["status"],
                                     registry=self.registry)
        self.link: RouterLink | None = None
        self.drain = GatewayDrain()
        self.timeline = Timeline()  # recent requests' phases, for /dashboard
        self.created = int(time.time())

    @property
    def max_model_len(self) -> int:
        limits = [self.settings.max_model_len or self.spec.max_position_embeddings]
        status = self.link.last_status if self.link else None
        if status is not None and status.max_model_len:
            limits.append(status.max_model_len)
        return min(limits)

    def parse(self, kind: str, body) -> ParsedRequest:
        if kind == "chat":
            return parse_chat(body, self.tokenizer, self.model_name, self.max_model_len,
                              vocab_size=self.spec.vocab_size,
                              tool_call_parser=self.settings.tool_call_parser)
        return parse_completion(body, self.tokenizer, self.model_name, self.max_model_len,
                                vocab_size=self.spec.vocab_size)


def create_app(settings: GatewaySettings) -> FastAPI:
    gw = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        gw.link = RouterLink(settings.router, settings.stream_bind, settings.advertise_host,
                             reach_s=settings.router_reach_timeout)
        gw.link.start()
        status = await gw.link.status(timeout=1.0)
        if status is not None:
            try:
                check_admission(settings.admission_timeout, status.queue_timeout)
            except ValueError as e:
                log.warning("%s", e)
        log.info("gateway for %s, router %s, tokens at %s", gw.model_name, settings.router,
                 gw.link.reply_to)
        yield
        await gw.link.close()

    app = FastAPI(title="Tandem", lifespan=lifespan)
    app.state.gateway = gw
    install_guards(app, settings.api_key, lambda e: error_response(gw, e))
    app.add_middleware(OpenRequests, drain=gw.drain)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the router answers with workers of both roles, and not draining."""
        status = await gw.link.status(timeout=1.0)
        ready = (status is not None and status.prefill_workers > 0 and status.decode_workers > 0
                 and not gw.drain.draining)
        state = "draining" if gw.drain.draining else "ok" if ready else "unavailable"
        detail = {"status": state, "router": status is not None,
                  "prefill_workers": status.prefill_workers if status else 0,
                  "decode_workers": status.decode_workers if status else 0,
                  "tokens_at": gw.link.reply_to}  # where workers push tokens (PULL)
        return JSONResponse(detail, status_code=200 if ready else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: linked to the router (it answers a ping) and not draining."""
        status = None if gw.drain.draining else await gw.link.status(timeout=1.0)
        reason = ("draining" if gw.drain.draining else
                  "the router does not answer" if status is None else None)
        if reason is not None:
            return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ready", "prefill_workers": status.prefill_workers,
                             "decode_workers": status.decode_workers})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.registry), media_type=CONTENT_TYPE_LATEST)

    install_dashboard(app, gw)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(responses.models_list([gw.model_name], gw.max_model_len, gw.created))

    vocab = gw.spec.vocab_size
    chat_doc = openapi.operation(openapi.chat_request(gw.model_name, vocab), "chat.completion")
    completion_doc = openapi.operation(openapi.completion_request(gw.model_name, vocab),
                                       "text_completion")

    @app.post("/v1/chat/completions", openapi_extra=chat_doc)
    async def chat(request: Request) -> Response:
        return await handle(gw, request, "chat")

    @app.post("/v1/completions", openapi_extra=completion_doc)
    async def completions(request: Request) -> Response:
        return await handle(gw, request, "completion")

    extras.install(app, gw)  # /tokenize, /detokenize, /version, /v1/models/{id}
    responses_api.install(app, gw)  # /v1/responses
    return app


def error_response(gw: Gateway, e: APIError) -> JSONResponse:
    gw.http_requests.labels(str(e.status)).inc()
    headers = {"Retry-After": str(max(1, round(e.retry_after)))} if e.retry_after else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def handle(gw: Gateway, request: Request, kind: str) -> Response:
    body = await generation.read_json(gw, request)
    if generation.client_left(body):
        return generation.nobody()
    parsed = gw.parse(kind, body)
    run = await generation.start_run(gw, request, parsed)
    if run is None:
        return generation.nobody()
    if parsed.stream:
        return generation.event_stream(gw, run.sse(request))
    return generation.answer(gw, await run.collect(request))
