// The shared-memory tiles of the wgmma attention kernels (attention_wgmma_fwd.cu, _bwd.cu): 64 rows
// (queries or keys) of one head's hd elements, bf16, in wgmma_ptx.cuh's 128-byte swizzle as
// 64-column blocks of [64 rows][128 bytes] (hd 64: one block, 8 KiB; hd 128: two, 16 KiB). One
// layout serves both operand forms: read K-major (rows of hd: the k16 slice kk of hd at block
// kk / 4, byte 32 (kk % 4) of the row) it is an A operand (M = rows) or a B operand with N = rows
// (S = Q K^T, S^T = K Q^T, dP = dO V^T, ...); read MN-major (the k16 slice kk of the rows at row
// 16 kk; SBO = 8 rows, LBO = the next 64-column block, wgmma_layout.h's constants, so whatever
// CudaWgmma.MnMajorStrideRoles finds applies here too) it is a B operand with K = rows and N = hd
// (P V, dV += P^T dO, dK += dS^T Q, dQ += dS K). Every tile starts 1024-aligned (in the shared
// window: the kernels start their tiles at wg::pattern_aligned of the dynamic shared memory).
#pragma once
#include <cuda_bf16.h>
#include <cuda_pipeline_primitives.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/wgmma_layout.h"

namespace ladder::cuda::k::attn {

constexpr int kWgThreads = 128;  // a block is one warpgroup, owning a 64-row tile (warp w: rows 16w..)

template <int HD>
struct WgTile {
  static constexpr int kBytes = kRows * HD * 2;
  static_assert(kBytes % wg::kPattern == 0, "every tile starts on a swizzle pattern");
};

// Byte offset of element (row r, column c) of a tile: column block c / 64, then the swizzled row.
// `swz` false: the planted layout bug (attention_wgmma_plant_layout_bug), rows unswizzled.
__device__ __forceinline__ uint32_t tile_offset(int r, int c, bool swz) {
  const uint32_t off = uint32_t(c / 64) * wg::kMnLboBytes + uint32_t(r) * wg::kRowBytes + uint32_t(c % 64) * 2u;
  return swz ? wg::swizzle128(off) : off;
}

// Rows [r0, r0 + 64) of head `head` of a [B*S, nh*HD] tensor into the tile at `dst` (rows at or past
// S: zeros), as stage_tile stages them (fp32 rounded to nearest even, bf16 copied; cp.async where
// `async`), in 16-byte chunks: the swizzle keeps a chunk's 8 elements together.
template <int HD, class E>
__device__ __forceinline__ void stage_swizzled(unsigned char* dst, const E* src, int b, int S, int nh, int head,
                                               int r0, bool vec, bool async, bool swz) {
  constexpr int C8 = HD / 8, kPerThread = kRows * C8 / kWgThreads;
  static_assert(kWgThreads % C8 == 0, "a thread's chunk column is the same on every row");
  const E* p = src + ((size_t(b) * S + min(r0, S - 1)) * nh + head) * HD;  // rows past S: never read
  const size_t ld = size_t(nh) * HD;
  const int n = S - r0, c = (threadIdx.x % C8) * 8;
#pragma unroll
  for (int x = 0; x < kPerThread; ++x) {
    const int r = threadIdx.x / C8 + x * (kWgThreads / C8);
    unsigned char* d = dst + tile_offset(r, c, swz);
    if (r >= n) {
      *reinterpret_cast<float4*>(d) = make_float4(0.f, 0.f, 0.f, 0.f);  // all-zero bits: bf16 zeros
      continue;
    }
    const E* s = p + r * ld + c;
    if constexpr (std::is_same_v<E, bf16>) {
      if (async) {
        __pipeline_memcpy_async(d, s, 16);
        continue;
      }
    }
    stage4(reinterpret_cast<bf16*>(d), s, vec);
    stage4(reinterpret_cast<bf16*>(d) + 4, s + 4, vec);
  }
}

// Descriptors of k16 slice kk of the tile at shared address `tile`: read K-major (Q, K, V, dO as
// A, or as B with N = rows) and MN-major (V, dO, Q, K as B with K = rows, N = hd).
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t tile, int kk) {
  return wg::make_desc(tile + uint32_t(kk / 4) * wg::kMnLboBytes + uint32_t(kk % 4) * 32u, 16u, wg::kSboBytes);
}
__device__ __forceinline__ uint64_t mnmajor_desc(uint32_t tile, int kk) {
  return wg::make_desc(tile + uint32_t(kk) * 16u * wg::kRowBytes, wg::kMnLboBytes, wg::kSboBytes);
}

}  // namespace ladder::cuda::k::attn
