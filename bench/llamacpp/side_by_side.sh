#!/usr/bin/env bash
# Both engines on the same GGUF files, same thread count, in one run: llama.cpp's llama-bench
# (pp128 and tg64) and `kimi-infer bench` (128-token prompt, 64 generated tokens), alternating
# round by round so that a change in machine load hits both. Needs bench/llamacpp/build.sh and
# a release build of kimi-infer (`cargo build --release -p kimi-cli`).
#
# Writes bench/llamacpp/side-by-side-<date>.json (every sample of both tools, load averages)
# and prints a table of medians and best rounds with their ratios.
#
# Env: LLAMACPP_DIR (default target/llamacpp), KIMI (default target/release/kimi-infer),
#      THREADS (default 2), ROUNDS (default 5),
#      KIMI_FLAGS (default --int8-matmul: int8 activations, as llama.cpp's quantized products),
#      FILES (default: the demo Q4_1 file and its Q8_0 requantization made by run.sh),
#      DATE (default today, UTC), OUT (default bench/llamacpp/side-by-side-<date>.json).
# kimi_gguf.sh runs it on Kimi Linear GGUFs made with `kimi-infer convert --random-config`.
set -euo pipefail
cd "$(dirname "$0")/../.."

ROOT=${LLAMACPP_DIR:-target/llamacpp}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-5}
KIMI_FLAGS=${KIMI_FLAGS:---int8-matmul}
DATE=${DATE:-$(date -u +%Y-%m-%d)}
OUT=${OUT:-bench/llamacpp/side-by-side-$DATE.json}
FILES=${FILES:-models/SmolLM2-135M-Instruct.Q4_1.gguf $ROOT/models/SmolLM2-135M-Instruct.Q8_0-requant-from-Q4_1.gguf}
KIMI=${KIMI:-target/release/kimi-infer}
LLAMA=$ROOT/build/bin/llama-bench
for b in "$KIMI" "$LLAMA"; do
  [ -x "$b" ] || { echo "missing $b (see this script's header)" >&2; exit 1; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

for round in $(seq 1 "$ROUNDS"); do
  for f in $FILES; do
    [ -s "$f" ] || { echo "missing $f (bench/llamacpp/run.sh makes the Q8_0 file)" >&2; exit 1; }
    tag=$(basename "$f" .gguf)
    load=$(cut -d' ' -f1 /proc/loadavg)
    "$LLAMA" -m "$f" -t "$THREADS" -p 128 -n 64 -r 1 -o json > "$tmp/llama-$tag-$round.json" 2>/dev/null
    # shellcheck disable=SC2086
    "$KIMI" bench --model "$f" --threads "$THREADS" --prompt-len 128 --gen-len 64 --repeats 1 \
      $KIMI_FLAGS --json "$tmp/kimi-$tag-$round.json" > /dev/null 2>&1
    echo "$load" > "$tmp/load-$tag-$round.txt"
    echo "round $round/$ROUNDS $tag done (load $load)" >&2
  done
done

python3 - "$tmp" "$OUT" "$THREADS" "$KIMI_FLAGS" "$ROUNDS" "$(git describe --always --dirty)" <<'PY'
import glob, json, os, statistics, sys
tmp, out, threads, flags, rounds, commit = sys.argv[1:]
rows = {}
for path in sorted(glob.glob(f"{tmp}/llama-*.json")):
    tag, rnd = os.path.basename(path)[6:-5].rsplit("-", 1)
    r = rows.setdefault(tag, {"llama_pp": [], "llama_tg": [], "kimi_pp": [], "kimi_tg": [], "load": []})
    for t in json.load(open(path)):
        (r["llama_pp"] if t["n_prompt"] else r["llama_tg"]).append(t["avg_ts"])
        build = t["build_commit"]
    k = json.load(open(f"{tmp}/kimi-{tag}-{rnd}.json"))
    r["kimi_pp"].append(k["runs"][0]["prefill_tokens_per_sec"])
    r["kimi_tg"].append(k["runs"][0]["decode_tokens_per_sec"])
    r["load"].append(float(open(f"{tmp}/load-{tag}-{rnd}.txt").read()))
json.dump({"commit": commit, "llama_cpp": build, "threads": int(threads), "kimi_flags": flags,
           "rounds": int(rounds), "files": rows}, open(out, "w"), indent=1)
print(f"kimi-infer {commit} ({flags}) vs llama.cpp {build}, {threads} threads, {rounds} rounds; "
      "median (best) tokens/s")
print(f"{'file':<44} {'llama pp128':>15} {'kimi pp128':>15} {'ratio':>6} "
      f"{'llama tg64':>15} {'kimi tg64':>15} {'ratio':>6}  load")
for tag, r in rows.items():
    m = {k: statistics.median(v) for k, v in r.items()}
    b = {k: max(v) for k, v in r.items()}
    print(f"{tag:<44} {m['llama_pp']:7.1f} ({b['llama_pp']:5.1f}) {m['kimi_pp']:7.1f} ({b['kimi_pp']:5.1f}) "
          f"{m['kimi_pp'] / m['llama_pp']:5.2f}x {m['llama_tg']:7.1f} ({b['llama_tg']:5.1f}) "
          f"{m['kimi_tg']:7.1f} ({b['kimi_tg']:5.1f}) "
          f"{m['kimi_tg'] / m['llama_tg']:5.2f}x  {min(r['load']):.2f}-{max(r['load']):.2f}")
print(f"wrote {out}")
PY
