"""Conditional disaggregation over real processes: in one P/D cluster (``--disagg-mode
auto``) a short prompt is prefilled on the decode worker itself, in chunks of the decode
worker's small prefill budget, and a long one on the prefill worker with its KV shipped;
greedy, both equal Hugging Face transformers token for token."""

from __future__ import annotations

import httpx
import pytest

from tests.cluster import Cluster, TokenIds, readable_prompt

N = 12
MAX_LOCAL = 24  # --disagg-max-local-prefill
BUDGET = 8  # --decode-prefill-budget: the short prompt takes three local chunks
CHOICES = "tandem:router_prefill_choices_total"
SENT = "tandem:kv_transfer_bytes_total"


@pytest.fixture(scope="module")
def pd(tiny_model_dir):
    extra = ("--num-kv-blocks", "512", "--disagg-max-local-prefill", str(MAX_LOCAL),
             "--decode-prefill-budget", str(BUDGET))
    with Cluster(str(tiny_model_dir), disagg_mode="auto", extra=extra) as cluster:
        yield cluster


def greedy(cluster: Cluster, prompt: list[int]) -> dict:
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": N, "temperature": 0, "logprobs": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_short_prompt_prefills_locally_and_long_remotely_both_like_hf(pd, tiny_model_dir):
    ids = TokenIds(tiny_model_dir)
    [prefill] = pd.workers("prefill")
    for length, where, shipped in ((MAX_LOCAL - 4, "local", False), (3 * MAX_LOCAL, "remote", True)):
        prompt, expected = readable_prompt(tiny_model_dir, ids, length, 10 * length, N, step=20, span=600)
        before = (pd.metric(pd.router, CHOICES, where=where), pd.metric(prefill, SENT))
        choice = greedy(pd, prompt)
        assert ids.of(choice) == expected, where
        assert pd.metric(pd.router, CHOICES, where=where) == before[0] + 1
        assert (pd.metric(prefill, SENT) > before[1]) == shipped, where
