"""Loaders and launchers of the CPU paged attention kernels: decode and prefill.

Owns ``kernels/cpu/paged_attention.c`` (decode): building it on first use (one build per
cache dtype, about a second each; the compile-and-cache mechanism, its cache dir and build
key are ``kernels.cpu_build``'s), loading it with ctypes, and the checked Python entry
point ``paged_decode_attention``, whose semantics are those of
``kernels.reference.paged_decode_attention`` for a float32 query and a float32, float16
or bfloat16 cache, and ``paged_decode_attention_quantized``, those of
``kernels.kv_quant.paged_decode_attention`` for an int8 / fp8 cache (codes read and scaled
in registers). ``available()`` says whether the kernel could be built here; when it
cannot, callers use the torch path.

Owns ``kernels/cpu/prefill_attention.c`` too: ``paged_prefill_attention`` is the causal
attention of one sequence's prefill chunk over its float32 cache, on AVX-512 builds
(``prefill_available()``); elsewhere callers use torch's SDPA.
"""

from __future__ import annotations

import ctypes
import shutil  # noqa: F401  (tests patch shutil.which through this module)
from pathlib import Path

import torch  # must be loaded before the kernel library, see kernels.cpu_build

from kernels import cpu_build
from kernels.cpu_build import CFLAGS, LIBS, build_key, cache_dir, openmp_runtimes
from kernels.kv_quant import KVQuant, QuantizedCache

__all__ = [
    "CFLAGS", "LIBS", "PREFILL_SOURCE", "SOURCE", "available", "bind", "bind_prefill", "build_flags", "build_key",
    "cache_dir", "entry_point", "library_path", "openmp_runtimes", "paged_decode_attention",
    "paged_decode_attention_quantized", "paged_prefill_attention", "prefill_available",
    "prefill_library_path", "prefill_supports", "prefill_unavailable_reason", "unavailable_reason",
]  # fmt: skip

SOURCE = Path(__file__).parent / "cpu" / "paged_attention.c"
PREFILL_SOURCE = Path(__file__).parent / "cpu" / "prefill_attention.c"

# Cache element type -> (suffix of the C entry point, -DPA_DTYPE code). Each type is a
# separate build (about a second of gcc), made the first time a cache of that type is seen.
_DTYPES = {torch.float32: ("f32", 0), torch.float16: ("f16", 1), torch.bfloat16: ("bf16", 2)}
# Quantised caches are variants too, keyed by their format.
_VARIANTS: dict[torch.dtype | KVQuant, tuple[str, int]] = {
    **_DTYPES, KVQuant.INT8: ("i8", 3), KVQuant.FP8: ("fp8", 4)}
_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ARGTYPES = [
    _ptr, _ptr, _ptr,  # q, k_cache, v_cache
    _i64, _i64, _i64, _i64, _i64,  # k/v block stride, token stride, head stride, num_blocks
    _ptr, _i64, _i32, _ptr,  # block_tables, its row stride, max_blocks, context_lens
    _i32, _i32, _i32, _i32, _i32,  # B, H, KVH, D, block_size
    ctypes.c_float, _ptr, _i32,  # scale, out, num_threads
]  # fmt: skip
_QUANT_ARGTYPES = [*_ARGTYPES, _ptr, _ptr, _i64, _i64]  # k/v scales, their block strides



def build_flags(dtype: torch.dtype | KVQuant) -> tuple[str, ...]:
    return (*CFLAGS, f"-DPA_DTYPE={_VARIANTS[dtype][1]}")


def library_path(dtype: torch.dtype | KVQuant = torch.float32) -> Path:
    """The build for this source, compiler, CPU and cache dtype (compiled if absent)."""
    return cpu_build.library_path(
        SOURCE, f"paged_attention-{_VARIANTS[dtype][0]}", build_flags(dtype)
    )


def bind(lib: ctypes.CDLL, dtype: torch.dtype | KVQuant) -> ctypes._CFuncPtr:
    """The entry point of ``lib`` for caches of ``dtype``, with its C signature set."""
    fn = getattr(lib, f"paged_decode_attention_{_VARIANTS[dtype][0]}")
    fn.argtypes = _QUANT_ARGTYPES if isinstance(dtype, KVQuant) else _ARGTYPES
    fn.restype = ctypes.c_int
    return fn


