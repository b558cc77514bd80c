// A Backend that forwards every op to an inner backend and runs each inside around(op, flops, f),
// the one place a decorator hooks in: ProfilingBackend times ops; the tests' guarded backend
// unlocks its emulated device memory around them. Memory management (is_host, mem_alloc, mem_free)
// forwards too and may be overridden.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "backend/backend.h"

namespace ladder {

class ForwardingBackend : public Backend {
 protected:
  // Runs f (the inner op). `op` names it for display ("gemm NT", "moe routing", ...); `flops` is
  // nonzero for GEMMs.
  virtual void around(const char* op, double flops, const std::function<void()>& f) {
    (void)op;
    (void)flops;
    f();
  }
  // around() with the op's shape ("16384x1024x1024 bf16,bf16->bf16" for a GEMM): a decorator that
  // tells shapes apart (ProfilingBackend: time per GEMM shape) overrides this one as well.
  virtual void around_shape(const char* op, const std::string& shape, double flops, const std::function<void()>& f) {
    (void)shape;
    around(op, flops, f);
  }
  template <class F>
  auto wrap(const char* op, double flops, F&& f) {
    if constexpr (std::is_void_v<decltype(f())>) {
      around(op, flops, f);
    } else {
      decltype(f()) r{};
      around(op, flops, [&] { r = f(); });
      return r;
    }
  }
  // A GEMM's shape: M x N x K, operand and output types (bf16 where the op is given bf16 bits;
  // fp32 operands may still run as bf16 under run.precision: bf16), "+C" when it adds to C, and
  // for a grouped GEMM the experts and the row bound.
  static std::string gemm_shape(int M, int N, int K, bool a16, bool b16, bool d16, bool addC) {
    auto t = [](bool b) { return b ? "bf16" : "f32"; };
    return std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K) + " " + t(a16) + "," + t(b16) +
           "->" + t(d16) + (addC ? "+C" : "");
  }
  static std::string grouped_shape(bool rows_out, bool transB, int E, int rows, int M, int N, int K, bool a16,
                                   bool b16, bool c16, bool addC) {
    return std::string(rows_out ? (transB ? "rows,B^T " : "rows,B ") : "wgrad ") + "E=" + std::to_string(E) +
           (rows >= 0 ? " rows=" + std::to_string(rows) + " " : " ") + gemm_shape(M, N, K, a16, b16, c16, addC);
  }
  // A GEMM's op name: its kind and transposes ("gemm NT"; "batched gemm NT" for the capacity
  // layout's expert GEMMs and "gemm fp32 NT" for the router's, apart from the others in a profile).
  static std::string gemm_op(bool ta, bool tb, const char* kind = "gemm") {
    return std::string(kind) + " " + (ta ? "T" : "N") + (tb ? "T" : "N");
  }

 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : b_(std::move(inner)) {}
  Backend& inner() { return *b_; }
  std::string name() const override { return b_->name(); }

