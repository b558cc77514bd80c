// The launcher of mma_selftest.cu: D (16x8 fp32, row-major) = A (16x16) * B (16x8), bf16 bits, one
// warp, the operands reaching their mma fragments by `mode` (0: ldmatrix from A and B^T; 1:
// ldmatrix .trans from A^T and B; 2: no ldmatrix; 3: mode 0, then [bf16(D) | 0] * B through pack_a).
// Every operand layout is passed (a = A [16][16], at = A^T, bnk = B^T [8][16], bkn = B [16][8]); each
// mode reads the ones it needs. cudaErrorInvalidValue for another mode.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace ladder::cuda::k {

cudaError_t mma_ptx_selftest(float* d, const uint16_t* a, const uint16_t* at, const uint16_t* bnk, const uint16_t* bkn,
                             int mode, cudaStream_t st);

}  // namespace ladder::cuda::k
