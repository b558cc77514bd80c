// CPU kernels of the recipe's optimizers: see optim_kernels.h for each function's contract.
#include "backend/cpu/optim_kernels.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace ladder::cpu {

// RECIPE.md section 3, in order of application.
const double kNsCoeffs[5][3] = {{4.0848, -6.8946, 2.9270},
                                {3.9505, -6.3029, 2.6377},
                                {3.7418, -5.5913, 2.3037},
                                {2.8769, -3.1427, 1.2046},
                                {2.8366, -3.0525, 1.2012}};

namespace {

// Below this many elements an OpenMP region costs more than the loop itself.
constexpr size_t kParallelMin = 1 << 15;

// Runs f(thread, lo, hi) over a static partition of [0, n) and returns the sum of f's results in
// thread order: the partition depends only on n and the team size, so the sum is reproducible.
// f's loops read their arrays and scalars through local copies: through the closure's references
// (which a store to a T* might alias) GCC 12 vectorized them with a gather of each pointer and
// scalar on every iteration, at a fifth of the memory bandwidth.
template <class F>
double chunked_sum(size_t n, F&& f) {
  const bool par = n >= kParallelMin;
  const int maxt = par ? omp_get_max_threads() : 1;
  double part[256] = {};
  const int cap = std::min(maxt, 256);
#pragma omp parallel num_threads(cap) if (par)
  {
    const size_t nt = size_t(omp_get_num_threads()), t = size_t(omp_get_thread_num());
    const size_t chunk = (n + nt - 1) / nt;
    const size_t lo = std::min(n, t * chunk), hi = std::min(n, lo + chunk);
    part[t] = f(lo, hi);
  }
  double s = 0;
  for (int t = 0; t < cap; ++t) s += part[t];
  return s;
}

template <class T>
void syrk_upper(bool trans, int N, int K, T alpha, const T* A, int lda, T beta, T* C, int ldc) {
  const auto tr = trans ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>)
    cblas_ssyrk(CblasRowMajor, CblasUpper, tr, N, K, alpha, A, lda, beta, C, ldc);
  else
    cblas_dsyrk(CblasRowMajor, CblasUpper, tr, N, K, alpha, A, lda, beta, C, ldc);
}

template <class T>
void gemm_nn(int M, int N, int K, const T* A, int lda, const T* B, int ldb, T* C, int ldc) {
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc);
  else
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.0, A, lda, B, ldb, 0.0, C, ldc);
}

// Copies the upper triangle of the m x m matrix S onto its lower triangle.
template <class T>
void mirror_upper(T* S, int m) {
  for (int i = 1; i < m; ++i)
    for (int j = 0; j < i; ++j) S[size_t(i) * m + j] = S[size_t(j) * m + i];
}

}  // namespace

template <class T>
double adam_moments(T* m_, T* v_, const T* g_, size_t n, T b1, T b2, T bc1, T bc2, T eps, T gscale) {
  const T inv_bc1 = T(1) / bc1, inv_bc2 = T(1) / bc2;
  return chunked_sum(n, [&](size_t lo, size_t hi) {
    T *m = m_, *v = v_;  // local copies: see chunked_sum
    const T* g = g_;
    const T b1l = b1, b2l = b2, gs = gscale, ib1 = inv_bc1, ib2 = inv_bc2, e = eps;
    double acc = 0;
#pragma omp simd reduction(+ : acc)
    for (size_t i = lo; i < hi; ++i) {
      const T gi = g[i] * gs;
      const T mi = b1l * m[i] + (T(1) - b1l) * gi;
      const T vi = b2l * v[i] + (T(1) - b2l) * gi * gi;
      m[i] = mi;
      v[i] = vi;
      const T u = (mi * ib1) / (std::sqrt(vi * ib2) + e);
      acc += double(u) * double(u);
    }
    return acc;
  });
}

template <class T>
double adam_apply(T* w_, const T* m_, const T* v_, size_t n, T bc1, T bc2, T eps, T alpha) {
  const T inv_bc1 = T(1) / bc1, inv_bc2 = T(1) / bc2;
  return chunked_sum(n, [&](size_t lo, size_t hi) {
    T* w = w_;  // local copies: see chunked_sum
    const T *m = m_, *v = v_;
    const T ib1 = inv_bc1, ib2 = inv_bc2, e = eps, a = alpha;
    double acc = 0;
#pragma omp simd reduction(+ : acc)
    for (size_t i = lo; i < hi; ++i) {
      const T u = (m[i] * ib1) / (std::sqrt(v[i] * ib2) + e);
      const T wi = w[i] + a * u;
      w[i] = wi;
      acc += double(wi) * double(wi);
    }
    return acc;
  });
}

