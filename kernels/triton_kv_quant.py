"""Triton cache write for the quantised KV cache (int8 / fp8 codes, per block and head scales).

Semantics and bit-exact oracle: ``kernels.kv_quant.write_kv`` (runs of consecutive tokens
in one block share a scale; a run that starts mid-block grows the block's scale and
requantises its earlier rows). One program per (token, kv head): the first token of each
run does the run's work and the others return, so the grid needs no host-side run list.
Codes are encoded with integer operations (round to nearest even, saturating), the same
on every target; ``tl.float8e4nv`` decodes fp8 codes (see ``kernels.triton_attention``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import KVQuant, QuantizedCache
from kernels.triton_attention import decode_codes

_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23, as in kernels.kv_quant
_QUANT = {KVQuant.INT8: 1, KVQuant.FP8: 2}


@triton.jit
def _encode(y, QUANT: tl.constexpr):
    """fp32 values already divided by their scale -> uint8 codes."""
    if QUANT == 1:
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        return ((y + _ROUND_MAGIC) - _ROUND_MAGIC).to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        sign = (y.to(tl.uint32, bitcast=True) >> 24) & 0x80
        a = tl.abs(y)
        sub = ((a * 512.0 + _ROUND_MAGIC) - _ROUND_MAGIC).to(tl.uint32)  # m * 2^-9
        mag = a.to(tl.uint32, bitcast=True)
        mag = mag + 0x7FFFF + ((mag >> 20) & 1)  # 23 mantissa bits to 3, ties to even
        normal = (mag >> 20) - (120 << 3)  # exponent bias 127 -> 7
        return (tl.where(a < 0.015625, sub, normal) | sign).to(tl.uint8)


@triton.jit
def _write_kernel(x_ptr, stride_xt, stride_xh, slot_ptr, num_tokens, codes_ptr, scales_ptr,
                  stride_cblock, stride_sblock, block_size, num_kv_heads,
                  HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  QUANT: tl.constexpr, QMAX: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    blk = slot // block_size
    prev = tl.load(slot_ptr + tl.maximum(token - 1, 0)).to(tl.int64)
    if (token > 0) & (prev // block_size == blk):
        return  # not the first token of its run
    first = (slot % block_size).to(tl.int32)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # The run: following tokens in the same block (at most block_size of them).
    run_tok = token + offs_s
    run_slot = tl.load(slot_ptr + run_tok, mask=run_tok < num_tokens, other=-1).to(tl.int64)
    same = (run_slot >= 0) & (run_slot // block_size == blk)
    n = tl.min(tl.where(same, BLOCK_S, offs_s), axis=0)  # first index outside the run
    in_run = offs_s < n
    mask = in_run[:, None] & d_mask[None, :]
    x_ptrs = x_ptr + run_tok.to(tl.int64)[:, None] * stride_xt + head * stride_xh + offs_d[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    need = tl.max(tl.max(tl.abs(x), axis=1), axis=0) / QMAX
    s_ptr = scales_ptr + blk * stride_sblock + head
    old = tl.load(s_ptr)
    new = tl.where(first == 0, need, tl.maximum(old, need))
    row_base = codes_ptr + blk * stride_cblock + head * HEAD_DIM
    row_stride = num_kv_heads * HEAD_DIM
    # Requantise the block's earlier rows when the scale grew.
    num_old = tl.where(new > old, first, 0)  # rows [0, first) when the scale grew
    old_mask = (offs_s < num_old)[:, None] & d_mask[None, :]
    old_ptrs = row_base + offs_s[:, None] * row_stride + offs_d[None, :]
    earlier = tl.load(old_ptrs, mask=old_mask, other=0)
    requant = _encode(tl.math.div_rn(decode_codes(earlier, QUANT) * old, new), QUANT)
    tl.store(old_ptrs, requant, mask=old_mask)
    tl.store(s_ptr, new)
    safe = tl.where(new > 0.0, new, 1.0)
    y = tl.where(new > 0.0, tl.math.div_rn(x, safe), 0.0)
    offsets = (run_slot % block_size).to(tl.int32)
    dst = row_base + offsets[:, None] * row_stride + offs_d[None, :]
    tl.store(dst, _encode(y, QUANT), mask=mask)


def _launch(x: torch.Tensor, cache: QuantizedCache, slots: torch.Tensor) -> None:
    codes, scales = cache.codes, cache.scales
    nb, bs, kvh, dim = codes.shape
    if x.dim() != 3 or x.shape[1:] != (kvh, dim) or x.stride(2) != 1:
        raise ValueError(f"rows must be [T, {kvh}, {dim}] with contiguous head_dim, got "
                         f"{tuple(x.shape)} {x.stride()}")
    if codes.dtype != torch.uint8 or codes.stride()[1:] != (kvh * dim, dim, 1):
        raise ValueError("codes must be uint8 with contiguous [BS, KVH, D]")
    if scales.dtype != torch.float32 or scales.shape != (nb, kvh) or scales.stride(1) != 1:
        raise ValueError(f"scales must be float32 [{nb}, {kvh}], kv heads contiguous")
    _write_kernel[(slots.shape[0], kvh)](
        x, x.stride(0), x.stride(1), slots, slots.shape[0], codes, scales,
        codes.stride(0), scales.stride(0), bs, kvh,
        HEAD_DIM=dim, BLOCK_S=triton.next_power_of_2(bs), BLOCK_D=triton.next_power_of_2(dim),
        QUANT=_QUANT[cache.fmt], QMAX=cache.fmt.qmax,
    )


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: QuantizedCache,
             v_cache: QuantizedCache, slot_mapping: torch.Tensor) -> None:
    """Quantise each token's key and value into its slot (in place).

    Slots must lie in ``[0, NB * BS)`` and ascend within each run; not checked on the device.
    """
    if slot_mapping.dim() != 1 or not slot_mapping.shape[0] == key.shape[0] == value.shape[0]:
        raise ValueError("slot_mapping must hold one slot per key/value row")
    if slot_mapping.shape[0] == 0:
        return
    devices = {t.device for t in (key, value, k_cache.codes, v_cache.codes, slot_mapping)}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    _launch(key, k_cache, slot_mapping)
    _launch(value, v_cache, slot_mapping)
