// Hopper's warpgroup MMA (wgmma, sm_90a only) as grouped_gemm_wgmma.cu uses it, and the shared-memory
// operand layout it reads: PTX ISA "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"
// (wgmma.mma_async, its matrix descriptor, the 128-byte swizzle and the m64nNk16 accumulator
// fragments). Every fact below is an assumption until CudaWgmma.* (tests/cuda/test_cuda_wgmma.cpp)
// has passed on a device; the host emulation (tests/cuda/emu/emu_cuda.h, emu::ptx_wgmma) is written
// from the same text, so the emulated tests show the kernel consistent with it, not the text right.
//
// wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16: a warpgroup (4 consecutive warps, the first
// one's index a multiple of 4; 128 threads) computes D[64 x 128] (+)= A[64 x 16] * B[16 x 128], both
// operands read from shared memory through 64-bit descriptors, D in 64 fp32 registers a thread.
// Accumulators: warp w of the warpgroup owns rows 16w..16w+15; lane (g = lane / 4, t = lane % 4)
// holds, for each n8 column block j, d[4j], d[4j+1] = (row 16w+g, cols 8j+2t, 8j+2t+1) and d[4j+2],
// d[4j+3] = (row 16w+g+8, the same cols): mma.sync's m16n8 C layout repeated over n.
//
// Descriptor (64 bits): bits 0-13 start address >> 4, 16-29 leading-dimension byte offset (LBO) >> 4,
// 32-45 stride-dimension byte offset (SBO) >> 4, 49-51 base offset (0 here), 62-63 swizzle (1 =
// 128-byte). With the 128-byte swizzle, rows are 128 bytes and the 16-byte chunk c of the row at
// shared address r is stored at chunk c ^ ((r >> 7) & 7): the XOR of address bits 4-6 with bits 7-9,
// so a pattern (8 rows, 1024 bytes) must start 1024-aligned in the shared window. The two operand
// forms (the transpose immediates tnspA / tnspB):
//  K-major (0): row x of the operand (m of A, n of B) holds its 64 k of the stage, 128 bytes; rows
//    x and x + 8 are SBO = 1024 bytes apart (8 rows of 128); LBO is unused. The k16 slice kk of the
//    stage starts at +32 kk bytes (the swizzle applies to the whole address, so moving the start
//    inside the row moves every row's chunks consistently).
//  MN-major (1): row k holds 64 consecutive x (128 bytes); SBO = the step between groups of 8 k
//    (1024 bytes: consecutive rows), LBO = the step between blocks of 64 x (here 64 rows apart:
//    8192 bytes). The k16 slice kk starts at +2048 kk bytes.
// Which of LBO / SBO steps which dimension of an MN-major operand is the least certain fact here:
// CudaWgmma.MnMajorStrideRoles tries both assignments on the device and says which one works.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/wgmma_layout.h"

// Every file with wgmma code includes this header: it must be compiled for the arch-specific
// target (CMakeLists.txt's sm_90a object library), since sm_80 and plain sm_90 have no wgmma.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(LADDER_CUDA_EMULATION)
#error "wgmma code needs the sm_90a target: -gencode=arch=compute_90a,code=sm_90a (CMakeLists.txt)"
#endif

namespace ladder::cuda::k::wg {

#ifdef LADDER_CUDA_EMULATION
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return emu::shared_address(p); }
__device__ __forceinline__ void fence_proxy_async() {}
__device__ __forceinline__ void wgmma_fence() { emu::ptx_wgmma_fence(); }
__device__ __forceinline__ void wgmma_commit() { emu::ptx_wgmma_commit(); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  emu::ptx_wgmma_wait(N);
}
template <bool TA, bool TB>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db) {
  emu::ptx_wgmma(d, 128, da, db, TA, TB);
}
__device__ __forceinline__ void fence_operand(float (&)[64]) {}
#else
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// This thread's generic-proxy writes to shared memory (cp.async landings, plain stores) become
// visible to the async proxy the tensor cores read through; then a barrier publishes them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Until at most N of this warpgroup's committed wgmma groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of the accumulators across the asynchronous MMAs.
__device__ __forceinline__ void fence_operand(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
#define LADDER_WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                        "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
// d += A * B (scale-d = 1: the caller zeroes d before the first one), A and B by descriptor,
// TA / TB: the operand is MN-major (the transpose immediates).
template <bool TA, bool TB>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, %66, %67;\n}\n"
      : LADDER_WG_D8(0), LADDER_WG_D8(8), LADDER_WG_D8(16), LADDER_WG_D8(24), LADDER_WG_D8(32), LADDER_WG_D8(40),
        LADDER_WG_D8(48), LADDER_WG_D8(56)
      : "l"(da), "l"(db), "n"(int(TA)), "n"(int(TB)), "r"(1));
}
#undef LADDER_WG_D8
#endif

// The first 1024-byte boundary (one 128-byte-swizzle pattern) of the shared window at or after `p`:
// base offset 0 needs every pattern to start there (PTX ISA, "Matrix Descriptor Format"), and the
// dynamic shared memory is only guaranteed 16-byte aligned (__align__ on an extern __shared__
// array is not honoured at run time: NVIDIA/cccl#5122), so a kernel allocates wg::kPattern bytes
// of slack and starts its tiles here.
__device__ __forceinline__ unsigned char* pattern_aligned(unsigned char* p) {
  return p + ((kPattern - smem_addr(p) % kPattern) % kPattern);
}

}  // namespace ladder::cuda::k::wg
