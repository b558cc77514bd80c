// Tensor-core attention backward on wgmma (sm_90a; attention_wgmma.cuh): the mma.sync backward's
// contract and work split (attention_mma_bwd.cu's header: a dK/dV kernel that owns 64 key rows of a
// KV head and walks, head by head of its GQA group, the query tiles that can see them; a dQ kernel
// that owns 64 query rows of a head and walks the key tiles they see; each output row written once
// by one block: no atomics, deterministic), the same bf16 rounding of q, k, v, dO, P and dS and the
// same fp32 statistics, with the five products on Hopper's warpgroup MMA. Built only with -gencode
// arch=compute_90a,code=sm_90a (CMakeLists.txt: the ladder_wgmma object library).
//
// A block is one warpgroup (128 threads); warp w owns rows 16w..16w+15 of the block's 64 rows, the
// m64nN accumulator rows (wgmma_attn_ptx.cuh), lane (g, t) rows g and g + 8, as in the mma.sync
// kernels. All tiles are attention_wgmma_tiles.cuh's swizzled 64-row tiles, read K-major or MN-major.
//   dK/dV, per query tile (64 queries of head h):
//     S^T (64 keys x 64 queries) = K Q^T, dP^T = V dO^T: HD / 16 wgmma m64n64k16 each, A (K, V) and
//       B (Q, dO) K-major from shared memory;
//     P^T = exp(scale S^T - lse[query]) (0 where masked), dS^T = P^T (dP^T - D[query]) in registers;
//     dV += bf16(P^T) dO, dK += bf16(dS^T) Q: 4 wgmma m64nHDk16 each, A from registers (pack_a),
//       B (dO, Q) MN-major; dK stored times scale.
//   dQ, per key tile: S = Q K^T, dP = dO V^T (K-major A and B), P, dS with the row's lse, D;
//     dQ += bf16(dS) K (A from registers, K MN-major); stored times scale.
// Every warp issues every MMA (warpgroup-collective), so no warp skips a tile its rows cannot see:
// the mask makes every such p 0, and the sums are those of the mma.sync kernels, which skip them.
//
// Shared memory: the two held tiles (K, V or Q, dO), the two streamed tiles double-buffered (Q, dO
// or K, V) and the row statistics (lse, D; two buffers in the dK/dV kernel): 6 tiles + 1 KiB =
// 49 KiB (hd 64), 97 KiB (hd 128), plus 1 KiB of slack to start the tiles at the first 1024-byte
// boundary of the dynamic shared memory (wg::pattern_aligned). Pipeline as the forward's: the next
// streamed tiles are issued right after the barrier that publishes the current ones (bf16 q, k, v
// by cp.async where aligned; the fp32 dO, and fp32 or unaligned inputs, through registers), one
// barrier per tile, and each MMA batch is waited for before its results are used.
#include <cuda_bf16.h>
#include <cuda_pipeline_primitives.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/attention_softmax.cuh"
#include "backend/cuda/attention_wgmma.cuh"
#include "backend/cuda/attention_wgmma_tiles.cuh"
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/mma_ptx.cuh"
#include "backend/cuda/wgmma_attn_ptx.cuh"

