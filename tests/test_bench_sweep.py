"""``tandem bench sweep`` and ``tandem bench plot`` (loadtest/sweep.py, sweep_plots.py).

End to end: a real colocated cluster with the tiny model, a sweep over two rates with a
handful of requests; its JSON's numbers agree with each other, its PNGs are real images,
and an overlay draws both series. The SLOs are chosen so that the outcome is exact, not
timing-dependent: one minute (every request meets it) or one microsecond (none can).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import pytest
from matplotlib import image

from cli.main import main
from loadtest import sweep, sweep_plots
from tests.cluster import Cluster, wait_for

RATES = [4.0, 16.0]
N, IN_LEN, OUT_LEN = 6, 24, 8
EASY, IMPOSSIBLE = "ttft:60000,tpot:60000", "ttft:0.001"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with Cluster(str(tiny_model_dir), prefill=0, decode=0, colocated=1) as c:
        yield c


def run_sweep(cluster: Cluster, tokenizer: Path, out: Path, label: str, slo: str,
              *extra: str, rates: list[float] = RATES) -> Path:
    argv = ["bench", "sweep", "--base-url", cluster.url, "--tokenizer", str(tokenizer),
            "--num-prompts", str(N), "--input-len", str(IN_LEN), "--output-len", str(OUT_LEN),
            "--request-rates", ",".join(f"{r:g}" for r in rates), "--slo", slo,
            "--extra-body", '{"ignore_eos": true}', "--label", label, "--output-dir", str(out),
            "--quiet", *extra]
    assert main(argv) == 0
    return out / f"sweep-{sweep.slug(label)}.json"


def served(cluster: Cluster) -> float:
    return cluster.metric(cluster.child("gateway"), "tandem:request_success_total")


@pytest.fixture(scope="module")
def easy(cluster, tiny_model_dir, tmp_path_factory) -> Path:
    before = served(cluster)
    path = run_sweep(cluster, tiny_model_dir, tmp_path_factory.mktemp("easy"), "P/D", EASY)
    # every point's requests, plus one unmeasured warm-up (one prompt length, one round)
    wait_for(lambda: served(cluster) - before == len(RATES) * N + 1, "the gateway's count")
    # each point (and the warm-up) sends its own text: no point rides an earlier one's cache
    assert cluster.workers_total("tandem:prefix_cache_hits_total") == 0
    return path


def test_json_has_every_point_with_consistent_numbers(easy: Path) -> None:
    result = json.loads(easy.read_text())
    assert (result["format"], result["label"], result["axis"]) == (sweep_plots.FORMAT, "P/D", "request_rate")
    assert result["machine"]["cpu_count"] == os.cpu_count()
    assert result["settings"]["slo"] == {"ttft": 60000.0, "tpot": 60000.0}
    assert result["settings"]["num_prompts"] == N and result["settings"]["model"]
    assert [p["x"] for p in result["points"]] == RATES
    assert [p["request_rate"] for p in result["points"]] == RATES
    assert [p["prompt_seed"] for p in result["points"]] == [0, 1]
    for point in result["points"]:
        s = point["summary"]
        assert (s["completed"], s["failed"], s["good_requests"]) == (N, 0, N)
        assert (s["total_input_tokens"], s["total_output_tokens"]) == (N * IN_LEN, N * OUT_LEN)
        assert s["request_throughput"] == pytest.approx(N / s["duration_s"])
        assert s["goodput"] == pytest.approx(s["request_throughput"])  # every request was good
        assert s["goodput"] <= s["request_throughput"]
        for metric in ("ttft_ms", "tpot_ms"):
            assert 0 < s[metric]["median"] <= s[metric]["p90"] <= s[metric]["p99"]
    best = max(result["points"], key=lambda p: p["summary"]["goodput"])
    assert result["best"] == {"goodput": best["summary"]["goodput"], "x": best["x"]}


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = image.imread(path)
    width, height = (round(v * sweep_plots.DPI) for v in sweep_plots.SIZE_IN)
    assert pixels.shape == (height, width, 4)
    assert pixels[..., :3].std() > 0.05  # drawn on, not a blank canvas


def test_pngs_are_real_images(easy: Path) -> None:
    for kind in sweep_plots.KINDS:
        assert_png(easy.parent / f"sweep-p-d-{kind}.png")


def legend_labels(fig) -> list[str]:
    [ax] = fig.axes
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_compare_overlays_two_series(cluster, tiny_model_dir, easy: Path, tmp_path: Path) -> None:
    path = run_sweep(cluster, tiny_model_dir, tmp_path, "colocated", IMPOSSIBLE,
                     "--compare", str(easy))
    tight = json.loads(path.read_text())
    assert [p["summary"]["good_requests"] for p in tight["points"]] == [0, 0]
    assert tight["best"] == {"goodput": 0.0, "x": RATES[0]}  # a tie: the lowest rate
    figs = sweep_plots.figures(sweep_plots.load_series([str(path), str(easy)]))
    assert legend_labels(figs["pareto"]) == ["colocated", "P/D"]
    assert [t.split()[0] for t in legend_labels(figs["ttft"])] == ["colocated"] * 3 + ["P/D"] * 3 + ["SLO"]
    best = json.loads(easy.read_text())["best"]
    assert [t for t in legend_labels(figs["goodput"]) if "goodput" in t] == [
        "colocated goodput (no request met the SLOs)", f"P/D goodput (best {best['goodput']:.2f} at {best['x']:g})"]
    for kind in sweep_plots.KINDS:
        assert_png(tmp_path / f"sweep-colocated-{kind}.png")


def test_plot_command_overlays_saved_sweeps(easy: Path, tmp_path: Path) -> None:
    other = json.loads(easy.read_text()) | {"label": "again"}
    (tmp_path / "again.json").write_text(json.dumps(other))
    assert main(["bench", "plot", str(easy), str(tmp_path / "again.json"),
                 "--output-dir", str(tmp_path / "cmp")]) == 0
    for kind in sweep_plots.KINDS:
        assert_png(tmp_path / "cmp" / f"compare-{kind}.png")


def test_without_matplotlib_the_json_is_still_written(cluster, tiny_model_dir, tmp_path: Path,
                                                      monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    path = run_sweep(cluster, tiny_model_dir, tmp_path, "bare", EASY, rates=[16.0])
    assert json.loads(path.read_text())["points"][0]["summary"]["completed"] == N
    assert not list(tmp_path.glob("*.png"))
    assert ".[bench]" in capsys.readouterr().err


# ---- pure parts --------------------------------------------------------------------------

def test_point_lists() -> None:
    assert sweep.positive_list("0.25, 0.5,1,2") == [0.25, 0.5, 1.0, 2.0]
    assert sweep.positive_ints("1,4,16") == [1, 4, 16]
    for bad in ("", "1,x", "0,1", "-1", "inf", "2,1", "1,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            sweep.positive_list(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        sweep.positive_ints("1,2.5")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_pick_one_axis() -> None:
    axis, shapes = sweep.shapes(_args("--request-rates", "1,2", "--max-concurrency", "3"))
    assert axis == "request_rate"
    assert [(s.rate, s.concurrency) for s in shapes] == [(1.0, 3), (2.0, 3)]
    axis, shapes = sweep.shapes(_args("--concurrencies", "1,4"))
    assert axis == "concurrency" and [s.concurrency for s in shapes] == [1, 4]
    assert _args("--concurrencies", "1").slo == {"ttft": 2000.0, "tpot": 100.0}
    for argv in ((), ("--request-rates", "1", "--concurrencies", "1")):
        with pytest.raises(SystemExit):
            _args(*argv)
    assert sweep.slug("P/D") == "p-d" and sweep.slug("//") == "sweep"


def test_overlay_refuses_different_axes(easy: Path) -> None:
    rates = json.loads(easy.read_text())
    closed = copy.deepcopy(rates) | {"axis": "concurrency"}
    with pytest.raises(ValueError, match="different axes"):
        sweep_plots.figures([rates, closed])
    (easy.parent / "not-a-sweep.json").write_text("{}")
    with pytest.raises(ValueError, match="not a `tandem bench sweep` JSON"):
        sweep_plots.load_series([str(easy.parent / "not-a-sweep.json")])
