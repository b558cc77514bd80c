// CUDA kernels of the MoE dispatch and the device-side grouped GEMM (launchers in moe_ops.cuh).
// Contracts: backend/cpu/moe_kernels.h and cpu::grouped_gemm (backend/cpu/kernels.h).
//
// Rules followed throughout:
//  - no host synchronization: the expert offsets never leave the device; the grouped GEMM maps its
//    blocks to (expert, tile) on the device from the offsets;
//  - no floating-point atomics: every output element is written by exactly one thread, and every
//    sum runs in an order fixed by the problem size, so results are reproducible run to run (integer
//    shared-memory atomics in the radix select only count, and counts are exact in any order);
//  - integer outputs (experts, rows, slots, offsets, selections) equal the CPU's bit for bit;
//  - element offsets computed in size_t (N*K*d and T*E can exceed 2^31).
#include <cub/device/device_radix_sort.cuh>

#include <cuda_bf16.h>

#include <climits>
#include <cmath>

#include "backend/cuda/moe_ops.cuh"
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/kernels.cuh"

namespace ladder::cuda::k {

namespace {

constexpr int kThreads = 256;
static_assert(kThreads == 256, "grid_for (device_common.cuh) sizes grids for 256-thread blocks by default");
constexpr int kWarps = kThreads / 32;

inline size_t align256(size_t b) { return (b + 255) / 256 * 256; }

// The CPU's sigmoid, T(1) / (T(1) + exp(-x)), with IEEE division and expf (not the fast intrinsics).
__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }

// ---------------------------------------------------------------------------------------------
// Top-K selection, one warp per token.
//
// The CPU inserts experts in increasing index into a sorted list and displaces only on a strictly
// greater score, so its selection is the first K experts of the total order "score descending,
// then index ascending". A warp reproduces it exactly without any per-token scratch: round k picks
// the best expert among those that come strictly after round k-1's pick (pv, pe) in that order.
// Each lane scans its experts (lane, lane+32, ...) in increasing index, then a butterfly reduction
// with the same order leaves the winner in every lane. Scores are s + bias rounded to float, as on
// the CPU.

struct Pick {
  float v;
  int e;  // INT_MAX: no candidate
};

__device__ __forceinline__ bool before(float v, int e, float pv, int pe) {  // (v, e) precedes (pv, pe)
  return v > pv || (v == pv && e < pe);
}

__device__ __forceinline__ Pick pick_next(const float* s, const float* bias, int E, int lane, Pick prev) {
  Pick best{-INFINITY, INT_MAX};
  for (int e = lane; e < E; e += 32) {
    const float v = s[e] + bias[e];
    if (!before(prev.v, prev.e, v, e)) continue;  // not after the previous pick: already taken
    if (best.e == INT_MAX || v > best.v) best = Pick{v, e};  // increasing e: ties keep the lower index
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best.v, o);
    const int oe = __shfl_xor_sync(0xffffffffu, best.e, o);
    if (oe != INT_MAX && (best.e == INT_MAX || before(ov, oe, best.v, best.e))) best = Pick{ov, oe};
  }
  return best;
}

// The sentinel "before everything": every expert comes after it.
__device__ __forceinline__ Pick pick_start() { return Pick{INFINITY, -1}; }

__global__ void route_kernel(float* lse, int32_t* expert, float* comb, const float* logits, const float* bias,
                             int N, int E, int K, bool normalized, float route_scale) {
  const int lane = threadIdx.x & 31;
  for (int64_t i = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); i < N; i += int64_t(gridDim.x) * kWarps) {
    const float* s = logits + size_t(i) * E;
    // logsumexp: float max, double sum of exp(float(s - max)), as the CPU.
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, s[e]);
    mx = warp_max(mx);
    double se = 0;
    for (int e = lane; e < E; e += 32) se += exp(double(s[e] - mx));
    se = warp_sum(se);
    if (lane == 0) lse[i] = float(double(mx) + log(se));

    int32_t* sel = expert + size_t(i) * K;
    Pick p = pick_start();
    for (int k = 0; k < K; ++k) {
      p = pick_next(s, bias, E, lane, p);
      if (lane == 0) sel[k] = p.e;
    }
    // Combine weights: lane 0 reads back its own writes (K is small), summing in k order as the CPU.
    if (lane == 0) {
      float* w = comb + size_t(i) * K;
      float sum = 0.f;
      for (int k = 0; k < K; ++k) {
        const float sg = sigmoidf_(s[sel[k]]);
        w[k] = sg;
        sum += sg;
      }
      if (normalized) {
        const float f = route_scale / (sum + 1e-9f);
        for (int k = 0; k < K; ++k) w[k] *= f;
      }
    }
  }
}

// vals[i, e] = s_ie - alpha_i, alpha_i the (K+1)-th largest biased score (its value only).
__global__ void balance_values_kernel(float* vals, const float* logits, const float* bias, int N, int E, int K) {
  const int lane = threadIdx.x & 31;
  for (int64_t i = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); i < N; i += int64_t(gridDim.x) * kWarps) {
    const float* s = logits + size_t(i) * E;
    Pick p = pick_start();
    for (int k = 0; k <= K; ++k) p = pick_next(s, bias, E, lane, p);
    const float alpha = p.v;
    float* v = vals + size_t(i) * E;
    for (int e = lane; e < E; e += 32) v[e] = s[e] - alpha;
  }
}

