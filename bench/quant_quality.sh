#!/usr/bin/env bash
# Quantization quality and speed on a trained model: the demo GGUF (SmolLM2-135M Q4_1)
# converted to a bf16 LlamaForCausalLM checkpoint, quantized by `kimi-infer quantize` with
# rtn / gptq / awq at 4 bits, then for each checkpoint: file size, perplexity of the first
# CHUNKS windows of alice29.txt (ctx 512, llama.cpp's rule), mean KL divergence and top-token
# agreement against the bf16 checkpoint's saved log-probabilities, and `bench` prefill/decode
# speed on the CPU. Calibration reads lcet10.txt (never the scored text).
#   bench/quant_quality.sh OUT_DIR [GROUP_SIZES]   (default groups: 64 32)
# Needs scripts/fetch_demo_model.sh and scripts/fetch_corpus.sh, and a release build.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?OUT_DIR}"; GROUP_SIZES="${2:-64 32}"
BIN=target/release/kimi-infer
CHUNKS=${CHUNKS:-20}; CAL_TOKENS=${CAL_TOKENS:-16384}
mkdir -p "$OUT"; W="${WORK:-/tmp/kimi-quant-quality}"; mkdir -p "$W"  # checkpoints: never in the repository
TEXT=models/corpus/alice29.txt; CAL=models/corpus/lcet10.txt
[ -d "$W/bf16" ] || $BIN convert --model models/SmolLM2-135M-Instruct.Q4_1.gguf --to safetensors \
  --quant bf16 --out "$W/bf16" 2>&1 | tail -1
run() { # name dir
  local name=$1 dir=$2 extra=()
  if [ "$name" = bf16 ]; then extra=(--save-logits "$W/bf16.kld"); else extra=(--kl-divergence "$W/bf16.kld"); fi
  $BIN perplexity --model "$dir" --text $TEXT --chunks $CHUNKS --json "$OUT/ppl-$name.json" "${extra[@]}" \
    > "$OUT/ppl-$name.txt" 2>&1
  $BIN bench --model "$dir" --prompt-len 256 --gen-len 32 --repeats 2 --json "$OUT/bench-$name.json" \
    > "$OUT/bench-$name.txt" 2>&1
  echo "$name $(du -b "$dir"/*.safetensors | awk '{s+=$1} END {print s}') $(grep -h 'Final estimate' "$OUT/ppl-$name.txt") $(grep -h 'Mean KLD\|Same top' "$OUT/ppl-$name.txt" | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
}
run bf16 "$W/bf16"
for g in $GROUP_SIZES; do
  for m in rtn gptq awq; do
    d="$W/$m-g$g"
    if [ ! -f "$d/config.json" ]; then
      rm -rf "$d"
      /usr/bin/time -f "$m-g$g quantize: %e s, %M KB peak" $BIN quantize --model "$W/bf16" --method $m \
        --group-size $g --calibration-text $CAL --calibration-tokens $CAL_TOKENS --out "$d" \
        > "$OUT/quantize-$m-g$g.txt" 2>&1
      tail -1 "$OUT/quantize-$m-g$g.txt" | tee -a "$OUT/summary.txt"
    fi
    run "$m-g$g" "$d"
  done
done
