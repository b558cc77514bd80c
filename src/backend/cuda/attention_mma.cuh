// The register-resident tensor-core attention (mma.sync m16n8k16 through mma_ptx.cuh; kernels in
// attention_mma_fwd.cu and attention_mma_bwd.cu), behind attention_tc.cu's launchers when
// attention_tc_kernels() selects it: the same contract, shapes, masking and determinism as the WMMA
// kernels (attention_tc.cuh), the same bf16 rounding of q, k, v, dO, P and dS, and fp32 softmax
// statistics; only the order of the fp32 sums inside the MMAs may differ. Unlike the WMMA kernels,
// scores and probabilities stay in registers (the fragment layouts are documented PTX), so no score
// tile goes through shared memory. Included by attention_tc.cu only; E is float or __nv_bfloat16.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "backend/cpu/kernels.h"

namespace ladder::cuda::k {

// o, lse: as attention_tc_forward (o rounded to EO). Shapes already checked (hd 64/128, H % KV == 0).
// Instantiated for (E, EO) = (float, float), (bf16, bf16) and (bf16, float): bf16 q, k, v with an fp32
// o (attention_tc_forward_in16), the bf16 staging (cp.async where aligned) with the fp32 output.
template <class E, class EO>
cudaError_t attention_mma_forward(EO* o, float* lse, const E* q, const E* k, const E* v, const cpu::AttnShape& s,
                                  cudaStream_t st);

// dq, dk, dv overwritten; D = rowsum(bf16(dO) * O) [B, H, S] already computed (attention_tc.cu).
template <class E>
cudaError_t attention_mma_backward(float* dq, float* dk, float* dv, const float* dout, const E* q, const E* k,
                                   const E* v, const float* lse, const float* D, const cpu::AttnShape& s,
                                   cudaStream_t st);

}  // namespace ladder::cuda::k
