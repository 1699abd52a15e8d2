"""The Triton GEMM on quantised weights (``kernels.triton_quant``) against the reference
dequantiser (``kernels.quant_formats``, bit-exact to gguf's), and a model that holds its
weights that way against the same model on the dequantised floats.

Without a GPU the kernel runs in Triton's interpreter on the CPU (tests/conftest.py sets
TRITON_INTERPRET=1), so the shapes are small.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from common.config import ModelConfig
from common.engine.setup import load_model
from common.model import quantization
from common.model.llama import LlamaModel
from common.model.loader import resolve_model
from common.sampling_params import SamplingParams
from kernels import triton_quant
from kernels.attention import TritonBackend
from kernels.quant_formats import QuantFormat
from tests.conftest import make_engine
from tests.test_cpu_quant import quantized, small_integer_weight
from tests.tiny_gguf import Q, write_tiny_gguf

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("fmt", list(QuantFormat))
@pytest.mark.parametrize("m", [1, 5, 17])
def test_linear_matches_the_dequantised_product(fmt: QuantFormat, m: int) -> None:
    n, k = 70, 96  # a partial tile of rows of W, three blocks along K
    w = quantized(fmt, n, k, seed=m)
    dw = triton_quant.to_device(w, DEVICE)
    g = torch.Generator().manual_seed(m + 1)
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    want = x.double() @ w.dequantize().double().T
    got = triton_quant.linear(x.to(DEVICE), dw).cpu()
    assert got.dtype is torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    got_b = triton_quant.linear(x.to(DEVICE), dw, b.to(DEVICE)).cpu()
    torch.testing.assert_close(got_b, (want + b.double()).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_exact_on_small_integers(fmt: QuantFormat) -> None:
    """Unit scales and small integer x: every partial sum is exact, so the kernel's
    dequantisation must give the float64 product bit for bit (nibble order included)."""
    g = torch.Generator().manual_seed(3)
    w = small_integer_weight(fmt, 19, 64, g)
    q, k = w.dequantize(), w.k
    x = torch.randint(-8, 8, (3, k), generator=g).float()
    got = triton_quant.linear(x.to(DEVICE), triton_quant.to_device(w, DEVICE)).cpu()
    assert torch.equal(got, (x.double() @ q.double().T).float())


@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_embedding_is_the_dequantised_rows(fmt: QuantFormat) -> None:
    w = quantized(fmt, 40, 64, seed=7)
    ids = torch.tensor([0, 39, 5, 5, 17])
    got = triton_quant.embedding(triton_quant.to_device(w, DEVICE), ids.to(DEVICE)).cpu()
    assert torch.equal(got, w.dequantize()[ids])
    with pytest.raises(ValueError, match="token ids"):
        triton_quant.embedding(triton_quant.to_device(w, DEVICE), torch.tensor([40]).to(DEVICE))


def test_linear_rejects_mismatched_operands() -> None:
    dw = triton_quant.to_device(quantized(QuantFormat.Q8_0, 16, 64, seed=1), DEVICE)
    with pytest.raises(ValueError, match=r"x must be a float tensor \[M, 64\]"):
        triton_quant.linear(torch.zeros(2, 32, device=DEVICE), dw)
    with pytest.raises(ValueError, match="bias must be"):
        triton_quant.linear(torch.zeros(2, 64, device=DEVICE), dw, torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="QuantWeight"):
        triton_quant.linear(torch.zeros(2, 64, device=DEVICE), torch.zeros(16, 64))


@pytest.mark.parametrize("proj", ["Q4_1", "Q4_0"])
def test_engine_on_triton_held_weights_matches_the_c_kernels(tmp_path, proj: str) -> None:
    """A tiny GGUF (projections in ``proj``, one layer's down projection in a format we
    do not run natively, so held in float beside the quantised ones; embedding and tied
    head Q8_0) served through the Triton attention backend on weights held for Triton
    gives the tokens and logprobs the CPU path gives on the same file's blocks."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", proj=Q[proj], overrides={"blk.1.ffn_down.weight": Q.Q5_0})
    source = resolve_model(str(path))
    try:
        cpu = load_model(ModelConfig(path=str(path), quantization="gguf"))
        model = LlamaModel(cpu.spec, cpu.max_len, torch.float32, torch.device(DEVICE))
        quantization.load(model, source, "gguf", triton=True)
        held = {name: type(w).__name__ for name, w in model.quantized.items()}
        assert held and set(held.values()) == {"QuantWeight"} and "layers.1.down" not in held
        assert model.use_cpu_kernels() == []  # nothing repacked for the C kernels
        triton = dataclasses.replace(cpu, model=model.eval(), backend=TritonBackend())
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1)
        prompts = [[5, 6, 7], list(range(40, 61))]
        got = make_engine(source.directory, loaded=triton, max_num_batched_tokens=8).generate(prompts, params)
        want = make_engine(source.directory, loaded=cpu, max_num_batched_tokens=8).generate(prompts, params)
        for g, w in zip(got, want, strict=True):
            [gc], [wc] = g.choices, w.choices
            assert gc.token_ids == wc.token_ids
            torch.testing.assert_close(torch.tensor([lp.logprob for lp in gc.logprobs]),
                                       torch.tensor([lp.logprob for lp in wc.logprobs]), atol=1e-4, rtol=0)
    finally:
        shutil.rmtree(source.directory, ignore_errors=True)  # the converted copy in the user's cache
        source.directory.with_suffix(".lock").unlink(missing_ok=True)
