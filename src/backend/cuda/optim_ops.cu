// CUDA kernels of the recipe optimizers' element passes, fp32 (contracts: backend/cpu/optim_kernels.h,
// CPU code in optim_kernels.cpp): Adam moments and apply (each fused with the squared norm the
// hyperball projection needs), Muon's Nesterov momentum, axpy with the norm, and the two small
// pieces of Newton-Schulz that are not GEMMs (normalization by a device-side norm, the polynomial's
// a I + b A). The GEMMs of Newton-Schulz go through the backend's LtGemm (cuda_backend.cpp).
//
// Determinism: every sum runs on a fixed grid of kRedBlocks x kThreads threads whatever n and the
// device; each thread accumulates its grid-stride elements in double, each block sums its threads
// in a fixed shared-memory tree, and one block sums the kRedBlocks partials in a fixed tree. No
// atomics, so a step is bitwise reproducible run to run (the order differs from the CPU's, which
// sums static per-thread chunks, so GPU and CPU agree to double rounding, not bitwise).
#include "backend/cuda/switch_optim_ops.cuh"

namespace ladder::cuda::k {

namespace {

constexpr int kThreads = 256;
constexpr int kRedBlocks = 512;  // the fixed reduction grid (as k::sum_squares in ops.cu)
// finish_sum_kernel runs kRedBlocks threads in one block, whose warp shuffles need whole warps.
static_assert(kRedBlocks % 32 == 0 && kRedBlocks <= 1024, "kRedBlocks: whole warps, at most one block");
constexpr size_t kMaxBlocks = 65536;

inline unsigned grid_for(size_t n) {
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return unsigned(blocks < kMaxBlocks ? (blocks ? blocks : 1) : kMaxBlocks);
}

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

__global__ void axpy_sumsq_kernel(float* w, const float* x, size_t n, float alpha, double* partials) {
  double acc = 0.0;
  LADDER_GRID_STRIDE(i, n) {
    const float wi = w[i] + alpha * x[i];
    w[i] = wi;
    acc += double(wi) * double(wi);
  }
  store_block_partial(acc, partials);
}

__global__ void muon_momentum_kernel(float* B, float* D, const float* G, size_t n, float mu) {
  LADDER_GRID_STRIDE(i, n) {
    const float gi = G[i];
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

#undef LADDER_GRID_STRIDE

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

cudaError_t muon_momentum(float* B, float* D, const float* G, size_t n, float mu, cudaStream_t st) {
  if (!n) return cudaSuccess;
  muon_momentum_kernel<<<grid_for(n), kThreads, 0, st>>>(B, D, G, n, mu);
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

}  // namespace ladder::cuda::k
