"""Faults under load against a real ``tandem up``: what a platform team's bad day does to it.

Eight clients stream chat completions without pause, one sends hostile requests (bad JSON,
bad UTF-8, a 30 MB body, a 100,000-deep array, out-of-range fields, an unknown model, a
prompt past the context), one hangs up after three chunks; meanwhile the plan signals the
cluster's processes (by default: kill -9 a decode worker at 20 s, the router at 45 s,
the prefill worker at 70 s, SIGTERM the other decode worker at 95 s; the launcher restarts
each). Then it waits for every worker's ``tandem:kv_cache_usage_perc`` and running/waiting
gauges to read 0, sends one more request, and stops the cluster with Ctrl-C. Printed: each
outcome's count (a stream that ended ``[DONE]`` after a finish reason is ``ok``; a 5xx,
an error event, a stream cut short or a request past 90 s is counted by name), the
hostile requests' statuses, the gauges at idle. Not part of CI (two to three minutes).

    python -m loadtest.chaos [--plan '[[20, "decode", "SIGKILL"], ...]'] [--long 300] -- [tandem up flags]

``--plan``: [seconds, role, signal] triples; the role is the process's ``tandem``
subcommand (router, gateway, prefill, decode, worker), the first such child is signalled;
SIGCONT goes to the process the last SIGSTOP of that role stopped. ``--long N``: a quarter
of the prompts carry an N-sentence passage (prefills of a few thousand tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from loadtest.children import wait_answering
from loadtest.router_metrics import scrape

ROOT = Path(__file__).resolve().parent.parent
BASE = "http://127.0.0.1:8000"
MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PLAN = [[20, "decode", "SIGKILL"], [45, "router", "SIGKILL"], [70, "prefill", "SIGKILL"],
                [95, "decode", "SIGTERM"]]
TOPICS = ["Tell me about the sea.", "Write a poem about CPUs.", "What is 2+2? Explain.",
          "List five fruits and describe each.", "Summarise the history of Rome."]


def chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


HOSTILE = {  # name -> httpx keyword arguments of a POST to /v1/chat/completions
    "bad JSON": {"content": b"{not json"},
    "bad UTF-8": {"content": json.dumps(chat("x")).encode().replace(b'"x"', b'"\xff\xfe"')},
    "30 MB body": {"content": b'{"a":"' + b"x" * 30_000_000 + b'"}'},
    "100,000-deep array": {"content": b"[" * 100_000 + b"]" * 100_000},
    "max_tokens -1": {"json": chat("x", max_tokens=-1)},
    "max_tokens 1e12": {"json": chat("x", max_tokens=10**12)},
    "n 100,000": {"json": chat("x", n=100_000)},
    "temperature a string": {"json": chat("x", temperature="hot")},
    "no messages": {"json": {"model": MODEL, "messages": []}},
    "prompt past the context": {"json": chat("word " * 40_000)},
    "top_logprobs 99": {"json": chat("x", logprobs=True, top_logprobs=99)},
    "10,000 stop strings": {"json": chat("x", stop=["a"] * 10_000)},
    "logit_bias not token ids": {"json": chat("x", logit_bias={"zz": 5})},
    "unknown model": {"json": {**chat("x"), "model": "gpt-9"}},
}


class Cluster:
    """``tandem up`` in its own session, its children found by their subcommand."""

    def __init__(self, flags: list[str], log: Path) -> None:
        self.proc = subprocess.Popen([str(ROOT / ".venv/bin/tandem"), "up", *flags], cwd=ROOT,
                                     stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.stopped: dict[str, int] = {}

    def children(self) -> dict[int, str]:
        """pid -> command line of each child of the launcher."""
        return {c.pid: " ".join(c.cmdline()) for c in psutil.Process(self.proc.pid).children()}

    @staticmethod
    def role(args: str) -> str | None:
        m = re.search(r"-m cli (\w+)", args)
        return m.group(1) if m else None

    def signal(self, role: str, name: str) -> int | None:
        """Signal the first child in ``role``; None if none runs now (being restarted)."""
        if name == "SIGCONT":
            pid = self.stopped.pop(role, None)
        else:
            pid = next((p for p, a in self.children().items() if self.role(a) == role), None)
        if pid is None:
            return None
        os.kill(pid, getattr(signal, name))
        if name == "SIGSTOP":
            self.stopped[role] = pid
        return pid

    def metrics_ports(self) -> dict[str, int]:
        ports = {}
        for args in self.children().values():
            m = re.search(r"--metrics-port[= ](\d+)", args)
            if m and self.role(args) in ("prefill", "decode", "worker"):
                ports[f"{self.role(args)}:{m.group(1)}"] = int(m.group(1))
        return ports

    def stop(self) -> int | None:
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return None


def ready() -> bool | None:
    try:
        return httpx.get(BASE + "/ready", timeout=2).status_code == 200 or None
    except httpx.HTTPError:
        return None


class Load:
    def __init__(self, long_sentences: int) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.hostile: collections.Counter[str] = collections.Counter()
        self.passage = " ".join(f"Fact {j}: {j * 7} is a number." for j in range(long_sentences))
        self.running = True

    def prompt(self, i: str) -> str:
        long = self.passage and random.random() < 0.25
        return (f"Read this. {self.passage} " if long else "") + f"{random.choice(TOPICS)} {i}"

    async def stream(self, client: httpx.AsyncClient, i: str) -> str:
        body = chat(self.prompt(i), max_tokens=random.choice([32, 64, 96]), stream=True, temperature=0)
        try:
            async with asyncio.timeout(90):
                return await self._read(client, body)
        except TimeoutError:
            return "HANG (90 s)"
        except httpx.HTTPError as e:
            return f"transport: {type(e).__name__}"

    async def _read(self, client: httpx.AsyncClient, body: dict) -> str:
        async with client.stream("POST", BASE + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return f"HTTP {r.status_code}"
            finished = error = None
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return error or ("ok" if finished else "no finish reason")
                if line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = f"error event: {chunk['error'].get('code') or chunk['error'].get('type')}"
                    elif chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                        finished = True
            return "cut short"

    async def streamer(self, client: httpx.AsyncClient, k: int) -> None:
        for i in itertools.count():
            if not self.running:
                return
            outcome = await self.stream(client, f"{k}-{i}")
            self.outcomes[outcome] += 1
            if outcome.startswith("transport"):  # the gateway is down: let it restart
                await asyncio.sleep(0.1)

    async def attacker(self, client: httpx.AsyncClient) -> None:
        while self.running:
            name, kw = random.choice(list(HOSTILE.items()))
            headers = {"content-type": "application/json"} if "content" in kw else None
            try:
                r = await client.post(BASE + "/v1/chat/completions", headers=headers, timeout=60, **kw)
                self.hostile[f"{name}: {r.status_code}"] += 1
            except httpx.HTTPError as e:
                self.hostile[f"{name}: {type(e).__name__}"] += 1
            await asyncio.sleep(0.05)

    async def quitter(self, client: httpx.AsyncClient) -> None:
        """Streams that the client abandons after three chunks."""
        while self.running:
            try:
                async with client.stream("POST", BASE + "/v1/chat/completions",
                                         json=chat("Count to 100.", max_tokens=200, stream=True)) as r:
                    chunks = 0
                    async for line in r.aiter_lines():
                        chunks += line.startswith("data: ")
                        if chunks >= 3:
                            break
                self.outcomes["hung up after 3 chunks"] += 1
            except httpx.HTTPError as e:
                self.outcomes[f"hang-up: {type(e).__name__}"] += 1
            await asyncio.sleep(0.2)


async def run_load(cluster: Cluster, load: Load, plan: list, duration: float) -> list:
    events = []
    start = time.monotonic()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(90, connect=10), limits=limits) as client:
        tasks = [asyncio.create_task(load.streamer(client, k)) for k in range(8)]
        tasks += [asyncio.create_task(load.attacker(client)), asyncio.create_task(load.quitter(client))]
        for at, role, name in plan:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            events.append((round(time.monotonic() - start, 1), role, name, cluster.signal(role, name)))
            print("signal", events[-1], flush=True)
        await asyncio.sleep(max(0.0, start + duration - time.monotonic()))
        load.running = False
        await asyncio.gather(*tasks)
    return events


def gauges_at_idle(cluster: Cluster, deadline_s: float = 60) -> dict[str, list[float]]:
    """Every worker's KV usage and running/waiting counts, once all read 0 (or at the deadline)."""
    names = ("tandem:kv_cache_usage_perc", "tandem:num_requests_running", "tandem:num_requests_waiting")
    end = time.monotonic() + deadline_s
    while True:
        values = {}
        for name, port in cluster.metrics_ports().items():
            samples = scrape(f"http://127.0.0.1:{port}/metrics").samples
            values[name] = [v for key, v in samples.items() if key.startswith(names)]
        if all(v == 0 for vs in values.values() for v in vs) or time.monotonic() > end:
            return values
        time.sleep(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", type=json.loads, default=DEFAULT_PLAN)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--long", type=int, default=0, help="sentences of the long prompts' passage")
    p.add_argument("--log", type=Path, default=Path("chaos-cluster.log"))
    p.add_argument("up_flags", nargs="*", help="for tandem up (after --)")
    args = p.parse_args()
    cluster = Cluster(args.up_flags or ["--prefill", "1", "--decode", "2"], args.log)
    try:
        start = time.monotonic()
        wait_answering(cluster.proc, ready, "cluster", timeout=300)
        print(f"ready in {time.monotonic() - start:.1f} s")
        load = Load(args.long)
        asyncio.run(run_load(cluster, load, args.plan, args.duration))
        print("requests:", dict(load.outcomes.most_common()))
        print("hostile:", dict(sorted(load.hostile.items())))
        print("gauges at idle (KV usage, running, waiting):", gauges_at_idle(cluster))
        r = httpx.post(BASE + "/v1/chat/completions", json=chat("Hi", max_tokens=8), timeout=60)
        print("one more request:", r.status_code)
    finally:
        print("tandem up exited with", cluster.stop())


if __name__ == "__main__":
    sys.exit(main())
