// Register-resident tensor-core attention, forward (attention_mma.cuh): FlashAttention-2 style, on
// mma.sync m16n8k16 (bf16 in, fp32 accumulators) and ldmatrix (mma_ptx.cuh). Same contract,
// masking, online softmax and rounding as the WMMA forward tc_fwd_kernel (attention_tc.cu): q, k, v
// rounded to bf16 as they are staged, S = Q K^T in fp32, P = exp(scale S - m) in fp32 (summed into
// l before rounding) and rounded to bf16 for P V, lse = m + log(l), o = O / l rounded to E.
//
// Work layout: grid (query tiles, H, B), the late (long causal) query tiles first; a block of 128
// threads (4 warps) owns query rows [i0, i0 + 64) of head h and warp w rows [i0 + 16w, +16). Shared
// memory holds the Q, K and V tiles only (bf16 [64][HD + 8]: a pitch of HD + 8 halves keeps every
// ldmatrix row 16-byte aligned and the 8 rows of an 8x8 matrix on distinct banks); the scores, P and
// the O accumulator never leave registers. Per warp and key tile:
//   S (16 x 64) = Q_w K^T: 8 n8 accumulator tiles; Q's A fragments (HD / 16 k16 slices, ldmatrix_x4
//     from the Q tile) are held across the key loop at hd 64 and reloaded per key tile at hd 128
//     (kHoldQ); K^T's B fragments come from ldmatrix_x4 on K rows (K row-major [key][hd] is B = K^T
//     in the "col" layout), two n8 tiles per load.
//   Lane l (g = l / 4, t = l % 4) holds, of n8 tile n, rows g and g + 8 (query i0 + 16w + g, + 8),
//     columns (keys) k0 + 8n + 2t, + 1 (mma_ptx.cuh): masking, scaling and exp in registers; a row's
//     max is the lane's max and two shuffles over the quad (xor 1, 2).
//   P: each pair of n8 tiles (2kk, 2kk + 1), rounded to bf16, is the A fragment of key slice kk
//     (pack_a); V's B fragments come from ldmatrix_x4_trans on V rows (V row-major [key][hd] = B
//     row-major; .trans gives the col layout), two n8 output tiles per load; O (HD / 8 n8 tiles)
//     += P V.
// The lane's share of l (its 16 p per row and tile) is accumulated per lane and rescaled with the row's
// corr, then summed over the quad in the epilogue (all four lanes get the same bits).
//
// Masking is exact (attention_tc.cu): (i, j) is used iff i < S, j < S and visible(i, j, W); other
// scores are -inf before the max and p = 0. A warp whose rows see no key of a tile skips it (the
// identity update); a tile every one of the warp's rows sees whole skips the per-element mask. A row
// with nothing visible yet keeps m = -inf, p = 0 and corr = 1 (no exp(-inf - -inf)); every row i < S
// sees key i, so l >= 1 at the end. Rows past S are never stored.
//
// E (float or __nv_bfloat16) changes only how the tiles are staged (fp32 rounded to nearest even,
// bf16 copied) and how o is stored (store_rn): the bf16 instantiation gives bitwise the fp32 one's
// results on the widened inputs (o then rounded). Deterministic: no atomics, fixed orders.
//
// Pipelining: the K and V tiles are staged by cp.async when the inputs are bf16 with 16-byte aligned
// bases (stage_tile; fp32 is rounded while staged, and unaligned bf16 is loaded 4 elements at a
// time: those go through registers, synchronously), so that a tile loads while the warps compute.
// Each key tile's V is issued at the top of its iteration and lands during S = Q K^T and the
// softmax; the next K tile is issued at the top too into a second K buffer (hd 64), or after
// S = Q K^T into the only one (hd 128), and lands by the end of the iteration. Three block barriers
// per key tile at hd 128, two at hd 64. The staged values and the math are unchanged: bitwise the
// results of the synchronous kernel.
//
// Shared memory per block: Q, V and one (hd 128) or two (hd 64) K tiles of 64 * (HD + 8) * 2 bytes:
// 36 KiB (hd 64), 51 KiB (hd 128); sm_90 (228 KiB per SM, 1 KiB reserved per block) then holds 6
// and 4 blocks, sm_80 (164 KiB) 4 and 3. Registers bind first: kMmaFwdBlocks below.
#include <cuda_bf16.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/attention_softmax.cuh"
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/mma_ptx.cuh"

