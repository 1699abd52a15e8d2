"""``tandem bench structured``: what a JSON-schema constraint costs per output token.

The offline engine decodes ``c`` requests at once (``--concurrency``, default c1 and
c16), greedy, ``--max-tokens`` each, without a constraint and with a JSON schema whose
``minItems`` keeps every answer open for the whole budget (an array of records: quoted
strings, bounded integers, structure), so both runs emit exactly the same number of
tokens. Per-output-token time is each request's (last token − first token) / (tokens − 1),
averaged; the runs alternate plain, constrained, plain, constrained (this machine drifts),
and each mode's mean is compared. Also printed: the time spent in the engine computing
masks per step (``Constraints.prepare``), and the first constrained request's one-off
cost (the llguidance tokenizer and the grammar compile; later requests hit the cache).

    tandem bench structured --model DIR --concurrency 1 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from common.flags import add_engine_flags, engine_config
from common.sampling_params import SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["people"], "properties": {
    "people": {"type": "array", "minItems": 200, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"enum": ["Paris", "Oslo", "Lima", "Kyoto"]}}}}}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="plain/constrained pairs per concurrency")
    p.add_argument("--json", help="also write the results here")
    add_engine_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from common.engine.engine import Engine
    from common.grammar import structured_from_json_schema

    engine = Engine(engine_config(args))
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    mask_clock = _time_masks(engine)
    structured = structured_from_json_schema(SCHEMA)
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=structured)
    rng = random.Random(1)
    prompt = lambda: [rng.randrange(3, engine.spec.vocab_size) for _ in range(args.input_len)]  # noqa: E731

    engine.generate([prompt()], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    engine.generate([prompt()], SamplingParams(max_tokens=2, temperature=0.0, structured=structured))
    first_s = time.perf_counter() - start  # tokenizer + compile + two steps
    results = []
    for c in args.concurrency:
        times: dict[str, list[float]] = {"plain": [], "json": []}
        mask_s, steps = 0.0, 0
        for r in range(args.rounds):
            for mode, params in (("plain", plain), ("json", constrained)):
                say(f"c{c} round {r + 1}: {mode} ...")
                mask_clock.reset()
                tpot, n_steps = _tpot(engine, [prompt() for _ in range(c)], params)
                times[mode].append(tpot)
                if mode == "json":
                    mask_s, steps = mask_s + mask_clock.seconds, steps + n_steps
        plain_ms = 1e3 * sum(times["plain"]) / len(times["plain"])
        json_ms = 1e3 * sum(times["json"]) / len(times["json"])
        results.append({"concurrency": c, "plain_tpot_ms": plain_ms, "json_tpot_ms": json_ms,
                        "overhead_pct": 100 * (json_ms / plain_ms - 1),
                        "mask_ms_per_step": 1e3 * mask_s / max(steps, 1),
                        "runs_ms": {k: [1e3 * x for x in v] for k, v in times.items()}})
    out = {"model": engine.loaded.name, "device": str(engine.runner.device),
           "max_tokens": args.max_tokens, "input_len": args.input_len,
           "first_constrained_request_s": first_s, "results": results}
    _print(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _tpot(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """Mean per-output-token time of requests decoded together, and the steps it took."""
    ids = [engine.add_request(p, params) for p in prompts]
    stamps: dict[str, list[float]] = {i: [] for i in ids}
    steps = 0
    while engine.has_unfinished:
        updates = engine.step()
        now = time.perf_counter()
        steps += 1
        for u in updates:
            if u.error is not None:
                raise RuntimeError(u.error)
            stamps[u.request_id] += [now] * len(u.token_ids)
            if u.finish_reason is not None:
                engine.finished_output(u.request_id)
    if any(len(s) != params.max_tokens for s in stamps.values()):
        raise RuntimeError("a request ended before max_tokens: the comparison needs equal lengths")
    engine.pool.reset_prefix_cache()
    per = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps.values()]
    return sum(per) / len(per), steps


class _MaskClock:
    def __init__(self) -> None:
        self.seconds = 0.0

    def reset(self) -> None:
        self.seconds = 0.0


def _time_masks(engine) -> _MaskClock:
    """Wrap the engine's mask computation with a clock (this benchmark's engine only)."""
    clock = _MaskClock()
    prepare = engine.constraints.prepare

    def timed(*a, **kw):
        start = time.perf_counter()
        try:
            return prepare(*a, **kw)
        finally:
            clock.seconds += time.perf_counter() - start

    engine.constraints.prepare = timed
    return clock


def _print(out: dict) -> None:
    lines = [f"model {out['model']} on {out['device']}: {out['input_len']} tokens in, "
             f"{out['max_tokens']} out, greedy; JSON schema: an array of >= 200 records",
             f"first constrained request (tokenizer + compile): {out['first_constrained_request_s']:.2f} s"]
    for r in out["results"]:
        lines.append(f"c{r['concurrency']:<3} per output token: plain {r['plain_tpot_ms']:7.2f} ms, "
                     f"json_schema {r['json_tpot_ms']:7.2f} ms ({r['overhead_pct']:+.1f}%); "
                     f"masks {r['mask_ms_per_step']:.2f} ms per step")
    print("\n".join(lines))
