// The MoE V1 block (RECIPE.md section 2): an fp32 router d -> E, top-K selection on (score + bias)
// with the bias outside the gradient, sigmoid combine weights (unnormalized, or normalized over the
// K selected and scaled), E routed SwiGLU experts run dropless, plus an optional always-on shared
// SwiGLU expert; router z-loss; quantile balancing of the selection bias.
//
// Dispatch: the N*K (token, slot) pairs are counting-sorted by expert (stable, so rows of one expert
// stay in token order), the input rows are gathered into that order, and each expert's contiguous
// block goes through one GEMM per matrix (Backend::grouped_gemm). Outputs are scattered back to
// their tokens weighted by the combine weights. Nothing is dropped: every token reaches its K
// experts whatever the load.
//
// The math is templated on the scalar type T and on an "ops" object that supplies gemm,
// grouped_gemm and swiglu: the model runs it in float through the Backend (BackendOps); the
// finite-difference tests run it in double through the CPU kernels (KernelOps<double>). Routing,
// the counting sort, gather and scatter are ops too (backend/cpu/moe_kernels.h), so on a GPU the
// whole block runs on the device and the routing never visits the host.
//
// Tensor layout (safetensors names, layer N):
//   model.layers.N.mlp.gate.weight                       [E, d]   router (Role::Router)
//   model.layers.N.mlp.gate.e_score_correction_bias      [E]      selection bias: a buffer, not a
//                                                                 parameter (no gradient, no optimizer
//                                                                 state), saved in checkpoints
//   model.layers.N.mlp.experts.{gate,up}_proj.weight     [E, I, d] routed experts (Role::ExpertMatrix)
//   model.layers.N.mlp.experts.down_proj.weight          [E, d, I]  expert e's matrix is slice e
//   model.layers.N.mlp.shared_expert.{gate,up}_proj.weight [I_s, d] (Role::SharedExpert)
//   model.layers.N.mlp.shared_expert.down_proj.weight    [d, I_s]
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/moe_kernels.h"
#include "core/error.h"

