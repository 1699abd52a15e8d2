"""The CPU kernels on quantised weights (kernels.cpu_quant) against gguf's dequantiser and torch.

Every path of the library runs every case: the AVX-512 one and the AVX2/FMA/F16C one
(where the CPU has them) and the portable C one (``set_isa``)."""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch

from common.model.gguf_file import read_gguf
from common.model.loader import ModelNotFoundError, default_gguf_path
from kernels import cpu_quant
from kernels.quant_formats import QuantFormat, QuantWeight, quantize_int8_rows

GGUF_FORMATS = [QuantFormat.Q8_0, QuantFormat.Q4_0, QuantFormat.Q4_1]


@pytest.fixture(autouse=True, scope="module")
def _needs_kernel() -> Iterator[None]:
    if not cpu_quant.available():
        pytest.skip(f"CPU quant kernel unavailable: {cpu_quant.unavailable_reason()}")
    # torch's own references on one thread: tiny products, where a second thread only waits
    # (the kernel's threads are set per call).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def real_tensors() -> dict[str, tuple[QuantWeight, torch.Tensor]]:
    """A few rows of the default model's own tensors (embedding Q8_0, layer 0 Q4_1) as
    QuantWeights, with gguf's dequantisation of them."""
    try:
        file = read_gguf(default_gguf_path())
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    out = {}
    for name, rows in (("token_embd.weight", [0, 1, 2, 9000, 49151]),
                       ("blk.0.attn_k.weight", range(192)), ("blk.0.ffn_down.weight", range(0, 576, 7))):
        info = file.tensors[name]
        (k, n), ttype = info.shape, info.ggml_type
        fmt = QuantFormat.from_ggml_type(ttype)
        row_bytes = fmt.row_bytes(k)
        data = torch.from_numpy(np.array(file.tensor_bytes(name, n * row_bytes).reshape(n, row_bytes)[list(rows)]))
        out[name] = QuantWeight(fmt, len(rows), k, data), torch.from_numpy(
            gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(ttype)))
    return out


@pytest.fixture(params=list(cpu_quant.ISAS))
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test on one path of the library, then lets the CPU choose again."""
    cpu_quant.set_isa(request.param)
    try:
        if cpu_quant.isa() != request.param:
            pytest.skip(f"this CPU lacks the {request.param} path's instructions")
        yield request.param
    finally:
        cpu_quant.set_isa(None)


def quantized(fmt: QuantFormat, n: int, k: int, seed: int) -> QuantWeight:
    """A random weight quantised by gguf itself (INT8_ROW: by quantize_int8_rows)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if fmt is QuantFormat.INT8_ROW:
        return quantize_int8_rows(w)
    blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
    return QuantWeight(fmt, n, k, torch.from_numpy(blocks.reshape(n, -1)))


