// Tensor-core attention forward on wgmma (sm_90a; attention_wgmma.cuh): the mma.sync forward's
// contract (attention_mma_fwd.cu's header: masking, online softmax, rounding of q, k, v and P to
// bf16, lse, o = O / l, determinism) with its products on Hopper's warpgroup MMA. Built only with
// -gencode arch=compute_90a,code=sm_90a (CMakeLists.txt: the ladder_wgmma object library).
//
// Work layout: grid (query tiles, H, B), the late (long causal) query tiles first, as the mma.sync
// kernel; a block is one warpgroup (128 threads) owning query rows [i0, i0 + 64) of head h, warp w
// rows [i0 + 16w, +16), lane (g, t) rows ia = i0 + 16w + g and ib = ia + 8: the m64nN accumulator
// rows (wgmma_attn_ptx.cuh) are the mma.sync kernel's, so the softmax and the epilogue are shared
// code (attention_softmax.cuh). Per key tile (64 keys):
//   S (64 x 64, fp32) = Q K^T: HD / 16 wgmma m64n64k16, Q (A) and K (B) both K-major from shared
//     memory (a tile row is a query's or key's hd elements).
//   P = exp(scale S - m) in registers; pairs of S tiles rounded to bf16 (pack_a) are the register A
//     fragments of the four key slices.
//   O (64 x HD, fp32) += P V: 4 wgmma m64nHDk16 with A = P from registers and B = V from shared
//     memory, MN-major (V is [key][hd], the N dimension contiguous).
// Every warp of the warpgroup issues every MMA (wgmma is warpgroup-collective), so unlike the
// mma.sync kernel a warp whose rows see none of a tile's keys does not skip it: the mask gives it
// P = 0 and corr = 1, the identity update, and the results are the same.
//
// Shared memory: Q, two K buffers and two (hd 64) or one (hd 128) V buffers (WgFwdTiles), every tile
// in one layout: the 128-byte swizzle
// of wgmma_ptx.cuh, 64-column blocks of [64 rows][128 bytes] (hd 64: one block, 8 KiB; hd 128: two,
// 16 KiB), so K-major reads of Q and K (k16 slice kk at block kk / 4, byte 32 (kk % 4) of the row)
// and MN-major reads of V (k16 slice kk at row 16 kk; SBO = 8 rows, LBO = the next 64-column block,
// wgmma_layout.h's constants, so whatever CudaWgmma.MnMajorStrideRoles finds applies here too) see
// the same bytes. 40 KiB (hd 64) and 64 KiB (hd 128) per block, plus 1 KiB of slack: the tiles
// start at the first 1024-byte boundary of the dynamic shared memory (wg::pattern_aligned).
// Pipeline: the next key tile's K (and V at hd 64) is issued (cp.async for aligned bf16; fp32 and
// unaligned bf16 go through registers, synchronously) right after the barrier that publishes the
// current one, into the other buffers, and lands while the warpgroup computes; one barrier per key
// tile at hd 64, two at hd 128 (the tile's own V, issued at the top, published before P V).
// Each MMA batch is waited for (wgmma.wait_group 0) before its results are used, so no operand
// buffer is overwritten under an MMA in flight.
#include <cuda_bf16.h>
#include <cuda_pipeline_primitives.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/attention_softmax.cuh"
#include "backend/cuda/attention_wgmma.cuh"
#include "backend/cuda/attention_wgmma_tiles.cuh"
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/mma_ptx.cuh"
#include "backend/cuda/wgmma_attn_ptx.cuh"
#include "backend/cuda/wgmma_layout.h"

