"""Loader and launcher of the CPU kernels on quantised weights (``kernels/cpu/quant_gemm.c``).

``pack(w)`` repacks a ``QuantWeight`` (GGUF Q8_0/Q4_0/Q4_1 blocks, or per-row int8) once,
at model load, into the kernel's panel layout, every quant and scale kept as it is;
``linear(x, packed, bias)`` is then ``x @ w.dequantize().T + bias`` for a CPU float32 ``x``
[M, K] (weights dequantised in registers, activations float32: only the summation order
differs from the float32 product), and ``embedding(packed, ids)`` the dequantised rows,
bit-exact. The library is built on first use by ``kernels.cpu_build``; ``available()``
says whether that worked. It holds an AVX-512 path, an AVX2/FMA/F16C one and a portable C
one, the CPU's best chosen at run time (``isa()``); ``set_isa`` caps it (tests, benchmarks).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch  # must be loaded before the kernel library, see kernels.cpu_build

from kernels import cpu_build, cpu_gemm, cpu_memory
from kernels.quant_formats import QuantFormat, QuantWeight

SOURCE = Path(__file__).parent / "cpu" / "quant_gemm.c"
# No contraction of a*b + c into an FMA, so that dequantisation rounds as gguf's (for the
# formats here d*q is exact anyway: an f16 d times a 4- or 8-bit q fits 24 bits).
CFLAGS = (*cpu_build.CFLAGS, "-ffp-contract=off")

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_f32 = torch.float32
_FMT = {QuantFormat.Q8_0: 0, QuantFormat.Q4_0: 1, QuantFormat.Q4_1: 2, QuantFormat.INT8_ROW: 3}


class Kernel(NamedTuple):
    """The library's entry points, C signatures set."""

    linear: ctypes._CFuncPtr  # quant_linear(fmt, x, ldx, w, bias, y, ldy, M, N, K, threads)
    pack: ctypes._CFuncPtr  # quant_pack(fmt, src, scales, N, K, out)
    packed_size: ctypes._CFuncPtr  # quant_packed_size(fmt, N, K) -> bytes
    embedding: ctypes._CFuncPtr  # quant_embedding(fmt, w, N, K, ids, T, out)
    set_isa: ctypes._CFuncPtr  # quant_set_isa(cap): an index of ISAS
    isa: ctypes._CFuncPtr  # quant_isa() -> the path taken now, numbered as set_isa's cap
    path: ctypes._CFuncPtr  # quant_path(fmt, M, K) -> an index of PATHS


def _open(_variant: None) -> Kernel:
    lib = cpu_build.load(cpu_build.library_path(SOURCE, "quant_gemm", CFLAGS), "CPU quant kernel")
    k = Kernel(lib.quant_linear, lib.quant_pack, lib.quant_packed_size, lib.quant_embedding,
               lib.quant_set_isa, lib.quant_isa, lib.quant_path)
    k.linear.argtypes = [_int, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int]
    k.pack.argtypes = [_int, _ptr, _ptr, _i64, _i64, _ptr]
    k.packed_size.argtypes = [_int, _i64, _i64]
    k.embedding.argtypes = [_int, _ptr, _i64, _i64, _ptr, _i64, _ptr]
    k.set_isa.argtypes, k.set_isa.restype = [_int], None
    k.path.argtypes = [_int, _i64, _i64]
    for f in (k.linear, k.pack, k.embedding, k.isa, k.path):
        f.restype = _int
    k.packed_size.restype = _i64
    return k


_loader = cpu_build.Loader("CPU quant kernel", _open)  # one variant: key None


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


def format_code(fmt: QuantFormat) -> int:
    """``fmt`` as the C entry points number it."""
    return _FMT[fmt]


# The kernel's instruction sets, each a superset of the last ("avx512vnni": AVX-512 with
# VNNI and VBMI, for the integer GEMV of block formats; "amx": that and AMX-BF16, granted
# by the kernel, for the GEMM of block formats above the GEMV's sizes).
ISAS = ("portable", "avx2", "avx512", "avx512vnni", "amx")


def set_isa(cap: str | None) -> None:
    """Let ``linear`` take at most path ``cap`` (one of ``ISAS``), or the CPU's best
    (None), process-wide. A cap above what the CPU has leaves the CPU's best."""
    if cap is not None and cap not in ISAS:
        raise ValueError(f"unknown ISA {cap!r}: one of {', '.join(ISAS)}")
    _loader.require(None).set_isa(len(ISAS) - 1 if cap is None else ISAS.index(cap))


def isa() -> str:
    """The instructions ``linear`` uses now: ``"amx"``, ``"avx512vnni"``, ``"avx512"``
    (AVX-512 F/BW/VL/DQ), ``"avx2"`` (AVX2+FMA+F16C) or ``"portable"``."""
    return ISAS[_loader.require(None).isa()]


# How ``linear`` multiplies (quant_gemm.c's Path): GEMV tiles, or a GEMM.
PATHS = ("gemv_vnni", "gemv_avx512", "gemv_avx2", "gemm_amx", "gemm_avx512", "gemm_avx2", "gemm_c",
         "gemv_avx2_int")


def path(fmt: QuantFormat, m: int, k: int) -> str:
    """The path ``linear`` takes now for ``m`` rows of x against a weight of ``k`` columns
    in ``fmt`` (one of ``PATHS``; an x holding a NaN or an infinity may take a float path
    instead)."""
    return PATHS[_loader.require(None).path(_FMT[fmt], m, k)]


