// Launch and warp helpers shared by the kernel files (one definition each; every file keeps its own
// block size).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ladder::cuda::k {

// Blocks for a grid-stride loop over n items handled per_block at a time, capped at 65536: the
// loop covers the rest, so huge tensors do not need huge grids. At least one block.
inline unsigned grid_for(size_t n, size_t per_block = 256) {
  const size_t blocks = (n + per_block - 1) / per_block;
  return unsigned(blocks < 65536 ? (blocks ? blocks : 1) : 65536);
}

// Sum / max over the 32 lanes of a warp (butterfly: every lane gets the result, in a fixed order).
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Element access for kernels templated on the storage type of their activations (float, or
// __nv_bfloat16 for the bf16 options such as model.attn_bf16): a load widens to fp32 (exact for
// bf16), a store rounds an fp32 value to the storage type (bf16: nearest even). The bf16
// instantiation of a kernel thus runs the fp32 instantiation's arithmetic on the widened inputs,
// and the fp32 one is unchanged (both helpers are the identity on float).
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void store_rn(float& dst, float v) { dst = v; }
__device__ __forceinline__ void store_rn(__nv_bfloat16& dst, float v) { dst = __float2bfloat16_rn(v); }

// The Backend interface's bf16 storage (uint16_t bits) as __nv_bfloat16, for the launchers.
inline const __nv_bfloat16* as_bf16(const uint16_t* p) { return reinterpret_cast<const __nv_bfloat16*>(p); }
inline __nv_bfloat16* as_bf16(uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); }

// Four bf16, one 8-byte load or store (the tensor-core kernels' operand staging).
struct alignas(8) Bf16x4 {
  __nv_bfloat162 lo, hi;
};

// Lets `kernel` launch with `bytes` of dynamic shared memory (above the default 48 KiB needs the
// opt-in); its error is the launcher's to return.
template <class Kernel>
cudaError_t allow_smem(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

// The expert owning row tile g of a grouped GEMM over expert row blocks (tile_start[e] = the first
// row tile of expert e, k::row_tile_prefix): the last e in [0, E) with tile_start[e] <= g. An empty
// expert shares its start with the next one and is skipped by taking the last.
__device__ __forceinline__ int expert_of_row_tile(const int32_t* tile_start, int E, int g) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_start[mid] <= g) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace ladder::cuda::k
