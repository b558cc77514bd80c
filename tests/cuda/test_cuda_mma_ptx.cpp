// mma_ptx.cuh's fragment layouts on the device (src/backend/cuda/mma_selftest.cu against a CPU
// product, tests/cuda/mma_selftest_case.h): the check that the layouts the register-resident
// attention kernels (attention_mma_*.cu) and the host emulation are built on are the device's.
// Without a GPU it skips with "no CUDA device: GPU test skipped (...)".
#include <gtest/gtest.h>

#include "backend/cuda/mma_selftest.cuh"
#include "cuda_fixture.h"
#include "mma_selftest_case.h"

namespace ladder {
namespace {

class CudaMmaPtx : public test::CudaFixture {};

TEST_F(CudaMmaPtx, FragmentLayoutsMatchACpuProduct) {
  mma_case::check_all(rng_, [&](const mma_case::Operands& o, int mode, std::vector<float>& d) {
    auto a = up(o.a), at = up(o.at), bnk = up(o.bnk), bkn = up(o.bkn);
    cuda::DeviceBuffer<float> D(128);
    D.poison();
    ASSERT_EQ(cuda::k::mma_ptx_selftest(D.data(), a.data(), at.data(), bnk.data(), bkn.data(), mode, st()),
              cudaSuccess);
    d = D.download();
  });
}

}  // namespace
}  // namespace ladder
