// CUDA kernels of the memory-bound ops (everything but GEMM and attention), fp32. Contracts are the
// CPU kernels' (backend/cpu/kernels.h). Every reduction runs in an order fixed by the problem size
// (fixed grids, fixed chunking, tree reductions in shared memory): no floating-point atomics, so
// results are reproducible run to run on one device.
//
// Fast paths (memory-bound kernels; set_reference_paths in kernels.cuh turns them off for tests):
// elementwise kernels move 16 bytes per load / store (for_each_vec, device_common.cuh) when every
// pointer is 16-byte aligned, with a scalar tail; RMSNorm's forward keeps a row's values in
// registers between its two passes when D <= kThreads * kMaxRegsPerThread, and its backward's first
// pass loads the row into registers the same way. Neither changes which thread sums which elements
// in which order, nor any per-element expression: the results are bitwise the scalar reference
// path's (CudaEmu.*MatchReferenceBitwise).
#include <cuda_bf16.h>

#include <cub/device/device_radix_sort.cuh>

#include <type_traits>

#include "backend/cuda/kernels.cuh"
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/optim_math.cuh"

namespace ladder::cuda::k {

namespace {

constexpr int kThreads = 256;
static_assert(kThreads == 256, "grid_for (device_common.cuh) sizes grids for 256-thread blocks by default");

// Block-wide sum in a fixed tree order; every thread gets the result. `red` holds 32 values.
template <class T>
__device__ T block_sum(T v, T* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T r = lane < nwarps ? red[lane] : T(0);
  return warp_sum(r);
}

__device__ float block_max(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? red[lane] : -INFINITY;
  return warp_max(r);
}

// ---------------------------------------------------------------------------------------------
// Embedding

__global__ void embedding_fwd_kernel(float* out, const float* table, const int32_t* ids, int N, int D) {
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    const float* src = table + size_t(ids[i]) * D;
    float* dst = out + size_t(i) * D;
    for (int c = threadIdx.x; c < D; c += blockDim.x) dst[c] = src[c];
  }
}

__global__ void iota_kernel(int32_t* v, int N) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < N; i += gridDim.x * blockDim.x) v[i] = i;
}

// One block per sorted position; only the first position of each run of equal ids works. It adds
// the run's rows in token order (the radix sort is stable) onto dtable's row: the CPU's order.
__global__ void embedding_bwd_segments(float* dtable, const float* dout, const uint32_t* sorted_ids,
                                       const int32_t* sorted_tok, int N, int D) {
  for (int p = blockIdx.x; p < N; p += gridDim.x) {
    const uint32_t id = sorted_ids[p];
    if (p > 0 && sorted_ids[p - 1] == id) continue;
    int end = p + 1;
    while (end < N && sorted_ids[end] == id) ++end;
    float* dst = dtable + size_t(id) * D;
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
      float acc = dst[c];
      for (int q = p; q < end; ++q) acc += dout[size_t(sorted_tok[q]) * D + c];
      dst[c] = acc;
    }
  }
}

struct EmbScratch {
  uint32_t* keys_out;
  int32_t* tok_in;
  int32_t* tok_out;
  void* cub_tmp;
  size_t cub_bytes;
};

inline size_t align256(size_t b) { return (b + 255) / 256 * 256; }

size_t cub_sort_bytes(int N) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                  static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), N);
  return bytes;
}

EmbScratch carve_emb(void* scratch, int N) {
  char* p = static_cast<char*>(scratch);
  EmbScratch s;
  s.keys_out = reinterpret_cast<uint32_t*>(p);
  p += align256(sizeof(uint32_t) * size_t(N));
  s.tok_in = reinterpret_cast<int32_t*>(p);
  p += align256(sizeof(int32_t) * size_t(N));
  s.tok_out = reinterpret_cast<int32_t*>(p);
  p += align256(sizeof(int32_t) * size_t(N));
  s.cub_tmp = p;
  s.cub_bytes = cub_sort_bytes(N);
  return s;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

// TY: the output's storage, float or __nv_bfloat16 (model.norm_bf16: the fp32 result rounded to
// nearest even as it is stored; store_rn, device_common.cuh).
template <class TY>
__global__ void rmsnorm_fwd_kernel(TY* y, float* rstd, const float* x, const float* gain, int N, int D, float eps) {
  __shared__ float red[32];
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    const float* xi = x + size_t(i) * D;
    TY* yi = y + size_t(i) * D;
    float ss = 0.f;
    for (int j = threadIdx.x; j < D; j += blockDim.x) ss += xi[j] * xi[j];
    ss = block_sum(ss, red);
    // The scalar in double, as the CPU computes it.
    const float r = float(1.0 / sqrt(double(ss) / D + double(eps)));
    if (threadIdx.x == 0) rstd[i] = r;
    if (gain) {
      for (int j = threadIdx.x; j < D; j += blockDim.x) store_rn(yi[j], xi[j] * r * gain[j]);
    } else {
      for (int j = threadIdx.x; j < D; j += blockDim.x) store_rn(yi[j], xi[j] * r);
    }
  }
}

