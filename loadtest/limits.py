"""What this machine could do at best, measured now: GEMM rate, memory read bandwidth,
and the FLOPs a generation workload needs. Benchmarks divide by these to report a
fraction of the physical limit measured in the same run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from common.model.spec import ModelSpec


def _best_seconds(fn: Callable[[], object], min_time: float = 0.3, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_time or n == 0:
            fn()
            n += 1
        best = min(best, elapsed / n)
    return best


def gemm_gflops(spec: ModelSpec, rows: int = 64) -> float:
    """Best fp32 GEMM rate over the model's own decode-shaped products (rows x K x N).

    The same shapes as the peers' ``phys_limit.py`` (64 x hidden x intermediate, its
    transpose, and the LM head), so fractions compare with the figures quoted for vLLM.
    """
    return _best_gflops(spec, rows, lambda w: w, torch.nn.functional.linear)


def kernel_gemm_gflops(spec: ModelSpec, rows: int = 64) -> float | None:
    """The same products by our packed-weight CPU kernel (None where it is unavailable).

    It beats torch's GEMM here, so a fraction of the limit at torch's rate flatters
    whoever uses the kernel; the limit at this rate is the stricter one."""
    from kernels import cpu_gemm

    if not cpu_gemm.available():
        return None
    return _best_gflops(spec, rows, cpu_gemm.pack, cpu_gemm.linear)


def _best_gflops(spec: ModelSpec, rows: int, prepare: Callable, product: Callable) -> float:
    """Best rate of ``product(x, prepare(w))`` over the shapes of ``gemm_gflops``."""
    shapes = [(spec.hidden_size, spec.intermediate_size), (spec.intermediate_size, spec.hidden_size),
              (spec.hidden_size, spec.vocab_size)]
    best = 0.0
    for k, n in shapes:
        a, b = torch.randn(rows, k), prepare(torch.randn(n, k))
        seconds = _best_seconds(lambda a=a, b=b: product(a, b))
        best = max(best, 2.0 * rows * k * n / seconds / 1e9)
    return best


def fma_peak_gflops(threads: int) -> float | None:
    """The machine's FMA peak on ``threads`` threads (register-resident FMA chains,
    ``kernels/cpu/fma_peak.c``); None where the kernel cannot be built."""
    from kernels import cpu_peak

    if not cpu_peak.available():
        return None
    return cpu_peak.fma_peak_gflops(threads)


def read_bandwidth_gbs(nbytes: int = 512 * 2**20) -> float:
    """Memory read bandwidth: summing a buffer far larger than the last-level cache."""
    x = torch.ones(nbytes // 4)
    return nbytes / _best_seconds(x.sum) / 1e9


def generation_flops(spec: ModelSpec, prompt_len: int, output_len: int, num_prompts: int) -> float:
    """Model FLOPs of a workload: 2 x non-embedding params per processed token, the LM head
    per generated token, and causal attention (QK^T and PV) over each token's context."""
    body = spec.num_params(with_embeddings=False)
    processed = prompt_len + output_len - 1  # the last token is sampled, never fed back
    lm_head = 2.0 * spec.vocab_size * spec.hidden_size
    attn_per_position = 4.0 * spec.num_layers * spec.num_heads * spec.head_dim
    context_sum = processed * (processed + 1) / 2  # token at position p attends to p+1 keys
    per_prompt = 2.0 * body * processed + lm_head * output_len + attn_per_position * context_sum
    return per_prompt * num_prompts


def decode_bytes_per_token(model, kv_bytes_per_position: float, context: float) -> float:
    """Bytes a batch-1 decode step reads: the model's weights as held (quantised or not)
    plus the cache of ``context`` positions (K and V of every layer, with their scales where
    the cache is quantised)."""
    return model.weight_bytes() + kv_bytes_per_position * context