// ds = z-loss gradient (or 0) plus, on the K selected experts, the gradient through the combine
// weights. Each lane owns experts e = lane mod 32 and is the only thread touching ds[e]: the base
// value and the selected-expert update are made by the same thread, no cross-lane ordering needed.
__global__ void router_backward_kernel(float* ds_out, const float* logits, const float* lse, const int32_t* expert,
                                       const float* dcomb, int N, int E, int K, bool normalized, float f,
                                       float z_scale) {
  const int lane = threadIdx.x & 31;
  for (int64_t i = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); i < N; i += int64_t(gridDim.x) * kWarps) {
    const float* s = logits + size_t(i) * E;
    float* ds = ds_out + size_t(i) * E;
    if (z_scale != 0.f) {
      const float l = lse[i], c = z_scale * 2.f * l;
      for (int e = lane; e < E; e += 32) ds[e] = c * expf(s[e] - l);
    } else {
      for (int e = lane; e < E; e += 32) ds[e] = 0.f;
    }
    const int32_t* sel = expert + size_t(i) * K;
    const float* dw = dcomb + size_t(i) * K;
    float sum = 0.f, dot = 0.f;  // every lane computes them (K reads, broadcast), in k order
    if (normalized) {
      for (int k = 0; k < K; ++k) {
        const float sg = sigmoidf_(s[sel[k]]);
        sum += sg;
        dot += dw[k] * sg;
      }
    }
    const float den = sum + 1e-9f;
    for (int k = 0; k < K; ++k) {
      const int e = sel[k];
      if ((e & 31) != lane) continue;
      const float sg = sigmoidf_(s[e]);
      const float dsig = normalized ? f * dw[k] / den - f * dot / (den * den) : dw[k];
      ds[e] += dsig * sg * (1.f - sg);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Gather / combine and their backward: memory-bound row copies, one block (or warp) per row.
//
// V: consecutive columns per thread and access (load_vec / store_vec, device_common.cuh): 4 = one
// 16-byte fp32 access (8 bytes for bf16 rows), when d is a multiple of 4 and every pointer is 16-byte
// aligned (the launchers check); 1 = the scalar reference path. Each column keeps its own arithmetic
// and order (k order in the sums), so the result does not depend on V.

// Negative slots (cslot of the capacity layout): -1, a padding row, writes a zero row; below -1, an
// unused row past the rows in use, is not written at all (nothing reads it: the SwiGLU and the
// GEMMs stop at the rows in use), which saves its stores. Both branches are on the block's row, so
// they never split a warp, and a valid slot's row is copied by the same loads and stores as before.
template <int V, class TO>
__global__ void gather_kernel(TO* xs, const float* h, const int32_t* slot, int NK, int K, int d) {
  for (int r = blockIdx.x; r < NK; r += gridDim.x) {
    const int s = slot[r];
    if (s < -1) continue;
    TO* dst = xs + size_t(r) * d;
    if (s < 0) {
      const float z[V] = {};
      for (int c = threadIdx.x * V; c < d; c += blockDim.x * V) store_vec<V>(dst + c, z);
      continue;
    }
    const float* src = h + size_t(s / K) * d;
    for (int c = threadIdx.x * V; c < d; c += blockDim.x * V) {
      float v[V];
      load_vec<V>(src + c, v);
      store_vec<V>(dst + c, v);  // bf16 rows: rounded to nearest even
    }
  }
}

// out[i] += sum_k comb[iK+k] y[row[iK+k]], added in k order (the CPU's order). Y: fp32, or bf16
// widened (exact). The k loop stores nothing, so its K row loads can be in flight together.
template <class Y, int V>
__global__ void combine_kernel(float* out, const Y* y, const float* comb, const int32_t* row, int N, int K, int d) {
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    float* o = out + size_t(i) * d;
    const size_t j0 = size_t(i) * K;
    for (int c = threadIdx.x * V; c < d; c += blockDim.x * V) {
      float acc[V], yv[V];
      load_vec<V>(o + c, acc);
      for (int k = 0; k < K; ++k) {
        const float w = comb[j0 + k];
        load_vec<V>(y + size_t(row[j0 + k]) * d + c, yv);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] += w * yv[e];
      }
      store_vec<V>(o + c, acc);
    }
  }
}

// One warp per slot j: dy[row[j]] = comb[j] dout[i] (each row is exactly one slot's: no conflicts),
// dcomb[j] = dout[i] . y[row[j]] (lane partials, then a fixed butterfly). The lanes keep the columns
// c = lane + 32 m (the partials' order); U: columns per lane loaded before any is used or stored (the
// stores to dy would otherwise keep the next column's loads from starting before them: one pair of
// loads in flight per lane). U = 1: the reference path. DY: dy's storage, fp32, or bf16
// (model.moe_bf16_grads: the same product rounded to nearest even as it is stored).
template <class Y, int U, class DY = float>
__global__ void combine_backward_kernel(DY* dy, float* dcomb, const float* dout, const Y* y, const float* comb,
                                        const int32_t* row, int64_t NK, int K, int d) {
  const int lane = threadIdx.x & 31;
  for (int64_t j = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); j < NK; j += int64_t(gridDim.x) * kWarps) {
    const float* go = dout + size_t(j / K) * d;
    const size_t r = size_t(row[j]);
    const Y* yr = y + r * d;
    DY* dyr = dy + r * d;
    const float w = comb[j];
    float dot = 0.f;
    int c = lane;
    for (; c + 32 * (U - 1) < d; c += 32 * U) {
      float g[U], yv[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        g[u] = go[c + 32 * u];
        yv[u] = widen(yr[c + 32 * u]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        dot += g[u] * yv[u];
        store_rn(dyr[c + 32 * u], w * g[u]);
      }
    }
    for (; c < d; c += 32) {
      const float g = go[c];
      dot += g * widen(yr[c]);
      store_rn(dyr[c], w * g);
    }
    dot = warp_sum(dot);
    if (lane == 0) dcomb[j] = dot;
  }
}

// dh[i] = sum_k dx[row[iK+k]] in k order (overwritten).
template <int V>
__global__ void gather_backward_kernel(float* dh, const float* dx, const int32_t* row, int N, int K, int d) {
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    float* o = dh + size_t(i) * d;
    const size_t j0 = size_t(i) * K;
    for (int c = threadIdx.x * V; c < d; c += blockDim.x * V) {
      float acc[V], xv[V];
      load_vec<V>(dx + size_t(row[j0]) * d + c, acc);
      for (int k = 1; k < K; ++k) {
        load_vec<V>(dx + size_t(row[j0 + k]) * d + c, xv);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] += xv[e];
      }
      store_vec<V>(o + c, acc);
    }
  }
}

// The capacity layout's padding rows of a gradient: zero row q where cslot[q] < 0, one block per
// row (the rows with a slot are left alone, one load each). V as the gather's.
template <int V, class T>
__global__ void zero_rows_kernel(T* x, const int32_t* cslot, int rows, int cols) {
  for (int q = blockIdx.x; q < rows; q += gridDim.x) {
    if (cslot[q] >= 0) continue;
    T* dst = x + size_t(q) * cols;
    const float z[V] = {};
    for (int c = threadIdx.x * V; c < cols; c += blockDim.x * V) store_vec<V>(dst + c, z);
  }
}

