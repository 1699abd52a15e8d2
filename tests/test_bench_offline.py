"""``tandem bench offline`` end to end on a tiny model (HF skipped): it runs, and reports
the fractions of the machine's limits it is meant to (not how fast: speed is for
benchmarks, never tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_offline_reports_fma_peak_and_bandwidth_fractions(tiny_model_dir, tmp_path):
    out = tmp_path / "offline.json"
    run = subprocess.run(
        [sys.executable, "-m", "cli", "bench", "offline", "--model", str(tiny_model_dir),
         "--num-prompts", "2", "--input-len", "16", "--output-len", "8", "--batch1-tokens", "4",
         "--skip-hf", "--threads", "1", "--num-kv-blocks", "64", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["fma_peak_gflops"] > 0 and r["fraction_of_fma_peak"] > 0
    assert r["batch1_bytes_per_token"] > 0 and r["batch1_bandwidth_limit_ms"] > 0
    assert "machine's FMA peak" in run.stdout and "MB read per token" in run.stdout
