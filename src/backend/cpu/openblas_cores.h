// OpenBLAS picks its kernels from the CPU's family and model numbers, once, in its load-time
// constructor. A processor newer than the installed OpenBLAS (Debian 12's 0.3.21 does not know
// Intel's family 6 model 207, Emerald Rapids) gets the generic SSE3 "Prescott" kernels: 4-7x slower
// sgemm than the AVX-512 ones on the same machine (docs/benchmarks.md, "Machine"), and every CPU run
// slows down with it. OpenBLAS takes OPENBLAS_CORETYPE from the environment instead, but only at
// load time, so the fix is a restart of the program with it set, before anything else runs.
#pragma once
#include <string>

namespace ladder {

// The instruction sets the choice depends on (x86-64).
struct CpuVectorIsa {
  bool avx2_fma = false;  // AVX2 and FMA
  bool avx512 = false;    // AVX-512 F, BW, DQ and VL (OpenBLAS's SkylakeX kernels)
};
CpuVectorIsa cpu_vector_isa();

// The OPENBLAS_CORETYPE this CPU should have instead of `detected` (what openblas_get_corename()
// reports), or "" when `detected` is already fine: a generic pre-AVX2 core name on a CPU with
// AVX-512 -> "SkylakeX", with AVX2 + FMA -> "Haswell".
std::string better_openblas_core(const std::string& detected, const CpuVectorIsa& isa);

// The core OpenBLAS runs (openblas_get_corename()).
std::string openblas_core();

// First thing in main(): when OpenBLAS chose generic kernels on a CPU with AVX2 or AVX-512, sets
// OPENBLAS_CORETYPE and restarts the program (same argv) so that OpenBLAS loads with the right ones
// (LADDER_OPENBLAS_DETECTED then holds the core OpenBLAS had chosen).
// Nothing happens when OPENBLAS_CORETYPE is already set (the user's choice, or the restarted
// process) or LADDER_OPENBLAS_CORETYPE=keep. If the restart fails, says so on stderr and goes on.
void ensure_openblas_kernels(char** argv);

}  // namespace ladder
