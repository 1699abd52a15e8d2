"""``tandem bench serve``: load any OpenAI-compatible server and measure what clients see.

This module owns the client-side serving benchmark. It builds a prompt set (``random``,
``shared-prefix`` or ``mixed`` lengths; every prompt re-encodes to exactly its token count),
sends streaming ``/v1/completions`` (or ``/v1/chat/completions``) requests at a Poisson
rate and/or a fixed concurrency, and reports throughput, latency statistics, failures by
HTTP status and goodput against SLOs. Metrics follow ``vllm bench serve``:

  TTFT  request sent -> first streamed chunk carrying text
  ITL   gaps between consecutive chunks carrying text
  TPOT  (E2EL - TTFT) / (output tokens - 1), per request
  E2EL  request sent -> end of the stream

Output tokens come from the final usage chunk (``stream_options.include_usage``) or, when
the server sends none, the number of text chunks. With ``--endpoint chat`` the prompt is one
user message, so the server's chat template adds tokens that the input counts leave out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

SLO_METRICS = ("ttft", "tpot", "e2el")
_FIT_ATTEMPTS = 50


# ---- command line ------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (inf: send all at once)")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    p.add_argument("--json", help="write the summary and per-request records here")
    p.set_defaults(func=run)


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The server, the prompt set and the request body: what every load shape shares
    (``tandem bench sweep`` reuses these and brings its own rates)."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="model id to request (default: the first of GET /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the default model's)")
    p.add_argument("--dataset", choices=["random", "shared-prefix", "mixed"], default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256, help="tokens per (short/unique) prompt")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: shared tokens")
    p.add_argument("--num-prefixes", type=int, default=1,
                   help="shared-prefix: distinct shared prefixes, cycled over the prompts")
    p.add_argument("--long-len", type=int, default=2000, help="mixed: tokens of a long prompt")
    p.add_argument("--long-fraction", type=float, default=0.1, help="mixed: share of long prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", type=json_object, default={},
                   help='JSON merged into every request body, e.g. \'{"ignore_eos": true}\'')
    p.add_argument("--slo", type=parse_slo, default={},
                   help="goodput SLOs in ms, e.g. ttft:500,tpot:50 (metrics: ttft, tpot, e2el)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as a bearer token (default: $OPENAI_API_KEY)")


def json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return value


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft:500,tpot:50"`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise argparse.ArgumentTypeError(f"bad SLO {item!r}: use NAME:MS with NAME in {SLO_METRICS}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad SLO {item!r}: {value!r} is not a number") from None
        if slos[name] <= 0:
            raise argparse.ArgumentTypeError(f"bad SLO {item!r}: the limit must be positive")
    return slos


# ---- prompts -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    num_tokens: int


class Codec:
    """Plain text <-> token ids without special tokens, and the ids safe to sample."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        banned = set(hf.all_special_ids) | set(getattr(hf, "added_tokens_decoder", {}))
        self.vocab = [i for i in range(len(hf)) if i not in banned]

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids))


def load_codec(directory: str | None) -> Codec:
    from pathlib import Path

    from common.model.loader import resolve_model
    from common.model.tokenizer import Tokenizer

    path = Path(directory) if directory else resolve_model(None).directory
    return Codec(Tokenizer(path).hf)


def fit_text(codec: Codec, rng: random.Random, length: int, head: str = "") -> str:
    """``head`` + random text such that the whole re-encodes to exactly len(head) + length
    tokens and still starts with head's own tokens."""
    head_ids = codec.encode(head) if head else []
    target = len(head_ids) + length
    tail = rng.choices(codec.vocab, k=length)
    for _ in range(_FIT_ATTEMPTS):
        text = head + codec.decode(tail)
        ids = codec.encode(text)
        if len(ids) == target and ids[: len(head_ids)] == head_ids:
            return text
        if ids[: len(head_ids)] != head_ids:  # the join merged tokens: start over
            tail = rng.choices(codec.vocab, k=length)
        else:  # re-tokenizing changed the length: trim or pad, then try again
            tail = ids[len(head_ids) : target]
            tail += rng.choices(codec.vocab, k=length - len(tail))
    raise ValueError(f"could not make a prompt that re-encodes to exactly {target} tokens")


def random_prompts(codec: Codec, num: int, input_len: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt(fit_text(codec, rng, input_len), input_len) for _ in range(num)]


