// Launchers of the tensor-core flash attention (attention_tc.cu): the same contract as
// k::attention_forward / k::attention_backward (kernels.cuh, backend/cpu/kernels.h): fp32 q, k, v,
// o, lse, dout, dq, dk, dv in the [B*S, heads*hd] layouts, lse [B, H, S], causal, sliding window
// (window > 0), GQA (H a multiple of KV), scores scale * q.k, no S x S matrix in memory.
//
// Inside, q, k, v (and dO, P, dS in the backward) are rounded to bf16 (round to nearest even) when
// staged into shared memory and multiplied on the tensor cores (WMMA 16x16x16, or mma.sync m16n8k16
// with attention_tc_kernels() below; fp32 accumulators); softmax statistics, lse and
// D = rowsum(bf16(dO) * O) stay fp32. Expect about 2-4e-3 relative difference from the fp32 kernels on
// the same fp32 inputs (docs/cuda.md, "Tensor-core attention").
//
// Plain C++ declarations (the host compiler includes this). Each launcher enqueues on `st` and
// returns the first error of its cudaFuncSetAttribute calls or cudaGetLastError() after the
// launches; a shape it does not support returns cudaErrorInvalidValue (check
// attention_tc_supported first and use the fp32 kernels otherwise).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cpu/kernels.h"

namespace ladder::cuda::k {

// head_dim 64 or 128, KV > 0, H % KV == 0, and the current device is sm_80+ with enough opt-in
// shared memory per block (up to 102.5 KiB at head_dim 128: A100, H100, H200 yes; sm_86/89 no).
bool attention_tc_supported(const cpu::AttnShape& s);

// Which kernels the launchers below run: the register-resident mma.sync kernels (attention_mma.cuh;
// the default since their tests passed on an H200, where they ran 1.3-1.7x faster than WMMA:
// docs/cuda.md "Measured runs"), or the WMMA kernels of attention_tc.cu, for the forward and the
// backward separately. The starting value comes from the environment LADDER_ATTN_MMA: unset, 1 or
// all = both mma.sync; 0 or wmma = both WMMA; fwd / bwd = only that one mma.sync.
// wgmma_fwd / wgmma_bwd (LADDER_ATTN_WGMMA=1, or fwd / bwd for one; off by default): the kernels on
// Hopper's wgmma (sm_90a) where the build has that code and the device runs it (attention_wgmma.cuh),
// ahead of mma.sync / WMMA, which run wherever they do not; also behind the in16 entry points.
// Not thread-safe: set it before launching.
struct AttnTcKernels {
  bool mma_fwd = true, mma_bwd = true;
  bool wgmma_fwd = false, wgmma_bwd = false;
};
AttnTcKernels attention_tc_kernels();
void attention_tc_set_kernels(AttnTcKernels k);

cudaError_t attention_tc_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                                 const cpu::AttnShape& s, cudaStream_t st);

// `scratch` holds attention_tc_backward_scratch_floats(s) floats (D_i = dO_i . O_i, [B, H, S]).
size_t attention_tc_backward_scratch_floats(const cpu::AttnShape& s);
// dq, dk, dv OVERWRITTEN. Deterministic (no atomics): bitwise the same result run to run.
cudaError_t attention_tc_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                                  const float* k, const float* v, const float* o, const float* lse,
                                  const cpu::AttnShape& s, float* scratch, cudaStream_t st);

// model.attn_bf16: q, k, v and o as bf16 bits (uint16_t); lse, dout and the gradients fp32. The
// tiles are staged from the bf16 values as they are (no rounding: they already are bf16) and o is
// rounded to nearest even in the forward's epilogue, so these give bitwise the results of the fp32
// launchers above on the widened inputs (o then rounded). The backward reads the bf16 o for D.
cudaError_t attention_tc_forward_bf16(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                                      const uint16_t* v, const cpu::AttnShape& s, cudaStream_t st);
cudaError_t attention_tc_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const uint16_t* q,
                                       const uint16_t* k, const uint16_t* v, const uint16_t* o, const float* lse,
                                       const cpu::AttnShape& s, float* scratch, cudaStream_t st);

// fp32 activations under bf16 precision, mma.sync or wgmma kernels only (attention_tc_kernels()
// .mma_fwd / .wgmma_fwd, .mma_bwd / .wgmma_bwd; else cudaErrorNotSupported): q, k, v already
// rounded to bf16 by the caller
// (k::f32_to_bf16, round to nearest even, as the fp32 launchers round them while staging), o fp32.
// So these give bitwise the fp32 launchers' results on the fp32 inputs, with the bf16 instantiation's
// staging: cp.async copies where aligned, which overlap the math (the fp32 staging goes through
// registers; on an H200 the bf16-input kernels ran 1.2-1.8x the fp32-input ones: docs/cuda.md).
// The backward computes D from the fp32 o, as attention_tc_backward does.
cudaError_t attention_tc_forward_in16(float* o, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                      const cpu::AttnShape& s, cudaStream_t st);
cudaError_t attention_tc_backward_in16(float* dq, float* dk, float* dv, const float* dout, const uint16_t* q,
                                       const uint16_t* k, const uint16_t* v, const float* o, const float* lse,
                                       const cpu::AttnShape& s, float* scratch, cudaStream_t st);

}  // namespace ladder::cuda::k
