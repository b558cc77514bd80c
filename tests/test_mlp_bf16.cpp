// model.mlp_bf16: the dense MLP's gate, up and SwiGLU output are written and kept in bf16. What must
// hold:
// - the backend ops behind it (Backend::gemm_ex with bf16 operands / output, swiglu_*_bf16) are, on
//   the CPU reference, exactly "widen the bf16 inputs, run the fp32 kernel, round the bf16 output";
// - the model with it stays close to the fp32 model (loss, every gradient, a short training run)
//   but is not the fp32 model (the option is in effect), and keeps fewer activation bytes;
// - it composes with bf16 saved activations (its tensors are not packed twice) and with
//   recomputation (which stays exact);
// - model.mlp_bf16_grads (the MLP's activation gradients in bf16 too) keeps the forward bit for bit
//   and the gradients within bf16 rounding of mlp_bf16's, with every form of h2 the weight
//   gradients read, and recomputation stays exact.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernels.h"
#include "model/transformer.h"
#include "bf16_model_compare.h"
#include "model_test_configs.h"
#include "train_side_by_side.h"
#include "optim/optimizer.h"
#include "train/trainer.h"

namespace ladder {
namespace {

using namespace test;  // model_test_configs.h

// gemm_ex on the CPU backend against the composition by hand, bitwise: every mix of fp32 / bf16
// A, B and D, both transposes, leading dimensions wider than the rows, and the fp32 addend forms
// (C_in separate, C_in nullptr = D's own values, beta 0).
TEST(MlpBf16Ops, GemmExIsWidenSgemmRound) {
  auto be = make_cpu_backend(0);
  const int M = 37, N = 29, K = 45, pad = 3;
  for (int mask = 0; mask < 8; ++mask)
    for (int t = 0; t < 4; ++t)
      for (int addend = 0; addend < 3; ++addend) {
        const bool a16 = mask & 1, b16 = mask & 2, d16 = mask & 4, ta = t & 1, tb = t & 2;
        if (d16 && addend != 0) continue;  // a bf16 output takes no addend
        const int lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
        const size_t na = size_t(ta ? K : M) * lda, nb = size_t(tb ? N : K) * ldb, nc = size_t(M) * ldc;
        const auto A = random_floats(na, 1 + mask), B = random_floats(nb, 11 + t), C = random_floats(nc, 21);
        const auto A16 = to_b16(A), B16 = to_b16(B);
        const std::vector<float> Aw = widen(A16), Bw = widen(B16);
        // by hand
        const float beta = addend == 0 ? 0.f : 0.5f;
        std::vector<float> ref = addend == 0 ? std::vector<float>(nc, 0.f) : C;
        cpu::gemm<float>(ta, tb, M, N, K, 1.25f, a16 ? Aw.data() : A.data(), lda, b16 ? Bw.data() : B.data(), ldb,
                         beta, ref.data(), ldc);
        const std::string tag = fmt::format("a16 {} b16 {} d16 {} ta {} tb {} addend {}", a16, b16, d16, ta, tb, addend);
        const void* pa = a16 ? static_cast<const void*>(A16.data()) : A.data();
        const void* pb = b16 ? static_cast<const void*>(B16.data()) : B.data();
        if (d16) {
          std::vector<uint16_t> D(nc, 0xffff);  // poisoned: the padding columns must stay so
          be->gemm_ex(ta, tb, M, N, K, 1.25f, pa, a16, lda, pb, b16, ldb, 0.f, nullptr, D.data(), true, ldc);
          for (int i = 0; i < M; ++i) {
            std::vector<uint16_t> r(N);
            cpu::f32_to_bf16(r.data(), ref.data() + size_t(i) * ldc, size_t(N));
            for (int j = 0; j < N; ++j) ASSERT_EQ(D[size_t(i) * ldc + j], r[size_t(j)]) << tag << " at " << i << "," << j;
            for (int j = N; j < ldc; ++j) ASSERT_EQ(D[size_t(i) * ldc + j], 0xffff) << tag << " padding written";
          }
          continue;
        }
        std::vector<float> D = addend == 2 ? C : std::vector<float>(nc, -7.f);
        const float* cin = addend == 1 ? C.data() : nullptr;  // 2: D's own values are the addend
        be->gemm_ex(ta, tb, M, N, K, 1.25f, pa, a16, lda, pb, b16, ldb, beta, cin, D.data(), false, ldc);
        for (int i = 0; i < M; ++i)
          ASSERT_EQ(0, std::memcmp(D.data() + size_t(i) * ldc, ref.data() + size_t(i) * ldc, sizeof(float) * N))
              << tag << " row " << i;
      }
  // A bf16 output with an addend is refused, not silently dropped.
  std::vector<float> x(4, 1.f);
  std::vector<uint16_t> y(4);
  EXPECT_THROW(be->gemm_ex(false, false, 2, 2, 2, 1.f, x.data(), false, 2, x.data(), false, 2, 1.f, x.data(), y.data(),
                           true, 2),
               std::exception);
}

// SwiGLU on bf16 gate / up against widen -> the fp32 kernel -> round, bitwise, on a length that is
// neither a multiple of the CPU's chunk nor below its parallel threshold.
TEST(MlpBf16Ops, SwigluBf16IsWidenComputeRound) {
  auto be = make_cpu_backend(0);
  for (size_t n : {size_t(1), size_t(4095), size_t(70001)}) {
    const auto g16 = to_b16(random_floats(n, 3, 3.f)), u16 = to_b16(random_floats(n, 4, 2.f));
    const auto dh = random_floats(n, 5);
    const auto gw = widen(g16), uw = widen(u16);
    std::vector<float> h(n), dg(n), du(n);
    cpu::swiglu_forward<float>(h.data(), gw.data(), uw.data(), n);
    cpu::swiglu_backward<float>(dg.data(), du.data(), dh.data(), gw.data(), uw.data(), n);
    const auto h16 = to_b16(h);

    std::vector<uint16_t> H(n, 0xffff);
    std::vector<float> DG(n, NAN), DU(n, NAN);
    be->swiglu_forward_bf16(H.data(), g16.data(), u16.data(), n);
    be->swiglu_backward_bf16(DG.data(), DU.data(), dh.data(), g16.data(), u16.data(), n);
    EXPECT_EQ(H, h16) << n;
    EXPECT_EQ(0, std::memcmp(DG.data(), dg.data(), n * sizeof(float))) << n;
    EXPECT_EQ(0, std::memcmp(DU.data(), du.data(), n * sizeof(float))) << n;
  }
}

// bf16 keeps 8 significant bits (2^-9 = 2e-3 relative rounding per element); gate, up and act
// each rounded, through the layers and the backward's sums of products: a few times that per
// gradient (5e-2 leaves room for sums with cancellation, as for bf16 saved activations). A wrong
// layout or a misread bf16 buffer gives O(1).
TEST(MlpBf16, CloseToTheFp32ModelButNotIt) {
  for (Config c : {dense_config(), switches_config()}) {
    Config h = c;
    h.model.mlp_bf16 = true;
    // Three [N, d_ff] tensors per layer at half the bytes.
    const size_t N = size_t(c.run.batch_size) * c.model.seq_len, saved = 3 * N * c.model.ff() * 2 * c.model.n_layers;
    expect_close_not_equal(c, h, 5e-2, saved, "mlp bf16", tag_of(c));
  }
}

// With bf16 saved activations gate, up and act are already bf16: kept per layer as they are (not
// packed again); the rest is packed as before. Against mlp_bf16 alone the forward is unchanged
// (storage only) and the gradients are close. MoE config: its one dense layer, next to MoE layers.
TEST(MlpBf16, WithBf16SavedActivations) {
  for (Config c : {dense_config(), moe_config(), switches_config()}) {
    c.model.n_layers = 4;
    c.model.mlp_bf16 = true;
    Config s = c;
    s.model.saved_activations = "bf16";
    const Compared r = compare(c, s, 5e-2);
    EXPECT_TRUE(r.loss_equal) << tag_of(c) << ": bf16 storage must not change the forward";
    EXPECT_GT(r.grads_differ, size_t(0)) << tag_of(c);
    // Packing leaves the MLP tensors out: the packed model with and without mlp_bf16 differ by
    // exactly the shared fp32 set's three [N, d_ff] tensors (dense layers exist in all three).
    Config s32 = s;
    s32.model.mlp_bf16 = false;
    const size_t N = size_t(c.run.batch_size) * c.model.seq_len;
    EXPECT_EQ(activation_bytes(s32) - activation_bytes(s), 3 * N * c.model.ff() * 4) << tag_of(c);
    // ... and the bf16-saved model with mlp_bf16 is still close to the plain fp32 model.
    Config f = c;
    f.model.mlp_bf16 = false;
    compare(f, s, 5e-2);
  }
}

// Recomputation re-runs the bf16 layer: bit for bit the same losses and gradients, less memory.
TEST(MlpBf16, WithRecomputeBitForBit) {
  for (Config c : {dense_config(), moe_config()}) {
    c.model.n_layers = 4;
    c.model.mlp_bf16 = true;
    expect_recompute_bit_exact(c, tag_of(c));
  }
}

// A learnable task (the target a fixed function of the input token), twenty AdamW steps: the loss
// curve follows the fp32 run.
TEST(MlpBf16, TrainingFollowsTheFp32Run) {
  for (const Config& c : {dense_config(), switches_config()}) {
    const LossCurves lc = twenty_adamw_steps(c, [](Config& h) { h.model.mlp_bf16 = true; });
    EXPECT_LT(lc.worst_rel(), 1e-2) << tag_of(c) << ": loss curves apart";
    std::printf("[ mlp bf16 ] %s: 20 AdamW steps, worst loss rel diff %.2e\n", tag_of(c), lc.worst_rel());
  }
}

TEST(MlpBf16, ConfigRefusesAModelWithoutDenseLayers) {
  Config c = moe_config();
  c.model.mlp_bf16 = true;
  EXPECT_NO_THROW(validate(c));  // layer 1 is dense
  c.model.moe_layers = "all";
  expect_refused_naming(c, "model.mlp_bf16");
}

// model.mlp_bf16_grads: against model.mlp_bf16 with fp32 gradients, the same forward (the loss bit
// for bit) and gradients within bf16 rounding of it (1e-2 relative: d(act), d(gate) and d(up) each
// rounded once, 2^-9 each; a wrong layout or a misread buffer is O(1)) but not equal. Every way the
// gate and up weight gradients read h2: fp32, bf16 from the norm (model.norm_bf16), the packed bf16
// copy (saved_activations bf16); the MoE model's one dense layer too.
TEST(MlpBf16Grads, CloseToFp32GradientsWithTheSameForward) {
  for (Config c : {dense_config(), switches_config(), moe_config()}) {
    c.model.mlp_bf16 = true;
    for (const char* variant : {"plain", "norm-bf16", "saved-bf16"}) {
      Config b = c;
      if (std::strcmp(variant, "norm-bf16") == 0) b.model.norm_bf16 = true;
      if (std::strcmp(variant, "saved-bf16") == 0) b.model.saved_activations = "bf16";
      Config g = b;
      g.model.mlp_bf16_grads = true;
      const Compared r = compare(b, g, 1e-2);
      EXPECT_TRUE(r.loss_equal) << tag_of(c) << " " << variant << ": the option must not change the forward";
      EXPECT_GT(r.grads_differ, size_t(0)) << tag_of(c) << " " << variant << ": is the option in effect?";
      std::printf("[ mlp bf16 grads ] %s %s: worst gradient rel err %.2e against fp32 gradients\n", tag_of(c),
                  variant, r.worst_grad);
    }
  }
}

// Recomputation re-runs the forward only: with bf16 gradients still bit for bit.
TEST(MlpBf16Grads, WithRecomputeBitForBit) {
  for (Config c : {dense_config(), moe_config()}) {
    c.model.n_layers = 4;
    c.model.mlp_bf16 = c.model.mlp_bf16_grads = true;
    expect_recompute_bit_exact(c, std::string("mlp bf16 grads ") + tag_of(c));
  }
}

TEST(MlpBf16Grads, ConfigRefusesItWithoutMlpBf16OrDenseLayers) {
  Config c = dense_config();
  c.model.mlp_bf16_grads = true;
  expect_refused_naming(c, "model.mlp_bf16_grads");  // without model.mlp_bf16
  c.model.mlp_bf16 = true;
  EXPECT_NO_THROW(validate(c));
  Config m = moe_config();
  m.model.mlp_bf16_grads = true;
  m.model.moe_layers = "all";
  expect_refused_naming(m, "model.mlp_bf16_grads");  // no dense layer
}

}  // namespace
}  // namespace ladder
