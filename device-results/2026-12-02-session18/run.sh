#!/usr/bin/env bash
# Device runs of session 18: correctness of the new binary (.device-bin), then decode at B=1
# with the L2 prefetch hints off (the code before this session), attached to the next small
# kernel, or launched on their own (KIMI_CUDA_PREFETCH=off|attach|launch), alternating, on
# one machine. (r1 and r2 ran an earlier build whose only mode was a launch of its own, its
# budget set by KIMI_CUDA_PREFETCH_MB; 0 = off.) Usage: run.sh STAGES...
source <(sed -n '/^# cuBLAS 13/,/^done/p' scripts/cuda/device-bench.sh)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p $OUT
NEW=.device-bin
CFG=crates/kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json
bench() { # NAME BATCHES PREFETCH_MODE
  KIMI_CUDA_PREFETCH=$3 timeout 250 $NEW/kimi-infer bench --device cuda --random-config $CFG \
    --prompt-len 1024 --gen-len 16 --repeats 2 --decode-batch $2 --context 1024 --decode-steps 8 \
    --bf16-activations --json $OUT/bench-$1.json > $OUT/bench-$1.txt 2>&1
  echo "$1 (prefetch $3): $(grep -E 'decode x' $OUT/bench-$1.txt | tr -s ' ' | tr '\n' ';')"
}
for st in "$@"; do
  set +u
  t0=$(date +%s)
  echo "=== $st"
  case $st in
    ops) timeout 200 $NEW/check ops fixtures > $OUT/check.txt 2>&1; echo rc=$?; grep -ci fail $OUT/check.txt; tail -3 $OUT/check.txt ;;
    big) timeout 200 $NEW/check big 1000 > $OUT/big.txt 2>&1; echo rc=$?; tail -4 $OUT/big.txt ;;
    ab3) for i in 1 2; do bench off$i 1 off; bench attach$i 1 attach; done ;;
    full) bench full 1,8,64 attach ;;
    fulloff) bench fulloff 1,8,64 off ;;
  esac
  echo "($st: $(( $(date +%s) - t0 )) s)"
done