constexpr int kCombineBwdUnroll = 8;

// The row kernels' vector width for rows of d columns: 4 when d allows it and every pointer is
// 16-byte aligned (then every row start and every 4-column group is), else 1.
template <class... P>
bool rows_vectorizable(int d, const P*... p) {
  return !reference_paths() && d % 4 == 0 && (aligned16(p) && ...);
}

// ---------------------------------------------------------------------------------------------
// Counting sort by expert.
//
// CUB's radix sort is stable, so sorting (expert, slot index) pairs leaves each expert's slots in
// increasing slot order: the sorted values are exactly the CPU's slot[] (row -> slot). Then
// row[slot[r]] = r, and offsets[e] = the first sorted position whose expert is >= e (a binary
// search per e; empty experts get equal offsets). Only the bits E needs are sorted.

__global__ void iota_kernel(int32_t* v, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) v[i] = i;
}

__global__ void invert_perm_kernel(int32_t* row, const int32_t* slot, int n) {
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < n; r += gridDim.x * blockDim.x) row[slot[r]] = r;
}

__global__ void offsets_from_sorted_kernel(int32_t* offsets, const uint32_t* sorted, int n, int E) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e <= E; e += gridDim.x * blockDim.x) {
    int lo = 0, hi = n;  // lower bound of e in sorted[0, n)
    while (lo < hi) {
      const int mid = lo + (hi - lo) / 2;
      if (sorted[mid] < uint32_t(e)) lo = mid + 1; else hi = mid;
    }
    offsets[e] = lo;
  }
}

// ---------------------------------------------------------------------------------------------
// Capacity layout (cpu::moe_capacity, bit for bit: integers only, each output written once).
//
// ov [E+2]: the exclusive prefix of the overflows max(0, load_e - C), one warp in chunks of 32
// experts (a shuffle scan per chunk, the chunk totals carried in every lane), and last the rows in
// use, ov[E+1] = E*C + ov[E] (what swiglu_*_rows read). E is a layer's experts (a few hundred at
// most): one warp is plenty, and it keeps the routing on the device.
__global__ void capacity_overflow_kernel(int32_t* ov, const int32_t* offsets, int E, int C) {
  const int lane = threadIdx.x;
  if (lane == 0) ov[0] = 0;
  int carry = 0;
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    int v = e < E ? max(0, offsets[e + 1] - offsets[e] - C) : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += t;
    }
    if (e < E) ov[e + 1] = carry + v;
    carry += __shfl_sync(0xffffffffu, v, 31);
  }
  if (lane == 0) ov[E + 1] = E * C + carry;  // carry: ov[E] in every lane; E*C <= R fits an int
}

// cslot before the rows kernel fills in the slots: -1 (padding) for q < E*C, -2 (unused) from E*C.
// Every overflow row, [E*C, E*C + ov[E]), has a slot (they are packed), so the rows kernel
// overwrites exactly those and the -2 left are the rows from E*C + ov[E] on: the CPU's cslot
// without reading ov here (it is not known on the host).
__global__ void capacity_fill_kernel(int32_t* cslot, int R, int EC) {
  for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < R; q += gridDim.x * blockDim.x)
    cslot[q] = q < EC ? -1 : -2;
}

// One thread per sorted position p: its expert e (the last with offsets[e] <= p, by binary search:
// empty experts share their offset with the next one), its rank r = p - offsets[e] in the expert,
// and its row q in the layout: e*C + r within capacity, else E*C + ov[e] + (r - C). row[slot[p]] = q
// and cslot[q] = slot[p]; every cslot entry not written keeps capacity_fill_kernel's -1 or -2.
// Slots are a permutation, so no two threads write one element. q < R holds whenever R is
// cpu::moe_capacity_rows' bound; the cslot store is guarded anyway, so a wrong R cannot write past
// the array (the CPU asserts it).
__global__ void capacity_rows_kernel(int32_t* row, int32_t* cslot, const int32_t* ov, const int32_t* offsets,
                                     const int32_t* slot, int NK, int E, int C, int R) {
  for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < NK; p += gridDim.x * blockDim.x) {
    const int e = expert_of_row_tile(offsets, E, p);
    const int r = p - offsets[e];
    const int64_t q = r < C ? int64_t(e) * C + r : int64_t(E) * C + ov[e] + (r - C);
    const int s = slot[p];
    row[s] = int32_t(q);
    if (q < R) cslot[q] = s;
  }
}

int sort_end_bit(int E) {  // bits needed for expert ids in [0, E)
  int b = 1;
  while (b < 31 && (1u << b) < unsigned(E)) ++b;
  return b;
}

size_t cub_sort_bytes(int n, int end_bit) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                  static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), n, 0, end_bit);
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// Quantile balancing: the exact q-th largest of each column of vals [T, E].
//
// The column is transposed into an order-preserving uint32 key (so a column is contiguous), then
// one block per column runs a 4-pass radix select over 8-bit digits, most significant first: each
// pass histograms the digit of the keys that match the prefix chosen so far and picks the bin that
// holds the q-th largest. Counts are integers, so the result is exact and the same in any order.
// (Small E leaves SMs idle: a multi-block select per column would fill them; not needed yet.)