namespace ladder::cuda::k {

namespace {

using cpu::AttnShape;
using bf16 = __nv_bfloat16;
using attn::key_lo;
using attn::kRows;
using attn::kmajor_desc;
using attn::stage_swizzled;
using attn::mnmajor_desc;
using attn::kWgThreads;
constexpr int kThreads = kWgThreads;  // one warpgroup: 64 query rows

template <int HD>
struct WgFwdTiles {
  static constexpr int kTile = attn::WgTile<HD>::kBytes;
  // V buffers: two at hd 64 (the next tile's V loads during the whole iteration, one barrier per
  // tile: 40 KiB, registers bind at 4 blocks per SM anyway); one at hd 128, so that the block takes
  // 64 KiB and sm_90 holds 3 blocks, as the registers allow (two would take 80 KiB: 2 blocks): the
  // tile's V is then issued at the top of its own iteration, once the previous P V has retired, and
  // lands during S = Q K^T and the softmax (a second barrier publishes it), as in the mma.sync kernel.
  static constexpr int kVBufs = HD == 64 ? 2 : 1;
  static constexpr int kQ = 0, kK = kTile, kV = 3 * kTile;  // byte offsets: Q, K[2], V[kVBufs]
  static constexpr size_t kBytes = size_t(3 + kVBufs) * kTile + wg::kPattern;  // + slack to align the base
};

// Blocks per SM for __launch_bounds__: shared memory allows 5 (hd 64) and 3 (hd 128) on sm_90.
// ptxas (CUDA 13.0, sm_90a; scripts/ptxas-regs.sh): hd 64, 4 blocks (cap 128): 125 registers (bf16
// inputs), 121 (fp32); hd 128, bf16 inputs (the model's: in16 and attn_bf16), 3 blocks (cap 168):
// 168, no spills; fp32 inputs (rounded while staged, through registers) spill 8 bytes at that cap,
// so they keep 2 blocks (183 registers).
template <int HD, class E>
constexpr int kWgFwdBlocks = HD == 64 ? 4 : std::is_same_v<E, float> ? 2 : 3;
static_assert(attn::blocks_per_sm(WgFwdTiles<64>::kBytes, 228) >= kWgFwdBlocks<64, bf16> &&
                  attn::blocks_per_sm(WgFwdTiles<128>::kBytes, 228) >= kWgFwdBlocks<128, bf16>,
              "sm_90: shared memory allows the blocks per SM the register caps are chosen for");

template <int HD, class E, class EO>
__global__ void __launch_bounds__(kThreads, kWgFwdBlocks<HD, E>)
    wg_fwd_kernel(EO* o, float* lse, const E* q, const E* k, const E* v, AttnShape sh, bool vec, bool async,
                  bool ovec, bool swz) {
  using T = WgFwdTiles<HD>;
  constexpr int kQk = HD / 16;    // k16 slices of Q K^T
  constexpr int kPv = kRows / 16;  // k16 slices of P V (4)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = wg::pattern_aligned(smem_raw);  // the tiles' swizzle needs a 1024-aligned base
  const uint32_t s0 = wg::smem_addr(smem);

  const int S = sh.S, H = sh.H, KV = sh.KV, W = sh.window;
  const int b = blockIdx.z, h = blockIdx.y, kvh = h / (H / KV);
  const int i0 = (gridDim.x - 1 - blockIdx.x) * kRows;  // the long (late) causal tiles first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int ia = i0 + warp * 16 + g, ib = ia + 8;
  const float scale = float(sh.scale);
  const int k_first = key_lo(i0, W);
  const int w_first = i0 + warp * 16;
  const int i_last = min(S, i0 + kRows) - 1;

  // Prologue: Q and the first K tile (and V tile, with two V buffers), one commit group.
  stage_swizzled<HD>(smem + T::kQ, q, b, S, H, h, i0, vec, async, swz);
  stage_swizzled<HD>(smem + T::kK, k, b, S, KV, kvh, k_first, vec, async, swz);
  if constexpr (T::kVBufs == 2) stage_swizzled<HD>(smem + T::kV, v, b, S, KV, kvh, k_first, vec, async, swz);
  __pipeline_commit();

  float oacc[HD / 8][4];  // O: the m64nHD accumulators (rows ia, ib; hd columns 8n + 2t, + 1)
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) oacc[n][0] = oacc[n][1] = oacc[n][2] = oacc[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // rows ia, ib: running max (the same bits in the quad)
  float l[2] = {0.f, 0.f};              // the lane's share of the row's denominator

  int buf = 0;
  for (int k0 = k_first; k0 <= i_last; k0 += kRows, buf ^= 1) {
    __pipeline_wait_prior(0);  // this thread's copies of this tile have landed ...
    wg::fence_proxy_async();   // ... and with its plain stores are visible to the tensor cores ...
    __syncthreads();           // ... everyone's; and every MMA of the previous tile has retired
    if constexpr (T::kVBufs == 1) {  // this tile's V into the one V buffer (the previous P V is done)
      stage_swizzled<HD>(smem + T::kV, v, b, S, KV, kvh, k0, vec, async, swz);
      __pipeline_commit();
    }
    if (k0 + kRows <= i_last) {  // the next tile into the other buffers (last read by the previous tile)
      stage_swizzled<HD>(smem + T::kK + (buf ^ 1) * T::kTile, k, b, S, KV, kvh, k0 + kRows, vec, async, swz);
      if constexpr (T::kVBufs == 2)
        stage_swizzled<HD>(smem + T::kV + (buf ^ 1) * T::kTile, v, b, S, KV, kvh, k0 + kRows, vec, async, swz);
    }
    __pipeline_commit();  // (empty after the last tile)
    const uint32_t ks = s0 + T::kK + buf * T::kTile, vs = s0 + T::kV + (T::kVBufs == 2 ? buf : 0) * T::kTile;

    // S = Q K^T (unscaled, fp32).
    float sacc[kRows / 8][4];
#pragma unroll
    for (int n = 0; n < kRows / 8; ++n) sacc[n][0] = sacc[n][1] = sacc[n][2] = sacc[n][3] = 0.f;
    wg::wgmma_fence();
    wg::fence_acc(sacc);
#pragma unroll
    for (int kk = 0; kk < kQk; ++kk) wg::ss<kRows, false>(sacc, kmajor_desc(s0 + T::kQ, kk), kmajor_desc(ks, kk));
    wg::wgmma_commit();
    wg::wgmma_wait<0>();
    wg::fence_acc(sacc);

    // Does every one of the warp's 16 rows (all < S) see every key of the tile (all < S)?
    const bool full = w_first + 15 < S && k0 + kRows - 1 <= w_first && (W <= 0 || w_first + 15 - k0 < W);
    float corr[2];
    attn::online_softmax(sacc, m, l, corr, ia, ib, k0, t, S, W, scale, full);
    attn::rescale_rows(oacc, corr);

    // O += P V: key slice kk's A fragment is S tiles 2kk, 2kk + 1 of P, rounded to bf16.
    uint32_t pa[kPv][4];
#pragma unroll
    for (int kk = 0; kk < kPv; ++kk) pack_a(pa[kk], sacc[2 * kk], sacc[2 * kk + 1]);
    if constexpr (T::kVBufs == 1) {
      __pipeline_wait_prior(1);  // this thread's V copies have landed (the next K's may be in flight) ...
      wg::fence_proxy_async();
      __syncthreads();  // ... and everyone's: the V tile is published
    }
    wg::wgmma_fence();
    wg::fence_acc(oacc);
#pragma unroll
    for (int kk = 0; kk < kPv; ++kk) wg::rs<HD, true>(oacc, pa[kk], mnmajor_desc(vs, kk));
    wg::wgmma_commit();
    wg::wgmma_wait<0>();
    wg::fence_acc(oacc);
  }
  __pipeline_wait_prior(0);  // (only an empty group is left)

  attn::store_rows<HD>(o, lse, oacc, l, m, b, S, H, h, ia, ib, t, ovec);
}

__global__ void __launch_bounds__(kThreads, 1)
    wg_rs_selftest_kernel(float* d, const uint16_t* a, const uint16_t* b, bool b_kmajor, bool swap_a12) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = wg::pattern_aligned(smem_raw);  // the tiles' swizzle needs a 1024-aligned base
  const uint32_t s0 = wg::smem_addr(smem);
  for (int i = threadIdx.x; i < 16 * 64; i += kThreads) {  // B (k, n) into the tile
    const int kk = i / 64, n = i % 64;
    const uint32_t off = b_kmajor ? attn::tile_offset(n, kk, true) : attn::tile_offset(kk, n, true);
    *reinterpret_cast<uint16_t*>(smem + off) = b[i];
  }
  wg::fence_proxy_async();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = 16 * warp + g;
  auto pair = [&](int r, int c) { return uint32_t(a[r * 16 + c]) | (uint32_t(a[r * 16 + c + 1]) << 16); };
  uint32_t fa[4] = {pair(r0, 2 * t), pair(r0 + 8, 2 * t), pair(r0, 2 * t + 8), pair(r0 + 8, 2 * t + 8)};
  if (swap_a12) {
    const uint32_t x = fa[1];
    fa[1] = fa[2];
    fa[2] = x;
  }
  float acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  wg::wgmma_fence();
  wg::fence_acc(acc);
  if (b_kmajor) wg::rs<64, false>(acc, fa, kmajor_desc(s0, 0));
  else wg::rs<64, true>(acc, fa, mnmajor_desc(s0, 0));
  wg::wgmma_commit();
  wg::wgmma_wait<0>();
  wg::fence_acc(acc);
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) d[(r0 + 8 * (e / 2)) * 64 + 8 * j + 2 * t + (e & 1)] = acc[j][e];
}