template <class T>
void muon_momentum(T* B, T* D, const T* G, size_t n, T mu, T gscale) {
  if (gscale == T(1)) {  // no clip this step (the usual case): G as it is, without the buffer below
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
    for (size_t i = 0; i < n; ++i) {
      const T b = mu * B[i] + G[i];
      B[i] = b;
      D[i] = G[i] + mu * b;
    }
    return;
  }
  // The scaled gradient goes through a small buffer: G * gscale feeds an addition here, which the
  // compiler would contract into one FMA (rounding the product away), while the promise is the
  // bits of a gradient scaled in memory first (the clip pass this replaces; rounded, then added).
  constexpr size_t kBlock = 1024;
  const size_t nblocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (size_t blk = 0; blk < nblocks; ++blk) {
    T gs[kBlock];
    const size_t lo = blk * kBlock, m = std::min(kBlock, n - lo);
    for (size_t j = 0; j < m; ++j) gs[j] = G[lo + j] * gscale;
#pragma omp simd
    for (size_t j = 0; j < m; ++j) {
      const T b = mu * B[lo + j] + gs[j];
      B[lo + j] = b;
      D[lo + j] = gs[j] + mu * b;
    }
  }
}

template <class T>
double axpy_sumsq(T* w_, const T* x_, size_t n, T alpha) {
  return chunked_sum(n, [&](size_t lo, size_t hi) {
    T* w = w_;  // local copies: see chunked_sum
    const T* x = x_;
    const T a = alpha;
    double acc = 0;
#pragma omp simd reduction(+ : acc)
    for (size_t i = lo; i < hi; ++i) {
      const T wi = w[i] + a * x[i];
      w[i] = wi;
      acc += double(wi) * double(wi);
    }
    return acc;
  });
}

size_t ns_work_size(int rows, int cols) {
  const size_t m = size_t(std::min(rows, cols));
  return size_t(rows) * size_t(cols) + 2 * m * m;
}

template <class T>
void newton_schulz5(T* X, int rows, int cols, T* work) {
  const bool tall = rows > cols;
  const int m = tall ? cols : rows;  // side of A = X X^T (wide) or X^T X (tall)
  const int n = tall ? rows : cols;
  const size_t mn = size_t(m) * size_t(n);
  T* Y = work;               // the other half of the ping-pong
  T* A = Y + mn;             // [m, m]
  T* P = A + size_t(m) * m;  // [m, m]: the polynomial a I + b A + c A^2

  // Frobenius normalization, written into Y so that the 5 (odd) steps end back in X.
  const double ss = chunked_sum(mn, [&](size_t lo, size_t hi) {
    const T* x = X;  // a local copy: see chunked_sum
    double acc = 0;
#pragma omp simd reduction(+ : acc)
    for (size_t i = lo; i < hi; ++i) acc += double(x[i]) * double(x[i]);
    return acc;
  });
  const T inv = T(1.0 / (std::sqrt(ss) + 1e-8));
#pragma omp parallel for simd schedule(static) if (mn >= kParallelMin)
  for (size_t i = 0; i < mn; ++i) Y[i] = X[i] * inv;

  T* cur = Y;
  T* nxt = X;
  for (int k = 0; k < 5; ++k) {
    const T a = T(kNsCoeffs[k][0]), b = T(kNsCoeffs[k][1]), c = T(kNsCoeffs[k][2]);
    // A = X X^T (wide, X is [m, n]) or X^T X (tall, X is [n, m]); one triangle, then mirrored.
    syrk_upper<T>(tall, m, n, T(1), cur, tall ? m : n, T(0), A, m);
    mirror_upper(A, m);
    // P = c A A^T + b A  (A is symmetric, so A A^T = A^2: a syrk again, half a general product)
    std::memcpy(P, A, sizeof(T) * size_t(m) * m);
    syrk_upper<T>(false, m, m, c, A, m, b, P, m);
    mirror_upper(P, m);
    for (int i = 0; i < m; ++i) P[size_t(i) * m + i] += a;
    // X <- P X (wide) or X P (tall): the a X term rides on P's diagonal, so no copy of X.
    if (tall)
      gemm_nn<T>(n, m, m, cur, m, P, m, nxt, m);
    else
      gemm_nn<T>(m, n, m, P, m, cur, n, nxt, n);
    std::swap(cur, nxt);
  }
  // 5 steps from Y: the result is in X.
}

#define LADDER_INSTANTIATE(T)                                                              \
  template double adam_moments<T>(T*, T*, const T*, size_t, T, T, T, T, T, T);             \
  template double adam_apply<T>(T*, const T*, const T*, size_t, T, T, T, T);               \
  template void muon_momentum<T>(T*, T*, const T*, size_t, T, T);                          \
  template double axpy_sumsq<T>(T*, const T*, size_t, T);                                  \
  template void newton_schulz5<T>(T*, int, int, T*);

LADDER_INSTANTIATE(float)
LADDER_INSTANTIATE(double)
#undef LADDER_INSTANTIATE

}  // namespace ladder::cpu
