// The checks of the wgmma layout facts (src/backend/cuda/wgmma_ptx.cuh) through k::wgmma_selftest
// (one warpgroup: D [64 x 128] = A [64 x 64] * B [64 x 128] from shared memory), shared by the GPU
// test (CudaWgmma, tests/cuda/test_cuda_wgmma.cpp: what proves the facts on a device) and the
// emulated one (CudaEmuWgmma, tests/cuda/emu/test_emu_wgmma.cpp: the emulation follows the same
// facts, and the planted bugs are caught). Each check names the fact it tests, so a failing GPU run
// says which assumption is wrong:
//  1. AccumulatorLayout: A[m][0] = m + 1, A[m][1] = 1, B[0][n] = 1, B[1][n] = 128 (n + 1), the rest
//     0, so D[m][n] = m + 1 + 128 (n + 1) exactly: each accumulator register names the (m, n) it
//     holds. K-major operands, k 0..1 only (the first 4 bytes of a row: chunk 0, at chunk m % 8 of
//     its swizzled row).
//  2. OperandLayouts: random bf16 A, B in each of the four form pairs (A, B each K-major or
//     MN-major) with the kernel's descriptors: D against a double product (products of bf16 are exact
//     in fp32; bound 1e-5 of ||D||). On failure, whether D matches the product the hardware would
//     compute reading the operands unswizzled (swizzle mode not applied) is printed.
//  3. MnMajorStrideRoles: MN-major operands with LBO and SBO swapped must fail where the kernel's
//     assignment passes; the printout says which assignment the hardware follows.
//  4. PlantedSwizzleBug: operands stored without the swizzle but described as 128-byte swizzled must
//     fail (if this passed on a device, the swizzle was not applied at all).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cuda/grouped_gemm_wgmma.cuh"
#include "backend/cuda/wgmma_layout.h"
#include "mma_selftest_case.h"