def small_integer_weight(fmt: QuantFormat, n: int, k: int, g: torch.Generator) -> QuantWeight:
    """Random integer weights in [-8, 8) with unit scales (Q4_1: m = -8) in ``fmt``: every
    product with small integer x is exact in float32, whatever the summation order."""
    q = torch.randint(-8, 8, (n, k), generator=g)
    if fmt is QuantFormat.INT8_ROW:
        w = QuantWeight(fmt, n, k, q.to(torch.int8).view(torch.uint8), torch.ones(n))
    else:
        blocks = torch.zeros(n, k // 32, fmt.block_bytes, dtype=torch.uint8)
        blocks[..., 0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
        qb = q.reshape(n, k // 32, 32)
        if fmt is QuantFormat.Q8_0:
            blocks[..., 2:] = qb.to(torch.int8).view(torch.uint8)
        else:
            nib = (qb + 8).to(torch.uint8)
            blocks[..., -16:] = nib[..., :16] | nib[..., 16:] << 4
            if fmt is QuantFormat.Q4_1:
                blocks[..., 2:4] = torch.tensor([-8.0], dtype=torch.float16).view(torch.uint8)
        w = QuantWeight(fmt, n, k, blocks.reshape(n, -1))
    assert torch.equal(w.dequantize(), q.float())
    return w


def gguf_dequantize(w: QuantWeight) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType(w.fmt.ggml_type)))


def reference(x: torch.Tensor, w: QuantWeight, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w.dequantize().T + b in float64, rounded to float32."""
    y = x.double() @ w.dequantize().double().T
    return (y if b is None else y + b.double()).float()


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    # Another summation order (and for Q4, d*sum(x*q) + m*sum(x)): a few float32 ulps.
    assert got.dtype is torch.float32 and got.is_contiguous() and got.shape == want.shape
    scale = float(want.abs().max()) if want.numel() else 1.0
    # (torch.allclose, not torch.testing.assert_close: that one's first call costs seconds)
    worst = float((got - want).abs().max() / scale) if want.numel() else 0.0
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * scale), f"max |diff| / max |want| = {worst:.2e}"


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_embedding_bit_exact_to_gguf(fmt: QuantFormat, isa: str) -> None:
    w = quantized(fmt, 37, 576, seed=1)
    want = gguf_dequantize(w)
    assert torch.equal(w.dequantize(), want)  # the reference this file trusts elsewhere
    ids = torch.tensor([0, 36, 5, 5, 16, 17, 31, 32])
    assert torch.equal(cpu_quant.embedding(cpu_quant.pack(w), ids), want[ids])
    assert cpu_quant.embedding(cpu_quant.pack(w), ids[:0]).shape == (0, 576)


def test_int8_row_embedding_exact() -> None:
    w = quantized(QuantFormat.INT8_ROW, 21, 37, seed=2)
    ids = torch.arange(20, -1, -1)
    assert torch.equal(cpu_quant.embedding(cpu_quant.pack(w), ids), w.dequantize()[ids])


def test_real_gguf_tensors(real_tensors: dict[str, tuple[QuantWeight, torch.Tensor]], isa: str) -> None:
    assert {w.fmt for w, _ in real_tensors.values()} == {QuantFormat.Q8_0, QuantFormat.Q4_1}
    for name, (w, want) in real_tensors.items():
        packed = cpu_quant.pack(w)
        assert torch.equal(cpu_quant.embedding(packed, torch.arange(w.n)), want), name
        x = torch.randn(3, w.k)
        assert_matches(cpu_quant.linear(x, packed), (x.double() @ want.double().T).float())


@pytest.mark.parametrize("k", [32, 576, 1536])
@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_linear_matches_torch(fmt: QuantFormat, k: int, isa: str) -> None:
    n = 149  # 9 full panels of 16 rows and a partial one
    w = quantized(fmt, n, k, seed=k)
    packed = cpu_quant.pack(w)
    assert (packed.fmt, packed.n, packed.k) == (fmt, n, k) and packed.nbytes == packed.data.numel()
    g = torch.Generator().manual_seed(k + 1)
    b, dense = torch.randn(n, generator=g), w.dequantize().double()
    # every GEMV tile of both vector paths, both sides of QG_GEMV_MAX, QG_GEMV_MAX16(_WIDE)
    # and QG_AMX_MIN
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 16, 23, 24, 25, 40, 41, 64, 100, 128, 129):
        x = torch.randn(m, k, generator=g)
        want = x.double() @ dense.T
        assert_matches(cpu_quant.linear(x, packed, num_threads=1), want.float())
        assert_matches(cpu_quant.linear(x, packed, b, num_threads=2), (want + b.double()).float())


@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_exact_on_small_integers(fmt: QuantFormat, isa: str) -> None:
    """Scales 1 (Q4_1: m = -8) and small integer x: every partial sum is exact in float32,
    so any order must give the float64 product exactly, tails included."""
    g = torch.Generator().manual_seed(3)
    w = small_integer_weight(fmt, 21, 64, g)
    n, k = w.n, w.k
    packed, b = cpu_quant.pack(w), torch.randint(-8, 8, (n,), generator=g).float()
    for m in (1, 2, 3, 4, 5, 8, 13):
        x = torch.randint(-8, 8, (m, k), generator=g).float()
        assert torch.equal(cpu_quant.linear(x, packed, b), reference(x, w, b))


def test_strided_and_empty_inputs(isa: str) -> None:
    w = quantized(QuantFormat.Q4_1, 40, 64, seed=4)
    packed = cpu_quant.pack(w)
    big = torch.randn(5, 100)
    for x in (big[:, 10:74], big[:, :64].t().contiguous().t()[:3]):  # strided rows; column-major
        assert_matches(cpu_quant.linear(x, packed), reference(x, w, None))
    assert cpu_quant.linear(torch.empty(0, 64), packed).shape == (0, 40)


def test_isa_names_the_path() -> None:
    best = cpu_quant.isa()
    assert best in cpu_quant.ISAS
    try:
        for cap in cpu_quant.ISAS:  # a cap never raises the path above the CPU's best
            cpu_quant.set_isa(cap)
            assert cpu_quant.isa() == min(cap, best, key=cpu_quant.ISAS.index)
        with pytest.raises(ValueError, match="unknown ISA"):
            cpu_quant.set_isa("sse2")
    finally:
        cpu_quant.set_isa(None)
    assert cpu_quant.isa() == best


def vnni_or_skip() -> None:
    cpu_quant.set_isa(None)
    if cpu_quant.isa() not in ("avx512vnni", "amx"):  # AMX CPUs run it too, for decode
        pytest.skip("this CPU lacks AVX-512 VNNI + VBMI: no integer GEMV to test")


# The two integer GEMVs: (the ISA cap that takes it, its path, the most rows it runs)
INTEGER_GEMVS = {"vnni": (None, "gemv_vnni", 8), "avx2_int": ("avx2", "gemv_avx2_int", 1)}


@pytest.fixture(params=list(INTEGER_GEMVS))
def integer_gemv(request: pytest.FixtureRequest) -> Iterator[int]:
    """Runs the test on one integer GEMV (the ISA capped to reach it); yields its most rows."""
    cap, name, rows = INTEGER_GEMVS[request.param]
    cpu_quant.set_isa(cap)
    try:
        if cpu_quant.path(QuantFormat.Q4_1, 1, 64) != name:
            pytest.skip(f"this CPU does not run {name}")
        yield rows
    finally:
        cpu_quant.set_isa(None)


def row_by_row(x: torch.Tensor, packed: cpu_quant.QuantPacked, rows: int) -> torch.Tensor:
    """linear over x in slices of at most ``rows`` rows (the integer GEMV's own sizes)."""
    return torch.cat([cpu_quant.linear(x[i : i + rows], packed, num_threads=2) for i in range(0, len(x), rows)])


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_integer_gemv_is_as_accurate_as_float32(fmt: QuantFormat, integer_gemv: int) -> None:
    """The integer GEMV rounds x once, to 23 bits of each block's largest |x|: whatever the
    spread of x within a block (outliers, tiny values, zero blocks), every output stays
    within that bound of the exact product, plus float32 rounding of the sums."""
    g = torch.Generator().manual_seed(11)
    w = quantized(fmt, 48, 256, seed=12)
    packed, dense = cpu_quant.pack(w), w.dequantize().double()
    x = torch.randn(8, 256, generator=g)
    x[0, 3] = 3e4  # an outlier beside values 1e4 times smaller
    x[1] *= 1e-30  # tiny, far from 1: the scale is a power of two, not a fixed range
    x[2, 32:64] = 0.0  # an all-zero block
    x[3, ::7] = -x[3, ::7] * 1e-6
    got = row_by_row(x, packed, integer_gemv).double()
    xd = x.double()
    want = xd @ dense.T
    block_max = xd.abs().view(8, -1, 32).amax(-1)  # [M, blocks]
    w_abs = dense.abs().view(48, -1, 32).sum(-1)  # [N, blocks]
    bound = block_max @ w_abs.T * 2.0**-23 + (xd.abs() @ dense.abs().T) * 2e-6
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() / bound).max())


def test_integer_gemv_leaves_non_finite_x_to_the_float_path(integer_gemv: int) -> None:
    """A NaN or an infinity anywhere in a block (either half of the vectors that find its
    largest |x|: vmaxps alone may drop a NaN) sends the call to the float GEMV: no finite
    output in its row, NaN where the float GEMV has NaN (the VNNI path: the AVX-512 GEMV's
    very bits; the AVX2 one: the AVX2 float GEMV's, which runs both rows at once)."""
    w = quantized(QuantFormat.Q4_1, 32, 64, seed=13)
    packed = cpu_quant.pack(w)
    cap = cpu_quant.isa()
    vnni = cap in ("avx512vnni", "amx")
    for col, bad in [(5, float("nan")), (40, float("inf")), (31, float("nan")), (16, float("-inf")), (9, float("nan"))]:
        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(14))
        x[0, col], x[1, 63 - col] = bad, bad
        got = row_by_row(x, packed, integer_gemv)
        cpu_quant.set_isa("avx512" if vnni else "avx2")
        try:
            want = cpu_quant.linear(x, packed)
        finally:
            cpu_quant.set_isa(cap)
        assert not bool(got.isfinite().any()) and torch.equal(got.isnan(), want.isnan()), col
        assert not vnni or torch.equal(got[~got.isnan()], want[~want.isnan()]), col


