// The optimizer ops that keep their scalars in backend memory (adamw_multi, adamh_multi,
// muonh_apply, axpy, grad_clip_factor + scale_by_device_factor) on the CPU backend, against the
// per-tensor / per-matrix host code the optimizer and the trainer ran before them. The CPU promise is
// BITWISE equality: the same kernels, the same double scalars, the same float casts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/backend.h"

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

TEST(OptimDeviceOps, AdamWMultiIsTheLoopOfAdamWUpdatesBitwise) {
  auto be = make_cpu_backend(0);
  std::mt19937 rng(11);
  Tensors a(rng, true);
  std::mt19937 rng2(11);
  Tensors b(rng2, true);
  const float lr[3] = {1e-3f, 3e-4f, 2e-2f}, wd[3] = {0.1f, 0.f, 0.01f};
  auto tab = b.table();
  for (int step = 1; step <= 3; ++step) {
    const float bc1 = float(1 - std::pow(0.9, step)), bc2 = float(1 - std::pow(0.95, step));
    for (auto& x : a.t)
      be->adamw_update(x.w.data(), x.g.data(), x.m.data(), x.v.data(), x.w.size(), lr[x.group], 0.9f, 0.95f, 1e-8f,
                       wd[x.group], bc1, bc2);
    be->adamw_multi(tab.data(), tab.size(), lr, wd, 3, 0.9f, 0.95f, 1e-8f, bc1, bc2);
  }
  expect_same(a, b);
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
      for (int64_t e = 0; e < x.nmat; ++e) {
        const size_t off = size_t(e) * mn;
        const double uu = be->adam_moments(x.m.data() + off, x.v.data() + off, x.g.data() + off, mn, float(b1),
                                           float(b2), float(bc1), float(bc2), float(eps));
        const double R = x.radius[size_t(e)];
        const double alpha = -lr[x.group] * R / std::max(std::sqrt(uu), 1e-10);
        const double ww = be->adam_apply(x.w.data() + off, x.m.data() + off, x.v.data() + off, mn, float(bc1),
                                         float(bc2), float(eps), float(alpha));
        be->scale_inplace(x.w.data() + off, float(R / std::sqrt(ww)), mn);
      }
    }
    be->adamh_multi(tab.data(), tab.size(), lr, 3, float(b1), float(b2), float(eps), float(bc1), float(bc2));
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

TEST(OptimDeviceOps, DeviceClipIsTheHostClipBitwise) {
  auto be = make_cpu_backend(0);
  std::mt19937 rng(14);
  std::vector<std::vector<float>> grads;
  for (size_t n : {size_t(17), size_t(4096), size_t(70000), size_t(3)}) grads.push_back(randv(rng, n));
  std::vector<double> sums;
  for (auto& g : grads) sums.push_back(be->sum_squares(g.data(), g.size()));
  double s = 0;
  for (double v : sums) s += v;
  const double norm = std::sqrt(s);
  // clip below the norm (scaled), above it (untouched), and off.
  for (double clip : {norm / 3, norm * 2, 0.0}) {
    double dnorm = -1;
    float factor = -1;
    be->grad_clip_factor(sums.data(), sums.size(), clip, &dnorm, &factor);
    EXPECT_EQ(std::memcmp(&dnorm, &norm, sizeof(double)), 0) << "clip " << clip;
    const bool clipped = clip > 0 && norm > clip;
    EXPECT_EQ(factor, clipped ? float(clip / (norm + 1e-6)) : 1.0f);
    for (auto& g : grads) {
      auto host = g, dev = g;
      if (clipped) be->scale_inplace(host.data(), float(clip / (norm + 1e-6)), host.size());
      be->scale_by_device_factor(dev.data(), &factor, dev.size());
      EXPECT_TRUE(bitwise_equal(host, dev)) << "clip " << clip;
    }
  }
}

}  // namespace
}  // namespace ladder
