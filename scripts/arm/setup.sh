#!/usr/bin/env bash
# Installs what cross-building and testing the workspace for aarch64-unknown-linux-gnu needs,
# from Debian's package archive only. Idempotent; prints `RUSTC=`, `RUSTDOC=` lines at the end.
#
# rustup cannot add a target here (its server is out of reach), and no registry carries the
# aarch64 standard library of the rustup rustc (1.95). Debian testing does carry a complete
# cross pair: rustc (amd64) and libstd-rust-dev for arm64, built together. So this script
#  - installs Debian bookworm's cross linker, aarch64 C library and qemu user-mode emulator
#    (gcc-aarch64-linux-gnu, libc6-dev-arm64-cross, qemu-user) with the system's apt;
#  - downloads rustc, rustdoc and the amd64 + arm64 standard libraries of Debian testing, with
#    the shared libraries they need (newer glibc, libstdc++, LLVM), through a private apt
#    configuration, and unpacks them with `dpkg -x` into .arm/root (git-ignored): nothing is
#    installed into the system from testing;
#  - puts wrappers in place of .arm/root/usr/bin/rustc and rustdoc, which start those binaries
#    through the unpacked glibc's own dynamic loader (`ld.so --library-path`), so the bookworm
#    system is left as it is and the processes they start (linker, build scripts) use its libs.
set -euo pipefail
cd "$(dirname "$0")/../.."
root_dir=$PWD/.arm
suite=${ARM_DEBIAN_SUITE:-forky}
mirror=${ARM_DEBIAN_MIRROR:-http://deb.debian.org/debian}

# 1. Bookworm's cross linker, aarch64 libc and qemu-aarch64.
need=()
for p in gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# 2. Debian testing's rustc + std for amd64 and arm64, unpacked into .arm/root.
apt_dir=$root_dir/apt
mkdir -p "$apt_dir"/etc/apt.conf.d "$apt_dir"/etc/preferences.d "$apt_dir"/etc/sources.list.d \
  "$apt_dir"/state/lists/partial "$apt_dir"/cache/archives/partial "$root_dir"/debs
touch "$apt_dir"/state/status
echo "deb [arch=amd64,arm64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" \
  >"$apt_dir"/etc/sources.list
cat >"$apt_dir"/apt.conf <<EOF
Dir::Etc "$apt_dir/etc";
Dir::State "$apt_dir/state";
Dir::State::status "$apt_dir/state/status";
Dir::Cache "$apt_dir/cache";
APT::Architecture "amd64";
APT::Architectures { "amd64"; "arm64"; };
APT::Sandbox::User "root";
Acquire::Check-Valid-Until "false";
Debug::NoLocking "true";
EOF
export APT_CONFIG=$apt_dir/apt.conf

stamp=$root_dir/root/.installed
if [ ! -f "$stamp" ] || [ ! -x "$root_dir/root/usr/bin/rustc.real" ]; then
  apt-get update -qq
  # rustc's own dependencies, less the C toolchain it expects to find (gcc, binutils, libc-dev:
  # the system's are used), followed recursively; plus both standard libraries.
  direct=$(apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks \
      --no-replaces --no-enhances rustc | sed -n 's/^ *Depends: //p' | tr -d '<>' |
    grep -vxE 'gcc|binutils|libc-dev|libc6-dev')
  libs=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
      --no-replaces --no-enhances $direct | grep -v '^ ' | tr -d '<>' | sort -u |
    grep -vxE 'gcc|binutils|libc-dev|libc6-dev|debconf|debconf-2.0|cdebconf')
  std_arm=$(apt-cache depends libstd-rust-dev:arm64 | sed -n 's/^ *Depends: //p' | grep '^libstd-rust-')
  pkgs="rustc $libs libstd-rust-dev:arm64 $std_arm"
  rm -rf "$root_dir"/debs/* "$root_dir"/root
  (cd "$root_dir"/debs && apt-get download -q $pkgs >/dev/null)
  mkdir -p "$root_dir"/root
  for d in "$root_dir"/debs/*.deb; do dpkg -x "$d" "$root_dir"/root; done
  # ~450 MB of indexes and caches, no longer needed.
  rm -rf "$root_dir"/debs/* "$apt_dir"/state/lists/* "$apt_dir"/cache/*.bin
  for tool in rustc rustdoc; do mv "$root_dir/root/usr/bin/$tool" "$root_dir/root/usr/bin/$tool.real"; done
  "$root_dir"/root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 --library-path \
    "$root_dir"/root/usr/lib/x86_64-linux-gnu "$root_dir"/root/usr/bin/rustc.real -V >"$stamp"
fi
# Wrappers in place of the binaries (rustdoc starts the rustc beside it to build doc tests).
# bash, not sh: dash drops environment variables whose names are not identifiers, such as
# cargo's CARGO_BIN_EXE_kimi-infer, on their way to rustc.
for tool in rustc rustdoc; do
  w=$root_dir/root/usr/bin/$tool
  cat >"$w.tmp" <<EOF
#!/bin/bash
# Debian testing's $tool, started by its own glibc's loader (see scripts/arm/setup.sh).
L="\$(cd "\$(dirname "\$0")/../lib/x86_64-linux-gnu" && pwd)"
exec "\$L/ld-linux-x86-64.so.2" --library-path "\$L" "\$0.real" "\$@"
EOF
  chmod +x "$w.tmp"
  if cmp -s "$w.tmp" "$w"; then rm "$w.tmp"; else mv "$w.tmp" "$w"; fi
done
echo "RUSTC=$root_dir/root/usr/bin/rustc"
echo "RUSTDOC=$root_dir/root/usr/bin/rustdoc"
