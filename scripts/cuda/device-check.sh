#!/usr/bin/env bash
# Runs the CUDA backend check on a GPU machine that has no Rust toolchain.
# Build here first:  scripts/cuda/build-check.sh   (puts the binary into .device-bin/)
# On the GPU machine, from the repository root:  scripts/cuda/device-check.sh [OUT_DIR [STAGE...]]
# (named stages of the check program only, e.g. `device-results k3-ops fixtures`)
# Writes OUT_DIR/cuda-check.txt (default: device-results/).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${1:-device-results}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/cuda-check.txt"
# cuBLAS 13: the system toolkit, else PyTorch's pip wheel.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
  $(python3 -c 'import nvidia.cublas as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null) \
  $(python3 -c 'import nvidia.cu13 as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null); do
  if [ -e "$d/libcublas.so.13" ]; then export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; break; fi
done
# NCCL (libnccl.so.2, linked as libnccl.so for cudarc): `check nccl`, several GPUs.
source scripts/cuda/nccl-lib.sh
{
  echo "# kimi-cuda check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown) (+ uncommitted kimi-cuda work)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
  echo "# LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
} | tee "$LOG"
BIN=.device-bin/check
if [ $# -gt 1 ]; then
  # Named stages only (e.g. `k3-ops fixtures`), in one process.
  shift
  timeout "${STAGES_TIMEOUT:-300}" "$BIN" "$@" 2>&1 | tee -a "$LOG"
  echo "# exit code: ${PIPESTATUS[0]}" | tee -a "$LOG"
  exit 0
fi
timeout "${OPS_TIMEOUT:-90}" "$BIN" ops 2>&1 | tee -a "$LOG"
timeout "${FIXTURES_TIMEOUT:-120}" "$BIN" fixtures 2>&1 | tee -a "$LOG"
timeout "${BIG_TIMEOUT:-240}" "$BIN" big "${BIG_TOKENS:-1000}" 2>&1 | tee -a "$LOG"
echo "# exit codes: ${PIPESTATUS[*]}" | tee -a "$LOG"
