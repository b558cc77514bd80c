// Register-resident tensor-core attention, backward (attention_mma.cuh): FlashAttention-2's backward
// in the WMMA backward's work split (attention_tc.cu, tc_bwd_dkdv_kernel and tc_bwd_dq_kernel): a
// kernel that owns 64 key rows of a KV head and walks, head by head of its GQA group, the query
// tiles that can see them (dK, dV), and one that owns 64 query rows of a head and walks the key
// tiles they see (dQ). Each output row is written by one block, once: no atomics, deterministic.
//
// Blocks of 128 threads (4 warps); warp w owns rows [16w, 16w + 16) of the block's 64-row tile. The
// bf16 tiles (q, k, v, dO: [64][HD + 8], rows 16-byte aligned, 8 rows of a ldmatrix on distinct
// banks) and the 64 rows' lse, D are the only shared memory; scores, probabilities and dS stay in
// mma.sync accumulators (mma_ptx.cuh's documented layouts), and the gradients accumulate in
// registers across the whole loop. The other operand's 64 rows are taken a chunk at a time
// (BwdCfg: kChunkKV queries in the dK/dV kernel, kChunkQ keys in the dQ kernel), so that only a
// 16 x chunk score and dP block is live beside the accumulators; the warp's own A fragments (K, V
// or Q, dO rows) are reloaded from shared memory (ldmatrix) per chunk rather than held, which the
// hd 128 dK/dV kernel's 128 accumulator registers leave no room for. A warp skips a chunk none of
// its rows sees (exact: every skipped p is 0). The results go straight from the accumulators to
// global memory (float2 stores where the base allows).
//
// dK/dV, per warp and chunk of queries (lane l: g = l / 4, t = l % 4; accumulator element e of n8
// tile n: key row g (e < 2) or g + 8, query column 8n + 2t + e % 2):
//   S^T = K_w Q^T, dP^T = V_w dO^T        (A: ldmatrix_x4 of K, V rows; B: ldmatrix_x4 of Q, dO rows)
//   P^T = exp(scale S^T - lse[query]) (0 where masked), dS^T = P^T (dP^T - D[query])   (fp32)
//   dV += bf16(P^T) dO, dK += bf16(dS^T) Q    (A: pack_a; B: ldmatrix_x4_trans of dO, Q rows)
// and dK is stored times scale, as the WMMA kernel does.
// dQ, per warp and chunk of keys: S = Q_w K^T, dP = dO_w V^T, P, dS as above with the row's lse, D;
// dQ += bf16(dS) K (B: ldmatrix_x4_trans of K rows); stored times scale.
//
// The same bf16 rounding as the WMMA kernels (staged q, k, v, dO; P and dS at the MMA inputs), the
// same masking and the same fp32 statistics; only the order of the fp32 sums inside the MMAs
// differs. bf16 inputs give bitwise what fp32 inputs give on the widened values (same tiles, same
// code after the staging).
//
// Pipelining: each kernel streams the other operand's rows through its tiles in steps of part of a
// tile (dK/dV: 32 queries of Q, dO, lse, D; dQ: 32 keys of K, V), the next step's rows issued as a
// step's math starts, into the rows of the step before, which every warp is done with: bf16 inputs
// with 16-byte aligned bases by cp.async (attn::stage_tile), landing while the math runs; fp32 q, k,
// v and the fp32 dO, lse, D through registers. One barrier per step, as many per tile as loading
// whole tiles took, and no more shared memory; the same values staged and the same math in the same
// order: bitwise the results of loading whole tiles.
//
// Shared memory per block: 4 tiles + 512 bytes = 37376 bytes (hd 64), 70144 (hd 128). Blocks per
// sm_90 SM (registers bound them before shared memory, which would hold 6 and 3; BwdCfg): hd 64
// dK/dV 4, dQ 4; hd 128 dK/dV 2, dQ 3. sm_80 (163 KiB): hd 64 4 of each, hd 128 2 of each.
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/attention_softmax.cuh"
#include "backend/cuda/mma_ptx.cuh"

