// CUDA kernels of the recipe's attention switches and GatedNorm's elementwise parts, fp32: partial
// key offset (PKO), exclusive self attention (XSA), the per-head output gate, SiLU and the sigmoid
// gate; and the fused attention input path (PKO shift + QK-norm + RoPE of queries and keys).
// Contracts: backend/cpu/kernels.h (CPU code in backend/cpu/attn_switch_kernels.cpp).
//
// All of them are memory-bound passes over [tokens, heads * hd] arrays. Elementwise ops use
// grid-stride loops with size_t indices; the ops that need a per-head dot product (XSA, the gate's
// backward) give one warp to one head row: the lanes stride over the row's hd values, a shuffle
// tree sums the dot product (fixed order: deterministic, no atomics), and each lane then writes only
// the elements it read itself, which is what makes the allowed in-place calls (z == y, dy == dz,
// dx == dout, out == x) safe without shared memory or block barriers.
//
// bf16 activations (model.attn_bf16): the QK prep, XSA and head-gate kernels are templated on the
// storage type T of their [tokens, heads * hd] activations (float or __nv_bfloat16). Inputs of type
// T are read through widen() (exact), outputs of type T written through store_rn() (round to nearest
// even); rstd, gate factors and every gradient stay fp32. So the bf16 instantiation is the fp32
// kernel's arithmetic, in the same order, on the widened inputs, with its outputs rounded once: the
// CPU reference's widen / fp32 kernel / round, in one pass and without scratch copies. The fp32
// instantiations are the kernels as they were (widen and store_rn are the identity on float).
#include "backend/cpu/kernels.h"
#include "backend/cuda/switch_optim_ops.cuh"
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/kernels.cuh"

#include <climits>

namespace ladder::cuda::k {

namespace {

constexpr int kThreads = 256;             // 8 warps per block
static_assert(kThreads == 256, "grid_for (device_common.cuh) sizes grids for 256-thread blocks by default");
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr size_t kMaxBlocks = 65536;      // grid-stride loops cover the rest

// One warp per row.
inline unsigned grid_for_rows(size_t rows) {
  const size_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return unsigned(blocks < kMaxBlocks ? (blocks ? blocks : 1) : kMaxBlocks);
}

// The CPU's expression, 1 / (1 + exp(-x)), so the two differ only by expf's last-bit rounding.
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

// Grid-stride over rows with one warp per row. The row index is uniform across a warp, so every
// lane takes part in every shuffle (blockDim.x is a multiple of 32).
#define LADDER_FOR_EACH_WARP_ROW(r, rows)                                                              \
  for (size_t r = size_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); r < (rows);             \
       r += size_t(gridDim.x) * (blockDim.x >> 5))

#define LADDER_GRID_STRIDE(i, n) \
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += size_t(gridDim.x) * blockDim.x)

// ---------------------------------------------------------------------------------------------
// Partial key offset. e indexes [N_tok, nkv * hd]; dims below from_dim are copied, the others come
// from the neighbouring token (t - 1 forward, t + 1 backward) unless a reset cuts the sequence.

__global__ void pko_fwd_kernel(float* out, const float* k, const uint8_t* reset, size_t total, size_t row, int hd,
                               int from_dim) {
  LADDER_GRID_STRIDE(e, total) {
    const size_t t = e / row;
    const int c = int((e - t * row) % size_t(hd));
    float val;
    if (c < from_dim) val = k[e];
    else val = (t == 0 || reset[t]) ? 0.f : k[e - row];
    out[e] = val;
  }
}

__global__ void pko_bwd_kernel(float* dk, const float* dout, const uint8_t* reset, size_t total, size_t row,
                               size_t N_tok, int hd, int from_dim) {
  LADDER_GRID_STRIDE(e, total) {
    const size_t t = e / row;
    const int c = int((e - t * row) % size_t(hd));
    float val;
    if (c < from_dim) val = dout[e];
    else val = (t + 1 < N_tok && !reset[t + 1]) ? dout[e + row] : 0.f;  // t's tail went to t + 1
    dk[e] = val;
  }
}

// ---------------------------------------------------------------------------------------------
// Queries / keys into attention: PKO shift -> QK-norm -> RoPE in one pass (cpu::qk_prep_forward is
// the composition of the three CPU kernels; here each (token, head) row of hd is one warp's: one
// pass over memory instead of three (the warp's second read of its row, after the sum of squares,
// should come from cache), and the shifted / normed rows are never stored).
//
// Lane ownership: RoPE pairs (i, i + half) for i = lane, lane + 32, ... and the unrotated dims
// [2 half, hd) in the same stride. A lane reads and writes only what it owns, so the row sums are
// the only cross-lane step (a shuffle tree: fixed order). The shift reads dims [from, hd) of the
// previous token's row of the same head; `from` is hd when there is no shift (reset == nullptr).

// Dim c of the shifted row: the row's own value below `from`, else token t-1's (zero at a reset,
// where prev is false). `stride` = nheads * hd, one token back.
template <class T>
__device__ __forceinline__ float qk_shifted(const T* xr, size_t stride, bool prev, int c, int from) {
  if (c < from) return widen(xr[c]);
  return prev ? widen(*(xr - stride + c)) : 0.f;
}

// The normed value (x * rstd) * gain, the CPU's order; v itself without the norm.
__device__ __forceinline__ float qk_normed(float v, float rs, const float* gain, int c, bool norm) {
  if (!norm) return v;
  return gain ? v * rs * gain[c] : v * rs;
}

