// Tests of the attention and norm recipe switches (RECIPE.md section 2): partial key offset,
// long/short (sliding-window) layers, XSA, the per-head output gate, GatedNorm, half-RoPE and the
// fixed query scale. Kernels are checked on hand-built inputs and against central finite
// differences in double; the model with every switch on against the independent PyTorch reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "model/transformer.h"
#include "train/bench.h"
#include "train/checkpoint.h"
#include "reference_harness.h"

namespace ladder {
namespace {

using Vec = std::vector<double>;

Vec randn(size_t n, uint64_t seed, double stddev = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, stddev);
  Vec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

double dot(const Vec& a, const Vec& b) {
  long double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += (long double)a[i] * b[i];
  return double(s);
}

// Central differences of loss() with respect to every element of x, against grad. An element's
// error is relative to max(|fd|, 1e-3 * max|grad|) so near-zero gradients are not held to noise.
// Non-finite values fail outright: std::max(m, NaN) keeps m and `NaN > worst` is false, so a running
// maximum alone would let a kernel that writes NaN or inf pass.
void check_grad(Vec& x, const Vec& grad, const std::function<double()>& loss, const std::string& what,
                double tol = 1e-6) {
  ASSERT_EQ(x.size(), grad.size());
  double gmax = 0;
  for (size_t i = 0; i < grad.size(); ++i) {
    ASSERT_TRUE(std::isfinite(grad[i])) << what << ": analytic gradient element " << i << " is " << grad[i];
    gmax = std::max(gmax, std::abs(grad[i]));
  }
  const double floor = std::max(1e-3 * gmax, 1e-10), eps = 1e-6;
  double worst = 0;
  size_t wi = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double save = x[i];
    x[i] = save + eps;
    const double lp = loss();
    x[i] = save - eps;
    const double lm = loss();
    x[i] = save;
    const double fd = (lp - lm) / (2 * eps);
    double err = std::abs(fd - grad[i]) / std::max(std::abs(fd), floor);
    if (!std::isfinite(err)) err = INFINITY;  // a NaN finite difference (the forward wrote NaN) fails
    if (err > worst) worst = err, wi = i;
  }
  EXPECT_LT(worst, tol) << what << ": worst element " << wi << " analytic " << grad[wi];
  EXPECT_GT(gmax, 0) << what << ": all-zero gradient proves nothing";
}

void expect_error(const std::function<void()>& f, std::initializer_list<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << *needles.begin() << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "error should be one line: " << msg;
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

// ---------------------------------------------------------------------------------------------
// Partial key offset

TEST(AttnSwitchKernels, PkoShiftsTheRopeFreeHalfOnHandBuiltKeys) {
  const int N = 12, KV = 2, hd = 8, half = 4;  // two sequences of 6 tokens
  Vec k(size_t(N) * KV * hd), out(k.size(), -1.0);
  for (int t = 0; t < N; ++t)
    for (int h = 0; h < KV; ++h)
      for (int c = 0; c < hd; ++c) k[(size_t(t) * KV + h) * hd + c] = 100.0 * t + 10.0 * h + c + 1;
  // sequence starts at 0 and 6; documents start at 3 and 10 (tokens 2 and 9 were end-of-document)
  std::vector<uint8_t> reset(N, 0);
  for (int t : {0, 3, 6, 10}) reset[t] = 1;
  cpu::pko_shift_forward(out.data(), k.data(), reset.data(), N, KV, hd, half);
  for (int t = 0; t < N; ++t)
    for (int h = 0; h < KV; ++h)
      for (int c = 0; c < hd; ++c) {
        const size_t i = (size_t(t) * KV + h) * hd + c;
        double want = k[i];  // RoPE half: untouched
        if (c >= half) want = reset[t] ? 0.0 : k[i - size_t(KV) * hd];  // previous token's, same head
        EXPECT_EQ(out[i], want) << "t " << t << " head " << h << " dim " << c;
      }
}

TEST(AttnSwitchKernels, PkoShiftGradientMatchesFiniteDifferences) {
  const int N = 10, KV = 2, hd = 8;
  std::vector<uint8_t> reset(N, 0);
  for (int t : {0, 4, 5}) reset[t] = 1;
  // NaN poison: dk is overwritten, and the shifted-in zeros at resets must be written, not left.
  Vec k = randn(size_t(N) * KV * hd, 1), R = randn(k.size(), 2), out(k.size(), NAN), dk(k.size(), NAN);
  cpu::pko_shift_backward(dk.data(), R.data(), reset.data(), N, KV, hd, hd / 2);
  check_grad(k, dk, [&] {
    cpu::pko_shift_forward(out.data(), k.data(), reset.data(), N, KV, hd, hd / 2);
    return dot(out, R);
  }, "pko dk");
}

// ---------------------------------------------------------------------------------------------
// The fused attention input path (qk_prep): PKO shift -> QK-norm -> RoPE as one op

// What attn_forward / attn_backward ran before the op existed, op by op into separate buffers: the
// fused CPU op must equal it bit for bit (CPU runs, references and resumed runs are unchanged).
struct QkComposition {
  std::vector<float> out, rstd, dx, dgain;
};
QkComposition qk_by_parts(const std::vector<float>& x, const float* gain, const uint8_t* reset,
                          const std::vector<float>& dout, std::vector<float> dgain, int N, int S, int nh, int hd,
                          int rot, float theta, bool norm, float eps) {
  const size_t n = x.size();
  QkComposition r;
  std::vector<float> xs(x);
  if (reset) cpu::pko_shift_forward(xs.data(), x.data(), reset, N, nh, hd, hd / 2);
  r.out.assign(n, 0.f);
  r.rstd.assign(size_t(N) * nh, 0.f);
  if (norm) cpu::rmsnorm_forward(r.out.data(), r.rstd.data(), xs.data(), gain, N * nh, hd, eps);
  else r.out = xs;
  cpu::rope_forward(r.out.data(), N, S, nh, hd, rot, theta);
  std::vector<float> dn(dout), ds(n);
  cpu::rope_backward(dn.data(), N, S, nh, hd, rot, theta);
  if (norm) cpu::rmsnorm_backward(ds.data(), gain ? dgain.data() : nullptr, dn.data(), xs.data(), gain, r.rstd.data(),
                                  N * nh, hd, false);
  else ds = dn;
  r.dx.assign(n, 0.f);
  if (reset) cpu::pko_shift_backward(r.dx.data(), ds.data(), reset, N, nh, hd, hd / 2);
  else r.dx = ds;
  r.dgain = std::move(dgain);
  return r;
}

TEST(AttnSwitchKernels, QkPrepEqualsShiftNormRopeBitwise) {
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  std::bernoulli_distribution doc(0.15);
  auto randf = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& e : v) e = u(rng);
    return v;
  };
  const int B = 3, S = 37;
  const int N = B * S;
  std::vector<uint8_t> reset(N);
  for (int t = 0; t < N; ++t) reset[t] = (t % S == 0 || doc(rng)) ? 1 : 0;
  // Query and key head counts of a GQA model (8 query heads over 2 KV heads), odd and even head dims.
  for (int nh : {8, 2})
    for (int hd : {16, 24, 64})
      for (int rot : {hd, hd / 2})
        for (bool norm : {true, false})
          for (bool with_gain : {true, false})
            for (bool pko : {true, false}) {
              const std::string what = fmt::format("nh={} hd={} rot={} norm={} gain={} pko={}", nh, hd, rot, norm,
                                                   with_gain, pko);
              SCOPED_TRACE(what);
              const size_t n = size_t(N) * nh * hd;
              const auto x = randf(n), dout = randf(n), gain = randf(size_t(hd)), dgain0 = randf(size_t(hd));
              const float* g = with_gain ? gain.data() : nullptr;
              const uint8_t* rs = pko ? reset.data() : nullptr;
              const float theta = 10000.f, eps = 1e-6f;
              const auto want = qk_by_parts(x, g, rs, dout, dgain0, N, S, nh, hd, rot, theta, norm, eps);
              std::vector<float> out(n, NAN), rstd(size_t(N) * nh, 0.f), dx(n, NAN), dgain = dgain0;
              cpu::qk_prep_forward(out.data(), rstd.data(), x.data(), g, rs, N, S, nh, hd, rot, theta, norm, eps);
              cpu::qk_prep_backward(dx.data(), with_gain ? dgain.data() : nullptr, dout.data(), x.data(), g,
                                    rstd.data(), rs, N, S, nh, hd, rot, theta, norm);
              EXPECT_EQ(0, std::memcmp(out.data(), want.out.data(), sizeof(float) * n)) << "out";
              if (norm) {
                EXPECT_EQ(0, std::memcmp(rstd.data(), want.rstd.data(), sizeof(float) * rstd.size())) << "rstd";
              }
              EXPECT_EQ(0, std::memcmp(dx.data(), want.dx.data(), sizeof(float) * n)) << "dx";
              // dgain accumulates onto what was there (and is untouched without a gain or a norm).
              EXPECT_EQ(0, std::memcmp(dgain.data(), want.dgain.data(), sizeof(float) * size_t(hd))) << "dgain";
              if (!norm || !with_gain) {
                EXPECT_EQ(dgain, dgain0);
              }
            }
}

