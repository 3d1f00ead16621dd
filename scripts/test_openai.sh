#!/usr/bin/env bash
# Runs tests/openai_client/test_openai.py: the official `openai` Python client against a
# real server on the demo model. Needs python3 (with venv) and PyPI access; the venv lives
# in target/ (gitignored).
set -euo pipefail
cd "$(dirname "$0")/.."

OPENAI_VERSION=3.57.0
PYTEST_VERSION=9.2.0
VENV=target/openai-venv

if [ ! -x "$VENV/bin/python" ]; then
  if ! python3 -m venv "$VENV" 2>/dev/null; then
    echo "python3 -m venv failed; on Debian: apt-get install python3-venv" >&2
    exit 1
  fi
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
  "openai==$OPENAI_VERSION" "pytest==$PYTEST_VERSION"

# The server binary: `kimi-infer serve` once the CLI has it, else the serve_demo example.
cargo build --release -p kimi-cli
cargo build --release -p kimi-server --example serve_demo

"$VENV/bin/python" -m pytest -q tests/openai_client/test_openai.py "$@"
