"""Loader and launcher of the CPU float32 GEMM kernel (``kernels/cpu/packed_gemm.c``).

``pack(weight)`` repacks an nn.Linear weight [N, K] once (at model load) into the
kernel's panel layout; ``linear(x, packed, bias)`` is then ``x @ weight.T + bias``
(``torch.nn.functional.linear``) for a CPU float32 ``x`` [M, K] of any number of rows:
decode steps (bandwidth-bound, every weight read once) and prefill chunks (FMA-bound).
See the C file for the design and ``loadtest/cpu_gemm_bench.py`` for where it beats
torch. The library is built on first use by ``kernels.cpu_build`` (about a second);
``available()`` says whether that worked, else callers use torch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch  # must be loaded before the kernel library, see kernels.cpu_build

from kernels import cpu_build, cpu_memory

SOURCE = Path(__file__).parent / "cpu" / "packed_gemm.c"
CFLAGS = cpu_build.CFLAGS

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# packed_linear_f32(x, ldx, packed, bias_or_null, y, ldy, M, N, K, num_threads) -> int
_ARGTYPES = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, ctypes.c_int]
_f32 = torch.float32


def library_path() -> Path:
    """The build for this source, compiler and CPU (compiled if absent)."""
    return cpu_build.library_path(SOURCE, "packed_gemm", CFLAGS)


class Kernel(NamedTuple):
    """The library's entry points, C signatures set."""

    linear: ctypes._CFuncPtr  # packed_linear_f32
    pack: ctypes._CFuncPtr  # pack_f32(w, ldw, N, K, out) -> int
    packed_size: ctypes._CFuncPtr  # packed_size_f32(N, K) -> floats


def bind(lib: ctypes.CDLL) -> Kernel:
    """The entry points of ``lib`` with their C signatures set."""
    k = Kernel(lib.packed_linear_f32, lib.pack_f32, lib.packed_size_f32)
    k.linear.argtypes, k.linear.restype = _ARGTYPES, ctypes.c_int
    k.pack.argtypes, k.pack.restype = [_ptr, _i64, _i64, _i64, _ptr], ctypes.c_int
    k.packed_size.argtypes, k.packed_size.restype = [_i64, _i64], _i64
    return k


def _open(_variant: None) -> Kernel:
    return bind(cpu_build.load(library_path(), "CPU GEMM kernel"))


_loader = cpu_build.Loader("CPU GEMM kernel", _open)  # one variant: key None



def forget_builds() -> None:
    """Forget what was built or loaded, as in a new process (tests of the build path)."""
    _loader.reset()

