"""Attention over the paged KV cache for one engine step, and the choice of kernels.

A step's tokens come back to back: first the sequences with one new token (decodes, and
prefill chunks of length one), then the prefill chunks. ``AttentionMetadata`` describes
that layout; a backend turns it into kernel calls. ``TritonBackend`` runs on CUDA,
``TorchBackend`` everywhere else (with the fused C decode kernel when it compiled).

A quantised cache (``--kv-cache-dtype int8|fp8``) reaches a backend as
``kernels.kv_quant.QuantizedCache`` views (codes + scales) instead of float tensors; the
backends write and read those with the quantised kernels. Every attention then reads the
cache, a prefill chunk's own tokens included (dequantised), so the CPU and Triton paths
compute the same thing. (Where chunk boundaries fall inside a block still matters: a block
filled by two runs has its first rows rounded twice, see ``kernels.kv_quant``.)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kernels import kv_quant, reference
from kernels.kv_quant import QuantizedCache

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's chunk of new tokens within the step."""

    start: int  # first row of the chunk in the step's token batch
    num_new: int
    num_context: int  # tokens cached for the sequence after this step, new ones included
    row: int  # the sequence's row in ``AttentionMetadata.prefill_block_tables``

    @property
    def has_prefix(self) -> bool:
        return self.num_context > self.num_new


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    num_decode: int  # rows 0..num_decode-1 are single-token sequences
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decode] int32
    prefills: list[PrefillSpan]
    prefill_block_tables: torch.Tensor  # [len(prefills), max_blocks] int32
    prefill_query_start: torch.Tensor  # [len(prefills)+1] int32
    prefill_context_lens: torch.Tensor  # [len(prefills)] int32


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor | QuantizedCache,  # [NB, BS, KVH, D], written in place
        v_cache: torch.Tensor | QuantizedCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        """Store the new tokens' K/V in their slots, then attend for every new token."""
        ...


@dataclass(frozen=True, slots=True)
class _CacheOps:
    """The three cache operations of the CPU path, for one kind of cache."""

    write: Callable  # (k, v, k_cache, v_cache, slot_mapping) -> None
    decode: Callable  # (q, k_cache, v_cache, block_tables, context_lens, scale) -> out
    gather: Callable  # (cache, block_ids, num_tokens) -> [num_tokens, KVH, D]


@functools.cache
def _quantized_ops(fmt: kv_quant.KVQuant, use_c: bool) -> _CacheOps:
    """C kernels where they build (and are wanted), else the torch reference."""
    from kernels import cpu_attention, cpu_kv_cache

    if not use_c:
        return _CacheOps(kv_quant.write_kv, kv_quant.paged_decode_attention, kv_quant.gather_kv)
    c_cache = cpu_kv_cache.available()
    if not c_cache:
        log.info("quantised KV-cache C kernels unavailable; using the torch reference")
    decode = (cpu_attention.paged_decode_attention_quantized if cpu_attention.available(fmt)
              else kv_quant.paged_decode_attention)
    return _CacheOps(cpu_kv_cache.write_kv if c_cache else kv_quant.write_kv, decode,
                     cpu_kv_cache.gather_kv if c_cache else kv_quant.gather_kv)


_FIRST_BLOCK = torch.zeros(1, dtype=torch.int32)  # the table of K/V held as one block


