#!/usr/bin/env bash
# The GPU session's one script (an H200 with 16 cores; docs/cuda.md): builds for sm_90, runs the
# GPU tests, runs the micro-benchmark and the model benchmarks (dense and MoE presets at d=1024 and
# d=2048, configs/gpu/), writes logs under $OUT and prints a short table last.
# Budget: under 8 minutes (each step has its own timeout). At most 8 files under $OUT come back:
# env (with the build's log), tests (with the PyTorch baseline's check), wgmma, sanitizer, bench,
# models and profile logs, and the console log the call tees.
#
# Build: on the GPU machine (-DCMAKE_CUDA_ARCHITECTURES=90, -j16) when its image has this
# project's CPU dependencies; otherwise the prebuilt gpu-bundle/ from scripts/gpu-prepare.sh
# (carried with the call). Which one ran is printed.
#   GPU_CHECK_BUILD=0      skip the device build, use gpu-bundle/ directly (saves ~1-2 minutes)
#   GPU_CHECK_SANITIZER=0  skip the compute-sanitizer pass
#   GPU_CHECK_PROFILE=0    skip the profiled benches (per-op shares of a step: MoE d=1024, dense d=2048)
#   GPU_CHECK_MODELS="dense-d1024:bf16 moe-d1024:bf16"   preset:precision[:key=value,...] to benchmark;
#                          key=value pairs go to `ladder bench --set`, LADDER_*=value to the
#                          environment, TORCH adds the PyTorch baseline (`ladder bench --torch`: PyTorch
#                          on the same model after Ladder's run), TORCH_COMPILE with torch.compile.
#                          The default, in order of what a run decides first (rows start while under
#                          370 s; the profiles get the minute after):
#                           1. the four presets in bf16 (their bf16 activations);
#                           2. the MoE capacity layout on both MoE presets (model.moe_capacity=1.0);
#                           3. where cuDNN attention passed its test, MoE d=1024 and dense d=2048 with
#                              run.attention=cudnn-nondeterministic;
#                           4. where the wgmma grouped GEMM passed its tests, both MoE presets with
#                              LADDER_GROUPED_WGMMA=1; where the wgmma attention passed, dense d=2048 and
#                              MoE d=1024 with LADDER_ATTN_WGMMA=1; both together on MoE d=1024;
#                           5. where the PyTorch baseline passed its check (step 2a), the d=1024 pair
#                              with TORCH;
#                           6. the other cuDNN rows (the other two presets nondeterministic; MoE d=1024
#                              and dense d=2048 with the deterministic `cudnn`; MoE d=1024 with the
#                              capacity layout and cuDNN);
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
#                          The attention's default is the mma.sync kernels; where they did not pass
#                          their tests in this run, every model bench runs with LADDER_ATTN_MMA=0
#                          (WMMA) instead.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[gpu-check +$(($(date +%s) - T0))s] $*"; }

{
  date -u
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi
  nvcc --version
  cmake --version
  nproc
  cat /etc/os-release
} >"$OUT/env.log" 2>&1
log "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi failed')"

# ---- 1. build -----------------------------------------------------------------------------------
BIN=""
if [ "${GPU_CHECK_BUILD:-1}" != 0 ] && command -v nvcc >/dev/null && command -v cmake >/dev/null; then
  gen=""
  command -v ninja >/dev/null && gen="-G Ninja"
  # The build log goes into env.log: $OUT may bring back 8 files, and the call tees console.log too.
  log "building for sm_90 on the device (log: env.log)"
  if timeout 60 cmake -S . -B build-gpu $gen -DCMAKE_BUILD_TYPE=Release -DLADDER_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DLADDER_TESTS=ON >>"$OUT/env.log" 2>&1 &&
    timeout 300 cmake --build build-gpu -j 16 --target ladder_cuda_tests ladder_cuda_bench ladder >>"$OUT/env.log" 2>&1; then
    BIN=build-gpu
    log "built on the device"
    grep -q "cuDNN attention: compiled" "$OUT/env.log" ||
      log "this build has no cuDNN attention (no .deps/cudnn-frontend here: carry it, or GPU_CHECK_BUILD=0 with gpu-bundle)"
  else
    log "device build failed (last lines of env.log follow); falling back to gpu-bundle/"
    tail -n 4 "$OUT/env.log"
  fi
