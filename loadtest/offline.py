"""``tandem bench offline``: Tandem's engine against HF transformers ``generate``, one run.

The workload (default 64 random prompts x 256 tokens in, 128 out, EOS ignored, greedy)
goes through Tandem, then transformers in static batches (default 16) with the same
prompts and thread count, then Tandem again (the ratio uses the mean of both Tandem
runs). It prints both throughputs and their ratio, Tandem's fraction of the compute limit
(workload FLOPs / fp32 GEMM rate measured now: torch's, as the peers' scripts measure it,
and our packed kernel's), the fraction of the machine's FMA peak (register-resident FMA
chains on every thread: the compute limit that no GEMM library defines), and batch-1
decode latency against the bandwidth limit (the bytes a step actually reads: weights as
held, quantised or not, plus the KV of the context, over the measured read rate).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from common.config import available_cpus
from common.flags import add_engine_flags, engine_config
from common.sampling_params import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch", type=int, default=16, help="static batch size of the HF baseline")
    p.add_argument("--skip-hf", action="store_true", help="measure Tandem only")
    p.add_argument("--batch1-tokens", type=int, default=64, help="output tokens of the TPOT probe")
    p.add_argument("--json", help="also write the results here")
    add_engine_flags(p)
    p.set_defaults(func=run)


def random_prompts(num: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


def run(args: argparse.Namespace) -> int:
    from common.engine.engine import Engine
    from loadtest import limits  # torch: not for every command that builds the parser

    threads = int(args.threads or available_cpus())
    args.threads = threads
    engine = Engine(engine_config(args))
    spec = engine.spec
    prompts = random_prompts(args.num_prompts, args.input_len, spec.vocab_size)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    say(f"measuring the machine ({threads} threads) ...")
    gflops = limits.gemm_gflops(spec)
    kernel_gflops = limits.kernel_gemm_gflops(spec)
    bandwidth = limits.read_bandwidth_gbs()
    peak = limits.fma_peak_gflops(threads)
    peak_1 = limits.fma_peak_gflops(1) if threads > 1 else peak

    engine.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.pool.reset_prefix_cache()

    def tandem_run() -> float:
        say(f"tandem: {len(prompts)} prompts x ({args.input_len} in, {args.output_len} out) ...")
        seconds = _timed(lambda: engine.generate(prompts, params))
        engine.pool.reset_prefix_cache()  # the next run must not hit this run's blocks
        return seconds

    # Tandem, HF, Tandem (A-B-A): this machine drifts, and averaging Tandem's runs on
    # both sides of HF's cancels a linear drift out of the ratio.
    tandem_runs = [tandem_run()]
    tpot_ms = _batch1_tpot_ms(engine, prompts[0], args.batch1_tokens)
    plan = engine.cache_plan
    step_bytes = limits.decode_bytes_per_token(engine.loaded.model, plan.bytes_per_block / plan.block_size,
                                               args.input_len + args.batch1_tokens / 2)

    hf_s = None
    if not args.skip_hf:
        say(f"hf transformers: static batches of {args.hf_batch} ...")
        hf_s = _hf_seconds(_model_dir(args), prompts, args.output_len, args.hf_batch)
        tandem_runs.append(tandem_run())
        gflops = (gflops + limits.gemm_gflops(spec)) / 2
        if peak is not None:  # a capability: the best seen is the best estimate of it
            peak = max(peak, limits.fma_peak_gflops(threads))
        if kernel_gflops is not None:
            kernel_gflops = (kernel_gflops + limits.kernel_gemm_gflops(spec)) / 2
    tandem_s = sum(tandem_runs) / len(tandem_runs)
    out_tokens = len(prompts) * args.output_len
    flops = limits.generation_flops(spec, args.input_len, args.output_len, len(prompts))
    result = {
        "threads": threads, "num_prompts": len(prompts), "input_len": args.input_len,
        "output_len": args.output_len, "gemm_gflops": gflops, "read_bandwidth_gbs": bandwidth,
        "tandem_seconds": tandem_s, "tandem_tok_s": out_tokens / tandem_s,
        "compute_limit_seconds": flops / (gflops * 1e9),
        "fraction_of_compute_limit": flops / (gflops * 1e9) / tandem_s,
        "kernel_gemm_gflops": kernel_gflops,
        "fma_peak_gflops": peak, "fma_peak_1thread_gflops": peak_1,
        "batch1_tpot_ms": tpot_ms,
        "batch1_bytes_per_token": step_bytes,
        "batch1_bandwidth_limit_ms": step_bytes / (bandwidth * 1e9) * 1e3,
    }
    if peak is not None:
        result["fma_limit_seconds"] = flops / (peak * 1e9)
        result["fraction_of_fma_peak"] = result["fma_limit_seconds"] / tandem_s
    if kernel_gflops is not None:
        result["kernel_compute_limit_seconds"] = flops / (kernel_gflops * 1e9)
        result["fraction_of_kernel_compute_limit"] = result["kernel_compute_limit_seconds"] / tandem_s
    result["tandem_runs_seconds"] = tandem_runs
    if hf_s is not None:
        result.update(hf_seconds=hf_s, hf_tok_s=out_tokens / hf_s, ratio_vs_hf=hf_s / tandem_s)
    _print(result, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _batch1_tpot_ms(engine, prompt: list[int], num_tokens: int) -> float:
    """Mean time per output token after the first, one request alone."""
    engine.add_request(prompt, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True),
                       request_id="tpot-probe")
    stamps = []
    while engine.has_unfinished:
        if engine.step():
            stamps.append(time.perf_counter())
        engine.finished_output("tpot-probe")
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3


def _model_dir(args: argparse.Namespace) -> str:
    from common.model.loader import resolve_model

    return str(resolve_model(args.model).directory)


def _hf_seconds(model_dir: str, prompts: list[list[int]], output_len: int, batch: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        warm = ids[:batch, :16]
        model.generate(warm, attention_mask=torch.ones_like(warm), **{**kwargs, "max_new_tokens": 2,
                                                                       "min_new_tokens": 2})
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            x = ids[i : i + batch]
            model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        return time.perf_counter() - start


def _print(r: dict, args: argparse.Namespace) -> None:
    lines = [
        f"workload: {r['num_prompts']} prompts x ({r['input_len']} in, {r['output_len']} out), "
        f"greedy, EOS ignored, {r['threads']} threads",
        f"machine now: fp32 GEMM {r['gemm_gflops']:.1f} GFLOP/s (torch), "
        + (f"{r['kernel_gemm_gflops']:.1f} GFLOP/s (our kernel), " if r["kernel_gemm_gflops"] else "")
        + f"memory read {r['read_bandwidth_gbs']:.1f} GB/s",
        f"tandem:           {r['tandem_tok_s']:7.1f} output tok/s ({r['tandem_seconds']:.1f} s, mean of "
        f"{len(r['tandem_runs_seconds'])} runs: {', '.join(f'{x:.1f}' for x in r['tandem_runs_seconds'])})",
    ]
    if "hf_tok_s" in r:
        lines += [f"hf transformers:  {r['hf_tok_s']:7.1f} output tok/s ({r['hf_seconds']:.1f} s, "
                  f"static batch {args.hf_batch})",
                  f"ratio tandem/hf:  {r['ratio_vs_hf']:7.2f}x"]
    lines += [
        f"compute limit:    {r['compute_limit_seconds']:.1f} s -> tandem at "
        f"{100 * r['fraction_of_compute_limit']:.0f}% of it (at torch's GEMM rate)",
    ]
    if "fma_limit_seconds" in r:
        lines += [f"                  {r['fma_limit_seconds']:.1f} s -> tandem at "
                  f"{100 * r['fraction_of_fma_peak']:.0f}% of it (at the machine's FMA peak, "
                  f"{r['fma_peak_gflops']:.1f} GFLOP/s on {r['threads']} threads, "
                  f"{r['fma_peak_1thread_gflops']:.1f} on one)"]
    if "kernel_compute_limit_seconds" in r:
        lines += [f"                  {r['kernel_compute_limit_seconds']:.1f} s -> tandem at "
                  f"{100 * r['fraction_of_kernel_compute_limit']:.0f}% of it (at our kernel's GEMM rate)"]
    lines += [
        f"batch-1 TPOT:     {r['batch1_tpot_ms']:.1f} ms (bandwidth limit {r['batch1_bandwidth_limit_ms']:.1f} ms "
        f"for {r['batch1_bytes_per_token'] / 1e6:.0f} MB read per token: at "
        f"{r['batch1_bandwidth_limit_ms'] / r['batch1_tpot_ms'] * 100:.0f}% of it)",
    ]
    print("\n".join(lines))
