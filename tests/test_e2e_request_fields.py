"""Issue 12's request fields end to end, over real processes on loopback, colocated and
P/D (where the prefill worker samples the first token and scores the prompt):
logit_bias, prompt_logprobs and echo with logprobs against HF transformers,
include_stop_str_in_output and skip_special_tokens, streamed and not."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.cluster import Cluster, TokenIds
from tests.test_e2e_serving import assert_idle, complete, stream_text
from tests.test_request_fields import hf_prompt_logprobs

FORCED = 4321  # reads back over HTTP as itself ("zing")
EOS = 2  # "<|im_end|>" in SmolLM2's tokenizer, which the tiny model uses


@pytest.fixture(scope="module")
def pd(tiny_model_dir):
    with Cluster(str(tiny_model_dir)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def colocated(tiny_model_dir):
    with Cluster(str(tiny_model_dir), colocated=1) as cluster:
        yield cluster


@pytest.fixture(scope="module", params=["colocated", "pd"])
def cluster(request):
    c = request.getfixturevalue(request.param)
    yield c
    assert_idle(c)


@pytest.fixture(scope="module")
def token_ids(tiny_model_dir) -> TokenIds:
    return TokenIds(tiny_model_dir)


GREEDY = {"temperature": 0, "ignore_eos": True}


def test_logit_bias_forces_and_bans_tokens_from_the_first_one_on(cluster, token_ids):
    prompt = list(range(110, 150))
    plain = complete(cluster, prompt=prompt, max_tokens=6, logprobs=0, **GREEDY)["choices"][0]
    assert token_ids.exact([FORCED]) and FORCED not in token_ids.of(plain)
    forced = complete(cluster, prompt=prompt, max_tokens=6, logprobs=0,
                      logit_bias={str(FORCED): 100}, **GREEDY)["choices"][0]
    assert token_ids.of(forced) == [FORCED] * 6  # the first token too (a prefill worker's)
    greedy_first = plain["logprobs"]["tokens"][0]
    banned = complete(cluster, prompt=prompt, max_tokens=6, logprobs=0,
                      logit_bias={str(token_ids.of(plain)[0]): -100}, **GREEDY)["choices"][0]
    assert greedy_first not in banned["logprobs"]["tokens"]
    chat = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "logit_bias": {str(FORCED): 100}, **GREEDY}).json()
    assert chat["choices"][0]["message"]["content"] == "zing" * 3


def test_logit_bias_outside_the_vocabulary_is_a_400_naming_it(cluster):
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=60,
                   json={"prompt": "hi", "logit_bias": {"49152": 1}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "logit_bias" and "49152" in r.json()["error"]["message"]


def _assert_vllm_prompt_logprobs(field, prompt, reference: torch.Tensor, k: int):
    assert field[0] is None and len(field) == len(prompt)
    for j in range(1, len(prompt)):
        row = reference[j - 1]
        entries = field[j]
        token = str(prompt[j])
        assert list(entries)[0] == token
        assert entries[token]["logprob"] == pytest.approx(float(row[prompt[j]]), abs=1e-3)
        best = row.topk(k)
        for rank, (t, v) in enumerate(zip(best.indices.tolist(), best.values.tolist(),
                                          strict=True), start=1):
            assert entries[str(t)]["logprob"] == pytest.approx(v, abs=1e-3)
            if str(t) != token:
                assert entries[str(t)]["rank"] == rank
        expected_rank = int((row > row[prompt[j]]).sum()) + 1
        assert abs(entries[token]["rank"] - expected_rank) <= expected_rank // 100  # fp32 ties


def test_prompt_logprobs_equal_hf_also_after_a_prefix_hit(cluster, tiny_model_dir):
    prompt = [(53 * i + 7) % 40000 + 3 for i in range(41)]
    reference = hf_prompt_logprobs(tiny_model_dir, prompt)
    warm = complete(cluster, prompt=prompt, max_tokens=2, **GREEDY)  # caches the prefix
    out = complete(cluster, prompt=prompt, max_tokens=2, prompt_logprobs=2, **GREEDY)
    [choice] = out["choices"]
    assert choice["text"] == warm["choices"][0]["text"]
    _assert_vllm_prompt_logprobs(choice["prompt_logprobs"], prompt, reference, 2)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = complete(cluster, prompt=prompt, max_tokens=2, **GREEDY)
    assert "prompt_logprobs" not in again["choices"][0]
    streamed, chunks = stream_text(cluster, "/v1/completions",
                                   {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2, **GREEDY})
    firsts = [c for c in chunks if c["choices"] and "prompt_logprobs" in c["choices"][0]]
    assert len(firsts) == 1 and firsts[0]["choices"][0]["prompt_logprobs"] == choice["prompt_logprobs"]
    assert streamed == choice["text"]


def test_prompt_logprobs_on_every_choice_of_n(cluster, tiny_model_dir):
    prompt = list(range(300, 318))
    out = complete(cluster, prompt=prompt, max_tokens=3, n=2, temperature=1.0, seed=4,
                   prompt_logprobs=0)
    a, b = (c["prompt_logprobs"] for c in out["choices"])
    assert a == b
    _assert_vllm_prompt_logprobs(a, prompt, hf_prompt_logprobs(tiny_model_dir, prompt), 0)


def test_echo_with_logprobs_scores_the_prompt_first_null(cluster, tiny_model_dir, token_ids):
    prompt = list(range(110, 130))
    reference = hf_prompt_logprobs(tiny_model_dir, prompt)
    body = {"prompt": prompt, "max_tokens": 4, "echo": True, "logprobs": 1, **GREEDY}
    [choice] = complete(cluster, **body)["choices"]
    [plain] = complete(cluster, prompt=prompt, max_tokens=4, logprobs=1, **GREEDY)["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 4
    assert lp["tokens"][len(prompt):] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, len(prompt)):
        assert lp["token_logprobs"][j] == pytest.approx(float(reference[j - 1][prompt[j]]), abs=1e-3)
        assert len(lp["top_logprobs"][j]) in (1, 2)  # the token and the best alternative
    assert choice["text"].endswith(plain["text"]) and len(choice["text"]) > len(plain["text"])
    streamed, chunks = stream_text(cluster, "/v1/completions", body)
    assert streamed == choice["text"]
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and first["tokens"][:len(prompt)] == lp["tokens"][:len(prompt)]


def test_include_stop_str_in_output_keeps_the_stop_string(cluster):
    body = {"prompt": list(range(120, 140)), "max_tokens": 16, **GREEDY}
    text = complete(cluster, **body)["choices"][0]["text"]
    at = next(i for i in range(3, len(text) - 3)
              if "\ufffd" not in text[i:i + 3] and text.find(text[i:i + 3]) == i)
    stop = text[at:at + 3]
    for include, want in [(False, text[:at]), (True, text[:at + 3])]:
        [choice] = complete(cluster, **body, stop=[stop], include_stop_str_in_output=include)["choices"]
        assert (choice["text"], choice["finish_reason"]) == (want, "stop")
        streamed, _ = stream_text(cluster, "/v1/completions",
                                  {**body, "stop": [stop], "include_stop_str_in_output": include})
        assert streamed == want


def test_skip_special_tokens_false_keeps_them_in_the_text(cluster):
    body = {"prompt": list(range(120, 140)), "max_tokens": 3, "logit_bias": {str(EOS): 100},
            **GREEDY}
    assert complete(cluster, **body)["choices"][0]["text"] == ""
    kept = complete(cluster, **body, skip_special_tokens=False)["choices"][0]["text"]
    assert kept == "<|im_end|>" * 3
    streamed, _ = stream_text(cluster, "/v1/completions", {**body, "skip_special_tokens": False})
    assert streamed == kept
    chat = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "skip_special_tokens": False, **body,
        "prompt": None}).json()
    assert chat["choices"][0]["message"]["content"] == "<|im_end|>" * 3


def test_the_eos_that_ends_a_choice_shows_only_with_include_stop_str_in_output(cluster):
    body = {"prompt": list(range(120, 140)), "max_tokens": 3, "temperature": 0,
            "logit_bias": {str(EOS): 100}, "skip_special_tokens": False}
    [hidden] = complete(cluster, **body)["choices"]
    assert (hidden["text"], hidden["finish_reason"]) == ("", "stop")
    [shown] = complete(cluster, **body, include_stop_str_in_output=True)["choices"]
    assert (shown["text"], shown["finish_reason"]) == ("<|im_end|>", "stop")
    streamed, _ = stream_text(cluster, "/v1/completions", {**body, "include_stop_str_in_output": True})
    assert streamed == "<|im_end|>"
