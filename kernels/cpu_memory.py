"""Big CPU buffers on transparent huge pages (2 MiB), where Linux allows it.

The KV cache (GiBs, its blocks read in scattered order) and the packed weights (hundreds
of MB, streamed every step) take a TLB miss every 4 KiB on normal pages; on huge pages
their whole extent fits the TLB. Measured here: decode attention 1.04-1.15x, the batch-1
GEMMs 1.08x. ``empty`` asks with ``madvise(MADV_HUGEPAGE)`` before the memory is first
touched, which works with the common ``transparent_hugepage=madvise`` setting; where it
is refused (another OS, THP off) the buffer is simply an ordinary one.

``copy_from_buffer`` is the one copy of a KV transfer into the cache: on the CPU one
thread's loads and non-temporal stores (``kernels/cpu/stream_copy.c``: the destination is
not read into the cache first, 1.5x memcpy here), else a single memcpy through numpy, which
reads read-only buffers as they are. Measured here (2 cores, loaded): numpy's memcpy 5.7
GB/s for 125 blocks of 737,280 bytes against 4.7 for torch's copy on one thread; torch's
copy on two threads fell to 0.02-0.08 GB/s when the cores were oversubscribed (every block
is a parallel region that waits for a descheduled thread).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kernels import cpu_build

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def huge_pages_supported() -> bool:
    """Whether this platform lets big buffers ask for transparent huge pages."""
    return _madvise() is not None


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, huge-page backed where possible.

    Below one huge page it is plain ``torch.empty``. Above, the storage is over-allocated
    by one huge page so the tensor can start on a 2 MiB boundary; it is a view into that
    storage (``.data_ptr()`` is aligned, ``.untyped_storage()`` is the larger buffer)."""
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if nbytes < HUGE_PAGE or madvise is None:
        return torch.empty(tuple(shape), dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE)  # advice only
    return raw[start : start + nbytes].view(dtype).view(tuple(shape))


def zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``empty(shape, dtype)`` filled with zeros (the first touch, so after the advice)."""
    return empty(shape, dtype).zero_()


def copy_from_buffer(dst: torch.Tensor, buf) -> None:
    """Copy the bytes of ``buf`` (any buffer, read-only allowed) into the contiguous ``dst``."""
    src = np.frombuffer(buf, dtype=np.uint8)
    dst = dst.view(-1).view(torch.uint8)
    if src.nbytes != dst.numel():
        raise ValueError(f"copy of {src.nbytes} bytes into {dst.numel()}")
    if dst.device.type == "cpu":
        copy = _stream_copy()
        if copy is not None:
            copy(dst.data_ptr(), src.ctypes.data, src.nbytes)
        else:
            np.copyto(dst.numpy(), src)
    else:  # torch cannot wrap read-only memory: one staging copy on the way to the device
        dst.copy_(torch.from_numpy(src.copy()))


def copy_blocks(dsts: list[torch.Tensor], bufs: list, num_threads: int = 1) -> None:
    """``copy_from_buffer`` for each pair (a transfer's blocks into cache blocks), spread
    over ``num_threads`` threads a block at a time where the streaming copy is built."""
    if len(dsts) != len(bufs):
        raise ValueError(f"{len(bufs)} buffers for {len(dsts)} blocks")
    lib = _copy_loader.get(None)
    srcs = [np.frombuffer(b, dtype=np.uint8) for b in bufs]
    flat = [d.view(-1).view(torch.uint8) for d in dsts]
    if lib is None or not srcs or any(not d.is_cpu for d in flat):
        for d, b in zip(dsts, bufs, strict=True):
            copy_from_buffer(d, b)
        return
    nbytes = srcs[0].nbytes
    if any(s.nbytes != nbytes or d.numel() != nbytes for s, d in zip(srcs, flat, strict=True)):
        raise ValueError("copy_blocks needs buffers and blocks of one size")
    count = len(srcs)
    dst_ptrs = (ctypes.c_void_p * count)(*[d.data_ptr() for d in flat])
    src_ptrs = (ctypes.c_void_p * count)(*[s.ctypes.data for s in srcs])
    lib.many(dst_ptrs, src_ptrs, count, nbytes, max(1, num_threads))


def _stream_copy():
    """The streaming-store copy (``kernels/cpu/stream_copy.c``), or None without a compiler."""
    lib = _copy_loader.get(None)
    return None if lib is None else lib.one


def streaming_copy_available() -> bool:
    return _stream_copy() is not None


def _open_copy(_variant: None):
    source = Path(__file__).parent / "cpu" / "stream_copy.c"
    lib = cpu_build.load(cpu_build.library_path(source, "stream_copy", cpu_build.CFLAGS),
                         "streaming copy")
    one, many = lib.stream_copy, lib.stream_copy_many
    one.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    many.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    one.restype = many.restype = ctypes.c_int
    return _CopyKernel(one, many)


class _CopyKernel(NamedTuple):
    one: ctypes._CFuncPtr
    many: ctypes._CFuncPtr


_copy_loader = cpu_build.Loader("streaming copy", _open_copy)
