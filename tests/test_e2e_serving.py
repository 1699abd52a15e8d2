"""End to end over real processes on loopback: gateway, router, prefill and decode
workers (or colocated ones), driven over HTTP and through the official openai SDK."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.cluster import Cluster, TokenIds
from tests.conftest import hf_greedy, write_tiny_model

LONG = 2000  # max_tokens no aborted request can reach before its abort lands


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    """The tiny model with room for LONG generated tokens."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-long"), smollm2_dir,
                            max_position_embeddings=4096)


@pytest.fixture(scope="module")
def pd(model_dir):
    with Cluster(str(model_dir)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def colocated(model_dir):
    with Cluster(str(model_dir), colocated=1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def token_ids(model_dir) -> TokenIds:
    return TokenIds(model_dir)


@pytest.fixture(autouse=True)
def no_blocks_held_afterwards(request):
    """After every test, every worker of every cluster it used is back to zero blocks."""
    yield
    for name in ("pd", "colocated"):
        if name in request.fixturenames:
            assert_idle(request.getfixturevalue(name))


def complete(cluster: Cluster, **body) -> dict:
    r = httpx.post(f"{cluster.url}/v1/completions", json={"max_tokens": 16, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream_text(cluster: Cluster, path: str, body: dict) -> tuple[str, list[dict]]:
    chunks = []
    with httpx.stream("POST", f"{cluster.url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    key = "text" if path.endswith("/completions") and "chat" not in path else "content"
    parts = [c["choices"][0].get("text") if key == "text" else c["choices"][0]["delta"].get("content")
             for c in chunks if c["choices"]]
    return "".join(p or "" for p in parts), chunks


def assert_idle(cluster: Cluster, timeout: float = 30.0) -> None:
    """Aborts travel gateway -> router -> workers, and gauges refresh with heartbeats:
    wait (bounded) for every worker to report no running request and no held block."""
    def usage() -> dict[str, tuple[float, float]]:
        return {w.name: (cluster.metric(w, "tandem:kv_cache_usage_perc"),
                         cluster.metric(w, "tandem:num_requests_running")) for w in cluster.workers()}

    deadline = time.monotonic() + timeout
    while any(u != (0.0, 0.0) for u in usage().values()) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling an observable condition, not a guess at a duration
    assert usage() == {w.name: (0.0, 0.0) for w in cluster.workers()}


def generated_tokens(cluster: Cluster) -> float:
    """Tokens the workers generated so far, over all of them."""
    return cluster.workers_total("tandem:generation_tokens_total")


def gateway_aborts(cluster: Cluster) -> float:
    [gateway] = [c for c in cluster.children if c.name == "gateway"]
    return cluster.metric(gateway, "tandem:request_success_total", finished_reason="abort")


def test_greedy_pd_equals_colocated_equals_hf(pd, colocated, model_dir, token_ids):
    prompt = list(range(110, 150))  # its output has no token whose text several ids share
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    a, b = complete(pd, **body), complete(colocated, **body)
    expected = hf_greedy(model_dir, prompt, 24)
    assert token_ids.of(a["choices"][0]) == expected
    assert token_ids.of(b["choices"][0]) == expected
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"]["completion_tokens"] == 24


def test_streaming_equals_non_streaming(pd):
    body = {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    full = complete(pd, **body)["choices"][0]["text"]
    streamed, chunks = stream_text(pd, "/v1/completions", body)
    assert streamed == full
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0,
            "stream_options": {"include_usage": True}}
    text, chunks = stream_text(pd, "/v1/chat/completions", chat)
    r = httpx.post(f"{pd.url}/v1/chat/completions", json={**chat, "stream_options": None}, timeout=60)
    assert text == r.json()["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_seeded_sampling_same_through_pd_and_colocated(pd, colocated):
    body = {"prompt": "The weather today", "max_tokens": 20, "temperature": 1.0, "seed": 42,
            "n": 2, "ignore_eos": True}
    a, b = complete(pd, **body), complete(colocated, **body)
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert a["choices"][0]["text"] != a["choices"][1]["text"]


def test_openai_sdk_sync_and_async(pd):
    client = openai.OpenAI(base_url=f"{pd.url}/v1", api_key="unused")
    [model] = [m.id for m in client.models.list().data]
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=8, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens > 0
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0,
        stream=True) if c.choices]
    assert "".join(pieces) == out.choices[0].message.content

    import asyncio

    async def run() -> str:
        aclient = openai.AsyncOpenAI(base_url=f"{pd.url}/v1", api_key="unused")
        stream = await aclient.completions.create(model=model, prompt="Hello", max_tokens=8,
                                                  temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    sync_text = client.completions.create(model=model, prompt="Hello", max_tokens=8,
                                          temperature=0).choices[0].text
    assert asyncio.run(run()) == sync_text


def test_stop_string_is_applied_by_the_gateway(pd):
    body = {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    text = complete(pd, **body)["choices"][0]["text"]
    stop = text[6:10]
    before = generated_tokens(pd)
    cut = complete(pd, **{**body, "max_tokens": LONG}, stop=[stop])["choices"][0]
    assert cut["text"] == text[: text.index(stop)] and cut["finish_reason"] == "stop"
    assert_idle(pd)
    # The gateway aborted the request upstream: the workers stopped far short of LONG.
    assert generated_tokens(pd) - before < LONG


def test_client_disconnect_frees_every_block(pd):
    body = {"prompt": list(range(200, 300)), "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": True}
    before, aborts = generated_tokens(pd), gateway_aborts(pd)
    with httpx.stream("POST", f"{pd.url}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break  # leave mid-stream
    assert_idle(pd)
    assert gateway_aborts(pd) == aborts + 1
    assert generated_tokens(pd) - before < LONG  # the abort reached the workers


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body,status,param,words", [
    (CHAT, {"messages": []}, 400, "messages", "messages"),
    (CHAT, [1, 2], 400, None, "object"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.[0].role", "role"),
    (CHAT, {"messages": HI, "temperature": "hot"}, 400, "temperature", "number"),
    (CHAT, {"messages": HI, "n": 0}, 400, "n", "n"),
    (CHAT, {"messages": HI, "max_tokens": -5}, 400, "max_tokens", "max_tokens"),
    (CHAT, {"messages": HI, "top_logprobs": 3}, 400, "top_logprobs", "logprobs"),
    (CHAT, {"messages": HI, "stream": "yes"}, 400, "stream", "boolean"),
    (CHAT, {"messages": HI, "model": "gpt-9"}, 404, "model", "does not exist"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 5000}, 400, "prompt", "context length"),
    (COMPLETIONS, {"prompt": list(range(5000))}, 400, "prompt", "context length"),
    (COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt", "prompt"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 9}, 400, "logprobs", "logprobs"),
])
def test_bad_input_table_over_http(pd, path, body, status, param, words):
    r = httpx.post(f"{pd.url}{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"]


def test_bad_input_gets_openai_errors(pd):
    r = httpx.post(f"{pd.url}/v1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{pd.url}/v1/completions", content=b"{nope", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{pd.url}/v1/completions", json={"prompt": "x", "model": "gpt-9"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{pd.url}/v1/completions", json={"prompt": list(range(5000)), "max_tokens": 5},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
