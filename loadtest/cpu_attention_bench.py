"""Microbenchmark of CPU paged decode attention: fused C kernel vs torch paths.

For B=64 sequences (``--batch``), H=9 query heads, KVH=3 kv heads, head_dim 64, block 16, fp32, it
prints per-call milliseconds of

* ``c kernel``: ``kernels.cpu_attention.paged_decode_attention``,
* ``torch paged``: the batched torch path (index_select gather of every sequence's
  blocks, then SDPA with a padding mask),
* ``ideal``: matmul-softmax-matmul over K/V that are already contiguous,

and the C kernel's effective bandwidth (K+V bytes read / time). Each call reads a
different layer of a multi-layer cache, so K/V come from DRAM as in a real decode step
("cold"); the "hot" column repeats one layer, whose K/V may then sit in the L3 cache.
Medians are printed, with the minimum beside them (the machine may be shared).

    python loadtest/cpu_attention_bench.py [--threads 2] [--contexts 320 1024] [--batch 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import cpu_attention, cpu_memory

BATCH, H, KVH, D, BS = 64, 9, 3, 64, 16  # BATCH: the default of --batch
COLD_BYTES = 256 << 20  # K/V bytes spread over the layers: well past any L3


def make_cache(B: int, ctx: int, layers: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [NB, layers, 2, BS, KVH, D] cache, shuffled block tables, lengths all ``ctx``."""
    per_seq = -(-ctx // BS)
    num_blocks = B * per_seq
    kv = cpu_memory.empty((num_blocks, layers, 2, BS, KVH, D))  # huge pages, as the engine's
    kv.copy_(torch.randn(kv.shape))
    tables = torch.randperm(num_blocks, dtype=torch.int32).view(B, per_seq)
    return kv, tables, torch.full((B,), ctx, dtype=torch.int32)


def torch_paged(q, k_cache, v_cache, tables, lens, scale, mask) -> torch.Tensor:
    """Batched torch path: gather all blocks, SDPA over [B, KVH, G, D] queries."""
    B = q.shape[0]
    t = tables.shape[1] * BS
    k = k_cache.index_select(0, tables.flatten().long()).view(B, t, KVH, D).transpose(1, 2)
    v = v_cache.index_select(0, tables.flatten().long()).view(B, t, KVH, D).transpose(1, 2)
    qg = q.view(B, KVH, H // KVH, D)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, H, D)


def ideal(q, k, v, scale) -> torch.Tensor:
    """Contiguous K/V [B, KVH, T, D]: matmul, softmax, matmul."""
    B = q.shape[0]
    qg = q.view(B, KVH, H // KVH, D)
    p = torch.softmax(torch.matmul(qg, k.transpose(2, 3)) * scale, dim=-1)
    return torch.matmul(p, v).reshape(B, H, D)


def time_ms(fn: Callable[[int], object], layers: int, cold: bool, reps: int) -> tuple[float, float]:
    """(median, min) ms per call of fn(layer), cycling layers when cold."""
    for i in range(3):
        fn(i % layers if cold else 0)
    samples = []
    for i in range(reps):
        start = time.perf_counter()
        fn(i % layers if cold else 0)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3, min(samples) * 1e3


def bench(B: int, ctx: int, threads: int, reps: int) -> None:
    layer_bytes = B * ctx * KVH * D * 4 * 2
    layers = max(2, -(-COLD_BYTES // layer_bytes))
    kv, tables, lens = make_cache(B, ctx, layers)
    scale = D**-0.5
    q = torch.randn(B, H, D)
    out = torch.empty_like(q)
    pos = torch.arange(tables.shape[1] * BS)
    mask = (pos < lens[:, None]).view(B, 1, 1, -1)
    dense = [
        (torch.randn(B, KVH, ctx, D), torch.randn(B, KVH, ctx, D))
        for _ in range(-(-COLD_BYTES // layer_bytes))
    ]

    def c_call(i: int) -> object:
        return cpu_attention.paged_decode_attention(
            q, kv[:, i, 0], kv[:, i, 1], tables, lens, scale, out=out, num_threads=threads
        )

    def t_call(i: int) -> object:
        return torch_paged(q, kv[:, i, 0], kv[:, i, 1], tables, lens, scale, mask)

    def i_call(i: int) -> object:
        return ideal(q, *dense[i % len(dense)], scale)

    diff = (c_call(0) - t_call(0)).abs().max().item()
    print(f"context {ctx}: K+V per call {layer_bytes / 1e6:.1f} MB, max |c - torch| {diff:.1e}")
    for name, fn in (("c kernel", c_call), ("torch paged", t_call), ("ideal", i_call)):
        (cold, cold_min), (hot, hot_min) = (time_ms(fn, layers, c, reps) for c in (True, False))
        line = f"  {name:12s} cold {cold:7.3f} ms (min {cold_min:7.3f})"
        line += f"   hot {hot:7.3f} ms (min {hot_min:7.3f})"
        if name == "c kernel":
            line += (
                f"   {layer_bytes / cold / 1e6:5.1f} GB/s cold, {layer_bytes / hot / 1e6:5.1f} hot"
            )
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", type=int, nargs="+", default=[320, 1024])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=BATCH, help="sequences per call (1: a batch-1 step)")
    args = ap.parse_args()
    if not cpu_attention.available():
        sys.exit(f"C kernel unavailable: {cpu_attention.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    print(f"B={args.batch} H={H} KVH={KVH} D={D} block={BS} fp32, {args.threads} threads")
    with torch.inference_mode():
        for ctx in args.contexts:
            bench(args.batch, ctx, args.threads, args.reps)


if __name__ == "__main__":
    main()
