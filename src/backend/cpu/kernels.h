// CPU reference kernels, templated on the scalar type: float is what training runs; double is what
// the finite-difference tests run. Each layer is a forward/backward pair. Conventions:
//  - all matrices row-major; activations are [N tokens, features];
//  - backward functions OVERWRITE input gradients (dx, dq, ...) unless a flag says accumulate, and
//    ACCUMULATE (+=) parameter gradients (dgain, dtable) so gradient accumulation is free;
//  - no allocation inside a call except thread-local scratch reused across calls.
// Explicit instantiations for float and double live in kernels.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ladder::cpu {

// C[M,N] = alpha * op(A) * op(B) + beta * C. op(A) is [M,K], op(B) is [K,N]. Row-major with
// leading dimensions lda/ldb/ldc (OpenBLAS cblas_sgemm / cblas_dgemm).
template <class T>
void gemm(bool transA, bool transB, int M, int N, int K, T alpha, const T* A, int lda, const T* B,
          int ldb, T beta, T* C, int ldc);

// Grouped GEMM over E groups of rows (the MoE's per-expert blocks after the counting sort): group e
// owns rows [offsets[e], offsets[e+1]) of the row-blocked operands. Two shapes:
//  - rows_out = true:  C[rows_e, :N] = alpha * A[rows_e, :K] * op(B_e) + beta * C[rows_e]
//                      (B_e = B + e*strideB is [N,K] when transB, else [K,N]);
//  - rows_out = false: C_e[M, N] = alpha * A[rows_e, :M]^T * B[rows_e, :N] + beta * C_e
//                      (C_e = C + e*strideC; the weight gradient of an expert, summed over its rows).
// Each group is one gemm; groups run in parallel (single-threaded gemms) when there are enough of
// them, else one after another with a threaded gemm. Deterministic for any thread count.
template <class T>
void grouped_gemm(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K, T alpha,
                  const T* A, int lda, const T* B, int ldb, size_t strideB, T beta, T* C, int ldc,
                  size_t strideC);

// out[i,:] = table[ids[i],:]   (table [V,D], out [N,D])
template <class T>
void embedding_forward(T* out, const T* table, const int32_t* ids, int N, int D);
// dtable[ids[i],:] += dout[i,:]  (deterministic regardless of thread count)
template <class T>
void embedding_backward(T* dtable, const T* dout, const int32_t* ids, int N, int D);

// RMSNorm over rows of length D: rstd[i] = 1/sqrt(mean(x_i^2) + eps); y = x * rstd * gain.
// gain may be nullptr (non-parametric norm, gain 1). rstd [N] is saved for backward.
template <class T>
void rmsnorm_forward(T* y, T* rstd, const T* x, const T* gain, int N, int D, T eps);
// dx = (overwrite, or += when accumulate_dx) gradient wrt x; dgain += gradient wrt gain (skipped
// when gain/dgain are nullptr).
template <class T>
void rmsnorm_backward(T* dx, T* dgain, const T* dy, const T* x, const T* gain, const T* rstd, int N,
                      int D, bool accumulate_dx);

// Rotary embedding, rotate-half convention, in place on x [N_tok, nheads*hd]. Token t has position
// t % S. Only the first rot_dims dims of each head rotate (rot_dims == hd: full RoPE; hd/2:
// half-RoPE): pairs (i, i + rot_dims/2) for i < rot_dims/2 with frequency theta^(-2i/rot_dims).
template <class T>
void rope_forward(T* x, int N_tok, int S, int nheads, int hd, int rot_dims, T theta);
// The adjoint (inverse rotation), in place on the gradient.
template <class T>
void rope_backward(T* dx, int N_tok, int S, int nheads, int hd, int rot_dims, T theta);

// Causal multi-head attention with grouped KV heads, optional sliding window.
//  q [B*S, H*hd], k and v [B*S, KV*hd], o [B*S, H*hd], lse [B, H, S] (log-sum-exp of the scaled
//  scores of each query row, saved for backward). Query head h uses KV head h / (H/KV).
//  Query i attends to keys j with j <= i and (window <= 0 or i - j < window).
//  Scores are scale * q.k. Blocked over query rows, no S x S tensor in memory.
struct AttnShape {
  int B, S, H, KV, hd;
  int window;  // <= 0: full causal
  double scale;
};
template <class T>
void attention_forward(T* o, T* lse, const T* q, const T* k, const T* v, const AttnShape& s);
// dq, dk, dv OVERWRITTEN. Recomputes probabilities from q, k, lse.
template <class T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                        const T* o, const T* lse, const AttnShape& s);

