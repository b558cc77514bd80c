#!/usr/bin/env bash
# Registers, spills and static shared memory of every kernel in the given .cu files, as ptxas reports them
# when compiling with the CUDA build's flags (CMakeLists.txt: -O2 -DNDEBUG -lineinfo). Needs nvcc,
# not a GPU: the numbers docs/cuda.md's register table quotes, and the quick check after a kernel
# change (a spill, or registers over a __launch_bounds__ cap, shows here before any GPU time).
#
#   scripts/ptxas-regs.sh [--arch 90|80] [file.cu ...]   (default: sm_90, the tensor-core files)
# grouped_gemm_wgmma.cu exists for sm_90a only (CMakeLists.txt): compiled for sm_90a with --arch 90,
# skipped with --arch 80.
set -euo pipefail
cd "$(dirname "$0")/.."
arch=90
if [ "${1:-}" = "--arch" ]; then
  arch=$2
  shift 2
fi
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(src/backend/cuda/attention_tc.cu src/backend/cuda/attention_mma_fwd.cu src/backend/cuda/attention_mma_bwd.cu
                              src/backend/cuda/grouped_gemm_tc.cu src/backend/cuda/grouped_gemm_wgmma.cu
                              src/backend/cuda/attention_wgmma_fwd.cu src/backend/cuda/attention_wgmma_bwd.cu)
command -v nvcc >/dev/null || { echo "ptxas-regs.sh: nvcc not found (CUDA toolkit not installed)" >&2; exit 1; }
obj=$(mktemp /tmp/ptxas-regs.XXXXXX.o)
trap 'rm -f "$obj"' EXIT
printf '%-72s %5s %7s %7s %7s\n' "kernel (sm_$arch; *wgmma*.cu: sm_90a)" regs "spill-st" "spill-ld" "st-smem"
for f in "${files[@]}"; do
  [ -f "$f" ] || { echo "ptxas-regs.sh: $f: no such file" >&2; exit 1; }
  a=$arch
  case "$f" in *wgmma*) [ "$arch" = 90 ] || continue; a=90a ;; esac
  nvcc -Isrc -O2 -DNDEBUG -lineinfo -std=c++17 --generate-code=arch=compute_$a,code=sm_$a \
    -x cu -c "$f" -o "$obj" -Xptxas -v 2>&1 |
    awk '
      /Compiling entry function/ { match($0, /_Z[A-Za-z0-9_]+/); name = substr($0, RSTART, RLENGTH); next }
      /spill stores/ { st = $(NF-7); ld = $(NF-3) }
      /Used [0-9]+ registers/ {
        regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
        smem = "0"; if (match($0, /[0-9]+ bytes smem/)) { smem = substr($0, RSTART, RLENGTH); sub(/ bytes smem/, "", smem) }
        print name, regs, st, ld, smem
      }' |
    while read -r name regs st ld smem; do
      pretty=$(echo "$name" | c++filt | sed -E 's/ladder::cuda::k::\(anonymous namespace\):://; s/\(.*//; s/__nv_bfloat16/bf16/g')
      printf '%-72s %5s %7s %7s %7s\n' "$pretty" "$regs" "$st" "$ld" "$smem"
    done
done