def _open(dtype: torch.dtype | KVQuant) -> ctypes._CFuncPtr:
    return bind(cpu_build.load(library_path(dtype), "CPU attention kernel"), dtype)


_loader = cpu_build.Loader("CPU paged attention kernel", _open)  # one variant per dtype


_PREFILL_ARGTYPES = [
    _ptr, _i64, _ptr, _ptr,  # q, its row stride, k_cache, v_cache
    _i64, _i64, _i64, _i64, _i64,  # k/v block stride, token stride, head stride, num_blocks
    _ptr, _i32, _i32,  # block_table (one row), num_context, num_new
    _i32, _i32, _i32, _i32,  # H, KVH, D, block_size
    ctypes.c_float, _ptr, _i64, _i32,  # scale, out, its row stride, num_threads
]  # fmt: skip


def prefill_library_path() -> Path:
    """The prefill kernel's build for this source, compiler and CPU (compiled if absent)."""
    return cpu_build.library_path(PREFILL_SOURCE, "prefill_attention")


def bind_prefill(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    """The prefill entry point of ``lib`` (a build of ``PREFILL_SOURCE``), its C signature set."""
    fn = lib.paged_prefill_attention_f32
    fn.argtypes, fn.restype = _PREFILL_ARGTYPES, ctypes.c_int
    return fn


def _open_prefill(_key: None) -> ctypes._CFuncPtr:
    lib = cpu_build.load(prefill_library_path(), "CPU prefill attention kernel")
    if not lib.prefill_attention_available():
        raise OSError("the prefill kernel needs AVX-512 (this build has none)")
    return bind_prefill(lib)


_prefill_loader = cpu_build.Loader("CPU prefill attention kernel", _open_prefill)


def forget_builds() -> None:
    """Forget what was built or loaded, as in a new process (tests of the build path)."""
    _loader.reset()
    _prefill_loader.reset()


def prefill_available() -> bool:
    """Whether ``paged_prefill_attention`` runs here (an AVX-512 build)."""
    return _prefill_loader.get(None) is not None


def prefill_unavailable_reason() -> str | None:
    return _prefill_loader.reason(None)


def paged_prefill_attention(
    q: torch.Tensor,  # [Q, H, D] float32, the chunk's queries, contiguous
    k_cache: torch.Tensor,  # [NB, BS, KVH, D] float32, inner 3 dims contiguous
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks] int, the sequence's row
    num_context: int,  # tokens cached after this chunk (its own Q included)
    scale: float,
    num_threads: int | None = None,
) -> torch.Tensor:  # [Q, H, D] float32
    """Causal attention of query row i (position ``num_context - Q + i``) over positions
    ``0 .. num_context - Q + i`` of the cache, as ``reference.paged_prefill_attention``.
    ValueError where the kernel does not take the shape (the caller asks
    ``prefill_supports`` first)."""
    fn = _prefill_loader.require(None)
    _check_cache(q, k_cache, v_cache)
    if k_cache.dtype is not torch.float32:
        raise ValueError(f"the prefill kernel reads float32 caches, not {k_cache.dtype}")
    table = _as_int32_rows(block_table, "block_table", 1)
    num_new, heads, dim = q.shape
    num_blocks, block_size, kvh, _ = k_cache.shape
    if not 1 <= num_new <= num_context or table.shape[0] * block_size < num_context:
        raise ValueError(f"{num_new} new tokens of {num_context} do not fit a table of "
                         f"{table.shape[0]} blocks")
    out = torch.empty_like(q)
    rc = fn(
        q.data_ptr(), heads * dim, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        v_cache.stride(0), kvh * dim, dim, num_blocks, table.data_ptr(), num_context, num_new,
        heads, kvh, dim, block_size, scale, out.data_ptr(), heads * dim,
        num_threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc == -2:
        raise ValueError(f"block_table has a block id outside [0, {num_blocks})")
    if rc == -3:
        raise MemoryError("CPU prefill attention could not allocate its scratch buffers")
    if rc != 0:
        raise ValueError(f"the prefill kernel does not take head_dim {dim} ({heads} over {kvh} heads)")
    return out


def prefill_supports(head_dim: int) -> bool:
    """Shapes the prefill kernel takes (any head counts; head_dim 64 or 128)."""
    return head_dim in (64, 128)


def available(cache_dtype: torch.dtype | KVQuant = torch.float32) -> bool:
    """Whether the kernel for caches of ``cache_dtype`` could be built and loaded.

    Compiles on the first call for each dtype (about a second), then answers from memory.
    """
    return cache_dtype in _VARIANTS and _loader.get(cache_dtype) is not None


def unavailable_reason(cache_dtype: torch.dtype | KVQuant = torch.float32) -> str | None:
    """Why ``available(cache_dtype)`` is False, else None."""
    if cache_dtype not in _VARIANTS:
        return f"no kernel for {cache_dtype} caches"
    return _loader.reason(cache_dtype)


def entry_point(cache_dtype: torch.dtype | KVQuant = torch.float32) -> ctypes._CFuncPtr:
    """The C function for caches of ``cache_dtype`` (RuntimeError if it did not build),
    for C callers such as ``kernels.cpu_decode`` that take its address."""
    return _loader.require(cache_dtype)


def _check_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    q_shape, k_shape = q.shape, k.shape
    if len(q_shape) != 3 or len(k_shape) != 4 or v.shape != k_shape:
        raise ValueError(
            f"want q [B,H,D] and equal k/v caches [NB,BS,KVH,D], got q {tuple(q_shape)}, "
            f"k {tuple(k_shape)}, v {tuple(v.shape)}"
        )
    heads, dim, kv_heads = q_shape[1], q_shape[2], k_shape[2]
    if dim != k_shape[3]:
        raise ValueError(f"head_dim mismatch: q has {dim}, cache has {k_shape[3]}")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"{heads} query heads is not a multiple of {kv_heads} kv heads")
    if q.dtype is not torch.float32 or k.dtype not in _DTYPES or v.dtype is not k.dtype:
        raise ValueError(
            f"want a float32 q and a float32, float16 or bfloat16 cache, got q {q.dtype}, "
            f"k {k.dtype}, v {v.dtype}"
        )
    if not (q.is_cpu and k.is_cpu and v.is_cpu):
        raise ValueError("the CPU kernel takes CPU tensors only")
    if not q.is_contiguous():
        raise ValueError("q must be contiguous")
    want = (kv_heads * dim, dim, 1)
    for name, c in (("k_cache", k), ("v_cache", v)):
        if not _inner_contiguous(k_shape[1:], c.stride()[1:], want):
            raise ValueError(f"{name}'s [block_size, kv_heads, head_dim] must be contiguous")