namespace ladder::cuda::k {

namespace {

using cpu::AttnShape;
using bf16 = __nv_bfloat16;
using attn::key_lo;
using attn::kmajor_desc;
using attn::kRows;
using attn::mnmajor_desc;
using attn::stage_swizzled;
using attn::visible;
constexpr int kThreads = attn::kWgThreads;

template <int HD>
struct WgBwdTiles {
  static constexpr int kTile = attn::WgTile<HD>::kBytes;
  // Held: A0, A1 (dK/dV: K, V; dQ: Q, dO). Streamed, two buffers each: B (Q; K), C (dO; V). Then
  // the row statistics: [2][lse 64, D 64] floats.
  static constexpr int kA0 = 0, kA1 = kTile, kB = 2 * kTile, kC = 4 * kTile, kStats = 6 * kTile;
  static constexpr size_t kBytes = 6 * size_t(kTile) + 4 * kRows * sizeof(float) + wg::kPattern;  // + align slack
};
// Blocks per SM for __launch_bounds__ (shared memory allows 4 at hd 64, 2 at hd 128 on sm_90).
// ptxas (CUDA 13.0, sm_90a, no spills; bf16 / fp32 inputs; scripts/ptxas-regs.sh): dK/dV 168 / 168
// at hd 64 (3 blocks: cap 168; 179 uncapped), 254 / 240 at hd 128 (2 blocks: the dK, dV
// accumulators alone are 128); dQ 150 / 154 at hd 64 (3 blocks), 176 / 168 at hd 128 (2 blocks).
template <int HD>
constexpr int kWgDkdvBlocks = HD == 64 ? 3 : 2;
template <int HD>
constexpr int kWgDqBlocks = HD == 64 ? 3 : 2;
static_assert(attn::blocks_per_sm(WgBwdTiles<64>::kBytes, 228) >= kWgDkdvBlocks<64> &&
                  attn::blocks_per_sm(WgBwdTiles<64>::kBytes, 228) >= kWgDqBlocks<64> &&
                  attn::blocks_per_sm(WgBwdTiles<128>::kBytes, 228) >= kWgDqBlocks<128> &&
                  attn::blocks_per_sm(WgBwdTiles<128>::kBytes, 228) >= kWgDkdvBlocks<128>,
              "sm_90: shared memory allows the blocks per SM the register caps are chosen for");

template <int N>
__device__ __forceinline__ void zero(float (&a)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) a[n][0] = a[n][1] = a[n][2] = a[n][3] = 0.f;
}

// c = A B^T and d = A' B'^T over hd (64 x 64 each): A, A' and B, B' K-major tiles, one MMA batch.
template <int HD>
__device__ __forceinline__ void two_score_tiles(float (&c)[kRows / 8][4], float (&d)[kRows / 8][4], uint32_t a,
                                                uint32_t bt, uint32_t a2, uint32_t bt2) {
  zero(c);
  zero(d);
  wg::wgmma_fence();
  wg::fence_acc(c);
  wg::fence_acc(d);
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) wg::ss<kRows, false>(c, kmajor_desc(a, kk), kmajor_desc(bt, kk));
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) wg::ss<kRows, false>(d, kmajor_desc(a2, kk), kmajor_desc(bt2, kk));
  wg::wgmma_commit();
  wg::wgmma_wait<0>();
  wg::fence_acc(c);
  wg::fence_acc(d);
}

// p (64 x 64 fp32 accumulators) rounded to bf16 as the register A fragments of its four k16 slices.
__device__ __forceinline__ void pack_p(uint32_t (&pa)[kRows / 16][4], const float (&p)[kRows / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kRows / 16; ++kk) pack_a(pa[kk], p[2 * kk], p[2 * kk + 1]);
}
// acc += P B over the tile's 64 rows: P's A fragments (pack_p), B the MN-major tile at `bm`. Not
// waited for: the caller fences before (every A register written by then: a register written
// between two wgmmas makes ptxas serialize them) and commits and waits after.
template <int HD>
__device__ __forceinline__ void issue_pv(float (&acc)[HD / 8][4], const uint32_t (&pa)[kRows / 16][4], uint32_t bm) {
#pragma unroll
  for (int kk = 0; kk < kRows / 16; ++kk) wg::rs<HD, true>(acc, pa[kk], mnmajor_desc(bm, kk));
}

