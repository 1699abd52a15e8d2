#!/usr/bin/env bash
# Soak: locust at moderate load against `tandem up` for DURATION seconds, with one worker
# killed (SIGKILL) every KILL_EVERY seconds, in turn; the launcher restarts it and its
# requests move to the surviving workers. Prints RSS per service at the start and the end
# and locust's totals. Not part of CI (it runs for minutes); stops by itself.
#   loadtest/soak.sh [OUT]      env: DURATION (600), KILL_EVERY (120), USERS (4),
#                               MODEL (default model), PORT (8010), MAX_TOKENS (64)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/soak-out}; mkdir -p "$OUT"
PY=$ROOT/.venv/bin/python
DURATION=${DURATION:-600}; KILL_EVERY=${KILL_EVERY:-120}; USERS=${USERS:-4}; PORT=${PORT:-8010}
MODEL_FLAG=(); [ -n "${MODEL:-}" ] && MODEL_FLAG=(--model "$MODEL")

cd "$ROOT"
$PY -m cli up --prefill 1 --decode 2 --port "$PORT" "${MODEL_FLAG[@]}" > "$OUT/cluster.log" 2>&1 &
LAUNCHER=$!
trap 'kill -TERM $LAUNCHER 2>/dev/null; wait $LAUNCHER 2>/dev/null || true' EXIT
until grep -q "ready: OpenAI API" "$OUT/cluster.log"; do
  kill -0 $LAUNCHER 2>/dev/null || { echo "cluster failed to start"; cat "$OUT/cluster.log"; exit 1; }
  sleep 1
done

rss() {  # one line per service: name pid rss_mb
  $PY - "$LAUNCHER" <<'PY'
import sys, psutil
for child in psutil.Process(int(sys.argv[1])).children():
    cmd = child.cmdline()
    name = next((c for c in cmd if c.startswith(("decode-", "prefill-"))), None) or cmd[3]
    print(f"{name:10} {child.pid:7d} {child.memory_info().rss / 2**20:8.1f} MB")
PY
}
echo "== RSS at start"; rss | tee "$OUT/rss_start.txt"

TANDEM_LOCUST_MAX_TOKENS=${MAX_TOKENS:-64} .venv/bin/locust -f loadtest/locustfile.py --headless \
  -u "$USERS" -r 1 -t "${DURATION}s" --host "http://127.0.0.1:$PORT" --csv "$OUT/locust" \
  --only-summary > "$OUT/locust.log" 2>&1 &
LOCUST=$!

victims=(decode-0 prefill-0 decode-1)
i=0; elapsed=0
while kill -0 $LOCUST 2>/dev/null && [ $((elapsed + KILL_EVERY)) -lt "$DURATION" ]; do
  sleep "$KILL_EVERY"; elapsed=$((elapsed + KILL_EVERY))
  v=${victims[$((i % 3))]}; i=$((i + 1))
  pid=$(pgrep -f -- "--worker-id $v" | head -1 || true)
  [ -n "$pid" ] && { echo "== $(date +%T) kill -9 $v (pid $pid)"; kill -9 "$pid"; }
done
wait $LOCUST || true
echo "== RSS at end"; rss | tee "$OUT/rss_end.txt"
echo "== locust totals (Aggregated)"; grep -E "^(Type|,|GET|POST|SSE).*|Aggregated" "$OUT/locust_stats.csv" | tail -4
echo "== failures"; cat "$OUT/locust_failures.csv" 2>/dev/null | head -20
grep -E "restarting|healthy again|moved to another worker" "$OUT/cluster.log" | tail -20
