// The MoE dispatch kernels and the device-side grouped GEMM (src/backend/cuda/moe_ops.cu) and the
// tensor-core flash attention (attention_tc.cu's WMMA kernels and attention_mma_*.cu's mma.sync
// ones behind the same launchers), rewritten by emulate.py and run by emu_cuda.h, against the CPU
// kernels: every moe_ops launcher against backend/cpu/moe_kernels.h and
// cpu::grouped_gemm (integers and selections exact, fp32 within 5e-6), attention_tc against
// cpu::attention_forward/backward within its documented bf16 tolerances (docs/cuda.md,
// "Tensor-core attention"). Conventions of test_emu_kernels.cpp (emu_fixture.h): outputs poisoned
// with 0xFF bytes, buffers and scratch exactly the size the launcher asks for (ASan in run.sh asan
// sees overruns), EMU_SEED repeats inputs, EMU_QUICK drops the costlier shapes. Shapes are those of
// tests/cuda/test_cuda_moe.cpp and test_cuda_attention_tc.cpp, made smaller where the emulation's
// cost (a fiber, or under asan/tsan a std::thread, per CUDA thread) would dominate; EMU_FULL=1 runs
// the GPU tests' attention_tc shapes (run.sh tc does).
#include "../grouped_gemm_case.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/moe_kernels.h"
#include "backend/cuda/attention_tc.cuh"
#include "backend/cuda/moe_ops.cuh"
#include "emu_fixture.h"

