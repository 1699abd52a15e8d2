"""Quantised weight modes (``--quantization gguf|int8``) against HF transformers.

gguf mode keeps a GGUF's own blocks; its greedy output must equal transformers run on the
same weights dequantised (the HF copy the loader converts the file into), token for
token, on tiny random GGUFs in each format and on the default SmolLM2 (Q4_1, Q8_0
embedding). int8 mode must equal transformers on a checkpoint whose weights are the
int8-dequantised ones. Native weights, un-permuted, are bit-identical to transformers'.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.config import ModelConfig
from common.engine.setup import load_model
from common.flags import add_engine_flags
from common.model.gguf_native import read_native
from common.model.loader import resolve_model
from common.model.quantization import resolve_mode
from common.model.spec import ModelSpec
from common.sampling_params import SamplingParams
from kernels import cpu_quant
from kernels.quant_formats import quantize_int8_rows
from tests.conftest import hf_greedy, make_engine
from tests.test_equivalence import PASSAGE
from tests.tiny_gguf import Q, write_tiny_gguf

NUM_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)

# name -> (how the file is written, what the loader must keep quantised: slot -> format)
_ALL = {f"layers.{i}.{n}" for i in range(2) for n in ("qkv", "o", "gate_up", "down")}
TINY = {
    "q8_0": (dict(proj=Q.Q8_0), {**dict.fromkeys(_ALL, "Q8_0"), "embed": "Q8_0", "lm_head": "Q8_0"}),
    "q4_0": (dict(proj=Q.Q4_0, tied=False, overrides={"blk.1.ffn_down.weight": Q.F16}),
             {**dict.fromkeys(_ALL - {"layers.1.down"}, "Q4_0"), "embed": "Q8_0", "lm_head": "Q4_0"}),
    "q4_1": (dict(proj=Q.Q4_1, overrides={"blk.0.attn_v.weight": Q.Q8_0, "blk.1.ffn_down.weight": Q.Q5_0}),
             {**dict.fromkeys(_ALL - {"layers.0.qkv", "layers.1.down"}, "Q4_1"), "embed": "Q8_0",
              "lm_head": "Q8_0"}),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny_gguf(request, tmp_path_factory):
    """(name, HF copy of the dequantised weights, model loaded in gguf mode)."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf",
                           **TINY[request.param][0])  # fmt: skip
    loaded = load_model(ModelConfig(path=str(path), quantization="gguf"))
    directory = resolve_model(str(path)).directory
    yield request.param, directory, loaded
    shutil.rmtree(directory, ignore_errors=True)  # the converted copy in the user's cache
    directory.with_suffix(".lock").unlink(missing_ok=True)


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def text_prompts(engine, lengths: list[int]) -> list[list[int]]:
    text = engine.tokenizer.encode(PASSAGE * 4)
    return [text[7 * i : 7 * i + n] for i, n in enumerate(lengths)]


def assert_matches_hf(directory: Path, prompts, outputs) -> None:
    for prompt, out in zip(prompts, outputs, strict=True):
        ours, theirs = out.choices[0].token_ids, hf_greedy(directory, prompt, NUM_TOKENS)
        assert ours == theirs, divergence(directory, prompt, ours, theirs)


def divergence(directory: Path, prompt: list[int], ours: list[int], theirs: list[int]) -> str:
    """Where the two continuations part, with HF's top-2 logprob margin there (a near-tie
    flipped by summation order shows as a margin of ~1e-6)."""
    from transformers import AutoModelForCausalLM

    i = next(j for j, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        logprobs = model(torch.tensor([prompt + theirs[:i]])).logits[0, -1].log_softmax(-1)
    top = logprobs.topk(2)
    return (f"token {i}: ours {ours[i]}, HF {theirs[i]}; HF top-2 {top.indices.tolist()}, "
            f"margin {(top.values[0] - top.values[1]).item():.3g} nats")


# ---- gguf mode on tiny random GGUFs ---------------------------------------------------


def test_tiny_gguf_keeps_the_files_formats(tiny_gguf):
    name, _, loaded = tiny_gguf
    model = loaded.model
    assert {slot: w.fmt.name for slot, w in model.quantized.items()} == TINY[name][1]
    assert model.embed.numel() == 0  # the fp32 copies are freed
    assert all(layer.o.numel() == 0 and layer.qkv.numel() == 0 for layer in model.layers)
    assert model.describe_weights().startswith("gguf ") and name.upper() in model.describe_weights()
    fp32_too = ["packed GEMM"] * (name != "q8_0")  # the others have fp32 projections
    assert model.cpu_kernels == [*fp32_too, f"quantised GEMM ({cpu_quant.isa()})", "fused ops"]


def test_tiny_gguf_batch_and_chunked_prefill_match_hf(tiny_gguf):
    _, directory, loaded = tiny_gguf
    engine = make_engine(directory, loaded=loaded, max_num_batched_tokens=16)
    prompts = random_prompts(loaded.spec.vocab_size, [1, 9, 40, 75], seed=1)
    assert_matches_hf(directory, prompts, engine.generate(prompts, GREEDY))


def test_tiny_gguf_prefix_hit_matches_hf(tiny_gguf):
    _, directory, loaded = tiny_gguf
    engine = make_engine(directory, loaded=loaded)
    shared, tail_a, tail_b = random_prompts(loaded.spec.vocab_size, [48, 5, 11], seed=2)
    [a] = engine.generate([shared + tail_a], GREEDY)
    [b] = engine.generate([shared + tail_b], GREEDY)
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 48)
    assert_matches_hf(directory, [shared + tail_a, shared + tail_b], [a, b])


# ---- the default model: SmolLM2, Q4_1 with a Q8_0 embedding ----------------------------


