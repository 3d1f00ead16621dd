#!/usr/bin/env bash
# Gateway overhead: the same streamed requests sent to a `kimi-infer serve` replica directly
# and through `kimi-infer gateway` in front of it, alternating, ROUNDS times each:
#   latency    concurrency 1, LAT_REQS requests: TTFT and end-to-end p50 / p99
#   throughput concurrency 64, TPUT_REQS requests: output tokens/s
# bench/serve_load.py (raw client: pre-built JSON over httpx, SSE read by hand) sends them.
# The replica runs on REPLICA_CORES; the gateway and the client share FRONT_CORES.
#
#   bench/gateway_overhead.sh OUT_DIR [MODEL_ARGS...]
# e.g. bench/gateway_overhead.sh /tmp/gw --model models/SmolLM2-135M-Instruct.Q4_1.gguf
# (no MODEL_ARGS: `serve`'s default demo model). A small, fast model shows the gateway's
# share of the time best. Environment: REPLICA_CORES (0), FRONT_CORES (1), THREADS (1),
# ROUNDS (2), LAT_REQS (200), TPUT_REQS (256), GEN (16 output tokens),
# PY (python with `openai`; default target/openai-venv/bin/python), BIN (target/release/kimi-infer).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: gateway_overhead.sh OUT_DIR [MODEL_ARGS...]}"
shift
REPLICA_CORES="${REPLICA_CORES:-0}" FRONT_CORES="${FRONT_CORES:-1}" THREADS="${THREADS:-1}"
ROUNDS="${ROUNDS:-2}" LAT_REQS="${LAT_REQS:-200}" TPUT_REQS="${TPUT_REQS:-256}" GEN="${GEN:-16}"
PY="${PY:-target/openai-venv/bin/python}" BIN="${BIN:-target/release/kimi-infer}"
REPLICA_PORT="${REPLICA_PORT:-8021}" GATEWAY_PORT="${GATEWAY_PORT:-8022}"
mkdir -p "$OUT"
pids=()
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done' EXIT
wait_healthy() {
  for _ in $(seq 1 240); do curl -sf "localhost:$1/health" >/dev/null 2>&1 && return 0; sleep 0.5; done
  echo "nothing healthy on port $1" >&2; return 1
}
taskset -c "$REPLICA_CORES" "$BIN" serve "$@" --threads "$THREADS" --port "$REPLICA_PORT" \
  --max-num-seqs 64 --max-model-len 2048 > "$OUT/replica.log" 2>&1 &
pids+=($!)
wait_healthy "$REPLICA_PORT"
KIMI_LOG=warn taskset -c "$FRONT_CORES" "$BIN" gateway --port "$GATEWAY_PORT" \
  --upstream "http://127.0.0.1:$REPLICA_PORT" > "$OUT/gateway.log" 2>&1 &
pids+=($!)
wait_healthy "$GATEWAY_PORT"
load() { # NAME PORT CONCURRENCY REQUESTS
  taskset -c "$FRONT_CORES" "$PY" bench/serve_load.py --client raw \
    --base-url "http://127.0.0.1:$2/v1" --concurrency "$3" --num-requests "$4" \
    --max-tokens "$GEN" --json "$OUT/$1.json" | grep '^concurrency'
}
for round in $(seq 1 "$ROUNDS"); do
  for target in direct gateway; do
    port=$REPLICA_PORT; [ "$target" = gateway ] && port=$GATEWAY_PORT
    echo "round $round, $target:"
    load "latency-$target-$round" "$port" 1 "$LAT_REQS"
    load "throughput-$target-$round" "$port" 64 "$TPUT_REQS"
  done
done
"$PY" - "$OUT" "$ROUNDS" <<'PY' | tee "$OUT/summary.md"
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def level(name):
    return [json.load(open(f"{out}/{name}-{r}.json"))["levels"][0] for r in range(1, rounds + 1)]
rows = []
for metric, key, scale, unit in [("TTFT p50", ("ttft_secs", "p50"), 1e3, "ms"),
                                 ("TTFT p99", ("ttft_secs", "p99"), 1e3, "ms"),
                                 ("end to end p50", ("e2e_secs", "p50"), 1e3, "ms"),
                                 ("end to end p99", ("e2e_secs", "p99"), 1e3, "ms")]:
    d = statistics.median(l[key[0]][key[1]] * scale for l in level("latency-direct"))
    g = statistics.median(l[key[0]][key[1]] * scale for l in level("latency-gateway"))
    rows.append((f"{metric}, 1 stream ({unit})", d, g, f"{g - d:+.2f} {unit}"))
d = statistics.median(l["output_tokens_per_sec"] for l in level("throughput-direct"))
g = statistics.median(l["output_tokens_per_sec"] for l in level("throughput-gateway"))
rows.append(("output tokens/s, 64 streams", d, g, f"{100 * (g / d - 1):+.1f} %"))
print("| measure (median of %d rounds) | direct | through the gateway | gateway adds |" % rounds)
print("|---|---|---|---|")
for name, d, g, added in rows:
    print(f"| {name} | {d:.2f} | {g:.2f} | {added} |")
PY
