"""``tandem bench gateway``: a real gateway process streams every token the fake router
pushes, back to back and paced, and the benchmark reports each stream."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtest.gateway_stream import bench


def test_every_pushed_token_reaches_the_client_as_a_chunk(tiny_model_dir: Path):
    streams = bench(tokens=40, paces_ms=[0.0, 1.0], rounds=1, model=str(tiny_model_dir))
    assert [(s.pace_ms, s.tokens, s.chunks) for s in streams] == [(0.0, 40, 40), (1.0, 40, 40)]
    assert all(s.cpu_ms_per_token >= 0 and s.wall_ms_per_token > 0 for s in streams)


def test_the_command_writes_its_json(tiny_model_dir: Path, tmp_path: Path):
    out = tmp_path / "gateway.json"
    done = subprocess.run([sys.executable, "-m", "cli", "bench", "gateway", "--tokens", "8",
                           "--pace-ms", "0", "--rounds", "1", "--model", str(tiny_model_dir),
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "| 0 | 8 | 8 |" in done.stdout
    assert [s["chunks"] for s in json.loads(out.read_text())] == [8]


def test_bad_arguments_are_refused():
    done = subprocess.run([sys.executable, "-m", "cli", "bench", "gateway", "--tokens", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--tokens" in done.stderr
