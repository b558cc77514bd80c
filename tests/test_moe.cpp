// The MoE V1 block (src/model/moe.h): finite differences in double through the whole block (router
// included, both combine modes), dropless dispatch, deterministic tie-break, quantile balancing on a
// skewed router, E=1/K=1 == dense SwiGLU, bad-input errors, and parity of a full MoE model (logits,
// loss, every gradient, 10 AdamW steps with balancing) against the independent PyTorch reference
// (tests/reference/ref_moe.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "model/config.h"
#include "model/flops.h"
#include "model/moe.h"
#include "model/transformer.h"
#include "optim/optimizer.h"
#include "train/bench.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "reference_harness.h"

namespace ladder {
namespace {

template <class T>
std::vector<T> randn(size_t n, uint64_t seed, double std = 1.0) {
  Philox r(seed, stream_id("moe-test"));
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = T(std * r.normal(i));
  return v;
}

// Every array of a block's activations and backward scratch, owned by the test.
template <class T>
struct Block {
  MoeDims D;
  std::vector<T> router, bias, wg, wu, wd, sg, su, sd;
  MoeActs<T> a;
  MoeScratch<T> s;
  std::vector<std::vector<double>> store;

  Block(const MoeDims& dims, uint64_t seed, double std = 0.5) : D(dims) {
    const size_t d = D.d, E = D.E, I = D.I, Is = D.Is;
    router = randn<T>(E * d, seed + 1, std);
    bias = randn<T>(E, seed + 2, 0.3);
    wg = randn<T>(E * I * d, seed + 3, std);
    wu = randn<T>(E * I * d, seed + 4, std);
    wd = randn<T>(E * d * I, seed + 5, std);
    sg = randn<T>(Is * d, seed + 6, std);
    su = randn<T>(Is * d, seed + 7, std);
    sd = randn<T>(d * Is, seed + 8, std);
    for (auto& [ptr, bytes] : moe_act_requests<T>(D, a)) alloc(ptr, bytes);
    for (auto& [ptr, bytes] : moe_scratch_requests<T>(D, s)) alloc(ptr, bytes);
  }
  void alloc(void** ptr, size_t bytes) {
    store.emplace_back((bytes + 7) / 8 + 1);
    *ptr = store.back().data();
  }
  MoeWeights<T> weights() const {
    MoeWeights<T> W;
    W.router = router.data();
    W.bias = bias.data();
    W.wg = wg.data();
    W.wu = wu.data();
    W.wd = wd.data();
    if (D.Is > 0) {
      W.sg = sg.data();
      W.su = su.data();
      W.sd = sd.data();
    }
    return W;
  }
  // out = MoE(h); returns sum lse^2
  double forward(const T* h, std::vector<T>& out) {
    out.assign(size_t(D.N) * D.d, T(0));
    KernelOps<T> ops;
    moe_forward<T>(ops, D, weights(), a, h, out.data());
    double lse_sq = 0;
    for (int i = 0; i < D.N; ++i) lse_sq += double(a.lse[i]) * double(a.lse[i]);
    return lse_sq;
  }
};

struct FdCase {
  bool normalized;
  int Is;
  int C = 0;  // capacity layout's rows per expert (0: sorted layout)
};
// Test names from the fields (gtest would print the struct's bytes, padding included).
void PrintTo(const FdCase& c, std::ostream* os) {
  *os << (c.normalized ? "normalized" : "sigmoid") << " Is " << c.Is << " C " << c.C;
}
class MoeFiniteDiff : public ::testing::TestWithParam<FdCase> {};

// L = sum(out * R) + zc * sum_i lse_i^2; every input and parameter against central differences.
// Also moe.h's accumulate/overwrite contract: out +=, parameter gradients +=, dh overwritten.
TEST_P(MoeFiniteDiff, WholeBlockGradientsMatchCentralDifferences) {
  MoeDims D;
  D.N = 7;
  D.d = 6;
  D.E = 5;
  D.K = 2;
  D.I = 4;
  D.Is = GetParam().Is;
  D.normalized = GetParam().normalized;
  D.route_scale = 2.5;
  D.C = GetParam().C;
  Block<double> b(D, 100);
  // Every activation and scratch array starts as NaN (ints -1): an element the first forward or
  // the backward reads before writing poisons what it reaches, and the checks below fail on NaN.
  for (auto& v : b.store) std::memset(v.data(), 0xff, v.size() * sizeof(double));
  auto h = randn<double>(size_t(D.N) * D.d, 7);
  const auto R = randn<double>(size_t(D.N) * D.d, 8);
  const double zc = 0.07;
  // The forward ADDS to out: started from random values, its change must be MoE(h) (b.forward
  // below starts from zeros). A forward that overwrote out would pass a test that starts at zero.
  const auto out0 = randn<double>(size_t(D.N) * D.d, 9);
  std::vector<double> acc = out0;
  {
    KernelOps<double> ops;
    moe_forward<double>(ops, D, b.weights(), b.a, h.data(), acc.data());
  }
  std::vector<double> out;
  b.forward(h.data(), out);
  {
    double worst = 0, scale = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_TRUE(std::isfinite(out[i]) && std::isfinite(acc[i])) << "out at " << i;
      worst = std::max(worst, std::fabs((acc[i] - out0[i]) - out[i]));
      scale = std::max(scale, std::fabs(out[i]));
    }
    EXPECT_GT(scale, 1e-3) << "out is trivially zero";
    EXPECT_LT(worst, 1e-12 * std::max(1.0, scale)) << "out: the forward must add MoE(h) to out";
  }
  // Selection must not flip under the perturbation: a margin between the K-th and (K+1)-th
  // biased score of every token.
  for (int i = 0; i < D.N; ++i) {
    std::vector<double> v(size_t(D.E));
    for (int e = 0; e < D.E; ++e) v[size_t(e)] = b.a.logits[i * D.E + e] + b.bias[size_t(e)];
    std::sort(v.rbegin(), v.rend());
    ASSERT_GT(v[size_t(D.K) - 1] - v[size_t(D.K)], 1e-4) << "test data has a near-tie at token " << i;
  }
  const std::vector<int32_t> sel0(b.a.expert, b.a.expert + D.N * D.K);

