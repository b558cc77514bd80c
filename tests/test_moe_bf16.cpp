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
#include "model/moe.h"
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

// ---- model.moe_bf16_grads: the routed experts' activation gradients dy, da, dg, du in bf16 ----

// The two ops it adds, on the CPU reference: the fp32 op on the widened inputs, its gradients
// rounded to nearest even, bitwise; dcomb is the fp32-dy op's (n above the parallel threshold,
// odd sizes, and one under a SwiGLU chunk).
TEST(MoeBf16Ops, Bf16GradientOpsAreTheFp32OpsRounded) {
  auto be = make_cpu_backend(0);
  for (size_t n : {size_t(5), size_t(4096 * 9 + 7)}) {
    const auto g16 = to_b16(random_floats(n, 1, 3.f)), u16 = to_b16(random_floats(n, 2)), dh16 = to_b16(random_floats(n, 3));
    const auto gw = widen(g16), uw = widen(u16), dhw = widen(dh16);
    std::vector<float> dg(n), du(n);
    cpu::swiglu_backward<float>(dg.data(), du.data(), dhw.data(), gw.data(), uw.data(), n);
    std::vector<uint16_t> got_g(n, 0xffff), got_u(n, 0xffff);
    be->swiglu_backward_bf16_grads(got_g.data(), got_u.data(), dh16.data(), g16.data(), u16.data(), n);
    EXPECT_EQ(got_g, to_b16(dg)) << n;
    EXPECT_EQ(got_u, to_b16(du)) << n;
  }
  for (auto [N, K, d] : {std::tuple{7, 2, 5}, std::tuple{300, 4, 257}}) {
    const size_t NK = size_t(N) * K;
    const auto y16 = to_b16(random_floats(NK * d, 6, 2.f));
    const auto comb = random_floats(NK, 7), dout = random_floats(size_t(N) * d, 8);
    std::vector<int32_t> row(NK);
    for (size_t j = 0; j < NK; ++j) row[j] = int32_t((j * 7919) % NK);
    std::vector<float> dy_ref(NK * d), dc_ref(NK), dc(NK, NAN);
    be->moe_combine_backward_bf16(dy_ref.data(), dc_ref.data(), dout.data(), y16.data(), comb.data(), row.data(), N, K,
                                  d);
    std::vector<uint16_t> dy(NK * d, 0xffff);
    be->moe_combine_backward_bf16_grads(dy.data(), dc.data(), dout.data(), y16.data(), comb.data(), row.data(), N, K, d);
    EXPECT_EQ(dy, to_b16(dy_ref)) << N << " x " << d;
    EXPECT_EQ(0, std::memcmp(dc.data(), dc_ref.data(), NK * sizeof(float))) << N << " x " << d;
  }
}