TEST(AttnSwitchKernels, QkPrepGradientMatchesFiniteDifferences) {
  const int B = 2, S = 5, N = B * S, nh = 3, hd = 8;
  std::vector<uint8_t> reset(N, 0);
  for (int t : {0, 3, 5, 6}) reset[t] = 1;  // sequence starts 0 and 5, documents at 3 and 6
  for (int rot : {hd, hd / 2})
    for (bool norm : {true, false})
      for (bool pko : {true, false}) {
        const std::string what = fmt::format("rot={} norm={} pko={}", rot, norm, pko);
        SCOPED_TRACE(what);
        const uint8_t* rs = pko ? reset.data() : nullptr;
        Vec x = randn(size_t(N) * nh * hd, 11), gain = randn(size_t(hd), 12, 0.5), R = randn(x.size(), 13);
        for (auto& g : gain) g += 1.0;
        // dx is overwritten (NaN poison); dgain accumulates, so it starts from random values and the
        // check is on its change.
        Vec out(x.size(), NAN), rstd(size_t(N) * nh, NAN), dx(x.size(), NAN);
        const Vec dgain0 = randn(size_t(hd), 14);
        Vec dgain = dgain0;
        auto loss = [&] {
          cpu::qk_prep_forward(out.data(), rstd.data(), x.data(), gain.data(), rs, N, S, nh, hd, rot, 10000.0, norm,
                               1e-6);
          return dot(out, R);
        };
        loss();
        cpu::qk_prep_backward(dx.data(), dgain.data(), R.data(), x.data(), gain.data(), rstd.data(), rs, N, S, nh, hd,
                              rot, 10000.0, norm);
        check_grad(x, dx, loss, what + " dx");
        if (norm) {
          Vec dg(static_cast<size_t>(hd));
          for (int c = 0; c < hd; ++c) dg[c] = dgain[c] - dgain0[c];
          check_grad(gain, dg, loss, what + " dgain");
        } else {
          EXPECT_EQ(dgain, dgain0) << "no norm: dgain untouched";
        }
      }
}

