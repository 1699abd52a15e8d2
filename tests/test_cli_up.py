"""`tandem up` as a user runs it: one command, a serving cluster, Ctrl-C stops it all."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from common.addresses import free_port


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
