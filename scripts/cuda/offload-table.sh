#!/usr/bin/env bash
# Issue 25's table on one GPU: Kimi-Linear-48B (random weights, cut to OFFLOAD_LAYERS layers so
# that its experts also fit the host's RAM when all of them live there) with a GPU budget that
# holds a given share of each MoE layer's 256 experts, decode tokens/s at batch 1 and 16
# against all of them on the GPU. Run on the device from the repository root after
# scripts/cuda/build-check.sh:
#   scripts/cuda/offload-table.sh OUT_DIR ROW...
# where a ROW is NAME:HOST:SLOTS:SKEW[:DTYPE] — HOST experts per layer in pinned host RAM, SLOTS
# device cache slots (the GPU holds 256 − HOST + SLOTS of them), SKEW `bench --routing-skew`
# (0: about uniform routing, the cache's worst case), DTYPE `bench --random-dtype` (default
# bf16; q4z: the linear layers and experts 4-bit, kept packed in every tier). HOST 0 is the
# all-on-GPU baseline.
# Every miss goes where the step ends sooner (`--offload-miss auto`). KIMI_INFER names another
# build to run (default .device-bin/kimi-infer), for two builds side by side in one lease.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="$1"
shift
mkdir -p "$OUT"
source scripts/cuda/device-env.sh
{
  echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) ${KIMI_INFER:-.device-bin/kimi-infer}, built from $(cat "$(dirname "${KIMI_INFER:-.device-bin/kimi-infer}")/COMMIT" 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
  grep -m1 'model name' /proc/cpuinfo
  free -g | sed -n 2p
} | tee "$OUT/env.txt"
CONFIG=/tmp/offload-table-config.json
cut_config crates/kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json \
  "${OFFLOAD_LAYERS:-20}" "$CONFIG"
for row in "$@"; do
  IFS=: read -r name host slots skew dtype <<<"$row"
  flags=(--random-dtype "${dtype:-bf16}")
  [ "$host" != 0 ] && flags+=(--offload-experts "$host" --expert-cache-slots "$slots" --offload-miss auto)
  echo "# $(date -u +%H:%M:%SZ) $name: host $host slots $slots skew $skew dtype ${dtype:-bf16}" | tee -a "$OUT/rows.txt"
  timeout "${OFFLOAD_TIMEOUT:-120}" "${KIMI_INFER:-.device-bin/kimi-infer}" bench --device cuda \
    --random-config "$CONFIG" --routing-skew "$skew" --prompt-len 256 --gen-len 8 --repeats 1 \
    --decode-batch 1,16 --context 256 --decode-steps "${OFFLOAD_STEPS:-16}" "${flags[@]}" \
    --json "$OUT/$name.json" >"$OUT/$name.txt" 2>&1
  echo "# rc $? $(grep -E '^decode x(1|16) ' "$OUT/$name.txt" | tr -s ' ' | tr '\n' ';')" | tee -a "$OUT/rows.txt"
done
