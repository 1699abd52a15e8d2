"""Microbenchmark of CPU prefill attention: the C kernel against torch's SDPA.

One sequence's prefill chunk (SmolLM2's shapes: 9 query over 3 kv heads, head_dim 64,
blocks of 16, fp32) attends causally over its paged cache: ``c kernel`` is
``kernels.cpu_attention.paged_prefill_attention`` on the cache in place, ``sdpa`` is
torch's ``scaled_dot_product_attention`` over K/V already gathered (what the engine ran
before, less its gather; ``is_causal`` for a whole prompt). Printed per shape: the best of ``--reps`` calls in ms and
GFLOP/s (4 * head_dim FLOPs per visible query-key pair and head) at 1 and 2 threads, and
the largest |difference| from the torch reference.

    python -m loadtest.prefill_attention_bench [--shapes 256:256 2048:2048 2048:512] [--reps 10]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import cpu_attention, reference

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def best_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def bench(context: int, new: int, reps: int) -> str:
    g = torch.Generator().manual_seed(0)
    num_blocks = -(-context // BLOCK) + 2
    k, v = (torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=g) for _ in range(2))
    table = torch.randperm(num_blocks, generator=g).to(torch.int32)
    q = torch.randn(new, HEADS, DIM, generator=g)
    scale = DIM**-0.5
    want = reference.paged_prefill_attention(q, k, v, table[None], torch.tensor([0, new]),
                                             torch.tensor([context]), scale)
    got = cpu_attention.paged_prefill_attention(q, k, v, table, context, scale)
    flops = 4 * DIM * HEADS * sum(context - new + i + 1 for i in range(new))
    line = f"{context:>7} {new:>5} | {(got - want).abs().max().item():8.1e}"
    for threads in (1, 2):
        ms = best_ms(lambda t=threads: cpu_attention.paged_prefill_attention(
            q, k, v, table, context, scale, num_threads=t), reps)
        line += f" | {threads}t {ms:7.2f} ms {flops / ms / 1e6:6.1f}"
    keys, values = (reference.gather_kv(c, table, context) for c in (k, v))
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, keys, values))
    # As the engine ran it: is_causal for a whole prompt, an explicit mask after a prefix.
    mask = None if new == context else torch.ones(new, context, dtype=torch.bool).tril(context - new)
    torch.set_num_threads(2)
    ms = best_ms(lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                                        is_causal=mask is None, enable_gqa=True), reps)
    return line + f" | {ms:7.2f} ms {flops / ms / 1e6:6.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["256:256", "2048:2048", "2048:512"],
                    help="context:new_tokens pairs")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if not cpu_attention.prefill_available():
        sys.exit(f"no C prefill kernel here: {cpu_attention.prefill_unavailable_reason()}")
    print(f"{HEADS} over {KV_HEADS} heads, head_dim {DIM}, fp32; best of {args.reps}; GFLOP/s after ms")
    print(f"{'context':>7} {'new':>5} | max |diff| | {'c kernel, 1 thread':>22} | {'2 threads':>22} | sdpa, 2 threads")
    for shape in args.shapes:
        context, new = map(int, shape.split(":"))
        print(bench(context, new, args.reps), flush=True)


if __name__ == "__main__":
    main()