// The whole block's backward with bf16 gradients on the CPU backend is, bit for bit, its
// definition written out here with the fp32 CPU kernels: dy = bf16(the combine's backward),
// da = bf16(dy wd), dg, du = bf16(SwiGLU's backward on da), dx, the weight gradients, the shared
// expert and the router in fp32 from those; the forward's bf16 tensors read widened. Both combine
// modes; the gradients accumulate onto random values.
TEST(MoeBf16Grads, BlockBackwardIsItsDefinitionBitForBit) {
  auto be = make_cpu_backend(0);
  for (bool normalized : {false, true}) {
    MoeDims D;
    D.N = 37, D.d = 24, D.E = 6, D.K = 2, D.I = 20, D.Is = 12;
    D.normalized = normalized;
    D.route_scale = 2.5;
    D.bf16 = D.bf16_grads = true;
    const int N = D.N, d = D.d, E = D.E, K = D.K, I = D.I, Is = D.Is, NK = N * K;
    const auto router = random_floats(size_t(E) * d, 1, 0.3f), bias = random_floats(size_t(E), 2, 0.1f);
    const auto wg = random_floats(size_t(E) * I * d, 3, 0.3f), wu = random_floats(size_t(E) * I * d, 4, 0.3f);
    const auto wd = random_floats(size_t(E) * d * I, 5, 0.3f), sg = random_floats(size_t(Is) * d, 6, 0.3f);
    const auto su = random_floats(size_t(Is) * d, 7, 0.3f), sd = random_floats(size_t(d) * Is, 8, 0.3f);
    const auto h = random_floats(size_t(N) * d, 9), dout = random_floats(size_t(N) * d, 10);
    const float z = 0.03f;
    // Gradients start at random values (accumulated), per parameter: router wg wu wd sg su sd.
    const size_t sizes[7] = {router.size(), wg.size(), wu.size(), wd.size(), sg.size(), su.size(), sd.size()};
    std::vector<std::vector<float>> got, ref;
    for (int i = 0; i < 7; ++i) got.push_back(random_floats(sizes[i], 20 + i, 1e-2f));
    ref = got;
    const MoeWeights<float> W{router.data(), bias.data(), wg.data(), wu.data(), wd.data(), sg.data(), su.data(), sd.data()};
    MoeGrads<float> G{got[0].data(), got[1].data(), got[2].data(), got[3].data(), got[4].data(), got[5].data(),
                      got[6].data()};
    MoeActs<float> A;
    MoeScratch<float> S;
    std::vector<std::vector<double>> store;
    for (auto reqs : {moe_act_requests<float>(D, A), moe_scratch_requests<float>(D, S)})
      for (auto& [ptr, bytes] : reqs) {
        store.emplace_back(bytes / sizeof(double) + 1, 0.0);
        *ptr = store.back().data();
      }
    std::vector<float> out(size_t(N) * d, 0.f), dh(size_t(N) * d, NAN);
    BackendOps ops{be.get()};
    moe_forward<float>(ops, D, W, A, h.data(), out.data());
    moe_backward<float>(ops, D, W, G, A, S, h.data(), dout.data(), dh.data(), z);

    // The definition, from the forward's saved tensors (bf16 bits widened).
    auto wide = [](const float* bits, size_t n) {
      std::vector<float> v(n);
      cpu::bf16_to_f32(v.data(), reinterpret_cast<const uint16_t*>(bits), n);
      return v;
    };
    auto round_trip = [](std::vector<float>& v) { v = widen(to_b16(v)); };  // the bf16 stores
    const size_t nkd = size_t(NK) * d, nki = size_t(NK) * I;
    const auto y = wide(A.y, nkd), xs = wide(A.xs, nkd), g = wide(A.g, nki), u = wide(A.u, nki), a = wide(A.a, nki);
    const auto sact = wide(A.sact, size_t(N) * Is);
    std::vector<float> dy(nkd), dcomb(NK), da(nki), dg(nki), du(nki), dx(nkd), dh_ref(size_t(N) * d);
    cpu::moe_combine_backward<float>(dy.data(), dcomb.data(), dout.data(), y.data(), A.comb, A.row, N, K, d);
    round_trip(dy);
    cpu::grouped_gemm<float>(true, false, E, A.offsets, 0, I, d, 1.f, dy.data(), d, wd.data(), I, size_t(d) * I, 0.f,
                             da.data(), I, 0);
    round_trip(da);
    cpu::grouped_gemm<float>(false, false, E, A.offsets, d, I, 0, 1.f, dy.data(), d, a.data(), I, 0, 1.f,
                             ref[3].data(), I, size_t(d) * I);
    cpu::swiglu_backward<float>(dg.data(), du.data(), da.data(), g.data(), u.data(), nki);
    round_trip(dg);
    round_trip(du);
    cpu::grouped_gemm<float>(true, false, E, A.offsets, 0, d, I, 1.f, dg.data(), I, wg.data(), d, size_t(I) * d, 0.f,
                             dx.data(), d, 0);
    cpu::grouped_gemm<float>(true, false, E, A.offsets, 0, d, I, 1.f, du.data(), I, wu.data(), d, size_t(I) * d, 1.f,
                             dx.data(), d, 0);
    cpu::grouped_gemm<float>(false, false, E, A.offsets, I, d, 0, 1.f, dg.data(), I, xs.data(), d, 0, 1.f,
                             ref[1].data(), d, size_t(I) * d);
    cpu::grouped_gemm<float>(false, false, E, A.offsets, I, d, 0, 1.f, du.data(), I, xs.data(), d, 0, 1.f,
                             ref[2].data(), d, size_t(I) * d);
    cpu::moe_gather_backward<float>(dh_ref.data(), dx.data(), A.row, N, K, d);
    // The shared expert and the router: fp32 gradients, as without the option.
    std::vector<float> dsa(size_t(N) * Is), dsg(size_t(N) * Is), dsu(size_t(N) * Is), ds(size_t(N) * E);
    cpu::gemm<float>(false, false, N, Is, d, 1.f, dout.data(), d, sd.data(), Is, 0.f, dsa.data(), Is);
    cpu::gemm<float>(true, false, d, Is, N, 1.f, dout.data(), d, sact.data(), Is, 1.f, ref[6].data(), Is);
    cpu::swiglu_backward_bf16(dsg.data(), dsu.data(), dsa.data(), reinterpret_cast<const uint16_t*>(A.sgate),
                              reinterpret_cast<const uint16_t*>(A.sup), size_t(N) * Is);
    cpu::gemm<float>(false, false, N, d, Is, 1.f, dsg.data(), Is, sg.data(), d, 1.f, dh_ref.data(), d);
    cpu::gemm<float>(false, false, N, d, Is, 1.f, dsu.data(), Is, su.data(), d, 1.f, dh_ref.data(), d);
    cpu::gemm<float>(true, false, Is, d, N, 1.f, dsg.data(), Is, h.data(), d, 1.f, ref[4].data(), d);
    cpu::gemm<float>(true, false, Is, d, N, 1.f, dsu.data(), Is, h.data(), d, 1.f, ref[5].data(), d);
    cpu::moe_router_backward<float>(ds.data(), A.logits, A.lse, A.expert, dcomb.data(), N, E, K, normalized, 2.5, z);
    cpu::gemm<float>(false, false, N, d, E, 1.f, ds.data(), E, router.data(), d, 1.f, dh_ref.data(), d);
    cpu::gemm<float>(true, false, E, d, N, 1.f, ds.data(), E, h.data(), d, 1.f, ref[0].data(), d);

    const std::string tag = normalized ? "normalized" : "sigmoid";
    // The scratch holds this backward's dy, da, dg and du as bf16 bits.
    EXPECT_EQ(wide(S.dy, nkd), dy) << tag << " dy";
    EXPECT_EQ(wide(S.da, nki), da) << tag << " da";
    EXPECT_EQ(wide(S.dg, nki), dg) << tag << " dg";
    EXPECT_EQ(wide(S.du, nki), du) << tag << " du";
    EXPECT_EQ(0, std::memcmp(dh.data(), dh_ref.data(), dh.size() * sizeof(float))) << tag << " dh";
    const char* names[7] = {"router", "wg", "wu", "wd", "sg", "su", "sd"};
    for (int i = 0; i < 7; ++i)
      EXPECT_EQ(0, std::memcmp(got[size_t(i)].data(), ref[size_t(i)].data(), sizes[i] * sizeof(float)))
          << tag << " d " << names[i];
  }
}