__device__ __forceinline__ uint32_t float_key(float f) {
  uint32_t u = __float_as_uint(f);
  if (u == 0x80000000u) u = 0;  // -0 and +0 compare equal: one key for both
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// keys[(j - j0) * T + i] = float_key(vals[i * E + j]) for the nc columns j0 <= j < j0 + nc;
// 32x32 tiles through shared memory.
__global__ void transpose_keys_kernel(uint32_t* keys, const float* vals, int64_t T, int E, int j0_cols, int nc) {
  __shared__ uint32_t tile[32][33];
  const int64_t tiles_t = (T + 31) / 32;
  const int tiles_e = (nc + 31) / 32;
  for (int64_t b = blockIdx.x; b < tiles_t * tiles_e; b += gridDim.x) {
    const int64_t i0 = (b / tiles_e) * 32;
    const int c0 = int(b % tiles_e) * 32;  // chunk-local column
    for (int r = threadIdx.y; r < 32; r += blockDim.y) {  // read rows i0+r, columns c0+tx
      const int64_t i = i0 + r;
      const int c = c0 + threadIdx.x;
      if (i < T && c < nc) tile[r][threadIdx.x] = float_key(vals[size_t(i) * E + j0_cols + c]);
    }
    __syncthreads();
    for (int r = threadIdx.y; r < 32; r += blockDim.y) {  // write column c0+r, rows i0+tx
      const int c = c0 + r;
      const int64_t i = i0 + threadIdx.x;
      if (i < T && c < nc) keys[size_t(c) * T + i] = tile[threadIdx.x][r];
    }
    __syncthreads();
  }
}

constexpr int kSelThreads = 512, kSelWarps = kSelThreads / 32;

__global__ void __launch_bounds__(kSelThreads) radix_select_kernel(double* beta, const uint32_t* keys, int T, int q) {
  __shared__ uint32_t hist[kSelWarps][256];  // one histogram per warp: less contention on hot bins
  __shared__ uint32_t s_prefix;
  __shared__ int s_rank;
  const int tid = threadIdx.x, warp = tid >> 5;
  const uint32_t* col = keys + size_t(blockIdx.x) * T;
  uint32_t prefix = 0, mask = 0;
  int rank = q;  // 1-based rank from the top among the keys matching prefix under mask
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < kSelWarps * 256; b += kSelThreads) (&hist[0][0])[b] = 0;
    __syncthreads();
    for (int i = tid; i < T; i += kSelThreads) {
      const uint32_t key = col[i];
      if ((key & mask) == prefix) atomicAdd(&hist[warp][(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (tid < 256) {
      uint32_t c = 0;
      for (int w = 0; w < kSelWarps; ++w) c += hist[w][tid];
      hist[0][tid] = c;  // only this thread reads or writes column tid here
    }
    __syncthreads();
    if (tid == 0) {
      uint32_t above = 0;  // keys matching the prefix whose digit is greater than b
      int b = 255;
      for (; b > 0; --b) {
        if (above + hist[0][b] >= uint32_t(rank)) break;
        above += hist[0][b];
      }
      s_prefix = prefix | (uint32_t(b) << shift);
      s_rank = rank - int(above);
    }
    __syncthreads();
    prefix = s_prefix;
    rank = s_rank;
    mask |= 255u << shift;
    // The next pass's zeroing is followed by a barrier before thread 0 writes s_prefix again.
  }
  if (tid == 0) beta[blockIdx.x] = double(key_float(prefix));
}

// ---------------------------------------------------------------------------------------------
// Grouped GEMM, fp32 on the CUDA cores.
//
// One block computes one 64x64 output tile with 256 threads, 4x4 outputs per thread, walking the
// reduction in steps of 16 through shared memory (the next step's operands are fetched into
// registers while the current step is multiplied). Both shapes reduce to the same tile product
//      C_tile[x_a, x_b] = alpha * sum_t opA(x_a, t) opB(t, x_b) + beta * C_tile
// and differ only in how the operands are addressed:
//   rows_out = true : opA(m, t) = A[(row0 + m) * lda + t]            (t contiguous)
//                     opB(t, n) = B_e[n * ldb + t] (transB, t contiguous) or B_e[t * ldb + n]
//                     the reduction runs over K; a tile is 64 of the expert's rows x 64 columns.
//   rows_out = false: opA(m, t) = A[(r0 + t) * lda + m]              (m contiguous)
//                     opB(t, n) = B[(r0 + t) * ldb + n]              (n contiguous)
//                     the reduction runs over the expert's rows; a tile is 64x64 of C_e.
// The loaders take either layout; out-of-range elements load as zeros (their products add exact
// zeros), so partial tiles need no special path. Each output element is accumulated by one thread
// in increasing t with fmaf: deterministic, and independent of the grid.
//
// Which block does which tile, with offsets on the device only:
//   rows_out = false: the grid is E x tilesM x tilesN (known on the host); block -> (e, tile).
//     An empty expert's tiles compute C_e = beta C_e (beta 0 writes zeros without reading C).
//   rows_out = true: the number of row tiles, sum_e ceil(rows_e / 64), is only known on the device.
//     A one-block kernel writes the exclusive prefix of per-expert row tiles into scratch; the GEMM
//     then runs a persistent grid (a few blocks per SM) that strides over the linear tile ids
//     [0, tiles * tilesN), each mapped to its expert by a binary search in the prefix. Every tile
//     costs the same (a full K reduction), so the static stride balances.
//
// bf16 tensor-core version (the planned path, docs/cuda.md): the same tile scheduling from offsets
// (prefix + persistent grid) stays; the tile body becomes mma.sync m16n8k16 (sm_80) / wgmma
// (sm_90a) on bf16 operands staged by cp.async / TMA in a multi-stage pipeline, 128x128 (or
// 128x256) tiles with fp32 accumulators, and the weight-gradient shape gets a split over the rows
// with a fixed-order second pass when an expert has few output tiles (small M, N) but many rows.

constexpr int kBM = 64, kBN = 64, kBK = 16, kGemmThreads = 256;
constexpr int kLds = 64 + 4;  // padded row: float4-aligned, fewer bank conflicts on t-contiguous stores

// Which (x, t) of the 16 x 64 operand tile thread `tid` loads in its q-th slot. t-contiguous
// operands walk t fastest (16 consecutive floats of one row per half-warp), x-contiguous ones x.
template <bool TCONTIG>
__device__ __forceinline__ void tile_coords(int idx, int& x, int& t) {
  if (TCONTIG) {
    t = idx & (kBK - 1);
    x = idx / kBK;
  } else {
    x = idx & 63;
    t = idx / 64;
  }
}

// An operand view: element (x, t) of the tile at p[x * ld + t] (TCONTIG) or p[t * ld + x];
// valid for x < xlim and t < tlim.
struct Operand {
  const float* p;
  size_t ld;
  int xlim;
};

template <bool TCONTIG>
__device__ __forceinline__ void load_regs(float (&r)[4], const Operand& op, int t0, int tlim, int tid) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    int x, t;
    tile_coords<TCONTIG>(tid + q * kGemmThreads, x, t);
    const int tt = t0 + t;
    float v = 0.f;
    if (x < op.xlim && tt < tlim) v = TCONTIG ? op.p[size_t(x) * op.ld + tt] : op.p[size_t(tt) * op.ld + x];
    r[q] = v;
  }
}

template <bool TCONTIG>
__device__ __forceinline__ void store_tile(float (*s)[kLds], const float (&r)[4], int tid) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    int x, t;
    tile_coords<TCONTIG>(tid + q * kGemmThreads, x, t);
    s[t][x] = r[q];
  }
}