// dK, dV. Grid (key tiles, KV, B); the block owns key rows [j0, j0 + 64) of KV head g and walks, head
// by head of the group, the query tiles that can see them: [j0, j_last + window).
template <int HD, class E>
__global__ void __launch_bounds__(kThreads, kWgDkdvBlocks<HD>)
    wg_bwd_dkdv_kernel(float* dk, float* dv, const float* dout, const E* q, const E* k, const E* v, const float* lse,
                       const float* Dv, AttnShape sh, bool vec, bool async, bool vec_out, bool swz) {
  using T = WgBwdTiles<HD>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = wg::pattern_aligned(smem_raw);  // the tiles' swizzle needs a 1024-aligned base
  const uint32_t s0 = wg::smem_addr(smem);
  float* stats = reinterpret_cast<float*>(smem + T::kStats);

  const int S = sh.S, H = sh.H, KV = sh.KV, W = sh.window, G = H / KV;
  const int b = blockIdx.z, g = blockIdx.y;
  const int j0 = blockIdx.x * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gq = lane >> 2, tq = lane & 3;
  const int ja = j0 + warp * 16 + gq, jb = ja + 8;  // the lane's key rows
  const float scale = float(sh.scale);
  const int j_last = min(S, j0 + kRows) - 1;
  const int q_end = W > 0 ? min(S, j_last + W) : S;  // queries past it see none of these keys
  const int head_tiles = (q_end - j0 + kRows - 1) / kRows, steps = G * head_tiles;
  // Step s: head g * G + s / head_tiles, query tile q0 = j0 + 64 (s % head_tiles), into buffer `buf`.
  auto stage_step = [&](int step, int buf) {
    const int h = g * G + step / head_tiles, q0 = j0 + (step % head_tiles) * kRows;
    stage_swizzled<HD>(smem + T::kB + buf * T::kTile, q, b, S, H, h, q0, vec, async, swz);
    stage_swizzled<HD>(smem + T::kC + buf * T::kTile, dout, b, S, H, h, q0, vec, false, swz);
    attn::load_row_stats(stats + buf * 2 * kRows, lse, b, H, h, S, q0);
    attn::load_row_stats(stats + buf * 2 * kRows + kRows, Dv, b, H, h, S, q0);
  };
  stage_swizzled<HD>(smem + T::kA0, k, b, S, KV, g, j0, vec, async, swz);
  stage_swizzled<HD>(smem + T::kA1, v, b, S, KV, g, j0, vec, async, swz);
  stage_step(0, 0);
  __pipeline_commit();

  float dka[HD / 8][4], dva[HD / 8][4];
  zero(dka);
  zero(dva);
  for (int step = 0; step < steps; ++step) {
    const int buf = step & 1;
    __pipeline_wait_prior(0);  // this thread's copies of the step have landed ...
    wg::fence_proxy_async();   // ... and with its plain stores are visible to the tensor cores ...
    __syncthreads();           // ... everyone's; every MMA of the previous step has retired
    if (step + 1 < steps) stage_step(step + 1, buf ^ 1);
    __pipeline_commit();
    const int q0 = j0 + (step % head_tiles) * kRows;
    const uint32_t qs = s0 + T::kB + buf * T::kTile, dos = s0 + T::kC + buf * T::kTile;
    const float* Lq = stats + buf * 2 * kRows;
    const float* Dq = Lq + kRows;

    float st[kRows / 8][4], dpt[kRows / 8][4];  // S^T, dP^T: key rows ja, jb; query columns
    two_score_tiles<HD>(st, dpt, s0 + T::kA0, qs, s0 + T::kA1, dos);
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n * 8 + 2 * tq + (e & 1), i = q0 + col, j = e < 2 ? ja : jb;
        const bool vis = j < S && i < S && visible(i, j, W);
        const float p = vis ? expf(scale * st[n][e] - Lq[col]) : 0.f;
        dpt[n][e] = p * (dpt[n][e] - Dq[col]);
        st[n][e] = p;
      }
    uint32_t pa[kRows / 16][4], sa[kRows / 16][4];
    pack_p(pa, st);
    pack_p(sa, dpt);
    wg::wgmma_fence();
    wg::fence_acc(dva);
    wg::fence_acc(dka);
    issue_pv<HD>(dva, pa, dos);  // dV += P^T dO
    issue_pv<HD>(dka, sa, qs);   // dK += dS^T Q   (scale applied at the store)
    wg::wgmma_commit();
    wg::wgmma_wait<0>();
    wg::fence_acc(dva);
    wg::fence_acc(dka);
  }
  __pipeline_wait_prior(0);  // (only an empty group is left)
  attn::store_grad_rows<HD>(dk, dka, scale, b, S, KV, g, ja, jb, tq, vec_out);
  attn::store_grad_rows<HD>(dv, dva, 1.f, b, S, KV, g, ja, jb, tq, vec_out);
}

