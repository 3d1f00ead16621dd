#!/usr/bin/env bash
# Server overhead on the CPU: `kimi-infer serve` under the openai-client load generator
# against the same engine offline (`kimi-infer bench --batch B`, no HTTP), on the same
# cores, same prompt and output lengths. The server and the offline engine share
# SERVER_CORES; the client runs on CLIENT_CORES so it does not take the engine's time.
#
#   bench/serve_overhead_cpu.sh OUT_DIR [MODEL_ARGS...]
# e.g. bench/serve_overhead_cpu.sh /tmp/so --model models/SmolLM2-135M-Instruct.Q4_1.gguf
# Environment: SERVER_CORES (default 0), CLIENT_CORES (default 1), THREADS (1),
# PY (python with `openai`; default target/openai-venv/bin/python), BIN (target/release/kimi-infer).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: serve_overhead_cpu.sh OUT_DIR [MODEL_ARGS...]}"
shift
SERVER_CORES="${SERVER_CORES:-0}" CLIENT_CORES="${CLIENT_CORES:-1}" THREADS="${THREADS:-1}"
PY="${PY:-target/openai-venv/bin/python}" BIN="${BIN:-target/release/kimi-infer}"
PORT="${PORT:-8013}" PROMPT="${PROMPT:-64}" GEN="${GEN:-32}" REQS="${REQS:-64}"
# The model's vocabulary size, so that the prompts are `kimi-infer bench`'s token ids
# (SmolLM2-135M: 49152).
VOCAB="${VOCAB:-49152}"
mkdir -p "$OUT"
# The offline engine (`bench --batch B`) schedules at most 2 × PROMPT tokens per step; the
# server gets the same budget so that both run the same steps.
taskset -c "$SERVER_CORES" "$BIN" serve "$@" --threads "$THREADS" --port "$PORT" \
  --max-num-seqs 64 --max-num-batched-tokens $((2 * PROMPT)) > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do curl -sf "localhost:$PORT/health" >/dev/null 2>&1 && break; sleep 1; done
taskset -c "$CLIENT_CORES" "$PY" bench/serve_load.py --base-url "http://127.0.0.1:$PORT/v1" \
  --concurrency 1 16 64 --num-requests "$REQS" --max-tokens "$GEN" --prompt-ids "$PROMPT" \
  --vocab "$VOCAB" --json "$OUT/serve.json" 2>&1 | tail -12 | tee "$OUT/serve.txt"
kill -TERM $SERVER; wait $SERVER || true
trap - EXIT
for b in 1 16 64; do
  taskset -c "$SERVER_CORES" "$BIN" bench "$@" --threads "$THREADS" --prompt-len "$PROMPT" \
    --gen-len "$GEN" --repeats 3 --batch "$b" --json "$OUT/offline-$b.json" 2>&1 \
    | grep -iE "batch|throughput|tokens/s" | tee -a "$OUT/offline.txt"
done
"$PY" - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
levels = json.load(open(os.path.join(out, "serve.json")))["levels"]
print("concurrency  server tok/s  offline tok/s  server/offline")
for lvl in levels:
    c = lvl["concurrency"]
    path = os.path.join(out, f"offline-{c}.json")
    if not os.path.exists(path):
        continue
    o = json.load(open(path))["batch_output_tokens_per_sec"]
    s = lvl["output_tokens_per_sec"]
    print(f"{c:11d}  {s:12.1f}  {o:13.1f}  {s / o:14.3f}")
PY