  // Analytic gradients. Parameter gradients ACCUMULATE: each starts from random values and the
  // gradient is its change (a backward that overwrote one would break grad_accum > 1 and pass a
  // test that starts at zero). dh is OVERWRITTEN: it starts as NaN, which a backward that added to
  // it, or left an element unwritten, would keep.
  std::vector<double> gr = randn<double>(b.router.size(), 11), gg = randn<double>(b.wg.size(), 12),
                      gu = randn<double>(b.wu.size(), 13), gd = randn<double>(b.wd.size(), 14),
                      gsg = randn<double>(b.sg.size(), 15), gsu = randn<double>(b.su.size(), 16),
                      gsd = randn<double>(b.sd.size(), 17);
  const std::vector<std::vector<double>> g0{gr, gg, gu, gd, gsg, gsu, gsd};
  std::vector<double> dh(h.size(), std::numeric_limits<double>::quiet_NaN());
  MoeGrads<double> G{gr.data(), gg.data(), gu.data(), gd.data(), gsg.data(), gsu.data(), gsd.data()};
  KernelOps<double> ops;
  moe_backward<double>(ops, D, b.weights(), G, b.a, b.s, h.data(), R.data(), dh.data(), zc);
  {
    std::vector<double>* g[] = {&gr, &gg, &gu, &gd, &gsg, &gsu, &gsd};
    for (size_t p = 0; p < g0.size(); ++p)
      for (size_t i = 0; i < g0[p].size(); ++i) (*g[p])[i] -= g0[p][i];
  }

