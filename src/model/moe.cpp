// The MoE V1 block: see moe.h for the contract and the tensor layout.
#include "model/moe.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace ladder {

namespace {

// Below this many output elements an OpenMP region costs more than the loop.
constexpr size_t kParMin = 1 << 14;

template <class T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

}  // namespace

template <class T>
std::vector<std::pair<void**, size_t>> moe_act_requests(const MoeDims& D, MoeActs<T>& a) {
  const size_t N = D.N, NK = size_t(D.N) * D.K, t = sizeof(T), i4 = sizeof(int32_t);
  std::vector<std::pair<void**, size_t>> r = {
      {(void**)&a.logits, N * D.E * t}, {(void**)&a.lse, N * t},          {(void**)&a.expert, NK * i4},
      {(void**)&a.comb, NK * t},        {(void**)&a.row, NK * i4},        {(void**)&a.slot, NK * i4},
      {(void**)&a.offsets, size_t(D.E + 1) * i4},                         {(void**)&a.xs, NK * D.d * t},
      {(void**)&a.g, NK * D.I * t},     {(void**)&a.u, NK * D.I * t},     {(void**)&a.a, NK * D.I * t},
      {(void**)&a.y, NK * D.d * t}};
  if (D.Is > 0)
    r.insert(r.end(), {{(void**)&a.sgate, N * D.Is * t}, {(void**)&a.sup, N * D.Is * t}, {(void**)&a.sact, N * D.Is * t}});
  return r;
}

template <class T>
std::vector<std::pair<void**, size_t>> moe_scratch_requests(const MoeDims& D, MoeScratch<T>& s) {
  const size_t N = D.N, NK = size_t(D.N) * D.K, t = sizeof(T);
  std::vector<std::pair<void**, size_t>> r = {
      {(void**)&s.dy, NK * D.d * t}, {(void**)&s.dg, NK * D.I * t}, {(void**)&s.du, NK * D.I * t},
      {(void**)&s.da, NK * D.I * t}, {(void**)&s.dx, NK * D.d * t}, {(void**)&s.ds, N * D.E * t},
      {(void**)&s.dcomb, NK * t}};
  if (D.Is > 0)
    r.insert(r.end(), {{(void**)&s.dsg, N * D.Is * t}, {(void**)&s.dsu, N * D.Is * t}, {(void**)&s.dsa, N * D.Is * t}});
  return r;
}

