// NCCL as the CUDA backend's data-parallel collectives (docs/data-parallel.md), on the one GPU a GPU
// session has: a job of one rank. What it checks is what a single device can: libnccl loads with
// every symbol and a new enough version, a job id is made and joined, and the sums, the mean and
// the ranges' reduce and broadcast run on the backend's stream and leave one rank's values as they
// were. (Two ranks need two GPUs: the decision protocol and the collectives' bits are tested on the
// CPU, tests/dist.)
#include <cstring>

#include "cuda_fixture.h"

namespace ladder::test {

class CudaNccl : public CudaFixture {};

TEST_F(CudaNccl, OneRankJobSumsAndAveragesOnTheStream) {
  DeviceCollectives* dc = be().collectives();
  ASSERT_NE(dc, nullptr);
  const std::string why = dc->unavailable();
  if (!why.empty()) GTEST_SKIP() << "NCCL not usable here: NCCL test skipped (" << why << ")";
  const std::string id = dc->device_id();
  EXPECT_EQ(id.rfind("GPU-", 0), 0u) << id;
  EXPECT_EQ(id.size(), 4u + 32u) << id;  // the 16-byte UUID in hex
  if (dc->state() == DeviceCollectives::State::kUndecided) dc->join(dc->new_job_id(), 0, 1);
  ASSERT_EQ(dc->state(), DeviceCollectives::State::kInUse);
  std::printf("[ nccl     ] %s\n", dc->describe().c_str());

  const std::vector<float> f = randv(100003);
  auto df = up(f);
  std::vector<double> d(4099);
  for (size_t i = 0; i < d.size(); ++i) d[i] = double(f[i]) * 1e3 + 1e-9 * double(i);
  auto dd = up(d);
  dc->allreduce_sum(df.data(), f.size());
  dc->allreduce_mean(dd.data(), d.size());
  dc->allreduce_sum(dd.data(), d.size());  // doubles: a sharded optimizer's per-tensor norm sums
  // A sharded optimizer's gradients and weights: the one rank's range is the whole buffer (grouped
  // reduces and broadcasts).
  dc->reduce_scatter_ranges(df.data(), {0, f.size()});
  dc->allgather_ranges(df.data(), {0, f.size()});
  const std::vector<float> gf = down(df, f.size());
  const std::vector<double> gd = down(dd, d.size());
  EXPECT_EQ(std::memcmp(gf.data(), f.data(), f.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(gd.data(), d.data(), d.size() * sizeof(double)), 0);
}

}  // namespace ladder::test
