// Two configurations trained side by side (tests of options that change numerics).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "backend/backend.h"
#include "model/transformer.h"
#include "model_test_configs.h"
#include "optim/optimizer.h"
#include "train/trainer.h"

namespace ladder::test {

// Two configurations trained side by side on the CPU from the same init and batches, on a
// learnable task (the target is a fixed function of the input token): the loss of each step of
// both runs. What the options that change numerics (bf16 storage, bf16 MLP) are held to.
struct LossCurves {
  std::vector<double> a, b;  // per step
  double worst_rel() const {
    double w = 0;
    for (size_t t = 0; t < a.size(); ++t) w = std::max(w, std::fabs(b[t] - a[t]) / a[t]);
    return w;
  }
};
inline LossCurves train_side_by_side(const Config& ca, const Config& cb, int steps) {
  auto be = make_cpu_backend(0);
  Transformer a(ca.model, ca.run.batch_size, *be), b(cb.model, cb.run.batch_size, *be);
  a.init(5);
  b.init(5);
  auto oa = make_optimizer(ca, a, *be), ob = make_optimizer(cb, b, *be);
  std::vector<int32_t> in(size_t(ca.run.batch_size) * ca.model.seq_len), tg(in.size());
  LossCurves out;
  for (int t = 0; t < steps; ++t) {
    auto run = [&](const Config& cc, Transformer& m, Optimizer& o) {
      uint64_t seed = 100 + uint64_t(t) * 7;
      return train_step(cc, t, m, o, *be,
                        [&](int32_t* x, int32_t* y) {
                          std::vector<int32_t> bi, bt;
                          make_batch(cc, seed++, bi, bt);
                          for (size_t i = 0; i < bi.size(); ++i) bt[i] = int32_t((bi[i] * 7 + 3) % cc.model.vocab_size);
                          std::copy(bi.begin(), bi.end(), x);
                          std::copy(bt.begin(), bt.end(), y);
                        },
                        in.data(), tg.data());
    };
    out.a.push_back(run(ca, a, *oa).loss);
    out.b.push_back(run(cb, b, *ob).loss);
  }
  return out;
}

// The options' training test: twenty AdamW steps at lr 1e-2 of `c` (a) against `c` with `option`
// applied (b), both validated; fails the test when the reference run did not learn (the
// comparison would be empty).
inline LossCurves twenty_adamw_steps(Config c, const std::function<void(Config&)>& option) {
  c.optim.name = "adamw";
  c.optim.lr = 1e-2;
  c.run.steps = 20;
  Config h = c;
  option(h);
  validate(c);
  validate(h);
  LossCurves lc = train_side_by_side(c, h, c.run.steps);
  EXPECT_LT(lc.a.back(), lc.a.front() - 0.5) << "the reference run did not learn: the comparison would be empty";
  return lc;
}

}  // namespace ladder::test
