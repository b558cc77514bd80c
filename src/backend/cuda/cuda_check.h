// Error checks for the CUDA runtime and cuBLASLt: every failing call becomes one ladder::Error line
// naming the call, where it was made and the runtime's own description. Host code only (g++): the
// .cu files return cudaError_t from their launchers and the callers check it here.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/error.h"

namespace ladder::cuda {

[[noreturn]] inline void fail_cuda(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaErrorMemoryAllocation)
    fail("CUDA out of device memory in {} ({}:{})", what, file, line);
  fail("CUDA error in {} ({}:{}): {} ({})", what, file, line, cudaGetErrorString(e), cudaGetErrorName(e));
}

[[noreturn]] inline void fail_cublas(cublasStatus_t s, const char* what, const char* file, int line) {
  fail("cuBLASLt error in {} ({}:{}): {} ({})", what, file, line, cublasLtGetStatusString(s),
       cublasLtGetStatusName(s));
}

}  // namespace ladder::cuda

#define LADDER_CUDA_CHECK(call)                                                       \
  do {                                                                                \
    const cudaError_t ladder_err_ = (call);                                           \
    if (ladder_err_ != cudaSuccess)                                                   \
      ::ladder::cuda::fail_cuda(ladder_err_, #call, __FILE__, __LINE__);              \
  } while (0)

#define LADDER_CUBLAS_CHECK(call)                                                     \
  do {                                                                                \
    const cublasStatus_t ladder_st_ = (call);                                         \
    if (ladder_st_ != CUBLAS_STATUS_SUCCESS)                                          \
      ::ladder::cuda::fail_cublas(ladder_st_, #call, __FILE__, __LINE__);             \
  } while (0)