// NV = 0: the reference path. NV > 0: the first pass (the row's dot) with the row in registers, as
// rmsnorm_fwd_regs_kernel below: the NV loads of dy, x and gain per thread in flight together
// instead of one loop step at a time, the dot's terms and order unchanged (its only FMA, dot +
// (dy g) x, is the same in any code shape). The second pass is the same loop on either path, reading
// dy and x again (L1 hits after block_sum's barrier): its expressions, g dy - x c and dx + r (...)
// under `acc`, are ones where the compiler's FMA contraction depends on the code around them (a loop
// unswitched on gain or acc; g dy of the dot and of dx one value with two uses when kept in
// registers), and a register version of this pass did not round as the reference does in the
// emulation.
template <int NV>
__global__ void rmsnorm_bwd_dx_kernel(float* dx, const float* dy, const float* x, const float* gain,
                                      const float* rstd, int N, int D, bool acc) {
  __shared__ float red[32];
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    const float* xi = x + size_t(i) * D;
    const float* dyi = dy + size_t(i) * D;
    float* dxi = dx + size_t(i) * D;
    const float r = rstd[i];
    float dot = 0.f;
    if constexpr (NV == 0) {
      for (int j = threadIdx.x; j < D; j += blockDim.x) dot += dyi[j] * (gain ? gain[j] : 1.f) * xi[j];
    } else {
      float xv[NV], dv[NV], gv[NV];
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int j = threadIdx.x + k * kThreads;
        xv[k] = j < D ? xi[j] : 0.f;
        dv[k] = j < D ? dyi[j] : 0.f;
        gv[k] = gain && j < D ? gain[j] : 1.f;
      }
#pragma unroll
      for (int k = 0; k < NV; ++k)
        if (int(threadIdx.x) + k * kThreads < D) dot += dv[k] * gv[k] * xv[k];
    }
    dot = block_sum(dot, red);
    const float c = dot * r * r / float(D);
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
      const float g = gain ? gain[j] : 1.f;
      const float v = r * (g * dyi[j] - xi[j] * c);
      dxi[j] = acc ? dxi[j] + v : v;
    }
  }
}

// RMSNorm with the row in registers: the same thread -> element map as above (element j = tid +
// k * kThreads, k = 0..NV-1, a thread's partial summed in k order, then block_sum), but each thread
// loads its NV elements (and the gain, once per kernel) up front, so the loads are independent and
// in flight together, and the second pass reads registers instead of global memory again.
constexpr int kMaxRegsPerThread = 8;  // rows up to 2048 elements

template <class TY, int NV>
__global__ void rmsnorm_fwd_regs_kernel(TY* y, float* rstd, const float* x, const float* gain, int N, int D,
                                        float eps) {
  __shared__ float red[32];
  float gv[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int j = threadIdx.x + k * kThreads;
    gv[k] = gain && j < D ? gain[j] : 1.f;
  }
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    const float* xi = x + size_t(i) * D;
    TY* yi = y + size_t(i) * D;
    float xv[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int j = threadIdx.x + k * kThreads;
      xv[k] = j < D ? xi[j] : 0.f;
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k)
      if (int(threadIdx.x) + k * kThreads < D) ss += xv[k] * xv[k];
    ss = block_sum(ss, red);
    const float r = float(1.0 / sqrt(double(ss) / D + double(eps)));  // as rmsnorm_fwd_kernel
    if (threadIdx.x == 0) rstd[i] = r;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int j = threadIdx.x + k * kThreads;
      if (j < D) store_rn(yi[j], gain ? xv[k] * r * gv[k] : xv[k] * r);
    }
  }
}

constexpr int kNormRowChunk = 128;

// partial[chunk, c] = sum over the chunk's rows of dy * x * rstd (one thread per column).
__global__ void rmsnorm_dgain_partial(float* partial, const float* dy, const float* x, const float* rstd, int N,
                                      int D) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int chunk = blockIdx.y;
  if (c >= D) return;
  const int r0 = chunk * kNormRowChunk, r1 = min(N, r0 + kNormRowChunk);
  float acc = 0.f;
  for (int r = r0; r < r1; ++r) acc += dy[size_t(r) * D + c] * x[size_t(r) * D + c] * rstd[r];
  partial[size_t(chunk) * D + c] = acc;
}

__global__ void rmsnorm_dgain_final(float* dgain, const float* partial, int nchunks, int D) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= D) return;
  float acc = 0.f;
  for (int k = 0; k < nchunks; ++k) acc += partial[size_t(k) * D + c];
  dgain[c] += acc;
}

