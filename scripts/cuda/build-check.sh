#!/usr/bin/env bash
# Builds the CUDA check program and `kimi-infer` with the cuda feature on this (possibly
# GPU-less) machine and copies them, stripped, into the git-ignored .device-bin/ for the
# device machine (`run` with carry [".device-bin", ".whl"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
export CUDA_HOME="${CUDA_HOME:-$PWD/.cuda/nvidia/cu13}"
[ -x "$CUDA_HOME/bin/nvcc" ] || scripts/cuda/setup.sh
cargo build -p kimi-cuda --features cuda --release --example check -j2
cargo build -p kimi-cli --features cuda --release -j2
cargo build -p kimi-cpu --release --example experts_bench -j2
mkdir -p .device-bin
cp target/release/examples/check .device-bin/check
cp target/release/kimi-infer .device-bin/kimi-infer
cp target/release/examples/experts_bench .device-bin/experts_bench
strip .device-bin/check .device-bin/kimi-infer .device-bin/experts_bench
# The device's copy of the tree has no usable git metadata: record what was built.
git describe --always --dirty > .device-bin/COMMIT
ls -la .device-bin
