// The attention on Hopper's warpgroup MMA (attention_wgmma_fwd.cu, attention_wgmma_bwd.cu, sm_90a
// only), behind attention_tc.cu's launchers when selected (AttnTcKernels::wgmma_fwd / wgmma_bwd,
// LADDER_ATTN_WGMMA=1; off by default) and attention_wgmma_available(): the contract, masking,
// rounding points and determinism of the mma.sync kernels (attention_mma.cuh), which run wherever
// these do not.
// Where the build has no sm_90a code (CMAKE_CUDA_ARCHITECTURES without 90) attention_tc.cu defines
// these as "not available" / cudaErrorNotSupported. Included by attention_tc.cu and the tests.
#pragma once
#include <cuda_runtime.h>

#include "backend/cpu/kernels.h"

namespace ladder::cuda::k {

// Whether the sm_90a kernels can run here: the build has them and the current device loads them
// (compute capability 9.0). Asked once per process.
bool attention_wgmma_available();

// attention_mma_forward's contract and instantiations ((E, EO) = (float, float), (bf16, bf16),
// (bf16, float)); shapes already checked. cudaErrorNotSupported where not available.
template <class E, class EO>
cudaError_t attention_wgmma_forward(EO* o, float* lse, const E* q, const E* k, const E* v, const cpu::AttnShape& s,
                                    cudaStream_t st);

// attention_mma_backward's contract (D = rowsum(bf16(dO) * O) already computed; dq, dk, dv
// overwritten; deterministic), E = float or bf16 (attention_wgmma_bwd.cu). cudaErrorNotSupported
// where not available.
template <class E>
cudaError_t attention_wgmma_backward(float* dq, float* dk, float* dv, const float* dout, const E* q, const E* k,
                                     const E* v, const float* lse, const float* D, const cpu::AttnShape& s,
                                     cudaStream_t st);

// The register-A wgmma's layout self-test (tests/cuda/test_cuda_attention_tc.cpp): one warpgroup,
// D [64][64] fp32 (row-major, device) = A [64][16] * B [16][64] (bf16 bits, row-major, device) by
// one wgmma m64n64k16 with A from registers, loaded in the fragment layout wgmma_attn_ptx.cuh states
// (`swap_a12`: a1 and a2 exchanged, the other plausible reading: the tests expect it to fail), B
// staged as an attention tile and read K-major (`b_kmajor`: tile rows are n) or MN-major (rows k).
cudaError_t wgmma_rs_selftest(float* d, const uint16_t* a, const uint16_t* b, bool b_kmajor, bool swap_a12,
                              cudaStream_t st);

// Tests only: stage the tiles without the 128-byte swizzle the descriptors declare (a planted bug
// that must make the results wrong: the tests show they can see a layout error). Not thread-safe.
void attention_wgmma_plant_layout_bug(bool on);
bool attention_wgmma_layout_bug_planted();

}  // namespace ladder::cuda::k