namespace ladder {

struct MoeDims {
  int N = 0;                  // tokens
  int d = 0, E = 0, K = 0;    // width, routed experts, experts per token
  int I = 0;                  // routed expert hidden
  int Is = 0;                 // shared expert hidden; 0 = no shared expert
  bool normalized = false;    // combine = scale * sig / (sum_topK sig + 1e-9) instead of sig
  double route_scale = 1.0;   // the scale of the normalized combine
  // model.moe_bf16: the gathered rows xs, the experts' hidden tensors (g, u, a; the shared
  // expert's sgate, sup, sact) and their outputs y are bf16 bits in their arrays (half the bytes):
  // the gather rounds xs, the GEMMs read it and write gate and up rounded to bf16, SwiGLU reads
  // them and writes a in bf16, the down projection reads a and writes y in bf16, which the combine
  // and its backward read; the weight gradients read xs and a as they are; every gradient stays
  // fp32 (unless bf16_grads). Only through a Backend (BackendOps): the double-precision kernels
  // have no bf16 form.
  bool bf16 = false;
  // model.moe_bf16_grads (needs bf16): the routed experts' activation gradients dy, da, dg and du
  // are bf16 bits too, so that the backward's grouped GEMMs read bf16 A operands (on a GPU an fp32
  // A is staged through registers, a bf16 one by cp.async) and the scratch is half the bytes:
  // the combine's backward rounds dy, the down projection's data-gradient GEMM writes da in bf16,
  // SwiGLU's backward reads it and rounds dg and du. Weight gradients, dx (back to the tokens),
  // dcomb, the router's gradients and the shared expert's gradients stay fp32.
  bool bf16_grads = false;
  // model.moe_capacity: the capacity layout. C > 0 rows per expert: expert e's first C rows sit at
  // rows [e*C, e*C + C) of the expert tensors (zero rows pad an expert with fewer), so each expert
  // GEMM is one strided batch of E products of C rows (cuBLASLt's batched GEMM on a GPU, at
  // library speed), and the rows past C, if any, follow from row E*C in a grouped GEMM's blocks
  // (cpu::moe_capacity). Still dropless: the same sums in another row order. 0: the sorted layout,
  // every expert's rows contiguous, all of them in grouped GEMMs.
  int C = 0;
};

// The rows of the expert tensors (xs, g, u, a, y and their gradients): N*K, or with a capacity
// layout E*C plus the most overflow there can be (cpu::moe_capacity_rows).
inline int64_t moe_rows(const MoeDims& D) { return cpu::moe_capacity_rows(D.N, D.K, D.E, D.C); }

template <class T>
struct MoeWeights {
  const T* router = nullptr;                            // [E, d]
  const T* bias = nullptr;                              // [E]
  const T *wg = nullptr, *wu = nullptr, *wd = nullptr;  // [E, I, d], [E, I, d], [E, d, I]
  const T *sg = nullptr, *su = nullptr, *sd = nullptr;  // [Is, d], [Is, d], [d, Is]
};

// Parameter gradients; ACCUMULATED (+=) like every parameter gradient of the model.
template <class T>
struct MoeGrads {
  T *router = nullptr, *wg = nullptr, *wu = nullptr, *wd = nullptr, *sg = nullptr, *su = nullptr, *sd = nullptr;
};

// Saved activations of one block.
template <class T>
struct MoeActs {
  T* logits = nullptr;         // [N, E] router scores s (unbiased)
  T* lse = nullptr;            // [N] logsumexp(s_i) (router z-loss)
  int32_t* expert = nullptr;   // [N*K] slot i*K+k -> k-th selected expert of token i (best first)
  T* comb = nullptr;           // [N*K] combine weight of each slot
  int32_t* row = nullptr;      // [N*K] slot -> row in the expert-sorted order
  int32_t* slot = nullptr;     // [N*K] row -> slot (token = slot / K)
  int32_t* offsets = nullptr;  // [E+1] expert e owns rows [offsets[e], offsets[e+1]) (sorted order)
  // Capacity layout (D.C > 0; else nullptr, and the row arrays below are in sorted order): row is
  // then slot -> row of the capacity layout, cslot [R] its inverse (-1: a padding row, -2: unused),
  // ov [E+2] the overflow blocks' offsets from row E*C and, last, the rows in use. R = moe_rows(D)
  // rows below, of which the gather and SwiGLU touch only those in use.
  int32_t* cslot = nullptr;
  int32_t* ov = nullptr;
  T* xs = nullptr;             // [R, d] input rows in expert order (bf16 bits: D.bf16)
  T *g = nullptr, *u = nullptr, *a = nullptr;  // [R, I] gate, up, silu(gate)*up (bf16 bits: D.bf16)
  T* y = nullptr;              // [R, d] expert outputs, unweighted (bf16 bits: D.bf16)
  T *sgate = nullptr, *sup = nullptr, *sact = nullptr;  // [N, Is] shared expert (bf16 bits: D.bf16)
};

// Backward scratch (one set serves every block).
template <class T>
struct MoeScratch {
  T* dy = nullptr;                              // [R, d] (bf16 bits: D.bf16_grads)
  T *dg = nullptr, *du = nullptr, *da = nullptr;  // [R, I] (bf16 bits: D.bf16_grads)
  T* dx = nullptr;                              // [R, d]
  T* ds = nullptr;                              // [N, E]
  T *dsg = nullptr, *dsu = nullptr, *dsa = nullptr;  // [N, Is]
  T* dcomb = nullptr;                           // [N*K]
};

// (pointer to fill, bytes) for every array of MoeActs / MoeScratch, for an arena or a test to fill.
template <class T>
std::vector<std::pair<void**, size_t>> moe_act_requests(const MoeDims& D, MoeActs<T>& a);
template <class T>
std::vector<std::pair<void**, size_t>> moe_scratch_requests(const MoeDims& D, MoeScratch<T>& s);

// Forward: out += MoE(h). h [N, d]. A.lse holds logsumexp(s_i) afterwards (the router z-loss is
// router_z_loss / MoE layers * sum_i lse_i^2 per token).
template <class T, class Ops>
void moe_forward(Ops& ops, const MoeDims& D, const MoeWeights<T>& W, MoeActs<T>& A, const T* h, T* out);

// Backward of out += MoE(h) given dout = dL/dout: dh OVERWRITTEN with dL/dh, parameter gradients
// accumulated. z_scale multiplies the gradient of sum_i logsumexp(s_i)^2 (router z-loss coefficient
// / MoE layers * the loss's per-token scale); 0 = no z-loss. The gradient reaches the router through
// the combine weights (and their normalization) and the z-loss; the selection itself is piecewise
// constant and has none.
template <class T, class Ops>
void moe_backward(Ops& ops, const MoeDims& D, const MoeWeights<T>& W, MoeGrads<T>& G, const MoeActs<T>& A,
                  MoeScratch<T>& S, const T* h, const T* dout, T* dh, T z_scale);

// Quantile balancing (RECIPE.md section 2), in two halves so data-parallel ranks can average beta
// in between: Backend::moe_balance_values per forward, Backend::moe_quantile_beta per step, then
// Backend::moe_balance_bias, bias = -(beta - mean(beta)) (contracts in backend/cpu/moe_kernels.h).

// The ops the block runs, through the templated CPU kernels (any T). The trailing flags say which
// tensors are bf16 bits (model.moe_bf16, MoeDims::bf16: a16 / b16 / c16 for a GEMM's A, B and
// output, h16 for SwiGLU's tensors, x16 for the gathered rows, y16 for the expert outputs;
// model.moe_bf16_grads, MoeDims::bf16_grads: d16 for the gradients dy, dh, dg and du); these
// kernels have no bf16 form, so here every flag must be false. `rows` bounds a grouped GEMM's
// offsets[E] (unused here).
template <class T>
struct KernelOps {
  void gemm(bool ta, bool tb, int M, int N, int K, T alpha, const T* A, int lda, const T* B, int ldb, T beta, T* C,
            int ldc, bool a16 = false, bool b16 = false, bool c16 = false) {
    LADDER_ASSERT(!a16 && !b16 && !c16);
    cpu::gemm<T>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void gemm_fp32(bool ta, bool tb, int M, int N, int K, T alpha, const T* A, int lda, const T* B, int ldb, T beta,
                 T* C, int ldc) {
    cpu::gemm<T>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void batched_gemm(int count, bool ta, bool tb, int M, int N, int K, T alpha, const T* A, int lda, const T* B,
                    int ldb, T beta, T* C, int ldc, bool a16 = false, bool b16 = false, bool c16 = false) {
    LADDER_ASSERT(!a16 && !b16 && !c16);
    for (int i = 0; i < count; ++i)
      cpu::gemm<T>(ta, tb, M, N, K, alpha, A + size_t(i) * (ta ? K : M) * lda, lda,
                   B + size_t(i) * (tb ? N : K) * ldb, ldb, beta, C + size_t(i) * M * ldc, ldc);
  }
  void grouped_gemm(bool rows_out, bool tb, int E, const int32_t* off, int M, int N, int K, T alpha, const T* A,
                    int lda, const T* B, int ldb, size_t sB, T beta, T* C, int ldc, size_t sC, int rows = 0,
                    bool a16 = false, bool b16 = false, bool c16 = false) {
    (void)rows;
    LADDER_ASSERT(!a16 && !b16 && !c16);
    cpu::grouped_gemm<T>(rows_out, tb, E, off, M, N, K, alpha, A, lda, B, ldb, sB, beta, C, ldc, sC);
  }
  void swiglu_forward(T* h, const T* g, const T* u, size_t n, bool h16 = false) {
    LADDER_ASSERT(!h16);
    cpu::swiglu_forward<T>(h, g, u, n);
  }
  void swiglu_backward(T* dg, T* du, const T* dh, const T* g, const T* u, size_t n, bool h16 = false,
                       bool d16 = false) {
    LADDER_ASSERT(!h16 && !d16);
    cpu::swiglu_backward<T>(dg, du, dh, g, u, n);
  }
  // The *_rows forms: the first min(rows, *used) rows of cols (host memory here).
  void swiglu_forward_rows(T* h, const T* g, const T* u, int64_t rows, int cols, const int32_t* used,
                           bool h16 = false) {
    swiglu_forward(h, g, u, rows_in_use(rows, cols, used), h16);
  }
  void swiglu_backward_rows(T* dg, T* du, const T* dh, const T* g, const T* u, int64_t rows, int cols,
                            const int32_t* used, bool h16 = false, bool d16 = false) {
    swiglu_backward(dg, du, dh, g, u, rows_in_use(rows, cols, used), h16, d16);
  }
  void moe_route(T* lse, int32_t* ex, T* comb, const T* s, const T* bias, int N, int E, int K, bool nz, double rs) {
    cpu::moe_route<T>(lse, ex, comb, s, bias, N, E, K, nz, rs);
  }
  void moe_sort(int32_t* off, int32_t* row, int32_t* slot, const int32_t* ex, int NK, int E) {
    cpu::moe_sort(off, row, slot, ex, NK, E);
  }
  void moe_capacity(int32_t* row, int32_t* cslot, int32_t* ov, const int32_t* off, const int32_t* slot, int NK,
                    int E, int C, int R) {
    cpu::moe_capacity(row, cslot, ov, off, slot, NK, E, C, R);
  }
  void moe_zero_rows(T* x, const int32_t* cslot, int rows, int cols, bool x16 = false) {
    LADDER_ASSERT(!x16);
    cpu::moe_zero_rows(x, sizeof(T), cslot, rows, cols);
  }
  void moe_gather(T* xs, const T* h, const int32_t* slot, int NK, int K, int d, bool x16 = false) {
    LADDER_ASSERT(!x16);
    cpu::moe_gather<T>(xs, h, slot, NK, K, d);
  }
  void moe_combine(T* out, const T* y, const T* comb, const int32_t* row, int N, int K, int d, bool y16 = false) {
    LADDER_ASSERT(!y16);
    cpu::moe_combine<T>(out, y, comb, row, N, K, d);
  }
  void moe_combine_backward(T* dy, T* dcomb, const T* dout, const T* y, const T* comb, const int32_t* row, int N,
                            int K, int d, bool y16 = false, bool d16 = false) {
    LADDER_ASSERT(!y16 && !d16);
    cpu::moe_combine_backward<T>(dy, dcomb, dout, y, comb, row, N, K, d);
  }
  void moe_gather_backward(T* dh, const T* dx, const int32_t* row, int N, int K, int d) {
    cpu::moe_gather_backward<T>(dh, dx, row, N, K, d);
  }
  void moe_router_backward(T* ds, const T* s, const T* lse, const int32_t* ex, const T* dcomb, int N, int E, int K,
                           bool nz, double rs, T z) {
    cpu::moe_router_backward<T>(ds, s, lse, ex, dcomb, N, E, K, nz, rs, z);
  }
};

// The same through a Backend (float): what the model uses. A flagged tensor's float* holds bf16 bits
// and goes to the backend's bf16 form of the op; unflagged calls are the plain fp32 ops. A grouped
// GEMM given `rows` (the block's N*K rows, offsets[E]: dropless) goes through grouped_gemm_ex, the
// same computation with a row bound (a profiler can then count its FLOPs).
struct BackendOps {
  Backend* be;
  static uint16_t* bits(float* p) { return reinterpret_cast<uint16_t*>(p); }
  static const uint16_t* bits(const float* p) { return reinterpret_cast<const uint16_t*>(p); }
  void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
            float beta, float* C, int ldc, bool a16 = false, bool b16 = false, bool c16 = false) {
    if (a16 || c16)
      be->gemm_ex(ta, tb, M, N, K, alpha, A, a16, lda, B, b16, ldb, beta, nullptr, C, c16, ldc);
    else if (b16)
      be->gemm_b16(ta, tb, M, N, K, alpha, A, lda, bits(B), ldb, beta, C, ldc);
    else
      be->gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void gemm_fp32(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                 float beta, float* C, int ldc) {
    be->gemm_fp32(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void batched_gemm(int count, bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                    const float* B, int ldb, float beta, float* C, int ldc, bool a16 = false, bool b16 = false,
                    bool c16 = false) {
    be->batched_gemm_ex(count, ta, tb, M, N, K, alpha, A, a16, lda, B, b16, ldb, beta, C, c16, ldc);
  }
  void grouped_gemm(bool rows_out, bool tb, int E, const int32_t* off, int M, int N, int K, float alpha,
                    const float* A, int lda, const float* B, int ldb, size_t sB, float beta, float* C, int ldc,
                    size_t sC, int rows = 0, bool a16 = false, bool b16 = false, bool c16 = false) {
    if (rows > 0 || a16 || b16 || c16)
      be->grouped_gemm_ex(rows_out, tb, E, off, rows, M, N, K, alpha, A, a16, lda, B, b16, ldb, sB, beta, C, c16, ldc,
                          sC);
    else
      be->grouped_gemm(rows_out, tb, E, off, M, N, K, alpha, A, lda, B, ldb, sB, beta, C, ldc, sC);
  }
  void swiglu_forward(float* h, const float* g, const float* u, size_t n, bool h16 = false) {
    be->swiglu_forward_typed(h, g, u, h16, n);
  }
  // d16 (bf16 dh, dg and du) only with h16 (bf16 g and u): model.moe_bf16_grads needs model.moe_bf16.
  void swiglu_backward(float* dg, float* du, const float* dh, const float* g, const float* u, size_t n,
                       bool h16 = false, bool d16 = false) {
    LADDER_ASSERT(h16 || !d16);
    be->swiglu_backward_typed(dg, du, dh, g, u, h16, d16, n);
  }
  void swiglu_forward_rows(float* h, const float* g, const float* u, int64_t rows, int cols, const int32_t* used,
                           bool h16 = false) {
    be->swiglu_forward_rows(h, g, u, h16, rows, cols, used);
  }
  void swiglu_backward_rows(float* dg, float* du, const float* dh, const float* g, const float* u, int64_t rows,
                            int cols, const int32_t* used, bool h16 = false, bool d16 = false) {
    LADDER_ASSERT(h16 || !d16);
    be->swiglu_backward_rows(dg, du, dh, g, u, h16, d16, rows, cols, used);
  }
  void moe_route(float* lse, int32_t* ex, float* comb, const float* s, const float* bias, int N, int E, int K,
                 bool nz, double rs) {
    be->moe_route(lse, ex, comb, s, bias, N, E, K, nz, rs);
  }
  void moe_sort(int32_t* off, int32_t* row, int32_t* slot, const int32_t* ex, int NK, int E) {
    be->moe_sort(off, row, slot, ex, NK, E);
  }
  void moe_capacity(int32_t* row, int32_t* cslot, int32_t* ov, const int32_t* off, const int32_t* slot, int NK,
                    int E, int C, int R) {
    be->moe_capacity(row, cslot, ov, off, slot, NK, E, C, R);
  }
  void moe_zero_rows(float* x, const int32_t* cslot, int rows, int cols, bool x16 = false) {
    be->moe_zero_rows(x, x16, cslot, rows, cols);
  }
  void moe_gather(float* xs, const float* h, const int32_t* slot, int NK, int K, int d, bool x16 = false) {
    if (x16) be->moe_gather_bf16(bits(xs), h, slot, NK, K, d);
    else be->moe_gather(xs, h, slot, NK, K, d);
  }
  void moe_combine(float* out, const float* y, const float* comb, const int32_t* row, int N, int K, int d,
                   bool y16 = false) {
    if (y16) be->moe_combine_bf16(out, bits(y), comb, row, N, K, d);
    else be->moe_combine(out, y, comb, row, N, K, d);
  }
  void moe_combine_backward(float* dy, float* dcomb, const float* dout, const float* y, const float* comb,
                            const int32_t* row, int N, int K, int d, bool y16 = false, bool d16 = false) {
    LADDER_ASSERT(y16 || !d16);  // a bf16 dy only with bf16 y, as for swiglu_backward
    if (d16) be->moe_combine_backward_bf16_grads(bits(dy), dcomb, dout, bits(y), comb, row, N, K, d);
    else if (y16) be->moe_combine_backward_bf16(dy, dcomb, dout, bits(y), comb, row, N, K, d);
    else be->moe_combine_backward(dy, dcomb, dout, y, comb, row, N, K, d);
  }
  void moe_gather_backward(float* dh, const float* dx, const int32_t* row, int N, int K, int d) {
    be->moe_gather_backward(dh, dx, row, N, K, d);
  }
  void moe_router_backward(float* ds, const float* s, const float* lse, const int32_t* ex, const float* dcomb, int N,
                           int E, int K, bool nz, double rs, float z) {
    be->moe_router_backward(ds, s, lse, ex, dcomb, N, E, K, nz, rs, z);
  }
};

}  // namespace ladder
