// The check of mma_ptx.cuh's fragment layouts (src/backend/cuda/mma_selftest.cu), shared by the GPU
// test (CudaMmaPtx, tests/cuda/test_cuda_mma_ptx.cpp), which is what proves the layouts on a device,
// and the host-emulated one (CudaEmuChecks, tests/cuda/emu/test_emu_kernels.cpp), which proves the
// emulation follows the same layouts. Random bf16 A (16x16) and B (16x8); `run(mode, D)` runs the
// kernel; each mode's D against a double product of the same bf16 values. Products of two bf16 are
// exact in fp32, so only the fp32 sum of 16 terms differs: bound 1e-5 of ||D||. A wrong layout
// (an element from the wrong row, column or half word) is off by O(1).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "backend/cpu/kernels.h"

namespace ladder::mma_case {

struct Operands {
  std::vector<uint16_t> a, at, bnk, bkn;  // A [16][16], A^T, B^T [8][16], B [16][8]
  std::vector<double> A, B;               // the same values, widened
};

inline Operands make(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  Operands o;
  o.a.resize(256), o.at.resize(256), o.bnk.resize(128), o.bkn.resize(128), o.A.resize(256), o.B.resize(128);
  for (int m = 0; m < 16; ++m)
    for (int k = 0; k < 16; ++k) {
      const uint16_t b = cpu::bf16_bits(u(rng));
      o.a[m * 16 + k] = o.at[k * 16 + m] = b;
      o.A[m * 16 + k] = cpu::bf16_value(b);
    }
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) {
      const uint16_t b = cpu::bf16_bits(u(rng));
      o.bkn[k * 8 + n] = o.bnk[n * 16 + k] = b;
      o.B[k * 8 + n] = cpu::bf16_value(b);
    }
  return o;
}

// C = L (16 x 16) * B, L given as a function of (m, k).
template <class L>
std::vector<double> product(const L& lhs, const std::vector<double>& B) {
  std::vector<double> C(128, 0.0);
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n)
      for (int k = 0; k < 16; ++k) C[m * 8 + n] += lhs(m, k) * B[k * 8 + n];
  return C;
}

inline double rel(const std::vector<float>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::isfinite(got[i]) ? double(got[i]) - ref[i] : 1e30;
    num += d * d, den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// Runs every mode through `run(mode, D)` (D: 128 floats, D[m * 8 + n]) and checks it.
template <class Run>
void check_all(std::mt19937_64& rng, Run&& run) {
  const Operands o = make(rng);
  const std::vector<double> ref = product([&](int m, int k) { return o.A[m * 16 + k]; }, o.B);
  std::vector<float> d0;
  for (int mode = 0; mode < 3; ++mode) {
    std::vector<float> d(128, NAN);
    run(o, mode, d);
    const double e = rel(d, ref);
    std::printf("[ rel err  ] mma.sync m16n8k16 bf16, mode %d (%s) %.3e (tol 1e-05)\n", mode,
                mode == 0 ? "ldmatrix" : mode == 1 ? "ldmatrix.trans" : "registers", e);
    EXPECT_LE(e, 1e-5) << "mode " << mode << ": the fragment layout of mma_ptx.cuh is wrong";
    if (mode == 0) d0 = d;
  }
  // Mode 3: [bf16(D) | 0] * B, D the device's own mode-0 result (its rounding to bf16 is then exact).
  std::vector<float> d(128, NAN);
  run(o, 3, d);
  const std::vector<double> ref3 = product(
      [&](int m, int k) { return k < 8 ? double(cpu::bf16_value(cpu::bf16_bits(d0[m * 8 + k]))) : 0.0; }, o.B);
  const double e = rel(d, ref3);
  std::printf("[ rel err  ] mma.sync m16n8k16 bf16, mode 3 (pack_a: C -> A) %.3e (tol 1e-05)\n", e);
  EXPECT_LE(e, 1e-5) << "pack_a's C -> A correspondence is wrong";
}

}  // namespace ladder::mma_case
