#!/usr/bin/env bash
# Run on a machine WITHOUT a GPU, before a GPU session (docs/cuda.md): builds the CUDA test and
# benchmark binaries for sm_90 and packs them, with the non-CUDA shared libraries they load
# (OpenBLAS, fmt, OpenMP, ...), into gpu-bundle/ (git-ignored). The GPU session names gpu-bundle in
# the device tool's `carry`; scripts/gpu-check.sh uses it when it cannot build on the GPU machine
# (whose image may lack this project's CPU dependencies). About 6 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${GPU_PREP_BUILD_DIR:-build-sm90}
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
# Allowed, but the bundle then holds changes no commit names: say so loudly (BUILD_INFO counts them).
dirty=$(git status --porcelain --untracked-files=no 2>/dev/null | wc -l)
if [ "$dirty" -gt 0 ]; then
  echo "gpu-prepare: WARNING: $dirty tracked files have uncommitted changes; the bundle is built from the working tree," \
    "not from commit $(git rev-parse --short HEAD 2>/dev/null)" >&2
fi
# The old bundle goes first: a failed build must not leave a stale one to be carried.
rm -rf gpu-bundle
# LADDER_NATIVE=OFF: AVX2+FMA only, so the host code also runs on the GPU machine's processor.
# LADDER_MPI=OFF: the GPU session runs one process; without MPI no Open MPI library (and its
# plugins) has to travel in the bundle.
# The configure output is kept (its "cuDNN attention: compiled / not compiled" line goes into BUILD_INFO).
mkdir -p "$B"
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLADDER_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DLADDER_NATIVE=OFF -DLADDER_MPI=OFF -DLADDER_TESTS=ON >"$B/gpu-prepare-configure.log" 2>&1 ||
  { tail -n 30 "$B/gpu-prepare-configure.log"; exit 1; }
cmake --build "$B" -j "${JOBS:-2}" --target ladder_cuda_tests ladder_cuda_bench ladder
# Staged in gpu-bundle/stage, then packed into one gzip'd tar: the device tool carries at most 64 MiB,
# and the three binaries (each with every kernel) plus OpenBLAS are ~66 MB raw, ~21 MB packed.
S=gpu-bundle/stage
mkdir -p "$S/lib"
cp "$B/ladder_cuda_tests" "$B/ladder_cuda_bench" "$B/ladder" "$S/"
# Bundle every resolved library except the C/C++ runtime (the GPU machine's own, newer ones) and
# CUDA's (the driver there must be used; cuBLASLt comes from the toolkit there).
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libstdc\+\+|libgcc_s|libcuda\.|libcudart|libcublas|libnvidia)'
for bin in "$S/ladder_cuda_tests" "$S/ladder_cuda_bench" "$S/ladder"; do
  ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  if ! [[ $name =~ $skip ]]; then cp -L "$path" "$S/lib/$name"; fi
done
{
  echo "commit $(git rev-parse HEAD)"
  echo "dirty $dirty tracked files changed"
  # "cuDNN attention: compiled (...)" or "not compiled (...)": from this build's configure output.
  grep -m1 -o 'cuDNN attention: .*' "$B/gpu-prepare-configure.log" ||
    echo 'cuDNN attention: unknown (no such line in the configure output)'
  grep -m1 -o 'NCCL: .*' "$B/gpu-prepare-configure.log" || echo 'NCCL: unknown (no such line in the configure output)'
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(nvcc --version 2>/dev/null | tail -1)"
} > "$S/BUILD_INFO"
cp "$S/BUILD_INFO" gpu-bundle/BUILD_INFO
ls -la "$S" "$S/lib"
tar czf gpu-bundle/bundle.tgz -C "$S" .
rm -rf "$S"
ls -la gpu-bundle
du -sh gpu-bundle
cat gpu-bundle/BUILD_INFO
if [ "$dirty" -gt 0 ]; then
  echo "gpu-prepare: WARNING: built from a dirty tree ($dirty tracked files changed since $(git rev-parse --short HEAD))" >&2
fi