namespace ladder::cuda::k {

namespace {

using cpu::AttnShape;
using bf16 = __nv_bfloat16;
using attn::key_lo;
using attn::kRows;
using attn::visible;

constexpr int kThreads = 128;  // 4 warps, 16 query rows each

template <int HD>
struct MmaFwdTiles {
  static constexpr int kLd = HD + 8;  // bf16 [64][HD + 8] tiles: Q, K, V
  static constexpr size_t kTile = size_t(kRows) * kLd * sizeof(bf16);
  // K buffers: two at hd 64, so that the next K tile is issued with the V tile at the top of the
  // iteration (only O and Q live: loading it after S = Q K^T, with S live too, spills under the
  // 128-register cap); one at hd 128, where a second would cost sm_80 a block per SM (shared memory)
  // and the 168-register cap leaves room to issue the next K tile after S = Q K^T.
  static constexpr int kKBufs = HD == 64 ? 2 : 1;
  static constexpr size_t kBytes = (2 + kKBufs) * kTile;  // Q, V, K (x kKBufs)
  static_assert((kLd * sizeof(bf16)) % 16 == 0 && kTile % 128 == 0, "16-byte aligned ldmatrix rows");
};

using attn::blocks_per_sm;

// Blocks per SM as __launch_bounds__ gives them to ptxas (registers capped at 65536 / (128 * N)):
// shared memory allows 6 (hd 64) and 4 (hd 128) on sm_90; registers bind first. hd 64: 4 blocks
// (128 registers, Q held); hd 128: 3 blocks (166 of 168 registers: with Q held ptxas spills, so Q
// is reloaded; holding it needs 218, i.e. 2 blocks). scripts/ptxas-regs.sh.
template <int HD>
constexpr int kMmaFwdBlocks = HD == 64 ? 4 : 3;
// Whether the warp's Q fragments are held in registers across the key loop (else reloaded from the
// Q tile, one k16 slice at a time, at every key tile).
template <int HD>
constexpr bool kHoldQ = HD == 64;
static_assert(blocks_per_sm(MmaFwdTiles<64>::kBytes, 228) >= kMmaFwdBlocks<64> &&
                  blocks_per_sm(MmaFwdTiles<128>::kBytes, 228) >= kMmaFwdBlocks<128>,
              "sm_90: shared memory allows the blocks per SM the register caps are chosen for");
static_assert(blocks_per_sm(MmaFwdTiles<64>::kBytes, 164) >= kMmaFwdBlocks<64> &&
                  blocks_per_sm(MmaFwdTiles<128>::kBytes, 164) >= kMmaFwdBlocks<128>,
              "sm_80: the same");

// EO: o's type (E, or float with bf16 inputs: attention_tc_forward_in16).
template <int HD, class E, class EO>
__global__ void __launch_bounds__(kThreads, kMmaFwdBlocks<HD>)
    mma_fwd_kernel(EO* o, float* lse, const E* q, const E* k, const E* v, AttnShape sh, bool vec, bool async,
                   bool ovec) {
  using T = MmaFwdTiles<HD>;
  constexpr int kLd = T::kLd;
  constexpr int kQk = HD / 16;  // k16 slices of Q K^T
  constexpr int kOn = HD / 8;   // n8 tiles of O
  constexpr int kSn = kRows / 8;  // n8 tiles of S (8)
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* Vs = reinterpret_cast<bf16*>(smem + T::kTile);
  bf16* Ks = reinterpret_cast<bf16*>(smem + 2 * T::kTile);  // the K tile of this iteration
  bf16* Kn = reinterpret_cast<bf16*>(smem + (1 + T::kKBufs) * T::kTile);  // the next one's (Ks if kKBufs = 1)

  const int S = sh.S, H = sh.H, KV = sh.KV, W = sh.window;
  const int b = blockIdx.z, h = blockIdx.y, kvh = h / (H / KV);
  const int i0 = (gridDim.x - 1 - blockIdx.x) * kRows;  // the long (late) causal tiles first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int wr0 = warp * 16;  // the warp's first row in the tile
  const int ia = i0 + wr0 + g, ib = ia + 8;  // the lane's two query rows (C rows g, g + 8)
  const float scale = float(sh.scale);
  const int k_first = key_lo(i0, W);

  // Prologue: Q and the first K tile, one commit group (stage_tile: cp.async or plain stores).
  attn::stage_tile<HD, kLd, kThreads>(Qs, q, b, S, H, h, i0, vec, async);
  attn::stage_tile<HD, kLd, kThreads>(Ks, k, b, S, KV, kvh, k_first, vec, async);
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();

  // ldmatrix row addresses (mma_ptx.cuh): Q's A fragments by frag_a, K^T's B fragments (keys as n)
  // by frag_b_nk, V's by frag_a with .trans (mma_ab_acc).
  const bf16* qrow = frag_a(Qs, kLd, wr0, 0, lane);
  uint32_t qa[kHoldQ<HD> ? kQk : 1][4];  // the warp's Q rows as A fragments, one per k16 slice (held)
  if constexpr (kHoldQ<HD>) {
#pragma unroll
    for (int kk = 0; kk < kQk; ++kk) ldmatrix_x4(qa[kk], qrow + kk * 16);
  }

  float oacc[kOn][4];  // O: rows g, g + 8 of the warp, hd columns 8n + 2t, + 1
#pragma unroll
  for (int n = 0; n < kOn; ++n) oacc[n][0] = oacc[n][1] = oacc[n][2] = oacc[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // rows ia, ib: running max (the same bits in the quad)
  float l[2] = {0.f, 0.f};              // the lane's share of the row's denominator

  const int w_first = i0 + wr0, w_last = min(S - 1, w_first + 15);
  const int i_last = min(S, i0 + kRows) - 1;
  // Each iteration starts with its K tile published and every warp done with the previous V tile.
  // The V tile loads (cp.async) while the warps compute S = Q K^T and the softmax; the next K tile
  // while they compute the whole iteration (two K buffers) or its softmax and O += P V (one). Two
  // commit groups per iteration, V's then the next K's, so the waits below count the same either way.
  for (int k0 = k_first; k0 <= i_last; k0 += kRows) {
    const bool more = k0 + kRows <= i_last;  // block-uniform
    attn::stage_tile<HD, kLd, kThreads>(Vs, v, b, S, KV, kvh, k0, vec, async);
    __pipeline_commit();
    if constexpr (T::kKBufs == 2) {  // Kn held the previous tile: every warp is done with it
      if (more) attn::stage_tile<HD, kLd, kThreads>(Kn, k, b, S, KV, kvh, k0 + kRows, vec, async);
      __pipeline_commit();  // (empty after the last tile)
    }
    // Does any of the warp's rows see any key of this tile? (Warp-uniform: the warp skips the math,
    // never the barriers or its share of the loads.)
    const bool active = w_first < S && k0 <= w_last && k0 + kRows - 1 >= key_lo(w_first, W);
    // Does every one of the warp's 16 rows (all < S) see every key of the tile (all < S)?
    const bool full = w_first + 15 < S && k0 + kRows - 1 <= w_first && (W <= 0 || w_first + 15 - k0 < W);

    // S = Q K^T (unscaled, fp32).
    float sacc[kSn][4];
#pragma unroll
    for (int n = 0; n < kSn; ++n) sacc[n][0] = sacc[n][1] = sacc[n][2] = sacc[n][3] = 0.f;
    if (active) {
#pragma unroll
      for (int kk = 0; kk < kQk; ++kk) {
        uint32_t a[4];  // Q's A fragment of slice kk: held (a register copy, free) or reloaded
        if constexpr (kHoldQ<HD>) {
#pragma unroll
          for (int x = 0; x < 4; ++x) a[x] = qa[kk][x];
        } else {
          ldmatrix_x4(a, qrow + kk * 16);
        }
#pragma unroll
        for (int n = 0; n < kSn; n += 2) {
          uint32_t kb[4];
          ldmatrix_x4(kb, frag_b_nk(Ks, kLd, 8 * n, kk * 16, lane));
          mma2(sacc[n], sacc[n + 1], a, kb);
        }
      }
    }
    if constexpr (T::kKBufs == 1) {
      __syncthreads();  // every warp is done with this K tile: the next one may load into its buffer
      if (more) attn::stage_tile<HD, kLd, kThreads>(Ks, k, b, S, KV, kvh, k0 + kRows, vec, async);
      __pipeline_commit();  // (empty after the last tile)
    }

    if (active) {
      // P = exp(scale S - m) in place, l and m updated; O's rows rescaled (attention_softmax.cuh).
      float corr[2];
      attn::online_softmax(sacc, m, l, corr, ia, ib, k0, t, S, W, scale, full);
      attn::rescale_rows(oacc, corr);
    }

    __pipeline_wait_prior(1);  // this thread's V copies have landed (the next K's may be in flight)
    __syncthreads();           // everyone's have: the V tile is published
    // O += P V: key slice kk's A fragment is n8 tiles 2kk, 2kk + 1 of P, rounded to bf16.
    if (active) mma_ab_acc<HD, kRows, kLd>(oacc, sacc, Vs, 0, lane);
    __pipeline_wait_prior(0);  // the next K tile has landed here ...
    __syncthreads();           // ... and everywhere, and every warp is done with this V tile
    if constexpr (T::kKBufs == 2) {
      bf16* const x = Ks;
      Ks = Kn;
      Kn = x;
    }
  }

  // Epilogue: o = O / l, lse = m + log(l) (attention_softmax.cuh).
  attn::store_rows<HD>(o, lse, oacc, l, m, b, S, H, h, ia, ib, t, ovec);
}

template <int HD, class E, class EO>
cudaError_t launch(EO* o, float* lse, const E* q, const E* k, const E* v, const AttnShape& s, cudaStream_t st) {
  using T = MmaFwdTiles<HD>;
  const bool vec = attn::vec_ok(q) && attn::vec_ok(k) && attn::vec_ok(v);
  const bool async = attn::async_ok(q) && attn::async_ok(k) && attn::async_ok(v);
  if (const cudaError_t e = allow_smem(mma_fwd_kernel<HD, E, EO>, T::kBytes); e != cudaSuccess) return e;
  const dim3 grid(unsigned((s.S + kRows - 1) / kRows), unsigned(s.H), unsigned(s.B));
  mma_fwd_kernel<HD, E, EO><<<grid, kThreads, T::kBytes, st>>>(o, lse, q, k, v, s, vec, async, attn::vec2_ok(o));
  return cudaGetLastError();
}

}  // namespace

template <class E, class EO>
cudaError_t attention_mma_forward(EO* o, float* lse, const E* q, const E* k, const E* v, const cpu::AttnShape& s,
                                  cudaStream_t st) {
  if (s.B <= 0 || s.S <= 0 || s.H <= 0) return cudaSuccess;
  if (!attn::shape_ok(s)) return cudaErrorInvalidValue;
  return s.hd == 64 ? launch<64>(o, lse, q, k, v, s, st) : launch<128>(o, lse, q, k, v, s, st);
}
template cudaError_t attention_mma_forward<float, float>(float*, float*, const float*, const float*, const float*,
                                                         const cpu::AttnShape&, cudaStream_t);
template cudaError_t attention_mma_forward<__nv_bfloat16, __nv_bfloat16>(__nv_bfloat16*, float*,
                                                                         const __nv_bfloat16*, const __nv_bfloat16*,
                                                                         const __nv_bfloat16*, const cpu::AttnShape&,
                                                                         cudaStream_t);
template cudaError_t attention_mma_forward<__nv_bfloat16, float>(float*, float*, const __nv_bfloat16*,
                                                                 const __nv_bfloat16*, const __nv_bfloat16*,
                                                                 const cpu::AttnShape&, cudaStream_t);

}  // namespace ladder::cuda::k
