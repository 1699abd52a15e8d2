"""The weight modes (``--quantization``): which weights a model keeps quantised, and loading them.

- ``none``: float weights (a GGUF model's dequantised once into its HF copy).
- ``gguf``: a .gguf model's own Q8_0/Q4_0/Q4_1 blocks, unchanged (``gguf_native``);
  tensors in other types (F32 norms, Q6_K, ...) come in fp32 from the HF copy, as does a
  fused q|k|v or gate|up whose parts differ in format.
- ``int8``: per-row int8 of every projection, the LM head and the embedding, made at load
  from the float weights of any model (``quantize_int8_rows``).
- ``auto``: ``QUANTIZATION_AUTO_FOR_GGUF`` for a .gguf model, ``none`` otherwise.

Quantised weights run through ``kernels.cpu_quant`` on a CPU (float32, the kernels built)
and through ``kernels.triton_quant`` on CUDA (any float dtype). Elsewhere a quantised mode
falls back to ``none``, saying why.
"""

from __future__ import annotations

import importlib.util
import logging
from collections import defaultdict

import torch

from common.config import QUANTIZATION_AUTO_FOR_GGUF
from common.model.gguf_native import read_native
from common.model.llama import LlamaModel
from common.model.loader import ModelSource, load_weights
from kernels import cpu_gemm, cpu_quant
from kernels.quant_formats import QuantWeight, concat_rows, quantize_int8_rows

log = logging.getLogger(__name__)


def resolve_mode(requested: str, source: ModelSource, device: torch.device, dtype: torch.dtype) -> str:
    """The mode to load in: ``auto`` decided, and a quantised mode the machine cannot run
    replaced by ``none`` (a warning when it was asked for by name)."""
    if requested == "gguf" and source.gguf is None:
        raise ValueError(f"--quantization gguf needs a .gguf model; {source.directory} is an HF "
                         f"directory (use --quantization int8 or none)")
    mode = requested
    if requested == "auto":
        mode = QUANTIZATION_AUTO_FOR_GGUF if source.gguf is not None else "none"
    if mode == "none":
        return mode
    why = _unsupported(device, dtype)
    if why is not None:
        (log.info if requested == "auto" else log.warning)(
            "quantization %s is not possible here (%s): running fp32 weights", mode, why)
        return "none"
    return mode


def _unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type == "cuda":  # the Triton GEMM, any float dtype (kernels.triton_quant)
        return None if importlib.util.find_spec("triton") else "CUDA runs them through Triton, not installed"
    if device.type != "cpu":
        return f"quantised weights run on the CPU and on CUDA, not on {device.type}"
    if dtype != torch.float32:
        return f"quantised weights run in float32 only, not {dtype}"
    if not cpu_quant.available():
        return f"the quantised CPU kernel is unavailable: {cpu_quant.unavailable_reason()}"
    if not cpu_gemm.available():
        return f"the CPU GEMM kernel is unavailable: {cpu_gemm.unavailable_reason()}"
    return None


def load(model: LlamaModel, source: ModelSource, mode: str, triton: bool | None = None) -> None:
    """Fill ``model`` with the weights of ``source`` in ``mode`` (a resolved one); quantised
    weights are held for the C kernels on a CPU, for Triton elsewhere (``triton=True``:
    for Triton on a CPU too, the interpreter's tests; see ``LlamaModel.quantize``)."""
    if mode == "none":
        load_weights(model, source.directory)
    elif mode == "gguf":
        native = gguf_weights(model, source)
        load_weights(model, source.directory, skip=_sources(model, native))
        model.quantize(native, triton)
    elif mode == "int8":
        load_weights(model, source.directory)
        model.quantize({name: quantize_int8_rows(model.get_parameter(name)) for name in _slot_sources(model)},
                       triton)
    else:
        raise ValueError(f"unknown weight mode {mode!r}")


def gguf_weights(model: LlamaModel, source: ModelSource) -> dict[str, QuantWeight]:
    """The model's weights (by parameter name) that the GGUF holds natively, fused;
    logs, in one line, the tensors that run in fp32 instead."""
    assert source.gguf is not None
    native = read_native(source.gguf, model.spec)
    out: dict[str, QuantWeight] = {}
    fp32 = defaultdict(list)  # why -> tensors
    for gguf_name, kind in native.others.items():
        fp32[kind].append(gguf_name)
    for slot, names in _slot_sources(model).items():
        parts = [native.quantized.get(n) for n in names]
        if all(p is not None for p in parts) and len({p.fmt for p in parts}) == 1:
            out[slot] = parts[0] if len(parts) == 1 else concat_rows(parts)
        elif any(p is not None for p in parts):
            fp32["mixed formats, fused in fp32"].append(slot)
    if fp32:
        log.info("gguf: in fp32: %s", "; ".join(f"{len(v)} {why} ({', '.join(v[:3])}"
                                                f"{', ...' if len(v) > 3 else ''})"
                                                for why, v in fp32.items()))  # fmt: skip
    return out


def _slot_sources(model: LlamaModel) -> dict[str, tuple[str, ...]]:
    """The weights a quantised mode may hold quantised (parameter names), each with its
    checkpoint tensors in fused order."""
    out: dict[str, tuple[str, ...]] = {"embed": ("model.embed_tokens.weight",)}
    if not model.spec.tie_word_embeddings:
        out["lm_head"] = ("lm_head.weight",)
    for i in range(model.spec.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[f"layers.{i}.qkv"] = tuple(attn + f"{x}_proj.weight" for x in "qkv")
        out[f"layers.{i}.o"] = (attn + "o_proj.weight",)
        out[f"layers.{i}.gate_up"] = (mlp + "gate_proj.weight", mlp + "up_proj.weight")
        out[f"layers.{i}.down"] = (mlp + "down_proj.weight",)
    return out


def _sources(model: LlamaModel, weights: dict[str, QuantWeight]) -> set[str]:
    """The checkpoint tensors that ``weights`` replace (not to be read in fp32)."""
    sources = _slot_sources(model)
    return {name for slot in weights for name in sources[slot]}
