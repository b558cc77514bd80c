// cuBLASLt stand-in for the host emulation: only what cuda_check.h and lt_gemm.h name. The emulated
// LtGemm (emu_lt_gemm.cpp) never calls cuBLASLt.
#pragma once
#include "emu_cuda.h"

enum cublasStatus_t { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_NOT_SUPPORTED = 15 };
inline const char* cublasLtGetStatusString(cublasStatus_t s) { return s ? "not supported" : "success"; }
inline const char* cublasLtGetStatusName(cublasStatus_t s) {
  return s ? "CUBLAS_STATUS_NOT_SUPPORTED" : "CUBLAS_STATUS_SUCCESS";
}