// dQ. Grid (query tiles, H, B), the late tiles (most keys) first; the block owns query rows
// [i0, i0 + 64) of head h and walks the key tiles they can see.
template <int HD, class E>
__global__ void __launch_bounds__(kThreads, kWgDqBlocks<HD>)
    wg_bwd_dq_kernel(float* dq, const float* dout, const E* q, const E* k, const E* v, const float* lse,
                     const float* Dv, AttnShape sh, bool vec, bool async, bool vec_out, bool swz) {
  using T = WgBwdTiles<HD>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = wg::pattern_aligned(smem_raw);  // the tiles' swizzle needs a 1024-aligned base
  const uint32_t s0 = wg::smem_addr(smem);
  float* Li = reinterpret_cast<float*>(smem + T::kStats);
  float* Di = Li + kRows;

  const int S = sh.S, H = sh.H, KV = sh.KV, W = sh.window;
  const int b = blockIdx.z, h = blockIdx.y, g = h / (H / KV);
  const int i0 = (gridDim.x - 1 - blockIdx.x) * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gq = lane >> 2, tq = lane & 3;
  const int ia = i0 + warp * 16 + gq, ib = ia + 8;  // the lane's query rows
  const float scale = float(sh.scale);
  const int k_first = key_lo(i0, W);
  const int i_last = min(S, i0 + kRows) - 1;

  stage_swizzled<HD>(smem + T::kA0, q, b, S, H, h, i0, vec, async, swz);
  stage_swizzled<HD>(smem + T::kA1, dout, b, S, H, h, i0, vec, false, swz);
  attn::load_row_stats(Li, lse, b, H, h, S, i0);
  attn::load_row_stats(Di, Dv, b, H, h, S, i0);
  stage_swizzled<HD>(smem + T::kB, k, b, S, KV, g, k_first, vec, async, swz);
  stage_swizzled<HD>(smem + T::kC, v, b, S, KV, g, k_first, vec, async, swz);
  __pipeline_commit();

  float dqa[HD / 8][4];
  zero(dqa);
  int buf = 0;
  for (int k0 = k_first; k0 <= i_last; k0 += kRows, buf ^= 1) {
    __pipeline_wait_prior(0);  // this thread's copies of the tile have landed ...
    wg::fence_proxy_async();   // ... and with its plain stores are visible to the tensor cores ...
    __syncthreads();           // ... everyone's; every MMA of the previous tile has retired
    if (k0 + kRows <= i_last) {
      stage_swizzled<HD>(smem + T::kB + (buf ^ 1) * T::kTile, k, b, S, KV, g, k0 + kRows, vec, async, swz);
      stage_swizzled<HD>(smem + T::kC + (buf ^ 1) * T::kTile, v, b, S, KV, g, k0 + kRows, vec, async, swz);
    }
    __pipeline_commit();
    const uint32_t ks = s0 + T::kB + buf * T::kTile, vs = s0 + T::kC + buf * T::kTile;
    const float la = Li[warp * 16 + gq], lb = Li[warp * 16 + gq + 8], da = Di[warp * 16 + gq],
                db = Di[warp * 16 + gq + 8];

    float s[kRows / 8][4], dp[kRows / 8][4];  // S, dP: query rows ia, ib; key columns
    two_score_tiles<HD>(s, dp, s0 + T::kA0, ks, s0 + T::kA1, vs);
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = k0 + n * 8 + 2 * tq + (e & 1), i = e < 2 ? ia : ib;
        const bool vis = i < S && j < S && visible(i, j, W);
        const float p = vis ? expf(scale * s[n][e] - (e < 2 ? la : lb)) : 0.f;
        dp[n][e] = p * (dp[n][e] - (e < 2 ? da : db));
      }
    uint32_t sa[kRows / 16][4];
    pack_p(sa, dp);
    wg::wgmma_fence();
    wg::fence_acc(dqa);
    issue_pv<HD>(dqa, sa, ks);  // dQ += dS K   (scale applied at the store)
    wg::wgmma_commit();
    wg::wgmma_wait<0>();
    wg::fence_acc(dqa);
  }
  __pipeline_wait_prior(0);  // (only an empty group is left)
  attn::store_grad_rows<HD>(dq, dqa, scale, b, S, H, h, ia, ib, tq, vec_out);
}