template <class T, class Ops>
double moe_forward(Ops& ops, const MoeDims& D, const MoeWeights<T>& W, MoeActs<T>& A, const T* h, T* out) {
  const int N = D.N, d = D.d, E = D.E, K = D.K, I = D.I, Is = D.Is;
  const size_t NK = size_t(N) * K;

  // 1. Router scores s = h W_r^T (fp32 at least: T is float or double).
  ops.gemm(false, true, N, E, d, T(1), h, d, W.router, d, T(0), A.logits, E);

  // 2. Per token: logsumexp (z-loss), top-K of s + bias, combine weights.
  double lse_sq = 0;
#pragma omp parallel for schedule(static) reduction(+ : lse_sq) if (size_t(N) * E >= kParMin)
  for (int i = 0; i < N; ++i) {
    const T* s = A.logits + size_t(i) * E;
    T mx = s[0];
    for (int e = 1; e < E; ++e) mx = std::max(mx, s[e]);
    double se = 0;
    for (int e = 0; e < E; ++e) se += std::exp(double(s[e] - mx));
    const T lse = T(double(mx) + std::log(se));
    A.lse[i] = lse;
    lse_sq += double(lse) * double(lse);
    // Insertion into a sorted list of K. A candidate displaces an entry only when strictly
    // greater, and experts are visited in increasing index, so on ties the lower index wins.
    int32_t* sel = A.expert + size_t(i) * K;
    T* val = A.comb + size_t(i) * K;  // biased scores, scratch until the weights overwrite them
    int n = 0;
    for (int e = 0; e < E; ++e) {
      const T v = s[e] + W.bias[e];
      if (n == K && !(v > val[K - 1])) continue;
      int p = n < K ? n++ : K - 1;
      while (p > 0 && v > val[p - 1]) {
        val[p] = val[p - 1];
        sel[p] = sel[p - 1];
        --p;
      }
      val[p] = v;
      sel[p] = e;
    }
    T sum = 0;
    for (int k = 0; k < K; ++k) {
      val[k] = sigmoid(s[sel[k]]);
      sum += val[k];
    }
    if (D.normalized) {
      const T f = T(D.route_scale) / (sum + T(1e-9));
      for (int k = 0; k < K; ++k) val[k] *= f;
    }
  }

  // 3. Counting sort of the slots by expert; stable, so each expert's rows are in token order.
  std::fill(A.offsets, A.offsets + E + 1, 0);
  for (size_t j = 0; j < NK; ++j) ++A.offsets[A.expert[j] + 1];
  for (int e = 0; e < E; ++e) A.offsets[e + 1] += A.offsets[e];
  // offsets[e] doubles as expert e's cursor; afterwards it holds the end of e = start of e+1.
  for (size_t j = 0; j < NK; ++j) {
    const int32_t r = A.offsets[A.expert[j]]++;
    A.row[j] = r;
    A.slot[r] = int32_t(j);
  }
  for (int e = E; e > 0; --e) A.offsets[e] = A.offsets[e - 1];
  A.offsets[0] = 0;

  // 4. Gather the input rows into expert order.
#pragma omp parallel for schedule(static) if (NK * d >= kParMin)
  for (size_t r = 0; r < NK; ++r)
    std::memcpy(A.xs + r * d, h + size_t(A.slot[r] / K) * d, sizeof(T) * d);

  // 5. The experts: one GEMM per matrix per expert over its contiguous rows.
  ops.grouped_gemm(true, true, E, A.offsets, 0, I, d, T(1), A.xs, d, W.wg, d, size_t(I) * d, T(0), A.g, I, 0);
  ops.grouped_gemm(true, true, E, A.offsets, 0, I, d, T(1), A.xs, d, W.wu, d, size_t(I) * d, T(0), A.u, I, 0);
  ops.swiglu_forward(A.a, A.g, A.u, NK * I);
  ops.grouped_gemm(true, true, E, A.offsets, 0, d, I, T(1), A.a, I, W.wd, I, size_t(d) * I, T(0), A.y, d, 0);

  // 6. Scatter back, weighted. Each token sums its own K rows in slot order: deterministic.
#pragma omp parallel for schedule(static) if (NK * d >= kParMin)
  for (int i = 0; i < N; ++i) {
    T* o = out + size_t(i) * d;
    for (int k = 0; k < K; ++k) {
      const size_t j = size_t(i) * K + k;
      const T w = A.comb[j];
      const T* y = A.y + size_t(A.row[j]) * d;
#pragma omp simd
      for (int c = 0; c < d; ++c) o[c] += w * y[c];
    }
  }

  // 7. The shared expert, on every token.
  if (Is > 0) {
    ops.gemm(false, true, N, Is, d, T(1), h, d, W.sg, d, T(0), A.sgate, Is);
    ops.gemm(false, true, N, Is, d, T(1), h, d, W.su, d, T(0), A.sup, Is);
    ops.swiglu_forward(A.sact, A.sgate, A.sup, size_t(N) * Is);
    ops.gemm(false, true, N, d, Is, T(1), A.sact, Is, W.sd, Is, T(1), out, d);
  }
  return lse_sq;
}