@pytest.mark.parametrize("fmt", [QuantFormat.Q4_0, QuantFormat.Q4_1])
def test_avx2_integer_gemv_equals_the_vnni_one_to_the_bit(fmt: QuantFormat) -> None:
    """Both integer GEMVs write x in the same digits, sum exact integer products and
    combine the digit sums in float32 in the same order: the same bits, strided x, bias
    and a partial panel included."""
    vnni_or_skip()
    g = torch.Generator().manual_seed(19)
    w = quantized(fmt, 16 * 4 + 5, 576, seed=20)
    packed, b = cpu_quant.pack(w), torch.randn(w.n, generator=g)
    for x in (torch.randn(1, 576, generator=g), torch.randn(2, 600, generator=g)[1:, 7:583]):
        want = cpu_quant.linear(x, packed, b)
        cpu_quant.set_isa("avx2")
        try:
            assert cpu_quant.path(fmt, 1, 576) == "gemv_avx2_int"
            got = cpu_quant.linear(x, packed, b)
        finally:
            cpu_quant.set_isa(None)
        assert torch.equal(got, want)


def test_each_isa_cap_takes_its_own_paths() -> None:
    """The path for a size never exceeds the cap: GEMV tiles for few rows and a GEMM for
    many, each of the capped instruction set (on AVX-512, the AVX2 GEMM or the AVX-512 one
    by how the core runs a 512-bit FMA), and AMX only under the "amx" cap."""
    allowed = {
        "portable": ({"gemm_c"}, {"gemm_c"}),
        "avx2": ({"gemv_avx2_int"}, {"gemm_avx2"}),
        "avx512": ({"gemv_avx512"}, {"gemm_avx512", "gemm_avx2"}),
        "avx512vnni": ({"gemv_vnni"}, {"gemm_avx512", "gemm_avx2"}),
        "amx": ({"gemv_vnni"}, {"gemm_amx"}),
    }
    seen = 0
    try:
        for cap, (few, many) in allowed.items():
            cpu_quant.set_isa(cap)
            if cpu_quant.isa() != cap:
                continue  # the CPU lacks it
            seen += 1
            assert cpu_quant.path(QuantFormat.Q4_1, 1, 64) in few, cap
            assert cpu_quant.path(QuantFormat.Q4_1, 2048, 64) in many, cap
            if cap == "avx2":  # the integer GEMV only for Q4 at one row
                assert cpu_quant.path(QuantFormat.Q4_1, 2, 64) == "gemv_avx2"
                assert cpu_quant.path(QuantFormat.Q8_0, 1, 64) == "gemv_avx2"
    finally:
        cpu_quant.set_isa(None)
    assert seen >= 1  # portable, at least


