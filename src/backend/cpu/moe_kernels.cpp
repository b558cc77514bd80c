// CPU kernels of the MoE dispatch: contracts in moe_kernels.h.
#include "backend/cpu/moe_kernels.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include "backend/cpu/kernels.h"
#include "core/error.h"

namespace ladder::cpu {

namespace {

// Below this many output elements an OpenMP region costs more than the loop.
constexpr size_t kParMin = 1 << 14;

template <class T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

}  // namespace

template <class T>
void moe_route(T* lse_out, int32_t* expert, T* comb, const T* logits, const T* bias, int N, int E, int K,
               bool normalized, double route_scale) {
#pragma omp parallel for schedule(static) if (size_t(N) * E >= kParMin)
  for (int i = 0; i < N; ++i) {
    const T* s = logits + size_t(i) * E;
    T mx = s[0];
    for (int e = 1; e < E; ++e) mx = std::max(mx, s[e]);
    double se = 0;
    for (int e = 0; e < E; ++e) se += std::exp(double(s[e] - mx));
    lse_out[i] = T(double(mx) + std::log(se));
    // Insertion into a sorted list of K. A candidate displaces an entry only when strictly
    // greater, and experts are visited in increasing index, so on ties the lower index wins.
    int32_t* sel = expert + size_t(i) * K;
    T* val = comb + size_t(i) * K;  // biased scores, scratch until the weights overwrite them
    int n = 0;
    for (int e = 0; e < E; ++e) {
      const T v = s[e] + bias[e];
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
    if (normalized) {
      const T f = T(route_scale) / (sum + T(1e-9));
      for (int k = 0; k < K; ++k) val[k] *= f;
    }
  }
}

void moe_sort(int32_t* offsets, int32_t* row, int32_t* slot, const int32_t* expert, int NK, int E) {
  std::fill(offsets, offsets + E + 1, 0);
  for (int j = 0; j < NK; ++j) ++offsets[expert[j] + 1];
  for (int e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  // offsets[e] doubles as expert e's cursor; afterwards it holds the end of e = start of e+1.
  for (int j = 0; j < NK; ++j) {
    const int32_t r = offsets[expert[j]]++;
    row[j] = r;
    slot[r] = j;
  }
  for (int e = E; e > 0; --e) offsets[e] = offsets[e - 1];
  offsets[0] = 0;
}

void moe_capacity(int32_t* row, int32_t* cslot, int32_t* ov, const int32_t* offsets, const int32_t* slot, int NK,
                  int E, int C, int R) {
  LADDER_ASSERT(C >= 1 && offsets[E] == NK);
  ov[0] = 0;
  for (int e = 0; e < E; ++e) ov[e + 1] = ov[e] + std::max(0, offsets[e + 1] - offsets[e] - C);
  ov[E + 1] = E * C + ov[E];
  LADDER_ASSERT(ov[E + 1] <= R);
  std::fill(cslot, cslot + E * C, -1);
  std::fill(cslot + E * C, cslot + R, -2);
  for (int e = 0; e < E; ++e)
    for (int p = offsets[e]; p < offsets[e + 1]; ++p) {
      const int r = p - offsets[e];
      const int q = r < C ? e * C + r : E * C + ov[e] + (r - C);
      row[slot[p]] = q;
      cslot[q] = slot[p];
    }
}

int64_t moe_capacity_rows(int N, int K, int E, int C) {
  const int64_t NK = int64_t(N) * K;
  if (C <= 0) return NK;
  return int64_t(E) * C + std::max<int64_t>(0, NK - int64_t(K) * std::min(C, N));
}

void moe_zero_rows(void* x, size_t elem_bytes, const int32_t* cslot, int rows, int cols) {
  const size_t row_bytes = elem_bytes * size_t(cols);
  for (int q = 0; q < rows; ++q)
    if (cslot[q] < 0) std::memset(static_cast<char*>(x) + size_t(q) * row_bytes, 0, row_bytes);
}

template <class T>
void moe_gather(T* xs, const T* h, const int32_t* slot, int NK, int K, int d) {
#pragma omp parallel for schedule(static) if (size_t(NK) * d >= kParMin)
  for (int r = 0; r < NK; ++r) {
    if (slot[r] >= 0) std::memcpy(xs + size_t(r) * d, h + size_t(slot[r] / K) * d, sizeof(T) * d);
    else if (slot[r] == -1) std::memset(xs + size_t(r) * d, 0, sizeof(T) * d);
  }
}

void moe_gather_bf16(uint16_t* xs, const float* h, const int32_t* slot, int NK, int K, int d) {
#pragma omp parallel for schedule(static) if (size_t(NK) * d >= kParMin)
  for (int r = 0; r < NK; ++r) {
    uint16_t* dst = xs + size_t(r) * d;
    if (slot[r] < 0) {
      if (slot[r] == -1) std::memset(dst, 0, sizeof(uint16_t) * d);
      continue;
    }
    const float* src = h + size_t(slot[r] / K) * d;
    for (int c = 0; c < d; ++c) dst[c] = bf16_bits(src[c]);
  }
}

// An element of y as T: itself, or bf16 bits widened (exact).
template <class T, class Y>
inline T y_value(Y v) {
  if constexpr (std::is_same_v<Y, uint16_t>) return T(bf16_value(v));
  else return v;
}

template <class T, class Y>
void moe_combine(T* out, const Y* y, const T* comb, const int32_t* row, int N, int K, int d) {
#pragma omp parallel for schedule(static) if (size_t(N) * K * d >= kParMin)
  for (int i = 0; i < N; ++i) {
    T* o = out + size_t(i) * d;
    for (int k = 0; k < K; ++k) {
      const size_t j = size_t(i) * K + k;
      const T w = comb[j];
      const Y* yr = y + size_t(row[j]) * d;
#pragma omp simd
      for (int c = 0; c < d; ++c) o[c] += w * y_value<T>(yr[c]);
    }
  }
}

// One slot of moe_combine_backward on T rows: dyr = w * go, returns go . yr. One function for every
// Y, so a bf16 y (widened into a T row first) gets bitwise the fp32 sum: the simd reduction's order
// is the compiler's, and is the same only for the same code.
template <class T>
[[gnu::noinline]] T combine_backward_row(T* dyr, const T* go, const T* yr, T w, int d) {
  T dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int c = 0; c < d; ++c) {
    dot += go[c] * yr[c];
    dyr[c] = w * go[c];
  }
  return dot;
}

template <class T, class Y>
void moe_combine_backward(T* dy, T* dcomb, const T* dout, const Y* y, const T* comb, const int32_t* row, int N,
                          int K, int d) {
#pragma omp parallel if (size_t(N) * K * d >= kParMin)
  {
    std::vector<T> wide(std::is_same_v<Y, T> ? 0 : size_t(d));  // a bf16 row, widened
#pragma omp for schedule(static)
    for (int i = 0; i < N; ++i) {
      const T* go = dout + size_t(i) * d;
      for (int k = 0; k < K; ++k) {
        const size_t j = size_t(i) * K + k;
        const size_t r = size_t(row[j]);
        const T* yr;
        if constexpr (std::is_same_v<Y, T>) {
          yr = y + r * d;
        } else {
          for (int c = 0; c < d; ++c) wide[size_t(c)] = y_value<T>(y[r * d + size_t(c)]);
          yr = wide.data();
        }
        dcomb[j] = combine_backward_row<T>(dy + r * d, go, yr, comb[j], d);
      }
    }
  }
}

template <class T>
void moe_gather_backward(T* dh, const T* dx, const int32_t* row, int N, int K, int d) {
#pragma omp parallel for schedule(static) if (size_t(N) * K * d >= kParMin)
  for (int i = 0; i < N; ++i) {
    T* o = dh + size_t(i) * d;
    std::memcpy(o, dx + size_t(row[size_t(i) * K]) * d, sizeof(T) * d);
    for (int k = 1; k < K; ++k) {
      const T* x = dx + size_t(row[size_t(i) * K + k]) * d;
#pragma omp simd
      for (int c = 0; c < d; ++c) o[c] += x[c];
    }
  }
}

template <class T>
void moe_router_backward(T* ds_out, const T* logits, const T* lse, const int32_t* expert, const T* dcomb, int N, int E,
                         int K, bool normalized, double route_scale, T z_scale) {
#pragma omp parallel for schedule(static) if (size_t(N) * E >= kParMin)
  for (int i = 0; i < N; ++i) {
    const T* s = logits + size_t(i) * E;
    T* ds = ds_out + size_t(i) * E;
    if (z_scale != T(0)) {
      const T c = z_scale * T(2) * lse[i];
      for (int e = 0; e < E; ++e) ds[e] = c * std::exp(s[e] - lse[i]);
    } else {
      std::fill(ds, ds + E, T(0));
    }
    const int32_t* sel = expert + size_t(i) * K;
    const T* dw = dcomb + size_t(i) * K;
    T sum = 0, dot = 0;  // sum_k sig_k and sum_k dw_k sig_k (normalization)
    if (normalized) {
      for (int k = 0; k < K; ++k) {
        const T sg = sigmoid(s[sel[k]]);
        sum += sg;
        dot += dw[k] * sg;
      }
    }
    const T den = sum + T(1e-9), f = T(route_scale);
    for (int k = 0; k < K; ++k) {
      const T sg = sigmoid(s[sel[k]]);
      // w_k = sig_k (V1), or f sig_k / den: dL/dsig_k = f dw_k / den - f (sum_m dw_m sig_m) / den^2.
      const T dsig = normalized ? f * dw[k] / den - f * dot / (den * den) : dw[k];
      ds[sel[k]] += dsig * sg * (T(1) - sg);
    }
  }
}

template <class T>
void moe_balance_values(float* vals, const T* logits, const T* bias, int N, int E, int K) {
  LADDER_ASSERT(K < E);
#pragma omp parallel
  {
    std::vector<T> b(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int i = 0; i < N; ++i) {
      const T* s = logits + size_t(i) * E;
      for (int e = 0; e < E; ++e) b[size_t(e)] = s[e] + bias[e];
      // alpha_i: the (K+1)-th largest biased score.
      std::nth_element(b.begin(), b.begin() + K, b.end(), std::greater<T>());
      const T alpha = b[size_t(K)];
      float* v = vals + size_t(i) * E;
      for (int e = 0; e < E; ++e) v[e] = float(s[e] - alpha);
    }
  }
}

void moe_quantile_beta(double* beta, const float* vals, int64_t T, int E, int K) {
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

void moe_count_load(int64_t* load, const int32_t* offsets, int E) {
  for (int e = 0; e < E; ++e) load[e] += offsets[e + 1] - offsets[e];
}

void pko_resets(uint8_t* reset, const int32_t* ids, int N_tok, int S, int eod_id) {
  for (int t = 0; t < N_tok; ++t) reset[t] = (t % S == 0 || ids[t - 1] == eod_id) ? 1 : 0;
}

#define LADDER_MOE_KERNELS(T)                                                                                    \
  template void moe_route<T>(T*, int32_t*, T*, const T*, const T*, int, int, int, bool, double);                 \
  template void moe_gather<T>(T*, const T*, const int32_t*, int, int, int);                                      \
  template void moe_combine<T>(T*, const T*, const T*, const int32_t*, int, int, int);                           \
  template void moe_combine_backward<T>(T*, T*, const T*, const T*, const T*, const int32_t*, int, int, int);    \
  template void moe_gather_backward<T>(T*, const T*, const int32_t*, int, int, int);                             \
  template void moe_router_backward<T>(T*, const T*, const T*, const int32_t*, const T*, int, int, int, bool,     \
                                       double, T);                                                               \
  template void moe_balance_values<T>(float*, const T*, const T*, int, int, int);
LADDER_MOE_KERNELS(float)
LADDER_MOE_KERNELS(double)
#undef LADDER_MOE_KERNELS
template void moe_combine<float, uint16_t>(float*, const uint16_t*, const float*, const int32_t*, int, int, int);
template void moe_combine_backward<float, uint16_t>(float*, float*, const float*, const uint16_t*, const float*,
                                                    const int32_t*, int, int, int);

}  // namespace ladder::cpu
