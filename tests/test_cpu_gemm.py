"""The CPU GEMM kernel on packed weights (kernels.cpu_gemm) against torch."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels import cpu_build, cpu_gemm, cpu_memory


@pytest.fixture(autouse=True, scope="module")
def _needs_kernel() -> None:
    if not cpu_gemm.available():
        pytest.skip(f"CPU GEMM kernel unavailable: {cpu_gemm.unavailable_reason()}")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + b in float64, rounded to float32."""
    y = x.double() @ w.double().T
    return (y if b is None else y + b.double()).float()


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    # Another summation order: differences of a few float32 ulps of the output's scale.
    assert got.dtype is torch.float32 and got.is_contiguous()
    scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("n", [960, 576, 3072, 7])
@pytest.mark.parametrize("k", [576, 1536, 37])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 33, 64, 97, 200])
def test_matches_torch(m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m * 10007 + k * 31 + n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n)
    packed = cpu_gemm.pack(w)
    assert packed.shape == (n, k)
    for threads in (1, 2):
        assert_matches(cpu_gemm.linear(x, packed, num_threads=threads), reference(x, w, None))
        assert_matches(cpu_gemm.linear(x, packed, b, num_threads=threads), reference(x, w, b))
    torch.testing.assert_close(cpu_gemm.linear(x, packed, b), x @ w.T + b, rtol=1e-4, atol=1e-3)