// ---------------------------------------------------------------------------------------------
// XSA

TEST(AttnSwitchKernels, XsaOutputIsOrthogonalToTheOwnValueVector) {
  const int N = 7, H = 6, KV = 2, hd = 16;  // GQA: heads 0-2 read KV head 0, heads 3-5 KV head 1
  Vec y = randn(size_t(N) * H * hd, 3), v = randn(size_t(N) * KV * hd, 4), z(y.size());
  cpu::xsa_forward(z.data(), y.data(), v.data(), N, H, KV, hd);
  std::vector<float> yf(y.begin(), y.end()), vf(v.begin(), v.end()), zf(y.size());
  cpu::xsa_forward(zf.data(), yf.data(), vf.data(), N, H, KV, hd);
  for (int t = 0; t < N; ++t)
    for (int h = 0; h < H; ++h) {
      const double* zr = &z[(size_t(t) * H + h) * hd];
      const float* zfr = &zf[(size_t(t) * H + h) * hd];
      const double* vr = &v[(size_t(t) * KV + h / (H / KV)) * hd];
      double zv = 0, zfv = 0, zz = 0, vv = 0, other = 0;
      for (int c = 0; c < hd; ++c) {
        zv += zr[c] * vr[c];
        zfv += double(zfr[c]) * vr[c];
        zz += zr[c] * zr[c];
        vv += vr[c] * vr[c];
        // against the other KV head's value: not orthogonal in general (the right v was used)
        other += zr[c] * v[(size_t(t) * KV + (1 - h / (H / KV))) * hd + c];
      }
      const double scale = std::sqrt(zz * vv);
      EXPECT_LT(std::abs(zv), 1e-12 * scale) << "t " << t << " h " << h;
      EXPECT_LT(std::abs(zfv), 1e-5 * scale) << "float, t " << t << " h " << h;
      EXPECT_GT(std::abs(other), 1e-3 * scale) << "t " << t << " h " << h;
    }
}

