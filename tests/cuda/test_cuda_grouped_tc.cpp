// The bf16 tensor-core grouped GEMM (backend/cuda/grouped_gemm_tc.cu) on the GPU against
// cpu::grouped_gemm<float>: the cases, references and bounds of grouped_tc_cases.h (shared with the
// emulated test tests/cuda/emu/test_emu_grouped_tc.cpp, where the same comparisons run without a
// GPU). Both shapes, both transB, alpha/beta, beta 0 on a poisoned C, empty experts, skewed loads,
// odd sizes, misaligned pointers, C outside the output untouched, two runs bitwise identical; plus a
// throughput print (no assertion) at an MoE-like size against the fp32 kernel of moe_ops.cu. The
// correctness tests run for each implementation of the tile product (mma.sync with ldmatrix, the
// default; WMMA; and, on an sm_90 device, the wgmma kernels of grouped_gemm_wgmma.cu: grouped_tc_cases.h's
// for_each_tile_product), plus CudaGroupedTc.Wgmma* on the wgmma kernels' cp.async path (bf16
// operands) and at MoE sizes; the throughput prints them side by side.
// Without a GPU each test calls GTEST_SKIP() with "no CUDA device: GPU test skipped (<reason>)".
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device_memory.h"
#include "backend/cuda/lt_gemm.h"
#include "cuda_fixture.h"
#include "backend/cuda/grouped_gemm_tc.cuh"
#include "backend/cuda/grouped_gemm_wgmma.cuh"
#include "backend/cuda/moe_ops.cuh"
#include "grouped_tc_cases.h"

namespace ladder {
namespace {

using cuda::DeviceBuffer;
namespace k = cuda::k;
namespace gt = grouped_tc;

class CudaGroupedTc : public test::CudaFixture {
 protected:
  static void SetUpTestSuite() {
    CudaFixture::SetUpTestSuite();
    if (be_) sms_ = be_->device().sm_count;
  }
  // The launcher on the legacy default stream (ordered with device_memory.h's copies).
  static void run(const gt::Case& c, const gt::Problem& p, std::vector<float>& C, int sms) {
    auto d_off = up(p.off);
    auto d_A = up(p.A), d_B = up(p.B), d_C = up(C);
    DeviceBuffer<int32_t> scratch(k::grouped_gemm_tc_scratch_ints(c.E));
    const int s = p.shift;
    ASSERT_EQ(k::grouped_gemm_tc(c.rows_out, c.transB, c.E, d_off.data(), c.M, c.N, c.K, c.alpha, d_A.data() + s,
                                 p.lda, d_B.data() + s, p.ldb, p.sB, c.beta, d_C.data() + s, p.ldc, p.sC,
                                 scratch.data(), sms, nullptr),
              cudaSuccess);
    cuda::device_synchronize();
    C = d_C.download();
    C.resize(p.C.size());
  }

  // f() with each tile product selected in turn (mma.sync, WMMA, wgmma where available:
  // grouped_tc_cases.h).
  template <class F>
  static void for_each(F&& f) {
    gt::for_each_tile_product(f);
  }

  // Larger MoE-like problems (many row tiles, reductions over hundreds of steps), both shapes, with
  // one implementation: a test each (on the emulated backend the mma.sync one takes minutes, the
  // WMMA one ~20 s; tests/cuda/emu/CMakeLists.txt leaves the former out of CTest).
  void large_shapes(bool mma) {
    const bool prev = k::grouped_gemm_tc_mma();
    k::grouped_gemm_tc_set_mma(mma);
    const gt::Case cases[] = {
        {true, true, 16, 0, 1000, 777, 0, 1.f, 0.f, 600},
        {true, false, 16, 0, 512, 1024, 1, 1.f, 1.f, 600, 1},
        {false, false, 16, 768, 520, 0, 0, 1.f, 1.f, 600},
        {false, false, 4, 300, 260, 0, 0, 1.f, 0.f, 2000, 0, true},
    };
    for (const auto& c : cases)
      gt::run_case(c, rng_, [&](const gt::Problem& p, std::vector<float>& C) { run(c, p, C, sms_); });
    k::grouped_gemm_tc_set_mma(prev);
  }

