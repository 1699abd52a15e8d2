"""`tandem up` as a user runs it: one command, a serving cluster, Ctrl-C stops it all;
and what it hands each worker: every engine flag the user changed."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from cli.main import build_parser
from common.addresses import ephemeral_range, free_port, free_ports
from services import launcher


def test_planned_ports_are_distinct_free_and_never_ones_the_kernel_hands_out():
    # A port planned up front is released before its service binds it; in that gap a
    # worker's bind(0) (its KV socket) or any connect() takes a port from the ephemeral
    # range, so a planned port from that range could be stolen (a CI run hit exactly this).
    low, high = ephemeral_range()
    ports = free_ports(40)
    assert len(set(ports)) == 40 and not any(low <= p <= high for p in ports)
    for port in ports:  # and free: each binds right away
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_up_serves_then_stops_every_process(tiny_model_dir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "up", "--model", str(tiny_model_dir), "--port", str(port),
         "--num-kv-blocks", "256", "--cpu-affinity"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parent.parent)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "ready: OpenAI API at" in line:
                break
        else:
            raise AssertionError("tandem up exited before it was ready:\n" + "".join(lines))
        names = {line.split("|")[0].strip() for line in lines if "|" in line}
        assert {"router", "prefill-0", "decode-0", "gateway"} <= names  # prefixed logs
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 4
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        affinity = {c.cmdline()[3]: c.cpu_affinity() for c in children
                    if len(c.cmdline()) > 3 and c.cmdline()[3] in ("prefill", "decode")}
        if psutil.cpu_count() >= 2:
            assert affinity["prefill"] != affinity["decode"]  # pinned apart
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert alive == []  # no orphans
    with httpx.Client() as client:
        try:
            client.get(f"http://127.0.0.1:{port}/health", timeout=2)
            raise AssertionError("the gateway still answers after shutdown")
        except httpx.TransportError:
            pass


# ---- what `up` forwards to every worker ----------------------------------------------

def _changed(action: argparse.Action) -> object:
    """A value for the flag that differs from its default (argparse-level only)."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return not action.default
    if action.choices:
        return next(c for c in action.choices if c != action.default)
    if action.type is int:
        return 7 if action.default != 7 else 8
    return "changed-value"


def _command_line(value: object, action: argparse.Action) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction):
        return [action.option_strings[0] if value else action.option_strings[1]]
    return [action.option_strings[0], str(value)]


def _workers_as_parsed(up_argv: list[str]) -> list[argparse.Namespace]:
    """Plan ``tandem up`` and parse each worker's command line as that worker would."""
    parser = build_parser()
    children = launcher.plan(parser.parse_args(["up", *up_argv]))
    workers = [c for c in children if c.name.split("-")[0] in ("prefill", "decode", "worker")]
    assert workers
    return [parser.parse_args(c.argv[3:]) for c in workers]  # after: python -m cli


@pytest.mark.parametrize("action", launcher.engine_flag_actions(), ids=lambda a: a.dest)
def test_every_engine_flag_reaches_every_worker_when_changed(action):
    value = _changed(action)
    for worker in _workers_as_parsed(_command_line(value, action)):
        assert getattr(worker, action.dest) == value


def test_unchanged_engine_flags_are_not_spelled_out():
    argv = launcher.engine_argv(build_parser().parse_args(["up"]))
    assert argv == []


def test_a_flag_added_to_the_engine_flags_is_forwarded_without_touching_the_launcher():
    flags = launcher.engine_flag_parser()
    flags.add_argument("--brand-new-knob", type=int, default=3)
    flags.add_argument("--brand-new-switch", action=argparse.BooleanOptionalAction, default=True)
    flags.add_argument("--brand-new-toggle", action="store_true")
    args = flags.parse_args(["--brand-new-knob", "5", "--no-brand-new-switch", "--brand-new-toggle",
                             "--max-num-seqs", "9"])
    argv = launcher.engine_argv(args, flags)
    assert argv == ["--max-num-seqs", "9", "--brand-new-knob", "5", "--no-brand-new-switch",
                    "--brand-new-toggle"]
    assert vars(flags.parse_args(argv)) == vars(args)  # what a worker parses back


def test_threads_are_shared_out_unless_given():
    [given] = {tuple(w.threads for w in _workers_as_parsed(["--threads", "3"]))}
    assert given == (3, 3)
    split = {w.threads for w in _workers_as_parsed(["--colocated", "2"])}
    assert len(split) == 1 and split.pop() >= 1


def test_a_pd_cluster_shares_its_cpus_unless_pinned_or_given_threads():
    assert {(w.threads, w.share_cpus) for w in _workers_as_parsed([])} == {(None, True)}
    assert {w.share_cpus for w in _workers_as_parsed(["--threads", "1"])} == {False}
    assert {w.share_cpus for w in _workers_as_parsed(["--cpu-affinity"])} == {False}