bool g_plant_layout_bug = false;

template <int HD, class E, class EO>
cudaError_t launch(EO* o, float* lse, const E* q, const E* k, const E* v, const AttnShape& s, cudaStream_t st) {
  using T = WgFwdTiles<HD>;
  const bool vec = attn::vec_ok(q) && attn::vec_ok(k) && attn::vec_ok(v);
  const bool async = attn::async_ok(q) && attn::async_ok(k) && attn::async_ok(v);
  if (const cudaError_t e = allow_smem(wg_fwd_kernel<HD, E, EO>, T::kBytes); e != cudaSuccess) return e;
  const dim3 grid(unsigned((s.S + kRows - 1) / kRows), unsigned(s.H), unsigned(s.B));
  wg_fwd_kernel<HD, E, EO><<<grid, kThreads, T::kBytes, st>>>(o, lse, q, k, v, s, vec, async, attn::vec2_ok(o),
                                                               !g_plant_layout_bug);
  return cudaGetLastError();
}

}  // namespace

bool attention_wgmma_available() {
  static const bool ok = device_runs(wg_fwd_kernel<64, bf16, bf16>);
  return ok;
}

cudaError_t wgmma_rs_selftest(float* d, const uint16_t* a, const uint16_t* b, bool b_kmajor, bool swap_a12,
                              cudaStream_t st) {
  if (!attention_wgmma_available()) return cudaErrorNotSupported;
  wg_rs_selftest_kernel<<<1, kThreads, attn::WgTile<64>::kBytes + wg::kPattern, st>>>(d, a, b, b_kmajor, swap_a12);
  return cudaGetLastError();
}

