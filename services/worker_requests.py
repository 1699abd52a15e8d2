"""What a worker keeps per request besides the engine's state: where its tokens go, and
the timestamps behind the latency metrics.

``GatewayPushers`` owns one PUSH socket per gateway (connected on first use);
``RequestClock`` records when a request arrived and produced tokens, and feeds the
metrics when it finishes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq

from common.engine.engine import SeqUpdate
from common.metrics import RequestMetrics
from common.protocol import Message, encode


class GatewayPushers:
    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._sockets: dict[str, zmq.Socket] = {}

    def send(self, addr: str, msg: Message) -> None:
        sock = self._sockets.get(addr)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # tokens are small; never drop one
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(addr)
            self._sockets[addr] = sock
        sock.send(encode(msg))

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()


@dataclass(slots=True)
class RequestMeta:
    request_id: str
    reply_to: str
    num_prompt_tokens: int
    handoff_addr: str | None  # prefill side: the decode worker's KV receiver
    arrival: float
    num_cached_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None


class RequestClock:
    def __init__(self) -> None:
        self._meta: dict[str, RequestMeta] = {}

    def start(self, request_id: str, reply_to: str, num_prompt: int,
              handoff_addr: str | None = None, cached: int = 0,
              first_token_seen: bool = False) -> RequestMeta:
        now = time.monotonic()
        meta = RequestMeta(request_id, reply_to, num_prompt, handoff_addr, now, cached,
                           first_token=now if first_token_seen else None)
        self._meta[request_id] = meta
        return meta

    def __len__(self) -> int:
        """Requests this worker holds (from their task or KV until they end here)."""
        return len(self._meta)

    def requests(self) -> list[RequestMeta]:
        return list(self._meta.values())

    def get(self, request_id: str) -> RequestMeta | None:
        return self._meta.get(request_id)

    def forget(self, request_id: str) -> None:
        self._meta.pop(request_id, None)

    def observe_token(self, meta: RequestMeta, u: SeqUpdate, now: float, m: RequestMetrics) -> None:
        m.generation_tokens.inc(len(u.token_ids))
        if meta.first_token is None:
            meta.first_token = now
            m.ttft.observe(now - meta.arrival)
            m.prompt_tokens.inc(meta.num_prompt_tokens)
        elif meta.last_token is not None and u.choice == 0:
            m.itl.observe(now - meta.last_token)
        if u.choice == 0:
            meta.last_token = now

    def finish(self, meta: RequestMeta, now: float, reason: str, m: RequestMetrics) -> None:
        m.e2e.observe(now - meta.arrival)
        m.success.labels(reason).inc()
        self.forget(meta.request_id)

