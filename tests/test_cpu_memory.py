"""Huge-page backed CPU buffers (kernels.cpu_memory)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu_memory


def test_small_buffers_are_plain_tensors() -> None:
    t = cpu_memory.empty((3, 4), torch.float16)
    assert t.shape == (3, 4) and t.dtype is torch.float16 and t.is_contiguous()
    assert t.untyped_storage().nbytes() == 24


def test_big_buffers_start_on_a_huge_page_and_behave_like_tensors() -> None:
    z = cpu_memory.zeros((5, 1 << 18), torch.float32)  # 5 MiB
    assert z.shape == (5, 1 << 18) and z.is_contiguous() and not z.any()
    if cpu_memory.huge_pages_supported():
        assert z.data_ptr() % cpu_memory.HUGE_PAGE == 0
    z[2, 7] = 3.0
    assert float(z.sum()) == 3.0
    assert z[2].view(torch.uint8).numpy().nbytes == 4 << 18  # views, numpy, as any tensor


@pytest.mark.parametrize("nbytes,offset", [(737_280, 0), (737_280 + 37, 5), (100, 3), (1, 0), (4096 * 3 + 96, 17)])
def test_the_kv_copy_is_byte_exact_at_any_size_and_alignment(nbytes, offset):
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes + offset, dtype=np.uint8)
    buf = memoryview(src.tobytes())[offset:]  # read-only, as a transport's frame or a peer's map
    dst = torch.zeros(nbytes + 64, dtype=torch.uint8)[offset % 7 : offset % 7 + nbytes]
    cpu_memory.copy_from_buffer(dst, buf)
    assert bytes(dst.numpy()) == bytes(buf)


def test_the_kv_copy_refuses_a_size_mismatch():
    with pytest.raises(ValueError, match="copy of 10 bytes into 12"):
        cpu_memory.copy_from_buffer(torch.zeros(12, dtype=torch.uint8), b"0123456789")


def test_the_streaming_copy_kernel_builds_here():
    assert cpu_memory.streaming_copy_available()  # gcc is on every machine this runs on


@pytest.mark.parametrize("threads", [1, 2])
def test_a_transfers_blocks_are_copied_byte_exact_on_any_thread_count(threads):
    rng = np.random.default_rng(threads)
    bufs = [memoryview(rng.integers(0, 256, 4096 + 40, dtype=np.uint8).tobytes()) for _ in range(9)]
    cache = torch.zeros((12, 4096 + 40), dtype=torch.uint8)
    ids = [3, 0, 11, 5, 6, 1, 9, 2, 7]
    cpu_memory.copy_blocks([cache[i] for i in ids], bufs, threads)
    for i, buf in zip(ids, bufs, strict=True):
        assert bytes(cache[i].numpy()) == bytes(buf)
    assert not cache[[4, 8, 10]].any()  # nothing written outside the blocks named


def test_copy_blocks_refuses_mismatched_sizes():
    cache = torch.zeros((2, 16), dtype=torch.uint8)
    with pytest.raises(ValueError, match="one size"):
        cpu_memory.copy_blocks([cache[0], cache[1]], [b"x" * 16, b"y" * 15])
    with pytest.raises(ValueError, match="1 buffers for 2 blocks"):
        cpu_memory.copy_blocks([cache[0], cache[1]], [b"x" * 16])