  // The case through grouped_gemm_tc_ex with its operands as the wgmma kernels take them
  // (grouped_tc_cases.h's wgmma_operands: bf16, aligned for cp.async) and wgmma selected; C fp32, or
  // bf16 bits (c16).
  template <class T>
  static void run_wgmma(const gt::Case& c, const gt::Problem& p, std::vector<T>& C, bool c16, int sms) {
    const gt::Bf16Operands o = gt::wgmma_operands(c, p);
    auto d_off = up(p.off);
    auto d_A = up(o.A), d_B = up(o.B);
    auto d_C = up(C);
    DeviceBuffer<int32_t> scratch(k::grouped_gemm_tc_scratch_ints(c.E));
    const int s = p.shift;
    ASSERT_EQ(k::grouped_gemm_tc_ex(c.rows_out, c.transB, c.E, d_off.data(), c.M, c.N, c.K, c.alpha, d_A.data(), true,
                                    o.lda, d_B.data(), true, o.ldb, o.sB, c.beta, d_C.data() + s, c16, p.ldc, p.sC,
                                    scratch.data(), sms, nullptr),
              cudaSuccess);
    cuda::device_synchronize();
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    C = d_C.download();
    C.resize(p.C.size());
  }
  // Skips where the wgmma kernels cannot run (no sm_90 device or no sm_90a code in the build) or
  // LADDER_TEST_WGMMA=0 (grouped_tc_cases.h's wgmma_tests_on).
  static bool wgmma_skip() { return !gt::wgmma_tests_on(); }

