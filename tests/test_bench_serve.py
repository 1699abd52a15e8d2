"""Unit tests of ``tandem bench serve``'s pure parts (loadtest/serve.py), with no network.

Datasets use the default model's real tokenizer (exact lengths are a property of
re-encoding); the stream reader runs on httpx's in-process MockTransport.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from pathlib import Path

import httpx
import pytest

from loadtest import serve
from loadtest.serve import Record


@pytest.fixture(scope="module")
def codec(smollm2_dir: Path) -> serve.Codec:
    return serve.load_codec(str(smollm2_dir))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


# ---- datasets ----------------------------------------------------------------------------

def test_random_prompts_re_encode_to_exact_length(codec: serve.Codec) -> None:
    prompts = serve.random_prompts(codec, 12, 100, seed=3)
    assert [len(codec.encode(p.text)) for p in prompts] == [100] * 12
    assert all(p.num_tokens == 100 for p in prompts)
    assert len({p.text for p in prompts}) == 12
    assert serve.random_prompts(codec, 12, 100, seed=3) == prompts


def test_random_prompts_avoid_special_tokens(codec: serve.Codec) -> None:
    special = set(codec.hf.all_special_ids)
    for p in serve.random_prompts(codec, 4, 64, seed=0):
        assert not special & set(codec.encode(p.text))


def test_shared_prefix_is_really_shared(codec: serve.Codec) -> None:
    prompts = serve.shared_prefix_prompts(codec, 8, prefix_len=80, input_len=24, seed=1)
    encoded = [codec.encode(p.text) for p in prompts]
    assert [len(ids) for ids in encoded] == [104] * 8
    assert all(p.num_tokens == 104 for p in prompts)
    assert len({tuple(ids[:80]) for ids in encoded}) == 1  # same prefix tokens: cacheable
    assert len({tuple(ids[80:]) for ids in encoded}) == 8  # unique tails
    prefix_text = codec.decode(encoded[0][:80])
    assert all(p.text.startswith(prefix_text) for p in prompts)


def test_mixed_has_the_long_fraction(codec: serve.Codec) -> None:
    prompts = serve.mixed_prompts(codec, 20, input_len=16, long_len=300, long_fraction=0.25, seed=2)
    lengths = [len(codec.encode(p.text)) for p in prompts]
    assert sorted(lengths) == [16] * 15 + [300] * 5
    assert [p.num_tokens for p in prompts] == lengths
    assert lengths != sorted(lengths)  # long prompts are spread, not bunched at one end


def test_build_prompts_dispatches_on_dataset(codec: serve.Codec) -> None:
    args = _args("--dataset", "shared-prefix", "--num-prompts", "3", "--prefix-len", "10",
                 "--input-len", "5")
    assert [p.num_tokens for p in serve.build_prompts(args, codec)] == [15] * 3


class _GreedyCodec(serve.Codec):
    """Toy tokenizer whose re-encoding merges "a" "b" into "ab": exercises the retries."""

    pieces = ("a", "b", "ab", "c")

    def __init__(self) -> None:
        self.vocab = [0, 1, 3]  # sample a, b, c; "ab" only appears by merging

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            step = 2 if text.startswith("ab", i) else 1
            ids.append(self.pieces.index(text[i : i + step]))
            i += step
        return ids

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_fit_text_retries_until_exact() -> None:
    codec, rng = _GreedyCodec(), random.Random(0)
    for _ in range(20):
        head = serve.fit_text(codec, rng, 6)
        assert len(codec.encode(head)) == 6
        text = serve.fit_text(codec, rng, 5, head=head)
        assert text.startswith(head)
        assert len(codec.encode(text)) == 11
        assert codec.encode(text)[:6] == codec.encode(head)


# ---- statistics --------------------------------------------------------------------------

def test_percentile_interpolates_like_numpy() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    assert serve.percentile(values, 50) == pytest.approx(3.5)
    assert serve.percentile(values, 99) == pytest.approx(9.75)
    assert serve.percentile(values, 0) == 1.0
    assert serve.percentile(values, 100) == 10.0
    assert serve.percentile([7.0], 99) == 7.0


def test_stats_ms_converts_seconds() -> None:
    assert serve.stats_ms([0.1, 0.2, 0.3]) == pytest.approx(
        {"mean": 200.0, "median": 200.0, "p90": 280.0, "p99": 298.0})
    assert serve.stats_ms([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def _records() -> list[Record]:
    return [
        Record(10, True, 200, ttft=0.1, itl=[0.02, 0.02, 0.02], e2el=0.16, output_tokens=4),
        Record(10, True, 200, ttft=0.3, itl=[0.05, 0.05, 0.05], e2el=0.45, output_tokens=4),
        Record(20, True, 200, ttft=0.05, itl=[], e2el=0.05, output_tokens=1),
        Record(10, False, 503, error="HTTP 503: busy"),
        Record(10, False, 503, error="HTTP 503: busy"),
        Record(10, False, None, error="ConnectError: refused"),
        Record(10, False, 200, error="BrokenStream: the stream carried no text"),
    ]


def test_tpot_per_request() -> None:
    records = _records()
    assert records[0].tpot == pytest.approx(0.02)
    assert records[1].tpot == pytest.approx(0.05)
    assert records[2].tpot is None  # one token: no time per output token
    assert records[3].tpot is None


def test_summary_math() -> None:
    s = serve.summarize(_records(), duration=2.0, slos={})
    assert (s["completed"], s["failed"]) == (3, 4)
    assert s["failed_by_status"] == {"503": 2, "ConnectError": 1, "BrokenStream": 1}
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (40, 9)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(24.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert s["ttft_ms"]["median"] == pytest.approx(100.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(35.0)
    assert s["itl_ms"]["median"] == pytest.approx(35.0)
    assert s["e2el_ms"]["p99"] == pytest.approx(160 + (450 - 160) * 0.98)
    assert "goodput" not in s
    assert "Failed requests:" in serve.format_summary(s)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = _records()
    s = serve.summarize(records, duration=2.0, slos={"ttft": 200.0, "tpot": 30.0})
    assert s["good_requests"] == 2  # the slow one misses both; one-token requests pass tpot
    assert s["goodput"] == pytest.approx(1.0)
    assert serve.summarize(records, 2.0, {"e2el": 100.0})["good_requests"] == 1
    assert serve.summarize(records, 2.0, {"ttft": 1e6})["good_requests"] == 3
    assert not serve.meets_slos(records[3], {"ttft": 1e6})
    assert "Request goodput" in serve.format_summary(s)


def test_parse_slo() -> None:
    assert serve.parse_slo("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert serve.parse_slo(" TTFT:1.5 , e2el:2000 ") == {"ttft": 1.5, "e2el": 2000.0}
    assert serve.parse_slo("") == {}
    for bad in ("ttft", "latency:5", "ttft:fast", "tpot:-1", "tpot:0"):
        with pytest.raises(argparse.ArgumentTypeError):
            serve.parse_slo(bad)


def test_flags() -> None:
    args = _args("--slo", "ttft:100", "--extra-body", '{"ignore_eos": true}', "--max-concurrency", "4")
    assert args.slo == {"ttft": 100.0}
    assert args.extra_body == {"ignore_eos": True}
    assert math.isinf(args.request_rate)
    assert args.func is serve.run
    with pytest.raises(SystemExit):
        _args("--extra-body", "[1, 2]")


# ---- load shape and requests -------------------------------------------------------------

def test_arrival_gaps() -> None:
    assert serve.arrival_gaps(5, math.inf, random.Random(0)) == [0.0] * 5
    gaps = serve.arrival_gaps(4000, 4.0, random.Random(0))
    assert gaps[0] == 0.0 and len(gaps) == 4000
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)
    assert serve.arrival_gaps(10, 4.0, random.Random(1)) == serve.arrival_gaps(10, 4.0, random.Random(1))


def test_request_body() -> None:
    prompt = serve.Prompt("hello", 1)
    body = serve.request_body(_args("--output-len", "7", "--extra-body", '{"ignore_eos": true, "temperature": 1}'),
                              "m", prompt)
    assert body["prompt"] == "hello" and body["max_tokens"] == 7 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 1  # extra body wins
    chat = serve.request_body(_args("--endpoint", "chat"), "m", prompt)
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and "prompt" not in chat


def _sse(*events: dict | str) -> bytes:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines).encode()


def _send(status: int, content: bytes) -> Record:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=content, headers={"content-type": "text/event-stream"})

    async def go() -> Record:
        record = Record(3)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await serve.send(client, "http://test/v1/completions", {}, record)
        return record

    return asyncio.run(go())


def test_send_reads_usage_and_gaps() -> None:
    record = _send(200, _sse({"choices": [{"text": "a"}]}, {"choices": [{"text": ""}]},
                             {"choices": [{"text": "b"}]}, {"choices": [{"text": "c"}]},
                             {"choices": [], "usage": {"completion_tokens": 5}}, "[DONE]"))
    assert record.success and record.status == 200
    assert record.output_tokens == 5  # usage wins over the 3 text chunks
    assert len(record.itl) == 2 and record.ttft is not None and record.e2el >= record.ttft


def test_send_counts_chunks_without_usage() -> None:
    record = _send(200, _sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                             {"choices": [{"delta": {"content": "x"}}]},
                             {"choices": [{"delta": {"content": "y"}}]}, "[DONE]"))
    assert record.success and record.output_tokens == 2


def test_send_failures() -> None:
    busy = _send(503, b'{"error": "busy"}')
    assert not busy.success and busy.failure_key == "503"
    broken = _send(200, _sse({"error": {"message": "engine died"}}))
    assert not broken.success and broken.failure_key == "BrokenStream"
    empty = _send(200, _sse("[DONE]"))
    assert not empty.success and "no text" in empty.error
