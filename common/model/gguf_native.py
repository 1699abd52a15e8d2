"""A GGUF file's own quantised tensors, under Hugging Face names and in HF row order.

``read_native`` returns every tensor of a format we run natively (``QuantFormat``: Q8_0,
Q4_0, Q4_1) as a ``QuantWeight`` with the file's bytes unchanged, and names the others
(F32/F16 norms, quantisation types we have no kernel for), which the caller takes in
fp32 from the converted HF copy instead. llama.cpp's converter permutes the rows of
``attn_q``/``attn_k`` of Llama-architecture models (interleaved RoPE halves);
transformers undoes that on the dequantised matrix, and we undo it on the quantised rows,
which is exact: each row's blocks run along the input dimension.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common.model.gguf_file import read_gguf
from common.model.spec import ModelSpec
from kernels.quant_formats import QuantFormat, QuantWeight

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_PERMUTING_ARCHITECTURES = ("llama",)  # as transformers' LlamaTensorProcessor


@dataclass(slots=True)
class NativeTensors:
    quantized: dict[str, QuantWeight] = field(default_factory=dict)  # HF name -> weight
    others: dict[str, str] = field(default_factory=dict)  # GGUF name -> its type, not kept


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight`` (None: unknown)."""
    m = _BLOCK_NAME.fullmatch(gguf_name)
    if m:
        part = _LAYER.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    base, _, suffix = gguf_name.rpartition(".")
    return f"{_GLOBAL[base]}.{suffix}" if base in _GLOBAL else None


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """The row order that turns llama.cpp's Q/K layout back into HF's: HF row r is GGUF
    row ``index[r]`` (transformers' ``_reverse_permute_weights`` as an index)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


def read_native(path: Path, spec: ModelSpec) -> NativeTensors:
    """The natively runnable tensors of the GGUF at ``path`` (see the module docstring)."""
    file = read_gguf(path)
    arch = file.architecture
    out = NativeTensors()
    for gguf_name, t in file.tensors.items():
        name, fmt = hf_name(gguf_name), QuantFormat.from_ggml_type(t.ggml_type)
        if name is None or fmt is None or len(t.shape) != 2:
            out.others[gguf_name] = _type_name(t.ggml_type)
            continue
        k, n = t.shape  # GGUF lists dims innermost first
        raw = file.tensor_bytes(gguf_name, n * fmt.row_bytes(k))
        data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).reshape(n, -1)
        w = QuantWeight(fmt, n, k, data)
        if arch in _PERMUTING_ARCHITECTURES and ".attn_q." in gguf_name:
            w = w.rows(unpermute_rows(n, spec.num_heads))
        elif arch in _PERMUTING_ARCHITECTURES and ".attn_k." in gguf_name:
            w = w.rows(unpermute_rows(n, spec.num_kv_heads))
        out.quantized[name] = w
    return out


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"
