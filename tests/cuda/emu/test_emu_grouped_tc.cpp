// The bf16 tensor-core grouped GEMM (src/backend/cuda/grouped_gemm_tc.cu, rewritten by emulate.py,
// run by emu_cuda.h's host threads) against cpu::grouped_gemm<float>, with no GPU: the cases and
// bounds of tests/cuda/grouped_tc_cases.h, which the GPU test (tests/cuda/test_cuda_grouped_tc.cpp)
// runs too. Pointers are host pointers (the emulated device memory is the host's). The emulated
// WMMA multiplies the bf16 fragments in fp32 like the device (its internal summation order aside), so
// this checks everything but the device's timing and memory model: tile mapping from device-side
// offsets, staging, zero padding of partial tiles, layouts, epilogue, alpha/beta, determinism.
// Every test runs for each implementation of the tile product (grouped_tc_cases.h's
// for_each_tile_product: mma.sync with ldmatrix, the default; WMMA; and the wgmma kernels of
// grouped_gemm_wgmma.cu on emu_cuda.h's wgmma), each against the same references.
// EMU_SEED=N repeats a run's inputs; EMU_QUICK=1 (sanitizer builds) drops the costlier shapes.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../grouped_tc_cases.h"
#include "backend/cpu/kernels.h"
#include "backend/cuda/grouped_gemm_tc.cuh"
#include "emu_cuda.h"

namespace ladder {
namespace {

namespace k = cuda::k;
namespace gt = grouped_tc;

bool quick() {
  static const bool q = std::getenv("EMU_QUICK") && std::string(std::getenv("EMU_QUICK")) != "0";
  return q;
}

class CudaEmuGroupedTc : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* env = std::getenv("EMU_SEED");
    const uint64_t seed = env ? std::strtoull(env, nullptr, 10) : std::random_device{}();
    rng_.seed(seed);
    std::printf("[ seed     ] %llu (EMU_SEED=%llu repeats it)\n", static_cast<unsigned long long>(seed),
                static_cast<unsigned long long>(seed));
  }
  // The launcher on host memory; `sms` sizes the rows_out grid (2 blocks per "SM").
  static void launch(const gt::Case& c, const gt::Problem& p, std::vector<float>& C, int sms) {
    std::vector<int32_t> scratch(k::grouped_gemm_tc_scratch_ints(c.E), -1);
    const int s = p.shift;
    const uint64_t copies = ::emu::g_async_copies.load();
    ASSERT_EQ(k::grouped_gemm_tc(c.rows_out, c.transB, c.E, p.off.data(), c.M, c.N, c.K, c.alpha, p.A.data() + s,
                                 p.lda, p.B.data() + s, p.ldb, p.sB, c.beta, C.data() + s, p.ldc, p.sC,
                                 scratch.data(), sms, nullptr),
              cudaSuccess);
    EXPECT_EQ(::emu::g_async_copies.load(), copies) << "fp32 operands go through registers, never cp.async";
  }
  // f() with each tile product selected in turn (mma.sync, WMMA, wgmma where available:
  // grouped_tc_cases.h).
  template <class F>
  static void for_each(F&& f) {
    gt::for_each_tile_product(f);
  }
  std::mt19937_64 rng_;
};

TEST_F(CudaEmuGroupedTc, BothShapes) {
  for_each([&] {
    int i = 0;
    for (const auto& c : gt::cases(quick()))  // the grid varies from case to case: 2, 4 or 6 blocks
      gt::run_case(c, rng_, [&](const gt::Problem& p, std::vector<float>& C) { launch(c, p, C, 1 + i++ % 3); });
  });
}

// The rows_out grid only sets which block takes which tile: 1, 3 and 64 blocks give the same bits.
TEST_F(CudaEmuGroupedTc, GridIndependent) {
  for_each([&] {
    for (const gt::Case& c : {gt::Case{true, false, 5, 0, 150, 40, 1, 1.f, 0.5f, 45, 1},
                              gt::Case{true, true, 4, 0, 64, 33, 0, -1.f, 0.f, 60}}) {
      SCOPED_TRACE(c.name());
      const gt::Problem p = gt::make_problem(c, rng_);
      std::vector<std::vector<float>> out;
      for (int half_sms : {0, 1, 32}) {  // sm_count <= 0 means the default (132 SMs, 264 blocks)
        std::vector<float> C = p.C;
        launch(c, p, C, half_sms);
        out.push_back(C);
      }
      EXPECT_EQ(out[0], out[1]);
      EXPECT_EQ(out[0], out[2]);
    }
  });
}

