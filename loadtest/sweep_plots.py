"""The plots of ``tandem bench sweep`` and ``tandem bench plot`` (overlay earlier sweeps).

This module owns turning sweep JSONs (``loadtest/sweep.py``) into four PNGs, one series
per JSON (e.g. P/D and colocated on one figure): the Pareto view (output tok/s against
per-user tok/s = 1000 / TPOT p50), TTFT and TPOT p50/p90/p99 against the sweep's axis, and
goodput against it. matplotlib draws off-screen (its ``Figure`` with the Agg canvas, no
pyplot state, no display); without matplotlib the JSON stands and a line says what to install.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

KINDS = ("pareto", "ttft", "tpot", "goodput")
FORMAT = "tandem-bench-sweep/1"
INSTALL_HINT = ("matplotlib is not installed, so no plots were drawn (the JSON is written): "
                "install the bench extra with `.venv/bin/pip install -e '.[bench]'` (./setup.sh "
                "does), then draw them with `tandem bench plot SWEEP.json ...`")
AXIS_TITLES = {"request_rate": "request rate (req/s, Poisson arrivals)",
               "concurrency": "concurrency (requests in flight)"}
PERCENTILES = (("median", "p50", "-"), ("p90", "p90", "--"), ("p99", "p99", ":"))
SIZE_IN, DPI = (8.0, 5.0), 100


# ---- the command -------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweeps", nargs="+", metavar="JSON", help="sweep JSONs, one series each")
    p.add_argument("--output-dir", default="bench-sweep", help="where the PNGs go")
    p.add_argument("--name", default="compare", help="file-name stem: NAME-pareto.png, ...")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    series = load_series(args.sweeps)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return 0 if write_plots(series, out, args.name) else 1


def load_series(paths: list[str]) -> list[dict[str, Any]]:
    """Each file's sweep; ValueError for a file that is not one."""
    series = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path} is not a `tandem bench sweep` JSON ({FORMAT})")
        series.append(data)
    return series


def write_plots(series: list[dict[str, Any]], directory: Path, stem: str) -> list[Path] | None:
    """Draw every kind to ``directory/stem-KIND.png``; None (and the install hint on
    stderr) when matplotlib is missing."""
    try:
        figs = figures(series)
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return None
    paths = []
    for kind, fig in figs.items():
        paths.append(directory / f"{stem}-{kind}.png")
        fig.savefig(paths[-1])
    print("plots: " + " ".join(str(p) for p in paths))
    return paths


# ---- the figures -------------------------------------------------------------------------

