#!/usr/bin/env bash
# Cross-builds the CPU crates for aarch64-unknown-linux-gnu and runs their tests (unit,
# integration and doc tests) under qemu-aarch64 user-mode emulation. The toolchain comes from
# scripts/arm/setup.sh (Debian's rustc + arm64 std; see there why not rustup's). Extra
# arguments go to `cargo test` (e.g. `scripts/arm/test.sh -p kimi-cpu -- simd`); with none,
# the crates below are tested. Run scripts/fetch_demo_model.sh first, or the tests that need
# the demo GGUF skip.
set -euo pipefail
cd "$(dirname "$0")/../.."
setup_out=$(scripts/arm/setup.sh)    # fails the script if the set-up fails
eval "$(sed -n 's/^\(RUSTC\|RUSTDOC\)=/export \1=/p' <<<"$setup_out")"

target=aarch64-unknown-linux-gnu
export CARGO_TARGET_DIR=$PWD/.arm/target    # apart from target/: another rustc, another target
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
# No debug info for this build: it would make .arm/target several times larger (~10 GB) and
# the links slower; panics still name their file and line.
export CARGO_PROFILE_DEV_DEBUG=false CARGO_PROFILE_TEST_DEBUG=false
# Tests with wall-clock bounds stretch them under emulation (kimi-server/tests/abuse.rs).
export KIMI_TEST_EMULATED=1

"$RUSTC" -V
if [ $# -gt 0 ]; then
  cargo test --target "$target" "$@"
  exit
fi
# With no arguments: the code that differs on aarch64 is kimi-cpu's (NEON kernels, each tested
# against its scalar twin) and `half`'s fp16 conversions, so kimi-cpu and the small crates
# under it (GGUF decoders, ops, core, weights) run whole, and of kimi-model the tests that
# run models on those kernels end to end: Kimi Linear against the transformers fixtures
# (golden), quantized checkpoints, K3 and Kimi Linear through GGUF, and the tiny Llama GGUF
# models. Left to x86-64, as they exercise no architecture-specific code of their own: the
# demo model's tests (135M parameters: eight minutes of CI under emulation for kernels the
# tests above already run), kimi-model's unit tests (a second build of the crate for
# arithmetic), its offload, FP8-cache and parallel tests, the serving crates (kimi-engine,
# kimi-server, kimi-gateway, kimi-hub, kimi-tokenizer), the CUDA crates (stubs without their
# feature), kimi-cli, whose tests start the aarch64 `kimi-infer` binary as a child process
# (that needs qemu registered with binfmt_misc, which a container may not allow), and
# kimi-agent, whose sandbox (seccomp, landlock) acts on the real kernel, which qemu-user does
# not emulate.
cargo test --target "$target" -p kimi-cpu -p kimi-gguf -p kimi-ops -p kimi-core -p kimi-weights
# (kimi-model's test files are modules of one binary, tests/integration.rs: filters by module.)
cargo test --target "$target" -p kimi-model --test integration -- \
  golden:: quantized:: llama_gguf:: gguf_kimi:: --skip demo_model_
