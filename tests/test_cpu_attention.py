"""The fused CPU paged decode attention kernel against the torch reference."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels import cpu_attention, reference


@pytest.fixture(autouse=True, scope="module")
def _needs_kernel() -> None:
    # A kernel that no longer builds is a regression, not a reason to skip: every CPU
    # engine uses it for decode attention (the engine falls back silently, tests must not).
    assert cpu_attention.available(), f"CPU kernel unavailable: {cpu_attention.unavailable_reason()}"


def make_case(
    lens: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k/v layer views of a 3-layer cache (strided block dim), shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 3
    kv = torch.randn(num_blocks, 3, 2, block_size, kv_heads, dim, generator=g).to(dtype)
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    perm = torch.randperm(num_blocks, generator=g)
    width = max(per_seq) + 2
    # Entries past a sequence's blocks are ignored, so fill them with invalid ids.
    tables = torch.full((len(lens), width), num_blocks + 7, dtype=torch.int32)
    start = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = perm[start : start + nb].to(torch.int32)
        start += nb
    q = torch.randn(len(lens), heads, dim, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


LENS = [1, 16, 37, 48, 5, 100, 33]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3), (4, 4), (7, 1), (8, 1)])
@pytest.mark.parametrize("dim", [64, 32])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_reference(heads: int, kv_heads: int, dim: int, threads: int) -> None:
    q, k, v, tables, lens = make_case(LENS, heads, kv_heads, dim)
    scale = dim**-0.5
    got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, scale, num_threads=threads)
    want = reference.paged_decode_attention(q, k, v, tables, lens, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 2, 12])
def test_work_item_granularity(batch: int) -> None:
    # One short sequence: a work item per kv head; more: one per sequence (parts of long
    # ones: test_few_sequences_split_their_tokens_into_parts).
    lens = [(37 * i) % 90 + 1 for i in range(batch)]
    q, k, v, tables, ctx = make_case(lens, 6, 3, 64, seed=batch)
    got = cpu_attention.paged_decode_attention(q, k, v, tables, ctx, 0.2, num_threads=2)
    want = reference.paged_decode_attention(q, k, v, tables, ctx, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens", [[1000], [600, 0], [64, 700, 3], [2048]])
@pytest.mark.parametrize("threads", [2, 3])
def test_few_sequences_split_their_tokens_into_parts(lens: list[int], threads: int) -> None:
    # Fewer sequences than the threads can share evenly: each one's tokens are
    # split into parts of at least 128, merged by their maxima and sums (parts that do not
    # start on a block, a sequence shorter than a part, an empty one beside a long one).
    q, k, v, tables, ctx = make_case(lens, 9, 3, 64, seed=len(lens))
    q = q * 4  # peaked softmax rows: the parts' maxima differ
    got = cpu_attention.paged_decode_attention(q, k, v, tables, ctx, 0.125, num_threads=threads)
    want = reference.paged_decode_attention(q, k, v, tables, ctx, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    one = cpu_attention.paged_decode_attention(q, k, v, tables, ctx, 0.125, num_threads=1)
    torch.testing.assert_close(got, one, rtol=1e-5, atol=1e-5)  # one thread: never split


@pytest.fixture(scope="module")
def scalar_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The C file built without AVX2/FMA: its portable path."""
    cc = shutil.which("gcc")
    assert cc is not None  # available() is True
    lib = tmp_path_factory.mktemp("scalar") / "scalar.so"
    flags = [f for f in cpu_attention.CFLAGS if f != "-march=native"]
    cmd = [cc, *flags, "-mno-avx2", "-mno-fma", str(cpu_attention.SOURCE), "-o", str(lib), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True)
    return ctypes.CDLL(str(lib))


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


def test_the_native_build_takes_the_avx512_path_exactly_where_the_cpu_has_it() -> None:
    lib = ctypes.CDLL(str(cpu_attention.library_path(torch.float32)))
    want = 2 if {"avx512f", "avx512dq"} <= _cpu_flags() else 1
    assert lib.paged_attention_simd_level() == want


