#!/usr/bin/env bash
# Builds llama.cpp as a side-by-side CPU baseline (see bench/llamacpp/README.md).
#
# Source: the sdist of llama-cpp-python==0.3.36 from PyPI, which vendors llama.cpp in
# vendor/llama.cpp (llama.cpp commit 0c1e57098 per the package's CHANGELOG). Nothing from
# llama.cpp is committed: the download, the sources and the build all live under
# target/llamacpp/ (git-ignored via /target).
#
# Builds only llama-bench, llama-completion (the non-interactive successor of the old
# llama-cli; in this llama.cpp version llama-cli is chat-only and needs the server build) and
# llama-quantize, Release, tuned for this CPU (GGML_NATIVE=ON; see ISA below for AMX CPUs),
# CPU backend only, static, no curl/OpenSSL, no server/tests/examples. Idempotent: does
# nothing if the binaries exist and were built with the same configuration.
#
# Env: LLAMACPP_DIR (default target/llamacpp), JOBS (default 2), NICE (default 19),
# LLAMACPP_TARGETS (space-separated; default "llama-bench llama-completion llama-quantize",
# e.g. LLAMACPP_TARGETS=llama-perplexity for BENCHMARKS.md's perplexity comparison).
set -euo pipefail
cd "$(dirname "$0")/../.."

ROOT=${LLAMACPP_DIR:-target/llamacpp}
JOBS=${JOBS:-2}
NICE=${NICE:-19}
PKG_VER=0.3.36
SDIST=llama_cpp_python-$PKG_VER.tar.gz
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMA_COMMIT=0c1e57098   # from CHANGELOG.md of llama-cpp-python 0.3.36 (the sdist has no .git)
CMAKE_PIP=cmake==3.31.6  # only used when no cmake >= 3.14 is on PATH
read -r -a TARGETS <<< "${LLAMACPP_TARGETS:-llama-bench llama-completion llama-quantize}"

mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
SRC=$ROOT/src/llama_cpp_python-$PKG_VER/vendor/llama.cpp
BUILD=$ROOT/build
BIN=$BUILD/bin
log() { echo "[llamacpp/build] $*" >&2; }

# 1. Source distribution from PyPI. `--no-binary llama-cpp-python` (not `:all:`): with :all:
#    pip would also build the sdist's build dependencies (cmake, ninja, ...) from source just to
#    read the metadata, which takes tens of minutes. This still fetches only the sdist.
if ! echo "$SDIST_SHA256  $ROOT/dl/$SDIST" | sha256sum -c --status 2>/dev/null; then
  log "downloading $SDIST from PyPI"
  mkdir -p "$ROOT/dl"
  python3 -m pip download --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$PKG_VER" -d "$ROOT/dl"
  echo "$SDIST_SHA256  $ROOT/dl/$SDIST" | sha256sum -c
fi

# 2. Unpack.
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  log "unpacking into $ROOT/src"
  rm -rf "$ROOT/src"; mkdir -p "$ROOT/src"
  tar -xzf "$ROOT/dl/$SDIST" -C "$ROOT/src"
fi

# 3. cmake: use one on PATH if >= 3.14, else a private venv with the PyPI cmake wheel.
CMAKE=""
if command -v cmake >/dev/null 2>&1; then
  v=$(cmake --version | head -1 | awk '{print $3}')
  if printf '3.14\n%s\n' "$v" | sort -V -C; then CMAKE=$(command -v cmake); fi
fi
if [ -z "$CMAKE" ]; then
  if [ ! -x "$ROOT/venv/bin/cmake" ]; then
    log "no cmake on PATH; installing $CMAKE_PIP into $ROOT/venv"
    python3 -m venv "$ROOT/venv"
    "$ROOT/venv/bin/python" -m pip install -q "$CMAKE_PIP"
  fi
  CMAKE=$ROOT/venv/bin/cmake
fi

# -march=native, except on CPUs with AMX: there ggml's AMX path (chosen by -march=native)
# crashed llama-bench (segfault in ggml_backend_amx_mul_mat, 2026-12-02, Xeon VM with
# amx_tile), so the ISA extensions are named one by one, AMX left out.
ISA=(-DGGML_NATIVE=ON)
if grep -qw amx_tile /proc/cpuinfo; then
  ISA=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_F16C=ON
    -DGGML_FMA=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
    -DGGML_AMX_BF16=OFF)
fi
CONF=(
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=OFF
  "${ISA[@]}"
  -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
  -DLLAMA_BUILD_COMMIT=$LLAMA_COMMIT
)
STAMP="pkg=$PKG_VER sdist=$SDIST_SHA256 conf=${CONF[*]} targets=${TARGETS[*]}"

built=1
for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || built=0; done
if [ "$built" = 1 ] && [ "$(cat "$ROOT/build.stamp" 2>/dev/null)" = "$STAMP" ]; then
  log "already built: $BIN ($("$BIN/${TARGETS[0]}" --version 2>&1 | grep -m1 version))"
  exit 0
fi

# 4. Configure and build.
t0=$(date +%s)
log "configuring with $("$CMAKE" --version | head -1)"
"$CMAKE" -S "$SRC" -B "$BUILD" "${CONF[@]}" 2>&1 | tee "$ROOT/configure.log" >&2
log "building ${TARGETS[*]} with -j$JOBS at nice $NICE"
nice -n "$NICE" "$CMAKE" --build "$BUILD" --config Release -j"$JOBS" --target "${TARGETS[@]}" \
  2>&1 | tee "$ROOT/build.log" | grep --line-buffered -E '^\[ *[0-9]+%\]|error|Error' >&2
secs=$(( $(date +%s) - t0 ))
for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || { log "missing $BIN/$t"; exit 1; }; done
echo "$STAMP" > "$ROOT/build.stamp"

# 5. Record what was built.
{
  echo "llama-cpp-python sdist: $SDIST sha256 $SDIST_SHA256"
  echo "llama.cpp commit (CHANGELOG): $LLAMA_COMMIT"
  echo "version: $("$BIN/${TARGETS[0]}" --version 2>&1 | tr '\n' ' ')"
  echo "cmake: $("$CMAKE" --version | head -1)"
  echo "compiler: $(${CC:-cc} --version | head -1)"
  echo "configure: ${CONF[*]}"
  echo "targets: ${TARGETS[*]}  jobs: $JOBS  nice: $NICE"
  echo "build seconds (configure + build): $secs"
  echo "native flags: $(grep -m1 -iE 'Adding CPU backend variant|-march' "$ROOT/configure.log" || true)"
  echo "host cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //') ($(nproc) cpus visible)"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} > "$ROOT/build-info.txt"
cat "$ROOT/build-info.txt" >&2
log "done in ${secs}s: $BIN"
