#!/usr/bin/env bash
# Fetches the texts the quality tools use, from the source distribution of Brotli 1.1.0 on
# PyPI, which ships the Canterbury compression corpus as test data:
#   alice29.txt  Lewis Carroll's "Alice's Adventures in Wonderland" (Project Gutenberg,
#                public domain, 152,089 bytes): the perplexity text;
#   lcet10.txt   the Library of Congress "Workshop on Electronic Texts" proceedings (Project
#                Gutenberg, public domain, 426,754 bytes): the calibration text of
#                `quantize --method gptq|awq`, so that calibration never sees the scored text.
# Lands in models/corpus/ (git-ignored). Idempotent: does nothing when the files are already
# present with the right sha256.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=models/corpus; mkdir -p "$dir"
sums="7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0  $dir/alice29.txt
5314ba1dbb03f471df88bec6cd120a938ef60d0fd3511c5c1dce61bf7463245f  $dir/lcet10.txt"
sdist_sha=81de08ac11bcb85841e440c13611c00b67d3bf82698314928d0b676362546724
if ! echo "$sums" | sha256sum -c --status 2>/dev/null; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --no-deps --no-binary=:all: -d "$tmp" Brotli==1.1.0   # 7.4 MB
  echo "$sdist_sha  $tmp/Brotli-1.1.0.tar.gz" | sha256sum -c
  for f in alice29.txt lcet10.txt; do
    tar -xzf "$tmp/Brotli-1.1.0.tar.gz" -C "$tmp" "Brotli-1.1.0/tests/testdata/$f"
    cp "$tmp/Brotli-1.1.0/tests/testdata/$f" "$dir/$f"
  done
  echo "$sums" | sha256sum -c
fi
