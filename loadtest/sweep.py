"""``tandem bench sweep``: one workload at a series of request rates (or concurrencies).

This module owns the sweep: it builds ``tandem bench serve``'s prompt set once, runs it
at each point of ``--request-rates`` (Poisson arrivals) or ``--concurrencies`` (all sent at
once, at most N in flight) against any OpenAI-compatible server, and writes one JSON
holding every point's summary, the settings, the series label and the machine, then the
plots (``loadtest/sweep_plots.py``). It reports the best goodput (requests per second that
meet every ``--slo``) and the point where it occurs. The server drains between points:
each point waits for all its requests before the next begins.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadtest import serve, sweep_plots
from loadtest.serve import LoadShape, Prompt, Record

DEFAULT_SLO = "ttft:2000,tpot:100"
AXES = {"request_rate": "rate", "concurrency": "concurrency"}


# ---- command line ------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    serve.add_workload_arguments(p)
    points = p.add_mutually_exclusive_group(required=True)
    points.add_argument("--request-rates", type=positive_list,
                        help="Poisson arrivals per second at each point, e.g. 0.25,0.5,1,2")
    points.add_argument("--concurrencies", type=positive_ints,
                        help="closed loop: all requests at once, at most N in flight, e.g. 1,4,16")
    p.add_argument("--max-concurrency", type=int,
                   help="with --request-rates: most requests in flight at once")
    p.add_argument("--warmup", type=int, default=1,
                   help="rounds of unmeasured requests before the first point, one a time, "
                   "one per prompt length in the set (fresh text: no prefix-cache hits)")
    p.add_argument("--label", help="the series' name in plots and file names, e.g. P/D "
                   "(default: the served model)")
    p.add_argument("--output-dir", default="bench-sweep", help="where the JSON and PNGs go")
    p.add_argument("--compare", nargs="+", default=[], metavar="JSON",
                   help="earlier sweep JSONs to overlay in this sweep's plots")
    p.add_argument("--quiet", action="store_true", help="no progress bars or per-point lines")
    p.set_defaults(func=run, slo=serve.parse_slo(DEFAULT_SLO))
    p.epilog = f"SLOs default to {DEFAULT_SLO} (ms); --slo '' counts every completed request."


def positive_list(text: str) -> list[float]:
    """``"0.25,0.5,1"`` -> ``[0.25, 0.5, 1.0]``: finite, positive, increasing, no repeats."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or not all(0 < v < math.inf for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give finite positive numbers")
    if values != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"{text!r}: give the points in increasing order, once each")
    return values


