"""The quantised KV cache (``--kv-cache-dtype int8|fp8``): format, kernels, plumbing, drift.

Every kernel path (C write / gather / decode, Triton write / decode / prefill under the
interpreter) is checked against ``kernels.kv_quant``'s torch reference: writes bit for
bit, attention within fp32 tolerance.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common.config import CacheConfig, EngineConfig  # noqa: E402
from common.engine.handoff import KVLayout  # noqa: E402
from common.engine.setup import LoadedModel, plan_cache  # noqa: E402
from common.model.loader import resolve_model  # noqa: E402
from common.model.spec import ModelSpec  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from kernels import cpu_attention, cpu_kv_cache, kv_quant, triton_attention  # noqa: E402
from kernels.attention import AttentionMetadata, PrefillSpan, TorchBackend  # noqa: E402
from kernels.kv_quant import KVQuant  # noqa: E402
from tests.conftest import loaded_model, make_engine  # noqa: E402
from tests.test_handoff import over_the_wire  # noqa: E402

FORMATS = list(KVQuant)
LAYERS, LAYER = 2, 1
# Steps of slots written into a cache of block size 4: a prefill across two blocks, then
# decode tokens (growing in magnitude) into a partly filled block and into block 10, whose
# offset-0 write reopens it; the last step reopens block 3, full since step 0.
STEPS = [[12, 13, 14, 15, 4, 5], [6, 40], [7, 41], [8, 42], [12]]


def make_views(fmt: KVQuant, num_blocks: int = 12, bs: int = 4, kvh: int = 3, dim: int = 64):
    slab = kv_quant.slab_nbytes(bs, kvh, dim)
    storage = torch.zeros(num_blocks, LAYERS, 2, slab, dtype=torch.uint8)
    return storage, kv_quant.layer_views(storage, bs, kvh, dim, fmt)[LAYER]


def written_rows(step: int, n: int, kvh: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(n, kvh, dim, generator=g) * (1 + step),
            torch.randn(n, kvh, dim, generator=g) * (1 + 3 * step))


def fill(write, fmt: KVQuant, dim: int = 64) -> torch.Tensor:
    storage, (k, v) = make_views(fmt, dim=dim)
    for i, slots in enumerate(STEPS):
        key, value = written_rows(i, len(slots), 3, dim)
        write(key, value, k, v, torch.tensor(slots))
    return storage


# ---- the format ----------------------------------------------------------------------


def exact_row(values: torch.Tensor, fmt: KVQuant) -> torch.Tensor:
    """One token whose head 0 holds ``values`` plus ±QMAX, so its scale is exactly 1."""
    row = torch.cat([values, torch.tensor([fmt.qmax, -fmt.qmax])])
    return row.view(1, 1, -1)


def grid_values(fmt: KVQuant) -> torch.Tensor:
    if fmt is KVQuant.INT8:  # ties at .5 go to even
        return torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.4, -126.6, 3.49, -3.5])
    codes = torch.arange(0, 127, dtype=torch.uint8)  # every finite positive e4m3 value
    exact = codes.view(torch.float8_e4m3fn).float()
    mids = (exact[:-1] + exact[1:]) / 2  # ties: round to the even code
    tiny = torch.tensor([2.0**-10, 3 * 2.0**-10, 1e-30, -2.0**-10])  # subnormal ties, underflow
    return torch.cat([exact, -exact, mids, -mids, tiny])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("impl", ["c", "triton"])
def test_encoders_round_to_nearest_even_like_torch(fmt, impl):
    values = grid_values(fmt)
    _, (k, v) = make_views(fmt, num_blocks=1, bs=1, kvh=1, dim=values.numel() + 2)
    write = cpu_kv_cache.write_kv if impl == "c" else triton_attention.write_kv
    x = exact_row(values, fmt)
    write(x, x, k, v, torch.tensor([0]))
    assert k.scales[0, 0].item() == 1.0
    expected = kv_quant.encode(x[0, 0], fmt)  # torch's own float8_e4m3fn / rounding
    if fmt is KVQuant.FP8:
        assert torch.equal(expected[:127], torch.arange(127, dtype=torch.uint8))
    assert torch.equal(k.codes[0, 0, 0], expected)


# ---- cache writes ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("impl", ["c", "triton"])
@pytest.mark.parametrize("dim", [64, 12])
def test_write_kernels_match_the_reference_bit_for_bit(fmt, impl, dim):
    write = cpu_kv_cache.write_kv if impl == "c" else triton_attention.write_kv
    assert torch.equal(fill(write, fmt, dim), fill(kv_quant.write_kv, fmt, dim))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_larger_token_grows_the_scale_and_requantises_earlier_rows(fmt):
    _, (k, v) = make_views(fmt, num_blocks=2, kvh=1, dim=8)
    small = torch.linspace(-1, 1, 8).view(1, 1, 8)
    kv_quant.write_kv(small, small, k, v, torch.tensor([4]))  # block 1, offset 0
    assert k.scales[1, 0].item() == pytest.approx(1 / fmt.qmax)
    codes_before = k.codes[1, 0].clone()
    big = small * 10
    cpu_kv_cache.write_kv(big, big, k, v, torch.tensor([5]))  # offset 1: the scale must grow
    new_scale = k.scales[1, 0].item()
    assert new_scale == pytest.approx(10 / fmt.qmax)
    assert not torch.equal(k.codes[1, 0], codes_before)  # row 0 requantised to the new scale
    rows = kv_quant.gather_kv(k, torch.tensor([1]), 2)
    # Row 0 was rounded twice: at the old scale, then at the new one. int8: within half
    # an old step plus half a new step; fp8: two relative half-ulps (2^-4 each) plus half
    # the new scale's subnormal step.
    old_scale = 1 / fmt.qmax
    if fmt is KVQuant.INT8:
        bound = torch.full_like(small[0], (old_scale + new_scale) / 2)
    else:
        bound = (2.0**-4 + 2.0**-4 * (1 + 2.0**-4)) * small[0].abs() + new_scale * 2.0**-10
    assert ((rows[0] - small[0]).abs() <= bound + 1e-7).all()
    assert torch.allclose(rows[1], big[0], rtol=2.0**-4, atol=new_scale / 2)
    # An offset-0 write reopens the block: the old, larger scale is forgotten.
    cpu_kv_cache.write_kv(small, small, k, v, torch.tensor([4]))
    assert k.scales[1, 0].item() == pytest.approx(1 / fmt.qmax)


@pytest.mark.parametrize("fmt", FORMATS)
def test_c_gather_dequantises_like_the_reference(fmt):
    storage = fill(kv_quant.write_kv, fmt)
    k = kv_quant.layer_views(storage, 4, 3, 64, fmt)[LAYER][0]
    ids = torch.tensor([3, 1, 2])
    assert torch.equal(cpu_kv_cache.gather_kv(k, ids, 9), kv_quant.gather_kv(k, ids, 9))


# ---- attention ------------------------------------------------------------------------


def paged_sequences(fmt: KVQuant, lens: list[int], dim: int, bs: int = 4):
    """A quantised layer holding len(lens) sequences in shuffled blocks."""
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    _, (k, v) = make_views(fmt, num_blocks=num_blocks, bs=bs, dim=dim)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
    width, used, tables = max(-(-n // bs) for n in lens), 0, []
    for i, n in enumerate(lens):
        ids = perm[used : used + -(-n // bs)]
        used += len(ids)
        tables.append(ids.tolist() + [0] * (width - len(ids)))
        slots = torch.tensor([int(ids[p // bs]) * bs + p % bs for p in range(n)])
        kv_quant.write_kv(*written_rows(i, n, 3, dim), k, v, slots)
    return k, v, torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dim", [64, 12])  # AVX2 tiles, and the scalar path
@pytest.mark.parametrize("threads", [1, 2])
def test_c_decode_attention_matches_the_reference(fmt, dim, threads):
    torch.manual_seed(7)
    k, v, tables, lens = paged_sequences(fmt, [1, 5, 37, 16, 0], dim)
    q = torch.randn(5, 9, dim)
    want = kv_quant.paged_decode_attention(q, k, v, tables, lens, 0.125)
    got = cpu_attention.paged_decode_attention_quantized(q, k, v, tables, lens, 0.125,
                                                         num_threads=threads)
    # fp32 summation order: the kernel folds the scales into the scores and probabilities
    # instead of dequantising first (seen: 1.5e-5 on values of order 1 with another q)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_c_decode_attention_split_into_parts_reads_each_parts_scales(fmt):
    # One long sequence on two threads: its tokens run in parts, each from its own first
    # token's block scales on (parts of 1000 / 8 tokens do not start on a block).
    torch.manual_seed(8)
    k, v, tables, lens = paged_sequences(fmt, [1000], 64)
    q = torch.randn(1, 9, 64)
    want = kv_quant.paged_decode_attention(q, k, v, tables, lens, 0.125)
    got = cpu_attention.paged_decode_attention_quantized(q, k, v, tables, lens, 0.125, num_threads=2)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_decode_and_prefill_attention_match_the_reference(fmt):
    k, v, tables, lens = paged_sequences(fmt, [9, 2, 20], 16)
    q = torch.randn(3, 6, 16)
    torch.testing.assert_close(triton_attention.paged_decode_attention(q, k, v, tables, lens, 0.25),
                               kv_quant.paged_decode_attention(q, k, v, tables, lens, 0.25),
                               atol=1e-5, rtol=1e-5)
    starts = torch.tensor([0, 3, 5, 12], dtype=torch.int32)  # 3, 2 and 7 new tokens
    qp = torch.randn(12, 6, 16)
    args = (qp, k, v, tables, starts, lens, 0.25)
    torch.testing.assert_close(triton_attention.paged_prefill_attention(*args),
                               kv_quant.paged_prefill_attention(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_backend_prefill_with_context_reads_the_quantised_prefix(fmt):
    k, v, tables, lens = paged_sequences(fmt, [13], 64)  # 10 cached + 3 new below
    q, new_k, new_v = torch.randn(3, 9, 64), torch.randn(3, 3, 64), torch.randn(3, 3, 64)
    slots = torch.tensor([int(tables[0, p // 4]) * 4 + p % 4 for p in range(10, 13)])
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    meta = AttentionMetadata(slots, 0, i32([[0]]), i32([]), [PrefillSpan(0, 3, 13, 0)], tables,
                             i32([0, 3]), lens)
    got = TorchBackend().forward(q, new_k, new_v, k, v, meta, 0.125)  # writes, then attends
    want = kv_quant.paged_prefill_attention(q, k, v, tables, i32([0, 3]), lens, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def two_chunks(backend: TorchBackend, fmt: KVQuant | torch.dtype) -> list[torch.Tensor]:
    """A 17-token prompt prefilled in chunks of 10 and 7 (the second over a cached
    prefix) through ``backend``, into a cache of ``fmt``: each chunk's attention output."""
    if isinstance(fmt, KVQuant):
        _, (k_cache, v_cache) = make_views(fmt)
    else:
        k_cache, v_cache = (torch.zeros(12, 4, 3, 64, dtype=fmt) for _ in range(2))
    table = torch.tensor([[7, 2, 9, 4, 11]], dtype=torch.int32)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    g = torch.Generator().manual_seed(3)
    outs = []
    for start, stop in ((0, 10), (10, 17)):
        n = stop - start
        q, k, v = torch.randn(n, 9, 64, generator=g), torch.randn(n, 3, 64, generator=g), torch.randn(n, 3, 64, generator=g)
        slots = torch.tensor([int(table[0, p // 4]) * 4 + p % 4 for p in range(start, stop)])
        meta = AttentionMetadata(slots, 0, i32([[0]]), i32([]), [PrefillSpan(0, n, stop, 0)], table,
                                 i32([0, n]), i32([stop]))
        outs.append(backend.forward(q, k, v, k_cache, v_cache, meta, 0.125))
    return outs


@pytest.mark.parametrize("fmt", [*FORMATS, torch.bfloat16, torch.float16])
def test_cpu_backend_prefill_over_gathered_kv_matches_the_torch_path(fmt):
    """Quantised and half caches: the C prefill kernel (where it runs) over the gathered
    K/V, or over the chunk's own K/V without a prefix, computes what SDPA does."""
    got, want = two_chunks(TorchBackend(), fmt), two_chunks(TorchBackend(use_c_kernel=False), fmt)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("use_c_kernel", [True, False])
def test_a_half_cache_serves_chunked_and_prefix_cached_prompts(tiny_model_dir, dtype, use_c_kernel):
    """A chunk over a cached prefix attends over the half cache's K/V (SDPA once refused
    their dtype beside a float32 query: any chunked or prefix-cached prompt failed)."""
    loaded = dataclasses.replace(loaded_model(tiny_model_dir), backend=TorchBackend(use_c_kernel))
    e = make_engine(tiny_model_dir, max_num_batched_tokens=16, kv_cache_dtype=dtype, loaded=loaded)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first, again = (e.generate([list(range(50, 90)) + tail], params)[0] for tail in ([], [7]))
    assert [len(o.choices[0].token_ids) for o in (first, again)] == [4, 4]
    assert again.num_cached_tokens == 32  # the first prompt's two full blocks


# ---- plumbing: capacity, layout, blocks -------------------------------------------------


def test_the_same_memory_holds_3_985x_the_tokens_of_float32():
    spec = ModelSpec.from_hf_config(resolve_model(None).hf_config())  # SmolLM2-135M
    loaded = LoadedModel("smollm2", spec, None, None, torch.float32, None, 8192)

    def plan(dtype: str):
        return plan_cache(EngineConfig(cache=CacheConfig(memory_bytes=2 * 1024**3,
                                                         kv_cache_dtype=dtype)), loaded)

    fp32, int8, fp8 = plan("float32"), plan("int8"), plan("fp8")
    # 30 layers x K,V x 16 tokens x 3 heads x 64 dims: 4 bytes each, or 1 + 12 scale bytes.
    assert fp32.bytes_per_block == 30 * 2 * 16 * 3 * 64 * 4 == 737_280
    assert int8.bytes_per_block == fp8.bytes_per_block == 30 * 2 * (16 * 3 * 64 + 3 * 4) == 185_040
    assert (fp32.num_tokens, int8.num_tokens) == (46_592, 185_680)  # 3.985x
    assert int8.num_tokens / fp32.num_tokens == pytest.approx(3.985, abs=1e-3)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_runner_allocates_what_the_plan_counted(tiny_model_dir, dtype):
    e = make_engine(tiny_model_dir, num_blocks=8, kv_cache_dtype=dtype)
    assert e.block_nbytes == e.cache_plan.bytes_per_block
    assert e.runner.kv_cache.nbytes == e.cache_plan.nbytes
    assert e.kv_layout.kv_dtype == dtype and e.kv_layout.element_size == 1


def test_a_peer_with_another_kv_dtype_is_refused_with_the_flag_to_fix():
    int8 = KVLayout(30, 16, 3, 64, 1, "int8")
    assert int8.mismatch(int8.as_list(), "int8") is None
    reason = int8.mismatch(int8.as_list(), "fp8")  # same sizes, other bytes
    assert "fp8" in reason and "int8" in reason and "--kv-cache-dtype" in reason


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_block_copies_move_codes_and_scales_together(tiny_model_dir, dtype):
    e = make_engine(tiny_model_dir, num_blocks=8, kv_cache_dtype=dtype)
    e.generate([list(range(50, 70))], SamplingParams(max_tokens=2, temperature=0.0))
    cache = e.runner.kv_cache
    src = next(b for b in range(8) if cache[b].any())
    e.runner.copy_blocks([(src, 7)])
    assert torch.equal(cache[7], cache[src])


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_pd_with_a_compact_kv_cache_equals_a_colocated_engine(tiny_model_dir, dtype):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [list(range(50, 50 + n)) for n in (5, 16, 37)]
    colocated = make_engine(tiny_model_dir, kv_cache_dtype=dtype).generate(prompts, params)
    prefill = make_engine(tiny_model_dir, num_blocks=32, kv_cache_dtype=dtype)
    decode = make_engine(tiny_model_dir, num_blocks=32, kv_cache_dtype=dtype)
    for i, p in enumerate(prompts):
        prefill.add_request(p, params, request_id=f"r{i}", prefill_only=True)
    first: dict[str, int] = {}
    while prefill.has_unfinished:
        for u in prefill.step():
            first.setdefault(u.request_id, u.token_ids[0])
        for h in prefill.take_handoffs():
            assert decode.add_prefilled(*over_the_wire(prefill, h))
            prefill.abort(h.request_id)
    outs = {}
    while decode.has_unfinished:
        for u in decode.step():
            if u.finish_reason is not None and (done := decode.finished_output(u.request_id)):
                outs[done.request_id] = [first[done.request_id]] + done.choices[0].token_ids[1:]
    assert [outs[f"r{i}"] for i in range(3)] == [o.choices[0].token_ids for o in colocated]


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_prefix_cache_hits_on_quantised_blocks_give_the_same_tokens(tiny_model_dir, dtype):
    e = make_engine(tiny_model_dir, kv_cache_dtype=dtype, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = list(range(100, 140))
    cold = e.generate([prompt], params)[0]
    warm = e.generate([prompt], params)[0]
    assert warm.num_cached_tokens >= 32
    assert warm.choices[0].token_ids == cold.choices[0].token_ids


# ---- drift on real weights --------------------------------------------------------------

# Measured (loadtest/kv_quant_drift.py --tokens 96: these 96 tokens, 80 scored positions):
# int8 top-1 agreement 0.975 (2 flips), mean |dlogprob| 0.041; fp8 0.9625 (3 flips), 0.084.
# Bounds with margin (several more flips, ~2x the mean) for summation-order noise:
DRIFT_BOUNDS = {"int8": (0.92, 0.08), "fp8": (0.80, 0.15)}


def test_drift_against_float32_kv_stays_within_the_measured_bounds(smollm2_dir):
    from loadtest.kv_quant_drift import HELD_OUT, drift

    loaded = loaded_model(smollm2_dir)
    ids = loaded.tokenizer.encode(HELD_OUT)[:96]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # OpenMP barriers stall on a shared machine
    try:
        results = drift(loaded, ids, 16, ["int8", "fp8"])
    finally:
        torch.set_num_threads(threads)
    for d in results:
        agree, dlp = DRIFT_BOUNDS[d.kv_dtype]
        assert d.top1_agreement >= agree, d
        assert d.mean_abs_dlogprob <= dlp, d
        assert d.mean_abs_dlogprob > 0  # the cache really was quantised
