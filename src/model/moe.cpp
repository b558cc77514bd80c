// The MoE V1 block: see moe.h for the contract and the tensor layout.
#include "model/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "core/error.h"

namespace ladder {


template <class T>
std::vector<std::pair<void**, size_t>> moe_act_requests(const MoeDims& D, MoeActs<T>& a) {
  const size_t N = D.N, NK = size_t(D.N) * D.K, R = size_t(moe_rows(D)), t = sizeof(T), i4 = sizeof(int32_t);
  const size_t th = D.bf16 ? sizeof(uint16_t) : t;  // the hidden tensors' element (D.bf16: bf16 bits)
  std::vector<std::pair<void**, size_t>> r = {
      {(void**)&a.logits, N * D.E * t}, {(void**)&a.lse, N * t},         {(void**)&a.expert, NK * i4},
      {(void**)&a.comb, NK * t},        {(void**)&a.row, NK * i4},       {(void**)&a.slot, NK * i4},
      {(void**)&a.offsets, size_t(D.E + 1) * i4},                        {(void**)&a.xs, R * D.d * th},
      {(void**)&a.g, R * D.I * th},     {(void**)&a.u, R * D.I * th},    {(void**)&a.a, R * D.I * th},
      {(void**)&a.y, R * D.d * th}};
  if (D.C > 0) r.insert(r.end(), {{(void**)&a.cslot, R * i4}, {(void**)&a.ov, size_t(D.E + 2) * i4}});
  if (D.Is > 0)
    r.insert(r.end(),
             {{(void**)&a.sgate, N * D.Is * th}, {(void**)&a.sup, N * D.Is * th}, {(void**)&a.sact, N * D.Is * th}});
  return r;
}

template <class T>
std::vector<std::pair<void**, size_t>> moe_scratch_requests(const MoeDims& D, MoeScratch<T>& s) {
  const size_t N = D.N, NK = size_t(D.N) * D.K, R = size_t(moe_rows(D)), t = sizeof(T);
  const size_t tg = D.bf16_grads ? sizeof(uint16_t) : t;  // dy, dg, du, da (D.bf16_grads: bf16 bits)
  std::vector<std::pair<void**, size_t>> r = {
      {(void**)&s.dy, R * D.d * tg}, {(void**)&s.dg, R * D.I * tg}, {(void**)&s.du, R * D.I * tg},
      {(void**)&s.da, R * D.I * tg}, {(void**)&s.dx, R * D.d * t},  {(void**)&s.ds, N * D.E * t},
      {(void**)&s.dcomb, NK * t}};
  if (D.Is > 0)
    r.insert(r.end(), {{(void**)&s.dsg, N * D.Is * t}, {(void**)&s.dsu, N * D.Is * t}, {(void**)&s.dsa, N * D.Is * t}});
  return r;
}

namespace {

// A pointer `elems` elements past p, whose elements are bf16 bits when b16.
template <class T>
T* past(T* p, size_t elems, bool b16) {
  using Byte = std::conditional_t<std::is_const_v<T>, const char, char>;
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(p) + elems * (b16 ? sizeof(uint16_t) : sizeof(T)));
}

// The expert GEMMs over the block's rows, in either layout (MoeDims::C). Sorted: one grouped GEMM
// over the offsets. Capacity: one batched GEMM over every expert's first C rows (rows e*C..), then
// a grouped GEMM over the overflow blocks from row E*C, if the layout has room for any.
template <class T, class Ops>
struct ExpertGemms {
  Ops& ops;
  const MoeDims& D;
  const MoeActs<T>& A;

  // The capacity layout's room for overflow rows, from row E*C (0: no grouped GEMM).
  int overflow_rows() const { return int(moe_rows(D) - int64_t(D.E) * D.C); }

  // Y[r] = X[r] op(W_e) (+ beta Y[r]) for every row r of expert e: W_e is the e-th of E stacked
  // [n, k] (tb) or [k, n] matrices. X [rows, k], Y [rows, n]; x16 / y16: bf16 bits.
  void rows(bool tb, int n, int k, const T* X, const T* W, T beta, T* Y, bool x16, bool y16) {
    const int E = D.E, C = D.C, ldb = tb ? k : n;
    const size_t sW = size_t(n) * k;
    if (C == 0)
      return ops.grouped_gemm(true, tb, E, A.offsets, 0, n, k, T(1), X, k, W, ldb, sW, beta, Y, n, 0,
                              int(size_t(D.N) * D.K), x16, false, y16);
    ops.batched_gemm(E, false, tb, C, n, k, T(1), X, k, W, ldb, beta, Y, n, x16, false, y16);
    const size_t EC = size_t(E) * C;
    if (const int ov_rows = overflow_rows(); ov_rows > 0)
      ops.grouped_gemm(true, tb, E, A.ov, 0, n, k, T(1), past(X, EC * k, x16), k, W, ldb, sW, beta,
                       past(Y, EC * n, y16), n, 0, ov_rows, x16, false, y16);
  }
  // G_e += dY_e^T X_e, summed over expert e's rows: dY [rows, m], X [rows, n], G [E, m, n].
  void wgrad(int m, int n, const T* dY, const T* X, T* G, bool dy16, bool x16) {
    const int E = D.E, C = D.C;
    if (C == 0)
      return ops.grouped_gemm(false, false, E, A.offsets, m, n, 0, T(1), dY, m, X, n, 0, T(1), G, n,
                              size_t(m) * n, int(size_t(D.N) * D.K), dy16, x16);
    ops.batched_gemm(E, true, false, m, n, C, T(1), dY, m, X, n, T(1), G, n, dy16, x16);
    const size_t EC = size_t(E) * C;
    if (const int ov_rows = overflow_rows(); ov_rows > 0)
      ops.grouped_gemm(false, false, E, A.ov, m, n, 0, T(1), past(dY, EC * m, dy16), m, past(X, EC * n, x16), n, 0,
                       T(1), G, n, size_t(m) * n, ov_rows, dy16, x16);
  }
};

}  // namespace

