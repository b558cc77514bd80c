// What the two tensor-core grouped GEMMs share (grouped_gemm_tc.cu: mma.sync / WMMA, sm_80 and
// sm_90; grouped_gemm_wgmma.cu: wgmma, sm_90a only): the operand and output descriptions, the
// epilogue's strip writer, which output tile a block takes (device-side offsets only), and the host
// checks that choose an operand's staging path. Both kernels compute 128 x 128 output tiles, so a
// tile id means the same thing in either (the contract: grouped_gemm_tc.cuh).
#pragma once
#include <cuda_bf16.h>
#include <cuda_pipeline_primitives.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "backend/cuda/device_common.cuh"

namespace ladder::cuda::k::gg {

using bf16 = __nv_bfloat16;

constexpr int kBX = 128;  // output tile extent in both dimensions (rows and columns)

// An operand: element (x, t) at p[x * ld + t] (t-contiguous) or p[t * ld + x]; x < xlim valid;
// p is const float* or, when b16, const bf16*. `vec`: p is aligned to 4 elements (16 bytes fp32,
// 8 bytes bf16) and ld % 4 == 0, so every group of 4 starting at a multiple of 4 is.
struct Operand {
  const void* p;
  size_t ld;
  int xlim;
  bool vec;
  bool b16;
};

// The output: fp32, or bf16 (c16: rounded to nearest even; beta is 0 then, C never read).
struct Out {
  void* p;
  bool c16;
};

// p advanced by n elements of the operand's type.
__device__ __forceinline__ const void* advance(const void* p, bool b16, size_t n) {
  return static_cast<const char*>(p) + n * (b16 ? sizeof(bf16) : sizeof(float));
}

// The first `nv` (0..4) of 4 consecutive elements from element `off` of op into v (the rest stay 0);
// one vector load when all 4 are valid and op.vec.
__device__ __forceinline__ void load4(float (&v)[4], const Operand& op, size_t off, int nv) {
  if (op.b16) {
    const bf16* p = static_cast<const bf16*>(op.p) + off;
    if (op.vec && nv == 4) {
      const Bf16x4 u = *reinterpret_cast<const Bf16x4*>(p);
      v[0] = __bfloat162float(u.lo.x), v[1] = __bfloat162float(u.lo.y);
      v[2] = __bfloat162float(u.hi.x), v[3] = __bfloat162float(u.hi.y);
    } else {
#pragma unroll  // static indices: v stays in registers
      for (int i = 0; i < 4; ++i)
        if (i < nv) v[i] = __bfloat162float(p[i]);
    }
  } else {
    const float* p = static_cast<const float*>(op.p) + off;
    if (op.vec && nv == 4) {
      const float4 f = *reinterpret_cast<const float4*>(p);
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
#pragma unroll  // static indices: v stays in registers
      for (int i = 0; i < 4; ++i)
        if (i < nv) v[i] = p[i];
    }
  }
}

// The group of 4 consecutive elements at (x, tt) of op (along t when TC: t-contiguous, else along
// x) as fp32 into v: its valid elements (x < op.xlim, t < tlim), zeros for the rest.
template <bool TC>
__device__ __forceinline__ void load_group4(float (&v)[4], const Operand& op, int x, int tt, int tlim) {
#pragma unroll  // static indices: v stays in registers
  for (int i = 0; i < 4; ++i) v[i] = 0.f;
  if (x < op.xlim && tt < tlim) {
    if (TC) load4(v, op, size_t(x) * op.ld + tt, min(4, tlim - tt));
    else load4(v, op, size_t(tt) * op.ld + x, min(4, op.xlim - x));
  }
}

// The chunk of 8 consecutive elements at (x, tt) of a bf16 operand (aligned to 8 elements, 16 bytes)
// into shared memory at d: one 16-byte cp.async (landing by the wait for its commit group) when all
// 8 are valid; the rare chunk at or past the edge as its valid elements and zeros, by plain stores.
template <bool TC>
__device__ __forceinline__ void copy_chunk8(bf16* d, const Operand& op, int x, int tt, int tlim) {
  const bf16* p = static_cast<const bf16*>(op.p);
  const bf16* src = TC ? p + size_t(x) * op.ld + tt : p + size_t(tt) * op.ld + x;
  const int nv = TC ? (x < op.xlim ? tlim - tt : 0) : (tt < tlim ? op.xlim - x : 0);
  if (nv >= 8) {
    __pipeline_memcpy_async(d, src, 16);
  } else {  // nv may be <= 0: all zeros
    for (int i = 0; i < 8; ++i) d[i] = i < nv ? src[i] : __float2bfloat16_rn(0.f);
  }
}

// Epilogue: a warp's staged 16 x 32 strip (rows m0.., columns n0.. of the tile, [16][ld] fp32) to
// C, lane = column, 128 contiguous bytes per row: C = alpha * acc (+ beta * C, read only when
// beta != 0; c16: rounded to nearest even).
__device__ __forceinline__ void write_strip(const float* stg, int ld, int m0, int n0, int lane, float alpha, float beta,
                                            Out C, size_t ldc, int mlim, int nlim) {
  const int n = n0 + lane;
  if (n >= nlim) return;
  for (int r = 0; r < 16; ++r) {
    const int m = m0 + r;
    if (m >= mlim) break;
    const float v = alpha * stg[r * ld + lane];
    if (C.c16) {
      static_cast<bf16*>(C.p)[size_t(m) * ldc + n] = __float2bfloat16_rn(v);
    } else {
      float* c = static_cast<float*>(C.p) + size_t(m) * ldc + n;
      *c = beta == 0.f ? v : v + beta * *c;  // beta 0: C is not read (it may hold NaN)
    }
  }
}

// One output tile and its operands, as a block of either kernel sees them: the A and B operands
// (x the output coordinate, t the reduction index), the reduction length, the output at the tile's
// (0, 0) and the tile's valid extent.
struct Tile {
  Operand a, b;
  int tlim;
  Out out;
  int mlim, nlim;
};

// rows_out = true, linear tile id `id` of [0, tile_start[E] * tilesN): consecutive ids share a row
// tile (128 rows of one expert, found by binary search in k::row_tile_prefix's tile_start), whose
// columns n0.. they split. A: the expert's rows (t-contiguous); B: expert e's weight, t-contiguous
// when transB.
__device__ __forceinline__ Tile rows_tile(int64_t id, int tilesN, const int32_t* offsets, const int32_t* tile_start,
                                          int E, bool transB, int N, int K, const void* A, bool a16, int lda,
                                          bool vecA, const void* B, bool b16, int ldb, size_t strideB, bool vecB,
                                          void* C, bool c16, int ldc) {
  const int g = int(id / tilesN), nt = int(id % tilesN);
  const int e = expert_of_row_tile(tile_start, E, g);
  const int row0 = offsets[e] + (g - tile_start[e]) * kBX;
  const int rows = min(offsets[e + 1] - row0, kBX);
  const int n0 = nt * kBX;
  const size_t b0 = size_t(e) * strideB + (transB ? size_t(n0) * ldb : size_t(n0));
  return Tile{Operand{advance(A, a16, size_t(row0) * lda), size_t(lda), rows, vecA, a16},
              Operand{advance(B, b16, b0), size_t(ldb), N - n0, vecB, b16},
              K,
              Out{const_cast<void*>(advance(C, c16, size_t(row0) * ldc + n0)), c16},
              rows,
              N - n0};
}

// rows_out = false, block `blk` of the E x tilesM x tilesN grid: C_e's tile (m0, n0), reducing over
// the expert's rows (both operands x-contiguous). `rows` (out): the expert's row count.
__device__ __forceinline__ Tile wgrad_tile(unsigned blk, const int32_t* offsets, int M, int N, const void* A, bool a16,
                                           int lda, bool vecA, const void* B, bool b16, int ldb, bool vecB, void* C,
                                           bool c16, int ldc, size_t strideC) {
  const int tilesM = (M + kBX - 1) / kBX, tilesN = (N + kBX - 1) / kBX;
  const int64_t per_e = int64_t(tilesM) * tilesN;
  const int e = int(blk / per_e);
  const int64_t rem = blk % per_e;
  const int m0 = int(rem / tilesN) * kBX, n0 = int(rem % tilesN) * kBX;
  const int r0 = offsets[e];
  const int rows = max(0, offsets[e + 1] - r0);
  return Tile{Operand{advance(A, a16, size_t(r0) * lda + m0), size_t(lda), M - m0, vecA, a16},
              Operand{advance(B, b16, size_t(r0) * ldb + n0), size_t(ldb), N - n0, vecB, b16},
              rows,
              Out{const_cast<void*>(advance(C, c16, size_t(e) * strideC + size_t(m0) * ldc + n0)), c16},
              M - m0,
              N - n0};
}

// Blocks of the rows_out = false grid (E x tilesM x tilesN, wgrad_tile), or -1 above INT_MAX (the
// launchers' cudaErrorInvalidConfiguration).
inline int64_t wgrad_blocks(int E, int M, int N) {
  const int64_t blocks = int64_t(E) * ((M + kBX - 1) / kBX) * ((N + kBX - 1) / kBX);
  return blocks > INT_MAX ? -1 : blocks;
}

// Four elements' worth of alignment: 16 bytes for fp32, 8 for bf16.
inline bool aligned4(const void* p, bool b16) { return (reinterpret_cast<uintptr_t>(p) & (b16 ? 7u : 15u)) == 0; }
// cp.async staging: bf16, 16-byte aligned, and every row (and expert, `stride`) start too.
inline bool async_ok(const void* p, bool b16, size_t ld, size_t stride) {
  return b16 && (reinterpret_cast<uintptr_t>(p) & 15u) == 0 && ld % 8 == 0 && stride % 8 == 0;
}

// How each operand of a grouped GEMM call can be staged, the same for every tile product: vector
// loads of 4 (vecA / vecB) and cp.async (a_async / b_async). B's expert stride counts only in the
// rows_out shape (B_e = B + e * strideB); in the weight-gradient shape both operands are row blocks.
struct Staging {
  bool vecA, vecB, a_async, b_async;
};
inline Staging staging(bool rows_out, const void* A, bool a_bf16, int lda, const void* B, bool b_bf16, int ldb,
                       size_t strideB) {
  const size_t sb = rows_out ? strideB : 0;
  return {aligned4(A, a_bf16) && lda % 4 == 0, aligned4(B, b_bf16) && ldb % 4 == 0 && sb % 4 == 0,
          async_ok(A, a_bf16, size_t(lda), 0), async_ok(B, b_bf16, size_t(ldb), sb)};
}

}  // namespace ladder::cuda::k::gg