  auto loss = [&] {
    std::vector<double> o;
    double lse_sq = b.forward(h.data(), o);
    double L = zc * lse_sq;
    for (size_t i = 0; i < o.size(); ++i) L += o[i] * R[i];
    return L;
  };
  // Any non-finite analytic or FD value fails: std::max never takes a NaN into the running maxima.
  auto check = [&](const char* name, std::vector<double>& x, const std::vector<double>& g) {
    double max_err = 0, max_g = 0;
    size_t bad = 0, first_bad = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double x0 = x[i], eps = 1e-6;
      x[i] = x0 + eps;
      const double lp = loss();
      x[i] = x0 - eps;
      const double lm = loss();
      x[i] = x0;
      const double fd = (lp - lm) / (2 * eps);
      if (!std::isfinite(fd) || !std::isfinite(g[i])) {
        if (bad++ == 0) first_bad = i;
        continue;
      }
      max_err = std::max(max_err, std::fabs(fd - g[i]));
      max_g = std::max(max_g, std::fabs(g[i]));
    }
    EXPECT_EQ(bad, 0u) << name << ": non-finite gradient or finite difference, first at " << first_bad << " (analytic "
                       << (bad ? g[first_bad] : 0.0) << ")";
    EXPECT_GT(max_g, 1e-3) << name << ": gradient is trivially zero";
    EXPECT_LT(max_err, 1e-7 * std::max(1.0, max_g)) << name;
  };
  check("h", h, dh);
  check("router", b.router, gr);
  check("experts.gate_proj", b.wg, gg);
  check("experts.up_proj", b.wu, gu);
  check("experts.down_proj", b.wd, gd);
  if (D.Is > 0) {
    check("shared.gate_proj", b.sg, gsg);
    check("shared.up_proj", b.su, gsu);
    check("shared.down_proj", b.sd, gsd);
  }
  b.forward(h.data(), out);
  EXPECT_EQ(sel0, std::vector<int32_t>(b.a.expert, b.a.expert + D.N * D.K));
}

INSTANTIATE_TEST_SUITE_P(CombineModes, MoeFiniteDiff,
                         ::testing::Values(FdCase{false, 3}, FdCase{true, 3}, FdCase{true, 0},
                                           // capacity layout: 14 rows over 5 experts, C = 2 pads some
                                           // experts and overflows others; C = 7 = N never overflows
                                           FdCase{false, 3, 2}, FdCase{true, 3, 7}));

// The capacity layout is the sorted layout's computation (the same sums, the rows of an expert
// split at C): output, dh and every gradient within fp32 rounding, and its padding and unused rows
// reach nothing even when every activation and scratch array starts as NaN (the gather writes the
// padding rows of xs as zeros, moe_zero_rows those of dy; without either, 0 * NaN poisons the
// weight gradients). The sorted-layout reference runs on NaN-filled arrays too, and dh starts as
// NaN in both (it is overwritten), so both sides must be finite: a NaN compared is never a mismatch.
TEST(Moe, CapacityLayoutIsTheSortedLayoutAndItsPaddingReachesNothing) {
  MoeDims D;
  D.N = 40;
  D.d = 12;
  D.E = 6;
  D.K = 2;
  D.I = 8;
  D.Is = 5;
  D.normalized = true;
  D.route_scale = 2.5;
  auto h = randn<float>(size_t(D.N) * D.d, 31);
  const auto dout = randn<float>(size_t(D.N) * D.d, 32);
  struct Run {
    std::vector<float> out, dh, gr, gg, gu, gd, gsg, gsu, gsd;
  };
  int padded = 0, overflowed = 0;  // experts, over the capacity runs
  auto run = [&](int C) {
    MoeDims Dc = D;
    Dc.C = C;
    Block<float> b(Dc, 77);
    for (auto& v : b.store) std::memset(v.data(), 0xff, v.size() * sizeof(double));  // NaN floats, -1 ints
    Run r;
    b.forward(h.data(), r.out);
    r.gr.assign(b.router.size(), 0.f);
    r.gg.assign(b.wg.size(), 0.f);
    r.gu.assign(b.wu.size(), 0.f);
    r.gd.assign(b.wd.size(), 0.f);
    r.gsg.assign(b.sg.size(), 0.f);
    r.gsu.assign(b.su.size(), 0.f);
    r.gsd.assign(b.sd.size(), 0.f);
    r.dh.assign(h.size(), std::numeric_limits<float>::quiet_NaN());
    MoeGrads<float> G{r.gr.data(), r.gg.data(), r.gu.data(), r.gd.data(), r.gsg.data(), r.gsu.data(), r.gsd.data()};
    KernelOps<float> ops;
    moe_backward<float>(ops, Dc, b.weights(), G, b.a, b.s, h.data(), dout.data(), r.dh.data(), 0.01f);
    for (int e = 0; C > 0 && e < D.E; ++e) {  // does this data pad and overflow?
      const int load = b.a.offsets[e + 1] - b.a.offsets[e];
      padded += load < C;
      overflowed += load > C;
    }
    return r;
  };
  const Run ref = run(0);
  for (int C : {8, 16, 40}) {  // mean load 13.3: overflow and padding; C = N: padding only
    const Run got = run(C);
    auto near = [&](const char* what, const std::vector<float>& a, const std::vector<float>& b) {
      ASSERT_EQ(a.size(), b.size());
      double worst = 0, scale = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_TRUE(std::isfinite(a[i])) << what << " C " << C << " at " << i;
        ASSERT_TRUE(std::isfinite(b[i])) << what << " sorted layout (C 0) at " << i;
        worst = std::max(worst, double(std::fabs(a[i] - b[i])));
        scale = std::max(scale, double(std::fabs(b[i])));
      }
      EXPECT_GT(scale, 0) << what;
      EXPECT_LT(worst, 1e-5 * scale) << what << " C " << C;
    };
    near("out", got.out, ref.out);
    near("dh", got.dh, ref.dh);
    near("router", got.gr, ref.gr);
    near("experts.gate_proj", got.gg, ref.gg);
    near("experts.up_proj", got.gu, ref.gu);
    near("experts.down_proj", got.gd, ref.gd);
    near("shared.gate_proj", got.gsg, ref.gsg);
    near("shared.up_proj", got.gsu, ref.gsu);
    near("shared.down_proj", got.gsd, ref.gsd);
  }
  EXPECT_GT(padded, 0) << "the test data never pads an expert";
  EXPECT_GT(overflowed, 0) << "the test data never overflows an expert";
}