TEST(AttnSwitchKernels, XsaGradientMatchesFiniteDifferences) {
  const int N = 3, H = 4, KV = 2, hd = 5;
  Vec y = randn(size_t(N) * H * hd, 5), v = randn(size_t(N) * KV * hd, 6), R = randn(y.size(), 7);
  Vec z(y.size(), NAN), dy(y.size(), NAN), dv(v.size(), NAN);  // all overwritten: NaN poison
  cpu::xsa_backward(dy.data(), dv.data(), R.data(), y.data(), v.data(), N, H, KV, hd);
  auto loss = [&] {
    cpu::xsa_forward(z.data(), y.data(), v.data(), N, H, KV, hd);
    return dot(z, R);
  };
  check_grad(y, dy, loss, "xsa dy");
  check_grad(v, dv, loss, "xsa dv");
  // In place (dy aliasing dz), as the model calls it.
  Vec inplace = R, dv2(v.size(), NAN);
  cpu::xsa_backward(inplace.data(), dv2.data(), inplace.data(), y.data(), v.data(), N, H, KV, hd);
  EXPECT_EQ(inplace, dy);
  EXPECT_EQ(dv2, dv);
}

// ---------------------------------------------------------------------------------------------
// Per-head output gate

TEST(AttnSwitchKernels, ZeroGateLogitGivesFactorExactlyOne) {
  const int N = 4, H = 3, hd = 8;
  Vec xd = randn(size_t(N) * H * hd, 8);
  std::vector<float> x(xd.begin(), xd.end()), out(x.size()), logit(size_t(N) * H, 0.f), f(logit.size());
  cpu::head_gate_forward(out.data(), f.data(), x.data(), logit.data(), N, H, hd);
  for (float fi : f) EXPECT_EQ(fi, 1.0f);
  EXPECT_EQ(out, x);
}

