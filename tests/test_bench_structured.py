"""``tandem bench structured`` end to end on a tiny model: it runs both modes at two
concurrencies with equal output lengths and reports the mask time (not how fast: speed is
for benchmarks, never tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_structured_reports_both_modes_at_each_concurrency(tiny_model_dir, tmp_path):
    out = tmp_path / "structured.json"
    run = subprocess.run(
        [sys.executable, "-m", "cli", "bench", "structured", "--model", str(tiny_model_dir),
         "--concurrency", "1", "3", "--max-tokens", "12", "--input-len", "8", "--rounds", "1",
         "--threads", "1", "--num-kv-blocks", "64", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [x["concurrency"] for x in r["results"]] == [1, 3]
    for x in r["results"]:
        assert x["plain_tpot_ms"] > 0 and x["json_tpot_ms"] > 0 and x["mask_ms_per_step"] > 0
    assert "json_schema" in run.stdout and r["first_constrained_request_s"] > 0
