#!/usr/bin/env bash
# Installs everything Ladder needs on a fresh Debian 12 machine (idempotent).
# Build: compiler, cmake, OpenBLAS, sentencepiece, yaml-cpp, nlohmann-json, CLI11, fmt, zstd, xxhash,
# SQLite, GoogleTest, Open MPI. Tests: Debian's python3-torch (the independent reference model).
# Data: text that Debian packages ship, used for the built-in default corpus.
set -euo pipefail
PKGS=(
  build-essential cmake ninja-build pkg-config
  libopenblas-openmp-dev libsentencepiece-dev sentencepiece libyaml-cpp-dev nlohmann-json3-dev
  libcli11-dev libfmt-dev libzstd-dev zstd libxxhash-dev zlib1g-dev libsqlite3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenmpi-dev openmpi-bin     # data parallelism across processes (mpirun -np N ladder train ...)
  python3-torch python3-numpy
  python3-pip                    # fetches cuDNN's frontend headers (below), where the CUDA toolkit is
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

# cuDNN's C++ frontend (header-only, NVIDIA's own graph API over libcudnn) for the CUDA build's fused
# attention (docs/cuda.md "cuDNN attention"), only where the CUDA toolkit is: PyPI's wheel carries the
# headers; pip downloads it (no install) and its include/ folder is unpacked into .deps/ (git-ignored),
# where CMake finds it. Without it (no network) the CUDA build still builds, with Ladder's own
# attention kernels only, and says so.
FE_VERSION=1.32.0
FE_DIR="$(cd "$(dirname "$0")/.." && pwd)/.deps/cudnn-frontend"
if { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } && [ ! -f "$FE_DIR/VERSION-$FE_VERSION" ]; then
  echo "install-deps: cuDNN frontend $FE_VERSION headers into $FE_DIR (pip download)"
  tmp=$(mktemp -d)
  if python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --dest "$tmp" \
      "nvidia-cudnn-frontend==$FE_VERSION" >"$tmp/log" 2>&1 &&
    python3 - "$tmp" "$FE_DIR.tmp" <<'PY' &&
import glob, os, shutil, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
shutil.rmtree(dst, ignore_errors=True)
with zipfile.ZipFile(glob.glob(os.path.join(src, "*.whl"))[0]) as z:
    for name in z.namelist():
        if name.startswith("include/") and not name.endswith("/"):
            z.extract(name, dst)
PY
    [ -f "$FE_DIR.tmp/include/cudnn_frontend.h" ]
  then
    touch "$FE_DIR.tmp/VERSION-$FE_VERSION"
    rm -rf "$FE_DIR" && mv "$FE_DIR.tmp" "$FE_DIR"
  else
    tail -n 3 "$tmp/log"
    rm -rf "$FE_DIR.tmp"
    echo "install-deps: WARNING: could not fetch nvidia-cudnn-frontend $FE_VERSION; the CUDA build will have no cuDNN attention"
  fi
  rm -rf "$tmp"
fi
echo "install-deps: all dependencies present"