TEST(AttnSwitchKernels, HeadGateGradientMatchesFiniteDifferences) {
  const int N = 3, H = 4, hd = 5;
  Vec x = randn(size_t(N) * H * hd, 9), logit = randn(size_t(N) * H, 10), R = randn(x.size(), 11);
  Vec out(x.size(), NAN), f(logit.size(), NAN), dx(x.size(), NAN), dl(logit.size(), NAN);  // overwritten
  cpu::head_gate_forward(out.data(), f.data(), x.data(), logit.data(), N, H, hd);
  cpu::head_gate_backward(dx.data(), dl.data(), R.data(), x.data(), f.data(), N, H, hd);
  auto loss = [&] {
    Vec ff(logit.size(), NAN);
    cpu::head_gate_forward(out.data(), ff.data(), x.data(), logit.data(), N, H, hd);
    return dot(out, R);
  };
  check_grad(x, dx, loss, "gate dx");
  check_grad(logit, dl, loss, "gate dlogit");
}

// ---------------------------------------------------------------------------------------------
// GatedNorm elementwise pieces

TEST(AttnSwitchKernels, GatedNormPiecesMatchFiniteDifferences) {
  const size_t n = 40;
  Vec u = randn(n, 12, 2.0), R = randn(n, 13), a(n, NAN), du(n, NAN);  // overwritten: NaN poison
  cpu::silu_backward(du.data(), R.data(), u.data(), n);
  check_grad(u, du, [&] {
    cpu::silu_forward(a.data(), u.data(), n);
    return dot(a, R);
  }, "silu");

  Vec x = randn(n, 14), g = randn(n, 15, 2.0), y(n, NAN), s = g, dx(n, NAN), dg(n, NAN);
  cpu::sigmoid_gate_forward(y.data(), s.data(), x.data(), n);  // s := sigmoid(g)
  cpu::sigmoid_gate_backward(dx.data(), dg.data(), R.data(), x.data(), s.data(), n, false);
  auto loss = [&] {
    Vec gg = g;
    cpu::sigmoid_gate_forward(y.data(), gg.data(), x.data(), n);
    return dot(y, R);
  };
  check_grad(x, dx, loss, "sigmoid gate dx");
  check_grad(g, dg, loss, "sigmoid gate dg");
  // accumulate_dx adds to what is there (random, so a kernel that overwrote or added a constant
  // would show); dg is still overwritten.
  const Vec acc0 = randn(n, 16);
  Vec acc = acc0, dg2(n, NAN);
  cpu::sigmoid_gate_backward(acc.data(), dg2.data(), R.data(), x.data(), s.data(), n, true);
  for (size_t i = 0; i < n; ++i)
    EXPECT_NEAR(acc[i] - acc0[i], dx[i], 1e-15 * (1 + std::abs(acc0[i]) + std::abs(dx[i])));
  EXPECT_EQ(dg2, dg);
}

// ---------------------------------------------------------------------------------------------
// Model level

ModelConfig small_model() {
  ModelConfig m;
  m.vocab_size = 40;
  m.d_model = 16;
  m.n_layers = 1;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.head_dim = 8;
  m.d_ff = 32;
  m.seq_len = 16;
  m.rope_theta = 10000;
  m.init_std = 0.3;
  return m;
}

std::vector<float> logits_of(Transformer& model, const std::vector<int32_t>& in) {
  std::vector<float> out(in.size() * size_t(model.config().vocab_size));
  model.forward_logits(in.data(), out.data());
  return out;
}

std::vector<int32_t> tokens(size_t n, int V, uint64_t seed) {
  Philox r(seed, stream_id("switch-tokens"));
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = int32_t(r.u64(i) % uint64_t(V));
  return t;
}

// Largest change of position i's logits when token j is replaced.
double influence(Transformer& model, const std::vector<int32_t>& in, int i, int j) {
  const int V = model.config().vocab_size;
  auto base = logits_of(model, in);
  auto changed = in;
  changed[j] = (in[j] + 7) % V;
  auto l2 = logits_of(model, changed);
  // NaN on a non-finite logit, which fails both EXPECT_EQ(.., 0) and EXPECT_GT(.., x) at the call
  // sites; a running std::max would skip a NaN and could report 0.
  double m = 0;
  for (int c = 0; c < V; ++c) {
    const double d = std::abs(double(l2[size_t(i) * V + c]) - double(base[size_t(i) * V + c]));
    if (!std::isfinite(d)) return NAN;
    m = std::max(m, d);
  }
  return m;
}