def test_native_weights_are_bit_identical_to_transformers(smollm2_dir):
    """Every tensor kept quantised, Q/K rows un-permuted on the quantised bytes, dequantises
    to exactly the fp32 tensor transformers wrote."""
    source = resolve_model(None)
    native = read_native(source.gguf, ModelSpec.from_hf_config(source.hf_config()))
    assert len(native.quantized) == 1 + 7 * 30 and set(native.others.values()) == {"F32"}
    [file] = smollm2_dir.glob("*.safetensors")
    with safe_open(str(file), framework="pt") as st:
        for name, w in native.quantized.items():
            assert torch.equal(w.dequantize(), st.get_tensor(name)), name


@pytest.fixture(scope="module")
def smollm2_gguf():
    return load_model(ModelConfig(quantization="gguf"))


def test_smollm2_gguf_mode_holds_the_files_blocks(smollm2_gguf):
    model = smollm2_gguf.model
    assert model.describe_weights().startswith("gguf Q4_1 (+Q8_0 head)")
    assert model.cpu_kernels == [f"quantised GEMM ({cpu_quant.isa()})", "fused ops"]  # the fused forward path
    fp32 = sum(p.numel() for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert fp32 == 0 and model.embed.numel() == 0
    spec = smollm2_gguf.spec
    q4_1 = spec.num_layers * (spec.hidden_size * (spec.q_size + 2 * spec.kv_size + spec.q_size)
                              + 3 * spec.hidden_size * spec.intermediate_size) * 20 // 32
    assert model.weight_bytes() == q4_1 + spec.vocab_size * spec.hidden_size * 34 // 32


def test_smollm2_gguf_mode_matches_hf(smollm2_gguf, smollm2_dir):
    engine = make_engine(smollm2_dir, loaded=smollm2_gguf, max_num_batched_tokens=32)
    prompts = text_prompts(engine, [21, 90])
    assert_matches_hf(smollm2_dir, prompts, engine.generate(prompts, GREEDY))


def test_smollm2_gguf_prefix_hit_matches_hf(smollm2_gguf, smollm2_dir):
    engine = make_engine(smollm2_dir, loaded=smollm2_gguf)
    [first, second] = text_prompts(engine, [70, 70])
    second = first[:64] + second[:9]
    outs = engine.generate([first], GREEDY) + engine.generate([second], GREEDY)
    assert outs[1].num_cached_tokens == 64
    assert_matches_hf(smollm2_dir, [first, second], outs)


# ---- int8 mode --------------------------------------------------------------------------


def write_int8_reference(source: Path, target: Path) -> Path:
    """``source`` with every matrix replaced by its per-row int8 dequantised."""
    tensors = {}
    for file in source.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = st.get_tensor(key)
                tensors[key] = quantize_int8_rows(t).dequantize() if t.dim() == 2 else t
    target.mkdir()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    for f in source.iterdir():
        if f.suffix in (".json", ".jinja") and not f.name.endswith("index.json"):
            shutil.copy(f, target / f.name)
    return target


@pytest.mark.parametrize("model_dir", ["tiny_model_dir", "tiny_qwen2_dir", "smollm2_dir"])
def test_int8_mode_matches_hf_on_int8_weights(model_dir, request, tmp_path):
    source = request.getfixturevalue(model_dir)
    reference = write_int8_reference(source, tmp_path / "int8")
    loaded = load_model(ModelConfig(path=str(source), quantization="int8"))
    assert loaded.model.describe_weights().startswith("int8 (+int8 head)")
    engine = make_engine(source, loaded=loaded, max_num_batched_tokens=32)
    if loaded.spec.num_layers > 2:
        prompts = text_prompts(engine, [45])
    else:
        prompts = random_prompts(loaded.spec.vocab_size, [1, 21, 90], seed=3)
    assert_matches_hf(reference, prompts, engine.generate(prompts, GREEDY))


# ---- flags and fallbacks ------------------------------------------------------------------


def test_quantization_flag_is_validated(tiny_model_dir):
    with pytest.raises(ValueError, match="quantization must be"):
        ModelConfig(quantization="fp4")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert parser.parse_args(["--quantization", "int8"]).quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "q4"])
    with pytest.raises(ValueError, match="needs a .gguf model"):
        load_model(ModelConfig(path=str(tiny_model_dir), quantization="gguf"))


def test_auto_picks_gguf_for_a_gguf_file_and_none_otherwise(tiny_model_dir):
    cpu, f32 = torch.device("cpu"), torch.float32
    assert resolve_mode("auto", resolve_model(None), cpu, f32) == "gguf"
    assert resolve_mode("auto", resolve_model(str(tiny_model_dir)), cpu, f32) == "none"
    assert resolve_mode("int8", resolve_model(str(tiny_model_dir)), cpu, f32) == "int8"


@pytest.mark.parametrize("device, dtype, why", [("mps", torch.float32, "on the CPU and on CUDA"),
                                                ("cpu", torch.bfloat16, "float32 only")])
def test_quantised_modes_fall_back_to_fp32_off_the_cpu_kernels(device, dtype, why, caplog):
    with caplog.at_level(logging.WARNING):
        mode = resolve_mode("gguf", resolve_model(None), torch.device(device), dtype)
    assert mode == "none"
    assert why in caplog.text and "running fp32 weights" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_keeps_quantised_modes_for_the_triton_gemm(dtype):
    """kernels.triton_quant runs them there (tests/test_triton_quant.py), in any float dtype."""
    assert resolve_mode("gguf", resolve_model(None), torch.device("cuda"), dtype) == "gguf"
    assert resolve_mode("auto", resolve_model(None), torch.device("cuda"), dtype) == "gguf"
