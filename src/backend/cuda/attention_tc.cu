// Tensor-core flash attention: bf16 inputs to the MMA, fp32 accumulation (docs/cuda.md, "Tensor-core
// attention"). Same contract as attention.cu (the fp32 reference it is tested against).
//
// Only the portable WMMA API (nvcuda::wmma, bf16 16x16x16 fragments, sm_80+) touches the tensor
// cores, and no fragment's element-to-thread mapping is ever assumed: every accumulator tile that
// needs per-row work (masking, online softmax, exp, dS) is stored to shared memory with
// store_matrix_sync, worked on there by ordinary threads, converted to bf16 in shared memory and
// loaded back as a matrix_a fragment (over the warp's own rows of the fp32 tile it was computed
// from: see Tiles). The accumulators (the forward's O, the backward's dK, dV, dQ) stay in
// fragments across the key / query loop; the forward's O goes through the warp's slab of the score
// tile only when one of the warp's rows needs its online-softmax rescale (store, scale each row,
// load back: exact) and for the epilogue.
//
// Work layout: blocks of 128 threads (4 warps) own a tile of 64 rows (query rows in the forward
// and the dQ kernel, key rows in the dK/dV kernel); warp w owns rows [16w, 16w + 16) of the tile and
// computes the full 64-wide score block of those rows against the other operand's 64-row tile.
// Elementwise work on a warp's 16 x 64 score block: lane = 2 * row + half, each lane does 32
// consecutive columns of its row, so a row's max and sum are one xor-1 shuffle.
//
// Masking is exact: a (query i, key j) pair is used iff i < S, j < S, j <= i and (window <= 0 or
// i - j < window); every other entry of a tile gets p = 0 (and score -inf before the max), rows
// and keys past S are loaded as zeros. A warp whose 16 rows see no key of the current tile skips
// it entirely (the skipped update is the identity: m unchanged, p = 0). Every query row i < S sees
// key i, so its running max becomes finite at the tile holding key i and l >= 1 from then on: no
// exp(-inf - -inf) and no division by zero.
//
// Backward without atomics (deterministic): D = rowsum(bf16(dO) * O) in fp32 first; then a kernel that
// owns 64 key rows and loops over the query tiles of every head of its KV group in head order (dK,
// dV) and one that owns 64 query rows and loops over key tiles (dQ). Both recompute P from q, k and
// the forward's lse, with the same bf16 rounding and the same MMA order as the forward.
//
// bf16 activations (model.attn_bf16): the kernels are templated on the storage type E of q, k, v
// and o (float or __nv_bfloat16). The tiles are bf16 in shared memory either way: fp32 rows are
// rounded to nearest even as they are staged, bf16 rows copied as they are, which are the bits the
// rounding of their widened values would give. The forward's epilogue rounds o to bf16 (store_rn),
// and the backward's D reads the bf16 o widened. So on bf16 inputs the kernels give bitwise what
// the fp32-input kernels give on the widened inputs (o then rounded): the same tiles, the same MMAs,
// the same fp32 softmax; there is no widening pass and no scratch copy. dO, lse, D and the
// gradients stay fp32.
#include <cuda_bf16.h>
#include <mma.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <cstdint>

#include "backend/cuda/attention_tc.cuh"
#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/attention_wgmma.cuh"
#include "backend/cuda/device_common.cuh"

