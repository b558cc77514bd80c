#!/usr/bin/env bash
# The GPU session's one script (an H200 with 16 cores; docs/cuda.md "The GPU session: exact commands"):
# the GPU tests, the model benchmarks (dense and MoE presets at d=1024 and d=2048, configs/gpu/) and
# their profiles, the micro-benchmark, then what the time left allows (the PyTorch bf16 check,
# compute-sanitizer). Logs go under $OUT; a compact verdict block (under ~10 KB) is printed LAST, so
# the device tool's 12,000-character output tail holds all of it. The device call (timeout_s=540):
#   GPU_CHECK_BUILD=0 timeout -k 5 525 bash scripts/gpu-check.sh >$OUT/console.log 2>&1; tail -c 11500 $OUT/console.log
# The script keeps its own deadline (GPU_CHECK_DEADLINE, 480 s from its start); the outer timeout only
# bounds a step that would not die, and the tail runs either way (a pipe into tail would be killed
# with the command at the device's limit and return nothing).
#
# Time. Every step runs under `timeout -k 5 T`, T = min(the step's cap, its phase's end - now); a
# step with too little time left is skipped and says so (rc 124/137: "timed out").
#   1. checks, ending GPU_CHECK_PRE_S (225 s) after the setup, 210 s before the deadline at the
#      latest: the GPU tests (cap 150 s; without the wgmma and cuDNN tests), the cuDNN tests in a
#      process of their own (60), the wgmma self-test, grouped GEMM and attention tests, each in its
#      own process (30/60/45), the PyTorch probe (30 per interpreter) and its fp32 check (60), the
#      micro-benchmark (60; moved to phase 4 when phase 1 has under 25 s left);
#   2. the model rows, from their start for GPU_CHECK_ROWS_S (240 s), never past the deadline less
#      the profiles' reserve (15 s each); a row 60 s at most, a row with PyTorch 200 s;
#   3. the profiles (90 s each), while 20 s are left;
#   4. with what is left before the deadline: the micro-benchmark if moved, the PyTorch bf16 check
#      (reported, not a gate), compute-sanitizer memcheck (120) and racecheck (90), the wgmma
#      memchecks (60 each). The sanitizer was clean in all three runs so far; it comes last.
# Files under $OUT (the device tool brings back at most 8; with the call's console.log, 8):
#   env.log      setup, the device build's log, ldd, the PyTorch probe's stderr
#   tests.log    the main test process, then the cuDNN process, then the PyTorch checks
#   wgmma.log    the three wgmma processes
#   bench.log    the micro-benchmark
#   models.log   each model row's and each profile's full output
#   sanitizer.log
#   results.log  each model row and profile as it finishes, then the long lists (per-op relative
#                errors, throughput lines, cuDNN notes) and the verdict block again
#
# Build: with GPU_CHECK_BUILD=1 (the default) on the GPU machine (-DCMAKE_CUDA_ARCHITECTURES=90,
# -j16) when its image has this project's CPU dependencies; otherwise (and with GPU_CHECK_BUILD=0)
# the prebuilt gpu-bundle/ from scripts/gpu-prepare.sh, carried with the call.
#   GPU_CHECK_DEADLINE=480 GPU_CHECK_PRE_S=225 GPU_CHECK_ROWS_S=240   the time limits above (seconds)
#   GPU_CHECK_SANITIZER=0  skip the compute-sanitizer pass
#   GPU_CHECK_PROFILE=0    skip the profiled benches (per-op shares of a step: MoE d=1024, dense d=2048)
#   GPU_CHECK_MODELS="dense-d1024:bf16 moe-d1024:bf16"   preset:precision[:key=value,...] to benchmark;
#                          key=value pairs go to `ladder bench --set`, LADDER_*=value to the
#                          environment, TORCH adds the PyTorch baseline (`ladder bench --torch`: PyTorch
#                          on the same model after Ladder's run), TORCH_COMPILE with torch.compile.
#                          The default, in order of what a run decides first (the rows run in this
#                          order until phase 2's time is spent):
#                           1. the four presets in bf16 (their bf16 activations);
#                           2. the MoE capacity layout on both MoE presets (model.moe_capacity=1.0);
#                           2b. the d=1024 pair at 4x the micro-batch (run.batch_size=32: 64k tokens);
#                           3. where cuDNN attention passed its tests, MoE d=1024 and dense d=2048 with
#                              run.attention=cudnn-nondeterministic;
#                           4. where the wgmma grouped GEMM passed its tests, both MoE presets with
#                              LADDER_GROUPED_WGMMA=1; where the wgmma attention passed, dense d=2048 and
#                              MoE d=1024 with LADDER_ATTN_WGMMA=1; both together on MoE d=1024;
#                           5. where the PyTorch baseline passed its fp32 check (phase 1), the d=1024
#                              pair with TORCH;
#                           6. the other cuDNN rows (the other two presets nondeterministic; MoE d=1024
#                              and dense d=2048 with the deterministic `cudnn`; MoE d=1024 with the
#                              capacity layout and cuDNN); MoE d=1024 with the capacity layout at 4x
#                              the micro-batch;
#                           7. capacity variants (with bf16 gradients; C = 1.1 x the mean load), the
#                              d=1024 pair with 4 micro-batches per optimizer step (run.grad_accum=4:
#                              64k tokens a step instead of 16k, still far under the millions of a real
#                              run, so the optimizer's fixed cost is amortized);
#                           8. both MoE presets with bf16 expert gradients (model.moe_bf16_grads), dense
#                              d=1024 with bf16 MLP gradients (model.mlp_bf16_grads), the d=1024 pair with
#                              the CPU's 128-row LM head chunks (LADDER_HEAD_CHUNK_MIB=16);
#                           9. the d=1024 pair and dense d=2048 with fp32 activations (mlp_bf16 or
#                              moe_bf16, attn_bf16, norm_bf16 = false), the d=1024 pair with MuonH
#                              (optim.name=muonh), MoE d=2048 with bf16 saved activations, MoE d=1024 with
#                              the WMMA grouped GEMM (LADDER_GROUPED_MMA=0), dense d=1024 with the WMMA
#                              attention (LADDER_ATTN_MMA=0);
#                          10. with the PyTorch baseline: the d=2048 pair (TORCH), and dense d=1024
#                              against torch.compile (TORCH_COMPILE).
#                          The attention's and grouped GEMM's defaults are the mma.sync kernels; where
#                          one of their tests failed or crashed in this run, every model bench runs the
#                          WMMA kernels instead (LADDER_ATTN_MMA=0, LADDER_GROUPED_MMA=0).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
T0=$(date +%s)
DEADLINE=$((T0 + ${GPU_CHECK_DEADLINE:-480}))
now() { date +%s; }
log() { echo "[gpu-check +$(($(now) - T0))s] $*"; }
# run_step CAP END MIN cmd...: cmd under `timeout -k 5 T`, T = min(CAP, END - now); not run (status
# 200) where T < MIN. Status 124 or 137: killed at T (-k: KILL 5 s after TERM, for a process stuck
# after a hung kernel).
run_step() {
  local cap=$1 end=$2 min=$3 t
  shift 3
  t=$((end - $(now)))
  [ "$t" -gt "$cap" ] && t=$cap
  [ "$t" -ge "$min" ] || return 200
  timeout -k 5 "$t" "$@"
}
rcword() {
  case $1 in
    0) echo "passed" ;;
    124) echo "timed out" ;;
    137) echo "killed (timed out, or SIGKILL from outside, e.g. out of memory)" ;;
    12[89] | 13[0-9] | 14[0-9] | 15[0-9]) echo "crashed (signal $(($1 - 128)))" ;;
    200) echo "not run (no time left)" ;;
    skipped) echo "skipped" ;;
    *) echo "exit $1" ;;
  esac
}
# Scratch files outside $OUT (at most 8 files come back from there).
TMPD=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$TMPD"' EXIT
RES=$OUT/results.log
: >"$RES"
# The machine's own LD_LIBRARY_PATH: Python and PyTorch run with it, not with the bundle's libraries
# (Debian's libgomp, libz, ...) and the toolkit folders added below.
if [ -n "${LD_LIBRARY_PATH+x}" ]; then ORIG=(env "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"); else ORIG=(env -u LD_LIBRARY_PATH); fi
# OpenBLAS (the CPU reference in the tests, the bench's CPU parts) picks generic kernels on CPUs its
# Debian build does not know, and ladder then re-executes itself with OPENBLAS_CORETYPE
# (src/backend/cpu/openblas_cores.cpp): set it once here instead (no re-exec under compute-sanitizer).
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  if [[ $flags == *" avx512f "* && $flags == *" avx512bw "* && $flags == *" avx512dq "* && $flags == *" avx512vl "* ]]; then
    export OPENBLAS_CORETYPE=SkylakeX
  elif [[ $flags == *" avx2 "* && $flags == *" fma "* ]]; then
    export OPENBLAS_CORETYPE=Haswell
  fi