// One 64x64 output tile. C points at the tile's (0, 0); mlim/nlim bound its valid part. Must be
// called by the whole block with block-uniform arguments (it synchronizes).
template <bool A_T, bool B_T>
__device__ void gemm_tile(float (*As)[kLds], float (*Bs)[kLds], const Operand& a, const Operand& b, int tlim,
                          float alpha, float beta, float* C, size_t ldc, int mlim, int nlim) {
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

  float ra[4], rb[4];
  load_regs<A_T>(ra, a, 0, tlim, tid);
  load_regs<B_T>(rb, b, 0, tlim, tid);
  for (int t0 = 0; t0 < tlim; t0 += kBK) {
    store_tile<A_T>(As, ra, tid);
    store_tile<B_T>(Bs, rb, tid);
    __syncthreads();
    if (t0 + kBK < tlim) {  // next step's loads in flight during the multiply
      load_regs<A_T>(ra, a, t0 + kBK, tlim, tid);
      load_regs<B_T>(rb, b, t0 + kBK, tlim, tid);
    }
#pragma unroll
    for (int t = 0; t < kBK; ++t) {
      const float4 av = *reinterpret_cast<const float4*>(&As[t][ty * 4]);
      const float4 bv = *reinterpret_cast<const float4*>(&Bs[t][tx * 4]);
      const float am[4] = {av.x, av.y, av.z, av.w}, bn[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(am[i], bn[j], acc[i][j]);
    }
    __syncthreads();  // the tile is consumed before the next step (or the next tile) overwrites it
  }

#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = ty * 4 + i;
    if (m >= mlim) continue;
    float* c = C + size_t(m) * ldc;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = tx * 4 + j;
      if (n >= nlim) continue;
      const float v = alpha * acc[i][j];
      c[n] = beta == 0.f ? v : v + beta * c[n];  // beta 0: C is not read (it may hold NaN)
    }
  }
}

// tile_start[e] = sum_{e' < e} ceil(rows_e' / tile_rows), tile_start[E] = the total. One block,
// chunks of kThreads experts: warp scans, then a scan of the warp totals, plus the running carry.
__global__ void row_tile_prefix_kernel(int32_t* tile_start, const int32_t* offsets, int E, int tile_rows) {
  __shared__ int32_t warp_tot[kWarps];
  __shared__ int32_t carry;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < E; base += kThreads) {
    const int e = base + tid;
    int own = 0;
    if (e < E) {
      const int rows = offsets[e + 1] - offsets[e];
      own = rows > 0 ? (rows + tile_rows - 1) / tile_rows : 0;
    }
    int v = own;  // inclusive warp scan
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += n;
    }
    if (lane == 31) warp_tot[warp] = v;
    __syncthreads();
    if (warp == 0) {
      int w = lane < kWarps ? warp_tot[lane] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += n;
      }
      if (lane < kWarps) warp_tot[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int before_warp = warp > 0 ? warp_tot[warp - 1] : 0;
    if (e < E) tile_start[e] = carry + before_warp + v - own;
    __syncthreads();  // every thread has read carry and warp_tot
    if (tid == 0) carry += warp_tot[kWarps - 1];
    __syncthreads();
  }
  if (tid == 0) tile_start[E] = carry;
}

template <bool TRANSB>
__global__ void __launch_bounds__(kGemmThreads)
    grouped_rows_kernel(const int32_t* offsets, const int32_t* tile_start, int E, int N, int K, float alpha,
                        const float* A, int lda, const float* B, int ldb, size_t strideB, float beta, float* C,
                        int ldc) {
  __shared__ __align__(16) float As[kBK][kLds];
  __shared__ __align__(16) float Bs[kBK][kLds];
  const int tilesN = (N + kBN - 1) / kBN;
  const int64_t total = int64_t(tile_start[E]) * tilesN;
  for (int64_t id = blockIdx.x; id < total; id += gridDim.x) {
    const int g = int(id / tilesN), nt = int(id % tilesN);
    const int e = expert_of_row_tile(tile_start, E, g);
    const int row0 = offsets[e] + (g - tile_start[e]) * kBM;
    const int rows = offsets[e + 1] - row0;
    const int n0 = nt * kBN;
    const float* Be = B + size_t(e) * strideB;
    const Operand a{A + size_t(row0) * lda, size_t(lda), rows};
    const Operand b = TRANSB ? Operand{Be + size_t(n0) * ldb, size_t(ldb), N - n0}
                             : Operand{Be + n0, size_t(ldb), N - n0};
    gemm_tile<true, TRANSB>(As, Bs, a, b, K, alpha, beta, C + size_t(row0) * ldc + n0, size_t(ldc), rows, N - n0);
  }
}

__global__ void __launch_bounds__(kGemmThreads)
    grouped_wgrad_kernel(const int32_t* offsets, int M, int N, float alpha, const float* A, int lda, const float* B,
                         int ldb, float beta, float* C, int ldc, size_t strideC) {
  __shared__ __align__(16) float As[kBK][kLds];
  __shared__ __align__(16) float Bs[kBK][kLds];
  const int tilesM = (M + kBM - 1) / kBM, tilesN = (N + kBN - 1) / kBN;
  const int64_t per_e = int64_t(tilesM) * tilesN;
  const int e = int(blockIdx.x / per_e);
  const int64_t rem = blockIdx.x % per_e;
  const int m0 = int(rem / tilesN) * kBM, n0 = int(rem % tilesN) * kBN;
  const int r0 = offsets[e];
  const int rows = max(0, offsets[e + 1] - r0);
  if (rows == 0 && beta == 1.f) return;  // C_e = 1 * C_e: nothing to write (block-uniform exit)
  const Operand a{A + size_t(r0) * lda + m0, size_t(lda), M - m0};
  const Operand b{B + size_t(r0) * ldb + n0, size_t(ldb), N - n0};
  gemm_tile<false, false>(As, Bs, a, b, rows, alpha, beta, C + size_t(e) * strideC + size_t(m0) * ldc + n0,
                          size_t(ldc), M - m0, N - n0);
}