template <class T>
__global__ void qk_prep_fwd_kernel(T* out, float* rstd, const T* x, const float* gain, const uint8_t* reset,
                                   const float* cos_sin, int N_tok, int S, int nheads, int hd, int half, int from,
                                   bool norm, float eps) {
  const int lane = threadIdx.x & 31;
  const size_t rows = size_t(N_tok) * nheads, stride = size_t(nheads) * hd;
  const float* ct = cos_sin;
  const float* st = cos_sin + size_t(S) * half;
  LADDER_FOR_EACH_WARP_ROW(r, rows) {
    const size_t t = r / nheads;
    const bool prev = reset && t > 0 && !reset[t];
    const T* xr = x + r * hd;
    T* o = out + r * hd;
    float rs = 1.f;
    if (norm) {
      float ss = 0.f;
      for (int c = lane; c < hd; c += 32) {
        const float v = qk_shifted(xr, stride, prev, c, from);
        ss += v * v;
      }
      ss = warp_sum(ss);
      // The scalar in double, as the CPU computes it (its sum of squares is in double too).
      rs = float(1.0 / sqrt(double(ss) / hd + double(eps)));
      if (lane == 0) rstd[r] = rs;
    }
    const size_t pos = t % size_t(S);
    for (int i = lane; i < half; i += 32) {
      const float a = qk_normed(qk_shifted(xr, stride, prev, i, from), rs, gain, i, norm);
      const float b = qk_normed(qk_shifted(xr, stride, prev, i + half, from), rs, gain, i + half, norm);
      const float c = ct[pos * half + i], s = st[pos * half + i];
      store_rn(o[i], a * c - b * s);
      store_rn(o[i + half], b * c + a * s);
    }
    for (int c = 2 * half + lane; c < hd; c += 32)
      store_rn(o[c], qk_normed(qk_shifted(xr, stride, prev, c, from), rs, gain, c, norm));
  }
}

constexpr int kQkChunkRows = 256;  // rows per dgain partial: 8 warps x 32 rows

