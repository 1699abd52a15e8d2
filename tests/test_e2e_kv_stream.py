"""KV streamed chunk by chunk over real processes: ``tandem up`` (one prefill worker, one
decode worker) with ``--max-num-batched-tokens 32``, so a 101-token prompt is computed in
four steps and its KV goes as three pieces and a final transfer.

The test-only fault hook drops two chosen transfers (``script``): the final transfer of
the first request (its stream breaks after three good pieces; the request goes again
whole) and the final transfer of the third (so the decode worker holds a reservation with
every piece copied in when it is SIGKILLed). Outcomes: greedy tokens equal to Hugging
Face's and to one engine doing both (colocated), on a stream that was retried and on a
prompt of exactly six blocks; the decode worker took pieces in; after the kill the
client gets a clear 503 and the prefill worker holds 0 blocks.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from common.sampling_params import SamplingParams
from tests.cluster import Cluster, TokenIds, readable_prompt, wait_for
from tests.conftest import make_engine

CHUNK = 32
N = 8
LEASE_S = "3"  # a dropped transfer costs this much before the request goes again
# transfers: A = 0-3 (its final, 3, dropped) + its whole retry 4; B = 5-7; C = 8-11 (11 dropped)
FAULTS = "script=" + "+".join("drop" if i in (3, 11) else "none" for i in range(12))
PIECES = "tandem:kv_stream_pieces_total"


def complete(url: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True, "logprobs": 0})


def colocated(model_dir, prompt: list[int]) -> list[int]:
    engine = make_engine(model_dir, num_blocks=64, max_num_batched_tokens=CHUNK)
    [out] = engine.generate([prompt], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))
    return out.choices[0].token_ids


def idle(health: dict) -> bool:
    return (health["running"], health["waiting"], health["kv_cache_usage"]) == (0, 0, 0)


@pytest.fixture(scope="module")
def cases(tiny_model_dir):
    ids = TokenIds(tiny_model_dir)
    return ids, readable_prompt(tiny_model_dir, ids, 101, 0, N), readable_prompt(tiny_model_dir, ids, 96, 500, N)


def test_streamed_kv_serves_like_hf_and_a_dead_receiver_leaves_no_block_held(
        tiny_model_dir, cases, monkeypatch):
    ids, (long_prompt, long_out), (even_prompt, even_out) = cases
    monkeypatch.setenv("TANDEM_KV_FAULTS", FAULTS)  # the launcher's children inherit it
    # A short queue and admission wait: after the kill, C's move waits that long for a decode
    # worker before its 503 (30 s by default, most of this test's time).
    extra = ("--num-kv-blocks", "512", "--max-num-batched-tokens", str(CHUNK), "--lease-seconds", LEASE_S,
             "--queue-timeout", "3", "--admission-timeout", "4")
    with Cluster(str(tiny_model_dir), extra=extra) as c:
        [prefill], [decode] = c.workers("prefill"), c.workers("decode")
        for prompt, want in ((long_prompt, long_out), (even_prompt, even_out)):
            r = complete(c.url, prompt)
            assert r.status_code == 200, r.text
            [choice] = r.json()["choices"]
            assert ids.of(choice) == want == colocated(tiny_model_dir, prompt)
        # A: 3 pieces (its stream broke at the final), B (six blocks): 2 pieces + the final
        assert c.metric(decode, PIECES, direction="received") == 5
        assert c.metric(prefill, "tandem:kv_transfer_failures_total", reason="retried") == 1
        wait_for(lambda: idle(c.health(prefill)) and idle(c.health(decode)), "both workers idle")

        with ThreadPoolExecutor(1) as pool:
            # a prompt of its own: A's would hit the prefill worker's prefix cache and go whole
            third = pool.submit(complete, c.url, list(range(5000, 5101)))
            # every piece of C is in, its final was dropped: the decode worker holds its
            # reservation, the prefill worker its blocks
            wait_for(lambda: c.metric(decode, PIECES, direction="received") == 8
                     and c.health(decode)["kv_cache_usage"] > 0, "C's pieces at the decode worker")
            decode.proc.send_signal(signal.SIGKILL)
            decode.proc.wait(timeout=10)
            assert third.result().status_code == 503
        wait_for(lambda: idle(c.health(prefill)), "the prefill worker holding nothing", timeout=30)
