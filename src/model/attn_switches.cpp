// Transformer pieces of the recipe switches that are not attention proper (which lives in
// transformer.cpp): RMSNorm followed by GatedNorm, and the PKO document-start flags.
#include "core/error.h"
#include "model/transformer.h"

namespace ladder {

// GatedNorm (RECIPE.md, V1): out = n * sigmoid(W_up silu(W_down n)), n = RMSNorm(x) with its gain.
void Transformer::norm_forward(float* out, float* rstd, const float* x, const Param* gain, GatedNormActs& gn,
                               bool out_bf16) {
  const int N = N_, d = cfg_.d_model;
  const float eps = float(cfg_.norm_eps);
  if (!gn.down) {
    if (out_bf16) return be_.rmsnorm_forward_bf16(b16(out), rstd, x, gain->w, N, d, eps);
    be_.rmsnorm_forward(out, rstd, x, gain->w, N, d, eps);
    return;
  }
  const int R = cfg_.gated_norm_rank;
  be_.rmsnorm_forward(gn.n, rstd, x, gain->w, N, d, eps);
  be_.gemm(false, true, N, R, d, 1.f, gn.n, d, gn.down->w, d, 0.f, gn.u, R);
  be_.silu_forward(gn.a, gn.u, size_t(N) * R);
  be_.gemm(false, true, N, d, R, 1.f, gn.a, R, gn.up->w, R, 0.f, gn.s, d);
  if (out_bf16) return be_.sigmoid_gate_forward_bf16(b16(out), gn.s, gn.n, size_t(N) * d);  // gn.s: the sigmoid
  be_.sigmoid_gate_forward(out, gn.s, gn.n, size_t(N) * d);  // gn.s becomes the sigmoid
}

void Transformer::norm_backward(float* dx, const float* dout, const float* x, Param* gain, const float* rstd,
                                GatedNormActs& gn, bool accumulate_dx) {
  const int N = N_, d = cfg_.d_model;
  const float* dn = dout;
  if (gn.down) {
    const int R = cfg_.gated_norm_rank;
    // d_gn_ = d(n) through the direct path, d_gs_ = d(pre-sigmoid logits).
    be_.sigmoid_gate_backward(d_gn_, d_gs_, dout, gn.n, gn.s, size_t(N) * d, false);
    be_.gemm(true, false, d, R, N, 1.f, d_gs_, d, gn.a, R, 1.f, gn.up->g, R);
    be_.gemm(false, false, N, R, d, 1.f, d_gs_, d, gn.up->w, R, 0.f, d_gr_, R);
    be_.silu_backward(d_gr_, d_gr_, gn.u, size_t(N) * R);
    be_.gemm(true, false, R, d, N, 1.f, d_gr_, R, gn.n, d, 1.f, gn.down->g, d);
    be_.gemm(false, false, N, d, R, 1.f, d_gr_, R, gn.down->w, d, 1.f, d_gn_, d);  // + the gate path
    dn = d_gn_;
  }
  be_.rmsnorm_backward(dx, gain->g, dn, x, gain->w, rstd, N, d, accumulate_dx);
}

// PKO's shifted key half must not carry anything across a sequence or document boundary: reset at
// position 0 of every sequence and at every token that follows an end-of-document token.
// Computed by the backend from the ids already in its memory (ids_), into its memory (resets_).
void Transformer::compute_resets() {
  be_.pko_resets(resets_, ids_, N_, S_, cfg_.eod_id);
}

}  // namespace ladder
