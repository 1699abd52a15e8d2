"""Routing and faults over real processes: prefix affinity with 2 prefill + 2 decode
workers, a worker killed mid-request, a cluster with no workers, the API key."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from common.addresses import free_ports
from tests.cluster import Cluster, TokenIds, wait_for
from tests.extras import require_module

PREFIX = list(range(1000, 1256))  # 16 full blocks


def shared_prefix_requests(cluster: Cluster) -> None:
    for tail in ([7, 8, 9], [17, 18], [27, 28, 29, 30]):
        complete(cluster, PREFIX + tail)


def complete(cluster: Cluster, prompt: list[int]) -> None:
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text


def per_worker(cluster: Cluster, metric: str) -> dict[str, float]:
    return {w.name: cluster.metric(w, metric) for w in cluster.workers("prefill")}


def placements(cluster: Cluster) -> dict[str, float]:
    """Requests the router placed on each prefill worker (its own count, not the worker's)."""
    return {w.name: cluster.metric(cluster.router, "tandem:router_placements_total", worker=w.name)
            for w in cluster.workers("prefill")}


def test_shared_prefix_follows_the_cache_to_the_second_worker(tiny_model_dir, monkeypatch):
    """Idle workers tie, and a tie goes to the first registered one; so the prefix is
    warmed on the *other* worker, and the later requests must follow it there."""
    # The worker frozen below must stay registered: a heartbeat timeout far beyond the test.
    monkeypatch.setenv("TANDEM_HEARTBEAT_TIMEOUT", "600")
    with Cluster(str(tiny_model_dir), prefill=2, decode=2, policy="prefix") as cluster:
        complete(cluster, list(range(3000, 3020)))  # unrelated: shows which worker wins ties
        [first] = [w for w in cluster.workers("prefill") if placements(cluster)[w.name] == 1]
        [second] = [w for w in cluster.workers("prefill") if w is not first]
        first.proc.send_signal(signal.SIGSTOP)  # whatever is placed there now stays outstanding
        try:
            busy = threading.Thread(target=complete, args=(cluster, list(range(4000, 4020))))
            busy.start()
            wait_for(lambda: placements(cluster)[first.name] == 2, "the second unrelated placement")
            complete(cluster, PREFIX + [1, 2])  # the first worker is loaded: lands on the second
            assert placements(cluster) == {first.name: 2, second.name: 1}
        finally:
            first.proc.send_signal(signal.SIGCONT)
        busy.join(120)
        shared_prefix_requests(cluster)
        assert placements(cluster) == {first.name: 2, second.name: 4}  # all three followed it
        hits = per_worker(cluster, "tandem:prefix_cache_hits_total")
    assert hits == {first.name: 0, second.name: 3 * len(PREFIX)}


def test_round_robin_spreads_a_shared_prefix_regardless_of_the_cache(tiny_model_dir):
    with Cluster(str(tiny_model_dir), prefill=2, decode=2, policy="round_robin") as cluster:
        shared_prefix_requests(cluster)
        queries = per_worker(cluster, "tandem:prefix_cache_queries_total")
        hits = per_worker(cluster, "tandem:prefix_cache_hits_total")
    assert all(q > 0 for q in queries.values())  # spread regardless of what is cached
    assert sum(hits.values()) < 2 * len(PREFIX)


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    # A short admission wait: the killed decode worker's request, moved, waits that long.
    extra = ("--num-kv-blocks", "512", "--api-key", "sekret", "--queue-timeout", "3",
             "--admission-timeout", "4")
    with Cluster(str(tiny_model_dir), extra=extra) as c:
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
    # The router notices the dead worker (heartbeat timeout) and stops counting it...
    wait_for(lambda: guarded.health(guarded.router)["decode_workers"] == 0, "the router to drop it")
    wait_for(lambda: guarded.metric(guarded.router, "tandem:router_workers", role="decode") == 0,
             "the router's decode-worker gauge to fall")
    # ...and the prefill worker holds nothing for the failed request.
    [prefill] = guarded.workers("prefill")
    wait_for(lambda: (guarded.metric(prefill, "tandem:kv_cache_usage_perc"),
                      guarded.metric(prefill, "tandem:num_requests_running")) == (0.0, 0.0),
             "the prefill worker to be idle")
    assert guarded.health(guarded.router)["prefill_workers"] == 1


def test_no_workers_means_503_with_retry_after(tiny_model_dir):
    router_port, gw_port = free_ports(2)
    py = [sys.executable, "-m", "cli"]
    procs = [subprocess.Popen(py + ["router", "--port", str(router_port), "--metrics-port", "0",
                                    "--startup-grace", "0"]),
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
    require_module("ucxx")
    from tests.conftest import hf_greedy

    prompt = list(range(400, 437))
    with Cluster(str(tiny_model_dir), kv_transport="ucx") as cluster:
        r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 0})
        [decode] = cluster.workers("decode")
        received = cluster.metric(decode, "tandem:kv_transfer_bytes_total")
    assert TokenIds(tiny_model_dir).of(r.json()["choices"][0]) == hf_greedy(tiny_model_dir, prompt, 16)
    assert received > 0  # the KV really crossed the UCX transport