// The backward of one row, from d(out): dn = RoPE^T(dout) (rotation by -angle, the CPU's
// expressions with sign -1), then the norm's adjoint dx_s = rs (g dn - xs (dn.g.xs) rs^2 / hd), then
// the shift's adjoint as a scatter: dims below `from` go to the row itself, the others to token
// t-1's row (they came from there), or nowhere at a reset. Dims [from, hd) of a row whose next token
// does not read it (t + 1 a reset or past the end) are zeroed by the row itself, so every element of
// dx is written exactly once, by one warp, and dx needs no pre-zeroing. With `part` (per-warp dgain
// partials in shared memory), adds dn * xs * rs to the lane's own columns.
template <class T>
__global__ void qk_prep_bwd_kernel(float* dx, float* partial, const float* dout, const T* x, const float* gain,
                                   const float* rstd, const uint8_t* reset, const float* cos_sin, int N_tok, int S,
                                   int nheads, int hd, int half, int from, bool norm) {
  extern __shared__ float part[];  // [warps, hd] when partial != nullptr
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const size_t rows = size_t(N_tok) * nheads, stride = size_t(nheads) * hd;
  const size_t nchunks = (rows + kQkChunkRows - 1) / kQkChunkRows;
  const float* ct = cos_sin;
  const float* st = cos_sin + size_t(S) * half;
  float* pw = partial ? part + size_t(warp) * hd : nullptr;
  for (size_t ch = blockIdx.x; ch < nchunks; ch += gridDim.x) {
    if (pw) {
      for (int c = lane; c < hd; c += 32) pw[c] = 0.f;
      __syncwarp();  // zeroed in one lane order, accumulated below in another
    }
    const size_t r1 = (ch + 1) * kQkChunkRows < rows ? (ch + 1) * kQkChunkRows : rows;
    for (size_t r = ch * kQkChunkRows + warp; r < r1; r += nwarps) {
      const size_t t = r / nheads;
      const bool prev = reset && t > 0 && !reset[t];
      const bool next_reads = reset && t + 1 < size_t(N_tok) && !reset[t + 1];
      const T* xr = x + r * hd;
      const float* g = dout + r * hd;
      float* d = dx + r * hd;
      const size_t pos = t % size_t(S);
      const float rs = norm ? rstd[r] : 1.f;
      // d(normed) of dim pair i: RoPE's adjoint.
      auto dn_pair = [&](int i, float& d1, float& d2) {
        const float a = g[i], b = g[i + half], c = ct[pos * half + i], si = -st[pos * half + i];
        d1 = a * c - b * si;
        d2 = b * c + a * si;
      };
      float cc = 0.f;
      if (norm) {
        float dot = 0.f;
        for (int i = lane; i < half; i += 32) {
          float d1, d2;
          dn_pair(i, d1, d2);
          const float g1 = gain ? gain[i] : 1.f, g2 = gain ? gain[i + half] : 1.f;
          dot += d1 * g1 * qk_shifted(xr, stride, prev, i, from);
          dot += d2 * g2 * qk_shifted(xr, stride, prev, i + half, from);
        }
        for (int c = 2 * half + lane; c < hd; c += 32)
          dot += g[c] * (gain ? gain[c] : 1.f) * qk_shifted(xr, stride, prev, c, from);
        dot = warp_sum(dot);
        cc = dot * rs * rs / float(hd);
      }
      // dx_s of dim c from dn, then where it goes.
      auto emit = [&](int c, float dn) {
        float v = dn;
        if (norm) {
          const float xs = qk_shifted(xr, stride, prev, c, from);
          v = rs * ((gain ? gain[c] : 1.f) * dn - xs * cc);
          if (pw) pw[c] += dn * xs * rs;
        }
        if (c < from) d[c] = v;
        else if (prev) *(d - stride + c) = v;  // token t-1's dims [from, hd) fed this row
        if (reset && c >= from && !next_reads) d[c] = 0.f;  // nothing read this row's dims [from, hd)
      };
      for (int i = lane; i < half; i += 32) {
        float d1, d2;
        dn_pair(i, d1, d2);
        emit(i, d1);
        emit(i + half, d2);
      }
      for (int c = 2 * half + lane; c < hd; c += 32) emit(c, g[c]);
    }
    if (partial) {
      __syncthreads();
      // The chunk's partial: the block's warps in warp order (each warp's rows in row order).
      for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < nwarps; ++w) acc += part[size_t(w) * hd + c];
        partial[ch * hd + c] = acc;
      }
      __syncthreads();  // part is zeroed again for the next chunk
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The QK prep's fast paths, for hd = 32 VPL and half = 32 HP (the model's shapes: hd 64 or 128, rope
// over hd or hd / 2). Lane `lane` owns dims c = lane + 32 j, j < VPL: exactly the dims the kernels
// above give it in their first loop, so its partial sums add the same terms in the same order and
// the shuffle tree is the same (the same rstd, dot and dgain). Since half is a multiple of 32, the
// RoPE partner c + half of dim c < half is the same lane's j + HP, so a row's loads are all issued
// together into registers (x, and dout in the backward, VPL each; cos / sin HP each) instead of one
// dependent loop step at a time. Row and token indices are 32-bit (the launcher checks N_tok *
// nheads < 2^31): a 32-bit division and modulo per row, where the reference's size_t ones compile to
// a run-time choice between the 32- and 64-bit instruction sequences. The forward
// reads its row once (the reference reads it twice) and the gain once per kernel. The backward
// loads two rows per step (twice the bytes in flight per warp: its grid is one block per 256-row
// chunk, too few blocks to fill the device at the model's sizes) and keeps the dgain partials in
// registers instead of shared memory.
//
// The per-element expressions are the reference kernels', in the same form: with the norm, the
// backward's second pass (dx from dn after the row's dot) reads dout, x, cos / sin and the gain
// again, as qk_prep_bwd_kernel does (L1 hits, after a __syncwarp that keeps the compiler from reusing
// the first pass's loads). Reusing the first pass's values would make gain * dn of the dot and of dx
// one value with two uses, and the compiler's FMA contraction of gain * dn - xs * cc then picks the
// other multiply (LLVM prefers the one with fewer uses): a different rounding. The emulated test
// (CudaEmu.QkPrepRegisterPathsMatchReferenceBitwise) compares the two paths bit for bit.

// The row's values after the PKO shift (qk_shifted of each owned dim).
template <int VPL, class T>
__device__ __forceinline__ void qk_load_shifted(float (&v)[VPL], const T* xr, size_t stride, bool prev, int lane,
                                                int from) {
#pragma unroll
  for (int j = 0; j < VPL; ++j) v[j] = qk_shifted(xr, stride, prev, lane + 32 * j, from);
}

// The gain of each owned dim (1 without a gain: the reference kernels' `gain ? gain[c] : 1.f`).
template <int VPL>
__device__ __forceinline__ void qk_load_gain(float (&gv)[VPL], const float* gain, int lane) {
#pragma unroll
  for (int j = 0; j < VPL; ++j) gv[j] = gain ? gain[lane + 32 * j] : 1.f;
}

template <class T, int VPL, int HP>
__global__ void qk_prep_fwd_regs_kernel(T* out, float* rstd, const T* x, const float* gain, const uint8_t* reset,
                                        const float* cos_sin, int N_tok, int S, int nheads, int from, bool norm,
                                        float eps) {
  constexpr int hd = 32 * VPL, half = 32 * HP;
  const int lane = threadIdx.x & 31;
  const unsigned rows = unsigned(N_tok) * unsigned(nheads), warps = gridDim.x * (blockDim.x >> 5);
  const size_t stride = size_t(nheads) * hd;
  const float* ct = cos_sin;
  const float* st = cos_sin + size_t(S) * half;
  float gv[VPL];
  qk_load_gain(gv, gain, lane);
  for (unsigned r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
    const unsigned t = r / unsigned(nheads), pos = t % unsigned(S);
    const bool prev = reset && t > 0 && !reset[t];
    float v[VPL], cs[HP], sn[HP];
    qk_load_shifted(v, x + size_t(r) * hd, stride, prev, lane, from);
#pragma unroll
    for (int j = 0; j < HP; ++j) {
      cs[j] = ct[pos * half + lane + 32 * j];
      sn[j] = st[pos * half + lane + 32 * j];
    }
    float rs = 1.f;
    if (norm) {
      float ss = 0.f;
#pragma unroll
      for (int j = 0; j < VPL; ++j) ss += v[j] * v[j];
      ss = warp_sum(ss);
      rs = float(1.0 / sqrt(double(ss) / hd + double(eps)));  // as qk_prep_fwd_kernel
      if (lane == 0) rstd[r] = rs;
#pragma unroll
      for (int j = 0; j < VPL; ++j) v[j] = gain ? v[j] * rs * gv[j] : v[j] * rs;  // qk_normed
    }
    T* o = out + size_t(r) * hd + lane;
#pragma unroll
    for (int j = 0; j < HP; ++j) {
      const float a = v[j], b = v[j + HP], c = cs[j], s = sn[j];
      store_rn(o[32 * j], a * c - b * s);
      store_rn(o[32 * j + half], b * c + a * s);
    }
#pragma unroll
    for (int j = 2 * HP; j < VPL; ++j) store_rn(o[32 * j], v[j]);
  }
}

// One row's inputs to the backward, loaded before any of them is used (qk_bwd_row_load), so that
// the warp has two rows' loads in flight at once (qk_prep_bwd_regs_kernel).
template <int VPL, int HP>
struct QkBwdRow {
  float g[VPL], xs[VPL], cs[HP], sn[HP], rs;
  unsigned t;
  bool prev, next_reads;
};

template <int VPL, int HP, class T>
__device__ __forceinline__ void qk_bwd_row_load(QkBwdRow<VPL, HP>& w, unsigned r, const float* dout, const T* x,
                                                const float* rstd, const uint8_t* reset, const float* cos_sin,
                                                unsigned N_tok, unsigned S, unsigned nheads, int lane, int from,
                                                bool norm) {
  constexpr int hd = 32 * VPL, half = 32 * HP;
  w.t = r / nheads;
  w.prev = reset && w.t > 0 && !reset[w.t];
  w.next_reads = reset && w.t + 1 < N_tok && !reset[w.t + 1];
  const unsigned pos = w.t % S;
  const float* g = dout + size_t(r) * hd + lane;
#pragma unroll
  for (int j = 0; j < VPL; ++j) w.g[j] = g[32 * j];
#pragma unroll
  for (int j = 0; j < HP; ++j) {
    w.cs[j] = cos_sin[pos * half + lane + 32 * j];
    w.sn[j] = cos_sin[size_t(S) * half + pos * half + lane + 32 * j];
  }
  w.rs = norm ? rstd[r] : 1.f;
  if (norm) qk_load_shifted(w.xs, x + size_t(r) * hd, size_t(nheads) * hd, w.prev, lane, from);
}

// qk_prep_bwd_kernel's row body on a loaded row: dn (RoPE's adjoint), the dot, then each dim's
// dx_s and where it goes; pacc: the lane's dgain partials (its dims), added in row order.
// d(normed) of the row: RoPE's adjoint (dn_pair of qk_prep_bwd_kernel) on the pairs, dout itself
// on the unrotated dims.
template <int VPL, int HP>
__device__ __forceinline__ void qk_bwd_dn(float (&dn)[VPL], const QkBwdRow<VPL, HP>& w) {
#pragma unroll
  for (int j = 0; j < HP; ++j) {
    const float a = w.g[j], b = w.g[j + HP], c = w.cs[j], si = -w.sn[j];
    dn[j] = a * c - b * si;
    dn[j + HP] = b * c + a * si;
  }
#pragma unroll
  for (int j = 2 * HP; j < VPL; ++j) dn[j] = w.g[j];
}

template <int VPL, int HP, class T>
__device__ __forceinline__ void qk_bwd_row_emit(QkBwdRow<VPL, HP>& w, float (&pacc)[VPL], const float* gain,
                                                float* dx, unsigned r, const float* dout, const T* x,
                                                const float* rstd, const uint8_t* reset, const float* cos_sin,
                                                unsigned N_tok, unsigned S, unsigned nheads, int lane, int from,
                                                bool norm, bool with_partial) {
  constexpr int hd = 32 * VPL;
  const size_t stride = size_t(nheads) * hd;
  float dn[VPL];
  qk_bwd_dn(dn, w);
  float cc = 0.f;
  if (norm) {
    float dot = 0.f;  // the reference order: pairs (i, i + half) in i order, then the unrotated dims
#pragma unroll
    for (int j = 0; j < HP; ++j) {
      const float g1 = gain ? gain[lane + 32 * j] : 1.f, g2 = gain ? gain[lane + 32 * (j + HP)] : 1.f;
      dot += dn[j] * g1 * w.xs[j];
      dot += dn[j + HP] * g2 * w.xs[j + HP];
    }
#pragma unroll
    for (int j = 2 * HP; j < VPL; ++j) dot += dn[j] * (gain ? gain[lane + 32 * j] : 1.f) * w.xs[j];
    dot = warp_sum(dot);
    cc = dot * w.rs * w.rs / float(hd);
    __syncwarp();  // a memory barrier to the compiler: the loads below are new ones (see above)
    qk_bwd_row_load(w, r, dout, x, rstd, reset, cos_sin, N_tok, S, nheads, lane, from, norm);
    qk_bwd_dn(dn, w);
  }
  float* d = dx + size_t(r) * hd;
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    const int c = lane + 32 * j;
    float v = dn[j];
    if (norm) {
      v = w.rs * ((gain ? gain[c] : 1.f) * dn[j] - w.xs[j] * cc);
      if (with_partial) pacc[j] += dn[j] * w.xs[j] * w.rs;
    }
    if (c < from) d[c] = v;
    else if (w.prev) *(d - stride + c) = v;
    if (reset && c >= from && !w.next_reads) d[c] = 0.f;
  }
}