// Persistent grid for the rows_out kernel: enough resident blocks to fill the device once.
template <bool TRANSB>
int rows_kernel_grid() {
  static const int blocks = [] {
    int dev = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, grouped_rows_kernel<TRANSB>, kGemmThreads, 0) !=
            cudaSuccess) {
      (void)cudaGetLastError();
      return 1024;  // any grid is correct (the kernel strides); this one is just a guess
    }
    return (sms > 0 ? sms : 132) * (per_sm > 0 ? per_sm : 4);
  }();
  return blocks;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

size_t grouped_gemm_scratch_ints(int E) { return size_t(E > 0 ? E : 0) + 1; }

cudaError_t row_tile_prefix(int32_t* tile_start, const int32_t* offsets, int E, int tile_rows, cudaStream_t st) {
  if (E <= 0 || tile_rows <= 0) return cudaErrorInvalidValue;
  row_tile_prefix_kernel<<<1, kThreads, 0, st>>>(tile_start, offsets, E, tile_rows);
  return cudaGetLastError();
}

cudaError_t grouped_gemm(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K, float alpha,
                         const float* A, int lda, const float* B, int ldb, size_t strideB, float beta, float* C,
                         int ldc, size_t strideC, int32_t* tile_scratch, cudaStream_t st) {
  if (E <= 0 || N <= 0) return cudaSuccess;
  if (rows_out) {
    if (K < 0) return cudaErrorInvalidValue;
    if (const cudaError_t e = row_tile_prefix(tile_scratch, offsets, E, kBM, st); e != cudaSuccess) return e;
    if (transB) {
      grouped_rows_kernel<true><<<rows_kernel_grid<true>(), kGemmThreads, 0, st>>>(
          offsets, tile_scratch, E, N, K, alpha, A, lda, B, ldb, strideB, beta, C, ldc);
    } else {
      grouped_rows_kernel<false><<<rows_kernel_grid<false>(), kGemmThreads, 0, st>>>(
          offsets, tile_scratch, E, N, K, alpha, A, lda, B, ldb, strideB, beta, C, ldc);
    }
  } else {
    if (M <= 0) return cudaSuccess;
    const int64_t blocks = int64_t(E) * ((M + kBM - 1) / kBM) * ((N + kBN - 1) / kBN);
    if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
    grouped_wgrad_kernel<<<unsigned(blocks), kGemmThreads, 0, st>>>(offsets, M, N, alpha, A, lda, B, ldb, beta, C,
                                                                    ldc, strideC);
  }
  return cudaGetLastError();
}

cudaError_t moe_route(float* lse, int32_t* expert, float* comb, const float* logits, const float* bias, int N, int E,
                      int K, bool normalized, double route_scale, cudaStream_t st) {
  if (N <= 0) return cudaSuccess;
  if (K < 1 || K > E) return cudaErrorInvalidValue;
  route_kernel<<<grid_for(size_t(N), kWarps), kThreads, 0, st>>>(lse, expert, comb, logits, bias, N, E, K,
                                                                 normalized, float(route_scale));
  return cudaGetLastError();
}

size_t moe_sort_scratch_bytes(int NK, int E) {
  if (NK <= 0) return 0;
  return 2 * align256(sizeof(int32_t) * size_t(NK)) + cub_sort_bytes(NK, sort_end_bit(E));
}

cudaError_t moe_sort(int32_t* offsets, int32_t* row, int32_t* slot, const int32_t* expert, int NK, int E,
                     void* scratch, size_t scratch_bytes, cudaStream_t st) {
  if (E < 0) return cudaErrorInvalidValue;
  if (NK <= 0) {  // every expert empty
    return cudaMemsetAsync(offsets, 0, sizeof(int32_t) * (size_t(E) + 1), st);
  }
  if (E == 0) return cudaErrorInvalidValue;  // slots but no expert to hold them
  if (scratch_bytes < moe_sort_scratch_bytes(NK, E)) return cudaErrorInvalidValue;
  char* p = static_cast<char*>(scratch);
  uint32_t* keys_sorted = reinterpret_cast<uint32_t*>(p);
  p += align256(sizeof(int32_t) * size_t(NK));
  int32_t* iota = reinterpret_cast<int32_t*>(p);
  p += align256(sizeof(int32_t) * size_t(NK));
  const int end_bit = sort_end_bit(E);
  size_t cub_bytes = cub_sort_bytes(NK, end_bit);
  iota_kernel<<<grid_for(size_t(NK)), kThreads, 0, st>>>(iota, NK);
  // Expert ids are in [0, E): their int32 bits sort as uint32; the sorted values are slot[].
  cudaError_t err = cub::DeviceRadixSort::SortPairs(p, cub_bytes, reinterpret_cast<const uint32_t*>(expert),
                                                    keys_sorted, iota, slot, NK, 0, end_bit, st);
  if (err != cudaSuccess) return err;
  invert_perm_kernel<<<grid_for(size_t(NK)), kThreads, 0, st>>>(row, slot, NK);
  offsets_from_sorted_kernel<<<grid_for(size_t(E) + 1), kThreads, 0, st>>>(offsets, keys_sorted, NK, E);
  return cudaGetLastError();
}

cudaError_t moe_capacity(int32_t* row, int32_t* cslot, int32_t* ov, const int32_t* offsets, const int32_t* slot,
                         int NK, int E, int C, int R, cudaStream_t st) {
  if (C < 1 || E < 0 || R < 0 || NK < 0 || (NK > 0 && E == 0)) return cudaErrorInvalidValue;
  if (int64_t(E) * C > R) return cudaErrorInvalidValue;
  if (R > 0) capacity_fill_kernel<<<grid_for(size_t(R)), kThreads, 0, st>>>(cslot, R, E * C);
  capacity_overflow_kernel<<<1, 32, 0, st>>>(ov, offsets, E, C);
  if (NK > 0)
    capacity_rows_kernel<<<grid_for(size_t(NK)), kThreads, 0, st>>>(row, cslot, ov, offsets, slot, NK, E, C, R);
  return cudaGetLastError();
}