// ---------------------------------------------------------------------------------------------
// RoPE (rotate-half): pairs (i, i + rot_dims/2) of each head's first rot_dims dims.

__global__ void rope_kernel(float* x, const float* cos_sin, int N_tok, int S, int nheads, int hd, int half,
                            float sign) {
  const size_t total = size_t(N_tok) * nheads * half;
  const float* ct = cos_sin;
  const float* st = cos_sin + size_t(S) * half;
  for (size_t e = blockIdx.x * size_t(blockDim.x) + threadIdx.x; e < total; e += size_t(gridDim.x) * blockDim.x) {
    const int i = int(e % half);
    const size_t th = e / half;  // token * nheads + head
    const int t = int(th / nheads);
    const int pos = t % S;
    float* x1 = x + th * hd;
    const float c = ct[size_t(pos) * half + i], s = sign * st[size_t(pos) * half + i];
    const float a = x1[i], b = x1[i + half];
    x1[i] = a * c - b * s;
    x1[i + half] = b * c + a * s;
  }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

// out[i] = f(a[i], b[i]) for i < n, in vectors of V (for_each_vec): both inputs of a vector are
// read before its output is written, so out may be a or b.
template <int V, class TO, class TA, class TB, class F>
__device__ __forceinline__ void map2(TO* out, const TA* a, const TB* b, size_t n, F f) {
  for_each_vec<V>(n, [&](size_t i, auto w) {
    constexpr int W = decltype(w)::value;
    float av[W], bv[W];
    load_vec<W>(a + i, av);
    load_vec<W>(b + i, bv);
#pragma unroll
    for (int j = 0; j < W; ++j) av[j] = f(av[j], bv[j]);
    store_vec<W>(out + i, av);
  });
}

// The elements an op over n = rows * cols elements works on: all n, or with rows_used (a row count
// in device memory: the MoE capacity layout's rows in use, swiglu_*_rows) the first
// min(n, max(*rows_used, 0) * cols). The grid is sized by n on the host and every thread reads the
// count here, so nothing waits for the host; the elements past it are not touched. The vector loop
// of for_each_vec covers n_eff / V vectors from the same base and its scalar tail the rest, so a
// bound that is not a multiple of V changes no element's arithmetic.
__device__ __forceinline__ size_t rows_bound(size_t n, const int32_t* rows_used, int cols) {
  if (!rows_used) return n;
  const int32_t r = *rows_used;
  const size_t m = r > 0 ? size_t(r) * size_t(cols) : 0;
  return m < n ? m : n;
}

// T: the storage of g, u and h, float or __nv_bfloat16 (model.mlp_bf16: the fp32 arithmetic on the
// widened values, h rounded to nearest even as it is stored; the backward's gradients fp32).
// V: elements per vector access (16 bytes of T: 4 fp32 or 8 bf16; 1 = the scalar reference path).
// Every input of a vector is read before any of its outputs is written, so the in-place calls stay
// correct (dg == dh, h == g). rows_used / cols: rows_bound's (nullptr: all n).
template <class T, int V>
__global__ void swiglu_fwd_kernel(T* h, const T* g, const T* u, size_t n, const int32_t* rows_used, int cols) {
  map2<V>(h, g, u, rows_bound(n, rows_used, cols), [](float gi, float ui) {
    const float sig = 1.f / (1.f + expf(-gi));
    return gi * sig * ui;
  });
}

// G: the storage of dh, dg and du: fp32, or bf16 (model.moe_bf16_grads: dh widened, dg and du
// rounded as they are stored).
template <class T, int V, class G = float>
__global__ void swiglu_bwd_kernel(G* dg, G* du, const G* dh, const T* g, const T* u, size_t n,
                                  const int32_t* rows_used, int cols) {
  for_each_vec<V>(rows_bound(n, rows_used, cols), [&](size_t i, auto w) {
    constexpr int W = decltype(w)::value;
    float gv[W], uv[W], dv[W];
    load_vec<W>(g + i, gv);
    load_vec<W>(u + i, uv);
    load_vec<W>(dh + i, dv);
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float gi = gv[j], ui = uv[j], dhi = dv[j];
      const float sig = 1.f / (1.f + expf(-gi));
      // d silu / dg = sig * (1 + g * (1 - sig)).
      dv[j] = dhi * ui * sig * (1.f + gi * (1.f - sig));
      uv[j] = dhi * gi * sig;
    }
    store_vec<W>(du + i, uv);
    store_vec<W>(dg + i, dv);
  });
}

// ---------------------------------------------------------------------------------------------
// Softmax cross-entropy (one block per row)

constexpr int kXentThreads = 512;

