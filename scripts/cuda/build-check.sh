#!/usr/bin/env bash
# Builds the CUDA check program on this (possibly GPU-less) machine and copies it, stripped,
# into the git-ignored .device-bin/ for the device machine (`run` with carry [".device-bin"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
export CUDA_HOME="${CUDA_HOME:-$PWD/.cuda/nvidia/cu13}"
[ -x "$CUDA_HOME/bin/nvcc" ] || scripts/cuda/setup.sh
cargo build -p kimi-cuda --features cuda --release --example check -j2
mkdir -p .device-bin
cp target/release/examples/check .device-bin/check
strip .device-bin/check
ls -la .device-bin