cudaError_t moe_zero_rows(void* x, bool bf16, const int32_t* cslot, int rows, int cols, cudaStream_t st) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (bf16) {
    __nv_bfloat16* xb = static_cast<__nv_bfloat16*>(x);
    if (rows_vectorizable(cols, xb))
      zero_rows_kernel<4, __nv_bfloat16><<<grid_for(size_t(rows), 1), kThreads, 0, st>>>(xb, cslot, rows, cols);
    else
      zero_rows_kernel<1, __nv_bfloat16><<<grid_for(size_t(rows), 1), kThreads, 0, st>>>(xb, cslot, rows, cols);
  } else {
    float* xf = static_cast<float*>(x);
    if (rows_vectorizable(cols, xf))
      zero_rows_kernel<4, float><<<grid_for(size_t(rows), 1), kThreads, 0, st>>>(xf, cslot, rows, cols);
    else
      zero_rows_kernel<1, float><<<grid_for(size_t(rows), 1), kThreads, 0, st>>>(xf, cslot, rows, cols);
  }
  return cudaGetLastError();
}

cudaError_t moe_gather(float* xs, const float* h, const int32_t* slot, int NK, int K, int d, cudaStream_t st) {
  if (NK <= 0 || d <= 0) return cudaSuccess;
  if (K < 1) return cudaErrorInvalidValue;
  if (rows_vectorizable(d, xs, h))
    gather_kernel<4, float><<<grid_for(size_t(NK), 1), kThreads, 0, st>>>(xs, h, slot, NK, K, d);
  else
    gather_kernel<1, float><<<grid_for(size_t(NK), 1), kThreads, 0, st>>>(xs, h, slot, NK, K, d);
  return cudaGetLastError();
}

cudaError_t moe_combine(float* out, const float* y, const float* comb, const int32_t* row, int N, int K, int d,
                        cudaStream_t st) {
  if (N <= 0 || d <= 0 || K <= 0) return cudaSuccess;
  if (rows_vectorizable(d, out, y))
    combine_kernel<float, 4><<<grid_for(size_t(N), 1), kThreads, 0, st>>>(out, y, comb, row, N, K, d);
  else
    combine_kernel<float, 1><<<grid_for(size_t(N), 1), kThreads, 0, st>>>(out, y, comb, row, N, K, d);
  return cudaGetLastError();
}

cudaError_t moe_combine_backward(float* dy, float* dcomb, const float* dout, const float* y, const float* comb,
                                 const int32_t* row, int N, int K, int d, cudaStream_t st) {
  const int64_t NK = int64_t(N) * K;
  if (NK <= 0) return cudaSuccess;
  if (!reference_paths())
    combine_backward_kernel<float, kCombineBwdUnroll><<<grid_for(size_t(NK), kWarps), kThreads, 0, st>>>(
        dy, dcomb, dout, y, comb, row, NK, K, d);
  else
    combine_backward_kernel<float, 1><<<grid_for(size_t(NK), kWarps), kThreads, 0, st>>>(dy, dcomb, dout, y, comb,
                                                                                          row, NK, K, d);
  return cudaGetLastError();
}

cudaError_t moe_combine_bf16(float* out, const uint16_t* y, const float* comb, const int32_t* row, int N, int K, int d,
                             cudaStream_t st) {
  if (N <= 0 || d <= 0 || K <= 0) return cudaSuccess;
  if (rows_vectorizable(d, out, y))
    combine_kernel<__nv_bfloat16, 4><<<grid_for(size_t(N), 1), kThreads, 0, st>>>(out, as_bf16(y), comb, row, N, K, d);
  else
    combine_kernel<__nv_bfloat16, 1><<<grid_for(size_t(N), 1), kThreads, 0, st>>>(out, as_bf16(y), comb, row, N, K, d);
  return cudaGetLastError();
}

cudaError_t moe_combine_backward_bf16(float* dy, float* dcomb, const float* dout, const uint16_t* y, const float* comb,
                                      const int32_t* row, int N, int K, int d, cudaStream_t st) {
  const int64_t NK = int64_t(N) * K;
  if (NK <= 0) return cudaSuccess;
  if (!reference_paths())
    combine_backward_kernel<__nv_bfloat16, kCombineBwdUnroll><<<grid_for(size_t(NK), kWarps), kThreads, 0, st>>>(
        dy, dcomb, dout, as_bf16(y), comb, row, NK, K, d);
  else
    combine_backward_kernel<__nv_bfloat16, 1><<<grid_for(size_t(NK), kWarps), kThreads, 0, st>>>(
        dy, dcomb, dout, as_bf16(y), comb, row, NK, K, d);
  return cudaGetLastError();
}

cudaError_t moe_combine_backward_bf16_grads(uint16_t* dy, float* dcomb, const float* dout, const uint16_t* y,
                                            const float* comb, const int32_t* row, int N, int K, int d,
                                            cudaStream_t st) {
  const int64_t NK = int64_t(N) * K;
  if (NK <= 0) return cudaSuccess;
  if (!reference_paths())
    combine_backward_kernel<__nv_bfloat16, kCombineBwdUnroll, __nv_bfloat16>
        <<<grid_for(size_t(NK), kWarps), kThreads, 0, st>>>(as_bf16(dy), dcomb, dout, as_bf16(y), comb, row, NK, K, d);
  else
    combine_backward_kernel<__nv_bfloat16, 1, __nv_bfloat16><<<grid_for(size_t(NK), kWarps), kThreads, 0, st>>>(
        as_bf16(dy), dcomb, dout, as_bf16(y), comb, row, NK, K, d);
  return cudaGetLastError();
}

cudaError_t moe_gather_bf16(uint16_t* xs, const float* h, const int32_t* slot, int NK, int K, int d, cudaStream_t st) {
  if (NK <= 0 || d <= 0) return cudaSuccess;
  if (K < 1) return cudaErrorInvalidValue;
  if (rows_vectorizable(d, xs, h))
    gather_kernel<4, __nv_bfloat16><<<grid_for(size_t(NK), 1), kThreads, 0, st>>>(as_bf16(xs), h, slot, NK, K, d);
  else
    gather_kernel<1, __nv_bfloat16><<<grid_for(size_t(NK), 1), kThreads, 0, st>>>(as_bf16(xs), h, slot, NK, K, d);
  return cudaGetLastError();
}

