// CUDA kernels of the recipe optimizers' element passes, fp32 (contracts: backend/cpu/optim_kernels.h,
// CPU code in optim_kernels.cpp): Adam moments and apply (each fused with the squared norm the
// hyperball projection needs), Muon's Nesterov momentum, axpy with the norm, and the two small
// pieces of Newton-Schulz that are not GEMMs (normalization by a device-side norm, the polynomial's
// a I + b A), each also over a batch of equally shaped matrices (per-matrix norms by a segmented
// reduction), and MuonH's projection of one matrix or of such a batch. The GEMMs of Newton-Schulz
// go through the backend's LtGemm (cuda_backend.cpp), strided-batched for a batch.
//
// Determinism: every sum runs on a fixed grid of kRedBlocks x kThreads threads whatever n and the
// device; each thread accumulates its grid-stride elements in double, each block sums its threads
// in a fixed shared-memory tree, and one block sums the kRedBlocks partials in a fixed tree. No
// atomics, so a step is bitwise reproducible run to run (the order differs from the CPU's, which
// sums static per-thread chunks, so GPU and CPU agree to double rounding, not bitwise).
#include "backend/cuda/optim_math.cuh"
#include "backend/cuda/switch_optim_ops.cuh"
#include "backend/cuda/device_common.cuh"

