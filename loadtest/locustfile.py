"""Locust load test of the gateway: streaming chat completions with TTFT and TPOT entries.

This file owns the locust user ``ChatUser``. Each task sends one streaming
``POST /v1/chat/completions`` with a prompt from a small built-in list and reports three
things to locust: the whole request (its normal entry, response time = end of the stream),
and, as request type ``SSE``, ``ttft`` (request sent -> first chunk carrying text) and
``tpot`` ((end - first text) / (output tokens - 1)). Non-200 answers, connection errors,
error events and streams that end without ``[DONE]`` or without text count as failures.

    locust -f loadtest/locustfile.py --headless -u 8 -r 2 -t 60s --host http://127.0.0.1:8000

Environment: ``TANDEM_LOCUST_MAX_TOKENS`` (max_tokens, default 64) and
``TANDEM_LOCUST_MODEL`` (default: the first id of ``GET /v1/models``).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass

import requests
from locust import HttpUser, between, task

PROMPTS = (
    "Explain what a KV cache is in two sentences.",
    "Write a haiku about a busy train station.",
    "List three uses of a paperclip other than holding paper.",
    "What is the difference between latency and throughput?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Give me a short recipe for tomato soup.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Translate 'good morning, how are you?' into French and Spanish.",
)


class BrokenStream(Exception):
    pass


@dataclass(frozen=True, slots=True)
class StreamResult:
    ttft_ms: float
    e2e_ms: float
    output_tokens: int
    text_length: int

    @property
    def tpot_ms(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)


def read_stream(lines: Iterable[bytes | str], start: float) -> StreamResult:
    """Consume an SSE chat stream; ``start`` is the perf_counter when the request was sent."""
    first: float | None = None
    chunks, chars, usage, done = 0, 0, None, False
    for raw in lines:
        line = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            raise BrokenStream(f"error event: {str(event['error'])[:200]}")
        usage = (event.get("usage") or {}).get("completion_tokens", usage)
        text = _delta_text(event)
        if text:
            first = time.perf_counter() if first is None else first
            chunks, chars = chunks + 1, chars + len(text)
    end = time.perf_counter()
    if not done or first is None:
        raise BrokenStream("stream ended without [DONE]" if not done else "stream carried no text")
    tokens = usage if usage is not None else chunks
    return StreamResult((first - start) * 1e3, (end - start) * 1e3, tokens, chars)


def _delta_text(event: dict) -> str:
    choices = event.get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


class ChatUser(HttpUser):
    wait_time = between(0.1, 1.0)
    max_tokens = int(os.environ.get("TANDEM_LOCUST_MAX_TOKENS", "64"))
    model: str | None = os.environ.get("TANDEM_LOCUST_MODEL") or None

    def on_start(self) -> None:
        if ChatUser.model is None:
            ChatUser.model = self._first_model()

    def _first_model(self) -> str | None:
        with self.client.get("/v1/models", catch_response=True) as resp:
            try:
                return resp.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError):
                resp.failure(f"no model list (HTTP {resp.status_code})")
                return None

    @task
    def chat(self) -> None:
        body = {"model": self.model or "default", "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
                "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        with self.client.post("/v1/chat/completions", json=body, stream=True,
                              catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {_error_text(resp)}")
                return
            try:
                result = read_stream(resp.iter_lines(), start)
            except (requests.RequestException, ValueError, BrokenStream) as e:
                resp.failure(f"broken stream: {type(e).__name__}: {e}")
                return
            resp.request_meta["response_time"] = result.e2e_ms
            resp.request_meta["response_length"] = result.text_length
            resp.success()
        self._report("ttft", result.ttft_ms, result.output_tokens)
        if result.tpot_ms is not None:
            self._report("tpot", result.tpot_ms, result.output_tokens)

    def _report(self, name: str, ms: float, tokens: int) -> None:
        self.environment.events.request.fire(
            request_type="SSE", name=name, response_time=ms, response_length=tokens,
            exception=None, context={})


def _error_text(resp: requests.Response) -> str:
    if getattr(resp, "error", None) is not None:  # the request never got an answer
        return str(resp.error)[:200]
    try:
        return resp.text[:200]
    except requests.RequestException as e:
        return str(e)[:200]
