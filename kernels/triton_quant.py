"""Quantised weights on the Triton path (CUDA): ``--quantization gguf|int8`` off the CPU.

The weight is a ``QuantWeight`` moved to the device as it is (``to_device``): a GGUF
file's own Q8_0 / Q4_0 / Q4_1 rows (or per-row int8 and its fp32 scales), never
dequantised in memory. ``linear`` computes ``x @ W.dequantize().T (+ bias)``: one program per tile of
BLOCK_M rows of x by BLOCK_N rows of W, stepping along K one 32-weight block at a time;
each block's scales and quants are loaded as bytes and dequantised in registers exactly
as ``QuantWeight.dequantize`` (and gguf) does (f16 d, then d*q, + m for Q4_1; d*q is
exact in float32, so a fused multiply-add rounds the same), then multiplied with
``tl.dot``: float32 accumulation, IEEE (never tf32) for float32 activations, so results
match the reference to float32 summation order. INT8_ROW applies its row scale once at
the end, as the CPU kernel does.

``embedding`` gathers rows and dequantises them with the reference (plain torch, any
device). Oracle for both: ``kernels.quant_formats``; tests run the kernel in Triton's
interpreter on the CPU (``tests/test_triton_quant.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_formats import QuantFormat, QuantWeight
from kernels.triton_attention import ieee_dot

_FMT = {QuantFormat.Q8_0: 0, QuantFormat.Q4_0: 1, QuantFormat.Q4_1: 2, QuantFormat.INT8_ROW: 3}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK_N = 64  # rows of W per program
_MIN_DOT = 16  # every tl.dot dimension must be >= 16 on GPU


def to_device(w: QuantWeight, device: torch.device | str) -> QuantWeight:
    """``w`` with its bytes (and scales) on ``device``, contiguous, unchanged."""
    scales = None if w.scales is None else w.scales.to(device=device, dtype=torch.float32).contiguous()
    return QuantWeight(w.fmt, w.n, w.k, w.data.to(device).contiguous(), scales)


@triton.jit
def _half(lo, hi):
    """Two bytes (little-endian) of an IEEE half -> float32."""
    bits = lo.to(tl.uint16) | (hi.to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_block(w_ptr, rows, kb, rk, n_mask, FMT: tl.constexpr):
    """Block kb (32 weights along K) of W's rows ``rows`` as float32 [32, BLOCK_N]
    (INT8_ROW: the int8 values, its scale applied by the caller)."""
    mask = n_mask[None, :]
    if FMT == 3:
        q = tl.load(w_ptr + rows[None, :] + kb * 32 + rk[:, None], mask=mask, other=0)
        return q.to(tl.int8, bitcast=True).to(tl.float32)
    if FMT == 0:
        base = rows + kb * 34
    elif FMT == 1:
        base = rows + kb * 18
    else:
        base = rows + kb * 20
    d = _half(tl.load(w_ptr + base, mask=n_mask, other=0), tl.load(w_ptr + base + 1, mask=n_mask, other=0))
    if FMT == 0:
        q = tl.load(w_ptr + base[None, :] + 2 + rk[:, None], mask=mask, other=0)
        return q.to(tl.int8, bitcast=True).to(tl.float32) * d[None, :]
    # Q4: byte j holds weight j (low nibble) and weight j + 16 (high nibble)
    first = 4 if FMT == 2 else 2
    byte = tl.load(w_ptr + base[None, :] + first + (rk[:, None] % 16), mask=mask, other=0)
    q = ((byte >> ((rk[:, None] // 16) * 4).to(tl.uint8)) & 15).to(tl.float32)
    if FMT == 1:
        return (q - 8.0) * d[None, :]
    m = _half(tl.load(w_ptr + base + 2, mask=n_mask, other=0), tl.load(w_ptr + base + 3, mask=n_mask, other=0))
    return d[None, :] * q + m[None, :]


@triton.jit
def _quant_linear_kernel(x_ptr, stride_xm, w_ptr, stride_wn, s_ptr, b_ptr, y_ptr, stride_ym,
                         M, N, K, FMT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 32)
    m_mask = rm < M
    n_mask = rn < N
    rows = rn.to(tl.int64) * stride_wn  # byte offset of each W row
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // 32):
        x = tl.load(x_rows + kb * 32 + rk[None, :], mask=m_mask[:, None], other=0.0)  # [BM, 32]
        w = _dequant_block(w_ptr, rows, kb, rk, n_mask, FMT)  # [32, BN]
        acc += ieee_dot(x, w.to(x.dtype), IEEE)
    if FMT == 3:
        acc = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def linear(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32, rows contiguous
    w: QuantWeight,  # on x's device (to_device)
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ w.dequantize().T + bias`` with the weight dequantised in registers."""
    if not isinstance(w, QuantWeight):
        raise ValueError(f"want a QuantWeight (triton_quant.to_device), got {type(w).__name__}")
    if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] == w.k and x.dtype in _FLOAT_DTYPES):
        raise ValueError(f"x must be a float tensor [M, {w.k}], got {getattr(x, 'dtype', type(x))} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if x.device != w.data.device:
        raise ValueError(f"x is on {x.device}, the weight on {w.data.device}")
    if bias is not None and (bias.shape != (w.n,) or bias.device != x.device):
        raise ValueError(f"bias must be [{w.n}] on {x.device}, got {tuple(bias.shape)} on {bias.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty((m, w.n), dtype=x.dtype, device=x.device)
    if m == 0 or w.n == 0:
        return y
    block_m = _MIN_DOT if m <= _MIN_DOT else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(w.n, _BLOCK_N))
    scales = w.scales if w.scales is not None else w.data  # a placeholder pointer when unused
    _quant_linear_kernel[grid](
        x, x.stride(0), w.data, w.data.stride(0), scales, bias if bias is not None else x, y, y.stride(0),
        m, w.n, w.k, FMT=_FMT[w.fmt], HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N)
    return y


def embedding(w: QuantWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``ids`` of ``w`` dequantised (bit-exact to ``QuantWeight.dequantize``): [T, K]."""
    if ids.dim() != 1 or ids.dtype != torch.long:
        raise ValueError(f"want long ids of shape [T], got {ids.dtype} {tuple(ids.shape)}")
    if bool(((ids < 0) | (ids >= w.n)).any()):  # one host sync a step, not two
        raise ValueError(f"token ids must lie in [0, {w.n})")
    return w.rows(ids.to(w.data.device)).dequantize().to(dtype)


__all__ = ["embedding", "linear", "to_device"]
