// run.device handling shared by the CPU-only and the CUDA builds.
#include "backend/backend.h"
#include "core/error.h"
#ifdef LADDER_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace ladder {

#ifndef LADDER_HAVE_CUDA
std::unique_ptr<Backend> make_cuda_backend(const std::string&, const std::string&) {
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

void Backend::swiglu_forward_typed(void* h, const void* g, const void* u, bool h16, size_t n) {
  if (h16)
    return swiglu_forward_bf16(static_cast<uint16_t*>(h), static_cast<const uint16_t*>(g),
                               static_cast<const uint16_t*>(u), n);
  swiglu_forward(static_cast<float*>(h), static_cast<const float*>(g), static_cast<const float*>(u), n);
}

void Backend::swiglu_backward_typed(void* dg, void* du, const void* dh, const void* g, const void* u, bool h16,
                                    bool d16, size_t n) {
  if (d16 && !h16) fail("swiglu_backward: bf16 gradients need bf16 gate and up (model.moe_bf16)");
  auto* g16 = static_cast<const uint16_t*>(g);
  auto* u16 = static_cast<const uint16_t*>(u);
  if (d16)
    return swiglu_backward_bf16_grads(static_cast<uint16_t*>(dg), static_cast<uint16_t*>(du),
                                      static_cast<const uint16_t*>(dh), g16, u16, n);
  auto* dgf = static_cast<float*>(dg);
  auto* duf = static_cast<float*>(du);
  auto* dhf = static_cast<const float*>(dh);
  if (h16) return swiglu_backward_bf16(dgf, duf, dhf, g16, u16, n);
  swiglu_backward(dgf, duf, dhf, static_cast<const float*>(g), static_cast<const float*>(u), n);
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

std::unique_ptr<Backend> make_backend(const std::string& device, int threads, const std::string& precision,
                                      const std::string& attention) {
  check_run_device(device);
  return device == "cuda" ? make_cuda_backend(precision, attention) : make_cpu_backend(threads);
}

}  // namespace ladder
