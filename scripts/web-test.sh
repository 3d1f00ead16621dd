#!/usr/bin/env bash
# The web page at `/` in headless Chromium (Debian's package) against two real
# `kimi-infer serve`s, the demo model with an API key and a tiny Kimi K3 MoE fixture:
# tests/web/web_test.mjs chats, stops a stream, reads the dashboard, the reasoning and the
# expert heatmap, and fails on any console error.
# A screenshot goes to target/web-test/ (WEB_TEST_OUT overrides). Exit 2: Chromium, node
# or playwright-core (npm, pinned) could not be installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PLAYWRIGHT_VERSION=1.65.2
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
OUT=${WEB_TEST_OUT:-target/web-test}
NODE_DIR=target/web-node
mkdir -p "$OUT" "$NODE_DIR"

if [ ! -x "$CHROMIUM" ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 || true
  fi
  [ -x "$CHROMIUM" ] || { echo "chromium is not installed at $CHROMIUM" >&2; exit 2; }
fi
command -v node >/dev/null || { echo "node is not installed" >&2; exit 2; }
if [ ! -f "$NODE_DIR/node_modules/playwright-core/package.json" ] ||
   ! grep -q "\"version\": \"$PLAYWRIGHT_VERSION\"" "$NODE_DIR/node_modules/playwright-core/package.json"; then
  npm install --silent --no-audit --no-fund --prefix "$NODE_DIR" "playwright-core@$PLAYWRIGHT_VERSION" >/dev/null ||
    { echo "npm could not install playwright-core@$PLAYWRIGHT_VERSION" >&2; exit 2; }
fi

# KIMI_BIN: a kimi-infer already built (scripts/test.sh passes the one `cargo test` made).
if [ -n "${KIMI_BIN:-}" ]; then
  bin=$KIMI_BIN
else
  cargo build --release -p kimi-cli
  bin="${CARGO_TARGET_DIR:-target}/release/kimi-infer"
fi

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
servers=()
trap 'for p in "${servers[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null || true; done' EXIT
# start_server LOG PORT ARGS...: serves in the background and waits for /health.
start_server() {
  local log=$1 port=$2; shift 2
  # A small cache: the default plan would reserve most of the machine's memory.
  "$bin" serve --host 127.0.0.1 --port "$port" --max-num-seqs 4 --max-model-len 2048 "$@" >"$log" 2>&1 &
  servers+=($!)
  for _ in $(seq 1 300); do
    curl -fs "http://127.0.0.1:$port/health" >/dev/null && return 0
    kill -0 "${servers[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  cat "$log" >&2; return 1
}
scripts/fetch_demo_model.sh
key="web-test-$RANDOM$RANDOM"
demo_port=$(free_port); moe_port=$(free_port)
start_server "$OUT/demo-server.log" "$demo_port" -m models/SmolLM2-135M-Instruct.Q4_1.gguf --api-key "$key"
start_server "$OUT/moe-server.log" "$moe_port" -m fixtures/kimi-k3/k3-tiny-7l

# The driver imports playwright-core from target/web-node (outside the source tree).
cp tests/web/web_test.mjs "$NODE_DIR/web_test.mjs"
CHROMIUM="$CHROMIUM" node "$NODE_DIR/web_test.mjs" "http://127.0.0.1:$demo_port" "$key" \
  "http://127.0.0.1:$moe_port" "$OUT"
echo "screenshot: $OUT/web-page.png"