def available() -> bool:
    """Whether the kernel could be built and loaded (compiles on the first call)."""
    return _loader.get(None) is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False, else None."""
    return _loader.reason(None)


def entry_points() -> Kernel:
    """The library's C functions (RuntimeError if it did not build), for C callers
    such as ``kernels.cpu_decode`` that take their addresses."""
    return _loader.require(None)


def check_operand(x: torch.Tensor, k: int) -> None:
    """ValueError unless ``x`` is a CPU float32 [M, k] operand (this kernel's, and the
    quantised one's in ``kernels.cpu_quant``)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"want a 2-d x, got shape {tuple(getattr(x, 'shape', ()))}")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns but weight rows have {k}")
    if x.dtype is not _f32:
        raise ValueError(f"want float32 x, got {x.dtype}")
    if not x.is_cpu:
        raise ValueError("the CPU kernel takes CPU tensors only")


def row_operand(x: torch.Tensor, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """(x, its row stride, bias) as the kernels take them: rows may be strided apart (a
    slice of a wider tensor is not copied), each row and the bias contiguous."""
    m, k = x.shape
    ldx = k
    if not x.is_contiguous():
        if _rows_contiguous(x):
            ldx = x.stride(0) if m > 1 else k
        else:
            x = x.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    return x, ldx, bias


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each row of 2-d ``t`` is contiguous and rows do not overlap (a stride only
    matters along a dim of more than one element)."""
    rows, cols = t.shape
    return (cols <= 1 or t.stride(1) == 1) and (rows <= 1 or t.stride(0) >= cols)


class PackedWeight:
    """An nn.Linear weight [N, K] in the kernel's panel layout (see the C file): packed
    once, at model load, and multiplied by ``linear`` as often as needed. The packed
    copy is all the kernel reads; the caller may free the original."""

    __slots__ = ("data", "shape")

    def __init__(self, data: torch.Tensor, shape: tuple[int, int]) -> None:
        self.data, self.shape = data, shape

    def __repr__(self) -> str:
        return f"PackedWeight(shape={self.shape})"


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> PackedWeight:
    """``weight`` [N, K] (CPU float32, rows contiguous) repacked for ``linear``, into
    ``out`` (contiguous float32, ``packed_size(N, K)`` elements) or a new buffer."""
    kernel = _loader.require(None)
    if weight.dim() != 2:
        raise ValueError(f"want a 2-d weight, got shape {tuple(weight.shape)}")
    if weight.dtype is not _f32 or not weight.is_cpu:
        raise ValueError(f"want a CPU float32 weight, got {weight.dtype} on {weight.device}")
    if not _rows_contiguous(weight):
        raise ValueError(f"weight rows must be contiguous, got strides {weight.stride()}")
    n, k = weight.shape
    size = packed_size(n, k)
    if out is None:
        out = torch.empty(size, dtype=_f32)
    elif out.dtype is not _f32 or out.numel() != size or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of {size} elements")
    ldw = weight.stride(0) if n > 1 else k
    if kernel.pack(weight.data_ptr(), max(ldw, k), n, k, out.data_ptr()) != 0:
        raise ValueError("CPU GEMM kernel rejected the weight's sizes or strides")
    return PackedWeight(out.view(-1), (n, k))


def pack_all(weights: list[torch.Tensor]) -> list[PackedWeight]:
    """Each weight packed, all into one buffer on huge pages (``kernels.cpu_memory``):
    a model's weights are streamed every step, and one 2 MiB-aligned arena keeps their
    page-table footprint small without wasting a huge page per weight."""
    sizes = [packed_size(*w.shape) if w.dim() == 2 else 0 for w in weights]
    arena = cpu_memory.empty((sum(sizes),), _f32)
    packed, at = [], 0
    for w, size in zip(weights, sizes, strict=True):
        packed.append(pack(w, arena[at : at + size]))
        at += size
    return packed


def packed_size(n: int, k: int) -> int:
    """Floats of the packed form of an [n, k] weight (whole 16-column panels)."""
    return -(-n // 16) * 16 * k


def linear(
    x: torch.Tensor,  # [M, K] float32; rows may be strided if each row is contiguous
    weight: PackedWeight | torch.Tensor,  # packed [N, K], or an nn.Linear weight to pack now
    bias: torch.Tensor | None = None,  # [N] float32
    num_threads: int | None = None,  # default torch.get_num_threads()
) -> torch.Tensor:  # [M, N] float32, a new contiguous tensor
    """``x @ weight.T + bias`` (``F.linear``) by the C kernel: float32 accumulation in
    another order than torch's (expect ~1e-6 relative differences). A plain tensor weight
    is packed first (a copy: for tests and one-offs; the model packs once). Not
    differentiable: for inference.

    Called once per projection per step, so the common case (contiguous float32 CPU
    operands) is checked with as few tensor attribute reads as possible."""
    kernel = _loader.require(None)
    packed = weight if isinstance(weight, PackedWeight) else pack(weight)
    n, k = packed.shape
    if not (x.dtype is _f32 and x.dim() == 2 and x.shape[1] == k and x.is_cpu):
        check_operand(x, k)
    if bias is not None and not (bias.dtype is _f32 and bias.is_cpu and bias.shape == (n,)):
        raise ValueError(f"bias must be a CPU float32 tensor of shape ({n},), got "
                         f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")
    m = x.shape[0]
    x, ldx, bias = row_operand(x, bias)
    y = torch.empty((m, n), dtype=_f32)
    rc = kernel.linear(
        x.data_ptr(), ldx, packed.data.data_ptr(), None if bias is None else bias.data_ptr(),
        y.data_ptr(), n, m, n, k, num_threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"CPU GEMM kernel rejected the sizes or strides (rc {rc})")
    return y
