"""``tandem up``: a whole local cluster — router, workers, gateway — as child processes.

Ports are picked up front on loopback, each child's output is prefixed with its name,
``up`` returns only once every service reports healthy, and Ctrl-C / SIGTERM stops
everything: children get SIGTERM, then SIGKILL after a grace period, and they die with
the launcher even if it is killed outright (``PR_SET_PDEATHSIG``), so nothing is orphaned.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from common.addresses import free_port
from common.config import available_cpus
from common.flags import add_engine_flags

GRACE_SECONDS = 10.0


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    health_url: str
    proc: subprocess.Popen | None = None
    tail: list[str] = field(default_factory=list)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--colocated", type=int, default=0,
                   help="workers doing both (replaces --prefill/--decode when > 0)")
    p.add_argument("--host", default="127.0.0.1", help="gateway interface")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--policy", default="prefix", choices=["prefix", "round_robin", "least_loaded"])
    p.add_argument("--kv-transport", default="zmq", choices=["zmq", "ucx"])
    p.add_argument("--cpu-affinity", action="store_true",
                   help="pin prefill and decode workers to different CPUs")
    p.add_argument("--api-key", default=None)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    add_engine_flags(p)
    p.set_defaults(func=run)


def engine_argv(args: argparse.Namespace, parser_defaults: dict) -> list[str]:
    """The engine flags the user changed, to hand to every worker."""
    out: list[str] = []
    for dest in ("model", "served_model_name", "dtype", "device", "max_model_len", "block_size",
                 "kv_cache_memory", "num_kv_blocks", "kv_cache_dtype", "max_num_seqs",
                 "max_num_batched_tokens", "seed"):
        value = getattr(args, dest)
        if value is not None and value != parser_defaults.get(dest):
            out += [f"--{dest.replace('_', '-')}", str(value)]
    for dest in ("enable_prefix_caching", "enable_chunked_prefill"):
        if getattr(args, dest) != parser_defaults.get(dest):
            out.append(f"--{'' if getattr(args, dest) else 'no-'}{dest.replace('_', '-')}")
    return out


def plan(args: argparse.Namespace, engine_flags: list[str]) -> list[Child]:
    py = [sys.executable, "-m", "cli"]
    router_port, router_metrics = free_port(), free_port()
    router = f"tcp://127.0.0.1:{router_port}"
    children = [Child("router", py + ["router", "--port", str(router_port), "--metrics-port",
                                      str(router_metrics), "--policy", args.policy],
                      f"http://127.0.0.1:{router_metrics}/health")]
    roles = ([("worker", "worker", args.colocated)] if args.colocated
             else [("prefill", "prefill", args.prefill), ("decode", "decode", args.decode)])
    workers = [(name, cmd, i) for name, cmd, count in roles for i in range(count)]
    cpus = sorted(os.sched_getaffinity(0))
    threads = args.threads or max(1, available_cpus() // max(len(workers), 1))
    for n, (name, cmd, i) in enumerate(workers):
        port = free_port()
        argv = py + [cmd, "--router", router, "--metrics-port", str(port), "--threads", str(threads),
                     "--kv-transport", args.kv_transport, "--worker-id", f"{name}-{i}", *engine_flags]
        if args.cpu_affinity:
            argv += ["--cpu-affinity", str(_cpu_for(name, i, n, len(workers), cpus))]
        children.append(Child(f"{name}-{i}", argv, f"http://127.0.0.1:{port}/health"))
    gw = py + ["gateway", "--router", router, "--host", args.host, "--port", str(args.port)]
    gw += _gateway_model_flags(args)
    if args.api_key:
        gw += ["--api-key", args.api_key]
    health_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    children.append(Child("gateway", gw, f"http://{health_host}:{args.port}/health"))
    return children


def _gateway_model_flags(args: argparse.Namespace) -> list[str]:
    out = []
    for dest in ("model", "served_model_name", "max_model_len"):
        if getattr(args, dest) is not None:
            out += [f"--{dest.replace('_', '-')}", str(getattr(args, dest))]
    return out


def _cpu_for(name: str, i: int, n: int, total: int, cpus: list[int]) -> int:
    """Prefill workers take CPUs from the front, decode workers from the back."""
    if name == "decode":
        return cpus[-1 - (i % len(cpus))]
    return cpus[n % len(cpus)]


def run(args: argparse.Namespace) -> int:
    defaults = vars(_defaults_parser().parse_args([]))
    children = plan(args, engine_argv(args, defaults))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        for child in children:
            _spawn(child)
        if not _wait_healthy(children, stop, args.startup_timeout):
            return 1
        _announce(args, children)
        while not stop.wait(0.5):
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                _say("launcher", f"{dead[0].name} exited with status {dead[0].proc.returncode}: stopping")
                return 1
        return 0
    finally:
        _shutdown(children)


def _defaults_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    add_engine_flags(p)
    return p


def _spawn(child: Child) -> None:
    child.proc = subprocess.Popen(child.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                  start_new_session=True, preexec_fn=_die_with_parent)
    threading.Thread(target=_pump, args=(child,), daemon=True, name=f"log-{child.name}").start()


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _pump(child: Child) -> None:
    for line in child.proc.stdout:
        line = line.rstrip("\n")
        child.tail = (child.tail + [line])[-20:]
        _say(child.name, line)


_print_lock = threading.Lock()


def _say(name: str, line: str) -> None:
    with _print_lock:
        print(f"{name:>10} | {line}", flush=True)


def _wait_healthy(children: list[Child], stop: threading.Event, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    pending = list(children)
    while pending and not stop.is_set():
        for child in list(pending):
            if child.proc.poll() is not None:
                _say("launcher", f"{child.name} failed to start (status {child.proc.returncode})")
                return False
            if _healthy(child.health_url):
                pending.remove(child)
        if time.monotonic() > deadline:
            _say("launcher", f"still not healthy after {timeout:.0f} s: {', '.join(c.name for c in pending)}")
            return False
        stop.wait(0.5)
    return not pending


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _announce(args: argparse.Namespace, children: list[Child]) -> None:
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    _say("launcher", f"ready: OpenAI API at http://{host}:{args.port}/v1 "
                     f"(metrics http://{host}:{args.port}/metrics)")
    for child in children[:-1]:
        _say("launcher", f"  {child.name}: {child.health_url.replace('/health', '/metrics')}")


def _shutdown(children: list[Child]) -> None:
    running = [c for c in children if c.proc is not None and c.proc.poll() is None]
    for child in reversed(running):  # the gateway first, so clients stop arriving
        child.proc.terminate()
    deadline = time.monotonic() + GRACE_SECONDS
    for child in running:
        try:
            child.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