namespace ladder::cuda::k {

namespace {

constexpr int kThreads = 256;
static_assert(kThreads == 256, "grid_for (device_common.cuh) sizes grids for 256-thread blocks by default");
constexpr int kRedBlocks = 512;  // the fixed reduction grid (as k::sum_squares in ops.cu)
// finish_sum_kernel runs kRedBlocks threads in one block, whose warp shuffles need whole warps.
static_assert(kRedBlocks % 32 == 0 && kRedBlocks <= 1024, "kRedBlocks: whole warps, at most one block");


#define LADDER_GRID_STRIDE(i, n) \
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += size_t(gridDim.x) * blockDim.x)

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide sum in a fixed tree order; thread 0 gets the result. `red` holds 32 doubles.
__device__ double block_sum(double v, double* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  double r = 0.0;
  if (warp == 0) r = warp_sum(lane < nwarps ? red[lane] : 0.0);
  return r;
}

// Each reduction kernel ends with this: the block's partial goes to partials[blockIdx.x].
__device__ __forceinline__ void store_block_partial(double acc, double* partials) {
  __shared__ double red[32];
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// *out = sum of partials[0, np) (one block of kRedBlocks threads).
__global__ void finish_sum_kernel(const double* partials, int np, double* out) {
  __shared__ double red[32];
  double acc = 0.0;
  for (int i = threadIdx.x; i < np; i += blockDim.x) acc += partials[i];
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) *out = acc;
}

// The arithmetic below is written in the CPU kernels' order (b1 m + (1 - b1) g, ((1 - b2) g) g,
// (m / bc1) / (sqrt(v / bc2) + eps) with the reciprocals taken in float on the host, as the CPU
// takes them in T), so the two differ only where nvcc contracts a multiply-add into an FMA.

__global__ void adam_moments_kernel(float* m, float* v, const float* g, size_t n, float b1, float b2, float inv_bc1,
                                    float inv_bc2, float eps, double* partials) {
  double acc = 0.0;
  LADDER_GRID_STRIDE(i, n) {
    const float gi = g[i];
    const float mi = b1 * m[i] + (1.f - b1) * gi;
    const float vi = b2 * v[i] + (1.f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float u = (mi * inv_bc1) / (sqrtf(vi * inv_bc2) + eps);
    acc += double(u) * double(u);
  }
  store_block_partial(acc, partials);
}

__global__ void adam_apply_kernel(float* w, const float* m, const float* v, size_t n, float inv_bc1, float inv_bc2,
                                  float eps, float alpha, double* partials) {
  double acc = 0.0;
  LADDER_GRID_STRIDE(i, n) {
    // U is recomputed rather than stored: one sqrt per element against a tensor-sized buffer.
    const float u = (m[i] * inv_bc1) / (sqrtf(v[i] * inv_bc2) + eps);
    const float wi = w[i] + alpha * u;
    w[i] = wi;
    acc += double(wi) * double(wi);
  }
  store_block_partial(acc, partials);
}

// w += alpha x over this thread's grid-stride elements, then the block's partial of ||w||^2.
__device__ __forceinline__ void axpy_sumsq_block(float* w, const float* x, size_t n, float alpha, double* partials) {
  double acc = 0.0;
  LADDER_GRID_STRIDE(i, n) {
    const float wi = w[i] + alpha * x[i];
    w[i] = wi;
    acc += double(wi) * double(wi);
  }
  store_block_partial(acc, partials);
}

__global__ void axpy_sumsq_kernel(float* w, const float* x, size_t n, float alpha, double* partials) {
  axpy_sumsq_block(w, x, n, alpha, partials);
}

// A weight update's store: w[i] = v, and its bf16 mirror's copy (nearest even) where w16 is given,
// so the update's last pass keeps the mirror current (every optimizer update below).
__device__ __forceinline__ void store_with_mirror(float* w, __nv_bfloat16* w16, size_t i, float v) {
  w[i] = v;
  if (w16) store_rn(w16[i], v);
}

// A gradient factor from device memory (the clip factor), or 1: g * 1 is g exactly.
__device__ __forceinline__ float grad_factor_of(const float* f) { return f ? *f : 1.f; }

// __fmul_rn: the scaled gradient feeds additions, which nvcc would otherwise contract with the
// product into one FMA (no rounding of G * f); rounded, it is the clip pass's gradient, as the CPU's.
__global__ void muon_momentum_kernel(float* B, float* D, const float* G, size_t n, float mu, const float* gfac) {
  const float f = grad_factor_of(gfac);
  LADDER_GRID_STRIDE(i, n) {
    const float gi = __fmul_rn(G[i], f);
    const float b = mu * B[i] + gi;
    B[i] = b;
    D[i] = gi + mu * b;  // Nesterov: the gradient plus the new momentum
  }
}

// y = x * inv with inv = 1 / (sqrt(sumsq) + 1e-8) taken in double, then rounded to float: the CPU's
// scalar. Every thread reads the device sum itself, so no kernel or host step sits in between.
__global__ void scale_by_inv_norm_kernel(float* y, const float* x, size_t n, const double* sumsq) {
  const float inv = float(1.0 / (sqrt(*sumsq) + 1e-8));
  LADDER_GRID_STRIDE(i, n) y[i] = x[i] * inv;
}

// P = b A + a I over the m x m matrix (the a X term of the step rides on P's diagonal).
__global__ void ns_poly_init_kernel(float* P, const float* A, int m, float a, float b) {
  const size_t total = size_t(m) * size_t(m);
  LADDER_GRID_STRIDE(e, total) {
    const size_t i = e / size_t(m), j = e - i * size_t(m);
    const float bv = b * A[e];
    P[e] = i == j ? bv + a : bv;
  }
}

// ---- multi-tensor and device-scalar optimizer kernels ------------------------------------------

constexpr size_t kChunk = 16 * kThreads;  // elements per block of the multi-tensor kernels

// The chunk [lo, hi) of block b inside its segment.
__device__ __forceinline__ void chunk_of(const OptSeg& s, size_t& lo, size_t& hi) {
  lo = size_t(int(blockIdx.x) - s.first_block) * kChunk;
  hi = lo + kChunk < s.n ? lo + kChunk : s.n;
}

// std::max(a, b) as the host code wrote it (a NaN `a` passes through, where fmax would drop it).
__device__ __forceinline__ double host_max(double a, double b) { return a < b ? b : a; }

// ops.cu's adamw_kernel element for element, the gradient times the clip factor (one float product,
// as cpu::adamw_update's gscale), and where the segment has a bf16 mirror the new weight's bf16
// (round to nearest even, f32_to_bf16's rounding): 2 bytes more per element written here saves the
// mirror's re-cast (4 read + 2 written) before the next step's first bf16 GEMM.
__global__ void adamw_multi_kernel(const OptSeg* segs, const int* block_seg, OptGroupScalars gs, float b1, float b2,
                                   float eps, float inv_bc1, float inv_bc2, const float* gfac) {
  const OptSeg s = segs[block_seg[blockIdx.x]];
  size_t lo, hi;
  chunk_of(s, lo, hi);
  const float lr = gs.lr[s.group], wd = gs.wd[s.group], f = grad_factor_of(gfac);
  float *p = s.w, *m = s.m, *v = s.v;
  const float* g = s.g;
  __nv_bfloat16* w16 = reinterpret_cast<__nv_bfloat16*>(s.w16);
  for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    float pi = p[i], mi = m[i], vi = v[i];
    adamw_element(pi, mi, vi, g[i] * f, lr, b1, b2, eps, wd, inv_bc1, inv_bc2);
    m[i] = mi, v[i] = vi;
    store_with_mirror(p, w16, i, pi);
  }
}

__global__ void adamh_moments_multi_kernel(const OptSeg* segs, const int* block_seg, float b1, float b2,
                                           float inv_bc1, float inv_bc2, float eps, const float* gfac,
                                           double* partials) {
  const OptSeg s = segs[block_seg[blockIdx.x]];
  size_t lo, hi;
  chunk_of(s, lo, hi);
  const float f = grad_factor_of(gfac);
  double acc = 0.0;
  for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float gi = s.g[i] * f;
    const float mi = b1 * s.m[i] + (1.f - b1) * gi;
    const float vi = b2 * s.v[i] + (1.f - b2) * gi * gi;
    s.m[i] = mi;
    s.v[i] = vi;
    const float u = (mi * inv_bc1) / (sqrtf(vi * inv_bc2) + eps);
    acc += double(u) * double(u);
  }
  store_block_partial(acc, partials);
}