class TorchBackend:
    """CPU path: the fused C kernels (or the reference) for decodes; for prefill chunks the
    C prefill kernel where it builds (AVX-512: in place over a float32 cache, over the
    gathered K/V of a quantised or half one), else SDPA."""

    def __init__(self, use_c_kernel: bool = True) -> None:
        self._use_c = use_c_kernel
        self._c_decode = _load_c_decode() if use_c_kernel else None
        self._float = _CacheOps(reference.write_kv, self._c_decode or reference.paged_decode_attention,
                                reference.gather_kv)
        self._c_prefill = _load_c_prefill() if use_c_kernel else None
        self.name = "torch+c" if self._c_decode else "torch"
        self.c_decode_f32 = self._c_decode is not None  # float32 decodes run the C kernel

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        quantized = isinstance(k_cache, QuantizedCache)
        ops = _quantized_ops(k_cache.fmt, self._use_c) if quantized else self._float
        ops.write(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            out[:nd] = ops.decode(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                  meta.decode_context_lens, scale)
        c_prefill = self._c_prefill is not None and self._c_prefill.prefill_supports(q.shape[-1])
        in_place = c_prefill and not quantized and k_cache.dtype is torch.float32
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.num_new)
            if in_place:  # reads the cache as it is: no gather, prefix or not
                out[rows] = self._c_prefill.paged_prefill_attention(
                    q[rows], k_cache, v_cache, meta.prefill_block_tables[span.row], span.num_context,
                    scale)
            elif span.has_prefix or quantized:
                ids = meta.prefill_block_tables[span.row]
                ks = ops.gather(k_cache, ids, span.num_context)
                vs = ops.gather(v_cache, ids, span.num_context)
                out[rows] = self._attend(q[rows], ks, vs, scale, c_prefill)
            else:
                out[rows] = self._attend(q[rows], k[rows], v[rows], scale, c_prefill)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                c_prefill: bool) -> torch.Tensor:  # q [Q, H, D], k/v [K, KVH, D] -> [Q, H, D]
        """Causal attention of q, the last Q of K positions, over contiguous K/V: the C
        prefill kernel where it runs (K/V as one cache block; 1.4-1.8x SDPA's speed from 256
        to 2,048 tokens on an AMX Xeon), else SDPA."""
        if not c_prefill:  # a half cache's K/V in q's dtype: SDPA takes one dtype
            return _sdpa(q, k.to(q.dtype), v.to(q.dtype), scale, prefix=k.shape[0] - q.shape[0])
        n, kvh, dim = k.shape
        one_block = lambda t: t.float().contiguous().view(1, n, kvh, dim)  # noqa: E731
        return self._c_prefill.paged_prefill_attention(
            q.contiguous(), one_block(k), one_block(v), _FIRST_BLOCK, n, scale)


class TritonBackend:
    """CUDA path: every operation is a Triton kernel."""

    name = "triton"

    def __init__(self) -> None:
        from kernels import triton_attention

        self._ops = triton_attention

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self._ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            out[:nd] = self._ops.paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
        if meta.prefills:
            out[nd:] = self._ops.paged_prefill_attention(
                q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start,
                meta.prefill_context_lens, scale)
        return out


def select_backend(device: torch.device) -> AttentionBackend:
    if device.type == "cuda":
        return TritonBackend()
    return TorchBackend()


def _sdpa(
    q: torch.Tensor,  # [Q, H, D]
    k: torch.Tensor,  # [K, KVH, D], K = prefix + Q
    v: torch.Tensor,
    scale: float,
    prefix: int,
) -> torch.Tensor:  # [Q, H, D]
    # Only 4-D inputs reach torch's fused CPU kernel; 3-D ones take the unfused math
    # path, 3-60x slower here.
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if prefix == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        visible = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(diagonal=prefix)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=scale,
                                             enable_gqa=True)
    return out[0].transpose(0, 1)


def _load_c_prefill():
    """``kernels.cpu_attention`` where its prefill kernel runs here, else None."""
    from kernels import cpu_attention

    if not cpu_attention.prefill_available():
        log.info("C prefill attention unavailable (%s); using SDPA",
                 cpu_attention.prefill_unavailable_reason())
        return None
    return cpu_attention


def _load_c_decode():
    try:
        from kernels import cpu_attention
    except ImportError:  # pragma: no cover - the module is part of the package
        return None
    if not cpu_attention.available():
        log.info("fused C decode kernel unavailable; using the torch reference")
        return None
    return cpu_attention.paged_decode_attention
