#!/usr/bin/env bash
# Call C: packed slot fills laid out on the GPU (`check offload`), the symmetric random 4-bit
# weights: the whole 48B and 16 layers against bf16, and issue 25's 4-bit rows.
set -uo pipefail
cd "$(dirname "$0")"
(cd .device-bin && gunzip -kf check.gz kimi-infer.gz && chmod +x check kimi-infer)
source scripts/cuda/device-env.sh
O=$OUT/c; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $O/env.txt
cat .device-bin/COMMIT >> $O/env.txt
timeout 120 .device-bin/check offload > $O/check-offload.txt 2>&1
echo "== offload rc $?"; grep -E "slot fill|FAIL|ERROR" $O/check-offload.txt | grep -vE "Q8Z|Q4_0|Q8_0|Q4_1|F8S" | tail -12; grep -c "(ok)\|resident bits" $O/check-offload.txt
CFG=crates/kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json
cut_config $CFG 16 /tmp/cfg16.json
B=".device-bin/kimi-infer bench --device cuda --prompt-len 2048 --gen-len 8 --repeats 1 --decode-batch 1,16,64 --context 512 --decode-steps 16"
for run in l16-q4z:/tmp/cfg16.json:q4z l16-bf16:/tmp/cfg16.json:bf16; do
  IFS=: read -r name cfg dt <<<"$run"
  timeout 150 $B --random-config $cfg --random-dtype $dt --json $O/$name.json > $O/$name.txt 2>&1
  echo "== $name rc $?"; grep -E "^(prefill|decode|loaded|device mem)|routing" $O/$name.txt | head -12
done
export OFFLOAD_LAYERS=16 OFFLOAD_TIMEOUT=70
scripts/cuda/offload-table.sh $O/off g0q:0:0:0:q4z a50q:256:128:0:q4z
KIMI_CUDA_PACKED_DEVICE_FILLS=0 scripts/cuda/offload-table.sh $O/off-hostfills a50q:256:128:0:q4z
grep -hE "expert misses|hit rate|routing" $O/off/a50q.txt $O/off-hostfills/a50q.txt | head
timeout 110 $B --random-config $CFG --random-dtype q4z --json $O/full-q4z.json > $O/full-q4z.txt 2>&1
echo "== full-q4z rc $?"; grep -E "^(prefill|decode|loaded|device mem)|routing" $O/full-q4z.txt | head -12