@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_avx512_gemm_equals_the_avx2_gemm_to_the_bit(fmt: QuantFormat) -> None:
    """Above the GEMV's sizes the AVX-512 path runs 12 x 32 tiles over pairs of dequantised
    panels where the AVX2 one runs 6 x 16 tiles over one: each element is still one FMA
    chain over k in order, so the two agree bit for bit: every tile height (the rows of a
    block split into tiles of up to 12), a lone panel at the end of a thread's share, bias
    and strided x included."""
    cpu_quant.set_isa("avx512")
    try:
        if cpu_quant.isa() != "avx512":
            pytest.skip("this CPU lacks AVX-512")
        if cpu_quant.path(fmt, 300, 64) != "gemm_avx512":
            pytest.skip("this CPU splits a 512-bit FMA (Zen 4): its AVX-512 path runs the AVX2 GEMM")
    finally:
        cpu_quant.set_isa(None)
    g = torch.Generator().manual_seed(17)
    k = 1 if fmt is QuantFormat.INT8_ROW else 64
    n = 16 * 5 + 3  # 6 panels: a lone one at the end of a thread's three, a partial one
    w = quantize_int8_rows(torch.randn(n, 45, generator=g)) if k == 1 else quantized(fmt, n, k, seed=18)
    packed, b = cpu_quant.pack(w), torch.randn(n, generator=g)
    got = {}
    for isa in ("avx512", "avx2"):
        cpu_quant.set_isa(isa)
        try:
            for m in (*range(193, 205), 129, 300):  # (blocks of 192 rows, then 1 to 12)
                x = torch.randn(m, w.k + 4, generator=torch.Generator().manual_seed(m))[:, 2 : 2 + w.k]
                for threads in (1, 2):
                    got[isa, m, threads] = cpu_quant.linear(x, packed, b, num_threads=threads)
        finally:
            cpu_quant.set_isa(None)
    for (_, m, threads), y in got.items():
        assert torch.equal(y, got["avx2", m, threads]), (m, threads)
    assert_matches(got["avx512", 300, 2], reference(x, w, b))


