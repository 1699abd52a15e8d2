"""Supervision: a child that dies after the cluster is up comes back with the same command
line, the others keep running, and only Ctrl-C / SIGTERM stops everything.

The backoff table is checked in-process with a hand-moved clock; the supervisor over real
stand-in children (tiny HTTP servers); then a real cluster (1 prefill + 2 decode) with a
decode worker killed, and ``tandem up`` itself as a user runs it, with its gateway killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from common.addresses import free_port, free_ports
from services import launcher
from services.supervision import RestartPolicy, Supervisor
from tests.cluster import Cluster, wait_for
from tests.conftest import ManualClock

ROOT = Path(__file__).resolve().parent.parent


def wait_for_restart(condition, what: str, timeout: float = 90.0) -> object:
    """A restart loads a model: the shared poll, with a longer deadline."""
    return wait_for(condition, what, timeout)


# ---- the backoff table ----------------------------------------------------------------

def test_backoff_doubles_from_half_a_second_up_to_ten():
    policy = RestartPolicy(clock=ManualClock())
    restarts = [policy.exited("decode-0") for _ in range(7)]
    assert [r.delay for r in restarts] == [0.5, 1, 2, 4, 8, 10, 10]
    assert [r.count for r in restarts] == [1, 2, 3, 4, 5, 6, 7]


def test_backoff_resets_only_after_a_long_enough_healthy_period():
    clock = ManualClock()
    policy = RestartPolicy(first=0.5, longest=10, reset_after=30, clock=clock)
    assert [policy.exited("w").delay for _ in range(3)] == [0.5, 1, 2]
    policy.healthy("w")
    clock.now += 29.9
    assert policy.exited("w").delay == 4  # healthy, but not for long enough: still backing off
    policy.healthy("w")
    clock.now += 20
    policy.healthy("w")  # a later report does not move the start of the healthy period
    clock.now += 10
    restart = policy.exited("w")
    assert (restart.delay, restart.count) == (0.5, 5)  # the delay resets, the count does not
    clock.now += 100  # a long time, but never healthy since: no reset
    assert policy.exited("w").delay == 1


def test_each_child_has_its_own_backoff():
    policy = RestartPolicy(clock=ManualClock())
    assert [policy.exited("a").delay for _ in range(3)] == [0.5, 1, 2]
    assert (policy.exited("b").delay, policy.exited("a").delay) == (0.5, 4)


@pytest.mark.parametrize("first,longest,reset_after", [(0, 10, 30), (2, 1, 30), (0.5, 10, 0)])
def test_a_policy_that_cannot_work_is_refused(first, longest, reset_after):
    with pytest.raises(ValueError):
        RestartPolicy(first, longest, reset_after)


# ---- the supervisor over stand-in children ----------------------------------------------

def _http_child(name: str, root: Path, port: int) -> launcher.Child:
    """A child whose /health answers 200: a static file server over a folder holding 'health'."""
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
            "--directory", str(root)]
    return launcher.Child(name, argv, f"http://127.0.0.1:{port}/health")


def test_the_supervisor_restarts_only_the_dead_child_and_never_once_stopping(tmp_path, capsys):
    (tmp_path / "health").write_text("ok")
    clock = ManualClock()
    children = [_http_child(name, tmp_path, port) for name, port in zip("ab", free_ports(2), strict=True)]
    with launcher.LocalCluster(children) as cluster:
        cluster.start(timeout=60)
        supervisor = Supervisor(cluster, RestartPolicy(clock=clock))
        a, b = (c.proc.pid for c in children)
        os.kill(a, signal.SIGKILL)
        children[0].proc.wait()
        supervisor.tick()
        assert "a exited with status -9: restarting in 0.5 s (restart 1)" in capsys.readouterr().out
        supervisor.tick()
        assert children[0].proc.pid == a  # not before its delay (the clock has not moved)
        clock.now += 0.5
        supervisor.tick()
        assert children[0].proc.pid != a and children[1].proc.pid == b
        wait_for_restart(lambda: (supervisor.tick(), "a is healthy again" in capsys.readouterr().out)[1],
                 "the restarted child to answer healthy")
        cluster.stop()
        assert cluster.exited() == children
        clock.now += 100
        supervisor.tick()
        assert cluster.respawn(children[0]) is False
        assert cluster.exited() == children and "restarting" not in capsys.readouterr().out


# ---- a real cluster under supervision -------------------------------------------------

def _complete(url: str, prompt: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def _batch(url: str, n: int = 4) -> bool:
    with ThreadPoolExecutor(n) as pool:
        replies = list(pool.map(lambda i: _complete(url, f"after the restart {i}"), range(n)))
    return all(r["choices"][0]["text"] for r in replies)


def _back_again(cluster: Cluster, name: str, old_pid: int) -> bool:
    child = cluster.child(name)
    return child.proc.pid != old_pid and cluster.local.healthy(child)


def _pids(cluster: Cluster) -> dict[str, int]:
    return {c.name: c.proc.pid for c in cluster.children}


def test_a_killed_decode_worker_is_restarted_rejoins_and_gets_work(tiny_model_dir):
    with Cluster(str(tiny_model_dir), prefill=1, decode=2, supervise=True) as cluster:
        _complete(cluster.url, "warm up")
        before = _pids(cluster)
        os.kill(before["decode-0"], signal.SIGKILL)
        wait_for_restart(lambda: _back_again(cluster, "decode-0", before["decode-0"]),
                 f"decode-0 to be restarted and healthy\n{cluster.logs()}")
        wait_for_restart(lambda: cluster.metric(cluster.router, "tandem:router_workers", role="decode") == 2,
                 "the router to count two decode workers")
        restarted = cluster.child("decode-0")
        assert cluster.metric(restarted, "tandem:generation_tokens_total") == 0  # a new process
        # Batches of concurrent requests (every one must succeed) until the restarted worker
        # has taken some: decode placement is by free blocks, so only overlapping requests
        # spread over both decode workers.
        wait_for_restart(lambda: _batch(cluster.url) and
                 cluster.metric(restarted, "tandem:generation_tokens_total") > 0,
                 "the restarted decode worker to be given work", timeout=60)
        after = _pids(cluster)
        assert {n: p for n, p in after.items() if n != "decode-0"} == \
               {n: p for n, p in before.items() if n != "decode-0"}  # nobody else restarted


# ---- `tandem up` itself ---------------------------------------------------------------

class Output:
    """The launcher's stdout, read on a thread (so its pipe never fills) and kept whole."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line)

    def has(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))