namespace ladder::cuda::k {

namespace {

using cpu::AttnShape;
using bf16 = __nv_bfloat16;
using attn::key_lo;
using attn::kRows;
using attn::load_row_stats;
using attn::visible;

constexpr int kThreads = 128;

template <int HD>
struct BwdCfg {
  static constexpr int kLd = HD + 8;  // bf16 tile pitch: 144 / 272 bytes (16-byte rows, conflict-free ldmatrix)
  static constexpr size_t kTile = size_t(kRows) * kLd * sizeof(bf16);
  static constexpr size_t kSmem = 4 * kTile + 2 * kRows * sizeof(float);
  // Rows of the other operand per register step (a multiple of 16: the 16 x kChunk S and dP blocks
  // live beside the accumulators), and the __launch_bounds__ minimum blocks per SM, of the dK/dV and
  // the dQ kernel. ptxas (CUDA 13, sm_90, no spills; bf16 / fp32 inputs): dK/dV 126 / 128
  // registers at hd 64 (4 blocks: cap 128), 238 / 240 at hd 128 (2 blocks; at 3, the 168 cap spills
  // even with 16-query chunks: 128 of them are the dK, dV accumulators); dQ 128 at hd 64 (4
  // blocks), 166 at hd 128 (3 blocks).
  static constexpr int kChunkKV = HD == 64 ? 16 : 32;
  static constexpr int kMinKV = HD == 64 ? 4 : 2;
  static constexpr int kChunkQ = 32;
  static constexpr int kMinQ = HD == 64 ? 4 : 3;
  static_assert(kTile % 128 == 0, "tiles stay 128-byte aligned");
};

using attn::blocks_per_sm;  // occupancy by shared memory (attention_common.cuh)
static_assert(blocks_per_sm(BwdCfg<64>::kSmem, 228) >= 4 && blocks_per_sm(BwdCfg<128>::kSmem, 228) >= 3,
              "sm_90: shared memory holds the blocks the register cap is sized for");
static_assert(BwdCfg<128>::kSmem <= 163 * 1024, "sm_80 opt-in limit");

// c[n] (16 x C: n8 tiles) = A_w[16 x HD] * B^T where A_w is rows [r0, r0 + 16) of tile `a` and B^T's
// columns are rows [n0, n0 + C) of tile `bt` (both [64][kLd] bf16 row-major).
template <int HD, int C>
__device__ __forceinline__ void mma_abt(float (&c)[C / 8][4], const bf16* a, const bf16* bt, int r0, int n0,
                                        int lane) {
  constexpr int kLd = BwdCfg<HD>::kLd;
#pragma unroll
  for (int n = 0; n < C / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[n][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    uint32_t fa[4];
    ldmatrix_x4(fa, frag_a(a, kLd, r0, kk * 16, lane));
#pragma unroll
    for (int n = 0; n < C / 16; ++n) {
      uint32_t fb[4];
      ldmatrix_x4(fb, frag_b_nk(bt, kLd, n0 + n * 16, kk * 16, lane));
      mma2(c[2 * n], c[2 * n + 1], fa, fb);
    }
  }
}

// dK, dV. Grid (key tiles, KV, B); the block owns key rows [j0, j0 + 64) of KV head g and walks, head
// by head of the group, the query tiles that can see them: [j0, j_last + window).
template <int HD, class E>
__global__ void __launch_bounds__(kThreads, BwdCfg<HD>::kMinKV)
    mma_bwd_dkdv_kernel(float* dk, float* dv, const float* dout, const E* q, const E* k, const E* v, const float* lse,
                        const float* Dv, AttnShape sh, bool vec, bool async, bool vec_out) {
  using Cfg = BwdCfg<HD>;
  constexpr int kLd = Cfg::kLd, C = Cfg::kChunkKV;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Ks = reinterpret_cast<bf16*>(smem);
  bf16* Vs = reinterpret_cast<bf16*>(smem + Cfg::kTile);
  bf16* Qs = reinterpret_cast<bf16*>(smem + 2 * Cfg::kTile);
  bf16* dOs = reinterpret_cast<bf16*>(smem + 3 * Cfg::kTile);
  float* Lq = reinterpret_cast<float*>(smem + 4 * Cfg::kTile);
  float* Dq = Lq + kRows;

  const int S = sh.S, H = sh.H, KV = sh.KV, W = sh.window, G = H / KV;
  const int b = blockIdx.z, g = blockIdx.y;
  const int j0 = blockIdx.x * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr0 = warp * 16;
  const int gq = lane >> 2, tq = lane & 3;
  const int ja = j0 + wr0 + gq, jb = ja + 8;  // the lane's key rows (accumulator elements 0, 1 and 2, 3)
  const float scale = float(sh.scale);

  const int w_first = j0 + wr0, w_last = min(S - 1, w_first + 15);
  const int j_last = min(S, j0 + kRows) - 1;
  const int q_end = W > 0 ? min(S, j_last + W) : S;  // queries past it see none of these keys
  // The query tiles [j0, q_end) of each head of the group, rounded up to whole tiles as the
  // tile-at-a-time loop took them, stream through the Q, dO tiles (and Lq, Dq) kStep rows at a time:
  // query i to row (i - j0) % 64. The next step's rows are issued (Q by cp.async; dO, lse and D are
  // fp32 and go through registers) as this step's math starts, into the rows of the step before (no
  // warp reads them again), so that the copies land while it runs: one commit group and one block
  // barrier per step, as many barriers per tile as before, no more shared memory.
  constexpr int kStep = 32;
  static_assert(kStep % C == 0 && kRows % kStep == 0 && kRows / kStep >= 2,
                "steps of whole chunks, two or more per tile");
  const int head_steps = (q_end - j0 + kRows - 1) / kRows * (kRows / kStep);
  auto stage_step = [&](int step) {  // head g * G + step / head_steps, queries [qs, qs + kStep)
    const int h = g * G + step / head_steps, r = (step % head_steps) * kStep, qs = j0 + r, c = r % kRows;
    attn::stage_tile<HD, kLd, kThreads, kStep>(Qs + c * kLd, q, b, S, H, h, qs, vec, async);
    attn::stage_tile<HD, kLd, kThreads, kStep>(dOs + c * kLd, dout, b, S, H, h, qs, vec, false);
    load_row_stats<kStep>(Lq + c, lse, b, H, h, S, qs);
    load_row_stats<kStep>(Dq + c, Dv, b, H, h, S, qs);
  };
  attn::stage_tile<HD, kLd, kThreads>(Ks, k, b, S, KV, g, j0, vec, async);
  attn::stage_tile<HD, kLd, kThreads>(Vs, v, b, S, KV, g, j0, vec, async);
  stage_step(0);
  __pipeline_commit();
  float dka[HD / 8][4], dva[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.f;

  const int steps = G * head_steps;
  for (int step = 0; step < steps; ++step) {
    __pipeline_wait_prior(0);  // this thread's copies of the step have landed ...
    __syncthreads();  // ... everyone's have, and every warp is done with the rows the next step takes
    if (step + 1 < steps) stage_step(step + 1);
    __pipeline_commit();  // (empty after the last step)
    if (w_first >= S) continue;
    const int r = (step % head_steps) * kStep, c_first = r % kRows;
    const int q0 = j0 + r - c_first;  // the step's query tile
    for (int c0 = c_first; c0 < c_first + kStep; c0 += C) {
      // Some query of the chunk sees some key of the warp's 16: the latest query is at or after
      // the first key, and (window) the earliest is less than `window` after the last key.
      const int qa = q0 + c0;
      if (!(qa + C - 1 >= w_first && (W <= 0 || qa <= w_last + W - 1))) continue;
      float st[C / 8][4], dpt[C / 8][4];
      mma_abt<HD, C>(st, Ks, Qs, wr0, c0, lane);
      mma_abt<HD, C>(dpt, Vs, dOs, wr0, c0, lane);
#pragma unroll
      for (int n = 0; n < C / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = c0 + n * 8 + 2 * tq + (e & 1), i = q0 + col, j = e < 2 ? ja : jb;
          const bool vis = j < S && i < S && visible(i, j, W);
          const float p = vis ? expf(scale * st[n][e] - Lq[col]) : 0.f;
          dpt[n][e] = p * (dpt[n][e] - Dq[col]);
          st[n][e] = p;
        }
      mma_ab_acc<HD, C, kLd>(dva, st, dOs, c0, lane);   // dV += P^T dO
      mma_ab_acc<HD, C, kLd>(dka, dpt, Qs, c0, lane);  // dK += dS^T Q   (scale applied at the store)
    }
  }
  __pipeline_wait_prior(0);  // (nothing is in flight: the last group is empty)
  attn::store_grad_rows<HD>(dk, dka, scale, b, S, KV, g, ja, jb, tq, vec_out);
  attn::store_grad_rows<HD>(dv, dva, 1.f, b, S, KV, g, ja, jb, tq, vec_out);
}

// dQ. Grid (query tiles, H, B), the late tiles (most keys) first; the block owns query rows
// [i0, i0 + 64) of head h and walks the key tiles they can see.
template <int HD, class E>
__global__ void __launch_bounds__(kThreads, BwdCfg<HD>::kMinQ)
    mma_bwd_dq_kernel(float* dq, const float* dout, const E* q, const E* k, const E* v, const float* lse,
                      const float* Dv, AttnShape sh, bool vec, bool async, bool vec_out) {
  using Cfg = BwdCfg<HD>;
  constexpr int kLd = Cfg::kLd, C = Cfg::kChunkQ;
  static_assert(kRows % C == 0 && kRows / C >= 2, "the next chunk's rows are not the current chunk's");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* dOs = reinterpret_cast<bf16*>(smem + Cfg::kTile);
  bf16* Ks = reinterpret_cast<bf16*>(smem + 2 * Cfg::kTile);
  bf16* Vs = reinterpret_cast<bf16*>(smem + 3 * Cfg::kTile);
  float* Li = reinterpret_cast<float*>(smem + 4 * Cfg::kTile);
  float* Di = Li + kRows;

  const int S = sh.S, H = sh.H, KV = sh.KV, W = sh.window;
  const int b = blockIdx.z, h = blockIdx.y, g = h / (H / KV);
  const int i0 = (gridDim.x - 1 - blockIdx.x) * kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wr0 = warp * 16;
  const int gq = lane >> 2, tq = lane & 3;
  const int ia = i0 + wr0 + gq, ib = ia + 8;  // the lane's query rows
  const float scale = float(sh.scale);

  // The keys the block sees, [k_first, i_last], stream through the K, V tiles a chunk (C rows) at a
  // time, key kc to row (kc - k_first) % 64, in the order the tile-at-a-time loop took them. The
  // next chunk's copies are issued (cp.async) as this chunk's math starts, into the rows of the
  // chunk before (no warp reads them again), so that they land while it runs: one commit group and
  // one block barrier per chunk, as many barriers as the tile-at-a-time loop had, no more shared
  // memory.
  const int k_first = key_lo(i0, W);
  const int i_last = min(S, i0 + kRows) - 1;
  auto stage_chunk = [&](int kc) {  // key rows [kc, kc + C) into their rows of Ks, Vs
    const int c = (kc - k_first) % kRows;
    attn::stage_tile<HD, kLd, kThreads, C>(Ks + c * kLd, k, b, S, KV, g, kc, vec, async);
    attn::stage_tile<HD, kLd, kThreads, C>(Vs + c * kLd, v, b, S, KV, g, kc, vec, async);
  };
  attn::stage_tile<HD, kLd, kThreads>(Qs, q, b, S, H, h, i0, vec, async);
  attn::load_tile<HD, kLd, kThreads>(dOs, dout, b, S, H, h, i0, vec);
  load_row_stats(Li, lse, b, H, h, S, i0);
  load_row_stats(Di, Dv, b, H, h, S, i0);
  stage_chunk(k_first);
  __pipeline_commit();
  float dqa[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dqa[n][e] = 0.f;

  const int w_first = i0 + wr0, w_last = min(S - 1, w_first + 15);
  for (int ka = k_first; ka <= i_last; ka += C) {
    __pipeline_wait_prior(0);  // this thread's copies of the chunk have landed ...
    __syncthreads();  // ... everyone's have, and every warp is done with the rows the next chunk takes
    if (ka + C <= i_last) stage_chunk(ka + C);
    __pipeline_commit();  // (empty after the last chunk)
    // Some key of the chunk is seen by some row of the warp.
    if (!(w_first < S && ka <= w_last && ka + C - 1 >= key_lo(w_first, W))) continue;
    const int c0 = (ka - k_first) % kRows;
    const float la = Li[wr0 + gq], lb = Li[wr0 + gq + 8], da = Di[wr0 + gq], db = Di[wr0 + gq + 8];
    float s[C / 8][4], dp[C / 8][4];
    mma_abt<HD, C>(s, Qs, Ks, wr0, c0, lane);
    mma_abt<HD, C>(dp, dOs, Vs, wr0, c0, lane);
#pragma unroll
    for (int n = 0; n < C / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = ka + n * 8 + 2 * tq + (e & 1), i = e < 2 ? ia : ib;
        const bool vis = i < S && j < S && visible(i, j, W);
        const float p = vis ? expf(scale * s[n][e] - (e < 2 ? la : lb)) : 0.f;
        dp[n][e] = p * (dp[n][e] - (e < 2 ? da : db));
      }
    mma_ab_acc<HD, C, kLd>(dqa, dp, Ks, c0, lane);  // dQ += dS K   (scale applied at the store)
  }
  __pipeline_wait_prior(0);  // (nothing is in flight: the last group is empty)
  attn::store_grad_rows<HD>(dq, dqa, scale, b, S, H, h, ia, ib, tq, vec_out);
}

template <int HD, class E>
cudaError_t bwd(float* dq, float* dk, float* dv, const float* dout, const E* q, const E* k, const E* v,
                const float* lse, const float* Dv, const AttnShape& s, cudaStream_t st) {
  using Cfg = BwdCfg<HD>;
  const bool vec = attn::vec_ok(q) && attn::vec_ok(k) && attn::vec_ok(v) && attn::vec_ok(dout);
  const bool async = attn::async_ok(q) && attn::async_ok(k) && attn::async_ok(v);
  cudaError_t e = allow_smem(mma_bwd_dkdv_kernel<HD, E>, Cfg::kSmem);
  if (e != cudaSuccess) return e;
  e = allow_smem(mma_bwd_dq_kernel<HD, E>, Cfg::kSmem);
  if (e != cudaSuccess) return e;
  const unsigned tiles = unsigned((s.S + kRows - 1) / kRows);
  mma_bwd_dkdv_kernel<HD, E><<<dim3(tiles, unsigned(s.KV), unsigned(s.B)), kThreads, Cfg::kSmem, st>>>(
      dk, dv, dout, q, k, v, lse, Dv, s, vec, async, attn::vec2_ok(dk) && attn::vec2_ok(dv));
  mma_bwd_dq_kernel<HD, E><<<dim3(tiles, unsigned(s.H), unsigned(s.B)), kThreads, Cfg::kSmem, st>>>(
      dq, dout, q, k, v, lse, Dv, s, vec, async, attn::vec2_ok(dq));
  return cudaGetLastError();
}

}  // namespace

template <class E>
cudaError_t attention_mma_backward(float* dq, float* dk, float* dv, const float* dout, const E* q, const E* k,
                                   const E* v, const float* lse, const float* D, const cpu::AttnShape& s,
                                   cudaStream_t st) {
  if (s.B <= 0 || s.S <= 0 || s.H <= 0) return cudaSuccess;
  if ((s.hd != 64 && s.hd != 128) || s.KV <= 0 || s.H % s.KV != 0) return cudaErrorInvalidValue;
  return s.hd == 64 ? bwd<64>(dq, dk, dv, dout, q, k, v, lse, D, s, st)
                    : bwd<128>(dq, dk, dv, dout, q, k, v, lse, D, s, st);
}
template cudaError_t attention_mma_backward<float>(float*, float*, float*, const float*, const float*, const float*,
                                                   const float*, const float*, const float*, const cpu::AttnShape&,
                                                   cudaStream_t);
template cudaError_t attention_mma_backward<__nv_bfloat16>(float*, float*, float*, const float*, const __nv_bfloat16*,
                                                           const __nv_bfloat16*, const __nv_bfloat16*, const float*,
                                                           const float*, const cpu::AttnShape&, cudaStream_t);

}  // namespace ladder::cuda::k
