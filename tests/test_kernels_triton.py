"""The Triton paged-attention kernels against the torch reference and naive dense attention.

Without a GPU the kernels run in Triton's interpreter on the CPU, so every shape here is tiny.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

# Triton picks interpreter or compiler when a kernel is decorated, i.e. at module import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


from kernels import reference, triton_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = triton_attention.interpreted()
# The interpreter keeps bf16 as raw uint16 bits and tl.dot multiplies those
# (triton-lang/triton#11584, "not supported yet"), so bf16 attention is GPU-only.
_NEEDS_BF16_DOT = pytest.mark.skipif(INTERPRETED, reason="Triton interpreter lacks bf16 tl.dot")
NUM_LAYERS, LAYER = 3, 1
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    # The kernels round softmax probabilities to the input dtype before the PV product.
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


@dataclass
class PagedBatch:
    """A strided, shuffled paged cache holding known per-sequence keys and values."""

    kv: torch.Tensor  # [NB, L, 2, BS, KVH, D], the runner's layout
    k_cache: torch.Tensor  # [NB, BS, KVH, D], layer view, strided block dim
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks]
    context_lens: torch.Tensor  # [S]
    keys: list[torch.Tensor]  # per sequence [n, KVH, D], contiguous ground truth
    values: list[torch.Tensor]


@pytest.fixture(autouse=True)
def _kernels_runnable() -> None:
    if DEVICE == "cpu" and not INTERPRETED:
        # Re-importing does not help: the interpreter still sees the compiled helpers.
        pytest.fail(
            "kernels.triton_attention was imported before TRITON_INTERPRET=1 was set and "
            "there is no GPU; export TRITON_INTERPRET=1 or set it in tests/conftest.py"
        )


def make_batch(
    lens: list[int],
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    index_dtype: torch.dtype,
    gen: torch.Generator,
) -> PagedBatch:
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 3
    # NaN everywhere no sequence owns: any read of an unowned slot poisons the output.
    kv = torch.full(
        (num_blocks, NUM_LAYERS, 2, block_size, kv_heads, head_dim), float("nan"), dtype=dtype
    )
    k_cache, v_cache = kv[:, LAYER, 0], kv[:, LAYER, 1]
    perm = torch.randperm(num_blocks, generator=gen)
    spare = int(perm[-1])  # a NaN block that padding entries point at
    tables = torch.full((len(lens), max(per_seq) + 1), spare, dtype=index_dtype)
    keys, values, used = [], [], 0
    for s, (n, nb) in enumerate(zip(lens, per_seq, strict=True)):
        tables[s, :nb] = perm[used : used + nb].to(index_dtype)
        used += nb
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(n)
        blocks = tables[s, pos // block_size].long()
        k_cache[blocks, pos % block_size] = k
        v_cache[blocks, pos % block_size] = v
        keys.append(k)
        values.append(v)
    kv = kv.to(DEVICE)
    return PagedBatch(
        kv=kv,
        k_cache=kv[:, LAYER, 0],
        v_cache=kv[:, LAYER, 1],
        block_tables=tables.to(DEVICE),
        context_lens=torch.tensor(lens, dtype=index_dtype, device=DEVICE),
        keys=[k.to(DEVICE) for k in keys],
        values=[v.to(DEVICE) for v in values],
    )


def with_bf16_marks(cases: list[tuple]) -> list:
    return [pytest.param(*c, marks=_NEEDS_BF16_DOT) if torch.bfloat16 in c else c for c in cases]


def case_id(value: object) -> str | None:
    """Readable parametrize ids: float32, 1,8,11 (lens), 5+3 (prefix + new tokens)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, list):
        return ",".join("+".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in value)
    return None


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, **TOLERANCES[actual.dtype])