// Dropless: every token reaches exactly K distinct experts, which are the top K of the biased
// scores; each expert's block holds exactly the rows routed to it, in token order.
TEST(Moe, DroplessDispatchRoutesEveryTokenToExactlyKDistinctTopExperts) {
  MoeDims D;
  D.N = 200;
  D.d = 16;
  D.E = 8;
  D.K = 3;
  D.I = 8;
  D.Is = 0;
  Block<float> b(D, 5);
  auto h = randn<float>(size_t(D.N) * D.d, 9);
  std::vector<float> out;
  b.forward(h.data(), out);
  const int NK = D.N * D.K;
  EXPECT_EQ(b.a.offsets[0], 0);
  EXPECT_EQ(b.a.offsets[D.E], NK);
  std::vector<int> rows_of_token(size_t(D.N), 0);
  for (int e = 0; e < D.E; ++e) {
    int prev_token = -1;
    for (int r = b.a.offsets[e]; r < b.a.offsets[e + 1]; ++r) {
      const int j = b.a.slot[r], tok = j / D.K;
      EXPECT_EQ(b.a.expert[j], e);
      EXPECT_EQ(b.a.row[j], r);
      EXPECT_GT(tok, prev_token) << "rows of an expert must be distinct tokens in token order";
      prev_token = tok;
      ++rows_of_token[size_t(tok)];
      for (int c = 0; c < D.d; ++c) ASSERT_EQ(b.a.xs[size_t(r) * D.d + c], h[size_t(tok) * D.d + c]);
    }
  }
  for (int i = 0; i < D.N; ++i) {
    EXPECT_EQ(rows_of_token[size_t(i)], D.K);
    std::set<int> sel(b.a.expert + i * D.K, b.a.expert + (i + 1) * D.K);
    EXPECT_EQ(int(sel.size()), D.K) << "token " << i;
    // Brute-force top K of the biased scores.
    std::vector<int> order(size_t(D.E));
    for (int e = 0; e < D.E; ++e) order[size_t(e)] = e;
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
      return b.a.logits[i * D.E + x] + b.bias[size_t(x)] > b.a.logits[i * D.E + y] + b.bias[size_t(y)];
    });
    for (int k = 0; k < D.K; ++k) EXPECT_EQ(b.a.expert[i * D.K + k], order[size_t(k)]) << "token " << i;
  }
}

