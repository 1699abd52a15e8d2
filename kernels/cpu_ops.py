"""Loader and launchers of the fused elementwise CPU kernels (``kernels/cpu/fused_ops.c``).

``add_rms_norm``, ``silu_mul`` and ``rope_qk`` are the elementwise steps of a Llama
layer in one pass each over CPU float32 tensors; their torch equivalents (the oracles)
are in ``common/model/llama.py``. ``argmax_rows`` is greedy sampling's pick (oracle:
``torch.argmax``). Built on first use by ``kernels.cpu_build``;
``available()`` says whether that worked, else the model keeps its torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch  # must be loaded before the kernel library, see kernels.cpu_build

from kernels import cpu_build

SOURCE = Path(__file__).parent / "cpu" / "fused_ops.c"
# No FMA contraction: the same roundings as the torch expressions they replace.
CFLAGS = (*cpu_build.CFLAGS, "-ffp-contract=off")

_i64, _ptr, _f = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_f32 = torch.float32


class Kernel(NamedTuple):
    add_rms_norm: ctypes._CFuncPtr
    silu_mul: ctypes._CFuncPtr
    rope_qk: ctypes._CFuncPtr
    argmax_rows: ctypes._CFuncPtr


def library_path() -> Path:
    """The build for this source, compiler and CPU (compiled if absent)."""
    return cpu_build.library_path(SOURCE, "fused_ops", CFLAGS)


def bind(lib: ctypes.CDLL) -> Kernel:
    """The entry points of ``lib`` with their C signatures set."""
    k = Kernel(lib.add_rms_norm_f32, lib.silu_mul_f32, lib.rope_qk_f32, lib.argmax_rows_f32)
    # add_rms_norm_f32(x, ldx, delta_or_null, ldd, weight, eps, out, ldo, T, C)
    k.add_rms_norm.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _f, _ptr, _i64, _i64, _i64]
    # silu_mul_f32(gu, ldg, out, ldo, T, I)
    k.silu_mul.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64]
    # rope_qk_f32(qkv, ldq, positions, cos, sin, max_pos, q, k, T, H, KVH, D)
    k.rope_qk.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64]
    # argmax_rows_f32(x, ldx, T, C, out)
    k.argmax_rows.argtypes = [_ptr, _i64, _i64, _i64, _ptr]
    for fn in k:
        fn.restype = ctypes.c_int
    return k


def _open(_variant: None) -> Kernel:
    return bind(cpu_build.load(library_path(), "fused CPU ops"))


_loader = cpu_build.Loader("fused CPU ops", _open)  # one variant: key None



def forget_builds() -> None:
    """Forget what was built or loaded, as in a new process (tests of the build path)."""
    _loader.reset()

def available() -> bool:
    """Whether the kernels could be built and loaded (compiles on the first call)."""
    return _loader.get(None) is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False, else None."""
    return _loader.reason(None)


def entry_points() -> Kernel:
    """The library's C functions (RuntimeError if it did not build), for C callers
    such as ``kernels.cpu_decode`` that take their addresses."""
    return _loader.require(None)


def _rows(t: torch.Tensor, name: str, cols: int | None = None) -> int:
    """The row stride of 2-d CPU float32 ``t`` with contiguous rows; ValueError otherwise."""
    if t.dim() != 2 or t.dtype is not _f32 or not t.is_cpu:
        raise ValueError(f"{name} must be a 2-d CPU float32 tensor, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name} has {t.shape[1]} columns, want {cols}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} rows must be contiguous, got strides {t.stride()}")
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``x += delta`` in place (skipped for None), then ``rms_norm(x) * weight`` as a new
    [T, C] tensor. x, delta: [T, C] with contiguous rows; weight [C] contiguous."""
    kernel = _loader.require(None)
    ldx = _rows(x, "x")
    t, c = x.shape
    ldd = 0 if delta is None else _rows(delta, "delta", c)
    if delta is not None and delta.shape[0] != t:
        raise ValueError(f"delta has {delta.shape[0]} rows, x {t}")
    if weight.shape != (c,) or weight.dtype is not _f32 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous float32 ({c},) tensor")
    out = torch.empty((t, c), dtype=_f32)
    rc = kernel.add_rms_norm(x.data_ptr(), ldx, None if delta is None else delta.data_ptr(), ldd,
                             weight.data_ptr(), eps, out.data_ptr(), c, t, c)
    if rc != 0:
        raise ValueError(f"add_rms_norm rejected the sizes (rc {rc})")
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for [T, 2I] ``gate_up`` → [T, I]."""
    kernel = _loader.require(None)
    ldg = _rows(gate_up, "gate_up")
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"gate_up needs an even number of columns, got {two_i}")
    out = torch.empty((t, two_i // 2), dtype=_f32)
    if kernel.silu_mul(gate_up.data_ptr(), ldg, out.data_ptr(), two_i // 2, t, two_i // 2) != 0:
        raise ValueError("silu_mul rejected the sizes")
    return out


def rope_qk(
    qkv: torch.Tensor,  # [T, >= (H + KVH) * D]: q heads, then k heads, then anything
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [max_pos, D]: (cos, cos)
    sin: torch.Tensor,  # [max_pos, D]: (-sin, sin)
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, H, D], k [T, KVH, D], contiguous
    """Rotary embedding of the q and k heads of fused qkv rows (``apply_rope``)."""
    kernel = _loader.require(None)
    ldq = _rows(qkv, "qkv")
    max_pos, d = cos.shape
    t = qkv.shape[0]
    if sin.shape != cos.shape or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos and sin must be contiguous tables of one shape")
    if cos.dtype is not _f32 or sin.dtype is not _f32:
        raise ValueError("cos and sin must be float32")
    if (positions.dtype is not torch.int64 or positions.shape != (t,)
            or not positions.is_contiguous()):
        raise ValueError(f"positions must be a contiguous int64 ({t},) tensor")
    if qkv.shape[1] < (num_heads + num_kv_heads) * d:
        raise ValueError(f"qkv rows hold {qkv.shape[1]} values, fewer than "
                         f"{num_heads + num_kv_heads} heads of {d}")
    q = torch.empty((t, num_heads, d), dtype=_f32)
    k = torch.empty((t, num_kv_heads, d), dtype=_f32)
    rc = kernel.rope_qk(qkv.data_ptr(), ldq, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                        max_pos, q.data_ptr(), k.data_ptr(), t, num_heads, num_kv_heads, d)
    if rc != 0:
        raise ValueError("rope_qk rejected the sizes or a position is out of the tables' range")
    return q, k


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a [T, C] CPU float32 tensor with contiguous rows, as int64
    [T]: the first of equal maxima, a row's first NaN where it has one (torch's answer)."""
    kernel = _loader.require(None)
    ldx = _rows(x, "x")
    t, c = x.shape
    if c == 0:
        raise ValueError("argmax of an empty row")
    out = torch.empty(t, dtype=torch.int64)
    if kernel.argmax_rows(x.data_ptr(), ldx, t, c, out.data_ptr()) != 0:
        raise ValueError(f"argmax_rows: bad sizes {tuple(x.shape)}")
    return out