fi

{
  date -u
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  timeout -k 5 30 nvidia-smi
  nvcc --version
  cmake --version
  nproc
  grep -m1 '^model name' /proc/cpuinfo
  echo "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
  cat /etc/os-release
  # What the host-memory check (src/core/memory.cpp, available_bytes) reads, never yet seen on the device.
  grep -E '^(MemTotal|MemAvailable|SwapFree):' /proc/meminfo
  for f in memory.max memory.current; do echo "cgroup $f: $(cat /sys/fs/cgroup/$f 2>/dev/null || echo absent)"; done
} >"$OUT/env.log" 2>&1
GPU_NAME=$(timeout -k 5 30 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
log "$(timeout -k 5 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null ||
  echo 'nvidia-smi failed'); deadline +$((DEADLINE - T0))s; OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"

# ---- 1. build -----------------------------------------------------------------------------------
BIN=""
if [ "${GPU_CHECK_BUILD:-1}" != 0 ] && command -v nvcc >/dev/null && command -v cmake >/dev/null; then
  gen=""
  command -v ninja >/dev/null && gen="-G Ninja"
  log "building for sm_90 on the device (log: env.log)"
  # shellcheck disable=SC2086  # $gen: no argument or two
  if run_step 60 $((DEADLINE - 300)) 10 cmake -S . -B build-gpu $gen -DCMAKE_BUILD_TYPE=Release -DLADDER_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DLADDER_TESTS=ON >>"$OUT/env.log" 2>&1 &&
    run_step 300 $((DEADLINE - 300)) 60 cmake --build build-gpu -j 16 --target ladder_cuda_tests ladder_cuda_bench ladder \
      >>"$OUT/env.log" 2>&1; then
    BIN=build-gpu
    log "built on the device"
    grep -q "cuDNN attention: compiled" "$OUT/env.log" ||
      log "this build has no cuDNN attention (no .deps/cudnn-frontend here: carry it, or GPU_CHECK_BUILD=0 with gpu-bundle)"
  else
    log "device build failed or out of time (last lines of env.log follow); falling back to gpu-bundle/"
    tail -n 4 "$OUT/env.log"
  fi
fi
if [ -z "$BIN" ]; then
  if [ ! -f gpu-bundle/bundle.tgz ]; then
    echo "gpu-check: no device build and no gpu-bundle/bundle.tgz (run scripts/gpu-prepare.sh first and carry gpu-bundle)"
    exit 1
  fi
  # Unpacked into the scratch folder, not inside gpu-bundle/: the carried folder must stay the packed
  # bundle alone (about 40 MB of the device tool's 64 MiB; unpacked beside it, 180 MB).
  mkdir -p "$TMPD/bundle" && tar xzf gpu-bundle/bundle.tgz -C "$TMPD/bundle"
  BIN=$TMPD/bundle
  cat "$BIN/BUILD_INFO"
  export LD_LIBRARY_PATH="$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# The libraries the binaries link (ldd, which follows LD_LIBRARY_PATH: cuBLASLt 13, the CUDA runtime)
# and those cuDNN attention (attention_cudnn.h) loads at run time: libcudnn.so.9 and NVRTC, which
# cuDNN's runtime-compiled engines need. What neither the loader's cache nor LD_LIBRARY_PATH has is
# looked up in one pass (the toolkit's folders first, then PyTorch's wheels under /usr/lib or /opt).
in_path() {  # true where the loader finds $1: its cache, or a folder of LD_LIBRARY_PATH
  local d
  ldconfig -p 2>/dev/null | awk -v l="$1" '$1 == l {f = 1} END {exit !f}' && return 0
  IFS=: read -ra dirs <<<"${LD_LIBRARY_PATH:-}"
  for d in "${dirs[@]}"; do [ -n "$d" ] && [ -e "$d/$1" ] && return 0; done
  return 1
}
missing=()
for b in ladder_cuda_tests ladder_cuda_bench ladder; do
  timeout -k 5 30 ldd "$BIN/$b" 2>/dev/null | awk '/=> not found/ {print $1}'
