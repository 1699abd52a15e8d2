"""What a quantised KV cache costs in accuracy, and what it buys in decode-attention time.

Drift: the default model (SmolLM2) reads a held-out paragraph (written for this tool, in
no prompt set) teacher-forced: the first ``--prefill`` tokens in one prefill, then one
token per decode step, every step attending over the cache. The same run with a float32
cache and with each quantised one gives, per dtype, the share of positions whose top-1
token equals float32's and the mean |Δ logprob| of the text's next tokens.

Speed: decode attention alone (the C kernel) for 16 sequences × 1024 cached tokens at
SmolLM2's shape, float32 vs int8 vs fp8 codes, each call on another layer's cache (cold).

    python loadtest/kv_quant_drift.py [--tokens 320] [--threads 1] [--bench-only | --no-bench]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from common.config import ModelConfig
from common.engine.setup import LoadedModel, kv_cache_dtype, load_model
from kernels import cpu_attention, kv_quant
from kernels.attention import AttentionMetadata, PrefillSpan
from kernels.kv_quant import KVQuant

HELD_OUT = (
    "The lighthouse keeper's logbook for the winter of 1893 survives in a cardboard box at the "
    "county archive, its pages stiff with salt. Most entries are short: the wind's direction, "
    "the hours the lamp burned, the number of gallons of oil carried up the spiral stair. But "
    "in the second week of February the handwriting changes. The keeper, a man named Elias "
    "Brand, begins to describe the ice. It arrived overnight, he writes, not as a sheet but as "
    "a field of broken plates that ground against one another with a sound like distant "
    "cannon. By morning the harbour had vanished under it, and the fishing boats that had not "
    "been hauled out were lifted and tilted until their masts pointed at odd angles, like the "
    "hands of stopped clocks. For nine days no supply boat could reach the island. Brand "
    "rationed the oil by lighting the lamp an hour later each evening, and he records that "
    "he read the same three books by daylight to keep from sleeping through the dark. On the "
    "tenth day a thaw came from the south. The ice did not melt so much as move, drifting out "
    "past the point in a slow procession, and the keeper counted forty-one seals riding on "
    "the floes. The supply boat arrived that afternoon with flour, lamp oil, a sack of "
    "letters and a newspaper that was already two weeks old. Brand's last entry for the month "
    "is a single line: the lamp lit at dusk, as it should be, and the sea is water again."
)


@dataclass(frozen=True, slots=True)
class Drift:
    kv_dtype: str
    positions: int
    top1_agreement: float  # share of positions whose argmax equals float32's
    mean_abs_dlogprob: float  # mean |logprob_q(target) - logprob_fp32(target)|
    max_abs_dlogprob: float


def _cache(loaded: LoadedModel, kv_dtype: str, num_blocks: int, block_size: int):
    s, dtype = loaded.spec, kv_cache_dtype(kv_dtype, loaded.dtype)
    if isinstance(dtype, KVQuant):
        slab = kv_quant.slab_nbytes(block_size, s.num_kv_heads, s.head_dim)
        storage = torch.zeros(num_blocks, s.num_layers, 2, slab, dtype=torch.uint8)
        return kv_quant.LayerViews(kv_quant.layer_views(storage, block_size, s.num_kv_heads,
                                                        s.head_dim, dtype))
    return torch.zeros(num_blocks, s.num_layers, 2, block_size, s.num_kv_heads, s.head_dim,
                       dtype=dtype)


def _meta(start: int, num_new: int, table: torch.Tensor, block_size: int) -> AttentionMetadata:
    """One sequence: a prefill of positions [0, num_new) or a decode of position start."""
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    slots = torch.arange(start, start + num_new)
    slots = table[slots // block_size].long() * block_size + slots % block_size
    if num_new == 1 and start > 0:
        return AttentionMetadata(slots, 1, table[None], i32([start + 1]), [], i32([[0]]),
                                 i32([0]), i32([]))
    span = PrefillSpan(0, num_new, start + num_new, 0)
    return AttentionMetadata(slots, 0, i32([[0]]), i32([]), [span], table[None],
                             i32([0, num_new]), i32([start + num_new]))


@torch.inference_mode()
def teacher_forced(loaded: LoadedModel, ids: list[int], kv_dtype: str, prefill: int,
                   block_size: int = 16) -> torch.Tensor:
    """Log-probabilities [len(ids) - prefill, vocab] of the tokens after each position
    from ``prefill - 1`` on: a prefill of ids[:prefill], then ids one decode step at a time."""
    num_blocks = -(-len(ids) // block_size)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    cache = _cache(loaded, kv_dtype, num_blocks, block_size)
    model, backend = loaded.model, loaded.backend
    rows = []

    def run(start: int, n: int) -> torch.Tensor:
        meta = _meta(start, n, table, block_size)
        hidden = model(torch.tensor(ids[start:start + n]), torch.arange(start, start + n),
                       cache, meta, backend)
        return model.logits(hidden[-1:]).log_softmax(-1)[0]

    rows.append(run(0, prefill))
    for pos in range(prefill, len(ids) - 1):
        rows.append(run(pos, 1))
    return torch.stack(rows)


def drift(loaded: LoadedModel, ids: list[int], prefill: int, dtypes: list[str]) -> list[Drift]:
    base = teacher_forced(loaded, ids, "float32", prefill)
    targets = torch.tensor(ids[prefill:])
    base_lp = base.gather(1, targets[:, None])[:, 0]
    out = []
    for name in dtypes:
        lp = teacher_forced(loaded, ids, name, prefill)
        delta = (lp.gather(1, targets[:, None])[:, 0] - base_lp).abs()
        agree = (lp.argmax(-1) == base.argmax(-1)).float().mean().item()
        out.append(Drift(name, len(targets), agree, delta.mean().item(), delta.max().item()))
    return out


# ---- decode-attention micro-benchmark ----------------------------------------------------

def _bench_caches(fmt: KVQuant | None, layers: int, num_blocks: int, bs: int, kvh: int, d: int):
    if fmt is None:
        kv = torch.randn(num_blocks, layers, 2, bs, kvh, d)
        return [(kv[:, i, 0], kv[:, i, 1]) for i in range(layers)]
    storage = torch.zeros(num_blocks, layers, 2, kv_quant.slab_nbytes(bs, kvh, d), dtype=torch.uint8)
    views = kv_quant.layer_views(storage, bs, kvh, d, fmt)
    slots = torch.arange(num_blocks * bs)
    for k, v in views:  # real codes and scales, written by the reference
        kv_quant.write_kv(torch.randn(len(slots), kvh, d), torch.randn(len(slots), kvh, d), k, v,
                          slots)
    return views


def bench(seqs: int = 16, ctx: int = 1024, iters: int = 20, layers: int = 8) -> dict[str, float]:
    """Median ms per decode-attention call, per cache dtype (SmolLM2: H 9, KVH 3, D 64)."""
    H, KVH, D, BS = 9, 3, 64, 16
    per_seq = ctx // BS
    num_blocks = seqs * per_seq
    tables = torch.randperm(num_blocks, dtype=torch.int32).view(seqs, per_seq)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    q = torch.randn(seqs, H, D)
    results = {}
    for name, fmt in (("float32", None), ("int8", KVQuant.INT8), ("fp8", KVQuant.FP8)):
        caches = _bench_caches(fmt, layers, num_blocks, BS, KVH, D)
        fn = (cpu_attention.paged_decode_attention if fmt is None
              else cpu_attention.paged_decode_attention_quantized)
        times = []
        for i in range(iters):
            k, v = caches[i % layers]
            t0 = time.perf_counter()
            fn(q, k, v, tables, lens, 0.125)
            times.append(time.perf_counter() - t0)
        results[name] = statistics.median(times[2:]) * 1e3
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=320, help="tokens of the paragraph to read")
    ap.add_argument("--prefill", type=int, default=16)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch/OpenMP threads (1: a shared machine stalls OpenMP barriers)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.bench_only:
        loaded = load_model(ModelConfig())
        ids = loaded.tokenizer.encode(HELD_OUT)[: args.tokens]
        print(f"held-out text: {len(ids)} tokens, prefill {args.prefill}, then decode steps")
        for d in drift(loaded, ids, args.prefill, ["int8", "fp8"]):
            print(f"  {d.kv_dtype:5s} top-1 agreement {d.top1_agreement:.4f}  mean |dlogprob| "
                  f"{d.mean_abs_dlogprob:.5f}  max {d.max_abs_dlogprob:.4f}  ({d.positions} positions)")
    if not args.no_bench:
        ms = bench()
        print("decode attention, 16 seqs x 1024 tokens, C kernel, median ms per call:")
        for name, t in ms.items():
            print(f"  {name:7s} {t:7.3f} ms  ({ms['float32'] / t:.2f}x float32)")


if __name__ == "__main__":
    main()