namespace ladder {
namespace {

using emu_test::CudaEmu;
using emu_test::kF32;
using emu_test::quick;
namespace k = cuda::k;

bool full() {
  static const bool f = std::getenv("EMU_FULL") && std::string(std::getenv("EMU_FULL")) != "0";
  return f;
}

// Inputs with many exact ties (multiples of `step` in [-levels, levels] * step) and skewed expert
// choices (experts above E/2 never chosen, low ones crowded), as in test_cuda_moe.cpp.
std::vector<float> quantized(std::mt19937_64& rng, size_t n, int levels, float step) {
  std::uniform_int_distribution<int> d(-levels, levels);
  std::vector<float> v(n);
  for (auto& x : v) x = float(d(rng)) * step;
  return v;
}
std::vector<int32_t> skewed_experts(std::mt19937_64& rng, size_t n, int E) {
  std::uniform_real_distribution<double> u(0, 1);
  const int used = std::max(1, E / 2 + 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = std::min(used - 1, int(used * std::pow(u(rng), 3.0)));
  return v;
}

// The expert ids the tests use: E = 8 (one lane pass), 65 (lanes loop twice, the sort's top key bit).
const int kEs[] = {8, 65};
const int kKs[] = {1, 2, 4};

// ---------------------------------------------------------------------------------------------
// moe_ops.cu: routing

TEST_F(CudaEmu, MoeRouteIncludingTies) {
  const int N = 45;  // 45 tokens over the capped grid's 24 warps: some warps take two
  for (int E : kEs)
    for (int K : kKs)
      for (int variant = 0; variant < 3; ++variant) {
        if (quick() && K == 2) continue;
        // 0: continuous; 1: coarse scores, no bias (exact ties); 2: coarse scores and bias.
        const bool normalized = variant != 0;
        const std::string what = fmt("moe_route E=%d K=%d var=%d", E, K, variant);
        std::vector<float> logits, bias;
        if (variant == 0) {
          logits = randv(size_t(N) * E, -3.f, 3.f);
          bias = randv(size_t(E), -0.5f, 0.5f);
        } else {
          logits = quantized(rng_, size_t(N) * E, 3, 0.5f);
          bias = variant == 1 ? std::vector<float>(size_t(E), 0.f) : quantized(rng_, size_t(E), 2, 0.5f);
        }
        const size_t NK = size_t(N) * K;
        std::vector<float> lse(N), comb(NK);
        std::vector<int32_t> expert(NK);
        cpu::moe_route<float>(lse.data(), expert.data(), comb.data(), logits.data(), bias.data(), N, E, K, normalized,
                              2.5);
        auto glse = poisoned(N), gcomb = poisoned(NK);
        auto gexp = poisoned<int32_t>(NK);
        ok(k::moe_route(glse.data(), gexp.data(), gcomb.data(), logits.data(), bias.data(), N, E, K, normalized, 2.5,
                        nullptr),
           what);
        exact(gexp, expert, what + " expert");
        check(glse, lse, kF32, what + " lse");
        check(gcomb, comb, kF32, what + " comb");
      }
  float dummy = 0;
  int32_t idummy = 0;
  EXPECT_EQ(k::moe_route(&dummy, &idummy, &dummy, &dummy, &dummy, 1, 4, 5, false, 1.0, nullptr), cudaErrorInvalidValue);
}

TEST_F(CudaEmu, MoeRouterBackward) {
  const int N = 37;
  for (int E : kEs)
    for (int K : kKs)
      for (int variant = 0; variant < 3; ++variant) {
        if (quick() && K == 2) continue;
        // 0: plain sigmoid, no z-loss; 1: normalized, z-loss; 2: plain sigmoid, z-loss.
        const bool normalized = variant == 1;
        const float z = variant == 0 ? 0.f : 3e-2f;
        const std::string what = fmt("moe_router_backward E=%d K=%d var=%d", E, K, variant);
        const size_t NK = size_t(N) * K;
        auto logits = randv(size_t(N) * E, -3.f, 3.f), bias = randv(size_t(E), -0.3f, 0.3f), dcomb = randv(NK);
        std::vector<float> lse(N), comb(NK), ds(size_t(N) * E);
        std::vector<int32_t> expert(NK);
        cpu::moe_route<float>(lse.data(), expert.data(), comb.data(), logits.data(), bias.data(), N, E, K, normalized,
                              1.7);
        cpu::moe_router_backward<float>(ds.data(), logits.data(), lse.data(), expert.data(), dcomb.data(), N, E, K,
                                        normalized, 1.7, z);
        auto gds = poisoned(ds.size());
        ok(k::moe_router_backward(gds.data(), logits.data(), lse.data(), expert.data(), dcomb.data(), N, E, K,
                                  normalized, 1.7, z, nullptr),
           what);
        check(gds, ds, kF32, what);
      }
}

// ---------------------------------------------------------------------------------------------
// moe_ops.cu: sort, gather / combine, load, resets

TEST_F(CudaEmu, MoeSortBitForBit) {
  auto run = [&](const std::vector<int32_t>& expert, int E, const std::string& what) {
    const int NK = int(expert.size());
    std::vector<int32_t> off(E + 1), row(NK), slot(NK);
    cpu::moe_sort(off.data(), row.data(), slot.data(), expert.data(), NK, E);
    // Exactly the scratch asked for: the CUB stand-in overwrites all of its temp storage.
    std::vector<unsigned char> scratch(k::moe_sort_scratch_bytes(NK, E));
    auto goff = poisoned<int32_t>(E + 1), grow = poisoned<int32_t>(NK), gslot = poisoned<int32_t>(NK);
    if (NK > 0) {
      EXPECT_EQ(k::moe_sort(goff.data(), grow.data(), gslot.data(), expert.data(), NK, E, scratch.data(),
                            scratch.size() - 1, nullptr),
                cudaErrorInvalidValue)
          << what;
    }
    ok(k::moe_sort(goff.data(), grow.data(), gslot.data(), expert.data(), NK, E, scratch.data(), scratch.size(),
                   nullptr),
       what);
    exact(goff, off, what + " offsets");
    exact(grow, row, what + " row");
    exact(gslot, slot, what + " slot");
  };
  const int N = 67;
  for (int E : kEs)
    for (int K : kKs) run(skewed_experts(rng_, size_t(N) * K, E), E, fmt("moe_sort E=%d K=%d", E, K));
  run({}, 8, "moe_sort NK=0");
  run(std::vector<int32_t>(77, 64), 65, "moe_sort all on expert 64");
  run(std::vector<int32_t>(5, 0), 1, "moe_sort E=1");
}

TEST_F(CudaEmu, MoeGatherCombineAndBackward) {
  const int N = 29;
  for (int E : kEs)
    for (int K : kKs)
      for (int d : {1, 37, 300}) {  // 300: a block's 256 threads go around the column loop
        if (quick() && (K == 2 || d == 37)) continue;
        const std::string what = fmt("E=%d K=%d d=%d", E, K, d);
        const int NK = N * K;
        const auto expert = skewed_experts(rng_, size_t(NK), E);
        std::vector<int32_t> off(E + 1), row(NK), slot(NK);
        cpu::moe_sort(off.data(), row.data(), slot.data(), expert.data(), NK, E);
        const auto h = randv(size_t(N) * d), y = randv(size_t(NK) * d), comb = randv(size_t(NK), 0.f, 1.f);
        const auto out0 = randv(size_t(N) * d), dout = randv(size_t(N) * d), dx = randv(size_t(NK) * d);

        std::vector<float> xs(size_t(NK) * d);
        cpu::moe_gather<float>(xs.data(), h.data(), slot.data(), NK, K, d);
        auto gxs = poisoned(xs.size());
        ok(k::moe_gather(gxs.data(), h.data(), slot.data(), NK, K, d, nullptr), what);
        exact(gxs, xs, "moe_gather " + what);

        std::vector<float> out = out0, gout = out0;  // accumulates onto random values
        cpu::moe_combine<float>(out.data(), y.data(), comb.data(), row.data(), N, K, d);
        ok(k::moe_combine(gout.data(), y.data(), comb.data(), row.data(), N, K, d, nullptr), what);
        check(gout, out, kF32, "moe_combine " + what);

        std::vector<float> dy(size_t(NK) * d), dcomb(NK);
        cpu::moe_combine_backward<float>(dy.data(), dcomb.data(), dout.data(), y.data(), comb.data(), row.data(), N,
                                         K, d);
        auto gdy = poisoned(dy.size()), gdcomb = poisoned(NK);
        ok(k::moe_combine_backward(gdy.data(), gdcomb.data(), dout.data(), y.data(), comb.data(), row.data(), N, K, d,
                                   nullptr),
           what);
        exact(gdy, dy, "moe_combine_backward dy " + what);  // one product per element
        check(gdcomb, dcomb, kF32, "moe_combine_backward dcomb " + what);

        // model.moe_bf16_grads: from bf16 y, dy written in bf16 is the CPU backend's bits (its
        // reference: the fp32 op from the widened y, then rounded).
        std::vector<uint16_t> y16(y.size()), dy16(dy.size());
        cpu::f32_to_bf16(y16.data(), y.data(), y.size());
        std::vector<float> dyw(dy.size()), dcw(NK);
        cpu::moe_combine_backward<float, uint16_t>(dyw.data(), dcw.data(), dout.data(), y16.data(), comb.data(),
                                                   row.data(), N, K, d);
        cpu::f32_to_bf16(dy16.data(), dyw.data(), dyw.size());
        auto gdy16 = poisoned<uint16_t>(dy.size());
        auto gdc16 = poisoned(NK);
        ok(k::moe_combine_backward_bf16_grads(gdy16.data(), gdc16.data(), dout.data(), y16.data(), comb.data(),
                                              row.data(), N, K, d, nullptr),
           what);
        exact(gdy16, dy16, "moe_combine_backward_bf16_grads dy " + what);
        check(gdc16, dcw, kF32, "moe_combine_backward_bf16_grads dcomb " + what);

        std::vector<float> dh(size_t(N) * d);
        cpu::moe_gather_backward<float>(dh.data(), dx.data(), row.data(), N, K, d);
        auto gdh = poisoned(dh.size());
        ok(k::moe_gather_backward(gdh.data(), dx.data(), row.data(), N, K, d, nullptr), what);
        check(gdh, dh, kF32, "moe_gather_backward " + what);
      }
}

TEST_F(CudaEmu, MoeCountLoadAndPkoResets) {
  std::uniform_int_distribution<int> u(0, 1000);
  for (int E : {8, 65, 300}) {  // 300 experts: past one block of the capped grid... and around
    const int NK = 500;
    const auto expert = skewed_experts(rng_, size_t(NK), E);
    std::vector<int32_t> off(E + 1), row(NK), slot(NK);
    cpu::moe_sort(off.data(), row.data(), slot.data(), expert.data(), NK, E);
    std::vector<int64_t> load(E);
    for (auto& x : load) x = u(rng_);
    auto gload = load;
    cpu::moe_count_load(load.data(), off.data(), E);
    ok(k::moe_count_load(gload.data(), off.data(), E, nullptr), "moe_count_load");
    exact(gload, load, fmt("moe_count_load E=%d", E));
  }
  std::uniform_int_distribution<int> id(0, 5);
  for (int S : {1, 7, 64, 300}) {
    const int N_tok = 3 * S + (S > 1 ? 5 : 0), eod = 3;  // a partial last sequence
    std::vector<int32_t> ids(N_tok);
    for (auto& x : ids) x = id(rng_);  // eod often, also at sequence ends
    std::vector<uint8_t> reset(N_tok);
    cpu::pko_resets(reset.data(), ids.data(), N_tok, S, eod);
    auto greset = poisoned<uint8_t>(N_tok);
    ok(k::pko_resets(greset.data(), ids.data(), N_tok, S, eod, nullptr), "pko_resets");
    exact(greset, reset, fmt("pko_resets S=%d", S));
  }
}

// ---------------------------------------------------------------------------------------------
// moe_ops.cu: quantile balancing

TEST_F(CudaEmu, MoeBalanceValuesAndQuantileBeta) {
  auto beta_of = [&](const std::vector<float>& vals, int64_t T, int E, int K, const std::string& what) {
    std::vector<double> beta(E);
    cpu::moe_quantile_beta(beta.data(), vals.data(), T, E, K);
    std::vector<unsigned char> scratch(k::moe_quantile_beta_scratch_bytes(T, E));
    auto gbeta = poisoned<double>(E);
    EXPECT_EQ(k::moe_quantile_beta(gbeta.data(), vals.data(), T, E, K, scratch.data(), scratch.size() - 1, nullptr),
              cudaErrorInvalidValue);
    ok(k::moe_quantile_beta(gbeta.data(), vals.data(), T, E, K, scratch.data(), scratch.size(), nullptr), what);
    // Compared as values, as the GPU test does: a selected -0 comes back as +0 (the kernel's keys
    // map both zeros to one key, moe_ops.cu float_key), the same threshold.
    size_t diff = 0;
    for (int e = 0; e < E; ++e) diff += !(gbeta[e] == beta[e]);
    std::printf("[ exact    ] %-48s %zu of %d differ\n", ("moe_quantile_beta " + what).c_str(), diff, E);
    EXPECT_EQ(diff, 0u) << what;
  };
  // E = 33: a second 32-column tile of the transpose, partly filled (E = 65 is left to the GPU).
  for (int E : {8, 33})
    for (int K : {1, 4})
      for (int T : {1, 10, 300})
        for (int ties = 0; ties < 2; ++ties) {
          if (quick() && (T == 10 || E == 33)) continue;
          const std::string what = fmt("E=%d K=%d T=%d%s", E, K, T, ties ? " ties" : "");
          auto logits = ties ? quantized(rng_, size_t(T) * E, 4, 0.25f) : randv(size_t(T) * E, -4.f, 4.f);
          auto bias = ties ? quantized(rng_, size_t(E), 1, 0.25f) : randv(size_t(E), -0.5f, 0.5f);
          std::vector<float> vals(size_t(T) * E);
          cpu::moe_balance_values<float>(vals.data(), logits.data(), bias.data(), T, E, K);
          auto gvals = poisoned(vals.size());
          ok(k::moe_balance_values(gvals.data(), logits.data(), bias.data(), T, E, K, nullptr), what);
          exact(gvals, vals, "moe_balance_values " + what);  // the same float subtraction
          // beta of the CPU's values (the selection alone), a negative zero included. Not every
          // case: the select costs a 512-thread block (16 barriers) per column here.
          const bool select = E == 8 ? (K == 4) == (T == 10) || (ties && T == 1) : K == 4 && T == 300 && ties;
          if (!select) continue;
          if (ties) vals[0] = -0.f;
          beta_of(vals, T, E, K, what);
        }
  // A longer column: the select's threads stride T, the transpose's capped grid strides its tiles.
  const int T = 2000, E = 3, K = 1;  // 63 transpose tiles over 3 blocks, 4 keys per select thread
  auto vals = randv(size_t(T) * E, -5.f, 5.f);
  for (size_t i = 0; i < vals.size(); i += 3) vals[i] = std::round(vals[i] * 4.f) / 4.f;  // ties
  beta_of(vals, T, E, K, fmt("T=%d E=%d K=%d", T, E, K));
}

// ---------------------------------------------------------------------------------------------
// moe_ops.cu: grouped GEMM

using grouped_gemm_test::GroupedCase;

TEST_F(CudaEmu, MoeGroupedGemmBothShapes) {
  // test_cuda_moe.cpp's cases, smaller: every tile costs K/16 (or rows/16) block barriers here.
  const GroupedCase cases[] = {
      // rows_out = true (forward / data gradient), both transB, beta 0 on a poisoned C and beta != 0.
      {true, true, 8, 0, 75, 37, 0, 1.f, 0.f, 30},
      {true, false, 8, 0, 75, 37, 3, 0.7f, 0.f, 30},
      {true, true, 65, 0, 70, 20, 1, -1.3f, 0.5f, 6},
      {true, false, 65, 0, 33, 40, 0, 1.f, 1.f, 6},
      {true, false, 5, 0, 130, 129, 2, 0.25f, -0.75f, 40},
      {true, true, 8, 0, 5, 0, 0, 1.f, 0.5f, 10},  // K = 0: C = beta C
      // rows_out = false (weight gradient), beta 0 poisoned, 1 (accumulate) and other.
      {false, false, 8, 70, 45, 0, 0, 1.f, 0.f, 30},
      {false, true, 8, 70, 45, 0, 5, 0.7f, 1.f, 30},  // transB is unused by this shape
      {false, false, 65, 33, 20, 0, 1, -1.3f, 0.5f, 6},
      {false, false, 4, 129, 130, 0, 3, 0.5f, 0.f, 40},
  };
  for (const auto& c : cases) {
    if (quick() && (c.E == 65 || c.M == 129 || c.N == 130)) continue;
    const std::string what = c.name();
    const auto p = grouped_gemm_test::make_problem(c, rng_);
    auto got = grouped_gemm_test::initial_C(c, p);  // beta 0 must not read C: poisoned
    std::vector<int32_t> tiles = poisoned<int32_t>(k::grouped_gemm_scratch_ints(c.E));
    ok(k::grouped_gemm(c.rows_out, c.transB, c.E, p.off.data(), c.M, c.N, c.K, c.alpha, p.A.data(), p.lda,
                       p.B.data(), p.ldb, p.sB, c.beta, got.data(), p.ldc, p.sC, tiles.data(), nullptr),
       what);
    // The logical output, and every other element of C (padding, stride gaps) left alone.
    const auto out = grouped_gemm_test::logical_output(c, p, got, grouped_gemm_test::reference(c, p));
    EXPECT_EQ(out.pad_changed, 0u) << what << ": elements outside the output were written";
    if (!out.got.empty()) check(out.got, out.ref, kF32, what);
  }
}

TEST_F(CudaEmu, MoeGroupedGemmAllExpertsEmpty) {
  const int E = 5, M = 20, N = 30;
  const std::vector<int32_t> off(E + 1, 0);
  const auto C = randv(size_t(E) * M * N);
  const std::vector<float> A(1, 0.f), B(1, 0.f);
  for (float beta : {0.f, 1.f, -2.f}) {
    // Weight gradient of no rows: C_e = beta C_e (beta 0: zeros, C not read).
    auto got = beta == 0.f ? poisoned(C.size()) : C;
    auto ref = C;
    ok(k::grouped_gemm(false, false, E, off.data(), M, N, 0, 1.f, A.data(), M, B.data(), N, 0, beta, got.data(), N,
                       size_t(M) * N, nullptr, nullptr),
       "grouped_gemm empty");
    cpu::grouped_gemm<float>(false, false, E, off.data(), M, N, 0, 1.f, A.data(), M, B.data(), N, 0, beta, ref.data(),
                             N, size_t(M) * N);
    exact(got, ref, fmt("grouped_gemm rows_out=0 all empty beta=%g", beta));
    // rows_out with no rows: nothing to write; C (here 1 element) untouched.
    std::vector<float> c1 = {7.f};
    std::vector<int32_t> tiles = poisoned<int32_t>(k::grouped_gemm_scratch_ints(E));
    ok(k::grouped_gemm(true, beta != 1.f, E, off.data(), 0, N, 8, 1.f, A.data(), 8, B.data(), 8, 8 * N, beta,
                       c1.data(), N, 0, tiles.data(), nullptr),
       "grouped_gemm rows_out empty");
    EXPECT_EQ(c1[0], 7.f);
    EXPECT_EQ(tiles[E], 0);
  }
}

// ---------------------------------------------------------------------------------------------
// attention_tc.cu: bf16 WMMA flash attention

float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// model.attn_bf16: the bf16 launchers against the fp32 ones on the widened inputs, bitwise (the
// contract attention_tc.cuh states): the same bf16 values are staged whichever way they travel.
// `boff` bf16 elements of offset on q, k, v and o: 0 stages the mma kernels' tiles by cp.async
// (16-byte aligned bases), 4 (8 bytes) by 4-element vector loads, 1 by scalar loads.
void tc_bf16_case(const cpu::AttnShape& s, const std::vector<float>& q, const std::vector<float>& kk,
                  const std::vector<float>& v, const std::vector<float>& dout, size_t boff, const std::string& what) {
  const size_t nq = q.size(), nk = kk.size(), nl = size_t(s.B) * s.H * s.S;
  auto bits = [](float x) {
    const __nv_bfloat16 b = __float2bfloat16_rn(x);
    uint16_t u;
    std::memcpy(&u, &b, 2);
    return u;
  };
  auto widen = [](uint16_t u) {
    const uint32_t w = uint32_t(u) << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  };
  auto to_bf16 = [&](const std::vector<float>& x) {  // boff elements of padding first
    std::vector<uint16_t> y(x.size() + boff, 0);
    for (size_t i = 0; i < x.size(); ++i) y[boff + i] = bits(x[i]);
    return y;
  };
  auto widened = [&](const std::vector<uint16_t>& y) {
    std::vector<float> x(y.size() - boff);
    for (size_t i = 0; i < x.size(); ++i) x[i] = widen(y[boff + i]);
    return x;
  };
  auto as_bits = [](const std::vector<float>& x) {
    std::vector<uint32_t> u(x.size());
    std::memcpy(u.data(), x.data(), x.size() * 4);
    return u;
  };
  const auto qb = to_bf16(q), kb = to_bf16(kk), vb = to_bf16(v);
  const auto wq = widened(qb), wk = widened(kb), wv = widened(vb);
  std::vector<uint16_t> ob(nq + boff, 0xFFFF);
  auto lseb = CudaEmu::poisoned(nl), o32 = CudaEmu::poisoned(nq), lse32 = CudaEmu::poisoned(nl);
  const uint64_t copies = ::emu::g_async_copies.load();
  CudaEmu::ok(k::attention_tc_forward_bf16(ob.data() + boff, lseb.data(), qb.data() + boff, kb.data() + boff,
                                           vb.data() + boff, s, nullptr),
              what + " bf16");
  if (boff != 0) {
    EXPECT_EQ(::emu::g_async_copies.load(), copies) << what << ": cp.async needs 16-byte aligned rows";
  } else if (k::attention_tc_kernels().mma_fwd) {
    EXPECT_GT(::emu::g_async_copies.load(), copies) << what << ": aligned bf16 tiles go by cp.async";
  }
  CudaEmu::ok(k::attention_tc_forward(o32.data(), lse32.data(), wq.data(), wk.data(), wv.data(), s, nullptr), what);
  std::vector<uint16_t> o32b(nq);
  for (size_t i = 0; i < nq; ++i) o32b[i] = bits(o32[i]);
  EXPECT_EQ(std::vector<uint16_t>(ob.begin() + ptrdiff_t(boff), ob.end()), o32b) << what << " bf16 o";
  EXPECT_EQ(as_bits(lseb), as_bits(lse32)) << what << " bf16 lse";

  const auto wo = widened(ob);
  auto scratch = CudaEmu::poisoned(k::attention_tc_backward_scratch_floats(s));
  auto dqb = CudaEmu::poisoned(nq), dkb = CudaEmu::poisoned(nk), dvb = CudaEmu::poisoned(nk);
  auto dq32 = CudaEmu::poisoned(nq), dk32 = CudaEmu::poisoned(nk), dv32 = CudaEmu::poisoned(nk);
  const uint64_t bwd_copies = ::emu::g_async_copies.load();
  CudaEmu::ok(k::attention_tc_backward_bf16(dqb.data(), dkb.data(), dvb.data(), dout.data(), qb.data() + boff,
                                            kb.data() + boff, vb.data() + boff, ob.data() + boff, lseb.data(), s,
                                            scratch.data(), nullptr),
              what + " bf16");
  if (boff != 0) {
    EXPECT_EQ(::emu::g_async_copies.load(), bwd_copies) << what << ": cp.async needs 16-byte aligned rows";
  } else if (k::attention_tc_kernels().mma_bwd) {
    EXPECT_GT(::emu::g_async_copies.load(), bwd_copies) << what << ": aligned bf16 tiles go by cp.async";
  }
  CudaEmu::ok(k::attention_tc_backward(dq32.data(), dk32.data(), dv32.data(), dout.data(), wq.data(), wk.data(),
                                       wv.data(), wo.data(), lseb.data(), s, scratch.data(), nullptr),
              what);
  EXPECT_EQ(as_bits(dqb), as_bits(dq32)) << what << " bf16 dq";
  EXPECT_EQ(as_bits(dkb), as_bits(dk32)) << what << " bf16 dk";
  EXPECT_EQ(as_bits(dvb), as_bits(dv32)) << what << " bf16 dv";
}

// Forward and backward of one shape against the CPU kernel on the fp32 inputs (1e-2) and on the
// bf16-rounded q, k, v, dO (5e-3), the tolerances test_cuda_attention_tc.cpp argues. `off` floats
// of offset make every input unaligned (the scalar load path).
void tc_case(CudaEmu& t, std::mt19937_64& rng, cpu::AttnShape s, float qk, size_t off, const std::string& what) {
  s.scale = 1.0 / std::sqrt(double(s.hd));
  ASSERT_TRUE(k::attention_tc_supported(s)) << what;
  const size_t nq = size_t(s.B) * s.S * s.H * s.hd, nk = size_t(s.B) * s.S * s.KV * s.hd, nl = size_t(s.B) * s.H * s.S;
  auto rnd = [&](size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> x(n + off, 0.f);
    for (size_t i = off; i < n + off; ++i) x[i] = d(rng);
    return x;
  };
  const auto q = rnd(nq, -qk, qk), kk = rnd(nk, -qk, qk), v = rnd(nk, -1, 1), dout = rnd(nq, -1, 1);
  auto o = CudaEmu::poisoned(nq), lse = CudaEmu::poisoned(nl), dq = CudaEmu::poisoned(nq),
       dk = CudaEmu::poisoned(nk), dv = CudaEmu::poisoned(nk);
  auto scratch = CudaEmu::poisoned(k::attention_tc_backward_scratch_floats(s));
  CudaEmu::ok(k::attention_tc_forward(o.data(), lse.data(), q.data() + off, kk.data() + off, v.data() + off, s, nullptr),
              what);
  CudaEmu::ok(k::attention_tc_backward(dq.data(), dk.data(), dv.data(), dout.data() + off, q.data() + off,
                                       kk.data() + off, v.data() + off, o.data(), lse.data(), s, scratch.data(),
                                       nullptr),
              what);
  auto unpad = [&](const std::vector<float>& x, bool round) {
    std::vector<float> y(x.begin() + off, x.end());
    if (round)
      for (auto& e : y) e = bf16r(e);
    return y;
  };
  // Sharp softmax (qk = 6): only the rounded-input reference applies (rounding q and k moves scores
  // this large by more than 1e-2 relative in P), as in the GPU test.
  for (bool round : {true, false}) {
    if (!round && qk != 2.f) continue;
    const auto rq = unpad(q, round), rk = unpad(kk, round), rv = unpad(v, round), rd = unpad(dout, round);
    std::vector<float> ro(nq), rl(nl), rdq(nq), rdk(nk), rdv(nk);
    cpu::attention_forward<float>(ro.data(), rl.data(), rq.data(), rk.data(), rv.data(), s);
    cpu::attention_backward<float>(rdq.data(), rdk.data(), rdv.data(), rd.data(), rq.data(), rk.data(), rv.data(),
                                   ro.data(), rl.data(), s);
    const double tol = round ? 5e-3 : 1e-2;
    // At S = 1 the exact dq, dk are zero: measured against ||dv||. lse against max(||lse||, sqrt(n)):
    // an absolute error e in lse is a relative error e in every probability of its row.
    double fdv = 0;
    if (s.S == 1)
      for (float e : rdv) fdv += double(e) * e;
    const std::string tag = what + (round ? " (bf16 inputs)" : "");
    CudaEmu::check(o, ro, tol, tag + " o");
    CudaEmu::check(lse, rl, tol, tag + " lse", std::sqrt(double(nl)));
    CudaEmu::check(dq, rdq, tol, tag + " dq", std::sqrt(fdv));
    CudaEmu::check(dk, rdk, tol, tag + " dk", std::sqrt(fdv));
    CudaEmu::check(dv, rdv, tol, tag + " dv");
  }
  // The bf16 launchers: aligned (cp.async), or as unaligned as the fp32 inputs (off 1: scalar
  // loads; 3: 8-byte vector loads).
  tc_bf16_case(s, unpad(q, false), unpad(kk, false), unpad(v, false), unpad(dout, false), off == 3 ? 4 : off, what);
  (void)t;
}

struct TcCase {
  cpu::AttnShape s;
  float qk;
  size_t off;
};

// The shapes of the tensor-core attention tests (both kernel families).
std::vector<TcCase> tc_cases() {
  using Case = TcCase;
  std::vector<Case> cases;
  if (full()) {  // test_cuda_attention_tc.cpp's shapes (run.sh tc)
    for (int hd : {64, 128})
      for (int S : {1, 17, 128, 300})
        for (int gqa = 0; gqa < 2; ++gqa)
          for (int W : {0, 5, 64}) cases.push_back({{2, S, gqa ? 8 : 2, 2, hd, W, 0}, 2.f, 0});
    for (int hd : {64, 128}) {
      cases.push_back({{2, 300, 8, 2, hd, 0, 0}, 6.f, 0});
      cases.push_back({{1, 300, 4, 4, hd, 100, 0}, 6.f, 0});
    }
    cases.push_back({{2, 77, 8, 2, 64, 0, 0}, 2.f, 1});
    cases.push_back({{1, 130, 4, 1, 128, 17, 0}, 2.f, 3});
  } else {
    // Both head dims, causal and windowed, MHA and GQA, S = 1, partial tiles, a second query tile,
    // a sharp softmax, unaligned inputs.
    cases = {{{1, 17, 2, 1, 64, 5, 0}, 2.f, 0},   {{1, 80, 2, 2, 128, 0, 0}, 2.f, 0},
             {{1, 70, 4, 1, 64, 64, 0}, 2.f, 1},  {{1, 130, 4, 1, 128, 64, 0}, 6.f, 0},
             {{2, 1, 2, 2, 64, 0, 0}, 2.f, 0},    {{1, 100, 4, 2, 64, 0, 0}, 6.f, 3},
             {{1, 300, 2, 1, 64, 100, 0}, 2.f, 0}};  // a window wider than a tile: whole tiles in it
    if (quick()) cases.resize(4);
  }
  return cases;
}

void run_tc_cases(CudaEmu& t, std::mt19937_64& rng, const char* name) {
  for (const auto& c : tc_cases()) {
    const std::string what = CudaEmu::fmt("%s B=%d S=%d H=%d KV=%d hd=%d W=%d qk=%g%s", name, c.s.B, c.s.S, c.s.H, c.s.KV,
                                 c.s.hd, c.s.window, c.qk, c.off ? " unaligned" : "");
    tc_case(t, rng, c.s, c.qk, c.off, what);
  }
}

// Selects the attention_tc launchers' kernels for one test, and restores the previous choice.
struct TcKernels {
  explicit TcKernels(k::AttnTcKernels want) : saved(k::attention_tc_kernels()) { k::attention_tc_set_kernels(want); }
  ~TcKernels() { k::attention_tc_set_kernels(saved); }
  k::AttnTcKernels saved;
};

TEST_F(CudaEmu, AttentionTcAgainstCpu) {
  const TcKernels wmma(k::AttnTcKernels{false, false});
  run_tc_cases(*this, rng_, "attn_tc");
  // Other head dims: not supported, and refused without a launch.
  const cpu::AttnShape bad{1, 4, 2, 2, 96, 0, 0.1};
  EXPECT_FALSE(k::attention_tc_supported(bad));
  EXPECT_EQ(k::attention_tc_forward(nullptr, nullptr, nullptr, nullptr, nullptr, bad, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// The register-resident (mma.sync) kernels on the same shapes and bounds: the forward with the WMMA
// backward, the backward with the WMMA forward, and both.
TEST_F(CudaEmu, AttentionMmaForwardAgainstCpu) {
  const TcKernels mma(k::AttnTcKernels{true, false});
  run_tc_cases(*this, rng_, "attn_mma fwd");
}
TEST_F(CudaEmu, AttentionMmaBackwardAgainstCpu) {
  const TcKernels mma(k::AttnTcKernels{false, true});
  run_tc_cases(*this, rng_, "attn_mma bwd");
}
TEST_F(CudaEmu, AttentionMmaAgainstCpu) {
  const TcKernels mma(k::AttnTcKernels{true, true});
  run_tc_cases(*this, rng_, "attn_mma");
}

}  // namespace
}  // namespace ladder
