// Tests of the CPU kernels. Gradients are checked against central finite differences of a random
// projection loss L = sum(out * R) in double precision (so every output element contributes and a
// wrong element of the Jacobian cannot hide); forward values against naive double implementations
// written independently here; the float instantiation against the double one.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/kernels.h"

using namespace ladder::cpu;

namespace {

using Vec = std::vector<double>;
using VecF = std::vector<float>;

Vec randn(size_t n, uint64_t seed, double stddev = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, stddev);
  Vec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

VecF to_f(const Vec& v) { return VecF(v.begin(), v.end()); }
Vec to_d(const VecF& v) { return Vec(v.begin(), v.end()); }

// Extended precision: the finite differences divide the change of this sum by 2e-6, so double
// rounding of a sum over 10^4 terms would swamp the 1e-6 relative tolerance.
double dot(const Vec& a, const Vec& b) {
  long double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += (long double)a[i] * b[i];
  return double(s);
}

// The helpers below fail on any non-finite value: std::max(m, NaN) keeps m and `NaN > worst` is
// false, so a running maximum would let a kernel that writes NaN or inf pass.

// Index of the first non-finite element, or a.size() when there is none.
size_t first_non_finite(const Vec& a) {
  for (size_t i = 0; i < a.size(); ++i)
    if (!std::isfinite(a[i])) return i;
  return a.size();
}

// Largest magnitude; infinity (so any EXPECT_LT on it fails) when an element is NaN or inf.
double max_abs(const Vec& a) {
  if (first_non_finite(a) != a.size()) return INFINITY;
  double m = 0;
  for (double x : a) m = std::max(m, std::abs(x));
  return m;
}

// Largest elementwise difference relative to the largest magnitude of the reference; a failure and
// infinity when the sizes differ or either side holds a non-finite element.
double rel_err(const Vec& got, const Vec& ref) {
  EXPECT_EQ(got.size(), ref.size());
  if (got.size() != ref.size()) return INFINITY;
  for (const Vec* a : {&got, &ref}) {
    const size_t i = first_non_finite(*a);
    if (i != a->size()) {
      ADD_FAILURE() << (a == &got ? "result" : "reference") << " element " << i << " is "
                    << (*a)[i];
      return INFINITY;
    }
  }
  double m = 0;
  for (size_t i = 0; i < ref.size(); ++i) m = std::max(m, std::abs(got[i] - ref[i]));
  return m / std::max(max_abs(ref), 1e-300);
}

// Indices to finite-difference: all of them, or `samples` distinct ones drawn at random (a partial
// Fisher-Yates shuffle, so no element is checked twice while another is skipped).
std::vector<size_t> pick(size_t n, size_t samples, uint64_t seed) {
  std::vector<size_t> idx(n);
  for (size_t i = 0; i < n; ++i) idx[i] = i;
  if (samples == 0 || samples >= n) return idx;
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < samples; ++i) {
    std::uniform_int_distribution<size_t> d(i, n - 1);
    std::swap(idx[i], idx[d(rng)]);
  }
  idx.resize(samples);
  return idx;
}

// Central differences of loss(i) with respect to x[i] for i in idx, compared with grad[i] (loss
// gets the perturbed index so it may evaluate only the part of the loss that depends on it). The
// error of an element is taken relative to max(|fd|, 1e-3 * max|grad|) so tiny gradients are not
// held to a tolerance below the rounding noise of the loss. Every element of grad (not only the
// sampled ones) must be finite, and a non-finite difference counts as an infinite error.
void check_grad(Vec& x, const Vec& grad, const std::function<double(size_t)>& loss,
                const std::vector<size_t>& idx, double tol, const std::string& what) {
  const size_t bad = first_non_finite(grad);
  if (bad != grad.size()) {
    ADD_FAILURE() << what << ": element " << bad << " of the analytic gradient is " << grad[bad];
    return;
  }
  const double eps = 1e-6;
  const double floor = std::max(1e-3 * max_abs(grad), 1e-10);
  double worst = 0;
  size_t worst_i = 0;
  double worst_fd = 0;
  for (size_t i : idx) {
    const double save = x[i];
    x[i] = save + eps;
    const double lp = loss(i);
    x[i] = save - eps;
    const double lm = loss(i);
    x[i] = save;
    const double fd = (lp - lm) / (2 * eps);
    double err = std::abs(fd - grad[i]) / std::max(std::abs(fd), floor);
    if (!std::isfinite(err)) err = INFINITY;  // NaN would never compare above `worst`
    if (err > worst) {
      worst = err;
      worst_i = i;
      worst_fd = fd;
    }
  }
  EXPECT_LT(worst, tol) << what << ": worst element " << worst_i << " analytic " << grad[worst_i]
                        << " finite-difference " << worst_fd;
}

