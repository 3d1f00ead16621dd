#!/usr/bin/env bash
# GGUF on CUDA (session 16, g1): a Kimi Linear 0.5B random config converted on the device to
# q8_0 and q4_k_m GGUF files (kv_b joined as f16, read as stored by the CUDA MLA kernels), then
# the logits of the same ids on the CPU and on CUDA, all at once, 5 and 1 token at a time
# (absorbed MLA decode). CUDA widens block-quantized weights to bf16 at load, so its reference
# is the CPU run with KIMI_WIDEN_QUANT=1 (the same bf16 weights); the CPU run on the quantized
# weights is printed for scale (this random model amplifies any perturbation along the
# sequence, see README.md). Run from the repo root with .device-bin carried; writes under $OUT.
set -uo pipefail
B=.device-bin/kimi-infer
CFG=bench/llamacpp/kimi-linear-0.5b.config.json
IDS=$(python3 -c "print(','.join(str((i*7919+13)%32000) for i in range(24)))")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for q in q8_0 q4_k_m; do
  f=/tmp/k-$q.gguf
  t0=$SECONDS
  $B convert --random-config $CFG --quant $q --out $f > /dev/null || exit 1
  echo "convert $q: $((SECONDS - t0)) s"
  $B logits -m $f --ids $IDS --out $OUT/$q-cpu.npy > /dev/null || exit 1
  KIMI_WIDEN_QUANT=1 $B logits -m $f --ids $IDS --out $OUT/$q-cpu-widened.npy > /dev/null || exit 1
  $B logits -m $f --ids $IDS --device cuda --out $OUT/$q-cuda.npy > /dev/null 2> $OUT/$q-cuda.err || { cat $OUT/$q-cuda.err; exit 1; }
  $B logits -m $f --ids $IDS --device cuda --step 1 --out $OUT/$q-cuda-step1.npy > /dev/null 2>> $OUT/$q-cuda.err || { cat $OUT/$q-cuda.err; exit 1; }
  $B logits -m $f --ids $IDS --device cuda --step 5 --out $OUT/$q-cuda-step5.npy > /dev/null 2>> $OUT/$q-cuda.err || { cat $OUT/$q-cuda.err; exit 1; }
done
python3 - "$OUT" <<'PY'
import sys, numpy as np
out = sys.argv[1]
worst = 0.0
for q in ["q8_0", "q4_k_m"]:
    ref = np.load(f"{out}/{q}-cpu-widened.npy")
    quant = np.load(f"{out}/{q}-cpu.npy")
    assert np.isfinite(ref).all()
    scale = float(np.linalg.norm(ref - quant) / np.linalg.norm(quant))
    print(f"{q:7s} cpu widened vs cpu quantized: rel {scale:.3e} (for scale)")
    for mode in ["cuda", "cuda-step1", "cuda-step5"]:
        got = np.load(f"{out}/{q}-{mode}.npy")
        rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        agree = float((got.argmax(-1) == ref.argmax(-1)).mean())
        worst = max(worst, rel) if np.isfinite(got).all() else float("inf")
        print(f"{q:7s} {mode:11s} rel {rel:.3e}  argmax agreement {agree:.3f}  finite {np.isfinite(got).all()}")
print("PASS" if worst < 2e-2 else "FAIL", f"worst rel {worst:.3e} (bound 2e-2, bf16 GPU path)")
PY
