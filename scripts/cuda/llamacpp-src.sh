#!/usr/bin/env bash
# A trimmed llama.cpp source tarball for the GPU machine (no network there), which
# scripts/cuda/device-bench.sh's `llamacpp` stage builds with CUDA: .device-bin/llamacpp-src.tar.gz
# (git-ignored), about 5 MB, holding `llama.cpp/` with what a CUDA or CPU build of llama-bench
# configures and compiles (CMake files, include, src, common, vendor, tools without the server
# and its web UI, ggml with only its CPU and CUDA backends) plus gguf-py/ for
# scripts/cuda/random-kimi-gguf.py. Nothing in it is changed: files are only left out (docs,
# examples, tests, models, media, .github, the other backends, the server).
#
# Source: the same llama-cpp-python 0.3.36 sdist as bench/llamacpp/build.sh (llama.cpp commit
# 0c1e57098 in vendor/llama.cpp), fetched into target/llamacpp/dl/ and checked by its sha256;
# a download build.sh already made is reused.
#
# Env: LLAMACPP_DIR (default target/llamacpp), OUT_TAR (default .device-bin/llamacpp-src.tar.gz).
set -euo pipefail
cd "$(dirname "$0")/../.."

ROOT=${LLAMACPP_DIR:-target/llamacpp}
OUT_TAR=${OUT_TAR:-.device-bin/llamacpp-src.tar.gz}
PKG_VER=0.3.36
SDIST=llama_cpp_python-$PKG_VER.tar.gz
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMA_COMMIT=0c1e57098
log() { echo "[llamacpp-src] $*" >&2; }

# The kept paths, relative to vendor/llama.cpp. Left out of ggml/src: every backend but
# ggml-cpu and ggml-cuda (their directories are only entered when GGML_<NAME>=ON). Left out
# of tools: server, cli and ui (only with LLAMA_BUILD_SERVER=ON).
KEEP=(
  CMakeLists.txt LICENSE AUTHORS licenses cmake include src common vendor gguf-py
  ggml/CMakeLists.txt ggml/cmake ggml/include ggml/src/ggml-cpu ggml/src/ggml-cuda
)

mkdir -p "$ROOT/dl"
if ! echo "$SDIST_SHA256  $ROOT/dl/$SDIST" | sha256sum -c --status 2>/dev/null; then
  log "downloading $SDIST from PyPI"
  python3 -m pip download --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$PKG_VER" -d "$ROOT/dl"
  echo "$SDIST_SHA256  $ROOT/dl/$SDIST" | sha256sum -c
fi

STAGE=$(mktemp -d "$ROOT/trim.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
PREFIX=llama_cpp_python-$PKG_VER/vendor/llama.cpp
tar -xzf "$ROOT/dl/$SDIST" -C "$STAGE" "$PREFIX"
SRC=$STAGE/$PREFIX
DST=$STAGE/llama.cpp
mkdir -p "$DST/ggml/src" "$DST/tools"
for p in "${KEEP[@]}"; do
  mkdir -p "$DST/$(dirname "$p")"
  cp -a "$SRC/$p" "$DST/$p"
done
# ggml/src's own files (not its backend directories).
find "$SRC/ggml/src" -maxdepth 1 -type f -exec cp -a {} "$DST/ggml/src/" \;
# tools: every tool tools/CMakeLists.txt adds without the server.
cp -a "$SRC/tools/CMakeLists.txt" "$DST/tools/"
for t in "$SRC"/tools/*/; do
  t=$(basename "$t")
  case $t in server | cli | ui) ;; *) cp -a "$SRC/tools/$t" "$DST/tools/$t" ;; esac
done
{
  echo "llama.cpp commit $LLAMA_COMMIT, from vendor/llama.cpp of the PyPI sdist $SDIST"
  echo "(sha256 $SDIST_SHA256), trimmed by kimi-infer's scripts/cuda/llamacpp-src.sh:"
  echo "files left out, none changed. Kept: ${KEEP[*]}, ggml/src/*.{c,cpp,h},"
  echo "tools/ without server, cli, ui."
} > "$DST/TRIMMED.txt"

mkdir -p "$(dirname "$OUT_TAR")"
tar --sort=name --mtime='2000-01-01 00:00Z' --owner=0 --group=0 --numeric-owner \
  -C "$STAGE" -cf - llama.cpp | gzip -9n > "$OUT_TAR.tmp"
mv "$OUT_TAR.tmp" "$OUT_TAR"
log "wrote $OUT_TAR ($(du -k "$OUT_TAR" | cut -f1) KiB, $(tar -tzf "$OUT_TAR" | wc -l) entries)"