namespace ladder::cuda::k {

namespace {

using cpu::AttnShape;
using bf16 = __nv_bfloat16;
namespace wmma = nvcuda::wmma;

constexpr int kThreads = 128;  // 4 warps per block, every kernel here
using attn::kRows;  // rows per tile: query tiles and key tiles alike
constexpr int kLdS = kRows + 4;  // fp32 [64][64] score tiles (ldm multiple of 4 floats)
// The bf16 P (forward), P^T, dS^T (dK/dV) and dS (dQ) rows, each over the fp32 row of the score tile it
// is computed from (Tiles): ld kLdB halves (= kLdS floats, 272 bytes), columns [0, 32) at halves
// [0, 32) of the row and columns [32, 64) at halves [64, 96), i.e. 16-column block kk at half
// kk * 16 + (kk / 2) * kGapB. So the lane doing a half row (columns [32 half, +32): fp32 bytes
// [128 half, +128) of the row) writes its bf16 values to bytes [128 half, +64): over fp32 values it
// has itself read, no other lane's.
constexpr int kLdB = 2 * kLdS;
constexpr int kGapB = 32;

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Shared-memory tile sizes in bytes. Every one is a multiple of 128 bytes, so carving them one after
// the other from the (128-byte aligned) dynamic buffer keeps each tile 128-byte aligned, and every
// 16x16 sub-tile a WMMA call addresses starts on a 32-byte boundary (rows are multiples of 16 apart,
// columns multiples of 16 elements), as load/store_matrix_sync require.
//
// No kernel has bf16 P / dS tiles of its own: each bf16 row of P (forward), P^T, dS^T (dK/dV) or dS
// (dQ) lies inside the fp32 row of S, S^T, dP^T or dP it is computed from (kLdB), and a lane writes
// the bf16 values of its half row over fp32 values of that half row, after reading them (a
// __syncwarp orders the loads before the stores). The rows are warp w's own (rows [16w, 16w + 16):
// only warp w touches them between two block barriers), and each 16x16 block starts on a 32-byte
// boundary (kSlab, kGapB). The forward has no fp32 O tile either: O stays in fragments, staged
// through the warp's slab (16 x kLdS floats: 64 columns at a time) for a rescale and the epilogue,
// when the slab's S has been read into registers and before P is written over it. So the forward
// needs Q K V and S only, the dK/dV kernel no P^T, dS^T tiles and the dQ kernel no dS tile, with
// the same MMAs and results as separate tiles: blocks_per_sm below.
template <int HD>
struct Tiles {
  static constexpr int kLdH = HD + 8;  // bf16 [64][HD] tiles (q, k, v, dO)
  static constexpr int kLdO = HD + 4;  // fp32 [64][HD] output staging of the backward
  static constexpr size_t kH = size_t(kRows) * kLdH * sizeof(bf16);
  static constexpr size_t kS = size_t(kRows) * kLdS * sizeof(float);
  static constexpr size_t kO = size_t(kRows) * kLdO * sizeof(float);
  static constexpr size_t kStats = 2 * kRows * sizeof(float);
  // forward: Q K V | S (P in each warp's slab; O staged in it)
  static constexpr size_t kFwd = 3 * kH + kS;
  // dK/dV: K V Q dO | S^T (P^T in each warp's slab) dP^T (dS^T in each warp's slab) | lse D ;
  // output staging [64][kLdO] fp32 reuses S^T dP^T
  static constexpr size_t kDkdv = 4 * kH + 2 * kS + kStats;
  // dQ: Q dO K V | S dP (dS in each warp's slab) | lse D ; output staging reuses S dP
  static constexpr size_t kDq = 4 * kH + 2 * kS + kStats;
  static constexpr size_t kSlab = size_t(16) * kLdS * sizeof(float);  // a warp's 16 rows of a score tile
  static_assert(kH % 128 == 0 && kS % 128 == 0, "tile alignment");
  static_assert(kSlab % 32 == 0 && kLdB % 8 == 0 && kGapB % 16 == 0 && 4 * 16 + kGapB <= kLdB &&
                    kLdB * sizeof(bf16) == kLdS * sizeof(float) && (kRows / 2 + kGapB) * sizeof(bf16) == kRows / 2 * sizeof(float),
                "bf16 rows over fp32 rows: 32-byte aligned blocks, each lane's bf16 half row over its own fp32 half row");
  static_assert(2 * kS >= kO, "the output staging tile must fit in the two score tiles it reuses");
  static constexpr size_t kMax = kDkdv > kFwd ? (kDkdv > kDq ? kDkdv : kDq) : (kFwd > kDq ? kFwd : kDq);
};

using attn::blocks_per_sm;  // occupancy by shared memory (attention_common.cuh)
// sm_90: hd 128 dK/dV, dQ 2 blocks (8 warps) per SM, forward 3 (12 warps); hd 64 dK/dV, dQ 3 blocks,
// forward 5 (20 warps).
static_assert(blocks_per_sm(Tiles<128>::kDkdv, 228) >= 2 && blocks_per_sm(Tiles<128>::kDq, 228) >= 2 &&
                  blocks_per_sm(Tiles<128>::kFwd, 228) >= 3,
              "hd 128: two backward blocks and three forward blocks per sm_90 SM");
static_assert(blocks_per_sm(Tiles<64>::kDkdv, 228) >= 3 && blocks_per_sm(Tiles<64>::kDq, 228) >= 3 &&
                  blocks_per_sm(Tiles<64>::kFwd, 228) >= 5,
              "hd 64: three backward blocks and five forward blocks per sm_90 SM");
// sm_80: hd 64 2 blocks per SM of dK/dV and dQ, 3 of the forward; hd 128 one of dK/dV and dQ, 2 of the
// forward (all fit the 163 KiB opt-in).
static_assert(blocks_per_sm(Tiles<64>::kDkdv, 164) >= 2 && blocks_per_sm(Tiles<64>::kDq, 164) >= 2 &&
                  blocks_per_sm(Tiles<64>::kFwd, 164) >= 3 && blocks_per_sm(Tiles<128>::kFwd, 164) >= 2 &&
                  Tiles<128>::kMax <= 163 * 1024,
              "sm_80 occupancy");

// Rows [r0, r0 + 64) of a head into a bf16 [64][kLdH] tile (attention_common.cuh) with this file's
// tile pitch and block size.
template <int HD, class E>
__device__ void load_tile(bf16* dst, const E* src, int b, int S, int nh, int head, int r0, bool vec) {
  attn::load_tile<HD, Tiles<HD>::kLdH, kThreads>(dst, src, b, S, nh, head, r0, vec);
}
using attn::key_lo;
using attn::load_row_stats;
using attn::visible;

// C[16 x 64] (fp32, row-major, ld kLdS) = A[16 x HD] * B^T where A's rows are `a` (row-major bf16,
// ld kLdH) and B's 64 rows are `bt` (row-major bf16 [64][kLdH], read as a col-major HD x 64 matrix).
template <int HD>
__device__ __forceinline__ void mma_abt(float* c, const bf16* a, const bf16* bt) {
  constexpr int kLd = Tiles<HD>::kLdH;
#pragma unroll
  for (int n = 0; n < kRows / 16; ++n) {
    FragC acc;
    wmma::fill_fragment(acc, 0.f);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      FragA fa;
      FragBCol fb;
      wmma::load_matrix_sync(fa, a + kk * 16, kLd);
      wmma::load_matrix_sync(fb, bt + n * 16 * kLd + kk * 16, kLd);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + n * 16, acc, kLdS, wmma::mem_row_major);
  }
}

// acc[n] += A[16 x 64] * B[64 x HD] (column block n), A = `a` (bf16 rows over fp32 score rows: ld
// kLdB, column block kk at kk * 16 + (kk / 2) * kGapB), B = `bm` (bf16 row-major [64][kLdH]).
template <int HD>
__device__ __forceinline__ void mma_ab_acc(FragC (&acc)[HD / 16], const bf16* a, const bf16* bm) {
  constexpr int kLd = Tiles<HD>::kLdH;
#pragma unroll
  for (int kk = 0; kk < kRows / 16; ++kk) {
    FragA fa;
    wmma::load_matrix_sync(fa, a + kk * 16 + (kk / 2) * kGapB, kLdB);
#pragma unroll
    for (int n = 0; n < HD / 16; ++n) {
      FragBRow fb;
      wmma::load_matrix_sync(fb, bm + kk * 16 * kLd + n * 16, kLd);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

// Stores 8 bf16 values (v[0..3]) at `d` (16-byte aligned).
__device__ __forceinline__ void store8(bf16* d, const __nv_bfloat162 (&v)[4]) {
  reinterpret_cast<Bf16x4*>(d)[0] = Bf16x4{v[0], v[1]};
  reinterpret_cast<Bf16x4*>(d)[1] = Bf16x4{v[2], v[3]};
}

// The block's 64 x HD fp32 result (fragments of each warp's 16 rows) to rows [r0, r0 + 64) of head
// `head` of a [B*S, nh*HD] tensor, times `mul`, through the shared staging tile. Called by every
// thread of the block (it synchronizes).
template <int HD>
__device__ void store_result(float* dst, float* stage, FragC (&acc)[HD / 16], float mul, int b, int S, int nh,
                             int head, int r0) {
  constexpr int kLd = Tiles<HD>::kLdO;
  const int wr0 = (threadIdx.x / 32) * 16;
  __syncthreads();  // the staging tile aliases tiles other warps may still read
#pragma unroll
  for (int n = 0; n < HD / 16; ++n) wmma::store_matrix_sync(stage + wr0 * kLd + n * 16, acc[n], kLd, wmma::mem_row_major);
  __syncthreads();
  for (int idx = threadIdx.x; idx < kRows * HD; idx += kThreads) {
    const int r = idx / HD, c = idx % HD, row = r0 + r;
    if (row < S) dst[((size_t(b) * S + row) * nh + head) * HD + c] = stage[r * kLd + c] * mul;
  }
}

// ---------------------------------------------------------------------------------------------
// Forward. Grid (query tiles, H, B); the block owns query rows [i0, i0 + 64) of head h.

// The warp's O accumulator fragments times its rows' `corr` (each lane's corr is its row's; both
// lanes of a row hold the same bits), through the warp's 16-row slab of the fp32 score tile (ld kLdS)
// in blocks of 64 columns: store, each lane scales its half row as the former shared accumulator
// was scaled (`*= corr` where corr != 1), load back. The store and load of fp32 accumulators are
// exact, so the fragments end up with the bits of the shared round trip. Warp-collective; the
// caller has made the slab free (a __syncwarp after its last read of it); ends with a __syncwarp.
template <int HD>
__device__ __forceinline__ void rescale_acc(FragC (&acc)[HD / 16], float* slab, int r, int half, float corr) {
#pragma unroll
  for (int c0 = 0; c0 < HD; c0 += kRows) {
#pragma unroll
    for (int n = 0; n < kRows / 16; ++n)
      wmma::store_matrix_sync(slab + n * 16, acc[c0 / 16 + n], kLdS, wmma::mem_row_major);
    __syncwarp();
    if (corr != 1.f) {
      float4* row = reinterpret_cast<float4*>(slab + r * kLdS + half * 32);  // 16-byte aligned: kLdS % 4 == 0
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        float4 x = row[c];
        x.x *= corr, x.y *= corr, x.z *= corr, x.w *= corr;
        row[c] = x;
      }
    }
    __syncwarp();
#pragma unroll
    for (int n = 0; n < kRows / 16; ++n)
      wmma::load_matrix_sync(acc[c0 / 16 + n], slab + n * 16, kLdS, wmma::mem_row_major);
    __syncwarp();  // every lane has loaded: the slab may be written again
  }
}

// The forward's blocks per SM (sm_90: shared memory allows 5 at hd 64, 3 at hd 128: blocks_per_sm),
// as __launch_bounds__ gives it to ptxas: registers capped at 96 (hd 64) and 168 (hd 128) per thread,
// met without spills on sm_90 and sm_80 (scripts/ptxas-regs.sh).
template <int HD>
constexpr int kFwdBlocks = HD == 64 ? 5 : 3;

template <int HD, class E>
__global__ void __launch_bounds__(kThreads, kFwdBlocks<HD>)
    tc_fwd_kernel(E* o, float* lse, const E* q, const E* k, const E* v, AttnShape sh, bool vec) {
  using T = Tiles<HD>;
  constexpr int kLdH = T::kLdH;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* Ks = reinterpret_cast<bf16*>(smem + T::kH);
  bf16* Vs = reinterpret_cast<bf16*>(smem + 2 * T::kH);
  float* Ss = reinterpret_cast<float*>(smem + 3 * T::kH);

  const int S = sh.S, H = sh.H, KV = sh.KV, W = sh.window;
  const int b = blockIdx.z, h = blockIdx.y, g = h / (H / KV);
  const int i0 = (gridDim.x - 1 - blockIdx.x) * kRows;  // the long (late) causal tiles first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr0 = warp * 16;                 // the warp's first row in the tile
  const int r = lane >> 1, half = lane & 1;  // elementwise work: row wr0 + r, columns [32 half, +32)
  const int i = i0 + wr0 + r;                // this lane's query row
  const float scale = float(sh.scale);
  // The warp's 16 rows of S (fp32, ld kLdS), over them its bf16 rows of P (ld kLdB; Tiles), and
  // the staging of its O rows for a rescale and for the epilogue.
  float* Sw = Ss + wr0 * kLdS;
  bf16* Pw = reinterpret_cast<bf16*>(Sw);

  load_tile<HD>(Qs, q, b, S, H, h, i0, vec);
  __syncthreads();
  FragC of[HD / 16];  // the warp's 16 x HD O accumulator
#pragma unroll
  for (int n = 0; n < HD / 16; ++n) wmma::fill_fragment(of[n], 0.f);

  float m = -INFINITY, l = 0.f;  // this row's running max and denominator (same bits in both lanes)
  const int w_first = i0 + wr0, w_last = min(S - 1, w_first + 15);
  const int i_last = min(S, i0 + kRows) - 1;
  for (int k0 = key_lo(i0, W); k0 <= i_last; k0 += kRows) {
    __syncthreads();  // every warp is done with the previous K, V tiles
    load_tile<HD>(Ks, k, b, S, KV, g, k0, vec);
    load_tile<HD>(Vs, v, b, S, KV, g, k0, vec);
    __syncthreads();
    // Does any of the warp's rows see any key of this tile? (Warp-uniform; no block barrier below.)
    if (!(w_first < S && k0 <= w_last && k0 + kRows - 1 >= key_lo(w_first, W))) continue;

    // S = Q K^T for the warp's 16 rows (unscaled, fp32). Q's fragments are loaded from Qs at every
    // tile: held across the loop next to O's, they would take ptxas past the register cap.
    mma_abt<HD>(Sw, Qs + wr0 * kLdH, Ks);
    __syncwarp();

    // Online softmax on the lane's half row: S into registers, then (slab free) the O rescale, then P.
    const float* srow = Sw + r * kLdS + half * 32;
    const int jbase = k0 + half * 32;
    float sv[32];
    float mt = -INFINITY;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int j = jbase + c;
      sv[c] = (i < S && j < S && visible(i, j, W)) ? scale * srow[c] : -INFINITY;
      mt = fmaxf(mt, sv[c]);
    }
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
    const float mnew = fmaxf(m, mt);
    // corr = 1: nothing visible to this row yet (P row = 0, state unchanged). corr = 0 while m is
    // -inf: the O row is still all zeros then (every earlier P row was exactly 0), and so is l.
    const float corr = mnew == -INFINITY ? 1.f : m == -INFINITY ? 0.f : expf(m - mnew);
    // P (bf16, packed) and its row sum, in registers: sv is dead before the O fragments are staged.
    __nv_bfloat162 pv[16];
    float sum = 0.f;
    if (mnew == -INFINITY) {
#pragma unroll
      for (int c = 0; c < 16; ++c) pv[c] = __floats2bfloat162_rn(0.f, 0.f);
    } else {
#pragma unroll
      for (int c = 0; c < 32; c += 2) {
        const float p0 = expf(sv[c] - mnew);  // masked: exp(-inf - finite) = 0
        sum += p0;
        const float p1 = expf(sv[c + 1] - mnew);
        sum += p1;
        pv[c / 2] = __floats2bfloat162_rn(p0, p1);
      }
    }
    // The O row needs its rescale iff corr != 1 and m is finite: with m = -inf it is all zeros (+0
    // or -0 products of P = 0 and the finite V) and 0 * corr leaves those bits as they are.
    const int need = corr != 1.f && m != -INFINITY;
    __syncwarp();  // every lane has read its S half row: the slab is free
    if (warp_sum(need)) rescale_acc<HD>(of, Sw, r, half, corr);
    // P over the lane's own S half row (ld kLdB; Tiles).
    bf16* prow = Pw + r * kLdB + half * (32 + kGapB);
#pragma unroll
    for (int c0 = 0; c0 < 16; c0 += 4) {  // 16-byte stores (prow + 2 c0 is 16-byte aligned)
      reinterpret_cast<Bf16x4*>(prow + 2 * c0)[0] = Bf16x4{pv[c0], pv[c0 + 1]};
      reinterpret_cast<Bf16x4*>(prow + 2 * c0)[1] = Bf16x4{pv[c0 + 2], pv[c0 + 3]};
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // a + b in one lane, b + a in the other: same bits
    l = l * corr + sum;
    m = mnew;
    __syncwarp();

    // O += P V: mma_ab_acc's MMAs in its order, with the kk loop rolled (unrolled, ptxas spills at the
    // 96-register cap of hd 64; Q's fragments are not held across the loop either, for the same reason).
#pragma unroll 1
    for (int kk = 0; kk < kRows / 16; ++kk) {
      FragA fa;
      wmma::load_matrix_sync(fa, Pw + kk * 16 + (kk / 2) * kGapB, kLdB);
#pragma unroll
      for (int n = 0; n < HD / 16; ++n) {
        FragBRow fb;
        wmma::load_matrix_sync(fb, Vs + kk * 16 * kLdH + n * 16, kLdH);
        wmma::mma_sync(of[n], fa, fb, of[n]);
      }
    }
  }

  // Epilogue: o = O / l through the slab, 64 columns at a time; lse = m + log(l).
  const float inv = 1.f / l;  // rows past S: l = 0, inf, never stored
  __syncwarp();               // every lane's P loads from the slab are done
#pragma unroll
  for (int c0 = 0; c0 < HD; c0 += kRows) {
#pragma unroll
    for (int n = 0; n < kRows / 16; ++n)
      wmma::store_matrix_sync(Sw + n * 16, of[c0 / 16 + n], kLdS, wmma::mem_row_major);
    __syncwarp();
#pragma unroll 4
    for (int t = 0; t < 32; ++t) {  // row t / 2, columns 32 (t % 2) + lane
      const int rr = t >> 1, c = (t & 1) * 32 + lane, ii = i0 + wr0 + rr;
      const float ir = __shfl_sync(0xffffffffu, inv, 2 * rr);
      if (ii < S) store_rn(o[((size_t(b) * S + ii) * H + h) * HD + c0 + c], Sw[rr * kLdS + c] * ir);
    }
    __syncwarp();
  }
  if (half == 0 && i < S) lse[(size_t(b) * H + h) * S + i] = m + logf(l);
}

// ---------------------------------------------------------------------------------------------
// Backward 1: Dv[b, h, i] = bf16(dO_i) . O_i in fp32 (one warp per row, fixed shuffle tree). dO is
// rounded as the MMAs see it, so that D_i = sum_j P_ij dP_ij holds to fp32 rounding for the dP the
// kernels compute (bf16(dO) . bf16(v)) and sum_j P_ij dS_ij stays ~0 for every row. With fp32 dO
// here, each row's dS would be off by (dO - bf16(dO)) . O, a ~1e-3 relative error that does not
// cancel (the gradient is then not the gradient of any rounding of the inputs); at S = 1, where
// the exact dq and dk are zero, it would give dq, dk of ~1e-3 instead of rounding noise. A bf16 o
// is widened (the forward's rounded output, as the contract asks).

template <class E>
__global__ void tc_bwd_dot_kernel(float* Dv, const float* dout, const E* o, AttnShape sh) {
  const int warps = blockDim.x / 32;
  const size_t rows = size_t(sh.B) * sh.S * sh.H;
  for (size_t rw = size_t(blockIdx.x) * warps + threadIdx.x / 32; rw < rows; rw += size_t(gridDim.x) * warps) {
    const int h = int(rw % sh.H);
    const size_t bs = rw / sh.H;
    const int i = int(bs % sh.S), b = int(bs / sh.S);
    const float* a = dout + rw * sh.hd;
    const E* c = o + rw * sh.hd;
    float acc = 0.f;
    for (int d = threadIdx.x % 32; d < sh.hd; d += 32)
      acc += __bfloat162float(__float2bfloat16_rn(a[d])) * widen(c[d]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (threadIdx.x % 32 == 0) Dv[(size_t(b) * sh.H + h) * sh.S + i] = acc;
  }
}

// Backward 2: dK, dV. Grid (key tiles, KV, B); the block owns key rows [j0, j0 + 64) of KV head g
// and walks, head by head of the group, the query tiles that can see them: [j0, j_last + window).
// Warp w computes the transposed blocks S^T = K_w Q^T and dP^T = V_w dO^T of its 16 keys.

template <int HD, class E>
__global__ void __launch_bounds__(kThreads) tc_bwd_dkdv_kernel(float* dk, float* dv, const float* dout, const E* q,
                                                               const E* k, const E* v, const float* lse,
                                                               const float* Dv, AttnShape sh, bool vec) {
  using T = Tiles<HD>;
  constexpr int kLdH = T::kLdH;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Ks = reinterpret_cast<bf16*>(smem);
  bf16* Vs = reinterpret_cast<bf16*>(smem + T::kH);
  bf16* Qs = reinterpret_cast<bf16*>(smem + 2 * T::kH);
  bf16* dOs = reinterpret_cast<bf16*>(smem + 3 * T::kH);
  float* STs = reinterpret_cast<float*>(smem + 4 * T::kH);
  float* dPTs = reinterpret_cast<float*>(smem + 4 * T::kH + T::kS);
  float* Lq = reinterpret_cast<float*>(smem + 4 * T::kH + 2 * T::kS);
  float* Dq = Lq + kRows;

  const int S = sh.S, H = sh.H, KV = sh.KV, W = sh.window, G = H / KV;
  const int b = blockIdx.z, g = blockIdx.y;
  const int j0 = blockIdx.x * kRows;  // the early key tiles (seen by the most queries) first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr0 = warp * 16;
  const int r = lane >> 1, half = lane & 1;
  const int j = j0 + wr0 + r;  // this lane's key row
  const float scale = float(sh.scale);
  // The warp's 16 rows of S^T and dP^T (fp32, ld kLdS), and over them its bf16 rows of P^T and dS^T
  // (ld kLdB; Tiles).
  float* STw = STs + wr0 * kLdS;
  float* dPTw = dPTs + wr0 * kLdS;
  bf16* PTw = reinterpret_cast<bf16*>(STw);
  bf16* dSTw = reinterpret_cast<bf16*>(dPTw);

  load_tile<HD>(Ks, k, b, S, KV, g, j0, vec);
  load_tile<HD>(Vs, v, b, S, KV, g, j0, vec);
  FragC dkf[HD / 16], dvf[HD / 16];
#pragma unroll
  for (int n = 0; n < HD / 16; ++n) {
    wmma::fill_fragment(dkf[n], 0.f);
    wmma::fill_fragment(dvf[n], 0.f);
  }

  const int w_first = j0 + wr0, w_last = min(S - 1, w_first + 15);
  const int j_last = min(S, j0 + kRows) - 1;
  const int q_end = W > 0 ? min(S, j_last + W) : S;  // queries past it see none of these keys
  for (int hh = 0; hh < G; ++hh) {
    const int h = g * G + hh;
    for (int q0 = j0; q0 < q_end; q0 += kRows) {
      __syncthreads();  // every warp is done with the previous Q, dO tiles (and K, V are loaded)
      load_tile<HD>(Qs, q, b, S, H, h, q0, vec);
      load_tile<HD>(dOs, dout, b, S, H, h, q0, vec);
      load_row_stats(Lq, lse, b, H, h, S, q0);
      load_row_stats(Dq, Dv, b, H, h, S, q0);
      __syncthreads();
      // Some query of the tile sees some key of the warp's 16: the latest query is at or after the
      // first key, and (window) the earliest query is less than `window` after the last key.
      if (!(w_first < S && q0 + kRows - 1 >= w_first && (W <= 0 || q0 <= w_last + W - 1))) continue;

      mma_abt<HD>(STw, Ks + wr0 * kLdH, Qs);
      mma_abt<HD>(dPTw, Vs + wr0 * kLdH, dOs);
      __syncwarp();
      {
        const float* srow = STw + r * kLdS + half * 32;
        const float* dprow = dPTw + r * kLdS + half * 32;
        bf16* prow = PTw + r * kLdB + half * (32 + kGapB);  // over srow[0, 16) (kLdB)
        bf16* dsrow = dSTw + r * kLdB + half * (32 + kGapB);
        const int cbase = half * 32;
        // Unroll 2: with 1 or 4, ptxas (CUDA 13, sm_90) takes 255 registers and spills at HD = 128.
#pragma unroll 2
        for (int c0 = 0; c0 < 32; c0 += 8) {
          __nv_bfloat162 pv[4], dsv[4];
#pragma unroll
          for (int c = c0; c < c0 + 8; c += 2) {
            float p[2], ds[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int ii = q0 + cbase + c + e;
              const bool vis = j < S && ii < S && visible(ii, j, W);
              p[e] = vis ? expf(scale * srow[c + e] - Lq[cbase + c + e]) : 0.f;
              ds[e] = p[e] * (dprow[c + e] - Dq[cbase + c + e]);
            }
            pv[(c - c0) / 2] = __floats2bfloat162_rn(p[0], p[1]);
            dsv[(c - c0) / 2] = __floats2bfloat162_rn(ds[0], ds[1]);
          }
          __syncwarp();  // the stores below land on srow, dprow [c0 / 2, c0 / 2 + 4): loaded by now
          store8(prow + c0, pv);
          store8(dsrow + c0, dsv);
        }
      }
      __syncwarp();
      mma_ab_acc<HD>(dvf, PTw, dOs);   // dV += P^T dO
      mma_ab_acc<HD>(dkf, dSTw, Qs);  // dK += dS^T Q   (scale applied at the store)
    }
  }
  float* stage = STs;  // [64][kLdO] fp32 over S^T and dP^T
  store_result<HD>(dk, stage, dkf, scale, b, S, KV, g, j0);
  store_result<HD>(dv, stage, dvf, 1.f, b, S, KV, g, j0);
}

// Backward 3: dQ. Grid (query tiles, H, B); the block owns query rows [i0, i0 + 64) of head h and
// walks the key tiles they can see.

template <int HD, class E>
__global__ void __launch_bounds__(kThreads) tc_bwd_dq_kernel(float* dq, const float* dout, const E* q, const E* k,
                                                             const E* v, const float* lse, const float* Dv,
                                                             AttnShape sh, bool vec) {
  using T = Tiles<HD>;
  constexpr int kLdH = T::kLdH;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* dOs = reinterpret_cast<bf16*>(smem + T::kH);
  bf16* Ks = reinterpret_cast<bf16*>(smem + 2 * T::kH);
  bf16* Vs = reinterpret_cast<bf16*>(smem + 3 * T::kH);
  float* Ss = reinterpret_cast<float*>(smem + 4 * T::kH);
  float* dPs = reinterpret_cast<float*>(smem + 4 * T::kH + T::kS);
  float* Li = reinterpret_cast<float*>(smem + 4 * T::kH + 2 * T::kS);
  float* Di = Li + kRows;

  const int S = sh.S, H = sh.H, KV = sh.KV, W = sh.window;
  const int b = blockIdx.z, h = blockIdx.y, g = h / (H / KV);
  const int i0 = (gridDim.x - 1 - blockIdx.x) * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr0 = warp * 16;
  const int r = lane >> 1, half = lane & 1;
  const int i = i0 + wr0 + r;  // this lane's query row
  const float scale = float(sh.scale);
  // The warp's 16 rows of S and dP (fp32, ld kLdS), and over its dP rows its bf16 rows of dS (ld
  // kLdB; Tiles).
  float* Sw = Ss + wr0 * kLdS;
  float* dPw = dPs + wr0 * kLdS;
  bf16* dSw = reinterpret_cast<bf16*>(dPw);

  load_tile<HD>(Qs, q, b, S, H, h, i0, vec);
  load_tile<HD>(dOs, dout, b, S, H, h, i0, vec);
  load_row_stats(Li, lse, b, H, h, S, i0);
  load_row_stats(Di, Dv, b, H, h, S, i0);
  FragC dqf[HD / 16];
#pragma unroll
  for (int n = 0; n < HD / 16; ++n) wmma::fill_fragment(dqf[n], 0.f);

  const int w_first = i0 + wr0, w_last = min(S - 1, w_first + 15);
  const int i_last = min(S, i0 + kRows) - 1;
  for (int k0 = key_lo(i0, W); k0 <= i_last; k0 += kRows) {
    __syncthreads();  // every warp is done with the previous K, V tiles (and Q, dO, L, D are loaded)
    load_tile<HD>(Ks, k, b, S, KV, g, k0, vec);
    load_tile<HD>(Vs, v, b, S, KV, g, k0, vec);
    __syncthreads();
    if (!(w_first < S && k0 <= w_last && k0 + kRows - 1 >= key_lo(w_first, W))) continue;

    mma_abt<HD>(Sw, Qs + wr0 * kLdH, Ks);
    mma_abt<HD>(dPw, dOs + wr0 * kLdH, Vs);
    __syncwarp();
    {
      const float* srow = Sw + r * kLdS + half * 32;
      const float* dprow = dPw + r * kLdS + half * 32;
      bf16* dsrow = dSw + r * kLdB + half * (32 + kGapB);  // over dprow[0, 16) (kLdB)
      const float li = Li[wr0 + r], di = Di[wr0 + r];
      const int jbase = k0 + half * 32;
#pragma unroll 2
      for (int c0 = 0; c0 < 32; c0 += 8) {
        __nv_bfloat162 dsv[4];
#pragma unroll
        for (int c = c0; c < c0 + 8; c += 2) {
          float ds[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int jj = jbase + c + e;
            const bool vis = i < S && jj < S && visible(i, jj, W);
            const float p = vis ? expf(scale * srow[c + e] - li) : 0.f;
            ds[e] = p * (dprow[c + e] - di);
          }
          dsv[(c - c0) / 2] = __floats2bfloat162_rn(ds[0], ds[1]);
        }
        __syncwarp();  // the stores below land on dprow[c0 / 2, c0 / 2 + 4): loaded by now
        store8(dsrow + c0, dsv);
      }
    }
    __syncwarp();
    mma_ab_acc<HD>(dqf, dSw, Ks);  // dQ += dS K   (scale applied at the store)
  }
  store_result<HD>(dq, Ss, dqf, scale, b, S, H, h, i0);
}

// ---------------------------------------------------------------------------------------------

using attn::shape_ok;

// Whether a tensor's base allows stage4's 4-element vector loads: 16 bytes for fp32, 8 for bf16.
using attn::vec_ok;


template <int HD, class E>
cudaError_t fwd(E* o, float* lse, const E* q, const E* k, const E* v, const AttnShape& s, cudaStream_t st) {
  using T = Tiles<HD>;
  const bool vec = vec_ok(q) && vec_ok(k) && vec_ok(v);
  cudaError_t e = allow_smem(tc_fwd_kernel<HD, E>, T::kFwd);
  if (e != cudaSuccess) return e;
  const dim3 grid(unsigned((s.S + kRows - 1) / kRows), unsigned(s.H), unsigned(s.B));
  tc_fwd_kernel<HD, E><<<grid, kThreads, T::kFwd, st>>>(o, lse, q, k, v, s, vec);
  return cudaGetLastError();
}

template <int HD, class E>
cudaError_t bwd(float* dq, float* dk, float* dv, const float* dout, const E* q, const E* k, const E* v,
                const float* lse, const float* Dv, const AttnShape& s, cudaStream_t st) {
  using T = Tiles<HD>;
  const bool vec = vec_ok(q) && vec_ok(k) && vec_ok(v) && vec_ok(dout);
  cudaError_t e = allow_smem(tc_bwd_dkdv_kernel<HD, E>, T::kDkdv);
  if (e != cudaSuccess) return e;
  e = allow_smem(tc_bwd_dq_kernel<HD, E>, T::kDq);
  if (e != cudaSuccess) return e;
  const unsigned tiles = unsigned((s.S + kRows - 1) / kRows);
  tc_bwd_dkdv_kernel<HD, E><<<dim3(tiles, unsigned(s.KV), unsigned(s.B)), kThreads, T::kDkdv, st>>>(
      dk, dv, dout, q, k, v, lse, Dv, s, vec);
  tc_bwd_dq_kernel<HD, E><<<dim3(tiles, unsigned(s.H), unsigned(s.B)), kThreads, T::kDq, st>>>(dq, dout, q, k, v,
                                                                                                lse, Dv, s, vec);
  return cudaGetLastError();
}

AttnTcKernels& kernels() {
  static AttnTcKernels k = [] {
    const char* e = std::getenv("LADDER_ATTN_MMA");
    const std::string v = e ? e : "";
    // Default (unset, 1, all): both mma.sync. 0 or wmma: both WMMA. fwd / bwd: only that one mma.sync.
    AttnTcKernels r;
    const bool wmma = v == "0" || v == "wmma";
    r.mma_fwd = !wmma && v != "bwd";
    r.mma_bwd = !wmma && v != "fwd";
    // LADDER_ATTN_WGMMA: 1 = the wgmma forward and backward (attention_wgmma.cuh) where the device
    // runs them; fwd / bwd = only that one; unset or anything else: neither.
    const char* e2 = std::getenv("LADDER_ATTN_WGMMA");
    const std::string w = e2 ? e2 : "";
    r.wgmma_fwd = w == "1" || w == "fwd";
    r.wgmma_bwd = w == "1" || w == "bwd";
    return r;
  }();
  return k;
}

// The wgmma kernels run where they are selected and the device runs them; else mma.sync / WMMA.
bool use_wgmma_fwd() { return kernels().wgmma_fwd && attention_wgmma_available(); }
bool use_wgmma_bwd() { return kernels().wgmma_bwd && attention_wgmma_available(); }

template <class E>
cudaError_t forward(E* o, float* lse, const E* q, const E* k, const E* v, const AttnShape& s, cudaStream_t st) {
  if (s.B <= 0 || s.S <= 0 || s.H <= 0) return cudaSuccess;
  if (!shape_ok(s)) return cudaErrorInvalidValue;
  if (use_wgmma_fwd()) return attention_wgmma_forward(o, lse, q, k, v, s, st);
  if (kernels().mma_fwd) return attention_mma_forward(o, lse, q, k, v, s, st);
  return s.hd == 64 ? fwd<64>(o, lse, q, k, v, s, st) : fwd<128>(o, lse, q, k, v, s, st);
}

// EO: o's type, read only for D (E, or float with bf16 inputs: attention_tc_backward_in16).
template <class E, class EO>
cudaError_t backward(float* dq, float* dk, float* dv, const float* dout, const E* q, const E* k, const E* v,
                     const EO* o, const float* lse, const AttnShape& s, float* scratch, cudaStream_t st) {
  if (s.B <= 0 || s.S <= 0 || s.H <= 0) return cudaSuccess;
  if (!shape_ok(s)) return cudaErrorInvalidValue;
  const size_t rows = size_t(s.B) * s.S * s.H;
  const size_t blocks = (rows + 7) / 8;  // 8 warps per block, one row per warp
  tc_bwd_dot_kernel<EO><<<unsigned(blocks < 65536 ? blocks : 65536), 256, 0, st>>>(scratch, dout, o, s);
  if (use_wgmma_bwd())
    return attention_wgmma_backward(dq, dk, dv, dout, q, k, v, lse, scratch, s, st);
  if (kernels().mma_bwd) return attention_mma_backward(dq, dk, dv, dout, q, k, v, lse, scratch, s, st);
  return s.hd == 64 ? bwd<64>(dq, dk, dv, dout, q, k, v, lse, scratch, s, st)
                    : bwd<128>(dq, dk, dv, dout, q, k, v, lse, scratch, s, st);
}

}  // namespace

#ifndef LADDER_WGMMA
// This build has no sm_90a code (CMAKE_CUDA_ARCHITECTURES without 90): attention_wgmma_fwd.cu is not
// compiled, and the launchers above keep to the mma.sync / WMMA kernels.
bool attention_wgmma_available() { return false; }
void attention_wgmma_plant_layout_bug(bool) {}
bool attention_wgmma_layout_bug_planted() { return false; }
cudaError_t wgmma_rs_selftest(float*, const uint16_t*, const uint16_t*, bool, bool, cudaStream_t) {
  return cudaErrorNotSupported;
}
template <class E, class EO>
cudaError_t attention_wgmma_forward(EO*, float*, const E*, const E*, const E*, const AttnShape&, cudaStream_t) {
  return cudaErrorNotSupported;
}
template <class E>
cudaError_t attention_wgmma_backward(float*, float*, float*, const float*, const E*, const E*, const E*, const float*,
                                     const float*, const AttnShape&, cudaStream_t) {
  return cudaErrorNotSupported;
}
#endif

AttnTcKernels attention_tc_kernels() { return kernels(); }
void attention_tc_set_kernels(AttnTcKernels k) { kernels() = k; }

bool attention_tc_supported(const AttnShape& s) {
  if (!shape_ok(s)) return false;
  int dev = 0, major = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    (void)cudaGetLastError();  // a failed query must not surface as a later launcher's error
    return false;
  }
  const size_t need = s.hd == 64 ? Tiles<64>::kMax : Tiles<128>::kMax;
  return major >= 8 && size_t(optin) >= need;
}

cudaError_t attention_tc_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                                 const AttnShape& s, cudaStream_t st) {
  return forward(o, lse, q, k, v, s, st);
}

cudaError_t attention_tc_forward_bf16(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k,
                                      const uint16_t* v, const AttnShape& s, cudaStream_t st) {
  return forward(as_bf16(o), lse, as_bf16(q), as_bf16(k), as_bf16(v), s, st);
}

size_t attention_tc_backward_scratch_floats(const AttnShape& s) { return size_t(s.B) * s.H * s.S; }

cudaError_t attention_tc_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                                  const float* k, const float* v, const float* o, const float* lse,
                                  const AttnShape& s, float* scratch, cudaStream_t st) {
  return backward(dq, dk, dv, dout, q, k, v, o, lse, s, scratch, st);
}

