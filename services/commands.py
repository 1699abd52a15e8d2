"""``tandem router|prefill|decode|worker|gateway``: flags and startup of each service.

Every flag reads a ``TANDEM_<FLAG>`` environment variable as its default (see
``common.flags``), which is how ``compose.yaml`` configures a container. Internal
services bind to loopback unless told otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from dataclasses import replace
from typing import NoReturn

from common.addresses import advertise_host
from common.flags import add_engine_flags, default_of, engine_config, env

log = logging.getLogger("tandem")

DEFAULT_ROUTER_PORT = 7100
DEFAULT_ROUTER = f"tcp://127.0.0.1:{DEFAULT_ROUTER_PORT}"


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    from services.router.disagg import add_disagg_flags
    from services.router.policies import RoutingPolicy
    from services.router.service import RouterSettings as R

    p.add_argument("--host", default=env("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=env("port", DEFAULT_ROUTER_PORT, int))
    p.add_argument("--metrics-port", type=int, default=env("metrics_port", 9100, int))
    p.add_argument("--policy", default=env("policy", default_of(R, "policy").value),
                   choices=[policy.value for policy in RoutingPolicy])
    p.add_argument("--prefill-token-budget", type=int,
                   default=env("prefill_token_budget", default_of(R, "token_budget"), int),
                   help="outstanding prompt tokens per prefill worker before requests queue")
    p.add_argument("--load-weight", type=float, default=env("load_weight", default_of(R, "load_weight"), float),
                   help="prefix policy: outstanding tokens that cancel one cached token")
    p.add_argument("--max-queue", type=int, default=env("max_queue", default_of(R, "max_queue"), int))
    p.add_argument("--queue-timeout", type=float,
                   default=env("queue_timeout", default_of(R, "queue_timeout"), float),
                   help="seconds a request may wait for a worker (the gateway's "
                        "--admission-timeout must be longer)")
    p.add_argument("--heartbeat-timeout", type=float,
                   default=env("heartbeat_timeout", default_of(R, "heartbeat_timeout"), float),
                   help="silence after which a worker is declared dead (at least two of the "
                        "workers' --heartbeat-interval)")
    p.add_argument("--startup-grace", type=float,
                   default=env("startup_grace", default_of(R, "startup_grace"), float),
                   help="a router just started holds requests (no 503) until its first "
                        "prefill-capable worker registers, at most this many seconds")
    add_disagg_flags(p)
    p.set_defaults(func=run_router)


def add_worker_arguments(p: argparse.ArgumentParser, role: str) -> None:
    from common.connector import KVTransport, ShmMode
    from services.worker_settings import WorkerSettings as W

    p.add_argument("--router", default=env("router", DEFAULT_ROUTER))
    p.add_argument("--host", default=env("host", "127.0.0.1"),
                   help="interface the KV receiver and metrics bind to")
    p.add_argument("--advertise-host", default=env("advertise_host"),
                   help="how peers reach this worker (default: --host; for 0.0.0.0, this host's "
                        "address on the route to the router)")
    p.add_argument("--metrics-port", type=int, default=env("metrics_port", default_of(W, "metrics_port"), int))
    p.add_argument("--worker-id", default=env("worker_id"))
    p.add_argument("--kv-transport", default=env("kv_transport", default_of(W, "kv_transport").value),
                   choices=[t.value for t in KVTransport])
    p.add_argument("--kv-shm", default=env("kv_shm", default_of(W, "kv_shm").value),
                   choices=[m.value for m in ShmMode],
                   help="KV through same-host shared memory: auto (where both ends are on one "
                        "host), on (always; a peer that cannot map it fails), off (socket frames)")
    p.add_argument("--kv-port", type=int, default=env("kv_port", 0, int))
    p.add_argument("--kv-address", default=env("kv_address"),
                   help="full KV receiver address instead of host:port, e.g. ipc:///tmp/kv.sock")
    p.add_argument("--lease-seconds", type=float,
                   default=env("lease_seconds", default_of(W, "lease_seconds"), float),
                   help="free a shipped request's blocks if the receiver has not acked by then "
                        "(longer than the KV transport's frame timeout)")
    p.add_argument("--kv-stream-chunks", action=argparse.BooleanOptionalAction,
                   default=env("kv_stream_chunks", default_of(W, "kv_stream_chunks"), bool),
                   help="a prefill worker ships each prompt chunk's KV while it computes the "
                        "next (off: one transfer after the first token)")
    p.add_argument("--heartbeat-interval", type=float,
                   default=env("heartbeat_interval", default_of(W, "heartbeat_interval"), float))
    p.add_argument("--drain-timeout", type=float,
                   default=env("drain_timeout", default_of(W, "drain_timeout"), float),
                   help="on SIGTERM, seconds to finish in-flight requests (no new ones come) "
                        "before handing the rest to other workers; a second signal stops at once")
    p.add_argument("--kv-faults", default=env("kv_faults"), metavar="SPEC",
                   help="TEST ONLY: a prefill worker drops, truncates, corrupts or delays KV "
                        "transfers on purpose, e.g. 'drop=0.05,corrupt=0.05,delay=0.05:0.5,seed=7' "
                        "(syntax: common/connector/faults.py); off unless given")
    p.add_argument("--cpu-affinity", default=env("cpu_affinity"),
                   help="CPUs to pin this process to, e.g. 0 or 0-1 or 0,2")
    add_engine_flags(p)
    p.set_defaults(func=run_worker, role=role)


def add_gateway_arguments(p: argparse.ArgumentParser) -> None:
    from services.gateway.settings import GatewaySettings as G

    p.add_argument("--router", default=env("router", DEFAULT_ROUTER))
    p.add_argument("--host", default=env("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=env("port", 8000, int))
    p.add_argument("--stream-port", type=int, default=env("stream_port", 0, int),
                   help="where workers push tokens (0 = any free port)")
    p.add_argument("--advertise-host", default=env("advertise_host"),
                   help="how workers reach the token stream (default: as for workers)")
    p.add_argument("--api-key", default=env("api_key"),
                   help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--model", default=env("model"), help="model whose tokenizer to use")
    p.add_argument("--served-model-name", default=env("served_model_name"))
    p.add_argument("--max-model-len", type=int, default=env("max_model_len", None, int))
    p.add_argument("--request-timeout", type=float,
                   default=env("request_timeout", default_of(G, "request_timeout"), float),
                   help="give up on a request that produced nothing for this long")
    p.add_argument("--admission-timeout", type=float,
                   default=env("admission_timeout", default_of(G, "admission_timeout"), float),
                   help="wait this long for the router to place a request (longer than the "
                        "router's --queue-timeout)")
    p.add_argument("--drain-timeout", type=float,
                   default=env("drain_timeout", default_of(G, "drain_timeout"), float),
                   help="on SIGTERM, refuse new requests (503) and give open ones this long "
                        "to finish; a second signal stops at once")
    p.add_argument("--router-reach-timeout", type=float,
                   default=env("router_reach_timeout", default_of(G, "router_reach_timeout"), float),
                   help="how long a request waits for a router out of reach (restarting) "
                        "before its 503; once it has been away this long, 503 at once")
    p.add_argument("--tool-call-parser", default=env("tool_call_parser",
                                                     default_of(G, "tool_call_parser")),
                   help="how tool calls are read out of the model's text (and asked for, "
                        "where the chat template knows no tools): hermes or llama3_json")
    p.set_defaults(func=run_gateway)


def parse_cpus(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"invalid --cpu-affinity {text!r}: use e.g. 0, 0-1 or 0,2")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _freeze_startup_heap() -> None:
    """Keep what startup built (modules, the model's Python objects, the service) out of
    every later garbage collection: it lives as long as the process, and a full collection
    walking it stalls the loop (~50-70 ms in a loaded router, 115-320 ms for a worker's
    ~335k objects). Startup's own garbage is collected first."""
    gc.collect()
    gc.freeze()


def run_router(args: argparse.Namespace) -> int:
    from services.router.disagg import disagg_rule
    from services.router.service import RouterService, RouterSettings

    settings = RouterSettings(
        bind=f"tcp://{args.host}:{args.port}", policy=args.policy,
        token_budget=args.prefill_token_budget,
        load_weight=args.load_weight, max_queue=args.max_queue, queue_timeout=args.queue_timeout,
        heartbeat_timeout=args.heartbeat_timeout, startup_grace=args.startup_grace,
        disagg=disagg_rule(args),
        metrics_host=args.host, metrics_port=args.metrics_port)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        service = RouterService(settings)
        _freeze_startup_heap()
        await service.run(stop)

    asyncio.run(main())
    return 0


def run_worker(args: argparse.Namespace) -> int:
    from common.engine.engine import Engine
    from services.worker import WorkerService, WorkerSettings

    if args.cpu_affinity:
        os.sched_setaffinity(0, parse_cpus(args.cpu_affinity))
    host = advertise_host(args.host, args.advertise_host, args.router)
    kv_bind = args.kv_address or _kv_bind(args)
    settings = WorkerSettings(
        role=args.role, router=args.router, kv_transport=args.kv_transport, kv_bind=kv_bind,
        kv_shm=args.kv_shm, metrics_host=args.host,
        metrics_port=args.metrics_port, advertise_host=host, lease_seconds=args.lease_seconds,
        heartbeat_interval=args.heartbeat_interval, kv_faults=args.kv_faults or None,
        kv_stream_chunks=args.kv_stream_chunks, drain_timeout=args.drain_timeout,
        **({"worker_id": args.worker_id} if args.worker_id else {}))
    config = engine_config(args)
    if settings.shares_kv_cache:  # peers on this host map it: the transfer's one copy is theirs
        config = replace(config, cache=replace(config.cache, shared_memory=True))
    engine = Engine(config, detokenize=False)
    service = WorkerService(settings, engine)
    _freeze_startup_heap()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the first drains, a second stops at once
        signal.signal(sig, lambda *_: service.request_drain())
    service.run()  # returns once its sockets, threads and cache are closed
    _exit_at_once(0)


def _exit_at_once(status: int) -> NoReturn:
    """Leave without the interpreter's teardown of torch and transformers (seconds on a
    CPU, and a restart waits for it); everything of ours is closed already."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _kv_bind(args: argparse.Namespace) -> str:
    scheme = "ucx" if args.kv_transport == "ucx" else "tcp"
    return f"{scheme}://{args.host}:{args.kv_port}"


def run_gateway(args: argparse.Namespace) -> int:
    from services.gateway.app import GatewaySettings, create_app
    from services.gateway.drain import serve

    settings = GatewaySettings(
        router=args.router, stream_bind=f"tcp://{args.host}:{args.stream_port}",
        advertise_host=advertise_host(args.host, args.advertise_host, args.router),
        api_key=args.api_key, model=args.model, served_model_name=args.served_model_name,
        max_model_len=args.max_model_len, request_timeout=args.request_timeout,
        admission_timeout=args.admission_timeout, drain_timeout=args.drain_timeout,
        router_reach_timeout=args.router_reach_timeout, tool_call_parser=args.tool_call_parser)
    app = create_app(settings)
    _freeze_startup_heap()
    serve(app, args.host, args.port)  # returns once drained and closed
    _exit_at_once(0)


def add_service_parsers(sub) -> None:
    add_router_arguments(sub.add_parser("router", help="the router"))
    add_worker_arguments(sub.add_parser("prefill", help="a prefill worker"), "prefill")
    add_worker_arguments(sub.add_parser("decode", help="a decode worker"), "decode")
    add_worker_arguments(sub.add_parser("worker", help="a colocated (prefill + decode) worker"),
                         "colocated")
    add_gateway_arguments(sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway"))