// Restores the OpenMP thread count when a test changes it.
struct ThreadGuard {
  int saved = omp_get_max_threads();
  ~ThreadGuard() { omp_set_num_threads(saved); }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// GEMM

TEST(Kernels, GemmAllTransposes) {
  const int M = 5, N = 7, K = 3;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      // Padded leading dimensions catch any lda/ldb/ldc mix-up.
      const int lda = (ta ? M : K) + 2, ldb = (tb ? K : N) + 3, ldc = N + 1;
      const int arows = ta ? K : M, brows = tb ? N : K;
      Vec A = randn(size_t(arows) * lda, 1 + ta);
      Vec B = randn(size_t(brows) * ldb, 3 + tb);
      Vec C = randn(size_t(M) * ldc, 5);
      const double alpha = 0.7, beta = -0.3;
      Vec ref = C;
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
          double s = 0;
          for (int p = 0; p < K; ++p) {
            const double a = ta ? A[size_t(p) * lda + i] : A[size_t(i) * lda + p];
            const double b = tb ? B[size_t(j) * ldb + p] : B[size_t(p) * ldb + j];
            s += a * b;
          }
          ref[size_t(i) * ldc + j] = alpha * s + beta * C[size_t(i) * ldc + j];
        }
      Vec got = C;
      gemm<double>(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, got.data(), ldc);
      EXPECT_LT(rel_err(got, ref), 1e-14) << "ta=" << ta << " tb=" << tb;
      VecF Af = to_f(A), Bf = to_f(B), gf = to_f(C);
      gemm<float>(ta, tb, M, N, K, float(alpha), Af.data(), lda, Bf.data(), ldb, float(beta),
                  gf.data(), ldc);
      EXPECT_LT(rel_err(to_d(gf), ref), 1e-5) << "float ta=" << ta << " tb=" << tb;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Embedding

TEST(Kernels, EmbeddingForwardBackward) {
  const int V = 6, D = 5;
  const std::vector<int32_t> ids = {3, 1, 3, 3, 0, 5, 1};
  const int N = int(ids.size());
  Vec table = randn(size_t(V) * D, 11);
  Vec out(size_t(N) * D, NAN);  // poison: every row must be written
  embedding_forward(out.data(), table.data(), ids.data(), N, D);
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < D; ++c) EXPECT_EQ(out[size_t(i) * D + c], table[size_t(ids[i]) * D + c]);

  Vec R = randn(out.size(), 12);
  // Start from a nonzero gradient: the backward must accumulate into it.
  Vec pre = randn(table.size(), 13);
  Vec dtable = pre;
  embedding_backward(dtable.data(), R.data(), ids.data(), N, D);
  for (int c = 0; c < D; ++c) {
    EXPECT_NEAR(dtable[3 * D + c], pre[3 * D + c] + R[0 * D + c] + R[2 * D + c] + R[3 * D + c],
                1e-14);
    EXPECT_NEAR(dtable[1 * D + c], pre[1 * D + c] + R[1 * D + c] + R[6 * D + c], 1e-14);
    EXPECT_EQ(dtable[2 * D + c], pre[2 * D + c]);  // unused row untouched
    EXPECT_EQ(dtable[4 * D + c], pre[4 * D + c]);
  }
  Vec grad(table.size());
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = dtable[i] - pre[i];
  auto loss = [&](size_t) {
    embedding_forward(out.data(), table.data(), ids.data(), N, D);
    return dot(out, R);
  };
  check_grad(table, grad, loss, pick(table.size(), 0, 0), 1e-6, "dtable");
}

