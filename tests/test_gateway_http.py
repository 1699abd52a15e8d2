"""The gateway over real HTTP: hostile bodies, unknown routes, API keys, an absent router.

Each gateway here is the real FastAPI app served by uvicorn on a free port in this
process; its router address is a port nobody listens on, which is all these checks need
(they are answered before a request would reach a worker).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from common.addresses import free_port
from services.gateway.app import GatewaySettings, create_app

ERROR_KEYS = {"message", "type", "param", "code"}
GOOD_COMPLETION = {"prompt": "hi", "max_tokens": 2}
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class ServedGateway:
    """``create_app(settings)`` under uvicorn on a free port, until the ``with`` ends."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.app = create_app(settings)
        self.port = free_port()
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServedGateway:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "gateway never started"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def nobody_listens() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def gateway(tiny_model_dir) -> Iterator[ServedGateway]:
    with ServedGateway(GatewaySettings(router=nobody_listens(), model=str(tiny_model_dir))) as gw:
        yield gw


@pytest.fixture(scope="module")
def guarded(tiny_model_dir) -> Iterator[ServedGateway]:
    settings = GatewaySettings(router=nobody_listens(), model=str(tiny_model_dir),
                               api_key="sekret")
    with ServedGateway(settings) as gw:
        yield gw


def local_port(r: httpx.Response) -> int:
    """The client-side port of the connection a response came on."""
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


HOSTILE = {
    "deeply nested array": b"[" * 100_000,
    "deeply nested object": b'{"a":' * 50_000,
    "nested below the parser's limit": b'{"prompt": "hi", "temperature": ' + b"[" * 900
                                       + b"]" * 900 + b"}",
    "not UTF-8": b'{"prompt": "\xff\xfe"}',
    "a lone continuation byte": b"\x80",
    "an integer too long to convert": b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    "an integer too large for a float": b'{"prompt": "hi", "temperature": ' + b"9" * 400 + b"}",
    "empty": b"",
    "truncated": b'{"prompt": "hi"',
    "not an object": b"[1, 2, 3]",
}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_body_is_a_400_and_the_connection_serves_the_next_request(gateway, route, name):
    with httpx.Client(base_url=gateway.url, timeout=30,
                      limits=httpx.Limits(max_connections=1)) as client:
        r = client.post(route, content=HOSTILE[name], headers={"Content-Type": "application/json"})
        error = assert_openai_error(r, 400)
        assert error["type"] == "invalid_request_error"
        after = client.get("/v1/models")
        assert after.status_code == 200 and after.json()["object"] == "list"
        assert local_port(after) == local_port(r), "the server dropped the keep-alive connection"


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/nope", 404),
    ("POST", "/v1/nope", 404),
    ("GET", "/v1/chat/completions", 405),
    ("PUT", "/v1/completions", 405),
    ("POST", "/v1/models", 405),
    ("DELETE", "/health", 405),
])
def test_unknown_routes_and_methods_get_openai_errors(gateway, method, path, status):
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        r = client.request(method, path)
        error = assert_openai_error(r, status)
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        if status == 405:
            assert r.headers["allow"]  # which methods the route does take
        assert local_port(client.get("/v1/models")) == local_port(r)


