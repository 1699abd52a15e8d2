"""Microbenchmark of the quantised-weight GEMMs of SmolLM2-135M on the CPU (``kernels.cpu_quant``)
against the packed float32 kernel (``kernels.cpu_gemm``) and torch on the same weights dequantised.

One step multiplies M rows by every weight: per layer the fused qkv (960x576), o (576x576),
gate/up (3072x576) and down (576x1536) projections in ``--fmt`` (default Q4_1, as the
default GGUF), 30 distinct layers (cold: from DRAM, as in a real step), then the tied LM
head (49152x576) in Q8_0. Weights are random valid blocks (random quants, small random
half scales); the float32 variants multiply their dequantised copies. For each M it prints
the milliseconds of the whole step (body + head; each product's best round) for

* ``quant``: ``cpu_quant.linear(x, cpu_quant.pack(w))``,
* ``fp32``: ``cpu_gemm.linear(x, cpu_gemm.pack(w.dequantize()))``,
* ``torch``: ``F.linear(x, w.dequantize())``,

the quant kernel's weight bandwidth (packed bytes / time), GFLOP/s of quant and fp32, and
``rel diff`` (largest |quant - fp32| / max|fp32| over the shapes).

    python -m loadtest.quant_gemm_bench [--m 1 2 4 8 64 256] [--threads 2] [--layers 30] [--per-shape]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import cpu_gemm, cpu_quant
from kernels.quant_formats import QuantFormat, QuantWeight

HIDDEN, VOCAB = 576, 49152
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of each layer


def random_weight(fmt: QuantFormat, n: int, k: int, g: torch.Generator) -> QuantWeight:
    """Random quants with half scales of a trained model's size (d ~ 1e-3, m ~ -8d)."""
    if fmt is QuantFormat.INT8_ROW:
        data = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).view(torch.uint8)
        return QuantWeight(fmt, n, k, data, torch.rand(n, generator=g) * 1e-3)
    blocks = torch.randint(0, 256, (n, k // 32, fmt.block_bytes), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, 1, generator=g) * 2e-3).half()
    blocks[..., 0:2] = d.view(torch.uint8)
    if fmt is QuantFormat.Q4_1:
        blocks[..., 2:4] = (-8 * d.float()).half().view(torch.uint8)
    return QuantWeight(fmt, n, k, blocks.reshape(n, -1))



def time_step(fn: Callable[[torch.Tensor, object], torch.Tensor], weights: list, xs: list) -> list[float]:
    """Seconds of each product of one step (weights in order, so each comes from DRAM)."""
    times = []
    for w, x in zip(weights, xs, strict=True):
        start = time.perf_counter()
        fn(x, w)
        times.append(time.perf_counter() - start)
    return times


def per_shape(m: int, qw: list[QuantWeight], best: dict[str, list[float]]) -> str:
    """GFLOP/s of quant / fp32 for each distinct (N, K, format) at m rows, summed over its
    layers, with the quant kernel's path."""
    shapes: dict[tuple[int, int, QuantFormat], list[int]] = {}
    for i, w in enumerate(qw):
        shapes.setdefault((w.n, w.k, w.fmt), []).append(i)
    parts = []
    for (n, k, fmt), idx in shapes.items():
        rates = [2 * m * n * k * len(idx) / (sum(best[v][i] for i in idx) * 1e9) for v in ("quant", "fp32")]
        parts.append(f"{n}x{k} {fmt.name} {rates[0]:.0f}/{rates[1]:.0f} ({cpu_quant.path(fmt, m, k)})")
    return " | ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 64, 256])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fmt", default="Q4_1", choices=[f.name for f in QuantFormat])
    ap.add_argument("--isa", choices=cpu_quant.ISAS, help="cap the kernel's path (default: the CPU's best)")
    ap.add_argument("--per-shape", action="store_true",
                    help="also print each product's GFLOP/s (quant / fp32) and the quant path it takes")
    args = ap.parse_args()
    if not (cpu_quant.available() and cpu_gemm.available()):
        sys.exit(f"C kernels unavailable: {cpu_quant.unavailable_reason() or cpu_gemm.unavailable_reason()}")
    cpu_quant.set_isa(args.isa)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    fmt = QuantFormat[args.fmt]
    qw = [random_weight(fmt, n, k, g) for _ in range(args.layers) for n, k in SHAPES]
    qw.append(random_weight(QuantFormat.Q8_0, VOCAB, HIDDEN, g))
    quant = cpu_quant.pack_all(qw)
    dense = [w.dequantize() for w in qw]
    packed = cpu_gemm.pack_all(dense)
    qbytes, fbytes = sum(p.nbytes for p in quant), sum(w.numel() * 4 for w in dense)
    flops_per_row = 2 * sum(w.numel() for w in dense)
    print(f"{args.layers} layers {fmt.name} + Q8_0 head: {qbytes / 1e6:.0f} MB packed "
          f"(fp32 {fbytes / 1e6:.0f} MB); {args.threads} threads, isa {cpu_quant.isa()}, "
          f"best of {args.rounds}")
    print("    M | ms: quant    fp32   torch | quant GB/s | GFLOP/s quant  fp32 | rel diff")
    variants = {
        "quant": (lambda x, w: cpu_quant.linear(x, w, num_threads=args.threads), quant),
        "fp32": (lambda x, w: cpu_gemm.linear(x, w, num_threads=args.threads), packed),
        "torch": (F.linear, dense),
    }
    with torch.inference_mode():
        for m in args.m:
            xs = [torch.randn(m, w.shape[1], generator=g) for w in dense]
            best = {name: [float("inf")] * len(dense) for name in variants}
            for fn, ws in variants.values():  # warm-up
                fn(xs[0], ws[0])
            for _ in range(args.rounds):  # per product, its best round: robust to a busy machine
                for name, (fn, ws) in variants.items():
                    best[name] = [min(a, b) for a, b in zip(best[name], time_step(fn, ws, xs), strict=True)]
            diff = max(float((cpu_quant.linear(x, q) - cpu_gemm.linear(x, p)).abs().max()
                             / cpu_gemm.linear(x, p).abs().max())
                       for x, q, p in zip(xs[:4] + xs[-1:], quant[:4] + quant[-1:],
                                          packed[:4] + packed[-1:], strict=True))
            q, f, t = (sum(best[v]) * 1e3 for v in ("quant", "fp32", "torch"))
            print(f"{m:>5} | {q:>9.1f} {f:>7.1f} {t:>7.1f} | {qbytes / (q * 1e6):>10.1f} | "
                  f"{flops_per_row * m / (q * 1e6):>13.1f} {flops_per_row * m / (f * 1e6):>5.1f} | "
                  f"{diff:8.1e}", flush=True)
            if args.per_shape:
                print("      " + per_shape(m, qw, best))


if __name__ == "__main__":
    main()