// Against model.moe_bf16 with fp32 gradients: the same forward (the loss bit for bit), gradients
// within bf16 rounding of it (1e-2 relative: each of dy, da, dg, du rounded once, 2^-9 each, a
// wrong layout or a misread buffer is O(1)) but not equal; both the MoE model and the switches
// model with its MoE layer first (routing in the next layers is decided by the forward, which does
// not change here).
TEST(MoeBf16Grads, CloseToFp32GradientsWithTheSameForward) {
  Config sw = moe_switches_config();
  sw.model.moe_layers = "0";
  for (Config c : {moe_config(), sw}) {
    c.model.moe_bf16 = true;
    Config g = c;
    g.model.moe_bf16_grads = true;
    const Compared r = compare(c, g, 1e-2);
    EXPECT_TRUE(r.loss_equal) << tag_of(c) << ": the option must not change the forward";
    EXPECT_GT(r.grads_differ, size_t(0)) << tag_of(c) << ": is the option in effect?";
    std::printf("[ moe bf16 grads ] %s: worst gradient rel err %.2e against fp32 gradients\n", tag_of(c),
                r.worst_grad);
  }
}

// Recomputation re-runs the forward only: with bf16 gradients still bit for bit.
TEST(MoeBf16Grads, WithRecomputeBitForBit) {
  Config c = moe_config();
  c.model.n_layers = 4;
  c.model.moe_bf16 = c.model.moe_bf16_grads = true;
  expect_recompute_bit_exact(c, "moe bf16 grads");
}

TEST(MoeBf16Grads, ConfigRefusesItWithoutMoeBf16OrMoeLayers) {
  Config c = moe_config();
  c.model.moe_bf16_grads = true;
  expect_refused_naming(c, "model.moe_bf16_grads");
  Config dn = dense_config();
  dn.model.moe_bf16_grads = true;
  expect_refused_naming(dn, "model.moe_bf16_grads");
  c.model.moe_bf16 = true;
  EXPECT_NO_THROW(validate(c));
}

}  // namespace
}  // namespace ladder