__global__ void adamh_apply_multi_kernel(const OptSeg* segs, const int* block_seg, float inv_bc1, float inv_bc2,
                                         float eps, const float* alpha, double* partials) {
  const int si = block_seg[blockIdx.x];
  const OptSeg s = segs[si];
  size_t lo, hi;
  chunk_of(s, lo, hi);
  const float a = alpha[si];
  double acc = 0.0;
  for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float u = (s.m[i] * inv_bc1) / (sqrtf(s.v[i] * inv_bc2) + eps);
    const float wi = s.w[i] + a * u;
    s.w[i] = wi;
    acc += double(wi) * double(wi);
  }
  store_block_partial(acc, partials);
}

// The sum of segment s's chunk partials in a fixed tree (one block per segment); thread 0 gets it.
__device__ double seg_total(const OptSeg& s, const double* partials) {
  __shared__ double red[32];
  double acc = 0.0;
  for (int j = threadIdx.x; j < s.nblocks; j += blockDim.x) acc += partials[s.first_block + j];
  return block_sum(acc, red);
}

// One block per segment: its chunks' partials in a fixed tree -> sums[seg]; then the scalar the
// next pass needs, in double as the host computed it, rounded to float once:
// step: scal[seg] = float(-lr R / max(sqrt(sum), 1e-10));  rescale: scal[seg] = float(R / sqrt(sum)).
__global__ void seg_finish_kernel(const OptSeg* segs, const double* partials, bool step, OptGroupLr glr,
                                  double* sums, float* scal) {
  const OptSeg s = segs[blockIdx.x];
  const double acc = seg_total(s, partials);
  if (threadIdx.x == 0) {
    sums[blockIdx.x] = acc;
    const double R = *s.radius;
    scal[blockIdx.x] = step ? float(-glr.lr[s.group] * R / host_max(sqrt(acc), 1e-10)) : float(R / sqrt(acc));
  }
}

// The multi-tensor sum of squares (of each segment's g): one partial per chunk, then per segment.
__global__ void seg_sumsq_kernel(const OptSeg* segs, const int* block_seg, double* partials) {
  const OptSeg s = segs[block_seg[blockIdx.x]];
  size_t lo, hi;
  chunk_of(s, lo, hi);
  double acc = 0.0;
  for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) acc += double(s.g[i]) * double(s.g[i]);
  store_block_partial(acc, partials);
}

__global__ void seg_sum_kernel(const OptSeg* segs, const double* partials, double* sums) {
  const double acc = seg_total(segs[blockIdx.x], partials);
  if (threadIdx.x == 0) sums[blockIdx.x] = acc;
}