def shared_prefix_prompts(codec: Codec, num: int, prefix_len: int, input_len: int,
                          seed: int, num_prefixes: int = 1) -> list[Prompt]:
    """``num_prefixes`` groups (e.g. system prompts), each shared by the prompts that
    cycle onto it; the groups are interleaved so that consecutive requests differ."""
    rng = random.Random(seed)
    prefixes = [fit_text(codec, rng, prefix_len) for _ in range(num_prefixes)]
    total = prefix_len + input_len
    return [Prompt(fit_text(codec, rng, input_len, head=prefixes[i % num_prefixes]), total)
            for i in range(num)]


def mixed_prompts(codec: Codec, num: int, input_len: int, long_len: int, long_fraction: float,
                  seed: int) -> list[Prompt]:
    """``round(num * long_fraction)`` prompts of long_len tokens at random places, the rest short."""
    rng = random.Random(seed)
    long_at = set(rng.sample(range(num), round(num * long_fraction)))
    lengths = [long_len if i in long_at else input_len for i in range(num)]
    return [Prompt(fit_text(codec, rng, n), n) for n in lengths]


def build_prompts(args: argparse.Namespace, codec: Codec) -> list[Prompt]:
    if args.dataset == "shared-prefix":
        return shared_prefix_prompts(codec, args.num_prompts, args.prefix_len, args.input_len,
                                     args.seed, args.num_prefixes)
    if args.dataset == "mixed":
        return mixed_prompts(codec, args.num_prompts, args.input_len, args.long_len,
                             args.long_fraction, args.seed)
    return random_prompts(codec, args.num_prompts, args.input_len, args.seed)


# ---- one request -------------------------------------------------------------------------

@dataclass(slots=True)
class Record:
    prompt_len: int
    success: bool = False
    status: int | None = None  # HTTP status; None when no response came
    error: str = ""
    ttft: float | None = None  # seconds, like every time here
    itl: list[float] = field(default_factory=list)
    e2el: float | None = None
    output_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if not self.success or self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def failure_key(self) -> str:
        return str(self.status) if self.status not in (None, 200) else self.error.split(":")[0]


class BrokenStream(Exception):
    pass


