#!/usr/bin/env bash
# The CUDA kernels' own source on the CPU (docs/cuda.md, "Kernels on the CPU: host emulation"):
#   bash tests/cuda/emu/run.sh [plain|asan|tsan] [gtest arguments...]
# plain: the CudaEmu tests as CTest runs them. asan: AddressSanitizer + UBSan (out-of-bounds global
# and shared memory, every __shared__ array being its own exact-size heap block; undefined behaviour).
# tsan: ThreadSanitizer (shared-memory races between barriers, what compute-sanitizer's racecheck
# reports on a GPU). Sanitizer modes set EMU_QUICK=1 (fewer shapes). Uses the CPU build directory
# (BUILD_DIR, default build), configuring it if needed; the sanitizer binaries are built on demand.
#   bash tests/cuda/emu/run.sh tc [plain|asan|tsan] [quick]
# the tensor-core attention's test alone (CudaEmu.AttentionTc*, test_emu_moe_tc.cpp): all the GPU
# test's shapes (EMU_FULL=1), or with `quick` the CTest shapes (4 of them under asan/tsan).
#   bash tests/cuda/emu/run.sh backend [gtest arguments...]
# the whole CudaBackend on the emulator (ladder_emu_backend_tests: tests/cuda/*.cpp unchanged; some
# of it is slow here, e.g. CudaMoe.QuantileBetaInColumnChunks runs 88M keys through the emulation).
set -euo pipefail
cd "$(dirname "$0")/../../.."
mode=${1:-plain}
shift || true
if [ "$mode" = tc ]; then
  sub=${1:-plain}
  shift || true
  case $sub in plain | asan | tsan) ;; *) echo "usage: run.sh tc [plain|asan|tsan] [quick]"; exit 2 ;; esac
  if [ "${1:-}" = quick ]; then export EMU_FULL=0; else export EMU_FULL=1; fi
  exec bash tests/cuda/emu/run.sh "$sub" --gtest_filter='CudaEmu.AttentionTc*'
fi
BUILD=${BUILD_DIR:-build}
case $mode in
  plain) target=ladder_emu_tests ;;
  backend) target=ladder_emu_backend_tests ;;
  asan | tsan) target=ladder_emu_tests_$mode ;;
  *) echo "usage: run.sh [plain|asan|tsan|backend] [gtest arguments...] | run.sh tc [plain|asan|tsan] [quick]"; exit 2 ;;
esac
[ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j "${JOBS:-2}" --target "$target"
case $mode in
  asan) export EMU_QUICK=1 ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}
        export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} ;;
  # One OpenMP thread: the CPU references run in libgomp, which TSan cannot see into.
  tsan) export EMU_QUICK=1 OMP_NUM_THREADS=1 TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1} ;;
esac
exec "$BUILD/tests/cuda/emu/$target" "$@"
