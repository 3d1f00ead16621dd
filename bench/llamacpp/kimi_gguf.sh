#!/usr/bin/env bash
# Kimi Linear against llama.cpp on the same GGUF files: converts the ~0.5B random config
# (kimi-linear-0.5b.config.json, deterministic random bf16 weights, no checkpoint needed) with
# `kimi-infer convert --random-config` into target/llamacpp/models/, compares greedy token ids
# of both engines on every file, then runs side_by_side.sh (pp128/tg64, both tools alternating
# round by round) on the benchmark files. Needs bench/llamacpp/build.sh, a release build of
# kimi-infer (`cargo build --release -p kimi-cli`) and g++ (for llama_greedy_logits.cpp,
# built against build.sh's static libraries).
#
# The greedy section also runs a control model: the same config with every expert routed.
#
# Writes bench/llamacpp/kimi-greedy-<date>.txt and bench/llamacpp/kimi-side-by-side-<date>.json.
#
# Env: LLAMACPP_DIR (default target/llamacpp), CONFIG (default the 0.5B config), THREADS (2),
#      ROUNDS (5), KIMI_FLAGS (--int8-matmul), DATE (today, UTC),
#      GREEDY_QUANTS (f32 f16 q8_0 q4_k_m), BENCH_QUANTS (q8_0 q4_k_m),
#      PROMPT (Once upon a time; the stand-in vocabulary encodes it byte by byte), N_GEN (16),
#      SKIP_GREEDY=1, SKIP_BENCH=1.
set -euo pipefail
cd "$(dirname "$0")/../.."

ROOT=${LLAMACPP_DIR:-target/llamacpp}
CONFIG=${CONFIG:-bench/llamacpp/kimi-linear-0.5b.config.json}
THREADS=${THREADS:-2}
DATE=${DATE:-$(date -u +%Y-%m-%d)}
GREEDY_QUANTS=${GREEDY_QUANTS:-f32 f16 q8_0 q4_k_m}
BENCH_QUANTS=${BENCH_QUANTS:-q8_0 q4_k_m}
PROMPT=${PROMPT:-Once upon a time}
N_GEN=${N_GEN:-16}
KIMI=target/release/kimi-infer
TOOL=$ROOT/build/bin/llama-greedy-logits
NAME=$(basename "$CONFIG" .config.json)
log() { echo "[kimi_gguf] $*" >&2; }

[ -x "$KIMI" ] || { log "missing $KIMI: cargo build --release -p kimi-cli"; exit 1; }
[ -f "$ROOT/build/src/libllama.a" ] || { log "missing $ROOT/build: run bench/llamacpp/build.sh"; exit 1; }

# 1. The greedy tool, against the same static libraries as llama-bench / llama-completion.
SRC=bench/llamacpp/llama_greedy_logits.cpp
if [ ! -x "$TOOL" ] || [ "$SRC" -nt "$TOOL" ]; then
  LL=$ROOT/src/llama_cpp_python-0.3.36/vendor/llama.cpp
  B=$ROOT/build
  log "building $TOOL"
  g++ -O2 -std=c++17 -I "$LL/include" -I "$LL/ggml/include" "$SRC" "$B/src/libllama.a" \
    "$B/ggml/src/libggml.a" "$B/ggml/src/libggml-cpu.a" "$B/ggml/src/libggml-base.a" \
    -fopenmp -lpthread -ldl -o "$TOOL"
fi

# 2. The GGUF files (remade when the config or kimi-infer is newer). The control model is the
#    same config with every expert routed (num_experts_per_token = num_experts): no top-k
#    choice, so it shows how the engines agree when routing cannot flip.
mkdir -p "$ROOT/models"
CONTROL_CONFIG=$ROOT/models/$NAME-allexperts.config.json
python3 - "$CONFIG" "$CONTROL_CONFIG" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["num_experts_per_token"] = c["num_experts"]
new = json.dumps(c, indent=1)
try:
    old = open(sys.argv[2]).read()
except OSError:
    old = None
if old != new:
    open(sys.argv[2], "w").write(new)
PY
convert() {  # CONFIG QUANT OUT
  if [ ! -s "$3" ] || [ "$1" -nt "$3" ] || [ "$KIMI" -nt "$3" ]; then
    log "converting $1 ($2) -> $3"
    "$KIMI" convert --random-config "$1" --quant "$2" --out "$3.tmp" 2> "$ROOT/convert-$2.log" \
      || { tail -5 "$ROOT/convert-$2.log" >&2; exit 1; }
    mv "$3.tmp" "$3"
  fi
}
gguf() { echo "$ROOT/models/$NAME-random.$1.gguf"; }
for q in $(echo "$GREEDY_QUANTS $BENCH_QUANTS" | tr ' ' '\n' | sort -u); do
  convert "$CONFIG" "$q" "$(gguf "$q")"
done
CONTROL=$ROOT/models/$NAME-allexperts-random.q8_0.gguf
[ "${SKIP_GREEDY:-0}" = 1 ] || convert "$CONTROL_CONFIG" q8_0 "$CONTROL"

