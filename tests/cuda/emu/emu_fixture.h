// The CudaEmu fixture shared by the emulated-kernel tests (test_emu_kernels.cpp, test_emu_moe_tc.cpp):
// seeded inputs, poisoned outputs, and the comparisons (relative error, exact, double sums).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "emu_cuda.h"
#include "../rel_check.h"

namespace ladder::cuda::k {}

namespace ladder::emu_test {

namespace k = cuda::k;
constexpr double kF32 = 5e-6;
constexpr double kSum = 1e-6;

inline bool quick() {
  static const bool q = std::getenv("EMU_QUICK") && std::string(std::getenv("EMU_QUICK")) != "0";
  return q;
}

class CudaEmu : public ::testing::Test {
 public:  // the helpers are used by free functions of the tests too
  void SetUp() override {
    const char* env = std::getenv("EMU_SEED");
    const uint64_t seed = env ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    rng_.seed(seed);
    std::printf("[ seed     ] %llu (EMU_SEED=%llu repeats it)\n", static_cast<unsigned long long>(seed),
                static_cast<unsigned long long>(seed));
  }
  std::vector<float> randv(size_t n, float lo = -1.f, float hi = 1.f) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng_);
    return v;
  }
  template <class T = float>
  static std::vector<T> poisoned(size_t n) {
    std::vector<T> v(n);
    if (n) std::memset(v.data(), 0xFF, n * sizeof(T));
    return v;
  }
  static void ok(cudaError_t e, const std::string& what) { ASSERT_EQ(e, cudaSuccess) << what; }

  // rel_check.h: non-finite where the CPU is finite fails, then ||got - cpu|| / ||cpu|| <= tol.
  static double check(const std::vector<float>& got, const std::vector<float>& cpu, double tol,
                      const std::string& what, double floor = 0) {
    return test::check_rel(got, cpu, tol, what, floor);
  }
  static void check_sum(double got, double ref, const std::string& what) {
    const double rel = std::abs(got - ref) / std::max(std::abs(ref), 1e-300);
    std::printf("[ rel err  ] %-48s %.3e (tol %.0e)\n", what.c_str(), rel, kSum);
    EXPECT_TRUE(std::isfinite(got)) << what;
    EXPECT_LE(rel, kSum) << what << ": emu " << got << " cpu " << ref;
  }
  template <class T>
  static void exact(const std::vector<T>& got, const std::vector<T>& ref, const std::string& what) {
    ASSERT_EQ(got.size(), ref.size()) << what;
    size_t diff = 0;
    for (size_t i = 0; i < ref.size(); ++i) diff += std::memcmp(&got[i], &ref[i], sizeof(T)) != 0;
    std::printf("[ exact    ] %-48s %zu of %zu differ\n", what.c_str(), diff, ref.size());
    EXPECT_EQ(diff, 0u) << what;
  }
  static std::string fmt(const char* f, auto... a) {
    char buf[256];
    std::snprintf(buf, sizeof buf, f, a...);
    return buf;
  }

  std::mt19937_64 rng_;
};

}  // namespace ladder::emu_test
