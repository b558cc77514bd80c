// The PTX warp-level matrix instructions the register-resident kernels use (attention_mma_*.cu):
// mma.sync m16n8k16 with bf16 inputs and fp32 accumulators, and ldmatrix (shared memory ->
// fragments, plain and transposed). Unlike WMMA, their fragment layouts are documented (PTX ISA,
// "Matrix Fragments for mma.m16n8k16 with floating point type" and "ldmatrix"), so a kernel may do
// per-row work (masking, softmax) on accumulators in registers. Lane l: g = l / 4, t = l % 4.
//   A 16x16 bf16 (row):  a[0] = row g,   cols 2t, 2t+1     a[1] = row g+8, cols 2t, 2t+1
//                        a[2] = row g,   cols 2t+8, 2t+9   a[3] = row g+8, cols 2t+8, 2t+9
//   B 16x8 bf16 (col):   b[0] = k 2t, 2t+1, col g          b[1] = k 2t+8, 2t+9, col g
//   C/D 16x8 fp32:       c[0], c[1] = row g, cols 2t, 2t+1;  c[2], c[3] = row g+8, cols 2t, 2t+1
// A 32-bit word holds two bf16, the lower column (or k) in its low half. So the accumulators of two
// adjacent n8 tiles (columns 8j.. and 8j+8..) are, rounded to bf16 and packed, exactly the A
// fragment of the k16 slice they span (pack_a below): P = softmax(S) feeds P V without a trip
// through shared memory.
// ldmatrix .x4: lanes 8j..8j+7 give the addresses of rows 0..7 of 8x8 matrix j (16-byte aligned,
// shared memory); register j gets row g, columns 2t, 2t+1 of matrix j, or with .trans rows 2t, 2t+1
// of column g. .x2: lanes 0..15 give the addresses of matrices 0 and 1.
//
// Below them, the warp-level building blocks the attention kernels share: each lane's ldmatrix row
// address (frag_a, frag_b_nk), a pair of n8 MMAs from one x4 load (mma2), and acc += P B with P
// from accumulators (mma_ab_acc).
//
// On the host emulation (tests/cuda/emu, LADDER_CUDA_EMULATION) the same functions are emu_cuda.h's
// stand-ins, written from the same layouts; CudaMmaPtx.* (tests/cuda) checks them on a device
// against a CPU product, which is what proves the layouts (and the emulation) right.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace ladder::cuda::k {

#ifdef LADDER_CUDA_EMULATION
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  emu::ptx_mma_bf16_16816(d, a, b);
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) { emu::ptx_ldmatrix(r, 4, false, row); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  emu::ptx_ldmatrix(r, 4, true, row);
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* row) { emu::ptx_ldmatrix(r, 2, false, row); }
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* row) {
  emu::ptx_ldmatrix(r, 2, true, row);
}
#else
// d += a * b (fp32 accumulators).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// The "memory" clobbers keep the compiler from moving plain shared-memory stores across the loads.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* row) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(s) : "memory");
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* row) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(s)
               : "memory");
}
#endif

// Two floats rounded to bf16 (nearest even), packed: lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, sizeof(u));
  return u;
}

// The A fragment (16 x k16, bf16) of the k16 slice spanned by two adjacent n8 accumulator tiles c0
// (columns 0..7 of the slice) and c1 (columns 8..15), rounded to bf16: the layouts above line up.
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

// The lane's row address for ldmatrix_x4 (plain or .trans) of the 16x16 block at (r0, c0) of a
// row-major bf16 tile: matrices 0..3 = (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols
// 8-15), (rows 8-15, cols 8-15). Plain, that is the A fragment of rows r0.. and k columns c0.. ;
// .trans on a [k][n] tile, it is the B fragments of the n8 tiles at columns c0 (registers 0, 1) and
// c0 + 8 (registers 2, 3) of the k16 slice at rows r0.
__device__ __forceinline__ const __nv_bfloat16* frag_a(const __nv_bfloat16* tile, int ld, int r0, int c0, int lane) {
  return tile + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + c0 + (lane >> 4) * 8;
}
// The lane's row address for ldmatrix_x4 (plain) of B from a [n][k] row-major tile: the B fragments
// of the n8 tiles at rows n0 (registers 0, 1) and n0 + 8 (registers 2, 3), k16 slice at column k0:
// matrices 0..3 = (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
__device__ __forceinline__ const __nv_bfloat16* frag_b_nk(const __nv_bfloat16* tile, int ld, int n0, int k0, int lane) {
  return tile + (n0 + (lane & 7) + (lane >> 4) * 8) * ld + k0 + ((lane >> 3) & 1) * 8;
}

// d0 += a * (b[0], b[1]), d1 += a * (b[2], b[3]): the two n8 tiles of one ldmatrix_x4 of B.
__device__ __forceinline__ void mma2(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[4], const uint32_t (&b)[4]) {
  const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
  mma_bf16_16816(d0, a, b0);
  mma_bf16_16816(d1, a, b1);
}

// acc[n] (16 x HD: n8 tiles) += bf16(p)[16 x C] * B[C x HD], p given as C / 8 n8 accumulator tiles
// (pack_a), B = rows [k0, k0 + C) of the [.][LD] bf16 row-major shared tile `bm` (ldmatrix .trans).
template <int HD, int C, int LD>
__device__ __forceinline__ void mma_ab_acc(float (&acc)[HD / 8][4], const float (&p)[C / 8][4], const __nv_bfloat16* bm,
                                           int k0, int lane) {
#pragma unroll
  for (int kk = 0; kk < C / 16; ++kk) {
    uint32_t fa[4];
    pack_a(fa, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
    for (int n = 0; n < HD / 16; ++n) {
      uint32_t fb[4];
      ldmatrix_x4_trans(fb, frag_a(bm, LD, k0 + kk * 16, n * 16, lane));
      mma2(acc[2 * n], acc[2 * n + 1], fa, fb);
    }
  }
}

// The lane's row address for ldmatrix_x4_trans of the A fragment (16 m x k16) from a [k][m]
// row-major tile (A stored transposed: m contiguous), k16 slice at row k0, rows m0.. of A. The A
// fragment's matrices 0..3 are (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15),
// i.e. the tile's blocks (rows k 0-7, cols m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15):
// frag_b_nk's order with k as the tile's rows; .trans hands lane (g, t) rows k 2t, 2t+1 of column m g.
__device__ __forceinline__ const __nv_bfloat16* frag_a_km(const __nv_bfloat16* tile, int ld, int k0, int m0, int lane) {
  return frag_b_nk(tile, ld, k0, m0, lane);
}

}  // namespace ladder::cuda::k