def app_routes(served: ServedGateway) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, docs included: a new route is covered too."""
    return [(method, route.path) for route in served.app.routes
            for method in sorted((getattr(route, "methods", None) or {"GET"}) - {"HEAD"})]


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Bearer sekretx", "Bearer sekre",
                                  "sekret", "bearer sekret", b"Bearer \xffsekret"])
def test_a_wrong_api_key_is_a_401_on_every_route_but_health(guarded, auth):
    headers = {} if auth is None else {"Authorization": auth}
    routes = app_routes(guarded)
    assert ("GET", "/metrics") in routes and ("POST", "/v1/chat/completions") in routes
    ports = set()
    with httpx.Client(base_url=guarded.url, timeout=30, headers=headers,
                      limits=httpx.Limits(max_connections=1)) as client:
        for method, path in routes:
            kwargs = {"json": GOOD_COMPLETION} if method == "POST" else {}
            r = client.request(method, path, **kwargs)
            ports.add(local_port(r))
            if path in ("/health", "/ready"):
                assert r.status_code == 503  # no router: unhealthy, but not a key question
            elif path == "/dashboard":
                assert r.status_code == 200  # the page holds no data; its polls need the key
            else:
                assert assert_openai_error(r, 401)["code"] == "invalid_api_key", (method, path)
    assert len(ports) == 1  # a refused request (its body unread) keeps the connection


def test_the_right_api_key_opens_every_route(guarded):
    with httpx.Client(base_url=guarded.url, timeout=30,
                      headers={"Authorization": "Bearer sekret"}) as client:
        assert client.get("/v1/models").status_code == 200
        assert client.get("/metrics").status_code == 200
        r = client.post("/v1/completions", json=GOOD_COMPLETION)
        assert_openai_error(r, 503)  # past the key check, and no router to serve it


@pytest.mark.parametrize("route,body", [("/v1/completions", GOOD_COMPLETION),
                                        ("/v1/chat/completions", GOOD_CHAT),
                                        ("/v1/completions", {**GOOD_COMPLETION, "stream": True})])
def test_an_unreachable_router_is_a_503_with_retry_after(gateway, route, body):
    # The client's timeout is far below the gateway's admission timeout (120 s): an answer
    # at all means the gateway did not wait for a router that is not there.
    with httpx.Client(base_url=gateway.url, timeout=20) as client:
        r = client.post(route, json=body)
        error = assert_openai_error(r, 503)
        assert error["type"] == "service_unavailable_error" and "router" in error["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert local_port(client.get("/v1/models")) == local_port(r)


def test_health_without_a_router_is_503(gateway):
    r = httpx.get(f"{gateway.url}/health", timeout=20)
    assert r.status_code == 503 and r.json()["router"] is False


def test_a_full_queue_is_a_429_with_retry_after_over_http(tiny_model_dir):
    """A real router (its own process) with no room to queue, a prefill worker registered
    (this test plays it) and no decode worker: nothing can be placed, so the gateway must
    answer 429 with Retry-After at once, and the next request on the connection too."""
    import subprocess
    import sys

    import zmq

    from common.protocol import Ping, Register, Status, decode, encode
    from common.roles import WorkerRole

    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "cli", "router", "--port", str(port),
                               "--metrics-port", "0", "--max-queue", "0"])
    ctx = zmq.Context()
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.IDENTITY, b"p1")
    worker.setsockopt(zmq.LINGER, 0)
    worker.connect(f"tcp://127.0.0.1:{port}")
    try:
        worker.send(encode(Register("p1", WorkerRole.PREFILL, None, "http://p1/metrics", 64, 16,
                                    1024, "tiny", 0.25)))
        deadline = time.monotonic() + 60
        while True:  # the router is up and has handled the registration
            worker.send(encode(Ping(1)))
            if worker.poll(500):
                status = decode(worker.recv())
                if isinstance(status, Status) and status.prefill_workers == 1:
                    break
            assert time.monotonic() < deadline and router.poll() is None, "router never answered"
        settings = GatewaySettings(router=f"tcp://127.0.0.1:{port}", model=str(tiny_model_dir))
        with ServedGateway(settings) as gw, httpx.Client(timeout=30) as client:
            first = client.post(f"{gw.url}/v1/completions", json=GOOD_COMPLETION)
            second = client.post(f"{gw.url}/v1/chat/completions", json=GOOD_CHAT)
            assert local_port(first) == local_port(second)  # the connection survived
        for r in (first, second):
            error = assert_openai_error(r, 429)
            assert "busy" in error["message"] and error["code"] == "rate_limit_exceeded"
            assert int(r.headers["retry-after"]) >= 1
    finally:
        worker.close()
        ctx.term()
        router.terminate()
        router.wait(20)


def test_an_oversized_body_is_refused_with_413_before_it_is_held(gateway):
    from services.gateway.guards import MAX_BODY_BYTES

    big = b'{"prompt": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}'
    declared = httpx.post(f"{gateway.url}/v1/completions", content=big, timeout=60)
    assert_openai_error(declared, 413)

    def chunks():  # no Content-Length: the limit must hold while the body streams in
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b"x" * 65536

    streamed = httpx.post(f"{gateway.url}/v1/completions", content=chunks(), timeout=60)
    assert_openai_error(streamed, 413)
    assert httpx.get(f"{gateway.url}/health", timeout=30).status_code in (200, 503)  # alive
