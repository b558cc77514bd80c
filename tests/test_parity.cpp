// The whole model against the independent PyTorch implementation (tests/reference), on identical
// weights and batches: logits, loss, every parameter gradient, and the losses (and final weights)
// of 10 AdamW steps. Exchange goes through safetensors files.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <vector>

#include "backend/backend.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "model/transformer.h"
#include "optim/optimizer.h"
#include "train/bench.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "reference_harness.h"

namespace ladder {
namespace {

Config tiny_config(bool qk_norm, double z_loss, int window) {
  Config c;
  c.source = "parity";
  auto& m = c.model;
  m.vocab_size = 96;
  m.d_model = 32;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.head_dim = 8;
  m.d_ff = 64;
  m.seq_len = 16;
  m.rope_theta = 10000;
  m.qk_norm = qk_norm;
  m.z_loss = z_loss;
  m.window = window;
  m.init_std = 0.2;  // larger than the recipe's so that the logits are far from uniform
  c.run.batch_size = 3;
  c.run.steps = 10;
  c.optim.lr = 1e-2;
  c.optim.weight_decay = 0.1;
  c.optim.clip = 0.5;  // small enough to trigger, so clipping is compared too
  c.schedule.warmup = 3;
  c.schedule.final_lr_frac = 0.1;
  return c;
}

std::vector<int32_t> random_tokens(size_t n, int V, uint64_t seed) {
  Philox r(seed, stream_id("tokens"));
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = int32_t(r.u64(i) % uint64_t(V));
  return t;
}

struct ParityCase {
  bool qk_norm;
  double z_loss;
  int window;
};

class ModelParity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(ModelParity, LogitsLossAndEveryGradientMatchPyTorch) {
  const auto pc = GetParam();
  Config c = tiny_config(pc.qk_norm, pc.z_loss, pc.window);
  test::TempDir dir("parity");
  auto be = make_cpu_backend(0);
  Transformer model(c.model, c.run.batch_size, *be);
  model.init(7);
  const int B = c.run.batch_size, S = c.model.seq_len, V = c.model.vocab_size, N = B * S;
  auto inputs = random_tokens(N, V, 1), targets = random_tokens(N, V, 2);
  auto ref = test::reference_forward_backward(dir.path, c, model, inputs, targets);
  EXPECT_LT(test::logits_rel_err(model, inputs, ref), 2e-6);

  model.zero_grad();
  LossSums s = model.forward_backward(inputs.data(), targets.data(), 1.0f / float(N));
  const double loss = (s.xent + c.model.z_loss * s.lse_sq) / double(N);
  const double ref_loss = ref.get_f32("loss")[0];
  EXPECT_NEAR(loss, ref_loss, 1e-5 * std::fabs(ref_loss));
  for (auto& p : model.params()) {
    auto g = ref.get_f32("grad." + p.name);
    ASSERT_EQ(g.size(), p.numel) << p.name;
    // Every gradient must be non-trivial (else the comparison proves nothing) and match.
    double norm = std::sqrt(be->sum_squares(p.g, p.numel));
    EXPECT_GT(norm, 1e-8) << p.name;
    EXPECT_LT(test::rel_err(p.g, g.data(), p.numel), 5e-5) << p.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Switches, ModelParity,
                         ::testing::Values(ParityCase{true, 0.0, 0}, ParityCase{true, 1e-4, 0},
                                           ParityCase{false, 0.0, 0}, ParityCase{true, 1e-4, 5}));

// Ten AdamW steps (clipped, warmup and decay) against the reference: losses, grad norms and the
// final weights. With micro-batches (run.grad_accum > 1) the reference trains on each step's
// micro-batches as one batch: accumulation must give that batch's mean loss and gradient.
void ten_adamw_steps_match_pytorch(int accum) {
  Config c = tiny_config(true, 1e-4, 0);
  c.run.grad_accum = accum;
  test::TempDir dir("parity-train-" + std::to_string(accum));
  auto be = make_cpu_backend(0);
  Transformer model(c.model, c.run.batch_size, *be);
  model.init(11);
  auto opt = make_optimizer(c.optim, model, *be);
  const int B = c.run.batch_size, S = c.model.seq_len, V = c.model.vocab_size, N = B * S;
  const int steps = int(c.run.steps);
  auto inputs = random_tokens(size_t(N) * accum * steps, V, 3), targets = random_tokens(size_t(N) * accum * steps, V, 4);
  auto ref = test::reference_train(dir.path, c, model, inputs, targets, steps);
  std::vector<int32_t> in(N), tg(N);
  for (int t = 0; t < steps; ++t) {
    size_t micro = size_t(t) * accum;  // the next micro-batch of this step
    StepStats st = train_step(c, t, model, *opt, *be,
                              [&](int32_t* a, int32_t* b) {
                                std::copy_n(inputs.data() + micro * N, N, a);
                                std::copy_n(targets.data() + micro * N, N, b);
                                ++micro;
                              },
                              in.data(), tg.data());
    EXPECT_EQ(micro, size_t(t + 1) * accum) << "step " << t << " did not read its " << accum << " micro-batches";
    EXPECT_EQ(st.tokens, int64_t(N) * accum) << "step " << t;
    const double ref_loss = ref["losses"][t].get<double>();
    const double loss = st.loss + c.model.z_loss * st.lse_sq;
    EXPECT_NEAR(loss, ref_loss, 2e-5 * std::fabs(ref_loss)) << "step " << t;
    EXPECT_NEAR(st.grad_norm, ref["grad_norms"][t].get<double>(), 1e-4 * st.grad_norm) << "step " << t;
  }
  auto fin = SafeTensors::open(dir.path / "ref_final.safetensors");
  for (auto& p : model.params()) {
    auto w = fin.get_f32(p.name);
    EXPECT_LT(test::rel_err(p.w, w.data(), p.numel), 1e-4) << p.name;
  }
}

TEST(ModelParity, TenAdamWStepsMatchPyTorch) { ten_adamw_steps_match_pytorch(1); }
TEST(ModelParity, TenAdamWStepsOfThreeMicroBatchesMatchPyTorch) { ten_adamw_steps_match_pytorch(3); }

}  // namespace
}  // namespace ladder