def amx_or_skip() -> None:
    cpu_quant.set_isa(None)
    if cpu_quant.isa() != "amx":
        pytest.skip("this CPU (or its kernel) gives no AMX-BF16: no tile GEMM to test")


@pytest.mark.parametrize("fmt", [*GGUF_FORMATS, QuantFormat.INT8_ROW])
def test_amx_gemm_is_exact_on_small_integers_at_every_shape(fmt: QuantFormat) -> None:
    """The tile GEMM pads x to 16-row tiles, runs passes of two tiles (the last may have
    one) over pairs of panels, in blocks of 128 rows: rows past M, a lone panel at the end
    of a thread's share, a partial panel and bias must not leak into y. Small integers
    keep every sum exact, so y equals float64's bit for bit."""
    amx_or_skip()
    g = torch.Generator().manual_seed(19)
    w = small_integer_weight(fmt, 16 * 4 + 5, 96, g)  # 5 panels: 3 + 2 on two threads
    packed, b = cpu_quant.pack(w), torch.randint(-8, 8, (w.n,), generator=g).float()
    for m in (12, 16, 17, 33, 48, 63, 64, 65, 129, 160, 300):
        x = torch.randint(-8, 8, (m, w.k + 3), generator=g).float()[:, 1 : 1 + w.k]  # strided
        for threads in (1, 2, 3):
            assert torch.equal(cpu_quant.linear(x, packed, b, num_threads=threads), reference(x, w, b)), (m, threads)


