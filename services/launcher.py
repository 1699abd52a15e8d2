"""``tandem up``: a whole local cluster — router, workers, gateway — as child processes.

Ports are picked up front on loopback, each child's output is prefixed with its name,
``up`` returns only once every service reports healthy, then supervises: a child that
dies is restarted with the same command line (``services.supervision``), and only Ctrl-C /
SIGTERM stops everything: the gateway and the workers get SIGTERM first (the gateway
refuses new requests, the workers drain: they finish what they hold while the router is
still there to release them), SIGKILL for any still running after the drain timeout and a
margin; then the router. Children die with the launcher even if it is killed outright
(``PR_SET_PDEATHSIG``), so nothing is orphaned. ``LocalCluster.restart`` drains one child
and starts it again (``rolling_restart``: every worker in turn).

The public surface, shared by ``tandem up`` and the end-to-end tests: ``plan`` (the
children for a set of ``up`` arguments), ``engine_argv`` (the engine flags forwarded to
every worker) and ``LocalCluster`` (start / respawn / stop those children).
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
from collections.abc import Callable
from dataclasses import dataclass, field

from common.addresses import free_ports
from common.config import available_cpus
from common.connector import KVTransport, ShmMode
from common.flags import add_engine_flags, default_of
from services.router.disagg import add_disagg_flags, disagg_argv
from services.router.policies import RoutingPolicy
from services.supervision import Supervisor
from services.timeouts import Timeouts, add_timeout_flags, timeouts

GRACE_SECONDS = 10.0  # the router, and anything not draining
DRAIN_MARGIN_S = 5.0  # beyond a child's drain timeout before it is killed


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    health_url: str
    proc: subprocess.Popen | None = None
    tail: list[str] = field(default_factory=list)

    @property
    def ready_url(self) -> str:
        """Where the child says whether it can take work (``/ready``, beside ``/health``)."""
        return self.health_url.replace("/health", "/ready")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--colocated", type=int, default=0,
                   help="workers doing both (replaces --prefill/--decode when > 0)")
    p.add_argument("--host", default="127.0.0.1", help="gateway interface")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--policy", default=RoutingPolicy.PREFIX.value,
                   choices=[policy.value for policy in RoutingPolicy])
    p.add_argument("--kv-transport", default=KVTransport.ZMQ.value,
                   choices=[t.value for t in KVTransport])
    p.add_argument("--kv-shm", default=ShmMode.AUTO.value, choices=[m.value for m in ShmMode],
                   help="KV through same-host shared memory: auto, on or off (see `tandem prefill -h`)")
    p.add_argument("--kv-stream-chunks", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill workers ship each chunk's KV while computing the next")
    p.add_argument("--cpu-affinity", action="store_true",
                   help="pin prefill and decode workers to different CPUs")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tool-call-parser", default=None,
                   help="the gateway's tool call parser (hermes, llama3_json)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    add_disagg_flags(p)
    add_timeout_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=run)


def engine_flag_parser() -> argparse.ArgumentParser:
    """A parser holding only the engine flags: the one list ``up`` forwards to workers."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_flags(p)
    return p


def engine_flag_actions(flags: argparse.ArgumentParser | None = None) -> list[argparse.Action]:
    """The optional flags ``flags`` defines (by default, the engine flags)."""
    if flags is None:
        return add_engine_flags(argparse.ArgumentParser(add_help=False))
    # argparse has no public accessor for a parser's actions; _actions is stable in practice.
    return [a for a in flags._actions if a.option_strings and a.dest != "help"]


def engine_argv(args: argparse.Namespace, flags: argparse.ArgumentParser | None = None) -> list[str]:
    """Every engine flag whose value differs from its default, spelled for a worker's
    command line. Iterates the flag definitions (``flags``, by default every flag that
    ``add_engine_flags`` defines), so a new engine flag is forwarded without a change here."""
    out: list[str] = []
    for action in engine_flag_actions(flags):
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(_bool_spelling(action, bool(value)))
        elif action.nargs == 0:  # store_true / store_const: the flag alone sets the value
            out.append(action.option_strings[0])
        elif value is not None:
            out += [action.option_strings[0], str(value)]
    return out


def _bool_spelling(action: argparse.Action, value: bool) -> str:
    positive = next(o for o in action.option_strings if not o.startswith("--no-"))
    return positive if value else "--no-" + positive[2:]