TEST(Moe, TiesGoToTheLowerExpertIndex) {
  MoeDims D;
  D.N = 4;
  D.d = 4;
  D.E = 6;
  D.K = 3;
  D.I = 4;
  Block<float> b(D, 3);
  std::fill(b.router.begin(), b.router.end(), 0.f);  // every score 0
  b.bias = {0.f, 1.f, 0.f, 1.f, 0.f, 1.f};            // experts 1, 3, 5 tie above 0, 2, 4
  auto h = randn<float>(16, 1);
  std::vector<float> out;
  b.forward(h.data(), out);
  for (int i = 0; i < D.N; ++i) EXPECT_EQ(std::vector<int32_t>(b.a.expert + 3 * i, b.a.expert + 3 * i + 3),
                                          (std::vector<int32_t>{1, 3, 5}));
  b.bias = {0.f, 1.f, 0.f, 0.f, 0.f, 1.f};
  b.forward(h.data(), out);
  EXPECT_EQ(std::vector<int32_t>(b.a.expert, b.a.expert + 3), (std::vector<int32_t>{1, 5, 0}));
}

// Quantile balancing on a router skewed towards the high experts: max/mean load falls towards 1
// over steps (fresh tokens every step), the bias keeps zero mean.
TEST(Moe, QuantileBalancingEvensOutASkewedRouter) {
  MoeDims D;
  D.N = 1024;
  D.d = 16;
  D.E = 8;
  D.K = 2;
  D.I = 4;
  Block<float> b(D, 11, 0.3);
  for (int e = 0; e < D.E; ++e) b.router[size_t(e) * D.d] += 0.5f * e;  // feature 0 is constant 1
  std::fill(b.bias.begin(), b.bias.end(), 0.f);
  std::vector<float> vals(size_t(D.N) * D.E), out;
  std::vector<double> beta(size_t(D.E)), ratio;
  for (int step = 0; step < 12; ++step) {
    auto h = randn<float>(size_t(D.N) * D.d, 1000 + step);
    for (int i = 0; i < D.N; ++i) h[size_t(i) * D.d] = 1.f;
    b.forward(h.data(), out);
    int mx = 0;
    for (int e = 0; e < D.E; ++e) mx = std::max(mx, b.a.offsets[e + 1] - b.a.offsets[e]);
    ratio.push_back(double(mx) / (double(D.N) * D.K / D.E));
    cpu::moe_balance_values<float>(vals.data(), b.a.logits, b.bias.data(), D.N, D.E, D.K);
    cpu::moe_quantile_beta(beta.data(), vals.data(), D.N, D.E, D.K);
    cpu::moe_balance_bias(b.bias.data(), beta.data(), D.E);
    double mean = 0;
    for (float x : b.bias) mean += x;
    EXPECT_NEAR(mean / D.E, 0.0, 1e-6) << "step " << step;
  }
  EXPECT_GT(ratio.front(), 2.5) << "the router is not skewed: the test proves nothing";
  EXPECT_LT(ratio.back(), 1.25);
  double tail = *std::max_element(ratio.begin() + 3, ratio.end());
  EXPECT_LT(tail, 1.3) << "balance must hold, not oscillate";
  EXPECT_GT(b.bias[0], b.bias[D.E - 1]) << "the favoured expert must be pushed down";
}

Config moe_config(int E, int K, int shared, const std::string& combine, double z, const std::string& layers) {
  Config c;
  c.source = "moe-test";
  auto& m = c.model;
  m.vocab_size = 96;
  m.d_model = 32;
  m.n_layers = 3;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.head_dim = 8;
  m.d_ff = 48;
  m.seq_len = 16;
  m.rope_theta = 10000;
  m.init_std = 0.2;
  m.moe_experts = E;
  m.moe_top_k = K;
  m.moe_expert_ff = 24;
  m.moe_shared_expert = shared > 0;
  m.moe_shared_ff = shared;
  m.moe_combine = combine;
  m.moe_route_scale = 2.5;
  m.router_z_loss = z;
  m.moe_layers = layers;
  c.run.batch_size = 3;
  c.run.steps = 10;
  c.optim.lr = 1e-2;
  c.optim.weight_decay = 0.1;
  c.optim.clip = 0.5;
  c.schedule.warmup = 3;
  c.schedule.final_lr_frac = 0.1;
  return c;
}

std::vector<int32_t> tokens(size_t n, int V, uint64_t seed) {
  Philox r(seed, stream_id("tokens"));
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = int32_t(r.u64(i) % uint64_t(V));
  return t;
}

// E = 1, K = 1, no shared expert, normalized combine with scale 1 (w = sig/(sig + 1e-9) = 1 in
// float): the model is the dense model with d_ff = expert hidden and the same weights.
TEST(Moe, OneExpertTopOneEqualsDenseSwiGLU) {
  Config cm = moe_config(1, 1, 0, "normalized", 0, "all");
  cm.model.moe_route_scale = 1.0;
  cm.model.moe_balance = "none";
  Config cd = cm;
  cd.model.moe_experts = 0;
  cd.model.moe_balance = "auto";
  cd.model.d_ff = cm.model.expert_ff();
  validate(cm);
  validate(cd);
  auto be = make_cpu_backend(0);
  Transformer moe(cm.model, 2, *be), dense(cd.model, 2, *be);
  moe.init(3);
  dense.init(4);
  auto map = [](std::string n) {
    for (const char* p : {"gate_proj", "up_proj", "down_proj"}) {
      auto from = std::string("mlp.experts.") + p, to = std::string("mlp.") + p;
      if (auto at = n.find(from); at != std::string::npos) n.replace(at, from.size(), to);
    }
    return n;
  };
  for (auto& p : moe.params()) {
    if (p.role == Role::Router) continue;
    Param& q = dense.param(map(p.name));
    ASSERT_EQ(q.numel, p.numel) << p.name;
    std::copy_n(p.w, p.numel, q.w);
  }
  const int N = 2 * cm.model.seq_len, V = cm.model.vocab_size;
  auto in = tokens(size_t(N), V, 1), tg = tokens(size_t(N), V, 2);
  std::vector<float> lm(size_t(N) * V), ld(size_t(N) * V);
  moe.forward_logits(in.data(), lm.data());
  dense.forward_logits(in.data(), ld.data());
  EXPECT_LT(test::rel_err(lm.data(), ld.data(), lm.size()), 1e-6);
  moe.zero_grad();
  dense.zero_grad();
  moe.forward_backward(in.data(), tg.data(), 1.f / N);
  dense.forward_backward(in.data(), tg.data(), 1.f / N);
  for (auto& p : moe.params()) {
    if (p.role == Role::Router) continue;
    Param& q = dense.param(map(p.name));
    EXPECT_LT(test::rel_err(p.g, q.g, p.numel), 1e-5) << p.name;
  }
}

