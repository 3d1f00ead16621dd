#!/usr/bin/env bash
# Fetches the perplexity corpus: Lewis Carroll's "Alice's Adventures in Wonderland" (Project
# Gutenberg text, public domain) as the Canterbury compression corpus has it (alice29.txt,
# 152,089 bytes), from the source distribution of Brotli 1.1.0 on PyPI, which ships it as
# test data. Lands in models/corpus/ (git-ignored). Idempotent: does nothing when the file is
# already present with the right sha256.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=models/corpus; mkdir -p "$dir"; f="$dir/alice29.txt"
text_sha=7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0
sdist_sha=81de08ac11bcb85841e440c13611c00b67d3bf82698314928d0b676362546724
if ! echo "$text_sha  $f" | sha256sum -c --status 2>/dev/null; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --no-deps --no-binary=:all: -d "$tmp" Brotli==1.1.0   # 7.4 MB
  echo "$sdist_sha  $tmp/Brotli-1.1.0.tar.gz" | sha256sum -c
  tar -xzf "$tmp/Brotli-1.1.0.tar.gz" -C "$tmp" Brotli-1.1.0/tests/testdata/alice29.txt
  cp "$tmp/Brotli-1.1.0/tests/testdata/alice29.txt" "$f"
  echo "$text_sha  $f" | sha256sum -c
fi
