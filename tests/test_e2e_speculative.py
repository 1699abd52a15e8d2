"""Speculative decoding over real processes: a prefill worker hands off to a decode
worker started with ``--speculative-config``; greedy output over HTTP equals HF
transformers token for token, and the decode worker's Prometheus counters show drafts
both accepted and rejected (the prefill worker drafts none)."""

from __future__ import annotations

import json

import httpx

from common.model.tokenizer import Tokenizer
from tests.cluster import Cluster
from tests.conftest import hf_greedy
from tests.test_speculative import PROMPTS, repeat_dir  # noqa: F401  (the fixture)

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
DRAFTED, ACCEPTED = "tandem:spec_decode_num_draft_tokens_total", "tandem:spec_decode_num_accepted_tokens_total"


def test_pd_with_speculation_matches_hf_and_counts_drafts(repeat_dir):  # noqa: F811
    extra = ("--num-kv-blocks", "256", "--speculative-config", SPEC)
    tokenizer = Tokenizer(repeat_dir)
    with Cluster(str(repeat_dir), prefill=1, decode=1, extra=extra) as cluster:
        for prompt in PROMPTS:
            r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                })
            assert r.status_code == 200, r.text
            # Compared as text: this model's byte tokens do not each read back as one id
            # (a trailing incomplete UTF-8 sequence shows as replacement characters in both).
            want = hf_greedy(repeat_dir, prompt, 32)
            assert r.json()["choices"][0]["text"] == tokenizer.decode(want)
            assert r.json()["usage"]["completion_tokens"] == len(want)
        [decode], [prefill] = cluster.workers("decode"), cluster.workers("prefill")
        drafted, accepted = cluster.metric(decode, DRAFTED), cluster.metric(decode, ACCEPTED)
        assert 0 < accepted < drafted, (accepted, drafted)
        assert cluster.metric(prefill, DRAFTED) == 0