// AdamH's last pass, w *= factor; the segment's bf16 mirror, where it has one, gets the new weight
// too (as adamw_multi_kernel).
__global__ void seg_scale_kernel(const OptSeg* segs, const int* block_seg, const float* factor) {
  const int si = block_seg[blockIdx.x];
  const OptSeg s = segs[si];
  size_t lo, hi;
  chunk_of(s, lo, hi);
  const float f = factor[si];
  __nv_bfloat16* w16 = reinterpret_cast<__nv_bfloat16*>(s.w16);
  for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) store_with_mirror(s.w, w16, i, s.w[i] * f);
}

__global__ void sumsq_kernel(const float* x, size_t n, double* partials) {
  double acc = 0.0;
  LADDER_GRID_STRIDE(i, n) acc += double(x[i]) * double(x[i]);
  store_block_partial(acc, partials);
}

// axpy_sumsq_kernel with alpha = float(-lr R / max(sqrt(*xx), 1e-10)) taken from device memory: every
// thread computes the scalar itself (a few flops) instead of a one-thread kernel in between.
__global__ void axpy_sumsq_dev_kernel(float* w, const float* x, size_t n, const float* radius, double lr,
                                      const double* xx, double* partials) {
  const double R = *radius;
  axpy_sumsq_block(w, x, n, float(-lr * R / host_max(sqrt(*xx), 1e-10)), partials);
}

// w *= float(R / sqrt(*ww)).
__global__ void scale_to_radius_kernel(float* w, size_t n, const float* radius, const double* ww) {
  const float f = float(double(*radius) / sqrt(*ww));
  LADDER_GRID_STRIDE(i, n) w[i] *= f;
}

// w16: w's bf16 mirror (nearest even) written with it, or nullptr.
__global__ void axpy_kernel(float* w, const float* x, size_t n, float alpha, __nv_bfloat16* w16) {
  LADDER_GRID_STRIDE(i, n) store_with_mirror(w, w16, i, w[i] + alpha * x[i]);
}

// One thread (of a warp: the emulator runs whole warps only): the host's loop (sums in index order), so the norm is bitwise the host's for the same
// per-tensor sums. A few hundred to a few thousand doubles: microseconds.
__global__ void grad_clip_factor_kernel(const double* sums, size_t count, double clip, double* norm, float* factor) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double s = 0.0;
  for (size_t i = 0; i < count; ++i) s += sums[i];
  const double nm = sqrt(s);
  *norm = nm;
  *factor = clip > 0 && nm > clip ? float(clip / (nm + 1e-6)) : 1.0f;
}

// ---- batches of equally shaped matrices (Muon / MuonH over an expert stack) --------------------
//
// `count` matrices of mn elements back to back. Each matrix is cut into bpm = ceil(mn / kChunk)
// chunks, one block per chunk (block b: matrix b / bpm, chunk b % bpm), so no block straddles two
// matrices: a matrix's sum is the partials of its own bpm blocks, summed by one block per matrix in
// a fixed tree (batch_finish_kernel). A segmented reduction whose order depends only on mn: bitwise
// reproducible, no atomics, one launch per pass whatever count is.

__device__ __forceinline__ void batch_chunk(size_t mn, int bpm, size_t& mat, size_t& lo, size_t& hi) {
  mat = size_t(blockIdx.x) / size_t(bpm);
  lo = (size_t(blockIdx.x) - mat * size_t(bpm)) * kChunk;
  hi = lo + kChunk < mn ? lo + kChunk : mn;
}

__global__ void batch_sumsq_kernel(const float* x, size_t mn, int bpm, double* partials) {
  size_t mat, lo, hi;
  batch_chunk(mn, bpm, mat, lo, hi);
  const float* xm = x + mat * mn;
  double acc = 0.0;
  for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) acc += double(xm[i]) * double(xm[i]);
  store_block_partial(acc, partials);
}

// One block per matrix: sums[mat] = its bpm partials in a fixed tree.
__global__ void batch_finish_kernel(const double* partials, int bpm, double* sums) {
  __shared__ double red[32];
  const double* pm = partials + size_t(blockIdx.x) * size_t(bpm);
  double acc = 0.0;
  for (int j = threadIdx.x; j < bpm; j += blockDim.x) acc += pm[j];
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) sums[blockIdx.x] = acc;
}