namespace ladder::wgmma_case {

namespace wg = cuda::k::wg;
constexpr int kM = 64, kN = 128, kK = 64;

struct Operands {
  std::vector<uint16_t> a, b;  // A [64 m][64 k], B [64 k][128 n], bf16 bits, row-major
};

inline Operands random_operands(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  Operands o{std::vector<uint16_t>(kM * kK), std::vector<uint16_t>(kK * kN)};
  for (auto& x : o.a) x = cpu::bf16_bits(u(rng));
  for (auto& x : o.b) x = cpu::bf16_bits(u(rng));
  return o;
}

inline std::vector<double> product(const Operands& o) {
  std::vector<double> d(kM * kN, 0.0);
  for (int m = 0; m < kM; ++m)
    for (int k = 0; k < kK; ++k) {
      const double a = cpu::bf16_value(o.a[m * kK + k]);
      for (int n = 0; n < kN; ++n) d[m * kN + n] += a * cpu::bf16_value(o.b[k * kN + n]);
    }
  return d;
}

using mma_case::rel;  // ||got - ref|| / ||ref||, a non-finite element counting as 1e30

// The kernel's descriptors for each form (grouped_gemm_wgmma.cu's operand_desc): K-major LBO unused
// (16), SBO 1024; MN-major LBO 8192 (the next 64 x), SBO 1024 (the next 8 k).
inline cuda::k::WgmmaSelftest kernel_config(bool a_mn, bool b_mn) {
  cuda::k::WgmmaSelftest c;
  c.a_mn = a_mn, c.b_mn = b_mn;
  c.lbo_a = a_mn ? wg::kMnLboBytes : 16, c.sbo_a = wg::kSboBytes;
  c.lbo_b = b_mn ? wg::kMnLboBytes : 16, c.sbo_b = wg::kSboBytes;
  return c;
}

inline std::string form(bool mn) { return mn ? "MN-major" : "K-major"; }

// The operands as the hardware would see them if it read the stored bytes without the swizzle:
// element (x, t) read at the unswizzled address holds whatever element was stored there.
inline Operands read_unswizzled(const Operands& o, bool a_mn, bool b_mn) {
  auto remap = [](const std::vector<uint16_t>& v, bool mn, int X, bool is_a) {
    const uint32_t bytes = wg::kTileBytes;
    std::vector<uint16_t> stored(bytes / 2, 0);
    auto at = [&](int x, int t) { return is_a ? x * kK + t : t * kN + x; };
    for (int x = 0; x < X; ++x)
      for (int t = 0; t < kK; ++t) stored[(mn ? wg::mnmajor_offset(x, t) : wg::kmajor_offset(x, t)) / 2] = v[at(x, t)];
    std::vector<uint16_t> out(v.size());
    for (int x = 0; x < X; ++x)
      for (int t = 0; t < kK; ++t)
        out[at(x, t)] = stored[wg::swizzle128(mn ? wg::mnmajor_offset(x, t) : wg::kmajor_offset(x, t)) / 2];
    return out;
  };
  return Operands{remap(o.a, a_mn, kM, true), remap(o.b, b_mn, kN, false)};
}

// `run(cfg, operands, D)` below: D (64 x 128 floats, row-major) from k::wgmma_selftest.

// D's relative error against `ref` (the product of o) with configuration c.
template <class Run>
double rel_of(Run&& run, const cuda::k::WgmmaSelftest& c, const Operands& o, const std::vector<double>& ref) {
  std::vector<float> d(kM * kN, NAN);
  run(c, o, d);
  return rel(d, ref);
}

template <class Run>
void accumulator_layout(Run&& run) {
  Operands o{std::vector<uint16_t>(kM * kK, 0), std::vector<uint16_t>(kK * kN, 0)};
  for (int m = 0; m < kM; ++m) o.a[m * kK] = cpu::bf16_bits(float(m + 1)), o.a[m * kK + 1] = cpu::bf16_bits(1.f);
  for (int n = 0; n < kN; ++n) o.b[n] = cpu::bf16_bits(1.f), o.b[kN + n] = cpu::bf16_bits(128.f * float(n + 1));
  std::vector<float> d(kM * kN, NAN);
  run(kernel_config(false, false), o, d);
  int wrong = 0, undecodable = 0;
  for (int m = 0; m < kM; ++m)
    for (int n = 0; n < kN; ++n) {
      const float v = d[m * kN + n];
      const int iv = int(v);
      const int dm = iv % 128 - 1, dn = iv / 128 - 1;
      if (!(std::isfinite(v) && float(iv) == v && dm >= 0 && dm < kM && dn >= 0 && dn < kN)) {
        if (undecodable++ < 4)
          std::printf("[ wgmma    ] D[%d][%d] = %g encodes no (m, n): the K-major operands' first chunk was not read "
                      "where wgmma_ptx.cuh says (see OperandLayouts)\n", m, n, double(v));
        continue;
      }
      if ((dm != m || dn != n) && wrong++ < 8)
        std::printf("[ wgmma    ] accumulator for D[%d][%d] (warp %d, lane %d, register %d) holds D[%d][%d]\n", m, n,
                    m / 16, (m % 8) * 4 + (n % 8) / 2, 4 * (n / 8) + 2 * ((m % 16) / 8) + n % 2, dm, dn);
    }
  std::printf("[ wgmma    ] accumulator layout (m64n128 f32): %d of %d elements elsewhere, %d not decodable\n", wrong,
              kM * kN, undecodable);
  EXPECT_EQ(wrong, 0) << "the m64nN accumulator layout of wgmma_ptx.cuh is wrong";
  EXPECT_EQ(undecodable, 0) << "the probe's operands were not read as laid out (K-major, 128-byte swizzle)";
}

template <class Run>
void operand_layouts(std::mt19937_64& rng, Run&& run) {
  const Operands o = random_operands(rng);
  const std::vector<double> ref = product(o);
  for (bool a_mn : {false, true})
    for (bool b_mn : {false, true}) {
      std::vector<float> d(kM * kN, NAN);
      run(kernel_config(a_mn, b_mn), o, d);
      const double e = rel(d, ref);
      std::printf("[ rel err  ] wgmma m64n128k16 A %s B %s %.3e (tol 1e-05)\n", form(a_mn).c_str(), form(b_mn).c_str(),
                  e);
      EXPECT_LE(e, 1e-5) << "A " << form(a_mn) << ", B " << form(b_mn)
                         << ": the operand layout or descriptor of wgmma_ptx.cuh is wrong for these forms";
      if (e > 1e-5) {
        const double u = rel(d, product(read_unswizzled(o, a_mn, b_mn)));
        std::printf("[ wgmma    ]   against the product of the operands read unswizzled: %.3e%s\n", u,
                    u <= 1e-5 ? " (match: the hardware did not apply the 128-byte swizzle as written)" : "");
        // Which of the four k16 slices (the four wgmmas, descriptor starts advanced by 32 bytes
        // K-major / 2048 MN-major) is read wrong: the operands with every other slice zeroed.
        for (int kk = 0; kk < kK / 16; ++kk) {
          Operands z = o;
          for (int m = 0; m < kM; ++m)
            for (int k = 0; k < kK; ++k)
              if (k / 16 != kk) z.a[m * kK + k] = 0;
          for (int k = 0; k < kK; ++k)
            if (k / 16 != kk)
              for (int n = 0; n < kN; ++n) z.b[k * kN + n] = 0;
          const double ez = rel_of(run, kernel_config(a_mn, b_mn), z, product(z));
          std::printf("[ wgmma    ]   k16 slice %d alone (descriptor starts A +%d, B +%d bytes): %.3e%s\n", kk,
                      kk * (a_mn ? 2048 : 32), kk * (b_mn ? 2048 : 32), ez, ez <= 1e-5 ? " ok" : " WRONG");
        }
      }
    }
}

template <class Run>
void mn_major_stride_roles(std::mt19937_64& rng, Run&& run) {
  const Operands o = random_operands(rng);
  const std::vector<double> ref = product(o);
  for (bool swapped : {false, true}) {
    cuda::k::WgmmaSelftest c = kernel_config(true, true);
    if (swapped) std::swap(c.lbo_a, c.sbo_a), std::swap(c.lbo_b, c.sbo_b);
    const double e = rel_of(run, c, o, ref);
    std::printf("[ wgmma    ] MN-major A and B, LBO %u (%s) SBO %u: rel err %.3e -> %s\n", c.lbo_b,
                swapped ? "the 8-k step" : "the 64-x step", c.sbo_b, e, e <= 1e-5 ? "works" : "wrong");
    if (swapped) {
      EXPECT_GT(e, 1e-2) << "the swapped stride roles should not work (the test's own sanity)";
    } else {
      EXPECT_LE(e, 1e-5) << "MN-major: LBO as the step between 64-element x blocks and SBO as the step between "
                            "8-k groups (wgmma_ptx.cuh) is not what the hardware does";
    }
  }
}

template <class Run>
void planted_swizzle_bug(std::mt19937_64& rng, Run&& run) {
  const Operands o = random_operands(rng);
  const std::vector<double> ref = product(o);
  for (bool mn : {false, true}) {
    cuda::k::WgmmaSelftest c = kernel_config(mn, mn);
    c.plain_store = true;
    const double e = rel_of(run, c, o, ref);
    std::printf("[ wgmma    ] planted bug: %s operands stored unswizzled: rel err %.3e (must be large)\n",
                form(mn).c_str(), e);
    EXPECT_GT(e, 1e-2) << "operands stored without the swizzle gave the right product: the swizzle is not applied";
  }
}

}  // namespace ladder::wgmma_case
