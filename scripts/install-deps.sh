#!/usr/bin/env bash
# Installs everything Ladder needs on a fresh Debian 12 machine (idempotent).
# Build: compiler, cmake, OpenBLAS, sentencepiece, yaml-cpp, nlohmann-json, CLI11, fmt, zstd, xxhash,
# SQLite, GoogleTest. Tests: Debian's python3-torch (the independent reference model).
# Data: text that Debian packages ship, used for the built-in default corpus.
set -euo pipefail
PKGS=(
  build-essential cmake ninja-build pkg-config
  libopenblas-openmp-dev libsentencepiece-dev sentencepiece libyaml-cpp-dev nlohmann-json3-dev
  libcli11-dev libfmt-dev libzstd-dev zstd libxxhash-dev zlib1g-dev libsqlite3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch python3-numpy
  chromium                       # the report test renders the HTML headless
  bible-kjv bible-kjv-text fortunes fortunes-min jargon-text wordnet-base
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "install-deps: all dependencies present"
