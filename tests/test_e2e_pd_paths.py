"""Prefill/decode runs over real processes on the paths where a request ends or starts
differently: by EOS, by a stop token id, with ``n > 1``, with logprobs, after a prefix
hit, after a chunked prefill. Each is compared, as token ids, against Hugging Face
transformers — or against a colocated cluster where HF cannot express the run (seeded
sampling). No run here sets ``ignore_eos``.

The tiny model's EOS is chosen from its own greedy output (a token first produced a few
steps in), so greedy runs really end by EOS; the weights are those of ``tiny_model_dir``.
Other prompts rarely meet that token, so the prefix-hit and chunked runs end by a stop
token id picked the same way from their own HF output.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from tests.cluster import Cluster, TokenIds
from tests.conftest import hf_greedy, write_tiny_model

CHUNK = 32  # --max-num-batched-tokens: a longer prompt is prefilled in several steps
N = 40  # tokens asked for: more than any run here needs to reach its EOS
EXTRA = ("--num-kv-blocks", "512", "--max-num-batched-tokens", str(CHUNK))
GENERATED = "tandem:generation_tokens_total"


def prompt_at(offset: int, length: int) -> list[int]:
    return list(range(100 + offset, 100 + offset + length))


@pytest.fixture(scope="module")
def eos_case(tmp_path_factory, smollm2_dir, tiny_model_dir) -> tuple[Path, list[int], int]:
    """(model dir, prompt, k): greedy from the prompt ends by EOS after k + 1 tokens."""
    ids = TokenIds(tiny_model_dir)
    for offset in range(0, 400, 10):
        prompt = prompt_at(offset, 20)
        out = hf_greedy(tiny_model_dir, prompt, N)
        firsts = [i for i in range(8, N - 8) if out[i] not in out[:i] and out[i] not in (1, 2)]
        if firsts and ids.exact(out[: firsts[0] + 1]):
            k = firsts[0]
            directory = write_tiny_model(tmp_path_factory.mktemp("tiny-eos"), smollm2_dir,
                                         eos_token_id=out[k])
            return directory, prompt, k
    raise AssertionError("no prompt found whose greedy output suits the EOS model")


@pytest.fixture(scope="module")
def model_dir(eos_case) -> Path:
    return eos_case[0]


@pytest.fixture(scope="module")
def token_ids(model_dir) -> TokenIds:
    return TokenIds(model_dir)


@pytest.fixture(scope="module")
def eos_id(model_dir) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["eos_token_id"]


@pytest.fixture(scope="module")
def pd(model_dir):
    with Cluster(str(model_dir), extra=EXTRA) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def colocated(model_dir):
    with Cluster(str(model_dir), colocated=1, extra=EXTRA) as cluster:
        yield cluster


def until_stop(output: list[int], stop_ids: set[int]) -> list[int] | None:
    """A greedy output up to and including its first stop token (EOS or one of
    ``stop_token_ids``), as HF ``generate`` with those as ``eos_token_id`` returns it;
    None when it does not stop."""
    end = next((i for i, t in enumerate(output) if t in stop_ids), None)
    return None if end is None else output[: end + 1]


def hf_until_stop(model_dir: Path, prompt: list[int], stop_ids: set[int]) -> list[int]:
    out = until_stop(hf_greedy(model_dir, prompt, N), stop_ids)
    assert out is not None, "the run would not stop within N tokens"
    return out


def complete(cluster: Cluster, **body) -> dict:
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120,
                   json={"max_tokens": N, "temperature": 0, "logprobs": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stop_case(model_dir: Path, token_ids: TokenIds, eos: set[int], make_prompt):
    """(prompt, stop token id, HF output up to it) for the first of ``make_prompt(0),
    make_prompt(1), ...`` whose HF output has a token first produced a few steps in, before
    any EOS, and reads back exactly over HTTP up to there."""
    for i in range(60):
        prompt = make_prompt(i)
        out = hf_greedy(model_dir, prompt, N)
        j = next((j for j in range(4, N) if out[j] not in out[:j]), None)
        if j is not None and not eos & set(out[: j + 1]) and token_ids.exact(out[: j + 1]):
            return prompt, out[j], out[: j + 1]
    raise AssertionError("no prompt found whose output suits a stop token id")


def test_greedy_ends_by_eos_like_hf(pd, eos_case, eos_id, token_ids):
    model_dir, prompt, k = eos_case
    out = complete(pd, prompt=prompt)
    [choice] = out["choices"]
    assert token_ids.of(choice) == hf_until_stop(model_dir, prompt, {eos_id, 2})
    assert len(token_ids.of(choice)) == k + 1 < N
    assert choice["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == k + 1


def test_stop_token_id_ends_like_hf(pd, eos_case, token_ids):
    model_dir, prompt, k = eos_case
    greedy = hf_greedy(model_dir, prompt, N)
    j = next(i for i in range(2, k) if greedy[i] not in greedy[:i])  # before the EOS
    [choice] = complete(pd, prompt=prompt, stop_token_ids=[greedy[j]])["choices"]
    assert token_ids.of(choice) == greedy[: j + 1]
    assert choice["finish_reason"] == "stop"


def test_every_greedy_choice_ends_by_eos(pd, eos_case, eos_id, token_ids):
    model_dir, prompt, _ = eos_case
    choices = complete(pd, prompt=prompt, n=3)["choices"]
    expected = hf_until_stop(model_dir, prompt, {eos_id, 2})
    assert [token_ids.of(c) for c in choices] == [expected] * 3
    assert [c["finish_reason"] for c in choices] == ["stop"] * 3


def test_logprobs_match_hf(pd, eos_case, eos_id, token_ids):
    model_dir, prompt, _ = eos_case
    [choice] = complete(pd, prompt=prompt, logprobs=2)["choices"]
    expected = hf_until_stop(model_dir, prompt, {eos_id, 2})
    assert token_ids.of(choice) == expected
    want = hf_logprobs(model_dir, prompt, expected)  # [len(expected), vocab]
    got = torch.tensor(choice["logprobs"]["token_logprobs"])
    torch.testing.assert_close(got, want.gather(1, torch.tensor(expected)[:, None])[:, 0],
                               atol=1e-3, rtol=0)
    # Each step's two alternatives are HF's two most likely tokens, with their logprobs.
    for step, top in enumerate(choice["logprobs"]["top_logprobs"]):
        values, best = want[step].topk(2)
        assert len(top) == 2
        torch.testing.assert_close(torch.tensor(sorted(top.values(), reverse=True)), values,
                                   atol=1e-3, rtol=0)
        assert best[0].item() == expected[step]


def test_prefix_hit_then_stop_token_id_like_hf(pd, model_dir, eos_id, token_ids):
    shared = prompt_at(700, 16)  # one full block; with a tail, still within one chunk
    prompt, stop_id, expected = stop_case(model_dir, token_ids, {eos_id, 2},
                                          lambda i: shared + prompt_at(900 + 10 * i, 8))
    complete(pd, prompt=shared + [5, 6, 7], max_tokens=1)  # caches the shared block
    out = complete(pd, prompt=prompt, stop_token_ids=[stop_id])
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    assert token_ids.of(out["choices"][0]) == expected
    assert out["choices"][0]["finish_reason"] == "stop"


def test_chunked_prefill_then_stop_token_id_like_hf(pd, model_dir, eos_id, token_ids):
    prompt, stop_id, expected = stop_case(model_dir, token_ids, {eos_id, 2},
                                          lambda i: prompt_at(1500 + 10 * i, 3 * CHUNK + 5))
    [choice] = complete(pd, prompt=prompt, stop_token_ids=[stop_id])["choices"]
    assert token_ids.of(choice) == expected and choice["finish_reason"] == "stop"


def test_seeded_n2_choice_stopping_at_its_first_token_stays_stopped(pd, colocated, token_ids):
    """A choice that ends at the token the prefill worker sampled must not be revived
    and decoded to max_tokens on the decode worker (the handoff's ``finished``)."""
    body = {"prompt": prompt_at(2000, 20), "temperature": 1.0, "seed": 11, "n": 2, "max_tokens": N}
    free = complete(colocated, **body)["choices"]
    firsts = [c["logprobs"]["tokens"][0] for c in free]
    assert firsts[0] != firsts[1], "pick another seed: both choices start alike"
    [stop_id] = token_ids.of({"logprobs": {"tokens": firsts[1:]}})
    before = colocated.workers_total(GENERATED)
    want = complete(colocated, **body, stop_token_ids=[stop_id])["choices"]
    colocated_work = colocated.workers_total(GENERATED) - before
    assert len(want[1]["logprobs"]["tokens"]) == 1 and want[1]["finish_reason"] == "stop"
    before = pd.workers_total(GENERATED)
    got = complete(pd, **body, stop_token_ids=[stop_id])["choices"]
    assert [(c["logprobs"]["tokens"], c["finish_reason"]) for c in got] == \
        [(c["logprobs"]["tokens"], c["finish_reason"]) for c in want]
    # The gateway shows a choice only up to its end; what the workers generated shows
    # whether the stopped choice was decoded on regardless (up to max_tokens).
    assert pd.workers_total(GENERATED) - before == colocated_work


def hf_logprobs(model_dir: Path, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF's log-softmax over the vocabulary at each output position (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)