  static inline int sms_ = 0;
};

TEST_F(CudaGroupedTc, BothShapes) {
  for_each([&] {
    for (const auto& c : gt::cases(false))
      gt::run_case(c, rng_, [&](const gt::Problem& p, std::vector<float>& C) { run(c, p, C, sms_); });
  });
}

TEST_F(CudaGroupedTc, LargeShapes) { large_shapes(true); }
TEST_F(CudaGroupedTc, LargeShapesWmma) { large_shapes(false); }

// The rows_out grid only sets which block takes which tile: different grids give the same bits.
TEST_F(CudaGroupedTc, GridIndependent) {
  for_each([&] {
    const gt::Case c{true, false, 9, 0, 300, 200, 1, 1.f, 0.5f, 200, 1};
    const gt::Problem p = gt::make_problem(c, rng_);
    std::vector<float> a = p.C, b = p.C, d = p.C;
    run(c, p, a, 1);
    run(c, p, b, sms_);
    run(c, p, d, 3 * sms_ + 1);
    EXPECT_EQ(a, b);
    EXPECT_EQ(a, d);
  });
}

// grouped_gemm_tc_ex with a bf16 C (c_bf16): every output element is the round-to-nearest-even of
// what the fp32-output run writes there, bitwise (the same tiles and accumulation, only the store
// differs); C outside the output keeps its (poisoned) bits. Every case with beta 0, both shapes (the
// emulated twin: CudaEmuGroupedTc.Bf16OutputIsTheFp32OutputRounded). With beta != 0 a bf16 C is
// refused (cudaErrorInvalidValue), nothing launched.
TEST_F(CudaGroupedTc, Bf16OutputIsTheFp32OutputRounded) {
  for_each([&] {
    int ran = 0;
    for (const auto& c : gt::cases(false)) {
      if (c.beta != 0.f) continue;
      SCOPED_TRACE(c.name());
      const gt::Problem p = gt::make_problem(c, rng_);
      const int s = p.shift;
      std::vector<float> ref(p.C.size());
      std::memset(ref.data(), 0xFF, ref.size() * sizeof(float));  // beta 0: C not read
      run(c, p, ref, sms_);
      if (HasFatalFailure()) return;
      auto d_off = up(p.off);
      auto d_A = up(p.A), d_B = up(p.B);
      auto d_C = poisoned<uint16_t>(p.C.size());
      DeviceBuffer<int32_t> scratch(k::grouped_gemm_tc_scratch_ints(c.E));
      ASSERT_EQ(k::grouped_gemm_tc_ex(c.rows_out, c.transB, c.E, d_off.data(), c.M, c.N, c.K, c.alpha, d_A.data() + s,
                                      false, p.lda, d_B.data() + s, false, p.ldb, p.sB, 0.f, d_C.data() + s, true,
                                      p.ldc, p.sC, scratch.data(), sms_, nullptr),
                cudaSuccess);
      cuda::device_synchronize();
      std::vector<uint16_t> got = d_C.download();
      got.resize(p.C.size());
      ran += gt::check_bf16_output(c, p, got, ref);
    }
    EXPECT_GE(ran, 4);
    // beta != 0 with a bf16 C: refused before any launch.
    const gt::Case c{true, true, 3, 0, 5, 4, 0, 1.f, 0.5f, 10};
    const gt::Problem p = gt::make_problem(c, rng_);
    auto d_off = up(p.off);
    auto d_A = up(p.A), d_B = up(p.B);
    auto d_C = poisoned<uint16_t>(p.C.size());
    DeviceBuffer<int32_t> scratch(k::grouped_gemm_tc_scratch_ints(c.E));
    for (bool rows_out : {true, false})
      EXPECT_EQ(k::grouped_gemm_tc_ex(rows_out, c.transB, c.E, d_off.data(), 4, c.N, c.K, 1.f, d_A.data(), false,
                                      p.lda, d_B.data(), false, p.ldb, p.sB, 0.5f, d_C.data(), true, c.N,
                                      size_t(4) * c.N, scratch.data(), sms_, nullptr),
                cudaErrorInvalidValue)
          << "rows_out " << rows_out;
    cuda::device_synchronize();
    EXPECT_EQ(d_C.download(), std::vector<uint16_t>(d_C.download().size(), 0xFFFF));
  });
}

TEST_F(CudaGroupedTc, AllExpertsEmpty) {
  for_each([&] {
    const int E = 5, M = 20, N = 30;
    const std::vector<int32_t> off(E + 1, 0);
    auto d_off = up(off);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    std::vector<float> C(size_t(E) * M * N);
    for (auto& x : C) x = u(rng_);
    for (float beta : {0.f, 1.f, -2.f}) {
      auto d_C = up(C);
      if (beta == 0.f) d_C.poison();
      ASSERT_EQ(k::grouped_gemm_tc(false, false, E, d_off.data(), M, N, 0, 1.f, nullptr, M, nullptr, N, 0, beta,
                                   d_C.data(), N, size_t(M) * N, nullptr, sms_, nullptr),
                cudaSuccess);
      std::vector<float> ref = C;
      cpu::grouped_gemm<float>(false, false, E, off.data(), M, N, 0, 1.f, nullptr, M, nullptr, N, 0, beta, ref.data(),
                               N, size_t(M) * N);
      EXPECT_EQ(d_C.download(), ref) << "beta " << beta;
    }
    DeviceBuffer<int32_t> scratch(k::grouped_gemm_tc_scratch_ints(E));
    auto d_R = up(std::vector<float>(C.begin(), C.begin() + 7));
    ASSERT_EQ(k::grouped_gemm_tc(true, true, E, d_off.data(), 0, N, M, 1.f, nullptr, M, nullptr, M, size_t(N) * M, 0.f,
                                 d_R.data(), N, 0, scratch.data(), sms_, nullptr),
              cudaSuccess);
    EXPECT_EQ(d_R.download(), std::vector<float>(C.begin(), C.begin() + 7));
  });
}

// The wgmma implementation (grouped_gemm_wgmma.cu, selected by grouped_gemm_tc_set_wgmma), beyond
// the tests above (which run it on the cases' own operands: fp32, through registers): every case
// with its operands in bf16 aligned for cp.async (grouped_tc_cases.h's wgmma_operands), against the
// same references and bounds; MoE-sized shapes; a bf16 C (the rounding of the fp32 output, bitwise)
// and grid independence. Read after CudaWgmma.* (the layout facts); skipped where no sm_90a code
// can run.
TEST_F(CudaGroupedTc, WgmmaBothShapes) {
  if (wgmma_skip()) GTEST_SKIP() << "wgmma kernels not run here (no sm_90a code for this device, or LADDER_TEST_WGMMA=0)";
  gt::with_wgmma([&] {
    for (const auto& c : gt::cases(false))
      gt::run_case(c, rng_, [&](const gt::Problem& p, std::vector<float>& C) { run_wgmma(c, p, C, false, sms_); });
  });
}

// MoE sizes on the wgmma kernels, both staging paths: fp32 operands (registers) and bf16 ones
// aligned for cp.async.
TEST_F(CudaGroupedTc, WgmmaLargeShapes) {
  if (wgmma_skip()) GTEST_SKIP() << "wgmma kernels not run here (no sm_90a code for this device, or LADDER_TEST_WGMMA=0)";
  const gt::Case cases[] = {
      {true, true, 16, 0, 1000, 777, 0, 1.f, 0.f, 600},
      {true, false, 16, 0, 512, 1024, 1, 1.f, 1.f, 600, 1},
      {false, false, 16, 768, 520, 0, 0, 1.f, 1.f, 600},
      {false, false, 4, 300, 260, 0, 0, 1.f, 0.f, 2000, 0, true},
  };
  gt::with_wgmma([&] {
    for (const auto& c : cases) {
      gt::run_case(c, rng_, [&](const gt::Problem& p, std::vector<float>& C) { run(c, p, C, sms_); });
      gt::run_case(c, rng_, [&](const gt::Problem& p, std::vector<float>& C) { run_wgmma(c, p, C, false, sms_); });
    }
  });
}

TEST_F(CudaGroupedTc, WgmmaBf16OutputAndGrid) {
  if (wgmma_skip()) GTEST_SKIP() << "wgmma kernels not run here (no sm_90a code for this device, or LADDER_TEST_WGMMA=0)";
  gt::with_wgmma([&] {
    int ran = 0;
    for (const auto& c : gt::cases(false)) {
      if (c.beta != 0.f) continue;
      SCOPED_TRACE(c.name());
      const gt::Problem p = gt::make_problem(c, rng_);
      std::vector<float> ref(p.C.size()), other(p.C.size());
      std::memset(ref.data(), 0xFF, ref.size() * sizeof(float));
      std::memset(other.data(), 0xFF, other.size() * sizeof(float));
      run_wgmma(c, p, ref, false, sms_);
      run_wgmma(c, p, other, false, 3);
      if (HasFatalFailure()) return;
      EXPECT_EQ(std::memcmp(ref.data(), other.data(), ref.size() * sizeof(float)), 0) << "grid-dependent bits";
      std::vector<uint16_t> got(p.C.size(), 0xFFFF);
      run_wgmma(c, p, got, true, sms_);
      if (HasFatalFailure()) return;
      ran += gt::check_bf16_output(c, p, got, ref);
    }
    EXPECT_GE(ran, 4);
  });
}

// Under bf16 precision the backend's grouped_gemm reads expert weights (B of the rows_out shape)
// from the bf16 mirror of registered weights (grouped_gemm_tc_ex): bitwise what the same values
// outside the registered arena give, and still after the weights change (the mirror is re-cast).
TEST_F(CudaGroupedTc, BackendReadsExpertWeightsThroughTheMirror) {
  auto bf = make_cuda_backend("bf16");
  const int E = 6, f = 40, d = 36;
  std::vector<int32_t> off(E + 1, 0);
  std::uniform_int_distribution<int> rows(0, 150);
  for (int e = 0; e < E; ++e) off[e + 1] = off[e] + (e == 2 ? 0 : rows(rng_));
  const int total = off[E];
  auto d_off = up(off);
  const size_t wn = size_t(E) * f * d;
  DeviceBuffer<float> W(wn), Wc(wn);  // W registered (mirrored), Wc a plain copy
  bf->register_weights(W.data(), wn * sizeof(float));
  auto X = up(randv(size_t(total) * d)), Y = up(randv(size_t(total) * f));
  for (int round = 0; round < 2; ++round) {
    const std::vector<float> w = randv(wn);
    bf->upload(W.data(), w.data(), wn * sizeof(float));  // a write into the weights: the mirror goes stale
    Wc.upload(w);
    for (bool transB : {true, false}) {
      // transB: y [rows, f] = x W_e^T (W_e [f, d]); else dx [rows, d] = dy W_e.
      const int N = transB ? f : d, K = transB ? d : f;
      const float* A = transB ? X.data() : Y.data();
      auto C1 = poisoned(size_t(total) * N), C2 = poisoned(size_t(total) * N);
      bf->grouped_gemm(true, transB, E, d_off.data(), 0, N, K, 1.f, A, K, W.data(), d, size_t(f) * d,
                       0.f, C1.data(), N, 0);
      bf->grouped_gemm(true, transB, E, d_off.data(), 0, N, K, 1.f, A, K, Wc.data(), d, size_t(f) * d,
                       0.f, C2.data(), N, 0);
      bf->synchronize();
      const auto a = C1.download(), b = C2.download();
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
          << "round " << round << " transB " << transB;
      EXPECT_TRUE(std::all_of(a.begin(), a.end(), [](float v) { return std::isfinite(v); }));
    }
  }
  bf->unregister_weights(W.data());
}

// Throughput at an MoE-like size (E experts, uniform load, d_model x d_ff experts): the three GEMMs
// of an expert FFN layer's forward and backward (rows_out with and without transB, weight gradient),
// tensor-core kernel vs the fp32 kernel. Printed only: a number to read when a GPU is lent.
TEST_F(CudaGroupedTc, Throughput) {
  const int E = 64, rows_per = 512, d = 2048, f = 1024, total = E * rows_per;
  std::vector<int32_t> off(E + 1);
  for (int e = 0; e <= E; ++e) off[e] = e * rows_per;
  auto d_off = up(off);
  DeviceBuffer<float> X(size_t(total) * d), W(size_t(E) * f * d), Y(size_t(total) * f), G(size_t(E) * f * d);
  std::vector<float> init(size_t(E) * f * d);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& x : init) x = u(rng_);
  W.upload(init);
  std::vector<uint16_t> w16(init.size());  // the weights' bf16 mirror, as the bf16 backend reads them
  for (size_t i = 0; i < init.size(); ++i) w16[i] = cpu::bf16_bits(init[i]);
  DeviceBuffer<uint16_t> W16(w16.size());
  W16.upload(w16);
  init.resize(size_t(total) * d);
  X.upload(init);
  std::vector<uint16_t> x16(init.size());  // the activations in bf16, as model.moe_bf16 keeps them
  for (size_t i = 0; i < init.size(); ++i) x16[i] = cpu::bf16_bits(init[i]);
  DeviceBuffer<uint16_t> X16(x16.size());
  X16.upload(x16);
  init.resize(size_t(total) * f);
  Y.upload(init);
  DeviceBuffer<int32_t> scratch(k::grouped_gemm_tc_scratch_ints(E));
  cudaEvent_t t0, t1;
  ASSERT_EQ(cudaEventCreate(&t0), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&t1), cudaSuccess);
  const double flops = 2.0 * total * double(d) * f;
  struct Op {
    const char* name;
    bool rows_out, transB;
    int M, N, K, lda, ldb, ldc;
    const float* A;
    const float* B;
    size_t sB, sC;
    float* C;
  };
  const Op ops[] = {
      // y = x W_e^T (W_e [f, d]); dx = dy W_e; dW_e = dy^T x
      {"fwd  rows_out tB=1", true, true, 0, f, d, d, d, f, X.data(), W.data(), size_t(f) * d, 0, Y.data()},
      {"dgrad rows_out tB=0", true, false, 0, d, f, f, d, d, Y.data(), W.data(), size_t(f) * d, 0, X.data()},
      {"wgrad            ", false, false, f, d, 0, f, d, d, Y.data(), X.data(), 0, size_t(f) * d, G.data()},
  };
  // tc 0: the fp32 kernel; 1: tensor cores, fp32 operands; 2: tensor cores, the weights (B of the
  // rows_out shapes) in bf16, as the bf16 backend passes them (staged by cp.async); 3: also the
  // activations x in bf16 (model.moe_bf16): the forward reads both operands by cp.async, the weight
  // gradient its x.
  const bool prev = k::grouped_gemm_tc_mma(), prev_wg = k::grouped_gemm_tc_wgmma();
  for (const Op& o : ops)
    for (int run = 0; run < 10; ++run) {
      // runs 4..6: tc 1..3 with the WMMA tile product (grouped_gemm_tc_set_mma(false)), to compare;
      // runs 7..9: with the wgmma kernels (where gt::wgmma_tests_on()), the same operand mixes.
      const bool wmma = run > 3 && run < 7, wgmma = run > 6;
      const int tc = wgmma ? run - 6 : wmma ? run - 3 : run;
      if (wgmma && !gt::wgmma_tests_on()) continue;
      k::grouped_gemm_tc_set_mma(!wmma);
      k::grouped_gemm_tc_set_wgmma(wgmma);
      if (tc == 2 && !o.rows_out) continue;
      if (tc == 3 && o.name[0] == 'd') continue;  // the data gradient reads no x
      auto launch = [&] {
        if (tc == 3 && o.rows_out)
          return k::grouped_gemm_tc_ex(o.rows_out, o.transB, E, d_off.data(), o.M, o.N, o.K, 1.f, X16.data(), true,
                                       o.lda, W16.data(), true, o.ldb, o.sB, 0.f, o.C, false, o.ldc, o.sC,
                                       scratch.data(), sms_, nullptr);
        if (tc == 3)
          return k::grouped_gemm_tc_ex(o.rows_out, o.transB, E, d_off.data(), o.M, o.N, o.K, 1.f, o.A, false, o.lda,
                                       X16.data(), true, o.ldb, o.sB, 0.f, o.C, false, o.ldc, o.sC, scratch.data(),
                                       sms_, nullptr);
        if (tc == 2)
          return k::grouped_gemm_tc_ex(o.rows_out, o.transB, E, d_off.data(), o.M, o.N, o.K, 1.f, o.A, false, o.lda,
                                       W16.data(), true, o.ldb, o.sB, 0.f, o.C, false, o.ldc, o.sC, scratch.data(), sms_,
                                       nullptr);
        return tc ? k::grouped_gemm_tc(o.rows_out, o.transB, E, d_off.data(), o.M, o.N, o.K, 1.f, o.A, o.lda, o.B,
                                       o.ldb, o.sB, 0.f, o.C, o.ldc, o.sC, scratch.data(), sms_, nullptr)
                  : k::grouped_gemm(o.rows_out, o.transB, E, d_off.data(), o.M, o.N, o.K, 1.f, o.A, o.lda, o.B,
                                    o.ldb, o.sB, 0.f, o.C, o.ldc, o.sC, scratch.data(), nullptr);
      };
      ASSERT_EQ(launch(), cudaSuccess);  // warm-up
      const int reps = tc ? 10 : 2;
      cudaEventRecord(t0, nullptr);
      for (int r = 0; r < reps; ++r) ASSERT_EQ(launch(), cudaSuccess);
      cudaEventRecord(t1, nullptr);
      cuda::device_synchronize();
      float ms = 0;
      cudaEventElapsedTime(&ms, t0, t1);
      const char* kind = tc == 3 ? "bf16 (x+W bf16)" : tc == 2 ? "bf16 (W bf16)" : tc ? "bf16" : "fp32";
      std::printf("[ thruput  ] %s %-15s %-5s E=%d rows=%d d=%d f=%d: %.3f ms, %.1f TFLOP/s\n", o.name, kind,
                  wgmma ? "wgmma" : wmma ? "wmma" : tc ? "mma" : "", E, total, d, f, ms / reps,
                  flops * reps / (ms * 1e-3) / 1e12);
    }
  k::grouped_gemm_tc_set_mma(prev);
  // Both operands bf16 (the wgmma kernels' calls): y = x W^T, dx = dy W, dW = dy^T x with x, dy and
  // W in bf16, the mma.sync kernels vs the wgmma ones (where an sm_90a device runs them).
  std::vector<uint16_t> y16(size_t(total) * f);
  {
    std::vector<float> y(size_t(total) * f);
    for (auto& v : y) v = u(rng_);
    for (size_t i = 0; i < y.size(); ++i) y16[i] = cpu::bf16_bits(y[i]);
  }
  DeviceBuffer<uint16_t> Y16(y16.size());
  Y16.upload(y16);
  for (const Op& o : ops)
    for (bool wgmma : {false, true}) {
      if (wgmma && !gt::wgmma_tests_on()) continue;
      k::grouped_gemm_tc_set_wgmma(wgmma);
      const void* A = o.name[0] == 'f' ? static_cast<const void*>(X16.data()) : Y16.data();
      const void* B = o.rows_out ? static_cast<const void*>(W16.data()) : X16.data();
      auto launch = [&] {
        return k::grouped_gemm_tc_ex(o.rows_out, o.transB, E, d_off.data(), o.M, o.N, o.K, 1.f, A, true, o.lda, B, true,
                                     o.ldb, o.sB, 0.f, o.C, false, o.ldc, o.sC, scratch.data(), sms_, nullptr);
      };
      ASSERT_EQ(launch(), cudaSuccess);  // warm-up
      const int reps = 10;
      cudaEventRecord(t0, nullptr);
      for (int r = 0; r < reps; ++r) ASSERT_EQ(launch(), cudaSuccess);
      cudaEventRecord(t1, nullptr);
      cuda::device_synchronize();
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
      float ms = 0;
      cudaEventElapsedTime(&ms, t0, t1);
      std::printf("[ thruput  ] %s %-15s %-5s E=%d rows=%d d=%d f=%d: %.3f ms, %.1f TFLOP/s\n", o.name, "bf16 (all bf16)",
                  wgmma ? "wgmma" : "mma", E, total, d, f, ms / reps, flops * reps / (ms * 1e-3) / 1e12);
    }
  k::grouped_gemm_tc_set_wgmma(prev_wg);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
}

