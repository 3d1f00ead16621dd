#!/usr/bin/env bash
# Converts every Kimi Linear fixture with `kimi-infer convert` (f16, q8_0, q4_k_m) and checks
# each file with llama.cpp's own gguf-py (scripts/check_gguf_kimi.py): metadata keys and
# types, tensor names, ggml shapes, types and values against the safetensors checkpoint.
# The Kimi K3 fixtures go the same way through scripts/check_gguf_k3.py (llama.cpp's
# kimi-k3 names and shapes; MXFP4 experts decoded by gguf-py equal to the checkpoint's).
# gguf-py is pinned and installed once into target/gguf-venv (PyPI); later runs are offline.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF_PY_VERSION=0.19.0
venv=target/gguf-venv
if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('gguf') != '$GGUF_PY_VERSION')" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet "gguf==$GGUF_PY_VERSION"
fi
# KIMI_BIN: a kimi-infer already built (scripts/test.sh passes the one `cargo test` made);
# else the release build that scripts/test_openai.sh and scripts/web-test.sh use too.
if [ -n "${KIMI_BIN:-}" ]; then
    bin=$KIMI_BIN
else
    cargo build --quiet --release -p kimi-cli
    bin=${CARGO_TARGET_DIR:-target}/release/kimi-infer
fi
out=target/gguf-check
mkdir -p "$out"
for dir in fixtures/kimi-linear/*/; do
    name=$(basename "$dir")
    # A save_pretrained fixture's values are checked against its hub-layout twin's files.
    ckpt=$dir
    twin=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("twin_of", ""))' "$dir/reference.json")
    if [ -n "$twin" ]; then ckpt=fixtures/kimi-linear/$twin; fi
    for quant in f16 q8_0 q4_k_m; do
        file="$out/$name-$quant.gguf"
        "$bin" convert --model "$dir" --quant "$quant" --out "$file" 2>/dev/null
        "$venv/bin/python" scripts/check_gguf_kimi.py "$file" --checkpoint "$ckpt"
    done
done
# The demo checkpoint carries Kimi's tiktoken vocabulary: its GGUF has the tokenizer too.
demo="$out/demo-model"
mkdir -p "$demo"
cp assets/demo-model/config.json assets/demo-model/model.safetensors assets/demo-tokenizer/* "$demo/"
"$bin" convert --model "$demo" --quant q8_0 --out "$out/demo-q8_0.gguf" 2>/dev/null
"$venv/bin/python" scripts/check_gguf_kimi.py "$out/demo-q8_0.gguf" --checkpoint "$demo"
for dir in fixtures/kimi-k3/*/; do
    name=$(basename "$dir")
    for quant in bf16 q8_0 q4_k_m; do
        file="$out/$name-$quant.gguf"
        "$bin" convert --model "$dir" --quant "$quant" --out "$file" 2>/dev/null
        "$venv/bin/python" scripts/check_gguf_k3.py "$file" --checkpoint "$dir"
    done
done