template <bool kGrad>
__global__ void xent_kernel(float* logits, const int32_t* targets, int N, int V, float z_coef, float grad_scale,
                            float* losses, double* row_sums) {
  __shared__ float redf[32];
  __shared__ double redd[32];
  for (int i = blockIdx.x; i < N; i += gridDim.x) {
    float* x = logits + size_t(i) * V;
    const int tgt = targets[i];
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, x[j]);
    mx = block_max(mx, redf);
    // Per-thread partial in float (at most V / blockDim terms), the block's sum in double: exact to
    // float rounding for vocabularies of 10^5 (the CPU sums 512-wide float chunks in double).
    float part = 0.f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) part += expf(x[j] - mx);
    const double sum = block_sum(double(part), redd);
    const float lse = float(double(mx) + log(sum));
    const float xt = x[tgt];  // every thread reads it before anyone overwrites (block_sum synced)
    const double xe = double(lse) - double(xt);
    if (threadIdx.x == 0) {
      row_sums[2 * size_t(i)] = xe;
      row_sums[2 * size_t(i) + 1] = double(lse) * double(lse);
      if (losses) losses[i] = float(xe);
    }
    if constexpr (kGrad) {
      __syncthreads();  // all reads of x (including x[tgt]) are done
      // d/dx [xent + z lse^2] = softmax - onehot + 2 z lse softmax
      const float coef = grad_scale * (1.f + 2.f * z_coef * lse);
      for (int j = threadIdx.x; j < V; j += blockDim.x) x[j] = coef * expf(x[j] - lse);
      __syncthreads();
      if (threadIdx.x == 0) x[tgt] -= grad_scale;
    }
    __syncthreads();  // the next row's block_max reuses the shared buffers
  }
}

// sums[0..1] = column sums of row_sums [N, 2], one block, fixed order.
__global__ void reduce_pairs_kernel(const double* row_sums, int N, double* sums) {
  __shared__ double red[32];
  double a = 0, b = 0;
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    a += row_sums[2 * size_t(i)];
    b += row_sums[2 * size_t(i) + 1];
  }
  a = block_sum(a, red);
  b = block_sum(b, red);
  if (threadIdx.x == 0) {
    sums[0] = a;
    sums[1] = b;
  }
}

// ---------------------------------------------------------------------------------------------
// Vector helpers, AdamW

template <int V>
__global__ void add_kernel(float* y, const float* x, size_t n) {
  map2<V>(y, y, x, n, [](float yi, float xi) { return yi + xi; });
}

template <int V>
__global__ void scale_kernel(float* x, float s, size_t n) {
  for_each_vec<V>(n, [&](size_t i, auto w) {
    constexpr int W = decltype(w)::value;
    float v[W];
    load_vec<W>(x + i, v);
#pragma unroll
    for (int j = 0; j < W; ++j) v[j] *= s;
    store_vec<W>(x + i, v);
  });
}

constexpr int kSsqBlocks = 512;

__global__ void ssq_partial_kernel(const float* x, size_t n, double* partial) {
  __shared__ double red[32];
  double acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    acc += double(x[i]) * double(x[i]);
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void ssq_final_kernel(const double* partial, int np, double* out) {
  __shared__ double red[32];
  double acc = 0;
  for (int i = threadIdx.x; i < np; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) *out = acc;
}

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, size_t n, float lr, float b1, float b2,
                             float eps, float wd, float inv_bc1, float inv_bc2) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    adamw_element(p[i], m[i], v[i], g[i], lr, b1, b2, eps, wd, inv_bc1, inv_bc2);
}

__global__ void scale_matrix_kernel(float* C, int M, int N, int ldc, float beta) {
  const size_t total = size_t(M) * N;
  for (size_t e = blockIdx.x * size_t(blockDim.x) + threadIdx.x; e < total; e += size_t(gridDim.x) * blockDim.x) {
    float* c = C + (e / N) * size_t(ldc) + e % N;
    *c = beta == 0.f ? 0.f : beta * *c;
  }
}

// Casts: load_vec widens (bf16 -> fp32 exactly), store_vec rounds (fp32 -> bf16 to nearest even), so
// a vector of V converts exactly as V scalar casts. V = 8: 32 bytes of fp32, 16 of bf16 per thread.
template <int V, class TO, class TI>
__device__ __forceinline__ void cast_range(TO* out, const TI* in, size_t n) {
  for_each_vec<V>(n, [&](size_t i, auto w) {
    constexpr int W = decltype(w)::value;
    float v[W];
    load_vec<W>(in + i, v);
    store_vec<W>(out + i, v);
  });
}

template <class TO, class TI, int V>
__global__ void cast_kernel(TO* out, const TI* in, size_t n) {
  cast_range<V>(out, in, n);
}