TEST(AttnSwitchModel, LongAndShortLayersFollowThePeriod) {
  ModelConfig m = small_model();
  m.n_layers = 8;
  m.long_every = 4;
  m.window = 3;
  std::vector<int> want = {3, 3, 3, 0, 3, 3, 3, 0};
  for (int l = 0; l < 8; ++l) EXPECT_EQ(m.layer_window(l), want[l]) << "layer " << l;
  m.n_layers = 6;
  m.last_layer_long = true;  // layer 5 joins layer 3
  for (int l = 0; l < 6; ++l) EXPECT_EQ(m.is_long_layer(l), l == 3 || l == 5) << "layer " << l;
}

// One short layer with window W: position i sees tokens i-W+1..i and nothing before; the same layer
// made long sees back to position 0.
TEST(AttnSwitchModel, SlidingWindowEdgesAreExactOnShortLayersAndLongLayersSeeEverything) {
  auto be = make_cpu_backend(0);
  ModelConfig m = small_model();
  m.long_every = 2;  // the only layer (0) is short
  m.window = 4;
  Transformer shortm(m, 1, *be);
  shortm.init(3);
  auto in = tokens(m.seq_len, m.vocab_size, 4);
  const int i = 10, W = m.window;
  EXPECT_EQ(influence(shortm, in, i, i - W), 0.0) << "token just outside the window leaked in";
  EXPECT_EQ(influence(shortm, in, i, 0), 0.0);
  EXPECT_GT(influence(shortm, in, i, i - W + 1), 1e-4) << "oldest token inside the window has no effect";
  EXPECT_EQ(influence(shortm, in, i, i + 1), 0.0) << "not causal";

  m.last_layer_long = true;  // the same layer, long: full causal
  Transformer longm(m, 1, *be);
  longm.init(3);
  EXPECT_GT(influence(longm, in, i, 0), 1e-4);
  EXPECT_GT(influence(longm, in, i, i - W), 1e-4);
  EXPECT_EQ(influence(longm, in, i, i + 1), 0.0);
}

TEST(AttnSwitchModel, WindowAtLeastTheSequenceEqualsFullCausal) {
  auto be = make_cpu_backend(0);
  ModelConfig m = small_model();
  m.n_layers = 2;
  Transformer full(m, 2, *be);
  full.init(5);
  auto in = tokens(size_t(2) * m.seq_len, m.vocab_size, 6);
  const auto ref = logits_of(full, in);
  for (int w : {m.seq_len, m.seq_len + 9}) {
    ModelConfig mw = m;
    mw.window = w;
    mw.long_every = 2;  // layer 0 short with window w, layer 1 long
    Transformer tw(mw, 2, *be);
    tw.init(5);
    EXPECT_EQ(logits_of(tw, in), ref) << "window " << w;
  }
}

