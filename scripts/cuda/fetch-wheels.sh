#!/usr/bin/env bash
# Downloads the pinned Python wheels the GPU machine (no network) needs for side-by-side runs
# into the git-ignored .whl/: flash-linear-attention (fla's Triton KDA kernels, also used by
# transformers' Kimi Linear) and the openai client (for bench/serve_load.py), for the
# device's CPython (3.10-3.13 covered). Carried with `run` carry [".device-bin", ".whl"].
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl/openai
pip download -q --no-deps -d .whl flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2
for v in 3.10 3.11 3.12 3.13; do
  pip download -q openai==3.57.0 --only-binary=:all: --python-version "$v" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl/openai
done
ls .whl
