// The comparison every CUDA kernel test makes, on the GPU (cuda_fixture.h) and on the host
// emulation (emu/emu_fixture.h): any non-finite value where the CPU's is finite fails (an element
// the kernel never wrote keeps its poison, a NaN), then ||got - cpu|| / ||cpu|| over the whole
// output must be within tol. `floor` > 0 stands in for ||cpu|| when the exact result is zero and both
// sides hold rounding only. Prints a "[ rel err  ]" line (scripts/gpu-check.sh gathers them).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace ladder::test {

inline double check_rel(const std::vector<float>& got, const std::vector<float>& cpu, double tol,
                        const std::string& what, double floor = 0) {
  EXPECT_EQ(got.size(), cpu.size()) << what;
  size_t bad = 0;
  double num = 0, den = 0;
  for (size_t i = 0; i < cpu.size() && i < got.size(); ++i) {
    if (!std::isfinite(got[i]) && std::isfinite(cpu[i])) {
      if (bad++ < 3) ADD_FAILURE() << what << ": element " << i << " is " << got[i] << " (cpu " << cpu[i] << ")";
      continue;
    }
    const double d = double(got[i]) - double(cpu[i]);
    num += d * d;
    den += double(cpu[i]) * double(cpu[i]);
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " elements not written or not finite";
  const double rel = std::sqrt(num) / std::max({std::sqrt(den), floor, 1e-30});
  std::printf("[ rel err  ] %-44s %.3e (tol %.0e)\n", what.c_str(), rel, tol);
  EXPECT_LE(rel, tol) << what;
  return rel;
}

}  // namespace ladder::test
