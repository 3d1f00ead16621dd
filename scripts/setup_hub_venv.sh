#!/usr/bin/env bash
# Installs the official `huggingface_hub` (pinned) into target/hub-venv for the test that
# shares the hub cache with it (crates/kimi-cli/tests/hub.rs). Idempotent: nothing is
# fetched once the pinned version is there.
# Exit status: 0 installed; 2 PyPI cannot be reached (the test is then skipped with a
# WARNING); anything else is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

HF_HUB_VERSION=2.4.0
VENV=target/hub-venv

installed() {
  "$VENV/bin/python" -c "import sys, huggingface_hub as h; sys.exit(h.__version__ != '$HF_HUB_VERSION')" 2>/dev/null
}
if installed; then
  exit 0
fi

make_venv() {
  rm -rf "$VENV"
  python3 -m venv "$VENV"
}
if ! make_venv 2>/dev/null; then
  # Debian's python3 has no ensurepip until python3-venv is installed.
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null) || exit 2
    make_venv
  else
    echo "python3 -m venv failed; install python3-venv (apt-get install python3-venv)" >&2
    exit 1
  fi
fi
if ! "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
  "huggingface_hub==$HF_HUB_VERSION"; then
  # Unreachable PyPI is an outage, not a failure of this code; anything else is.
  probe=$(mktemp -d)
  if ! "$VENV/bin/python" -m pip download --quiet --no-deps -d "$probe" \
    "huggingface_hub==$HF_HUB_VERSION" >/dev/null 2>&1; then
    rm -rf "$probe" "$VENV"
    exit 2
  fi
  rm -rf "$probe"
  exit 1
fi
installed
