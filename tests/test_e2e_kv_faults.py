"""KV transfer faults at random, over real processes: ``tandem up`` (one prefill worker,
one decode worker) with the test-only fault hook on (``TANDEM_KV_FAULTS``, inherited by
every child): 5% of transfers each dropped, truncated, corrupted or delayed, fixed seed.

Forty greedy requests, half streaming: each one either completes with exactly Hugging
Face's tokens or fails with a clear error (503 / an SSE error event naming the KV
transfer, never a ``length`` finish); none hangs. Afterwards no process has crashed or
restarted, every ``/health`` answers 200, and every worker holds 0 KV blocks.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import cycle, islice

import httpx
import pytest

from tests.cluster import Cluster, TokenIds
from tests.conftest import hf_greedy

FAULTS = "drop=0.05,truncate=0.05,corrupt=0.05,delay=0.05:0.3,seed=7"
LEASE_S = "1.5"  # a dropped transfer costs this much before its retry
REQUESTS = 40
PROMPTS = 8
MAX_TOKENS = 8
FAILURES = "tandem:kv_transfer_failures_total"
DEADLINE_S = 30.0


@dataclass
class Outcome:
    status: int
    tokens: list[str]  # token texts, in order
    finish: str | None
    error: str | None


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> dict[tuple[int, ...], list[int]]:
    """PROMPTS prompts of 24 tokens, each with its HF greedy output (readable back exactly)."""
    ids = TokenIds(tiny_model_dir)
    found = {}
    for offset in range(0, 4000, 37):
        prompt = list(range(100 + offset, 124 + offset))
        out = hf_greedy(tiny_model_dir, prompt, MAX_TOKENS)
        if ids.exact(out):
            found[tuple(prompt)] = out
        if len(found) == PROMPTS:
            return found
    raise AssertionError("not enough prompts whose output reads back exactly")


def complete(url: str, prompt: list[int], stream: bool) -> Outcome:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": stream}
    with httpx.Client(timeout=60) as client:
        if not stream:
            r = client.post(f"{url}/v1/completions", json=body)
            data = r.json()
            if r.status_code != 200:
                return Outcome(r.status_code, [], None, data["error"]["message"])
            [choice] = data["choices"]
            return Outcome(200, choice["logprobs"]["tokens"], choice["finish_reason"], None)
        tokens, finish, error = [], None, None
        with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    continue
                for choice in chunk.get("choices", []):
                    tokens += (choice.get("logprobs") or {}).get("tokens", [])
                    finish = choice.get("finish_reason") or finish
            return Outcome(r.status_code, tokens, finish, error)


def test_random_transfer_faults_fail_requests_clearly_and_leak_nothing(
        tiny_model_dir, prompts, monkeypatch):
    monkeypatch.setenv("TANDEM_KV_FAULTS", FAULTS)  # the launcher's children inherit it
    ids = TokenIds(tiny_model_dir)
    with Cluster(str(tiny_model_dir), extra=("--num-kv-blocks", "512", "--lease-seconds", LEASE_S)) as c:
        pids = {child.name: child.proc.pid for child in c.children}
        work = [(list(p), i % 2 == 1) for i, p in enumerate(islice(cycle(prompts), REQUESTS))]
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(lambda w: complete(c.url, *w), work))

        ok = failed = 0
        for (prompt, stream), out in zip(work, outcomes, strict=True):
            if out.error is None:
                assert (out.status, out.finish) == (200, "length"), out
                assert ids.of({"logprobs": {"tokens": out.tokens}}) == prompts[tuple(prompt)]
                ok += 1
            else:
                assert "KV transfer failed" in out.error, out
                assert out.status == (200 if stream else 503) and out.finish is None, out
                failed += 1
        assert ok + failed == REQUESTS and ok > 0, outcomes[:3]

        [prefill] = c.workers("prefill")
        [decode] = c.workers("decode")
        assert c.metric(prefill, FAILURES, reason="retried") > 0  # faults were met, and retried
        # One per failed request, and possibly more: a transfer whose ack arrives after its
        # lease (a loaded machine) is a failure to the sender although the decode worker,
        # which had copied the blocks, served the request.
        assert c.metric(prefill, FAILURES, reason="send") >= failed
        assert c.metric(decode, FAILURES, reason="bad_transfer") > 0  # truncated/corrupt refused

        assert {child.name: child.proc.pid for child in c.children} == pids
        assert all(child.proc.poll() is None for child in c.children)
        for child in c.children:
            c.health(child)  # raises unless 200
        deadline = time.monotonic() + DEADLINE_S
        while not all(idle(c.health(w)) for w in c.workers()):
            assert time.monotonic() < deadline, [c.health(w) for w in c.workers()]
            time.sleep(0.1)  # pacing a poll of /health, not synchronisation


def idle(health: dict) -> bool:
    return (health["running"], health["waiting"], health["kv_cache_usage"]) == (0, 0, 0)