done | sort -u >"$TMPD/ldd-missing"
while read -r lib; do missing+=("$lib"); done <"$TMPD/ldd-missing"
for lib in libcudnn.so.9 libnvrtc.so.13 libnccl.so.2; do in_path "$lib" || missing+=("$lib"); done
if [ ${#missing[@]} -gt 0 ]; then
  expr=()
  for lib in "${missing[@]}"; do
    [ ${#expr[@]} -gt 0 ] && expr+=(-o)
    expr+=(-name "$lib")
  done
  found=$(timeout -k 5 30 find /usr/local /usr/lib /opt \( "${expr[@]}" \) 2>/dev/null)
  for lib in "${missing[@]}"; do
    d=$(grep -m1 "/$lib\$" <<<"$found")
    if [ -n "$d" ] && [ "$lib" = libnccl.so.2 ]; then
      # NCCL by its full path (src/backend/cuda/nccl_collectives.cpp): its folder on the search path
      # could put a wheel's cuBLAS ahead of the toolkit's.
      export LADDER_NCCL_LIB=$d
      log "$lib: $d (LADDER_NCCL_LIB)"
    elif [ -n "$d" ]; then
      LD_LIBRARY_PATH="$(dirname "$d"):${LD_LIBRARY_PATH:-}"
      export LD_LIBRARY_PATH
      log "$lib from $(dirname "$d")"
    else
      log "$lib: not found on this machine"
    fi
  done
fi
{
  echo "=== ldd (LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-})"
  timeout -k 5 30 ldd "$BIN/ladder_cuda_tests"
} >>"$OUT/env.log" 2>&1
if timeout -k 5 30 ldd "$BIN/ladder_cuda_tests" "$BIN/ladder_cuda_bench" "$BIN/ladder" 2>/dev/null | grep "not found"; then
  echo "gpu-check: libraries above not found on this machine"
  exit 1
fi

# Tests of a gtest log that did not pass: those with a "[  FAILED  ]" line, and those a crash or a
# timeout ended in (a "[ RUN      ]" line with no result after it; a log may hold several processes).
# Tests that never started (after a crash) are not listed: they did not fail.
notok() {
  awk '$1 == "[" && $3 == "]" && $4 ~ /\./ {
      n = $4; sub(/,$/, "", n)
      if ($2 == "RUN") run[n] = 1
      else if ($2 == "OK" || $2 == "SKIPPED") delete run[n]
      else if ($2 == "FAILED") { delete run[n]; bad[n] = 1 }
    }
    END { for (t in bad) print t; for (t in run) print t " (crashed or timed out in it)" }' "$@" | sort -u
}
export LADDER_SOURCE_DIR=$PWD  # the bundle's binaries find scripts/bench-torch.py here
# Phase 1 ends GPU_CHECK_PRE_S after the setup, and leaves the rows and profiles 210 s at least.
PRE_END=$(($(now) + ${GPU_CHECK_PRE_S:-225}))
[ $PRE_END -gt $((DEADLINE - 210)) ] && PRE_END=$((DEADLINE - 210))

# ---- 2. GPU tests -------------------------------------------------------------------------------
# Without the wgmma tests (LADDER_TEST_WGMMA=0; 2c), the cuDNN ones (*Cudnn*; 2b) and NCCL's (*Nccl*,
# below): a kernel that faults ends its process's CUDA context (and a library's setup may hang), so
# each of those runs in a process of its own.
log "GPU tests (log: tests.log)"
run_step 150 $PRE_END 30 env LADDER_TEST_WGMMA=0 "$BIN/ladder_cuda_tests" --gtest_color=no --gtest_filter='-*Cudnn*:*Nccl*' \
  >"$OUT/tests.log" 2>&1
TEST_RC=$?
MAIN_NOTOK=$(notok "$OUT/tests.log")
TESTS_TOTAL=$(grep -m1 -o 'Running [0-9]* tests' "$OUT/tests.log" | awk '{print $2}')
TESTS_RAN=$(grep -c '^\[ RUN      \]' "$OUT/tests.log")
log "GPU tests: $(rcword $TEST_RC); ran ${TESTS_RAN} of ${TESTS_TOTAL:-?}; $(grep -c '^\[       OK \]' "$OUT/tests.log") ok, $(grep -c . <<<"$MAIN_NOTOK") not ok"
[ -n "$MAIN_NOTOK" ] && head -n 12 <<<"$MAIN_NOTOK" | sed 's/^/  not ok: /'
grep -B1 -A3 "Failure" "$OUT/tests.log" | head -n 12
# The register-resident mma.sync attention and the grouped GEMM's mma.sync tile product (the
# defaults): the model benches use them unless one of their tests failed or crashed here (a test
# that never started, after another one's crash, is no failure); else WMMA (LADDER_ATTN_MMA=0,
# LADDER_GROUPED_MMA=0).
MMA_OK=1
grep -qE '^(CudaAttentionMma|CudaMmaPtx)\.' <<<"$MAIN_NOTOK" && MMA_OK=0
[ $MMA_OK = 1 ] || export LADDER_ATTN_MMA=0
GG_OK=1
grep -q '^CudaGroupedTc\.' <<<"$MAIN_NOTOK" && GG_OK=0
[ $GG_OK = 1 ] || export LADDER_GROUPED_MMA=0
MMA_RAN=$(grep -cE '^\[       OK \] (CudaAttentionMma|CudaMmaPtx)\.' "$OUT/tests.log")
GG_RAN=$(grep -cE '^\[       OK \] CudaGroupedTc\.' "$OUT/tests.log")
# A kernel no test reached (the main process timed out or crashed before it) is not benchmarked as
# the default either: untested is not passed.
[ "$MMA_RAN" -gt 0 ] || { MMA_OK=0; export LADDER_ATTN_MMA=0; }
[ "$GG_RAN" -gt 0 ] || { GG_OK=0; export LADDER_GROUPED_MMA=0; }
log "mma.sync attention: $([ $MMA_OK = 1 ] && echo "no test failed ($MMA_RAN passed): the default" || echo "a test failed or none ran ($MMA_RAN passed): LADDER_ATTN_MMA=0 (WMMA) for every bench"); grouped GEMM mma.sync: $([ $GG_OK = 1 ] && echo "no test failed ($GG_RAN passed)" || echo "a test failed or none ran ($GG_RAN passed): LADDER_GROUPED_MMA=0 (WMMA) for every bench")"

# NCCL (loaded at run time, never yet run on a GPU): a one-rank job's sums on the backend's stream, in
# a process of its own (appended to tests.log) so that a crash or hang in its setup costs 30 s at most.
log "NCCL test (log: tests.log)"
run_step 30 $PRE_END 10 "$BIN/ladder_cuda_tests" --gtest_color=no --gtest_filter='*Nccl*' >"$TMPD/nccl.log" 2>&1
NCCL_RC=$?
{ echo "=== NCCL tests (*Nccl*, a process of their own): $(rcword $NCCL_RC)"; cat "$TMPD/nccl.log"; } >>"$OUT/tests.log"
NCCL_NOTOK=$(notok "$TMPD/nccl.log")
if grep -q '^\[       OK \] CudaNccl\.' "$TMPD/nccl.log" && [ -z "$NCCL_NOTOK" ]; then
  NCCL_STATE="passed: $(grep -m1 '^\[ nccl     \]' "$TMPD/nccl.log" | cut -c14-120)"
elif grep -q '^\[  SKIPPED \] CudaNccl\.' "$TMPD/nccl.log"; then
  NCCL_STATE="skipped: $(grep -m1 -o 'NCCL not usable here.*' "$TMPD/nccl.log" | cut -c1-120)"
elif [ -n "$NCCL_NOTOK" ]; then
  NCCL_STATE="$(rcword $NCCL_RC), not passed: $NCCL_NOTOK"
else
  NCCL_STATE="$(rcword $NCCL_RC), no CudaNccl result (none in this build, or not reached)"
fi
log "NCCL: $NCCL_STATE"

# ---- 2b. cuDNN attention (run.attention: cudnn, cudnn-nondeterministic; off by default), in a process
# of its own (appended to tests.log): a cuDNN fault must not take the other tests' results with it.
# Its model rows, and the micro-benchmark's cudnn rows, only where its op test ran on cuDNN and passed
# (it is skipped where libcudnn does not load) and neither it nor the model test failed or crashed.
log "cuDNN tests (log: tests.log)"
run_step 60 $PRE_END 20 "$BIN/ladder_cuda_tests" --gtest_color=no --gtest_filter='*Cudnn*' >"$TMPD/cudnn.log" 2>&1
CUDNN_RC=$?
{
  echo "=== cuDNN tests (*Cudnn*, a process of their own): $(rcword $CUDNN_RC)"
  cat "$TMPD/cudnn.log"
} >>"$OUT/tests.log"
CUDNN_NOTOK=$(notok "$TMPD/cudnn.log")
CUDNN_OK=0
grep -q '^\[       OK \] CudaAttnBf16.AttentionCudnnMatchesTheCpu' "$TMPD/cudnn.log" &&
  ! grep -qE '^(CudaAttnBf16.AttentionCudnnMatchesTheCpu|CudaModel.CudnnAttentionStepsFollowTheCpu)' <<<"$CUDNN_NOTOK" &&
  CUDNN_OK=1
log "cuDNN attention: $(rcword $CUDNN_RC), $([ $CUDNN_OK = 1 ] && echo "passed: model rows with run.attention=cudnn* added" || echo "not passed, crashed or skipped: not benchmarked")"
grep -m3 '^\[ cudnn    \]' "$TMPD/cudnn.log" | cut -c1-160

# ---- 2c. the wgmma grouped GEMM (sm_90a, off by default: LADDER_GROUPED_WGMMA=1), in processes of its
# own (log: wgmma.log): its layout self-test first, on a fresh context (CudaWgmma.*: accumulator
# layout, operand layouts, MN-major strides, the planted swizzle bug: the '[ wgmma    ]' lines say
# which fact failed); where it passed, the grouped GEMM with wgmma as a third tile product
# (CudaGroupedTc.BothShapes), on its cp.async path and at MoE sizes (CudaGroupedTc.Wgmma*), and the
# throughput rows (CudaGroupedTc.Throughput: mma vs wgmma, printed only here). Benchmarked in the
# model only where all of it passed.
log "wgmma grouped GEMM tests (log: wgmma.log)"
: >"$OUT/wgmma.log"
run_step 30 $PRE_END 15 "$BIN/ladder_cuda_tests" --gtest_color=no --gtest_filter='CudaWgmma.*' >"$TMPD/wg1.log" 2>&1
WG1=$?
{ echo "=== CudaWgmma (self-test): $(rcword $WG1)"; cat "$TMPD/wg1.log"; } >>"$OUT/wgmma.log"
WG2=skipped
if [ $WG1 = 0 ] && [ "$(grep -c '^\[       OK \] CudaWgmma\.' "$TMPD/wg1.log")" -ge 4 ]; then
  run_step 60 $PRE_END 20 "$BIN/ladder_cuda_tests" --gtest_color=no \
    --gtest_filter='CudaGroupedTc.BothShapes:CudaGroupedTc.Wgmma*:CudaGroupedTc.Throughput' >"$TMPD/wg2.log" 2>&1
  WG2=$?
  { echo "=== CudaGroupedTc with wgmma: $(rcword $WG2)"; cat "$TMPD/wg2.log"; } >>"$OUT/wgmma.log"
fi
WG_RC="$WG1/$WG2"
WG_OK=0
if [ "$WG_RC" = 0/0 ] && [ "$(grep -c '^\[       OK \] CudaGroupedTc\.Wgmma' "$TMPD/wg2.log")" -ge 3 ] &&
  ! grep -q '^\[  FAILED  \]' "$OUT/wgmma.log"; then
  WG_OK=1
fi
log "grouped GEMM wgmma: $([ $WG_OK = 1 ] && echo "tests passed, MoE rows with LADDER_GROUPED_WGMMA=1 added" || echo "self-test $(rcword $WG1), grouped GEMM $(rcword $WG2): not benchmarked")"

# ---- 2d. the wgmma attention (sm_90a, off by default: LADDER_ATTN_WGMMA=1), in its own process
# (appended to wgmma.log): the mma.sync attention's cases with the wgmma forward and backward, the
# register-A layout self-test and the planted swizzle bug. Only where all of it passed do the model
# rows add dense-d2048 and moe-d1024 with LADDER_ATTN_WGMMA=1.
log "wgmma attention tests (log: wgmma.log)"
run_step 45 $PRE_END 15 "$BIN/ladder_cuda_tests" --gtest_color=no --gtest_filter='CudaAttentionWgmma.*' >"$TMPD/aw.log" 2>&1
AW_RC=$?
{ echo "=== CudaAttentionWgmma: $(rcword $AW_RC)"; cat "$TMPD/aw.log"; } >>"$OUT/wgmma.log"
AW_OK=0
[ $AW_RC = 0 ] && [ "$(grep -c '^\[       OK \] CudaAttentionWgmma\.' "$TMPD/aw.log")" -ge 6 ] && AW_OK=1
log "attention wgmma: $([ $AW_OK = 1 ] && echo "tests passed, rows with LADDER_ATTN_WGMMA=1 added" || echo "$(rcword $AW_RC), not passed (or skipped): not benchmarked")"

# ---- 2e. PyTorch on this GPU: the baseline of the presets' "x torch" column (`ladder bench --torch`:
# scripts/bench-torch.py's fast model: SDPA, grouped GEMMs, bf16 autocast, fused AdamW), first checked
# to be Ladder's model (tests/reference/check_fast_model.py against the reference, fp32 on the GPU:
# the gate of the TORCH rows; the bf16 check, flash attention and grouped GEMMs, runs in phase 4 and
# is reported). Python runs with the machine's LD_LIBRARY_PATH (ORIG), and `ladder bench --torch`
# starts it through a wrapper that restores it.
TORCH_OK=0
TORCH_PY=""
TORCH_VERSION="no python with a CUDA torch"
TORCH_RC=skipped
TORCH_BF16_RC=skipped
declare -A seen=()
for py in ${LADDER_TORCH_PYTHON:-} python3 /opt/torch/.venv/bin/python3; do
  p=$(command -v "$py" 2>/dev/null) || continue
  # One try per interpreter: by its resolved file, and its venv where it sits in one (a venv's
  # python3 resolves to the base interpreter, but has other packages).
  key=$(readlink -f "$p")
  [ -f "$(dirname "$p")/../pyvenv.cfg" ] && key="$key venv $(readlink -f "$(dirname "$p")/..")"
  [ -n "${seen[$key]:-}" ] && continue
  seen[$key]=1
  echo "=== PyTorch probe: $p ($key)" >>"$OUT/env.log"
  if v=$(run_step 30 $PRE_END 10 "${ORIG[@]}" "$p" -c \
    'import sys, torch; print("torch", torch.__version__, "cuda", torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else 1)' \
    2>>"$OUT/env.log"); then
    TORCH_PY=$p
    TORCH_VERSION="$v, $p"
    break
  elif [ $? = 200 ]; then
    TORCH_VERSION="no time left to look for a python with a CUDA torch"
    break
  fi
done
if [ -n "$TORCH_PY" ]; then
  W=$(mktemp "$TMPD/torch-python.XXXXXX")
  {
    echo '#!/usr/bin/env bash'
    echo "# gpu-check: $TORCH_PY with the machine's LD_LIBRARY_PATH, not the bundle's"
    if [ "${ORIG[1]}" = -u ]; then echo 'unset LD_LIBRARY_PATH'; else printf 'export %q\n' "${ORIG[1]}"; fi
    printf 'exec %q "$@"\n' "$TORCH_PY"
  } >"$W"
  chmod +x "$W"
  export LADDER_TORCH_PYTHON=$W
  log "PyTorch baseline fp32 check with $TORCH_PY (log: tests.log)"
  echo "=== TorchFast: check_fast_model.py --device cuda (fp32)" >>"$OUT/tests.log"
  run_step 60 $PRE_END 20 "${ORIG[@]}" PYTHONUNBUFFERED=1 "$TORCH_PY" tests/reference/check_fast_model.py --device cuda >>"$OUT/tests.log" 2>&1
  TORCH_RC=$?
  [ "$TORCH_RC" = 0 ] && TORCH_OK=1
fi
log "PyTorch baseline ($TORCH_VERSION): fp32 check $(rcword $TORCH_RC)$([ $TORCH_OK = 1 ] && echo ": TORCH rows added")"

# ---- 3. micro-benchmark (log: bench.log): last of phase 1, else in phase 4 -----------------------
BENCH_RC=skipped
run_bench() {
  log "benchmark (log: bench.log)"
  run_step 60 "$1" 25 env LADDER_BENCH_ATTN_MMA=$MMA_OK LADDER_BENCH_ATTN_WGMMA=$AW_OK LADDER_BENCH_CUDNN=$CUDNN_OK \
    "$BIN/ladder_cuda_bench" >"$OUT/bench.log" 2>&1
  BENCH_RC=$?
  log "benchmark: $(rcword $BENCH_RC)"
}
if [ $((PRE_END - $(now))) -ge 25 ]; then run_bench $PRE_END; else log "benchmark moved after the profiles (phase 1's time is spent)"; fi

# ---- 4. model benchmarks: `ladder bench --device cuda` on the configs/gpu presets, each at a GEMM
# precision (run.precision); MFU is against the GEMM rate the same run measures at that precision.
WG_ROWS=""
[ $WG_OK = 1 ] && WG_ROWS="moe-d1024:bf16:LADDER_GROUPED_WGMMA=1 moe-d2048:bf16:LADDER_GROUPED_WGMMA=1 "
[ $AW_OK = 1 ] && WG_ROWS="${WG_ROWS}dense-d2048:bf16:LADDER_ATTN_WGMMA=1 moe-d1024:bf16:LADDER_ATTN_WGMMA=1 "
# Both wgmma paths together: the MoE step the goal is about, with every kernel the next step needs.
[ $WG_OK = 1 ] && [ $AW_OK = 1 ] && WG_ROWS="${WG_ROWS}moe-d1024:bf16:LADDER_GROUPED_WGMMA=1,LADDER_ATTN_WGMMA=1 "
F32D=model.mlp_bf16=false,model.attn_bf16=false,model.norm_bf16=false
F32M=model.moe_bf16=false,model.attn_bf16=false,model.norm_bf16=false
# The capacity layout (model.moe_capacity, session 10): the expert GEMMs as strided-batched cuBLASLt
# calls at C = 1.0 x the mean load, right after the presets: it is the MoE lever a run decides first.
CAP=model.moe_capacity=1.0
# The d=1024 pair with 4x the tokens per micro-batch (64k, still one optimizer step per micro-batch):
# each of the 64 experts then gets ~4k rows instead of ~1k (the grouped GEMM's tiles fill), and the
# optimizer's fixed cost per step (~10% of the MoE step at 16k tokens) is spread over 4x the tokens.
# About 90 GiB for the MoE (47 GiB at batch 8, of which ~32 GiB weights, gradients and Adam state).
B32=run.batch_size=32
# cuDNN attention where its tests passed: MoE d=1024 and dense d=2048 with its nondeterministic
# backward (atomic dQ; every cuDNN 9 runs it) right after the capacity rows; later the other two
# presets, two with the deterministic one, and the MoE with the capacity layout too. The
# deterministic rows only where its op test ran a whole case on cuDNN: cuDNN before 9.25 declines it
# (it would keep an S x S workspace), and those rows would time Ladder's kernels again (20-30 s).
CUDNN_ROWS=""
CUDNN_REST=""
ND=run.attention=cudnn-nondeterministic
CUDNN_DET=0
grep -qE '^\[ cudnn    \] attn_cudnn det .*: 5 of 5 passes ran on cuDNN' "$TMPD/cudnn.log" && CUDNN_DET=1
DET_ROWS=""
[ $CUDNN_DET = 1 ] && DET_ROWS="moe-d1024:bf16:run.attention=cudnn dense-d2048:bf16:run.attention=cudnn "
[ $CUDNN_OK = 1 ] && [ $CUDNN_DET = 0 ] && log "deterministic cuDNN attention ran no whole case in its test (cuDNN < 9.25, or not Hopper): its rows left out"
[ $CUDNN_OK = 1 ] && CUDNN_ROWS="moe-d1024:bf16:$ND dense-d2048:bf16:$ND " &&
  CUDNN_REST="dense-d1024:bf16:$ND moe-d2048:bf16:$ND ${DET_ROWS}moe-d1024:bf16:$CAP,$ND "
# The PyTorch baseline where it passed its check (TORCH: `ladder bench --torch`, PyTorch on the same
# model after Ladder's run has freed the device; about 40 s a row): the d=1024 pair after the cuDNN
# rows, the d=2048 pair and torch.compile (TORCH_COMPILE) at the end, while time is left.
TORCH_ROWS=""
TORCH_LATE=""
[ $TORCH_OK = 1 ] && TORCH_ROWS="dense-d1024:bf16:TORCH moe-d1024:bf16:TORCH " &&
  TORCH_LATE=" dense-d2048:bf16:TORCH moe-d2048:bf16:TORCH dense-d1024:bf16:TORCH_COMPILE"
MODELS=${GPU_CHECK_MODELS:-dense-d1024:bf16 moe-d1024:bf16 dense-d2048:bf16 moe-d2048:bf16 moe-d1024:bf16:$CAP moe-d2048:bf16:$CAP moe-d1024:bf16:$B32 dense-d1024:bf16:$B32 ${CUDNN_ROWS}${WG_ROWS}${TORCH_ROWS}${CUDNN_REST}moe-d1024:bf16:$CAP,$B32 moe-d1024:bf16:$CAP,model.moe_bf16_grads=true moe-d1024:bf16:model.moe_capacity=1.1 moe-d1024:bf16:$CAP,run.grad_accum=4 dense-d1024:bf16:run.grad_accum=4 moe-d1024:bf16:model.moe_bf16_grads=true moe-d2048:bf16:model.moe_bf16_grads=true dense-d1024:bf16:model.mlp_bf16_grads=true moe-d1024:bf16:LADDER_HEAD_CHUNK_MIB=16 dense-d1024:bf16:LADDER_HEAD_CHUNK_MIB=16 dense-d1024:bf16:$F32D moe-d1024:bf16:$F32M dense-d2048:bf16:$F32D dense-d1024:bf16:optim.name=muonh moe-d1024:bf16:optim.name=muonh moe-d2048:bf16:model.saved_activations=bf16 moe-d1024:bf16:LADDER_GROUPED_MMA=0 dense-d1024:bf16:LADDER_ATTN_MMA=0${TORCH_LATE}}
# The profiles: the bf16 MoE at d=1024 and dense at d=2048 (the presets the MFU goals are furthest
# from / closest to), the MoE with the capacity layout (its batched GEMMs show apart: "batched
# gemm") and, where cuDNN attention passed, the MoE with it (what attention costs then).
PROFILES="moe-d1024 dense-d2048 moe-d1024:$CAP"
[ $CUDNN_OK = 1 ] && PROFILES="$PROFILES moe-d1024:$ND"
PROF_RESERVE=0
[ "${GPU_CHECK_PROFILE:-1}" != 0 ] && PROF_RESERVE=$((15 * $(wc -w <<<"$PROFILES")))
R0=$(now)
ROW_END=$((R0 + ${GPU_CHECK_ROWS_S:-240}))
[ $ROW_END -gt $((DEADLINE - PROF_RESERVE)) ] && ROW_END=$((DEADLINE - PROF_RESERVE))
log "model benchmarks until +$((ROW_END - T0))s (log: models.log; each row also in results.log)"
: >"$OUT/models.log"
HDR="preset       prec  rc      tokens/s  TFLOP/s  GEMM TF/s    MFU  MFU@ds  act MiB  dev MiB  (settings)"
echo "== model rows (ladder bench --device cuda, median of 4 steps; MFU = model TFLOP/s / same-run GEMM TFLOP/s)" >>"$RES"
echo "$HDR" >>"$RES"
ROW=$TMPD/row.out  # one row's output, then appended to models.log
MODEL_ROWS=""
NOT_RUN=""
for mp in $MODELS; do
  IFS=: read -r m prec extra <<<"$mp"
  sets=(--set "run.precision=$prec")
  envs=()    # LADDER_* items are environment variables (LADDER_ATTN_MMA=0: the WMMA attention)
  tflags=()  # TORCH: the PyTorch baseline too; TORCH_COMPILE: with torch.compile
  for kv in ${extra//,/ }; do
    if [ "$kv" = TORCH ]; then tflags=(--torch)
    elif [ "$kv" = TORCH_COMPILE ]; then tflags=(--torch --torch-args=--compile)
    elif [[ $kv == LADDER_* ]]; then envs+=("$kv"); else sets+=(--set "$kv"); fi
  done
  skip=""
  if [ ${#tflags[@]} -gt 0 ] && [ $TORCH_OK != 1 ]; then skip="the PyTorch baseline did not pass its check here"
  elif [[ " ${envs[*]} " == *" LADDER_ATTN_MMA=0 "* ]] && [ $MMA_OK != 1 ]; then skip="every bench runs the WMMA attention already"
  elif [[ " ${envs[*]} " == *" LADDER_GROUPED_MMA=0 "* ]] && [ $GG_OK != 1 ]; then skip="every bench runs the WMMA grouped GEMM already"
  elif [[ " ${envs[*]} " == *" LADDER_ATTN_WGMMA=1 "* ]] && [ $AW_OK != 1 ]; then skip="the wgmma attention did not pass its tests here"
  elif [[ ",$extra," == *",run.attention=cudnn"* ]] && [ $CUDNN_OK != 1 ]; then skip="cuDNN attention did not pass its tests here"
  elif [[ " ${envs[*]} " == *" LADDER_GROUPED_WGMMA=1 "* ]] && [ $WG_OK != 1 ]; then skip="the wgmma grouped GEMM did not pass its tests here"
  fi
  if [ -n "$skip" ]; then
    log "skipping $mp: $skip"
    continue
  fi
  # A row: 60 s at most (about 10 s in run 3; grad_accum=4 rows take longer). With the baseline: Ladder's 6 steps, then PyTorch's start (import, CUDA
  # context), 2 warm-up and 4 timed steps (torch.compile: its compilation too): up to 200 s, started
  # only with 45 s of the rows' time and 90 s before the deadline left.
  cap=60
  need=1
  [ ${#tflags[@]} -gt 0 ] && cap=200 && need=45
  if [ $((ROW_END - $(now))) -lt $need ] || { [ ${#tflags[@]} -gt 0 ] && [ $((DEADLINE - $(now))) -lt 90 ]; }; then
    NOT_RUN="$NOT_RUN $mp"
    continue
  fi
  echo "=== $mp" >>"$OUT/models.log"
  # A row started near the end of the rows' time may overrun it by at most 15 s (60 s with PyTorch),
  # so the profiles keep their reserve.
  row_end=$((ROW_END + 15))
  [ ${#tflags[@]} -gt 0 ] && row_end=$((ROW_END + 60))
  [ $row_end -gt $DEADLINE ] && row_end=$DEADLINE
  run_step $cap $row_end 20 env "${envs[@]}" "$BIN/ladder" bench --config "configs/gpu/$m.yaml" --device cuda "${sets[@]}" \
    --steps 4 --json "${tflags[@]}" >"$ROW" 2>&1
  rc=$?
  cat "$ROW" >>"$OUT/models.log"
  # Two MFUs: against the GEMM rate measured in the same run at this precision, and against the
  # H100/H200 datasheet's dense rate (bf16 989, tf32 495, fp32 67 TFLOP/s), the number papers quote.
  row=$(grep '^{' "$ROW" | tail -n 1 | PREC=$prec "${ORIG[@]}" python3 -c 'import json,os,sys
try:
    j = json.loads(sys.stdin.read())
    peak = {"bf16": 989e3, "tf32": 494.7e3, "fp32": 66.9e3}[os.environ["PREC"]]
    cap = j.get("moe_capacity")  # the capacity layout: overflow and padding shares of the expert rows
    print("%10.0f %9.1f %9.1f %6.1f%% %6.1f%% %8.0f %8.0f%s" % (j["tokens_per_s"], j["train_gflops"] / 1e3,
          j["sgemm_gflops"] / 1e3, 100 * j["mfu"], 100 * j["train_gflops"] / peak, j.get("activation_mib", 0),
          j.get("device_mem_used_mib", -1),
          " [C=%d ovf %.1f%% pad %.1f%%]" % (cap["C"], 100 * cap["overflow_frac"], 100 * cap["padding_frac"]) if cap else ""), end="")
    t = j.get("torch")  # the PyTorch baseline on the same model: tokens/s and Ladder / PyTorch
    if t:
        print(" [PyTorch %.0f tokens/s, Ladder %.2fx; %s%s, %s, GEMMs %s, %.0f MiB]" % (t["tokens_per_s"], j["speedup_vs_torch"],
              t.get("attention", "?"), " compiled" if t.get("compile") else "", t.get("torch", "?"),
              t.get("moe_gemm", "dense"), t.get("peak_mem_mib", -1)), end="")
    elif "torch_error" in j:
        print(" [PyTorch failed: see models.log]", end="")
    print()
except Exception:
    print("   (failed: see models.log)")' 2>/dev/null)
  case $rc in 124 | 137) rcs=TO ;; 200) rcs=NR ;; *) rcs=$rc ;; esac
  line=$(printf '%-12s %-5s rc=%-3s %s %s' "$m" "$prec" "$rcs" "${row:-   (failed: see models.log)}" "$extra")
  MODEL_ROWS="$MODEL_ROWS$line"$'\n'
  echo "$line" >>"$RES"
  log "row: $line"
done
if [ -n "$NOT_RUN" ]; then
  log "$(wc -w <<<"$NOT_RUN") rows not run (the rows' time was spent; listed in results.log)"
  echo "not run (the rows' time was spent):$NOT_RUN" >>"$RES"
fi

# ---- 5. where the time goes: profiled benches (each op's device time from CUDA events on the
# backend's stream, Backend::make_op_timer; no host wait per op), while 20 s are left.
PROFILE_ROWS=""
PROF=$TMPD/profile.out
[ "${GPU_CHECK_PROFILE:-1}" != 0 ] && echo "== profiles (bf16, ladder bench --profile: device time per op from CUDA events, top 12; then the 8 slowest GEMM shapes)" >>"$RES"
for pm in $PROFILES; do
  [ "${GPU_CHECK_PROFILE:-1}" != 0 ] || break
  [ $((DEADLINE - $(now))) -ge 20 ] || { log "profiles stopped: under 20 s before the deadline"; break; }
  IFS=: read -r pp pset <<<"$pm"
  psets=(--set run.precision=bf16)
  penv=()  # a LADDER_* item is an environment variable, as in the model list
  if [[ $pset == LADDER_* ]]; then penv+=("$pset"); elif [ -n "$pset" ]; then psets+=(--set "$pset"); fi
  log "profiled bench: $pm bf16 (log: models.log)"
  run_step 90 $DEADLINE 20 env "${penv[@]}" "$BIN/ladder" bench --config "configs/gpu/$pp.yaml" --device cuda "${psets[@]}" \
    --steps 2 --profile --json >"$PROF" 2>&1
  prc=$?
  { echo "=== profile $pm: $(rcword $prc)"; cat "$PROF"; } >>"$OUT/models.log"
  full=$(grep '^{' "$PROF" | tail -n 1 | PM=$pm "${ORIG[@]}" python3 -c 'import json,os,sys
try:
    j = json.loads(sys.stdin.read())
    p, steps = j["profile"], max(1, j["steps_timed"])
    print("%s: %.0f tokens/s, device busy %.1f%% of the steps (sum of the ops\x27 event times / wall time; the rest: gaps between kernels)"
          % (os.environ["PM"], j["tokens_per_s"], 100 * j["profile_busy"]))
    for op, t in sorted(p.items(), key=lambda kv: -kv[1]["share"])[:12]:
        g = t["gflops"]
        print("  %-18s %5.1f%% %9.2f ms/step %7d calls %s" % (op, 100 * t["share"], t["ms_per_step"], t["calls"] // steps,
              ("%.1f TFLOP/s" % (g / 1e3)) if g > 0 else ""))
    # The GEMM time again by shape (ForwardingBackend::gemm_shape).
    for key, t in sorted(j.get("profile_shapes", {}).items(), key=lambda kv: -kv[1]["ms_per_step"])[:8]:
        print("    %5.1f%% %8.2f ms/step %5d calls %6.1f TFLOP/s  %s" % (100 * t["share"], t["ms_per_step"], t["calls"] // steps,
              t["gflops"] / 1e3, key))
except Exception:
    print("%s: (failed: see models.log)" % os.environ["PM"])' 2>/dev/null)
  [ -n "$full" ] || full="$pm: (failed: see models.log)"
  echo "$full" >>"$RES"
  # The verdict keeps the 6 largest ops and the 3 slowest GEMM shapes.
  short=$(awk '/^    / {if (s++ < 3) print; next} /^  / {if (o++ < 6) print; next} {sub(/ of the steps .*/, ""); print}' <<<"$full")
  PROFILE_ROWS="$PROFILE_ROWS$short"$'\n'
  echo "$short"
done

# ---- 6. with the time left before the deadline ----------------------------------------------------
[ "$BENCH_RC" = skipped ] && run_bench $DEADLINE
if [ -n "$TORCH_PY" ]; then
  echo "=== TorchFast bf16: check_fast_model.py --device cuda --precision bf16" >>"$OUT/tests.log"
  run_step 60 $DEADLINE 20 "${ORIG[@]}" PYTHONUNBUFFERED=1 "$TORCH_PY" tests/reference/check_fast_model.py --device cuda --precision bf16 \
    >>"$OUT/tests.log" 2>&1
  TORCH_BF16_RC=$?
  log "PyTorch bf16 check: $(rcword $TORCH_BF16_RC)"
fi
# The memory checker on the small kernel tests (out-of-bounds, uninitialized reads, races), without
# the wgmma tests (LADDER_TEST_WGMMA=0; they get a memcheck of their own where they passed), cuDNN's
# (its library is no kernel of ours) and the large shapes. A part killed at its time says "timed out".
SAN="skipped"
if [ "${GPU_CHECK_SANITIZER:-1}" != 0 ] && command -v compute-sanitizer >/dev/null; then
  log "compute-sanitizer memcheck + racecheck while time is left (log: sanitizer.log)"
  : >"$OUT/sanitizer.log"
  san() {  # name cap min filter [env...]: one compute-sanitizer pass
    local name=$1 cap=$2 min=$3 tool=memcheck rc
    [[ $name == racecheck* ]] && tool=racecheck
    echo "=== $name" >>"$OUT/sanitizer.log"
    run_step "$cap" $DEADLINE "$min" env LADDER_TEST_WGMMA="$5" compute-sanitizer --tool $tool --error-exitcode 9 \
      "$BIN/ladder_cuda_tests" --gtest_color=no --gtest_filter="$4" >>"$OUT/sanitizer.log" 2>&1
    rc=$?
    case $rc in 0) r=clean ;; 9) r="ERRORS" ;; *) r=$(rcword $rc) ;; esac
    # compute-sanitizer refuses some virtualized machines ("Device not supported", then API errors
    # it would count as memory errors): not a finding about Ladder.
    if tail -n 400 "$OUT/sanitizer.log" | grep -q 'Device not supported'; then r="unsupported on this machine"; fi
    SAN="$SAN, $name $r"
  }
  SAN="sanitizer:"
  san memcheck 120 45 'CudaKernels.Embedding*:CudaKernels.RmsNorm*:CudaKernels.Rope*:CudaKernels.Attention*:CudaKernels.Softmax*:CudaAttentionTc.UnalignedInputs:CudaAttentionMma.UnalignedInputs:CudaMmaPtx.*:CudaMoe.Sort*:CudaMoe.GroupedGemm*:CudaMoe.GatherAndCombine*:CudaSwitchOptim.*:CudaGroupedTc.*:CudaAttnBf16.*-*Throughput*:*LargeShapes*:*Cudnn*' 0
  san racecheck 90 30 'CudaKernels.AttentionForwardBackward:CudaKernels.RmsNorm*:CudaAttentionTc.UnalignedInputs:CudaAttentionMma.UnalignedInputs:CudaGroupedTc.BothShapes' 0
  # The wgmma kernels: both staging paths (BothShapes' third tile product: registers; WgmmaBothShapes:
  # cp.async) and the self-test.
  [ $WG_OK = 1 ] && san memcheck-wgmma 60 30 'CudaWgmma.*:CudaGroupedTc.BothShapes:CudaGroupedTc.WgmmaBothShapes' 1
  [ $AW_OK = 1 ] && san memcheck-attn-wgmma 60 30 'CudaAttentionWgmma.UnalignedInputs:CudaAttentionWgmma.RegisterAFragmentLayout' 1
  SAN=${SAN/sanitizer:, /}
  log "compute-sanitizer: $SAN"
fi

# ---- 7. the long lists (results.log), then the verdict, last ----------------------------------------
{
  echo "== largest relative error per op (vs the CPU kernels)"
  cat "$OUT/tests.log" "$OUT/wgmma.log" | grep '^\[ rel err  \]' | awk '{
    op = $5; for (i = 6; i <= NF && $i !~ /^[0-9.]+e[-+][0-9]+$/; ++i) if ($i !~ /=|[0-9]x[0-9]/) op = op " " $i;
    v = $i + 0; if (!(op in mx) || v > mx[op]) mx[op] = v } END { for (o in mx) printf "  %-40s %.2e\n", o, mx[o] }' | sort
  echo "== grouped GEMM throughput (CudaGroupedTc.Throughput*; wgmma rows from wgmma.log)"
  grep -h '^\[ thruput  \]' "$OUT/tests.log" "$OUT/wgmma.log" | sed 's/^\[ thruput  \] /  /'
  echo "== wgmma self-test lines"
  grep -h '^\[ wgmma    \]' "$OUT/wgmma.log" | sort -u
  echo "== cuDNN lines"
  grep -h '^\[ cudnn    \]' "$OUT/tests.log"
  grep -hsE 'declined attention|runs attention|cuDNN attention is on|cuDNN attention not used' "$OUT/tests.log" "$OUT/models.log" | sort -u
  echo "== tests not passed: main process"
  echo "$MAIN_NOTOK"
  echo "== tests not passed: cuDNN process"
  echo "$CUDNN_NOTOK"
  echo "== tests not passed: wgmma processes"
  notok "$OUT/wgmma.log"
} >>"$RES" 2>&1

V=$TMPD/verdict
{
  echo
  echo "== gpu-check verdict: ${GPU_NAME:-no GPU name}, build: ${BIN/#$TMPD\/bundle/gpu-bundle}, $(($(now) - T0)) s (deadline $((DEADLINE - T0)) s) =="
  [ -f "$BIN/BUILD_INFO" ] && grep -E '^(commit|dirty|cuDNN|NCCL)' "$BIN/BUILD_INFO" | tr '\n' ';' && echo
  NOTOK_ALL=$(printf '%s\n%s\n%s\n' "$MAIN_NOTOK" "$NCCL_NOTOK" "$CUDNN_NOTOK" | grep .)
  echo "GPU tests (main, NCCL and cuDNN processes): $(grep -c '^\[       OK \]' "$OUT/tests.log") ok, $(grep -c . <<<"$NOTOK_ALL") not ok, $(grep -c '^\[  SKIPPED \] .*(' "$OUT/tests.log") skipped; main process $(rcword $TEST_RC), ran ${TESTS_RAN} of ${TESTS_TOTAL:-?}"
  [ -n "$NOTOK_ALL" ] && head -n 10 <<<"$NOTOK_ALL" | sed 's/^/  not ok: /'
  echo "mma.sync attention: $([ $MMA_OK = 1 ] && echo "on ($MMA_RAN tests passed)" || echo "OFF: a test failed, benches on WMMA"); grouped GEMM mma.sync: $([ $GG_OK = 1 ] && echo on || echo "OFF: a test failed, benches on WMMA")"
  echo "NCCL (one-rank job): $NCCL_STATE"
  echo "cuDNN attention: $(rcword $CUDNN_RC), $([ $CUDNN_OK = 1 ] && echo "PASSED (rows added)" || echo "not passed or skipped")"
  [ -n "$CUDNN_NOTOK" ] && head -n 4 <<<"$CUDNN_NOTOK" | awk '{print "  not ok: " $0}' 
  grep '^\[ cudnn    \]' "$OUT/tests.log" | head -n 4 | cut -c1-150 | sed 's/^/  /'
  grep -hsE 'declined attention|runs attention|cuDNN attention is on|cuDNN attention not used' "$OUT/models.log" | sort -u | head -n 4 | cut -c1-150 | sed 's/^/  /'
  echo "grouped GEMM wgmma: self-test $(rcword $WG1), grouped GEMM $(rcword $WG2): $([ $WG_OK = 1 ] && echo "PASSED (rows added)" || echo "not passed")"
  if [ $WG_OK != 1 ]; then
    # The self-test's lines name the layout fact at fault; then what did not pass, a hang included.
    [ "$WG1" = 0 ] || grep '^\[ wgmma    \]' "$OUT/wgmma.log" | sort -u | head -n 6 | cut -c1-150 | sed 's/^/  /'
    notok "$OUT/wgmma.log" | grep -v '^CudaAttentionWgmma' | head -n 4 | sed 's/^/  not ok: /'
  fi
  grep '^\[ thruput  \].*(all bf16)' "$OUT/wgmma.log" | sed 's/^\[ thruput  \] /  /'
  echo "attention wgmma: $(rcword $AW_RC): $([ $AW_OK = 1 ] && echo "PASSED (rows added)" || echo "not passed")"
  if [ $AW_OK != 1 ]; then
    sed -n '/^=== CudaAttentionWgmma/,$p' "$OUT/wgmma.log" | grep '\[ wgmma    \] register A' | sort -u | head -n 2 | cut -c1-150 | sed 's/^/  /'
    notok "$OUT/wgmma.log" | grep '^CudaAttentionWgmma' | head -n 4 | sed 's/^/  not ok: /'
  fi
  sed -n '/^=== CudaAttentionWgmma/,$p' "$OUT/wgmma.log" | grep '^\[ rel err  \] attn_wgmma .* vs mma' | head -n 6 | sed 's/^\[ rel err  \] /  /'
  echo "PyTorch ($TORCH_VERSION): fp32 check (the gate) $(rcword $TORCH_RC), bf16 check (reported) $(rcword $TORCH_BF16_RC)"
  sed -n '/^=== TorchFast/,$p' "$OUT/tests.log" | grep -E '^\[FAIL\]' | head -n 4 | cut -c1-150 | sed 's/^/  /'
  echo "compute-sanitizer: $SAN"
  echo "relative errors: $(grep -c '^\[ rel err  \]' "$OUT/tests.log") comparisons; the largest per op in results.log"
  echo "benchmark: $(rcword $BENCH_RC); the GEMM ceiling and attention (full table: bench.log):"
  grep -E '^\| (gemm .*8192|attn fwd\+bwd .* hd64 W0|attn cudnn|d2d copy)' "$OUT/bench.log" | cut -c1-100 | sed 's/^/  /'
  grep -E '^attn cudnn rows skipped|not run:' "$OUT/bench.log" | head -n 2 | sed 's/^/  /'
  [ "$BENCH_RC" = 0 ] || [ "$BENCH_RC" = skipped ] || tail -n 3 "$OUT/bench.log" | cut -c1-150 | sed 's/^/  /'
  if [ -n "$PROFILE_ROWS" ]; then
    echo "where a step's time goes (top 6 ops, 3 slowest GEMM shapes; all in results.log):"
    printf '%s' "$PROFILE_ROWS"
  fi
  echo "model rows ($(grep -c . <<<"$MODEL_ROWS") run$([ -n "$NOT_RUN" ] && echo ", $(wc -w <<<"$NOT_RUN") not run: no time"); rc TO = timed out):"
  echo "$HDR"
  printf '%s' "$MODEL_ROWS"
} >"$V" 2>&1
# The verdict must fit the device tool's output tail with room to spare: where it does not, the
# profiles (in results.log in full) shrink to their 3 largest ops, then go.
if [ "$(wc -c <"$V")" -gt 10000 ] && [ -n "$PROFILE_ROWS" ]; then
  awk '/^where a step.s time goes/ {p = 1; print "where a step'"'"'s time goes (top 3 ops; the rest in results.log):"; next}
    /^model rows / {p = 0}
    p && /^    / {next}
    p && /^  / {if (n++ < 3) print; next}
    p {n = 0}
    {print}' "$V" >"$V.2" && mv "$V.2" "$V"
fi
if [ "$(wc -c <"$V")" -gt 10000 ] && [ -n "$PROFILE_ROWS" ]; then
  awk '/^where a step.s time goes/ {p = 1; print "where a step'"'"'s time goes: left out (verdict over 10 KB); see results.log"; next}
    /^model rows / {p = 0} !p' "$V" >"$V.2" && mv "$V.2" "$V"
fi
echo "== files under \$OUT: $(find "$OUT" -maxdepth 1 -type f | wc -l) (the device tool brings back at most 8); verdict $(wc -c <"$V") bytes" >>"$V"
cat "$V" >>"$RES"
cat "$V"
[ "$TEST_RC" = 0 ] && { [ "$BENCH_RC" = 0 ] || [ "$BENCH_RC" = skipped ]; }
