"""The fused elementwise CPU kernels (kernels.cpu_ops) against the torch expressions."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.model.llama import apply_rope
from kernels import cpu_ops


@pytest.fixture(autouse=True, scope="module")
def _needs_kernel() -> None:
    if not cpu_ops.available():
        pytest.skip(f"fused CPU ops unavailable: {cpu_ops.unavailable_reason()}")


def rope_tables(max_pos: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return torch.cat((freqs.cos(),) * 2, -1), torch.cat((-freqs.sin(), freqs.sin()), -1)


@pytest.mark.parametrize("c", [576, 37, 8, 1])
@pytest.mark.parametrize("t", [1, 5, 300])
def test_add_rms_norm(t: int, c: int) -> None:
    g = torch.Generator().manual_seed(t * 1000 + c)
    x, d, w = (torch.randn(t, c, generator=g), torch.randn(t, c, generator=g),
               torch.randn(c, generator=g))  # fmt: skip
    want_x = x + d
    want = F.rms_norm(want_x, (c,), w, 1e-5)
    got = cpu_ops.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(x, want_x)  # the residual stream, updated in place, exactly
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    x2 = want_x.clone()
    torch.testing.assert_close(cpu_ops.add_rms_norm(x2, None, w, 1e-5), want, rtol=2e-6, atol=2e-6)
    assert torch.equal(x2, want_x)  # no delta: x untouched


def test_add_rms_norm_strided_rows() -> None:
    big, dbig, w = torch.randn(8, 700), torch.randn(8, 650), torch.randn(576)
    x, d = big[::2, 3:579], dbig[::2, :576]  # rows contiguous, strided
    want_x = x + d
    got = cpu_ops.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(big[::2, 3:579], want_x)
    torch.testing.assert_close(got, F.rms_norm(want_x, (576,), w, 1e-6), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("i", [1536, 13, 8])
@pytest.mark.parametrize("t", [1, 4, 100])
def test_silu_mul(t: int, i: int) -> None:
    g = torch.Generator().manual_seed(t + i)
    gu = torch.randn(t, 2 * i, generator=g) * 6
    gu[0, 0], gu[-1, 1 % i] = -100.0, 95.0  # exp() under- and overflow ranges
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_mul(gu), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_silu_mul_special_values() -> None:
    gu = torch.tensor([[0.0, -0.0, float("inf"), float("-inf"), float("nan"),
                        1e-30, -88.0, 88.0] + [1.0] * 8])  # fmt: skip
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_mul(gu), F.silu(gate) * up, equal_nan=True)


@pytest.mark.parametrize("t", [1, 7, 260])
def test_rope_qk_is_bitwise_apply_rope(t: int) -> None:
    heads, kv_heads, dim = 9, 3, 64
    cos, sin = rope_tables(512, dim)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim)
    pos = torch.randint(0, 512, (t,))
    q, k = cpu_ops.rope_qk(qkv, pos, cos, sin, heads, kv_heads)
    qk = apply_rope(qkv[:, : (heads + kv_heads) * dim].unflatten(-1, (-1, dim)),
                    cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))  # fmt: skip
    assert q.is_contiguous() and k.is_contiguous()
    assert torch.equal(q, qk[:, :heads]) and torch.equal(k, qk[:, heads:])


def test_rope_qk_odd_head_dim_tail() -> None:
    cos, sin = rope_tables(16, 12)  # half = 6: no full vector, the scalar tail only
    qkv = torch.randn(3, 4 * 12)
    pos = torch.tensor([0, 5, 15])
    q, k = cpu_ops.rope_qk(qkv, pos, cos, sin, 2, 1)
    qk = apply_rope(qkv[:, :36].unflatten(-1, (-1, 12)), cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    assert torch.equal(q, qk[:, :2]) and torch.equal(k, qk[:, 2:])


def test_rejects_bad_inputs() -> None:
    cos, sin = rope_tables(8, 4)
    qkv = torch.randn(2, 12)
    with pytest.raises(ValueError, match="position"):
        cpu_ops.rope_qk(qkv, torch.tensor([0, 8]), cos, sin, 1, 1)
    with pytest.raises(ValueError, match="int64"):
        cpu_ops.rope_qk(qkv, torch.tensor([0, 1], dtype=torch.int32), cos, sin, 1, 1)
    with pytest.raises(ValueError, match="heads"):
        cpu_ops.rope_qk(qkv, torch.tensor([0, 1]), cos, sin, 3, 1)
    with pytest.raises(ValueError, match="float32"):
        cpu_ops.silu_mul(torch.randn(2, 4).double())
    with pytest.raises(ValueError, match="even"):
        cpu_ops.silu_mul(torch.randn(2, 5))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_ops.silu_mul(torch.randn(6, 2).t())
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="weight"):
        cpu_ops.add_rms_norm(x, None, torch.randn(5), 1e-5)
    with pytest.raises(ValueError, match="rows"):
        cpu_ops.add_rms_norm(x, torch.randn(2, 4), torch.randn(4), 1e-5)


def test_scalar_fallback_build(tmp_path: Path) -> None:
    """The C file built without AVX2/FMA: its portable path gives the same results."""
    cc = shutil.which("gcc")
    assert cc is not None
    lib_path = tmp_path / "scalar.so"
    flags = [f for f in cpu_ops.CFLAGS if f != "-march=native"]
    subprocess.run([cc, *flags, "-mno-avx2", "-mno-fma", str(cpu_ops.SOURCE), "-o", str(lib_path),
                    "-lm"], check=True, capture_output=True)  # fmt: skip
    lib = ctypes.CDLL(str(lib_path))
    assert lib.fused_ops_simd_level() == 0
    kernel = cpu_ops.bind(lib)
    x, d, w = torch.randn(3, 20), torch.randn(3, 20), torch.randn(20)
    out, want_x = torch.empty(3, 20), x + d
    assert kernel.add_rms_norm(x.data_ptr(), 20, d.data_ptr(), 20, w.data_ptr(), 1e-5,
                               out.data_ptr(), 20, 3, 20) == 0  # fmt: skip
    assert torch.equal(x, want_x)
    torch.testing.assert_close(out, F.rms_norm(want_x, (20,), w, 1e-5), rtol=2e-6, atol=2e-6)
    gu, y = torch.randn(2, 18), torch.empty(2, 9)
    assert kernel.silu_mul(gu.data_ptr(), 18, y.data_ptr(), 9, 2, 9) == 0
    torch.testing.assert_close(y, F.silu(gu[:, :9]) * gu[:, 9:])
    assert kernel.silu_mul(gu.data_ptr(), 17, y.data_ptr(), 9, 2, 9) == -1  # ldg < 2I
    x = torch.tensor([[1.0, 3.0, 3.0, -1.0] * 5, [0.0] * 19 + [float("nan")]])
    got = torch.empty(2, dtype=torch.int64)
    assert kernel.argmax_rows(x.data_ptr(), 20, 2, 20, got.data_ptr()) == 0
    assert got.tolist() == [1, 19]


def argmax_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(rows, cols, generator=g) for rows, cols in ((1, 49152), (16, 49152), (64, 1000),
                                                                     (3, 7), (2, 8), (5, 9))]
    ties = torch.randn(4, 100, generator=g)
    ties[0, [5, 50, 99]] = 9.0  # equal maxima: the first
    ties[1, [3, 60]] = 9.0
    ties[2] = -float("inf")  # every entry masked out: index 0
    ties[3, :] = 0.0
    ties[3, 40] = -0.0  # signed zeros are equal: the first
    nans = torch.randn(4, 67, generator=g)
    nans[0, 66] = float("nan")  # a NaN is the largest, wherever it is
    nans[1, [20, 9]] = float("nan")  # the first NaN
    nans[2, 3], nans[2, 10] = float("inf"), float("nan")
    nans[3, 0] = float("nan")
    return [*cases, ties, nans]


@pytest.mark.parametrize("case", range(len(argmax_cases())))
def test_argmax_rows_is_torch_argmax(case: int) -> None:
    x = argmax_cases()[case]
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(dim=-1))
    wide = torch.zeros(x.shape[0], x.shape[1] + 5)
    wide[:, 2 : 2 + x.shape[1]] = x  # strided rows
    assert torch.equal(cpu_ops.argmax_rows(wide[:, 2 : 2 + x.shape[1]]), x.argmax(dim=-1))


def test_argmax_rows_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError):
        cpu_ops.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(ValueError):
        cpu_ops.argmax_rows(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError):
        cpu_ops.argmax_rows(torch.zeros(8, 2).t())  # columns not contiguous
