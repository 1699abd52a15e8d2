"""Prometheus metrics with vLLM's names under our ``tandem:`` prefix, and the small HTTP
server (``/metrics``, ``/health``, ``/ready``) that every non-gateway service runs.

Each service builds its own ``CollectorRegistry``, so several services can live in one
test process without clashing.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                         0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# Tokens per request, and per engine step (vLLM's buckets for the same histograms).
REQUEST_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                         50000, 100000)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MODEL = "model_name"  # the label every request and engine metric carries, as vLLM's do


class ByModel:
    """A labelled metric seen through its ``model_name`` label: ``labels(...)`` takes the
    other labels only, so a call site reads as it did before the model label existed."""

    def __init__(self, metric, model_name: str) -> None:
        self._metric, self._model = metric, model_name

    def labels(self, *values: str):
        return self._metric.labels(self._model, *values)

    def collect(self):
        """The whole family, every label set (as the metric's own ``collect``)."""
        return self._metric.collect()


def _model_metric(kind, name: str, doc: str, model_name: str, labels: tuple[str, ...] = (),
                  registry: CollectorRegistry | None = None, **kw):
    """One metric under ``model_name``: the bound child when it has no other labels, else
    a ``ByModel`` to pick the other labels from."""
    metric = kind(name, doc, [MODEL, *labels], registry=registry, **kw)
    return ByModel(metric, model_name) if labels else metric.labels(model_name)


def counter_value(child) -> float:
    """The running total of one counter child (what a heartbeat reports: prometheus_client
    keeps it in ``_value``; tests/test_metrics.py pins the behaviour)."""
    return child._value.get()


class RequestMetrics:
    """Latency histograms and token counters, as seen by whoever owns the request's
    lifetime. Every one carries ``model_name``."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def metric(kind, name, doc, labels=(), **kw):
            return _model_metric(kind, name, doc, model_name, labels, registry, **kw)

        self.model_name = model_name
        self.ttft = metric(Histogram, "tandem:time_to_first_token_seconds", "Time to first token",
                           buckets=LATENCY_BUCKETS)
        self.itl = metric(Histogram, "tandem:inter_token_latency_seconds",
                          "Time between output tokens", buckets=TOKEN_LATENCY_BUCKETS)
        self.e2e = metric(Histogram, "tandem:e2e_request_latency_seconds", "Request latency",
                          buckets=LATENCY_BUCKETS)
        self.prompt_tokens = metric(Counter, "tandem:prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = metric(Counter, "tandem:generation_tokens", "Tokens generated")
        self.success = metric(Counter, "tandem:request_success", "Finished requests",
                              ("finished_reason",))


class GatewayMetrics(RequestMetrics):
    """What the gateway sees of each whole request (vLLM's request-level histograms): its
    phases from admission to the last token, and its sizes. Workers see only their part of
    a disaggregated request, so these live here alone."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        super().__init__(registry, model_name)

        def metric(kind, name, doc, **kw):
            return _model_metric(kind, name, doc, model_name, registry=registry, **kw)

        self.tpot = metric(Histogram, "tandem:time_per_output_token_seconds",
                           "Mean time per output token after the first, per request",
                           buckets=TOKEN_LATENCY_BUCKETS)
        self.prefill_time = metric(Histogram, "tandem:request_prefill_time_seconds",
                                   "Admission to the first token (prefill)", buckets=LATENCY_BUCKETS)
        self.decode_time = metric(Histogram, "tandem:request_decode_time_seconds",
                                  "First token to the last (decode, and the KV transfer before "
                                  "it when disaggregated)", buckets=LATENCY_BUCKETS)
        self.request_prompt_tokens = metric(Histogram, "tandem:request_prompt_tokens",
                                            "Prompt tokens per request", buckets=REQUEST_TOKEN_BUCKETS)
        self.request_generation_tokens = metric(Histogram, "tandem:request_generation_tokens",
                                                "Generated tokens per request (all choices)",
                                                buckets=REQUEST_TOKEN_BUCKETS)

    def observe_request(self, phases: RequestPhases) -> None:
        """One finished request: its sizes and phase histograms."""
        self.request_prompt_tokens.observe(phases.prompt_tokens)
        self.request_generation_tokens.observe(phases.generation_tokens)
        if phases.first_token is None:
            return
        self.prefill_time.observe(phases.first_token - phases.admitted)
        self.decode_time.observe(phases.finished - phases.first_token)
        if phases.generation_tokens > 1:
            self.tpot.observe((phases.finished - phases.first_token)
                              / (phases.generation_tokens - 1))


@dataclass(frozen=True, slots=True)
class RequestPhases:
    """When a request was admitted, produced its first token and finished (one clock), and
    its sizes: what ``GatewayMetrics.observe_request`` records."""

    admitted: float
    first_token: float | None  # None: it ended before any token
    finished: float
    prompt_tokens: int
    generation_tokens: int


class EngineMetrics(RequestMetrics):
    """What a worker's engine reports."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        super().__init__(registry, model_name)

        def metric(kind, name, doc, labels=(), **kw):
            return _model_metric(kind, name, doc, model_name, labels, registry, **kw)

        self.running = metric(Gauge, "tandem:num_requests_running", "Requests in the running batch")
        self.waiting = metric(Gauge, "tandem:num_requests_waiting", "Requests waiting to run")
        self.kv_usage = metric(Gauge, "tandem:kv_cache_usage_perc",
                               "Fraction of KV blocks held by requests (1 = full)")
        self.iteration_tokens = metric(Histogram, "tandem:iteration_tokens_total",
                                       "Tokens computed per engine step",
                                       buckets=ITERATION_TOKEN_BUCKETS)
        self.prefix_queries = metric(Counter, "tandem:prefix_cache_queries",
                                     "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = metric(Counter, "tandem:prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache")
        self.preemptions = metric(Counter, "tandem:num_preemptions", "Sequences preempted")
        # Acceptance rate = rate(accepted) / rate(draft), as with vLLM's counters.
        self.spec_draft_tokens = metric(Counter, "tandem:spec_decode_num_draft_tokens",
                                        "Speculative draft tokens verified")
        self.spec_accepted_tokens = metric(Counter, "tandem:spec_decode_num_accepted_tokens",
                                           "Speculative draft tokens accepted")
        self.step_threads = metric(Gauge, "tandem:step_threads", "Threads the last engine step "
                                   "ran on (with --share-cpus: what the other workers left)")
        self.cpu_wait = metric(Counter, "tandem:cpu_wait_seconds", "Time prefill steps waited "
                               "for a CPU that other workers' steps held (--share-cpus)")
        self.kv_bytes = metric(Counter, "tandem:kv_transfer_bytes", "KV bytes shipped or received",
                               ("direction",))
        self.kv_received = metric(Counter, "tandem:kv_transfers_received", "KV transfers taken "
                                  "in, by how their blocks came: shm (borrowed from a same-host "
                                  "sender's memory) or the receiver's transport (tcp, ipc, ucx)",
                                  ("via",))
        self.kv_seconds = metric(Histogram, "tandem:kv_transfer_seconds",
                                 "Send to ack of one KV transfer", buckets=LATENCY_BUCKETS)
        self.kv_pieces = metric(Counter, "tandem:kv_stream_pieces", "KV stream pieces (non-final "
                                "transfers of a prompt shipped chunk by chunk) sent or received",
                                ("direction",))
        self.kv_failures = metric(Counter, "tandem:kv_transfer_failures", "KV transfers that failed",
                                  ("reason",))
        self.handler_errors = metric(Counter, "tandem:worker_handler_errors",
                                     "Messages or requests whose handling failed (the worker "
                                     "went on)", ("handler",))

    def kv_bytes_total(self, direction: str) -> int:
        """KV bytes sent (``sent``) or received (``received``) since the worker started."""
        return int(counter_value(self.kv_bytes.labels(direction)))


@dataclass(frozen=True, slots=True)
class ServiceHealth:
    """What ``/health`` (or ``/ready``) answers: 200 with ``detail`` when ``ok``, else 503
    (``detail`` then says why, under ``reason``)."""

    ok: bool
    detail: dict[str, Any]


class MetricsServer:
    """``/metrics`` (Prometheus text), ``/health`` and ``/ready`` (JSON) on a daemon thread.

    ``/health`` is liveness: the process answers (a probe that fails restarts it).
    ``/ready`` is readiness: the service can take work now (a probe that fails only takes
    it out of rotation); without a ``ready`` callable it answers as ``/health``."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 health: Callable[[], ServiceHealth],
                 ready: Callable[[], ServiceHealth] | None = None) -> None:
        handler = _handler(registry, health, ready or health)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True, name="metrics-http")

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(registry: CollectorRegistry, health: Callable[[], ServiceHealth],
             ready: Callable[[], ServiceHealth]):
    probes = {"/health": health, "/ready": ready}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            probe = probes.get(self.path.partition("?")[0])
            if self.path.startswith("/metrics"):
                self._reply(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            elif probe is not None:
                h = probe()
                self._reply(200 if h.ok else 503, "application/json", json.dumps(h.detail).encode())
            else:
                self._reply(404, "text/plain", b"not found\n")

        def _reply(self, status: int, ctype: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes every few seconds: keep logs clean
            pass

    return Handler
