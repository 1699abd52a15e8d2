"""`tandem generate` as a user runs it: a real process, JSONL in, JSONL out, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def tandem(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=Path(__file__).parent.parent)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_default_model_needs_no_flags(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"messages": [{"role": "user", "content": "What is the capital of France?"}],
         "max_tokens": 12, "temperature": 0},
    ])
    out = tmp_path / "o.jsonl"
    proc = tandem("generate", "--prompts", str(prompts), "--out", str(out), "--num-kv-blocks", "64")
    assert proc.returncode == 0, proc.stderr
    [row] = read_jsonl(out)
    assert "Paris" in row["text"]
    assert row["finish_reason"] in ("stop", "length") and row["token_ids"]


def test_every_input_form_and_field(tmp_path, tiny_model_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0},
        {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "logprobs": 2},
        {"prompt_token_ids": [10, 20, 30], "max_tokens": 6, "n": 3, "seed": 1, "ignore_eos": True},
        {"prompt_token_ids": [10, 20, 30], "max_tokens": 3, "temperature": 0, "ignore_eos": True},
    ])
    out = tmp_path / "o.jsonl"
    proc = tandem("generate", "--model", str(tiny_model_dir), "--prompts", str(prompts),
                  "--out", str(out), "--num-kv-blocks", "64")
    assert proc.returncode == 0, proc.stderr
    rows = read_jsonl(out)
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert len(rows[0]["token_ids"]) <= 5 and isinstance(rows[0]["text"], str)
    lps = rows[1]["logprobs"]
    assert len(lps) == len(rows[1]["token_ids"]) and len(lps[0]["top_logprobs"]) == 2
    assert [lp["token_id"] for lp in lps] == rows[1]["token_ids"]
    assert [c["index"] for c in rows[2]["choices"]] == [0, 1, 2]
    assert all(len(c["token_ids"]) == 6 and c["finish_reason"] == "length" for c in rows[2]["choices"])
    assert rows[3]["finish_reason"] == "length" and len(rows[3]["token_ids"]) == 3
    assert rows[3]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 0}


def test_bad_lines_are_reported_and_the_rest_still_runs(tmp_path, tiny_model_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 2, "ignore_eos": True},
        "{not json",
        {"prompt_token_ids": list(range(100, 200)), "max_tokens": 2},  # longer than the limit
        {"prompt": "x", "temperature": -1},
        {"max_tokens": 3},
        {"prompt_token_ids": [5, 99999999]},
        {"prompt_token_ids": [8, 9], "max_tokens": 2, "ignore_eos": True},
    ])
    out = tmp_path / "o.jsonl"
    proc = tandem("generate", "--model", str(tiny_model_dir), "--prompts", str(prompts),
                  "--out", str(out), "--max-model-len", "64", "--num-kv-blocks", "16")
    assert proc.returncode == 1
    rows = read_jsonl(out)
    assert [("error" in r) for r in rows] == [False, True, True, True, True, True, False]
    assert "invalid JSON" in rows[1]["error"]
    assert "maximum context length is 64" in rows[2]["error"]
    assert "temperature" in rows[3]["error"]
    assert "prompt" in rows[4]["error"]
    assert "token ids" in rows[5]["error"]
    assert len(rows[6]["token_ids"]) == 2
    errors = [line for line in proc.stderr.splitlines() if "line " in line and "tandem generate" in line]
    assert [e.split(": ")[2] for e in errors] == ["line 2", "line 3", "line 4", "line 5", "line 6"]


def test_the_gateways_message_shapes_work_here_too(tmp_path, tiny_model_dir):
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}], **greedy},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], **greedy},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"prompt": [10, 20, 30], **greedy},  # /v1/completions' token-id prompt
        {"prompt_token_ids": [10, 20, 30], **greedy},
        "[" * 100_000,  # a line the JSON parser cannot nest that deep: an error, not a crash
    ])
    out = tmp_path / "o.jsonl"
    proc = tandem("generate", "--model", str(tiny_model_dir), "--prompts", str(prompts),
                  "--out", str(out), "--num-kv-blocks", "64")
    assert proc.returncode == 1, proc.stderr
    rows = read_jsonl(out)
    assert [("error" in r) for r in rows] == [False, False, True, False, False, True]
    # One text part is the same prompt as the plain string, so greedy gives the same tokens.
    assert rows[1]["token_ids"] == rows[0]["token_ids"] and len(rows[0]["token_ids"]) == 4
    assert rows[1]["usage"]["prompt_tokens"] == rows[0]["usage"]["prompt_tokens"]
    assert "image_url" in rows[2]["error"] and "not supported" in rows[2]["error"]
    assert rows[3]["token_ids"] == rows[4]["token_ids"] and rows[3]["usage"]["prompt_tokens"] == 3
    assert "invalid JSON" in rows[5]["error"]


@pytest.mark.parametrize("setup,expected", [
    ("missing", "does not exist"),
    ("gpt2", "unsupported architecture GPT2LMHeadModel"),
    ("flag", "--max-model-len 100000 exceeds"),
])
def test_startup_errors_are_one_line(tmp_path, tiny_model_dir, setup, expected):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    model, extra = str(tiny_model_dir), []
    if setup == "missing":
        model = str(tmp_path / "no-such-model")
    elif setup == "gpt2":
        (tmp_path / "gpt2").mkdir()
        (tmp_path / "gpt2" / "config.json").write_text(json.dumps(
            {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
        model = str(tmp_path / "gpt2")
    else:
        extra = ["--max-model-len", "100000"]
    proc = tandem("generate", "--model", model, "--prompts", str(prompts),
                  "--out", str(tmp_path / "o.jsonl"), *extra)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr
