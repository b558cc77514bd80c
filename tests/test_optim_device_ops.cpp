// The optimizer ops that keep their scalars in backend memory (adamw_multi, adamh_multi,
// muonh_apply, axpy, sum_squares_multi + grad_clip_factor, and the clip factor the updates apply
// as they read the gradients) on the CPU backend, against the per-tensor / per-matrix host code the
// optimizer and the trainer ran before them (the clip: every gradient scaled in memory first). The
// CPU promise is BITWISE equality: the same kernels, the same double scalars, the same float casts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "host_params.h"
#include "backend/forwarding_backend.h"
#include "model/config.h"
#include "core/rng.h"
#include "model/transformer.h"
#include "optim/optimizer.h"

namespace ladder {
namespace {

std::vector<float> randv(std::mt19937& rng, size_t n, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Tensors of several sizes (one above the CPU kernels' parallel threshold, odd sizes, and
// [E, out, in] stacks) with weights, gradients, moments and one radius per matrix.
struct Tensors {
  struct T {
    std::vector<float> w, g, m, v, radius;
    int64_t nmat;
    int group;
  };
  std::vector<T> t;
  Tensors(std::mt19937& rng, bool positive_v) {
    const struct {
      size_t mat;
      int64_t nmat;
      int group;
    } shapes[] = {{37 * 29, 1, 0}, {64 * 48, 3, 1}, {1, 1, 0}, {300 * 257, 1, 2}, {5 * 7, 4, 1}};
    for (auto s : shapes) {
      T x;
      const size_t n = s.mat * size_t(s.nmat);
      x.w = randv(rng, n);
      x.g = randv(rng, n, -0.1f, 0.1f);
      x.m = randv(rng, n, -0.01f, 0.01f);
      x.v = randv(rng, n, positive_v ? 1e-6f : 0.f, 1e-4f);
      x.nmat = s.nmat;
      x.group = s.group;
      for (int64_t e = 0; e < s.nmat; ++e) x.radius.push_back(std::uniform_real_distribution<float>(0.5f, 3.f)(rng));
      t.push_back(std::move(x));
    }
  }
  std::vector<OptimTensor> table() {
    std::vector<OptimTensor> out;
    for (auto& x : t) {
      OptimTensor o;
      o.w = x.w.data();
      o.g = x.g.data();
      o.m = x.m.data();
      o.v = x.v.data();
      o.n = x.w.size();
      o.nmat = x.nmat;
      o.radius = x.radius.data();
      o.group = x.group;
      out.push_back(o);
    }
    return out;
  }
};

void expect_same(const Tensors& a, const Tensors& b) {
  for (size_t i = 0; i < a.t.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(a.t[i].w, b.t[i].w)) << "tensor " << i << " weights";
    EXPECT_TRUE(bitwise_equal(a.t[i].m, b.t[i].m)) << "tensor " << i << " exp_avg";
    EXPECT_TRUE(bitwise_equal(a.t[i].v, b.t[i].v)) << "tensor " << i << " exp_avg_sq";
  }
}

// The clip factors the multi-tensor tests step with: none (nullptr), 1 (g exactly) and a clip.
// `a` (the host code) sees g scaled in memory by the factor, as the trainer's former clip pass did.
constexpr float kClip = 0.3713f;
const float* step_factor(int step) {
  static const float one = 1.0f, clip = kClip;
  return step == 1 ? nullptr : step == 2 ? &one : &clip;
}
std::vector<float> clipped(Backend& be, const std::vector<float>& g, const float* f) {
  auto out = g;
  if (f && *f != 1.0f) be.scale_inplace(out.data(), *f, out.size());
  return out;
}

TEST(OptimDeviceOps, AdamWMultiIsTheLoopOfAdamWUpdatesBitwise) {
  auto be = make_cpu_backend(0);
  std::mt19937 rng(11);
  Tensors a(rng, true);
  std::mt19937 rng2(11);
  Tensors b(rng2, true);
  const float lr[3] = {1e-3f, 3e-4f, 2e-2f}, wd[3] = {0.1f, 0.f, 0.01f};
  auto tab = b.table();
  const auto g0 = b.t[0].g;
  for (int step = 1; step <= 3; ++step) {
    const float bc1 = float(1 - std::pow(0.9, step)), bc2 = float(1 - std::pow(0.95, step));
    for (auto& x : a.t) {
      const auto g = clipped(*be, x.g, step_factor(step));
      be->adamw_update(x.w.data(), g.data(), x.m.data(), x.v.data(), x.w.size(), lr[x.group], 0.9f, 0.95f, 1e-8f,
                       wd[x.group], bc1, bc2);
    }
    be->adamw_multi(tab.data(), tab.size(), lr, wd, 3, 0.9f, 0.95f, 1e-8f, bc1, bc2, step_factor(step));
  }
  expect_same(a, b);
  EXPECT_TRUE(bitwise_equal(b.t[0].g, g0)) << "the factor must not scale the gradient in memory";
}

TEST(OptimDeviceOps, AdamHMultiIsThePerMatrixHostStepBitwise) {
  auto be = make_cpu_backend(0);
  std::mt19937 rng(12);
  Tensors a(rng, false);
  std::mt19937 rng2(12);
  Tensors b(rng2, false);
  const double lr[3] = {0.02, 0.005, 0.05};
  auto tab = b.table();
  for (int step = 1; step <= 3; ++step) {
    const double b1 = 0.9, b2 = 0.95, eps = 1e-8;
    const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    // The optimizer's host code before adamh_multi (src/optim/optimizers.cpp, Kind::AdamH).
    for (auto& x : a.t) {
      const size_t mn = x.w.size() / size_t(x.nmat);
      const auto g = clipped(*be, x.g, step_factor(step));
      for (int64_t e = 0; e < x.nmat; ++e) {
        const size_t off = size_t(e) * mn;
        const double uu = be->adam_moments(x.m.data() + off, x.v.data() + off, g.data() + off, mn, float(b1),
                                           float(b2), float(bc1), float(bc2), float(eps));
        const double R = x.radius[size_t(e)];
        const double alpha = -lr[x.group] * R / std::max(std::sqrt(uu), 1e-10);
        const double ww = be->adam_apply(x.w.data() + off, x.m.data() + off, x.v.data() + off, mn, float(bc1),
                                         float(bc2), float(eps), float(alpha));
        be->scale_inplace(x.w.data() + off, float(R / std::sqrt(ww)), mn);
      }
    }
    be->adamh_multi(tab.data(), tab.size(), lr, 3, float(b1), float(b2), float(eps), float(bc1), float(bc2),
                    step_factor(step));
  }
  expect_same(a, b);
}

TEST(OptimDeviceOps, MuonHApplyAndAxpyAreTheHostStepsBitwise) {
  auto be = make_cpu_backend(0);
  std::mt19937 rng(13);
  for (size_t n : {size_t(1), size_t(1001), size_t(256 * 300)}) {
    auto w0 = randv(rng, n), D = randv(rng, n, -0.2f, 0.2f);
    const float R = 1.7f;
    const double lr = 0.013;
    // MuonH before muonh_apply.
    auto w_host = w0;
    const double xx = be->sum_squares(D.data(), n);
    const double alpha = -lr * double(R) / std::max(std::sqrt(xx), 1e-10);
    const double ww = be->axpy_sumsq(w_host.data(), D.data(), n, float(alpha));
    be->scale_inplace(w_host.data(), float(double(R) / std::sqrt(ww)), n);
    auto w_dev = w0;
    be->muonh_apply(w_dev.data(), D.data(), n, &R, lr);
    EXPECT_TRUE(bitwise_equal(w_host, w_dev)) << "muonh_apply, n = " << n;
    // Plain Muon's axpy.
    auto w1 = w0, w2 = w0;
    (void)be->axpy_sumsq(w1.data(), D.data(), n, -0.037f);
    be->axpy(w2.data(), D.data(), n, -0.037f);
    EXPECT_TRUE(bitwise_equal(w1, w2)) << "axpy, n = " << n;
  }
}

// Muon over an [E, out, in] stack: newton_schulz5_batched and muonh_apply_batched are the
// per-matrix loops, and the elementwise ops the optimizer now runs over a whole batch (momentum,
// plain Muon's axpy) give the per-matrix calls' bits. Square, wide and tall matrices, sizes not
// multiples of 16, one matrix above the CPU kernels' parallel threshold (1 << 15 elements).
TEST(OptimDeviceOps, BatchedMuonOpsAreThePerMatrixLoopBitwise) {
  auto be = make_cpu_backend(0);
  std::mt19937 rng(14);
  struct Shape {
    int r, c;
  };
  for (const Shape sh : {Shape{40, 40}, Shape{23, 57}, Shape{61, 19}, Shape{150, 230}}) {
    for (int count : {1, 3, 8}) {
      const size_t mn = size_t(sh.r) * size_t(sh.c), n = mn * size_t(count);
      SCOPED_TRACE(testing::Message() << sh.r << "x" << sh.c << " x" << count);
      auto x = randv(rng, n, -3.f, 3.f);
      auto batched = x, loop = x;
      be->newton_schulz5_batched(batched.data(), sh.r, sh.c, count);
      for (int e = 0; e < count; ++e) be->newton_schulz5(loop.data() + size_t(e) * mn, sh.r, sh.c);
      EXPECT_TRUE(bitwise_equal(batched, loop)) << "newton_schulz5_batched";

      auto w0 = randv(rng, n);
      std::vector<float> R;
      for (int e = 0; e < count; ++e) R.push_back(std::uniform_real_distribution<float>(0.5f, 3.f)(rng));
      auto wb = w0, wl = w0;
      be->muonh_apply_batched(wb.data(), loop.data(), mn, count, R.data(), 0.013);
      for (int e = 0; e < count; ++e)
        be->muonh_apply(wl.data() + size_t(e) * mn, loop.data() + size_t(e) * mn, mn, &R[size_t(e)], 0.013);
      EXPECT_TRUE(bitwise_equal(wb, wl)) << "muonh_apply_batched";

      auto G = randv(rng, n, -0.1f, 0.1f), B0 = randv(rng, n, -0.05f, 0.05f);
      auto Bb = B0, Bl = B0;
      std::vector<float> Db(n), Dl(n);
      be->muon_momentum(Bb.data(), Db.data(), G.data(), n, 0.95f, nullptr);
      for (int e = 0; e < count; ++e) {
        const size_t off = size_t(e) * mn;
        be->muon_momentum(Bl.data() + off, Dl.data() + off, G.data() + off, mn, 0.95f, nullptr);
      }
      EXPECT_TRUE(bitwise_equal(Bb, Bl) && bitwise_equal(Db, Dl)) << "muon_momentum over the batch";
      // With the clip factor: the momentum of the gradient scaled in memory.
      auto Bf = B0, Bs = B0;
      std::vector<float> Df(n), Ds(n);
      const auto Gs = clipped(*be, G, step_factor(3));
      be->muon_momentum(Bf.data(), Df.data(), G.data(), n, 0.95f, step_factor(3));
      be->muon_momentum(Bs.data(), Ds.data(), Gs.data(), n, 0.95f, nullptr);
      EXPECT_TRUE(bitwise_equal(Bf, Bs) && bitwise_equal(Df, Ds)) << "muon_momentum with the clip factor";
      EXPECT_FALSE(bitwise_equal(Bf, Bb)) << "the factor changed nothing";
      auto ab = w0, al = w0;
      be->axpy(ab.data(), Db.data(), n, -0.037f);
      for (int e = 0; e < count; ++e) be->axpy(al.data() + size_t(e) * mn, Db.data() + size_t(e) * mn, mn, -0.037f);
      EXPECT_TRUE(bitwise_equal(ab, al)) << "axpy over the batch";
    }
  }
}

TEST(OptimDeviceOps, DeviceClipIsTheHostClipBitwise) {
  auto be = make_cpu_backend(0);
  std::mt19937 rng(14);
  std::vector<std::vector<float>> grads;
  for (size_t n : {size_t(17), size_t(4096), size_t(70000), size_t(3), size_t(0)}) grads.push_back(randv(rng, n));
  std::vector<double> sums;
  for (auto& g : grads) sums.push_back(be->sum_squares(g.data(), g.size()));
  // The per-tensor sums in one call.
  std::vector<const float*> ptrs;
  std::vector<size_t> sizes;
  for (auto& g : grads) ptrs.push_back(g.data()), sizes.push_back(g.size());
  std::vector<double> multi(grads.size(), -1.0);
  be->sum_squares_multi(ptrs.data(), sizes.data(), grads.size(), multi.data());
  EXPECT_EQ(std::memcmp(multi.data(), sums.data(), sums.size() * sizeof(double)), 0);
  double s = 0;
  for (double v : sums) s += v;
  const double norm = std::sqrt(s);
  // clip below the norm (scaled), above it (untouched), and off.
  for (double clip : {norm / 3, norm * 2, 0.0}) {
    double dnorm = -1;
    float factor = -1;
    be->grad_clip_factor(sums.data(), sums.size(), clip, &dnorm, &factor);
    EXPECT_EQ(std::memcmp(&dnorm, &norm, sizeof(double)), 0) << "clip " << clip;
    const bool clips = clip > 0 && norm > clip;
    EXPECT_EQ(factor, clips ? float(clip / (norm + 1e-6)) : 1.0f);
  }
}

// ---------------------------------------------------------------------------------------------
// The optimizer and the model on the new ops, against the code they ran before, bitwise.

// Params with every optimizer's kind of tensor: vectors, wide/tall/square matrices, an [E, out, in]
// stack, an embedding (its own group through embed_lr_mult) and the head.
struct Params : test::HostParams {
  Params() {
    const int64_t V = 30, d = 20, E = 3;
    add("model.embed_tokens.weight", Role::Embedding, {V, d});
    add("model.layers.0.input_layernorm.weight", Role::NormGain, {d});
    add("model.layers.0.self_attn.q_proj.weight", Role::AttnMatrix, {28, d});
    add("model.layers.0.self_attn.o_proj.weight", Role::AttnMatrix, {d, 28});
    add("model.layers.0.mlp.gate.weight", Role::Router, {E, d});
    add("model.layers.0.mlp.experts.gate_proj.weight", Role::ExpertMatrix, {E, 12, d});
    add("model.layers.0.mlp.shared_expert.up_proj.weight", Role::SharedExpert, {d, d});
    add("model.norm.weight", Role::NormGain, {d});
    add("lm_head.weight", Role::Head, {V, d});
    carve(3, "device-ops-params");
  }
  // Gradient scale per tensor (in add() order), 1 down to 1e-9, so both paths also run where
  // Adam's eps (1e-8) and Newton-Schulz's ||D|| + 1e-8 carry the update, not only where they
  // vanish in rounding.
  const std::vector<double> scale = {1e-9, 1.0, 1e-3, 3e-9, 1e-7, 0.1, 1.0, 1e-8, 1e-9};
  // N(0, scale^2) per tensor; expert 1 of the stack gets no gradient (no token routed to it), so
  // the hyperball's 1e-10 floors and u = 0 / (0 + eps) are on both paths (without them: NaN).
  void set_grads(int t) {
    Philox r(5, stream_id("device-ops-grads") + uint64_t(t));
    for (size_t k = 0; k < params.size(); ++k) {
      const Param& p = params[k];
      const size_t off = size_t(p.g - g.data());
      for (size_t i = 0; i < p.numel; ++i) p.g[i] = float(scale.at(k) * r.normal(off + i));
    }
    for (auto& p : params)
      if (p.name == "model.layers.0.mlp.experts.gate_proj.weight") {
        const size_t mn = p.numel / size_t(p.shape[0]);
        std::fill(p.g + mn, p.g + 2 * mn, 0.0f);
      }
  }
};

// The recipe optimizer's step as it was before the no-wait ops (per tensor, per matrix, scalars on
// the host), written out against the synchronous ops.
struct FormerOptimizer {
  Backend& be;
  OptimConfig oc;
  std::vector<ParamGroup> groups;
  std::map<const Param*, size_t> group_of;
  std::map<const Param*, std::vector<float>> m, v, mom, radius;
  std::vector<float> D;
  int64_t t = 0;
  FormerOptimizer(Backend& b, const OptimConfig& c, std::vector<Param>& params) : be(b), oc(c) {
    groups = plan_groups(oc, params, RunShape{});
    for (size_t gi = 0; gi < groups.size(); ++gi)
      for (Param* p : groups[gi].params) group_of[p] = gi;
  }
  static void dims(const Param& p, int64_t& nmat, int& rows, int& cols) {
    nmat = p.shape.size() == 3 ? p.shape[0] : 1;
    rows = int(p.shape[p.shape.size() - 2]);
    cols = int(p.shape.back());
  }
  void step(std::vector<Param>& params, double lr) {
    const bool first = t == 0;
    ++t;
    const double b1 = oc.beta1, b2 = oc.beta2;
    const double bc1 = 1.0 - std::pow(b1, double(t)), bc2 = 1.0 - std::pow(b2, double(t));
    for (Param& p : params) {
      const ParamGroup& g = groups[group_of.at(&p)];
      const double glr = (g.lr == oc.lr ? lr : g.lr * (lr / oc.lr)) * g.lr_mult;
      const std::string& k = g.optimizer;
      if (k == "adamw" || k == "adam") {
        auto &pm = m[&p], &pv = v[&p];
        pm.resize(p.numel), pv.resize(p.numel);
        be.adamw_update(p.w, p.g, pm.data(), pv.data(), p.numel, float(glr), float(b1), float(b2), float(oc.eps),
                        float(g.weight_decay), float(bc1), float(bc2));
        continue;
      }
      int64_t nmat;
      int rows, cols;
      dims(p, nmat, rows, cols);
      const size_t mn = size_t(rows) * size_t(cols);
      auto& R = radius[&p];
      if (first && (k == "adamh" || k == "muonh"))
        for (int64_t e = 0; e < nmat; ++e) R.push_back(float(std::sqrt(be.sum_squares(p.w + size_t(e) * mn, mn))));
      if (k == "adamh") {
        auto &pm = m[&p], &pv = v[&p];
        pm.resize(p.numel), pv.resize(p.numel);
        for (int64_t e = 0; e < nmat; ++e) {
          const size_t off = size_t(e) * mn;
          const double uu = be.adam_moments(pm.data() + off, pv.data() + off, p.g + off, mn, float(b1), float(b2),
                                            float(bc1), float(bc2), float(oc.eps));
          const double r = R[size_t(e)];
          const double alpha = -glr * r / std::max(std::sqrt(uu), 1e-10);
          const double ww = be.adam_apply(p.w + off, pm.data() + off, pv.data() + off, mn, float(bc1), float(bc2),
                                          float(oc.eps), float(alpha));
          be.scale_inplace(p.w + off, float(r / std::sqrt(ww)), mn);
        }
        continue;
      }
      auto& B = mom[&p];
      B.resize(p.numel);
      D.resize(mn);
      const double scale = std::sqrt(std::max(1.0, double(rows) / double(cols)));
      for (int64_t e = 0; e < nmat; ++e) {
        const size_t off = size_t(e) * mn;
        be.muon_momentum(B.data() + off, D.data(), p.g + off, mn, float(oc.muon_momentum), nullptr);
        be.newton_schulz5(D.data(), rows, cols);
        if (k == "muon") {
          be.axpy_sumsq(p.w + off, D.data(), mn, float(-glr * scale));
        } else {
          const double r = R[size_t(e)];
          const double xx = be.sum_squares(D.data(), mn);
          const double alpha = -glr * r / std::max(std::sqrt(xx), 1e-10);
          const double ww = be.axpy_sumsq(p.w + off, D.data(), mn, float(alpha));
          be.scale_inplace(p.w + off, float(r / std::sqrt(ww)), mn);
        }
      }
    }
  }
};

TEST(OptimDeviceOps, EveryPresetStepsBitwiseAsTheFormerHostLoop) {
  auto be = make_cpu_backend(0);
  for (const char* name : {"adamw", "adam", "adamh", "muon", "muonh"}) {
    SCOPED_TRACE(name);
    OptimConfig oc;
    oc.name = name;
    oc.lr = 0.02;
    oc.adam_lr = "0.01";
    oc.adamh_lr = "0.05";
    oc.muon_lr = "0.03";
    oc.muonh_lr = "0.04";
    oc.weight_decay = 0.1;
    oc.embed_lr_mult = 2.0;
    Params a, b;
    auto opt = make_optimizer(oc, a.params, *be);
    FormerOptimizer former(*be, oc, b.params);
    for (int step = 0; step < 4; ++step) {
      a.set_grads(step);
      b.set_grads(step);
      const double lr = oc.lr * (1.0 - 0.2 * step);  // a changing schedule
      // No clip factor, a factor of 1, then a clip: the former loop sees the gradients scaled first.
      const float* f = step_factor(1 + std::min(step, 2));
      if (f && *f != 1.0f)
        for (auto& p : b.params) be->scale_inplace(p.g, *f, p.numel);
      opt->step(lr, f);
      former.step(b.params, lr);
    }
    EXPECT_TRUE(bitwise_equal(a.w, b.w)) << name;
    for (auto& st : opt->state()) {
      const std::string kind = st.name.substr(0, st.name.find('.'));
      const std::string pname = st.name.substr(st.name.find('.') + 1);
      const Param* pb = nullptr;
      for (auto& p : b.params)
        if (p.name == pname) pb = &p;
      ASSERT_TRUE(pb) << st.name;
      const std::vector<float>& ref = kind == "exp_avg" ? former.m[pb]
                                      : kind == "exp_avg_sq" ? former.v[pb]
                                      : kind == "momentum"   ? former.mom[pb]
                                                             : former.radius[pb];
      size_t n = 1;
      for (auto d : st.shape) n *= size_t(d);
      ASSERT_EQ(ref.size(), n) << st.name;
      EXPECT_EQ(std::memcmp(ref.data(), st.data, n * sizeof(float)), 0) << st.name;
    }
  }
}

// A dense model small enough for bitwise comparisons of whole gradient arenas.
ModelConfig tiny_model(int layers) {
  ModelConfig m;
  m.vocab_size = 40;
  m.d_model = 16;
  m.n_layers = layers;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.head_dim = 8;
  m.d_ff = 32;
  m.seq_len = 16;
  m.rope_theta = 10000;
  m.init_std = 0.3;
  return m;
}

// Transformer::grad_clip_factor_async + last_grad_norm against grad_norm() and the host's factor
// (the trainer's former clip), on a small model's real gradient layout; the gradients stay as they
// are (the optimizer applies the factor as it reads them).
TEST(OptimDeviceOps, ModelClipFactorIsTheHostClipBitwise) {
  const ModelConfig m = tiny_model(2);
  auto be = make_cpu_backend(0);
  Transformer model(m, 2, *be);
  model.init(3);
  std::mt19937 rng(15);
  std::vector<std::vector<float>> g0;
  for (auto& p : model.params()) {
    g0.push_back(randv(rng, p.numel));
    std::copy(g0.back().begin(), g0.back().end(), p.g);
  }
  const double norm = model.grad_norm();
  for (double clip : {norm / 2, norm * 2, 0.0}) {
    SCOPED_TRACE(clip);
    for (size_t i = 0; i < g0.size(); ++i) std::copy(g0[i].begin(), g0[i].end(), model.params()[i].g);
    const float* factor = model.grad_clip_factor_async(clip);
    const double dnorm = model.last_grad_norm();
    EXPECT_EQ(std::memcmp(&dnorm, &norm, sizeof(double)), 0);
    EXPECT_EQ(*factor, clip > 0 && norm > clip ? float(clip / (norm + 1e-6)) : 1.0f);
    for (size_t i = 0; i < g0.size(); ++i) {
      const Param& p = model.params()[i];
      EXPECT_EQ(std::memcmp(g0[i].data(), p.g, p.numel * sizeof(float)), 0) << p.name;
    }
  }
}

// Counts the calls that make the host wait for a device backend: the ops that return a value, the
// copies to and from the host, synchronize. (Their CPU versions do not wait, but a CudaBackend's
// do, so a path that calls none of them has no host wait on the GPU either, barring waits inside
// the backend's own ops, which the CUDA ops of this path do not have after their first call.)
class WaitCounter final : public ForwardingBackend {
 public:
  WaitCounter() : ForwardingBackend(make_cpu_backend(0)) {}
  int waits = 0;
  void synchronize() override { ++waits, inner().synchronize(); }
  void upload(void* d, const void* s, size_t n) override { ++waits, inner().upload(d, s, n); }
  void download(void* d, const void* s, size_t n) override { ++waits, inner().download(d, s, n); }
  double sum_squares(const float* x, size_t n) override { return ++waits, inner().sum_squares(x, n); }
  double adam_moments(float* m, float* v, const float* g, size_t n, float b1, float b2, float bc1, float bc2,
                      float eps) override {
    return ++waits, inner().adam_moments(m, v, g, n, b1, b2, bc1, bc2, eps);
  }
  double adam_apply(float* w, const float* m, const float* v, size_t n, float bc1, float bc2, float eps,
                    float alpha) override {
    return ++waits, inner().adam_apply(w, m, v, n, bc1, bc2, eps, alpha);
  }
  double axpy_sumsq(float* w, const float* x, size_t n, float alpha) override {
    return ++waits, inner().axpy_sumsq(w, x, n, alpha);
  }
  XentSums softmax_xent(float* l, const int32_t* t, int N, int V, float z, float gs) override {
    return ++waits, inner().softmax_xent(l, t, N, V, z, gs);
  }
  XentSums softmax_xent_forward(const float* l, const int32_t* t, int N, int V, float* losses) override {
    return ++waits, inner().softmax_xent_forward(l, t, N, V, losses);
  }
};

TEST(OptimDeviceOps, StepsAfterTheFirstAndTheClipCallNothingThatWaits) {
  for (const char* name : {"adamw", "adamh", "muon", "muonh"}) {
    SCOPED_TRACE(name);
    WaitCounter be;
    OptimConfig oc;
    oc.name = name;
    oc.lr = 0.02;
    Params a;
    auto opt = make_optimizer(oc, a.params, be);
    a.set_grads(0);
    opt->step(oc.lr);  // the first step takes the hyperball radii (sums of squares, one upload)
    be.waits = 0;
    for (int step = 1; step < 3; ++step) {
      a.set_grads(step);
      opt->step(oc.lr);
    }
    EXPECT_EQ(be.waits, 0);
  }
  const ModelConfig m = tiny_model(1);
  WaitCounter be;
  Transformer model(m, 1, be);
  model.grad_clip_factor_async(1.0);  // the first call allocates its two scalars (no copy)
  be.waits = 0;
  model.grad_clip_factor_async(1.0);
  EXPECT_EQ(be.waits, 0);
  (void)model.last_grad_norm();
  EXPECT_EQ(be.waits, 1);  // the one download
}

}  // namespace
}  // namespace ladder
