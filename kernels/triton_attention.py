"""Triton kernels for the attention hot path over the paged KV cache.

This module owns the GPU versions of the three operations whose semantics are defined by
``kernels/reference.py`` (the oracle the tests compare against): ``write_kv``,
``paged_decode_attention`` and ``paged_prefill_attention``. Each public function has the
reference's signature and is a thin launcher: it validates shapes, dtypes and strides
(raising ``ValueError``), then starts one ``@triton.jit`` kernel.

Cache views are ``[num_blocks, block_size, num_kv_heads, head_dim]``. The inner three dims
must be contiguous; the block dim may be strided, as it is for a layer's slice
``kv[:, layer, 0]`` of the runner's ``[num_blocks, num_layers, 2, block_size, kv_heads,
head_dim]`` tensor. Both attention kernels walk keys in tiles of ``BLOCK_N`` positions that
may span several cache blocks, so ``tl.dot`` always gets >= 16 keys whatever the block size,
and use an fp32 online softmax.

A quantised cache (``kernels.kv_quant.QuantizedCache``: uint8 codes + per block, per kv
head fp32 scales) is accepted wherever a cache is: the attention kernels widen its codes
in registers (int8 as integers, fp8 through ``tl.float8e4nv``), multiply by the key's
block scale and continue in the query's dtype; ``write_kv`` hands it to
``kernels.triton_kv_quant``.

Importing this module compiles and launches nothing, so it is safe without a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.kv_quant import KVQuant, QuantizedCache

_LOG2E = 1.4426950408889634
_MIN_DOT = 16  # every tl.dot dimension must be >= 16 on GPU
_BLOCK_N = 64  # keys per inner step (halved for fp32, whose tiles take twice the SRAM)
_PREFILL_BLOCK_M = 64  # rows per program: query tokens x query heads of one kv group
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------------------
# Shared device code
# ---------------------------------------------------------------------------------------


@triton.jit
def ieee_dot(a, b, IEEE: tl.constexpr):
    """tl.dot; float32 operands (IEEE) in full precision."""
    # fp32 must not silently drop to tf32, or GPU results drift ~1e-3 from the reference.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def decode_codes(c, QUANT: tl.constexpr):
    """uint8 cache codes -> fp32 values before scaling (QUANT: 1 int8, 2 fp8 e4m3)."""
    if QUANT == 1:
        return c.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        return c.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _attend_rows(
    q,  # [BLOCK_M, BLOCK_D], cache dtype
    q_pos,  # [BLOCK_M] int: row r sees key positions 0..q_pos[r]
    k_ptr,  # cache base, already offset to this kv head
    v_ptr,
    table_ptr,  # this sequence's row of the block table
    stride_table,
    stride_block,
    num_keys,  # positions to visit; keys at or past it are never read
    block_size,
    token_stride,  # num_kv_heads * head_dim
    qk_scale,  # softmax scale * log2(e): exp2 is cheaper than exp
    ks_ptr,  # quantised caches: K scales, already offset to this kv head (else unused)
    vs_ptr,
    stride_sblock,  # elements between two blocks' scales
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    QUANT: tl.constexpr,  # 0 float cache, 1 int8 codes, 2 fp8 codes
):
    """Online-softmax attention of a row tile over one sequence's paged keys.

    Returns the unnormalised fp32 accumulator [BLOCK_M, BLOCK_D] and row sums [BLOCK_M].
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, num_keys, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N]
        in_ctx = pos < num_keys
        # Table entries past the sequence's blocks may be garbage: never read them.
        block = tl.load(table_ptr + (pos // block_size) * stride_table, mask=in_ctx, other=0)
        kv_off = block.to(tl.int64) * stride_block + (pos % block_size) * token_stride
        kv_mask = in_ctx[:, None] & d_mask[None, :]
        kv_ptrs = kv_off[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
        k = tl.load(k_ptr + kv_ptrs, mask=kv_mask, other=0)
        v = tl.load(v_ptr + kv_ptrs, mask=kv_mask, other=0)
        if QUANT != 0:  # dequantise in registers: codes * their block's scale
            s_off = block.to(tl.int64) * stride_sblock
            ks = tl.load(ks_ptr + s_off, mask=in_ctx, other=0.0)
            vs = tl.load(vs_ptr + s_off, mask=in_ctx, other=0.0)
            k = (decode_codes(k, QUANT) * ks[:, None]).to(q.dtype)
            v = (decode_codes(v, QUANT) * vs[:, None]).to(q.dtype)

        s = ieee_dot(q, tl.trans(k), IEEE) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (pos[None, :] <= q_pos[:, None]) & in_ctx[None, :]
        s = tl.where(visible, s, float("-inf"))
        # Every row (padding included) sees position 0 in the first tile, so m_new is
        # finite from then on and exp2 never meets -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + ieee_dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return acc, l_i


@triton.jit
def _normalise(acc, l_i):
    # An empty context gives l == 0; the reference returns zeros there, not NaN.
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]


# ---------------------------------------------------------------------------------------
# write_kv
# ---------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_block,
    block_size,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    dst = (
        (slot // block_size) * stride_block
        + (slot % block_size) * (num_kv_heads * HEAD_DIM)
        + offs_h[:, None] * HEAD_DIM
        + offs_d[None, :]
    )
    k_src = key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    v_src = value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    k = tl.load(k_src, mask=mask)
    v = tl.load(v_src, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int
) -> None:
    """Store each token's key and value into its cache slot (in place).

    Slots must lie in ``[0, NB * BS)``; they are not range-checked on the device.
    """
    if isinstance(k_cache, QuantizedCache):
        from kernels import triton_kv_quant

        return triton_kv_quant.write_kv(key, value, k_cache, v_cache, slot_mapping)
    _check_cache(k_cache, v_cache)
    _check_index("slot_mapping", slot_mapping, 1)
    _, _, num_kv_heads, head_dim = k_cache.shape
    num_tokens = slot_mapping.shape[0]
    for name, t in (("key", key), ("value", value)):
        _check_rows(name, t, num_tokens, num_kv_heads, head_dim, "[T, KVH, D]")
    _check_device(k_cache, key, value, slot_mapping)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.shape[1],
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


# ---------------------------------------------------------------------------------------
# Decode: one query per sequence
# ---------------------------------------------------------------------------------------


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    tables_ptr,
    context_lens_ptr,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_tb,
    stride_tn,
    stride_block,
    block_size,
    num_kv_heads,
    qk_scale,
    ks_ptr,
    vs_ptr,
    stride_sblock,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    QUANT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g  # [BLOCK_G]
    mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_G, BLOCK_D]
    q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask, other=0.0)
    # The query sits at the last cached position, so it sees the whole context.
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + (context_len - 1)
    acc, l_i = _attend_rows(
        q,
        q_pos,
        k_cache_ptr + kv_head * HEAD_DIM,
        v_cache_ptr + kv_head * HEAD_DIM,
        tables_ptr + seq * stride_tb,
        stride_tn,
        stride_block,
        context_len,
        block_size,
        num_kv_heads * HEAD_DIM,
        qk_scale,
        ks_ptr + kv_head,
        vs_ptr + kv_head,
        stride_sblock,
        HEAD_DIM,
        BLOCK_G,
        BLOCK_N,
        BLOCK_D,
        IEEE,
        QUANT,
    )
    out = _normalise(acc, l_i)
    o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], one query per sequence, at position context_lens-1
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int; entries past a sequence's blocks are ignored
    context_lens: torch.Tensor,  # [B] int, tokens in cache including the query's own
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Each query attends to every cached position of its sequence."""
    c = _cache_args(q, k_cache, v_cache)
    k_cache, v_cache = c.k, c.v
    group = _check_attention(q, k_cache, v_cache, quantized=c.quant != 0)
    num_seqs = q.shape[0]
    _check_index("block_tables", block_tables, 2, num_seqs)
    _check_index("context_lens", context_lens, 1, num_seqs)
    _check_device(q, block_tables, context_lens)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    _decode_kernel[(num_seqs, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        context_lens,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        block_tables.stride(1),
        k_cache.stride(0),
        k_cache.shape[1],
        num_kv_heads,
        float(scale) * _LOG2E,
        c.k_scales,
        c.v_scales,
        c.scale_stride,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(_MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_N=_block_n(q.dtype),
        BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
        IEEE=q.dtype == torch.float32,
        QUANT=c.quant,
    )
    return out


# ---------------------------------------------------------------------------------------
# Prefill: causal attention of each sequence's new tokens
# ---------------------------------------------------------------------------------------


@triton.jit
def _find_sequence(query_start_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence s owns the tiles [query_start[s] // BLOCK_Q + s, query_start[s+1] // BLOCK_Q + s]:
    # binary-search the last s whose first tile is <= tile.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    tables_ptr,
    query_start_ptr,
    context_lens_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_tb,
    stride_tn,
    stride_block,
    block_size,
    num_seqs,
    num_kv_heads,
    qk_scale,
    ks_ptr,
    vs_ptr,
    stride_sblock,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows: BLOCK_Q tokens x GROUP heads, padded
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    QUANT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_ptr, tile, num_seqs, BLOCK_Q)
    if seq < 0:  # only when query_start[0] > 0: tiles before it belong to no sequence
        return
    q_begin = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_begin
    local_tile = tile - (q_begin // BLOCK_Q + seq)
    # The grid gives every sequence one spare tile so it can be sized without a host sync.
    if local_tile * BLOCK_Q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    prefix = context_len - q_len  # positions cached before this chunk

    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    token = local_tile * BLOCK_Q + rows // GROUP  # [BLOCK_M], index within the chunk
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (token < q_len)
    mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_M, BLOCK_D]
    q_rows = (q_begin + token).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask, other=0.0)
    # Causal limit: the tile's last token sees up to its own position, never past the context.
    num_keys = tl.minimum(context_len, prefix + (local_tile + 1) * BLOCK_Q)
    acc, l_i = _attend_rows(
        q,
        prefix + token,
        k_cache_ptr + kv_head * HEAD_DIM,
        v_cache_ptr + kv_head * HEAD_DIM,
        tables_ptr + seq.to(tl.int64) * stride_tb,
        stride_tn,
        stride_block,
        num_keys,
        block_size,
        num_kv_heads * HEAD_DIM,
        qk_scale,
        ks_ptr + kv_head,
        vs_ptr + kv_head,
        stride_sblock,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        IEEE,
        QUANT,
    )
    out = _normalise(acc, l_i)
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D], the new tokens of all sequences, back to back
    k_cache: torch.Tensor,  # [NB, BS, KVH, D], already holding the new tokens' K/V
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int
    query_start: torch.Tensor,  # [S+1] int, q rows of sequence s are query_start[s]:query_start[s+1]
    context_lens: torch.Tensor,  # [S] int, cached tokens of s including its new ones
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's new tokens over its whole paged context.

    The new tokens are the last ``q_len`` positions of the context, so a query at
    position p sees keys 0..p: the cached prefix and the new tokens up to itself.
    """
    c = _cache_args(q, k_cache, v_cache)
    k_cache, v_cache = c.k, c.v
    group = _check_attention(q, k_cache, v_cache, quantized=c.quant != 0)
    _check_index("context_lens", context_lens, 1)
    num_seqs = context_lens.shape[0]
    _check_index("block_tables", block_tables, 2, num_seqs)
    _check_index("query_start", query_start, 1, num_seqs + 1)
    _check_device(q, block_tables, query_start, context_lens)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    block_m = max(_PREFILL_BLOCK_M, triton.next_power_of_2(group))
    block_q = block_m // group
    # Sequence s gets query_start[s+1] // BLOCK_Q - query_start[s] // BLOCK_Q + 1 tiles,
    # enough for its q_len rows; the total is bounded by T // BLOCK_Q + S.
    num_tiles = q.shape[0] // block_q + num_seqs
    _prefill_kernel[(num_tiles, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start,
        context_lens,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        block_tables.stride(1),
        k_cache.stride(0),
        k_cache.shape[1],
        num_seqs,
        num_kv_heads,
        float(scale) * _LOG2E,
        c.k_scales,
        c.v_scales,
        c.scale_stride,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=_block_n(q.dtype),
        BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
        IEEE=q.dtype == torch.float32,
        QUANT=c.quant,
    )
    return out


def _block_n(dtype: torch.dtype) -> int:
    return _BLOCK_N // 2 if dtype == torch.float32 else _BLOCK_N


# ---------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------


class _CacheArgs(NamedTuple):
    k: torch.Tensor  # the cache tensors the kernels index (codes for a quantised cache)
    v: torch.Tensor
    k_scales: torch.Tensor  # [NB, KVH] fp32; the K cache itself when unquantised (unread)
    v_scales: torch.Tensor
    scale_stride: int
    quant: int  # the kernels' QUANT: 0 float, 1 int8, 2 fp8


_QUANT_CODE = {KVQuant.INT8: 1, KVQuant.FP8: 2}


def _cache_args(q: torch.Tensor, k_cache, v_cache) -> _CacheArgs:
    if not isinstance(k_cache, QuantizedCache):
        return _CacheArgs(k_cache, v_cache, k_cache, v_cache, 0, 0)
    if not isinstance(v_cache, QuantizedCache) or v_cache.fmt is not k_cache.fmt:
        raise ValueError("k and v caches must share one quantised format")
    ks, vs = k_cache.scales, v_cache.scales
    nb, kvh = k_cache.shape[0], k_cache.shape[2]
    for t in (ks, vs):
        if t.shape != (nb, kvh) or t.dtype != torch.float32 or t.stride(1) != 1:
            raise ValueError(f"scales must be float32 [{nb}, {kvh}], kv heads contiguous")
    if ks.stride() != vs.stride():
        raise ValueError("k and v scales must share strides")
    _check_device(q, ks, vs)
    return _CacheArgs(k_cache.codes, v_cache.codes, ks, vs, ks.stride(0), _QUANT_CODE[k_cache.fmt])


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, quantized: bool = False) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [NB, BS, KVH, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(
            f"v_cache must match k_cache in shape and strides: got {tuple(v_cache.shape)} "
            f"{v_cache.stride()} vs {tuple(k_cache.shape)} {k_cache.stride()}"
        )
    allowed = (torch.uint8,) if quantized else _FLOAT_DTYPES
    if v_cache.dtype != k_cache.dtype or k_cache.dtype not in allowed:
        raise ValueError(
            f"caches must share one dtype of {_FLOAT_DTYPES}, got {k_cache.dtype}/{v_cache.dtype}"
        )
    _, _, kv_heads, head_dim = k_cache.shape
    if min(k_cache.shape[1:]) == 0:
        raise ValueError(f"cache dims [BS, KVH, D] must be non-empty, got {tuple(k_cache.shape)}")
    inner = (kv_heads * head_dim, head_dim, 1)
    # The kernels derive the inner strides from the shape; a size-1 dim's stride is moot.
    sizes, strides = k_cache.shape[1:], k_cache.stride()[1:]
    if any(n > 1 and got != want for n, got, want in zip(sizes, strides, inner, strict=True)):
        raise ValueError(
            f"cache inner dims [BS, KVH, D] must be contiguous (strides {inner}), "
            f"got strides {strides}"
        )
    if v_cache.device != k_cache.device:
        raise ValueError(f"k_cache on {k_cache.device} but v_cache on {v_cache.device}")


def _check_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     quantized: bool = False) -> int:
    """Validate q against the caches; returns the GQA group size H // KVH."""
    _check_cache(k_cache, v_cache, quantized)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [tokens, H, D], got shape {tuple(q.shape)}")
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if q.shape[1] == 0 or q.shape[1] % num_kv_heads:
        raise ValueError(
            f"num_heads {q.shape[1]} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    if q.dtype not in _FLOAT_DTYPES or (not quantized and q.dtype != k_cache.dtype):
        raise ValueError(f"q dtype {q.dtype} must equal cache dtype {k_cache.dtype}")
    if q.stride(2) != 1:
        raise ValueError(f"q head_dim must be contiguous, got strides {q.stride()}")
    _check_device(k_cache, q)
    return q.shape[1] // num_kv_heads


def _check_rows(
    name: str, t: torch.Tensor, num_tokens: int, kv_heads: int, head_dim: int, layout: str
) -> None:
    if t.dim() != 3 or t.shape[1:] != (kv_heads, head_dim) or t.shape[0] != num_tokens:
        raise ValueError(
            f"{name} must be {layout} = [{num_tokens}, {kv_heads}, {head_dim}], "
            f"got {tuple(t.shape)}"
        )
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} dtype must be one of {_FLOAT_DTYPES}, got {t.dtype}")
    if t.stride(2) != 1:
        raise ValueError(f"{name} head_dim must be contiguous, got strides {t.stride()}")


def _check_index(name: str, t: torch.Tensor, dim: int, rows: int | None = None) -> None:
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows, got shape {tuple(t.shape)}")


def _check_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def interpreted() -> bool:
    """True when the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_decode_kernel, InterpretedFunction)