// The question behind a capacity layout for the experts (docs/cuda.md, "What is left"): how fast
// would the same expert GEMMs run as ONE strided-batched cuBLASLt call, each expert padded to a
// fixed capacity C of rows? At the two MoE presets' shapes (uniform load, all operands bf16, fp32
// output): the grouped GEMM (mma.sync; wgmma where it runs) against cuBLASLt batched with C = the
// load (perfect balance) and C = 1.25 x the load rounded up to 128 rows (the padding a dropless
// capacity layout would carry). Rates count the real rows' FLOPs only. Printed, not asserted.
TEST_F(CudaGroupedTc, ThroughputAgainstBatchedCublasLt) {
  struct Shape {
    const char* preset;
    int E, rows_per, d, f;
  };
  cudaEvent_t t0, t1;
  ASSERT_EQ(cudaEventCreate(&t0), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&t1), cudaSuccess);
  auto time_ms = [&](const std::function<cudaError_t()>& launch) {
    EXPECT_EQ(launch(), cudaSuccess);  // warm-up (and the plan's first use)
    const int reps = 10;
    cudaEventRecord(t0, nullptr);
    for (int r = 0; r < reps; ++r) EXPECT_EQ(launch(), cudaSuccess);
    cudaEventRecord(t1, nullptr);
    cuda::device_synchronize();
    float ms = 0;
    cudaEventElapsedTime(&ms, t0, t1);
    return double(ms) / reps;
  };
  cuda::LtGemm lt(nullptr);
  const bool prev_wg = k::grouped_gemm_tc_wgmma();
  for (const Shape& sh : {Shape{"moe-d1024", 64, 1024, 1024, 512}, Shape{"moe-d2048", 64, 512, 2048, 1024}}) {
    const int E = sh.E, d = sh.d, f = sh.f, total = E * sh.rows_per;
    const int cap = (sh.rows_per * 5 / 4 + 127) / 128 * 128;  // 1.25 x the load, whole 128-row tiles
    std::vector<int32_t> off(E + 1);
    for (int e = 0; e <= E; ++e) off[e] = e * sh.rows_per;
    auto d_off = up(off);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    auto random16 = [&](size_t n) {
      std::vector<uint16_t> h(n);
      for (auto& x : h) x = cpu::bf16_bits(u(rng_));
      DeviceBuffer<uint16_t> b(n);
      b.upload(h);
      return b;
    };
    // Buffers sized for the padded layout (E x cap rows); the grouped GEMM reads the first `total`.
    DeviceBuffer<uint16_t> X16 = random16(size_t(E) * cap * d), Y16 = random16(size_t(E) * cap * f),
                           W16 = random16(size_t(E) * f * d);
    DeviceBuffer<float> out(size_t(E) * cap * std::max(d, f)), G(size_t(E) * f * d);
    DeviceBuffer<int32_t> scratch(k::grouped_gemm_tc_scratch_ints(E));
    const double flops = 2.0 * total * double(d) * f;
    struct Op {
      const char* name;
      bool rows_out, transB;
      int M, N, K, lda, ldb, ldc;
      const uint16_t *A, *B;
      size_t sB, sC;
      float* C;
    };
    const Op ops[] = {
        {"fwd  y = x W^T ", true, true, 0, f, d, d, d, f, X16.data(), W16.data(), size_t(f) * d, 0, out.data()},
        {"dgrad dx = dy W", true, false, 0, d, f, f, d, d, Y16.data(), W16.data(), size_t(f) * d, 0, out.data()},
        {"wgrad dW = dy^T x", false, false, f, d, 0, f, d, d, Y16.data(), X16.data(), 0, size_t(f) * d, G.data()},
    };
    for (const Op& o : ops) {
      auto print = [&](const char* how, double ms) {
        std::printf("[ thruput  ] experts %-7s %-17s %-26s E=%d rows/expert=%d d=%d f=%d: %.3f ms, %.1f TFLOP/s\n",
                    sh.preset, o.name, how, E, sh.rows_per, d, f, ms, flops / (ms * 1e-3) / 1e12);
      };
      for (bool wgmma : {false, true}) {
        if (wgmma && !gt::wgmma_tests_on()) continue;
        k::grouped_gemm_tc_set_wgmma(wgmma);
        print(wgmma ? "grouped wgmma" : "grouped mma.sync", time_ms([&] {
                return k::grouped_gemm_tc_ex(o.rows_out, o.transB, E, d_off.data(), o.M, o.N, o.K, 1.f, o.A, true,
                                             o.lda, o.B, true, o.ldb, o.sB, 0.f, o.C, false, o.ldc, o.sC,
                                             scratch.data(), sms_, nullptr);
              }));
      }
      k::grouped_gemm_tc_set_wgmma(prev_wg);
      for (int C : {sh.rows_per, cap}) {
        // Expert e's rows at e * C: x_e [C, d], dy_e [C, f]; W_e [f, d]; dW_e [f, d].
        const double ms = time_ms([&] {
          if (o.name[0] == 'f')
            lt.run_batched(cuda::GemmType::BF16, false, true, C, f, d, 1.f, o.A, d, int64_t(C) * d, o.B, d,
                           int64_t(f) * d, 0.f, o.C, f, int64_t(C) * f, E);
          else if (o.name[0] == 'd')
            lt.run_batched(cuda::GemmType::BF16, false, false, C, d, f, 1.f, o.A, f, int64_t(C) * f, o.B, d,
                           int64_t(f) * d, 0.f, o.C, d, int64_t(C) * d, E);
          else
            lt.run_batched(cuda::GemmType::BF16, true, false, f, d, C, 1.f, o.A, f, int64_t(C) * f, o.B, d,
                           int64_t(C) * d, 0.f, o.C, d, int64_t(f) * d, E);
          return cudaGetLastError();
        });
        const std::string how = "cuBLASLt batched C=" + std::to_string(C);
        print(how.c_str(), ms);
      }
    }
  }
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
}

}  // namespace
}  // namespace ladder
