// OpenBLAS's kernels for the CPU (backend/cpu/openblas_cores.h): a CPU the installed OpenBLAS does
// not know must not run its generic kernels.
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "backend/cpu/openblas_cores.h"

namespace ladder {
namespace {

TEST(OpenBlasCores, GenericCoresOnVectorCpusGetVectorKernels) {
  const CpuVectorIsa avx512{true, true}, avx2{true, false}, none{};
  EXPECT_EQ(better_openblas_core("Prescott", avx512), "SkylakeX");  // an unknown AVX-512 CPU
  EXPECT_EQ(better_openblas_core("Prescott", avx2), "Haswell");
  EXPECT_EQ(better_openblas_core("PRESCOTT", avx2), "Haswell");
  EXPECT_EQ(better_openblas_core("Nehalem", avx2), "Haswell");
  EXPECT_EQ(better_openblas_core("Sandybridge", avx512), "SkylakeX");
  EXPECT_EQ(better_openblas_core("", avx2), "Haswell");
  EXPECT_EQ(better_openblas_core("Prescott", none), "");  // nothing better to choose
  // A core OpenBLAS recognised is kept, even one with narrower kernels than the CPU has.
  EXPECT_EQ(better_openblas_core("SkylakeX", avx512), "");
  EXPECT_EQ(better_openblas_core("Cooperlake", avx512), "");
  EXPECT_EQ(better_openblas_core("Haswell", avx512), "");
  EXPECT_EQ(better_openblas_core("Zen", avx2), "");
}

// The test binaries' main restarts them with the right kernels, as `ladder` does.
TEST(OpenBlasCores, ThisProcessRunsVectorKernelsWhereTheCpuHasThem) {
  if (const char* k = std::getenv("LADDER_OPENBLAS_CORETYPE"); k && std::string(k) == "keep")
    GTEST_SKIP() << "LADDER_OPENBLAS_CORETYPE=keep: OpenBLAS's own choice was asked for";
  const char* set = std::getenv("OPENBLAS_CORETYPE");
  if (set && !std::getenv("LADDER_OPENBLAS_DETECTED"))
    GTEST_SKIP() << "OPENBLAS_CORETYPE=" << set << " was set before the test started: the user's choice";
  const CpuVectorIsa isa = cpu_vector_isa();
  if (!isa.avx2_fma) GTEST_SKIP() << "this CPU has no AVX2 + FMA";
  EXPECT_EQ(better_openblas_core(openblas_core(), isa), "")
      << "OpenBLAS runs its " << openblas_core() << " kernels on a CPU with "
      << (isa.avx512 ? "AVX-512" : "AVX2") << " (stderr says why the restart did not happen)";
  if (const char* d = std::getenv("LADDER_OPENBLAS_DETECTED"))
    std::printf("[ openblas ] OpenBLAS chose %s for this CPU; restarted with %s\n", d, openblas_core().c_str());
}

}  // namespace
}  // namespace ladder