def request_body(args: argparse.Namespace, model: str, prompt: Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": args.output_len,
                            "temperature": args.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    return {**body, **args.extra_body}


def chunk_text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or [{}]
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], record: Record) -> None:
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
                return
            await _read_stream(response, record, start)
    except (httpx.HTTPError, BrokenStream, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return
    record.e2el = time.perf_counter() - start
    record.success = True


async def _read_stream(response: httpx.Response, record: Record, start: float) -> None:
    last, chunks, usage = start, 0, None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            raise BrokenStream(str(event["error"])[:200])
        usage = (event.get("usage") or {}).get("completion_tokens", usage)
        if chunk_text(event):
            now = time.perf_counter()
            if record.ttft is None:
                record.ttft = now - start
            else:
                record.itl.append(now - last)
            last, chunks = now, chunks + 1
    if record.ttft is None:
        raise BrokenStream("the stream carried no text")
    record.output_tokens = usage if usage is not None else chunks


# ---- the load ----------------------------------------------------------------------------

def arrival_gaps(num: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds to wait before each request: Poisson arrivals, or none at rate inf."""
    if math.isinf(rate):
        return [0.0] * num
    return [0.0] + [rng.expovariate(rate) for _ in range(num - 1)]


@dataclass(frozen=True, slots=True)
class LoadShape:
    """How requests arrive: Poisson at ``rate`` per second (inf: all at once), at most
    ``concurrency`` in flight (None: no cap)."""

    rate: float = math.inf
    concurrency: int | None = None

    @classmethod
    def of(cls, args: argparse.Namespace) -> LoadShape:
        return cls(args.request_rate, args.max_concurrency)


async def run_load(args: argparse.Namespace, url: str, model: str, prompts: Sequence[Prompt],
                   shape: LoadShape, on_done: Callable[[Record], None] | None = None,
                   ) -> tuple[list[Record], float]:
    """Send every prompt in ``shape``; ``on_done`` hears of each request as it ends
    (a progress bar). Returns the records in prompt order and the seconds it all took."""
    in_flight = shape.concurrency or len(prompts)
    gate = asyncio.Semaphore(in_flight)
    records = [Record(p.num_tokens) for p in prompts]
    gaps = arrival_gaps(len(prompts), shape.rate, random.Random(args.seed))
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits,
                                 headers=auth_headers(args.api_key)) as client:

        async def one(prompt: Prompt, record: Record) -> None:
            async with gate:
                await send(client, url, request_body(args, model, prompt), record)
            if on_done is not None:
                on_done(record)

        start = time.perf_counter()
        tasks = []
        for gap, prompt, record in zip(gaps, prompts, records, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt, record)))
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - start


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def first_model(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> str:
    try:
        response = httpx.get(base_url + "/v1/models", headers=auth_headers(api_key), timeout=timeout)
        response.raise_for_status()
        models = response.json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        raise ValueError(f"cannot list the models at {base_url}/v1/models: {e}") from e
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no models")
    return models[0]["id"]


# ---- statistics --------------------------------------------------------------------------

def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def stats_ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ms = [v * 1e3 for v in values]
    return {"mean": statistics.fmean(ms), "median": percentile(ms, 50),
            "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


def meets_slos(record: Record, slos: dict[str, float]) -> bool:
    if not record.success:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    return all(values[name] * 1e3 <= limit for name, limit in slos.items())


def summarize(records: Sequence[Record], duration: float, slos: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    failed = Counter(r.failure_key for r in records if not r.success)
    duration = max(duration, 1e-9)
    inputs, outputs = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "duration_s": duration, "completed": len(ok), "failed": sum(failed.values()),
        "failed_by_status": dict(failed), "total_input_tokens": inputs,
        "total_output_tokens": outputs, "request_throughput": len(ok) / duration,
        "output_throughput": outputs / duration, "total_token_throughput": (inputs + outputs) / duration,
        "ttft_ms": stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": stats_ms([gap for r in ok for gap in r.itl]),
        "e2el_ms": stats_ms([r.e2el for r in ok if r.e2el is not None]),
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in records)
        summary.update(slo_ms=slos, good_requests=good, goodput=good / duration)
    return summary


def format_summary(s: dict[str, Any]) -> str:
    lines = [" Serving Benchmark Result ".center(56, "="),
             f"{'Successful requests:':<40}{s['completed']}",
             f"{'Failed requests:':<40}{s['failed']}"]
    lines += [f"{'  ' + key + ':':<40}{n}" for key, n in sorted(s["failed_by_status"].items())]
    lines += [f"{'Benchmark duration (s):':<40}{s['duration_s']:.2f}",
              f"{'Total input tokens:':<40}{s['total_input_tokens']}",
              f"{'Total generated tokens:':<40}{s['total_output_tokens']}",
              f"{'Request throughput (req/s):':<40}{s['request_throughput']:.2f}",
              f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:.2f}",
              f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:.2f}"]
    if "goodput" in s:
        lines.append(f"{'Request goodput (req/s):':<40}{s['goodput']:.2f}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        lines.append(f" {name.upper()} (ms) ".center(56, "-"))
        for stat, value in s[f"{name}_ms"].items():
            shown = "n/a" if value is None else f"{value:.2f}"
            lines.append(f"{stat.capitalize() + ' ' + name.upper() + ':':<40}{shown}")
    return "\n".join(lines + ["=" * 56])


# ---- entry point -------------------------------------------------------------------------

def target(args: argparse.Namespace) -> tuple[str, str]:
    """The URL to post to and the model to name (asked of the server when not given)."""
    base = args.base_url.rstrip("/")
    model = args.model or first_model(base, args.api_key)
    return base + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"), model


def run(args: argparse.Namespace) -> int:
    url, model = target(args)
    print(f"building {args.num_prompts} {args.dataset} prompts ...", file=sys.stderr, flush=True)
    prompts = build_prompts(args, load_codec(args.tokenizer))
    print(f"sending them to {url} (model {model}) ...", file=sys.stderr, flush=True)
    records, duration = asyncio.run(run_load(args, url, model, prompts, LoadShape.of(args)))
    summary = summarize(records, duration, args.slo)
    print(format_summary(summary))
    if args.json:
        _write_json(args, model, summary, records)
    return 0 if summary["completed"] else 1


def _write_json(args: argparse.Namespace, model: str, summary: dict[str, Any],
                records: Sequence[Record]) -> None:
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
    config.update(model=model, request_rate=None if math.isinf(args.request_rate) else args.request_rate)
    rows = [{**asdict(r), "tpot": r.tpot} for r in records]
    with open(args.json, "w") as f:
        json.dump({"config": config, "summary": summary, "records": rows}, f, indent=1)