// grouped_gemm_tc_ex: an operand given as its bf16 rounding (the backend passes the expert
// weights' bf16 mirror) gives bitwise what the fp32 operand gives, which the kernel rounds the
// same way; every case (aligned and misaligned, both shapes), A, B or both in bf16. A bf16 operand
// aligned to 8 elements is staged by cp.async instead of through registers: the same bits.
TEST_F(CudaEmuGroupedTc, Bf16OperandsGiveTheFp32OperandsBits) {
  for_each([&] {
    auto bits = [](const std::vector<float>& v) {
      std::vector<uint16_t> b(v.size());
      for (size_t i = 0; i < v.size(); ++i) b[i] = cpu::bf16_bits(v[i]);
      return b;
    };
    int i = 0;
    const uint64_t copies = ::emu::g_async_copies.load();
    for (const auto& c : gt::cases(quick())) {
      SCOPED_TRACE(c.name());
      const gt::Problem p = gt::make_problem(c, rng_);
      const int s = p.shift;
      std::vector<float> ref = p.C;
      launch(c, p, ref, 1 + i % 3);
      const std::vector<uint16_t> A16 = bits(p.A), B16 = bits(p.B);
      for (auto [a16, b16] : {std::pair{false, true}, std::pair{true, false}, std::pair{true, true}}) {
        std::vector<float> got = p.C;
        std::vector<int32_t> scratch(k::grouped_gemm_tc_scratch_ints(c.E), -1);
        const void* A = a16 ? static_cast<const void*>(A16.data() + s) : p.A.data() + s;
        const void* B = b16 ? static_cast<const void*>(B16.data() + s) : p.B.data() + s;
        ASSERT_EQ(k::grouped_gemm_tc_ex(c.rows_out, c.transB, c.E, p.off.data(), c.M, c.N, c.K, c.alpha, A, a16, p.lda,
                                        B, b16, p.ldb, p.sB, c.beta, got.data() + s, false, p.ldc, p.sC, scratch.data(),
                                        1 + i % 3, nullptr),
                  cudaSuccess);
        EXPECT_EQ(std::memcmp(got.data(), ref.data(), ref.size() * sizeof(float)), 0)
            << "bf16 A " << a16 << ", bf16 B " << b16;
      }
      ++i;
    }
    // The aligned cases (ld and stride multiples of 8 elements) took the cp.async path.
    EXPECT_GT(::emu::g_async_copies.load() - copies, 0u) << "no bf16 operand was staged by cp.async";
  });
}

// grouped_gemm_tc_ex with a bf16 C (c_bf16): every output element is the round-to-nearest-even of
// what the fp32-output run writes there, bitwise (the same tiles and accumulation, only the store
// differs); C outside the output keeps its (poisoned) bits. Every case with beta 0, both shapes.
// With beta != 0 a bf16 C is refused (cudaErrorInvalidValue), nothing launched.
TEST_F(CudaEmuGroupedTc, Bf16OutputIsTheFp32OutputRounded) {
  for_each([&] {
    int i = 0, ran = 0;
    for (const auto& c : gt::cases(quick())) {
      if (c.beta != 0.f) continue;
      SCOPED_TRACE(c.name());
      const gt::Problem p = gt::make_problem(c, rng_);
      const int s = p.shift;
      const int sms = 1 + i++ % 3;
      std::vector<float> ref(p.C.size());
      std::memset(ref.data(), 0xFF, ref.size() * sizeof(float));  // beta 0: C not read
      launch(c, p, ref, sms);
      if (HasFatalFailure()) return;
      std::vector<uint16_t> got(p.C.size(), 0xFFFF);
      std::vector<int32_t> scratch(k::grouped_gemm_tc_scratch_ints(c.E), -1);
      ASSERT_EQ(k::grouped_gemm_tc_ex(c.rows_out, c.transB, c.E, p.off.data(), c.M, c.N, c.K, c.alpha, p.A.data() + s,
                                      false, p.lda, p.B.data() + s, false, p.ldb, p.sB, 0.f, got.data() + s, true,
                                      p.ldc, p.sC, scratch.data(), sms, nullptr),
                cudaSuccess);
      ran += gt::check_bf16_output(c, p, got, ref);
    }
    EXPECT_GE(ran, 4);
    // beta != 0 with a bf16 C: refused before any launch.
    const gt::Case c{true, true, 3, 0, 5, 4, 0, 1.f, 0.5f, 10};
    const gt::Problem p = gt::make_problem(c, rng_);
    std::vector<uint16_t> C16(p.C.size(), 0xFFFF);
    std::vector<int32_t> scratch(k::grouped_gemm_tc_scratch_ints(c.E), -1);
    for (bool rows_out : {true, false})
      EXPECT_EQ(k::grouped_gemm_tc_ex(rows_out, c.transB, c.E, p.off.data(), 4, c.N, c.K, 1.f, p.A.data(), false,
                                      p.lda, p.B.data(), false, p.ldb, p.sB, 0.5f, C16.data(), true, c.N,
                                      size_t(4) * c.N, scratch.data(), 1, nullptr),
                cudaErrorInvalidValue)
          << "rows_out " << rows_out;
    EXPECT_EQ(C16, std::vector<uint16_t>(p.C.size(), 0xFFFF));
  });
}

TEST_F(CudaEmuGroupedTc, AllExpertsEmpty) {
  for_each([&] {
    const int E = 5, M = 20, N = 30;
    const std::vector<int32_t> off(E + 1, 0);
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    std::vector<float> C(size_t(E) * M * N);
    for (auto& x : C) x = d(rng_);
    for (float beta : {0.f, 1.f, -2.f}) {
      std::vector<float> got = C, ref = C;
      ASSERT_EQ(k::grouped_gemm_tc(false, false, E, off.data(), M, N, 0, 1.f, nullptr, M, nullptr, N, 0, beta,
                                   got.data(), N, size_t(M) * N, nullptr, 2, nullptr),
                cudaSuccess);
      cpu::grouped_gemm<float>(false, false, E, off.data(), M, N, 0, 1.f, nullptr, M, nullptr, N, 0, beta, ref.data(),
                               N, size_t(M) * N);
      EXPECT_EQ(got, ref) << "beta " << beta;
    }
    // rows_out with no rows: nothing to write, C untouched.
    std::vector<int32_t> scratch(k::grouped_gemm_tc_scratch_ints(E));
    std::vector<float> got(C.begin(), C.begin() + 7);
    ASSERT_EQ(k::grouped_gemm_tc(true, true, E, off.data(), 0, N, M, 1.f, nullptr, M, nullptr, M, size_t(N) * M, 0.f,
                                 got.data(), N, 0, scratch.data(), 2, nullptr),
              cudaSuccess);
    EXPECT_EQ(got, std::vector<float>(C.begin(), C.begin() + 7));
  });
}

}  // namespace
}  // namespace ladder