def plan(args: argparse.Namespace) -> list[Child]:
    """The children ``up`` runs for these arguments, in start order (router first,
    gateway last), each with its command line and health URL; ports are picked here."""
    engine_flags = engine_argv(args)
    limits = timeouts(args)  # raises ValueError (one line, exit 2) before anything starts
    py = [sys.executable, "-m", "cli"]
    roles = ([("worker", "worker", args.colocated)] if args.colocated
             else [("prefill", "prefill", args.prefill), ("decode", "decode", args.decode)])
    workers = [(name, cmd, i) for name, cmd, count in roles for i in range(count)]
    # One pick for every port: distinct from each other and from the gateway's.
    router_port, router_metrics, *worker_ports = free_ports(2 + len(workers),
                                                            avoid=frozenset({args.port}))
    router = f"tcp://127.0.0.1:{router_port}"
    children = [Child("router", py + ["router", "--port", str(router_port), "--metrics-port",
                                      str(router_metrics), "--policy", args.policy,
                                      *limits.router_argv(), *disagg_argv(args)],
                      f"http://127.0.0.1:{router_metrics}/health")]
    cpus = sorted(os.sched_getaffinity(0))
    # --threads is an engine flag (forwarded when given). Unset, a P/D cluster's workers
    # share the CPUs (every one may use them all, each step as many as the others leave
    # idle: measured here, c1 TPOT 0.72x and c16 1.10x the tok/s of one CPU each), and
    # colocated workers split them, unless --share-cpus; --cpu-affinity pins one CPU each.
    share = not args.cpu_affinity and not args.threads and (args.share_cpus or not args.colocated)
    if share:
        cpu_flags = [] if args.share_cpus else ["--share-cpus"]  # given: forwarded already
    elif args.threads:
        cpu_flags = []  # forwarded with the engine flags
    else:
        cpu_flags = ["--threads", str(max(1, available_cpus() // max(len(workers), 1)))]
    for n, ((name, cmd, i), port) in enumerate(zip(workers, worker_ports, strict=True)):
        argv = py + [cmd, "--router", router, "--metrics-port", str(port), *cpu_flags,
                     "--kv-transport", args.kv_transport, "--kv-shm", args.kv_shm,
                     "--kv-stream-chunks" if args.kv_stream_chunks else "--no-kv-stream-chunks",
                     "--worker-id", f"{name}-{i}",
                     *limits.worker_argv(), *engine_flags]
        if args.cpu_affinity:
            argv += ["--cpu-affinity", str(_cpu_for(name, i, n, len(workers), cpus))]
        children.append(Child(f"{name}-{i}", argv, f"http://127.0.0.1:{port}/health"))
    gw = py + ["gateway", "--router", router, "--host", args.host, "--port", str(args.port)]
    gw += _gateway_model_flags(args) + limits.gateway_argv()
    if args.api_key:
        gw += ["--api-key", args.api_key]
    health_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    children.append(Child("gateway", gw, f"http://{health_host}:{args.port}/health"))
    return children


def _gateway_model_flags(args: argparse.Namespace) -> list[str]:
    out = []
    for dest in ("model", "served_model_name", "max_model_len", "tool_call_parser"):
        if getattr(args, dest) is not None:
            out += [f"--{dest.replace('_', '-')}", str(getattr(args, dest))]
    return out


def _cpu_for(name: str, i: int, n: int, total: int, cpus: list[int]) -> int:
    """Prefill workers take CPUs from the front, decode workers from the back."""
    if name == "decode":
        return cpus[-1 - (i % len(cpus))]
    return cpus[n % len(cpus)]


STARTUP_RESPAWNS = 2  # times a child killed by a signal while starting is started again


class StartupError(RuntimeError):
    """A child exited, or not every child was healthy in time, during ``start``."""


class LocalCluster:
    """The children of a plan as running processes: ``start`` spawns them all and returns
    once every one reports healthy (or raises ``StartupError``), ``stop`` ends them all.
    Used by ``tandem up`` and by the end-to-end tests alike."""

    def __init__(self, children: list[Child],
                 drain_timeout: float = default_of(Timeouts, "drain_timeout")) -> None:
        self.children = children
        self.drain_timeout = drain_timeout  # the children's --drain-timeout
        # Children asked to exit one by one (``drain``): the supervisor leaves them alone.
        self.retiring: set[str] = set()
        # Spawning and stopping exclude each other, so no child is started once stop began.
        self._lock = threading.Lock()
        self._stopping = False

    def start(self, timeout: float, stop: threading.Event | None = None) -> None:
        """Spawn every child and wait for all to be healthy; ``stop`` cuts the wait short.
        On failure the children already started are stopped before ``StartupError``."""
        try:
            for child in self.children:
                _spawn(child)
            _wait_healthy(self.children, stop or threading.Event(), timeout, respawn=self.respawn)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Drain the gateway and the workers (SIGTERM, gateway first; SIGKILL past the drain
        timeout and a margin), then stop the router. From here on ``respawn`` refuses, so a
        supervisor cannot bring a child back."""
        with self._lock:
            self._stopping = True
        _shutdown(self.children, self.drain_timeout + DRAIN_MARGIN_S)

    def drain(self, child: Child) -> int:
        """SIGTERM one child and wait for it to exit (SIGKILL past its drain timeout and a
        margin); its exit is no crash to the supervisor. Returns its exit status."""
        self.retiring.add(child.name)
        child.proc.terminate()
        _wait_or_kill([child], self.drain_timeout + DRAIN_MARGIN_S)
        return child.proc.returncode

    def restart(self, child: Child, timeout: float) -> int:
        """Drain ``child``, start it again with the same command line, and wait until it is
        ready (``/ready``; ``StartupError`` if not within ``timeout``). Returns the status
        the drained process exited with."""
        status = self.drain(child)
        try:
            if not self.respawn(child):
                return status
        finally:
            self.retiring.discard(child.name)
        _wait_healthy([child], threading.Event(), timeout, ready=True)
        return status

    def rolling_restart(self, children: list[Child], timeout: float) -> dict[str, int]:
        """``restart`` each child in turn; their drained exit statuses by name."""
        return {child.name: self.restart(child, timeout) for child in children}

    @property
    def stopping(self) -> bool:
        return self._stopping

    def respawn(self, child: Child) -> bool:
        """Start an exited child again with its same command line; False once stopping."""
        with self._lock:
            if self._stopping:
                return False
            _spawn(child)
            return True

    def healthy(self, child: Child) -> bool:
        return _healthy(child.health_url)

    def log(self, line: str) -> None:
        """A line of the launcher's own, among the children's prefixed output."""
        _say("launcher", line)

    def exited(self) -> list[Child]:
        return [c for c in self.children if c.proc is not None and c.proc.poll() is not None]

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run(args: argparse.Namespace) -> int:
    cluster = LocalCluster(plan(args), timeouts(args).drain_timeout)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with cluster:
        try:
            cluster.start(args.startup_timeout, stop)
        except StartupError as e:
            _say("launcher", str(e))
            return 1
        _announce(args, cluster.children)
        Supervisor(cluster).run(stop)  # until Ctrl-C / SIGTERM; a dead child is restarted
        _say("launcher", "stopping")
        return 0


def _spawn(child: Child) -> None:
    proc = subprocess.Popen(child.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, bufsize=1,
                            start_new_session=True, preexec_fn=_die_with_parent)
    child.proc = proc
    threading.Thread(target=_pump, args=(child, proc), daemon=True, name=f"log-{child.name}").start()


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _pump(child: Child, proc: subprocess.Popen) -> None:
    for line in proc.stdout:  # this process's output, even after a restart replaced it
        line = line.rstrip("\n")
        child.tail = (child.tail + [line])[-20:]
        _say(child.name, line)


_print_lock = threading.Lock()


def _say(name: str, line: str) -> None:
    with _print_lock:
        print(f"{name:>10} | {line}", flush=True)


def _wait_healthy(children: list[Child], stop: threading.Event, timeout: float,
                  ready: bool = False, respawn: Callable[[Child], bool] | None = None) -> None:
    """Until every child answers 200 on ``/health`` (``ready``: on ``/ready``). A child
    that exits first is a ``StartupError`` (bad flags, a model that does not load), except,
    with ``respawn``, one killed by a signal (the OOM killer, a stray ``kill -9``): that is
    no fault of its own, so it is started again, up to STARTUP_RESPAWNS times."""
    deadline = time.monotonic() + timeout
    pending = list(children)
    respawned: dict[str, int] = {}
    while pending:
        for child in list(pending):
            if child.proc.poll() is not None:
                status, again = child.proc.returncode, respawned.get(child.name, 0)
                if respawn is not None and status < 0 and again < STARTUP_RESPAWNS:
                    respawned[child.name] = again + 1
                    _say("launcher", f"{child.name} was killed by signal {-status} while starting: "
                                     "starting it again")
                    if respawn(child):
                        continue
                raise StartupError(f"{child.name} failed to start (status {status})")
            if _healthy(child.ready_url if ready else child.health_url):
                pending.remove(child)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise StartupError(f"still not healthy after {timeout:.0f} s: "
                               f"{', '.join(c.name for c in pending)}")
        if stop.wait(0.5):
            raise StartupError("stopped before every service was healthy")


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


def _shutdown(children: list[Child], drain_seconds: float) -> None:
    """The gateway and workers drain first (the router must be there to release the
    workers), the router after them."""
    running = [c for c in children if c.proc is not None and c.proc.poll() is None]
    router = [c for c in running if c.name == "router"]
    draining = [c for c in running if c.name != "router"]
    for child in reversed(draining):  # the gateway first, so clients stop arriving
        child.proc.terminate()
    _wait_or_kill(draining, drain_seconds)
    for child in router:
        child.proc.terminate()
    _wait_or_kill(router, GRACE_SECONDS)


def _wait_or_kill(children: list[Child], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for child in children:
        try:
            child.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
