#!/usr/bin/env bash
# Installs the pinned PyPI CUDA 13.0 build toolchain (nvcc, nvvm, cudart, cccl, crt) into the
# git-ignored `.cuda/` folder of the repository root. Idempotent: does nothing when the
# pinned nvcc is already there. Prints the CUDA_HOME to export for
# `cargo build -p kimi-cuda --features cuda`.
set -euo pipefail
cd "$(dirname "$0")/../.."
PIN="cuda-toolkit[nvcc,nvvm,cudart,cccl,crt]==13.0.2"
CUDA_HOME="$PWD/.cuda/nvidia/cu13"
if [ -x "$CUDA_HOME/bin/nvcc" ] && "$CUDA_HOME/bin/nvcc" --version | grep -q "release 13.0"; then
  echo "nvcc 13.0 already installed" >&2
else
  python3 -m pip install --disable-pip-version-check --no-input --target .cuda "$PIN"
fi
grep -qx '/.cuda' .gitignore 2>/dev/null || echo '/.cuda' >> .gitignore
"$CUDA_HOME/bin/nvcc" --version | tail -n 2 >&2
echo "CUDA_HOME=$CUDA_HOME"
