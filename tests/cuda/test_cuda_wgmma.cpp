// The wgmma layout facts of src/backend/cuda/wgmma_ptx.cuh on the device (k::wgmma_selftest against
// CPU products, tests/cuda/wgmma_selftest_case.h): the check that what the wgmma grouped GEMM and
// its host emulation assume (accumulator layout, 128-byte swizzle, K-major and MN-major operand
// layouts and descriptor strides) is what an sm_90 device does. The tests run in this order so that
// the first failure names the first wrong assumption: AccumulatorLayout (registers -> (m, n)),
// OperandLayouts (the four K-/MN-major form pairs; on failure, whether the hardware read the data
// unswizzled), MnMajorStrideRoles (which of LBO / SBO steps which dimension), PlantedSwizzleBug
// (unswizzled data must fail). Where they pass, CudaGroupedTc.Wgmma* test the whole grouped GEMM.
// Without a GPU: "no CUDA device: GPU test skipped (...)"; without sm_90a code for the device (an
// sm_80 device, or a build without 90 in CMAKE_CUDA_ARCHITECTURES), or with LADDER_TEST_WGMMA=0
// (scripts/gpu-check.sh runs them in a process of their own): skipped with that reason.
#include <gtest/gtest.h>

#include "backend/cuda/grouped_gemm_wgmma.cuh"
#include "cuda_fixture.h"
#include "grouped_tc_cases.h"
#include "wgmma_selftest_case.h"

namespace ladder {
namespace {

namespace wc = wgmma_case;

class CudaWgmma : public test::CudaFixture {
 protected:
  void SetUp() override {
    CudaFixture::SetUp();
    if (IsSkipped()) return;
    if (!cuda::k::grouped_gemm_wgmma_available())
      GTEST_SKIP() << "no sm_90a code for this device (wgmma needs an sm_90 device and 90 in CMAKE_CUDA_ARCHITECTURES)";
    if (!grouped_tc::wgmma_tests_on()) GTEST_SKIP() << "LADDER_TEST_WGMMA=0: the wgmma tests run in a process of their own";
  }
  // The self-test on the device: D (64 x 128, row-major) for the operands and configuration.
  void selftest(const cuda::k::WgmmaSelftest& cfg, const wc::Operands& o, std::vector<float>& d) {
    auto a = up(o.a), b = up(o.b);
    auto D = poisoned<float>(d.size());
    ASSERT_EQ(cuda::k::wgmma_selftest(D.data(), a.data(), b.data(), cfg, st()), cudaSuccess);
    d = down(D, d.size());
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  }
  auto runner() {
    return [this](const cuda::k::WgmmaSelftest& cfg, const wc::Operands& o, std::vector<float>& d) { selftest(cfg, o, d); };
  }
};

TEST_F(CudaWgmma, AccumulatorLayout) { wc::accumulator_layout(runner()); }
TEST_F(CudaWgmma, OperandLayouts) { wc::operand_layouts(rng_, runner()); }
TEST_F(CudaWgmma, MnMajorStrideRoles) { wc::mn_major_stride_roles(rng_, runner()); }
TEST_F(CudaWgmma, PlantedSwizzleBug) { wc::planted_swizzle_bug(rng_, runner()); }

}  // namespace
}  // namespace ladder
