#!/usr/bin/env bash
# Installs Debian's redis-server (the tests of shared rate limits and the shared response
# cache start their own on a free loopback port; nothing runs as a service). Exit 0 when
# redis-server is on PATH afterwards, 1 when it cannot be installed (no apt, not root, or
# the archive cannot be reached).
set -euo pipefail
if command -v redis-server >/dev/null; then
  exit 0
fi
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  # policy-rc.d keeps the package from starting a system-wide server.
  policy=/usr/sbin/policy-rc.d
  created=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created=1
  fi
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server) >/dev/null 2>&1 || true
  [ "$created" = 1 ] && rm -f "$policy"
fi
command -v redis-server >/dev/null || { echo "redis-server could not be installed" >&2; exit 1; }
