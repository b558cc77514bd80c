// A one-warp check of mma_ptx.cuh's fragment layouts: D (16x8 fp32) = A (16x16 bf16) * B (16x8 bf16),
// with the operands reaching their fragments four ways. A device test (CudaMmaPtx.*) compares each
// with a CPU product: if the layouts written in mma_ptx.cuh (and the host emulation built from them)
// were wrong, this is where a GPU says so, before any kernel built on them is trusted.
//   mode 0: A by ldmatrix_x4 from row-major A; B by ldmatrix_x2 from B stored [n][k] (B^T row-major)
//   mode 1: A by ldmatrix_x4_trans from A stored [k][m] (A^T row-major); B by ldmatrix_x2_trans from
//           B stored [k][n]
//   mode 2: A and B read straight from global memory into the documented register layout (the mma's
//           layout alone, without ldmatrix)
//   mode 3: as mode 0, then D (rounded to bf16, zero-extended to 16 x 16 as the first n8 tile of a
//           k16 slice) times B again: D2 = [bf16(D) | 0] * B, through pack_a (the C -> A
//           correspondence the attention kernels use for P V)
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/mma_ptx.cuh"
#include "backend/cuda/mma_selftest.cuh"

namespace ladder::cuda::k {

namespace {

using bf16 = __nv_bfloat16;
constexpr int kLd = 24;  // shared rows of 24 bf16 (48 bytes: every row 16-byte aligned)

__device__ __forceinline__ uint32_t word(const uint16_t* p) { return uint32_t(p[0]) | (uint32_t(p[1]) << 16); }

// a: A row-major [16][16]; at: A^T row-major [16][16]; bnk: B^T [8][16]; bkn: B [16][8] (bf16 bits).
__global__ void mma_selftest_kernel(float* d, const uint16_t* a, const uint16_t* at, const uint16_t* bnk,
                                    const uint16_t* bkn, int mode) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint16_t* As = reinterpret_cast<uint16_t*>(smem);  // [16][kLd]: A (mode 0, 3) or A^T (mode 1)
  uint16_t* Bs = As + 16 * kLd;                       // [16][kLd]: B^T rows 0..7 (mode 0, 3) or B [16][8]
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  for (int i = lane; i < 16 * 16; i += 32) As[(i / 16) * kLd + i % 16] = mode == 1 ? at[i] : a[i];
  for (int i = lane; i < 16 * 8; i += 32) {
    if (mode == 1) Bs[(i / 8) * kLd + i % 8] = bkn[i];  // [k][n]
    else Bs[(i / 16) * kLd + i % 16] = bnk[i];          // [n][k]
  }
  __syncwarp();
  uint32_t fa[4], fb[2];
  const int j = lane / 8, r = lane % 8;
  // Modes 0 and 1 address the loads as the attention kernels do (frag_a, frag_b_nk: lanes 0-15 of
  // an x4 address are an x2's), so a device run checks those helpers too.
  const bf16* as = reinterpret_cast<const bf16*>(As);
  const bf16* bs = reinterpret_cast<const bf16*>(Bs);
  if (mode == 0 || mode == 3) {
    ldmatrix_x4(fa, frag_a(as, kLd, 0, 0, lane));
    ldmatrix_x2(fb, frag_b_nk(bs, kLd, 0, 0, lane));
  } else if (mode == 1) {
    ldmatrix_x4_trans(fa, As + ((j >> 1) * 8 + r) * kLd + (j & 1) * 8);  // A^T: [k][m]
    ldmatrix_x2_trans(fb, frag_a(bs, kLd, 0, 0, lane));
  } else {
    fa[0] = word(a + g * 16 + 2 * t);
    fa[1] = word(a + (g + 8) * 16 + 2 * t);
    fa[2] = word(a + g * 16 + 2 * t + 8);
    fa[3] = word(a + (g + 8) * 16 + 2 * t + 8);
    fb[0] = uint32_t(bkn[(2 * t) * 8 + g]) | (uint32_t(bkn[(2 * t + 1) * 8 + g]) << 16);
    fb[1] = uint32_t(bkn[(2 * t + 8) * 8 + g]) | (uint32_t(bkn[(2 * t + 9) * 8 + g]) << 16);
  }
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  mma_bf16_16816(acc, fa, fb);
  if (mode == 3) {  // [bf16(D) | 0] (16 x 16) * B
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
    uint32_t fp[4];
    pack_a(fp, acc, zero);
    float acc2[4] = {0.f, 0.f, 0.f, 0.f};
    mma_bf16_16816(acc2, fp, fb);
    for (int i = 0; i < 4; ++i) acc[i] = acc2[i];
  }
  d[g * 8 + 2 * t] = acc[0];
  d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2];
  d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

}  // namespace

cudaError_t mma_ptx_selftest(float* d, const uint16_t* a, const uint16_t* at, const uint16_t* bnk, const uint16_t* bkn,
                             int mode, cudaStream_t st) {
  if (mode < 0 || mode > 3) return cudaErrorInvalidValue;
  mma_selftest_kernel<<<1, 32, 2 * 16 * kLd * sizeof(uint16_t), st>>>(d, a, at, bnk, bkn, mode);
  return cudaGetLastError();
}

}  // namespace ladder::cuda::k
