// run.device handling shared by the CPU-only and the CUDA builds.
#include "backend/backend.h"
#include "core/error.h"
#ifdef LADDER_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace ladder {

#ifndef LADDER_HAVE_CUDA
std::unique_ptr<Backend> make_cuda_backend(const std::string&) {
  fail("--device cuda: this build has no CUDA backend (configure with -DLADDER_CUDA=ON; it needs nvcc and a GPU "
       "of compute capability 8.0 or newer)");
}
#endif

void check_grouped_gemm_ex(bool rows_out, int E, int M, int N, float beta, bool c_bf16, int ldc, size_t strideC) {
  if (!c_bf16 || E <= 0 || N <= 0) return;
  if (beta != 0.f) fail("grouped_gemm_ex: a bf16 output takes no addend (beta must be 0, got {})", beta);
  if (ldc != N) fail("grouped_gemm_ex: a bf16 output must be packed (ldc {} != N {})", ldc, N);
  if (!rows_out && strideC != size_t(M) * size_t(N))
    fail("grouped_gemm_ex: a bf16 output must be packed (strideC {} != M * N = {})", strideC, size_t(M) * size_t(N));
}

void check_run_device(const std::string& device) {
  if (device == "cpu") return;
  if (device != "cuda") fail("run.device '{}' is not known (expected cpu or cuda)", device);
#ifdef LADDER_HAVE_CUDA
  cuda::probe_device();  // one line when there is no usable GPU; builds nothing
#else
  make_cuda_backend();   // "this build has no CUDA backend"
#endif
}

std::unique_ptr<Backend> make_backend(const std::string& device, int threads, const std::string& precision) {
  check_run_device(device);
  return device == "cuda" ? make_cuda_backend(precision) : make_cpu_backend(threads);
}

}  // namespace ladder
