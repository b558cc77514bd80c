// Flash-style causal attention in fp32 on the CUDA cores: online softmax over key tiles, lse saved,
// causal + sliding window + GQA, no S x S matrix anywhere. Correctness first (docs/cuda.md): the
// tensor-core (bf16, wgmma) version is the next step; this one is the reference it will be held to.
//
// Layout of the work: a group of T = HDMAX/32 consecutive lanes owns one row (a query row in the
// forward and dQ kernels, a key row in the dK/dV kernel); lane t of the group holds the 32 dims
// d = t + T*k (k < 32) in registers. Dot products are reduced over the group with xor shuffles, so
// every lane of the group ends with the same bits. Interleaving the dims (rather than giving each
// lane a contiguous 32-dim slice) makes the group's shared-memory reads of one K/V row hit T
// consecutive banks: conflict-free, while the other groups read the same row (broadcast).
//
// Backward without atomics (deterministic): D_i = dO_i . O_i first, then one kernel that owns key
// rows and sums over all query rows of all heads of the KV group (dK, dV), then one that owns query
// rows (dQ). The probabilities are recomputed in both from q, k and lse.
//
// bf16 activations (model.attn_bf16): every kernel is templated on the storage type E of q, k, v and
// o (float or __nv_bfloat16); dout, lse, D and the gradients are fp32 either way. Rows and tiles are
// widened as they are loaded into registers / shared memory (exact: the tiles stay fp32), and the
// forward rounds o to nearest even as it stores it. The bf16 instantiation is therefore the fp32
// kernel's arithmetic on the widened inputs, with no widening pass and no scratch copy; the fp32
// instantiation is the kernel as it was. The backward reads the bf16 o (D = dO . o), as the contract
// asks: the rounded value the next op saw.
#include <cmath>

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/kernels.cuh"

namespace ladder::cuda::k {

namespace {

using cpu::AttnShape;

constexpr int kThreads = 128;  // per block, every kernel here
constexpr int kTile = 32;      // keys per shared-memory tile (forward, dQ); queries per tile (dK/dV)

template <int T>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = T / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ int key_lo(int i, int window) { return window > 0 ? max(0, i - window + 1) : 0; }
__device__ __forceinline__ bool visible(int i, int j, int window) {
  return j <= i && (window <= 0 || i - j < window);
}

// Rows [r0, r0 + kTile) of a [B*S, nh*hd] tensor (head `head`, batch b; fp32, or bf16 widened) into
// smem [kTile][HDMAX], zero beyond hd and beyond S.
template <int HDMAX, class E>
__device__ void load_tile(float (*dst)[HDMAX], const E* src, int b, int S, int nh, int head, int hd, int r0) {
  for (int idx = threadIdx.x; idx < kTile * HDMAX; idx += blockDim.x) {
    const int r = idx / HDMAX, d = idx % HDMAX, row = r0 + r;
    dst[r][d] = (row < S && d < hd) ? widen(src[((size_t(b) * S + row) * nh + head) * hd + d]) : 0.f;
  }
}

template <int HDMAX, class E>
__device__ void load_row(float (&reg)[32], const E* src, int b, int S, int nh, int head, int hd, int row, int t) {
  constexpr int T = HDMAX / 32;
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    const int d = t + T * k;
    reg[k] = (row < S && d < hd && d < HDMAX) ? widen(src[((size_t(b) * S + row) * nh + head) * hd + d]) : 0.f;
  }
}

// reg * mul, rounded to E (fp32: as is; bf16: nearest even).
template <int HDMAX, class E>
__device__ void store_row(E* dst, const float (&reg)[32], float mul, int b, int S, int nh, int head, int hd, int row,
                          int t) {
  constexpr int T = HDMAX / 32;
  if (row >= S) return;
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    const int d = t + T * k;
    if (d < hd && d < HDMAX) store_rn(dst[((size_t(b) * S + row) * nh + head) * hd + d], reg[k] * mul);
  }
}

template <int HDMAX>
__device__ __forceinline__ float dot_row(const float (&reg)[32], const float* srow, int t) {
  constexpr int T = HDMAX / 32;
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < 32; ++k) acc += reg[k] * srow[t + T * k];
  return group_sum<T>(acc);
}

// ---------------------------------------------------------------------------------------------
// Forward: grid (query tiles, H, B); each group of T lanes owns one query row.

