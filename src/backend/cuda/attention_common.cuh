// What the tensor-core attention kernels share (the WMMA kernels of attention_tc.cu and the
// mma.sync kernels of attention_mma_*.cu): the masking rule, and the staging of 64-row tiles of q,
// k, v, dO (fp32 rounded to bf16, or bf16 as it is) and of per-row statistics into shared memory.
#pragma once
#include <cuda_bf16.h>
#include <cuda_pipeline_primitives.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "backend/cpu/kernels.h"
#include "backend/cuda/device_common.cuh"

namespace ladder::cuda::k::attn {

using bf16 = __nv_bfloat16;

constexpr int kRows = 64;  // rows per tile: query tiles and key tiles alike

// The first key query row i sees, and whether it sees key j: causal, and within the sliding window
// (window > 0) of i.
__device__ __forceinline__ int key_lo(int i, int window) { return window > 0 ? max(0, i - window + 1) : 0; }
__device__ __forceinline__ bool visible(int i, int j, int window) {
  return j <= i && (window <= 0 || i - j < window);
}

// Four consecutive elements p[0..3] of a row into the bf16 tile at d (8-byte aligned). fp32 is
// rounded to nearest even (vec: p is 16-byte aligned, one float4 load); bf16 is copied as it is
// (vec: p is 8-byte aligned, one 8-byte load).
__device__ __forceinline__ void stage4(bf16* d, const float* p, bool vec) {
  float4 f;
  if (vec) f = *reinterpret_cast<const float4*>(p);
  else f = make_float4(p[0], p[1], p[2], p[3]);
  *reinterpret_cast<__nv_bfloat162*>(d) = __floats2bfloat162_rn(f.x, f.y);
  *reinterpret_cast<__nv_bfloat162*>(d + 2) = __floats2bfloat162_rn(f.z, f.w);
}
__device__ __forceinline__ void stage4(bf16* d, const bf16* p, bool vec) {
  Bf16x4 u;
  if (vec) {
    u = *reinterpret_cast<const Bf16x4*>(p);
  } else {
    u.lo.x = p[0], u.lo.y = p[1];
    u.hi.x = p[2], u.hi.y = p[3];
  }
  *reinterpret_cast<Bf16x4*>(d) = u;
}

// Rows [0, ROWS) (a tile: 64) of a row-major fp32 or bf16 matrix whose row 0 is at `src` and rows
// `ld` elements apart into a bf16 [ROWS][LD] shared tile (stage4), by a block of THREADS threads;
// rows at or past `n` are zeros. `vec`: the tensor's base is aligned for 4-element loads (vec_ok), so (HD and ld
// being multiples of 4) every 4-element group is too. Thread t loads column group t % (HD / 4) of
// rows t / (HD / 4) + k * kStep, walking one pointer down the rows: with unroll 4, ptxas issues four
// row loads at a time, and the HD = 128 WMMA dK/dV kernel, which holds 16 accumulator fragments
// across its loop, fits in 168 (fp32 E) / 178 (bf16 E) registers on sm_90 instead of 255 plus a
// 40-byte spill (a flat index loop).
template <int HD, int LD, int THREADS, int ROWS = kRows, class E>
__device__ void load_rows(bf16* dst, const E* src, size_t ld, int n, bool vec) {
  constexpr int C4 = HD / 4, kStep = THREADS / C4;
  static_assert(THREADS % C4 == 0, "a thread's column group is the same on every row it loads");
  static_assert(LD % 4 == 0 && (LD * sizeof(bf16)) % 8 == 0, "8-byte aligned 4-element groups");
  const int c = (threadIdx.x % C4) * 4;
  int r = threadIdx.x / C4;
  bf16* d = dst + r * LD + c;  // 8-byte aligned: c % 4 == 0 and LD * 2 % 8 == 0
  const E* p = src + r * ld + c;
#pragma unroll 4
  for (; r < ROWS; r += kStep, d += kStep * LD, p += kStep * ld) {
    if (r < n) {
      stage4(d, p, vec);
    } else {
      *reinterpret_cast<__nv_bfloat162*>(d) = __floats2bfloat162_rn(0.f, 0.f);
      *reinterpret_cast<__nv_bfloat162*>(d + 2) = __floats2bfloat162_rn(0.f, 0.f);
    }
  }
}

// Rows [r0, r0 + 64) (r0 < S) of head `head` of a [B*S, nh*HD] tensor (batch b; fp32 or bf16) into a
// bf16 [64][LD] shared tile; rows at or past S are zeros.
template <int HD, int LD, int THREADS, class E>
__device__ void load_tile(bf16* dst, const E* src, int b, int S, int nh, int head, int r0, bool vec) {
  load_rows<HD, LD, THREADS>(dst, src + ((size_t(b) * S + r0) * nh + head) * HD, size_t(nh) * HD, S - r0, vec);
}

// load_rows for bf16 whose rows are 16-byte aligned (async_ok), by cp.async: 8-element chunks go
// from global to shared memory without passing through registers, so the caller can compute while
// they are in flight. A chunk lands when the issuing thread waits for the commit group it joins
// (__pipeline_wait_prior) and is visible to the block after the next __syncthreads; rows at or past
// `n` are zeroed by plain stores (no source to copy), visible after that same barrier. The values
// are the ones load_rows stages (bf16 is copied as it is).
template <int HD, int LD, int THREADS, int ROWS = kRows>
__device__ __forceinline__ void load_rows_async(bf16* dst, const bf16* src, size_t ld, int n) {
  constexpr int C8 = HD / 8, kStep = THREADS / C8;
  static_assert(THREADS % C8 == 0 && ROWS % kStep == 0, "a thread's chunk column is the same on every row");
  static_assert((LD * sizeof(bf16)) % 16 == 0, "16-byte aligned shared rows");
  const int c = (threadIdx.x % C8) * 8, r0 = threadIdx.x / C8;
#pragma unroll
  for (int r = r0; r < ROWS; r += kStep) {
    bf16* d = dst + r * LD + c;
    if (r < n) __pipeline_memcpy_async(d, src + r * ld + c, 16);
    else *reinterpret_cast<float4*>(d) = make_float4(0.f, 0.f, 0.f, 0.f);  // all-zero bits: bf16 zeros
  }
}

// Rows [r0, r0 + ROWS) (a tile, or part of one) as load_tile stages them (rows at or past S: zeros),
// but by cp.async (load_rows_async) when E is bf16 and `async` (async_ok of the tensor): the caller
// then waits for the commit group before the barrier that publishes the rows. Otherwise load_rows:
// plain stores, published by the barrier alone (a wait for an empty group is free).
template <int HD, int LD, int THREADS, int ROWS = kRows, class E>
__device__ __forceinline__ void stage_tile(bf16* dst, const E* src, int b, int S, int nh, int head, int r0, bool vec,
                                           bool async) {
  const E* p = src + ((size_t(b) * S + min(r0, S - 1)) * nh + head) * HD;  // rows past S: never read
  const size_t ld = size_t(nh) * HD;
  if constexpr (std::is_same_v<E, bf16>) {
    if (async) {
      load_rows_async<HD, LD, THREADS, ROWS>(dst, p, ld, S - r0);
      return;
    }
  }
  load_rows<HD, LD, THREADS, ROWS>(dst, p, ld, S - r0, vec);
}

// Per-row fp32 values [B, H, S] (lse, D) of rows [r0, r0 + ROWS) into shared memory (0 past S); the
// block's first ROWS threads do it.
template <int ROWS = kRows>
__device__ __forceinline__ void load_row_stats(float* dst, const float* src, int b, int H, int h, int S, int r0) {
  if (threadIdx.x < ROWS) {
    const int i = r0 + threadIdx.x;
    dst[threadIdx.x] = i < S ? src[(size_t(b) * H + h) * S + i] : 0.f;
  }
}

// Occupancy by shared memory: the blocks of `bytes` of dynamic shared memory an SM of `sm_kib` KiB
// holds, with the 1 KiB per block the runtime reserves. sm_90 (H100/H200): 228 KiB per SM, 227 per
// block; sm_80 (A100): 164 and 163. (Registers: 65536 per SM, so blocks of 128 threads fit 2 per SM
// up to 255 registers per thread, 3 up to 168, 4 up to 128, 5 up to 96.)
constexpr int blocks_per_sm(size_t bytes, size_t sm_kib) { return int(sm_kib * 1024 / (bytes + 1024)); }

// Whether a tensor's base allows the 4-element vector loads of stage4.
inline bool vec_ok(const float* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
inline bool vec_ok(const bf16* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; }
// Whether a bf16 tensor's base allows load_rows_async's 16-byte copies: rows of HD = 64 or 128 bf16
// are 128 or 256 bytes, so every row and every 8-element chunk is then 16-byte aligned as well.
inline bool async_ok(const bf16* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
inline bool async_ok(const float*) { return false; }  // fp32 is rounded while staged: no plain copy

// Two consecutive elements of an output row (fp32 values, rounded to bf16 for a bf16 output): one
// 8-byte (fp32) or 4-byte (bf16) store when the base is aligned for it (`vec`: vec2_ok, and every
// pair starts at an even element), else two.
__device__ __forceinline__ void store2(float* d, float a, float b, bool vec) {
  if (vec) {
    *reinterpret_cast<float2*>(d) = make_float2(a, b);
  } else {
    d[0] = a;
    d[1] = b;
  }
}
__device__ __forceinline__ void store2(bf16* d, float a, float b, bool vec) {
  if (vec) {
    *reinterpret_cast<__nv_bfloat162*>(d) = __floats2bfloat162_rn(a, b);
  } else {
    store_rn(d[0], a);
    store_rn(d[1], b);
  }
}
inline bool vec2_ok(const float* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; }
inline bool vec2_ok(const bf16* p) { return reinterpret_cast<uintptr_t>(p) % 4 == 0; }

// The shapes the tensor-core attention kernels (WMMA and mma.sync) take: head_dim 64 or 128, GQA
// with H a multiple of KV.
inline bool shape_ok(const cpu::AttnShape& s) { return (s.hd == 64 || s.hd == 128) && s.KV > 0 && s.H % s.KV == 0; }

}  // namespace ladder::cuda::k::attn
