// CUDA kernels of the recipe's attention switches and GatedNorm's elementwise parts, fp32: partial
// key offset (PKO), exclusive self attention (XSA), the per-head output gate, SiLU and the sigmoid
// gate. Contracts: backend/cpu/kernels.h (CPU code in backend/cpu/attn_switch_kernels.cpp).
//
// All of them are memory-bound passes over [tokens, heads * hd] arrays. Elementwise ops use
// grid-stride loops with size_t indices; the ops that need a per-head dot product (XSA, the gate's
// backward) give one warp to one head row: the lanes stride over the row's hd values, a shuffle
// tree sums the dot product (fixed order: deterministic, no atomics), and each lane then writes only
// the elements it read itself, which is what makes the allowed in-place calls (z == y, dy == dz,
// dx == dout, out == x) safe without shared memory or block barriers.
#include "backend/cpu/kernels.h"
#include "backend/cuda/switch_optim_ops.cuh"

namespace ladder::cuda::k {

namespace {

constexpr int kThreads = 256;             // 8 warps per block
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr size_t kMaxBlocks = 65536;      // grid-stride loops cover the rest

inline unsigned grid_for(size_t n) {
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return unsigned(blocks < kMaxBlocks ? (blocks ? blocks : 1) : kMaxBlocks);
}
// One warp per row.
inline unsigned grid_for_rows(size_t rows) {
  const size_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return unsigned(blocks < kMaxBlocks ? (blocks ? blocks : 1) : kMaxBlocks);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
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
// Exclusive self attention: z = y - (y.v / (v.v + eps)) v per query head (see kernels.h).

__global__ void xsa_fwd_kernel(float* z, const float* y, const float* v, int N_tok, int H, int KV, int hd,
                               float eps) {
  const int lane = threadIdx.x & 31;
  const int G = H / KV;
  const size_t rows = size_t(N_tok) * H;
  LADDER_FOR_EACH_WARP_ROW(r, rows) {
    const size_t t = r / H;
    const int h = int(r - t * H);
    const float* yr = y + r * hd;
    const float* vr = v + (t * KV + h / G) * hd;
    float* zr = z + r * hd;
    float yv = 0.f, vv = 0.f;
    for (int c = lane; c < hd; c += 32) {
      yv += yr[c] * vr[c];
      vv += vr[c] * vr[c];
    }
    yv = warp_sum(yv);
    vv = warp_sum(vv);
    const float coef = yv / (vv + eps);
    for (int c = lane; c < hd; c += 32) zr[c] = yr[c] - coef * vr[c];
  }
}

// One warp per (token, KV group): dv of the group is owned by this warp, which adds the G heads'
// contributions in head order (the CPU's order), so no atomics and no cross-warp reduction.
__global__ void xsa_bwd_kernel(float* dy, float* dv, const float* dz, const float* y, const float* v, int N_tok,
                               int H, int KV, int hd, float eps) {
  const int lane = threadIdx.x & 31;
  const int G = H / KV;
  const size_t groups = size_t(N_tok) * KV;
  LADDER_FOR_EACH_WARP_ROW(r, groups) {
    const size_t t = r / KV;
    const int g = int(r - t * KV);
    const float* vr = v + r * hd;
    float* dvr = dv + r * hd;
    float vv = 0.f;
    for (int c = lane; c < hd; c += 32) vv += vr[c] * vr[c];
    const float n = warp_sum(vv) + eps;
    for (int j = 0; j < G; ++j) {
      const size_t hr = t * H + size_t(g) * G + j;  // the query head's row
      const float* yr = y + hr * hd;
      const float* dzr = dz + hr * hd;
      float* dyr = dy + hr * hd;
      float yv = 0.f, a = 0.f;
      for (int c = lane; c < hd; c += 32) {
        yv += yr[c] * vr[c];
        a += dzr[c] * vr[c];
      }
      yv = warp_sum(yv);
      a = warp_sum(a);
      const float coef = yv / n, an = a / n, vcoef = 2.f * a * coef / n;
      for (int c = lane; c < hd; c += 32) {
        const float dzc = dzr[c];  // read before dy[c] is written: dy may alias dz
        const float prev = j == 0 ? 0.f : dvr[c];
        dvr[c] = prev + (-coef * dzc - an * yr[c] + vcoef * vr[c]);
        dyr[c] = dzc - an * vr[c];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Per-head output gate, one warp per (token, head) row. Forward needs no reduction, but a row per
// warp also writes factor when hd == 0, as the CPU does.

__global__ void head_gate_fwd_kernel(float* out, float* factor, const float* x, const float* logit, int N_tok,
                                     int H, int hd) {
  const int lane = threadIdx.x & 31;
  const size_t rows = size_t(N_tok) * H;
  LADDER_FOR_EACH_WARP_ROW(r, rows) {
    const float f = 2.f * sigmoid_f(logit[r]);
    if (lane == 0) factor[r] = f;
    const float* xr = x + r * hd;
    float* orow = out + r * hd;
    for (int c = lane; c < hd; c += 32) orow[c] = xr[c] * f;
  }
}

__global__ void head_gate_bwd_kernel(float* dx, float* dlogit, const float* dout, const float* x,
                                     const float* factor, int N_tok, int H, int hd) {
  const int lane = threadIdx.x & 31;
  const size_t rows = size_t(N_tok) * H;
  LADDER_FOR_EACH_WARP_ROW(r, rows) {
    const float f = factor[r];
    const float* dor = dout + r * hd;
    const float* xr = x + r * hd;
    float* dxr = dx + r * hd;
    float s = 0.f;
    for (int c = lane; c < hd; c += 32) s += dor[c] * xr[c];
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

__global__ void sigmoid_gate_fwd_kernel(float* y, float* g, const float* x, size_t n) {
  LADDER_GRID_STRIDE(i, n) {
    const float s = sigmoid_f(g[i]);
    g[i] = s;
    y[i] = x[i] * s;
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

cudaError_t xsa_forward(float* z, const float* y, const float* v, int N_tok, int H, int KV, int hd,
                        cudaStream_t st) {
  if (N_tok <= 0 || H <= 0 || KV <= 0 || hd <= 0) return cudaSuccess;
  if (H % KV != 0) return cudaErrorInvalidValue;
  xsa_fwd_kernel<<<grid_for_rows(size_t(N_tok) * H), kThreads, 0, st>>>(z, y, v, N_tok, H, KV, hd,
                                                                       float(cpu::kXsaEps));
  return cudaGetLastError();
}

cudaError_t xsa_backward(float* dy, float* dv, const float* dz, const float* y, const float* v, int N_tok, int H,
                         int KV, int hd, cudaStream_t st) {
  if (N_tok <= 0 || H <= 0 || KV <= 0 || hd <= 0) return cudaSuccess;
  if (H % KV != 0) return cudaErrorInvalidValue;
  xsa_bwd_kernel<<<grid_for_rows(size_t(N_tok) * KV), kThreads, 0, st>>>(dy, dv, dz, y, v, N_tok, H, KV, hd,
                                                                        float(cpu::kXsaEps));
  return cudaGetLastError();
}

cudaError_t head_gate_forward(float* out, float* factor, const float* x, const float* logit, int N_tok, int H,
                              int hd, cudaStream_t st) {
  if (N_tok <= 0 || H <= 0 || hd < 0) return cudaSuccess;
  head_gate_fwd_kernel<<<grid_for_rows(size_t(N_tok) * H), kThreads, 0, st>>>(out, factor, x, logit, N_tok, H, hd);
  return cudaGetLastError();
}

cudaError_t head_gate_backward(float* dx, float* dlogit, const float* dout, const float* x, const float* factor,
                               int N_tok, int H, int hd, cudaStream_t st) {
  if (N_tok <= 0 || H <= 0 || hd < 0) return cudaSuccess;
  head_gate_bwd_kernel<<<grid_for_rows(size_t(N_tok) * H), kThreads, 0, st>>>(dx, dlogit, dout, x, factor, N_tok,
                                                                             H, hd);
  return cudaGetLastError();
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
  sigmoid_gate_fwd_kernel<<<grid_for(n), kThreads, 0, st>>>(y, g, x, n);
  return cudaGetLastError();
}

cudaError_t sigmoid_gate_backward(float* dx, float* dg, const float* dy, const float* x, const float* s, size_t n,
                                  bool accumulate_dx, cudaStream_t st) {
  if (!n) return cudaSuccess;
  sigmoid_gate_bwd_kernel<<<grid_for(n), kThreads, 0, st>>>(dx, dg, dy, x, s, n, accumulate_dx);
  return cudaGetLastError();
}

}  // namespace ladder::cuda::k
