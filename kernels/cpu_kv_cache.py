"""Loader and launchers of the quantised KV-cache C kernels (``kernels/cpu/kv_cache_quant.c``).

``write_kv`` stores a step's new K/V into an int8/fp8 cache (scale growth and requantise
as ``kernels.kv_quant.write_kv``, bit for bit); ``gather_kv`` dequantises one sequence's
context into a contiguous fp32 tensor for prefill attention (as ``kernels.kv_quant.gather_kv``).
Decode attention reads the codes itself (``kernels.cpu_attention``). Built on first use by
``kernels.cpu_build``; ``available()`` says whether that worked, else callers use torch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch  # must be loaded before the kernel library, see kernels.cpu_build

from kernels import cpu_build
from kernels.kv_quant import KVQuant, QuantizedCache

SOURCE = Path(__file__).parent / "cpu" / "kv_cache_quant.c"
# No FMA contraction: the same roundings as the torch reference.
CFLAGS = (*cpu_build.CFLAGS, "-ffp-contract=off")
FMT_CODE = {KVQuant.INT8: 0, KVQuant.FP8: 1}  # kvq.h's KVQ_INT8 / KVQ_FP8

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class Kernel(NamedTuple):
    write: ctypes._CFuncPtr
    gather: ctypes._CFuncPtr


def library_path() -> Path:
    return cpu_build.library_path(SOURCE, "kv_cache_quant", CFLAGS)


def bind(lib: ctypes.CDLL) -> Kernel:
    k = Kernel(lib.kv_quant_write, lib.kv_quant_gather)
    # write(fmt, x, x_tok, x_head, slots, T, codes, scales, code_block, scale_block, NB, BS, KVH, D)
    k.write.argtypes = [_i32, _ptr, _i64, _i64, _ptr, _i32, _ptr, _ptr, _i64, _i64, _i64,
                        _i32, _i32, _i32]
    # gather(fmt, codes, scales, code_block, scale_block, NB, ids, n, BS, KVH, D, out, threads)
    k.gather.argtypes = [_i32, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i32, _i32, _i32, _i32,
                         _ptr, _i32]
    for fn in k:
        fn.restype = ctypes.c_int
    return k


def _open(_variant: None) -> Kernel:
    return bind(cpu_build.load(library_path(), "quantised KV-cache kernels"))


_loader = cpu_build.Loader("quantised KV-cache kernels", _open)  # one variant: key None


def available() -> bool:
    return _loader.get(None) is not None


def _check(cache: QuantizedCache) -> tuple[int, int, int, int]:
    codes, scales = cache.codes, cache.scales
    nb, bs, kvh, dim = codes.shape
    if codes.dtype is not torch.uint8 or scales.dtype is not torch.float32:
        raise ValueError(f"want uint8 codes and float32 scales, got {codes.dtype}, {scales.dtype}")
    if codes.stride()[1:] != (kvh * dim, dim, 1) or scales.shape != (nb, kvh) or scales.stride(1) != 1:
        raise ValueError("codes' [BS, KVH, D] and scales' [KVH] must be contiguous")
    if not (codes.is_cpu and scales.is_cpu):
        raise ValueError("the CPU kernel takes CPU tensors only")
    return nb, bs, kvh, dim


def _write_one(k: Kernel, x: torch.Tensor, cache: QuantizedCache, slots: torch.Tensor) -> None:
    nb, bs, kvh, dim = _check(cache)
    if x.dim() != 3 or x.shape[1:] != (kvh, dim) or x.dtype is not torch.float32:
        raise ValueError(f"want float32 rows [T, {kvh}, {dim}], got {x.dtype} {tuple(x.shape)}")
    if x.stride(2) != 1:
        x = x.contiguous()
    rc = k.write(FMT_CODE[cache.fmt], x.data_ptr(), x.stride(0), x.stride(1), slots.data_ptr(),
                 slots.shape[0], cache.codes.data_ptr(), cache.scales.data_ptr(),
                 cache.codes.stride(0), cache.scales.stride(0), nb, bs, kvh, dim)
    if rc != 0:
        raise ValueError(f"slot_mapping[{-rc - 1}] is outside the cache's {nb * bs} slots")


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: QuantizedCache,
             v_cache: QuantizedCache, slot_mapping: torch.Tensor) -> None:
    """Quantise each token's key and value into its slot (in place); see ``kv_quant.write_kv``."""
    k = _loader.require(None)
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.dim() != 1 or slots.shape[0] != key.shape[0] or value.shape[0] != key.shape[0]:
        raise ValueError("slot_mapping must hold one slot per key/value row")
    _write_one(k, key, k_cache, slots)
    _write_one(k, value, v_cache, slots)


def gather_kv(cache: QuantizedCache, block_ids: torch.Tensor, num_tokens: int,
              num_threads: int | None = None) -> torch.Tensor:  # [num_tokens, KVH, D] fp32
    """The first ``num_tokens`` positions of one sequence, dequantised and contiguous."""
    k = _loader.require(None)
    nb, bs, kvh, dim = _check(cache)
    ids = block_ids.to(torch.int32).contiguous()
    if num_tokens < 0 or ids.shape[0] * bs < num_tokens:
        raise ValueError(f"{ids.shape[0]} blocks cannot hold {num_tokens} tokens")
    out = torch.empty(num_tokens, kvh, dim, dtype=torch.float32)
    rc = k.gather(FMT_CODE[cache.fmt], cache.codes.data_ptr(), cache.scales.data_ptr(),
                  cache.codes.stride(0), cache.scales.stride(0), nb, ids.data_ptr(), num_tokens,
                  bs, kvh, dim, out.data_ptr(), num_threads or torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"block_ids[{-rc - 1}] is outside [0, {nb})")
    return out
