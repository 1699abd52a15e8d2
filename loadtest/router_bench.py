"""``tandem bench router``: how many placements one real router takes, and how fast.

Three processes: the router exactly as ``tandem router`` runs it (its own process, its
real ROUTER socket, default flags unless ``--router-flag`` adds some); a simulated fleet
of ``--workers`` workers (``loadtest.router_sim``: each a real DEALER that registers with
its snapshot of cached block hashes, heartbeats, sends KV events and answers every Task
with the ``Finished`` messages its role sends, without a model); and a simulated gateway
offering Submits at Poisson arrivals. Prompts share prefixes with what the workers hold
(``loadtest.router_workload``), so every placement walks the prefix index.

Per offered rate it reports placement latency (a Submit sent by the gateway process → its
Task read by a worker in the fleet process; both clocks are the host's monotonic one),
placements/s achieved, the router's own time per Submit and per KV event (its
``tandem:router_message_seconds`` histogram), KV events absorbed per second, the index
size (``tandem:router_prefix_index_blocks``) and each process's CPU use. The latency
includes both load processes' own delays (they share the CPUs with the router): the
router's histogram is the part that is the router's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import zmq

from common.addresses import free_ports
from common.protocol import Ping, Status, decode, encode
from loadtest.children import stop, wait_answering
from loadtest.router_gateway import GatewaySettings, gateway_main
from loadtest.router_metrics import cpu_seconds, scrape
from loadtest.router_sim import FleetSettings, fleet_main
from loadtest.router_workload import Topology, Workload

ROOT = Path(__file__).resolve().parent.parent


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Workload()
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--topology", choices=[t.value for t in Topology], default=d.topology.value,
                   help="pd: half prefill, half decode workers; colocated: all do both")
    p.add_argument("--blocks", type=int, default=d.blocks, help="block hashes indexed, in all")
    p.add_argument("--groups", type=int, default=d.groups, help="shared prefixes")
    p.add_argument("--prefix-blocks", type=int, default=d.prefix_blocks)
    p.add_argument("--replicas", type=int, default=d.replicas, help="workers caching each prefix")
    p.add_argument("--tail-tokens", type=int, default=d.tail_tokens)
    p.add_argument("--rates", type=float, nargs="+", default=[2000, 5000, 10000],
                   help="offered Submits per second, one phase each")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per phase")
    p.add_argument("--warmup", type=float, default=2.0,
                   help="seconds at the first rate before the phases, not reported")
    f = FleetSettings(d, "")
    p.add_argument("--heartbeat-interval", type=float, default=f.heartbeat_interval)
    p.add_argument("--kv-interval", type=float, default=f.kv_interval,
                   help="seconds between each worker's KVEvents")
    p.add_argument("--kv-blocks", type=int, default=f.kv_blocks,
                   help="blocks stored (and as many evicted) per KVEvents")
    p.add_argument("--prefill-ms", type=float, default=f.prefill_ms)
    p.add_argument("--decode-ms", type=float, default=f.decode_ms)
    p.add_argument("--gateways", type=int, default=GatewaySettings(d, "").gateways)
    p.add_argument("--router-flag", action="append", default=[], metavar="FLAG",
                   help="passed to `tandem router` (repeat), e.g. --router-flag=--disagg-mode=always")
    p.add_argument("--json", help="also write the results here")
    p.set_defaults(func=run)


@dataclass
class Phase:
    offered_per_s: float
    sent: int
    placed: int  # Tasks that reached a simulated worker
    acks: dict[str, int]
    achieved_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    router_submit_us_mean: float | None  # the router's own time per Submit, decode included
    router_submit_us_p99: float | None  # from its histogram's buckets (an upper bound)
    kv_events_per_s: float  # KVEvents messages the router handled
    kv_blocks_per_s: float  # blocks stored + evicted in them (as the fleet sent them)
    heartbeats_per_s: float
    router_cpu: float  # fraction of one core
    router_cpu_us_per_placement: float | None  # its CPU time per placement, beyond the background
    load_cpu: float  # the fleet and the gateway together
    index_blocks: int | None
    reregisters: int  # workers the router declared dead meanwhile (they registered again)


@dataclass
class Result:
    workload: Workload
    indexed_blocks: int | None  # after registration, as the router reports it
    registered_workers: int
    background_cpu: float  # the router's CPU (fraction of a core) on heartbeats and KV events alone
    phases: list[Phase] = field(default_factory=list)


def run(args: argparse.Namespace) -> int:
    w = Workload(args.workers, args.topology, args.blocks, groups=args.groups,
                 prefix_blocks=args.prefix_blocks, replicas=args.replicas, tail_tokens=args.tail_tokens)
    result = bench(w, args.rates, args.duration, args.router_flag, warmup=args.warmup, fleet=dict(
        heartbeat_interval=args.heartbeat_interval, kv_interval=args.kv_interval,
        kv_blocks=args.kv_blocks, prefill_ms=args.prefill_ms, decode_ms=args.decode_ms),
        gateways=args.gateways, say=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(result), f, indent=1, default=str)
    return 0


def bench(w: Workload, rates: list[float], duration: float, router_flags: list[str] = (),
          warmup: float = 0.0, fleet: dict | None = None, gateways: int = 4,
          say=lambda m: None) -> Result:
    """Start the router, the fleet and the gateway; one phase per rate; stop everything."""
    port, metrics_port = free_ports(2)
    address = f"tcp://127.0.0.1:{port}"
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    router = subprocess.Popen(
        [sys.executable, "-m", "cli", "--log-level", "warning", "router", "--port", str(port),
         "--metrics-port", str(metrics_port), *router_flags],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = []
    try:
        wait_answering(router, lambda: _status(address), "router", 60)
        fleet_pipe, child = ctx.Pipe()
        procs.append(ctx.Process(target=fleet_main, args=(FleetSettings(w, address, **(fleet or {})), child),
                                 daemon=True))
        gw_pipe, child = ctx.Pipe()
        procs.append(ctx.Process(target=gateway_main, args=(GatewaySettings(w, address, gateways), child),
                                 daemon=True))
        for p in procs:
            p.start()
        _expect(fleet_pipe, "registered", 120)
        _expect(gw_pipe, "ready", 120)
        say(f"{w.workers} workers registered; waiting for the router to index {w.indexed_blocks():,} blocks")
        registered, indexed = _wait_indexed(address, metrics, w)
        result = Result(w, indexed, registered, _background_cpu(router.pid))
        if warmup > 0 and rates:
            _phase("warmup", rates[0], warmup, gw_pipe, fleet_pipe, metrics, router.pid,
                   [p.pid for p in procs], result.background_cpu)
        for i, rate in enumerate(rates):
            result.phases.append(_phase(f"p{i}", rate, duration, gw_pipe, fleet_pipe, metrics,
                                        router.pid, [p.pid for p in procs], result.background_cpu))
            say(row(result.phases[-1]))
        for pipe in (fleet_pipe, gw_pipe):
            pipe.send(("stop",))
        return result
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        stop(router)


def _background_cpu(router_pid: int, seconds: float = 2.0) -> float:
    start = cpu_seconds([router_pid])
    time.sleep(seconds)
    return (cpu_seconds([router_pid]) - start) / seconds


def _phase(name: str, rate: float, duration: float, gw: mp.connection.Connection,
           fleet: mp.connection.Connection, metrics: str, router_pid: int,
           load_pids: list[int], background: float) -> Phase:
    router_pids = [router_pid]
    before, cpu_r0, cpu_l0 = scrape(metrics), cpu_seconds(router_pids), cpu_seconds(load_pids)
    _, counts0 = _take(fleet, "-")  # the counters before
    t0 = time.monotonic()
    gw.send(("run", name, rate, duration))
    sent, acks = _expect(gw, None, duration + 60)
    admitted = acks.get("admitted", 0)
    arrivals: dict[str, float] = {}
    deadline = time.monotonic() + 10
    while True:  # the Admitted ack follows the Task, which may still be in the fleet's socket
        taken, counts = _take(fleet, f"{name}-")
        arrivals.update(taken)
        if len(arrivals) >= admitted or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    wall = time.monotonic() - t0
    after, cpu_r1, cpu_l1 = scrape(metrics), cpu_seconds(router_pids), cpu_seconds(load_pids)
    lat = sorted((t - sent[int(rid.rsplit("-", 1)[1])]) * 1e3 for rid, t in arrivals.items())
    last = max(arrivals.values(), default=t0)
    span = max(last - sent[0], 1e-9) if sent else 1.0
    delta = {k: counts.get(k, 0) - counts0.get(k, 0) for k in set(counts) | set(counts0)}
    submit = after.histogram_delta(before, "submit")
    kv = after.histogram_delta(before, "kv_events")
    return Phase(
        rate, len(sent), len(arrivals), acks, len(arrivals) / span, _pct(lat, 0.5), _pct(lat, 0.99),
        lat[-1] if lat else float("nan"),
        submit.mean_us(), submit.quantile_us(0.99), kv.count / wall,
        delta.get("kv_blocks", 0) / wall, delta.get("heartbeat", 0) / wall,
        (cpu_r1 - cpu_r0) / wall,
        max(0.0, cpu_r1 - cpu_r0 - background * wall) / len(arrivals) * 1e6 if arrivals else None,
        (cpu_l1 - cpu_l0) / wall,
        after.gauge("tandem:router_prefix_index_blocks"), delta.get("reregister", 0))


def _take(fleet: mp.connection.Connection, prefix: str) -> tuple[dict[str, float], dict[str, int]]:
    fleet.send(("take", prefix))
    return _expect(fleet, None, 30)


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _expect(pipe: mp.connection.Connection, what, timeout: float):
    if not pipe.poll(timeout):
        raise RuntimeError(f"no answer from a load process within {timeout:g} s")
    got = pipe.recv()
    if what is not None and got != what:
        raise RuntimeError(f"expected {what!r} from a load process, got {got!r}")
    return got


def _status(address: str, timeout: float = 1.0) -> Status | None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(encode(Ping(1)))
        if not sock.poll(int(timeout * 1000)):
            return None
        msg = decode(sock.recv())
        return msg if isinstance(msg, Status) else None
    finally:
        sock.close()


def _wait_indexed(address: str, metrics: str, w: Workload, timeout: float = 120) -> tuple[int, int | None]:
    """Until every worker is registered and the index holds every snapshot (or timeout)."""
    deadline = time.monotonic() + timeout
    registered, indexed = 0, None
    while time.monotonic() < deadline:
        status = _status(address)
        if status is not None:
            registered = w.workers if _all_registered(status, w) else 0
            indexed = scrape(metrics).gauge("tandem:router_prefix_index_blocks")
            if registered and indexed == w.indexed_blocks():
                break
        time.sleep(0.1)
    return registered, indexed


def _all_registered(status: Status, w: Workload) -> bool:
    roles = [w.role(i) for i in range(w.workers)]
    return (status.prefill_workers == sum(r.can_prefill for r in roles)
            and status.decode_workers == sum(r.can_decode for r in roles))


# ---- output -------------------------------------------------------------------------------

HEADER = ("| workers | indexed blocks | offered/s | achieved/s | p50 ms | p99 ms | router µs/submit "
          "(mean, p99≤) | router CPU µs/placement | KV events/s (blocks/s) | router CPU | load CPU |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def row(p: Phase, w: Workload | None = None, indexed: int | None = None) -> str:
    us = lambda v: "?" if v is None else f"{v:.0f}"  # noqa: E731
    return (f"| {w.workers if w else ''} | {indexed if indexed is not None else p.index_blocks:,} "
            f"| {p.offered_per_s:,.0f} | {p.achieved_per_s:,.0f} | {p.p50_ms:.2f} | {p.p99_ms:.2f} "
            f"| {us(p.router_submit_us_mean)}, {us(p.router_submit_us_p99)} "
            f"| {us(p.router_cpu_us_per_placement)} "
            f"| {p.kv_events_per_s:,.0f} ({p.kv_blocks_per_s:,.0f}) | {p.router_cpu:.0%} | {p.load_cpu:.0%} |")


def table(r: Result) -> str:
    return "\n".join([HEADER] + [row(p, r.workload, r.indexed_blocks) for p in r.phases])
