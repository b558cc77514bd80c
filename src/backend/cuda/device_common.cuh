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

// ---------------------------------------------------------------------------------------------
// Vector access for the memory-bound elementwise and row kernels: V consecutive elements of type T
// moved as one aligned aggregate, which nvcc turns into 16-byte (or 8-byte) loads and stores
// (ld.global.v4 / v2) instead of V scalar ones. Each element still goes through widen() / store_rn(),
// so a vector path computes exactly what the scalar path computes, element by element. The caller
// checks alignment once at launch (aligned16 on every pointer, and V * sizeof(T) a multiple of 16 or
// the pointer's offset a multiple of V * sizeof(T)), never per element.
template <class T, int V>
struct alignas(V * sizeof(T) < 16 ? V * sizeof(T) : 16) Packed {
  T e[V];
};

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <int V, class T>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[V]) {
  using P = Packed<T, V>;  // an alias keeps the cast a simple one (emulate.py checks its alignment)
  const P pk = *reinterpret_cast<const P*>(p);
#pragma unroll
  for (int j = 0; j < V; ++j) v[j] = widen(pk.e[j]);
}

template <int V, class T>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[V]) {
  using P = Packed<T, V>;
  P pk;
#pragma unroll
  for (int j = 0; j < V; ++j) store_rn(pk.e[j], v[j]);
  *reinterpret_cast<P*>(p) = pk;
}

// A compile-time vector width for the generic bodies of for_each_vec.
template <int W>
struct Width {
  static constexpr int value = W;
};

// Grid-stride loop over n elements in vectors of V: body(i, Width<V>{}) for each full vector starting
// at element i (i a multiple of V), then body(i, Width<1>{}) for the n % V tail elements. With V == 1
// it is the plain scalar grid-stride loop. The body does the same per-element arithmetic at either
// width, so the result does not depend on V (only the memory access pattern does).
template <int V, class Body>
__device__ __forceinline__ void for_each_vec(size_t n, Body&& body) {
  const size_t stride = size_t(gridDim.x) * blockDim.x, tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nv = n / V;
  for (size_t i = tid; i < nv; i += stride) body(i * V, Width<V>{});
  if (V > 1)
    for (size_t i = nv * V + tid; i < n; i += stride) body(i, Width<1>{});
}

// Whether the current device runs `kernel`: this binary holds an image of it for the device's
// architecture (an arch-specific sm_90a kernel on anything but an sm_90 device has none, and
// cudaFuncGetAttributes fails, not stickily: the error is cleared here).
template <class Kernel>
bool device_runs(Kernel kernel) {
  cudaFuncAttributes attr;
  const cudaError_t e = cudaFuncGetAttributes(&attr, kernel);
  cudaGetLastError();
  return e == cudaSuccess;
}

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