// qk_prep_bwd_kernel with the rows in registers: the same chunks, the same rows per warp in the same
// order (so the same dgain partials, summed in the same order), two rows loaded per step. The dgain
// partial of a dim lives in its lane's registers for the chunk and reaches shared memory once.
template <class T, int VPL, int HP>
__global__ void qk_prep_bwd_regs_kernel(float* dx, float* partial, const float* dout, const T* x, const float* gain,
                                        const float* rstd, const uint8_t* reset, const float* cos_sin, int N_tok,
                                        int S, int nheads, int from, bool norm) {
  constexpr int hd = 32 * VPL;
  extern __shared__ float part[];  // [warps, hd] when partial != nullptr
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const unsigned rows = unsigned(N_tok) * unsigned(nheads);
  const unsigned nchunks = (rows + kQkChunkRows - 1) / kQkChunkRows;
  for (unsigned ch = blockIdx.x; ch < nchunks; ch += gridDim.x) {
    float pacc[VPL];
#pragma unroll
    for (int j = 0; j < VPL; ++j) pacc[j] = 0.f;
    const unsigned r1 = (ch + 1) * kQkChunkRows < rows ? (ch + 1) * kQkChunkRows : rows;
    for (unsigned r = ch * kQkChunkRows + warp; r < r1; r += 2 * nwarps) {
      const unsigned r2 = r + nwarps;
      QkBwdRow<VPL, HP> a = {}, b = {};  // b: loaded only when the warp has a second row; xs with the norm
      qk_bwd_row_load(a, r, dout, x, rstd, reset, cos_sin, N_tok, S, nheads, lane, from, norm);
      if (r2 < r1) qk_bwd_row_load(b, r2, dout, x, rstd, reset, cos_sin, N_tok, S, nheads, lane, from, norm);
      qk_bwd_row_emit(a, pacc, gain, dx, r, dout, x, rstd, reset, cos_sin, N_tok, S, nheads, lane, from, norm,
                      partial != nullptr);
      if (r2 < r1)
        qk_bwd_row_emit(b, pacc, gain, dx, r2, dout, x, rstd, reset, cos_sin, N_tok, S, nheads, lane, from, norm,
                        partial != nullptr);
    }
    if (partial) {
#pragma unroll
      for (int j = 0; j < VPL; ++j) part[warp * hd + lane + 32 * j] = pacc[j];
      __syncthreads();
      // The chunk's partial: the block's warps in warp order, as qk_prep_bwd_kernel.
      for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < nwarps; ++w) acc += part[w * hd + c];
        partial[size_t(ch) * hd + c] = acc;
      }
      __syncthreads();  // part is written again for the next chunk
    }
  }
}