  // ---- everything below forwards through wrap() -> around()
  void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
            float beta, float* C, int ldc) override {
    around_shape(gemm_op(ta, tb).c_str(), gemm_shape(M, N, K, false, false, false, beta != 0.f),
                 2.0 * M * N * K, [&] { b_->gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc); });
  }
  void gemm_fp32(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                 float beta, float* C, int ldc) override {
    around_shape(gemm_op(ta, tb, "gemm fp32").c_str(), gemm_shape(M, N, K, false, false, false, beta != 0.f),
                 2.0 * M * N * K, [&] { b_->gemm_fp32(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc); });
  }
  void gemm_add(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                const float* C, float* D, int ldc) override {
    around_shape(gemm_op(ta, tb).c_str(), gemm_shape(M, N, K, false, false, false, true), 2.0 * M * N * K,
                 [&] { b_->gemm_add(ta, tb, M, N, K, alpha, A, lda, B, ldb, C, D, ldc); });
  }
  void gemm_b16(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const uint16_t* B, int ldb,
                float beta, float* C, int ldc) override {
    around_shape(gemm_op(ta, tb).c_str(), gemm_shape(M, N, K, false, true, false, beta != 0.f),
                 2.0 * M * N * K, [&] { b_->gemm_b16(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc); });
  }
  void gemm_ex(bool ta, bool tb, int M, int N, int K, float alpha, const void* A, bool a_bf16, int lda, const void* B,
               bool b_bf16, int ldb, float beta, const float* C_in, void* D, bool d_bf16, int ldc) override {
    around_shape(gemm_op(ta, tb).c_str(),
                 gemm_shape(M, N, K, a_bf16, b_bf16, d_bf16, beta != 0.f), 2.0 * M * N * K, [&] {
      b_->gemm_ex(ta, tb, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, beta, C_in, D, d_bf16, ldc);
    });
  }
  void batched_gemm_ex(int count, bool ta, bool tb, int M, int N, int K, float alpha, const void* A, bool a_bf16,
                       int lda, const void* B, bool b_bf16, int ldb, float beta, void* C, bool c_bf16,
                       int ldc) override {
    around_shape(gemm_op(ta, tb, "batched gemm").c_str(),
                 std::string("x") + std::to_string(count) + " " + gemm_shape(M, N, K, a_bf16, b_bf16, c_bf16, beta != 0.f),
                 2.0 * count * M * N * K, [&] {
      b_->batched_gemm_ex(count, ta, tb, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, beta, C, c_bf16, ldc);
    });
  }
  void grouped_gemm(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K, float alpha,
                    const float* A, int lda, const float* B, int ldb, size_t strideB, float beta, float* C, int ldc,
                    size_t strideC) override {
    around_shape("grouped gemm", grouped_shape(rows_out, transB, E, -1, M, N, K, false, false, false, beta != 0.f), 0,
                 [&] {
      b_->grouped_gemm(rows_out, transB, E, offsets, M, N, K, alpha, A, lda, B, ldb, strideB, beta, C, ldc, strideC);
    });
  }
  void grouped_gemm_ex(bool rows_out, bool transB, int E, const int32_t* offsets, int rows, int M, int N, int K,
                       float alpha, const void* A, bool a_bf16, int lda, const void* B, bool b_bf16, int ldb,
                       size_t strideB, float beta, void* C, bool c_bf16, int ldc, size_t strideC) override {
    // FLOPs from the row bound: exact where rows is offsets[E], as in the model (dropless MoE).
    const double flops = 2.0 * double(rows) * N * (rows_out ? K : M);
    around_shape("grouped gemm",
                 grouped_shape(rows_out, transB, E, rows, M, N, K, a_bf16, b_bf16, c_bf16, beta != 0.f), flops, [&] {
      b_->grouped_gemm_ex(rows_out, transB, E, offsets, rows, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, strideB,
                          beta, C, c_bf16, ldc, strideC);
    });
  }
  void embedding_forward(float* o, const float* t, const int32_t* ids, int N, int D) override {
    wrap("embedding", 0, [&] { b_->embedding_forward(o, t, ids, N, D); });
  }
  void embedding_backward(float* dt, const float* d, const int32_t* ids, int N, int D) override {
    wrap("embedding", 0, [&] { b_->embedding_backward(dt, d, ids, N, D); });
  }
  void rmsnorm_forward(float* y, float* r, const float* x, const float* g, int N, int D, float eps) override {
    wrap("rmsnorm", 0, [&] { b_->rmsnorm_forward(y, r, x, g, N, D, eps); });
  }
  void rmsnorm_backward(float* dx, float* dg, const float* dy, const float* x, const float* g, const float* r, int N,
                        int D, bool acc) override {
    wrap("rmsnorm", 0, [&] { b_->rmsnorm_backward(dx, dg, dy, x, g, r, N, D, acc); });
  }
  void rmsnorm_forward_bf16(uint16_t* y, float* rstd, const float* x, const float* gain, int N, int D,
                            float eps) override {
    wrap("rmsnorm", 0, [&] { b_->rmsnorm_forward_bf16(y, rstd, x, gain, N, D, eps); });
  }
  void rope_forward(float* x, int N, int S, int nh, int hd, int rot, float th) override {
    wrap("rope", 0, [&] { b_->rope_forward(x, N, S, nh, hd, rot, th); });
  }
  void rope_backward(float* x, int N, int S, int nh, int hd, int rot, float th) override {
    wrap("rope", 0, [&] { b_->rope_backward(x, N, S, nh, hd, rot, th); });
  }
  void attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                         const AttnShape& s) override {
    wrap("attention fwd", 0, [&] { b_->attention_forward(o, lse, q, k, v, s); });
  }
  void attention_backward(float* dq, float* dk, float* dv, const float* d, const float* q, const float* k,
                          const float* v, const float* o, const float* lse, const AttnShape& s) override {
    wrap("attention bwd", 0, [&] { b_->attention_backward(dq, dk, dv, d, q, k, v, o, lse, s); });
  }
  void swiglu_forward_rows(void* h, const void* g, const void* u, bool h16, int64_t rows, int cols,
                           const int32_t* used) override {
    wrap("swiglu", 0, [&] { b_->swiglu_forward_rows(h, g, u, h16, rows, cols, used); });
  }
  void swiglu_backward_rows(void* dg, void* du, const void* dh, const void* g, const void* u, bool h16, bool d16,
                            int64_t rows, int cols, const int32_t* used) override {
    wrap("swiglu", 0, [&] { b_->swiglu_backward_rows(dg, du, dh, g, u, h16, d16, rows, cols, used); });
  }
  void swiglu_forward(float* h, const float* g, const float* u, size_t n) override {
    wrap("swiglu", 0, [&] { b_->swiglu_forward(h, g, u, n); });
  }
  void swiglu_backward(float* dg, float* du, const float* dh, const float* g, const float* u, size_t n) override {
    wrap("swiglu", 0, [&] { b_->swiglu_backward(dg, du, dh, g, u, n); });
  }
  void swiglu_forward_bf16(uint16_t* h, const uint16_t* g, const uint16_t* u, size_t n) override {
    wrap("swiglu", 0, [&] { b_->swiglu_forward_bf16(h, g, u, n); });
  }
  void swiglu_backward_bf16(float* dg, float* du, const float* dh, const uint16_t* g, const uint16_t* u,
                            size_t n) override {
    wrap("swiglu", 0, [&] { b_->swiglu_backward_bf16(dg, du, dh, g, u, n); });
  }
  void swiglu_backward_bf16_grads(uint16_t* dg, uint16_t* du, const uint16_t* dh, const uint16_t* g, const uint16_t* u,
                                  size_t n) override {
    wrap("swiglu", 0, [&] { b_->swiglu_backward_bf16_grads(dg, du, dh, g, u, n); });
  }
  XentSums softmax_xent(float* l, const int32_t* t, int N, int V, float z, float gs) override {
    return wrap("softmax_xent", 0, [&] { return b_->softmax_xent(l, t, N, V, z, gs); });
  }
  XentSums softmax_xent_forward(const float* l, const int32_t* t, int N, int V, float* losses) override {
    return wrap("softmax_xent", 0, [&] { return b_->softmax_xent_forward(l, t, N, V, losses); });
  }
  void add_inplace(float* y, const float* x, size_t n) override { wrap("vector ops", 0, [&] { b_->add_inplace(y, x, n); }); }
  void scale_inplace(float* x, float s, size_t n) override { wrap("vector ops", 0, [&] { b_->scale_inplace(x, s, n); }); }
  double sum_squares(const float* x, size_t n) override {
    return wrap("grad norm", 0, [&] { return b_->sum_squares(x, n); });
  }
  double device_memory_used() const override { return b_->device_memory_used(); }
  std::unique_ptr<OpTimer> make_op_timer() override { return b_->make_op_timer(); }
  size_t lm_head_chunk_bytes() const override { return b_->lm_head_chunk_bytes(); }
  DeviceCollectives* collectives() override { return b_->collectives(); }
  void to_bf16(uint16_t* out, const float* in, size_t n) override {
    wrap("bf16 storage", 0, [&] { b_->to_bf16(out, in, n); });
  }
  void from_bf16(float* out, const uint16_t* in, size_t n) override {
    wrap("bf16 storage", 0, [&] { b_->from_bf16(out, in, n); });
  }
  void adamw_update(float* p, const float* g, float* m, float* v, size_t n, float lr, float b1, float b2, float eps,
                    float wd, float bc1, float bc2) override {
    wrap("optimizer", 0, [&] { b_->adamw_update(p, g, m, v, n, lr, b1, b2, eps, wd, bc1, bc2); });
  }
  void pko_shift_forward(float* out, const float* k, const uint8_t* r, int N, int nkv, int hd, int from) override {
    wrap("attn switches", 0, [&] { b_->pko_shift_forward(out, k, r, N, nkv, hd, from); });
  }
  void pko_shift_backward(float* dk, const float* d, const uint8_t* r, int N, int nkv, int hd, int from) override {
    wrap("attn switches", 0, [&] { b_->pko_shift_backward(dk, d, r, N, nkv, hd, from); });
  }
  void qk_prep_forward(float* out, float* rs, const float* x, const float* g, const uint8_t* r, int N, int S, int nh,
                       int hd, int rot, float th, bool norm, float eps) override {
    wrap("qk prep", 0, [&] { b_->qk_prep_forward(out, rs, x, g, r, N, S, nh, hd, rot, th, norm, eps); });
  }
  void qk_prep_backward(float* dx, float* dg, const float* d, const float* x, const float* g, const float* rs,
                        const uint8_t* r, int N, int S, int nh, int hd, int rot, float th, bool norm) override {
    wrap("qk prep", 0, [&] { b_->qk_prep_backward(dx, dg, d, x, g, rs, r, N, S, nh, hd, rot, th, norm); });
  }
  void xsa_forward(float* z, const float* y, const float* v, int N, int H, int KV, int hd) override {
    wrap("attn switches", 0, [&] { b_->xsa_forward(z, y, v, N, H, KV, hd); });
  }
  void xsa_backward(float* dy, float* dv, const float* dz, const float* y, const float* v, int N, int H, int KV,
                    int hd) override {
    wrap("attn switches", 0, [&] { b_->xsa_backward(dy, dv, dz, y, v, N, H, KV, hd); });
  }
  void head_gate_forward(float* out, float* f, const float* x, const float* l, int N, int H, int hd) override {
    wrap("attn switches", 0, [&] { b_->head_gate_forward(out, f, x, l, N, H, hd); });
  }
  void head_gate_backward(float* dx, float* dl, const float* d, const float* x, const float* f, int N, int H,
                          int hd) override {
    wrap("attn switches", 0, [&] { b_->head_gate_backward(dx, dl, d, x, f, N, H, hd); });
  }
  void qk_prep_forward_bf16(uint16_t* out, float* rs, const uint16_t* x, const float* g, const uint8_t* r, int N,
                            int S, int nh, int hd, int rot, float th, bool norm, float eps) override {
    wrap("qk prep", 0, [&] { b_->qk_prep_forward_bf16(out, rs, x, g, r, N, S, nh, hd, rot, th, norm, eps); });
  }
  void qk_prep_backward_bf16(float* dx, float* dg, const float* d, const uint16_t* x, const float* g, const float* rs,
                             const uint8_t* r, int N, int S, int nh, int hd, int rot, float th, bool norm) override {
    wrap("qk prep", 0, [&] { b_->qk_prep_backward_bf16(dx, dg, d, x, g, rs, r, N, S, nh, hd, rot, th, norm); });
  }
  void attention_forward_bf16(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              const AttnShape& s) override {
    wrap("attention fwd", 0, [&] { b_->attention_forward_bf16(o, lse, q, k, v, s); });
  }
  void attention_backward_bf16(float* dq, float* dk, float* dv, const float* d, const uint16_t* q, const uint16_t* k,
                               const uint16_t* v, const uint16_t* o, const float* lse, const AttnShape& s) override {
    wrap("attention bwd", 0, [&] { b_->attention_backward_bf16(dq, dk, dv, d, q, k, v, o, lse, s); });
  }
  void xsa_forward_bf16(uint16_t* z, const uint16_t* y, const uint16_t* v, int N, int H, int KV, int hd) override {
    wrap("attn switches", 0, [&] { b_->xsa_forward_bf16(z, y, v, N, H, KV, hd); });
  }
  void xsa_backward_bf16(float* dy, float* dv, const float* dz, const uint16_t* y, const uint16_t* v, int N, int H,
                         int KV, int hd) override {
    wrap("attn switches", 0, [&] { b_->xsa_backward_bf16(dy, dv, dz, y, v, N, H, KV, hd); });
  }
  void head_gate_forward_bf16(uint16_t* out, float* f, const uint16_t* x, const float* l, int N, int H,
                              int hd) override {
    wrap("attn switches", 0, [&] { b_->head_gate_forward_bf16(out, f, x, l, N, H, hd); });
  }
  void head_gate_backward_bf16(float* dx, float* dl, const float* d, const uint16_t* x, const float* f, int N, int H,
                               int hd) override {
    wrap("attn switches", 0, [&] { b_->head_gate_backward_bf16(dx, dl, d, x, f, N, H, hd); });
  }
  void silu_forward(float* a, const float* u, size_t n) override {
    wrap("gated norm", 0, [&] { b_->silu_forward(a, u, n); });
  }
  void silu_backward(float* du, const float* da, const float* u, size_t n) override {
    wrap("gated norm", 0, [&] { b_->silu_backward(du, da, u, n); });
  }
  void sigmoid_gate_forward(float* y, float* g, const float* x, size_t n) override {
    wrap("gated norm", 0, [&] { b_->sigmoid_gate_forward(y, g, x, n); });
  }
  void sigmoid_gate_forward_bf16(uint16_t* y, float* g, const float* x, size_t n) override {
    wrap("gated norm", 0, [&] { b_->sigmoid_gate_forward_bf16(y, g, x, n); });
  }
  void sigmoid_gate_backward(float* dx, float* dg, const float* dy, const float* x, const float* s, size_t n,
                             bool acc) override {
    wrap("gated norm", 0, [&] { b_->sigmoid_gate_backward(dx, dg, dy, x, s, n, acc); });
  }
  double adam_moments(float* m, float* v, const float* g, size_t n, float b1, float b2, float bc1, float bc2,
                      float eps) override {
    return wrap("optimizer", 0, [&] { return b_->adam_moments(m, v, g, n, b1, b2, bc1, bc2, eps); });
  }
  double adam_apply(float* w, const float* m, const float* v, size_t n, float bc1, float bc2, float eps,
                    float alpha) override {
    return wrap("optimizer", 0, [&] { return b_->adam_apply(w, m, v, n, bc1, bc2, eps, alpha); });
  }
  void muon_momentum(float* B, float* D, const float* G, size_t n, float mu, const float* grad_factor) override {
    wrap("optimizer", 0, [&] { b_->muon_momentum(B, D, G, n, mu, grad_factor); });
  }
  double axpy_sumsq(float* w, const float* x, size_t n, float alpha) override {
    return wrap("optimizer", 0, [&] { return b_->axpy_sumsq(w, x, n, alpha); });
  }
  void newton_schulz5(float* X, int rows, int cols) override {
    wrap("newton-schulz", 0, [&] { b_->newton_schulz5(X, rows, cols); });
  }
  void newton_schulz5_batched(float* X, int rows, int cols, int count) override {
    wrap("newton-schulz", 0, [&] { b_->newton_schulz5_batched(X, rows, cols, count); });
  }
  void adamw_multi(const OptimTensor* t, size_t count, const float* lr, const float* wd, int ngroups, float b1,
                   float b2, float eps, float bc1, float bc2, const float* grad_factor) override {
    wrap("optimizer", 0, [&] { b_->adamw_multi(t, count, lr, wd, ngroups, b1, b2, eps, bc1, bc2, grad_factor); });
  }
  void adamh_multi(const OptimTensor* t, size_t count, const double* lr, int ngroups, float b1, float b2, float eps,
                   float bc1, float bc2, const float* grad_factor) override {
    wrap("optimizer", 0, [&] { b_->adamh_multi(t, count, lr, ngroups, b1, b2, eps, bc1, bc2, grad_factor); });
  }
  void muonh_apply(float* w, const float* D, size_t n, const float* radius, double lr) override {
    wrap("optimizer", 0, [&] { b_->muonh_apply(w, D, n, radius, lr); });
  }
  void muonh_apply_batched(float* w, const float* D, size_t n, int count, const float* radius, double lr) override {
    wrap("optimizer", 0, [&] { b_->muonh_apply_batched(w, D, n, count, radius, lr); });
  }
  void axpy(float* w, const float* x, size_t n, float alpha) override {
    wrap("optimizer", 0, [&] { b_->axpy(w, x, n, alpha); });
  }
  void grad_clip_factor(const double* sums, size_t count, double clip, double* norm, float* factor) override {
    wrap("vector ops", 0, [&] { b_->grad_clip_factor(sums, count, clip, norm, factor); });
  }
  void sum_squares_multi(const float* const* x, const size_t* n, size_t count, double* out) override {
    wrap("grad norm", 0, [&] { b_->sum_squares_multi(x, n, count, out); });
  }

  void register_weights(const void* base, size_t bytes) override { b_->register_weights(base, bytes); }
  void unregister_weights(const void* base) override { b_->unregister_weights(base); }
  void note_external_write(const void* p, size_t bytes) override { b_->note_external_write(p, bytes); }
  // Memory, and the ops that write their sums to backend memory.
  bool is_host() const override { return b_->is_host(); }
  size_t available_bytes() const override { return b_->available_bytes(); }
  void* mem_alloc(size_t bytes, const char* what) override { return b_->mem_alloc(bytes, what); }
  void mem_free(void* p) override { b_->mem_free(p); }
  void upload(void* d, const void* s, size_t n) override { wrap("copies", 0, [&] { b_->upload(d, s, n); }); }
  void download(void* d, const void* s, size_t n) override { wrap("copies", 0, [&] { b_->download(d, s, n); }); }
  void copy(void* d, const void* s, size_t n) override { wrap("copies", 0, [&] { b_->copy(d, s, n); }); }
  void zero(void* p, size_t n) override { wrap("copies", 0, [&] { b_->zero(p, n); }); }
  void synchronize() override { b_->synchronize(); }
  void softmax_xent_async(float* l, const int32_t* t, int N, int V, float z, float gs, double* sums) override {
    wrap("softmax_xent", 0, [&] { b_->softmax_xent_async(l, t, N, V, z, gs, sums); });
  }
  void softmax_xent_forward_async(const float* l, const int32_t* t, int N, int V, float* losses,
                                  double* sums) override {
    wrap("softmax_xent", 0, [&] { b_->softmax_xent_forward_async(l, t, N, V, losses, sums); });
  }
  void sum_squares_async(const float* x, size_t n, double* out) override {
    wrap("vector ops", 0, [&] { b_->sum_squares_async(x, n, out); });
  }
  void pko_resets(uint8_t* r, const int32_t* ids, int N, int S, int eod) override {
    wrap("pko", 0, [&] { b_->pko_resets(r, ids, N, S, eod); });
  }
  // MoE dispatch: one entry for routing (route, sort, router backward, balancing) and one for the
  // data movement (gather, combine and their backward).
  void moe_route(float* lse, int32_t* ex, float* comb, const float* s, const float* bias, int N, int E, int K,
                 bool nz, double rs) override {
    wrap("moe routing", 0, [&] { b_->moe_route(lse, ex, comb, s, bias, N, E, K, nz, rs); });
  }
  void moe_sort(int32_t* off, int32_t* row, int32_t* slot, const int32_t* ex, int NK, int E) override {
    wrap("moe routing", 0, [&] { b_->moe_sort(off, row, slot, ex, NK, E); });
  }
  void moe_capacity(int32_t* row, int32_t* cslot, int32_t* ov, const int32_t* offsets, const int32_t* slot, int NK,
                    int E, int C, int R) override {
    wrap("moe routing", 0, [&] { b_->moe_capacity(row, cslot, ov, offsets, slot, NK, E, C, R); });
  }
  void moe_zero_rows(void* x, bool bf16, const int32_t* cslot, int rows, int cols) override {
    wrap("moe permute", 0, [&] { b_->moe_zero_rows(x, bf16, cslot, rows, cols); });
  }
  void moe_gather(float* xs, const float* h, const int32_t* slot, int NK, int K, int d) override {
    wrap("moe permute", 0, [&] { b_->moe_gather(xs, h, slot, NK, K, d); });
  }
  void moe_combine(float* out, const float* y, const float* comb, const int32_t* row, int N, int K, int d) override {
    wrap("moe permute", 0, [&] { b_->moe_combine(out, y, comb, row, N, K, d); });
  }
  void moe_combine_backward(float* dy, float* dc, const float* dout, const float* y, const float* comb,
                            const int32_t* row, int N, int K, int d) override {
    wrap("moe permute", 0, [&] { b_->moe_combine_backward(dy, dc, dout, y, comb, row, N, K, d); });
  }
  void moe_combine_bf16(float* out, const uint16_t* y, const float* comb, const int32_t* row, int N, int K,
                        int d) override {
    wrap("moe permute", 0, [&] { b_->moe_combine_bf16(out, y, comb, row, N, K, d); });
  }
  void moe_combine_backward_bf16(float* dy, float* dc, const float* dout, const uint16_t* y, const float* comb,
                                 const int32_t* row, int N, int K, int d) override {
    wrap("moe permute", 0, [&] { b_->moe_combine_backward_bf16(dy, dc, dout, y, comb, row, N, K, d); });
  }
  void moe_combine_backward_bf16_grads(uint16_t* dy, float* dc, const float* dout, const uint16_t* y,
                                       const float* comb, const int32_t* row, int N, int K, int d) override {
    wrap("moe permute", 0, [&] { b_->moe_combine_backward_bf16_grads(dy, dc, dout, y, comb, row, N, K, d); });
  }
  void moe_gather_bf16(uint16_t* xs, const float* h, const int32_t* slot, int NK, int K, int d) override {
    wrap("moe permute", 0, [&] { b_->moe_gather_bf16(xs, h, slot, NK, K, d); });
  }
  void moe_gather_backward(float* dh, const float* dx, const int32_t* row, int N, int K, int d) override {
    wrap("moe permute", 0, [&] { b_->moe_gather_backward(dh, dx, row, N, K, d); });
  }
  void moe_router_backward(float* ds, const float* s, const float* lse, const int32_t* ex, const float* dc, int N,
                           int E, int K, bool nz, double rs, float z) override {
    wrap("moe routing", 0, [&] { b_->moe_router_backward(ds, s, lse, ex, dc, N, E, K, nz, rs, z); });
  }
  void moe_balance_values(float* v, const float* s, const float* bias, int N, int E, int K) override {
    wrap("moe routing", 0, [&] { b_->moe_balance_values(v, s, bias, N, E, K); });
  }
  void moe_quantile_beta(double* beta, const float* v, int64_t T, int E, int K) override {
    wrap("moe routing", 0, [&] { b_->moe_quantile_beta(beta, v, T, E, K); });
  }
  void moe_balance_bias(float* bias, const double* beta, int E) override {
    wrap("moe routing", 0, [&] { b_->moe_balance_bias(bias, beta, E); });
  }
  void moe_count_load(int64_t* load, const int32_t* off, int E) override {
    wrap("moe routing", 0, [&] { b_->moe_count_load(load, off, E); });
  }


 protected:
  std::unique_ptr<Backend> b_;
};

}  // namespace ladder