template <class T, class Ops>
void moe_forward(Ops& ops, const MoeDims& D, const MoeWeights<T>& W, MoeActs<T>& A, const T* h, T* out) {
  const int N = D.N, d = D.d, E = D.E, K = D.K, I = D.I, Is = D.Is;
  const size_t NK = size_t(N) * K;

  // 1. Router scores s = h W_r^T, in fp32 arithmetic under any run.precision (the recipe's fp32
  //    router: bf16 operands would move near-tie tokens to other experts), or double.
  ops.gemm_fp32(false, true, N, E, d, T(1), h, d, W.router, d, T(0), A.logits, E);

  // 2. Per token: logsumexp (z-loss), top-K of s + bias, combine weights.
  ops.moe_route(A.lse, A.expert, A.comb, A.logits, W.bias, N, E, K, D.normalized, D.route_scale);
  // 3. Counting sort of the slots by expert; stable, so each expert's rows are in token order.
  ops.moe_sort(A.offsets, A.row, A.slot, A.expert, int(NK), E);
  // 4. Gather the input rows into expert order.
  // 5. The experts: one GEMM per matrix per expert over its contiguous rows (rows = N*K, dropless).
  // 6. Scatter back, weighted. Each token sums its own K rows in slot order: deterministic.
  // D.bf16 (h16): xs, g, u, a and y are bf16 bits: the gather rounds the rows, gate and up are
  // written as bf16 by the GEMM, SwiGLU computes in fp32 from them into bf16, down reads that and
  // writes y in bf16, which the combine reads.
  // With a capacity layout (D.C), the rows move to it first: row and cslot are its maps, the
  // gather writes zeros in the padding rows and skips the unused ones, and SwiGLU runs over the
  // rows in use (a count on the device); the combine reads the rows through row as before.
  const bool h16 = D.bf16;
  const int R = int(moe_rows(D));
  if (D.C > 0) ops.moe_capacity(A.row, A.cslot, A.ov, A.offsets, A.slot, int(NK), E, D.C, R);
  ExpertGemms<T, Ops> X{ops, D, A};
  ops.moe_gather(A.xs, h, D.C > 0 ? A.cslot : A.slot, R, K, d, h16);
  X.rows(true, I, d, A.xs, W.wg, T(0), A.g, h16, h16);
  X.rows(true, I, d, A.xs, W.wu, T(0), A.u, h16, h16);
  if (D.C > 0) ops.swiglu_forward_rows(A.a, A.g, A.u, R, I, A.ov + E + 1, h16);
  else ops.swiglu_forward(A.a, A.g, A.u, NK * I, h16);
  X.rows(true, d, I, A.a, W.wd, T(0), A.y, h16, h16);
  ops.moe_combine(out, A.y, A.comb, A.row, N, K, d, h16);

  // 7. The shared expert, on every token (D.bf16: its three hidden tensors in bf16 likewise).
  if (Is > 0) {
    ops.gemm(false, true, N, Is, d, T(1), h, d, W.sg, d, T(0), A.sgate, Is, false, false, h16);
    ops.gemm(false, true, N, Is, d, T(1), h, d, W.su, d, T(0), A.sup, Is, false, false, h16);
    ops.swiglu_forward(A.sact, A.sgate, A.sup, size_t(N) * Is, h16);
    ops.gemm(false, true, N, d, Is, T(1), A.sact, Is, W.sd, Is, T(1), out, d, h16);
  }
}

