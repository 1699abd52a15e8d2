"""Microbenchmark of the GEMMs of SmolLM2-135M on the CPU: our packed-weight C kernel vs torch.

One step of the model multiplies M rows (one per sequence decoding, or per prompt token
of a prefill chunk) by every weight: per
layer the fused qkv (960x576), o (576x576), fused gate/up (3072x576) and down
(576x1536) projections, 30 layers, then the LM head (49152x576). The 30 layers are
distinct tensors (~425 MB, plus 113 MB of head), far past the L3 cache, so each weight
comes from DRAM as in a real step ("cold"). For each thread count and M it prints the
best-of-rounds milliseconds of the body (120 products) and of the head for

* ``kernel``: ``kernels.cpu_gemm.linear(x, packed)``, ``packed = cpu_gemm.pack(w)`` made
  once beforehand (as the model does at load),
* ``F.linear``: ``torch.nn.functional.linear(x, w)``,
* ``mm``: ``torch.mm(w, x.t())`` (the transposed product, which MKL often runs faster),

the kernel's speedup over the faster torch variant, its effective bandwidth (weight
bytes / time), and ``rel diff``: the largest |kernel - F.linear| / max|F.linear| over the
five shapes (another summation order, so not 0). Variants are interleaved within each round, so a noisy neighbour hits them
alike; rerun noisy cases with ``--m``/``--threads``.

    python loadtest/cpu_gemm_bench.py [--threads 1 2] [--m 1 2 4 8 16 32 64 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import cpu_gemm

HIDDEN, LAYERS, VOCAB = 576, 30, 49152
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of each layer
Variant = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def variants(threads: int, packed: dict[int, cpu_gemm.PackedWeight]) -> dict[str, Variant]:
    """``packed``: each weight's packed form, by ``id`` of the weight."""
    return {
        "kernel": lambda x, w: cpu_gemm.linear(x, packed[id(w)], num_threads=threads),
        "F.linear": lambda x, w: F.linear(x, w),
        "mm": lambda x, w: torch.mm(w, x.t()),
    }


def time_body(fn: Variant, layers: list[list[torch.Tensor]], xs: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for layer in layers:
        for w, x in zip(layer, xs, strict=True):
            fn(x, w)
    return time.perf_counter() - start


def time_head(fn: Variant, head: torch.Tensor, x: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(x, head)
    return time.perf_counter() - start


def rel_diff(threads: int, layer: list[torch.Tensor], head: torch.Tensor, m: int) -> float:
    worst = 0.0
    for w in [*layer, head]:
        x = torch.randn(m, w.shape[1])
        want = F.linear(x, w)
        got = cpu_gemm.linear(x, w, num_threads=threads)
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return worst


def bench(
    threads: int, m: int, rounds: int, layers: list[list[torch.Tensor]], head: torch.Tensor,
    packed: dict[int, cpu_gemm.PackedWeight],
) -> dict[str, tuple[float, float]]:
    """{variant: (best body s, best head s)}."""
    xs = [torch.randn(m, k) for _, k in SHAPES]
    xh = torch.randn(m, HIDDEN)
    fns = variants(threads, packed)
    best = {name: [float("inf"), float("inf")] for name in fns}
    for fn in fns.values():  # warm-up: first-call costs (MKL init, kernel build)
        fn(xs[0], layers[0][0])
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name][0] = min(best[name][0], time_body(fn, layers, xs))
            best[name][1] = min(best[name][1], time_head(fn, head, xh))
    return {name: (b, h) for name, (b, h) in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not cpu_gemm.available():
        sys.exit(f"C kernel unavailable: {cpu_gemm.unavailable_reason()}")
    torch.manual_seed(0)
    layers = [[torch.randn(n, k) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    head = torch.randn(VOCAB, HIDDEN) * 0.02
    packed = {id(w): cpu_gemm.pack(w) for w in [*(w for layer in layers for w in layer), head]}
    body_bytes = sum(w.numel() * 4 for layer in layers for w in layer)
    head_bytes = head.numel() * 4
    print(
        f"body: {LAYERS} layers x {SHAPES} = {body_bytes / 1e6:.0f} MB; "
        f"head: {tuple(head.shape)} = {head_bytes / 1e6:.0f} MB; best of {args.rounds} rounds"
    )
    part = "kernel F.linear     mm  speedup  GB/s"
    cols = f"thr    M | body ms: {part} | head ms: {part} | rel diff"
    print(cols)
    print("-" * len(cols))
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for m in args.m:
                r = bench(threads, m, args.rounds, layers, head, packed)
                row = f"{threads:>3} {m:>4} |"
                for i, nbytes in ((0, body_bytes), (1, head_bytes)):
                    k, fl, mm = (r[v][i] * 1e3 for v in ("kernel", "F.linear", "mm"))
                    row += (
                        f"        {k:>7.1f} {fl:>8.1f} {mm:>6.1f} {min(fl, mm) / k:>7.2f}x"
                        f" {nbytes / (k * 1e6):>5.1f} |"
                    )
                print(f"{row} {rel_diff(threads, layers[0], head, m):8.1e}", flush=True)


if __name__ == "__main__":
    main()
