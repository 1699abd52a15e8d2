"""``tandem router|prefill|decode|worker|gateway``: flags and startup of each service.

Every flag reads a ``TANDEM_<FLAG>`` environment variable as its default (see
``services.flags``), which is how ``compose.yaml`` configures a container. Internal
services bind to loopback unless told otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket

from services.flags import add_engine_flags, engine_config, env_default

log = logging.getLogger("tandem")

DEFAULT_ROUTER = "tcp://127.0.0.1:7100"


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=env_default("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env_default("port", 7100)))
    p.add_argument("--metrics-port", type=int, default=int(env_default("metrics_port", 9100)))
    p.add_argument("--policy", default=env_default("policy", "prefix"),
                   choices=["prefix", "round_robin", "least_loaded"])
    p.add_argument("--prefill-token-budget", type=int, default=int(env_default("prefill_token_budget", 8192)),
                   help="outstanding prompt tokens per prefill worker before requests queue")
    p.add_argument("--load-weight", type=float, default=float(env_default("load_weight", 1.0)),
                   help="prefix policy: outstanding tokens that cancel one cached token")
    p.add_argument("--max-queue", type=int, default=int(env_default("max_queue", 256)))
    p.add_argument("--queue-timeout", type=float, default=float(env_default("queue_timeout", 60)))
    p.add_argument("--heartbeat-timeout", type=float, default=float(env_default("heartbeat_timeout", 5)))
    p.set_defaults(func=run_router)


def add_worker_arguments(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--router", default=env_default("router", DEFAULT_ROUTER))
    p.add_argument("--host", default=env_default("host", "127.0.0.1"),
                   help="interface the KV receiver and metrics bind to")
    p.add_argument("--advertise-host", default=env_default("advertise_host"),
                   help="how peers reach this worker (default: --host, or the hostname for 0.0.0.0)")
    p.add_argument("--metrics-port", type=int, default=int(env_default("metrics_port", 0)))
    p.add_argument("--worker-id", default=env_default("worker_id"))
    p.add_argument("--kv-transport", default=env_default("kv_transport", "zmq"), choices=["zmq", "ucx"])
    p.add_argument("--kv-port", type=int, default=int(env_default("kv_port", 0)))
    p.add_argument("--kv-address", default=env_default("kv_address"),
                   help="full KV receiver address instead of host:port, e.g. ipc:///tmp/kv.sock")
    p.add_argument("--lease-seconds", type=float, default=float(env_default("lease_seconds", 30)))
    p.add_argument("--cpu-affinity", default=env_default("cpu_affinity"),
                   help="CPUs to pin this process to, e.g. 0 or 0-1 or 0,2")
    add_engine_flags(p)
    p.set_defaults(func=run_worker, role=role)


def add_gateway_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", default=env_default("router", DEFAULT_ROUTER))
    p.add_argument("--host", default=env_default("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env_default("port", 8000)))
    p.add_argument("--stream-port", type=int, default=int(env_default("stream_port", 0)),
                   help="where workers push tokens (0 = any free port)")
    p.add_argument("--advertise-host", default=env_default("advertise_host"))
    p.add_argument("--api-key", default=env_default("api_key"),
                   help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    p.add_argument("--model", default=env_default("model"), help="model whose tokenizer to use")
    p.add_argument("--served-model-name", default=env_default("served_model_name"))
    p.add_argument("--max-model-len", type=int, default=env_default("max_model_len"))
    p.add_argument("--request-timeout", type=float, default=float(env_default("request_timeout", 600)),
                   help="give up on a request that produced nothing for this long")
    p.set_defaults(func=run_gateway)


def advertised(host: str, given: str | None) -> str:
    if given:
        return given
    return socket.gethostname() if host in ("0.0.0.0", "::") else host


def parse_cpus(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"invalid --cpu-affinity {text!r}: use e.g. 0, 0-1 or 0,2")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def run_router(args: argparse.Namespace) -> int:
    from services.router.service import RouterService, RouterSettings

    settings = RouterSettings(
        bind=f"tcp://{args.host}:{args.port}", policy=args.policy, token_budget=args.prefill_token_budget,
        load_weight=args.load_weight, max_queue=args.max_queue, queue_timeout=args.queue_timeout,
        heartbeat_timeout=args.heartbeat_timeout, metrics_host=args.host, metrics_port=args.metrics_port)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await RouterService(settings).run(stop)

    asyncio.run(main())
    return 0


def run_worker(args: argparse.Namespace) -> int:
    from common.engine.engine import Engine
    from services.worker import WorkerService, WorkerSettings

    if args.cpu_affinity:
        os.sched_setaffinity(0, parse_cpus(args.cpu_affinity))
    host = advertised(args.host, args.advertise_host)
    kv_bind = args.kv_address or _kv_bind(args)
    settings = WorkerSettings(
        role=args.role, router=args.router, kv_transport=args.kv_transport, kv_bind=kv_bind,
        metrics_host=args.host,
        metrics_port=args.metrics_port, advertise_host=host, lease_seconds=args.lease_seconds,
        **({"worker_id": args.worker_id} if args.worker_id else {}))
    engine = Engine(engine_config(args), detokenize=False)
    service = WorkerService(settings, engine)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: service.stop())
    service.run()
    return 0


def _kv_bind(args: argparse.Namespace) -> str:
    scheme = "ucx" if args.kv_transport == "ucx" else "tcp"
    return f"{scheme}://{args.host}:{args.kv_port}"


def run_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from services.gateway.app import GatewaySettings, create_app

    settings = GatewaySettings(
        router=args.router, stream_bind=f"tcp://{args.host}:{args.stream_port}",
        advertise_host=advertised(args.host, args.advertise_host),
        api_key=args.api_key, model=args.model, served_model_name=args.served_model_name,
        max_model_len=int(args.max_model_len) if args.max_model_len else None,
        request_timeout=args.request_timeout)
    app = create_app(settings)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


def add_service_parsers(sub) -> None:
    add_router_arguments(sub.add_parser("router", help="the router"))
    add_worker_arguments(sub.add_parser("prefill", help="a prefill worker"), "prefill")
    add_worker_arguments(sub.add_parser("decode", help="a decode worker"), "decode")
    add_worker_arguments(sub.add_parser("worker", help="a colocated (prefill + decode) worker"),
                         "colocated")
    add_gateway_arguments(sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway"))
