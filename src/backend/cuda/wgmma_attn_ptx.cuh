// The wgmma (sm_90a) forms the attention kernels use beyond wgmma_ptx.cuh's m64n128k16 (which
// keeps its layout facts: descriptor, 128-byte swizzle, K-major / MN-major operands, accumulator
// fragments). Accumulators are held here as [N / 8][4] arrays: element [j][e] is the m64nN
// accumulator register 4j + e (n8 column block j; e = 0, 1 row g, columns 8j + 2t, + 1; e = 2, 3
// row g + 8), which is mma.sync's m16n8 C tile j of the warp (mma_ptx.cuh), so the attention's
// per-tile softmax code reads them unchanged.
//
//  ss<N, TB>: D[64 x N] += A[64 x 16] * B[16 x N], A and B from shared memory by descriptor (A
//    K-major; TB: B MN-major). S = Q K^T uses it with N = 64 (keys), both K-major.
//  rs<N, TB>: the same with A from registers: PTX ISA "Register Fragments and Shared Memory Matrix
//    Layouts", wgmma .m64nNk16 A: warp w of the warpgroup holds rows 16w..16w+15 of A in four
//    32-bit registers a0..a3 laid out as mma.m16n8k16's A fragment (lane g = l / 4, t = l % 4:
//    a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..); the lower
//    column in the low half). So a pair of S accumulator tiles (2kk, 2kk + 1), rounded to bf16 by
//    pack_a (mma_ptx.cuh), is the A fragment of key slice kk: P V takes P from registers. The
//    instruction has one transpose immediate (B's); A in registers is always "row-major".
// The register-A layout is an assumption until CudaAttentionWgmma.* has passed on a device (the
// emulation, tests/cuda/emu/emu_wgmma_rs.h, is written from the same reading of the text).
// A's registers and the accumulators must not be touched until wgmma.wait_group retires the MMA.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/wgmma_ptx.cuh"

namespace ladder::cuda::k::wg {

// Keeps the compiler from moving accesses of the accumulators across the asynchronous MMAs.
template <int J>
__device__ __forceinline__ void fence_acc(float (&d)[J][4]) {
#ifndef LADDER_CUDA_EMULATION
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
#endif
}

#ifdef LADDER_CUDA_EMULATION
template <int N, bool TB>
__device__ __forceinline__ void ss(float (&d)[N / 8][4], uint64_t da, uint64_t db) {
  emu::ptx_wgmma(&d[0][0], N, da, db, false, TB);
}
template <int N, bool TB>
__device__ __forceinline__ void rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db) {
  emu::ptx_wgmma_rs(&d[0][0], N, a, db, TB);
}
#else
// Operand lists: the accumulators of n8 blocks j .. j + 1 (8 registers).
#define LADDER_WGA_D2(j)                                                                                      \
  "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3]), "+f"(d[j + 1][0]), "+f"(d[j + 1][1]),          \
      "+f"(d[j + 1][2]), "+f"(d[j + 1][3])
#define LADDER_WGA_R32                                                                                         \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                   \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define LADDER_WGA_R64                                                                                         \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                   \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                          \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                          \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d += A * B, both by descriptor (scale-d = 1: the caller zeroes d first); A K-major.
template <int N, bool TB>
__device__ __forceinline__ void ss(float (&d)[N / 8][4], uint64_t da, uint64_t db) {
  static_assert(N == 64, "the attention uses m64n64k16 with both operands in shared memory");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %35, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " LADDER_WGA_R32 ", %32, %33, p, 1, 1, 0, %34;\n}\n"
      : LADDER_WGA_D2(0), LADDER_WGA_D2(2), LADDER_WGA_D2(4), LADDER_WGA_D2(6)
      : "l"(da), "l"(db), "n"(int(TB)), "r"(1));
}

// d += A * B, A from registers (the warp's m16n8k16 A fragment), B by descriptor.
template <int N, bool TB>
__device__ __forceinline__ void rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db) {
  static_assert(N == 64 || N == 128, "m64n64k16 or m64n128k16");
  if constexpr (N == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " LADDER_WGA_R32
        ", {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
        : LADDER_WGA_D2(0), LADDER_WGA_D2(2), LADDER_WGA_D2(4), LADDER_WGA_D2(6)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(int(TB)), "r"(1));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " LADDER_WGA_R64
        ", {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
        : LADDER_WGA_D2(0), LADDER_WGA_D2(2), LADDER_WGA_D2(4), LADDER_WGA_D2(6), LADDER_WGA_D2(8),
          LADDER_WGA_D2(10), LADDER_WGA_D2(12), LADDER_WGA_D2(14)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(int(TB)), "r"(1));
  }
}
#undef LADDER_WGA_D2
#undef LADDER_WGA_R32
#undef LADDER_WGA_R64
#endif

}  // namespace ladder::cuda::k::wg