// scale_by_inv_norm_kernel per matrix, the scalar from that matrix's own device sum.
__global__ void batch_scale_by_inv_norm_kernel(float* y, const float* x, size_t mn, int bpm, const double* sumsq) {
  size_t mat, lo, hi;
  batch_chunk(mn, bpm, mat, lo, hi);
  const float inv = float(1.0 / (sqrt(sumsq[mat]) + 1e-8));
  const float* xm = x + mat * mn;
  float* ym = y + mat * mn;
  for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) ym[i] = xm[i] * inv;
}

// ns_poly_init_kernel over `count` m x m matrices back to back.
__global__ void batch_ns_poly_init_kernel(float* P, const float* A, int m, size_t total, float a, float b) {
  const size_t mm = size_t(m) * size_t(m);
  LADDER_GRID_STRIDE(e, total) {
    const size_t r = e % mm;
    const size_t i = r / size_t(m), j = r - i * size_t(m);
    const float bv = b * A[e];
    P[e] = i == j ? bv + a : bv;
  }
}

// axpy_sumsq_dev_kernel per matrix: alpha from the matrix's ||D||^2 (xx[mat]) and radius[mat].
__global__ void batch_axpy_sumsq_dev_kernel(float* w, const float* D, size_t mn, int bpm, const float* radius,
                                            double lr, const double* xx, double* partials) {
  size_t mat, lo, hi;
  batch_chunk(mn, bpm, mat, lo, hi);
  const double R = radius[mat];
  const float alpha = float(-lr * R / host_max(sqrt(xx[mat]), 1e-10));
  float* wm = w + mat * mn;
  const float* dm = D + mat * mn;
  double acc = 0.0;
  for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float wi = wm[i] + alpha * dm[i];
    wm[i] = wi;
    acc += double(wi) * double(wi);
  }
  store_block_partial(acc, partials);
}

// w *= float(R / sqrt(ww)) per matrix.
// The batch's last pass; w16: the batch's bf16 mirror (count * mn values), written too, or nullptr.
__global__ void batch_scale_to_radius_kernel(float* w, size_t mn, int bpm, const float* radius, const double* ww,
                                             __nv_bfloat16* w16) {
  size_t mat, lo, hi;
  batch_chunk(mn, bpm, mat, lo, hi);
  const float f = float(double(radius[mat]) / sqrt(ww[mat]));
  float* wm = w + mat * mn;
  __nv_bfloat16* w16m = w16 ? w16 + mat * mn : nullptr;
  for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) store_with_mirror(wm, w16m, i, wm[i] * f);
}

#undef LADDER_GRID_STRIDE

