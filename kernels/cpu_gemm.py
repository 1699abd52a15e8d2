"""Loader and launcher of the CPU small-M float32 GEMM kernel (``kernels/cpu/small_gemm.c``).

``linear(x, weight, bias)`` is ``x @ weight.T + bias`` (``torch.nn.functional.linear``)
for a CPU float32 ``x`` [M, K] with few rows (decode: one per sequence) and an nn.Linear
weight [N, K], read in place, once, by a kernel that is bandwidth-bound at small M and
FMA-bound at large M; see the C file for the design and ``loadtest/cpu_gemm_bench.py``
for where it beats torch. The library is built on first use by ``kernels.cpu_build``
(about a second); ``available()`` says whether that worked, else callers use torch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch  # must be loaded before the kernel library, see kernels.cpu_build

from kernels import cpu_build

SOURCE = Path(__file__).parent / "cpu" / "small_gemm.c"
CFLAGS = cpu_build.CFLAGS

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# linear_f32(x, ldx, w, ldw, bias_or_null, y, ldy, M, N, K, num_threads) -> int
_ARGTYPES = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, ctypes.c_int]
_KEY = "f32"

_functions: dict[str, ctypes._CFuncPtr | None] = {}  # None: could not build
_reasons: dict[str, str] = {}
_f32 = torch.float32


def library_path() -> Path:
    """The build for this source, compiler and CPU (compiled if absent)."""
    return cpu_build.library_path(SOURCE, "small_gemm", CFLAGS)


def bind(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    """``linear_f32`` of ``lib`` with its C signature set."""
    fn = lib.linear_f32
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return fn


def _open() -> ctypes._CFuncPtr:
    return bind(cpu_build.load(library_path(), "CPU GEMM kernel"))


def _function() -> ctypes._CFuncPtr | None:
    fn = _functions.get(_KEY, _functions)  # the per-call fast path: no lock
    if fn is not _functions:
        return fn
    return cpu_build.load_once(_functions, _reasons, _KEY, _open, "CPU GEMM kernel")


def available() -> bool:
    """Whether the kernel could be built and loaded (compiles on the first call)."""
    return _function() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False, else None."""
    _function()
    return _reasons.get(_KEY)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """ValueError unless (x, weight, bias) are a CPU float32 linear's operands."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"want 2-d x and weight, got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns but weight rows have {weight.shape[1]}")
    if (
        x.dtype is not _f32
        or weight.dtype is not _f32
        or (bias is not None and bias.dtype is not _f32)
    ):
        got = f"x {x.dtype}, weight {weight.dtype}" + (
            f", bias {bias.dtype}" if bias is not None else ""
        )
        raise ValueError(f"want float32 tensors, got {got}")
    if not (x.is_cpu and weight.is_cpu and (bias is None or bias.is_cpu)):
        raise ValueError("the CPU kernel takes CPU tensors only")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not _rows_contiguous(weight):
        raise ValueError(f"weight rows must be contiguous, got strides {weight.stride()}")


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each row of 2-d ``t`` is contiguous and rows do not overlap (a stride only
    matters along a dim of more than one element)."""
    rows, cols = t.shape
    return (cols <= 1 or t.stride(1) == 1) and (rows <= 1 or t.stride(0) >= cols)


def linear(
    x: torch.Tensor,  # [M, K] float32; rows may be strided if each row is contiguous
    weight: torch.Tensor,  # [N, K] float32, rows contiguous (an nn.Linear weight)
    bias: torch.Tensor | None = None,  # [N] float32
    num_threads: int | None = None,  # default torch.get_num_threads()
) -> torch.Tensor:  # [M, N] float32, a new contiguous tensor
    """``x @ weight.T + bias`` (``F.linear``) by the C kernel: float32 accumulation in a
    different order than torch's (expect ~1e-6 relative differences). ``weight`` is read
    in place; its rows may be strided (a row slice of a bigger matrix) but each row must
    be contiguous. Not differentiable: for inference.

    Called once per projection per decode step, so the common case (contiguous float32
    CPU operands) is checked with as few tensor attribute reads as possible."""
    fn = _functions.get(_KEY) or _function()
    if fn is None:
        raise RuntimeError(f"CPU GEMM kernel unavailable: {_reasons[_KEY]}")
    if not (
        x.dtype is _f32
        and weight.dtype is _f32
        and x.dim() == 2
        and weight.dim() == 2
        and x.is_cpu
        and weight.is_cpu
        and weight.is_contiguous()
        and (bias is None or (bias.dtype is _f32 and bias.is_cpu and bias.dim() == 1))
    ):
        _check(x, weight, bias)  # raises, unless only weight's rows are strided
    m, k = x.shape
    n, kw = weight.shape
    if k != kw or (bias is not None and bias.shape[0] != n):
        _check(x, weight, bias)
    ldx = ldw = k
    if not x.is_contiguous():
        if _rows_contiguous(x):
            ldx = x.stride(0) if m > 1 else k
        else:
            x = x.contiguous()
    if not weight.is_contiguous() and n > 1:
        ldw = weight.stride(0)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    y = torch.empty((m, n), dtype=_f32)
    rc = fn(
        x.data_ptr(), ldx, weight.data_ptr(), ldw, None if bias is None else bias.data_ptr(),
        y.data_ptr(), n, m, n, k, num_threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"CPU GEMM kernel rejected the sizes or strides (rc {rc})")
    return y
