// The wgmma grouped GEMM (src/backend/cuda/grouped_gemm_wgmma.cu) on the host emulation of wgmma
// (emu_cuda.h, emu::ptx_wgmma): the layout self-test's checks (tests/cuda/wgmma_selftest_case.h,
// which the GPU test CudaWgmma runs on a device), the emulator's own checks on planted bugs, and
// every case of tests/cuda/grouped_tc_cases.h through grouped_gemm_tc_ex with the wgmma kernels
// selected on their cp.async path: each case's operands as their bf16 rounding repacked with ld
// rounded up to a multiple of 8 (grouped_tc_cases.h's wgmma_operands), so its references (fp32
// inputs within 1e-2, bf16-rounded inputs within 1e-4) apply unchanged. (The register path, the
// cases' own fp32 operands, runs in CudaEmuGroupedTc.*, whose for_each_tile_product includes wgmma.)
// EMU_SEED=N repeats a run's inputs; EMU_QUICK=1 (sanitizer builds) drops the costlier shapes.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../grouped_tc_cases.h"
#include "../wgmma_selftest_case.h"
#include "backend/cpu/kernels.h"
#include "backend/cuda/grouped_gemm_tc.cuh"
#include "backend/cuda/grouped_gemm_wgmma.cuh"
#include "backend/cuda/wgmma_layout.h"
#include "emu_cuda.h"
#include "emu_fixture.h"

namespace ladder {
namespace {

namespace k = cuda::k;
namespace gt = grouped_tc;
namespace wc = wgmma_case;

// The CudaEmu fixture (seeded inputs, EMU_SEED), with the wgmma kernels selected.
class CudaEmuWgmma : public emu_test::CudaEmu {
 protected:
  void SetUp() override {
    CudaEmu::SetUp();
    prev_ = k::grouped_gemm_tc_wgmma();
    k::grouped_gemm_tc_set_wgmma(true);
  }
  void TearDown() override { k::grouped_gemm_tc_set_wgmma(prev_); }

  // The self-test kernel on host memory.
  static void selftest(const k::WgmmaSelftest& cfg, const wc::Operands& o, std::vector<float>& d) {
    ASSERT_EQ(k::wgmma_selftest(d.data(), o.a.data(), o.b.data(), cfg, nullptr), cudaSuccess);
  }

  // Case c through grouped_gemm_tc_ex with bf16 operands eligible for the wgmma kernels; C as given
  // (fp32, or bf16 bits when c16). Expects the wgmma kernels to have run where there was work.
  static void launch(const gt::Case& c, const gt::Problem& p, void* C, bool c16, int sms) {
    const int s = p.shift, total = p.off[c.E];
    const gt::Bf16Operands o = gt::wgmma_operands(c, p);
    std::vector<int32_t> scratch(k::grouped_gemm_tc_scratch_ints(c.E), -1);
    const uint64_t ops = ::emu::g_wgmma_ops.load();
    const size_t cs = c16 ? sizeof(uint16_t) : sizeof(float);
    ASSERT_EQ(k::grouped_gemm_tc_ex(c.rows_out, c.transB, c.E, p.off.data(), c.M, c.N, c.K, c.alpha, o.A.data(), true,
                                    o.lda, o.B.data(), true, o.ldb, o.sB, c.beta,
                                    static_cast<char*>(C) + size_t(s) * cs, c16, p.ldc, p.sC, scratch.data(), sms,
                                    nullptr),
              cudaSuccess);
    const bool work = c.rows_out ? (total > 0 && c.K > 0) : total > 0;
    if (work) {
      EXPECT_GT(::emu::g_wgmma_ops.load(), ops) << "the wgmma kernels did not run";
    }
  }