def figures(series: list[dict[str, Any]]) -> dict[str, Any]:
    """One matplotlib Figure per kind, every series on each; ValueError when the series
    lie on different axes (a rate sweep and a concurrency sweep do not share an x)."""
    from matplotlib.figure import Figure

    axes = {s["axis"] for s in series}
    if len(axes) != 1:
        raise ValueError(f"cannot overlay sweeps over different axes: {sorted(axes)}")
    figs = {kind: Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained") for kind in KINDS}
    workload = " vs ".join(dict.fromkeys(describe(s["settings"]) for s in series))
    _pareto(figs["pareto"].add_subplot(), series, workload)
    for metric in ("ttft", "tpot"):
        _latency(figs[metric].add_subplot(), series, metric, workload)
    _goodput(figs["goodput"].add_subplot(), series, workload)
    return figs


def describe(settings: dict[str, Any]) -> str:
    """The workload in a few words, for titles."""
    s, dataset = settings, settings["dataset"]
    if dataset == "shared-prefix":
        prompt = f"{s['num_prefixes']}×{s['prefix_len']} shared + {s['input_len']}"
    elif dataset == "mixed":
        prompt = f"{s['input_len']} ({s['long_fraction']:.0%} at {s['long_len']})"
    else:
        prompt = f"{s['input_len']}"
    return f"{dataset}: {prompt} in, {s['output_len']} out, {s['num_prompts']} req/point"


def _xs(s: dict[str, Any]) -> list[float]:
    return [p["x"] for p in s["points"]]


def _x_axis(ax: Any, series: list[dict[str, Any]]) -> None:
    xs = sorted({x for s in series for x in _xs(s)})
    if xs[-1] / xs[0] >= 4:  # a geometric sweep (0.25, 0.5, 1, 2): even spacing on log2
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.minorticks_off()
    ax.set_xlabel(AXIS_TITLES[series[0]["axis"]])
    ax.grid(True, alpha=0.3)


def _pareto(ax: Any, series: list[dict[str, Any]], workload: str) -> None:
    unit = "/s" if series[0]["axis"] == "request_rate" else " in flight"
    for i, s in enumerate(series):
        pts = [(1e3 / p["summary"]["tpot_ms"]["median"], p["summary"]["output_throughput"], p["x"])
               for p in s["points"] if p["summary"]["tpot_ms"]["median"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i}", label=s["label"])
        for user, total, x in pts:
            ax.annotate(f"{x:g}{unit}", (user, total), textcoords="offset points",
                        xytext=(5, 5), fontsize=8, color=f"C{i}")
    ax.set_xlabel("per-user decode speed (tok/s = 1000 / TPOT p50)")
    ax.set_ylabel("output throughput (tok/s, all users)")
    ax.set_title(f"Throughput vs per-user speed (up-right is better)\n{workload}")
    ax.set_xlim(left=0, right=ax.get_xlim()[1] * 1.08)  # room for the last point's note
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.05)
    ax.grid(True, alpha=0.3)
    ax.legend()


def _latency(ax: Any, series: list[dict[str, Any]], metric: str, workload: str) -> None:
    for i, s in enumerate(series):
        for key, name, style in PERCENTILES:
            values = [p["summary"][f"{metric}_ms"][key] for p in s["points"]]
            ax.plot(_xs(s), values, style, marker="o", color=f"C{i}", label=f"{s['label']} {name}")
    values = [p["summary"][f"{metric}_ms"][key] for s in series for p in s["points"]
              for key, _, _ in PERCENTILES]
    _y_range(ax, [v for v in values if v], series[0]["settings"]["slo"].get(metric))
    _x_axis(ax, series)
    ax.set_ylabel(f"{metric.upper()} (ms)")
    what = "time to first token" if metric == "ttft" else "time per output token"
    ax.set_title(f"{metric.upper()} ({what}) p50 / p90 / p99\n{workload}")
    ax.legend(fontsize=8, ncols=len(series))


def _y_range(ax: Any, values: list[float], slo: float | None) -> None:
    """Latencies past saturation grow by orders of magnitude: log scale when they span
    over 30x, else linear from 0. The SLO is a line when near the data, else a legend note
    (a far-off line would flatten every curve)."""
    if not values:
        return
    low, high = min(values), max(values)
    log = high / low > 30
    if log:
        ax.set_yscale("log")
    near = slo is not None and slo <= 3 * high
    if near:
        ax.axhline(slo, color="red", linewidth=1, alpha=0.6, label=f"SLO {slo:g} ms")
        high = max(high, slo)
    elif slo is not None:
        ax.plot([], [], color="red", linewidth=1, alpha=0.6, label=f"SLO {slo:g} ms (above)")
    ax.set_ylim(low / 1.5 if log else 0, high * (1.5 if log else 1.1))


def _goodput(ax: Any, series: list[dict[str, Any]], workload: str) -> None:
    for i, s in enumerate(series):
        xs = _xs(s)
        # wide and pale, so that it shows beneath goodput where every request met the SLOs
        ax.plot(xs, [p["summary"]["request_throughput"] for p in s["points"]], "-",
                color=f"C{i}", alpha=0.25, linewidth=6, label=f"{s['label']} completed")
        best = s["best"]
        if best is not None:
            note = (f"best {best['goodput']:.2f} at {best['x']:g}" if best["goodput"]
                    else "no request met the SLOs")
            ax.plot(xs, [p["summary"]["goodput"] for p in s["points"]], "o-", color=f"C{i}",
                    label=f"{s['label']} goodput ({note})")
            if best["goodput"]:
                ax.plot([best["x"]], [best["goodput"]], "*", color=f"C{i}", markersize=14)
    if series[0]["axis"] == "request_rate":
        xs = sorted({x for s in series for x in _xs(s)})
        ax.plot(xs, xs, ":", color="gray", label="offered load")
    _x_axis(ax, series)
    ax.set_ylabel("requests/s")
    ax.set_title(f"Goodput (requests/s meeting {_slo_text(series)})\n{workload}")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)


def _slo_text(series: list[dict[str, Any]]) -> str:
    slos = [s["settings"]["slo"] for s in series]
    text = ", ".join(f"{k.upper()} ≤ {v:g} ms" for k, v in slos[0].items()) or "no SLO: all completed"
    return text if all(slo == slos[0] for slo in slos) else text + "; SLOs differ"
