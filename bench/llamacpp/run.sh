#!/usr/bin/env bash
# Runs the llama.cpp CPU baseline on the demo model (SmolLM2-135M-Instruct) as Q4_1 and as a
# Q8_0 requantized from that Q4_1 (see README.md). Needs bench/llamacpp/build.sh first.
#
# Writes:
#   bench/llamacpp/results-<date>.json  raw `llama-bench -o json` array (pp128 and tg64, both files)
#   bench/llamacpp/results-<date>.summary.txt  mean/stddev/median/best per test, load averages
#   bench/llamacpp/greedy-<date>.txt    greedy (temp 0) continuations of the two golden prompts of
#                                       shared/docs/demo-model.md, sha256 of both files, system_info
#
# Env: LLAMACPP_DIR (default target/llamacpp), THREADS (default 2), REPS (default 10),
#      DATE (default today, UTC), OUT_DIR (default bench/llamacpp), SKIP_GREEDY=1 (bench only).
set -euo pipefail
cd "$(dirname "$0")/../.."

ROOT=${LLAMACPP_DIR:-target/llamacpp}
BIN=$ROOT/build/bin
THREADS=${THREADS:-2}
REPS=${REPS:-10}  # 10, not 3: on this shared 2-core VM single repetitions collapse; see README
DATE=${DATE:-$(date -u +%Y-%m-%d)}
OUT_DIR=${OUT_DIR:-bench/llamacpp}
Q4=models/SmolLM2-135M-Instruct.Q4_1.gguf
Q8=$ROOT/models/SmolLM2-135M-Instruct.Q8_0-requant-from-Q4_1.gguf
log() { echo "[llamacpp/run] $*" >&2; }

for t in llama-bench llama-completion llama-quantize; do
  [ -x "$BIN/$t" ] || { log "missing $BIN/$t: run bench/llamacpp/build.sh first"; exit 1; }
done

# Demo model (Q4_1, sha256-checked) and its Q8_0 requantization. The original GGUF exists only as
# Q4_1 (token_embd Q8_0), so the Q8_0 file is made from dequantized Q4_1 weights:
# --allow-requantize; it has Q8_0 speed/layout but no more accuracy than the Q4_1 file.
bash scripts/fetch_demo_model.sh
if [ ! -s "$Q8" ]; then
  mkdir -p "$(dirname "$Q8")"
  log "requantizing $Q4 -> $Q8"
  "$BIN/llama-quantize" --allow-requantize "$Q4" "$Q8.tmp" Q8_0 "$THREADS" > "$ROOT/quantize.log" 2>&1 \
    || { tail -20 "$ROOT/quantize.log" >&2; exit 1; }
  mv "$Q8.tmp" "$Q8"
fi

mkdir -p "$OUT_DIR"
RES=$OUT_DIR/results-$DATE.json
GREEDY=$OUT_DIR/greedy-$DATE.txt

# 1. Throughput: prompt processing of 128 tokens and generation of 64 tokens, REPS repetitions.
# On a shared 2-core box other processes make single repetitions collapse (OpenMP threads spin
# while descheduled), so the summary also shows the median and the best repetition; the load
# averages before/after are recorded next to it.
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
log "llama-bench -t $THREADS -p 128 -n 64 -r $REPS (load before: $load_before)"
"$BIN/llama-bench" -m "$Q4" -m "$Q8" -t "$THREADS" -p 128 -n 64 -r "$REPS" -o json > "$RES.tmp" \
  2> "$ROOT/bench.log" || { tail -20 "$ROOT/bench.log" >&2; exit 1; }
mv "$RES.tmp" "$RES"
python3 - "$RES" "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)" <<'PY2' | tee "${RES%.json}.summary.txt" >&2
import json, statistics, sys
rs = json.load(open(sys.argv[1]))
print(f"llama.cpp {rs[0]['build_commit']} ({rs[0]['build_number']}) {rs[0]['cpu_info']} backends={rs[0]['backends']}")
print(f"load avg before: {sys.argv[2]}  after: {sys.argv[3]}")
print(f"{'model':<28} {'test':<6} {'thr':>3} {'mean t/s':>9} {'stddev':>8} {'median':>8} {'best':>8}  samples")
for r in rs:
    kind = f"pp{r['n_prompt']}" if r['n_prompt'] else f"tg{r['n_gen']}"
    s = r['samples_ts']
    print(f"{r['model_type']:<28} {kind:<6} {r['n_threads']:>3} {r['avg_ts']:9.2f} {r['stddev_ts']:8.2f} "
          f"{statistics.median(s):8.2f} {max(s):8.2f}  {[round(x, 1) for x in s]}")
PY2

[ "${SKIP_GREEDY:-0}" = 1 ] && { log "wrote $RES"; exit 0; }

# 2. Greedy outputs for the golden prompts (prompt tokenized with special tokens, no BOS added
#    since add_bos_token=false; -no-cnv = plain completion, no chat template applied by llama.cpp).
#    CHAT_NOSYS (ChatML without the system turn, which is what the GGUF's own jinja template makes)
#    is informational only: it has no golden ids in demo-model.md.
RAW='Once upon a time'
CHAT=$'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n'
CHAT_NOSYS=$'<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n'
# Golden texts (NumPy f32 reference, shared/docs/demo-model.md): first 24 generated tokens / full answer.
GOLD_RAW=', the city of Nova Haven was a thriving metropolis, with towering skyscrapers and bustling streets. But as the years went by'
GOLD_CHAT='The capital of France is Paris. [end of text]'
GOLD_CHAT_NOSYS=''
GCMD=(-no-cnv --temp 0 -n 32 -s 0 -t "$THREADS" -c 512 --no-display-prompt --verbose-prompt --no-warmup)
{
  echo "# llama.cpp greedy outputs, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# $("$BIN/llama-completion" --version 2>&1 | tr '\n' ' ')"
  echo "# cmd: llama-completion -m FILE -p PROMPT ${GCMD[*]}"
  for m in "$Q4" "$Q8"; do
    echo "# $(sha256sum "$m")"
  done
  for m in "$Q4" "$Q8"; do
    for p in RAW CHAT CHAT_NOSYS; do
      echo; echo "=== $(basename "$m") / $p prompt ==="
      out=$("$BIN/llama-completion" -m "$m" -p "${!p}" "${GCMD[@]}" < /dev/null 2> "$ROOT/greedy.log")
      out=${out%$'\n'}
      echo "prompt ids: $(grep -oE '[0-9]+ -> ' "$ROOT/greedy.log" | tr -dc '0-9\n' | paste -sd,)"
      echo "output>>>${out}<<<"
      g=GOLD_$p; gold=${!g}
      if [ -n "$gold" ]; then
        case "$out" in
          "$gold"*) echo "golden: MATCH (output starts with the golden text)" ;;
          *) i=0; while [ "$i" -lt "${#gold}" ] && [ "${out:$i:1}" = "${gold:$i:1}" ]; do i=$((i+1)); done
             echo "golden: DIFFERS from char $i: golden>>>${gold}<<<" ;;
        esac
      fi
    done
  done
  echo; echo "=== system_info ==="
  grep -m1 'system_info' "$ROOT/greedy.log" | sed 's/^.*system_info/system_info/' || true
} > "$GREEDY.tmp"
mv "$GREEDY.tmp" "$GREEDY"
cat "$GREEDY" >&2
log "wrote $RES and $GREEDY (load after: $(cut -d' ' -f1-3 /proc/loadavg))"
