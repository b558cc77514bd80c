// The test binaries' main: OpenBLAS's kernels for this CPU first (backend/cpu/openblas_cores.h: on a
// CPU the installed OpenBLAS does not know it would otherwise run its generic ones, several times
// slower), then GoogleTest.
#include <gtest/gtest.h>

#include "backend/cpu/openblas_cores.h"

int main(int argc, char** argv) {
  ladder::ensure_openblas_kernels(argv);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
