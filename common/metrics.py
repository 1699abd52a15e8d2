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


class RequestMetrics:
    """Latency histograms, as seen by whoever owns the request's lifetime."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Time between output tokens",
                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated", registry=r)
        self.success = Counter("tandem:request_success", "Finished requests",
                               ["finished_reason"], registry=r)


class EngineMetrics(RequestMetrics):
    """What a worker's engine reports."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        r = registry
        self.running = Gauge("tandem:num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("tandem:num_requests_waiting", "Requests waiting to run", registry=r)
        self.kv_usage = Gauge("tandem:kv_cache_usage_perc",
                              "Fraction of KV blocks held by requests (1 = full)", registry=r)
        self.prefix_queries = Counter("tandem:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("tandem:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache", registry=r)
        self.preemptions = Counter("tandem:num_preemptions", "Sequences preempted", registry=r)
        # Acceptance rate = rate(accepted) / rate(draft), as with vLLM's counters.
        self.spec_draft_tokens = Counter("tandem:spec_decode_num_draft_tokens",
                                         "Speculative draft tokens verified", registry=r)
        self.spec_accepted_tokens = Counter("tandem:spec_decode_num_accepted_tokens",
                                            "Speculative draft tokens accepted", registry=r)
        self.kv_bytes = Counter("tandem:kv_transfer_bytes", "KV bytes shipped or received",
                                ["direction"], registry=r)
        self.kv_received = Counter("tandem:kv_transfers_received", "KV transfers taken in, by "
                                   "how their blocks came: shm (borrowed from a same-host "
                                   "sender's memory) or the receiver's transport (tcp, ipc, ucx)",
                                   ["via"], registry=r)
        self.kv_seconds = Histogram("tandem:kv_transfer_seconds",
                                    "Send to ack of one KV transfer", buckets=LATENCY_BUCKETS, registry=r)
        self.kv_pieces = Counter("tandem:kv_stream_pieces", "KV stream pieces (non-final "
                                 "transfers of a prompt shipped chunk by chunk) sent or received",
                                 ["direction"], registry=r)
        self.kv_failures = Counter("tandem:kv_transfer_failures", "KV transfers that failed",
                                   ["reason"], registry=r)
        self.handler_errors = Counter("tandem:worker_handler_errors",
                                      "Messages or requests whose handling failed (the worker "
                                      "went on)", ["handler"], registry=r)


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
