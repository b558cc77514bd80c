// CPU kernels of the recipe switches in attention and norms (RECIPE.md section 2): partial key
// offset, exclusive self attention, the per-head output gate and the elementwise parts of GatedNorm.
// See kernels.h for each contract. All are memory-bound passes over [tokens, features] arrays:
// OpenMP over tokens (or elements), each output element owned by one thread, so results do not
// depend on the thread count.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/kernels.h"

namespace ladder::cpu {

namespace {

// Below this many elements an OpenMP region costs more than the pass itself.
constexpr size_t kMinParallel = 1 << 15;

template <class T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Partial key offset

template <class T>
void pko_shift_forward(T* out, const T* k, const uint8_t* reset, int N_tok, int nkv, int hd, int from_dim) {
  const size_t row = size_t(nkv) * hd;
  const int tail = hd - from_dim;
#pragma omp parallel for schedule(static) if (size_t(N_tok) * row >= kMinParallel)
  for (int t = 0; t < N_tok; ++t) {
    T* o = out + size_t(t) * row;
    const T* cur = k + size_t(t) * row;
    // reset[t] is set at every sequence start, so t-1 is only read inside the same sequence.
    const T* prev = (reset[t] || t == 0) ? nullptr : cur - row;
    for (int h = 0; h < nkv; ++h) {
      const size_t off = size_t(h) * hd;
      std::memcpy(o + off, cur + off, sizeof(T) * from_dim);
      if (prev)
        std::memcpy(o + off + from_dim, prev + off + from_dim, sizeof(T) * tail);
      else
        std::memset(o + off + from_dim, 0, sizeof(T) * tail);
    }
  }
}

template <class T>
void pko_shift_backward(T* dk, const T* dout, const uint8_t* reset, int N_tok, int nkv, int hd, int from_dim) {
  const size_t row = size_t(nkv) * hd;
  const int tail = hd - from_dim;
#pragma omp parallel for schedule(static) if (size_t(N_tok) * row >= kMinParallel)
  for (int t = 0; t < N_tok; ++t) {
    T* d = dk + size_t(t) * row;
    const T* cur = dout + size_t(t) * row;
    // Token t's shifted half went to token t+1 (unless t+1 starts a sequence or document).
    const T* next = (t + 1 < N_tok && !reset[t + 1]) ? cur + row : nullptr;
    for (int h = 0; h < nkv; ++h) {
      const size_t off = size_t(h) * hd;
      std::memcpy(d + off, cur + off, sizeof(T) * from_dim);
      if (next)
        std::memcpy(d + off + from_dim, next + off + from_dim, sizeof(T) * tail);
      else
        std::memset(d + off + from_dim, 0, sizeof(T) * tail);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Queries / keys into attention: PKO shift -> QK-norm -> RoPE
//
// The composition of the existing kernels, on purpose: the CPU results (and so every CPU test,
// the PyTorch references and resumed runs) stay bitwise what the three separate ops gave.

namespace {

// Scratch reused across calls (per thread and scalar type), like rmsnorm_backward's partials.
template <class T>
T* qk_scratch(size_t n) {
  static thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

}  // namespace

template <class T>
void qk_prep_forward(T* out, T* rstd, const T* x, const T* gain, const uint8_t* reset, int N_tok, int S, int nheads,
                     int hd, int rot_dims, T theta, bool norm, T eps) {
  const size_t n = size_t(N_tok > 0 ? N_tok : 0) * size_t(nheads) * size_t(hd);
  if (n == 0) return;
  const T* src = x;
  if (reset) {
    pko_shift_forward(out, x, reset, N_tok, nheads, hd, hd / 2);
    src = out;  // normed in place below: rmsnorm reads a whole row before writing it, element by element
  }
  if (norm)
    rmsnorm_forward(out, rstd, src, gain, N_tok * nheads, hd, eps);
  else if (src != out)
    std::memcpy(out, src, sizeof(T) * n);
  rope_forward(out, N_tok, S, nheads, hd, rot_dims, theta);
}

template <class T>
void qk_prep_backward(T* dx, T* dgain, const T* dout, const T* x, const T* gain, const T* rstd, const uint8_t* reset,
                      int N_tok, int S, int nheads, int hd, int rot_dims, T theta, bool norm) {
  const size_t n = size_t(N_tok > 0 ? N_tok : 0) * size_t(nheads) * size_t(hd);
  if (n == 0) return;
  const int from = hd / 2;
  if (!norm) {
    if (!reset) {  // RoPE's adjoint alone, in place on a copy
      std::memcpy(dx, dout, sizeof(T) * n);
      rope_backward(dx, N_tok, S, nheads, hd, rot_dims, theta);
      return;
    }
    T* dn = qk_scratch<T>(n);
    std::memcpy(dn, dout, sizeof(T) * n);
    rope_backward(dn, N_tok, S, nheads, hd, rot_dims, theta);
    pko_shift_backward(dx, dn, reset, N_tok, nheads, hd, from);
    return;
  }
  // [d(norm output) | shifted input | d(shifted input)]; the last two only with the shift.
  T* scratch = qk_scratch<T>(reset ? 3 * n : n);
  T* dn = scratch;
  std::memcpy(dn, dout, sizeof(T) * n);
  rope_backward(dn, N_tok, S, nheads, hd, rot_dims, theta);
  if (!reset) {
    rmsnorm_backward(dx, dgain, dn, x, gain, rstd, N_tok * nheads, hd, false);
    return;
  }
  T* xs = scratch + n;
  T* ds = scratch + 2 * n;
  pko_shift_forward(xs, x, reset, N_tok, nheads, hd, from);  // the rows the forward normed
  rmsnorm_backward(ds, dgain, dn, xs, gain, rstd, N_tok * nheads, hd, false);
  pko_shift_backward(dx, ds, reset, N_tok, nheads, hd, from);
}

// ---------------------------------------------------------------------------------------------
// Exclusive self attention
//
// With c = (y.v)/n, n = v.v + eps:  z = y - c v.
//   dy = dz - (dz.v / n) v                       (the projection is symmetric)
//   dv = -c dz - (a/n) y + (2 a c / n) v,  a = dz.v   (c depends on v through y.v and n)

template <class T>
void xsa_forward(T* z, const T* y, const T* v, int N_tok, int H, int KV, int hd) {
  const int G = H / KV;
#pragma omp parallel for schedule(static) if (size_t(N_tok) * H * hd >= kMinParallel)
  for (int t = 0; t < N_tok; ++t) {
    for (int h = 0; h < H; ++h) {
      const T* yr = y + (size_t(t) * H + h) * hd;
      const T* vr = v + (size_t(t) * KV + h / G) * hd;
      T* zr = z + (size_t(t) * H + h) * hd;
      T yv = 0, vv = 0;
      for (int c = 0; c < hd; ++c) {
        yv += yr[c] * vr[c];
        vv += vr[c] * vr[c];
      }
      const T coef = yv / (vv + T(kXsaEps));
      for (int c = 0; c < hd; ++c) zr[c] = yr[c] - coef * vr[c];
    }
  }
}

template <class T>
void xsa_backward(T* dy, T* dv, const T* dz, const T* y, const T* v, int N_tok, int H, int KV, int hd) {
  const int G = H / KV;
#pragma omp parallel for schedule(static) if (size_t(N_tok) * H * hd >= kMinParallel)
  for (int t = 0; t < N_tok; ++t) {
    for (int g = 0; g < KV; ++g) {
      const T* vr = v + (size_t(t) * KV + g) * hd;
      T* dvr = dv + (size_t(t) * KV + g) * hd;
      T vv = 0;
      for (int c = 0; c < hd; ++c) vv += vr[c] * vr[c];
      const T n = vv + T(kXsaEps);
      std::fill(dvr, dvr + hd, T(0));
      for (int h = g * G; h < (g + 1) * G; ++h) {
        const T* yr = y + (size_t(t) * H + h) * hd;
        const T* dzr = dz + (size_t(t) * H + h) * hd;
        T* dyr = dy + (size_t(t) * H + h) * hd;
        T yv = 0, a = 0;
        for (int c = 0; c < hd; ++c) {
          yv += yr[c] * vr[c];
          a += dzr[c] * vr[c];
        }
        const T coef = yv / n, an = a / n, vcoef = T(2) * a * coef / n;
        // dv first: dy may alias dz.
        for (int c = 0; c < hd; ++c) dvr[c] += -coef * dzr[c] - an * yr[c] + vcoef * vr[c];
        for (int c = 0; c < hd; ++c) dyr[c] = dzr[c] - an * vr[c];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Per-head output gate

template <class T>
void head_gate_forward(T* out, T* factor, const T* x, const T* logit, int N_tok, int H, int hd) {
#pragma omp parallel for schedule(static) if (size_t(N_tok) * H * hd >= kMinParallel)
  for (int t = 0; t < N_tok; ++t) {
    for (int h = 0; h < H; ++h) {
      const size_t i = size_t(t) * H + h;
      const T f = T(2) * sigmoid(logit[i]);
      factor[i] = f;
      const T* xr = x + i * hd;
      T* orow = out + i * hd;
      for (int c = 0; c < hd; ++c) orow[c] = xr[c] * f;
    }
  }
}

template <class T>
void head_gate_backward(T* dx, T* dlogit, const T* dout, const T* x, const T* factor, int N_tok, int H, int hd) {
#pragma omp parallel for schedule(static) if (size_t(N_tok) * H * hd >= kMinParallel)
  for (int t = 0; t < N_tok; ++t) {
    for (int h = 0; h < H; ++h) {
      const size_t i = size_t(t) * H + h;
      const T f = factor[i];
      const T* dor = dout + i * hd;
      const T* xr = x + i * hd;
      T* dxr = dx + i * hd;
      T s = 0;
      for (int c = 0; c < hd; ++c) s += dor[c] * xr[c];
      // d(2 sigmoid(a))/da = 2 sigmoid (1 - sigmoid) = f (1 - f/2).
      dlogit[i] = s * f * (T(1) - T(0.5) * f);
      for (int c = 0; c < hd; ++c) dxr[c] = dor[c] * f;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GatedNorm elementwise parts

template <class T>
void silu_forward(T* a, const T* u, size_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallel)
  for (size_t i = 0; i < n; ++i) a[i] = u[i] * sigmoid(u[i]);
}

template <class T>
void silu_backward(T* du, const T* da, const T* u, size_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallel)
  for (size_t i = 0; i < n; ++i) {
    const T s = sigmoid(u[i]);
    du[i] = da[i] * s * (T(1) + u[i] * (T(1) - s));
  }
}

template <class T>
void sigmoid_gate_forward(T* y, T* g, const T* x, size_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallel)
  for (size_t i = 0; i < n; ++i) {
    const T s = sigmoid(g[i]);
    g[i] = s;
    y[i] = x[i] * s;
  }
}

template <class T>
void sigmoid_gate_backward(T* dx, T* dg, const T* dy, const T* x, const T* s, size_t n, bool accumulate_dx) {
  if (accumulate_dx) {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallel)
    for (size_t i = 0; i < n; ++i) {
      dg[i] = dy[i] * x[i] * s[i] * (T(1) - s[i]);
      dx[i] += dy[i] * s[i];
    }
  } else {
#pragma omp parallel for simd schedule(static) if (n >= kMinParallel)
    for (size_t i = 0; i < n; ++i) {
      const T d = dy[i];
      dg[i] = d * x[i] * s[i] * (T(1) - s[i]);
      dx[i] = d * s[i];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Explicit instantiations

#define LADDER_INSTANTIATE_SWITCHES(T)                                                             \
  template void pko_shift_forward<T>(T*, const T*, const uint8_t*, int, int, int, int);           \
  template void pko_shift_backward<T>(T*, const T*, const uint8_t*, int, int, int, int);          \
  template void qk_prep_forward<T>(T*, T*, const T*, const T*, const uint8_t*, int, int, int, int, int, T, bool, T); \
  template void qk_prep_backward<T>(T*, T*, const T*, const T*, const T*, const T*, const uint8_t*, int, int, int,  \
                                    int, int, T, bool);                                            \
  template void xsa_forward<T>(T*, const T*, const T*, int, int, int, int);                        \
  template void xsa_backward<T>(T*, T*, const T*, const T*, const T*, int, int, int, int);         \
  template void head_gate_forward<T>(T*, T*, const T*, const T*, int, int, int);                   \
  template void head_gate_backward<T>(T*, T*, const T*, const T*, const T*, int, int, int);        \
  template void silu_forward<T>(T*, const T*, size_t);                                             \
  template void silu_backward<T>(T*, const T*, const T*, size_t);                                  \
  template void sigmoid_gate_forward<T>(T*, T*, const T*, size_t);                                 \
  template void sigmoid_gate_backward<T>(T*, T*, const T*, const T*, const T*, size_t, bool);

LADDER_INSTANTIATE_SWITCHES(float)
LADDER_INSTANTIATE_SWITCHES(double)
#undef LADDER_INSTANTIATE_SWITCHES

}  // namespace ladder::cpu