fi
if [ -z "$BIN" ]; then
  if [ ! -f gpu-bundle/bundle.tgz ]; then
    echo "gpu-check: no device build and no gpu-bundle/bundle.tgz (run scripts/gpu-prepare.sh first and carry gpu-bundle)"
    exit 1
  fi
  rm -rf gpu-bundle/x && mkdir -p gpu-bundle/x && tar xzf gpu-bundle/bundle.tgz -C gpu-bundle/x
  BIN=gpu-bundle/x
  cat "$BIN/BUILD_INFO"
  export LD_LIBRARY_PATH="$PWD/$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# cuBLASLt 13: the toolkit's, else one shipped in Python wheels (PyTorch's).
if ldd "$BIN/ladder_cuda_tests" | grep -q "libcublasLt.so.13 => not found"; then
  lt=$(find /usr/local /usr/lib /opt -name 'libcublasLt.so.13' 2>/dev/null | head -n 1)
  [ -n "$lt" ] && export LD_LIBRARY_PATH="$(dirname "$lt"):${LD_LIBRARY_PATH:-}" && log "cuBLASLt from $(dirname "$lt")"
fi
# cuDNN for LADDER_ATTN_CUDNN (attention_cudnn.h), loaded at run time: libcudnn.so.9 from the machine
# (the toolkit's, else PyTorch's wheel), the CUDA 13 runtime that cuDNN's frontend loads, and NVRTC,
# which cuDNN's runtime-compiled attention engines need. Only what the loader cannot find already
# is looked up, in one pass, the toolkit's folders first.
missing=()
for lib in libcudnn.so.9 libcudart.so.13 libnvrtc.so.13; do
  ldconfig -p 2>/dev/null | awk -v l="$lib" '$1 == l {f = 1} END {exit !f}' || missing+=("$lib")