# --------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "kv_heads", "head_dim", "block_size", "key_dtype", "cache_dtype", "index_dtype"),
    [
        (10, 2, 16, 4, torch.float32, torch.float32, torch.int64),
        (7, 1, 32, 8, torch.float32, torch.float16, torch.int32),
        (5, 3, 24, 4, torch.bfloat16, torch.bfloat16, torch.int32),  # non-power-of-two dims
    ],
    ids=case_id,
)
def test_write_kv_writes_exactly_the_given_slots(
    num_tokens: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    key_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    index_dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks = 6
    shape = (num_blocks, NUM_LAYERS, 2, block_size, kv_heads, head_dim)
    kv = torch.randn(shape, generator=gen).to(cache_dtype).to(DEVICE)
    expected = kv.clone()
    # Keys come as a strided view of a fused projection, like the model produces them.
    qkv = torch.randn(num_tokens, 3, kv_heads, head_dim, generator=gen).to(key_dtype).to(DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots = slots.to(index_dtype).to(DEVICE)

    triton_attention.write_kv(key, value, kv[:, LAYER, 0], kv[:, LAYER, 1], slots)
    reference.write_kv(key, value, expected[:, LAYER, 0], expected[:, LAYER, 1], slots)

    # The whole tensor: other layers, the other half (K/V) and untouched slots stay as they were.
    assert torch.equal(kv, expected)


# --------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------

DECODE_CASES = [
    # heads, kv_heads, head_dim, block_size, context lens, dtype, index dtype
    (4, 2, 16, 4, [1, 8, 11], torch.float32, torch.int32),  # GQA; len 1, k*BS, mid-block
    (2, 2, 32, 8, [40, 1, 16], torch.float32, torch.int64),  # H == KVH; two key tiles
    (8, 1, 16, 8, [17, 33], torch.float32, torch.int32),  # MQA
    (6, 2, 24, 4, [9, 36, 3], torch.float32, torch.int64),  # group of 3, head_dim masked
    (4, 2, 32, 8, [5, 29, 16], torch.float16, torch.int32),
    (4, 2, 16, 4, [12, 1, 30], torch.bfloat16, torch.int64),
]


def _decode_inputs(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    lens: list[int],
    dtype: torch.dtype,
    index_dtype: torch.dtype,
) -> tuple[PagedBatch, torch.Tensor, float]:
    gen = torch.Generator().manual_seed(sum(lens) + heads)
    batch = make_batch(lens, kv_heads, head_dim, block_size, dtype, index_dtype, gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return batch, q, head_dim**-0.5


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "lens", "dtype", "index_dtype"),
    with_bf16_marks(DECODE_CASES),
    ids=case_id,
)
def test_decode_matches_reference_and_dense(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    lens: list[int],
    dtype: torch.dtype,
    index_dtype: torch.dtype,
) -> None:
    b, q, scale = _decode_inputs(heads, kv_heads, head_dim, block_size, lens, dtype, index_dtype)
    args = (q, b.k_cache, b.v_cache, b.block_tables, b.context_lens, scale)

    out = triton_attention.paged_decode_attention(*args)

    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, reference.paged_decode_attention(*args))
    for s, n in enumerate(lens):
        # The decode query is the last row of a causal pass over the whole sequence.
        q_full = torch.zeros(n, heads, head_dim, dtype=dtype, device=DEVICE)
        q_full[-1] = q[s]
        dense = reference.dense_causal_attention(q_full, b.keys[s], b.values[s], scale)
        assert_close(out[s], dense[-1])


def test_decode_strided_query_and_empty_context() -> None:
    b, q, scale = _decode_inputs(4, 2, 16, 4, [0, 6], torch.float32, torch.int32)
    q_view = torch.cat([q, q], dim=-1)[..., :16]  # non-contiguous rows, contiguous head_dim
    args = (q_view, b.k_cache, b.v_cache, b.block_tables, b.context_lens, scale)

    out = triton_attention.paged_decode_attention(*args)

    # An empty context attends to nothing: the reference gives zeros, not NaN.
    assert_close(out, reference.paged_decode_attention(*args))
    assert torch.equal(out[0], torch.zeros_like(out[0]))


# --------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------

