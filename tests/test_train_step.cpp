// train_step without host waits inside a step: the micro-batches' loss sums stay in backend memory
// (Transformer::forward_backward_async / take_loss_sums), the MoE balancing bias is computed there
// (update_balance), the clip factor too; the host reads results only after the optimizer update is
// enqueued. Held to: (1) bitwise the synchronous composition it replaced, (2) on a backend that
// records the order of ops and waits, no wait before the step's last kernel.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/forwarding_backend.h"
#include "core/error.h"
#include "model/transformer.h"
#include "model_test_configs.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "train/trainer.h"

namespace ladder {
namespace {

using test::make_batch;
using test::moe_switches_config;

Config step_config(const char* optim) {
  Config c = moe_switches_config();  // quantile balancing, router z-loss, PKO, every switch
  c.run.grad_accum = 3;
  c.run.steps = 10;
  c.optim.name = optim;
  c.optim.clip = 0.05;  // below the tiny model's gradient norm: every step clips (checked below)
  return c;
}

BatchFn batches(const Config& c, uint64_t& seed) {
  return [&c, &seed](int32_t* x, int32_t* y) {
    std::vector<int32_t> in, tg;
    make_batch(c, seed++, in, tg);
    std::copy(in.begin(), in.end(), x);
    std::copy(tg.begin(), tg.end(), y);
  };
}

void expect_bitwise_same(const std::vector<Param>& a, const std::vector<Param>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(std::memcmp(a[i].w, b[i].w, a[i].numel * sizeof(float)), 0) << what << " " << a[i].name;
}

// Two models from the same init on one CPU backend, each with its optimizer, and host batch buffers.
struct Twins {
  std::unique_ptr<Backend> be;
  Transformer a, b;
  std::unique_ptr<Optimizer> oa, ob;
  std::vector<int32_t> in, tg;
  explicit Twins(const Config& c)
      : be(make_cpu_backend(0)),
        a(c.model, c.run.batch_size, *be),
        b(c.model, c.run.batch_size, *be),
        in(size_t(c.run.batch_size) * c.model.seq_len),
        tg(in.size()) {
    a.init(11);
    b.init(11);
    oa = make_optimizer(c, a, *be);
    ob = make_optimizer(c, b, *be);
  }
};

// The step as it was before: one synchronous forward_backward per micro-batch, beta through the
// host and back, the statistics read before the optimizer, the clip on the host (the norm
// downloaded, every gradient scaled in memory) and an optimizer step without a factor.
StepStats synchronous_step(const Config& cfg, int64_t step, Transformer& model, Optimizer& opt,
                           const BatchFn& next, int32_t* in, int32_t* tg) {
  const int N = model.batch() * cfg.model.seq_len, accum = cfg.run.grad_accum;
  model.zero_grad();
  const float grad_scale = 1.0f / float(int64_t(N) * accum);
  StepStats st;
  double xent = 0, lse_sq = 0, router_z = 0;
  int64_t ntok = 0;
  for (int micro = 0; micro < accum; ++micro) {
    next(in, tg);
    const LossSums s = model.forward_backward(in, tg, grad_scale);
    xent += s.xent, lse_sq += s.lse_sq, router_z += s.router_z, ntok += s.tokens;
  }
  model.apply_balance(model.balance_beta());
  st.moe = model.take_moe_stats();
  st.grad_norm = model.grad_norm();
  if (cfg.optim.clip > 0 && st.grad_norm > cfg.optim.clip)
    scale_grads(model, model.backend(), float(cfg.optim.clip / (st.grad_norm + 1e-6)));
  st.lr = cfg.optim.lr * lr_multiplier(cfg.schedule, step, cfg.run.steps);
  opt.step(st.lr);
  st.loss = xent / double(ntok), st.lse_sq = lse_sq / double(ntok), st.router_z = router_z / double(ntok);
  st.tokens = ntok;
  return st;
}

TEST(TrainStep, IsBitwiseTheSynchronousStepItReplaced) {
  for (const char* optim : {"adamw", "muonh"}) {
    SCOPED_TRACE(optim);
    const Config c = step_config(optim);
    validate(c);
    Twins t(c);
    auto& [be, a, b, oa, ob, in, tg] = t;
    uint64_t sa = 40, sb = 40;
    for (int step = 0; step < 3; ++step) {
      const StepStats x = train_step(c, step, a, *oa, *be, batches(c, sa), in.data(), tg.data());
      const StepStats y = synchronous_step(c, step, b, *ob, batches(c, sb), in.data(), tg.data());
      EXPECT_EQ(x.loss, y.loss) << "step " << step;
      EXPECT_EQ(x.lse_sq, y.lse_sq) << "step " << step;
      EXPECT_EQ(x.router_z, y.router_z) << "step " << step;
      EXPECT_GT(x.router_z, 0) << "step " << step;
      EXPECT_EQ(x.grad_norm, y.grad_norm) << "step " << step;
      EXPECT_GT(x.grad_norm, c.optim.clip) << "step " << step << ": the step did not clip";
      EXPECT_EQ(x.tokens, y.tokens);
      ASSERT_EQ(x.moe.size(), y.moe.size());
      ASSERT_EQ(x.moe.size(), 2u);
      for (size_t i = 0; i < x.moe.size(); ++i) {
        EXPECT_EQ(x.moe[i].load_min, y.moe[i].load_min);
        EXPECT_EQ(x.moe[i].load_max, y.moe[i].load_max);
        EXPECT_EQ(x.moe[i].lse_sq, y.moe[i].lse_sq);
        EXPECT_GT(x.moe[i].lse_sq, 0);
      }
    }
    expect_bitwise_same(a.params(), b.params(), "weight");
    expect_bitwise_same(a.buffers(), b.buffers(), "balancing bias");
    // The bias moved off zero: balancing ran (and so was compared above).
    const auto bias = a.download(a.buffers().at(0));
    EXPECT_TRUE(std::any_of(bias.begin(), bias.end(), [](float v) { return v != 0.f; }));
  }
}

// Records every op in order; the calls that make the host wait for a device backend (downloads,
// ops returning a value, synchronize) as "WAIT ...". Uploads are recorded with their size: a
// CudaBackend stages those up to 1 MiB through pinned memory without waiting for the stream.
class StepRecorder final : public ForwardingBackend {
 public:
  StepRecorder() : ForwardingBackend(make_cpu_backend(0)) {}
  std::vector<std::string> log;
  size_t largest_upload = 0;