def test_exact_on_small_integers() -> None:
    """Integers small enough to be exact in float32: any summation order gives the same
    sums, so the kernel must equal the float64 product exactly, tails included."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-8, 8, (13, 45), generator=g).float()
    w = torch.randint(-8, 8, (37, 45), generator=g).float()
    b = torch.randint(-8, 8, (37,), generator=g).float()
    assert torch.equal(cpu_gemm.linear(x, cpu_gemm.pack(w), b), reference(x, w, b))


@pytest.mark.parametrize("m", [1, 4, 7])
@pytest.mark.parametrize("k", [1, 5, 8, 16, 100, 777])
def test_odd_sizes(m: int, k: int) -> None:
    for n in (1, 2, 3, 4, 5, 8, 9, 17, 100):
        x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        assert_matches(cpu_gemm.linear(x, w, b, num_threads=2), reference(x, w, b))


@pytest.mark.parametrize("m", [1, 5, 16])
def test_strided_rows(m: int) -> None:
    big = torch.randn(m * 2, 1600)
    x = big[::2, 10 : 10 + 576]  # each row contiguous, rows 3200 floats apart: no copy
    assert x.stride() == (3200, 1)
    w_big = torch.randn(3 * 960, 700)
    w = w_big[::3, 50 : 50 + 576]  # row-strided weight (rows contiguous): read in place
    b_big = torch.randn(960 * 2)
    b = b_big[::2]  # strided bias: copied
    for threads in (1, 2):
        assert_matches(cpu_gemm.linear(x, w, b, num_threads=threads), reference(x, w, b))
    xt = torch.randn(576, m).t()  # columns contiguous: copied
    assert_matches(cpu_gemm.linear(xt, w), reference(xt, w, None))


def test_empty_sizes() -> None:
    w, b = torch.randn(7, 5), torch.randn(7)
    assert cpu_gemm.linear(torch.randn(0, 5), w, b).shape == (0, 7)
    assert cpu_gemm.linear(torch.randn(3, 5), torch.randn(0, 5)).shape == (3, 0)
    got = cpu_gemm.linear(torch.randn(3, 0), torch.randn(7, 0), b)  # empty dot products
    torch.testing.assert_close(got, b.expand(3, 7))
    torch.testing.assert_close(cpu_gemm.linear(torch.randn(2, 0), torch.randn(4, 0)),
                               torch.zeros(2, 4))  # fmt: skip


def test_rejects_bad_inputs() -> None:
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    with pytest.raises(ValueError, match="2-d"):
        cpu_gemm.linear(x[0], w)
    with pytest.raises(ValueError, match="2-d"):
        cpu_gemm.linear(x, w[None])
    with pytest.raises(ValueError, match="columns"):
        cpu_gemm.linear(x[:, :7], w)
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.linear(x.double(), w)
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.linear(x, w.half())
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.linear(x, w, b.bfloat16())
    with pytest.raises(ValueError, match="bias must be"):
        cpu_gemm.linear(x, w, b[:5])
    with pytest.raises(ValueError, match="bias must be"):
        cpu_gemm.linear(x, w, b[None])
    with pytest.raises(ValueError, match="weight rows must be contiguous"):
        cpu_gemm.linear(x, torch.randn(8, 6).t())
    with pytest.raises(ValueError, match="CPU"):
        cpu_gemm.linear(x, torch.empty(6, 8, device="meta"))


def test_one_openmp_runtime_shared_with_torch() -> None:
    runtimes = cpu_build.openmp_runtimes()
    if not runtimes:
        pytest.skip("/proc/self/maps unreadable")
    assert len(runtimes) == 1, runtimes
    assert Path(runtimes[0]).parent == Path(torch.__file__).parent / "lib", runtimes


def test_scalar_fallback_build(tmp_path: Path) -> None:
    """The C file built without AVX2/FMA: its portable path."""
    cc = shutil.which("gcc")
    assert cc is not None  # available() is True
    lib_path = tmp_path / "scalar.so"
    flags = [f for f in cpu_gemm.CFLAGS if f != "-march=native"]
    cmd = [cc, *flags, "-mno-avx2", "-mno-fma", str(cpu_gemm.SOURCE), "-o", str(lib_path)]
    subprocess.run(cmd, check=True, capture_output=True)
    lib = ctypes.CDLL(str(lib_path))
    assert lib.packed_gemm_simd_level() == 0
    kernel = cpu_gemm.bind(lib)
    x, w, b = torch.randn(5, 37), torch.randn(11, 37), torch.randn(11)
    packed = torch.empty(kernel.packed_size(11, 37))
    assert packed.numel() == 16 * 37  # one zero-padded panel
    assert kernel.pack(w.data_ptr(), 37, 11, 37, packed.data_ptr()) == 0
    y = torch.empty(5, 11)
    assert kernel.linear(x.data_ptr(), 37, packed.data_ptr(), b.data_ptr(), y.data_ptr(), 11,
                         5, 11, 37, 2) == 0  # fmt: skip
    assert_matches(y, reference(x, w, b))
    assert kernel.linear(x.data_ptr(), 36, packed.data_ptr(), None, y.data_ptr(), 11,
                         5, 11, 37, 1) == -1  # fmt: skip


def test_simd_build_and_rejected_strides() -> None:
    lib = ctypes.CDLL(str(cpu_gemm.library_path()))
    assert lib.packed_gemm_simd_level() in (0, 1)
    kernel = cpu_gemm.bind(lib)
    x, y = torch.randn(2, 8), torch.full((2, 3), 7.0)
    packed = cpu_gemm.pack(torch.randn(3, 8)).data
    assert kernel.pack(x.data_ptr(), 7, 2, 8, y.data_ptr()) == -1  # ldw < K
    for ldx, ldy in ((7, 3), (8, 2)):
        assert kernel.linear(x.data_ptr(), ldx, packed.data_ptr(), None, y.data_ptr(), ldy,
                             2, 3, 8, 1) == -1  # fmt: skip
    assert (y == 7).all()  # nothing written


@pytest.fixture
def fresh_loader() -> Iterator[None]:
    """The loader as in a new process: nothing built or loaded yet."""
    cpu_gemm.forget_builds()
    yield
    cpu_gemm.forget_builds()  # what the test built or failed to build is not the real state


@pytest.mark.usefixtures("fresh_loader")
def test_unavailable_without_gcc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_build.shutil, "which", lambda _name: None)
    assert not cpu_gemm.available()
    assert "gcc not found" in (cpu_gemm.unavailable_reason() or "")
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_gemm.linear(torch.randn(2, 3), torch.randn(4, 3))


@pytest.mark.usefixtures("fresh_loader")
def test_builds_into_cache_dir_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    assert cpu_gemm.available()
    path = cpu_gemm.library_path()
    assert path.parent == tmp_path / "kernels" and path.name.startswith("packed_gemm-")
    mtime = path.stat().st_mtime_ns
    assert cpu_gemm.library_path() == path and path.stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_pack_all_shares_one_aligned_arena() -> None:
    ws = [torch.randn(n, k) for n, k in ((960, 576), (7, 5), (3072, 576))]
    packed = cpu_gemm.pack_all(ws)
    storage = packed[0].data.untyped_storage().data_ptr()
    assert all(p.data.untyped_storage().data_ptr() == storage for p in packed)
    assert [p.data.numel() for p in packed] == [cpu_gemm.packed_size(*w.shape) for w in ws]
    assert packed[0].data.data_ptr() % cpu_memory.HUGE_PAGE == 0  # the arena exceeds 2 MiB
    for w, p in zip(ws, packed, strict=True):
        x = torch.randn(3, w.shape[1])
        assert_matches(cpu_gemm.linear(x, p), reference(x, w, None))


def test_pack_into_a_wrong_buffer_is_refused() -> None:
    with pytest.raises(ValueError, match="out must be"):
        cpu_gemm.pack(torch.randn(4, 3), torch.empty(5))


def test_build_key_covers_included_headers(tmp_path: Path) -> None:
    """A kernel includes kernels/cpu/simd.h: editing the header must rebuild it."""
    (tmp_path / "shared.h").write_text("static int x;\n")
    source = tmp_path / "kernel.c"
    source.write_text('#include <math.h>\n#include "shared.h"\nint f(void) { return x; }\n')
    before = cpu_build.source_text(source)
    (tmp_path / "shared.h").write_text("static int x = 1;\n")
    assert cpu_build.source_text(source) != before
    assert "static int x = 1;" in cpu_build.source_text(source)