@pytest.mark.parametrize("new,context,heads,kv_heads,dim", [
    (256, 256, 9, 3, 64),  # a whole prompt
    (37, 100, 9, 3, 64),  # a later chunk: a cached prefix, tiles of rows and keys cut short
    (1, 17, 4, 2, 64),  # one row
    (100, 100, 8, 1, 128),
    (13, 13, 4, 4, 64),
    (40, 70, 7, 7, 64),
    (300, 700, 9, 3, 64),  # many row tiles after a prefix: diagonal tiles, maxima rising tile by tile
    (33, 90, 4, 2, 128),
])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_kernel_matches_the_reference(new, context, heads, kv_heads, dim, threads) -> None:
    if not cpu_attention.prefill_available():
        pytest.skip(f"no prefill kernel here: {cpu_attention.prefill_unavailable_reason()}")
    q, k, v, tables, _ = make_case([context], heads, kv_heads, dim, seed=new)
    queries = torch.randn(new, heads, dim, generator=torch.Generator().manual_seed(context))
    queries[0, 0] *= 40  # a peaked softmax: the running max must rescale what came before
    got = cpu_attention.paged_prefill_attention(queries, k, v, tables[0], context, dim**-0.5,
                                                num_threads=threads)
    want = reference.paged_prefill_attention(queries, k, v, tables[:1], torch.tensor([0, new]),
                                             torch.tensor([context]), dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prefill_kernel_is_there_exactly_where_the_cpu_has_avx512() -> None:
    assert cpu_attention.prefill_available() == ({"avx512f", "avx512dq"} <= _cpu_flags())
    if cpu_attention.prefill_available():
        q, k, v, tables, _ = make_case([20], 4, 2, 64)
        with pytest.raises(ValueError, match="outside"):
            bad = tables[0].clone()
            bad[0] = 10_000
            cpu_attention.paged_prefill_attention(torch.randn(4, 4, 64), k, v, bad, 20, 0.125)
        with pytest.raises(ValueError, match="do not fit"):
            cpu_attention.paged_prefill_attention(torch.randn(30, 4, 64), k, v, tables[0], 20, 0.125)


def test_a_build_without_avx512_has_no_prefill_kernel(tmp_path: Path) -> None:
    cc = shutil.which("gcc")
    assert cc is not None
    lib_path = tmp_path / "prefill_avx2.so"
    cmd = [cc, *cpu_attention.CFLAGS, "-mno-avx512f", str(cpu_attention.PREFILL_SOURCE), "-o", str(lib_path), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True)
    lib = ctypes.CDLL(str(lib_path))
    assert lib.prefill_attention_available() == 0
    fn = cpu_attention.bind_prefill(lib)
    _, k, v, tables, _ = make_case([17], 4, 2, 64)
    q = torch.randn(17, 4, 64)
    out = torch.empty_like(q)
    args = (q.data_ptr(), 4 * 64, k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), 2 * 64, 64,
            k.shape[0], tables[0].data_ptr(), 17, 17, 4, 2, 64, k.shape[1], 0.125, out.data_ptr(), 4 * 64, 1)
    assert fn(*args) == -1  # the caller takes torch's path