template <int HDMAX, class E>
__global__ void __launch_bounds__(kThreads) attn_fwd_kernel(E* o, float* lse, const E* q, const E* k, const E* v,
                                                            AttnShape sh) {
  constexpr int T = HDMAX / 32, ROWS = kThreads / T;
  __shared__ float Ks[kTile][HDMAX];
  __shared__ float Vs[kTile][HDMAX];
  const int S = sh.S, H = sh.H, KV = sh.KV, hd = sh.hd, W = sh.window;
  const int b = blockIdx.z, h = blockIdx.y, g = h / (H / KV);
  const int i0 = blockIdx.x * ROWS;
  const int t = threadIdx.x % T, i = i0 + threadIdx.x / T;
  const float scale = float(sh.scale);

  float qr[32], acc[32];
  load_row<HDMAX>(qr, q, b, S, H, h, hd, i, t);
#pragma unroll
  for (int x = 0; x < 32; ++x) acc[x] = 0.f;
  float m = -INFINITY, l = 0.f;

  const int i_last = min(S, i0 + ROWS) - 1;
  for (int k0 = key_lo(i0, W); k0 <= i_last; k0 += kTile) {
    __syncthreads();  // the previous tile is no longer read
    load_tile<HDMAX>(Ks, k, b, S, KV, g, hd, k0);
    load_tile<HDMAX>(Vs, v, b, S, KV, g, hd, k0);
    __syncthreads();
    float s[kTile];
    float mt = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < kTile; ++jj) {
      const float d = dot_row<HDMAX>(qr, Ks[jj], t);  // every lane takes part in the shuffles
      const int j = k0 + jj;
      s[jj] = (i < S && j < S && visible(i, j, W)) ? scale * d : -INFINITY;
      mt = fmaxf(mt, s[jj]);
    }
    const float mnew = fmaxf(m, mt);
    // Nothing visible yet for this row (rows past S, or a window's first tiles): no shuffles follow,
    // so skipping is safe; the __syncthreads at the loop's top is still reached by every thread.
    if (mnew == -INFINITY) continue;
    const float corr = m == -INFINITY ? 0.f : expf(m - mnew);
    l *= corr;
#pragma unroll
    for (int x = 0; x < 32; ++x) acc[x] *= corr;
#pragma unroll
    for (int jj = 0; jj < kTile; ++jj) {
      const float p = expf(s[jj] - mnew);  // exp(-inf) = 0 for masked keys
      l += p;
#pragma unroll
      for (int x = 0; x < 32; ++x) acc[x] += p * Vs[jj][t + T * x];
    }
    m = mnew;
  }
  if (i < S) {
    store_row<HDMAX>(o, acc, 1.f / l, b, S, H, h, hd, i, t);
    if (t == 0) lse[(size_t(b) * H + h) * S + i] = m + logf(l);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward 1: Dv[b, h, i] = dO_i . O_i (one warp per row).

template <class E>
__global__ void attn_bwd_dot_kernel(float* Dv, const float* dout, const E* o, AttnShape sh) {
  const int warps = blockDim.x / 32;
  const size_t rows = size_t(sh.B) * sh.S * sh.H;
  for (size_t r = size_t(blockIdx.x) * warps + threadIdx.x / 32; r < rows; r += size_t(gridDim.x) * warps) {
    // r enumerates [B, S, H] (the memory order of dout/o rows); Dv is [B, H, S] like lse.
    const int h = int(r % sh.H);
    const size_t bs = r / sh.H;
    const int i = int(bs % sh.S), b = int(bs / sh.S);
    const float* a = dout + r * sh.hd;
    const E* c = o + r * sh.hd;
    float acc = 0.f;
    for (int d = threadIdx.x % 32; d < sh.hd; d += 32) acc += a[d] * widen(c[d]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (threadIdx.x % 32 == 0) Dv[(size_t(b) * sh.H + h) * sh.S + i] = acc;
  }
}

// Backward 2: dK, dV. Grid (key tiles, KV, B); each group of T lanes owns one key row j and walks the
// query rows that see it (i in [j, j + window)) of every head of its KV group, in head order.
template <int HDMAX, class E>
__global__ void __launch_bounds__(kThreads) attn_bwd_dkdv_kernel(float* dk, float* dv, const float* dout, const E* q,
                                                                 const E* k, const E* v, const float* lse,
                                                                 const float* Dv, AttnShape sh) {
  constexpr int T = HDMAX / 32, ROWS = kThreads / T;
  __shared__ float Qs[kTile][HDMAX];
  __shared__ float dOs[kTile][HDMAX];
  __shared__ float Ls[kTile], Ds[kTile];
  const int S = sh.S, H = sh.H, KV = sh.KV, hd = sh.hd, W = sh.window, G = H / KV;
  const int b = blockIdx.z, g = blockIdx.y;
  const int j0 = blockIdx.x * ROWS;
  const int t = threadIdx.x % T, j = j0 + threadIdx.x / T;
  const float scale = float(sh.scale);

  float kr[32], vr[32], dkr[32], dvr[32];
  load_row<HDMAX>(kr, k, b, S, KV, g, hd, j, t);
  load_row<HDMAX>(vr, v, b, S, KV, g, hd, j, t);
#pragma unroll
  for (int x = 0; x < 32; ++x) dkr[x] = dvr[x] = 0.f;

  const int j_last = min(S, j0 + ROWS) - 1;
  // Queries that see some key of this block: [j0, j_last + window - 1] (all later ones when causal).
  const int q_end = W > 0 ? min(S, j_last + W) : S;
  for (int hh = 0; hh < G; ++hh) {
    const int h = g * G + hh;
    for (int q0 = j0; q0 < q_end; q0 += kTile) {
      __syncthreads();
      load_tile<HDMAX>(Qs, q, b, S, H, h, hd, q0);
      load_tile<HDMAX>(dOs, dout, b, S, H, h, hd, q0);
      if (threadIdx.x < kTile) {
        const int i = q0 + threadIdx.x;
        Ls[threadIdx.x] = i < S ? lse[(size_t(b) * H + h) * S + i] : 0.f;
        Ds[threadIdx.x] = i < S ? Dv[(size_t(b) * H + h) * S + i] : 0.f;
      }
      __syncthreads();
      for (int ii = 0; ii < kTile; ++ii) {
        const int i = q0 + ii;
        // Every lane of the warp runs the shuffles (a full-mask shuffle needs all 32 lanes); pairs
        // that are not visible get p = 0 and so contribute nothing.
        const bool vis = j < S && i < S && visible(i, j, W);
        const float s = scale * dot_row<HDMAX>(kr, Qs[ii], t);
        const float p = vis ? expf(s - Ls[ii]) : 0.f;
        const float dp = dot_row<HDMAX>(vr, dOs[ii], t);
        const float ds = p * (dp - Ds[ii]);
#pragma unroll
        for (int x = 0; x < 32; ++x) {
          dvr[x] += p * dOs[ii][t + T * x];
          dkr[x] += scale * ds * Qs[ii][t + T * x];
        }
      }
    }
  }
  store_row<HDMAX>(dk, dkr, 1.f, b, S, KV, g, hd, j, t);
  store_row<HDMAX>(dv, dvr, 1.f, b, S, KV, g, hd, j, t);
}

// Backward 3: dQ. Grid (query tiles, H, B); each group of T lanes owns one query row.
template <int HDMAX, class E>
__global__ void __launch_bounds__(kThreads) attn_bwd_dq_kernel(float* dq, const float* dout, const E* q, const E* k,
                                                               const E* v, const float* lse, const float* Dv,
                                                               AttnShape sh) {
  constexpr int T = HDMAX / 32, ROWS = kThreads / T;
  __shared__ float Ks[kTile][HDMAX];
  __shared__ float Vs[kTile][HDMAX];
  const int S = sh.S, H = sh.H, KV = sh.KV, hd = sh.hd, W = sh.window;
  const int b = blockIdx.z, h = blockIdx.y, g = h / (H / KV);
  const int i0 = blockIdx.x * ROWS;
  const int t = threadIdx.x % T, i = i0 + threadIdx.x / T;
  const float scale = float(sh.scale);

  float qr[32], dor[32], dqr[32];
  load_row<HDMAX>(qr, q, b, S, H, h, hd, i, t);
  load_row<HDMAX>(dor, dout, b, S, H, h, hd, i, t);
#pragma unroll
  for (int x = 0; x < 32; ++x) dqr[x] = 0.f;
  const float li = i < S ? lse[(size_t(b) * H + h) * S + i] : 0.f;
  const float Di = i < S ? Dv[(size_t(b) * H + h) * S + i] : 0.f;

  const int i_last = min(S, i0 + ROWS) - 1;
  for (int k0 = key_lo(i0, W); k0 <= i_last; k0 += kTile) {
    __syncthreads();
    load_tile<HDMAX>(Ks, k, b, S, KV, g, hd, k0);
    load_tile<HDMAX>(Vs, v, b, S, KV, g, hd, k0);
    __syncthreads();
    for (int jj = 0; jj < kTile; ++jj) {
      const int j = k0 + jj;
      const bool vis = i < S && j < S && visible(i, j, W);  // no early exit: shuffles need all lanes
      const float s = scale * dot_row<HDMAX>(qr, Ks[jj], t);
      const float p = vis ? expf(s - li) : 0.f;
      const float dp = dot_row<HDMAX>(dor, Vs[jj], t);
      const float ds = p * (dp - Di);
#pragma unroll
      for (int x = 0; x < 32; ++x) dqr[x] += scale * ds * Ks[jj][t + T * x];
    }
  }
  store_row<HDMAX>(dq, dqr, 1.f, b, S, H, h, hd, i, t);
}

template <int HDMAX, class E>
cudaError_t fwd(E* o, float* lse, const E* q, const E* k, const E* v, const AttnShape& s, cudaStream_t st) {
  constexpr int ROWS = kThreads / (HDMAX / 32);
  dim3 grid(unsigned((s.S + ROWS - 1) / ROWS), unsigned(s.H), unsigned(s.B));
  attn_fwd_kernel<HDMAX, E><<<grid, kThreads, 0, st>>>(o, lse, q, k, v, s);
  return cudaGetLastError();
}

template <int HDMAX, class E>
cudaError_t bwd(float* dq, float* dk, float* dv, const float* dout, const E* q, const E* k, const E* v,
                const float* lse, const float* Dv, const AttnShape& s, cudaStream_t st) {
  constexpr int ROWS = kThreads / (HDMAX / 32);
  dim3 gkv(unsigned((s.S + ROWS - 1) / ROWS), unsigned(s.KV), unsigned(s.B));
  attn_bwd_dkdv_kernel<HDMAX, E><<<gkv, kThreads, 0, st>>>(dk, dv, dout, q, k, v, lse, Dv, s);
  dim3 gq(unsigned((s.S + ROWS - 1) / ROWS), unsigned(s.H), unsigned(s.B));
  attn_bwd_dq_kernel<HDMAX, E><<<gq, kThreads, 0, st>>>(dq, dout, q, k, v, lse, Dv, s);
  return cudaGetLastError();
}

template <class E>
cudaError_t forward(E* o, float* lse, const E* q, const E* k, const E* v, const AttnShape& s, cudaStream_t st) {
  if (s.B <= 0 || s.S <= 0 || s.H <= 0) return cudaSuccess;
  if (!attention_supported(s.hd) || s.KV <= 0 || s.H % s.KV != 0) return cudaErrorInvalidValue;
  if (s.hd <= 32) return fwd<32>(o, lse, q, k, v, s, st);
  if (s.hd <= 64) return fwd<64>(o, lse, q, k, v, s, st);
  return fwd<128>(o, lse, q, k, v, s, st);
}

template <class E>
cudaError_t backward(float* dq, float* dk, float* dv, const float* dout, const E* q, const E* k, const E* v,
                     const E* o, const float* lse, const AttnShape& s, float* scratch, cudaStream_t st) {
  if (s.B <= 0 || s.S <= 0 || s.H <= 0) return cudaSuccess;
  if (!attention_supported(s.hd) || s.KV <= 0 || s.H % s.KV != 0) return cudaErrorInvalidValue;
  const size_t rows = size_t(s.B) * s.S * s.H;
  const size_t blocks = (rows + 7) / 8;  // 8 warps of 32 per block, one row per warp
  attn_bwd_dot_kernel<E><<<unsigned(blocks < 65536 ? blocks : 65536), 256, 0, st>>>(scratch, dout, o, s);
  if (s.hd <= 32) return bwd<32>(dq, dk, dv, dout, q, k, v, lse, scratch, s, st);
  if (s.hd <= 64) return bwd<64>(dq, dk, dv, dout, q, k, v, lse, scratch, s, st);
  return bwd<128>(dq, dk, dv, dout, q, k, v, lse, scratch, s, st);
}

}  // namespace

bool attention_supported(int hd) { return hd >= 1 && hd <= 128; }

cudaError_t attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                              const AttnShape& s, cudaStream_t st) {
  return forward(o, lse, q, k, v, s, st);
}

cudaError_t attention_forward_bf16(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                   const AttnShape& s, cudaStream_t st) {
  return forward(as_bf16(o), lse, as_bf16(q), as_bf16(k), as_bf16(v), s, st);
}

size_t attention_backward_scratch_floats(const AttnShape& s) { return size_t(s.B) * s.H * s.S; }

cudaError_t attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                               const float* v, const float* o, const float* lse, const AttnShape& s,
                               float* scratch, cudaStream_t st) {
  return backward(dq, dk, dv, dout, q, k, v, o, lse, s, scratch, st);
}

cudaError_t attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const uint16_t* q,
                                    const uint16_t* k, const uint16_t* v, const uint16_t* o, const float* lse,
                                    const AttnShape& s, float* scratch, cudaStream_t st) {
  return backward(dq, dk, dv, dout, as_bf16(q), as_bf16(k), as_bf16(v), as_bf16(o), lse, s, scratch, st);
}

}  // namespace ladder::cuda::k
