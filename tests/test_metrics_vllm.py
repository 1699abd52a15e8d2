"""vLLM-compatible metrics on a real tiny P/D cluster: vLLM's names under ``tandem:``,
the ``model_name`` label on every request and engine metric, counts that move with
traffic, and a Grafana dashboard (``deploy/grafana/tandem.json``) whose every query names
a metric the cluster exports."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import httpx
import pytest

from tests.cluster import Cluster, wait_for

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "tandem.json"
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? (\S+)$", re.M)
GATEWAY_METRICS = (  # vLLM's request-level names (the gateway sees whole requests)
    "tandem:time_to_first_token_seconds", "tandem:time_per_output_token_seconds",
    "tandem:e2e_request_latency_seconds", "tandem:request_prefill_time_seconds",
    "tandem:request_decode_time_seconds", "tandem:request_prompt_tokens",
    "tandem:request_generation_tokens")
WORKER_GAUGES = ("tandem:num_requests_running", "tandem:num_requests_waiting",
                 "tandem:kv_cache_usage_perc")


def scrape(cluster: Cluster, child) -> list[tuple[str, dict[str, str], float]]:
    """Every sample on a service's /metrics: (name, labels, value)."""
    url = child.health_url.replace("/health", "/metrics")
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = []
    for name, labels, value in SAMPLE.findall(text):
        pairs = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels))
        out.append((name, pairs, float(value)))
    return out


def value(samples, name: str, missing_ok: bool = False, **labels: str) -> float:
    """The sum of the samples of ``name`` that have ``labels``; a labelled child that was
    never used has none (``missing_ok``: 0 then), any other absence fails."""
    found = [v for n, ls, v in samples if n == name and labels.items() <= ls.items()]
    assert found or missing_ok, f"no sample {name} with {labels}"
    return sum(found)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with Cluster(str(tiny_model_dir), prefill=1, decode=1) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(cluster) -> str:
    return httpx.get(f"{cluster.url}/v1/models", timeout=30).json()["data"][0]["id"]


def complete(cluster: Cluster, prompt: str, max_tokens: int) -> dict:
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_request_metrics_carry_model_name_and_move_with_traffic(cluster, model_name):
    gateway = cluster.child("gateway")
    before = scrape(cluster, gateway)
    usages = [complete(cluster, f"metrics request {i} " * (i + 1), 4 + i) for i in range(3)]
    after = scrape(cluster, gateway)
    for name in GATEWAY_METRICS:
        grew = (value(after, f"{name}_count", model_name=model_name)
                - value(before, f"{name}_count", model_name=model_name))
        assert grew == 3, name  # one observation per request
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated == 4 + 5 + 6  # ignore_eos: each ran to its max_tokens
    for name, expected in (("tandem:request_prompt_tokens_sum", prompt),
                           ("tandem:request_generation_tokens_sum", generated),
                           ("tandem:prompt_tokens_total", prompt),
                           ("tandem:generation_tokens_total", generated)):
        assert value(after, name, model_name=model_name) - value(before, name,
                                                                 model_name=model_name) == expected
    # e2e counts from the Submit: its queue time, then the prefill and the decode time.
    def grew(name: str) -> float:
        return value(after, name, model_name=model_name) - value(before, name, model_name=model_name)

    phases = (grew("tandem:request_prefill_time_seconds_sum")
              + grew("tandem:request_decode_time_seconds_sum"))
    assert grew("tandem:e2e_request_latency_seconds_sum") >= phases - 1e-9 and phases > 0
    # Each ran out of tokens: vLLM's finished_reason="length".
    success = "tandem:request_success_total"
    assert (value(after, success, model_name=model_name, finished_reason="length")
            - value(before, success, True, model_name=model_name, finished_reason="length")) == 3


def test_engine_metrics_carry_model_name_on_every_worker(cluster, model_name):
    for worker in cluster.workers():
        before = scrape(cluster, worker)
        for name in WORKER_GAUGES:
            [labels] = [ls for n, ls, _ in before if n == name]
            assert labels == {"model_name": model_name}, (worker.name, name)

    def total(name: str) -> float:
        return sum(value(scrape(cluster, w), name, model_name=model_name)
                   for w in cluster.workers())

    def steps() -> float:
        return total("tandem:iteration_tokens_total_count")

    def prefix() -> float:
        return total("tandem:prefix_cache_queries_total")
    steps0, prefix0 = steps(), prefix()
    complete(cluster, "engine metrics " * 8, 3)
    assert steps() > steps0  # engine steps were observed (prefill and decode)
    wait_for(lambda: prefix() > prefix0, "the prefix lookups to be counted", timeout=30)
    [prefill] = cluster.workers("prefill")
    [decode] = cluster.workers("decode")
    assert value(scrape(cluster, prefill), "tandem:kv_transfer_bytes_total",
                 model_name=model_name, direction="sent") > 0
    assert value(scrape(cluster, decode), "tandem:kv_transfer_bytes_total",
                 model_name=model_name, direction="received") > 0


def test_every_metric_the_grafana_dashboard_queries_is_exported(cluster):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    named = {m for e in exprs for m in re.findall(r"tandem:[a-zA-Z0-9_:]+", e)}
    assert len(exprs) >= 20 and len(named) >= 15
    complete(cluster, "dashboard", 2)  # every histogram has observations
    exported = {n for child in [cluster.child("gateway"), cluster.router, *cluster.workers()]
                for n, _, _ in scrape(cluster, child)}
    assert named - exported == set()
    panels = {p["title"] for p in dashboard["panels"]}
    for wanted in ("Token throughput", "Time to first token", "Time per output token",
                   "End-to-end request latency", "Requests running and waiting",
                   "KV cache usage per worker", "Prefix cache hit rate",
                   "Finished requests by finished_reason", "Queue, prefill and decode time (p90)"):
        assert wanted in panels
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