 protected:
  void around(const char* op, double, const std::function<void()>& f) override {
    log.emplace_back(op);
    f();
  }

 public:
  void synchronize() override { log.emplace_back("WAIT synchronize"), inner().synchronize(); }
  void upload(void* d, const void* s, size_t n) override {
    largest_upload = std::max(largest_upload, n);
    log.emplace_back("upload"), inner().upload(d, s, n);
  }
  void download(void* d, const void* s, size_t n) override { log.emplace_back("WAIT download"), inner().download(d, s, n); }
  void zero(void* p, size_t n) override { log.emplace_back("zero"), inner().zero(p, n); }
  double sum_squares(const float* x, size_t n) override {
    return log.emplace_back("WAIT sum_squares"), inner().sum_squares(x, n);
  }
  double adam_moments(float* m, float* v, const float* g, size_t n, float b1, float b2, float bc1, float bc2,
                      float eps) override {
    return log.emplace_back("WAIT adam_moments"), inner().adam_moments(m, v, g, n, b1, b2, bc1, bc2, eps);
  }
  double adam_apply(float* w, const float* m, const float* v, size_t n, float bc1, float bc2, float eps,
                    float alpha) override {
    return log.emplace_back("WAIT adam_apply"), inner().adam_apply(w, m, v, n, bc1, bc2, eps, alpha);
  }
  double axpy_sumsq(float* w, const float* x, size_t n, float alpha) override {
    return log.emplace_back("WAIT axpy_sumsq"), inner().axpy_sumsq(w, x, n, alpha);
  }
  XentSums softmax_xent(float* l, const int32_t* t, int N, int V, float z, float gs) override {
    return log.emplace_back("WAIT softmax_xent"), inner().softmax_xent(l, t, N, V, z, gs);
  }
  XentSums softmax_xent_forward(const float* l, const int32_t* t, int N, int V, float* losses) override {
    return log.emplace_back("WAIT softmax_xent_forward"), inner().softmax_xent_forward(l, t, N, V, losses);
  }
};

TEST(TrainStep, EnqueuesEveryOpBeforeItsFirstWait) {
  for (const char* optim : {"adamw", "adamh", "muonh"}) {
    SCOPED_TRACE(optim);
    const Config c = step_config(optim);
    StepRecorder be;
    Transformer model(c.model, c.run.batch_size, be);
    model.init(11);
    auto opt = make_optimizer(c, model, be);
    std::vector<int32_t> in(size_t(c.run.batch_size) * c.model.seq_len), tg(in.size());
    uint64_t seed = 1;
    // The first step sizes the scratch and takes the hyperball radii; the next ones are the rule.
    train_step(c, 0, model, *opt, be, batches(c, seed), in.data(), tg.data());
    for (int step = 1; step < 3; ++step) {
      be.log.clear();
      be.largest_upload = 0;
      train_step(c, step, model, *opt, be, batches(c, seed), in.data(), tg.data());
      const auto& log = be.log;
      const auto first_wait =
          std::find_if(log.begin(), log.end(), [](const std::string& s) { return s.rfind("WAIT", 0) == 0; });
      ASSERT_NE(first_wait, log.end());
      const auto before = size_t(first_wait - log.begin());
      // Every micro-batch's GEMMs, MoE routing and the optimizer precede the first wait ...
      EXPECT_GT(before, 100u);
      EXPECT_EQ(std::count(log.begin(), first_wait, std::string("moe routing")) > 0, true);
      EXPECT_EQ(std::count(log.begin(), log.end(), std::string("upload")), 2 * c.run.grad_accum);  // ids, targets
      EXPECT_LE(be.largest_upload, size_t(1) << 20);
      // ... and after it come only the step's three reads (grad norm, loss sums, MoE loads) and
      // the reset of the load counters.
      std::vector<std::string> tail(first_wait, log.end());
      EXPECT_EQ(tail, (std::vector<std::string>{"WAIT download", "WAIT download", "WAIT download", "zero"}))
          << "ops from the first wait on: " << tail.size();
    }
  }
}

// A micro-batch that throws (a token id outside the vocabulary) aborts the step; a caller that goes
// on gets a clean next step: bitwise the step of a model that never saw the aborted one (the
// aborted micro-batches changed no weight: gradients are zeroed per step, the optimizer never ran).
TEST(TrainStep, AnAbortedStepLeavesNothingBehind) {
  const Config c = step_config("adamw");
  Twins t(c);
  auto& [be, a, b, oa, ob, in, tg] = t;
  uint64_t seed = 5;
  int calls = 0;
  const BatchFn bad = [&](int32_t* x, int32_t* y) {
    batches(c, seed)(x, y);
    if (++calls == 3) x[7] = c.model.vocab_size;  // the last micro-batch
  };
  EXPECT_THROW(train_step(c, 0, a, *oa, *be, bad, in.data(), tg.data()), Error);
  uint64_t sa = 60, sb = 60;
  const StepStats x = train_step(c, 0, a, *oa, *be, batches(c, sa), in.data(), tg.data());
  const StepStats y = train_step(c, 0, b, *ob, *be, batches(c, sb), in.data(), tg.data());
  EXPECT_EQ(x.tokens, y.tokens);
  EXPECT_EQ(x.loss, y.loss);
  EXPECT_EQ(x.grad_norm, y.grad_norm);
  expect_bitwise_same(a.params(), b.params(), "weight");
  expect_bitwise_same(a.buffers(), b.buffers(), "balancing bias");
  // The step's MoE statistics are its own: the aborted micro-batches' expert loads and tokens are
  // not added to the next step's (they were, before discard_step reset them).
  EXPECT_EQ(x.router_z, y.router_z);
  EXPECT_EQ(x.lse_sq, y.lse_sq);
  ASSERT_EQ(x.moe.size(), y.moe.size());
  ASSERT_FALSE(x.moe.empty());
  for (size_t i = 0; i < x.moe.size(); ++i) {
    EXPECT_EQ(x.moe[i].load_min, y.moe[i].load_min) << "MoE layer " << i;
    EXPECT_EQ(x.moe[i].load_max, y.moe[i].load_max) << "MoE layer " << i;
    EXPECT_EQ(x.moe[i].load_mean, y.moe[i].load_mean) << "MoE layer " << i;
    EXPECT_EQ(x.moe[i].dropped_frac, y.moe[i].dropped_frac) << "MoE layer " << i;
    EXPECT_EQ(x.moe[i].lse_sq, y.moe[i].lse_sq) << "MoE layer " << i;
  }
}

TEST(TrainStep, SynchronousCallsRefuseWhileMicroBatchesArePending) {
  const Config c = step_config("adamw");
  auto be = make_cpu_backend(0);
  Transformer model(c.model, c.run.batch_size, *be);
  model.init(1);
  std::vector<int32_t> in, tg;
  make_batch(c, 1, in, tg);
  model.forward_backward_async(in.data(), tg.data(), 1.f);
  model.forward_backward_async(in.data(), tg.data(), 1.f);  // grows the slots (unplanned), keeps the first
  EXPECT_THROW(model.forward_loss(in.data(), tg.data()), Error);
  EXPECT_THROW(model.forward_backward(in.data(), tg.data(), 1.f), Error);
  const auto sums = model.take_loss_sums();
  ASSERT_EQ(sums.size(), 2u);
  EXPECT_EQ(sums[0].xent, sums[1].xent);  // the same batch twice, the same weights
  EXPECT_GT(sums[0].xent, 0);
  EXPECT_TRUE(model.take_loss_sums().empty());
  const LossSums once = model.forward_loss(in.data(), tg.data());
  EXPECT_EQ(once.xent, sums[0].xent);
}

}  // namespace
}  // namespace ladder