template <class T, class Ops>
void moe_backward(Ops& ops, const MoeDims& D, const MoeWeights<T>& W, MoeGrads<T>& G, const MoeActs<T>& A,
                  MoeScratch<T>& S, const T* h, const T* dout, T* dh, T z_scale) {
  const int N = D.N, d = D.d, E = D.E, K = D.K, I = D.I, Is = D.Is;

  // 1. Through the weighted scatter: dy_row = w_slot * dout_token; dL/dw_slot = dout_token . y_row.
  // 2. The experts, per block: down, SwiGLU, gate/up; weight gradients summed over each block.
  //    D.bf16 (h16): y, a, g, u and xs are read as the bf16 they are. D.bf16_grads (d16): dy, da,
  //    dg and du are written in bf16 (each the fp32 value rounded) and read so; dx, dcomb and the
  //    weight gradients are fp32 either way.
  //    A capacity layout's padding rows of dy are zeroed (the combine's backward writes the slots'
  //    rows only), so that they add nothing to the weight gradients, like the padding of xs and a.
  const bool h16 = D.bf16, d16 = D.bf16_grads;
  const int R = int(moe_rows(D));
  ExpertGemms<T, Ops> X{ops, D, A};
  ops.moe_combine_backward(S.dy, S.dcomb, dout, A.y, A.comb, A.row, N, K, d, h16, d16);
  if (D.C > 0) ops.moe_zero_rows(S.dy, A.cslot, E * D.C, d, d16);
  X.rows(false, I, d, S.dy, W.wd, T(0), S.da, d16, d16);
  X.wgrad(d, I, S.dy, A.a, G.wd, d16, h16);
  if (D.C > 0) ops.swiglu_backward_rows(S.dg, S.du, S.da, A.g, A.u, R, I, A.ov + E + 1, h16, d16);
  else ops.swiglu_backward(S.dg, S.du, S.da, A.g, A.u, size_t(N) * K * I, h16, d16);
  X.rows(false, d, I, S.dg, W.wg, T(0), S.dx, d16, false);
  X.rows(false, d, I, S.du, W.wu, T(1), S.dx, d16, false);
  X.wgrad(I, d, S.dg, A.xs, G.wg, d16, h16);
  X.wgrad(I, d, S.du, A.xs, G.wu, d16, h16);

  // 3. Gather the row gradients back to their tokens (the adjoint of the forward gather).
  ops.moe_gather_backward(dh, S.dx, A.row, N, K, d);

  // 4. The shared expert.
  if (Is > 0) {
    ops.gemm(false, false, N, Is, d, T(1), dout, d, W.sd, Is, T(0), S.dsa, Is);
    ops.gemm(true, false, d, Is, N, T(1), dout, d, A.sact, Is, T(1), G.sd, Is, false, h16);
    ops.swiglu_backward(S.dsg, S.dsu, S.dsa, A.sgate, A.sup, size_t(N) * Is, h16);
    ops.gemm(false, false, N, d, Is, T(1), S.dsg, Is, W.sg, d, T(1), dh, d);
    ops.gemm(false, false, N, d, Is, T(1), S.dsu, Is, W.su, d, T(1), dh, d);
    ops.gemm(true, false, Is, d, N, T(1), S.dsg, Is, h, d, T(1), G.sg, d);
    ops.gemm(true, false, Is, d, N, T(1), S.dsu, Is, h, d, T(1), G.su, d);
  }

  // 5. Router scores: through the combine weights (sigmoid, and the normalization when on) and the
  //    z-loss  sum_i lse_i^2  (d/ds_ie = 2 lse_i softmax(s_i)_e).
  ops.moe_router_backward(S.ds, A.logits, A.lse, A.expert, S.dcomb, N, E, K, D.normalized, D.route_scale, z_scale);
  ops.gemm_fp32(false, false, N, d, E, T(1), S.ds, E, W.router, d, T(1), dh, d);
  ops.gemm_fp32(true, false, E, d, N, T(1), S.ds, E, h, d, T(1), G.router, d);
}

#define LADDER_MOE_INSTANTIATE(T, OPS)                                                                     \
  template void moe_forward<T, OPS>(OPS&, const MoeDims&, const MoeWeights<T>&, MoeActs<T>&, const T*, T*); \
  template void moe_backward<T, OPS>(OPS&, const MoeDims&, const MoeWeights<T>&, MoeGrads<T>&,             \
                                     const MoeActs<T>&, MoeScratch<T>&, const T*, const T*, T*, T);
LADDER_MOE_INSTANTIATE(float, BackendOps)
LADDER_MOE_INSTANTIATE(float, KernelOps<float>)
LADDER_MOE_INSTANTIATE(double, KernelOps<double>)
#undef LADDER_MOE_INSTANTIATE

#define LADDER_MOE_INSTANTIATE_T(T)                                                                     \
  template std::vector<std::pair<void**, size_t>> moe_act_requests<T>(const MoeDims&, MoeActs<T>&);     \
  template std::vector<std::pair<void**, size_t>> moe_scratch_requests<T>(const MoeDims&, MoeScratch<T>&);
LADDER_MOE_INSTANTIATE_T(float)
LADDER_MOE_INSTANTIATE_T(double)
#undef LADDER_MOE_INSTANTIATE_T

}  // namespace ladder