cudaError_t attention_tc_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const uint16_t* q,
                                       const uint16_t* k, const uint16_t* v, const uint16_t* o, const float* lse,
                                       const AttnShape& s, float* scratch, cudaStream_t st) {
  return backward(dq, dk, dv, dout, as_bf16(q), as_bf16(k), as_bf16(v), as_bf16(o), lse, s, scratch, st);
}

cudaError_t attention_tc_forward_in16(float* o, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                      const AttnShape& s, cudaStream_t st) {
  if (use_wgmma_fwd())
    return attention_wgmma_forward(o, lse, as_bf16(q), as_bf16(k), as_bf16(v), s, st);
  if (!kernels().mma_fwd) return cudaErrorNotSupported;
  return attention_mma_forward(o, lse, as_bf16(q), as_bf16(k), as_bf16(v), s, st);
}

cudaError_t attention_tc_backward_in16(float* dq, float* dk, float* dv, const float* dout, const uint16_t* q,
                                       const uint16_t* k, const uint16_t* v, const float* o, const float* lse,
                                       const AttnShape& s, float* scratch, cudaStream_t st) {
  if (!kernels().mma_bwd && !use_wgmma_bwd()) return cudaErrorNotSupported;
  return backward(dq, dk, dv, dout, as_bf16(q), as_bf16(k), as_bf16(v), o, lse, s, scratch, st);  // D from fp32 o
}

}  // namespace ladder::cuda::k
