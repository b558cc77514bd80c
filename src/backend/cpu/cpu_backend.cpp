// CpuBackend: forwards the op interface to the float instantiations of the CPU kernels.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"

extern "C" void openblas_set_num_threads(int);

namespace ladder {
namespace {

// An optimizer op's gradient factor (Backend::muon_momentum): nullptr reads the gradient as it is.
float factor_or_one(const float* grad_factor) { return grad_factor ? *grad_factor : 1.0f; }

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  // Host memory.
  bool is_host() const override { return true; }
  size_t available_bytes() const override { return host_memory().available_bytes(); }
  void* mem_alloc(size_t bytes, const char* what) override { return host_memory().mem_alloc(bytes, what); }
  void mem_free(void* p) override { host_memory().mem_free(p); }
  void upload(void* dst, const void* src, size_t bytes) override { host_memory().upload(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override { host_memory().download(dst, src, bytes); }
  void copy(void* dst, const void* src, size_t bytes) override { host_memory().copy(dst, src, bytes); }
  void zero(void* p, size_t bytes) override { host_memory().zero(p, bytes); }

  void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
            int ldb, float beta, float* C, int ldc) override {
    cpu::gemm<float>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void gemm_fp32(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                 int ldb, float beta, float* C, int ldc) override {  // the CPU's GEMMs are all fp32
    cpu::gemm<float>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  // The copy-then-accumulate it replaces, so CPU results stay bitwise the same.
  void gemm_add(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                const float* C, float* D, int ldc) override {
    gemm_add_scaled(ta, tb, M, N, K, alpha, A, lda, B, ldb, 1.f, C, D, ldc);
  }
  // D = alpha op(A) op(B) + beta C: C copied into D, then the GEMM accumulates with beta.
  void gemm_add_scaled(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                       int ldb, float beta, const float* C, float* D, int ldc) {
    if (C != D && M > 0 && N > 0) {
      if (ldc == N)
        std::memcpy(D, C, sizeof(float) * size_t(M) * size_t(N));
      else
        for (int i = 0; i < M; ++i) std::memcpy(D + size_t(i) * ldc, C + size_t(i) * ldc, sizeof(float) * size_t(N));
    }
    cpu::gemm<float>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, D, ldc);
  }
  // Widened into scratch with B's own leading dimension: the same sgemm call as on an fp32 B.
  void gemm_b16(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const uint16_t* B,
                int ldb, float beta, float* C, int ldc) override {
    const float* b = widen(1, B, span(tb ? N : K, ldb, tb ? K : N));
    cpu::gemm<float>(ta, tb, M, N, K, alpha, A, lda, b, ldb, beta, C, ldc);
  }
  // The reference for typed GEMMs: bf16 operands widened into scratch (same leading dimension),
  // the sgemm of gemm() / gemm_add(), and a bf16 D rounded from an fp32 result (packed scratch).
  void gemm_ex(bool ta, bool tb, int M, int N, int K, float alpha, const void* A, bool a_bf16, int lda, const void* B,
               bool b_bf16, int ldb, float beta, const float* C_in, void* D, bool d_bf16, int ldc) override {
    if (d_bf16 && (beta != 0.f || C_in)) fail("gemm_ex: a bf16 output takes no addend (beta 0, no C_in)");
    const float* a = a_bf16 ? widen(0, A, span(ta ? K : M, lda, ta ? M : K)) : static_cast<const float*>(A);
    const float* b = b_bf16 ? widen(1, B, span(tb ? N : K, ldb, tb ? K : N)) : static_cast<const float*>(B);
    if (!d_bf16) {
      float* d = static_cast<float*>(D);
      if (C_in && C_in != d) return gemm_add_scaled(ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, C_in, d, ldc);
      return cpu::gemm<float>(ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, d, ldc);
    }
    if (M <= 0 || N <= 0) return;
    float* df = wide_out(size_t(M) * size_t(N));
    cpu::gemm<float>(ta, tb, M, N, K, alpha, a, lda, b, ldb, 0.f, df, N);
    uint16_t* d = static_cast<uint16_t*>(D);
    if (ldc == N) return cpu::f32_to_bf16(d, df, size_t(M) * size_t(N));
    for (int i = 0; i < M; ++i) cpu::f32_to_bf16(d + size_t(i) * ldc, df + size_t(i) * N, size_t(N));
  }
  // One gemm_ex per matrix of the stacks: the reference of a strided batch.
  void batched_gemm_ex(int count, bool ta, bool tb, int M, int N, int K, float alpha, const void* A, bool a_bf16,
                       int lda, const void* B, bool b_bf16, int ldb, float beta, void* C, bool c_bf16,
                       int ldc) override {
    auto at = [](const void* X, bool b16, size_t elems) {
      return static_cast<const char*>(X) + elems * (b16 ? sizeof(uint16_t) : sizeof(float));
    };
    const size_t sa = size_t(ta ? K : M) * size_t(lda), sb = size_t(tb ? N : K) * size_t(ldb), sc = size_t(M) * size_t(ldc);
    for (int i = 0; i < count; ++i)
      gemm_ex(ta, tb, M, N, K, alpha, at(A, a_bf16, i * sa), a_bf16, lda, at(B, b_bf16, i * sb), b_bf16, ldb, beta,
              nullptr, const_cast<char*>(at(C, c_bf16, i * sc)), c_bf16, ldc);
  }
  void grouped_gemm(bool rows_out, bool tb, int E, const int32_t* offsets, int M, int N, int K, float alpha,
                    const float* A, int lda, const float* B, int ldb, size_t strideB, float beta, float* C,
                    int ldc, size_t strideC) override {
    cpu::grouped_gemm<float>(rows_out, tb, E, offsets, M, N, K, alpha, A, lda, B, ldb, strideB, beta, C, ldc, strideC);
  }
  // The reference of the typed form: widen the bf16 operands, the fp32 grouped GEMM, round the
  // output. The offsets are host memory here, so the spans come from offsets[E] itself.
  void grouped_gemm_ex(bool rows_out, bool tb, int E, const int32_t* offsets, int rows, int M, int N, int K,
                       float alpha, const void* A, bool a_bf16, int lda, const void* B, bool b_bf16, int ldb,
                       size_t strideB, float beta, void* C, bool c_bf16, int ldc, size_t strideC) override {
    check_grouped_gemm_ex(rows_out, E, M, N, beta, c_bf16, ldc, strideC);
    if (E <= 0) return;
    const int total = offsets[E];
    if (total > rows) fail("grouped_gemm_ex: the offsets hold {} rows, more than the {} the call bounds", total, rows);
    const size_t a_n = rows_out ? span(total, lda, K) : span(total, lda, M);
    const size_t b_n = rows_out ? size_t(E - 1) * strideB + (tb ? span(N, ldb, K) : span(K, ldb, N)) : span(total, ldb, N);
    const float* a = a_bf16 ? widen(0, A, a_n) : static_cast<const float*>(A);
    const float* b = b_bf16 ? widen(1, B, b_n) : static_cast<const float*>(B);
    if (!c_bf16)
      return cpu::grouped_gemm<float>(rows_out, tb, E, offsets, M, N, K, alpha, a, lda, b, ldb, strideB, beta,
                                      static_cast<float*>(C), ldc, strideC);
    const size_t c_n = rows_out ? size_t(total) * size_t(N) : size_t(E) * strideC;
    float* cf = wide_out(c_n);
    cpu::grouped_gemm<float>(rows_out, tb, E, offsets, M, N, K, alpha, a, lda, b, ldb, strideB, 0.f, cf, ldc, strideC);
    cpu::f32_to_bf16(static_cast<uint16_t*>(C), cf, c_n);
  }
  void embedding_forward(float* out, const float* table, const int32_t* ids, int N, int D) override {
    cpu::embedding_forward<float>(out, table, ids, N, D);
  }
  void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int N, int D) override {
    cpu::embedding_backward<float>(dtable, dout, ids, N, D);
  }
  void rmsnorm_forward(float* y, float* rstd, const float* x, const float* gain, int N, int D, float eps) override {
    cpu::rmsnorm_forward<float>(y, rstd, x, gain, N, D, eps);
  }
  void rmsnorm_backward(float* dx, float* dgain, const float* dy, const float* x, const float* gain,
                        const float* rstd, int N, int D, bool acc) override {
    cpu::rmsnorm_backward<float>(dx, dgain, dy, x, gain, rstd, N, D, acc);
  }
  // model.norm_bf16's reference: the fp32 kernel into scratch, then rounded.
  void rmsnorm_forward_bf16(uint16_t* y, float* rstd, const float* x, const float* gain, int N, int D,
                            float eps) override {
    const size_t n = size_t(N) * size_t(D);
    float* yf = wide_out(n);
    cpu::rmsnorm_forward<float>(yf, rstd, x, gain, N, D, eps);
    cpu::f32_to_bf16(y, yf, n);
  }
  void rope_forward(float* x, int N_tok, int S, int nh, int hd, int rot, float theta) override {
    cpu::rope_forward<float>(x, N_tok, S, nh, hd, rot, theta);
  }
  void rope_backward(float* dx, int N_tok, int S, int nh, int hd, int rot, float theta) override {
    cpu::rope_backward<float>(dx, N_tok, S, nh, hd, rot, theta);
  }
  void attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                         const AttnShape& s) override {
    cpu::attention_forward<float>(o, lse, q, k, v, s);
  }
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                          const float* v, const float* o, const float* lse, const AttnShape& s) override {
    cpu::attention_backward<float>(dq, dk, dv, dout, q, k, v, o, lse, s);
  }
  // The rows in use are host memory here: the plain ops on those rows.
  void swiglu_forward_rows(void* h, const void* g, const void* u, bool h16, int64_t rows, int cols,
                           const int32_t* rows_used) override {
    swiglu_forward_typed(h, g, u, h16, rows_in_use(rows, cols, rows_used));
  }
  void swiglu_backward_rows(void* dg, void* du, const void* dh, const void* g, const void* u, bool h16, bool d16,
                            int64_t rows, int cols, const int32_t* rows_used) override {
    swiglu_backward_typed(dg, du, dh, g, u, h16, d16, rows_in_use(rows, cols, rows_used));
  }
  void swiglu_forward(float* h, const float* g, const float* u, size_t n) override {
    cpu::swiglu_forward<float>(h, g, u, n);
  }
  void swiglu_backward(float* dg, float* du, const float* dh, const float* g, const float* u, size_t n) override {
    cpu::swiglu_backward<float>(dg, du, dh, g, u, n);
  }
  void swiglu_forward_bf16(uint16_t* h, const uint16_t* g, const uint16_t* u, size_t n) override {
    cpu::swiglu_forward_bf16(h, g, u, n);
  }
  void swiglu_backward_bf16(float* dg, float* du, const float* dh, const uint16_t* g, const uint16_t* u,
                            size_t n) override {
    cpu::swiglu_backward_bf16(dg, du, dh, g, u, n);
  }
  void swiglu_backward_bf16_grads(uint16_t* dg, uint16_t* du, const uint16_t* dh, const uint16_t* g, const uint16_t* u,
                                  size_t n) override {
    cpu::swiglu_backward_bf16(dg, du, dh, g, u, n);
  }
  XentSums softmax_xent(float* logits, const int32_t* t, int N, int V, float z, float gs) override {
    return cpu::softmax_xent<float>(logits, t, N, V, z, gs);
  }
  XentSums softmax_xent_forward(const float* logits, const int32_t* t, int N, int V, float* losses) override {
    return cpu::softmax_xent_forward<float>(logits, t, N, V, losses);
  }
  void add_inplace(float* y, const float* x, size_t n) override { cpu::add_inplace<float>(y, x, n); }
  void scale_inplace(float* x, float s, size_t n) override { cpu::scale_inplace<float>(x, s, n); }
  double sum_squares(const float* x, size_t n) override { return cpu::sum_squares<float>(x, n); }
  void to_bf16(uint16_t* out, const float* in, size_t n) override { cpu::f32_to_bf16(out, in, n); }
  void from_bf16(float* out, const uint16_t* in, size_t n) override { cpu::bf16_to_f32(out, in, n); }
  void softmax_xent_async(float* logits, const int32_t* t, int N, int V, float z, float gs, double* sums) override {
    const XentSums r = cpu::softmax_xent<float>(logits, t, N, V, z, gs);
    sums[0] = r.xent;
    sums[1] = r.lse_sq;
  }
  void softmax_xent_forward_async(const float* logits, const int32_t* t, int N, int V, float* losses,
                                  double* sums) override {
    const XentSums r = cpu::softmax_xent_forward<float>(logits, t, N, V, losses);
    sums[0] = r.xent;
    sums[1] = r.lse_sq;
  }
  void sum_squares_async(const float* x, size_t n, double* out) override { *out = cpu::sum_squares<float>(x, n); }
  void pko_resets(uint8_t* reset, const int32_t* ids, int N_tok, int S, int eod_id) override {
    cpu::pko_resets(reset, ids, N_tok, S, eod_id);
  }
  void moe_route(float* lse, int32_t* expert, float* comb, const float* logits, const float* bias, int N, int E,
                 int K, bool normalized, double route_scale) override {
    cpu::moe_route<float>(lse, expert, comb, logits, bias, N, E, K, normalized, route_scale);
  }
  void moe_sort(int32_t* offsets, int32_t* row, int32_t* slot, const int32_t* expert, int NK, int E) override {
    cpu::moe_sort(offsets, row, slot, expert, NK, E);
  }
  void moe_capacity(int32_t* row, int32_t* cslot, int32_t* ov, const int32_t* offsets, const int32_t* slot, int NK,
                    int E, int C, int R) override {
    cpu::moe_capacity(row, cslot, ov, offsets, slot, NK, E, C, R);
  }
  void moe_zero_rows(void* x, bool bf16, const int32_t* cslot, int rows, int cols) override {
    cpu::moe_zero_rows(x, bf16 ? sizeof(uint16_t) : sizeof(float), cslot, rows, cols);
  }
  void moe_gather(float* xs, const float* h, const int32_t* slot, int NK, int K, int d) override {
    cpu::moe_gather<float>(xs, h, slot, NK, K, d);
  }
  void moe_combine(float* out, const float* y, const float* comb, const int32_t* row, int N, int K, int d) override {
    cpu::moe_combine<float>(out, y, comb, row, N, K, d);
  }
  void moe_combine_backward(float* dy, float* dcomb, const float* dout, const float* y, const float* comb,
                            const int32_t* row, int N, int K, int d) override {
    cpu::moe_combine_backward<float>(dy, dcomb, dout, y, comb, row, N, K, d);
  }
  void moe_combine_bf16(float* out, const uint16_t* y, const float* comb, const int32_t* row, int N, int K,
                        int d) override {
    cpu::moe_combine<float>(out, y, comb, row, N, K, d);
  }
  void moe_combine_backward_bf16(float* dy, float* dcomb, const float* dout, const uint16_t* y, const float* comb,
                                 const int32_t* row, int N, int K, int d) override {
    cpu::moe_combine_backward<float>(dy, dcomb, dout, y, comb, row, N, K, d);
  }
  // model.moe_bf16_grads' reference: the fp32 row gradients into scratch, then rounded.
  void moe_combine_backward_bf16_grads(uint16_t* dy, float* dcomb, const float* dout, const uint16_t* y,
                                       const float* comb, const int32_t* row, int N, int K, int d) override {
    // The fp32 rows in scratch, then each slot's row rounded: the rows are wherever `row` puts
    // them (a capacity layout's reach past N*K), and only those are written.
    const size_t NK = size_t(N) * size_t(K);
    int32_t rows = 0;
    for (size_t j = 0; j < NK; ++j) rows = std::max(rows, row[j] + 1);
    float* dyf = wide_out(size_t(rows) * size_t(d));
    cpu::moe_combine_backward<float>(dyf, dcomb, dout, y, comb, row, N, K, d);
    for (size_t j = 0; j < NK; ++j)
      cpu::f32_to_bf16(dy + size_t(row[j]) * d, dyf + size_t(row[j]) * d, size_t(d));
  }
  void moe_gather_bf16(uint16_t* xs, const float* h, const int32_t* slot, int NK, int K, int d) override {
    cpu::moe_gather_bf16(xs, h, slot, NK, K, d);
  }
  void moe_gather_backward(float* dh, const float* dx, const int32_t* row, int N, int K, int d) override {
    cpu::moe_gather_backward<float>(dh, dx, row, N, K, d);
  }
  void moe_router_backward(float* ds, const float* logits, const float* lse, const int32_t* expert,
                           const float* dcomb, int N, int E, int K, bool normalized, double route_scale,
                           float z_scale) override {
    cpu::moe_router_backward<float>(ds, logits, lse, expert, dcomb, N, E, K, normalized, route_scale, z_scale);
  }
  void moe_balance_values(float* vals, const float* logits, const float* bias, int N, int E, int K) override {
    cpu::moe_balance_values<float>(vals, logits, bias, N, E, K);
  }
  void moe_quantile_beta(double* beta, const float* vals, int64_t T, int E, int K) override {
    cpu::moe_quantile_beta(beta, vals, T, E, K);
  }
  void moe_balance_bias(float* bias, const double* beta, int E) override { cpu::moe_balance_bias(bias, beta, E); }
  void moe_count_load(int64_t* load, const int32_t* offsets, int E) override { cpu::moe_count_load(load, offsets, E); }
  void pko_shift_forward(float* out, const float* k, const uint8_t* reset, int n, int nkv, int hd, int from) override {
    cpu::pko_shift_forward<float>(out, k, reset, n, nkv, hd, from);
  }
  void pko_shift_backward(float* dk, const float* dout, const uint8_t* reset, int n, int nkv, int hd, int from) override {
    cpu::pko_shift_backward<float>(dk, dout, reset, n, nkv, hd, from);
  }
  void qk_prep_forward(float* out, float* rstd, const float* x, const float* gain, const uint8_t* reset, int n,
                       int S, int nh, int hd, int rot, float theta, bool norm, float eps) override {
    cpu::qk_prep_forward<float>(out, rstd, x, gain, reset, n, S, nh, hd, rot, theta, norm, eps);
  }
  void qk_prep_backward(float* dx, float* dgain, const float* dout, const float* x, const float* gain,
                        const float* rstd, const uint8_t* reset, int n, int S, int nh, int hd, int rot, float theta,
                        bool norm) override {
    cpu::qk_prep_backward<float>(dx, dgain, dout, x, gain, rstd, reset, n, S, nh, hd, rot, theta, norm);
  }
  void xsa_forward(float* z, const float* y, const float* v, int n, int H, int KV, int hd) override {
    cpu::xsa_forward<float>(z, y, v, n, H, KV, hd);
  }
  void xsa_backward(float* dy, float* dv, const float* dz, const float* y, const float* v, int n, int H, int KV,
                    int hd) override {
    cpu::xsa_backward<float>(dy, dv, dz, y, v, n, H, KV, hd);
  }
  void head_gate_forward(float* out, float* f, const float* x, const float* logit, int n, int H, int hd) override {
    cpu::head_gate_forward<float>(out, f, x, logit, n, H, hd);
  }
  void head_gate_backward(float* dx, float* dlogit, const float* dout, const float* x, const float* f, int n, int H,
                          int hd) override {
    cpu::head_gate_backward<float>(dx, dlogit, dout, x, f, n, H, hd);
  }
  // model.attn_bf16's reference: the bf16 inputs widened into scratch, the fp32 kernel, the bf16
  // outputs rounded from an fp32 result in scratch.
  void qk_prep_forward_bf16(uint16_t* out, float* rstd, const uint16_t* x, const float* gain, const uint8_t* reset,
                            int n, int S, int nh, int hd, int rot, float theta, bool norm, float eps) override {
    const size_t len = size_t(n) * nh * hd;
    float* o = wide_out(len);
    cpu::qk_prep_forward<float>(o, rstd, widen(0, x, len), gain, reset, n, S, nh, hd, rot, theta, norm, eps);
    cpu::f32_to_bf16(out, o, len);
  }
  void qk_prep_backward_bf16(float* dx, float* dgain, const float* dout, const uint16_t* x, const float* gain,
                             const float* rstd, const uint8_t* reset, int n, int S, int nh, int hd, int rot,
                             float theta, bool norm) override {
    cpu::qk_prep_backward<float>(dx, dgain, dout, widen(0, x, size_t(n) * nh * hd), gain, rstd, reset, n, S, nh, hd,
                                 rot, theta, norm);
  }
  void attention_forward_bf16(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              const AttnShape& s) override {
    const size_t nq = size_t(s.B) * s.S * s.H * s.hd, nk = size_t(s.B) * s.S * s.KV * s.hd;
    float* of = wide_out(nq);
    cpu::attention_forward<float>(of, lse, widen(0, q, nq), widen(1, k, nk), widen(2, v, nk), s);
    cpu::f32_to_bf16(o, of, nq);
  }
  void attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const uint16_t* q, const uint16_t* k,
                               const uint16_t* v, const uint16_t* o, const float* lse, const AttnShape& s) override {
    const size_t nq = size_t(s.B) * s.S * s.H * s.hd, nk = size_t(s.B) * s.S * s.KV * s.hd;
    cpu::attention_backward<float>(dq, dk, dv, dout, widen(0, q, nq), widen(1, k, nk), widen(2, v, nk),
                                   widen(3, o, nq), lse, s);
  }
  void xsa_forward_bf16(uint16_t* z, const uint16_t* y, const uint16_t* v, int n, int H, int KV, int hd) override {
    const size_t ny = size_t(n) * H * hd, nv = size_t(n) * KV * hd;
    float* zf = wide_out(ny);
    cpu::xsa_forward<float>(zf, widen(0, y, ny), widen(1, v, nv), n, H, KV, hd);
    cpu::f32_to_bf16(z, zf, ny);
  }
  void xsa_backward_bf16(float* dy, float* dv, const float* dz, const uint16_t* y, const uint16_t* v, int n, int H,
                         int KV, int hd) override {
    cpu::xsa_backward<float>(dy, dv, dz, widen(0, y, size_t(n) * H * hd), widen(1, v, size_t(n) * KV * hd), n, H, KV,
                             hd);
  }
  void head_gate_forward_bf16(uint16_t* out, float* f, const uint16_t* x, const float* logit, int n, int H,
                              int hd) override {
    const size_t nx = size_t(n) * H * hd;
    float* of = wide_out(nx);
    cpu::head_gate_forward<float>(of, f, widen(0, x, nx), logit, n, H, hd);
    cpu::f32_to_bf16(out, of, nx);
  }
  void head_gate_backward_bf16(float* dx, float* dlogit, const float* dout, const uint16_t* x, const float* f, int n,
                               int H, int hd) override {
    cpu::head_gate_backward<float>(dx, dlogit, dout, widen(0, x, size_t(n) * H * hd), f, n, H, hd);
  }
  void silu_forward(float* a, const float* u, size_t n) override { cpu::silu_forward<float>(a, u, n); }
  void silu_backward(float* du, const float* da, const float* u, size_t n) override {
    cpu::silu_backward<float>(du, da, u, n);
  }
  void sigmoid_gate_forward(float* y, float* g, const float* x, size_t n) override {
    cpu::sigmoid_gate_forward<float>(y, g, x, n);
  }
  void sigmoid_gate_forward_bf16(uint16_t* y, float* g, const float* x, size_t n) override {
    float* yf = wide_out(n);
    cpu::sigmoid_gate_forward<float>(yf, g, x, n);
    cpu::f32_to_bf16(y, yf, n);
  }
  void sigmoid_gate_backward(float* dx, float* dg, const float* dy, const float* x, const float* s, size_t n,
                             bool acc) override {
    cpu::sigmoid_gate_backward<float>(dx, dg, dy, x, s, n, acc);
  }
  void adamw_update(float* p, const float* g, float* m, float* v, size_t n, float lr, float b1, float b2,
                    float eps, float wd, float bc1, float bc2) override {
    cpu::adamw_update<float>(p, g, m, v, n, lr, b1, b2, eps, wd, bc1, bc2);
  }
  double adam_moments(float* m, float* v, const float* g, size_t n, float b1, float b2, float bc1, float bc2,
                      float eps) override {
    return cpu::adam_moments<float>(m, v, g, n, b1, b2, bc1, bc2, eps);
  }
  double adam_apply(float* w, const float* m, const float* v, size_t n, float bc1, float bc2, float eps,
                    float alpha) override {
    return cpu::adam_apply<float>(w, m, v, n, bc1, bc2, eps, alpha);
  }
  void muon_momentum(float* B, float* D, const float* G, size_t n, float mu, const float* grad_factor) override {
    cpu::muon_momentum<float>(B, D, G, n, mu, factor_or_one(grad_factor));
  }
  double axpy_sumsq(float* w, const float* x, size_t n, float alpha) override {
    return cpu::axpy_sumsq<float>(w, x, n, alpha);
  }
  // The no-wait optimizer ops: on the host they are the per-matrix code the optimizer ran before
  // (same kernels, same double scalars, same float casts), so results are bitwise unchanged.
  void adamw_multi(const OptimTensor* t, size_t count, const float* lr, const float* wd, int ngroups, float b1,
                   float b2, float eps, float bc1, float bc2, const float* grad_factor) override {
    const float gf = factor_or_one(grad_factor);
    for (size_t i = 0; i < count; ++i) {
      LADDER_ASSERT(t[i].group >= 0 && t[i].group < ngroups);
      cpu::adamw_update<float>(t[i].w, t[i].g, t[i].m, t[i].v, t[i].n, lr[t[i].group], b1, b2, eps, wd[t[i].group],
                               bc1, bc2, gf);
    }
  }
  void adamh_multi(const OptimTensor* t, size_t count, const double* lr, int ngroups, float b1, float b2, float eps,
                   float bc1, float bc2, const float* grad_factor) override {
    const float gf = factor_or_one(grad_factor);
    for (size_t i = 0; i < count; ++i) {
      const OptimTensor& x = t[i];
      LADDER_ASSERT(x.group >= 0 && x.group < ngroups && x.nmat > 0 && x.n % size_t(x.nmat) == 0);
      const size_t mn = x.n / size_t(x.nmat);
      for (int64_t e = 0; e < x.nmat; ++e) {
        const size_t off = size_t(e) * mn;
        const double uu = cpu::adam_moments<float>(x.m + off, x.v + off, x.g + off, mn, b1, b2, bc1, bc2, eps, gf);
        const double R = x.radius[e];
        const double alpha = -lr[x.group] * R / std::max(std::sqrt(uu), 1e-10);
        const double ww = cpu::adam_apply<float>(x.w + off, x.m + off, x.v + off, mn, bc1, bc2, eps, float(alpha));
        cpu::scale_inplace<float>(x.w + off, float(R / std::sqrt(ww)), mn);
      }
    }
  }
  void muonh_apply(float* w, const float* D, size_t n, const float* radius, double lr) override {
    const double R = *radius;
    const double xx = cpu::sum_squares<float>(D, n);
    const double alpha = -lr * R / std::max(std::sqrt(xx), 1e-10);
    const double ww = cpu::axpy_sumsq<float>(w, D, n, float(alpha));
    cpu::scale_inplace<float>(w, float(R / std::sqrt(ww)), n);
  }
  // The batched ops are the per-matrix loops themselves, so the CPU's results cannot change.
  void muonh_apply_batched(float* w, const float* D, size_t n, int count, const float* radius, double lr) override {
    for (int e = 0; e < count; ++e) muonh_apply(w + size_t(e) * n, D + size_t(e) * n, n, radius + e, lr);
  }
  // axpy_sumsq itself (its sum dropped) rather than a second loop, so Muon's w is bitwise what it was
  // whatever the compiler contracts into FMAs.
  void axpy(float* w, const float* x, size_t n, float alpha) override { (void)cpu::axpy_sumsq<float>(w, x, n, alpha); }
  void grad_clip_factor(const double* sums, size_t count, double clip, double* norm, float* factor) override {
    double s = 0;
    for (size_t i = 0; i < count; ++i) s += sums[i];
    *norm = std::sqrt(s);
    *factor = clip > 0 && *norm > clip ? float(clip / (*norm + 1e-6)) : 1.0f;
  }
  void sum_squares_multi(const float* const* x, const size_t* n, size_t count, double* out) override {
    for (size_t i = 0; i < count; ++i) out[i] = cpu::sum_squares<float>(x[i], n[i]);
  }
  void newton_schulz5(float* X, int rows, int cols) override {
    // Grown to the largest matrix seen, never shrunk: steady-state steps allocate nothing.
    const size_t need = cpu::ns_work_size(rows, cols);
    if (ns_work_.size() < need) ns_work_.resize(need);
    cpu::newton_schulz5<float>(X, rows, cols, ns_work_.data());
  }
  void newton_schulz5_batched(float* X, int rows, int cols, int count) override {
    const size_t mn = rows > 0 && cols > 0 ? size_t(rows) * size_t(cols) : 0;
    for (int e = 0; e < count; ++e) newton_schulz5(X + size_t(e) * mn, rows, cols);
  }

 private:
  // The bf16 ops' reference steps (typed GEMMs, the bf16 activation options): a bf16 input widened
  // into scratch slot `slot` (distinct slots for the inputs of one call), and the fp32 result a bf16
  // output is rounded from. Scratch grows to the largest call, then is reused.
  const float* widen(int slot, const void* x, size_t n) {
    std::vector<float>& b = wide_[slot];
    if (b.size() < n) b.resize(n);
    cpu::bf16_to_f32(b.data(), static_cast<const uint16_t*>(x), n);
    return b.data();
  }
  float* wide_out(size_t n) {
    if (wide_out_.size() < n) wide_out_.resize(n);
    return wide_out_.data();
  }
  // Elements of a rows x cols view with leading dimension ld (its last row ends at cols).
  static size_t span(int rows, int ld, int cols) {
    return rows > 0 && cols > 0 ? size_t(rows - 1) * size_t(ld) + size_t(cols) : 0;
  }
  std::vector<float> wide_[4], wide_out_;
  std::vector<float> ns_work_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int threads) {
  if (threads > 0) omp_set_num_threads(threads);
  openblas_set_num_threads(cpu_threads());
  return std::make_unique<CpuBackend>();
}

int cpu_threads() { return omp_get_max_threads(); }

}  // namespace ladder