// dgain += the chunks' partials, added in chunk order (one thread per column).
__global__ void qk_dgain_final_kernel(float* dgain, const float* partial, size_t nchunks, int hd) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= hd) return;
  float acc = 0.f;
  for (size_t k = 0; k < nchunks; ++k) acc += partial[k * hd + c];
  dgain[c] += acc;
}

// ---------------------------------------------------------------------------------------------
// Exclusive self attention: z = y - (y.v / (v.v + eps)) v per query head (see kernels.h).

template <class T>
__global__ void xsa_fwd_kernel(T* z, const T* y, const T* v, int N_tok, int H, int KV, int hd, float eps) {
  const int lane = threadIdx.x & 31;
  const int G = H / KV;
  const size_t rows = size_t(N_tok) * H;
  LADDER_FOR_EACH_WARP_ROW(r, rows) {
    const size_t t = r / H;
    const int h = int(r - t * H);
    const T* yr = y + r * hd;
    const T* vr = v + (t * KV + h / G) * hd;
    T* zr = z + r * hd;
    float yv = 0.f, vv = 0.f;
    for (int c = lane; c < hd; c += 32) {
      const float yc = widen(yr[c]), vc = widen(vr[c]);
      yv += yc * vc;
      vv += vc * vc;
    }
    yv = warp_sum(yv);
    vv = warp_sum(vv);
    const float coef = yv / (vv + eps);
    for (int c = lane; c < hd; c += 32) store_rn(zr[c], widen(yr[c]) - coef * widen(vr[c]));
  }
}

