// The shared-memory operand layouts of the wgmma grouped GEMM (wgmma_ptx.cuh explains them), as
// plain functions the kernels and the host-side tests (tests/cuda/wgmma_selftest_case.h) share.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define LADDER_WG_HD __host__ __device__
#else
#define LADDER_WG_HD
#endif

namespace ladder::cuda::k::wg {

constexpr int kRowBytes = 128;              // one swizzled row: 64 bf16
constexpr int kStageK = 64;                 // reduction elements per stage (one K-major row)
constexpr int kTileX = 128;                 // operand extent along x per stage
constexpr int kPattern = 8 * kRowBytes;     // one 128-byte-swizzle pattern: 8 rows, 1024 bytes
constexpr int kTileBytes = kTileX * kRowBytes;  // 16 KiB per operand per stage, either form
constexpr uint32_t kSboBytes = kPattern;        // 8 rows on (K-major: 8 x; MN-major: 8 k)
constexpr uint32_t kMnLboBytes = kStageK * kRowBytes;  // MN-major: the next 64 x (8192 bytes)
static_assert(kTileBytes == 2 * kMnLboBytes, "an MN-major tile is two blocks of 64 x");

// The 128-byte swizzle of a byte offset from a 1024-aligned base: chunk bits 4-6 ^= row bits 7-9.
LADDER_WG_HD constexpr uint32_t swizzle128(uint32_t off) { return off ^ (((off >> 7) & 7u) << 4); }
// Byte offset of element (x, t) in a K-major stage tile ([128 x][64 t], row x at 128 x).
LADDER_WG_HD constexpr uint32_t kmajor_offset(int x, int t) {
  return swizzle128(uint32_t(x) * kRowBytes + uint32_t(t) * 2u);
}
// Byte offset of element (x, t) in an MN-major stage tile ([2 blocks of 64 x][64 t][64 x]).
LADDER_WG_HD constexpr uint32_t mnmajor_offset(int x, int t) {
  return swizzle128(uint32_t(x / 64) * kMnLboBytes + uint32_t(t) * kRowBytes + uint32_t(x % 64) * 2u);
}

// The descriptor of an operand starting at shared address `saddr` (128-byte swizzle, base offset 0).
LADDER_WG_HD constexpr uint64_t make_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((saddr >> 4) & 0x3FFFu) | (uint64_t((lbo >> 4) & 0x3FFFu) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFFu) << 32) | (uint64_t(1) << 62);
}

}  // namespace ladder::cuda::k::wg