TEST(Kernels, EmbeddingBackwardDeterministicAcrossThreads) {
  ThreadGuard guard;
  const int V = 50, D = 300, N = 2000;  // N*D above the parallel threshold
  std::mt19937_64 rng(21);
  std::vector<int32_t> ids(N);
  for (auto& x : ids) x = int32_t(rng() % V);
  VecF dout = to_f(randn(size_t(N) * D, 22));
  VecF ref;
  for (int nt : {1, 2, 3, 5}) {
    omp_set_num_threads(nt);
    VecF dt(size_t(V) * D, 0.5f);
    embedding_backward(dt.data(), dout.data(), ids.data(), N, D);
    if (ref.empty()) {
      ref = dt;
      // Against a plain serial loop (same token order, so bitwise equal).
      VecF serial(size_t(V) * D, 0.5f);
      for (int i = 0; i < N; ++i)
        for (int c = 0; c < D; ++c) serial[size_t(ids[i]) * D + c] += dout[size_t(i) * D + c];
      EXPECT_EQ(dt, serial);
    } else {
      EXPECT_EQ(dt, ref) << "threads=" << nt;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

namespace {

void naive_rmsnorm(Vec& y, Vec& rstd, const Vec& x, const double* gain, int N, int D, double eps) {
  for (int i = 0; i < N; ++i) {
    double ss = 0;
    for (int j = 0; j < D; ++j) ss += x[size_t(i) * D + j] * x[size_t(i) * D + j];
    rstd[i] = 1.0 / std::sqrt(ss / D + eps);
    for (int j = 0; j < D; ++j)
      y[size_t(i) * D + j] = x[size_t(i) * D + j] * rstd[i] * (gain ? gain[j] : 1.0);
  }
}

void rmsnorm_case(int N, int D, bool with_gain, size_t fd_samples) {
  const double eps = 1e-5;
  Vec x = randn(size_t(N) * D, 31 + N);
  Vec gain = randn(D, 32);
  for (auto& g : gain) g += 1.0;
  const double* gp = with_gain ? gain.data() : nullptr;
  Vec y(x.size(), NAN), rstd(N, NAN), yr(x.size()), rr(N);  // NaN poison: must be overwritten
  rmsnorm_forward(y.data(), rstd.data(), x.data(), gp, N, D, eps);
  naive_rmsnorm(yr, rr, x, gp, N, D, eps);
  EXPECT_LT(rel_err(y, yr), 1e-14);
  EXPECT_LT(rel_err(rstd, rr), 1e-14);

  Vec R = randn(y.size(), 33);
  Vec dx(x.size(), NAN);  // accumulate_dx off: dx is overwritten, so NaN must not survive
  Vec dgain_pre = randn(D, 34);  // dgain accumulates: start from random values, check the change
  Vec dgain = dgain_pre;
  rmsnorm_backward(dx.data(), with_gain ? dgain.data() : nullptr, R.data(), x.data(), gp,
                   rstd.data(), N, D, false);
  auto loss = [&](size_t) {
    Vec yy(x.size()), rs(N);
    rmsnorm_forward(yy.data(), rs.data(), x.data(), with_gain ? gain.data() : nullptr, N, D, eps);
    return dot(yy, R);
  };
  // Big rows sum more rounding noise into the loss: looser tolerance there.
  const double tol = fd_samples ? 1e-5 : 1e-6;
  check_grad(x, dx, loss, pick(x.size(), fd_samples, 35), tol, "rmsnorm dx");
  if (with_gain) {
    Vec dg(D);
    for (int j = 0; j < D; ++j) dg[j] = dgain[j] - dgain_pre[j];
    check_grad(gain, dg, loss, pick(D, 0, 0), tol, "rmsnorm dgain");
  }

  // accumulate_dx adds onto what is there.
  Vec dx2 = randn(x.size(), 36);
  Vec dx2_pre = dx2;
  rmsnorm_backward(dx2.data(), static_cast<double*>(nullptr), R.data(), x.data(), gp, rstd.data(),
                   N, D, true);
  Vec diff(x.size());
  for (size_t i = 0; i < diff.size(); ++i) diff[i] = dx2[i] - dx2_pre[i];
  EXPECT_LT(rel_err(diff, dx), 1e-12);

  // float instantiation against double
  VecF xf = to_f(x), gf = to_f(gain), Rf = to_f(R), yf(x.size(), NAN), rf(N, NAN),
      dxf(x.size(), NAN);
  VecF dgf = to_f(dgain_pre);
  rmsnorm_forward(yf.data(), rf.data(), xf.data(), with_gain ? gf.data() : nullptr, N, D,
                  float(eps));
  rmsnorm_backward(dxf.data(), with_gain ? dgf.data() : nullptr, Rf.data(), xf.data(),
                   with_gain ? gf.data() : nullptr, rf.data(), N, D, false);
  EXPECT_LT(rel_err(to_d(yf), y), 1e-6);
  EXPECT_LT(rel_err(to_d(dxf), dx), 1e-5);
  if (with_gain) {
    Vec dg(D), dgf_change(D);
    for (int j = 0; j < D; ++j) {
      dg[j] = dgain[j] - dgain_pre[j];
      dgf_change[j] = double(dgf[j]) - double(float(dgain_pre[j]));
    }
    EXPECT_LT(rel_err(dgf_change, dg), 1e-5);
  }
}

}  // namespace

TEST(Kernels, RmsNormWithGain) { rmsnorm_case(6, 10, true, 0); }
TEST(Kernels, RmsNormWithoutGain) { rmsnorm_case(6, 10, false, 0); }
TEST(Kernels, RmsNormLargeParallel) {
  // Large enough for the threaded path with per-thread dgain partials.
  ThreadGuard guard;
  omp_set_num_threads(3);
  rmsnorm_case(300, 130, true, 60);
}

// ---------------------------------------------------------------------------------------------
// RoPE

namespace {

void rope_case(int rot_dims_div) {
  const int B = 2, S = 9, nh = 3, hd = 8;
  const int rot = hd / rot_dims_div;
  const double theta = 500.0;  // small theta: every frequency turns visibly within S positions
  const int Nt = B * S;
  Vec x = randn(size_t(Nt) * nh * hd, 41 + rot);
  Vec ref = x;
  for (int t = 0; t < Nt; ++t) {
    const int pos = t % S;
    for (int h = 0; h < nh; ++h) {
      double* r = &ref[(size_t(t) * nh + h) * hd];
      const double* xi = &x[(size_t(t) * nh + h) * hd];
      for (int i = 0; i < rot / 2; ++i) {
        const double ang = pos * std::pow(theta, -2.0 * i / rot);
        r[i] = xi[i] * std::cos(ang) - xi[i + rot / 2] * std::sin(ang);
        r[i + rot / 2] = xi[i + rot / 2] * std::cos(ang) + xi[i] * std::sin(ang);
      }
    }
  }
  Vec y = x;
  rope_forward(y.data(), Nt, S, nh, hd, rot, theta);
  EXPECT_LT(rel_err(y, ref), 1e-14);
  // Dimensions past rot_dims pass through untouched.
  for (int t = 0; t < Nt; ++t)
    for (int h = 0; h < nh; ++h)
      for (int i = rot; i < hd; ++i)
        EXPECT_EQ(y[(size_t(t) * nh + h) * hd + i], x[(size_t(t) * nh + h) * hd + i]);

  Vec R = randn(x.size(), 42);
  Vec dx = R;
  rope_backward(dx.data(), Nt, S, nh, hd, rot, theta);
  auto loss = [&](size_t) {
    Vec yy = x;
    rope_forward(yy.data(), Nt, S, nh, hd, rot, theta);
    return dot(yy, R);
  };
  check_grad(x, dx, loss, pick(x.size(), 0, 0), 1e-6, "rope dx");

  VecF xf = to_f(x);
  rope_forward(xf.data(), Nt, S, nh, hd, rot, float(theta));
  EXPECT_LT(rel_err(to_d(xf), y), 1e-6);
  VecF Rf = to_f(R);
  rope_backward(Rf.data(), Nt, S, nh, hd, rot, float(theta));
  EXPECT_LT(rel_err(to_d(Rf), dx), 1e-6);
}

}  // namespace

TEST(Kernels, RopeFull) { rope_case(1); }
TEST(Kernels, RopeHalf) { rope_case(2); }

// ---------------------------------------------------------------------------------------------
// Attention

namespace {

void naive_attention(Vec& o, Vec& lse, const Vec& q, const Vec& k, const Vec& v,
                     const AttnShape& s) {
  const int G = s.H / s.KV;
  o.assign(size_t(s.B) * s.S * s.H * s.hd, 0.0);
  lse.assign(size_t(s.B) * s.H * s.S, 0.0);
  Vec sc(s.S);
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.H; ++h) {
      const int g = h / G;
      for (int i = 0; i < s.S; ++i) {
        const double* qi = &q[((size_t(b) * s.S + i) * s.H + h) * s.hd];
        double mx = -INFINITY;
        for (int j = 0; j < s.S; ++j) {
          const bool visible = j <= i && (s.window <= 0 || i - j < s.window);
          if (!visible) {
            sc[j] = -INFINITY;
            continue;
          }
          const double* kj = &k[((size_t(b) * s.S + j) * s.KV + g) * s.hd];
          double d = 0;
          for (int c = 0; c < s.hd; ++c) d += qi[c] * kj[c];
          sc[j] = d * s.scale;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (int j = 0; j < s.S; ++j) sum += std::exp(sc[j] - mx);
        lse[(size_t(b) * s.H + h) * s.S + i] = mx + std::log(sum);
        double* oi = &o[((size_t(b) * s.S + i) * s.H + h) * s.hd];
        for (int j = 0; j < s.S; ++j) {
          const double p = std::exp(sc[j] - mx) / sum;
          const double* vj = &v[((size_t(b) * s.S + j) * s.KV + g) * s.hd];
          for (int c = 0; c < s.hd; ++c) oi[c] += p * vj[c];
        }
      }
    }
}

// The backward of the same attention, straight from the math in O(S^2) per head, sharing no code
// or blocking with the kernel: with P_ij = softmax_j(scale * q_i.k_j) over the visible keys and
// dO = dout,
//   dv_j += sum_i P_ij dO_i                     (summed over the query heads of the KV group)
//   dP_ij = dO_i . v_j,  D_i = sum_j P_ij dP_ij,  dS_ij = P_ij (dP_ij - D_i)
//   dq_i = scale * sum_j dS_ij k_j,  dk_j += scale * sum_i dS_ij q_i
// D_i is the sum over j here, not dO_i . O_i as the kernel takes it (equal only when the forward
// is right).
void naive_attention_backward(Vec& dq, Vec& dk, Vec& dv, const Vec& dout, const Vec& q,
                              const Vec& k, const Vec& v, const AttnShape& s) {
  const int G = s.H / s.KV;
  dq.assign(size_t(s.B) * s.S * s.H * s.hd, 0.0);
  dk.assign(size_t(s.B) * s.S * s.KV * s.hd, 0.0);
  dv.assign(dk.size(), 0.0);
  Vec p(s.S), dp(s.S);
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.H; ++h) {
      const int g = h / G;
      auto krow = [&](const Vec& x, int j) {
        return &x[((size_t(b) * s.S + j) * s.KV + g) * s.hd];
      };
      for (int i = 0; i < s.S; ++i) {
        const size_t qo = ((size_t(b) * s.S + i) * s.H + h) * s.hd;
        const double* qi = &q[qo];
        const double* doi = &dout[qo];
        const int lo = s.window > 0 ? std::max(0, i - s.window + 1) : 0;  // keys lo..i visible
        double mx = -INFINITY;
        for (int j = lo; j <= i; ++j) {
          const double* kj = krow(k, j);
          double d = 0;
          for (int c = 0; c < s.hd; ++c) d += qi[c] * kj[c];
          p[j] = d * s.scale;
          mx = std::max(mx, p[j]);
        }
        double sum = 0;
        for (int j = lo; j <= i; ++j) sum += (p[j] = std::exp(p[j] - mx));
        double D = 0;
        for (int j = lo; j <= i; ++j) {
          p[j] /= sum;
          const double* vj = krow(v, j);
          double d = 0;
          for (int c = 0; c < s.hd; ++c) d += doi[c] * vj[c];
          dp[j] = d;
          D += p[j] * d;
        }
        for (int j = lo; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - D);
          const double* kj = krow(k, j);
          double* dkj = &dk[((size_t(b) * s.S + j) * s.KV + g) * s.hd];
          double* dvj = &dv[((size_t(b) * s.S + j) * s.KV + g) * s.hd];
          for (int c = 0; c < s.hd; ++c) {
            dq[qo + c] += s.scale * ds * kj[c];
            dkj[c] += s.scale * ds * qi[c];
            dvj[c] += p[j] * doi[c];
          }
        }
      }
    }
}

struct AttnResult {
  Vec o, lse, dq, dk, dv;
};

AttnResult attention_case(const AttnShape& s, size_t fd_samples, uint64_t seed,
                          bool check_fd = true) {
  const size_t nq = size_t(s.B) * s.S * s.H * s.hd, nk = size_t(s.B) * s.S * s.KV * s.hd;
  // q scaled up so the softmax is peaked: a wrong mask or a wrong row max would show clearly.
  Vec q = randn(nq, seed, 2.0), k = randn(nk, seed + 1), v = randn(nk, seed + 2);
  Vec R = randn(nq, seed + 3);
  AttnResult r;
  // NaN poison: every element of o, lse, dq, dk, dv must be written (rel_err fails on NaN).
  r.o.assign(nq, NAN);
  r.lse.assign(size_t(s.B) * s.H * s.S, NAN);
  attention_forward(r.o.data(), r.lse.data(), q.data(), k.data(), v.data(), s);
  Vec o_ref, lse_ref;
  naive_attention(o_ref, lse_ref, q, k, v, s);
  EXPECT_LT(rel_err(r.o, o_ref), 1e-12);
  EXPECT_LT(rel_err(r.lse, lse_ref), 1e-12);

  r.dq.assign(nq, NAN);
  r.dk.assign(nk, NAN);
  r.dv.assign(nk, NAN);
  attention_backward(r.dq.data(), r.dk.data(), r.dv.data(), R.data(), q.data(), k.data(),
                     v.data(), r.o.data(), r.lse.data(), s);
  // Every element against the naive backward: this covers the shapes too big to finite-difference
  // in full (several query and key blocks, the threaded paths). Both sides are double and differ
  // only in summation order and the kernel's D = dO.O, so 1e-12 of the largest magnitude is ample.
  Vec dq_ref, dk_ref, dv_ref;
  naive_attention_backward(dq_ref, dk_ref, dv_ref, R, q, k, v, s);
  EXPECT_LT(rel_err(r.dq, dq_ref), 1e-12);
  EXPECT_LT(rel_err(r.dk, dk_ref), 1e-12);
  EXPECT_LT(rel_err(r.dv, dv_ref), 1e-12);
  if (check_fd) {
    auto loss = [&](size_t) {
      Vec oo(nq), ll(r.lse.size());
      attention_forward(oo.data(), ll.data(), q.data(), k.data(), v.data(), s);
      return dot(oo, R);
    };
    check_grad(q, r.dq, loss, pick(nq, fd_samples, seed + 4), 1e-5, "attention dq");
    check_grad(k, r.dk, loss, pick(nk, fd_samples, seed + 5), 1e-5, "attention dk");
    check_grad(v, r.dv, loss, pick(nk, fd_samples, seed + 6), 1e-5, "attention dv");
  }

  // The float kernel (what training runs) against the double naive references, not against the
  // double kernel (same code). Its error is the float rounding of the inputs and of the blocked
  // sums: measured at most 9e-7 of the largest magnitude over the cases here (S up to 330, peaked
  // softmax with q ~ 2 N(0,1)), against 3e-15 for the double kernel. 2e-5 leaves a 20x margin for
  // other BLAS builds and thread counts, while a reference that drops one key per row misses by
  // 4e-2 and one with the scale off by 0.1% by 1e-3 (tried on the S = 330 windowed case).
  VecF qf = to_f(q), kf = to_f(k), vf = to_f(v), Rf = to_f(R);
  VecF of(nq, NAN), lf(r.lse.size(), NAN), dqf(nq, NAN), dkf(nk, NAN), dvf(nk, NAN);
  attention_forward(of.data(), lf.data(), qf.data(), kf.data(), vf.data(), s);
  attention_backward(dqf.data(), dkf.data(), dvf.data(), Rf.data(), qf.data(), kf.data(),
                     vf.data(), of.data(), lf.data(), s);
  EXPECT_LT(rel_err(to_d(of), o_ref), 2e-5);
  EXPECT_LT(rel_err(to_d(lf), lse_ref), 2e-5);
  EXPECT_LT(rel_err(to_d(dqf), dq_ref), 2e-5);
  EXPECT_LT(rel_err(to_d(dkf), dk_ref), 2e-5);
  EXPECT_LT(rel_err(to_d(dvf), dv_ref), 2e-5);
  return r;
}

AttnShape shape(int B, int S, int H, int KV, int hd, int window) {
  return AttnShape{B, S, H, KV, hd, window, 1.0 / std::sqrt(double(hd))};
}

}  // namespace

TEST(Kernels, AttentionCausalFull) { attention_case(shape(2, 13, 2, 2, 8, 0), 0, 100); }

TEST(Kernels, AttentionGQA) {
  // B*KV = 2 tasks: with 1 or 2 threads the backward runs one task per KV group, with 3 threads one
  // task per query head plus the head-sum pass. Both must agree with finite differences and with
  // each other.
  ThreadGuard guard;
  std::vector<AttnResult> res;
  for (int nt : {1, 2, 3}) {
    omp_set_num_threads(nt);
    res.push_back(attention_case(shape(1, 13, 4, 2, 8, 0), 0, 200));
  }
  for (size_t i = 1; i < res.size(); ++i) {
    EXPECT_LT(rel_err(res[i].dq, res[0].dq), 1e-13);
    EXPECT_LT(rel_err(res[i].dk, res[0].dk), 1e-13);
    EXPECT_LT(rel_err(res[i].dv, res[0].dv), 1e-13);
  }
}

TEST(Kernels, AttentionSlidingWindow) {
  ThreadGuard guard;
  attention_case(shape(2, 13, 4, 2, 8, 5), 0, 300);
  omp_set_num_threads(3);
  attention_case(shape(1, 13, 4, 2, 8, 4), 0, 310);
}

TEST(Kernels, AttentionWindowOne) {
  // Each query sees only itself: o is its own v row, lse its own score, and q, k get no gradient.
  const AttnShape s = shape(2, 70, 4, 2, 8, 1);
  const size_t nq = size_t(s.B) * s.S * s.H * s.hd, nk = size_t(s.B) * s.S * s.KV * s.hd;
  Vec q = randn(nq, 320), k = randn(nk, 321), v = randn(nk, 322), R = randn(nq, 323);
  // NaN poison: dq and dk are exactly zero here, which a kernel that skipped them would also leave
  // in zero-initialized buffers; all five are overwritten by contract.
  Vec o(nq, NAN), lse(size_t(s.B) * s.H * s.S, NAN), dq(nq, NAN), dk(nk, NAN), dv(nk, NAN);
  attention_forward(o.data(), lse.data(), q.data(), k.data(), v.data(), s);
  attention_backward(dq.data(), dk.data(), dv.data(), R.data(), q.data(), k.data(), v.data(),
                     o.data(), lse.data(), s);
  Vec dv_ref(nk, 0.0);
  for (int t = 0; t < s.B * s.S; ++t)
    for (int h = 0; h < s.H; ++h) {
      const int g = h / (s.H / s.KV);
      for (int c = 0; c < s.hd; ++c) {
        EXPECT_NEAR(o[(size_t(t) * s.H + h) * s.hd + c], v[(size_t(t) * s.KV + g) * s.hd + c],
                    1e-14);
        dv_ref[(size_t(t) * s.KV + g) * s.hd + c] += R[(size_t(t) * s.H + h) * s.hd + c];
      }
    }
  EXPECT_LT(max_abs(dq), 1e-13);
  EXPECT_LT(max_abs(dk), 1e-13);
  EXPECT_LT(rel_err(dv, dv_ref), 1e-14);
}

TEST(Kernels, AttentionLongMultiBlock) {
  // S spans several query blocks and, for late rows, more than one key block (online softmax
  // rescaling); finite differences on a random sample of elements.
  attention_case(shape(1, 300, 4, 2, 16, 0), 24, 400);
}

TEST(Kernels, AttentionLongSlidingWindow) {
  // Window 250 with S = 330: key ranges start past 0 and span two key blocks, with rows that see
  // nothing in one of them.
  ThreadGuard guard;
  omp_set_num_threads(3);
  attention_case(shape(1, 330, 2, 1, 16, 250), 24, 500);
  attention_case(shape(2, 200, 2, 2, 16, 70), 24, 510);
}

TEST(Kernels, AttentionMultiBlockBackwardMatchesNaive) {
  // Every element of dq, dk, dv against the naive double backward (in attention_case), float and
  // double kernels, on shapes with several 64-row query blocks (and, past S = 256, two key blocks)
  // that are big enough for the threaded path (B*H*S*min(S, window)*hd >= 2^20). 1, 2 and 3
  // threads: with 3 the B*KV group tasks do not divide among the threads, so the backward takes
  // the per-head slab path and sums the group's heads afterwards; otherwise one task per group
  // (the S = 330 case, one group, takes the slab path from 2 threads).
  // No finite differences: the naive backward is the independent check, and it is cheap.
  ThreadGuard guard;
  const AttnShape shapes[] = {
      shape(2, 70, 4, 2, 32, 0),            // two query blocks, the second partial
      AttnShape{2, 70, 8, 2, 32, 30, 0.25},  // window inside and across blocks, G = 4, own scale
      shape(1, 300, 4, 2, 16, 0),           // five query blocks; late rows span two key blocks
      AttnShape{1, 330, 2, 1, 16, 250, 0.3},  // key ranges start past 0 and span two key blocks
  };
  uint64_t seed = 800;
  for (const AttnShape& s : shapes)
    for (int nt : {1, 2, 3}) {
      SCOPED_TRACE("S=" + std::to_string(s.S) + " window=" + std::to_string(s.window) +
                   " threads=" + std::to_string(nt));
      omp_set_num_threads(nt);
      attention_case(s, 0, seed += 10, false);
    }
}

TEST(Kernels, AttentionWindowAtLeastSIsFullCausal) {
  const int S = 70;  // more than one query block
  AttnResult full = attention_case(shape(2, S, 4, 2, 8, 0), 0, 600, false);
  for (int w : {S, S + 7}) {
    AttnResult r = attention_case(shape(2, S, 4, 2, 8, w), 0, 600, false);
    EXPECT_EQ(r.o, full.o) << "window " << w;
    EXPECT_EQ(r.lse, full.lse) << "window " << w;
    EXPECT_EQ(r.dq, full.dq) << "window " << w;
    EXPECT_EQ(r.dk, full.dk) << "window " << w;
    EXPECT_EQ(r.dv, full.dv) << "window " << w;
  }
}

namespace {

template <class T>
void window_edge_case(int S, int w) {
  // v one-hot per key position (hd == S), so o[i, j] is exactly the attention weight of key j.
  const int hd = S;
  AttnShape s{1, S, 1, 1, hd, w, 0.5};
  Vec qd = randn(size_t(S) * hd, 700), kd = randn(size_t(S) * hd, 701);
  std::vector<T> q(qd.begin(), qd.end()), k(kd.begin(), kd.end()), v(size_t(S) * hd, T(0));
  for (int j = 0; j < S; ++j) v[size_t(j) * hd + j] = T(1);
  std::vector<T> o(size_t(S) * hd), lse(S);
  attention_forward(o.data(), lse.data(), q.data(), k.data(), v.data(), s);
  for (int i = 0; i < S; ++i) {
    T rowsum = 0;
    for (int j = 0; j < S; ++j) {
      const T p = o[size_t(i) * hd + j];
      rowsum += p;
      const bool visible = j <= i && i - j < w;
      if (visible)
        EXPECT_GT(p, T(0)) << "i=" << i << " j=" << j;
      else
        EXPECT_EQ(p, T(0)) << "i=" << i << " j=" << j;
    }
    EXPECT_NEAR(double(rowsum), 1.0, 1e-5);
  }
}

}  // namespace

TEST(Kernels, AttentionWindowEdgesExact) {
  window_edge_case<double>(16, 5);
  window_edge_case<float>(16, 5);
  window_edge_case<float>(80, 30);  // edges inside and across query blocks
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

TEST(Kernels, SwiGLU) {
  const size_t n = 40;
  Vec g = randn(n, 50, 3.0), u = randn(n, 51);
  Vec h(n, NAN);  // NaN poison on every output: all are overwritten
  swiglu_forward(h.data(), g.data(), u.data(), n);
  for (size_t i = 0; i < n; ++i)
    EXPECT_NEAR(h[i], g[i] / (1.0 + std::exp(-g[i])) * u[i], 1e-14 * (1 + std::abs(h[i])));
  Vec R = randn(n, 52);
  Vec dg(n, NAN), du(n, NAN);
  swiglu_backward(dg.data(), du.data(), R.data(), g.data(), u.data(), n);
  auto loss = [&](size_t) {
    Vec hh(n);
    swiglu_forward(hh.data(), g.data(), u.data(), n);
    return dot(hh, R);
  };
  check_grad(g, dg, loss, pick(n, 0, 0), 1e-6, "swiglu dg");
  check_grad(u, du, loss, pick(n, 0, 0), 1e-6, "swiglu du");

  // float, over a size that takes the threaded path, including large |g|
  const size_t m = 100000;
  Vec G = randn(m, 53, 6.0), U = randn(m, 54), DH = randn(m, 55);
  G[0] = -200;
  G[1] = 200;
  Vec H(m, NAN), DG(m, NAN), DU(m, NAN);
  swiglu_forward(H.data(), G.data(), U.data(), m);
  swiglu_backward(DG.data(), DU.data(), DH.data(), G.data(), U.data(), m);
  VecF Gf = to_f(G), Uf = to_f(U), DHf = to_f(DH), Hf(m, NAN), DGf(m, NAN), DUf(m, NAN);
  swiglu_forward(Hf.data(), Gf.data(), Uf.data(), m);
  swiglu_backward(DGf.data(), DUf.data(), DHf.data(), Gf.data(), Uf.data(), m);
  EXPECT_LT(rel_err(to_d(Hf), H), 1e-6);
  EXPECT_LT(rel_err(to_d(DGf), DG), 1e-6);
  EXPECT_LT(rel_err(to_d(DUf), DU), 1e-6);
  for (size_t i = 0; i < m; ++i) ASSERT_TRUE(std::isfinite(Hf[i]) && std::isfinite(DGf[i]));
}

// ---------------------------------------------------------------------------------------------
// Softmax cross-entropy

namespace {

void xent_case(int N, int V, double z, size_t fd_samples, double offset) {
  Vec logits = randn(size_t(N) * V, 60 + N, 3.0);
  for (auto& x : logits) x += offset;  // large common offset: the max subtraction must hold
  std::vector<int32_t> tgt(N);
  std::mt19937_64 rng(61);
  for (auto& t : tgt) t = int32_t(rng() % V);
  const double gs = 0.37;

  double xs = 0, ls = 0;
  Vec row_loss(N);
  for (int i = 0; i < N; ++i) {
    const double* x = &logits[size_t(i) * V];
    double mx = *std::max_element(x, x + V), s = 0;
    for (int j = 0; j < V; ++j) s += std::exp(x[j] - mx);
    const double lse = mx + std::log(s);
    row_loss[i] = lse - x[tgt[i]];
    xs += row_loss[i];
    ls += lse * lse;
  }
  Vec losses(N, NAN);  // poison: every row's loss must be written
  XentSums f = softmax_xent_forward(logits.data(), tgt.data(), N, V, losses.data());
  EXPECT_NEAR(f.xent, xs, 1e-11 * std::abs(xs));
  EXPECT_NEAR(f.lse_sq, ls, 1e-11 * std::abs(ls));
  EXPECT_LT(rel_err(losses, row_loss), 1e-12);

  Vec grad = logits;
  XentSums b = softmax_xent(grad.data(), tgt.data(), N, V, z, gs);
  EXPECT_NEAR(b.xent, xs, 1e-11 * std::abs(xs));
  EXPECT_NEAR(b.lse_sq, ls, 1e-11 * std::abs(ls));
  // Only the perturbed row: the other rows' terms would add rounding noise and nothing else.
  auto loss = [&](size_t i) {
    const size_t row = i / V;
    XentSums r = softmax_xent_forward(&logits[row * V], &tgt[row], 1, V,
                                      static_cast<double*>(nullptr));
    return gs * (r.xent + z * r.lse_sq);
  };
  check_grad(logits, grad, loss, pick(logits.size(), fd_samples, 62), 1e-5, "xent dlogits");

  VecF lf = to_f(logits);
  VecF lossf(N, NAN);
  XentSums ff = softmax_xent_forward(lf.data(), tgt.data(), N, V, lossf.data());
  EXPECT_NEAR(ff.xent, xs, 1e-5 * std::abs(xs) + 1e-4 * N);
  EXPECT_LT(rel_err(to_d(lossf), row_loss), 1e-5);
  XentSums bf = softmax_xent(lf.data(), tgt.data(), N, V, float(z), float(gs));
  EXPECT_NEAR(bf.lse_sq, ls, 1e-5 * std::abs(ls));
  EXPECT_LT(rel_err(to_d(lf), grad), 2e-5);
}

}  // namespace

TEST(Kernels, SoftmaxXent) { xent_case(5, 11, 0.0, 0, 0.0); }
TEST(Kernels, SoftmaxXentZLoss) { xent_case(5, 11, 0.05, 0, 0.0); }
TEST(Kernels, SoftmaxXentLargeParallel) {
  ThreadGuard guard;
  omp_set_num_threads(3);
  xent_case(70, 1000, 1e-3, 80, 40.0);
}

// ---------------------------------------------------------------------------------------------
// Vector helpers and AdamW

TEST(Kernels, AddScaleInplace) {
  const size_t n = 70001;
  Vec x = randn(n, 70), y = randn(n, 71);
  Vec y2 = y;
  add_inplace(y2.data(), x.data(), n);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(y2[i], y[i] + x[i]);
  scale_inplace(y2.data(), 0.25, n);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(y2[i], (y[i] + x[i]) * 0.25);
}

TEST(Kernels, SumSquares) {
  ThreadGuard guard;
  for (size_t n : {size_t(0), size_t(7), size_t(100003)}) {
    Vec x = randn(n, 80 + n);
    long double ref = 0;
    for (double v : x) ref += (long double)v * v;
    for (int nt : {1, 3}) {
      omp_set_num_threads(nt);
      const double s = sum_squares(x.data(), n);
      EXPECT_NEAR(s, double(ref), 1e-12 * double(ref) + 1e-300);
      EXPECT_EQ(s, sum_squares(x.data(), n));  // same thread count, same bits
      VecF xf = to_f(x);
      EXPECT_NEAR(sum_squares(xf.data(), n), double(ref), 1e-6 * double(ref) + 1e-30);
    }
  }
}

TEST(Kernels, AdamW) {
  const size_t n = 50000;
  const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  Vec p = randn(n, 90), m(n, 0.0), v(n, 0.0);
  Vec pr = p, mr = m, vr = v;
  VecF pf = to_f(p), mf(n, 0.0f), vf(n, 0.0f);
  for (int step = 1; step <= 3; ++step) {
    Vec g = randn(n, 91 + step);
    const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    adamw_update(p.data(), g.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, bc1, bc2);
    for (size_t i = 0; i < n; ++i) {
      mr[i] = b1 * mr[i] + (1 - b1) * g[i];
      vr[i] = b2 * vr[i] + (1 - b2) * g[i] * g[i];
      const double upd = (mr[i] / bc1) / (std::sqrt(vr[i] / bc2) + eps);
      pr[i] -= lr * (upd + wd * pr[i]);
    }
    VecF gf = to_f(g);
    adamw_update(pf.data(), gf.data(), mf.data(), vf.data(), n, float(lr), float(b1), float(b2),
                 float(eps), float(wd), float(bc1), float(bc2));
  }
  EXPECT_LT(rel_err(m, mr), 1e-13);
  EXPECT_LT(rel_err(v, vr), 1e-13);
  EXPECT_LT(rel_err(p, pr), 1e-13);
  EXPECT_LT(rel_err(to_d(pf), pr), 1e-6);
  // The update moved the parameters (so the comparison above is not of two untouched copies).
  EXPECT_GT(rel_err(p, randn(n, 90)), 1e-4);
}
