// CPU kernels of the MoE V1 dispatch (RECIPE.md section 2; model/moe.h has the block's math and
// tensor layout), templated on the scalar type like kernels.h: float is what training runs, double
// is what the finite-difference tests run. The CUDA backend implements the same contracts
// (backend/cuda/moe_ops.cu) and is tested against these.
//
// Shapes: N tokens, E routed experts, K experts per token, d width; NK = N*K slots, slot j = i*K+k
// is token i's k-th selected expert. `logits` are the router scores s [N, E] (unbiased).
#pragma once
#include <cstddef>
#include <cstdint>

namespace ladder::cpu {

// Per token i: lse[i] = logsumexp(s_i); expert[iK..iK+K) = top-K of s_i + bias, best first (on
// ties the lower expert index wins); comb[j] = sigmoid(s_{i,expert[j]}), or, when `normalized`,
// route_scale * sigmoid / (sum over the K selected sigmoids + 1e-9).
template <class T>
void moe_route(T* lse, int32_t* expert, T* comb, const T* logits, const T* bias, int N, int E, int K,
               bool normalized, double route_scale);

// Stable counting sort of the NK slots by expert: offsets [E+1] (expert e owns rows
// [offsets[e], offsets[e+1])), row [NK] slot -> row, slot [NK] row -> slot. Rows of one expert are
// in slot order. Integers: every backend gives the same answer bit for bit.
void moe_sort(int32_t* offsets, int32_t* row, int32_t* slot, const int32_t* expert, int NK, int E);

// The capacity layout of moe_sort's rows (model.moe_capacity): expert e's r-th row (sorted row
// offsets[e] + r) moves to q = e*C + r while r < C, and past that to E*C + ov[e] + (r - C), where
// ov [E+1] is the exclusive prefix sum of the overflows max(0, load_e - C) (ov[E]: all of them).
// So rows [e*C, e*C + C) are expert e's first C rows, padded when it has fewer, and rows from E*C
// are the rest, expert by expert (grouped GEMM blocks at the offsets ov, relative to row E*C).
// ov [E+2]: ov[E+1] = E*C + ov[E], the rows in use (for the ops that skip the rest).
// row [NK] OVERWRITTEN with each slot's q (slot -> row, as moe_sort's); cslot [R] gets each q's
// slot, -1 for the padding rows (below E*C) and -2 for the unused rows, from E*C + ov[E] to R.
// R >= E*C + ov[E] (moe_capacity_rows gives the bound). C >= 1.
void moe_capacity(int32_t* row, int32_t* cslot, int32_t* ov, const int32_t* offsets, const int32_t* slot, int NK,
                  int E, int C, int R);

// The rows a capacity layout of N tokens, K slots each, E experts, C rows per expert can need:
// E*C + the most overflow, NK - K*min(C, N). (An expert takes each token at most once, load_e <= N,
// and min(l, C) >= l * min(C, N) / N for 0 <= l <= N, so the rows within capacity sum to at least
// K*min(C, N).) C = 0 (no capacity layout): NK.
int64_t moe_capacity_rows(int N, int K, int E, int C);

// Zero the rows q < rows (cols elements of elem_bytes each, packed) whose cslot[q] < 0.
void moe_zero_rows(void* x, size_t elem_bytes, const int32_t* cslot, int rows, int cols);

// xs[r] = h[slot[r] / K] (rows of d); zeros where slot[r] == -1 (the capacity layout's padding),
// left as it is where slot[r] < -1 (its unused rows).
template <class T>
void moe_gather(T* xs, const T* h, const int32_t* slot, int NK, int K, int d);

// out[i] += sum_k comb[iK+k] * y[row[iK+k]], the K terms added in k order (deterministic).
// Y: T, or uint16_t for bf16 bits of y (model.moe_bf16's expert outputs), each widened exactly.
template <class T, class Y = T>
void moe_combine(T* out, const Y* y, const T* comb, const int32_t* row, int N, int K, int d);

// Backward of moe_combine: dy[row[j]] = comb[j] * dout[i] (OVERWRITTEN; every row is some slot's),
// dcomb[j] = dout[i] . y[row[j]]. Y as for moe_combine.
template <class T, class Y = T>
void moe_combine_backward(T* dy, T* dcomb, const T* dout, const Y* y, const T* comb, const int32_t* row, int N,
                          int K, int d);

// moe_gather with each row rounded to bf16 (nearest even) on the way: xs [NK, d] bf16 bits
// (model.moe_bf16's gathered expert rows).
void moe_gather_bf16(uint16_t* xs, const float* h, const int32_t* slot, int NK, int K, int d);

// Backward of moe_gather: dh[i] = sum_k dx[row[iK+k]] in k order (OVERWRITTEN).
template <class T>
void moe_gather_backward(T* dh, const T* dx, const int32_t* row, int N, int K, int d);

// Gradient of the loss with respect to the router scores, ds [N, E] (OVERWRITTEN): through the
// combine weights (sigmoid, and the normalization when on) given dcomb, plus z_scale times the
// gradient of sum_i lse_i^2 (2 lse_i softmax(s_i)); z_scale 0 = no z-loss. The top-K selection is
// piecewise constant and has no gradient.
template <class T>
void moe_router_backward(T* ds, const T* logits, const T* lse, const int32_t* expert, const T* dcomb, int N, int E,
                         int K, bool normalized, double route_scale, T z_scale);

// Quantile balancing, the per-token half: vals[i, e] = s_ie - alpha_i (float), alpha_i the
// (K+1)-th largest biased score s_i + bias. Requires K < E.
template <class T>
void moe_balance_values(float* vals, const T* logits, const T* bias, int N, int E, int K);

// Quantile balancing, the per-step half: beta[e] = the q-th largest of vals[:, e] over the T
// tokens (rows) of the step, q = max(1, floor(T*K/E)). Exact (a selection, no approximation).
void moe_quantile_beta(double* beta, const float* vals, int64_t T, int E, int K);

// Quantile balancing, the bias from beta: bias[e] = -(beta[e] - mean(beta)), the mean summed in
// double in expert order (what a one-thread device kernel repeats bit for bit).
template <class T>
void moe_balance_bias(T* bias, const double* beta, int E) {
  double mean = 0;
  for (int e = 0; e < E; ++e) mean += beta[e];
  mean /= E;
  for (int e = 0; e < E; ++e) bias[e] = T(-(beta[e] - mean));
}

// load[e] += offsets[e+1] - offsets[e]  (tokens routed to each expert, for the load statistics).
void moe_count_load(int64_t* load, const int32_t* offsets, int E);

// PKO reset flags: reset[t] = 1 at position 0 of each sequence of S tokens and after every eod_id
// token of the same sequence; else 0. ids [N_tok].
void pko_resets(uint8_t* reset, const int32_t* ids, int N_tok, int S, int eod_id);

}  // namespace ladder::cpu
