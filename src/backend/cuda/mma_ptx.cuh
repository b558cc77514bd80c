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

}  // namespace ladder::cuda::k