// One warp per (token, KV group): dv of the group is owned by this warp, which adds the G heads'
// contributions in head order (the CPU's order), so no atomics and no cross-warp reduction.
template <class T>
__global__ void xsa_bwd_kernel(float* dy, float* dv, const float* dz, const T* y, const T* v, int N_tok, int H,
                               int KV, int hd, float eps) {
  const int lane = threadIdx.x & 31;
  const int G = H / KV;
  const size_t groups = size_t(N_tok) * KV;
  LADDER_FOR_EACH_WARP_ROW(r, groups) {
    const size_t t = r / KV;
    const int g = int(r - t * KV);
    const T* vr = v + r * hd;
    float* dvr = dv + r * hd;
    float vv = 0.f;
    for (int c = lane; c < hd; c += 32) vv += widen(vr[c]) * widen(vr[c]);
    const float n = warp_sum(vv) + eps;
    for (int j = 0; j < G; ++j) {
      const size_t hr = t * H + size_t(g) * G + j;  // the query head's row
      const T* yr = y + hr * hd;
      const float* dzr = dz + hr * hd;
      float* dyr = dy + hr * hd;
      float yv = 0.f, a = 0.f;
      for (int c = lane; c < hd; c += 32) {
        yv += widen(yr[c]) * widen(vr[c]);
        a += dzr[c] * widen(vr[c]);
      }
      yv = warp_sum(yv);
      a = warp_sum(a);
      const float coef = yv / n, an = a / n, vcoef = 2.f * a * coef / n;
      for (int c = lane; c < hd; c += 32) {
        const float dzc = dzr[c];  // read before dy[c] is written: dy may alias dz
        const float prev = j == 0 ? 0.f : dvr[c];
        const float yc = widen(yr[c]), vc = widen(vr[c]);
        dvr[c] = prev + (-coef * dzc - an * yc + vcoef * vc);
        dyr[c] = dzc - an * vc;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Per-head output gate, one warp per (token, head) row. Forward needs no reduction, but a row per
// warp also writes factor when hd == 0, as the CPU does.

template <class T>
__global__ void head_gate_fwd_kernel(T* out, float* factor, const T* x, const float* logit, int N_tok, int H,
                                     int hd) {
  const int lane = threadIdx.x & 31;
  const size_t rows = size_t(N_tok) * H;
  LADDER_FOR_EACH_WARP_ROW(r, rows) {
    const float f = 2.f * sigmoid_f(logit[r]);
    if (lane == 0) factor[r] = f;
    const T* xr = x + r * hd;
    T* orow = out + r * hd;
    for (int c = lane; c < hd; c += 32) store_rn(orow[c], widen(xr[c]) * f);
  }
}

template <class T>
__global__ void head_gate_bwd_kernel(float* dx, float* dlogit, const float* dout, const T* x, const float* factor,
                                     int N_tok, int H, int hd) {
  const int lane = threadIdx.x & 31;
  const size_t rows = size_t(N_tok) * H;
  LADDER_FOR_EACH_WARP_ROW(r, rows) {
    const float f = factor[r];
    const float* dor = dout + r * hd;
    const T* xr = x + r * hd;
    float* dxr = dx + r * hd;
    float s = 0.f;
    for (int c = lane; c < hd; c += 32) s += dor[c] * widen(xr[c]);
    s = warp_sum(s);
    // d(2 sigmoid(a))/da = 2 sigmoid (1 - sigmoid) = f (1 - f/2).
    if (lane == 0) dlogit[r] = s * f * (1.f - 0.5f * f);
    for (int c = lane; c < hd; c += 32) dxr[c] = dor[c] * f;  // lane-owned: dx may alias dout
  }
}

// ---------------------------------------------------------------------------------------------
// GatedNorm elementwise parts. Each element is read into registers before its outputs are written,
// so the in-place calls the contract allows (du == da, y == x, dx == dy) are safe.

__global__ void silu_fwd_kernel(float* a, const float* u, size_t n) {
  LADDER_GRID_STRIDE(i, n) {
    const float ui = u[i];
    a[i] = ui * sigmoid_f(ui);
  }
}

__global__ void silu_bwd_kernel(float* du, const float* da, const float* u, size_t n) {
  LADDER_GRID_STRIDE(i, n) {
    const float ui = u[i];
    const float s = sigmoid_f(ui);
    du[i] = da[i] * s * (1.f + ui * (1.f - s));
  }
}

// TY: float, or __nv_bfloat16 for GatedNorm's output under model.norm_bf16 (rounded as stored).
template <class TY>
__global__ void sigmoid_gate_fwd_kernel(TY* y, float* g, const float* x, size_t n) {
  LADDER_GRID_STRIDE(i, n) {
    const float s = sigmoid_f(g[i]);
    g[i] = s;
    store_rn(y[i], x[i] * s);
  }
}

__global__ void sigmoid_gate_bwd_kernel(float* dx, float* dg, const float* dy, const float* x, const float* s,
                                        size_t n, bool accumulate_dx) {
  LADDER_GRID_STRIDE(i, n) {
    const float d = dy[i], si = s[i];
    dg[i] = d * x[i] * si * (1.f - si);
    const float v = d * si;
    dx[i] = accumulate_dx ? dx[i] + v : v;
  }
}

#undef LADDER_FOR_EACH_WARP_ROW
#undef LADDER_GRID_STRIDE

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

cudaError_t pko_shift_forward(float* out, const float* k, const uint8_t* reset, int N_tok, int nkv, int hd,
                              int from_dim, cudaStream_t st) {
  const size_t row = size_t(nkv > 0 ? nkv : 0) * size_t(hd > 0 ? hd : 0);
  const size_t total = size_t(N_tok > 0 ? N_tok : 0) * row;
  if (!total) return cudaSuccess;
  pko_fwd_kernel<<<grid_for(total), kThreads, 0, st>>>(out, k, reset, total, row, hd, from_dim);
  return cudaGetLastError();
}

cudaError_t pko_shift_backward(float* dk, const float* dout, const uint8_t* reset, int N_tok, int nkv, int hd,
                               int from_dim, cudaStream_t st) {
  const size_t row = size_t(nkv > 0 ? nkv : 0) * size_t(hd > 0 ? hd : 0);
  const size_t total = size_t(N_tok > 0 ? N_tok : 0) * row;
  if (!total) return cudaSuccess;
  pko_bwd_kernel<<<grid_for(total), kThreads, 0, st>>>(dk, dout, reset, total, row, size_t(N_tok), hd, from_dim);
  return cudaGetLastError();
}

// The launchers of the templated kernels: one body per op for both storage types (launch_*), the
// public fp32 and bf16 entry points below it.
namespace {

using bf16 = __nv_bfloat16;

// Calls f(Width<VPL>{}, Width<HP>{}) when the QK prep's register kernels cover hd = 32 VPL and half
// = 32 HP (the model's shapes: hd 64 or 128 with rope over hd or hd / 2) and the rows fit 32-bit
// indices; false (nothing called) otherwise, or when the reference paths are forced. Not hd = 256:
// there the emulation's compiler fuses the backward's rotation (a c - b s over 4 pairs per lane, as
// vectors) into FMAs differently from qk_prep_bwd_kernel's loop, so it is not bitwise the reference.
template <class F>
bool with_qk_regs_shape(int hd, int half, size_t rows, F&& f) {
  if (reference_paths() || rows > size_t(INT_MAX) || hd % 32 != 0 || half % 32 != 0) return false;
  switch ((hd / 32) * 16 + half / 32) {
    case 2 * 16 + 1: f(Width<2>{}, Width<1>{}); return true;
    case 4 * 16 + 2: f(Width<4>{}, Width<2>{}); return true;
    case 4 * 16 + 1: f(Width<4>{}, Width<1>{}); return true;
    default: return false;
  }
}

template <class T>
cudaError_t launch_qk_prep_forward(T* out, float* rstd, const T* x, const float* gain, const uint8_t* reset,
                                   const float* cos_sin, int N_tok, int S, int nheads, int hd, int rot_dims, bool norm,
                                   float eps, cudaStream_t st) {
  if (N_tok <= 0 || nheads <= 0 || hd <= 0) return cudaSuccess;
  if (S < 1 || rot_dims < 0 || rot_dims > hd) return cudaErrorInvalidValue;
  const size_t rows = size_t(N_tok) * nheads;
  const int from = reset ? hd / 2 : hd;
  const bool regs = with_qk_regs_shape(hd, rot_dims / 2, rows, [&](auto vpl, auto hp) {
    constexpr int VPL = decltype(vpl)::value, HP = decltype(hp)::value;
    qk_prep_fwd_regs_kernel<T, VPL, HP><<<grid_for_rows(rows), kThreads, 0, st>>>(out, rstd, x, gain, reset, cos_sin,
                                                                                 N_tok, S, nheads, from, norm, eps);
  });
  if (!regs)
    qk_prep_fwd_kernel<T><<<grid_for_rows(rows), kThreads, 0, st>>>(out, rstd, x, gain, reset, cos_sin, N_tok, S,
                                                                    nheads, hd, rot_dims / 2, from, norm, eps);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_qk_prep_backward(float* dx, float* dgain, const float* dout, const T* x, const float* gain,
                                    const float* rstd, const uint8_t* reset, const float* cos_sin, int N_tok, int S,
                                    int nheads, int hd, int rot_dims, bool norm, float* scratch, cudaStream_t st) {
  if (N_tok <= 0 || nheads <= 0 || hd <= 0) return cudaSuccess;
  if (S < 1 || rot_dims < 0 || rot_dims > hd) return cudaErrorInvalidValue;
  const bool with_gain = norm && gain && dgain;
  if (with_gain && !qk_prep_backward_supported(hd)) return cudaErrorInvalidValue;
  const size_t rows = size_t(N_tok) * nheads;
  const size_t nchunks = (rows + kQkChunkRows - 1) / kQkChunkRows;
  const unsigned grid = unsigned(nchunks < kMaxBlocks ? nchunks : kMaxBlocks);
  const size_t smem = with_gain ? size_t(hd) * kWarpsPerBlock * sizeof(float) : 0;
  float* partial = with_gain ? scratch : nullptr;
  const int from = reset ? hd / 2 : hd;
  const bool regs = with_qk_regs_shape(hd, rot_dims / 2, rows, [&](auto vpl, auto hp) {
    constexpr int VPL = decltype(vpl)::value, HP = decltype(hp)::value;
    qk_prep_bwd_regs_kernel<T, VPL, HP><<<grid, kThreads, smem, st>>>(dx, partial, dout, x, gain, rstd, reset,
                                                                     cos_sin, N_tok, S, nheads, from, norm);
  });
  if (!regs)
    qk_prep_bwd_kernel<T><<<grid, kThreads, smem, st>>>(dx, partial, dout, x, gain, rstd, reset, cos_sin, N_tok, S,
                                                        nheads, hd, rot_dims / 2, from, norm);
  if (with_gain)
    qk_dgain_final_kernel<<<unsigned((hd + kThreads - 1) / kThreads), kThreads, 0, st>>>(dgain, scratch, nchunks, hd);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_xsa_forward(T* z, const T* y, const T* v, int N_tok, int H, int KV, int hd, cudaStream_t st) {
  if (N_tok <= 0 || H <= 0 || KV <= 0 || hd <= 0) return cudaSuccess;
  if (H % KV != 0) return cudaErrorInvalidValue;
  xsa_fwd_kernel<T><<<grid_for_rows(size_t(N_tok) * H), kThreads, 0, st>>>(z, y, v, N_tok, H, KV, hd,
                                                                          float(cpu::kXsaEps));
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_xsa_backward(float* dy, float* dv, const float* dz, const T* y, const T* v, int N_tok, int H,
                                int KV, int hd, cudaStream_t st) {
  if (N_tok <= 0 || H <= 0 || KV <= 0 || hd <= 0) return cudaSuccess;
  if (H % KV != 0) return cudaErrorInvalidValue;
  xsa_bwd_kernel<T><<<grid_for_rows(size_t(N_tok) * KV), kThreads, 0, st>>>(dy, dv, dz, y, v, N_tok, H, KV, hd,
                                                                           float(cpu::kXsaEps));
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_head_gate_forward(T* out, float* factor, const T* x, const float* logit, int N_tok, int H, int hd,
                                     cudaStream_t st) {
  if (N_tok <= 0 || H <= 0 || hd < 0) return cudaSuccess;
  head_gate_fwd_kernel<T><<<grid_for_rows(size_t(N_tok) * H), kThreads, 0, st>>>(out, factor, x, logit, N_tok, H,
                                                                                hd);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_head_gate_backward(float* dx, float* dlogit, const float* dout, const T* x, const float* factor,
                                      int N_tok, int H, int hd, cudaStream_t st) {
  if (N_tok <= 0 || H <= 0 || hd < 0) return cudaSuccess;
  head_gate_bwd_kernel<T><<<grid_for_rows(size_t(N_tok) * H), kThreads, 0, st>>>(dx, dlogit, dout, x, factor,
                                                                                N_tok, H, hd);
  return cudaGetLastError();
}

}  // namespace

cudaError_t qk_prep_forward(float* out, float* rstd, const float* x, const float* gain, const uint8_t* reset,
                            const float* cos_sin, int N_tok, int S, int nheads, int hd, int rot_dims, bool norm,
                            float eps, cudaStream_t st) {
  return launch_qk_prep_forward(out, rstd, x, gain, reset, cos_sin, N_tok, S, nheads, hd, rot_dims, norm, eps, st);
}

cudaError_t qk_prep_forward_bf16(uint16_t* out, float* rstd, const uint16_t* x, const float* gain,
                                 const uint8_t* reset, const float* cos_sin, int N_tok, int S, int nheads, int hd,
                                 int rot_dims, bool norm, float eps, cudaStream_t st) {
  return launch_qk_prep_forward(as_bf16(out), rstd, as_bf16(x), gain, reset, cos_sin, N_tok, S, nheads, hd, rot_dims,
                                norm, eps, st);
}

size_t qk_prep_backward_scratch_floats(int N_tok, int nheads, int hd) {
  const size_t rows = size_t(N_tok > 0 ? N_tok : 0) * size_t(nheads > 0 ? nheads : 0);
  return (rows + kQkChunkRows - 1) / kQkChunkRows * size_t(hd > 0 ? hd : 0);
}

bool qk_prep_backward_supported(int hd) { return hd >= 1 && size_t(hd) * kWarpsPerBlock * sizeof(float) <= 48 * 1024; }

cudaError_t qk_prep_backward(float* dx, float* dgain, const float* dout, const float* x, const float* gain,
                             const float* rstd, const uint8_t* reset, const float* cos_sin, int N_tok, int S,
                             int nheads, int hd, int rot_dims, bool norm, float* scratch, cudaStream_t st) {
  return launch_qk_prep_backward(dx, dgain, dout, x, gain, rstd, reset, cos_sin, N_tok, S, nheads, hd, rot_dims, norm,
                                 scratch, st);
}

cudaError_t qk_prep_backward_bf16(float* dx, float* dgain, const float* dout, const uint16_t* x, const float* gain,
                                  const float* rstd, const uint8_t* reset, const float* cos_sin, int N_tok, int S,
                                  int nheads, int hd, int rot_dims, bool norm, float* scratch, cudaStream_t st) {
  return launch_qk_prep_backward(dx, dgain, dout, as_bf16(x), gain, rstd, reset, cos_sin, N_tok, S, nheads, hd,
                                 rot_dims, norm, scratch, st);
}

cudaError_t xsa_forward(float* z, const float* y, const float* v, int N_tok, int H, int KV, int hd,
                        cudaStream_t st) {
  return launch_xsa_forward(z, y, v, N_tok, H, KV, hd, st);
}

cudaError_t xsa_forward_bf16(uint16_t* z, const uint16_t* y, const uint16_t* v, int N_tok, int H, int KV, int hd,
                             cudaStream_t st) {
  return launch_xsa_forward(as_bf16(z), as_bf16(y), as_bf16(v), N_tok, H, KV, hd, st);
}

cudaError_t xsa_backward(float* dy, float* dv, const float* dz, const float* y, const float* v, int N_tok, int H,
                         int KV, int hd, cudaStream_t st) {
  return launch_xsa_backward(dy, dv, dz, y, v, N_tok, H, KV, hd, st);
}

cudaError_t xsa_backward_bf16(float* dy, float* dv, const float* dz, const uint16_t* y, const uint16_t* v, int N_tok,
                              int H, int KV, int hd, cudaStream_t st) {
  return launch_xsa_backward(dy, dv, dz, as_bf16(y), as_bf16(v), N_tok, H, KV, hd, st);
}

cudaError_t head_gate_forward(float* out, float* factor, const float* x, const float* logit, int N_tok, int H,
                              int hd, cudaStream_t st) {
  return launch_head_gate_forward(out, factor, x, logit, N_tok, H, hd, st);
}

cudaError_t head_gate_forward_bf16(uint16_t* out, float* factor, const uint16_t* x, const float* logit, int N_tok,
                                   int H, int hd, cudaStream_t st) {
  return launch_head_gate_forward(as_bf16(out), factor, as_bf16(x), logit, N_tok, H, hd, st);
}

cudaError_t head_gate_backward(float* dx, float* dlogit, const float* dout, const float* x, const float* factor,
                               int N_tok, int H, int hd, cudaStream_t st) {
  return launch_head_gate_backward(dx, dlogit, dout, x, factor, N_tok, H, hd, st);
}

cudaError_t head_gate_backward_bf16(float* dx, float* dlogit, const float* dout, const uint16_t* x,
                                    const float* factor, int N_tok, int H, int hd, cudaStream_t st) {
  return launch_head_gate_backward(dx, dlogit, dout, as_bf16(x), factor, N_tok, H, hd, st);
}

cudaError_t silu_forward(float* a, const float* u, size_t n, cudaStream_t st) {
  if (!n) return cudaSuccess;
  silu_fwd_kernel<<<grid_for(n), kThreads, 0, st>>>(a, u, n);
  return cudaGetLastError();
}

cudaError_t silu_backward(float* du, const float* da, const float* u, size_t n, cudaStream_t st) {
  if (!n) return cudaSuccess;
  silu_bwd_kernel<<<grid_for(n), kThreads, 0, st>>>(du, da, u, n);
  return cudaGetLastError();
}

cudaError_t sigmoid_gate_forward(float* y, float* g, const float* x, size_t n, cudaStream_t st) {
  if (!n) return cudaSuccess;
  sigmoid_gate_fwd_kernel<float><<<grid_for(n), kThreads, 0, st>>>(y, g, x, n);
  return cudaGetLastError();
}

cudaError_t sigmoid_gate_forward_bf16(uint16_t* y, float* g, const float* x, size_t n, cudaStream_t st) {
  if (!n) return cudaSuccess;
  sigmoid_gate_fwd_kernel<bf16><<<grid_for(n), kThreads, 0, st>>>(as_bf16(y), g, x, n);
  return cudaGetLastError();
}

cudaError_t sigmoid_gate_backward(float* dx, float* dg, const float* dy, const float* x, const float* s, size_t n,
                                  bool accumulate_dx, cudaStream_t st) {
  if (!n) return cudaSuccess;
  sigmoid_gate_bwd_kernel<<<grid_for(n), kThreads, 0, st>>>(dx, dg, dy, x, s, n, accumulate_dx);
  return cudaGetLastError();
}

}  // namespace ladder::cuda::k
