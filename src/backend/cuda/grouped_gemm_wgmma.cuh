// The wgmma (sm_90a) implementation of the bf16 tensor-core grouped GEMM (grouped_gemm_wgmma.cu)
// and its layout self-test. Backend code does not call these directly: grouped_gemm_tc_ex
// (grouped_gemm_tc.cuh) dispatches to grouped_gemm_wgmma when grouped_gemm_tc_set_wgmma(true) (or
// LADDER_GROUPED_WGMMA=1) selected it, the call is eligible and grouped_gemm_wgmma_available().
// Where the build has no sm_90a code (CMAKE_CUDA_ARCHITECTURES without 90) grouped_gemm_tc.cu
// defines these as "not available" / cudaErrorNotSupported.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ladder::cuda::k {

// Whether the sm_90a kernels can run here: the build has them and the current device loads them
// (compute capability 9.0). Asked once per process (the first answer is kept).
bool grouped_gemm_wgmma_available();

// grouped_gemm_tc_ex's contract and arguments, every call (bf16 operands that are 16-byte aligned
// with ld, and for rows_out B's strideB, multiples of 8 elements are staged by cp.async, any other
// operand through registers). cudaErrorNotSupported where not available (nothing launched).
cudaError_t grouped_gemm_wgmma(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K,
                               float alpha, const void* A, bool a_bf16, int lda, const void* B, bool b_bf16, int ldb,
                               size_t strideB, float beta, void* C, bool c_bf16, int ldc, size_t strideC,
                               int32_t* tile_scratch, int sm_count, cudaStream_t st);

// One warpgroup, D [64][128] fp32 (row-major, device) = A [64][64] * B [64][128] (bf16 bits,
// row-major, device), as four m64n128k16 wgmmas over k 0..63 from shared memory: A staged K-major
// (a_mn false) or MN-major, B likewise, in the layouts of wgmma_ptx.cuh (swizzled unless
// `plain_store`: the planted bug the tests expect to fail), read through descriptors with the given
// LBO / SBO bytes per operand, D written from the documented accumulator layout.
struct WgmmaSelftest {
  bool a_mn = false, b_mn = false;
  uint32_t lbo_a = 16, sbo_a = 1024, lbo_b = 16, sbo_b = 1024;
  bool plain_store = false;
};
cudaError_t wgmma_selftest(float* d, const uint16_t* a, const uint16_t* b, const WgmmaSelftest& cfg, cudaStream_t st);

}  // namespace ladder::cuda::k