// PKO on the long layer only: layer 0 (short) sees exactly the keys it would see without PKO; on
// layer 1 (long) the RoPE-free half of each key is the previous token's, zero at sequence and
// document starts. QK-norm is off so the keys' second half is the raw projection.
TEST(AttnSwitchModel, PkoShiftsKeysOnLongLayersOnlyAndResetsAtDocumentStarts) {
  auto be = make_cpu_backend(0);
  ModelConfig m = small_model();
  m.n_layers = 2;
  m.n_kv_heads = 2;
  m.qk_norm = false;
  m.half_rope = true;
  m.long_every = 2;
  m.window = 5;
  m.eod_id = 2;
  const int B = 2, S = m.seq_len, KV = 2, hd = m.head_dim, N = B * S;
  auto in = tokens(N, m.vocab_size, 8);
  for (auto& t : in) t = t == 2 ? 3 : t;
  in[4] = in[20] = in[S - 1] = 2;  // documents start at 5 and S+5; S-1's eod is followed by a new row
  Transformer off(m, B, *be);
  off.init(9);
  m.pko = true;
  Transformer on(m, B, *be);
  on.init(9);
  logits_of(off, in);
  logits_of(on, in);
  const size_t row = size_t(KV) * hd;
  for (size_t i = 0; i < N * row; ++i)
    ASSERT_EQ(on.attention_keys(0)[i], off.attention_keys(0)[i]) << "short layer changed at " << i;
  const float* kon = on.attention_keys(1);
  const float* koff = off.attention_keys(1);
  int zeroed = 0;
  for (int t = 0; t < N; ++t) {
    const bool start = t % S == 0 || in[t - 1] == 2;
    zeroed += start;
    for (int g = 0; g < KV; ++g)
      for (int c = 0; c < hd; ++c) {
        const size_t i = size_t(t) * row + size_t(g) * hd + c;
        const float want = c < hd / 2 ? koff[i] : (start ? 0.f : koff[i - row]);
        ASSERT_EQ(kon[i], want) << "t " << t << " kv head " << g << " dim " << c;
      }
  }
  EXPECT_EQ(zeroed, 4);  // rows 0 and 1 start, documents at 5 and S+5
}

TEST(AttnSwitchModel, ZeroInitializedGateChangesNothing) {
  auto be = make_cpu_backend(0);
  ModelConfig m = small_model();
  m.n_layers = 2;
  Transformer plain(m, 1, *be);
  plain.init(12);
  m.attn_gate = true;
  Transformer gated(m, 1, *be);
  gated.init(12);
  auto& w = gated.param("model.layers.1.self_attn.attn_gate.weight");
  EXPECT_EQ(w.role, Role::AttnGate);
  for (size_t i = 0; i < w.numel; ++i) ASSERT_EQ(w.w[i], 0.f);
  auto in = tokens(m.seq_len, m.vocab_size, 13);
  EXPECT_EQ(logits_of(gated, in), logits_of(plain, in));
}

// ---------------------------------------------------------------------------------------------
// Bad input: one clear line each.

TEST(AttnSwitchConfig, BadInputGivesOneClearError) {
  auto check = [](auto edit, std::initializer_list<std::string> needles) {
    Config c;
    c.source = "cfg.yaml";
    c.model.d_model = 64;
    c.model.n_heads = 4;
    c.model.n_layers = 4;
    edit(c.model);
    expect_error([&] { validate(c); }, needles);
  };
  check([](ModelConfig& m) { m.half_rope = true, m.head_dim = 7; }, {"cfg.yaml", "model.half_rope", "multiple of 4", "7"});
  check([](ModelConfig& m) { m.half_rope = true, m.head_dim = 6; }, {"model.half_rope", "6"});
  check([](ModelConfig& m) { m.long_every = 4, m.window = 0; }, {"model.long_every", "model.window must be >= 1"});
  check([](ModelConfig& m) { m.long_every = 4, m.window = -3; }, {"model.window"});
  check([](ModelConfig& m) { m.half_rope = true, m.pko = true, m.window = 8; },
        {"model.pko", "none of the 4 layers is long"});
  check([](ModelConfig& m) { m.half_rope = true, m.pko = true, m.long_every = 8, m.window = 8; },
        {"model.pko", "long"});
  check([](ModelConfig& m) { m.pko = true, m.long_every = 4, m.window = 8; }, {"model.pko", "model.half_rope"});
  check([](ModelConfig& m) { m.half_rope = true, m.pko = true, m.long_every = 3, m.window = 8; },
        {"model.pko", "layer 3 is short", "model.last_layer_long"});
  check([](ModelConfig& m) { m.half_rope = true, m.pko = true, m.long_every = 4, m.window = 8, m.qk_norm = false; },
        {"model.pko", "model.qk_norm: true"});
  check([](ModelConfig& m) { m.gated_norm_rank = -1; }, {"model.gated_norm_rank"});
  check([](ModelConfig& m) { m.q_scale = 0; }, {"model.q_scale"});
  // The document-start rule with no end-of-document token.
  auto be = make_cpu_backend(0);
  ModelConfig m = small_model();
  m.n_layers = 2;
  m.half_rope = true;
  m.pko = true;
  m.long_every = 2;
  m.window = 4;
  expect_error([&] { Transformer t(m, 1, *be); }, {"model.pko", "end-of-document", "model.eod_id"});
}

