"""Hostile input against a real cluster: schemathesis explores the gateway's published
OpenAPI request schemas (the generation routes, /v1/responses, /tokenize, /detokenize) (no 5xx, answers as documented, the connection and the server
stay up), and random and malformed msgpack frames go to the gateway's token socket (each
dropped, and the gateway keeps serving)."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator

import httpx
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings

from common.protocol import Tokens, encode
from tests.cluster import Cluster
from tests.extras import require_module

# Kept small so each example is quick: the published schema allows any max_tokens and n
# the context holds; this test narrows its copy of the schema, not the server.
TEST_MAX_TOKENS = 4
TEST_MAX_N = 4
EXAMPLES = 50


@pytest.fixture(scope="module")
def cluster(tiny_model_dir) -> Iterator[Cluster]:
    with Cluster(str(tiny_model_dir)) as c:
        yield c


@pytest.fixture(scope="module")
def gateway(cluster):
    [gateway] = [c for c in cluster.children if c.name == "gateway"]
    return gateway


def small(schema: dict) -> dict:
    """A copy of the gateway's schema whose requests ask for little work each."""
    doc = copy.deepcopy(schema)
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        fields = body["properties"]
        for name in ("max_tokens", "max_completion_tokens"):
            if name in fields:
                fields[name] = {"type": "integer", "minimum": 1, "maximum": TEST_MAX_TOKENS}
        fields["n"] = {"type": "integer", "minimum": 1, "maximum": TEST_MAX_N}
        fields.pop("best_of", None)  # only equal to n: nothing more to explore
        body["required"] = [*body["required"], "max_tokens"]
    responses = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]
    body = responses["application/json"]["schema"]
    body["properties"]["max_output_tokens"] = {"type": "integer", "minimum": 1,
                                               "maximum": TEST_MAX_TOKENS}
    body["required"] = [*body["required"], "max_output_tokens"]
    return doc


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses",
                                  "/tokenize", "/detokenize"])
def test_schemathesis_finds_no_server_error_and_no_undocumented_answer(cluster, path):
    schemathesis = require_module("schemathesis")
    import requests  # schemathesis calls through a requests session
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    published = httpx.get(f"{cluster.url}/openapi.json", timeout=10).json()
    assert published["paths"][path]["post"]["requestBody"]["required"] is True
    operation = schemathesis.openapi.from_dict(small(published))[path]["POST"]
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance, response_headers_conformance]
    session = requests.Session()  # one connection for every example: none may be dropped
    statuses: set[int] = set()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def explore(case) -> None:
        response = case.call(base_url=cluster.url, session=session, timeout=60)
        statuses.add(response.status_code)
        case.validate_response(response, checks=checks)

    explore()
    assert 200 in statuses  # it did reach the workers, not only the parser
    assert httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200


# ---- the token socket --------------------------------------------------------------------

def hostile_frames(seed: int = 8) -> list[bytes]:
    """Random bytes, truncated and bit-flipped real messages, and well-formed msgpack
    that is not a message: unknown tags and versions, wrong field types and counts."""
    rng = random.Random(seed)
    real = encode(Tokens("cmpl-nobody", 0, 0, [1, 2, 3], num_prompt_tokens=3))
    frames = [b"", b"\xc1", b"\xdd\xff\xff\xff\xff", b"\x91" * 2000]  # bad byte, huge array
    frames += [rng.randbytes(rng.randrange(1, 400)) for _ in range(200)]
    frames += [real[:cut] for cut in range(1, len(real))]
    for _ in range(200):
        flipped = bytearray(real)
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        frames.append(bytes(flipped))
    tag, version, fields = msgpack.unpackb(real)
    odd_values = [None, -1, 2**64 - 1, -(2**63), "x" * 10, [], {}, [[[]]], 1.5, True, b"\x00"]
    frames += [msgpack.packb([tag, 99, fields]), msgpack.packb(["no-such-tag", version, fields]),
               msgpack.packb([tag, version]), msgpack.packb([tag, version, fields[:3]]),
               msgpack.packb({"tag": tag}), msgpack.packb(odd_values)]
    for i in range(len(fields)):
        for value in odd_values:
            frames.append(msgpack.packb([tag, version, fields[:i] + [value] + fields[i + 1:]]))
    return frames


def test_garbage_on_the_token_socket_is_dropped_and_the_gateway_keeps_serving(cluster, gateway):
    tokens_at = cluster.health(gateway)["tokens_at"]
    body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(tokens_at)
    try:
        with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it is under way
            for frame in hostile_frames():  # while it streams through the same socket
                push.send(frame)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
        assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 40
        # The same socket still carries every token of the next request.
        plain = {k: v for k, v in body.items() if k != "stream_options"}
        after = httpx.post(f"{cluster.url}/v1/completions", json={**plain, "stream": False},
                           timeout=60)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 40
    finally:
        push.close(linger=0)
        ctx.term()
    assert gateway.proc.poll() is None
    assert cluster.health(gateway)["status"] == "ok"
    assert any("dropping a bad message" in line for line in gateway.tail)
