"""Tiny random-weight Llama GGUF files, written the way llama.cpp's converter lays them out.

Projections are quantised by ``gguf.quants.quantize`` (``proj``; single tensors may take
other types through ``overrides``), the embedding is Q8_0 as in the default model, norms
are F32, and ``attn_q``/``attn_k`` rows are in llama.cpp's permuted order (transformers and
our loader both undo it). The tokenizer is a small byte-level BPE (256 byte tokens, 100
merges, three specials), so the files are a few hundred KB and parse fast.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from transformers.convert_slow_tokenizer import bytes_to_unicode

Q = GGMLQuantizationType


def _tokenizer(writer: GGUFWriter) -> int:
    chars = list(bytes_to_unicode().values())
    merges = [f"{chars[i]} {chars[i + 1]}" for i in range(0, 200, 2)]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *chars, *(m.replace(" ", "") for m in merges)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    return len(tokens)


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF row order → llama.cpp's (the converter's permutation of Q and K)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, proj: Q, embed: Q = Q.Q8_0, tied: bool = True,
                    overrides: dict[str, Q] | None = None, seed: int = 0, hidden: int = 64,
                    intermediate: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2) -> Path:
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 1024),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, intermediate),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-5),
                       (writer.add_rope_dimension_count, hidden // heads)):  # fmt: skip
        add(value)
    vocab = _tokenizer(writer)
    writer.add_vocab_size(vocab)

    def matrix(name: str, rows: int, cols: int, qtype: Q, permute_heads: int = 0) -> None:
        qtype = (overrides or {}).get(name, qtype)
        w = (rng.standard_normal((rows, cols)) * 0.5).astype(np.float32)  # peaked logits
        if permute_heads:
            w = _llama_permute(w, permute_heads)
        writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    head_dim = hidden // heads
    matrix("token_embd.weight", vocab, hidden, embed)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", vocab, hidden, proj)
    for i in range(layers):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight")
        norm(b + "ffn_norm.weight")
        matrix(b + "attn_q.weight", heads * head_dim, hidden, proj, permute_heads=heads)
        matrix(b + "attn_k.weight", kv_heads * head_dim, hidden, proj, permute_heads=kv_heads)
        matrix(b + "attn_v.weight", kv_heads * head_dim, hidden, proj)
        matrix(b + "attn_output.weight", hidden, heads * head_dim, proj)
        matrix(b + "ffn_gate.weight", intermediate, hidden, proj)
        matrix(b + "ffn_up.weight", intermediate, hidden, proj)
        matrix(b + "ffn_down.weight", hidden, intermediate, proj)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