void attention_wgmma_plant_layout_bug(bool on) { g_plant_layout_bug = on; }
bool attention_wgmma_layout_bug_planted() { return g_plant_layout_bug; }

template <class E, class EO>
cudaError_t attention_wgmma_forward(EO* o, float* lse, const E* q, const E* k, const E* v, const cpu::AttnShape& s,
                                    cudaStream_t st) {
  if (!attention_wgmma_available()) return cudaErrorNotSupported;
  if (s.B <= 0 || s.S <= 0 || s.H <= 0) return cudaSuccess;
  if (!attn::shape_ok(s)) return cudaErrorInvalidValue;
  return s.hd == 64 ? launch<64>(o, lse, q, k, v, s, st) : launch<128>(o, lse, q, k, v, s, st);
}
template cudaError_t attention_wgmma_forward<float, float>(float*, float*, const float*, const float*, const float*,
                                                           const cpu::AttnShape&, cudaStream_t);
template cudaError_t attention_wgmma_forward<__nv_bfloat16, __nv_bfloat16>(__nv_bfloat16*, float*,
                                                                           const __nv_bfloat16*, const __nv_bfloat16*,
                                                                           const __nv_bfloat16*, const cpu::AttnShape&,
                                                                           cudaStream_t);
template cudaError_t attention_wgmma_forward<__nv_bfloat16, float>(float*, float*, const __nv_bfloat16*,
                                                                   const __nv_bfloat16*, const __nv_bfloat16*,
                                                                   const cpu::AttnShape&, cudaStream_t);

}  // namespace ladder::cuda::k
