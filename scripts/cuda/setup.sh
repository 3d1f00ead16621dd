#!/usr/bin/env bash
# Installs the pinned PyPI CUDA 13.0 build toolchain (nvcc, nvvm, cudart, cccl, crt) into the
# git-ignored `.cuda/` folder of the repository root, and the headers of the pinned
# `flashinfer-python` wheel (sha256 checked; FlashInfer with the CUTLASS and CCCL it bundles)
# into `.cuda/flashinfer`. Idempotent: does nothing when both are there. Prints the
# CUDA_HOME to export for `cargo build -p kimi-cuda --features cuda` (the FlashInfer folder
# is found from it).
set -euo pipefail
cd "$(dirname "$0")/../.."
# curand: headers that FlashInfer's CUTLASS utilities include.
PIN="cuda-toolkit[nvcc,nvvm,cudart,cccl,crt,curand]==13.0.2"
CUDA_HOME="$PWD/.cuda/nvidia/cu13"
if [ -x "$CUDA_HOME/bin/nvcc" ] && "$CUDA_HOME/bin/nvcc" --version | grep -q "release 13.0" \
  && [ -f "$CUDA_HOME/include/curand_kernel.h" ]; then
  echo "nvcc 13.0 already installed" >&2
else
  # --upgrade: replace an older install in place (pip skips existing folders otherwise).
  python3 -m pip install --disable-pip-version-check --no-input --upgrade --target .cuda "$PIN"
fi
# FlashInfer's headers and the CUTLASS 4.5 and CCCL it bundles (kimi-cuda-kernels/cutlass and
# /flashinfer): only those include trees of the wheel, into .cuda/flashinfer.
FI_WHEEL=flashinfer_python-0.7.2.post1-py3-none-any.whl
FI_SHA256=bfdc18b9e1e4d8d0730fe4343dc0e284cd0c160086de80f99888bc4867922d49
if [ ! -f .cuda/flashinfer/include/flashinfer/attention/hopper/prefill_sm90.cuh ]; then
  tmp=$(mktemp -d)
  python3 -m pip download --disable-pip-version-check --no-input --no-deps -q \
    -d "$tmp" flashinfer-python==0.7.2.post1
  echo "$FI_SHA256  $tmp/$FI_WHEEL" | sha256sum -c --quiet
  rm -rf .cuda/flashinfer
  python3 - "$tmp/$FI_WHEEL" .cuda/flashinfer <<'PY'
import os, sys, zipfile
keep = ["include/", "cutlass/include/", "cutlass/tools/util/include/",
        "cccl/libcudacxx/include/", "cccl/cub/", "cccl/thrust/"]
root = "flashinfer/data/"
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        rel = name[len(root):] if name.startswith(root) else None
        if rel and not name.endswith("/") and any(rel.startswith(k) for k in keep):
            dst = os.path.join(sys.argv[2], rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with z.open(name) as src, open(dst, "wb") as out:
                out.write(src.read())
PY
  rm -rf "$tmp"
fi
grep -qx '/.cuda' .gitignore 2>/dev/null || echo '/.cuda' >> .gitignore
"$CUDA_HOME/bin/nvcc" --version | tail -n 2 >&2
echo "CUDA_HOME=$CUDA_HOME"
