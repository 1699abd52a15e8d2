"""Where the offline workload's time goes: per-kernel timers around one engine run.

The workload of ``tandem bench offline`` (random prompts, greedy, EOS ignored) runs once
through the engine with a wall-clock timer around each kernel entry point the model calls
(``kernels.cpu_quant.linear`` split into GEMV-sized and GEMM-sized calls and the LM head,
``cpu_gemm.linear``, the one-call decode layers, the attention backend in steps with and
without prefill chunks, the fused elementwise ops) and around each engine step, split by the step's
kind (only decode rows, or with prefill chunks). What no timer covers is the step's
Python: scheduling, metadata, sampling, bookkeeping. Printed: seconds and share of the
run per entry, and the FLOP rate of the GEMM entries.

Timers nest (the decode layers call the GEMV from C, so no linear timer sees those
calls), so each line is its own time: the shares add up to the run.
``--split-decode-layers`` runs decode steps layer by layer from Python instead (the same
kernels, so GEMV and decode attention are timed apart, plus the launches' Python cost).

    python -m loadtest.profile_offline [--num-prompts 64] [--input-len 256] [--output-len 128]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import time
from collections.abc import Callable, Iterator

from common.config import available_cpus
from common.flags import add_engine_flags, engine_config
from common.sampling_params import SamplingParams
from loadtest.offline import random_prompts


class Timers:
    """Seconds, calls and FLOPs per label; ``own`` excludes the time of nested timers."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.flops: dict[str, float] = collections.defaultdict(float)
        self._stack: list[float] = []  # time spent in nested timers, per open frame

    def wrap(self, fn: Callable, label: Callable[..., tuple[str, float]]) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            name, flops = label(*args, **kwargs)
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - start
                nested = self._stack.pop()
                self.seconds[name] += total - nested
                self.calls[name] += 1
                self.flops[name] += flops
                if self._stack:
                    self._stack[-1] += total
        return timed


def _linear_label(vocab: int) -> Callable[..., tuple[str, float]]:
    def label(x, weight, bias=None):
        m, n, k = x.shape[0], weight.n, x.shape[-1]
        kind = ("lm head" if n == vocab else "M <= 8" if m <= 8 else "M <= 40" if m <= 40
                else "M <= 128" if m <= 128 else "M > 128")  # the paths' bounds, quant_gemm.c
        return f"quant {kind}", 2.0 * m * n * k
    return label


@contextlib.contextmanager
def installed(timers: Timers, engine) -> Iterator[None]:
    """Timers around the kernels the engine's model calls (module attributes, as the model
    looks them up at each call) and around ``engine.step``, for the ``with`` block; every
    patched attribute is put back after it."""
    from kernels import attention, cpu_decode, cpu_gemm, cpu_ops, cpu_quant

    vocab = engine.spec.vocab_size

    def attention_label(self, q, k, v, k_cache, v_cache, meta, scale):
        return ("attention, with prefill chunks" if meta.prefills else "attention, decode rows only"), 0.0

    def step_label(self):
        sched = self.scheduler  # a waiting prompt is prefilled by this step, or waits for room
        prefill = bool(sched.waiting) or any(s.num_uncomputed_tokens > 1 for s in sched.running)
        return ("step: rest (Python, sampling, scheduling)" + (", with prefill" if prefill else ", decode only")), 0.0

    patches = [
        (cpu_quant, "linear", _linear_label(vocab)),
        (cpu_gemm, "linear", lambda x, w, b=None: ("fp32 packed GEMM", 2.0 * x.shape[0] * w.shape[0] * x.shape[-1])),
        (cpu_decode.DecodeLayers, "run", lambda self, x, *a, **k: ("decode layers (C, one call)", 0.0)),
        (attention.TorchBackend, "forward", attention_label),
        (type(engine), "step", step_label),
        *[(cpu_ops, name, lambda *a, _n=name, **k: (f"elementwise {_n}", 0.0))
          for name in ("add_rms_norm", "rope_qk", "silu_mul")],
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, label in patches:
            setattr(owner, name, timers.wrap(getattr(owner, name), label))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--split-decode-layers", action="store_true",
                   help="run decode steps layer by layer from Python (the same kernels, each timed "
                        "on its own) instead of the one C call")
    add_engine_flags(p)
    args = p.parse_args(argv)
    args.threads = int(args.threads or available_cpus())
    from common.engine.engine import Engine

    engine = Engine(engine_config(args))
    if args.split_decode_layers:
        engine.loaded.model.decode_loop = False
    prompts = random_prompts(args.num_prompts, args.input_len, engine.spec.vocab_size)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.pool.reset_prefix_cache()
    timers = Timers()
    with installed(timers, engine):
        start = time.perf_counter()
        engine.generate(prompts, params)
        wall = time.perf_counter() - start
    tokens = args.num_prompts * args.output_len
    print(f"{args.num_prompts} prompts x ({args.input_len} in, {args.output_len} out), "
          f"{args.threads} threads: {wall:.2f} s, {tokens / wall:.1f} output tok/s; {engine.describe()}")
    print(f"{'entry':48s} {'seconds':>8s} {'share':>6s} {'calls':>7s} {'GFLOP/s':>8s}")
    for name in sorted(timers.seconds, key=timers.seconds.get, reverse=True):
        s = timers.seconds[name]
        rate = f"{timers.flops[name] / s / 1e9:8.1f}" if timers.flops[name] else ""
        print(f"{name:48s} {s:8.2f} {100 * s / wall:5.1f}% {timers.calls[name]:7d} {rate:>8s}")
    print(f"{'outside any step':48s} {wall - sum(timers.seconds.values()):8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
