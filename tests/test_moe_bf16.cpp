// model.moe_bf16: the MoE experts' gate, up and SwiGLU output (routed and shared) are written and
// kept in bf16. What must hold:
// - the op behind it, Backend::grouped_gemm_ex, is on the CPU reference exactly "widen the bf16
//   operands, run the fp32 grouped GEMM, round the bf16 output", writes nothing past offsets[E],
//   and refuses what a bf16 output cannot take;
// - the model with it stays close to the fp32 model (loss, every gradient, a short training run)
//   but is not the fp32 model, and plans exactly the expected activation bytes less;
// - it composes with bf16 saved activations (its tensors are not packed twice) and with
//   recomputation (which stays exact).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernels.h"
#include "bf16_model_compare.h"
#include "core/error.h"
#include "model/transformer.h"
#include "model_test_configs.h"
#include "train_side_by_side.h"

namespace ladder {
namespace {

using namespace test;

// Rows per expert from [0, max_rows], expert 1 always empty.
std::vector<int32_t> offsets(int E, int max_rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> off(size_t(E) + 1, 0);
  for (int e = 0; e < E; ++e) off[size_t(e) + 1] = off[size_t(e)] + (e == 1 ? 0 : int32_t(rng() % uint32_t(max_rows + 1)));
  return off;
}

// grouped_gemm_ex on the CPU backend against the composition by hand, bitwise: every mix of fp32 /
// bf16 A, B and C, both shapes (rows_out with and without transB; the weight-gradient shape),
// leading dimensions wider than the rows, an addend where C is fp32; a bf16 C's rows past
// offsets[E] (the `rows` bound is larger) stay as they were.
TEST(MoeBf16Ops, GroupedGemmExIsWidenGroupedGemmRound) {
  auto be = make_cpu_backend(0);
  const int E = 5, pad = 3;
  const auto off = offsets(E, 23, 7);
  const int total = off[E], rows = total + 9;
  for (int shape = 0; shape < 3; ++shape)
    for (int mask = 0; mask < 8; ++mask) {
      const bool rows_out = shape < 2, tb = shape == 0, a16 = mask & 1, b16 = mask & 2, c16 = mask & 4;
      // rows_out: C[rows, N] = A[rows, K] op(B_e); else C_e[M, N] = A[rows, M]^T B[rows, N].
      const int M = rows_out ? 0 : 19, N = 21, K = rows_out ? 26 : 0;
      const int lda = (rows_out ? K : M) + pad, ldb = rows_out ? (tb ? K : N) + pad : N + pad;
      const int ldc = c16 ? N : N + pad;  // a bf16 C is packed
      const size_t sB = rows_out ? size_t(tb ? N : K) * ldb + 5 : 0, sC = rows_out ? 0 : size_t(M) * ldc;
      const size_t na = size_t(rows) * lda, nb = rows_out ? size_t(E) * sB : size_t(rows) * ldb;
      const size_t nc = rows_out ? size_t(rows) * ldc : size_t(E) * sC;
      const auto A = random_floats(na, 1 + mask), B = random_floats(nb, 11 + shape), C0 = random_floats(nc, 21);
      const auto A16 = to_b16(A), B16 = to_b16(B);
      const std::vector<float> Aw = widen(A16), Bw = widen(B16);
      const float beta = c16 ? 0.f : 0.5f;
      std::vector<float> ref = C0;
      cpu::grouped_gemm<float>(rows_out, tb, E, off.data(), M, N, K, 1.25f, a16 ? Aw.data() : A.data(), lda,
                               b16 ? Bw.data() : B.data(), ldb, sB, beta, ref.data(), ldc, sC);
      const std::string tag = "shape " + std::to_string(shape) + " a16 " + std::to_string(a16) + " b16 " +
                              std::to_string(b16) + " c16 " + std::to_string(c16);
      const void* pa = a16 ? static_cast<const void*>(A16.data()) : A.data();
      const void* pb = b16 ? static_cast<const void*>(B16.data()) : B.data();
      if (c16) {
        std::vector<uint16_t> D(nc, 0xffff);
        be->grouped_gemm_ex(rows_out, tb, E, off.data(), rows, M, N, K, 1.25f, pa, a16, lda, pb, b16, ldb, sB, 0.f,
                            D.data(), true, ldc, sC);
        const size_t written = rows_out ? size_t(total) * N : nc;
        std::vector<uint16_t> r(written);
        cpu::f32_to_bf16(r.data(), ref.data(), written);
        for (size_t i = 0; i < written; ++i) ASSERT_EQ(D[i], r[i]) << tag << " at " << i;
        for (size_t i = written; i < nc; ++i) ASSERT_EQ(D[i], 0xffff) << tag << ": row past offsets[E] written";
        continue;
      }
      std::vector<float> D = C0;
      be->grouped_gemm_ex(rows_out, tb, E, off.data(), rows, M, N, K, 1.25f, pa, a16, lda, pb, b16, ldb, sB, beta,
                          D.data(), false, ldc, sC);
      ASSERT_EQ(0, std::memcmp(D.data(), ref.data(), nc * sizeof(float))) << tag;
    }
}

// The bf16 gather is the fp32 gather rounded, bitwise (odd d, a size above the parallel threshold).
TEST(MoeBf16Ops, GatherBf16IsTheGatherRounded) {
  auto be = make_cpu_backend(0);
  for (auto [N, K, d] : {std::tuple{7, 2, 5}, std::tuple{300, 4, 257}}) {
    const auto h = random_floats(size_t(N) * d, 3, 2.f);
    std::vector<int32_t> slot(size_t(N) * K);
    std::mt19937 rng(5);
    for (auto& s : slot) s = int32_t(rng() % uint32_t(N * K));
    std::vector<float> xs(slot.size() * d);
    cpu::moe_gather<float>(xs.data(), h.data(), slot.data(), N * K, K, d);
    std::vector<uint16_t> got(xs.size(), 0xffff);
    be->moe_gather_bf16(got.data(), h.data(), slot.data(), N * K, K, d);
    EXPECT_EQ(got, to_b16(xs)) << N << " x " << d;
  }
}

// The combine and its backward from bf16 expert outputs are those from the widened outputs, bitwise.
TEST(MoeBf16Ops, CombineFromBf16IsTheCombineOfTheWidened) {
  auto be = make_cpu_backend(0);
  for (auto [N, K, d] : {std::tuple{7, 2, 5}, std::tuple{300, 4, 257}}) {
    const size_t NK = size_t(N) * K;
    const auto y16 = to_b16(random_floats(NK * d, 6, 2.f));
    const auto yw = widen(y16);
    const auto comb = random_floats(NK, 7), dout = random_floats(size_t(N) * d, 8), out0 = random_floats(size_t(N) * d, 9);
    std::vector<int32_t> row(NK);
    for (size_t j = 0; j < NK; ++j) row[j] = int32_t((j * 7919) % NK);  // a permutation (7919 is prime, NK < 7919)
    std::vector<float> ref = out0, got = out0;
    cpu::moe_combine<float>(ref.data(), yw.data(), comb.data(), row.data(), N, K, d);
    be->moe_combine_bf16(got.data(), y16.data(), comb.data(), row.data(), N, K, d);
    EXPECT_EQ(0, std::memcmp(got.data(), ref.data(), ref.size() * sizeof(float))) << N << " x " << d;
    std::vector<float> dy_ref(NK * d, NAN), dc_ref(NK, NAN), dy(NK * d, NAN), dc(NK, NAN);
    cpu::moe_combine_backward<float>(dy_ref.data(), dc_ref.data(), dout.data(), yw.data(), comb.data(), row.data(), N, K, d);
    be->moe_combine_backward_bf16(dy.data(), dc.data(), dout.data(), y16.data(), comb.data(), row.data(), N, K, d);
    EXPECT_EQ(0, std::memcmp(dy.data(), dy_ref.data(), dy.size() * sizeof(float))) << N << " x " << d;
    EXPECT_EQ(0, std::memcmp(dc.data(), dc_ref.data(), dc.size() * sizeof(float))) << N << " x " << d;
  }
}

TEST(MoeBf16Ops, GroupedGemmExRefusesWhatABf16OutputCannotTake) {
  auto be = make_cpu_backend(0);
  const int E = 2;
  const std::vector<int32_t> off = {0, 3, 5};
  std::vector<float> A(64, 1.f), B(64, 1.f);
  std::vector<uint16_t> C(64);
  auto call = [&](int rows, float beta, int ldc, size_t sC, bool rows_out) {
    be->grouped_gemm_ex(rows_out, true, E, off.data(), rows, 2, 2, 2, 1.f, A.data(), false, 2, B.data(), false, 2, 4,
                        beta, C.data(), true, ldc, sC);
  };
  EXPECT_NO_THROW(call(5, 0.f, 2, 0, true));
  EXPECT_THROW(call(5, 1.f, 2, 0, true), Error);   // an addend into bf16
  EXPECT_THROW(call(5, 0.f, 3, 0, true), Error);   // not packed
  EXPECT_THROW(call(5, 0.f, 2, 5, false), Error);  // weight-gradient shape: strideC != M * N
  EXPECT_THROW(call(4, 0.f, 2, 0, true), Error);   // the offsets hold more rows than `rows`
}

// Per MoE layer: the gathered rows and the expert outputs [N*K, d], the routed experts' three
// [N*K, I] and the shared expert's three [N, I_s] tensors.
size_t moe_bf16_saving(const Config& c) {
  const size_t N = size_t(c.run.batch_size) * c.model.seq_len, NK = N * size_t(c.model.moe_top_k);
  const size_t per_layer =
      2 * NK * size_t(c.model.d_model) + 3 * NK * size_t(c.model.expert_ff()) + 3 * N * size_t(c.model.shared_ff());
  return per_layer * 2 * size_t(c.model.n_moe_layers());  // half of 4 bytes each
}

// bf16 keeps 8 significant bits; gate, up and a each rounded, through the layers and the
// backward's sums: a few times 2^-9 per gradient (5e-2 as for model.mlp_bf16). A misread bf16
// buffer or a wrong layout gives O(1). One thing bf16 does that an fp32 comparison cannot hold to
// a tolerance: an MoE layer after a bf16 one may route a near-tie token to another expert (the
// switches model does so in layer 2: its expert loads differ), a discrete change of that layer's
// gradients. So the switches model here has its MoE layer first, whose routing sees the same input
// in both models; the MoE config's second MoE layer happens to route alike on this batch.
TEST(MoeBf16, CloseToTheFp32ModelButNotIt) {
  Config sw = moe_switches_config();
  sw.model.moe_layers = "0";
  for (Config c : {moe_config(), sw}) {
    Config h = c;
    h.model.moe_bf16 = true;
    expect_close_not_equal(c, h, 5e-2, moe_bf16_saving(c), "moe bf16", tag_of(c));
  }
}

// With bf16 saved activations the experts' hidden tensors are already bf16: kept per layer as they
// are (not packed again), so the forward is unchanged (storage only) and the gradients are close;
// with mlp_bf16 too, every MLP tensor of the model is bf16.
TEST(MoeBf16, WithBf16SavedActivations) {
  for (bool mlp : {false, true}) {
    Config c = moe_switches_config();
    c.model.n_layers = 4;
    c.model.moe_bf16 = true;
    c.model.mlp_bf16 = mlp;
    Config s = c;
    s.model.saved_activations = "bf16";
    const Compared r = compare(c, s, 5e-2);
    EXPECT_TRUE(r.loss_equal) << "bf16 storage must not change the forward";
    EXPECT_GT(r.grads_differ, size_t(0));
    // Packing leaves the expert tensors out: both models keep 2 bytes per element of them per MoE
    // layer (their own bf16 arrays, or the packed copies), and without moe_bf16 also the fp32 set
    // the MoE layers share (4 bytes per element, once).
    Config s32 = s;
    s32.model.moe_bf16 = false;
    const size_t per_layer_elems = moe_bf16_saving(c) / 2 / size_t(c.model.n_moe_layers());
    EXPECT_EQ(activation_bytes(s32) - activation_bytes(s), per_layer_elems * 4) << "mlp_bf16 " << mlp;
    Config f = c;
    f.model.moe_bf16 = false;
    f.model.mlp_bf16 = false;
    compare(f, s, 5e-2);
  }
}

// Recomputation re-runs the bf16 layer: bit for bit the same losses and gradients, less memory.
TEST(MoeBf16, WithRecomputeBitForBit) {
  Config c = moe_config();
  c.model.n_layers = 4;
  c.model.moe_bf16 = true;
  expect_recompute_bit_exact(c, "moe");
}

// A learnable task, twenty AdamW steps (lr 1e-2): the loss curve follows the fp32 run. Routing
// makes this noisier than for model.mlp_bf16: once the weights differ by rounding, near-tie
// tokens go to other experts and single steps move by a few percent either way (the bf16 run ends
// below the fp32 run as often as above it). So: every step within 5e-2, and the bf16 run learns
// at least 90% of what the fp32 run learns (first step to the mean of the last five); a misread
// bf16 buffer or a lost gradient is far outside both.
TEST(MoeBf16, TrainingFollowsTheFp32Run) {
  const LossCurves lc = twenty_adamw_steps(moe_config(), [](Config& h) { h.model.moe_bf16 = true; });
  EXPECT_LT(lc.worst_rel(), 5e-2) << "loss curves apart";
  double ta = 0, tb = 0;
  for (size_t t = lc.a.size() - 5; t < lc.a.size(); ++t) ta += lc.a[t] / 5, tb += lc.b[t] / 5;
  const double learned_a = lc.a.front() - ta, learned_b = lc.b.front() - tb;
  EXPECT_GT(learned_b, 0.9 * learned_a) << "the bf16 run learns less";
  if (getenv("SHOW"))
    for (size_t t = 0; t < lc.a.size(); ++t) std::printf("%zu %.5f %.5f\n", t, lc.a[t], lc.b[t]);
  std::printf("[ moe bf16 ] 20 AdamW steps, worst loss rel diff %.2e, learned %.3f (fp32 %.3f)\n", lc.worst_rel(),
              learned_b, learned_a);
}

TEST(MoeBf16, ConfigRefusesAModelWithoutMoeLayers) {
  Config c = dense_config();
  c.model.moe_bf16 = true;
  expect_refused_naming(c, "model.moe_bf16");
}

}  // namespace
}  // namespace ladder