def test_tandem_up_restarts_a_killed_gateway_on_its_port_and_sigterm_leaves_no_orphans(tiny_model_dir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "up", "--model", str(tiny_model_dir), "--port", str(port),
         "--num-kv-blocks", "256", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    out = Output(proc)
    try:
        wait_for_restart(lambda: out.has("ready: OpenAI API at") or proc.poll() is not None, "tandem up")
        assert proc.poll() is None, "".join(out.lines)
        before = {c.cmdline()[3]: c for c in psutil.Process(proc.pid).children()}
        assert {"router", "prefill", "decode", "gateway"} <= set(before)
        before["gateway"].send_signal(signal.SIGKILL)
        wait_for_restart(lambda: out.has("launcher | gateway exited with status -9: restarting in 0.5 s "
                                 "(restart 1)"), "the restart line\n" + "".join(out.lines))
        wait_for_restart(lambda: out.has("launcher | gateway is healthy again"), "the gateway to be back")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})
        assert r.status_code == 200, r.text
        after = {c.cmdline()[3]: c for c in psutil.Process(proc.pid).children()}
        assert after["gateway"].pid != before["gateway"].pid
        assert {n: c.pid for n, c in after.items() if n != "gateway"} == \
               {n: c.pid for n, c in before.items() if n != "gateway"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    _, alive = psutil.wait_procs(list(after.values()), timeout=15)
    assert alive == []  # no orphans, the restarted gateway included
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