def _inner_contiguous(sizes: torch.Size, strides: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Strides as wanted, except where a dim of size 1 makes its stride irrelevant."""
    if strides == want:
        return True
    return all(n <= 1 or s == w for n, s, w in zip(sizes, strides, want, strict=True))


def _as_int32_rows(t: torch.Tensor, name: str, dims: int) -> torch.Tensor:
    if t.dim() != dims or not t.is_cpu:
        raise ValueError(f"{name} must be a {dims}-d CPU tensor, got shape {tuple(t.shape)}")
    if t.dtype is not torch.int32 or t.stride(-1) != 1:
        t = t.to(torch.int32).contiguous()
    return t


def _check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype is not q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {tuple(q.shape)}")
    if not out.is_cpu:
        raise ValueError("the CPU kernel takes CPU tensors only")
    return out


def _raise_for(rc: int, batch: int, max_context: int, num_blocks: int) -> None:
    if -batch <= rc < 0:
        raise ValueError(
            f"context_lens[{-rc - 1}] is negative or longer than its block table allows "
            f"({max_context} tokens)"
        )
    if -2 * batch <= rc < -batch:
        raise ValueError(
            f"block_tables[{-rc - batch - 1}] has a block id outside [0, {num_blocks})"
        )
    raise MemoryError("CPU paged attention could not allocate its scratch buffers")


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D] float32, contiguous
    k_cache: torch.Tensor,  # [NB, BS, KVH, D] float32/float16/bfloat16, inner 3 dims contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int
    scale: float,
    out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:  # [B, H, D] float32
    """Fused ``kernels.reference.paged_decode_attention`` (see there for the semantics)."""
    _check_cache(q, k_cache, v_cache)
    return _launch(_loader.require(k_cache.dtype), q, k_cache, v_cache, block_tables,
                   context_lens, scale, out, num_threads)


def paged_decode_attention_quantized(
    q: torch.Tensor,  # [B, H, D] float32, contiguous
    k_cache: QuantizedCache,  # codes [NB, BS, KVH, D] uint8, scales [NB, KVH] fp32
    v_cache: QuantizedCache,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int
    scale: float,
    out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:  # [B, H, D] float32
    """Fused ``kernels.kv_quant.paged_decode_attention``: codes dequantised in registers."""
    _check_quantized(q, k_cache, v_cache)
    scales = (k_cache.scales.data_ptr(), v_cache.scales.data_ptr(),
              k_cache.scales.stride(0), v_cache.scales.stride(0))
    return _launch(_loader.require(k_cache.fmt), q, k_cache.codes, v_cache.codes, block_tables,
                   context_lens, scale, out, num_threads, scales)


def _launch(fn, q, k, v, block_tables, context_lens, scale, out, num_threads,
            extra: tuple = ()) -> torch.Tensor:
    """Run one decode-attention entry point on checked caches ``k``/``v`` [NB, BS, KVH, D]
    (values or codes); ``extra``: the arguments a variant takes after the common ones."""
    block_tables = _as_int32_rows(block_tables, "block_tables", 2)
    context_lens = _as_int32_rows(context_lens, "context_lens", 1)
    batch, heads, dim = q.shape
    num_blocks, block_size, kvh, _ = k.shape
    if block_tables.shape[0] != batch or context_lens.shape[0] != batch:
        raise ValueError(f"block_tables and context_lens must have {batch} rows")
    out = _check_out(out, q)
    max_blocks = block_tables.shape[1]
    rc = fn(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), kvh * dim, dim,
        num_blocks, block_tables.data_ptr(), block_tables.stride(0), max_blocks,
        context_lens.data_ptr(), batch, heads, kvh, dim, block_size,
        scale, out.data_ptr(), num_threads or torch.get_num_threads(), *extra,
    )  # fmt: skip
    if rc != 0:
        _raise_for(rc, batch, max_blocks * block_size, num_blocks)
    return out


def _check_quantized(q: torch.Tensor, k_cache: QuantizedCache, v_cache: QuantizedCache) -> None:
    k = k_cache.codes
    if v_cache.fmt is not k_cache.fmt or v_cache.codes.shape != k.shape:
        raise ValueError("k and v caches must share one format and shape")
    if q.dim() != 3 or k.dim() != 4 or q.shape[2] != k.shape[3]:
        raise ValueError(f"want q [B,H,D] and codes [NB,BS,KVH,D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    num_blocks, _, kvh, dim = k.shape
    if kvh == 0 or q.shape[1] % kvh:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {kvh} kv heads")
    if q.dtype is not torch.float32 or not q.is_contiguous() or not q.is_cpu:
        raise ValueError("q must be a contiguous float32 CPU tensor")
    for c in (k_cache, v_cache):
        if c.codes.dtype is not torch.uint8 or c.scales.dtype is not torch.float32:
            raise ValueError("want uint8 codes and float32 scales")
        if not c.codes.is_cpu or not c.scales.is_cpu:
            raise ValueError("the CPU kernel takes CPU tensors only")
        if not _inner_contiguous(k.shape[1:], c.codes.stride()[1:], (kvh * dim, dim, 1)):
            raise ValueError("codes' [block_size, kv_heads, head_dim] must be contiguous")
        if c.scales.shape != (num_blocks, kvh) or c.scales.stride(1) != 1:
            raise ValueError(f"scales must be [{num_blocks}, {kvh}], kv heads contiguous")
