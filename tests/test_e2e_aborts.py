"""Clients that go away, over real processes on loopback: one non-streaming client that
closes its socket mid-generation, then a seeded storm of concurrent requests of which a
fifth disconnect at random points (on arrival, mid-prefill or queued, mid-decode;
streaming and not). Afterwards no worker holds a block or runs a request, and the
router's queue is empty."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.cluster import Cluster, wait_for
from tests.conftest import write_tiny_model

LONG = 2000  # max_tokens no aborted request can reach before its abort lands
STORM_REQUESTS = 1000
STORM_ABORT_SHARE = 0.2
STORM_CONCURRENCY = 32
STORM_ABORT_TOKENS = 4000  # what an aborted storm request asks for (the model has 4096)
# A small prefill budget, so that the storm's requests do queue at the router.
PREFILL_TOKEN_BUDGET = 256


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm2_dir) -> Iterator[Cluster]:
    model = write_tiny_model(tmp_path_factory.mktemp("tiny-long"), smollm2_dir,
                             max_position_embeddings=4096)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TANDEM_PREFILL_TOKEN_BUDGET", str(PREFILL_TOKEN_BUDGET))
        with Cluster(str(model)) as c:
            yield c


def usage(cluster: Cluster) -> dict[str, tuple[float, float]]:
    return {w.name: (cluster.metric(w, "tandem:kv_cache_usage_perc"),
                     cluster.metric(w, "tandem:num_requests_running")) for w in cluster.workers()}


def assert_idle(cluster: Cluster, timeout: float = 30.0) -> None:
    """Every worker back to no block and no running request, and the router's queue
    empty (gauges refresh with heartbeats, hence the bounded wait)."""
    def idle() -> bool:
        return (all(u == (0.0, 0.0) for u in usage(cluster).values())
                and cluster.metric(cluster.router, "tandem:router_queue_length") == 0)

    wait_for(idle, "every worker and the router to be idle", timeout)


def generated(cluster: Cluster) -> float:
    return cluster.workers_total("tandem:generation_tokens_total")


def gateway_aborts(cluster: Cluster) -> float:
    [gateway] = [c for c in cluster.children if c.name == "gateway"]
    return cluster.metric(gateway, "tandem:request_success_total", finished_reason="abort")


def http_request(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


def test_non_streaming_client_that_leaves_is_aborted_at_once(cluster):
    """A steadily generating request never goes 0.5 s without a token: only a watch on
    the connection itself notices its client closing."""
    body = {"prompt": list(range(200, 300)), "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True}
    before, aborts = generated(cluster), gateway_aborts(cluster)
    with socket.create_connection(("127.0.0.1", cluster.port)) as sock:
        sock.sendall(http_request("/v1/completions", body))
        wait_for(lambda: generated(cluster) > before + 10, "generation to start", 60)
    # The socket is closed: read nothing, wait for nothing.
    assert_idle(cluster)
    assert gateway_aborts(cluster) == aborts + 1
    assert generated(cluster) - before < LONG  # the workers stopped far short of max_tokens


# ---- the storm -------------------------------------------------------------------------

LEAVE_AT = ("at_once", "mid_prefill", "mid_decode_stream", "mid_decode_body")


@dataclass(frozen=True, slots=True)
class Planned:
    index: int
    prompt: list[int]
    stream: bool
    leave_at: str | None  # None: the client stays for the whole answer
    max_tokens: int
    delay: float  # seconds before a mid_* client leaves
    chunks: int  # SSE events a mid_decode_stream client reads first


def storm_plan(seed: int = 8) -> list[Planned]:
    rng = random.Random(seed)
    plan = []
    for i in range(STORM_REQUESTS):
        leave = rng.choice(LEAVE_AT) if rng.random() < STORM_ABORT_SHARE else None
        stream = leave == "mid_decode_stream" or (leave is None and rng.random() < 0.5)
        start = rng.randrange(100, 40000)
        prompt = list(range(start, start + rng.randrange(8, 96)))
        plan.append(Planned(i, prompt, stream, leave,
                            STORM_ABORT_TOKENS if leave else rng.randrange(4, 12),
                            rng.uniform(0.0, 0.05), rng.randrange(1, 6)))
    return plan


def storm_body(p: Planned) -> dict:
    body = {"prompt": p.prompt, "max_tokens": p.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": p.stream}
    if p.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def stay(client: httpx.AsyncClient, p: Planned) -> int:
    """The whole answer; returns its completion_tokens (fails on anything but 200)."""
    if not p.stream:
        r = await client.post("/v1/completions", json=storm_body(p))
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]
    usage = None
    async with client.stream("POST", "/v1/completions", json=storm_body(p)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                usage = event.get("usage") or usage
    return usage["completion_tokens"]


async def leave(port: int, p: Planned) -> None:
    """Send the request over a raw connection and close it at the planned point."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(http_request("/v1/completions", storm_body(p)))
        await writer.drain()
        if p.leave_at == "mid_decode_stream":
            seen = 0
            while seen < p.chunks and (line := await reader.readline()):
                seen += line.startswith(b"data: ")
        elif p.leave_at != "at_once":
            await asyncio.sleep(p.delay)  # the random point of leaving, not a synchronisation
    finally:
        writer.close()


async def run_storm(cluster: Cluster, plan: list[Planned]) -> dict[int, int]:
    gate = asyncio.Semaphore(STORM_CONCURRENCY)
    # No idle connections kept: one the server closes after its keep-alive timeout just as
    # the pool hands it out again fails a POST with ReadError, a race of the client's pool
    # under a loaded machine that has nothing to do with aborts.
    limits = httpx.Limits(max_connections=STORM_CONCURRENCY, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=cluster.url, timeout=120, limits=limits) as client:
        async def one(p: Planned) -> tuple[int, int | None]:
            async with gate:
                if p.leave_at is None:
                    return p.index, await stay(client, p)
                await leave(cluster.port, p)
                return p.index, None

        results = await asyncio.gather(*(one(p) for p in plan))
    return {i: tokens for i, tokens in results if tokens is not None}


def test_abort_storm_leaves_nothing_behind(cluster):
    plan = storm_plan()
    leaving = [p for p in plan if p.leave_at]
    assert set(Counter(p.leave_at for p in leaving)) == set(LEAVE_AT)
    assert_idle(cluster)
    aborts = gateway_aborts(cluster)
    ran_out = cluster.workers_total("tandem:request_success_total", finished_reason="length")
    completed = asyncio.run(run_storm(cluster, plan))
    # Every client that stayed got its whole answer.
    assert completed == {p.index: p.max_tokens for p in plan if not p.leave_at}
    assert_idle(cluster)
    # No aborted request could have finished (each asked for STORM_ABORT_TOKENS), so the
    # gateway aborted every one of them, whether queued, prefilling or decoding ...
    assert gateway_aborts(cluster) - aborts == len(leaving)
    # ... and the workers stopped every one of them: the only requests that ran to their
    # length are the clients that stayed (an abort that failed to land would add one).
    finished = cluster.workers_total("tandem:request_success_total", finished_reason="length")
    assert finished - ran_out == len(completed)