done
if [ ${#missing[@]} -gt 0 ]; then
  found=$(find /usr/local /usr/lib /opt \( -name libcudnn.so.9 -o -name libcudart.so.13 -o -name libnvrtc.so.13 \) \
    2>/dev/null)
  for lib in "${missing[@]}"; do
    d=$(grep -m1 "/$lib\$" <<<"$found")
    [ -n "$d" ] && export LD_LIBRARY_PATH="$(dirname "$d"):${LD_LIBRARY_PATH:-}" && log "$lib from $(dirname "$d")"
  done
fi
if ldd "$BIN/ladder_cuda_tests" | grep "not found"; then
  echo "gpu-check: libraries above not found on this machine"
  exit 1
fi

# ---- 2. GPU tests -------------------------------------------------------------------------------
log "GPU tests (log: tests.log)"
# The wgmma grouped GEMM's tests run apart (step 2b): a wgmma kernel that faults ends the CUDA
# context of its process, which must not be this one (LADDER_TEST_WGMMA=0 leaves them out here).
LADDER_TEST_WGMMA=0 timeout 300 "$BIN/ladder_cuda_tests" --gtest_color=no >"$OUT/tests.log" 2>&1
TEST_RC=$?
grep -E "^\[  (FAILED|PASSED)  \]" "$OUT/tests.log" | sort -u | head -n 20
echo "skipped: $(grep -c '^\[  SKIPPED \] .*(' "$OUT/tests.log")"
grep -B1 -A3 "Failure" "$OUT/tests.log" | head -n 40

# The register-resident mma.sync attention (the default) is benchmarked only where its layout check
# and its attention tests all passed on this device; a faulting kernel would end the process it runs
# in, so otherwise the model benches run on the WMMA kernels (LADDER_ATTN_MMA=0).
MMA_OK=0
if grep -q '^\[       OK \] CudaMmaPtx.FragmentLayoutsMatchACpuProduct' "$OUT/tests.log" &&
   [ "$(grep -c '^\[       OK \] CudaAttentionMma\.' "$OUT/tests.log")" -ge 3 ] &&
   ! grep -q '^\[  FAILED  \] CudaAttentionMma\.\|^\[  FAILED  \] CudaMmaPtx\.' "$OUT/tests.log"; then
  MMA_OK=1
fi
log "mma.sync attention: $([ $MMA_OK = 1 ] && echo "tests passed, benchmarked beside WMMA" || echo "tests not passed, not benchmarked: LADDER_ATTN_MMA=0")"
[ $MMA_OK = 1 ] || export LADDER_ATTN_MMA=0
# Likewise the grouped GEMM's mma.sync tile product (the default; its tests run both it and WMMA):
# where any CudaGroupedTc test failed here, the model benches use WMMA (LADDER_GROUPED_MMA=0).
GG_OK=1
if ! grep -q '^\[       OK \] CudaGroupedTc.BothShapes' "$OUT/tests.log" ||
   grep -q '^\[  FAILED  \] CudaGroupedTc\.' "$OUT/tests.log"; then
  GG_OK=0
  export LADDER_GROUPED_MMA=0
fi
log "grouped GEMM mma.sync: $([ $GG_OK = 1 ] && echo "tests passed" || echo "tests not passed: model benches on WMMA (LADDER_GROUPED_MMA=0)")"
# cuDNN's fused attention (run.attention: cudnn, cudnn-nondeterministic; off by default): benchmarked in the models only where
# its test ran on cuDNN and passed (the test is skipped where libcudnn does not load).
CUDNN_OK=0
if grep -q '^\[       OK \] CudaAttnBf16.AttentionCudnnMatchesTheCpu' "$OUT/tests.log"; then CUDNN_OK=1; fi
log "cuDNN attention: $([ $CUDNN_OK = 1 ] && echo "test passed, model benches with run.attention=cudnn* added" || echo "test not passed or skipped: not benchmarked") ($(grep -m1 '^\[ cudnn    \]' "$OUT/tests.log" | cut -c14- ))"
# ---- 2a. PyTorch on this GPU: the baseline of the presets' "x torch" column (`ladder bench --torch`:
# scripts/bench-torch.py's fast model: SDPA, grouped GEMMs, bf16 autocast, fused AdamW). First the check
# that it is Ladder's model (tests/reference/check_fast_model.py against the reference: fp32 on the
# GPU, then bf16 autocast with flash attention and grouped GEMMs; log appended to tests.log).
export LADDER_SOURCE_DIR=$PWD  # the bundle's binaries find scripts/bench-torch.py here
TORCH_OK=0
TORCH_PY=""
TORCH_VERSION="no python with a CUDA torch"
TORCH_RC=skipped
for py in ${LADDER_TORCH_PYTHON:-} python3 /opt/torch/.venv/bin/python3; do
  if v=$(timeout 60 "$py" -c 'import sys, torch; print("torch", torch.__version__); sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null); then
    TORCH_PY=$py
    TORCH_VERSION="$v, $py"
    break
  fi
done
if [ -n "$TORCH_PY" ]; then
  export LADDER_TORCH_PYTHON=$TORCH_PY
  log "PyTorch baseline check with $TORCH_PY (log: tests.log)"
  echo "=== TorchFast: check_fast_model.py --device cuda (fp32, then bf16)" >>"$OUT/tests.log"
  # Both gate the TORCH rows: fp32 (the same model, SDPA on this GPU) and bf16 (flash attention,
  # grouped GEMMs and autocast: the paths the benchmark times, with bounds that catch a wrong layout).
  timeout 90 "$TORCH_PY" tests/reference/check_fast_model.py --device cuda >>"$OUT/tests.log" 2>&1
  TORCH_RC=$?
  echo "=== TorchFast bf16" >>"$OUT/tests.log"
  timeout 90 "$TORCH_PY" tests/reference/check_fast_model.py --device cuda --precision bf16 >>"$OUT/tests.log" 2>&1
  TORCH_RC="$TORCH_RC/$?"
  [ "$TORCH_RC" = 0/0 ] && TORCH_OK=1
fi
log "PyTorch baseline ($TORCH_VERSION): $([ $TORCH_OK = 1 ] && echo "same model as the reference on this GPU, TORCH rows added to the model benches" || echo "checks exit $TORCH_RC (fp32/bf16): no TORCH rows")"

# ---- 2b. the wgmma grouped GEMM (sm_90a, off by default: LADDER_GROUPED_WGMMA=1), in its own
# process (log: wgmma.log): its layout self-test first (CudaWgmma.*: accumulator layout, operand
# layouts, MN-major strides, the planted swizzle bug: the '[ wgmma    ]' lines say which fact failed),
# then the grouped GEMM tests with wgmma as a third tile product (CudaGroupedTc.*) and on its cp.async
# path (CudaGroupedTc.Wgmma*), and the throughput rows (mma vs wgmma). Benchmarked in the model only
# where all of it passed: then the MoE presets run once more with it, beside the mma.sync rows.
log "wgmma grouped GEMM tests (log: wgmma.log)"
# Two processes, the self-test on a fresh context first: its diagnosis must not depend on what a
# faulting grouped GEMM left behind.
timeout 60 "$BIN/ladder_cuda_tests" --gtest_color=no --gtest_filter='CudaWgmma.*' >"$OUT/wgmma.log" 2>&1
WG_RC=$?
timeout 150 "$BIN/ladder_cuda_tests" --gtest_color=no \
  --gtest_filter='CudaGroupedTc.*-CudaGroupedTc.LargeShapes:CudaGroupedTc.LargeShapesWmma' >>"$OUT/wgmma.log" 2>&1
WG_RC="$WG_RC/$?"
WG_OK=0
if [ "$WG_RC" = 0/0 ] && [ "$(grep -c '^\[       OK \] CudaWgmma\.' "$OUT/wgmma.log")" -ge 4 ] &&
   [ "$(grep -c '^\[       OK \] CudaGroupedTc\.Wgmma' "$OUT/wgmma.log")" -ge 3 ] &&
   ! grep -q '^\[  FAILED  \]' "$OUT/wgmma.log"; then
  WG_OK=1
fi
log "grouped GEMM wgmma: $([ $WG_OK = 1 ] && echo "tests passed, MoE benches with LADDER_GROUPED_WGMMA=1 added" || echo "tests not passed (or skipped): not benchmarked")"

# ---- 2c. the wgmma attention (sm_90a, off by default: LADDER_ATTN_WGMMA=1), in its own process too
# (log appended to wgmma.log): CudaAttentionWgmma.* (the mma.sync attention's cases with the wgmma
# forward and backward, against the CPU and the mma.sync kernels, the register-A layout self-test and
# the planted swizzle bug). Only
# where all of it passed do the model benches add dense-d2048 and moe-d1024 with LADDER_ATTN_WGMMA=1.
log "wgmma attention tests (log: wgmma.log)"
echo "=== CudaAttentionWgmma" >>"$OUT/wgmma.log"
timeout 90 "$BIN/ladder_cuda_tests" --gtest_color=no --gtest_filter='CudaAttentionWgmma.*' >>"$OUT/wgmma.log" 2>&1
AW_RC=$?
AW_OK=0
if [ $AW_RC = 0 ] && [ "$(sed -n '/^=== CudaAttentionWgmma/,$p' "$OUT/wgmma.log" | grep -c '^\[       OK \] CudaAttentionWgmma\.')" -ge 6 ]; then
  AW_OK=1
fi
log "attention wgmma: $([ $AW_OK = 1 ] && echo "tests passed, dense-d2048 / moe-d1024 benches with LADDER_ATTN_WGMMA=1 added" || echo "tests not passed (or skipped): not benchmarked")"

# ---- 3. memory checker on the small kernel tests (out-of-bounds, uninitialized reads, races) ----
SAN_RC=skipped
if [ "${GPU_CHECK_SANITIZER:-1}" != 0 ] && command -v compute-sanitizer >/dev/null && [ $(($(date +%s) - T0)) -lt 240 ]; then
  log "compute-sanitizer memcheck + racecheck (log: sanitizer.log)"
  f='CudaKernels.Embedding*:CudaKernels.RmsNorm*:CudaKernels.Rope*:CudaKernels.Attention*:CudaKernels.Softmax*:CudaAttentionTc.UnalignedInputs:CudaAttentionMma.UnalignedInputs:CudaMmaPtx.*:CudaMoe.Sort*:CudaMoe.GroupedGemm*:CudaMoe.GatherAndCombine*:CudaSwitchOptim.*:CudaGroupedTc.*:CudaAttnBf16.*-*Throughput*:*LargeShapesWmma*'
  # Without the wgmma tests (LADDER_TEST_WGMMA=0: the 120 s were sized without them); they get a
  # memcheck of their own below where they passed in 2b.
  LADDER_TEST_WGMMA=0 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/ladder_cuda_tests" --gtest_filter="$f" \
    >"$OUT/sanitizer.log" 2>&1
  SAN_RC=$?
  LADDER_TEST_WGMMA=0 timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/ladder_cuda_tests" \
    --gtest_filter='CudaKernels.AttentionForwardBackward:CudaKernels.RmsNorm*:CudaAttentionTc.UnalignedInputs:CudaAttentionMma.UnalignedInputs:CudaGroupedTc.BothShapes' >>"$OUT/sanitizer.log" 2>&1
  SAN_RC="$SAN_RC/$?"
  # The wgmma kernels: both staging paths (BothShapes' third tile product: registers; WgmmaBothShapes:
  # cp.async) and the self-test.
  if [ $WG_OK = 1 ]; then
    timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/ladder_cuda_tests" \
      --gtest_filter='CudaWgmma.*:CudaGroupedTc.BothShapes:CudaGroupedTc.WgmmaBothShapes' >>"$OUT/sanitizer.log" 2>&1
    SAN_RC="$SAN_RC/wgmma $?"
  fi
  if [ $AW_OK = 1 ]; then
    timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/ladder_cuda_tests" \
      --gtest_filter='CudaAttentionWgmma.UnalignedInputs:CudaAttentionWgmma.RegisterAFragmentLayout' >>"$OUT/sanitizer.log" 2>&1
    SAN_RC="$SAN_RC/attn-wgmma $?"
  fi
  tail -n 3 "$OUT/sanitizer.log"
fi

# ---- 4. micro-benchmark -------------------------------------------------------------------------------
log "benchmark (log: bench.log)"
LADDER_BENCH_ATTN_MMA=$MMA_OK LADDER_BENCH_ATTN_WGMMA=$AW_OK timeout 240 "$BIN/ladder_cuda_bench" >"$OUT/bench.log" 2>&1
BENCH_RC=$?

# ---- 5. model benchmarks: `ladder bench --device cuda` on the configs/gpu presets, each at a GEMM
# precision (run.precision); MFU is against the GEMM rate the same run measures at that precision.
log "model benchmarks (log: models.log)"
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
# cuDNN attention where its test passed: MoE d=1024 and dense d=2048 with its nondeterministic
# backward (atomic dQ; every cuDNN 9 runs it) right after the capacity rows; later the other two
# presets, two with the deterministic one (which cuDNN before 9.25 would run on an S x S workspace:
# then declined, and the row is Ladder's kernels, models.log says), and the MoE with the capacity
# layout too.
CUDNN_ROWS=""
CUDNN_REST=""
ND=run.attention=cudnn-nondeterministic
[ $CUDNN_OK = 1 ] && CUDNN_ROWS="moe-d1024:bf16:$ND dense-d2048:bf16:$ND " &&
  CUDNN_REST="dense-d1024:bf16:$ND moe-d2048:bf16:$ND moe-d1024:bf16:run.attention=cudnn dense-d2048:bf16:run.attention=cudnn moe-d1024:bf16:$CAP,$ND "
# The PyTorch baseline where it passed its check (TORCH: `ladder bench --torch`, PyTorch on the same
# model after Ladder's run has freed the device; about 40 s a row): the d=1024 pair after the cuDNN
# rows, the d=2048 pair and torch.compile (TORCH_COMPILE) at the end, while time is left.
TORCH_ROWS=""
TORCH_LATE=""
[ $TORCH_OK = 1 ] && TORCH_ROWS="dense-d1024:bf16:TORCH moe-d1024:bf16:TORCH " &&
  TORCH_LATE=" dense-d2048:bf16:TORCH moe-d2048:bf16:TORCH dense-d1024:bf16:TORCH_COMPILE"
MODELS=${GPU_CHECK_MODELS:-dense-d1024:bf16 moe-d1024:bf16 dense-d2048:bf16 moe-d2048:bf16 moe-d1024:bf16:$CAP moe-d2048:bf16:$CAP ${CUDNN_ROWS}${WG_ROWS}${TORCH_ROWS}${CUDNN_REST}moe-d1024:bf16:$CAP,model.moe_bf16_grads=true moe-d1024:bf16:model.moe_capacity=1.1 moe-d1024:bf16:$CAP,run.grad_accum=4 dense-d1024:bf16:run.grad_accum=4 moe-d1024:bf16:model.moe_bf16_grads=true moe-d2048:bf16:model.moe_bf16_grads=true dense-d1024:bf16:model.mlp_bf16_grads=true moe-d1024:bf16:LADDER_HEAD_CHUNK_MIB=16 dense-d1024:bf16:LADDER_HEAD_CHUNK_MIB=16 dense-d1024:bf16:$F32D moe-d1024:bf16:$F32M dense-d2048:bf16:$F32D dense-d1024:bf16:optim.name=muonh moe-d1024:bf16:optim.name=muonh moe-d2048:bf16:model.saved_activations=bf16 moe-d1024:bf16:LADDER_GROUPED_MMA=0 dense-d1024:bf16:LADDER_ATTN_MMA=0${TORCH_LATE}}
: >"$OUT/models.log"
ROW=$(mktemp)  # one row's output (outside $OUT: at most 8 files come back)
MODEL_ROWS=""
for mp in $MODELS; do
  IFS=: read -r m prec extra <<<"$mp"
  sets=(--set "run.precision=$prec")
  envs=()  # LADDER_* items are environment variables (LADDER_ATTN_MMA=0: the WMMA attention)
  tflags=()  # TORCH: the PyTorch baseline too; TORCH_COMPILE: with torch.compile
  for kv in ${extra//,/ }; do
    if [ "$kv" = TORCH ]; then tflags=(--torch)
    elif [ "$kv" = TORCH_COMPILE ]; then tflags=(--torch --torch-args=--compile)
    elif [[ $kv == LADDER_* ]]; then envs+=("$kv"); else sets+=(--set "$kv"); fi
  done
  if [ ${#tflags[@]} -gt 0 ] && [ $TORCH_OK != 1 ]; then
    log "skipping $mp: the PyTorch baseline did not pass its check here"
    continue
  fi
  if [ ${#envs[@]} -gt 0 ] && [[ " ${envs[*]} " == *" LADDER_ATTN_MMA=0 "* ]] && [ $MMA_OK != 1 ]; then
    log "skipping $mp: every bench runs the WMMA attention already (the mma.sync kernels did not pass here)"
    continue
  fi
  if [[ " ${envs[*]} " == *" LADDER_GROUPED_MMA=0 "* ]] && [ $GG_OK != 1 ]; then
    log "skipping $mp: every bench runs the WMMA grouped GEMM already"
    continue
  fi
  if [[ " ${envs[*]} " == *" LADDER_ATTN_WGMMA=1 "* ]] && [ $AW_OK != 1 ]; then
    log "skipping $mp: the wgmma attention did not pass its tests here"
    continue
  fi
  if [[ ",$extra," == *",run.attention=cudnn"* ]] && [ $CUDNN_OK != 1 ]; then
    log "skipping $mp: cuDNN attention did not pass its test here"
    continue
  fi
  if [[ " ${envs[*]} " == *" LADDER_GROUPED_WGMMA=1 "* ]] && [ $WG_OK != 1 ]; then
    log "skipping $mp: the wgmma grouped GEMM did not pass its tests here"
    continue
  fi
  # 370 s, not 420: the profiled benches below (about 12 s each in run 3) get the last minute.
  [ $(($(date +%s) - T0)) -lt 370 ] || { log "skipping $mp: over 370 s (the profiles come next)"; continue; }
  # A row with the baseline: Ladder's 6 steps, then PyTorch's start (import, CUDA context), 2 warm-up
  # and 4 timed steps (torch.compile: its compilation too): up to 200 s, and never past 480 s.
  to=100
  if [ ${#tflags[@]} -gt 0 ]; then
    to=$((480 - ($(date +%s) - T0)))
    [ $to -gt 200 ] && to=200
    [ $to -ge 90 ] || { log "skipping $mp: under 90 s left for a row with PyTorch"; continue; }
  fi
  echo "=== $mp" >>"$OUT/models.log"
  env "${envs[@]}" timeout $to "$BIN/ladder" bench --config "configs/gpu/$m.yaml" --device cuda "${sets[@]}" \
    --steps 4 --json "${tflags[@]}" >"$ROW" 2>&1
  rc=$?
  cat "$ROW" >>"$OUT/models.log"
  # Two MFUs: against the GEMM rate measured in the same run at this precision, and against the
  # H100/H200 datasheet's dense rate (bf16 989, tf32 495, fp32 67 TFLOP/s), the number papers quote.
  row=$(grep '^{' "$ROW" | tail -n 1 | PREC=$prec python3 -c 'import json,os,sys
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
  MODEL_ROWS="$MODEL_ROWS$(printf '%-12s %-5s rc=%-3s %s %s' "$m" "$prec" "$rc" "$row" "$extra")"$'\n'
done
rm -f "$ROW"

# ---- 5b. where the time goes: profiled benches (each op's device time from CUDA events on the
# backend's stream, Backend::make_op_timer; no host wait per op) of the bf16 MoE at d=1024 and the
# bf16 dense at d=2048 (the presets the MFU goals are furthest from / closest to).
PROFILE_ROWS=""
# The third: the MoE with the capacity layout, where its batched GEMMs show apart ("batched gemm").
# The fourth, where cuDNN attention passed its test: the MoE with it (what attention costs then).
PROFILES="moe-d1024 dense-d2048 moe-d1024:$CAP"
[ $CUDNN_OK = 1 ] && PROFILES="$PROFILES moe-d1024:$ND"
for pm in $PROFILES; do
  [ "${GPU_CHECK_PROFILE:-1}" != 0 ] && [ $(($(date +%s) - T0)) -lt 420 ] || break
  IFS=: read -r pp pset <<<"$pm"
  psets=(--set run.precision=bf16)
  penv=()  # a LADDER_* item is an environment variable, as in the model list
  if [[ $pset == LADDER_* ]]; then penv+=("$pset"); elif [ -n "$pset" ]; then psets+=(--set "$pset"); fi
  log "profiled bench: $pm bf16 (log: profile.log)"
  # One log for all (the device tool brings back at most 8 files from $OUT).
  env "${penv[@]}" timeout 90 "$BIN/ladder" bench --config "configs/gpu/$pp.yaml" --device cuda "${psets[@]}" \
    --steps 2 --profile --json >"$OUT/profile-run.tmp" 2>&1
  { echo "=== $pm"; cat "$OUT/profile-run.tmp"; } >>"$OUT/profile.log"
  PROFILE_ROWS="$PROFILE_ROWS$(tail -n 1 "$OUT/profile-run.tmp" | PM=$pm python3 -c 'import json,os,sys
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
    print("%s: (failed: see profile.log)" % os.environ["PM"])' 2>/dev/null)"$'\n'
done
rm -f "$OUT/profile-run.tmp"

# ---- 6. the table, last -------------------------------------------------------------------------
echo
echo "== gpu-check: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1), build: $BIN, $(($(date +%s) - T0)) s =="
echo "GPU tests: exit $TEST_RC; $(grep -c '^\[       OK \]' "$OUT/tests.log") ok, $(grep '^\[  FAILED  \] Cuda' "$OUT/tests.log" | awk '{print $4}' | sort -u | wc -l) failed; sanitizer exit: $SAN_RC"
echo "largest relative error per op (vs the CPU kernels):"
grep '^\[ rel err  \]' "$OUT/tests.log" | awk '{
  op = $5; for (i = 6; i <= NF && $i !~ /^[0-9.]+e[-+][0-9]+$/; ++i) if ($i !~ /=|[0-9]x[0-9]/) op = op " " $i;
  v = $i + 0; if (!(op in mx) || v > mx[op]) mx[op] = v } END { for (o in mx) printf "  %-26s %.2e\n", o, mx[o] }' | sort
echo "grouped GEMM wgmma (sm_90a): exit $WG_RC, $([ $WG_OK = 1 ] && echo "CudaWgmma + CudaGroupedTc with wgmma passed" || echo "not passed or skipped: see wgmma.log ('[ wgmma    ]' lines name the layout fact at fault)")"
grep -E '^\[  (FAILED|SKIPPED) \] Cuda|^\[ wgmma    \]' "$OUT/wgmma.log" | sort -u | head -n 16 | sed 's/^/  /'
grep '^\[ rel err  \] wgmma' "$OUT/wgmma.log" | sed 's/^\[ rel err  \] /  /'
echo "attention wgmma (sm_90a): exit $AW_RC, $([ $AW_OK = 1 ] && echo "CudaAttentionWgmma passed" || echo "not passed or skipped: see wgmma.log")"
sed -n '/^=== CudaAttentionWgmma/,$p' "$OUT/wgmma.log" | grep -E '^\[  (FAILED|SKIPPED) \] Cuda|\[ wgmma    \] register A' | sort -u | head -n 8 | sed 's/^/  /'
sed -n '/^=== CudaAttentionWgmma/,$p' "$OUT/wgmma.log" | grep '^\[ rel err  \] attn_wgmma .* vs mma' | sed 's/^\[ rel err  \] /  /'
echo "cuDNN attention: $([ $CUDNN_OK = 1 ] && echo "CudaAttnBf16.AttentionCudnnMatchesTheCpu passed" || echo "not passed or skipped")"
grep '^\[ cudnn    \]' "$OUT/tests.log" | head -n 12 | sed 's/^/  /'
grep -hsE 'declined attention|runs attention|cuDNN attention is on|cuDNN attention not used' "$OUT/tests.log" \
  "$OUT/models.log" | sort -u | head -n 16 | sed 's/^/  /'
echo "PyTorch baseline ($TORCH_VERSION): check_fast_model.py on this GPU, fp32/bf16 exit $TORCH_RC$([ $TORCH_OK = 1 ] && echo ": the same model" || echo ": see tests.log")"
sed -n '/^=== TorchFast/,$p' "$OUT/tests.log" | grep -E '^\[FAIL\]|failed|passed|^torch ' | head -n 8 | sed 's/^/  /'
echo "grouped GEMM throughput (CudaGroupedTc.Throughput: E=64 experts, fp32 kernel vs tensor cores by operand staging; 'experts' rows: ThroughputAgainstBatchedCublasLt, the presets' expert GEMMs grouped vs one strided-batched cuBLASLt call at capacity C):"
grep '^\[ thruput  \]' "$OUT/tests.log" | sed 's/^\[ thruput  \] /  /'
grep '^\[ thruput  \].*wgmma' "$OUT/wgmma.log" | sed 's/^\[ thruput  \] /  /'
echo "benchmark: exit $BENCH_RC"
sed -n '/^| what/,$p' "$OUT/bench.log"
[ "$BENCH_RC" = 0 ] || tail -n 5 "$OUT/bench.log"
echo "model benchmarks (ladder bench --device cuda, median of 4 steps; MFU = model TFLOP/s / same-run GEMM TFLOP/s):"
echo "preset       prec  rc      tokens/s  TFLOP/s  GEMM TF/s    MFU  MFU@ds  act MiB  dev MiB  (settings)"
printf '%s' "$MODEL_ROWS"
if [ -n "$PROFILE_ROWS" ]; then
  echo "where a step's time goes (bf16, ladder bench --profile: device time per op from CUDA events, top 12; then the 8 slowest GEMM shapes):"
  printf '%s' "$PROFILE_ROWS"
fi
[ "$TEST_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
