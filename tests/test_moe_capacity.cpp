// model.moe_capacity: the MoE experts in a capacity layout (each expert's first C rows at e*C, the
// rest after E*C), so that the expert GEMMs are strided batches. What must hold:
// - cpu::moe_capacity moves every sorted row where its contract says, pads with -1, and the row
//   bound moe_capacity_rows is never exceeded (and is reached by the worst loads);
// - ModelConfig::expert_capacity is the documented rounding, and bad values are clear errors;
// - the model with it is the model without it up to fp32 summation order (two micro-batches of
//   gradients, 20 AdamW steps), in fp32 and with the bf16 experts.
// The block-level check with NaN-poisoned buffers and the finite differences in double are in
// test_moe.cpp; the device's kernels in tests/cuda (CudaMoe.Capacity*, CudaModel.MoeCapacity*).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/moe_kernels.h"
#include "backend/profiling_backend.h"
#include "bf16_model_compare.h"
#include "model/config.h"
#include "model_test_configs.h"
#include "train_side_by_side.h"

namespace ladder {
namespace {

using namespace test;

// K distinct experts per token. kind 0: uniform; 1: every token on experts 0..K-1 (the most
// overflow there can be); 2: skewed (expert e drawn with weight 1 / (e + 1)).
std::vector<int32_t> pick_experts(int N, int K, int E, int kind, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<double> w(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) w[size_t(e)] = kind == 2 ? 1.0 / (e + 1) : 1.0;
  std::vector<int32_t> ex(size_t(N) * K);
  for (int i = 0; i < N; ++i) {
    std::vector<double> wi = w;
    for (int k = 0; k < K; ++k) {
      int e = k;
      if (kind != 1) {
        std::discrete_distribution<int> pick(wi.begin(), wi.end());
        e = pick(rng);
      }
      wi[size_t(e)] = 0;
      ex[size_t(i) * K + k] = e;
    }
  }
  return ex;
}

TEST(MoeCapacity, LayoutMovesEverySortedRowAndPadsTheRest) {
  for (int kind = 0; kind < 3; ++kind)
    for (auto [N, K, E] : {std::tuple{50, 2, 6}, std::tuple{97, 4, 16}, std::tuple{8, 1, 3}})
      for (int C : {1, 8, 16, 33, N}) {
        const std::string tag = "kind " + std::to_string(kind) + " N " + std::to_string(N) + " K " +
                                std::to_string(K) + " E " + std::to_string(E) + " C " + std::to_string(C);
        const int NK = N * K;
        const auto expert = pick_experts(N, K, E, kind, uint32_t(N + C + kind));
        std::vector<int32_t> off(static_cast<size_t>(E) + 1), row(static_cast<size_t>(NK)), slot(static_cast<size_t>(NK));
        cpu::moe_sort(off.data(), row.data(), slot.data(), expert.data(), NK, E);
        const int64_t R = cpu::moe_capacity_rows(N, K, E, C);
        std::vector<int32_t> crow = row, cslot(size_t(R), 7), ov(size_t(E) + 2, 7);
        cpu::moe_capacity(crow.data(), cslot.data(), ov.data(), off.data(), slot.data(), NK, E, C, int(R));
        ASSERT_EQ(ov[0], 0) << tag;
        for (int e = 0; e < E; ++e) ASSERT_EQ(ov[size_t(e) + 1] - ov[size_t(e)], std::max(0, off[e + 1] - off[e] - C)) << tag;
        const int in_use = E * C + ov[size_t(E)];
        ASSERT_EQ(ov[size_t(E) + 1], in_use) << tag;
        ASSERT_LE(in_use, R) << tag;
        if (kind == 1 && C < N) {
          EXPECT_EQ(in_use, R) << tag << ": the bound is the worst case";
        }
        int with_slot = 0;
        for (int64_t q = 0; q < R; ++q) {
          with_slot += cslot[size_t(q)] >= 0;
          if (q >= in_use) ASSERT_EQ(cslot[size_t(q)], -2) << tag << ": unused row " << q;
          if (q < E * C && cslot[size_t(q)] < 0) ASSERT_EQ(cslot[size_t(q)], -1) << tag << ": padding row " << q;
        }
        ASSERT_EQ(with_slot, NK) << tag << ": every other row is -1 or -2";
        for (int s = 0; s < NK; ++s) {
          const int e = expert[size_t(s)], r = row[size_t(s)] - off[size_t(e)];
          const int q = r < C ? e * C + r : E * C + ov[size_t(e)] + (r - C);
          ASSERT_EQ(crow[size_t(s)], q) << tag << " slot " << s;
          ASSERT_EQ(cslot[size_t(q)], s) << tag << " row " << q;
        }
      }
}

// The gather and SwiGLU on a layout touch only its rows in use: the gather zeroes the padding rows
// and skips the unused ones, swiglu_*_rows computes the first ov[E+1] rows (the plain ops' values,
// bitwise) and leaves the rest. On the CPU backend, fp32 and bf16.
TEST(MoeCapacity, GatherAndSwigluTouchOnlyTheRowsInUse) {
  auto be = make_cpu_backend(0);
  const int N = 40, K = 2, E = 6, C = 8, d = 5, I = 3, NK = N * K;
  const auto expert = pick_experts(N, K, E, 2, 3);  // skewed: padding and overflow
  std::vector<int32_t> off(static_cast<size_t>(E) + 1), row(static_cast<size_t>(NK)), slot(static_cast<size_t>(NK));
  cpu::moe_sort(off.data(), row.data(), slot.data(), expert.data(), NK, E);
  const int R = int(cpu::moe_capacity_rows(N, K, E, C));
  std::vector<int32_t> cslot(static_cast<size_t>(R)), ov(static_cast<size_t>(E) + 2);
  cpu::moe_capacity(row.data(), cslot.data(), ov.data(), off.data(), slot.data(), NK, E, C, R);
  const int used = ov[static_cast<size_t>(E) + 1];
  ASSERT_LT(used, R) << "no unused rows: the test would be empty";
  ASSERT_GT(used, E * C) << "no overflow rows";
  const auto h = random_floats(size_t(N) * d, 4);
  const float poison = 1234.5f;
  std::vector<float> xs(size_t(R) * d, poison);
  be->moe_gather(xs.data(), h.data(), cslot.data(), R, K, d);
  for (int q = 0; q < R; ++q)
    for (int c = 0; c < d; ++c) {
      const float want = cslot[size_t(q)] >= 0 ? h[size_t(cslot[size_t(q)] / K) * d + c]
                         : cslot[size_t(q)] == -1 ? 0.f : poison;
      ASSERT_EQ(xs[size_t(q) * d + c], want) << "row " << q;
    }
  for (bool b16 : {false, true}) {
    const size_t n = size_t(R) * I, n_used = size_t(used) * I;
    auto g = random_floats(n, 5), u = random_floats(n, 6), dh = random_floats(n, 7);
    if (b16) g = widen(to_b16(g)), u = widen(to_b16(u)), dh = widen(to_b16(dh));
    // Expected: the plain ops over the rows in use.
    std::vector<float> a_ref(n_used), dg_ref(n_used), du_ref(n_used);
    be->swiglu_forward(a_ref.data(), g.data(), u.data(), n_used);
    be->swiglu_backward(dg_ref.data(), du_ref.data(), dh.data(), g.data(), u.data(), n_used);
    std::vector<float> a(n, poison), dg(n, poison), du(n, poison);
    if (!b16) {
      be->swiglu_forward_rows(a.data(), g.data(), u.data(), false, R, I, &ov[size_t(E) + 1]);
      be->swiglu_backward_rows(dg.data(), du.data(), dh.data(), g.data(), u.data(), false, false, R, I,
                               &ov[size_t(E) + 1]);
    } else {  // bf16 tensors and gradients: the reference rounded
      const auto g16 = to_b16(g), u16 = to_b16(u), dh16 = to_b16(dh);
      std::vector<uint16_t> a16(n, 0x7fc1), dg16(n, 0x7fc1), du16(n, 0x7fc1);
      be->swiglu_forward_rows(a16.data(), g16.data(), u16.data(), true, R, I, &ov[size_t(E) + 1]);
      be->swiglu_backward_rows(dg16.data(), du16.data(), dh16.data(), g16.data(), u16.data(), true, true, R, I,
                               &ov[size_t(E) + 1]);
      for (size_t i = n_used; i < n; ++i)
        ASSERT_TRUE(a16[i] == 0x7fc1 && dg16[i] == 0x7fc1 && du16[i] == 0x7fc1) << "bf16 unused element " << i;
      a16.resize(n_used), dg16.resize(n_used), du16.resize(n_used);
      EXPECT_EQ(a16, to_b16(a_ref));
      EXPECT_EQ(dg16, to_b16(dg_ref));
      EXPECT_EQ(du16, to_b16(du_ref));
      continue;
    }
    for (size_t i = n_used; i < n; ++i) ASSERT_TRUE(a[i] == poison && dg[i] == poison && du[i] == poison) << i;
    a.resize(n_used), dg.resize(n_used), du.resize(n_used);
    EXPECT_EQ(a, a_ref);
    EXPECT_EQ(dg, dg_ref);
    EXPECT_EQ(du, du_ref);
  }
}

TEST(MoeCapacity, CapacityIsTheFactorOfTheMeanLoadRoundedUpTo8AndAtMostTheTokens) {
  ModelConfig m;
  m.moe_experts = 64;
  m.moe_top_k = 4;
  EXPECT_EQ(m.expert_capacity(16384), 0) << "off by default";
  m.moe_capacity = 1.0;
  EXPECT_EQ(m.expert_capacity(16384), 1024);   // the GPU preset: mean load 1024
  m.moe_capacity = 1.1;
  EXPECT_EQ(m.expert_capacity(16384), 1128);   // 1126.4 -> 1127 -> 1128
  m.moe_capacity = 0.001;
  EXPECT_EQ(m.expert_capacity(16384), 8);      // at least one row, rounded up
  m.moe_capacity = 1000;
  EXPECT_EQ(m.expert_capacity(16384), 16384);  // never more than the tokens
  m.moe_experts = 0;
  EXPECT_EQ(m.expert_capacity(16384), 0) << "no experts, no layout";
}

TEST(MoeCapacity, BadValuesAreOneClearErrorNamingTheField) {
  Config c = moe_config();
  for (double v : {-1.0, std::nan(""), 1e9}) {
    SCOPED_TRACE(v);
    c.model.moe_capacity = v;
    expect_refused_naming(c, "model.moe_capacity");
  }
  Config d = dense_config();
  d.model.moe_capacity = 1.0;
  expect_refused_naming(d, "model.moe_capacity");
  expect_refused_naming(d, "moe_experts is 0");
}

// moe_config: 64 tokens, E 8, K 2, mean load 16. 0.5: C 8, overflow in both MoE layers; 1.0: C 16;
// 100: C = 64 = the tokens, padding only. Also with bf16 saved activations (the expert rows packed
// per layer) and with recomputation (the layout built again in the backward).
TEST(MoeCapacity, ModelIsTheSortedLayoutsUpToSummationOrder) {
  for (const char* mode : {"fp32", "bf16", "saved-bf16", "recompute"})
    for (double f : {0.5, 1.0, 100.0}) {
      SCOPED_TRACE(std::string(mode) + " capacity " + std::to_string(f));
      const bool bf16 = std::string(mode) == "bf16";
      Config c = moe_config();
      c.model.moe_bf16 = c.model.moe_bf16_grads = bf16;
      if (std::string(mode) == "saved-bf16") c.model.saved_activations = "bf16";
      c.model.recompute = std::string(mode) == "recompute";
      Config k = c;
      k.model.moe_capacity = f;
      // The same sums in another order (an expert's rows in two parts; rows of GEMMs of another
      // height). fp32: about 1e-7 relative to 1e-5 in the first layers' gradients; bf16 roundings
      // (bf16 gradients, bf16 saved activations) turn such last-bit differences into bf16 steps.
      const double tol = bf16 ? 1e-2 : std::string(mode) == "saved-bf16" ? 2e-4 : 1e-5;
      const Compared r = compare(c, k, tol);
      std::printf("[ capacity ] %-10s f %5.1f: loss rel %.1e, worst gradient rel %.1e\n", mode, f, r.loss_rel,
                  r.worst_grad);
      EXPECT_LT(r.loss_rel, bf16 ? 1e-3 : 1e-6) << "bf16 " << bf16 << " capacity " << f;
    }
}

// The bench's diagnostic: each MoE layer's overflow rows of the last forward. moe_config's two MoE
// layers: none without a layout, 0 rows at C = N, some (and at most the bound's) at C = 8; with
// recomputation the layers share their arrays: one value.
TEST(MoeCapacity, OverflowRowsOfTheLastForward) {
  auto be = make_cpu_backend(0);
  for (double f : {0.0, 0.5, 100.0, -0.5}) {
    Config c = moe_config();
    c.model.recompute = f < 0;
    f = std::fabs(f);
    c.model.moe_capacity = f;
    validate(c);
    Transformer m(c.model, c.run.batch_size, *be);
    m.init(9);
    std::vector<int32_t> in, tg;
    make_batch(c, 40, in, tg);
    m.forward_backward(in.data(), tg.data(), 1e-3f);
    const std::vector<int> ov = m.capacity_overflow_rows();
    if (f == 0) {
      EXPECT_TRUE(ov.empty());
      continue;
    }
    ASSERT_EQ(ov.size(), c.model.recompute ? 1u : 2u) << f;
    const int N = c.run.batch_size * c.model.seq_len, K = c.model.moe_top_k, C = c.model.expert_capacity(N);
    for (int o : ov) {
      if (f > 1) EXPECT_EQ(o, 0) << "C = N leaves nothing over";
      else EXPECT_GT(o, 0) << "C = " << C;
      EXPECT_LE(o, N * K - K * C);
    }
  }
}

// The recipe's fp32 router: its three GEMMs (scores, dh, the router's gradient) go through
// Backend::gemm_fp32, which a GPU runs in fp32 under bf16 GEMMs (CudaGemm.Fp32GemmIgnoresBf16Precision),
// in either layout. moe_config: 64 tokens, E 8, d 64, two MoE layers.
TEST(MoeRouter, GemmsRunInFp32WhateverThePrecision) {
  for (double f : {0.0, 1.0}) {
    Config c = moe_config();
    c.model.moe_capacity = f;
    auto prof = make_profiling_backend(make_cpu_backend(0));
    Transformer m(c.model, c.run.batch_size, *prof);
    m.init(9);
    std::vector<int32_t> in, tg;
    make_batch(c, 40, in, tg);
    m.forward_backward(in.data(), tg.data(), 1e-3f);
    prof->times();
    std::map<std::string, int64_t> fp32_calls;
    for (auto& [key, t] : prof->shape_times())
      if (key.rfind("gemm fp32 ", 0) == 0) fp32_calls[key] += t.calls;
    const std::map<std::string, int64_t> want = {{"gemm fp32 NT 64x8x64 f32,f32->f32", 2},      // scores
                                                 {"gemm fp32 NN 64x64x8 f32,f32->f32+C", 2},    // dh
                                                 {"gemm fp32 TN 8x64x64 f32,f32->f32+C", 2}};  // router grad
    EXPECT_EQ(fp32_calls, want) << "capacity " << f;
  }
}

TEST(MoeCapacity, TrainingFollowsTheSortedLayout) {
  const LossCurves lc = twenty_adamw_steps(moe_config(), [](Config& h) { h.model.moe_capacity = 0.5; });
  EXPECT_LT(lc.worst_rel(), 1e-4);
}

}  // namespace
}  // namespace ladder