// The first min(*rows, max_rows) rows of `cols` elements: the row count read on the device.
template <int V>
__global__ void f32_to_bf16_rows_kernel(__nv_bfloat16* out, const float* in, const int32_t* rows, size_t cols,
                                        size_t max_rows) {
  cast_range<V>(out, in, min(size_t(max(*rows, 0)), max_rows) * cols);
}

// A rows x cols view with leading dimension ld -> packed bf16 [rows, cols]. One block row per
// matrix row keeps both sides coalesced. V: columns per access (cols and ld multiples of V, the
// launcher checks; 4 = a float4 in, 8 bytes out).
template <int V>
__global__ void f32_to_bf16_2d_kernel(__nv_bfloat16* out, const float* in, int rows, int cols, int ld) {
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* src = in + size_t(r) * ld;
    __nv_bfloat16* dst = out + size_t(r) * cols;
    for (int c = threadIdx.x * V; c < cols; c += blockDim.x * V) {
      float v[V];
      load_vec<V>(src + c, v);
      store_vec<V>(dst + c, v);
    }
  }
}

__global__ void fill_uniform_kernel(float* x, size_t n, uint64_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    // splitmix64 of (seed, i): independent of the launch shape.
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * (i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    x[i] = lo + (hi - lo) * float(z >> 40) * (1.0f / 16777216.0f);
  }
}

bool g_reference_paths = false;

// The fast path's preconditions: every pointer 16-byte aligned (a vector of 16 bytes, or 8 for four
// bf16, then never straddles an alignment boundary) and the reference paths not forced.
template <class... P>
bool vectorizable(const P*... p) {
  return !g_reference_paths && (aligned16(p) && ...);
}

// One launch of an elementwise kernel over n elements at width V (vectors of V, so the grid covers
// n / V threads) or at width 1 (the reference path), as `vec` says.
template <int V, class Launch>
cudaError_t launch_vec(size_t n, bool vec, Launch&& launch) {
  if (!n) return cudaSuccess;
  if (vec) launch(std::integral_constant<int, V>{}, grid_for((n + V - 1) / V));
  else launch(std::integral_constant<int, 1>{}, grid_for(n));
  return cudaGetLastError();
}

}  // namespace

void set_reference_paths(bool on) { g_reference_paths = on; }
bool reference_paths() { return g_reference_paths; }

// ---------------------------------------------------------------------------------------------
// Launchers

cudaError_t embedding_forward(float* out, const float* table, const int32_t* ids, int N, int D, cudaStream_t st) {
  if (N <= 0 || D <= 0) return cudaSuccess;
  embedding_fwd_kernel<<<unsigned(N < 65536 ? N : 65536), kThreads, 0, st>>>(out, table, ids, N, D);
  return cudaGetLastError();
}

size_t embedding_backward_scratch_bytes(int N) {
  if (N <= 0) return 0;
  return 3 * align256(sizeof(int32_t) * size_t(N)) + cub_sort_bytes(N);
}

cudaError_t embedding_backward(float* dtable, const float* dout, const int32_t* ids, int N, int D, void* scratch,
                               size_t scratch_bytes, cudaStream_t st) {
  if (N <= 0 || D <= 0) return cudaSuccess;
  if (scratch_bytes < embedding_backward_scratch_bytes(N)) return cudaErrorInvalidValue;
  EmbScratch s = carve_emb(scratch, N);
  iota_kernel<<<grid_for(size_t(N)), kThreads, 0, st>>>(s.tok_in, N);
  // Token ids are non-negative, so their int32 bits sort as uint32.
  cudaError_t e = cub::DeviceRadixSort::SortPairs(s.cub_tmp, s.cub_bytes, reinterpret_cast<const uint32_t*>(ids),
                                                  s.keys_out, s.tok_in, s.tok_out, N, 0, 32, st);
  if (e != cudaSuccess) return e;
  embedding_bwd_segments<<<unsigned(N < 65536 ? N : 65536), kThreads, 0, st>>>(dtable, dout, s.keys_out,
                                                                                s.tok_out, N, D);
  return cudaGetLastError();
}

