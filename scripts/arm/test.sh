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
if [ $# -eq 0 ]; then
  # The crates whose code differs on aarch64 (kimi-cpu's NEON kernels, `half`'s fp16
  # conversions) and those whose tests run the model on them end to end (kimi-model's
  # goldens and GGUF generations, the GGUF decoders, the collectives). The serving crates
  # (kimi-engine, kimi-server, kimi-gateway, kimi-hub, kimi-tokenizer) hold no
  # architecture-specific code and are tested on x86-64; emulating them cost CI minutes.
  # Not here either: the CUDA crates (stubs without their feature), kimi-cli, whose tests
  # start the aarch64 `kimi-infer` binary as a child process (that needs qemu registered
  # with binfmt_misc, which a container may not allow), and kimi-agent, whose sandbox
  # (seccomp, landlock) acts on the real kernel, which qemu-user does not emulate.
  set -- -p kimi-cpu -p kimi-model -p kimi-gguf -p kimi-ops -p kimi-core -p kimi-weights
fi
cargo test --target "$target" "$@"
