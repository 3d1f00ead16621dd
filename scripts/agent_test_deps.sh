#!/usr/bin/env bash
# Installs what the agent tests need besides Rust: the official `mcp` Python package (its
# FastMCP server runs as the tests' MCP server, tests/agent/mcp_server.py), pinned, in
# target/agent-venv (gitignored). Idempotent. Exit status 2 when PyPI cannot be reached,
# so that scripts/test.sh can tell an outage from a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

MCP_VERSION=1.30.0
VENV=target/agent-venv

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import mcp, importlib.metadata as m; assert m.version('mcp') == '$MCP_VERSION'" 2>/dev/null; then
  exit 0
fi
rm -rf "$VENV"
if ! python3 -m venv "$VENV" 2>/dev/null; then
  # Debian's python3 has no ensurepip until python3-venv is installed.
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    rm -rf "$VENV"
    python3 -m venv "$VENV"
  else
    echo "python3 -m venv failed; install python3-venv" >&2
    exit 1
  fi
fi
if ! "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "mcp==$MCP_VERSION"; then
  rm -rf "$VENV"
  exit 2
fi
