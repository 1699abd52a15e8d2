"""Routing and faults over real processes: prefix affinity with 2 prefill + 2 decode
workers, a worker killed mid-request, a cluster with no workers, the API key."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from common.addresses import free_port
from tests.cluster import Cluster

PREFIX = list(range(1000, 1256))  # 16 full blocks


def shared_prefix_requests(cluster: Cluster) -> None:
    for tail in ([7, 8, 9], [17, 18], [27, 28, 29, 30]):
        r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
            "prompt": PREFIX + tail, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text


def per_worker(cluster: Cluster, metric: str) -> dict[str, float]:
    return {w.name: cluster.metric(w, metric) for w in cluster.workers("prefill")}


@pytest.mark.parametrize("policy", ["prefix", "round_robin"])
def test_shared_prefix_follows_the_cache_only_with_prefix_policy(tiny_model_dir, policy):
    with Cluster(str(tiny_model_dir), prefill=2, decode=2, policy=policy) as cluster:
        shared_prefix_requests(cluster)
        queries = per_worker(cluster, "tandem:prefix_cache_queries_total")
        hits = per_worker(cluster, "tandem:prefix_cache_hits_total")
    used = [name for name, q in queries.items() if q > 0]
    if policy == "prefix":
        assert len(used) == 1  # all three landed on the worker that holds the prefix
        assert hits[used[0]] == 2 * len(PREFIX)  # the second and third hit every block
    else:
        assert len(used) == 2  # spread regardless of what is cached
        assert sum(hits.values()) < 2 * len(PREFIX)


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    with Cluster(str(tiny_model_dir), extra=("--num-kv-blocks", "512", "--api-key", "sekret")) as c:
        yield c


def test_api_key_is_required(guarded):
    body = {"prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{guarded.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    ok = httpx.post(f"{guarded.url}/v1/completions", json=body, timeout=60,
                    headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200


def test_killed_decode_worker_fails_the_stream_and_frees_prefill_blocks(guarded):
    headers = {"Authorization": "Bearer sekret"}
    body = {"prompt": list(range(300, 340)), "max_tokens": 900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    [decode] = guarded.workers("decode")
    events = []
    with httpx.stream("POST", f"{guarded.url}/v1/completions", json=body, headers=headers,
                      timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                decode.proc.send_signal(signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert "failed" in error["error"]["message"] and error["error"]["type"] == "service_unavailable_error"
    [prefill] = guarded.workers("prefill")
    assert guarded.metric(prefill, "tandem:kv_cache_usage_perc") == 0.0


def test_no_workers_means_503_with_retry_after(tiny_model_dir):
    router_port, gw_port = free_port(), free_port()
    py = [sys.executable, "-m", "cli"]
    procs = [subprocess.Popen(py + ["router", "--port", str(router_port), "--metrics-port", "0"]),
             subprocess.Popen(py + ["gateway", "--router", f"tcp://127.0.0.1:{router_port}",
                                    "--port", str(gw_port), "--model", str(tiny_model_dir)])]
    try:
        url = f"http://127.0.0.1:{gw_port}"
        deadline = time.monotonic() + 120
        while True:  # wait for the gateway to listen (it answers 503: nothing to serve)
            try:
                health = httpx.get(f"{url}/health", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "gateway never started"
                time.sleep(0.2)
        assert health.status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "no prefill worker" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1
    finally:
        for p in procs:
            p.terminate()
            p.wait(20)


def test_pd_over_ucx_gives_the_hf_tokens(tiny_model_dir):
    pytest.importorskip("ucxx")
    from tests.conftest import hf_greedy

    prompt = list(range(400, 437))
    with Cluster(str(tiny_model_dir), kv_transport="ucx") as cluster:
        r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        [decode] = cluster.workers("decode")
        received = cluster.metric(decode, "tandem:kv_transfer_bytes_total")
    from common.model.tokenizer import Tokenizer

    assert r.json()["choices"][0]["text"] == Tokenizer(tiny_model_dir).decode(
        hf_greedy(tiny_model_dir, prompt, 16))
    assert received > 0  # the KV really crossed the UCX transport