@pytest.mark.parametrize("fmt", [*GGUF_FORMATS, QuantFormat.INT8_ROW])
def test_amx_gemm_is_as_accurate_as_float32(fmt: QuantFormat) -> None:
    """x goes to the tile unit as three bf16 parts that sum to it exactly, the weights as
    their integer codes (exact in bf16): whatever the spread of x (outliers, tiny values,
    zero blocks), every output is within float32 summation error of the exact product,
    no further from it than the float paths' (the GEMM's, or the GEMV's, whose per-block
    d*t + m*sum(x) it shares; INT8_ROW's tiles sum all of K, then one row scale)."""
    amx_or_skip()
    g = torch.Generator().manual_seed(21)
    w = quantized(fmt, 80, 576, seed=22)
    packed, dense = cpu_quant.pack(w), w.dequantize().double()
    x = torch.randn(70, 576, generator=g)
    x[0, 3] = 3e4  # an outlier beside values 1e4 times smaller
    x[1] *= 1e-30  # tiny: its parts stay normal floats
    x[2, 32:64] = 0.0  # an all-zero block
    x[3, ::7] = -x[3, ::7] * 1e-6
    got = cpu_quant.linear(x, packed, num_threads=2).double()
    cpu_quant.set_isa("avx512")
    try:
        gemm = cpu_quant.linear(x, packed, num_threads=2).double()
        gemv = torch.cat([cpu_quant.linear(x[i : i + 8], packed).double() for i in range(0, 70, 8)])
    finally:
        cpu_quant.set_isa(None)
    want = x.double() @ dense.T
    scale = x.double().abs() @ dense.abs().T  # what float32 sums round against
    err = lambda y: float(((y - want).abs() / scale).max())  # noqa: E731
    assert err(got) <= 2.0**-17 and err(got) <= max(err(gemm), err(gemv)), (err(got), err(gemm), err(gemv))


def test_amx_gemm_leaves_non_finite_x_to_the_float_path() -> None:
    amx_or_skip()
    w = quantized(QuantFormat.Q4_1, 48, 64, seed=23)
    packed = cpu_quant.pack(w)
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(24))
    x[0, 5], x[33, 40] = float("nan"), float("inf")
    got = cpu_quant.linear(x, packed)
    cpu_quant.set_isa("avx512")
    try:
        want = cpu_quant.linear(x, packed)
    finally:
        cpu_quant.set_isa(None)
    assert bool(got.isnan().any()) and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("k", [1, 7, 45])
def test_int8_rows_of_any_length(k: int, isa: str) -> None:
    """INT8_ROW takes any K: the vector paths' tails past their unrolled steps."""
    g = torch.Generator().manual_seed(k)
    w = quantize_int8_rows(torch.randn(35, k, generator=g))
    packed = cpu_quant.pack(w)
    for m in (1, 3, 5, 9, 30, 40):  # 40: past where a K of whole blocks would take the tile GEMM
        x = torch.randn(m, k, generator=g)
        assert_matches(cpu_quant.linear(x, packed), reference(x, w, None))


def test_argument_errors() -> None:
    w = quantized(QuantFormat.Q8_0, 20, 64, seed=5)
    packed = cpu_quant.pack(w)
    bad_x = [torch.randn(2, 64, dtype=torch.float64), torch.randn(2, 63), torch.randn(64),
             torch.empty(2, 64, device="meta")]
    for x in bad_x:
        with pytest.raises(ValueError):
            cpu_quant.linear(x, packed)
    for bias in (torch.randn(19), torch.randn(20, dtype=torch.float64)):
        with pytest.raises(ValueError, match="bias"):
            cpu_quant.linear(torch.randn(2, 64), packed, bias)
    with pytest.raises(ValueError, match="QuantPacked"):
        cpu_quant.linear(torch.randn(2, 64), w)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="QuantWeight"):
        cpu_quant.pack(torch.randn(20, 64))  # type: ignore[arg-type]
    for ids in (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([[0]]), torch.tensor([3, 20]),
                torch.tensor([-1])):
        with pytest.raises(ValueError):
            cpu_quant.embedding(packed, ids)
    with pytest.raises(ValueError, match="uint8"):
        cpu_quant.pack(w, out=torch.empty(7, dtype=torch.uint8))