template <class T, class Ops>
void moe_backward(Ops& ops, const MoeDims& D, const MoeWeights<T>& W, MoeGrads<T>& G, const MoeActs<T>& A,
                  MoeScratch<T>& S, const T* h, const T* dout, T* dh, T z_scale) {
  const int N = D.N, d = D.d, E = D.E, K = D.K, I = D.I, Is = D.Is;
  const size_t NK = size_t(N) * K;

  // 1. Through the weighted scatter: dy_row = w_slot * dout_token; dL/dw_slot = dout_token . y_row.
#pragma omp parallel for schedule(static) if (NK * d >= kParMin)
  for (int i = 0; i < N; ++i) {
    const T* go = dout + size_t(i) * d;
    for (int k = 0; k < K; ++k) {
      const size_t j = size_t(i) * K + k;
      const size_t r = size_t(A.row[j]);
      const T* y = A.y + r * d;
      T* dy = S.dy + r * d;
      const T w = A.comb[j];
      T dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int c = 0; c < d; ++c) {
        dot += go[c] * y[c];
        dy[c] = w * go[c];
      }
      S.dcomb[j] = dot;
    }
  }

  // 2. The experts, per block: down, SwiGLU, gate/up; weight gradients summed over each block.
  ops.grouped_gemm(true, false, E, A.offsets, 0, I, d, T(1), S.dy, d, W.wd, I, size_t(d) * I, T(0), S.da, I, 0);
  ops.grouped_gemm(false, false, E, A.offsets, d, I, 0, T(1), S.dy, d, A.a, I, 0, T(1), G.wd, I, size_t(d) * I);
  ops.swiglu_backward(S.dg, S.du, S.da, A.g, A.u, NK * I);
  ops.grouped_gemm(true, false, E, A.offsets, 0, d, I, T(1), S.dg, I, W.wg, d, size_t(I) * d, T(0), S.dx, d, 0);
  ops.grouped_gemm(true, false, E, A.offsets, 0, d, I, T(1), S.du, I, W.wu, d, size_t(I) * d, T(1), S.dx, d, 0);
  ops.grouped_gemm(false, false, E, A.offsets, I, d, 0, T(1), S.dg, I, A.xs, d, 0, T(1), G.wg, d, size_t(I) * d);
  ops.grouped_gemm(false, false, E, A.offsets, I, d, 0, T(1), S.du, I, A.xs, d, 0, T(1), G.wu, d, size_t(I) * d);

  // 3. Gather the row gradients back to their tokens (the adjoint of the forward gather).
#pragma omp parallel for schedule(static) if (NK * d >= kParMin)
  for (int i = 0; i < N; ++i) {
    T* o = dh + size_t(i) * d;
    std::memcpy(o, S.dx + size_t(A.row[size_t(i) * K]) * d, sizeof(T) * d);
    for (int k = 1; k < K; ++k) {
      const T* x = S.dx + size_t(A.row[size_t(i) * K + k]) * d;
#pragma omp simd
      for (int c = 0; c < d; ++c) o[c] += x[c];
    }
  }

  // 4. The shared expert.
  if (Is > 0) {
    ops.gemm(false, false, N, Is, d, T(1), dout, d, W.sd, Is, T(0), S.dsa, Is);
    ops.gemm(true, false, d, Is, N, T(1), dout, d, A.sact, Is, T(1), G.sd, Is);
    ops.swiglu_backward(S.dsg, S.dsu, S.dsa, A.sgate, A.sup, size_t(N) * Is);
    ops.gemm(false, false, N, d, Is, T(1), S.dsg, Is, W.sg, d, T(1), dh, d);
    ops.gemm(false, false, N, d, Is, T(1), S.dsu, Is, W.su, d, T(1), dh, d);
    ops.gemm(true, false, Is, d, N, T(1), S.dsg, Is, h, d, T(1), G.sg, d);
    ops.gemm(true, false, Is, d, N, T(1), S.dsu, Is, h, d, T(1), G.su, d);
  }

  // 5. Router scores: through the combine weights (sigmoid, and the normalization when on) and the
  //    z-loss  sum_i lse_i^2  (d/ds_ie = 2 lse_i softmax(s_i)_e).