// Blocks of a batch pass, or 0 where the grid would not fit gridDim.x (the callers' batches are
// bounded far below that: 2^31 blocks of kChunk floats is 32 TiB).
size_t batch_grid(size_t mn, int count) {
  const size_t blocks = size_t(count) * batch_blocks_per_matrix(mn);
  return blocks <= size_t(0x7fffffff) ? blocks : 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers. The reductions always launch their fixed grid, also for n == 0 (the loops are empty
// and *out becomes 0), so the caller's *out is always written.

int optim_reduce_blocks() { return kRedBlocks; }

cudaError_t adam_moments(float* m, float* v, const float* g, size_t n, float b1, float b2, float bc1, float bc2,
                         float eps, double* out, double* partials, cudaStream_t st) {
  adam_moments_kernel<<<kRedBlocks, kThreads, 0, st>>>(m, v, g, n, b1, b2, 1.f / bc1, 1.f / bc2, eps, partials);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  finish_sum_kernel<<<1, kRedBlocks, 0, st>>>(partials, kRedBlocks, out);
  return cudaGetLastError();
}

cudaError_t adam_apply(float* w, const float* m, const float* v, size_t n, float bc1, float bc2, float eps,
                       float alpha, double* out, double* partials, cudaStream_t st) {
  adam_apply_kernel<<<kRedBlocks, kThreads, 0, st>>>(w, m, v, n, 1.f / bc1, 1.f / bc2, eps, alpha, partials);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  finish_sum_kernel<<<1, kRedBlocks, 0, st>>>(partials, kRedBlocks, out);
  return cudaGetLastError();
}

cudaError_t muon_momentum(float* B, float* D, const float* G, size_t n, float mu, const float* grad_factor,
                          cudaStream_t st) {
  if (!n) return cudaSuccess;
  muon_momentum_kernel<<<grid_for(n), kThreads, 0, st>>>(B, D, G, n, mu, grad_factor);
  return cudaGetLastError();
}

cudaError_t axpy_sumsq(float* w, const float* x, size_t n, float alpha, double* out, double* partials,
                       cudaStream_t st) {
  axpy_sumsq_kernel<<<kRedBlocks, kThreads, 0, st>>>(w, x, n, alpha, partials);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  finish_sum_kernel<<<1, kRedBlocks, 0, st>>>(partials, kRedBlocks, out);
  return cudaGetLastError();
}

cudaError_t scale_by_inv_norm(float* y, const float* x, size_t n, const double* sumsq, cudaStream_t st) {
  if (!n) return cudaSuccess;
  scale_by_inv_norm_kernel<<<grid_for(n), kThreads, 0, st>>>(y, x, n, sumsq);
  return cudaGetLastError();
}

cudaError_t ns_poly_init(float* P, const float* A, int m, float a, float b, cudaStream_t st) {
  if (m <= 0) return cudaSuccess;
  ns_poly_init_kernel<<<grid_for(size_t(m) * size_t(m)), kThreads, 0, st>>>(P, A, m, a, b);
  return cudaGetLastError();
}

size_t optim_multi_chunk() { return kChunk; }

cudaError_t adamw_multi(const OptSeg* segs, const int* block_seg, int nblocks, const OptGroupScalars& gs, float b1,
                        float b2, float eps, float bc1, float bc2, const float* grad_factor, cudaStream_t st) {
  if (nblocks <= 0) return cudaSuccess;
  adamw_multi_kernel<<<nblocks, kThreads, 0, st>>>(segs, block_seg, gs, b1, b2, eps, 1.f / bc1, 1.f / bc2,
                                                   grad_factor);
  return cudaGetLastError();
}

cudaError_t sum_squares_multi(const OptSeg* segs, int nseg, const int* block_seg, int nblocks, double* partials,
                              double* sums, cudaStream_t st) {
  if (nseg <= 0 || nblocks <= 0) return cudaSuccess;
  seg_sumsq_kernel<<<nblocks, kThreads, 0, st>>>(segs, block_seg, partials);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  seg_sum_kernel<<<nseg, kThreads, 0, st>>>(segs, partials, sums);
  return cudaGetLastError();
}

cudaError_t adamh_multi(const OptSeg* segs, int nseg, const int* block_seg, int nblocks, const OptGroupLr& glr,
                        float b1, float b2, float eps, float bc1, float bc2, const float* grad_factor, double* partials,
                        double* sums, float* scal, cudaStream_t st) {
  if (nseg <= 0 || nblocks <= 0) return cudaSuccess;
  const float inv_bc1 = 1.f / bc1, inv_bc2 = 1.f / bc2;
  adamh_moments_multi_kernel<<<nblocks, kThreads, 0, st>>>(segs, block_seg, b1, b2, inv_bc1, inv_bc2, eps,
                                                           grad_factor, partials);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  seg_finish_kernel<<<nseg, kThreads, 0, st>>>(segs, partials, true, glr, sums, scal);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  adamh_apply_multi_kernel<<<nblocks, kThreads, 0, st>>>(segs, block_seg, inv_bc1, inv_bc2, eps, scal, partials);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  seg_finish_kernel<<<nseg, kThreads, 0, st>>>(segs, partials, false, glr, sums + nseg, scal + nseg);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  seg_scale_kernel<<<nblocks, kThreads, 0, st>>>(segs, block_seg, scal + nseg);
  return cudaGetLastError();
}

cudaError_t muonh_apply(float* w, const float* D, size_t n, const float* radius, double lr, double* sums,
                        double* partials, cudaStream_t st) {
  sumsq_kernel<<<kRedBlocks, kThreads, 0, st>>>(D, n, partials);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  finish_sum_kernel<<<1, kRedBlocks, 0, st>>>(partials, kRedBlocks, sums);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  axpy_sumsq_dev_kernel<<<kRedBlocks, kThreads, 0, st>>>(w, D, n, radius, lr, sums, partials);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  finish_sum_kernel<<<1, kRedBlocks, 0, st>>>(partials, kRedBlocks, sums + 1);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  if (!n) return cudaSuccess;
  scale_to_radius_kernel<<<grid_for(n), kThreads, 0, st>>>(w, n, radius, sums + 1);
  return cudaGetLastError();
}

int batch_blocks_per_matrix(size_t mn) { return int(mn ? (mn + kChunk - 1) / kChunk : 1); }

cudaError_t batched_sum_squares(const float* x, size_t mn, int count, double* sums, double* partials,
                                cudaStream_t st) {
  if (count <= 0) return cudaSuccess;
  const size_t blocks = batch_grid(mn, count);
  if (!blocks) return cudaErrorInvalidValue;
  const int bpm = batch_blocks_per_matrix(mn);
  batch_sumsq_kernel<<<unsigned(blocks), kThreads, 0, st>>>(x, mn, bpm, partials);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  batch_finish_kernel<<<unsigned(count), kThreads, 0, st>>>(partials, bpm, sums);
  return cudaGetLastError();
}

cudaError_t batched_scale_by_inv_norm(float* y, const float* x, size_t mn, int count, const double* sumsq,
                                      cudaStream_t st) {
  if (count <= 0 || !mn) return cudaSuccess;
  const size_t blocks = batch_grid(mn, count);
  if (!blocks) return cudaErrorInvalidValue;
  batch_scale_by_inv_norm_kernel<<<unsigned(blocks), kThreads, 0, st>>>(y, x, mn, batch_blocks_per_matrix(mn), sumsq);
  return cudaGetLastError();
}

cudaError_t batched_ns_poly_init(float* P, const float* A, int m, int count, float a, float b, cudaStream_t st) {
  if (m <= 0 || count <= 0) return cudaSuccess;
  const size_t total = size_t(m) * size_t(m) * size_t(count);
  batch_ns_poly_init_kernel<<<grid_for(total), kThreads, 0, st>>>(P, A, m, total, a, b);
  return cudaGetLastError();
}

cudaError_t muonh_apply_batched(float* w, const float* D, size_t mn, int count, const float* radius, double lr,
                                double* sums, double* partials, uint16_t* w16, cudaStream_t st) {
  if (count <= 0) return cudaSuccess;
  const size_t blocks = batch_grid(mn, count);
  if (!blocks) return cudaErrorInvalidValue;
  const int bpm = batch_blocks_per_matrix(mn);
  double *xx = sums, *ww = sums + count;
  cudaError_t e = batched_sum_squares(D, mn, count, xx, partials, st);
  if (e != cudaSuccess) return e;
  batch_axpy_sumsq_dev_kernel<<<unsigned(blocks), kThreads, 0, st>>>(w, D, mn, bpm, radius, lr, xx, partials);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  batch_finish_kernel<<<unsigned(count), kThreads, 0, st>>>(partials, bpm, ww);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  if (!mn) return cudaSuccess;
  batch_scale_to_radius_kernel<<<unsigned(blocks), kThreads, 0, st>>>(w, mn, bpm, radius, ww,
                                                                      reinterpret_cast<__nv_bfloat16*>(w16));
  return cudaGetLastError();
}

cudaError_t axpy(float* w, const float* x, size_t n, float alpha, uint16_t* w16, cudaStream_t st) {
  if (!n) return cudaSuccess;
  axpy_kernel<<<grid_for(n), kThreads, 0, st>>>(w, x, n, alpha, reinterpret_cast<__nv_bfloat16*>(w16));
  return cudaGetLastError();
}

cudaError_t grad_clip_factor(const double* sums, size_t count, double clip, double* norm, float* factor,
                             cudaStream_t st) {
  grad_clip_factor_kernel<<<1, 32, 0, st>>>(sums, count, clip, norm, factor);
  return cudaGetLastError();
}


}  // namespace ladder::cuda::k