  bool prev_ = false;
};

TEST_F(CudaEmuWgmma, AccumulatorLayout) { wc::accumulator_layout(selftest); }
TEST_F(CudaEmuWgmma, OperandLayouts) { wc::operand_layouts(rng_, selftest); }
TEST_F(CudaEmuWgmma, MnMajorStrideRoles) { wc::mn_major_stride_roles(rng_, selftest); }
TEST_F(CudaEmuWgmma, PlantedSwizzleBug) { wc::planted_swizzle_bug(rng_, selftest); }

// The emulator's asynchrony checks, on a planted kernel: an operand overwritten between the MMA and
// its wait_group, and an MMA without a wgmma.fence, are reported (counted here instead of dying).
void planted_kernel(bool overwrite, bool fence) {
  const uint32_t slack = (k::wg::kPattern - ::emu::shared_address(::emu::g_smem) % k::wg::kPattern) % k::wg::kPattern;
  unsigned char* smem = ::emu::g_smem + slack;  // the first 1024-byte boundary of the shared window
  for (int i = int(threadIdx.x); i < 2 * k::wg::kTileBytes / 2; i += 128)
    reinterpret_cast<uint16_t*>(smem)[i] = cpu::bf16_bits(1.f);
  __syncthreads();
  float acc[64] = {};
  const uint32_t s0 = ::emu::shared_address(smem);
  if (fence) ::emu::ptx_wgmma_fence();
  ::emu::ptx_wgmma(acc, 128, k::wg::make_desc(s0, 16, 1024), k::wg::make_desc(s0 + k::wg::kTileBytes, 16, 1024),
                   false, false);
  ::emu::ptx_wgmma_commit();
  __syncthreads();
  if (overwrite && threadIdx.x == 0) reinterpret_cast<uint16_t*>(smem)[0] = cpu::bf16_bits(2.f);
  __syncthreads();
  ::emu::ptx_wgmma_wait(0);
  EXPECT_EQ(acc[0], 16.f);
}

TEST_F(CudaEmuWgmma, PlantedAsyncBugsAreCaught) {
  ::emu::g_wgmma_die = false;
  for (auto [overwrite, fence] : {std::pair{false, true}, std::pair{true, true}, std::pair{false, false}}) {
    const uint64_t v = ::emu::g_wgmma_violations.load();
    ::emu::launch(false, dim3(1), dim3(128), 2 * size_t(k::wg::kTileBytes) + k::wg::kPattern, planted_kernel,
                  overwrite, fence);
    const uint64_t n = ::emu::g_wgmma_violations.load() - v;
    // Overwrite: the threads whose MMA read element 0 (row 0 of A: warp 0, lanes 0-3).
    const uint64_t want = overwrite ? 4u : fence ? 0u : 128u;
    EXPECT_EQ(n, want) << (overwrite ? "the overwrite under an in-flight wgmma was not caught"
                           : fence   ? "a correct kernel was reported"
                                     : "an MMA without wgmma.fence was not caught");
  }
  ::emu::g_wgmma_die = true;
}

TEST_F(CudaEmuWgmma, GroupedGemmAllCases) {
  int i = 0;
  for (const auto& c : gt::cases(emu_test::quick()))
    gt::run_case(c, rng_, [&](const gt::Problem& p, std::vector<float>& C) { launch(c, p, C.data(), false, 1 + i++ % 3); });
}

// bf16 C: the rounding of the fp32 output, bitwise; the rows_out grid does not change a bit.
TEST_F(CudaEmuWgmma, Bf16OutputAndGrid) {
  int i = 0, ran = 0;
  for (const auto& c : gt::cases(true)) {
    if (c.beta != 0.f) continue;
    SCOPED_TRACE(c.name());
    const gt::Problem p = gt::make_problem(c, rng_);
    std::vector<float> ref(p.C.size());
    std::memset(ref.data(), 0xFF, ref.size() * sizeof(float));
    launch(c, p, ref.data(), false, 1 + i % 3);
    if (c.rows_out) {
      std::vector<float> other(p.C.size());
      std::memset(other.data(), 0xFF, other.size() * sizeof(float));
      launch(c, p, other.data(), false, 2 + i % 3);
      EXPECT_EQ(std::memcmp(ref.data(), other.data(), ref.size() * sizeof(float)), 0) << "grid-dependent bits";
    }
    std::vector<uint16_t> got(p.C.size(), 0xFFFF);
    launch(c, p, got.data(), true, 1 + i++ % 3);
    ran += gt::check_bf16_output(c, p, got, ref);
  }
  EXPECT_GE(ran, 4);
}

// In the emulation the wgmma kernels give the mma.sync kernels' bits: both stage the same bf16
// values and both emulations add the exact products in increasing k onto fp32 accumulators in
// 16-wide chunks in increasing t (on a device the MMAs' internal adder orders differ, and so may the
// last bits). Every case, with its own operands (fp32: the register path) and as aligned bf16 (the
// cp.async path), the latter also with the mma.sync kernels taking them by cp.async.
TEST_F(CudaEmuWgmma, GivesTheMmaSyncBitsInEmulation) {
  int i = 0;
  for (const auto& c : gt::cases(true)) {
    SCOPED_TRACE(c.name());
    const gt::Problem p = gt::make_problem(c, rng_);
    const gt::Bf16Operands o = gt::wgmma_operands(c, p);
    const int s = p.shift;
    std::vector<int32_t> scratch(k::grouped_gemm_tc_scratch_ints(c.E), -1);
    for (bool bf16 : {false, true}) {
      std::vector<float> out[2];
      for (bool wgmma : {false, true}) {
        k::grouped_gemm_tc_set_wgmma(wgmma);
        std::vector<float>& C = out[wgmma];
        C = p.C;
        const uint64_t ops = ::emu::g_wgmma_ops.load();
        ASSERT_EQ(k::grouped_gemm_tc_ex(c.rows_out, c.transB, c.E, p.off.data(), c.M, c.N, c.K, c.alpha,
                                        bf16 ? static_cast<const void*>(o.A.data()) : p.A.data() + s, bf16,
                                        bf16 ? o.lda : p.lda,
                                        bf16 ? static_cast<const void*>(o.B.data()) : p.B.data() + s, bf16,
                                        bf16 ? o.ldb : p.ldb, bf16 ? o.sB : p.sB, c.beta, C.data() + s, false, p.ldc,
                                        p.sC, scratch.data(), 1 + i % 3, nullptr),
                  cudaSuccess);
        const bool work = c.rows_out ? (p.off[c.E] > 0 && c.K > 0) : p.off[c.E] > 0;
        EXPECT_EQ(::emu::g_wgmma_ops.load() > ops, wgmma && work) << "wgmma " << wgmma << ", bf16 " << bf16;
      }
      EXPECT_EQ(std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)), 0)
          << "bf16 operands " << bf16 << ": wgmma and mma.sync bits differ";
    }
    ++i;
  }
}

}  // namespace
}  // namespace ladder
