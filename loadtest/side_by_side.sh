#!/usr/bin/env bash
# The README's benchmark run in one go, peers and Tandem side by side on this machine:
#   1. offline: vLLM-CPU (the peers' vllm_offline_bench.py), `tandem bench offline` (with HF
#      transformers), vLLM again (A-B-A: the machine drifts);
#   2. serving: vLLM's OpenAI server, llama.cpp's llama-server and `tandem up --colocated 1`
#      started together (idle while another is measured), then loadtest/serving_matrix.sh.
# Everything it starts is stopped on exit. Set up the peers first as
# ../shared/peers/README.md says (a venv with vLLM-CPU, one with transformers + httpx, the
# fp32 HF copy of the GGUF, the prompt file, a native llama-server build).
#   VLLM_PY=$PEERS/vllm/bin/python HF_PY=$PEERS/hf/bin/python HF_MODEL=$PEERS/smollm2-hf \
#   PROMPTS=$PEERS/prompts_512x256.json LLAMA_SERVER=$PEERS/bin/llama-server \
#   loadtest/side_by_side.sh OUT
# Env: GGUF (default: the default model's file), STEPS (default "offline serving").
set -u
OUT=${1:?usage: loadtest/side_by_side.sh OUT}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS_DIR=${PEERS:-$ROOT/../shared/peers}
: "${VLLM_PY:?} ${HF_PY:?} ${HF_MODEL:?} ${PROMPTS:?} ${LLAMA_SERVER:?}"
GGUF=${GGUF:-$(cd "$ROOT" && .venv/bin/python -c \
  'from common.model.loader import resolve_model; print(resolve_model(None).gguf)')}
mkdir -p "$OUT"
VLLM_ENV=(VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
          OMP_NUM_THREADS=2)
pids=()
trap 'for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null; done; wait' EXIT

vllm_offline() {
  (cd "$PEERS_DIR" && env "${VLLM_ENV[@]}" "$VLLM_PY" vllm_offline_bench.py --model "$HF_MODEL" \
     --dtype float32 --prompts "$PROMPTS" --num 64 --offset 300 --max-tokens 128) > "$OUT/$1.log" 2>&1
  echo "  $(grep -o '"out_tok_per_s": [0-9.]*' "$OUT/$1.log")"
}

ready() {  # url → 0 once it answers 200
  for _ in $(seq 200); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$1")" = 200 ] && return 0; sleep 3
  done
  echo "no answer from $1" >&2; return 1
}

for step in ${STEPS:-offline serving}; do
  case $step in
    offline)
      echo "=== vLLM offline $(date +%T)"; vllm_offline vllm_offline_1
      echo "=== tandem bench offline $(date +%T)"
      (cd "$ROOT" && .venv/bin/tandem bench offline --json "$OUT/tandem_offline.json") \
        > "$OUT/tandem_offline.log" 2>&1
      grep -E "^(tandem|hf transformers|ratio|compute limit| {10,}[0-9]|batch-1)" "$OUT/tandem_offline.log"
      echo "=== vLLM offline again $(date +%T)"; vllm_offline vllm_offline_2 ;;
    serving)
      echo "=== starting the servers $(date +%T)"
      (cd "$PEERS_DIR" && exec env "${VLLM_ENV[@]}" "$VLLM_PY" -m vllm.entrypoints.openai.api_server \
         --model "$HF_MODEL" --served-model-name smollm2 --host 127.0.0.1 --port 8002 \
         --max-model-len 2048 --dtype float32) > "$OUT/vllm_server.log" 2>&1 & pids+=($!)
      "$LLAMA_SERVER" -m "$GGUF" -a smollm2 --host 127.0.0.1 --port 8003 -t 2 -tb 2 -np 32 -c 16384 \
        -b 2048 -ub 512 --no-webui > "$OUT/llama_server.log" 2>&1 & pids+=($!)
      (cd "$ROOT" && exec .venv/bin/tandem up --colocated 1) > "$OUT/tandem_up.log" 2>&1 & pids+=($!)
      ready http://127.0.0.1:8002/v1/models && ready http://127.0.0.1:8003/v1/models \
        && ready http://127.0.0.1:8000/v1/models || exit 1
      for _ in $(seq 100); do  # the gateway answers before its worker has registered
        curl -s http://127.0.0.1:8000/ready | grep -q '"decode_workers":[1-9]' && break; sleep 3
      done
      echo "=== serving matrix $(date +%T)"
      PY=$HF_PY PROMPTS=$PROMPTS OFF=240 PEERS=$PEERS_DIR "$ROOT/loadtest/serving_matrix.sh" "$OUT/matrix" \
        "vllm|http://127.0.0.1:8002|smollm2" "llama-server|http://127.0.0.1:8003|smollm2" \
        "tandem|http://127.0.0.1:8000|SmolLM2-135M-Instruct" ;;
    *) echo "unknown step $step (offline, serving)" >&2; exit 2 ;;
  esac
done
echo "=== done $(date +%T)"