@pytest.fixture(scope="module")
def avx2_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The C file built for AVX2 + FMA only: the tiles an AVX-512 machine never runs."""
    if not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA")
    cc = shutil.which("gcc")
    assert cc is not None  # available() is True
    lib = tmp_path_factory.mktemp("avx2") / "avx2.so"
    cmd = [cc, *cpu_attention.CFLAGS, "-mno-avx512f", "-DPA_DTYPE=0", str(cpu_attention.SOURCE),
           "-o", str(lib), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True)
    return ctypes.CDLL(str(lib))


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 2), (4, 4)])
def test_avx2_build_matches_reference(avx2_lib: ctypes.CDLL, heads: int, kv_heads: int) -> None:
    assert avx2_lib.paged_attention_simd_level() == 1
    fn = cpu_attention.bind(avx2_lib, torch.float32)
    q, k, v, tables, lens = make_case(LENS, heads, kv_heads, 64)
    out = torch.empty_like(q)
    rc = fn(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), kv_heads * 64, 64,
        k.shape[0], tables.data_ptr(), tables.stride(0), tables.shape[1], lens.data_ptr(),
        len(LENS), heads, kv_heads, 64, 16, 0.125, out.data_ptr(), 2,
    )  # fmt: skip
    assert rc == 0
    want = reference.paged_decode_attention(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scalar_fallback_build(scalar_lib: ctypes.CDLL, dtype: torch.dtype) -> None:
    assert scalar_lib.paged_attention_simd_level() == 0
    fn = cpu_attention.bind(scalar_lib, dtype)
    q, k, v, tables, lens = make_case(LENS, 9, 3, 64, dtype=dtype)
    if dtype == torch.float16:  # exercise the subnormal half conversion too
        k[0], v[0] = k[0] * 1e-5, v[0] * 1e-5
    out = torch.empty_like(q)
    rc = fn(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), 3 * 64, 64,
        k.shape[0], tables.data_ptr(), tables.stride(0), tables.shape[1], lens.data_ptr(),
        len(LENS), 9, 3, 64, 16, 0.125, out.data_ptr(), 2,
    )  # fmt: skip
    assert rc == 0
    want = reference.paged_decode_attention(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_matches_dense_last_row() -> None:
    heads, kv_heads, dim = 9, 3, 64
    q, k, v, tables, lens = make_case(LENS, heads, kv_heads, dim, seed=1)
    got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, 0.125)
    for i, n in enumerate(lens.tolist()):
        kd = reference.gather_kv(k, tables[i, : -(-n // 16)], n)
        vd = reference.gather_kv(v, tables[i, : -(-n // 16)], n)
        qd = torch.randn(n, heads, dim)
        qd[-1] = q[i]
        want = reference.dense_causal_attention(qd, kd, vd, 0.125)[-1]
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim,block_size", [(20, 5), (24, 3), (128, 1)])
def test_odd_dims_and_block_sizes(dim: int, block_size: int) -> None:
    q, k, v, tables, lens = make_case([1, 9, 17, 30], 6, 2, dim, block_size=block_size)
    got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, 0.3, num_threads=2)
    want = reference.paged_decode_attention(q, k, v, tables, lens, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_caches(dtype: torch.dtype) -> None:
    q, k, v, tables, lens = make_case(LENS, 9, 3, 64, dtype=dtype)
    got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, 0.125, num_threads=2)
    want = reference.paged_decode_attention(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_peaked_softmax_is_stable() -> None:
    q, k, v, tables, lens = make_case(LENS, 4, 2, 64, seed=2)
    q = q * 40  # logits in the hundreds: exp without the max shift would overflow
    got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, 1.0)
    want = reference.paged_decode_attention(q, k, v, tables, lens, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_out_param_int64_tables_and_empty_context() -> None:
    q, k, v, tables, lens = make_case([0, 20, 1], 4, 2, 32)
    wide = torch.cat([tables.long(), tables.long()], dim=1)[:, : tables.shape[1]]
    out = torch.full_like(q, float("nan"))
    got = cpu_attention.paged_decode_attention(q, k, v, wide, lens.long(), 0.5, out=out)
    assert got is out
    want = reference.paged_decode_attention(q, k, v, tables, lens, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[0] == 0).all()


def test_empty_batch() -> None:
    q, k, v, tables, lens = make_case([3], 4, 2, 32)
    got = cpu_attention.paged_decode_attention(q[:0], k, v, tables[:0], lens[:0], 0.5)
    assert got.shape == (0, 4, 32)


def test_rejects_head_dim_mismatch() -> None:
    q, k, v, tables, lens = make_case([3, 4], 4, 2, 32)
    with pytest.raises(ValueError, match="head_dim"):
        cpu_attention.paged_decode_attention(q[..., :16].contiguous(), k, v, tables, lens, 1.0)


def test_rejects_non_multiple_heads() -> None:
    q, k, v, tables, lens = make_case([3, 4], 4, 3, 32)
    with pytest.raises(ValueError, match="multiple"):
        cpu_attention.paged_decode_attention(q, k, v, tables, lens, 1.0)


def test_rejects_context_longer_than_block_table() -> None:
    q, k, v, tables, lens = make_case([3, 40], 4, 2, 32)
    lens[1] = tables.shape[1] * 16 + 1
    with pytest.raises(ValueError, match=r"context_lens\[1\]"):
        cpu_attention.paged_decode_attention(q, k, v, tables, lens, 1.0)


def test_rejects_block_id_out_of_range() -> None:
    q, k, v, tables, lens = make_case([3, 40], 4, 2, 32)
    tables[1, 2] = k.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[1\]"):
        cpu_attention.paged_decode_attention(q, k, v, tables, lens, 1.0)


def test_rejects_bad_layouts_and_dtypes() -> None:
    q, k, v, tables, lens = make_case([3, 4], 4, 2, 32)
    with pytest.raises(ValueError, match="contiguous"):
        bad_k = k.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, [KVH, BS] order
        cpu_attention.paged_decode_attention(q, bad_k, v, tables, lens, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_attention.paged_decode_attention(
            q.transpose(0, 1).contiguous().transpose(0, 1), k, v, tables, lens, 1.0
        )
    with pytest.raises(ValueError, match="float32"):
        cpu_attention.paged_decode_attention(q.double(), k, v, tables, lens, 1.0)


def test_one_openmp_runtime_shared_with_torch() -> None:
    runtimes = cpu_attention.openmp_runtimes()
    if not runtimes:
        pytest.skip("/proc/self/maps unreadable")
    assert len(runtimes) == 1, runtimes
    assert Path(runtimes[0]).parent == Path(torch.__file__).parent / "lib", runtimes


@pytest.fixture
def fresh_loader() -> Iterator[None]:
    """The loader as in a new process: nothing built or loaded yet."""
    cpu_attention.forget_builds()
    yield
    cpu_attention.forget_builds()  # what the test built or failed to build is not the real state


@pytest.mark.usefixtures("fresh_loader")
def test_unavailable_without_gcc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_attention.shutil, "which", lambda _name: None)
    assert not cpu_attention.available()
    assert "gcc not found" in (cpu_attention.unavailable_reason() or "")
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_attention.paged_decode_attention(*make_case([3], 4, 2, 32), 1.0)


@pytest.mark.usefixtures("fresh_loader")
def test_unavailable_when_compile_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(cpu_attention, "SOURCE", bad)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    assert not cpu_attention.available()
    assert "failed" in (cpu_attention.unavailable_reason() or "")
    assert not cpu_attention.available(torch.float64)
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []  # no temp file left


def test_builds_into_cache_dir_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tiny = tmp_path / "tiny.c"
    tiny.write_text("int paged_attention_tiny(void) { return 7; }\n")
    monkeypatch.setattr(cpu_attention, "SOURCE", tiny)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = cpu_attention.library_path(torch.float32)
    assert path.parent == tmp_path / "kernels" and path.suffix == ".so"
    mtime = path.stat().st_mtime_ns
    assert cpu_attention.library_path(torch.float32) == path
    assert path.stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    tiny.write_text("int paged_attention_tiny(void) { return 8; }\n")  # a new source version
    assert cpu_attention.library_path(torch.float32) != path


def test_build_key_depends_on_source_compiler_and_flags() -> None:
    a = cpu_attention.build_key("int x;", "gcc 12")
    assert a == cpu_attention.build_key("int x;", "gcc 12")
    assert a != cpu_attention.build_key("int y;", "gcc 12")
    assert a != cpu_attention.build_key("int x;", "gcc 13")
    f32, f16 = (cpu_attention.build_flags(t) for t in (torch.float32, torch.float16))
    assert cpu_attention.build_key("int x;", "gcc 12", f32) != cpu_attention.build_key(
        "int x;", "gcc 12", f16
    )
