"""Loader and launcher of the fused CPU paged decode attention kernel.

Owns ``kernels/cpu/paged_attention.c``: compiling it with the system gcc on first use
(one build per cache dtype, about a second each) into a per-user cache
(``$TANDEM_CACHE_DIR/kernels``, else ``~/.cache/tandem/kernels``),
loading it with ctypes, and the checked Python entry point ``paged_decode_attention``,
whose semantics are those of ``kernels.reference.paged_decode_attention`` for a float32
query and a float32, float16 or bfloat16 cache. ``available()`` says whether the kernel
could be built here; when it cannot, callers use the torch path.

The build is keyed by a hash of the source, the flags, the compiler version, the machine
and the CPU (``-march=native``), so a stale or foreign build is never loaded. torch is
imported before the library is loaded so that its ``libgomp.so.1`` dependency binds to
the libgomp torch already mapped: one OpenMP runtime and thread pool for both.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch  # must be loaded before the kernel library, see the docstring

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu" / "paged_attention.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)

# Cache element type -> (suffix of the C entry point, -DPA_DTYPE code). Each type is a
# separate build (about a second of gcc), made the first time a cache of that type is seen.
_DTYPES = {torch.float32: ("f32", 0), torch.float16: ("f16", 1), torch.bfloat16: ("bf16", 2)}
_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ARGTYPES = [
    _ptr, _ptr, _ptr,  # q, k_cache, v_cache
    _i64, _i64, _i64, _i64, _i64,  # k/v block stride, token stride, head stride, num_blocks
    _ptr, _i64, _i32, _ptr,  # block_tables, its row stride, max_blocks, context_lens
    _i32, _i32, _i32, _i32, _i32,  # B, H, KVH, D, block_size
    ctypes.c_float, _ptr, _i32,  # scale, out, num_threads
]  # fmt: skip

_BUILD_ERRORS = (OSError, RuntimeError, AttributeError, IndexError, subprocess.SubprocessError)
_OPENMP_LIB = re.compile(r"\S*/lib(?:gomp|iomp5|omp)\b[^/\s]*\.so[^/\s]*")
_lock = threading.Lock()
_functions: dict[torch.dtype, ctypes._CFuncPtr | None] = {}  # None: could not build
_reasons: dict[torch.dtype, str] = {}


def cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "tandem"
    return base / "kernels"


def _cpu_identity() -> str:
    """The CPU model and flags lines of /proc/cpuinfo ('' where unreadable)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    keep = ("model name", "flags", "Features", "CPU part")
    found: dict[str, str] = {}
    for line in lines:
        key = line.split(":", 1)[0].strip()
        if key in keep and key not in found:
            found[key] = line
    return "\n".join(found[k] for k in keep if k in found)


@functools.cache
def _compiler_version(cc: str) -> str:
    run = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True, timeout=30)
    target = subprocess.run(
        [cc, "-dumpmachine"], check=False, capture_output=True, text=True, timeout=30
    )
    return run.stdout.splitlines()[0] + " " + target.stdout.strip()


def build_flags(dtype: torch.dtype) -> tuple[str, ...]:
    return (*CFLAGS, f"-DPA_DTYPE={_DTYPES[dtype][1]}")


def build_key(source: str, cc_version: str, flags: tuple[str, ...] = CFLAGS) -> str:
    """Hash of everything that decides what the built library contains."""
    parts = [source, " ".join(flags + LIBS), cc_version, platform.machine(), _cpu_identity()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _compile(cc: str, flags: tuple[str, ...], out: Path) -> None:
    """Build into a temporary name beside ``out``, then rename (safe under races)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, str(SOURCE), "-o", tmp, *LIBS]
        res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr.strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path(dtype: torch.dtype = torch.float32) -> Path:
    """The build for this source, compiler, CPU and cache dtype (compiled if absent)."""
    cc = shutil.which("gcc")
    if cc is None:
        raise RuntimeError("gcc not found on PATH")
    flags = build_flags(dtype)
    key = build_key(SOURCE.read_text(), _compiler_version(cc), flags)
    path = cache_dir() / f"paged_attention-{_DTYPES[dtype][0]}-{key}.so"
    if not path.exists():
        _compile(cc, flags, path)
    return path


def bind(lib: ctypes.CDLL, dtype: torch.dtype) -> ctypes._CFuncPtr:
    """The entry point of ``lib`` for caches of ``dtype``, with its C signature set."""
    fn = getattr(lib, f"paged_decode_attention_{_DTYPES[dtype][0]}")
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return fn


def openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process ([] where unknowable)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted(set(_OPENMP_LIB.findall(maps)))


def _open(dtype: torch.dtype) -> ctypes._CFuncPtr:
    fn = bind(ctypes.CDLL(str(library_path(dtype))), dtype)
    runtimes = openmp_runtimes()
    if len(runtimes) > 1:  # e.g. a torch build whose bundled libgomp was renamed
        log.warning("CPU attention kernel and torch use different OpenMP runtimes: %s", runtimes)
    return fn


def _function(dtype: torch.dtype) -> ctypes._CFuncPtr | None:
    if dtype in _functions:  # the per-call fast path: no lock
        return _functions[dtype]
    with _lock:
        if dtype not in _functions:
            try:
                _functions[dtype] = _open(dtype)
            except _BUILD_ERRORS as exc:  # any of these means: use the torch path
                _functions[dtype], _reasons[dtype] = None, f"{type(exc).__name__}: {exc}"
                log.debug("CPU paged attention kernel unavailable: %s", _reasons[dtype])
    return _functions[dtype]


def available(cache_dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernel for caches of ``cache_dtype`` could be built and loaded.

    Compiles on the first call for each dtype (about a second), then answers from memory.
    """
    return cache_dtype in _DTYPES and _function(cache_dtype) is not None


def unavailable_reason(cache_dtype: torch.dtype = torch.float32) -> str | None:
    """Why ``available(cache_dtype)`` is False, else None."""
    if cache_dtype not in _DTYPES:
        return f"no kernel for {cache_dtype} caches"
    _function(cache_dtype)
    return _reasons.get(cache_dtype)


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
    fn = _function(k_cache.dtype)
    if fn is None:
        raise RuntimeError(f"CPU paged attention kernel unavailable: {_reasons[k_cache.dtype]}")
    block_tables = _as_int32_rows(block_tables, "block_tables", 2)
    context_lens = _as_int32_rows(context_lens, "context_lens", 1)
    batch, heads, dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    if block_tables.shape[0] != batch or context_lens.shape[0] != batch:
        raise ValueError(f"block_tables and context_lens must have {batch} rows")
    out = _check_out(out, q)
    max_blocks = block_tables.shape[1]
    rc = fn(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), v_cache.stride(0), kv_heads * dim, dim, num_blocks,
        block_tables.data_ptr(), block_tables.stride(0), max_blocks, context_lens.data_ptr(),
        batch, heads, kv_heads, dim, block_size,
        scale, out.data_ptr(), num_threads or torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        _raise_for(rc, batch, max_blocks * block_size, num_blocks)
    return out
