// What every GPU test suite shares: one CUDA backend per suite, or the reason every test of it skips
// ("no CUDA device: GPU test skipped (<reason>)"); a fresh random seed per test, printed as
// "[ seed     ]" to reproduce a failure; device buffers filled from host vectors, or poisoned (every
// byte 0xFF: NaN floats, -1 integers) so an element a kernel never writes fails the comparison; and
// the comparison itself, ||gpu - cpu|| / ||cpu|| over the whole output, printed as "[ rel err  ]"
// lines that scripts/gpu-check.sh gathers into its table.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device_memory.h"
#include "rel_check.h"

namespace ladder::test {

class CudaFixture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    reason_ = cuda::device_unavailable_reason();
    if (reason_.empty()) be_ = cuda::make_backend().release();
  }
  static void TearDownTestSuite() {
    delete be_;
    be_ = nullptr;
  }
  void SetUp() override {
    if (!reason_.empty()) GTEST_SKIP() << "no CUDA device: GPU test skipped (" << reason_ << ")";
    const uint64_t seed = std::random_device{}();
    rng_.seed(seed);
    RecordProperty("seed", std::to_string(seed));
    std::printf("[ seed     ] %llu\n", static_cast<unsigned long long>(seed));
  }

  cuda::CudaBackend& be() { return *be_; }
  cudaStream_t st() { return be_->stream(); }

  std::vector<float> randv(size_t n, float lo = -1.f, float hi = 1.f) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng_);
    return v;
  }
  std::vector<int32_t> randi(size_t n, int hi) {
    std::uniform_int_distribution<int> d(0, hi - 1);
    std::vector<int32_t> v(n);
    for (auto& x : v) x = d(rng_);
    return v;
  }
  // A device copy of h starting `offset` elements into its buffer (offset 1: not 16-byte aligned).
  template <class T>
  static cuda::DeviceBuffer<T> up(const std::vector<T>& h, size_t offset = 0) {
    std::vector<T> padded(offset, T{});
    padded.insert(padded.end(), h.begin(), h.end());
    cuda::DeviceBuffer<T> d(padded.size() ? padded.size() : 1);
    if (!padded.empty()) d.upload(padded);
    return d;
  }
  template <class T = float>
  static cuda::DeviceBuffer<T> poisoned(size_t n) {
    cuda::DeviceBuffer<T> d(n ? n : 1);
    d.poison();
    return d;
  }
  // The n elements from `offset` on, after the backend's stream has finished.
  template <class T>
  std::vector<T> down(const cuda::DeviceBuffer<T>& d, size_t n, size_t offset = 0) {
    be_->synchronize();
    std::vector<T> h = d.download();
    return std::vector<T>(h.begin() + long(offset), h.begin() + long(offset + n));
  }

  // rel_check.h: non-finite where the CPU is finite fails, then ||got - cpu|| / ||cpu|| <= tol.
  static double check(const std::vector<float>& got, const std::vector<float>& cpu, double tol,
                      const std::string& what, double floor = 0) {
    return check_rel(got, cpu, tol, what, floor);
  }

  static inline std::string reason_;
  static inline cuda::CudaBackend* be_ = nullptr;
  std::mt19937_64 rng_;
};

}  // namespace ladder::test
