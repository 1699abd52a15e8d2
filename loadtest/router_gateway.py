"""The simulated gateway of ``tandem bench router``: ``gateways`` DEALERs sending
``Submit`` at Poisson arrivals of a given rate, noting when each was sent, and counting
the router's acknowledgements. It takes commands from the parent over a
``multiprocessing`` pipe, one phase at a time."""

from __future__ import annotations

import dataclasses
import random
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgpack
import zmq

from common.protocol import Submit, encode
from common.sampling_params import SamplingParams
from loadtest.router_workload import Workload, prompts

PROMPT_POOL = 2048


class SubmitEncoder:
    """``encode(Submit.of(...))`` for a prompt packed (and hashed) once, as a real gateway
    would hash it: the request id, which leads the fields, is the only new part."""

    def __init__(self, params: SamplingParams, reply_to: str, block_size: int) -> None:
        self._params, self._reply_to, self._block_size = params, reply_to, block_size
        self._head = b"\x93" + msgpack.packb(Submit.TAG) + msgpack.packb(Submit.VERSION)
        self._head += bytes([0x90 + len(dataclasses.fields(Submit))])
        if not encode(self._submit("", [1])).startswith(self._head + b"\xa0"):
            raise ValueError("the codec no longer writes a Submit as this encoder assumes")

    def _submit(self, request_id: str, tokens: list[int]) -> Submit:
        return Submit.of(request_id, tokens, self._params, self._reply_to, self._block_size)

    def packed_prompt(self, tokens: list[int]) -> bytes:
        """Everything after the request id (an empty id packs to one byte)."""
        return encode(self._submit("", tokens))[len(self._head) + 1:]

    def encode(self, request_id: str, packed_prompt: bytes) -> bytes:
        return self._head + msgpack.packb(request_id) + packed_prompt


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    workload: Workload
    router: str
    gateways: int = 4
    seed: int = 2


def gateway_main(s: GatewaySettings, pipe: Connection) -> None:
    ctx = zmq.Context()
    socks = []
    for i in range(s.gateways):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt_string(zmq.IDENTITY, f"sim-gateway-{i}")
        sock.connect(s.router)
        socks.append(sock)
    encoder = SubmitEncoder(SamplingParams(max_tokens=16), "tcp://127.0.0.1:1", s.workload.block_size)
    pool = [encoder.packed_prompt(p) for p in prompts(s.workload, PROMPT_POOL, s.seed)]
    pipe.send("ready")
    while True:
        cmd = pipe.recv()
        if cmd[0] != "run":
            return
        _, phase, rate, duration = cmd
        pipe.send(_offer(socks, encoder, pool, phase, rate, duration))


def _offer(socks: list[zmq.Socket], encoder: SubmitEncoder, pool: list[bytes], phase: str,
           rate: float, duration: float) -> tuple[list[float], dict[str, int]]:
    """Send Poisson arrivals at ``rate`` for ``duration`` seconds, then wait (up to 10 s)
    for every Submit's final acknowledgement; returns the send times and the ack counts."""
    rng = random.Random(zlib.crc32(phase.encode()))
    sent: list[float] = []
    acks: Counter[str] = Counter()
    pending = 0
    start = time.monotonic()
    due = start
    while due < start + duration:
        now = time.monotonic()
        while due <= now and due < start + duration:
            i = len(sent)
            socks[i % len(socks)].send(encoder.encode(f"{phase}-{i}", pool[i % len(pool)]))
            sent.append(time.monotonic())
            pending += 1
            due += rng.expovariate(rate)
        pending -= _drain(socks, acks)
        gap = due - time.monotonic()
        if gap > 0.0002:
            time.sleep(min(gap, 0.005) - 0.0001)
    deadline = time.monotonic() + 10.0
    while pending > 0 and time.monotonic() < deadline:
        pending -= _drain(socks, acks)
        time.sleep(0.001)
    return sent, dict(acks)


def _drain(socks: list[zmq.Socket], acks: Counter[str]) -> int:
    """Count the acknowledgements waiting; returns how many were final (not ``queued``)."""
    final = 0
    for sock in socks:
        while True:
            try:
                tag = msgpack.unpackb(sock.recv(zmq.NOBLOCK), raw=False)[0]
            except zmq.Again:
                break
            acks[tag] += 1
            final += tag != "queued"
    return final