PREFILL_CASES = [
    # heads, kv_heads, head_dim, block_size, (cached prefix, new tokens) per sequence, dtypes
    (4, 2, 16, 4, [(0, 1), (0, 8), (0, 11)], torch.float32, torch.int32),  # no prefix
    (4, 2, 16, 8, [(5, 3), (0, 40), (8, 8)], torch.float32, torch.int64),  # 2 query tiles
    (2, 2, 32, 4, [(13, 7), (1, 1), (20, 20)], torch.float32, torch.int32),  # H == KVH
    (8, 1, 24, 8, [(3, 12), (16, 9)], torch.float32, torch.int64),  # MQA, masked head_dim
    (4, 2, 16, 4, [(6, 4), (4, 0), (0, 9)], torch.float32, torch.int32),  # a sequence with no rows
    (4, 2, 32, 8, [(7, 10), (0, 23)], torch.float16, torch.int32),
    (2, 1, 16, 4, [(11, 5), (0, 14)], torch.bfloat16, torch.int64),
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "chunks", "dtype", "index_dtype"),
    with_bf16_marks(PREFILL_CASES),
    ids=case_id,
)
def test_prefill_matches_reference_and_dense(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    chunks: list[tuple[int, int]],
    dtype: torch.dtype,
    index_dtype: torch.dtype,
) -> None:
    lens = [prefix + new for prefix, new in chunks]
    gen = torch.Generator().manual_seed(sum(lens) + heads)
    b = make_batch(lens, kv_heads, head_dim, block_size, dtype, index_dtype, gen)
    q_lens = [new for _, new in chunks]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query_start = torch.tensor(starts, dtype=index_dtype, device=DEVICE)
    q = torch.randn(starts[-1], heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = 0.7 * head_dim**-0.5
    args = (q, b.k_cache, b.v_cache, b.block_tables, query_start, b.context_lens, scale)

    out = triton_attention.paged_prefill_attention(*args)

    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, reference.paged_prefill_attention(*args))
    for s, (n, q_len) in enumerate(zip(lens, q_lens, strict=True)):
        # The chunk is the last q_len rows of a causal pass over the whole sequence.
        q_full = torch.zeros(n, heads, head_dim, dtype=dtype, device=DEVICE)
        q_full[n - q_len :] = q[starts[s] : starts[s + 1]]
        dense = reference.dense_causal_attention(q_full, b.keys[s], b.values[s], scale)
        assert_close(out[starts[s] : starts[s + 1]], dense[n - q_len :])


# --------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------


def _bad_call(case: str) -> None:
    gen = torch.Generator().manual_seed(0)
    b = make_batch([5, 9], 2, 16, 4, torch.float32, torch.int32, gen)
    q = torch.randn(2, 4, 16).to(DEVICE)
    qs = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    kc, vc, bt, cl = b.k_cache, b.v_cache, b.block_tables, b.context_lens
    decode = triton_attention.paged_decode_attention
    prefill = triton_attention.paged_prefill_attention
    if case == "q head_dim":
        decode(torch.randn(2, 4, 32, device=DEVICE), kc, vc, bt, cl, 1.0)
    elif case == "num_heads":
        decode(torch.randn(2, 3, 16, device=DEVICE), kc, vc, bt, cl, 1.0)
    elif case == "prefill num_heads":
        prefill(torch.randn(2, 5, 16, device=DEVICE), kc, vc, bt, qs, cl, 1.0)
    elif case == "query_start":
        prefill(q, kc, vc, bt, qs[:2], cl, 1.0)
    elif case == "context_lens":
        decode(q, kc, vc, bt, cl[:1], 1.0)
    elif case == "float index":
        decode(q, kc, vc, bt.float(), cl, 1.0)
    elif case == "q dtype":
        decode(q.half(), kc, vc, bt, cl, 1.0)
    elif case == "inner strides":
        wide = torch.zeros(kc.shape[0], 4, 4, 16, device=DEVICE)  # [NB, BS, 2*KVH, D]
        decode(q, wide[:, :, :2], wide[:, :, 2:], bt, cl, 1.0)
    elif case == "v_cache shape":
        decode(q, kc, vc[:, :2], bt, cl, 1.0)
    elif case == "write_kv key shape":
        key = torch.randn(3, 2, 8, device=DEVICE)
        triton_attention.write_kv(key, key, kc, vc, torch.arange(3, device=DEVICE))
    elif case == "write_kv tokens":
        key = torch.randn(3, 2, 16, device=DEVICE)
        triton_attention.write_kv(key, key, kc, vc, torch.arange(4, device=DEVICE))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("q head_dim", "head_dim 32 != cache head_dim 16"),
        ("num_heads", "multiple of num_kv_heads"),
        ("prefill num_heads", "multiple of num_kv_heads"),
        ("query_start", "query_start must have 3 rows"),
        ("context_lens", "context_lens must have 2 rows"),
        ("float index", "block_tables must be int32 or int64"),
        ("q dtype", "must equal cache dtype"),
        ("inner strides", "must be contiguous"),
        ("v_cache shape", "v_cache must match k_cache"),
        ("write_kv key shape", r"key must be \[T, KVH, D\]"),
        ("write_kv tokens", r"key must be \[T, KVH, D\] = \[4,"),
    ],
)
def test_launchers_reject_bad_inputs(case: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _bad_call(case)
