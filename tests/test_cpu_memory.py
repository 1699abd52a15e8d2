"""Huge-page backed CPU buffers (kernels.cpu_memory)."""

from __future__ import annotations

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
