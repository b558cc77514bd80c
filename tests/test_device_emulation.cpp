// The model, optimizers, train_step, checkpoints and forward_logits on a backend whose memory the
// host cannot touch (tests/guarded_backend.h: the CPU kernels behind PROT_NONE pages). What this
// proves without a GPU: no code above the backend dereferences a backend pointer (such a read or
// write faults and the test dies with a backtrace naming the line), every transfer goes through
// upload / download / copy, and the results are bit-identical to the plain CPU backend's, step
// after step, for dense, MoE (balancing, router z-loss) and every attention switch, with AdamW and
// MuonH. The same code then runs on CUDA device memory (tests/cuda/test_cuda_model.cpp).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "guarded_backend.h"
#include "model/transformer.h"
#include "model_test_configs.h"
#include "optim/optimizer.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace ladder {
namespace {

using namespace test;  // model_test_configs.h
using testing_support::GuardedBackend;

bool same_bits(const std::vector<float>& a, const float* b) {
  return std::memcmp(a.data(), b, a.size() * sizeof(float)) == 0;
}

// Every parameter and buffer of `g` (on the guarded backend) equals `c`'s (host memory) bit for bit.
void expect_same_state(const Transformer& g, const Transformer& c, const std::string& when) {
  ASSERT_EQ(g.params().size(), c.params().size());
  for (size_t i = 0; i < c.params().size(); ++i)
    EXPECT_TRUE(same_bits(g.download(g.params()[i]), c.params()[i].w)) << when << ": " << c.params()[i].name;
  for (size_t i = 0; i < c.buffers().size(); ++i)
    EXPECT_TRUE(same_bits(g.download(g.buffers()[i]), c.buffers()[i].w)) << when << ": " << c.buffers()[i].name;
}

struct Run {
  std::vector<std::vector<int32_t>> ins, tgs;
  std::vector<int32_t> in, tg;
  StepStats step(const Config& c, int t, Transformer& m, Optimizer& o, Backend& be) {
    size_t b = size_t(t) * c.run.grad_accum;
    return train_step(c, t, m, o, be,
                      [&](int32_t* a, int32_t* y) {
                        std::copy(ins[b].begin(), ins[b].end(), a);
                        std::copy(tgs[b].begin(), tgs[b].end(), y);
                        ++b;
                      },
                      in.data(), tg.data());
  }
};

void train_and_compare(Config c, const std::string& optim) {
  c.optim.name = optim;
  const int steps = 4;
  c.run.steps = steps + 2;
  validate(c);
  Run r;
  r.ins.resize(size_t(c.run.steps) * c.run.grad_accum);
  r.tgs.resize(r.ins.size());
  for (size_t b = 0; b < r.ins.size(); ++b) make_batch(c, 100 + b, r.ins[b], r.tgs[b]);
  r.in.resize(r.ins[0].size());
  r.tg.resize(r.in.size());

  auto cpu = make_cpu_backend(0);
  GuardedBackend guarded;
  Transformer mc(c.model, c.run.batch_size, *cpu), mg(c.model, c.run.batch_size, guarded);
  mc.init(5);
  mg.init(5);
  expect_same_state(mg, mc, "init");
  auto oc = make_optimizer(c, mc, *cpu), og = make_optimizer(c, mg, guarded);
  for (int t = 0; t < steps; ++t) {
    const StepStats sc = r.step(c, t, mc, *oc, *cpu), sg = r.step(c, t, mg, *og, guarded);
    EXPECT_EQ(sg.loss, sc.loss) << optim << " step " << t;
    EXPECT_EQ(sg.lse_sq, sc.lse_sq) << optim << " step " << t;
    EXPECT_EQ(sg.grad_norm, sc.grad_norm) << optim << " step " << t;
    EXPECT_EQ(sg.router_z, sc.router_z) << optim << " step " << t;
    ASSERT_EQ(sg.moe.size(), sc.moe.size());
    for (size_t l = 0; l < sc.moe.size(); ++l) {
      EXPECT_EQ(sg.moe[l].load_min, sc.moe[l].load_min);
      EXPECT_EQ(sg.moe[l].load_max, sc.moe[l].load_max);
      EXPECT_EQ(sg.moe[l].lse_sq, sc.moe[l].lse_sq);
    }
  }
  expect_same_state(mg, mc, optim + " after training");
  EXPECT_GT(guarded.ops(), 100) << "the model did not run through the guarded backend";

  // Evaluation and logits (host output) through the guarded memory.
  const LossSums ec = mc.forward_loss(r.ins[0].data(), r.tgs[0].data());
  const LossSums eg = mg.forward_loss(r.ins[0].data(), r.tgs[0].data());
  EXPECT_EQ(eg.xent, ec.xent);
  std::vector<float> lc(r.in.size() * size_t(c.model.vocab_size)), lg(lc.size());
  mc.forward_logits(r.ins[1].data(), lc.data());
  mg.forward_logits(r.ins[1].data(), lg.data());
  EXPECT_EQ(0, std::memcmp(lc.data(), lg.data(), lc.size() * sizeof(float))) << "forward_logits";

  // A checkpoint written from guarded memory and read back into a fresh guarded model and
  // optimizer continues exactly like the uninterrupted CPU run.
  test::TempDir dir("device-emulation");
  CheckpointState st;
  st.step = steps;
  st.config = nlohmann::json::object();
  const auto ck = save_checkpoint(dir.path, st, mg, *og, {}, 1);
  GuardedBackend guarded2;
  Transformer mr(c.model, c.run.batch_size, guarded2);
  auto orr = make_optimizer(c, mr, guarded2);
  load_checkpoint_weights(ck, mr, orr.get());
  expect_same_state(mr, mc, optim + " after reload");
  for (int t = steps; t < c.run.steps; ++t) {
    const StepStats sc = r.step(c, t, mc, *oc, *cpu), sr = r.step(c, t, mr, *orr, guarded2);
    EXPECT_EQ(sr.loss, sc.loss) << optim << " resumed step " << t;
    EXPECT_EQ(sr.grad_norm, sc.grad_norm) << optim << " resumed step " << t;
  }
  expect_same_state(mr, mc, optim + " after resumed steps");
}

TEST(DeviceEmulation, DenseAdamwIsBitIdenticalWithoutHostAccess) { train_and_compare(dense_config(), "adamw"); }
TEST(DeviceEmulation, MoeAdamwIsBitIdenticalWithoutHostAccess) { train_and_compare(moe_config(), "adamw"); }
TEST(DeviceEmulation, SwitchesMuonhIsBitIdenticalWithoutHostAccess) { train_and_compare(switches_config(), "muonh"); }
TEST(DeviceEmulation, MoeMuonhIsBitIdenticalWithoutHostAccess) { train_and_compare(moe_config(), "muonh"); }

TEST(DeviceEmulation, RecomputeMoeSwitchesIsBitIdenticalWithoutHostAccess) {
  Config c = moe_switches_config();
  c.model.recompute = true;
  train_and_compare(c, "adamw");
}

// bf16 saved activations: packing and restoring through backend ops only, bit-identical.
TEST(DeviceEmulation, SavedBf16MoeSwitchesIsBitIdenticalWithoutHostAccess) {
  Config c = moe_switches_config();
  c.model.saved_activations = "bf16";
  train_and_compare(c, "adamw");
}

// bf16 dense MLP (model.mlp_bf16): typed GEMMs and the bf16 SwiGLU through backend ops only, on the
// MoE model's dense layer next to bf16 saved activations (the MLP tensors are not packed again).
TEST(DeviceEmulation, MlpBf16MoeSwitchesIsBitIdenticalWithoutHostAccess) {
  Config c = moe_switches_config();
  c.model.mlp_bf16 = true;
  c.model.saved_activations = "bf16";
  train_and_compare(c, "adamw");
}
// The attention block and the norms' outputs in bf16 (model.attn_bf16, norm_bf16) with every switch
// and the other bf16 options, through backend ops only: typed GEMMs, the bf16 norm, qk-prep,
// attention, XSA and gate ops.
TEST(DeviceEmulation, AttnBf16MoeSwitchesIsBitIdenticalWithoutHostAccess) {
  Config c = moe_switches_config();
  c.model.attn_bf16 = c.model.norm_bf16 = c.model.mlp_bf16 = c.model.moe_bf16 = true;
  c.model.saved_activations = "bf16";
  train_and_compare(c, "muonh");
}
// The routed experts' activation gradients in bf16 too (model.moe_bf16_grads): the bf16-gradient
// combine backward and SwiGLU backward, and grouped GEMMs reading and writing bf16 gradients,
// through backend ops only.
TEST(DeviceEmulation, MoeBf16GradsMoeSwitchesIsBitIdenticalWithoutHostAccess) {
  Config c = moe_switches_config();
  c.model.moe_bf16 = c.model.moe_bf16_grads = true;
  train_and_compare(c, "adamw");
}
// The capacity layout (model.moe_capacity 0.5: overflow rows in every step) with bf16 experts and
// gradients: the row maps, zero padding and batched GEMMs through backend ops only.
TEST(DeviceEmulation, MoeCapacityBf16IsBitIdenticalWithoutHostAccess) {
  Config c = moe_switches_config();
  c.model.moe_capacity = 0.5;
  c.model.moe_bf16 = c.model.moe_bf16_grads = true;
  train_and_compare(c, "adamw");
}
TEST(DeviceEmulation, MlpBf16DenseMuonhIsBitIdenticalWithoutHostAccess) {
  Config c = dense_config();
  c.model.mlp_bf16 = true;
  train_and_compare(c, "muonh");
}
// The dense MLP's activation gradients in bf16 too (model.mlp_bf16_grads): the bf16-output GEMM,
// SwiGLU backward with bf16 gradients and GEMMs reading them as bf16, through backend ops only.
TEST(DeviceEmulation, MlpBf16GradsDenseIsBitIdenticalWithoutHostAccess) {
  Config c = dense_config();
  c.model.mlp_bf16 = c.model.mlp_bf16_grads = true;
  train_and_compare(c, "adamw");
}
// ... and on the widest model with bf16 saved activations: the gate and up weight gradients then
// read bf16 gradients against the dense layer's packed bf16 h2.
TEST(DeviceEmulation, MlpBf16GradsMoeSwitchesIsBitIdenticalWithoutHostAccess) {
  Config c = moe_switches_config();
  c.model.mlp_bf16 = c.model.mlp_bf16_grads = true;
  c.model.saved_activations = "bf16";
  train_and_compare(c, "adamw");
}

// Activation recomputation changes memory, never results: losses and every gradient bit for bit,
// for dense, MoE (mixed with a dense layer) and every switch, over two micro-batches.
TEST(Recompute, SameGradientsBitForBitWithLessActivationMemory) {
  for (Config c : {dense_config(), moe_config(), switches_config()}) {
    c.model.n_layers = 4;
    Config r = c;
    r.model.recompute = true;
    validate(c);
    validate(r);
    auto be = make_cpu_backend(0);
    Transformer a(c.model, c.run.batch_size, *be), b(r.model, r.run.batch_size, *be);
    a.init(9);
    b.init(9);
    EXPECT_LT(double(b.activation_bytes()), 0.7 * double(a.activation_bytes())) << c.model.moe_layers;
    for (int mb = 0; mb < 2; ++mb) {
      std::vector<int32_t> in, tg;
      make_batch(c, 40 + mb, in, tg);
      const LossSums la = a.forward_backward(in.data(), tg.data(), 1e-3f);
      const LossSums lb = b.forward_backward(in.data(), tg.data(), 1e-3f);
      EXPECT_EQ(la.xent, lb.xent);
      EXPECT_EQ(la.router_z, lb.router_z);
    }
    for (size_t i = 0; i < a.params().size(); ++i)
      EXPECT_EQ(0, std::memcmp(a.params()[i].g, b.params()[i].g, a.params()[i].numel * sizeof(float)))
          << a.params()[i].name;
    const auto sa = a.take_moe_stats(), sb = b.take_moe_stats();  // statistics recorded once, not twice
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t l = 0; l < sa.size(); ++l) EXPECT_EQ(sa[l].load_mean, sb[l].load_mean);
    EXPECT_EQ(a.balance_beta(), b.balance_beta());
  }
}

// The guard itself: a host read of backend memory outside an op dies with the message.
TEST(DeviceEmulationDeathTest, HostReadOfBackendMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        GuardedBackend g;
        auto* p = static_cast<volatile float*>(g.mem_alloc(64, "probe"));
        (void)p[3];
      },
      "host code touched backend");
}

}  // namespace
}  // namespace ladder