cudaError_t moe_gather_backward(float* dh, const float* dx, const int32_t* row, int N, int K, int d,
                                cudaStream_t st) {
  if (N <= 0 || d <= 0) return cudaSuccess;
  if (K < 1) return cudaErrorInvalidValue;
  if (rows_vectorizable(d, dh, dx))
    gather_backward_kernel<4><<<grid_for(size_t(N), 1), kThreads, 0, st>>>(dh, dx, row, N, K, d);
  else
    gather_backward_kernel<1><<<grid_for(size_t(N), 1), kThreads, 0, st>>>(dh, dx, row, N, K, d);
  return cudaGetLastError();
}

cudaError_t moe_router_backward(float* ds, const float* logits, const float* lse, const int32_t* expert,
                                const float* dcomb, int N, int E, int K, bool normalized, double route_scale,
                                float z_scale, cudaStream_t st) {
  if (N <= 0 || E <= 0) return cudaSuccess;
  if (K < 0 || K > E) return cudaErrorInvalidValue;
  router_backward_kernel<<<grid_for(size_t(N), kWarps), kThreads, 0, st>>>(ds, logits, lse, expert, dcomb, N, E, K,
                                                                           normalized, float(route_scale), z_scale);
  return cudaGetLastError();
}

cudaError_t moe_balance_values(float* vals, const float* logits, const float* bias, int N, int E, int K,
                               cudaStream_t st) {
  if (N <= 0) return cudaSuccess;
  if (K < 0 || K >= E) return cudaErrorInvalidValue;
  balance_values_kernel<<<grid_for(size_t(N), kWarps), kThreads, 0, st>>>(vals, logits, bias, N, E, K);
  return cudaGetLastError();
}

// The transposed keys of a chunk of columns; chunks bound the scratch (T * E * 4 bytes at once
// would be gigabytes for a large step) while keeping enough columns per launch to fill the device.
static constexpr size_t kQuantileScratchCap = size_t(64) << 20;

static int quantile_chunk_cols(int64_t T, int E) {
  const size_t per_col = sizeof(uint32_t) * size_t(T);
  const size_t cols = kQuantileScratchCap / per_col;
  return int(cols < 1 ? 1 : (cols > size_t(E) ? size_t(E) : cols));
}

size_t moe_quantile_beta_scratch_bytes(int64_t T, int E) {
  if (T <= 0 || E <= 0) return 0;
  return sizeof(uint32_t) * size_t(T) * size_t(quantile_chunk_cols(T, E));
}

cudaError_t moe_quantile_beta(double* beta, const float* vals, int64_t T, int E, int K, void* scratch,
                              size_t scratch_bytes, cudaStream_t st) {
  if (E <= 0) return cudaSuccess;
  if (T < 1 || T > INT_MAX || K < 0 || K > E) return cudaErrorInvalidValue;
  if (scratch_bytes < moe_quantile_beta_scratch_bytes(T, E)) return cudaErrorInvalidValue;
  const int64_t q64 = T * K / E;  // floor(T*K/E), at least 1 (the CPU's q); <= T since K <= E
  const int q = int(q64 < 1 ? 1 : q64);
  uint32_t* keys = static_cast<uint32_t*>(scratch);
  const int chunk = quantile_chunk_cols(T, E);
  for (int j0 = 0; j0 < E; j0 += chunk) {  // stream order: a chunk's select finishes before the next transpose
    const int nc = E - j0 < chunk ? E - j0 : chunk;
    const size_t tiles = size_t((T + 31) / 32) * size_t((nc + 31) / 32);
    transpose_keys_kernel<<<grid_for(tiles, 1), dim3(32, 8), 0, st>>>(keys, vals, T, E, j0, nc);
    radix_select_kernel<<<unsigned(nc), kSelThreads, 0, st>>>(beta + j0, keys, int(T), q);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

namespace {
__global__ void count_load_kernel(int64_t* load, const int32_t* offsets, int E) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x)
    load[e] += int64_t(offsets[e + 1] - offsets[e]);
}

// E is small (the experts of one layer) and this runs once per layer and optimizer step: one
// thread (of one warp) keeps the summation order of cpu::moe_balance_bias.
__global__ void balance_bias_kernel(float* bias, const double* beta, int E) {
  if (threadIdx.x != 0) return;
  double mean = 0;
  for (int e = 0; e < E; ++e) mean += beta[e];
  mean /= E;
  for (int e = 0; e < E; ++e) bias[e] = float(-(beta[e] - mean));
}

__global__ void pko_resets_kernel(uint8_t* reset, const int32_t* ids, int N_tok, int S, int eod_id) {
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < N_tok; t += gridDim.x * blockDim.x)
    reset[t] = (t % S == 0 || ids[t - 1] == eod_id) ? 1 : 0;  // t % S == 0 covers t = 0: ids[-1] unread
}
}  // namespace

cudaError_t moe_count_load(int64_t* load, const int32_t* offsets, int E, cudaStream_t st) {
  if (E <= 0) return cudaSuccess;
  count_load_kernel<<<grid_for(size_t(E)), kThreads, 0, st>>>(load, offsets, E);
  return cudaGetLastError();
}

cudaError_t moe_balance_bias(float* bias, const double* beta, int E, cudaStream_t st) {
  if (E <= 0) return cudaSuccess;
  balance_bias_kernel<<<1, 32, 0, st>>>(bias, beta, E);
  return cudaGetLastError();
}

cudaError_t pko_resets(uint8_t* reset, const int32_t* ids, int N_tok, int S, int eod_id, cudaStream_t st) {
  if (N_tok <= 0) return cudaSuccess;
  if (S < 1) return cudaErrorInvalidValue;
  pko_resets_kernel<<<grid_for(size_t(N_tok)), kThreads, 0, st>>>(reset, ids, N_tok, S, eod_id);
  return cudaGetLastError();
}

}  // namespace ladder::cuda::k
