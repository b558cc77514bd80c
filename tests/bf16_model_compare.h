// What the bf16 activation options' tests share (tests/test_mlp_bf16.cpp, test_moe_bf16.cpp,
// test_attn_bf16.cpp): random inputs and bf16 round trips (bf16_vectors.h), and one config compared
// against another on the CPU: losses of two micro-batches, every gradient's relative error, and the
// activation bytes each plans.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernels.h"
#include "bf16_vectors.h"
#include "model/transformer.h"
#include "model_test_configs.h"

namespace ladder::test {

inline std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> x(n);
  for (auto& v : x) v = d(rng);
  return x;
}

inline double rel(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double e = double(a[i]) - double(b[i]);
    num += e * e;
    den += double(b[i]) * double(b[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline const char* tag_of(const Config& c) { return c.model.moe() ? "moe" : c.model.pko ? "switches" : "dense"; }

struct Compared {
  double loss_rel = 0, worst_grad = 0;
  size_t grads_differ = 0;
  bool loss_equal = false;
};

// One config against another, same weights and two micro-batches (gradients accumulate): the
// loss of each, every gradient's relative error (each asserted under grad_tol).
inline Compared compare(const Config& ref, const Config& test, double grad_tol) {
  validate(ref);
  validate(test);
  auto be = make_cpu_backend(0);
  Transformer a(ref.model, ref.run.batch_size, *be), b(test.model, test.run.batch_size, *be);
  a.init(9);
  b.init(9);
  Compared r;
  r.loss_equal = true;
  for (int mb = 0; mb < 2; ++mb) {
    std::vector<int32_t> in, tg;
    make_batch(ref, 40 + mb, in, tg);
    const LossSums la = a.forward_backward(in.data(), tg.data(), 1e-3f);
    const LossSums lb = b.forward_backward(in.data(), tg.data(), 1e-3f);
    r.loss_rel = std::max(r.loss_rel, std::fabs(lb.xent - la.xent) / la.xent);
    r.loss_equal = r.loss_equal && la.xent == lb.xent && la.lse_sq == lb.lse_sq;
  }
  for (size_t i = 0; i < a.params().size(); ++i) {
    const Param& pa = a.params()[i];
    const double e = rel(b.params()[i].g, pa.g, pa.numel);
    r.worst_grad = std::max(r.worst_grad, e);
    r.grads_differ += std::memcmp(b.params()[i].g, pa.g, pa.numel * sizeof(float)) != 0;
    EXPECT_LT(e, grad_tol) << tag_of(ref) << " " << pa.name;
    if (getenv("SHOW")) std::printf("%s %.3e\n", pa.name.c_str(), e);
  }
  return r;
}

inline size_t activation_bytes(const Config& c) {
  validate(c);
  auto be = make_cpu_backend(1);
  Transformer m(c.model, c.run.batch_size, *be);
  return m.activation_bytes();
}

// Recomputation (model.recompute) re-runs each layer's forward, bf16 options included: bit for bit
// the same losses and gradients as `c` without it, and fewer activation bytes.
inline void expect_recompute_bit_exact(const Config& c, const std::string& tag) {
  Config r = c;
  r.model.recompute = true;
  const Compared cr = compare(c, r, 1e-30);
  EXPECT_TRUE(cr.loss_equal) << tag;
  EXPECT_EQ(cr.grads_differ, size_t(0)) << tag;
  EXPECT_LT(activation_bytes(r), activation_bytes(c)) << tag;
}

// A bf16 activation option against fp32: `h` (c with the option on) is close to c (loss within
// 1e-2 relative, every gradient under grad_tol), is not c (the forward changed and some gradient
// differs: the option is in effect), and plans exactly `saving` activation bytes less. One line
// printed under `label`.
inline Compared expect_close_not_equal(const Config& c, const Config& h, double grad_tol, size_t saving,
                                       const std::string& label, const std::string& tag) {
  const Compared r = compare(c, h, grad_tol);
  EXPECT_LT(r.loss_rel, 1e-2) << tag;
  EXPECT_FALSE(r.loss_equal) << tag << ": the forward did not change: is the option in effect?";
  EXPECT_GT(r.grads_differ, size_t(0)) << tag;
  const size_t fa = activation_bytes(c), fb = activation_bytes(h);
  EXPECT_EQ(fa - fb, saving) << tag;
  std::printf("[ %s ] %s: loss rel %.2e, worst gradient rel err %.2e, activations %.1f%% of fp32\n", label.c_str(),
              tag.c_str(), r.loss_rel, r.worst_grad, 100.0 * double(fb) / double(fa));
  return r;
}

// validate(c) must refuse c with an error that names `field` (the config key the user must change).
inline void expect_refused_naming(const Config& c, const std::string& field) {
  try {
    validate(c);
    ADD_FAILURE() << field << ": the config was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
}

}  // namespace ladder::test