def test_workers_sharing_cpus_may_each_use_them_all():
    workers = _workers_as_parsed(["--share-cpus"])
    assert [(w.threads, w.share_cpus) for w in workers] == [(None, True)] * len(workers)
    pinned = _workers_as_parsed(["--share-cpus", "--cpu-affinity"])
    assert all(w.threads is not None for w in pinned)  # one CPU each: nothing to share


def test_kv_streaming_is_forwarded_to_the_workers():
    assert {w.kv_stream_chunks for w in _workers_as_parsed([])} == {True}
    assert {w.kv_stream_chunks for w in _workers_as_parsed(["--no-kv-stream-chunks"])} == {False}


def test_a_child_that_exits_during_start_is_a_startup_error():
    router = launcher.Child("router", [sys.executable, "-c", "raise SystemExit(3)"],
                            f"http://127.0.0.1:{free_port()}/health")
    cluster = launcher.LocalCluster([router])
    with pytest.raises(launcher.StartupError, match="router failed to start .status 3"):
        cluster.start(timeout=60)
    assert cluster.exited() == [router]


def _child_killed_on_its_first_starts(tmp_path, kills: int) -> launcher.Child:
    """A child that SIGKILLs itself on its first ``kills`` starts, then serves /health."""
    port = free_port()
    script = (
        "import http.server, os, pathlib, signal\n"
        f"marks = pathlib.Path({str(tmp_path)!r})\n"
        f"starts = len(list(marks.glob('start-*'))); (marks / f'start-{{starts}}').touch()\n"
        f"if starts < {kills}: os.kill(os.getpid(), signal.SIGKILL)\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self): self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    return launcher.Child("decode-0", [sys.executable, "-c", script], f"http://127.0.0.1:{port}/health")


def test_a_child_killed_by_a_signal_while_starting_is_started_again(tmp_path):
    """An OOM kill or a stray kill -9 during the model load is no fault of the child's: the
    cluster still comes up (a non-zero exit, as above, stays fatal)."""
    child = _child_killed_on_its_first_starts(tmp_path, kills=launcher.STARTUP_RESPAWNS)
    cluster = launcher.LocalCluster([child])
    try:
        cluster.start(timeout=60)
        assert len(list(tmp_path.glob("start-*"))) == launcher.STARTUP_RESPAWNS + 1
        assert cluster.healthy(child)
    finally:
        cluster.stop()


def test_a_child_killed_at_every_start_is_a_startup_error(tmp_path):
    child = _child_killed_on_its_first_starts(tmp_path, kills=launcher.STARTUP_RESPAWNS + 1)
    cluster = launcher.LocalCluster([child])
    with pytest.raises(launcher.StartupError, match="decode-0 failed to start .status -9"):
        cluster.start(timeout=60)
    assert len(list(tmp_path.glob("start-*"))) == launcher.STARTUP_RESPAWNS + 1


# ---- the ports a plan hands out ------------------------------------------------------

def _ports_of(child: launcher.Child) -> list[int]:
    argv = child.argv
    flags = [int(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a in ("--port", "--metrics-port")]
    return sorted(set(flags + [int(child.health_url.rsplit(":", 1)[1].split("/")[0])]))


def test_every_port_a_plan_hands_out_is_its_own_and_never_the_gateways():
    # Once, two picks came out equal: a worker's metrics server took the gateway's port,
    # answered the launcher's /health for it, and every POST got its 501.
    gateway = free_port()
    for _ in range(10):
        children = launcher.plan(build_parser().parse_args(
            ["up", "--prefill", "4", "--decode", "4", "--port", str(gateway)]))
        services = [_ports_of(c) for c in children[:-1]]
        ports = [p for each in services for p in each]
        assert len(ports) == len(set(ports)) == 2 + 8  # router: ZMQ + metrics; workers: metrics
        assert gateway not in ports and _ports_of(children[-1]) == [gateway]


class _ScriptedSocket:
    """A socket whose bind to port 0 gets the next of ``ports`` (the kernel's choice)."""

    ports: list[int] = []

    def __init__(self, *args) -> None:
        self.port = None

    def bind(self, address) -> None:
        self.port = _ScriptedSocket.ports.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self.port)

    def close(self) -> None:
        pass


def test_a_plan_skips_the_gateways_port_when_the_kernel_hands_it_out(monkeypatch):
    from common import addresses

    args = build_parser().parse_args(["up", "--port", "40000"])  # parsed before the script
    monkeypatch.setattr(addresses.socket, "socket", _ScriptedSocket)
    _ScriptedSocket.ports = [40000, 40001, 40002, 40003, 40004]
    children = launcher.plan(args)
    assert [_ports_of(c) for c in children] == [[40001, 40002], [40003], [40004], [40000]]
