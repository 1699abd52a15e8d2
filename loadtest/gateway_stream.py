"""``tandem bench gateway``: the gateway's CPU per streamed token, the gateway alone.

A real ``tandem gateway`` process streams completions from a fake router in this process,
which admits each request and pushes its tokens one ``Tokens`` message each, back to back
(``--pace-ms 0``: the gateway's work per token) or one every ``--pace-ms`` milliseconds
(as a decode worker sends them at batch 1: the work plus a sleep and a wakeup per token).
The gateway's user + system CPU seconds over each stream, from ``/proc``, divided by the
tokens, are the figures; the client's own CPU is not in them.

    tandem bench gateway --tokens 1000 --pace-ms 0 7 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import zmq

from common.addresses import free_ports
from common.outputs import FinishReason
from common.protocol import Admitted, Ping, Status, Submit, Tokens, decode, encode
from loadtest.children import stop, wait_answering
from loadtest.router_metrics import cpu_seconds

ROOT = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 1 << 20  # what the fake router reports: no limit on the streams
VOCAB_SPREAD = 20_000  # token ids pushed cycle through this many (real detokenization)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=1000, help="tokens per stream")
    p.add_argument("--pace-ms", type=float, nargs="+", default=[0.0, 7.0],
                   help="milliseconds between two tokens of a stream (0: back to back)")
    p.add_argument("--rounds", type=int, default=2, help="streams per pace")
    p.add_argument("--model", help="the gateway's --model (default: the default model)")
    p.add_argument("--json", help="also write the results here")
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class Stream:
    pace_ms: float
    tokens: int
    chunks: int  # SSE data chunks the client read ([DONE] aside)
    cpu_ms_per_token: float  # the gateway's
    wall_ms_per_token: float


class FakeRouter:
    """Answers pings and admits every ``Submit``, then pushes its tokens from a thread."""

    def __init__(self, tokens: int) -> None:
        self.tokens, self.pace_s = tokens, 0.0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            identity, data = self._sock.recv_multipart()
            msg = decode(data)
            if isinstance(msg, Ping):
                self._sock.send_multipart([identity, encode(Status(
                    msg.nonce, 1, 1, 0, MAX_MODEL_LEN, 60.0, 16))])
            elif isinstance(msg, Submit):
                self._sock.send_multipart([identity, encode(Admitted(msg.request_id))])
                threading.Thread(target=self._push, args=(msg, self.pace_s), daemon=True).start()

    def _push(self, submit: Submit, pace_s: float) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.connect(submit.reply_to)
        for i in range(self.tokens):
            if pace_s:
                time.sleep(pace_s)
            last = i == self.tokens - 1
            push.send(encode(Tokens(submit.request_id, 0, i, [100 + i * 7919 % VOCAB_SPREAD],
                                    finish_reason=FinishReason.LENGTH if last else None,
                                    num_prompt_tokens=submit.num_prompt_tokens)))
        push.close(linger=1000)


def bench(tokens: int, paces_ms: list[float], rounds: int, model: str | None = None,
          say=lambda m: None) -> list[Stream]:
    router = FakeRouter(tokens)
    (port,) = free_ports(1)
    gateway = subprocess.Popen(
        [sys.executable, "-m", "cli", "--log-level", "warning", "gateway", "--router",
         f"tcp://127.0.0.1:{router.port}", "--port", str(port), *(["--model", model] if model else [])],
        cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        model_name = wait_answering(gateway, lambda: _served_model(url), "gateway", 120)
        streams = []
        for pace in paces_ms:
            router.pace_s = pace / 1e3
            for _ in range(rounds):
                streams.append(_stream(url, model_name, tokens, pace, gateway.pid))
                say(row(streams[-1]))
        return streams
    finally:
        stop(gateway, grace=30)


def _served_model(url: str) -> str | None:
    """The model the gateway serves, once it answers (None before)."""
    try:
        models = httpx.get(f"{url}/v1/models", timeout=2)
    except httpx.TransportError:
        return None
    return models.json()["data"][0]["id"] if models.status_code == 200 else None


def _stream(url: str, model: str, tokens: int, pace_ms: float, pid: int) -> Stream:
    body = {"model": model, "prompt": "hi", "max_tokens": tokens, "stream": True}
    cpu, wall, chunks = cpu_seconds([pid]), time.perf_counter(), 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
    cpu, wall = cpu_seconds([pid]) - cpu, time.perf_counter() - wall
    return Stream(pace_ms, tokens, chunks, cpu * 1e3 / tokens, wall * 1e3 / tokens)


def row(s: Stream) -> str:
    return (f"| {s.pace_ms:g} | {s.tokens:,} | {s.chunks:,} | {s.cpu_ms_per_token:.3f} | "
            f"{s.wall_ms_per_token:.3f} |")


def run(args: argparse.Namespace) -> int:
    if args.tokens < 1 or args.rounds < 1 or min(args.pace_ms) < 0:
        raise ValueError("--tokens and --rounds must be >= 1, --pace-ms >= 0")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    print("| pace ms | tokens | chunks | gateway CPU ms/token | wall ms/token |\n|---|---|---|---|---|",
          flush=True)
    streams = bench(args.tokens, args.pace_ms, args.rounds, args.model,
                    say=lambda m: print(m, flush=True))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(s) for s in streams], indent=1))
    return 0