@dataclass(frozen=True, slots=True, eq=False)
class QuantPacked:
    """A ``QuantWeight`` [n, k] in the kernel's panel layout (see the C file): all the
    kernel reads; the caller may free the original."""

    fmt: QuantFormat
    n: int
    k: int
    data: torch.Tensor  # uint8, packed_size(fmt, n, k) bytes

    @property
    def nbytes(self) -> int:
        """Bytes a full pass over the weight reads."""
        return self.data.numel()


def packed_size(fmt: QuantFormat, n: int, k: int) -> int:
    """Bytes of the packed form of an [n, k] weight in ``fmt`` (whole 16-row panels)."""
    size = _loader.require(None).packed_size(_FMT[fmt], n, k)
    if size < 0:
        raise ValueError(f"no {fmt.name} weight of shape ({n}, {k})")
    return size


def pack(w: QuantWeight, out: torch.Tensor | None = None) -> QuantPacked:
    """``w`` repacked for ``linear``/``embedding``, into ``out`` (contiguous uint8 of
    ``packed_size`` bytes) or a new buffer."""
    kernel = _loader.require(None)
    if not isinstance(w, QuantWeight):
        raise ValueError(f"want a QuantWeight, got {type(w).__name__}")
    if not w.data.is_cpu:
        raise ValueError(f"the CPU kernel takes CPU weights only, got {w.data.device}")
    size = packed_size(w.fmt, w.n, w.k)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8)
    elif out.dtype is not torch.uint8 or out.numel() != size or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous uint8 tensor of {size} bytes")
    data = w.data.contiguous()
    scales = None if w.scales is None else w.scales.to(_f32).contiguous()
    rc = kernel.pack(_FMT[w.fmt], data.data_ptr(), None if scales is None else scales.data_ptr(),
                     w.n, w.k, out.data_ptr())
    if rc != 0:
        raise ValueError(f"CPU quant kernel rejected the {w.fmt.name} weight ({w.n}, {w.k})")
    return QuantPacked(w.fmt, w.n, w.k, out.view(-1))


def pack_all(weights: list[QuantWeight]) -> list[QuantPacked]:
    """Each weight packed, all into one buffer on huge pages (see ``cpu_gemm.pack_all``)."""
    sizes = [packed_size(w.fmt, w.n, w.k) for w in weights]
    arena = cpu_memory.empty((sum(sizes),), torch.uint8)
    packed, at = [], 0
    for w, size in zip(weights, sizes, strict=True):
        packed.append(pack(w, arena[at : at + size]))
        at += size
    return packed



def linear(
    x: torch.Tensor,  # [M, K] float32; rows may be strided if each row is contiguous
    w: QuantPacked,
    bias: torch.Tensor | None = None,  # [N] float32
    *,
    num_threads: int | None = None,  # default torch.get_num_threads()
) -> torch.Tensor:  # [M, N] float32, a new contiguous tensor
    """``x @ w.dequantize().T + bias`` by the C kernel (float32 accumulation in another
    order than torch's). Not differentiable: for inference."""
    kernel = _loader.require(None)
    if not isinstance(w, QuantPacked):
        raise ValueError(f"want a QuantPacked weight (cpu_quant.pack), got {type(w).__name__}")
    n, k = w.n, w.k
    if not (isinstance(x, torch.Tensor) and x.dtype is _f32 and x.dim() == 2 and x.shape[1] == k
            and x.is_cpu):
        cpu_gemm.check_operand(x, k)
    if bias is not None and not (isinstance(bias, torch.Tensor) and bias.dtype is _f32
                                 and bias.is_cpu and bias.shape == (n,)):
        raise ValueError(f"bias must be a CPU float32 tensor of shape ({n},), got "
                         f"{getattr(bias, 'dtype', type(bias))} {tuple(getattr(bias, 'shape', ()))}")
    m = x.shape[0]
    x, ldx, bias = cpu_gemm.row_operand(x, bias)
    y = torch.empty((m, n), dtype=_f32)
    rc = kernel.linear(_FMT[w.fmt], x.data_ptr(), ldx, w.data.data_ptr(),
                       None if bias is None else bias.data_ptr(), y.data_ptr(), n, m, n, k,
                       num_threads or torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"CPU quant kernel rejected the sizes or strides (rc {rc})")
    return y


def embedding(w: QuantPacked, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (long [T]) of ``w`` dequantised: float32 [T, K], bit-exact to
    ``w``'s ``QuantWeight.dequantize()`` rows. ValueError on an id outside [0, n)."""
    kernel = _loader.require(None)
    if not isinstance(w, QuantPacked):
        raise ValueError(f"want a QuantPacked weight (cpu_quant.pack), got {type(w).__name__}")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype is not torch.long or not ids.is_cpu:
        raise ValueError(f"want CPU long ids of shape [T], got {getattr(ids, 'dtype', type(ids))} "
                         f"{tuple(getattr(ids, 'shape', ()))}")
    ids = ids.contiguous()
    out = torch.empty((ids.numel(), w.k), dtype=_f32)
    rc = kernel.embedding(_FMT[w.fmt], w.data.data_ptr(), w.n, w.k, ids.data_ptr(), ids.numel(),
                          out.data_ptr())
    if rc == -2:
        raise ValueError(f"token ids must lie in [0, {w.n})")
    if rc != 0:
        raise ValueError(f"CPU quant kernel rejected the embedding (rc {rc})")
    return out
