// The CUDA MoE dispatch ops and the device-side grouped GEMM (backend/cuda/moe_ops.cu) against the
// CPU kernels (backend/cpu/moe_kernels.h, cpu::grouped_gemm; float) on fresh random inputs, plus
// the whole MoE block (model/moe.h) through BackendOps on the CUDA backend against the CPU backend.
// Same conventions as test_cuda_kernels.cpp: the seed is printed, outputs are poisoned first (every
// byte 0xFF: NaN for floats, -1 for integers) so an element a kernel never writes fails, float
// outputs are compared by ||gpu - cpu|| / ||cpu|| ("[ rel err ]" lines), integer outputs and
// selections (experts, rows, slots, offsets, loads, resets, balance values, quantile beta) exactly.
// Without a GPU each test calls GTEST_SKIP() with "no CUDA device: GPU test skipped (<reason>)".
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/moe_kernels.h"
#include "backend/cuda/cuda_backend.h"
#include "../bf16_vectors.h"
#include "cuda_fixture.h"
#include "grouped_gemm_case.h"
#include "backend/cuda/device_memory.h"
#include "core/error.h"
#include "model/moe.h"

namespace ladder {
namespace {

using cuda::DeviceBuffer;

constexpr double kF32 = 5e-6;
constexpr double kBlock = 1e-5;  // the whole MoE block, CUDA backend vs CPU backend

class CudaMoe : public test::CudaFixture {
 protected:
  // Multiples of `step` in [-levels, levels] * step: many exact ties, and exact sums and products.
  std::vector<float> quantized(size_t n, int levels, float step) {
    std::uniform_int_distribution<int> d(-levels, levels);
    std::vector<float> v(n);
    for (auto& x : v) x = float(d(rng_)) * step;
    return v;
  }
  int randint(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  // Skewed expert choice: experts >= E/2 + 1 never chosen, low experts far more often (u^3).
  std::vector<int32_t> skewed_experts(size_t n, int E) {
    std::uniform_real_distribution<double> u(0, 1);
    const int used = std::max(1, E / 2 + 1);
    std::vector<int32_t> v(n);
    for (auto& x : v) x = std::min(used - 1, int(used * std::pow(u(rng_), 3.0)));
    return v;
  }
  // NK slots' skewed expert choices, counting-sorted by the CPU as the model sorts them: the
  // experts' row offsets, each slot's row and each row's slot.
  struct Sorted {
    std::vector<int32_t> expert, off, row, slot;
  };
  Sorted sorted_slots(int NK, int E) {
    Sorted s{skewed_experts(size_t(NK), E), std::vector<int32_t>(size_t(E) + 1), std::vector<int32_t>(size_t(NK)),
             std::vector<int32_t>(size_t(NK))};
    cpu::moe_sort(s.off.data(), s.row.data(), s.slot.data(), s.expert.data(), NK, E);
    return s;
  }

  // N tokens' K distinct experts each (an expert takes a token at most once, as the router picks,
  // so cpu::moe_capacity_rows' bound holds), skewed as skewed_experts: low experts far more often,
  // the upper ones never (E > 2K). Counting-sorted by the CPU as sorted_slots.
  Sorted distinct_sorted(int N, int K, int E) {
    std::uniform_real_distribution<double> u(0, 1);
    const int used = std::max(K, E / 2 + 1);
    const int NK = N * K;
    Sorted s{std::vector<int32_t>(size_t(NK)), std::vector<int32_t>(size_t(E) + 1), std::vector<int32_t>(size_t(NK)),
             std::vector<int32_t>(size_t(NK))};
    for (int i = 0; i < N; ++i)
      for (int k = 0; k < K; ++k) {
        const auto first = s.expert.begin() + size_t(i) * K, last = first + k;
        int e;
        do e = std::min(used - 1, int(used * std::pow(u(rng_), 3.0)));
        while (std::find(first, last, e) != last);
        s.expert[size_t(i) * K + k] = e;
      }
    cpu::moe_sort(s.off.data(), s.row.data(), s.slot.data(), s.expert.data(), NK, E);
    return s;
  }

  // Exact equality, element by element (integers; float selections compared with ==).
  template <class T>
  static void exact(const std::vector<T>& gpu, const std::vector<T>& cpu, const std::string& what) {
    ASSERT_EQ(gpu.size(), cpu.size()) << what;
    size_t bad = 0;
    for (size_t i = 0; i < cpu.size(); ++i)
      if (!(gpu[i] == cpu[i]) && bad++ < 5)
        ADD_FAILURE() << what << ": element " << i << " is " << +gpu[i] << ", cpu " << +cpu[i];
    std::printf("[ exact    ] %-44s %zu of %zu differ\n", what.c_str(), bad, cpu.size());
    EXPECT_EQ(bad, 0u) << what;
  }
};

const int kEs[] = {8, 64, 65};
const int kKs[] = {1, 2, 4};

// ---------------------------------------------------------------------------------------------

TEST_F(CudaMoe, RouteMatchesCpuIncludingTies) {
  const int N = 203;
  for (int E : kEs)
    for (int K : kKs)
      for (int variant = 0; variant < 3; ++variant) {
        // 0: continuous scores and bias; 1: scores on a coarse grid, no bias (many exact ties);
        // 2: coarse scores and a coarse bias (ties of s + bias between different s).
        const bool normalized = variant != 0;
        const std::string what = fmt::format("moe_route E={} K={} var={}", E, K, variant);
        SCOPED_TRACE(what);
        std::vector<float> logits, bias;
        if (variant == 0) {
          logits = randv(size_t(N) * E, -3.f, 3.f);
          bias = randv(size_t(E), -0.5f, 0.5f);
        } else {
          logits = quantized(size_t(N) * E, 3, 0.5f);
          bias = variant == 1 ? std::vector<float>(size_t(E), 0.f) : quantized(size_t(E), 2, 0.5f);
        }
        const size_t NK = size_t(N) * K;
        std::vector<float> lse(N), comb(NK);
        std::vector<int32_t> expert(NK);
        cpu::moe_route<float>(lse.data(), expert.data(), comb.data(), logits.data(), bias.data(), N, E, K, normalized,
                              2.5);
        auto d_logits = up(logits), d_bias = up(bias);
        auto d_lse = poisoned<float>(N), d_comb = poisoned<float>(NK);
        auto d_expert = poisoned<int32_t>(NK);
        be().moe_route(d_lse.data(), d_expert.data(), d_comb.data(), d_logits.data(), d_bias.data(), N, E, K,
                       normalized, 2.5);
        exact(down(d_expert, NK), expert, what + " expert");
        check(down(d_lse, N), lse, kF32, what + " lse");
        check(down(d_comb, NK), comb, kF32, what + " comb");
      }
}

TEST_F(CudaMoe, SortIsTheCpuSortBitForBit) {
  const int N = 203;
  for (int E : kEs)
    for (int K : kKs) {
      const std::string what = fmt::format("moe_sort E={} K={}", E, K);
      SCOPED_TRACE(what);
      const int NK = N * K;
      const auto [expert, off, row, slot] = sorted_slots(NK, E);  // upper experts empty, lower ones crowded
      ASSERT_EQ(off[E], NK);
      auto d_expert = up(expert);
      auto d_off = poisoned<int32_t>(E + 1), d_row = poisoned<int32_t>(NK), d_slot = poisoned<int32_t>(NK);
      be().moe_sort(d_off.data(), d_row.data(), d_slot.data(), d_expert.data(), NK, E);
      exact(down(d_off, E + 1), off, what + " offsets");
      exact(down(d_row, NK), row, what + " row");
      exact(down(d_slot, NK), slot, what + " slot");
    }
  // No slots at all: every offset 0.
  auto d_off = poisoned<int32_t>(9);
  be().moe_sort(d_off.data(), nullptr, nullptr, nullptr, 0, 8);
  exact(down(d_off, 9), std::vector<int32_t>(9, 0), "moe_sort NK=0");
  // Every slot on the last expert (E = 65: the top key bit is in use).
  const int E = 65, NK = 77;
  std::vector<int32_t> expert(NK, E - 1), off(E + 1), row(NK), slot(NK);
  cpu::moe_sort(off.data(), row.data(), slot.data(), expert.data(), NK, E);
  auto d_expert = up(expert);
  auto d_off2 = poisoned<int32_t>(E + 1), d_row = poisoned<int32_t>(NK), d_slot = poisoned<int32_t>(NK);
  be().moe_sort(d_off2.data(), d_row.data(), d_slot.data(), d_expert.data(), NK, E);
  exact(down(d_off2, E + 1), off, "moe_sort all on expert 64 offsets");
  exact(down(d_row, NK), row, "moe_sort all on expert 64 row");
  exact(down(d_slot, NK), slot, "moe_sort all on expert 64 slot");
}

TEST_F(CudaMoe, GatherCombineAndBackward) {
  const int N = 131;
  for (int E : kEs)
    for (int K : kKs)
      for (int d : {1, 37, 300}) {
        const std::string what = fmt::format("E={} K={} d={}", E, K, d);
        SCOPED_TRACE(what);
        const int NK = N * K;
        const auto [expert, off, row, slot] = sorted_slots(NK, E);
        auto h = randv(size_t(N) * d), y = randv(size_t(NK) * d), comb = randv(size_t(NK), 0.f, 1.f);
        auto out0 = randv(size_t(N) * d), dout = randv(size_t(N) * d), dx = randv(size_t(NK) * d);
        auto d_row = up(row), d_slot = up(slot);
        auto d_h = up(h), d_y = up(y), d_comb = up(comb), d_dout = up(dout), d_dx = up(dx);

        std::vector<float> xs(size_t(NK) * d);
        cpu::moe_gather<float>(xs.data(), h.data(), slot.data(), NK, K, d);
        auto d_xs = poisoned<float>(xs.size());
        be().moe_gather(d_xs.data(), d_h.data(), d_slot.data(), NK, K, d);
        check(down(d_xs, xs.size()), xs, 0.0, "moe_gather " + what);

        std::vector<float> out = out0;  // accumulates: starts from random values
        cpu::moe_combine<float>(out.data(), y.data(), comb.data(), row.data(), N, K, d);
        auto d_out = up(out0);
        be().moe_combine(d_out.data(), d_y.data(), d_comb.data(), d_row.data(), N, K, d);
        check(down(d_out, out.size()), out, kF32, "moe_combine " + what);

        std::vector<float> dy(size_t(NK) * d), dcomb(NK);
        cpu::moe_combine_backward<float>(dy.data(), dcomb.data(), dout.data(), y.data(), comb.data(), row.data(), N,
                                         K, d);
        auto d_dy = poisoned<float>(dy.size()), d_dcomb = poisoned<float>(NK);
        be().moe_combine_backward(d_dy.data(), d_dcomb.data(), d_dout.data(), d_y.data(), d_comb.data(),
                                  d_row.data(), N, K, d);
        check(down(d_dy, dy.size()), dy, 0.0, "moe_combine_backward dy " + what);  // one product each
        check(down(d_dcomb, NK), dcomb, kF32, "moe_combine_backward dcomb " + what);

        std::vector<float> dh(size_t(N) * d);
        cpu::moe_gather_backward<float>(dh.data(), dx.data(), row.data(), N, K, d);
        auto d_dh = poisoned<float>(dh.size());
        be().moe_gather_backward(d_dh.data(), d_dx.data(), d_row.data(), N, K, d);
        check(down(d_dh, dh.size()), dh, kF32, "moe_gather_backward " + what);
      }
}

// model.moe_bf16's forms: the gather rounding its rows to bf16 (exact: the CPU's bits), the
// combine and its backward reading bf16 expert outputs (against the CPU on the same bf16 bits).
TEST_F(CudaMoe, GatherAndCombineWithBf16Rows) {
  const int N = 131;
  for (int K : kKs)
    for (int d : {1, 37, 300}) {
      const std::string what = fmt::format("K={} d={}", K, d);
      SCOPED_TRACE(what);
      const int NK = N * K, E = 8;
      const auto [expert, off, row, slot] = sorted_slots(NK, E);
      auto h = randv(size_t(N) * d), comb = randv(size_t(NK), 0.f, 1.f), out0 = randv(size_t(N) * d);
      auto dout = randv(size_t(N) * d);
      auto cpu_be = make_cpu_backend(0);
      const auto yf = randv(size_t(NK) * d);
      std::vector<uint16_t> y16(yf.size());
      cpu::f32_to_bf16(y16.data(), yf.data(), yf.size());
      auto d_row = up(row), d_slot = up(slot);
      auto d_h = up(h), d_comb = up(comb), d_dout = up(dout);
      auto d_y = up(y16);

      std::vector<uint16_t> xs(size_t(NK) * d);
      cpu_be->moe_gather_bf16(xs.data(), h.data(), slot.data(), NK, K, d);
      auto d_xs = poisoned<uint16_t>(xs.size());
      be().moe_gather_bf16(d_xs.data(), d_h.data(), d_slot.data(), NK, K, d);
      EXPECT_EQ(down(d_xs, xs.size()), xs) << "moe_gather_bf16 " << what;

      std::vector<float> out = out0;
      cpu_be->moe_combine_bf16(out.data(), y16.data(), comb.data(), row.data(), N, K, d);
      auto d_out = up(out0);
      be().moe_combine_bf16(d_out.data(), d_y.data(), d_comb.data(), d_row.data(), N, K, d);
      check(down(d_out, out.size()), out, kF32, "moe_combine_bf16 " + what);

      std::vector<float> dy(size_t(NK) * d), dcomb(NK);
      cpu_be->moe_combine_backward_bf16(dy.data(), dcomb.data(), dout.data(), y16.data(), comb.data(), row.data(), N, K,
                                      d);
      auto d_dy = poisoned<float>(dy.size()), d_dcomb = poisoned<float>(NK);
      be().moe_combine_backward_bf16(d_dy.data(), d_dcomb.data(), d_dout.data(), d_y.data(), d_comb.data(),
                                     d_row.data(), N, K, d);
      check(down(d_dy, dy.size()), dy, 0.0, "moe_combine_backward_bf16 dy " + what);
      check(down(d_dcomb, NK), dcomb, kF32, "moe_combine_backward_bf16 dcomb " + what);
    }
}

// model.moe_bf16_grads' ops, poisoned outputs: the combine backward writing dy in bf16 is the
// CPU's bits (one product per element, then the rounding); its dcomb is the fp32-dy op's, bitwise.
// SwiGLU's backward with bf16 dh, dg and du is the device's fp32-gradient SwiGLU backward on the
// widened dh, rounded, bitwise (one formula), and within one bf16 step of the CPU's (the device's
// expf and the CPU's exp differ in the last fp32 bit, which may move a rounding).
TEST_F(CudaMoe, Bf16GradientOpsMatchTheirFp32FormsRounded) {
  auto cpu_be = make_cpu_backend(0);
  const int N = 131;
  for (int K : kKs)
    for (int d : {1, 37, 300}) {
      const std::string what = fmt::format("K={} d={}", K, d);
      SCOPED_TRACE(what);
      const int NK = N * K, E = 8;
      const auto [expert, off, row, slot] = sorted_slots(NK, E);
      const auto comb = randv(size_t(NK), 0.f, 1.f), dout = randv(size_t(N) * d);
      const auto y16 = test::to_b16(randv(size_t(NK) * d));
      auto d_row = up(row);
      auto d_comb = up(comb), d_dout = up(dout);
      auto d_y = up(y16);
      std::vector<uint16_t> dy(size_t(NK) * d, 0xffff);
      std::vector<float> dcomb(NK, NAN);
      cpu_be->moe_combine_backward_bf16_grads(dy.data(), dcomb.data(), dout.data(), y16.data(), comb.data(),
                                              row.data(), N, K, d);
      auto d_dy = poisoned<uint16_t>(dy.size());
      auto d_dy32 = poisoned<float>(dy.size());
      auto d_dcomb = poisoned<float>(NK), d_dcomb32 = poisoned<float>(NK);
      be().moe_combine_backward_bf16_grads(d_dy.data(), d_dcomb.data(), d_dout.data(), d_y.data(), d_comb.data(),
                                           d_row.data(), N, K, d);
      be().moe_combine_backward_bf16(d_dy32.data(), d_dcomb32.data(), d_dout.data(), d_y.data(), d_comb.data(),
                                     d_row.data(), N, K, d);
      exact(down(d_dy, dy.size()), dy, "moe_combine_backward_bf16_grads dy vs cpu " + what);
      check(down(d_dcomb, NK), down(d_dcomb32, NK), 0.0, "moe_combine_backward_bf16_grads dcomb (exact) " + what);
      check(down(d_dcomb, NK), dcomb, kF32, "moe_combine_backward_bf16_grads dcomb vs cpu " + what);
    }
  for (size_t n : {size_t(1), size_t(37), size_t(8 * 97 + 5), size_t(40000)}) {
    const std::string what = fmt::format("swiglu n={}", n);
    SCOPED_TRACE(what);
    const auto g16 = test::to_b16(randv(n, -4.f, 4.f)), u16 = test::to_b16(randv(n)),
               dh16 = test::to_b16(randv(n));
    auto d_g = up(g16), d_u = up(u16), d_dh = up(dh16);
    auto d_dhw = up(test::widen(dh16));
    auto d_dg = poisoned<uint16_t>(n), d_du = poisoned<uint16_t>(n);
    auto d_dg32 = poisoned<float>(n), d_du32 = poisoned<float>(n);
    be().swiglu_backward_bf16_grads(d_dg.data(), d_du.data(), d_dh.data(), d_g.data(), d_u.data(), n);
    be().swiglu_backward_bf16(d_dg32.data(), d_du32.data(), d_dhw.data(), d_g.data(), d_u.data(), n);
    const auto dg = down(d_dg, n), du = down(d_du, n);
    exact(dg, test::to_b16(down(d_dg32, n)), "swiglu_backward_bf16_grads dg = the fp32 form rounded " + what);
    exact(du, test::to_b16(down(d_du32, n)), "swiglu_backward_bf16_grads du = the fp32 form rounded " + what);
    std::vector<uint16_t> cdg(n, 0xffff), cdu(n, 0xffff);
    cpu_be->swiglu_backward_bf16_grads(cdg.data(), cdu.data(), dh16.data(), g16.data(), u16.data(), n);
    // One bf16 step is a relative 2^-8 of an element; over a vector far less.
    check(test::widen(dg), test::widen(cdg), 1.0 / 256, "swiglu_backward_bf16_grads dg vs cpu " + what);
    check(test::widen(du), test::widen(cdu), 1.0 / 256, "swiglu_backward_bf16_grads du vs cpu " + what);
  }
}

TEST_F(CudaMoe, RouterBackwardMatchesCpu) {
  const int N = 157;
  for (int E : kEs)
    for (int K : kKs)
      for (int variant = 0; variant < 3; ++variant) {
        // 0: plain sigmoid, no z-loss; 1: normalized, z-loss; 2: plain sigmoid, z-loss.
        const bool normalized = variant == 1;
        const float z = variant == 0 ? 0.f : 3e-2f;
        const std::string what = fmt::format("moe_router_backward E={} K={} var={}", E, K, variant);
        SCOPED_TRACE(what);
        const size_t NK = size_t(N) * K;
        auto logits = randv(size_t(N) * E, -3.f, 3.f), bias = randv(size_t(E), -0.3f, 0.3f);
        auto dcomb = randv(NK);
        std::vector<float> lse(N), comb(NK), ds(size_t(N) * E);
        std::vector<int32_t> expert(NK);
        cpu::moe_route<float>(lse.data(), expert.data(), comb.data(), logits.data(), bias.data(), N, E, K, normalized,
                              1.7);
        cpu::moe_router_backward<float>(ds.data(), logits.data(), lse.data(), expert.data(), dcomb.data(), N, E, K,
                                        normalized, 1.7, z);
        auto d_logits = up(logits), d_lse = up(lse), d_dcomb = up(dcomb);
        auto d_expert = up(expert);
        auto d_ds = poisoned<float>(ds.size());
        be().moe_router_backward(d_ds.data(), d_logits.data(), d_lse.data(), d_expert.data(), d_dcomb.data(), N, E,
                                 K, normalized, 1.7, z);
        check(down(d_ds, ds.size()), ds, kF32, what);
      }
}

TEST_F(CudaMoe, BalanceValuesAndQuantileBetaAreExact) {
  for (int E : kEs)
    for (int K : kKs)
      for (int T : {1, 10, 777}) {
        for (int ties = 0; ties < 2; ++ties) {
          const std::string what = fmt::format("E={} K={} T={}{}", E, K, T, ties ? " ties" : "");
          SCOPED_TRACE(what);
          auto logits = ties ? quantized(size_t(T) * E, 4, 0.25f) : randv(size_t(T) * E, -4.f, 4.f);
          auto bias = ties ? quantized(size_t(E), 1, 0.25f) : randv(size_t(E), -0.5f, 0.5f);
          std::vector<float> vals(size_t(T) * E);
          cpu::moe_balance_values<float>(vals.data(), logits.data(), bias.data(), T, E, K);
          auto d_logits = up(logits), d_bias = up(bias);
          auto d_vals = poisoned<float>(vals.size());
          be().moe_balance_values(d_vals.data(), d_logits.data(), d_bias.data(), T, E, K);
          auto got = down(d_vals, vals.size());
          // s - alpha with the same alpha is the same float subtraction: exact.
          exact(got, vals, "moe_balance_values " + what);

          // beta from the same vals on both sides (the CPU's), so the selection alone is tested;
          // negative zeros included (they equal +0 in the selection).
          std::vector<float> v2 = vals;
          if (ties && !v2.empty()) v2[0] = -0.f;
          std::vector<double> beta(E);
          cpu::moe_quantile_beta(beta.data(), v2.data(), T, E, K);
          auto d_v2 = up(v2);
          auto d_beta = poisoned<double>(E);
          be().moe_quantile_beta(d_beta.data(), d_v2.data(), T, E, K);
          exact(down(d_beta, E), beta, "moe_quantile_beta " + what);
        }
      }
  // A large column: T = 100000 (several grid-stride passes of the select and transpose).
  const int T = 100000, E = 8, K = 2;
  auto vals = randv(size_t(T) * E, -5.f, 5.f);
  for (size_t i = 0; i < vals.size(); i += 3) vals[i] = std::round(vals[i] * 4.f) / 4.f;  // ties
  std::vector<double> beta(E);
  cpu::moe_quantile_beta(beta.data(), vals.data(), T, E, K);
  auto d_vals = up(vals);
  auto d_beta = poisoned<double>(E);
  be().moe_quantile_beta(d_beta.data(), d_vals.data(), T, E, K);
  exact(down(d_beta, E), beta, "moe_quantile_beta T=100000");
}

TEST_F(CudaMoe, QuantileBetaInColumnChunks) {
  // T = 2^22: 16 MiB of keys per column, so the 64 MiB scratch takes 4 columns at a time and
  // E = 21 runs in 6 chunks, the last one a single column.
  const int64_t T = int64_t(1) << 22;
  const int E = 21, K = 3;
  std::vector<float> vals(size_t(T) * E);
  std::uniform_int_distribution<int> q(-20000, 20000);  // coarse values: many ties around the quantile
  for (auto& x : vals) x = float(q(rng_)) * 1e-3f;
  std::vector<double> beta(E);
  cpu::moe_quantile_beta(beta.data(), vals.data(), T, E, K);
  auto d_vals = up(vals);
  auto d_beta = poisoned<double>(E);
  be().moe_quantile_beta(d_beta.data(), d_vals.data(), T, E, K);
  exact(down(d_beta, E), beta, "moe_quantile_beta T=2^22 E=21 (chunks)");
}

TEST_F(CudaMoe, CountLoadAndPkoResets) {
  for (int E : kEs) {
    const int NK = 500;
    const auto [expert, off, row, slot] = sorted_slots(NK, E);
    std::vector<int64_t> load(E);
    for (auto& x : load) x = randint(0, 1000);
    auto d_load = up(load);
    auto d_off = up(off);
    cpu::moe_count_load(load.data(), off.data(), E);
    be().moe_count_load(d_load.data(), d_off.data(), E);
    exact(down(d_load, E), load, fmt::format("moe_count_load E={}", E));
  }
  for (int S : {1, 7, 64}) {
    const int N_tok = 3 * S + (S > 1 ? 5 : 0), eod = 3;
    std::vector<int32_t> ids(N_tok);
    for (auto& x : ids) x = randint(0, 5);  // eod often, also at sequence ends
    std::vector<uint8_t> reset(N_tok);
    cpu::pko_resets(reset.data(), ids.data(), N_tok, S, eod);
    auto d_ids = up(ids);
    auto d_reset = poisoned<uint8_t>(N_tok);
    be().pko_resets(d_reset.data(), d_ids.data(), N_tok, S, eod);
    exact(down(d_reset, N_tok), reset, fmt::format("pko_resets S={}", S));
  }
}

// ---------------------------------------------------------------------------------------------
// Grouped GEMM

using grouped_gemm_test::GroupedCase;

TEST_F(CudaMoe, GroupedGemmBothShapes) {
  const GroupedCase cases[] = {
      // rows_out = true (forward / data gradient), both transB, beta 0 on a poisoned C and beta != 0.
      {true, true, 8, 0, 75, 37, 0, 1.f, 0.f, 50},
      {true, false, 8, 0, 75, 37, 3, 0.7f, 0.f, 50},
      {true, true, 65, 0, 130, 67, 1, -1.3f, 0.5f, 20},
      {true, false, 65, 0, 33, 129, 0, 1.f, 1.f, 20},
      {true, true, 64, 0, 64, 64, 0, 1.f, 0.f, 64},
      {true, false, 8, 0, 200, 512, 2, 0.25f, -0.75f, 90},
      {true, true, 8, 0, 5, 0, 0, 1.f, 0.5f, 10},  // K = 0: C = beta C
      // rows_out = false (weight gradient), beta 0 poisoned, 1 (accumulate) and other.
      {false, false, 8, 70, 45, 0, 0, 1.f, 0.f, 50},
      {false, true, 8, 70, 45, 0, 5, 0.7f, 1.f, 50},  // transB is unused by this shape
      {false, false, 65, 33, 130, 0, 1, -1.3f, 0.5f, 20},
      {false, false, 64, 64, 64, 0, 0, 1.f, 1.f, 64},
      {false, false, 8, 129, 200, 0, 3, 0.5f, 0.f, 300},
  };
  for (const auto& c : cases) {
    const std::string what = c.name();
    SCOPED_TRACE(what);
    const auto p = grouped_gemm_test::make_problem(c, rng_);
    const auto& C = p.C;
    const std::vector<float> ref = grouped_gemm_test::reference(c, p);
    auto d_off = up(p.off);
    auto d_A = up(p.A), d_B = up(p.B);
    std::vector<float> first;
    for (int rep = 0; rep < 2; ++rep) {
      DeviceBuffer<float> d_C(C.size() ? C.size() : 1);
      if (c.beta == 0.f) d_C.poison(); else d_C.upload(C);  // beta 0 must not read C
      be().grouped_gemm(c.rows_out, c.transB, c.E, d_off.data(), c.M, c.N, c.K, c.alpha, d_A.data(), p.lda,
                        d_B.data(), p.ldb, p.sB, c.beta, d_C.data(), p.ldc, p.sC);
      auto got = down(d_C, C.size());
      // Compare the logical output (padding is not part of it), and that padding kept its value
      // when C was not poisoned.
      const auto out = grouped_gemm_test::logical_output(c, p, got, ref);
      EXPECT_EQ(out.pad_changed, 0u) << "elements outside the output were written";
      if (out.got.empty()) continue;
      check(out.got, out.ref, kF32, what);
      if (rep == 0) {
        first = got;
      } else {
        EXPECT_EQ(std::memcmp(first.data(), got.data(), got.size() * sizeof(float)), 0)
            << "not bitwise reproducible run to run";
      }
    }
  }
}

TEST_F(CudaMoe, GroupedGemmAllExpertsEmpty) {
  const int E = 5, M = 20, N = 30;
  std::vector<int32_t> off(E + 1, 0);
  auto d_off = up(off);
  auto C = randv(size_t(E) * M * N);
  for (float beta : {0.f, 1.f, -2.f}) {
    DeviceBuffer<float> d_C(C.size());
    if (beta == 0.f) d_C.poison(); else d_C.upload(C);
    be().grouped_gemm(false, false, E, d_off.data(), M, N, 0, 1.f, nullptr, M, nullptr, N, 0, beta, d_C.data(), N,
                      size_t(M) * N);
    std::vector<float> ref = C;
    cpu::grouped_gemm<float>(false, false, E, off.data(), M, N, 0, 1.f, nullptr, M, nullptr, N, 0, beta, ref.data(),
                             N, size_t(M) * N);
    check(down(d_C, C.size()), ref, 0.0, fmt::format("grouped_gemm all empty beta={}", beta));
    // rows_out = true with no rows: nothing to do, C untouched.
    DeviceBuffer<float> d_R(7);
    d_R.upload(C.data(), 7);
    be().grouped_gemm(true, true, E, d_off.data(), 0, N, M, 1.f, nullptr, M, nullptr, M, size_t(N) * M, beta,
                      d_R.data(), N, 0);
    check(down(d_R, 7), std::vector<float>(C.begin(), C.begin() + 7), 0.0, "grouped_gemm rows_out no rows");
  }
}

// ---------------------------------------------------------------------------------------------
// grouped_gemm_ex (model.moe_bf16): A, B and C each fp32 or bf16 bits, the CUDA backend against the
// CPU backend's reference (widen, fp32 grouped GEMM, round to nearest even), every (a_bf16, b_bf16,
// c_bf16), both shapes (rows_out with transB true and false; the weight-gradient shape), random
// offsets with empty experts, `rows` equal to or larger than offsets[E] (the buffers hold that many rows; the
// rows past offsets[E] of a rows_out C must keep their poison), poisoned outputs for beta 0 and a
// fp32 C with beta != 0 in some combinations (C read), fp32 C with padded rows (padding untouched).

struct ExCase {
  bool rows_out, transB;
  int E, M, N, K, max_rows;
  int extra_rows;  // `rows` - offsets[E]: 0 (the model's calls) or more
};

std::vector<uint16_t> bf16_of(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = cpu::bf16_bits(v[i]);
  return b;
}

// tol32 / tol16: bounds on ||gpu - cpu|| / ||cpu|| for a fp32 / a bf16 (widened) C; min_same: the
// fraction of bf16 output elements that must be bitwise the CPU's (0: not checked).
void grouped_ex_vs_cpu(Backend& gb, std::mt19937_64& rng, const std::string& tag, double tol32, double tol16,
                       double min_same) {
  auto cpu_be = make_cpu_backend(0);
  Backend& cb = *cpu_be;
  const ExCase cases[] = {
      {true, true, 7, 0, 70, 36, 20, 9},
      {true, false, 7, 0, 36, 70, 20, 0},
      {true, false, 5, 0, 40, 36, 20, 5},
      {false, false, 7, 40, 70, 0, 20, 9},
  };
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  auto randv = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = u(rng);
    return v;
  };
  auto dev = [](const auto& h) {
    using T = typename std::decay_t<decltype(h)>::value_type;
    DeviceBuffer<T> d(h.size() ? h.size() : 1);
    if (!h.empty()) d.upload(h);
    return d;
  };
  for (const ExCase& c : cases) {
    const std::vector<int32_t> off = grouped_gemm_test::random_offsets(rng, c.E, c.max_rows);
    const int total = off[c.E], rows = total + c.extra_rows;  // the bound on offsets[E]
    const int lda = c.rows_out ? c.K + 3 : c.M + 1;
    const int ldb = c.rows_out ? (c.transB ? c.K : c.N) + 1 : c.N + 2;
    const size_t sB = c.rows_out ? size_t(c.transB ? c.N : c.K) * ldb + 3 : 0;
    const std::vector<float> A = randv(size_t(rows) * lda), B = randv(c.rows_out ? sB * c.E : size_t(rows) * ldb);
    const std::vector<uint16_t> A16 = bf16_of(A), B16 = bf16_of(B);
    auto dA = dev(A), dB = dev(B);
    auto dA16 = dev(A16), dB16 = dev(B16);
    auto d_off = dev(off);
    for (int combo = 0; combo < 8; ++combo) {
      const bool a16 = combo & 1, b16 = combo & 2, c16 = combo & 4;
      const std::string what = fmt::format("{} grouped_gemm_ex rows_out={} tB={} A{} B{} C{}", tag, c.rows_out,
                                           c.transB, a16 ? 16 : 32, b16 ? 16 : 32, c16 ? 16 : 32);
      SCOPED_TRACE(what);
      // A bf16 C is packed; a fp32 C gets padded rows (and a padded expert stride).
      const int ldc = c16 ? c.N : c.N + 2;
      const size_t sC = c.rows_out ? 0 : size_t(c.M) * ldc + (c16 ? 0 : 5);
      const size_t nC = c.rows_out ? size_t(rows) * ldc : size_t(c.E) * sC;
      const float alpha = 0.7f, beta = !c16 && a16 != b16 ? 0.5f : 0.f;
      std::vector<char> is_out(nC, 0);
      const int blocks = c.rows_out ? 1 : c.E, out_rows = c.rows_out ? total : c.M;
      for (int e = 0; e < blocks; ++e)
        for (int r = 0; r < out_rows; ++r)
          for (int j = 0; j < c.N; ++j) is_out[size_t(e) * sC + size_t(r) * ldc + j] = 1;
      const void* hA = a16 ? static_cast<const void*>(A16.data()) : A.data();
      const void* hB = b16 ? static_cast<const void*>(B16.data()) : B.data();
      const void* gA = a16 ? static_cast<const void*>(dA16.data()) : dA.data();
      const void* gB = b16 ? static_cast<const void*>(dB16.data()) : dB.data();
      size_t same = 0, outs = 0, outside = 0;
      std::vector<float> got, ref;
      if (c16) {
        std::vector<uint16_t> hc(nC, 0xFFFF);
        auto dc = dev(hc);
        cb.grouped_gemm_ex(c.rows_out, c.transB, c.E, off.data(), rows, c.M, c.N, c.K, alpha, hA, a16, lda, hB, b16,
                           ldb, sB, 0.f, hc.data(), true, ldc, sC);
        gb.grouped_gemm_ex(c.rows_out, c.transB, c.E, d_off.data(), rows, c.M, c.N, c.K, alpha, gA, a16, lda, gB,
                           b16, ldb, sB, 0.f, dc.data(), true, ldc, sC);
        gb.synchronize();
        const std::vector<uint16_t> gc = dc.download();
        for (size_t i = 0; i < nC; ++i) {
          if (!is_out[i]) {
            outside += gc[i] != 0xFFFF;  // rows_out: the rows past offsets[E]
            continue;
          }
          ++outs;
          same += gc[i] == hc[i];
          got.push_back(cpu::bf16_value(gc[i]));
          ref.push_back(cpu::bf16_value(hc[i]));
        }
      } else {
        const std::vector<float> C0 = randv(nC);
        std::vector<float> hc = C0;
        auto dc = dev(C0);
        if (beta == 0.f) {  // C not read: poisoned on both sides
          std::memset(hc.data(), 0xFF, nC * sizeof(float));
          dc.poison();
        }
        const std::vector<float> init = hc;
        cb.grouped_gemm_ex(c.rows_out, c.transB, c.E, off.data(), rows, c.M, c.N, c.K, alpha, hA, a16, lda, hB, b16,
                           ldb, sB, beta, hc.data(), false, ldc, sC);
        gb.grouped_gemm_ex(c.rows_out, c.transB, c.E, d_off.data(), rows, c.M, c.N, c.K, alpha, gA, a16, lda, gB,
                           b16, ldb, sB, beta, dc.data(), false, ldc, sC);
        gb.synchronize();
        const std::vector<float> gc = dc.download();
        for (size_t i = 0; i < nC; ++i) {
          if (!is_out[i]) {
            outside += std::memcmp(&gc[i], &init[i], sizeof(float)) != 0;
            continue;
          }
          ++outs;
          got.push_back(gc[i]);
          ref.push_back(hc[i]);
        }
      }
      EXPECT_EQ(outside, 0u) << "elements outside the output were written";
      ASSERT_GT(outs, 0u);
      test::check_rel(got, ref, c16 ? tol16 : tol32, what);
      if (c16 && min_same > 0) {
        std::printf("[ same     ] %-60s %zu of %zu bitwise\n", what.c_str(), same, outs);
        EXPECT_GE(double(same), min_same * double(outs)) << "bf16 outputs bitwise equal to the CPU's";
      }
    }
  }
}

// The fp32 backend: bf16 operands widened in scratch, the fp32 kernel, a bf16 C rounded from it.
// fp32 C: fp32-level agreement; bf16 C: the same fp32 values rounded, so bitwise equal but where
// the two fp32 results straddle a rounding midpoint (then one bf16 ulp apart).
TEST_F(CudaMoe, GroupedGemmExMatchesTheCpuBackend) {
  grouped_ex_vs_cpu(be(), rng_, "fp32", kF32, 1e-2, 0.95);
}

// The bf16 backend: the tensor-core kernel reads bf16 operands as they are and writes a bf16 C
// directly; fp32 operands are rounded to bf16 on the way in, so against the CPU's fp32 product the
// bf16 bound of grouped_tc_cases.h.
TEST_F(CudaMoe, GroupedGemmExBf16BackendMatchesTheCpuBackend) {
  auto bf = make_cuda_backend("bf16");
  grouped_ex_vs_cpu(*bf, rng_, "bf16", 1e-2, 1e-2, 0);
}

// A bf16 C takes no addend and must be packed: ladder::Error before anything runs, on both the fp32
// and the bf16 backend, for both shapes.
TEST_F(CudaMoe, GroupedGemmExBf16OutputRejectsBetaAndPadding) {
  auto bf = make_cuda_backend("bf16");
  const int E = 3, M = 8, N = 8, K = 8, rows = 12;
  const std::vector<int32_t> off = {0, 4, 4, 10};
  auto d_off = up(off);
  DeviceBuffer<float> A(size_t(rows) * 16), B(size_t(E) * 64 + size_t(rows) * 16);
  auto C = poisoned<uint16_t>(size_t(E) * M * (N + 1) + size_t(rows) * (N + 1));
  for (Backend* g : {static_cast<Backend*>(&be()), bf.get()})
    for (bool rows_out : {true, false}) {
      SCOPED_TRACE(fmt::format("{} rows_out {}", g == bf.get() ? "bf16" : "fp32", rows_out));
      const size_t sB = rows_out ? size_t(N) * K : 0, sC = rows_out ? 0 : size_t(M) * N;
      EXPECT_THROW(g->grouped_gemm_ex(rows_out, true, E, d_off.data(), rows, M, N, K, 1.f, A.data(), false, 8,
                                      B.data(), false, 8, sB, 0.5f, C.data(), true, N, sC),
                   Error);
      EXPECT_THROW(g->grouped_gemm_ex(rows_out, true, E, d_off.data(), rows, M, N, K, 1.f, A.data(), false, 8,
                                      B.data(), false, 8, sB, 0.f, C.data(), true, N + 1, sC),
                   Error);
      g->synchronize();
    }
  const std::vector<uint16_t> after = C.download();
  EXPECT_TRUE(std::all_of(after.begin(), after.end(), [](uint16_t v) { return v == 0xFFFF; }))
      << "a refused call wrote its output";
}

// ---------------------------------------------------------------------------------------------
// The capacity layout (model.moe_capacity): moe_capacity's maps, moe_zero_rows, and the gathers'
// zero rows for negative slots, against the CPU kernels bit for bit.

// The CPU's capacity layout of a sorted routing: row (slot -> layout row), cslot [R], ov [E+2] (the
// overflow offsets, then the rows in use).
struct Capacity {
  std::vector<int32_t> row, cslot, ov;
};
Capacity cpu_capacity(const std::vector<int32_t>& off, const std::vector<int32_t>& slot, int NK, int E, int C,
                      int R) {
  Capacity c{std::vector<int32_t>(size_t(NK)), std::vector<int32_t>(size_t(R)), std::vector<int32_t>(size_t(E) + 2)};
  cpu::moe_capacity(c.row.data(), c.cslot.data(), c.ov.data(), off.data(), slot.data(), NK, E, C, R);
  return c;
}

// Every map of the layout, bit for bit, over E in {8, 64, 65}, K in {1, 2, 4}, C from 1 (nearly
// everything overflows) to N (no overflow: every expert padded), R the model's bound and R with
// spare rows: ov[E+1] = E*C + ov[E] (the rows in use), cslot -1 on the padding rows below E*C and
// -2 on every row from ov[E+1] on (the unused rows, spare ones included), checked on the CPU's
// answer too so a stale reference cannot pass. row and the maps start poisoned (-1 is a valid
// cslot value, so cslot is poisoned with 0x7F bytes instead).
TEST_F(CudaMoe, CapacityLayoutMatchesTheCpu) {
  const int N = 131;
  bool saw_overflow = false, saw_padding = false, saw_no_overflow = false, saw_unused = false;
  for (int E : kEs)
    for (int K : kKs)
      for (int C : {1, 8, std::max(1, N * K / E), N})
        for (int spare : {0, 7}) {
          const int NK = N * K;
          const int R = int(cpu::moe_capacity_rows(N, K, E, C)) + spare;
          const std::string what = fmt::format("moe_capacity E={} K={} C={} R={}", E, K, C, R);
          SCOPED_TRACE(what);
          const Sorted s = distinct_sorted(N, K, E);
          const Capacity ref = cpu_capacity(s.off, s.slot, NK, E, C, R);
          const int used = E * C + ref.ov[E];
          ASSERT_EQ(ref.ov[E + 1], used) << "the CPU's ov[E+1] is not the rows in use";
          ASSERT_EQ(std::count(ref.cslot.begin(), ref.cslot.end(), -2), R - used) << "the CPU's unused rows";
          ASSERT_TRUE(std::all_of(ref.cslot.begin() + used, ref.cslot.end(), [](int32_t c) { return c == -2; }));
          saw_unused |= used < R;
          saw_overflow |= ref.ov[E] > 0;
          saw_no_overflow |= ref.ov[E] == 0;
          saw_padding |= std::count(ref.cslot.begin(), ref.cslot.begin() + size_t(E) * C, -1) > 0;
          auto d_off = up(s.off), d_slot = up(s.slot);
          auto d_row = poisoned<int32_t>(NK), d_ov = poisoned<int32_t>(E + 2);
          auto d_cslot = up(std::vector<int32_t>(size_t(R), 0x7F7F7F7F));
          be().moe_capacity(d_row.data(), d_cslot.data(), d_ov.data(), d_off.data(), d_slot.data(), NK, E, C, R);
          exact(down(d_ov, E + 2), ref.ov, what + " ov");
          exact(down(d_row, NK), ref.row, what + " row");
          exact(down(d_cslot, R), ref.cslot, what + " cslot");
        }
  EXPECT_TRUE(saw_overflow && saw_padding && saw_no_overflow && saw_unused)
      << "the cases miss overflow, padding, neither or unused rows";
  // No slots: the overflow offsets all 0 and E*C rows in use, every cslot below E*C -1 and the rest
  // -2, row untouched (it has no element).
  const int E = 8, C = 4, R = 40;
  auto d_off = up(std::vector<int32_t>(E + 1, 0));
  auto d_ov = poisoned<int32_t>(E + 2), d_cslot = up(std::vector<int32_t>(R, 5));
  be().moe_capacity(nullptr, d_cslot.data(), d_ov.data(), d_off.data(), nullptr, 0, E, C, R);
  std::vector<int32_t> ov0(E + 2, 0), cslot0(R, -2);
  ov0[E + 1] = E * C;
  std::fill(cslot0.begin(), cslot0.begin() + E * C, -1);
  exact(down(d_ov, E + 2), ov0, "moe_capacity NK=0 ov");
  exact(down(d_cslot, R), cslot0, "moe_capacity NK=0 cslot");
  // C < 1, or fewer rows than E*C: one ladder::Error line before anything runs.
  EXPECT_THROW(be().moe_capacity(nullptr, d_cslot.data(), d_ov.data(), d_off.data(), nullptr, 0, E, 0, R), Error);
  EXPECT_THROW(be().moe_capacity(nullptr, d_cslot.data(), d_ov.data(), d_off.data(), nullptr, 0, E, 6, R), Error);
}

// moe_zero_rows: the rows q < rows with cslot[q] < 0 become zeros, every other byte (rows with a
// slot, rows past `rows`) is left as it was; fp32 and bf16, aligned (vector path) and at an odd
// element offset (scalar path), against cpu::moe_zero_rows byte for byte.
TEST_F(CudaMoe, ZeroRowsMatchesTheCpu) {
  std::bernoulli_distribution pad(0.3);
  for (bool bf16 : {false, true})
    for (int cols : {1, 37, 64, 300})
      for (size_t offset : {size_t(0), size_t(1)}) {
        const int total = 97, rows = 90;  // rows 90..96 are outside: never zeroed
        const std::string what = fmt::format("moe_zero_rows bf16={} cols={} offset={}", bf16, cols, offset);
        SCOPED_TRACE(what);
        std::vector<int32_t> cslot(static_cast<size_t>(total));
        for (auto& c : cslot) c = pad(rng_) ? -1 - int(rng_() % 3) : int(rng_() % 1000);
        cslot[0] = -1;
        cslot[total - 1] = -1;
        auto d_cslot = up(cslot);
        const size_t n = size_t(total) * cols;
        if (bf16) {
          const std::vector<uint16_t> x = bf16_of(randv(n));
          std::vector<uint16_t> ref = x;
          cpu::moe_zero_rows(ref.data(), sizeof(uint16_t), cslot.data(), rows, cols);
          auto d_x = up(x, offset);
          be().moe_zero_rows(d_x.data() + offset, true, d_cslot.data(), rows, cols);
          exact(down(d_x, n, offset), ref, what);
        } else {
          const std::vector<float> x = randv(n);
          std::vector<float> ref = x;
          cpu::moe_zero_rows(ref.data(), sizeof(float), cslot.data(), rows, cols);
          auto d_x = up(x, offset);
          be().moe_zero_rows(d_x.data() + offset, false, d_cslot.data(), rows, cols);
          exact(down(d_x, n, offset), ref, what);
        }
      }
}

// moe_gather / moe_gather_bf16 through a capacity layout's cslot (the model's call): rows with a
// slot are the token's row (bf16: rounded), padding rows (-1) zeros, unused rows (-2) not written,
// on poisoned outputs, against the CPU backend's gathers (their outputs poisoned alike) bit for
// bit; then a hand-made slot map with other values below -1 (-3, INT_MIN: "below -1", not "-2", is
// the contract), whose rows must keep their poison. d = 300 takes the vector path, 37 the scalar one.
TEST_F(CudaMoe, GatherWritesZerosForNegativeSlots) {
  auto cpu_be = make_cpu_backend(0);
  auto bits = [](const std::vector<float>& v) {  // floats compared as bits: the poison is a NaN
    std::vector<uint32_t> b(v.size());
    if (!v.empty()) std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
    return b;
  };
  // Every element of the rows whose slot is below -1 still the poison (all bits set).
  auto kept = [](const auto& x, const std::vector<int32_t>& slots, int d, const std::string& what) {
    using T = typename std::decay_t<decltype(x)>::value_type;  // uint32_t or uint16_t
    size_t bad = 0;
    for (size_t q = 0; q < slots.size(); ++q)
      if (slots[q] < -1)
        for (int c = 0; c < d; ++c) bad += x[q * size_t(d) + size_t(c)] != T(~T(0));
    EXPECT_EQ(bad, 0u) << what << ": elements of rows with a slot below -1 written";
  };
  const int N = 61;
  for (int K : {1, 2})
    for (int d : {1, 37, 300}) {
      const int E = 8, C = 8, NK = N * K, R = int(cpu::moe_capacity_rows(N, K, E, C));
      const std::string what = fmt::format("K={} d={} R={}", K, d, R);
      SCOPED_TRACE(what);
      const Sorted s = distinct_sorted(N, K, E);
      const Capacity cap = cpu_capacity(s.off, s.slot, NK, E, C, R);
      ASSERT_GT(std::count(cap.cslot.begin(), cap.cslot.end(), -1), 0) << "no padding slot: the test proves nothing";
      ASSERT_GT(std::count(cap.cslot.begin(), cap.cslot.end(), -2), 0) << "no unused slot: the test proves nothing";
      const auto h = randv(size_t(N) * d);
      auto d_h = up(h);
      std::vector<int32_t> hand(size_t(3 * N));  // token rows, -1, and -2, -3 or INT_MIN in turn
      const int32_t below[] = {-2, -3, std::numeric_limits<int32_t>::min()};
      for (int i = 0; i < N; ++i) {
        hand[3 * size_t(i)] = int32_t(rng_() % size_t(NK));
        hand[3 * size_t(i) + 1] = -1;
        hand[3 * size_t(i) + 2] = below[i % 3];
      }
      const std::pair<const std::vector<int32_t>*, const char*> maps[] = {{&cap.cslot, "cslot"}, {&hand, "hand"}};
      for (const auto& [map, name] : maps) {
        const std::vector<int32_t>& slots = *map;
        const int rows = int(slots.size());
        const std::string w = what + " " + name;
        auto d_slots = up(slots);
        std::vector<float> xs(size_t(rows) * d);
        std::memset(xs.data(), 0xFF, xs.size() * sizeof(float));
        cpu_be->moe_gather(xs.data(), h.data(), slots.data(), rows, K, d);
        auto d_xs = poisoned<float>(xs.size());
        be().moe_gather(d_xs.data(), d_h.data(), d_slots.data(), rows, K, d);
        const auto gxs = down(d_xs, xs.size());
        exact(bits(gxs), bits(xs), "moe_gather " + w);
        kept(bits(gxs), slots, d, "moe_gather " + w);
        std::vector<uint16_t> xs16(size_t(rows) * d, 0xFFFF);
        cpu_be->moe_gather_bf16(xs16.data(), h.data(), slots.data(), rows, K, d);
        auto d_xs16 = poisoned<uint16_t>(xs16.size());
        be().moe_gather_bf16(d_xs16.data(), d_h.data(), d_slots.data(), rows, K, d);
        const auto gxs16 = down(d_xs16, xs16.size());
        exact(gxs16, xs16, "moe_gather_bf16 " + w);
        kept(gxs16, slots, d, "moe_gather_bf16 " + w);
      }
    }
}

// ---------------------------------------------------------------------------------------------
// The whole block: moe_forward / moe_backward through BackendOps, CUDA backend vs CPU backend.

// Arrays of MoeActs / MoeScratch: host storage for the CPU side, device storage for the GPU side.
struct HostArrays {
  std::vector<std::vector<double>> store;  // double: 8-byte aligned storage for any element type
  void fill(const std::vector<std::pair<void**, size_t>>& req) {
    for (auto& [ptr, bytes] : req) {
      store.emplace_back(bytes / sizeof(double) + 1, 0.0);
      *ptr = store.back().data();
    }
  }
};
struct DeviceArrays {
  std::vector<DeviceBuffer<char>> store;
  void fill(const std::vector<std::pair<void**, size_t>>& req) {
    for (auto& [ptr, bytes] : req) {
      store.emplace_back(bytes ? bytes : 1, "moe test array");
      store.back().poison();
      *ptr = store.back().data();
    }
  }
};

TEST_F(CudaMoe, MoeBlockForwardBackwardMatchesCpuBackend) {
  struct BlockCase {
    int N, d, E, K, I, Is;
    bool normalized;
  };
  const BlockCase cases[] = {{70, 40, 8, 2, 24, 16, true}, {97, 33, 65, 4, 19, 0, false}, {64, 48, 64, 1, 32, 8, true}};
  auto cpu_be = make_cpu_backend(2);
  for (const auto& bc : cases) {
    const std::string what = fmt::format("moe block N={} d={} E={} K={} I={} Is={}", bc.N, bc.d, bc.E, bc.K, bc.I,
                                         bc.Is);
    SCOPED_TRACE(what);
    MoeDims D;
    D.N = bc.N;
    D.d = bc.d;
    D.E = bc.E;
    D.K = bc.K;
    D.I = bc.I;
    D.Is = bc.Is;
    D.normalized = bc.normalized;
    D.route_scale = 2.5;
    const size_t N = D.N, d = D.d, E = D.E, I = D.I, Is = D.Is;
    // h and the router on coarse binary grids: every router score is exact in fp32 whatever the
    // summation order, so both backends route the same (ties included) and the comparison is about
    // the kernels, not about a near-tie flipping one expert.
    auto h = quantized(N * d, 8, 0.125f);
    auto router = quantized(E * d, 8, 0.0625f);
    auto bias = quantized(E, 4, 1.f / 64);
    auto wg = randv(E * I * d, -0.2f, 0.2f), wu = randv(E * I * d, -0.2f, 0.2f), wd = randv(E * d * I, -0.2f, 0.2f);
    auto sg = randv(Is * d, -0.2f, 0.2f), su = randv(Is * d, -0.2f, 0.2f), sd = randv(d * Is, -0.2f, 0.2f);
    // out and the gradients accumulate: small random starting values, so that a kernel which
    // overwrote instead of adding fails, while the block's own contribution dominates the norm.
    auto small = [&](size_t n) { return randv(n, -1e-3f, 1e-3f); };
    auto out0 = small(N * d), dout = randv(N * d);
    auto g_router = small(E * d), g_wg = small(E * I * d), g_wu = small(E * I * d), g_wd = small(E * d * I);
    auto g_sg = small(Is * d), g_su = small(Is * d), g_sd = small(d * Is);
    const float z_scale = 0.01f;

    // CPU backend.
    MoeWeights<float> Wc{router.data(), bias.data(), wg.data(), wu.data(), wd.data(),
                         Is ? sg.data() : nullptr, Is ? su.data() : nullptr, Is ? sd.data() : nullptr};
    auto c_out = out0;
    auto cg_router = g_router, cg_wg = g_wg, cg_wu = g_wu, cg_wd = g_wd, cg_sg = g_sg, cg_su = g_su, cg_sd = g_sd;
    MoeGrads<float> Gc{cg_router.data(), cg_wg.data(), cg_wu.data(), cg_wd.data(),
                       Is ? cg_sg.data() : nullptr, Is ? cg_su.data() : nullptr, Is ? cg_sd.data() : nullptr};
    MoeActs<float> Ac;
    MoeScratch<float> Sc;
    HostArrays hc;
    hc.fill(moe_act_requests<float>(D, Ac));
    hc.fill(moe_scratch_requests<float>(D, Sc));
    std::vector<float> c_dh(N * d);
    BackendOps cops{cpu_be.get()};
    moe_forward<float>(cops, D, Wc, Ac, h.data(), c_out.data());
    moe_backward<float>(cops, D, Wc, Gc, Ac, Sc, h.data(), dout.data(), c_dh.data(), z_scale);

    // CUDA backend, the same inputs uploaded.
    auto dh_ = up(h), d_router = up(router), d_bias = up(bias), d_wg = up(wg), d_wu = up(wu), d_wd = up(wd);
    auto d_sg = up(sg), d_su = up(su), d_sd = up(sd), d_out = up(out0), d_dout = up(dout);
    auto dg_router = up(g_router), dg_wg = up(g_wg), dg_wu = up(g_wu), dg_wd = up(g_wd);
    auto dg_sg = up(g_sg), dg_su = up(g_su), dg_sd = up(g_sd);
    auto d_dh = poisoned<float>(N * d);
    MoeWeights<float> Wg{d_router.data(), d_bias.data(), d_wg.data(), d_wu.data(), d_wd.data(),
                         Is ? d_sg.data() : nullptr, Is ? d_su.data() : nullptr, Is ? d_sd.data() : nullptr};
    MoeGrads<float> Gg{dg_router.data(), dg_wg.data(), dg_wu.data(), dg_wd.data(),
                       Is ? dg_sg.data() : nullptr, Is ? dg_su.data() : nullptr, Is ? dg_sd.data() : nullptr};
    MoeActs<float> Ag;
    MoeScratch<float> Sg;
    DeviceArrays dv;
    dv.fill(moe_act_requests<float>(D, Ag));
    dv.fill(moe_scratch_requests<float>(D, Sg));
    BackendOps gops{&be()};
    moe_forward<float>(gops, D, Wg, Ag, dh_.data(), d_out.data());
    moe_backward<float>(gops, D, Wg, Gg, Ag, Sg, dh_.data(), d_dout.data(), d_dh.data(), z_scale);
    be().synchronize();

    auto dl = [&](const void* p, size_t n) {
      std::vector<float> v(n);
      if (n) cuda::copy_d2h(v.data(), p, n * sizeof(float));
      return v;
    };
    auto dli = [&](const int32_t* p, size_t n) {
      std::vector<int32_t> v(n);
      if (n) cuda::copy_d2h(v.data(), p, n * sizeof(int32_t));
      return v;
    };
    const size_t NK = N * size_t(D.K);
    exact(dli(Ag.expert, NK), std::vector<int32_t>(Ac.expert, Ac.expert + NK), what + " expert");
    exact(dli(Ag.offsets, E + 1), std::vector<int32_t>(Ac.offsets, Ac.offsets + E + 1), what + " offsets");
    exact(dli(Ag.row, NK), std::vector<int32_t>(Ac.row, Ac.row + NK), what + " row");
    check(dl(Ag.logits, N * E), std::vector<float>(Ac.logits, Ac.logits + N * E), 0.0, what + " logits (exact)");
    check(dl(Ag.y, NK * d), std::vector<float>(Ac.y, Ac.y + NK * d), kBlock, what + " y");
    check(dl(d_out.data(), N * d), c_out, kBlock, what + " out");
    check(dl(d_dh.data(), N * d), c_dh, kBlock, what + " dh");
    check(dl(dg_router.data(), E * d), cg_router, kBlock, what + " d router");
    check(dl(dg_wg.data(), E * I * d), cg_wg, kBlock, what + " d wg");
    check(dl(dg_wu.data(), E * I * d), cg_wu, kBlock, what + " d wu");
    check(dl(dg_wd.data(), E * d * I), cg_wd, kBlock, what + " d wd");
    if (Is) {
      check(dl(dg_sg.data(), Is * d), cg_sg, kBlock, what + " d sg");
      check(dl(dg_su.data(), Is * d), cg_su, kBlock, what + " d su");
      check(dl(dg_sd.data(), d * Is), cg_sd, kBlock, what + " d sd");
    }
  }
}

}  // namespace
}  // namespace ladder