namespace {

// Registers per thread for a row of D (0: the row does not fit, or the reference path is forced).
int norm_regs(int D) {
  const int nv = (D + kThreads - 1) / kThreads;
  return g_reference_paths || D <= 0 || nv > kMaxRegsPerThread ? 0 : nv;
}

// Calls launch(std::integral_constant<int, NV>) for NV = nv in [1, kMaxRegsPerThread].
template <class Launch>
void with_norm_regs(int nv, Launch&& launch) {
  switch (nv) {
    case 1: launch(std::integral_constant<int, 1>{}); break;
    case 2: launch(std::integral_constant<int, 2>{}); break;
    case 3: launch(std::integral_constant<int, 3>{}); break;
    case 4: launch(std::integral_constant<int, 4>{}); break;
    case 5: launch(std::integral_constant<int, 5>{}); break;
    case 6: launch(std::integral_constant<int, 6>{}); break;
    case 7: launch(std::integral_constant<int, 7>{}); break;
    default: launch(std::integral_constant<int, 8>{}); break;
  }
  static_assert(kMaxRegsPerThread == 8, "with_norm_regs covers 1..kMaxRegsPerThread");
}

template <class TY>
cudaError_t launch_rmsnorm_forward(TY* y, float* rstd, const float* x, const float* gain, int N, int D, float eps,
                                   cudaStream_t st) {
  if (N <= 0) return cudaSuccess;
  const unsigned grid = unsigned(N < 65536 ? N : 65536);
  if (const int nv = norm_regs(D)) {
    with_norm_regs(nv, [&](auto c) {
      constexpr int NV = decltype(c)::value;
      rmsnorm_fwd_regs_kernel<TY, NV><<<grid, kThreads, 0, st>>>(y, rstd, x, gain, N, D, eps);
    });
  } else {
    rmsnorm_fwd_kernel<TY><<<grid, kThreads, 0, st>>>(y, rstd, x, gain, N, D, eps);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t rmsnorm_forward(float* y, float* rstd, const float* x, const float* gain, int N, int D, float eps,
                            cudaStream_t st) {
  return launch_rmsnorm_forward(y, rstd, x, gain, N, D, eps, st);
}

cudaError_t rmsnorm_forward_bf16(uint16_t* y, float* rstd, const float* x, const float* gain, int N, int D, float eps,
                                 cudaStream_t st) {
  return launch_rmsnorm_forward(as_bf16(y), rstd, x, gain, N, D, eps, st);
}

size_t rmsnorm_backward_scratch_floats(int N, int D) {
  return size_t((N + kNormRowChunk - 1) / kNormRowChunk) * size_t(D);
}

cudaError_t rmsnorm_backward(float* dx, float* dgain, const float* dy, const float* x, const float* gain,
                             const float* rstd, int N, int D, bool accumulate_dx, float* scratch, cudaStream_t st) {
  if (N <= 0) return cudaSuccess;
  const unsigned grid = unsigned(N < 65536 ? N : 65536);
  if (const int nv = norm_regs(D)) {
    with_norm_regs(nv, [&](auto c) {
      constexpr int NV = decltype(c)::value;
      rmsnorm_bwd_dx_kernel<NV><<<grid, kThreads, 0, st>>>(dx, dy, x, gain, rstd, N, D, accumulate_dx);
    });
  } else {
    rmsnorm_bwd_dx_kernel<0><<<grid, kThreads, 0, st>>>(dx, dy, x, gain, rstd, N, D, accumulate_dx);
  }
  if (gain && dgain) {
    const int nchunks = (N + kNormRowChunk - 1) / kNormRowChunk;
    dim3 grid(unsigned((D + kThreads - 1) / kThreads), unsigned(nchunks));
    rmsnorm_dgain_partial<<<grid, kThreads, 0, st>>>(scratch, dy, x, rstd, N, D);
    rmsnorm_dgain_final<<<unsigned((D + kThreads - 1) / kThreads), kThreads, 0, st>>>(dgain, scratch, nchunks, D);
  }
  return cudaGetLastError();
}

cudaError_t rope_apply(float* x, const float* cos_sin, int N_tok, int S, int nheads, int hd, int rot_dims,
                       float sign, cudaStream_t st) {
  const int half = rot_dims / 2;
  if (half <= 0 || N_tok <= 0) return cudaSuccess;
  rope_kernel<<<grid_for(size_t(N_tok) * nheads * half), kThreads, 0, st>>>(x, cos_sin, N_tok, S, nheads, hd,
                                                                             half, sign);
  return cudaGetLastError();
}

namespace {

// 16 bytes of T per access in the forward (4 fp32, 8 bf16); the backward's fp32 gradients take 4 per
// access with fp32 inputs, 8 (two 16-byte accesses, one for the bf16 inputs) with bf16 ones.
// rows_used / cols: the kernels' device bound (swiglu_*_rows), nullptr for all n.
template <class T>
cudaError_t launch_swiglu_forward(T* h, const T* g, const T* u, size_t n, cudaStream_t st,
                                  const int32_t* rows_used = nullptr, int cols = 0) {
  return launch_vec<16 / sizeof(T)>(n, vectorizable(h, g, u), [&](auto v, unsigned grid) {
    constexpr int V = decltype(v)::value;
    swiglu_fwd_kernel<T, V><<<grid, kThreads, 0, st>>>(h, g, u, n, rows_used, cols);
  });
}

template <class T, class G>
cudaError_t launch_swiglu_backward(G* dg, G* du, const G* dh, const T* g, const T* u, size_t n, cudaStream_t st,
                                   const int32_t* rows_used = nullptr, int cols = 0) {
  return launch_vec<16 / sizeof(T)>(n, vectorizable(dg, du, dh, g, u), [&](auto v, unsigned grid) {
    constexpr int V = decltype(v)::value;
    swiglu_bwd_kernel<T, V, G><<<grid, kThreads, 0, st>>>(dg, du, dh, g, u, n, rows_used, cols);
  });
}

// The elements of a [rows, cols] tensor, 0 when either is not positive (then nothing launches).
size_t rows_elements(int64_t rows, int cols) { return rows > 0 && cols > 0 ? size_t(rows) * size_t(cols) : 0; }

}  // namespace

cudaError_t swiglu_forward(float* h, const float* g, const float* u, size_t n, cudaStream_t st) {
  return launch_swiglu_forward(h, g, u, n, st);
}

cudaError_t swiglu_backward(float* dg, float* du, const float* dh, const float* g, const float* u, size_t n,
                            cudaStream_t st) {
  return launch_swiglu_backward(dg, du, dh, g, u, n, st);
}

cudaError_t swiglu_forward_bf16(uint16_t* h, const uint16_t* g, const uint16_t* u, size_t n, cudaStream_t st) {
  return launch_swiglu_forward(as_bf16(h), as_bf16(g), as_bf16(u), n, st);
}

cudaError_t swiglu_backward_bf16(float* dg, float* du, const float* dh, const uint16_t* g, const uint16_t* u,
                                 size_t n, cudaStream_t st) {
  return launch_swiglu_backward(dg, du, dh, as_bf16(g), as_bf16(u), n, st);
}

cudaError_t swiglu_backward_bf16_grads(uint16_t* dg, uint16_t* du, const uint16_t* dh, const uint16_t* g,
                                       const uint16_t* u, size_t n, cudaStream_t st) {
  return launch_swiglu_backward(as_bf16(dg), as_bf16(du), as_bf16(dh), as_bf16(g), as_bf16(u), n, st);
}

cudaError_t swiglu_forward_rows(void* h, const void* g, const void* u, bool h16, int64_t rows, int cols,
                                const int32_t* rows_used, cudaStream_t st) {
  if (!rows_used) return cudaErrorInvalidValue;
  const size_t n = rows_elements(rows, cols);
  if (h16)
    return launch_swiglu_forward(static_cast<__nv_bfloat16*>(h), static_cast<const __nv_bfloat16*>(g),
                                 static_cast<const __nv_bfloat16*>(u), n, st, rows_used, cols);
  return launch_swiglu_forward(static_cast<float*>(h), static_cast<const float*>(g), static_cast<const float*>(u), n,
                               st, rows_used, cols);
}

cudaError_t swiglu_backward_rows(void* dg, void* du, const void* dh, const void* g, const void* u, bool h16, bool d16,
                                 int64_t rows, int cols, const int32_t* rows_used, cudaStream_t st) {
  if (!rows_used || (d16 && !h16)) return cudaErrorInvalidValue;
  const size_t n = rows_elements(rows, cols);
  using B = __nv_bfloat16;
  if (d16)
    return launch_swiglu_backward(static_cast<B*>(dg), static_cast<B*>(du), static_cast<const B*>(dh),
                                  static_cast<const B*>(g), static_cast<const B*>(u), n, st, rows_used, cols);
  float* dgf = static_cast<float*>(dg);
  float* duf = static_cast<float*>(du);
  const float* dhf = static_cast<const float*>(dh);
  if (h16)
    return launch_swiglu_backward(dgf, duf, dhf, static_cast<const B*>(g), static_cast<const B*>(u), n, st,
                                  rows_used, cols);
  return launch_swiglu_backward(dgf, duf, dhf, static_cast<const float*>(g), static_cast<const float*>(u), n, st,
                                rows_used, cols);
}

cudaError_t softmax_xent(float* logits, const int32_t* targets, int N, int V, float z_coef, float grad_scale,
                         double* row_sums, cudaStream_t st) {
  if (N <= 0) return cudaSuccess;
  xent_kernel<true><<<unsigned(N < 65536 ? N : 65536), kXentThreads, 0, st>>>(logits, targets, N, V, z_coef,
                                                                               grad_scale, nullptr, row_sums);
  return cudaGetLastError();
}

cudaError_t softmax_xent_forward(const float* logits, const int32_t* targets, int N, int V, float* losses,
                                 double* row_sums, cudaStream_t st) {
  if (N <= 0) return cudaSuccess;
  xent_kernel<false><<<unsigned(N < 65536 ? N : 65536), kXentThreads, 0, st>>>(
      const_cast<float*>(logits), targets, N, V, 0.f, 0.f, losses, row_sums);
  return cudaGetLastError();
}

cudaError_t reduce_pairs(const double* row_sums, int N, double* sums, cudaStream_t st) {
  reduce_pairs_kernel<<<1, 1024, 0, st>>>(row_sums, N, sums);
  return cudaGetLastError();
}

cudaError_t add_inplace(float* y, const float* x, size_t n, cudaStream_t st) {
  return launch_vec<4>(n, vectorizable(y, x), [&](auto v, unsigned grid) {
    constexpr int V = decltype(v)::value;
    add_kernel<V><<<grid, kThreads, 0, st>>>(y, x, n);
  });
}

cudaError_t scale_inplace(float* x, float s, size_t n, cudaStream_t st) {
  return launch_vec<4>(n, vectorizable(x), [&](auto v, unsigned grid) {
    constexpr int V = decltype(v)::value;
    scale_kernel<V><<<grid, kThreads, 0, st>>>(x, s, n);
  });
}

size_t sum_squares_scratch_doubles() { return kSsqBlocks; }

cudaError_t sum_squares(const float* x, size_t n, double* out, double* scratch, cudaStream_t st) {
  // A fixed grid of kSsqBlocks blocks (not sized to n or to the device) fixes the summation order.
  ssq_partial_kernel<<<kSsqBlocks, kThreads, 0, st>>>(x, n, scratch);
  ssq_final_kernel<<<1, kSsqBlocks, 0, st>>>(scratch, kSsqBlocks, out);
  return cudaGetLastError();
}

cudaError_t adamw_update(float* p, const float* g, float* m, float* v, size_t n, float lr, float b1, float b2,
                         float eps, float wd, float bc1, float bc2, cudaStream_t st) {
  if (!n) return cudaSuccess;
  adamw_kernel<<<grid_for(n), kThreads, 0, st>>>(p, g, m, v, n, lr, b1, b2, eps, wd, 1.f / bc1, 1.f / bc2);
  return cudaGetLastError();
}

cudaError_t scale_matrix(float* C, int M, int N, int ldc, float beta, cudaStream_t st) {
  if (M <= 0 || N <= 0) return cudaSuccess;
  scale_matrix_kernel<<<grid_for(size_t(M) * N), kThreads, 0, st>>>(C, M, N, ldc, beta);
  return cudaGetLastError();
}

cudaError_t fill_uniform(float* x, size_t n, uint64_t seed, float lo, float hi, cudaStream_t st) {
  if (!n) return cudaSuccess;
  fill_uniform_kernel<<<grid_for(n), kThreads, 0, st>>>(x, n, seed, lo, hi);
  return cudaGetLastError();
}

cudaError_t probe_kernel_attributes(cudaFuncAttributes* attr) {
  return cudaFuncGetAttributes(attr, add_kernel<4>);
}

namespace {
template <class TO, class TI>
cudaError_t launch_cast(TO* out, const TI* in, size_t n, cudaStream_t st) {
  return launch_vec<8>(n, vectorizable(out, in), [&](auto v, unsigned grid) {
    constexpr int V = decltype(v)::value;
    cast_kernel<TO, TI, V><<<grid, kThreads, 0, st>>>(out, in, n);
  });
}
}  // namespace

cudaError_t f32_to_bf16(uint16_t* out, const float* in, size_t n, cudaStream_t st) {
  return launch_cast(as_bf16(out), in, n, st);
}

cudaError_t bf16_to_f32(float* out, const uint16_t* in, size_t n, cudaStream_t st) {
  return launch_cast(out, as_bf16(in), n, st);
}

cudaError_t f32_to_bf16_rows(uint16_t* out, const float* in, const int32_t* rows, size_t cols, size_t max_rows,
                             cudaStream_t st) {
  if (!cols || !max_rows) return cudaSuccess;
  return launch_vec<8>(cols * max_rows, vectorizable(out, in), [&](auto v, unsigned grid) {
    constexpr int V = decltype(v)::value;
    f32_to_bf16_rows_kernel<V><<<grid, kThreads, 0, st>>>(as_bf16(out), in, rows, cols, max_rows);
  });
}

cudaError_t f32_to_bf16_2d(uint16_t* out, const float* in, int rows, int cols, int ld, cudaStream_t st) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const unsigned grid = unsigned(rows < 65535 ? rows : 65535);
  // Every row's start stays 16-byte aligned (fp32 side) and 8-byte aligned (bf16 side) when cols and
  // ld are multiples of 4.
  if (vectorizable(out, in) && cols % 4 == 0 && ld % 4 == 0)
    f32_to_bf16_2d_kernel<4><<<grid, kThreads, 0, st>>>(as_bf16(out), in, rows, cols, ld);
  else
    f32_to_bf16_2d_kernel<1><<<grid, kThreads, 0, st>>>(as_bf16(out), in, rows, cols, ld);
  return cudaGetLastError();
}

}  // namespace ladder::cuda::k
