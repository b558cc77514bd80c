// run.device and --device cuda in a build without CUDA: one clear line each (issue 6, bad input).
// The CUDA build's own checks are in tests/cuda/test_cuda_kernels.cpp (CudaProbe).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

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

TEST(Device, AttentionIsCheckedAndNeedsCudaBf16) {
  Config c;
  c.model.vocab_size = 256;
  c.run.attention = "flash";
  std::string e = error_of([&] { validate(c); });
  EXPECT_NE(e.find("run.attention 'flash' is not known (expected ladder, cudnn or cudnn-nondeterministic)"),
            std::string::npos)
      << e;
  for (const char* a : {"cudnn", "cudnn-nondeterministic"}) {
    c.run.attention = a;  // on the CPU
    e = error_of([&] { validate(c); });
    EXPECT_NE(e.find(std::string("run.attention '") + a + "' needs run.device cuda and run.precision bf16"),
              std::string::npos)
        << e;
    c.run.device = "cuda";
    c.run.precision = "tf32";
    EXPECT_EQ(error_of([&] { validate(c); }), e);
    c.run.device = "cpu";
    c.run.precision = "fp32";
  }
  c.run.attention = "ladder";
  EXPECT_NO_THROW(validate(c));
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

// Backend::gemm_add on the CPU is the copy + beta = 1 GEMM it replaced in the model, bit for bit,
// and leaves C alone.
TEST(Device, CpuGemmAddIsCopyThenAccumulate) {
  auto be = make_cpu_backend(0);
  const int M = 37, N = 29, K = 41, ldc = N + 2;
  std::vector<float> A(size_t(M) * K), B(size_t(N) * K), C(size_t(M) * ldc), D(C.size(), -7.f);
  for (size_t i = 0; i < A.size(); ++i) A[i] = float(std::sin(0.37 * double(i)));
  for (size_t i = 0; i < B.size(); ++i) B[i] = float(std::cos(0.11 * double(i)));
  for (size_t i = 0; i < C.size(); ++i) C[i] = float(std::sin(1.3 * double(i)));
  const std::vector<float> C0 = C;
  be->gemm_add(false, true, M, N, K, 0.75f, A.data(), K, B.data(), K, C.data(), D.data(), ldc);
  std::vector<float> ref = C;
  be->gemm(false, true, M, N, K, 0.75f, A.data(), K, B.data(), K, 1.f, ref.data(), ldc);
  EXPECT_EQ(C, C0) << "C was written";
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) ASSERT_EQ(D[size_t(i) * ldc + j], ref[size_t(i) * ldc + j]) << i << "," << j;
  for (int i = 0; i < M; ++i)  // padding columns of D untouched
    for (int j = N; j < ldc; ++j) ASSERT_EQ(D[size_t(i) * ldc + j], -7.f);
}

}  // namespace
}  // namespace ladder
