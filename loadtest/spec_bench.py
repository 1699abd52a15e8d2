"""Speculative decoding at batch 1, offline: output tok/s with it off and on.

Two workloads, greedy, one request at a time (c1) through the offline engine:
- ``grounded``: chat prompts asking the model to repeat or lightly edit a given passage,
  so its output copies its input (where prompt lookup pays);
- ``random``: prompts of random token ids (where it should cost next to nothing).
Each round runs the workload with speculation off, then on for every ``--k``; printed per
configuration: the median output tok/s over ``--rounds`` rounds, the median of the rounds'
on/off ratios (each a side-by-side pair, so a machine whose speed drifts between rounds
does not tilt it), the acceptance rate.

    python -m loadtest.spec_bench --k 2 3 4 5 --prompt-lookup-max 3 --max-tokens 128 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace

from common.config import EngineConfig, SpeculativeConfig
from common.engine.engine import Engine
from common.engine.setup import load_model
from common.sampling_params import SamplingParams

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff for more than a century. Every night its "
    "keeper climbed the spiral stairs, trimmed the wick and watched the beam sweep across the "
    "dark water, warning ships away from the rocks below.",
    "To make the bread, mix the flour, water, salt and yeast in a large bowl. Knead the dough for "
    "ten minutes until it is smooth, then leave it to rise in a warm place for an hour before "
    "shaping it into a loaf and baking it until golden.",
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase spending on the library and the park, and to "
    "postpone the repairs to the town hall until the spring.",
    "Rivers carry water from the mountains to the sea. Along the way they shape valleys, feed "
    "wetlands and provide homes for fish, birds and insects. People have always settled near "
    "rivers, using them for drinking water, farming and transport.",
]
INSTRUCTIONS = ["Repeat the following text exactly:", "Rewrite the following text, fixing any "
                "mistakes and keeping everything else the same:"]


def grounded_prompts(engine: Engine, num: int) -> list[list[int]]:
    tok = engine.tokenizer
    assert tok is not None, "the grounded workload needs a tokenizer"
    return [tok.apply_chat_template([{"role": "user", "content":
                                      f"{INSTRUCTIONS[i % 2]}\n\n{PASSAGES[i % len(PASSAGES)]}"}])
            for i in range(num)]


def random_prompts(num: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(num)]


def run_c1(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """(output tok/s, tokens) with one request in flight at a time."""
    tokens, start = 0, time.perf_counter()
    for prompt in prompts:
        tokens += len(engine.generate([prompt], params)[0].choices[0].token_ids)
    return tokens / (time.perf_counter() - start), tokens


def measure_round(off: Engine, engines: dict[int, Engine], prompts: list[list[int]],
                  params: SamplingParams) -> dict[int, tuple[float, int, int]]:
    """One pass of the workload off (key 0) and then with each draft length: per key,
    (output tok/s, draft tokens, accepted draft tokens)."""
    out = {0: (run_c1(off, prompts, params)[0], 0, 0)}
    for k, engine in engines.items():
        before = engine.stats()
        tps, _ = run_c1(engine, prompts, params)
        after = engine.stats()
        out[k] = (tps, after.num_draft_tokens - before.num_draft_tokens,
                  after.num_accepted_tokens - before.num_accepted_tokens)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, nargs="+", default=[3], help="num_speculative_tokens to try")
    p.add_argument("--prompt-lookup-max", type=int, default=3)
    p.add_argument("--prompt-lookup-min", type=int, default=0, help="0: the engine's default")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--random-len", type=int, default=256)
    p.add_argument("--workloads", nargs="+", default=["grounded", "random"], choices=["grounded", "random"])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    base = EngineConfig()
    loaded = load_model(base.model)
    off = Engine(base, loaded=loaded)
    engines = {k: Engine(replace(base, speculative=SpeculativeConfig(
        num_speculative_tokens=k, prompt_lookup_max=args.prompt_lookup_max,
        prompt_lookup_min=args.prompt_lookup_min)), loaded=loaded) for k in args.k}
    workloads = {"grounded": grounded_prompts(off, args.num_prompts),
                 "random": random_prompts(args.num_prompts, args.random_len, off.spec.vocab_size)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    results = []
    for name in args.workloads:
        prompts = workloads[name]
        for engine in [off, *engines.values()]:  # warm up (kernels, caches)
            engine.generate(prompts[:1], replace(params, max_tokens=4))
        rounds = [measure_round(off, engines, prompts, params) for _ in range(args.rounds)]
        base_tps = statistics.median(r[0][0] for r in rounds)
        print(f"{name:9s} off        {base_tps:7.1f} output tok/s (median of {args.rounds})", flush=True)
        for k in engines:
            tps = statistics.median(r[k][0] for r in rounds)
            ratio = statistics.median(r[k][0] / r[0][0] for r in rounds)
            drafted = sum(r[k][1] for r in rounds)
            rate = sum(r[k][2] for r in rounds) / drafted if drafted else 0.0
            print(f"{name:9s} on k={k} m={args.prompt_lookup_max} {tps:7.1f} output tok/s  "
                  f"{ratio:5.2f}x  acceptance {100 * rate:3.0f}% of {drafted} draft tokens", flush=True)
            results.append({"workload": name, "k": k, "m": args.prompt_lookup_max, "off_tok_s": base_tps,
                            "on_tok_s": tps, "ratio": ratio, "acceptance_rate": rate,
                            "rounds": [{"off_tok_s": r[0][0], "on_tok_s": r[k][0]} for r in rounds]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