def positive_ints(text: str) -> list[int]:
    values = positive_list(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: concurrencies are whole numbers")
    return [int(v) for v in values]


def shapes(args: argparse.Namespace) -> tuple[str, list[LoadShape]]:
    """The axis the points lie on and each point's load shape."""
    if args.concurrencies:
        return "concurrency", [LoadShape(math.inf, c) for c in args.concurrencies]
    return "request_rate", [LoadShape(r, args.max_concurrency) for r in args.request_rates]


def slug(label: str) -> str:
    """A label as a file-name stem: ``"P/D"`` -> ``"p-d"``."""
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") or "sweep"


# ---- the sweep ---------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    for noisy in ("httpx", "matplotlib"):  # a line per request would bury the bars
        logging.getLogger(noisy).setLevel(logging.WARNING)
    compared = sweep_plots.load_series(args.compare)  # fail on a bad file before any load
    url, model = serve.target(args)
    label = args.label or model
    print(f"building {args.num_prompts} {args.dataset} prompts ...", file=sys.stderr, flush=True)
    codec = serve.load_codec(args.tokenizer)
    axis, points = shapes(args)
    prompt_sets = [serve.build_prompts(with_seed(args, args.seed + i), codec)
                   for i in range(len(points))]
    print(f"sweeping {url} (model {model}) over {len(points)} points ...", file=sys.stderr, flush=True)
    warm_up(args, url, model, codec, prompt_sets[0], first_seed=args.seed + len(points))
    rows = run_points(args, url, model, prompt_sets, axis, points)
    result = sweep_result(args, model, label, axis, rows)
    print(format_table(result))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sweep-{slug(label)}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    sweep_plots.write_plots([result, *compared], out, f"sweep-{slug(label)}")
    return 0 if any(row["summary"]["completed"] for row in rows) else 1


def with_seed(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    """Each point's own prompts (same lengths, other text): with one set for all, every
    point after the first would hit the server's prefix cache and look fast."""
    return argparse.Namespace(**{**vars(args), "seed": seed})


def warm_up(args: argparse.Namespace, url: str, model: str, codec: serve.Codec,
            prompts: list[Prompt], first_seed: int) -> None:
    """Unmeasured requests first: a server's first passes at a shape (allocations, kernel
    builds) would otherwise land in the first point's latencies. Seeds from ``first_seed``
    on, which no point uses, so that no point's prompts are cached by them."""
    lengths = sorted({p.num_tokens for p in prompts})
    seeds = iter(range(first_seed, first_seed + args.warmup * len(lengths)))
    warm = [serve.random_prompts(codec, 1, n, seed=next(seeds))[0]
            for _ in range(args.warmup) for n in lengths]
    if warm:
        print(f"warming up with {len(warm)} requests ...", file=sys.stderr, flush=True)
        asyncio.run(serve.run_load(args, url, model, warm, LoadShape(math.inf, 1)))


def run_points(args: argparse.Namespace, url: str, model: str, prompt_sets: list[list[Prompt]],
               axis: str, points: list[LoadShape]) -> list[dict[str, Any]]:
    """Every point in turn, each with its own prompts; arrivals keep ``args.seed``'s
    pattern, so that points differ in rate only."""
    bars = Progress(len(points), enabled=not args.quiet and sys.stderr.isatty())
    rows = []
    for i, (shape, prompts) in enumerate(zip(points, prompt_sets, strict=True)):
        x = point_x(axis, shape)
        with bars.point(f"{AXES[axis]} {x:g}", len(prompts)) as on_done:
            records, duration = asyncio.run(serve.run_load(args, url, model, prompts, shape, on_done))
        summary = serve.summarize(records, duration, args.slo)
        rows.append({"x": x, "request_rate": None if math.isinf(shape.rate) else shape.rate,
                     "max_concurrency": shape.concurrency, "prompt_seed": args.seed + i,
                     "summary": summary})
        if not args.quiet:
            bars.write(f"{AXES[axis]} {x:g}: {point_line(summary)}")
    bars.close()
    return rows


def point_x(axis: str, shape: LoadShape) -> float:
    return float(shape.concurrency) if axis == "concurrency" else shape.rate


def point_line(s: dict[str, Any]) -> str:
    ms = lambda d: "n/a" if d["median"] is None else f"{d['median']:.0f} ms"  # noqa: E731
    good = f", goodput {s['goodput']:.2f} req/s" if "goodput" in s else ""
    return (f"{s['completed']}/{s['completed'] + s['failed']} ok, {s['output_throughput']:.1f} tok/s, "
            f"TTFT p50 {ms(s['ttft_ms'])}, TPOT p50 {ms(s['tpot_ms'])}{good}")


def sweep_result(args: argparse.Namespace, model: str, label: str, axis: str,
                 rows: list[dict[str, Any]]) -> dict[str, Any]:
    skip = {"func", "api_key", "compare", "quiet", "output_dir", "label"}  # not the workload
    settings = {k: v for k, v in vars(args).items() if k not in skip}
    settings["model"] = model
    return {"format": sweep_plots.FORMAT, "label": label, "axis": axis, "settings": settings,
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version()},
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "points": rows,
            "best": best_goodput(rows)}


def best_goodput(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """The point with the most goodput (the lowest such x on a tie); None without SLOs."""
    scored = [(row["summary"]["goodput"], -row["x"]) for row in rows if "goodput" in row["summary"]]
    if not scored:
        return None
    goodput, neg_x = max(scored)
    return {"goodput": goodput, "x": -neg_x}


def format_table(result: dict[str, Any]) -> str:
    axis = AXES[result["axis"]]
    head = (f"{axis:>11} {'ok':>5} {'fail':>4} {'out tok/s':>9} {'tok/s/user':>10} "
            f"{'TTFT p50/p90/p99 ms':>21} {'TPOT p50/p90/p99 ms':>21} {'goodput':>8}")
    lines = [f" Sweep: {result['label']} ".center(len(head), "="), head]
    for row in result["points"]:
        s = row["summary"]
        tpot = s["tpot_ms"]["median"]
        lines.append(f"{row['x']:>11g} {s['completed']:>5} {s['failed']:>4} "
                     f"{s['output_throughput']:>9.1f} {_num(tpot and 1e3 / tpot, 1):>10} "
                     f"{_pcts(s['ttft_ms']):>21} {_pcts(s['tpot_ms']):>21} "
                     f"{_num(s.get('goodput'), 2):>8}")
    best = result["best"]
    slo = result["settings"]["slo"]
    if best is None:
        lines.append("no SLO given: no goodput")
    elif best["goodput"] == 0:
        lines.append(f"no request met every SLO ({_limits(slo)}) at any {axis}")
    else:
        lines.append(f"best goodput {best['goodput']:.2f} req/s at {axis} {best['x']:g} "
                     f"({_limits(slo)})")
    return "\n".join(lines + ["=" * len(head)])


def _limits(slo: dict[str, float]) -> str:
    return ", ".join(f"{k} <= {v:g} ms" for k, v in slo.items())


def _num(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _pcts(stats: dict[str, float | None]) -> str:
    return "/".join(_num(stats[k], 0) for k in ("median", "p90", "p99"))


# ---- progress ----------------------------------------------------------------------------

class Progress:
    """tqdm bars on stderr: one over the points, one over the current point's requests.
    Off with ``enabled=False`` (``--quiet``, stderr no terminal) or without tqdm."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._tqdm = _tqdm() if enabled else None
        self._outer = (self._tqdm(total=total, desc="sweep", unit="point", file=sys.stderr)
                       if self._tqdm else None)

    def point(self, desc: str, total: int) -> _PointBar:
        return _PointBar(self._tqdm, self._outer, desc, total)

    def write(self, line: str) -> None:
        if self._tqdm:
            self._tqdm.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._outer is not None:
            self._outer.close()


class _PointBar:
    def __init__(self, tqdm: Any, outer: Any, desc: str, total: int) -> None:
        self._bar = tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr) if tqdm else None
        self._outer = outer

    def __enter__(self) -> Callable[[Record], None] | None:
        return None if self._bar is None else (lambda record: self._bar.update(1))

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
            self._outer.update(1)


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # bars are a nicety: the sweep runs without them
        return None
    return tqdm
