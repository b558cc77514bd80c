// The per-warp online softmax and the epilogues of the register-resident attention kernels
// (attention_mma_*.cu on mma.sync, attention_wgmma_*.cu on wgmma): both hold 16-row score tiles and
// the O (or gradient) rows in the m16n8 accumulator layout (mma_ptx.cuh; wgmma_attn_ptx.cuh: the
// m64nN accumulators of warp w are the same tiles for rows 16w..16w+15), so the masking, the
// statistics and the epilogues are one piece of code and the kernels round at the same points.
// Lane (g, t) holds, of n8 tile n, rows ia, ib (C rows g, g + 8) and columns k0 + 8n + 2t, + 1. The
// masking rule and the -inf conventions are attention_mma_fwd.cu's header's.
#pragma once
#include <cuda_bf16.h>

#include <cmath>
#include <cstddef>

#include "backend/cuda/attention_common.cuh"

namespace ladder::cuda::k::attn {

// Scale and mask S (fp32, unscaled) in place into P = exp(scale S - m) (0 where masked, and on rows
// with nothing visible yet), with the rows' running max m, the lane's share of the denominator l
// (summed before P is rounded) and corr, the factor the O rows are rescaled by. `full`: every one of
// the warp's rows (all < S) sees every key of the tile (all < S), so no per-element mask.
template <int NS>
__device__ __forceinline__ void online_softmax(float (&s)[NS][4], float (&m)[2], float (&l)[2], float (&corr)[2],
                                               int ia, int ib, int k0, int t, int S, int W, float scale,
                                               bool full) {
  // The rows' maxima over the tile (the lane's 2 NS values per row, then the quad).
  float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < NS; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = e < 2 ? ia : ib, j = k0 + 8 * n + 2 * t + (e & 1);
      const float x = (full || (i < S && j < S && visible(i, j, W))) ? scale * s[n][e] : -INFINITY;
      s[n][e] = x;
      mt[e / 2] = fmaxf(mt[e / 2], x);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 1));
    mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 2));
    const float mnew = fmaxf(m[r], mt[r]);
    // corr = 1: nothing visible to this row yet (P row = 0, state unchanged). corr = 0 while m is
    // -inf: the O row and l are still zeros.
    corr[r] = mnew == -INFINITY ? 1.f : m[r] == -INFINITY ? 0.f : expf(m[r] - mnew);
    m[r] = mnew;
  }
  float psum[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < NS; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float mr = m[e / 2];
      const float p = mr == -INFINITY ? 0.f : expf(s[n][e] - mr);  // masked: exp(-inf) = 0
      s[n][e] = p;
      psum[e / 2] += p;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) l[r] = l[r] * corr[r] + psum[r];
}

// O's rows (ia: elements 0, 1; ib: 2, 3 of each n8 tile) times their corr.
template <int NO>
__device__ __forceinline__ void rescale_rows(float (&o)[NO][4], const float (&corr)[2]) {
#pragma unroll
  for (int n = 0; n < NO; ++n) {
    o[n][0] *= corr[0];
    o[n][1] *= corr[0];
    o[n][2] *= corr[1];
    o[n][3] *= corr[1];
  }
}

// Epilogue: l over the quad (the same bits in its four lanes), o = O / l (rounded to EO), lse =
// m + log(l), for the lane's rows ia, ib of head h (rows past S are never stored).
template <int HD, class EO>
__device__ __forceinline__ void store_rows(EO* o, float* lse, const float (&oacc)[HD / 8][4], float (&l)[2],
                                           const float (&m)[2], int b, int S, int H, int h, int ia, int ib, int t,
                                           bool ovec) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  const float inv_a = 1.f / l[0], inv_b = 1.f / l[1];  // rows past S: l = 0, inf, never stored
  // Rows past S are never stored; their pointers are formed from row 0 so as not to point past o.
  EO* oa = o + ((size_t(b) * S + (ia < S ? ia : 0)) * H + h) * HD + 2 * t;
  EO* ob = o + ((size_t(b) * S + (ib < S ? ib : 0)) * H + h) * HD + 2 * t;
  if (t == 0 && ia < S) lse[(size_t(b) * H + h) * S + ia] = m[0] + logf(l[0]);
  if (t == 0 && ib < S) lse[(size_t(b) * H + h) * S + ib] = m[1] + logf(l[1]);
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
    if (ia < S) store2(oa + 8 * n, oacc[n][0] * inv_a, oacc[n][1] * inv_a, ovec);
    if (ib < S) store2(ob + 8 * n, oacc[n][2] * inv_b, oacc[n][3] * inv_b, ovec);
  }
}

// The backward kernels' epilogue (mma.sync and wgmma): the warp's 16 x HD gradient accumulator (the
// lane's rows ra, rb: its g and g + 8) times `mul` to rows ra, rb of head `head` of a [B*S, nh*HD]
// fp32 tensor (rows at or past S skipped). vec: the base is 8-byte aligned (float2 stores).
template <int HD>
__device__ __forceinline__ void store_grad_rows(float* dst, const float (&acc)[HD / 8][4], float mul, int b, int S,
                                                int nh, int head, int ra, int rb, int t, bool vec) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = half ? rb : ra;
    if (row >= S) continue;
    float* p = dst + ((size_t(b) * S + row) * nh + head) * HD + 2 * t;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      store2(p + n * 8, acc[n][2 * half] * mul, acc[n][2 * half + 1] * mul, vec);
    }
  }
}

}  // namespace ladder::cuda::k::attn