std::string error_of(Config c) {
  try {
    validate(c);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Moe, BadInputIsOneClearErrorNamingTheField) {
  auto base = [] { return moe_config(4, 2, 16, "sigmoid", 0, "all"); };
  EXPECT_EQ(error_of(base()), "");
  Config c = base();
  c.model.moe_top_k = 5;
  EXPECT_NE(error_of(c).find("model.moe_top_k (5) must be <= model.moe_experts (4)"), std::string::npos) << error_of(c);
  c = base();
  c.model.moe_top_k = 0;
  EXPECT_NE(error_of(c).find("model.moe_top_k must be >= 1"), std::string::npos) << error_of(c);
  c = base();
  c.model.moe_expert_ff = -8;
  EXPECT_NE(error_of(c).find("model.moe_expert_ff"), std::string::npos) << error_of(c);
  c = base();
  c.model.moe_expert_ff = 1 << 20;
  c.model.moe_experts = 4096;
  EXPECT_NE(error_of(c).find("does not fit"), std::string::npos) << error_of(c);
  c = base();
  c.model.moe_layers = "1,7";
  EXPECT_NE(error_of(c).find("model.moe_layers names layer 7"), std::string::npos) << error_of(c);
  c = base();
  c.model.moe_layers = "one";
  EXPECT_NE(error_of(c).find("model.moe_layers expects"), std::string::npos) << error_of(c);
  c = base();
  c.model.moe_combine = "softmax";
  EXPECT_NE(error_of(c).find("model.moe_combine 'softmax'"), std::string::npos) << error_of(c);
  c = base();
  c.model.moe_experts = 0;
  c.model.moe_balance = "quantile";
  EXPECT_NE(error_of(c).find("model.moe_balance is 'quantile' but model.moe_experts is 0"), std::string::npos)
      << error_of(c);
  c = base();
  c.model.moe_experts = 0;
  c.model.router_z_loss = 1e-3;
  EXPECT_NE(error_of(c).find("model.router_z_loss"), std::string::npos) << error_of(c);
  // and through a YAML file: the key is checked like every other
  test::TempDir dir("moe-bad");
  write_file_atomic(dir.path / "c.yaml", "model:\n  moe_experts: 4\n  moe_top_k: 9\n");
  Config y = load_config(dir.path / "c.yaml");
  EXPECT_NE(error_of(y).find("model.moe_top_k (9) must be <= model.moe_experts (4)"), std::string::npos);
}

TEST(Moe, FlopsAndActiveParamsFollowTheRecipe) {
  Config c = moe_config(6, 2, 16, "sigmoid", 0, "0,2");
  const auto& m = c.model;
  const double d = 32, I = 24, Is = 16, E = 6, K = 2;
  const auto f = flops_per_token(m);
  EXPECT_DOUBLE_EQ(f.mlp, 6 * d * 48 + 2 * (6 * d * I * K + 6 * d * Is + 2 * d * E));
  const auto p = count_params(m);
  EXPECT_EQ(p.total - p.active, int64_t(2 * (E - K) * 3 * d * I));
  auto be = make_cpu_backend(0);
  Transformer model(m, 1, *be);
  EXPECT_EQ(int64_t(model.num_params()), p.total);
  EXPECT_EQ(model.buffers().size(), 2u);
}

void set_random_bias(Transformer& model, uint64_t seed) {
  for (auto& b : model.buffers()) {
    auto v = randn<float>(b.numel, seed++, 0.5);
    std::copy(v.begin(), v.end(), b.w);
  }
}

struct ParityCase {
  std::string combine;
  double router_z;
  int shared;
};
class MoeParity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(MoeParity, LogitsLossAndEveryGradientMatchPyTorch) {
  const auto pc = GetParam();
  // Layers 0 and 2 MoE, layer 1 dense: mixed models must work too.
  Config c = moe_config(6, 2, pc.shared, pc.combine, pc.router_z, "0,2");
  validate(c);
  test::TempDir dir("moe-parity");
  auto be = make_cpu_backend(0);
  Transformer model(c.model, c.run.batch_size, *be);
  model.init(7);
  set_random_bias(model, 50);  // non-zero selection bias: selection differs from the plain top-K
  const int B = c.run.batch_size, S = c.model.seq_len, V = c.model.vocab_size, N = B * S;
  auto inputs = tokens(size_t(N), V, 1), targets = tokens(size_t(N), V, 2);
  auto ref = test::reference_forward_backward(dir.path, c, model, inputs, targets);
  EXPECT_LT(test::logits_rel_err(model, inputs, ref), 2e-6);

  model.zero_grad();
  LossSums s = model.forward_backward(inputs.data(), targets.data(), 1.0f / float(N));
  const double loss = (s.xent + c.model.z_loss * s.lse_sq + s.router_z) / double(N);
  const double ref_loss = ref.get_f32("loss")[0];
  EXPECT_NEAR(loss, ref_loss, 1e-5 * std::fabs(ref_loss));
  if (pc.router_z > 0) {
    EXPECT_GT(s.router_z / N, 1e-3 * loss) << "router z-loss must matter for the test";
  }
  int checked = 0;
  for (auto& p : model.params()) {
    auto g = ref.get_f32("grad." + p.name);
    ASSERT_EQ(g.size(), p.numel) << p.name;
    double norm = std::sqrt(be->sum_squares(p.g, p.numel));
    EXPECT_GT(norm, 1e-8) << p.name;
    EXPECT_LT(test::rel_err(p.g, g.data(), p.numel), 5e-5) << p.name;
    checked += p.role == Role::Router || p.role == Role::SharedExpert || p.role == Role::ExpertMatrix;
  }
  EXPECT_EQ(checked, 2 * (4 + (pc.shared > 0 ? 3 : 0)));
}

INSTANTIATE_TEST_SUITE_P(Switches, MoeParity,
                         ::testing::Values(ParityCase{"sigmoid", 0.0, 16}, ParityCase{"sigmoid", 1e-2, 16},
                                           ParityCase{"normalized", 1e-2, 16}, ParityCase{"normalized", 0.0, 0}));

// Ten AdamW steps with quantile balancing: losses, grad norms, final weights and selection biases.
TEST(MoeParityTrain, TenStepsWithQuantileBalancingMatchPyTorch) {
  Config c = moe_config(6, 2, 16, "sigmoid", 1e-3, "0,2");
  validate(c);
  test::TempDir dir("moe-parity-train");
  auto be = make_cpu_backend(0);
  Transformer model(c.model, c.run.batch_size, *be);
  model.init(11);
  auto opt = make_optimizer(c.optim, model, *be);
  const int B = c.run.batch_size, S = c.model.seq_len, V = c.model.vocab_size, N = B * S;
  const int steps = int(c.run.steps);
  auto inputs = tokens(size_t(N) * steps, V, 3), targets = tokens(size_t(N) * steps, V, 4);
  auto ref = test::reference_train(dir.path, c, model, inputs, targets, steps);
  std::vector<int32_t> in(N), tg(N);
  for (int t = 0; t < steps; ++t) {
    StepStats st = train_step(c, t, model, *opt, *be,
                              [&](int32_t* a, int32_t* b) {
                                std::copy_n(inputs.data() + size_t(t) * N, N, a);
                                std::copy_n(targets.data() + size_t(t) * N, N, b);
                              },
                              in.data(), tg.data());
    const double loss = st.loss + c.model.z_loss * st.lse_sq + st.router_z;
    const double ref_loss = ref["losses"][t].get<double>();
    EXPECT_NEAR(loss, ref_loss, 2e-5 * std::fabs(ref_loss)) << "step " << t;
    EXPECT_NEAR(st.grad_norm, ref["grad_norms"][t].get<double>(), 1e-4 * st.grad_norm) << "step " << t;
    ASSERT_EQ(st.moe.size(), 2u);
    EXPECT_DOUBLE_EQ(st.moe[0].load_mean, double(N) * 2 / 6);
    for (auto& m : st.moe) EXPECT_EQ(m.dropped_frac, 0.0) << "layer " << m.layer;  // dropless
  }
  auto fin = SafeTensors::open(dir.path / "ref_final.safetensors");
  for (auto& p : model.params()) {
    auto w = fin.get_f32(p.name);
    EXPECT_LT(test::rel_err(p.w, w.data(), p.numel), 1e-4) << p.name;
  }
  for (auto& b : model.buffers()) {
    auto w = fin.get_f32(b.name);
    double mean = 0;
    for (size_t i = 0; i < b.numel; ++i) mean += b.w[i];
    EXPECT_NEAR(mean, 0.0, 1e-5) << b.name;
    EXPECT_LT(test::rel_err(b.w, w.data(), b.numel), 1e-3) << b.name;
  }
  // The biases travel with the weights (checkpoints).
  save_weights(dir.path / "back.safetensors", model);
  Transformer again(c.model, c.run.batch_size, *be);
  load_weights(dir.path / "back.safetensors", again);
  for (size_t i = 0; i < model.buffers().size(); ++i)
    EXPECT_EQ(test::rel_err(again.buffers()[i].w, model.buffers()[i].w, model.buffers()[i].numel), 0.0);
}

}  // namespace
}  // namespace ladder
