#!/usr/bin/env bash
# The serving comparison of the README: the peers' client (../shared/peers/bench_client.py)
# against several OpenAI-compatible servers, interleaved per workload, each workload on
# its own slice of the prompt file (so no server's prefix cache holds them from a rerun
# that starts at another OFF).
#   loadtest/serving_matrix.sh OUT "label|base-url|model" ...
#   e.g. OFF=240 loadtest/serving_matrix.sh /tmp/m "vllm|http://127.0.0.1:8002|smollm2" \
#          "colocated|http://127.0.0.1:8000|SmolLM2-135M-Instruct"
# Env: PY (a python with httpx and transformers, default the repo's .venv), PEERS (default
# ../shared/peers), PROMPTS (default OUT/prompts_512x256.json, made on first use by
# $PEERS/make_prompts.py with the default model's tokenizer: 512 prompts of 256 tokens),
# WORKLOADS (default c1 c16 rate), OFF (first prompt, default 16).
set -u
OUT=$1; shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${PEERS:-$ROOT/../shared/peers}
PY=${PY:-$ROOT/.venv/bin/python}; CLIENT=$PEERS/bench_client.py
mkdir -p "$OUT"; OFF=${OFF:-16}
PROMPTS=${PROMPTS:-$OUT/prompts_512x256.json}
if [ ! -f "$PROMPTS" ]; then
  TOKENIZER=$(cd "$ROOT" && HF_HUB_OFFLINE=1 $PY -c \
    'from common.model.loader import resolve_model; print(resolve_model(None).directory)')
  $PY "$PEERS/make_prompts.py" --tokenizer "$TOKENIZER" --num 512 --input-len 256 --out "$PROMPTS"
fi
for w in ${WORKLOADS:-c1 c16 rate}; do
  case $w in
    c1) n=8; args="--num 8 --concurrency 1";;
    c16) n=64; args="--num 64 --concurrency 16";;
    rate) n=32; args="--num 32 --concurrency 64 --request-rate 0.5";;
    *) echo "unknown workload $w" >&2; exit 2;;
  esac
  for spec in "$@"; do
    IFS='|' read -r label url model <<< "$spec"
    echo "=== $w $label $(date +%T)"
    $PY "$CLIENT" --base-url "$url" --model "$model" --prompts "$PROMPTS" --max-tokens 128 $args \
      --offset "$OFF" --extra-body '{"ignore_eos": true}' --label "$label/$w" \
      --json-out "$OUT/${label}_${w}.json" \
      | python3 -c 'import json,sys; d=json.load(sys.stdin); print("  out_tok/s %.1f  ttft_p50 %.0f ms  tpot_p50 %.1f ms  tpot_p99 %.1f  wall %.1fs" % (d["out_tok_per_s"], d["ttft_ms_p50"], d["tpot_ms_p50"], d["tpot_ms_p99"], d["wall_s"]))'
  done
  OFF=$((OFF + n))
done