#pragma omp parallel for schedule(static) if (size_t(N) * E >= kParMin)
  for (int i = 0; i < N; ++i) {
    const T* s = A.logits + size_t(i) * E;
    T* ds = S.ds + size_t(i) * E;
    if (z_scale != T(0)) {
      const T c = z_scale * T(2) * A.lse[i];
      for (int e = 0; e < E; ++e) ds[e] = c * std::exp(s[e] - A.lse[i]);
    } else {
      std::fill(ds, ds + E, T(0));
    }
    const int32_t* sel = A.expert + size_t(i) * K;
    const T* dw = S.dcomb + size_t(i) * K;
    T sum = 0, dot = 0;  // sum_k sig_k and sum_k dw_k sig_k (normalization)
    if (D.normalized) {
      for (int k = 0; k < K; ++k) {
        const T sg = sigmoid(s[sel[k]]);
        sum += sg;
        dot += dw[k] * sg;
      }
    }
    const T den = sum + T(1e-9), f = T(D.route_scale);
    for (int k = 0; k < K; ++k) {
      const T sg = sigmoid(s[sel[k]]);
      // w_k = sig_k (V1), or f sig_k / den: dL/dsig_k = f dw_k / den - f (sum_m dw_m sig_m) / den^2.
      const T dsig = D.normalized ? f * dw[k] / den - f * dot / (den * den) : dw[k];
      ds[sel[k]] += dsig * sg * (T(1) - sg);
    }
  }
  ops.gemm(false, false, N, d, E, T(1), S.ds, E, W.router, d, T(1), dh, d);
  ops.gemm(true, false, E, d, N, T(1), S.ds, E, h, d, T(1), G.router, d);
}

template <class T>
void moe_balance_values(const MoeDims& D, const MoeActs<T>& A, const T* bias, float* vals) {
  const int N = D.N, E = D.E, K = D.K;
  LADDER_ASSERT(K < E);
#pragma omp parallel
  {
    std::vector<T> b(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int i = 0; i < N; ++i) {
      const T* s = A.logits + size_t(i) * E;
      for (int e = 0; e < E; ++e) b[size_t(e)] = s[e] + bias[e];
      // alpha_i: the (K+1)-th largest biased score.
      std::nth_element(b.begin(), b.begin() + K, b.end(), std::greater<T>());
      const T alpha = b[size_t(K)];
      float* v = vals + size_t(i) * E;
      for (int e = 0; e < E; ++e) v[e] = float(s[e] - alpha);
    }
  }
}

void moe_quantile_beta(const float* vals, int64_t T, int E, int K, double* beta) {
  const int64_t q = std::max<int64_t>(1, T * K / E);  // floor(T*K/E), at least 1
  LADDER_ASSERT(q <= T);
#pragma omp parallel
  {
    std::vector<float> col(static_cast<size_t>(T));
#pragma omp for schedule(static)
    for (int j = 0; j < E; ++j) {
      for (int64_t i = 0; i < T; ++i) col[size_t(i)] = vals[size_t(i) * E + j];
      std::nth_element(col.begin(), col.begin() + (q - 1), col.end(), std::greater<float>());
      beta[j] = double(col[size_t(q - 1)]);
    }
  }
}

template <class T>
void moe_bias_from_beta(const double* beta, int E, T* bias) {
  double mean = 0;
  for (int e = 0; e < E; ++e) mean += beta[e];
  mean /= E;
  for (int e = 0; e < E; ++e) bias[e] = T(-(beta[e] - mean));
}

#define LADDER_MOE_INSTANTIATE(T, OPS)                                                                     \
  template double moe_forward<T, OPS>(OPS&, const MoeDims&, const MoeWeights<T>&, MoeActs<T>&, const T*, T*); \
  template void moe_backward<T, OPS>(OPS&, const MoeDims&, const MoeWeights<T>&, MoeGrads<T>&,             \
                                     const MoeActs<T>&, MoeScratch<T>&, const T*, const T*, T*, T);
LADDER_MOE_INSTANTIATE(float, BackendOps)
LADDER_MOE_INSTANTIATE(float, KernelOps<float>)
LADDER_MOE_INSTANTIATE(double, KernelOps<double>)
#undef LADDER_MOE_INSTANTIATE

#define LADDER_MOE_INSTANTIATE_T(T)                                                                     \
  template std::vector<std::pair<void**, size_t>> moe_act_requests<T>(const MoeDims&, MoeActs<T>&);     \
  template std::vector<std::pair<void**, size_t>> moe_scratch_requests<T>(const MoeDims&, MoeScratch<T>&); \
  template void moe_balance_values<T>(const MoeDims&, const MoeActs<T>&, const T*, float*);             \
  template void moe_bias_from_beta<T>(const double*, int, T*);
LADDER_MOE_INSTANTIATE_T(float)
LADDER_MOE_INSTANTIATE_T(double)
#undef LADDER_MOE_INSTANTIATE_T

}  // namespace ladder