# 3. Greedy ids: llama.cpp from the prompt's byte ids; kimi-infer from the prompt text (the
#    stand-in vocabulary gives the same byte ids), with f32 products and with --int8-matmul.
if [ "${SKIP_GREEDY:-0}" != 1 ]; then
  GREEDY=bench/llamacpp/kimi-greedy-$DATE.txt
  ids=$(printf '%s' "$PROMPT" | od -An -tu1 -v | tr -s ' \n' ',' | sed 's/^,//; s/,$//')
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  tags=""
  for q in $GREEDY_QUANTS control-q8_0; do
    if [ "$q" = control-q8_0 ]; then f=$CONTROL; else f=$(gguf "$q"); fi
    tags="$tags $q"
    log "greedy $q"
    "$TOOL" "$f" "$THREADS" "$N_GEN" "$ids" > "$tmp/llama-$q.txt" 2> /dev/null
    # The same weights in f32 math: llama-quantize dequantizes the file's tensors to F32, so
    # llama.cpp runs exactly the file's values without rounding activations to 8 or 16 bits.
    if [ "$q" != f32 ]; then
      "$ROOT/build/bin/llama-quantize" --allow-requantize "$f" "$tmp/deq.gguf" F32 "$THREADS" \
        > "$tmp/deq-$q.log" 2>&1 || { tail -5 "$tmp/deq-$q.log" >&2; exit 1; }
      "$TOOL" "$tmp/deq.gguf" "$THREADS" "$N_GEN" "$ids" > "$tmp/llama-deq-$q.txt" 2> /dev/null
      rm -f "$tmp/deq.gguf"
    fi
    for mode in f32 int8; do
      flag=$([ "$mode" = int8 ] && echo --int8-matmul || true)
      # shellcheck disable=SC2086
      "$KIMI" --threads "$THREADS" run --model "$f" --prompt "$PROMPT" --max-tokens "$N_GEN" \
        --ignore-eos --temperature 0 --logprobs 2 $flag 2> "$tmp/kimi-$mode-$q.txt" > /dev/null
    done
  done
  python3 - "$tmp" "$GREEDY" "$tags" "$NAME" "$ids" "$THREADS" "$(git describe --always --dirty)" <<'PY'
import os, re, sys
tmp, out, quants, name, ids, threads, commit = sys.argv[1:]
lines = [f"# greedy token ids, llama.cpp (llama_greedy_logits.cpp) vs kimi-infer {commit} (run --logprobs 2)",
         "# llama.cpp deq: llama.cpp on the file's weights dequantized to F32 (llama-quantize",
         "# --allow-requantize FILE OUT F32), i.e. the file's values without 8/16-bit activations",
         f"# model {name}-random.QUANT.gguf, prompt ids {ids}, {threads} threads, temperature 0",
         "# margin = top-1 minus top-2 logit at the step (kimi: log-probability difference, the same)", ""]
for q in quants.split():
    def steps(path):
        return [(int(m[1]), float(m[2]), int(m[3]), float(m[4])) for m in re.finditer(
            r"step \d+: id=(\d+) top1=(\S+) top2=(\d+):(\S+) margin", open(path).read())]
    llama = steps(f"{tmp}/llama-{q}.txt")
    lines.append(f"== {q}" + (" (control: the same config with every expert routed, "
                              f"{name}-allexperts-random.q8_0.gguf)" if q.startswith("control") else ""))
    lines.append(f"llama.cpp       : {','.join(str(t[0]) for t in llama)}")
    deq = steps(f"{tmp}/llama-deq-{q}.txt") if os.path.exists(f"{tmp}/llama-deq-{q}.txt") else None
    if deq is not None:
        lines.append(f"llama.cpp deq   : {','.join(str(t[0]) for t in deq)}"
                     "  (the file's weights dequantized to F32 by llama-quantize)")
    for mode in ("f32", "int8"):
        kimi = [(int(m[1]), float(m[2]), int(m[3]), float(m[4])) for m in re.finditer(
            r"\[token (\d+) logprob \S+ top \d+:(\S+) (\d+):([^\]\s]+)\]",
            open(f"{tmp}/kimi-{mode}-{q}.txt").read())]
        label = "kimi-infer" + (" --int8-matmul" if mode == "int8" else "")
        lines.append(f"{label:<16}: {','.join(str(t[0]) for t in kimi)}")
        n = min(len(llama), len(kimi))
        prefix = next((i for i in range(n) if llama[i][0] != kimi[i][0]), n)
        same = sum(llama[i][0] == kimi[i][0] for i in range(n))
        note = f"  {label}: first {prefix}/{n} ids agree ({same}/{n} position-wise)"
        if prefix < n:
            l, k = llama[prefix], kimi[prefix]
            note += (f"; step {prefix}: llama.cpp {l[0]} (margin {l[1] - l[3]:.4f} over {l[2]}), "
                     f"kimi-infer {k[0]} (margin {k[1] - k[3]:.4f} over {k[2]})")
        lines.append(note)
        if deq is not None:
            n = min(len(deq), len(kimi))
            prefix = next((i for i in range(n) if deq[i][0] != kimi[i][0]), n)
            lines.append(f"  {label} vs llama.cpp deq: first {prefix}/{n} ids agree")
    lines.append("")
open(out, "w").write("\n".join(lines))
print("\n".join(lines))
print(f"wrote {out}")
PY
fi

# 4. Throughput, both engines alternating round by round.
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  files=""
  for q in $BENCH_QUANTS; do files="$files $(gguf "$q")"; done
  FILES="$files" OUT=${OUT:-bench/llamacpp/kimi-side-by-side-$DATE.json} THREADS=$THREADS \
    DATE=$DATE bash bench/llamacpp/side_by_side.sh
fi
