#!/usr/bin/env bash
# Device run of session 16: correctness of the new binary (.device-bin), then A/B against
# session 15's final binary (HEAD 1143ac3) (.device-bin/base, xz-packed): MoE decode layer (graph + PDL),
# ncu of one B=1 step, model bench B=1/8/64. Usage: run.sh STAGES...
# (bench1x: the alternating B=1 pairs with the new binary first.)
source <(sed -n '/^# cuBLAS 13/,/^done/p' scripts/cuda/device-bench.sh)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p $OUT
NEW=.device-bin BASE=/tmp/base
for b in base; do
  [ -d .device-bin/$b ] && [ ! -x /tmp/$b/check ] || continue
  mkdir -p /tmp/$b
  for f in check kimi-infer; do xz -dc .device-bin/$b/$f.xz > /tmp/$b/$f; chmod +x /tmp/$b/$f; done
done
CFG=crates/kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json
ncu_step() { # BIN NAME
  NCU_BATCH=1 NCU_HALF=1 timeout 200 ncu --profile-from-start off --clock-control none --csv \
    --page raw --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum \
    $1/check ncu-step > $OUT/ncu-raw-$2.csv 2> $OUT/ncu-$2.err
  python3 scripts/cuda/ncu_summary.py $OUT/ncu-raw-$2.csv > $OUT/ncu-$2.txt
  cat $OUT/ncu-$2.txt
  rm $OUT/ncu-raw-$2.csv
}
bench() { # BIN NAME BATCHES
  timeout 250 $1/kimi-infer bench --device cuda --random-config $CFG --prompt-len 1024 --gen-len 16 \
    --repeats 2 --decode-batch $3 --context 1024 --decode-steps 8 --bf16-activations \
    --json $OUT/bench-$2.json > $OUT/bench-$2.txt 2>&1
  grep -i "decode" $OUT/bench-$2.txt | tail -5
}
for st in "$@"; do
  set +u
  t0=$(date +%s)
  echo "=== $st"
  case $st in
    ops) timeout 200 $NEW/check ops fixtures > $OUT/check.txt 2>&1; echo rc=$?; grep -ci fail $OUT/check.txt; tail -3 $OUT/check.txt ;;
    big) timeout 200 $NEW/check big 1000 > $OUT/big.txt 2>&1; echo rc=$?; tail -4 $OUT/big.txt ;;
    ncu) ncu_step $NEW new ;;
    ncubase) ncu_step $BASE base ;;
    moe) for b in $BASE $NEW $BASE $NEW; do echo "$b"; timeout 100 $b/check moe-decode 2>&1 | grep -E "n=1|rror"; done | tee $OUT/moe-decode.txt ;;
    moeshape) for sh in 20,200 40,200; do echo "KIMI_CUDA_STREAM_SHAPE=$sh"; KIMI_CUDA_STREAM_SHAPE=$sh timeout 100 $NEW/check moe-decode 2>&1 | grep -E "n=1|rror"; done | tee $OUT/moe-shape.txt ;;
    bench1) for i in 1 2; do bench $BASE base$i 1; bench $NEW new$i 1; done ;;
    bench1x) for i in 3 4; do bench $NEW new$i 1; bench $BASE base$i 1; done ;;
    bench) bench $NEW full 1,8,64 ;;
    benchbase) bench $BASE basefull 1,8,64 ;;
  esac
  echo "($st: $(( $(date +%s) - t0 )) s)"
done