// ---------------------------------------------------------------------------------------------
// Parity with the PyTorch reference, every switch on at once.

class AttnSwitchParity : public ::testing::TestWithParam<bool> {};

TEST_P(AttnSwitchParity, AllSwitchesOnMatchPyTorch) {
  Config c;
  c.source = "parity";
  auto& m = c.model;
  m.vocab_size = 96;
  m.d_model = 32;
  m.n_layers = 3;  // short, long (period 2), long (last)
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.head_dim = 8;
  m.d_ff = 64;
  m.seq_len = 16;
  m.rope_theta = 10000;
  m.init_std = 0.2;
  m.qk_norm = true;
  m.qk_norm_gain = GetParam();
  m.q_scale = 1.3;
  m.half_rope = true;
  m.window = 5;
  m.long_every = 2;
  m.last_layer_long = true;
  m.pko = true;
  m.eod_id = 3;
  m.xsa = true;
  m.attn_gate = true;
  m.gated_norm_rank = 4;
  c.run.batch_size = 3;
  validate(c);
  test::TempDir dir("attn-switch-parity");
  auto be = make_cpu_backend(0);
  Transformer model(m, c.run.batch_size, *be);
  model.init(21);
  // Non-zero gates (and norm gains) so that the gate's forward path is exercised too.
  for (auto& p : model.params()) {
    if (p.role != Role::AttnGate && p.role != Role::NormGain) continue;
    Philox r(5, stream_id(p.name));
    for (size_t i = 0; i < p.numel; ++i) p.w[i] += float(0.3 * r.trunc_normal(i));
  }
  const int B = c.run.batch_size, S = m.seq_len, V = m.vocab_size, N = B * S;
  auto inputs = tokens(N, V, 22), targets = tokens(N, V, 23);
  for (int i : {6, 11, 20, 33, 47}) inputs[i] = 3;  // document boundaries inside rows
  auto ref = test::reference_forward_backward(dir.path, c, model, inputs, targets);
  EXPECT_LT(test::logits_rel_err(model, inputs, ref), 2e-6);

  model.zero_grad();
  LossSums s = model.forward_backward(inputs.data(), targets.data(), 1.0f / float(N));
  EXPECT_NEAR(s.xent / N, ref.get_f32("loss")[0], 1e-5 * s.xent / N);
  int gates = 0, gated_norms = 0;
  for (auto& p : model.params()) {
    auto g = ref.get_f32("grad." + p.name);
    ASSERT_EQ(g.size(), p.numel) << p.name;
    EXPECT_GT(std::sqrt(be->sum_squares(p.g, p.numel)), 1e-8) << p.name;
    EXPECT_LT(test::rel_err(p.g, g.data(), p.numel), 5e-5) << p.name;
    gates += p.role == Role::AttnGate;
    gated_norms += p.role == Role::GatedNormMatrix;
  }
  EXPECT_EQ(gates, 3);
  EXPECT_EQ(gated_norms, 2 * (2 * 3 + 1));
}

INSTANTIATE_TEST_SUITE_P(QkNorm, AttnSwitchParity, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "LearnedGain" : "NonParametric"; });

}  // namespace
}  // namespace ladder