template <int HD, class E>
cudaError_t bwd(float* dq, float* dk, float* dv, const float* dout, const E* q, const E* k, const E* v,
                const float* lse, const float* Dv, const AttnShape& s, bool swz, cudaStream_t st) {
  using T = WgBwdTiles<HD>;
  const bool vec = attn::vec_ok(q) && attn::vec_ok(k) && attn::vec_ok(v) && attn::vec_ok(dout);
  const bool async = attn::async_ok(q) && attn::async_ok(k) && attn::async_ok(v);
  cudaError_t e = allow_smem(wg_bwd_dkdv_kernel<HD, E>, T::kBytes);
  if (e != cudaSuccess) return e;
  e = allow_smem(wg_bwd_dq_kernel<HD, E>, T::kBytes);
  if (e != cudaSuccess) return e;
  const unsigned tiles = unsigned((s.S + kRows - 1) / kRows);
  wg_bwd_dkdv_kernel<HD, E><<<dim3(tiles, unsigned(s.KV), unsigned(s.B)), kThreads, T::kBytes, st>>>(
      dk, dv, dout, q, k, v, lse, Dv, s, vec, async, attn::vec2_ok(dk) && attn::vec2_ok(dv), swz);
  wg_bwd_dq_kernel<HD, E><<<dim3(tiles, unsigned(s.H), unsigned(s.B)), kThreads, T::kBytes, st>>>(
      dq, dout, q, k, v, lse, Dv, s, vec, async, attn::vec2_ok(dq), swz);
  return cudaGetLastError();
}

}  // namespace

template <class E>
cudaError_t attention_wgmma_backward(float* dq, float* dk, float* dv, const float* dout, const E* q, const E* k,
                                     const E* v, const float* lse, const float* D, const cpu::AttnShape& s,
                                     cudaStream_t st) {
  if (!attention_wgmma_available()) return cudaErrorNotSupported;
  if (s.B <= 0 || s.S <= 0 || s.H <= 0) return cudaSuccess;
  if (!attn::shape_ok(s)) return cudaErrorInvalidValue;
  const bool swz = !attention_wgmma_layout_bug_planted();
  return s.hd == 64 ? bwd<64>(dq, dk, dv, dout, q, k, v, lse, D, s, swz, st)
                    : bwd<128>(dq, dk, dv, dout, q, k, v, lse, D, s, swz, st);
}
template cudaError_t attention_wgmma_backward<float>(float*, float*, float*, const float*, const float*, const float*,
                                                     const float*, const float*, const float*, const cpu::AttnShape&,
                                                     cudaStream_t);
template cudaError_t attention_wgmma_backward<__nv_bfloat16>(float*, float*, float*, const float*,
                                                             const __nv_bfloat16*, const __nv_bfloat16*,
                                                             const __nv_bfloat16*, const float*, const float*,
                                                             const cpu::AttnShape&, cudaStream_t);

}  // namespace ladder::cuda::k
