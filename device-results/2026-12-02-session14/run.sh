#!/usr/bin/env bash
# Device run of session 14: correctness of the new binary (.device-bin), then A/B against
# the session-13 binary (.device-bin/base): MoE decode layer bench, ncu of one B=1 step,
# model bench at B=1 (alternating). Usage: run.sh STAGES... (ops big ncu moe bench1 bench)
source <(sed -n '/^# cuBLAS 13/,/^done/p' scripts/cuda/device-bench.sh)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p $OUT
NEW=.device-bin BASE=.device-bin/base V1=.device-bin/v1
CFG=crates/kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json
ncu_step() { # BIN NAME
  NCU_BATCH=1 NCU_HALF=1 timeout 200 ncu --profile-from-start off --clock-control none --csv \
    --page raw --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum,sm__cycles_active.max,sm__cycles_active.avg \
    $1/check ncu-step > $OUT/ncu-raw-$2.csv 2> $OUT/ncu-$2.err
  python3 scripts/cuda/ncu_summary.py $OUT/ncu-raw-$2.csv > $OUT/ncu-$2.txt
  head -8 $OUT/ncu-$2.txt
  python3 - $OUT/ncu-raw-$2.csv > $OUT/ncu-launches-$2.txt <<'PY'
import csv, sys
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
for x in list(csv.DictReader(lines))[1:]:
    n = x['Kernel Name'].split('(')[0]
    if n in ('moe_stream_1', 'gemv_bulk_1'):
        t = float(x['gpu__time_duration.sum'].replace(',', ''))
        b = float(x['dram__bytes_read.sum'].replace(',', ''))
        print(f"{n:14} grid {x['Grid Size']:>14} {t/1e3:8.2f} us {b/1e6:8.1f} MB {b/t:6.0f} GB/s")
PY
  head -14 $OUT/ncu-launches-$2.txt
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
    ops) timeout 300 $NEW/check ops fixtures > $OUT/check.txt 2>&1; echo rc=$?; tail -5 $OUT/check.txt ;;
    big) timeout 300 $NEW/check big 1000 > $OUT/big.txt 2>&1; echo rc=$?; tail -5 $OUT/big.txt ;;
    ncu) ncu_step $NEW new ;;
    ncubase) ncu_step $BASE base ;;
    ncuv1) ncu_step $V1 v1 ;;
    moe) for b in $BASE $NEW $V1 $BASE $NEW $V1; do echo "$b"; timeout 100 $b/check moe-decode 2>&1 | grep "n=1"; done | tee $OUT/moe-decode.txt ;;
    gemv) timeout 200 $NEW/check gemv-bench > $OUT/gemv-new.txt 2>&1; grep "n=1" $OUT/gemv-new.txt ;;
    sweep)
      # moe-decode (one 48B MoE layer, graph + PDL) per bulk-copy chunk and stream shape;
      # the fastest setting is exported for the later stages.
      best=999; : > $OUT/sweep.txt
      for cfg in "0 40,200" "8192 40,200" "4096 40,200" "16384 40,200" "0 20,200" "8192 20,200" "4096 20,200"; do
        set -- $cfg
        us=$(KIMI_CUDA_STREAM_CHUNK=$1 KIMI_CUDA_STREAM_SHAPE=$2 timeout 60 $NEW/check moe-decode 2>&1 | grep "n=1" | sed 's/.*route_one + stream *\([0-9.]*\) us.*/\1/')
        echo "chunk=$1 shape=$2 stream_us=$us" | tee -a $OUT/sweep.txt
        if [ -n "$us" ] && awk "BEGIN{exit !($us < $best)}"; then best=$us; BC=$1; BS=$2; fi
      done
      us=$(timeout 60 $BASE/check moe-decode 2>&1 | grep "n=1" | sed 's/.*route_one + stream *\([0-9.]*\) us.*/\1/')
      echo "base stream_us=$us" | tee -a $OUT/sweep.txt
      export KIMI_CUDA_STREAM_CHUNK=$BC KIMI_CUDA_STREAM_SHAPE=$BS
      echo "best: chunk=$BC shape=$BS ($best us)" | tee -a $OUT/sweep.txt ;;
    benchbase) bench $BASE basefull 1,8,64 ;;
    bench1) for i in 1 2; do bench $BASE base$i 1; bench $NEW new$i 1; done ;;
    bench) bench $NEW full 1,8,64 ;;
  esac
  echo "($st: $(( $(date +%s) - t0 )) s)"
done
