"""Greedy output equals Hugging Face transformers' token for token (fp32).

Every scheduling path must leave the numbers alone: batching very different lengths,
chunked prefill under a tiny budget, prefix-cache hits and preemption by recompute —
on random-weight Llama and Qwen2 models and on SmolLM2.
"""

from __future__ import annotations

import random

import pytest

from common.sampling_params import SamplingParams
from tests.conftest import hf_greedy, make_engine

NUM_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)

PASSAGE = (
    "The history of the lighthouse begins in the ancient world, where fires were lit on hills "
    "to guide sailors home. Over the centuries these beacons became towers of stone, and the "
    "keepers who tended them lived lonely lives on rocky islands far from any town. In the "
    "nineteenth century engineers learned to focus the light with glass lenses, so that a single "
    "lamp could be seen from twenty miles away. Today most lighthouses run on their own, yet "
    "people still visit them to watch the sea and to imagine the storms the keepers endured. "
)


@pytest.fixture(params=["tiny_model_dir", "tiny_qwen2_dir", "smollm2_dir"])
def model_dir(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(params=["tiny_model_dir", "tiny_qwen2_dir"])
def tiny_dir(request):
    """The random-weight models only: for paths whose SmolLM2 run costs a minute of HF
    reference generation and adds no coverage (the kernels are the same, only bigger)."""
    return request.getfixturevalue(request.param)


def prompts_of(engine, lengths: list[int], seed: int) -> list[list[int]]:
    """Real text for SmolLM2 (peaked, realistic logits), random tokens for tiny models."""
    rng = random.Random(seed)
    if engine.spec.num_layers > 2:
        text = engine.tokenizer.encode(PASSAGE * 4)
        starts = [rng.randrange(0, len(text) - n) for n in lengths]
        return [text[s : s + n] for s, n in zip(starts, lengths, strict=True)]
    return [[rng.randrange(3, engine.spec.vocab_size) for _ in range(n)] for n in lengths]


def assert_matches_hf(model_dir, prompts, outputs):
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out.choices[0].token_ids) == NUM_TOKENS
        assert out.choices[0].token_ids == hf_greedy(model_dir, prompt, NUM_TOKENS)


def test_single_prompt(model_dir):
    engine = make_engine(model_dir)
    prompts = prompts_of(engine, [21], seed=1)
    assert_matches_hf(model_dir, prompts, engine.generate(prompts, GREEDY))


def test_batch_of_very_different_lengths(model_dir):
    engine = make_engine(model_dir)
    prompts = prompts_of(engine, [1, 7, 16, 45, 200], seed=2)
    assert_matches_hf(model_dir, prompts, engine.generate(prompts, GREEDY))


def test_chunked_prefill_with_tiny_budget(tiny_dir):
    engine = make_engine(tiny_dir, max_num_batched_tokens=8)
    prompts = prompts_of(engine, [45, 70, 9], seed=3)
    assert_matches_hf(tiny_dir, prompts, engine.generate(prompts, GREEDY))


def test_prefix_cache_hit_gives_same_tokens(model_dir):
    engine = make_engine(model_dir)
    [shared, tail_a, tail_b] = prompts_of(engine, [64, 10, 13], seed=4)
    first, second = shared + tail_a, shared + tail_b
    [a] = engine.generate([first], GREEDY)
    [b] = engine.generate([second], GREEDY)
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 64  # the shared prefix's four full blocks
    assert_matches_hf(model_dir, [first, second], [a, b])


def test_preemption_recomputes_exactly(model_dir):
    # 4 sequences x (40 + 32) tokens need 20 blocks of 16; 12 blocks force preemption.
    engine = make_engine(model_dir, num_blocks=12)
    prompts = prompts_of(engine, [40, 40, 40, 40], seed=5)
    outs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert_matches_hf(model_dir, prompts, outs)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_torch_path_without_c_kernels(model_dir, monkeypatch):
    """The portable forward pass (no packed GEMM, no fused ops, no C decode attention:
    what CUDA, bf16 and a machine without gcc run) matches too, on the same chunked,
    batched workload."""
    import dataclasses

    from common.config import ModelConfig
    from common.engine.setup import load_model
    from common.model.llama import LlamaModel
    from kernels.attention import TorchBackend

    monkeypatch.setattr(LlamaModel, "use_cpu_kernels", lambda self: [])
    loaded = load_model(ModelConfig(path=str(model_dir)))
    loaded = dataclasses.replace(loaded, backend=TorchBackend(use_c_kernel=False))
    assert loaded.model.cpu_kernels == [] and loaded.backend.name == "torch"
    engine = make_engine(model_dir, max_num_batched_tokens=32, loaded=loaded)
    prompts = prompts_of(engine, [3, 50, 21], seed=6)
    assert_matches_hf(model_dir, prompts, engine.generate(prompts, GREEDY))


def test_engine_uses_the_c_kernels(model_dir):
    """On this CPU in float32 the default path is the packed GEMM and the fused ops, so
    every other test here checks them against transformers."""
    engine = make_engine(model_dir)
    assert engine.loaded.model.cpu_kernels == ["packed GEMM", "fused ops"]


def test_engine_uses_the_c_decode_attention(model_dir):
    """The default CPU backend runs decode attention in the fused C kernel, so the tests
    above check it, and the torch-path test above really is the other path."""
    engine = make_engine(model_dir)
    assert engine.loaded.backend.name == "torch+c"