// SwiGLU: h = silu(g) * u, elementwise over n values.
template <class T>
void swiglu_forward(T* h, const T* g, const T* u, size_t n);
template <class T>
void swiglu_backward(T* dg, T* du, const T* dh, const T* g, const T* u, size_t n);

// Softmax cross-entropy with optional z-loss, fused, IN PLACE: `logits` [N,V] is replaced by the
// gradient of  grad_scale * sum_i (xent_i + z_coef * lse_i^2)  with respect to the logits.
// Returns the sums over the N rows (in double) of xent_i and of lse_i^2.
struct XentSums {
  double xent = 0, lse_sq = 0;
};
template <class T>
XentSums softmax_xent(T* logits, const int32_t* targets, int N, int V, T z_coef, T grad_scale);
// Forward only (logits untouched): per-row losses written to `losses` [N] if not nullptr.
template <class T>
XentSums softmax_xent_forward(const T* logits, const int32_t* targets, int N, int V, T* losses);

// Small vector helpers (OpenMP over elements).
template <class T>
void add_inplace(T* y, const T* x, size_t n);  // y += x
template <class T>
void scale_inplace(T* x, T s, size_t n);  // x *= s
template <class T>
double sum_squares(const T* x, size_t n);  // deterministic for a fixed thread count

// bf16 storage (model.saved_activations: bf16): out[i] = bf16(in[i]), round to nearest even (NaN
// stays NaN), as uint16_t bits; and back (exact: a bf16 is the top half of a float).
void f32_to_bf16(uint16_t* out, const float* in, size_t n);
void bf16_to_f32(float* out, const uint16_t* in, size_t n);
// The same for one value (what the array forms do per element, and what tests and the emulated
// cuBLASLt round with). Round to nearest even on the bit pattern: adding 0x7fff plus the lowest
// kept bit carries into the kept half exactly when the dropped half is above one half ulp, or equal
// with an odd kept half; NaNs stay NaN (quiet bit set) instead of possibly rounding into infinity.
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_value(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
// SwiGLU on bf16 gate / up (model.mlp_bf16): in chunks, the chunk's g and u widened, then
// swiglu_forward<float> / swiglu_backward<float> on them, the forward's h rounded with f32_to_bf16:
// bitwise those three steps on whole arrays, without [n]-sized fp32 scratch.
void swiglu_forward_bf16(uint16_t* h, const uint16_t* g, const uint16_t* u, size_t n);
void swiglu_backward_bf16(float* dg, float* du, const float* dh, const uint16_t* g, const uint16_t* u, size_t n);
// The same with dh, dg and du in bf16 as well (model.moe_bf16_grads): dh widened with g and u, dg and
// du rounded with f32_to_bf16 from swiglu_backward<float>'s results.
void swiglu_backward_bf16(uint16_t* dg, uint16_t* du, const uint16_t* dh, const uint16_t* g, const uint16_t* u,
                          size_t n);

// AdamW on one tensor (decoupled weight decay, bias corrections passed in):
//  m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//  p -= lr * ( (m/bc1) / (sqrt(v/bc2) + eps) + wd * p )
// with g read as g * gscale (optim_kernels.h: the clip factor without a pass over the gradients).
template <class T>
void adamw_update(T* p, const T* g, T* m, T* v, size_t n, T lr, T b1, T b2, T eps, T wd, T bc1,
                  T bc2, T gscale = T(1));

// ---------------------------------------------------------------------------------------------
// Recipe switches in attention and norms (RECIPE.md section 2); code in attn_switch_kernels.cpp.

// Partial key offset. k, out [N_tok, nkv*hd]; token t = b*S + p. out = k, except that dims
// [from_dim, hd) of every head of token t hold token t-1's, or zero where reset[t] != 0. The caller
// sets reset[t] at position 0 of each sequence and at every document start, so nothing crosses a
// sequence or a document.
template <class T>
void pko_shift_forward(T* out, const T* k, const uint8_t* reset, int N_tok, int nkv, int hd, int from_dim);
// The adjoint: dk (OVERWRITTEN) from dout; dims [from_dim, hd) of token t get dout of token t+1
// (zero when t+1 is a reset or past the end).
template <class T>
void pko_shift_backward(T* dk, const T* dout, const uint8_t* reset, int N_tok, int nkv, int hd, int from_dim);

// The attention input path of queries or keys, as one op: out = RoPE(QK-norm(PKO-shift(x))) per head
// row of hd, i.e. exactly
//   pko_shift_forward(s, x, reset, N_tok, nheads, hd, hd/2)      only when reset != nullptr
//   rmsnorm_forward(n, rstd, s, gain, N_tok*nheads, hd, eps)     only when norm (else n = s)
//   rope_forward(n, N_tok, S, nheads, hd, rot_dims, theta);  out = n
// (the CPU runs exactly that, so results are bitwise the three ops'; a GPU fuses them into one pass).
// x, out [N_tok, nheads*hd]; rstd [N_tok*nheads] written only when norm; gain [hd] or nullptr.
// out must not alias x (the shift reads the previous token's row).
template <class T>
void qk_prep_forward(T* out, T* rstd, const T* x, const T* gain, const uint8_t* reset, int N_tok, int S, int nheads,
                     int hd, int rot_dims, T theta, bool norm, T eps);
// The adjoint, from the forward's own inputs (x is the RAW input, before the shift: the shifted
// rows are recomputed, so the caller need not keep them) and its rstd: dx OVERWRITTEN; dgain +=
// the gain gradient (as rmsnorm_backward: skipped when gain or dgain is nullptr, or !norm). dout is
// read only. dx must not alias dout or x.
template <class T>
void qk_prep_backward(T* dx, T* dgain, const T* dout, const T* x, const T* gain, const T* rstd, const uint8_t* reset,
                      int N_tok, int S, int nheads, int hd, int rot_dims, T theta, bool norm);

// Exclusive self attention: per query head, z = y - (y.v / (v.v + kXsaEps)) v, with v the token's
// own value vector of the head's KV group (h / (H/KV)). y, z [N_tok, H*hd], v [N_tok, KV*hd].
constexpr double kXsaEps = 1e-12;  // only keeps an all-zero value vector finite
template <class T>
void xsa_forward(T* z, const T* y, const T* v, int N_tok, int H, int KV, int hd);
// dy and dv OVERWRITTEN (dv sums the G heads of a group); dy may alias dz.
template <class T>
void xsa_backward(T* dy, T* dv, const T* dz, const T* y, const T* v, int N_tok, int H, int KV, int hd);

// Per-head output gate: factor[t,h] = 2*sigmoid(logit[t,h]) (saved), out = x * factor per head.
// x, out [N_tok, H*hd]; logit, factor [N_tok, H]. out may alias x.
template <class T>
void head_gate_forward(T* out, T* factor, const T* x, const T* logit, int N_tok, int H, int hd);
// dx OVERWRITTEN (may alias dout), dlogit OVERWRITTEN.
template <class T>
void head_gate_backward(T* dx, T* dlogit, const T* dout, const T* x, const T* factor, int N_tok, int H, int hd);

// Elementwise pieces of GatedNorm y = x * sigmoid(W_up SiLU(W_down x)):
// a = silu(u);  du = da * silu'(u) (OVERWRITTEN, may alias da).
template <class T>
void silu_forward(T* a, const T* u, size_t n);
template <class T>
void silu_backward(T* du, const T* da, const T* u, size_t n);
// g := sigmoid(g) in place (saved for backward), y = x * g.
template <class T>
void sigmoid_gate_forward(T* y, T* g, const T* x, size_t n);
// From dy and the saved sigmoid s: dg = dy * x * s * (1 - s) (OVERWRITTEN), dx = dy * s
// (OVERWRITTEN, or += when accumulate_dx). dx may alias dy when not accumulating.
template <class T>
void sigmoid_gate_backward(T* dx, T* dg, const T* dy, const T* x, const T* s, size_t n, bool accumulate_dx);

}  // namespace ladder::cpu
