// run.device and --device cuda in a build without CUDA: one clear line each (issue 6, bad input).
// The CUDA build's own checks are in tests/cuda/test_cuda_kernels.cpp (CudaProbe).
#include <gtest/gtest.h>

#include <string>

#include "backend/backend.h"
#include "core/error.h"
#include "model/config.h"

namespace ladder {
namespace {

std::string error_of(auto fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Device, CpuIsAcceptedAndUnknownDevicesAreNamed) {
  Config c;
  c.model.vocab_size = 256;
  EXPECT_NO_THROW(validate(c));
  EXPECT_NO_THROW(check_run_device("cpu"));
  c.run.device = "tpu";
  const std::string e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("run.device 'tpu'"), std::string::npos) << e;
  EXPECT_NE(error_of([] { check_run_device("tpu"); }).find("'tpu'"), std::string::npos);
}

TEST(Device, PrecisionIsCheckedAndNeedsCuda) {
  Config c;
  c.model.vocab_size = 256;
  c.run.precision = "fp16";
  std::string e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("run.precision 'fp16' is not known (expected fp32, tf32 or bf16)"), std::string::npos) << e;
  c.run.precision = "bf16";  // on the CPU
  e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("run.precision 'bf16' needs run.device cuda"), std::string::npos) << e;
}

#ifndef LADDER_HAVE_CUDA
TEST(Device, CudaWithoutCudaBuildIsOneClearLine) {
  Config c;
  c.model.vocab_size = 256;
  c.run.device = "cuda";
  const std::string e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("run.device 'cuda': this build lacks CUDA"), std::string::npos) << e;
  EXPECT_NE(e.find("-DLADDER_CUDA=ON"), std::string::npos) << e;
  const std::string b = error_of([] { make_cuda_backend(); });
  EXPECT_EQ(b.rfind("--device cuda: this build has no CUDA backend", 0), 0u) << b;
  EXPECT_EQ(b.find('\n'), std::string::npos) << b;
  EXPECT_EQ(error_of([] { check_run_device("cuda"); }), b);
  // The trainer and bench build their backend with make_backend: the same line.
  EXPECT_EQ(error_of([] { make_backend("cuda", 1); }), b);
}
#endif

TEST(Device, MakeBackendBuildsTheCpuBackendAndNamesUnknownDevices) {
  auto be = make_backend("cpu", 1);
  ASSERT_TRUE(be);
  EXPECT_TRUE(be->is_host());
  const std::string e = error_of([] { make_backend("tpu", 1); });
  EXPECT_NE(e.find("'tpu'"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
}

}  // namespace
}  // namespace ladder
