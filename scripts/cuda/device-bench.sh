#!/usr/bin/env bash
# Everything measured on the GPU machine in one lease of the device, so that peers and kimi-infer run
# side by side on the same GPU. Build here first: scripts/cuda/build-check.sh; fetch the
# Python wheels (fla-core, flash-linear-attention, einops, openai) into .whl/ with
# scripts/cuda/fetch-wheels.sh; for the llamacpp stages, llama.cpp's source into
# .device-bin/llamacpp-src.tar.gz with scripts/cuda/llamacpp-src.sh. Then on the device, from the
# repository root:
#   scripts/cuda/device-bench.sh OUT_DIR [check] [quant] [int4-model] [ncu-int4] [fp8-kv] [nccl] [kernels] [profile] [ncu] [peers] [bench] [hf] [serve] [serve-cpu] [k3-stack] [k3-big] [k3-offload] [offload] [split] [ranks] [k3-ranks] [experts-cpu] [llamacpp-prep] [llamacpp]
# (no stage names = all). Each stage writes OUT_DIR/<stage>.txt (+ JSON where it has one).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-device-results/run}"
shift || true
STAGES="${*:-check kernels peers bench hf serve}"
mkdir -p "$OUT"
want() { [[ " $STAGES " == *" $1 "* ]]; }
# Waits up to $2 seconds for a server on port $1 to answer /health.
wait_healthy() {
  for _ in $(seq 1 "$2"); do
    curl -sf "localhost:$1/health" >/dev/null 2>&1 && return 0
    sleep 1
  done
}
CONFIG=crates/kimi-core/tests/data/kimi-linear-48b-a3b-instruct.config.json
# cut_config, cuBLAS on the library path.
source scripts/cuda/device-env.sh
# NCCL (libnccl.so.2, linked as libnccl.so for cudarc): `check nccl`, several GPUs.
source scripts/cuda/nccl-lib.sh
# Carried wheels, installed into a private folder (the machine has no network).
PYLIB=/tmp/kimi-pylib
if [ -d .whl ] && [ ! -d "$PYLIB" ]; then
  python3 -m pip install -q --no-deps --no-index --target "$PYLIB" .whl/*.whl 2>&1 | tail -2
  python3 -m pip install -q --no-index --find-links .whl/openai --target "$PYLIB/openai-env" openai==3.57.0 2>&1 | tail -2
fi
export PYTHONPATH="$PYLIB:${PYTHONPATH:-}"
{
  echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) binaries built from $(cat .device-bin/COMMIT 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>&1
  python3 -c 'import fla; print("fla", fla.__version__)' 2>&1 | tail -1
} | tee "$OUT/env.txt"

if want check; then
  timeout 240 .device-bin/check ops fixtures 2>&1 | tee "$OUT/check.txt"
fi
# Quantized weights kept packed on CUDA (Q4Z/Q8Z/F8S, ggml Q4_0/Q4_1/Q8_0/Q4_K) against the CPU
# backend, then their GEMV at Kimi-Linear-48B shapes against bf16.
if want quant; then
  timeout ${QUANT_TIMEOUT:-150} .device-bin/check quant-ops 2>&1 | tee "$OUT/quant-ops.txt" | tail -40
  timeout ${QUANT_TIMEOUT:-150} .device-bin/check quant-bench 2>&1 | tee "$OUT/quant-bench.txt"
fi
# Issue 27's INT4 decode: the 48B model's random weights as bf16, then with its linear layers
# 4-bit (`--random-dtype q4z`, kept packed: KIMI_CUDA_PACKED_QUANT=1), decode at batch
# 1/16/64 and prefill, for the runs INT4_RUNS names (default `bf16 q4z q4z-mma`);
# INT4_LAYERS cuts the config (16 fit an H100's bf16 baseline). `check quant-ops` and
# `k3-ops` first (the 4-bit and MXFP4 expert kernels against the CPU).
# One decode step at batch 1 (NCU_BATCHES) of the 48B cut to INT4_LAYERS (default 16) layers,
# bf16 against 4-bit linear layers kept packed, op by op under Nsight Compute.
if want ncu-int4; then
  cut_config "$CONFIG" "${INT4_LAYERS:-16}" /tmp/int4-config.json
  NCU="ncu --profile-from-start off --clock-control none --csv --page raw --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum"
  for dt in bf16 q4z; do
    CHECK_CONFIG=/tmp/int4-config.json CHECK_DTYPE=$dt KIMI_CUDA_PACKED_QUANT=1 KIMI_CUDA_INT4_LAYER=${NCU_INT4_LAYER:-1} KIMI_CUDA_INT4_GEMV=${NCU_INT4_GEMV:-1} NCU_BATCH=${NCU_BATCHES:-1} \
      timeout ${NCU_TIMEOUT:-200} $NCU .device-bin/check ncu-step > "$OUT/ncu-int4-$dt.csv" 2> "$OUT/ncu-int4-$dt.err"
    echo "== $dt"; tail -3 "$OUT/ncu-int4-$dt.err"
    python3 scripts/cuda/ncu_summary.py "$OUT/ncu-int4-$dt.csv" 30 | tee "$OUT/ncu-int4-$dt.txt"
    gzip -f "$OUT/ncu-int4-$dt.csv"
  done
fi
if want int4-model; then
  KIMI_CUDA_INT4_LAYER=1 KIMI_CUDA_INT4_GEMV=1 timeout ${QUANT_TIMEOUT:-150} .device-bin/check quant-ops k3-ops 2>&1 | tee "$OUT/int4-ops.txt" | grep -E "FAIL|ERROR|RESULT|cases" | tail -20
  cfg=$CONFIG
  if [ -n "${INT4_LAYERS:-}" ]; then
    cut_config "$CONFIG" "$INT4_LAYERS" /tmp/int4-config.json
    cfg=/tmp/int4-config.json
  fi
  # q4z: the 4-bit model as it runs by default (one-token layers and products streamed);
  # q4z-mma: its experts on the tensor-core kernels and its products on `quant_gemv_*`.
  for run in ${INT4_RUNS:-bf16 q4z q4z-mma}; do
    dt=${run%-*}
    layer=1; gemv=1
    [ "$run" = q4z-mma ] && layer=0 && gemv=0
    echo "== $run"
    KIMI_CUDA_PACKED_QUANT=1 KIMI_CUDA_INT4_LAYER=$layer KIMI_CUDA_INT4_GEMV=$gemv timeout ${INT4_TIMEOUT:-150} .device-bin/kimi-infer bench --device cuda \
      --random-config "$cfg" --random-dtype $dt --prompt-len ${INT4_PROMPT:-2048} --gen-len 8 \
      --repeats 1 --decode-batch 1,16,64 --context 512 --decode-steps 16 \
      --json "$OUT/int4-model-$run.json" 2>&1 | tee "$OUT/int4-model-$run.txt" | grep -E "^(prefill|decode|loaded|device mem)"
  done
fi
# MLA over an FP8 E4M3 latent cache (`--kv-cache-dtype fp8`) against the CPU backend's FP8
# cache: the op at several shapes, then the Kimi Linear fixtures (`check fp8-kv`).
if want fp8-kv; then
  timeout ${FP8_KV_TIMEOUT:-300} .device-bin/check fp8-kv 2>&1 | tee "$OUT/fp8-kv.txt"
fi
# NCCL behind the collective interface, every op against the threads' implementation (world 1
# on one GPU; one rank per visible GPU otherwise).
if want nccl; then
  timeout 120 .device-bin/check nccl 2>&1 | tee "$OUT/nccl.txt"
fi
# A model over two ranks on GPU 0 (threads meeting in ThreadGroup) against one rank: the
# CUDA side of tensor and expert parallelism without a second GPU.
if want split; then
  timeout ${SPLIT_TIMEOUT:-240} .device-bin/check split 2>&1 | tee "$OUT/split.txt"
fi
# Several GPUs: one process per GPU (`--distributed-executor-backend mp`, the default on
# CUDA) over RANKS_TP (2) GPUs, NCCL between them. The fixtures' logits at -t RANKS_TP
# (tensor, then expert parallel) against -t 1, then the 48B model's random weights
# (RANKS_LAYERS layers, default all) decoding and prefilling at -t 1 and -t RANKS_TP.
if want ranks; then
  tp=${RANKS_TP:-2}
  {
    nvidia-smi -L
    for fixture in fixtures/kimi-k3/k3-tiny-7l fixtures/kimi-linear/native-f32-short; do
      name=$(basename "$fixture")
      ids=1,5,9,2,7,3,11
      timeout 120 .device-bin/kimi-infer logits --device cuda --model "$fixture" --ids $ids \
        --out "$OUT/ranks-$name-1.npy" 2>&1 | tail -1
      for ep in "" "--enable-expert-parallel"; do
        tag=$([ -n "$ep" ] && echo ep || echo tp)
        timeout 180 .device-bin/kimi-infer logits --device cuda --model "$fixture" --ids $ids \
          -t "$tp" $ep --out "$OUT/ranks-$name-$tag$tp.npy" 2>&1 | tail -3
        python3 - "$OUT/ranks-$name-1.npy" "$OUT/ranks-$name-$tag$tp.npy" "$name $tag=$tp" <<'PY'
import sys
import numpy as np
try:
    a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
    err = float(np.linalg.norm(b - a) / np.linalg.norm(a))
    print(f"{sys.argv[3]}: rel err {err:.2e} against one GPU ({'ok' if err < 1e-2 and np.isfinite(b).all() else 'FAIL'})")
except Exception as e:
    print(f"{sys.argv[3]}: FAIL ({e})")
PY
      done
    done
    cfg=$CONFIG
    if [ -n "${RANKS_LAYERS:-}" ]; then
      cut_config "$CONFIG" "$RANKS_LAYERS" /tmp/ranks-config.json
      cfg=/tmp/ranks-config.json
    fi
    # One GPU, tensor parallel, expert parallel with token dispatch.
    for split in "1" "$tp" "$tp --enable-expert-parallel --expert-dispatch all-to-all"; do
      tag=$(echo "t$split" | tr -d ' ' | sed 's/--enable-expert-parallel--expert-dispatchall-to-all/-ep/')
      timeout ${RANKS_TIMEOUT:-300} .device-bin/kimi-infer bench --device cuda --random-config "$cfg" \
        -t $split --prompt-len 8192 --gen-len 8 --repeats 1 --decode-batch "${RANKS_BATCHES:-1,64,256}" \
        --context 1024 --decode-steps 8 --json "$OUT/ranks-bench-$tag.json" 2>&1 | tail -15
    done
  } 2>&1 | tee "$OUT/ranks.txt"
fi
# Kimi K3 at full width over every GPU of the machine (K3_RANKS_LAYERS layers, default 8),
# whole experts spread over the ranks with token dispatch: all of each rank's share on its
# GPU, then K3_RANKS_HOST of each rank's experts per layer in host RAM behind
# K3_RANKS_SLOTS slots (the way the full model fits one node).
if want k3-ranks; then
  g=${RANKS_TP:-$(nvidia-smi -L | wc -l)}
  cut_config crates/kimi-core/tests/data/kimi-k3-trimmed.config.json "${K3_RANKS_LAYERS:-8}" /tmp/k3-ranks.json
  {
    nvidia-smi -L
    for tiers in "" "--offload-experts ${K3_RANKS_HOST:-64} --expert-cache-slots ${K3_RANKS_SLOTS:-16}"; do
      tag=$([ -n "$tiers" ] && echo tiers || echo gpu)
      timeout ${K3_RANKS_TIMEOUT:-300} .device-bin/kimi-infer bench --device cuda \
        --random-config /tmp/k3-ranks.json -t "$g" --enable-expert-parallel \
        --expert-dispatch all-to-all $tiers --prompt-len 1024 --gen-len 8 --repeats 1 \
        --decode-batch 1,16,64 --context 1024 --decode-steps 8 \
        --json "$OUT/k3-ranks-$g-$tag.json" 2>&1 | tail -20
    done
  } 2>&1 | tee "$OUT/k3-ranks.txt"
fi
if want kernels; then
  timeout ${KERNELS_TIMEOUT:-240} .device-bin/check kda-bench mla-bench 2>&1 | tee "$OUT/kernels.txt"
fi
if want profile; then
  timeout 300 .device-bin/check profile 2>&1 | tee "$OUT/profile.txt"
fi
# Per-kernel device time of one decode step at B=1 and of one 8K prefill with bf16
# activations, op by op under Nsight Compute (scripts/cuda/ncu_summary.py sums it by kernel).
if want ncu; then
  NCU="ncu --profile-from-start off --clock-control none --csv --page raw --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum"
  NCU_BATCH=1 timeout 300 $NCU .device-bin/check ncu-step > "$OUT/ncu-b1.csv" 2> "$OUT/ncu-b1.err"
  python3 scripts/cuda/ncu_summary.py "$OUT/ncu-b1.csv" 40 | tee "$OUT/ncu-b1.txt"
  NCU_BATCH=1 NCU_HALF=1 timeout 300 $NCU .device-bin/check ncu-step > "$OUT/ncu-b1-half.csv" 2> "$OUT/ncu-b1-half.err"
  python3 scripts/cuda/ncu_summary.py "$OUT/ncu-b1-half.csv" 40 | tee "$OUT/ncu-b1-half.txt"
  NCU_BATCH=none NCU_PREFILL=8192 NCU_HALF=1 timeout 400 $NCU .device-bin/check ncu-step > "$OUT/ncu-p8k.csv" 2> "$OUT/ncu-p8k.err"
  python3 scripts/cuda/ncu_summary.py "$OUT/ncu-p8k.csv" 40 | tee "$OUT/ncu-p8k.txt"
  gzip -f "$OUT/ncu-b1.csv"; rm -f "$OUT/ncu-p8k.csv" "$OUT/ncu-b1-half.csv"
fi
if want peers; then
  # Kimi Linear's shapes, then Kimi K3's KDA (96 heads, safe gate computed in the kernel).
  timeout 400 python3 bench/fla_kda.py --decode-batch 1,64,256 --k3-heads 96 \
    --out "$OUT/fla_kda.json" 2>&1 | grep -v "^[ {}\[\]\"]" | tee "$OUT/peers.txt"
fi
if want bench; then
  timeout 420 .device-bin/kimi-infer bench --device cuda --random-config "$CONFIG" \
    --prompt-len "${PROMPTS:-1024,8192}" --gen-len 16 --repeats 1 \
    --decode-batch "${BATCHES:-1,8,64,256}" --context "${CONTEXT:-1024}" --decode-steps 8 \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
fi
if want hf; then
  timeout 420 python3 bench/transformers_baseline.py --config "$CONFIG" \
    --prefill 1024,8192 --decode-batch 1,8 --out "$OUT/transformers.json" 2>&1 | tail -12 | tee "$OUT/hf.txt"
fi
if want serve; then
  TOK=/tmp/kimi-synth-tok
  python3 bench/synthetic_tokenizer.py --vocab 163840 --out "$TOK" >/dev/null
  .device-bin/kimi-infer serve --device cuda --random-config "$CONFIG" --tokenizer "$TOK" \
    --served-model-name kimi-48b-random --port 8011 --max-model-len 4096 --max-num-seqs 64 \
    --max-num-batched-tokens 1024 > "$OUT/serve-server.log" 2>&1 &
  SERVER=$!
  wait_healthy 8011 120
  # Pre-built requests (--client raw) for the overhead comparison: the openai package spends
  # ~0.3-0.5 s building a 64-request level before any of it reaches the server (see
  # bench/serve_load.py); one pass with it follows for reference.
  PYTHONPATH="$PYLIB/openai-env:$PYTHONPATH" timeout 300 python3 bench/serve_load.py --client raw \
    --base-url http://127.0.0.1:8011/v1 --model kimi-48b-random --concurrency 1 16 16 16 64 64 64 \
    --num-requests 64 --max-tokens 64 --prompt-ids 512 --vocab 163840 --json "$OUT/serve.json" 2>&1 | tail -20 | tee "$OUT/serve.txt"
  # Sampled requests (temperature and top-p, drawn on the device) against the greedy ones.
  PYTHONPATH="$PYLIB/openai-env:$PYTHONPATH" timeout 200 python3 bench/serve_load.py --client raw \
    --base-url http://127.0.0.1:8011/v1 --model kimi-48b-random --concurrency 1 64 64 \
    --num-requests 64 --max-tokens 64 --prompt-ids 512 --vocab 163840 --temperature 0.8 --top-p 0.95 \
    --json "$OUT/serve-sampled.json" 2>&1 | tail -8 | tee -a "$OUT/serve.txt"
  PYTHONPATH="$PYLIB/openai-env:$PYTHONPATH" timeout 120 python3 bench/serve_load.py --client openai \
    --base-url http://127.0.0.1:8011/v1 --model kimi-48b-random --concurrency 16 64 \
    --num-requests 64 --max-tokens 64 --prompt-ids 512 --vocab 163840 --json "$OUT/serve-openai.json" 2>&1 | tail -6 | tee -a "$OUT/serve.txt"
  kill -TERM $SERVER; wait $SERVER
  # The same engine offline (no HTTP): the server-overhead baselines at concurrency 16 and 64.
  # `bench --batch` schedules at most 2 × 512 tokens per step; the server above got the same.
  # Both sides report their best of three waves (the first pays CUDA graph captures).
  for b in 16 64; do
    timeout 300 .device-bin/kimi-infer bench --device cuda --random-config "$CONFIG" \
      --prompt-len 512 --gen-len 64 --repeats 3 --batch $b --json "$OUT/serve-offline-$b.json" \
      2>&1 | tee -a "$OUT/serve.txt"
  done
fi
# The CPU backend serving the built-in demo model, with the server (and the offline engine it
# is compared with) on cores 0-1 and the load generator on other cores, so that the client's
# own CPU time does not count against the server as it does on a 2-core machine.
if want serve-cpu; then
  taskset -c 0,1 .device-bin/kimi-infer serve --threads 2 --port 8012 --max-num-seqs 64 \
    > "$OUT/serve-cpu-server.log" 2>&1 &
  SERVER=$!
  wait_healthy 8012 60
  PYTHONPATH="$PYLIB/openai-env:$PYTHONPATH" timeout 300 taskset -c 4-11 python3 bench/serve_load.py \
    --base-url http://127.0.0.1:8012/v1 --concurrency 1 16 64 --num-requests 64 --max-tokens 32 \
    --prompt-ids 64 --vocab 1212 --json "$OUT/serve-cpu.json" 2>&1 | tail -20 | tee "$OUT/serve-cpu.txt"
  kill -TERM $SERVER; wait $SERVER
  for b in 1 16 64; do
    timeout 120 taskset -c 0,1 .device-bin/kimi-infer bench --threads 2 --prompt-len 64 --gen-len 32 \
      --repeats 3 --batch $b --json "$OUT/serve-cpu-offline-$b.json" 2>&1 | tee -a "$OUT/serve-cpu.txt"
  done
fi
# Kimi K3 at full width (hidden 7168, 96 KDA heads, gated MLA, 896 MXFP4 experts top-16 in
# the 3584 latent, AttnRes), random weights: the released config cut to 2 and to 6 layers.
# Layers 2..5 of the deeper stack are one K3 block (3 KDA + 1 MLA, all LatentMoE), so the
# difference of the two runs is the cost of one block without the embedding and the head.
if want k3-stack; then
  K3FULL=crates/kimi-core/tests/data/kimi-k3-trimmed.config.json
  for n in ${K3_DEPTHS:-2 6}; do
    cut_config "$K3FULL" "$n" "/tmp/k3-$n.json"
    timeout ${K3_TIMEOUT:-280} .device-bin/kimi-infer bench --device cuda --random-config "/tmp/k3-$n.json" \
      --prompt-len "${K3_PROMPTS:-8192}" --gen-len 8 --repeats 1 \
      --decode-batch "${K3_BATCHES:-1,16,64,256}" --context "${CONTEXT:-1024}" --decode-steps 8 \
      --json "$OUT/k3-stack-$n.json" 2>&1 | tee "$OUT/k3-stack-$n.txt"
  done
fi
# Kimi K3's experts in tiers: the full-width config cut to K3_OFFLOAD_LAYERS (2: one LatentMoE
# layer; 4: KKKM, three) layers, K3_OFFLOAD_HOST (448, half) of its 896 experts per layer in
# host RAM behind K3_OFFLOAD_SLOTS (64) slots, MXFP4 fills laid out on the host and on the GPU
# (KIMI_CUDA_MXFP4_DEVICE_FILLS), `--offload-miss auto`.
if want k3-offload; then
  K3L=${K3_OFFLOAD_LAYERS:-2}
  cut_config crates/kimi-core/tests/data/kimi-k3-trimmed.config.json "$K3L" "/tmp/k3-$K3L.json"
  for fills in ${K3_OFFLOAD_FILLS:-0 1}; do
    KIMI_CUDA_MXFP4_DEVICE_FILLS=$fills timeout ${K3_OFFLOAD_TIMEOUT:-150} .device-bin/kimi-infer bench \
      --device cuda --random-config "/tmp/k3-$K3L.json" --prompt-len 64 --gen-len 4 --repeats 1 \
      --decode-batch 1,16 --context 256 --decode-steps 8 \
      --offload-experts "${K3_OFFLOAD_HOST:-448}" --expert-cache-slots "${K3_OFFLOAD_SLOTS:-64}" \
      --json "$OUT/k3-offload-$K3L-fills$fills.json" 2>&1 | tee "$OUT/k3-offload-$K3L-fills$fills.txt"
  done
fi
# Kimi K3 at full width cut to K3_BIG_LAYERS (default 4: KKKM) layers: decode graphs against
# op by op, 1,000 greedy tokens with every logit checked finite, 1K and 8K prefills.
if want k3-big; then
  timeout ${K3_BIG_TIMEOUT:-540} .device-bin/check k3-big "${K3_BIG_TOKENS:-1000}" 2>&1 | tee "$OUT/k3-big.txt"
fi
# Experts beyond GPU memory: the 48B model's routed experts partly in host RAM (computed on
# the CPU when cold) behind device cache slots; all on the GPU first, for the ratio. With
# slots, page-locked fills (the default) and staged ones (KIMI_CUDA_PIN_HOST_EXPERTS=0), and
# each miss policy (--offload-miss: auto balances copies against the CPU by measured costs).
# OFFLOAD_HOST: experts per layer (of 256) kept in host RAM; OFFLOAD_SLOTS: device slots;
# OFFLOAD_PIN: 1 and/or 0; OFFLOAD_MISS: auto, copy and/or cpu; OFFLOAD_SKEW: `bench
# --routing-skew` values (0: about uniform routing, the worst case for the cache);
# OFFLOAD_PREFETCH: `--offload-prefetch` values (router and/or next-layer); OFFLOAD_BEHIND: 0
# and/or 1 (`--offload-copy-behind`).
# First the fixtures in tiers against all resident on the device (`check offload`).
# OFFLOAD_LAYERS=N cuts the config to its first N layers, so that an all-on-GPU baseline fits a
# smaller card (16 of the 48B's 27 layers fit an H100's 80 GB).
if want offload; then
  [ -n "${OFFLOAD_SKIP_CHECK:-}" ] || timeout 240 .device-bin/check offload 2>&1 | tee "$OUT/offload-check.txt"
  if [ -n "${OFFLOAD_LAYERS:-}" ]; then
    cut_config "$CONFIG" "$OFFLOAD_LAYERS" /tmp/offload-config.json
    CONFIG=/tmp/offload-config.json
  fi
  for host in ${OFFLOAD_HOST:-0 128}; do
    for slots in ${OFFLOAD_SLOTS:-0 64}; do
      [ "$host" = 0 ] && [ "$slots" != 0 ] && continue
      for pin in ${OFFLOAD_PIN:-1 0}; do
        [ "$slots" = 0 ] && [ "$pin" = 0 ] && continue
        misses=${OFFLOAD_MISS:-copy}
        for miss in $misses; do
          # Without slots every miss is computed on the CPU: one run.
          [ "$slots" = 0 ] && [ "$miss" != "${misses%% *}" ] && continue
          flags=""
          [ "$host" != 0 ] && flags="--offload-experts $host --expert-cache-slots $slots --offload-miss $miss"
          for skew in ${OFFLOAD_SKEW:-0}; do
            prefetches=${OFFLOAD_PREFETCH:-router}
            for prefetch in $prefetches; do
             behinds=${OFFLOAD_BEHIND:-0}
             for behind in $behinds; do
              # Without slots nothing is copied: one run.
              [ "$slots" = 0 ] && [ "$prefetch" != "${prefetches%% *}" ] && continue
              [ "$slots" = 0 ] && [ "$behind" != "${behinds%% *}" ] && continue
              name="offload-$host-$slots-pin$pin-$miss-skew$skew"
              pf=""
              if [ "$host" != 0 ] && [ "$slots" != 0 ]; then
                pf="--offload-prefetch $prefetch"
                [ "$prefetch" != router ] && name="$name-$prefetch"
                [ "$behind" = 1 ] && pf="$pf --offload-copy-behind" && name="$name-behind"
              fi
              KIMI_CUDA_PIN_HOST_EXPERTS=$pin timeout ${OFFLOAD_TIMEOUT:-300} .device-bin/kimi-infer bench \
                --device cuda --random-config "$CONFIG" --routing-skew "$skew" \
                --prompt-len 256 --gen-len 8 --repeats 1 --decode-batch "${OFFLOAD_BATCHES:-1,16}" \
                --context 256 --decode-steps "${OFFLOAD_STEPS:-16}" $flags $pf \
                --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.txt"
             done
            done
          done
        done
      done
    done
  done
fi
# The host CPU's expert products (the cold experts of a host tier): its flags, then
# .device-bin/experts_bench (crates/kimi-cpu/examples/experts_bench.rs: bf16 SwiGLU experts at
# the 48B's shapes, 1 to 32 tokens each, f32 products and bf16 pair products) on
# EXPERTS_THREADS (16) threads over EXPERTS_COUNT (64) experts.
if want experts-cpu; then
  {
    lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|L2|L3)'
    echo "flags: $(grep -o -w -E 'avx2|avx512f|avx512_bf16|avx512_fp16|amx_bf16|amx_tile|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    timeout 240 .device-bin/experts_bench "${EXPERTS_THREADS:-16}" "${EXPERTS_COUNT:-64}"
  } 2>&1 | tee "$OUT/experts-cpu.txt"
fi
# Experts on the CPU against llama.cpp's: `-ngl 99 -ot exps=CPU` (every routed expert in host RAM,
# computed there; the rest on the GPU) and kimi-infer's `--offload-experts 256
# --expert-cache-slots 0`, then both all on the GPU, on one random bf16 GGUF of the 48B config cut to
# LLAMACPP_LAYERS (8: KKKMKKKM, ~28 GB) layers (scripts/cuda/random-kimi-gguf.py), and kimi-infer
# also on `--random-config` of that cut config. llama.cpp 0c1e57098 is built here (CUDA, sm_90a,
# llama-bench only) from .device-bin/llamacpp-src.tar.gz (scripts/cuda/llamacpp-src.sh), beside
# the GGUF's writing. Its prefill runs with -nopo 0 (its default: batches of 32+ tokens copy the
# CPU's expert weights to the GPU) and -nopo 1 (the CPU computes them). `llamacpp-prep` builds and
# writes the GGUF only; both steps are skipped when their output is in /tmp already.
# LLAMACPP_KIMI_SOURCES: `gguf` and/or `random` (kimi-infer's runs).
if want llamacpp-prep || want llamacpp; then
  LLC=/tmp/llama.cpp LLB=/tmp/llamacpp-build
  LLBENCH=$LLB/bin/llama-bench
  LAYERS=${LLAMACPP_LAYERS:-8}
  GGUF=/tmp/kimi-48b-${LAYERS}l.gguf GCONF=/tmp/kimi-48b-${LAYERS}l.config.json
  build_pid=""
  [ -f "$LLC/CMakeLists.txt" ] || tar -xzf .device-bin/llamacpp-src.tar.gz -C /tmp
  if [ ! -x "$LLBENCH" ] && [ -f "$LLC/CMakeLists.txt" ]; then
    (
      t0=$(date +%s)
      NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
      GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
      cmake -S "$LLC" -B "$LLB" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON -DGGML_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES=90a \
        -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_FA_QUANTS=f16-f16 -DGGML_CUDA_NCCL=OFF \
        -DGGML_CUDA_COMPRESSION_MODE=none -DGGML_CCACHE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_COMMIT=0c1e57098 \
        && timeout "${LLAMACPP_BUILD_TIMEOUT:-540}" cmake --build "$LLB" --config Release -j16 --target llama-bench
      echo "llama.cpp build: rc $? in $(( $(date +%s) - t0 )) s"
    ) > "$OUT/llamacpp-build.log" 2>&1 &
    build_pid=$!
  fi
  if [ ! -s "$GGUF" ]; then
    timeout "${LLAMACPP_GGUF_TIMEOUT:-400}" python3 scripts/cuda/random-kimi-gguf.py --config "$CONFIG" \
      --layers "$LAYERS" --out "$GGUF" --write-config "$GCONF" --gguf-py "$LLC/gguf-py" \
      --threads 8 2>&1 | tee -a "$OUT/llamacpp.txt"
  fi
  if [ -n "$build_pid" ]; then
    wait "$build_pid"
    { grep -m5 -E "error|FAILED" "$OUT/llamacpp-build.log"; tail -3 "$OUT/llamacpp-build.log"; } \
      | tee -a "$OUT/llamacpp.txt"
  fi
fi
if want llamacpp; then
  THREADS=${LLAMACPP_THREADS:-16}
  if [ -x "$LLBENCH" ] && [ -s "$GGUF" ]; then
    for mode in ot-cpu gpu; do
      flags=(-nopo 0); [ "$mode" = ot-cpu ] && flags=(-ot exps=CPU -nopo "0,1")
      timeout "${LLAMACPP_TIMEOUT:-300}" "$LLBENCH" -m "$GGUF" -ngl 99 "${flags[@]}" -t "$THREADS" \
        -p 256 -n 32 -r 2 -o json > "$OUT/llamacpp-$mode.json" 2> "$OUT/llamacpp-$mode.err"
      echo "llama-bench $mode: rc $?" | tee -a "$OUT/llamacpp.txt"
      python3 - "$OUT/llamacpp-$mode.json" "$mode" <<'PY' 2>&1 | tee -a "$OUT/llamacpp.txt"
import json, sys
for r in json.load(open(sys.argv[1])):
    print("llama.cpp %s nopo=%s pp%d tg%d: %.1f +- %.1f tokens/s" % (sys.argv[2], r.get("no_op_offload"),
          r["n_prompt"], r["n_gen"], r["avg_ts"], r["stddev_ts"]))
PY
    done
  else
    echo "llamacpp: no $LLBENCH or $GGUF: llama.cpp skipped" | tee -a "$OUT/llamacpp.txt"
  fi
  for src in ${LLAMACPP_KIMI_SOURCES:-gguf random}; do
    model=(--model "$GGUF"); [ "$src" = random ] && model=(--random-config "$GCONF")
    [ -s "${model[1]}" ] || continue
    for mode in ot-cpu gpu; do
      flags=(); [ "$mode" = ot-cpu ] && flags=(--offload-experts 256 --expert-cache-slots 0 --offload-miss cpu)
      timeout "${LLAMACPP_TIMEOUT:-300}" .device-bin/kimi-infer bench --device cuda "${model[@]}" \
        --threads "$THREADS" --prompt-len 256 --gen-len 32 --repeats 2 --decode-batch 1,16 \
        --context 256 "${flags[@]}" --json "$OUT/llamacpp-kimi-$src-$mode.json" 2>&1 \
        | tee "$OUT/llamacpp-kimi-$src-$mode.txt" | grep -E "^(loaded|prefill|decode)|  experts|rror" \
        | sed "s/^/kimi-infer $src $mode: /" | tee -a "$OUT/llamacpp.txt"
    done
  done
fi
echo "# done: $STAGES" | tee -a "$OUT/env.txt"
