#include "backend/profiling_backend.h"

#include <chrono>

namespace ladder {
namespace {

class Profiler final : public ProfilingBackend {
 public:
  explicit Profiler(std::unique_ptr<Backend> b) : b_(std::move(b)) {}
  const std::map<std::string, OpTime>& times() const override { return t_; }
  void reset() override { t_.clear(); }
  std::string name() const override { return b_->name() + "+profile"; }

  template <class F>
  auto timed(const std::string& op, double flops, F&& f) {
    auto t0 = std::chrono::steady_clock::now();
    if constexpr (std::is_void_v<decltype(f())>) {
      f();
      add(op, flops, t0);
    } else {
      auto r = f();
      add(op, flops, t0);
      return r;
    }
  }
  void add(const std::string& op, double flops, std::chrono::steady_clock::time_point t0) {
    auto& e = t_[op];
    e.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    e.flops += flops;
    e.calls++;
  }

  void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
            float beta, float* C, int ldc) override {
    std::string op = std::string("gemm ") + (ta ? "T" : "N") + (tb ? "T" : "N");
    timed(op, 2.0 * M * N * K, [&] { b_->gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc); });
  }
  void grouped_gemm(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K, float alpha,
                    const float* A, int lda, const float* B, int ldb, size_t strideB, float beta, float* C, int ldc,
                    size_t strideC) override {
    timed("grouped gemm", 0, [&] {
      b_->grouped_gemm(rows_out, transB, E, offsets, M, N, K, alpha, A, lda, B, ldb, strideB, beta, C, ldc, strideC);
    });
  }
  void embedding_forward(float* o, const float* t, const int32_t* ids, int N, int D) override {
    timed("embedding", 0, [&] { b_->embedding_forward(o, t, ids, N, D); });
  }
  void embedding_backward(float* dt, const float* d, const int32_t* ids, int N, int D) override {
    timed("embedding", 0, [&] { b_->embedding_backward(dt, d, ids, N, D); });
  }
  void rmsnorm_forward(float* y, float* r, const float* x, const float* g, int N, int D, float eps) override {
    timed("rmsnorm", 0, [&] { b_->rmsnorm_forward(y, r, x, g, N, D, eps); });
  }
  void rmsnorm_backward(float* dx, float* dg, const float* dy, const float* x, const float* g, const float* r, int N,
                        int D, bool acc) override {
    timed("rmsnorm", 0, [&] { b_->rmsnorm_backward(dx, dg, dy, x, g, r, N, D, acc); });
  }
  void rope_forward(float* x, int N, int S, int nh, int hd, int rot, float th) override {
    timed("rope", 0, [&] { b_->rope_forward(x, N, S, nh, hd, rot, th); });
  }
  void rope_backward(float* x, int N, int S, int nh, int hd, int rot, float th) override {
    timed("rope", 0, [&] { b_->rope_backward(x, N, S, nh, hd, rot, th); });
  }
  void attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                         const AttnShape& s) override {
    timed("attention fwd", 0, [&] { b_->attention_forward(o, lse, q, k, v, s); });
  }
  void attention_backward(float* dq, float* dk, float* dv, const float* d, const float* q, const float* k,
                          const float* v, const float* o, const float* lse, const AttnShape& s) override {
    timed("attention bwd", 0, [&] { b_->attention_backward(dq, dk, dv, d, q, k, v, o, lse, s); });
  }
  void swiglu_forward(float* h, const float* g, const float* u, size_t n) override {
    timed("swiglu", 0, [&] { b_->swiglu_forward(h, g, u, n); });
  }
  void swiglu_backward(float* dg, float* du, const float* dh, const float* g, const float* u, size_t n) override {
    timed("swiglu", 0, [&] { b_->swiglu_backward(dg, du, dh, g, u, n); });
  }
  XentSums softmax_xent(float* l, const int32_t* t, int N, int V, float z, float gs) override {
    return timed("softmax_xent", 0, [&] { return b_->softmax_xent(l, t, N, V, z, gs); });
  }
  XentSums softmax_xent_forward(const float* l, const int32_t* t, int N, int V, float* losses) override {
    return timed("softmax_xent", 0, [&] { return b_->softmax_xent_forward(l, t, N, V, losses); });
  }
  void add_inplace(float* y, const float* x, size_t n) override { timed("vector ops", 0, [&] { b_->add_inplace(y, x, n); }); }
  void scale_inplace(float* x, float s, size_t n) override { timed("vector ops", 0, [&] { b_->scale_inplace(x, s, n); }); }
  double sum_squares(const float* x, size_t n) override {
    return timed("grad norm", 0, [&] { return b_->sum_squares(x, n); });
  }
  void adamw_update(float* p, const float* g, float* m, float* v, size_t n, float lr, float b1, float b2, float eps,
                    float wd, float bc1, float bc2) override {
    timed("optimizer", 0, [&] { b_->adamw_update(p, g, m, v, n, lr, b1, b2, eps, wd, bc1, bc2); });
  }
  void pko_shift_forward(float* out, const float* k, const uint8_t* r, int N, int nkv, int hd, int from) override {
    timed("attn switches", 0, [&] { b_->pko_shift_forward(out, k, r, N, nkv, hd, from); });
  }
  void pko_shift_backward(float* dk, const float* d, const uint8_t* r, int N, int nkv, int hd, int from) override {
    timed("attn switches", 0, [&] { b_->pko_shift_backward(dk, d, r, N, nkv, hd, from); });
  }
  void xsa_forward(float* z, const float* y, const float* v, int N, int H, int KV, int hd) override {
    timed("attn switches", 0, [&] { b_->xsa_forward(z, y, v, N, H, KV, hd); });
  }
  void xsa_backward(float* dy, float* dv, const float* dz, const float* y, const float* v, int N, int H, int KV,
                    int hd) override {
    timed("attn switches", 0, [&] { b_->xsa_backward(dy, dv, dz, y, v, N, H, KV, hd); });
  }
  void head_gate_forward(float* out, float* f, const float* x, const float* l, int N, int H, int hd) override {
    timed("attn switches", 0, [&] { b_->head_gate_forward(out, f, x, l, N, H, hd); });
  }
  void head_gate_backward(float* dx, float* dl, const float* d, const float* x, const float* f, int N, int H,
                          int hd) override {
    timed("attn switches", 0, [&] { b_->head_gate_backward(dx, dl, d, x, f, N, H, hd); });
  }
  void silu_forward(float* a, const float* u, size_t n) override {
    timed("gated norm", 0, [&] { b_->silu_forward(a, u, n); });
  }
  void silu_backward(float* du, const float* da, const float* u, size_t n) override {
    timed("gated norm", 0, [&] { b_->silu_backward(du, da, u, n); });
  }
  void sigmoid_gate_forward(float* y, float* g, const float* x, size_t n) override {
    timed("gated norm", 0, [&] { b_->sigmoid_gate_forward(y, g, x, n); });
  }
  void sigmoid_gate_backward(float* dx, float* dg, const float* dy, const float* x, const float* s, size_t n,
                             bool acc) override {
    timed("gated norm", 0, [&] { b_->sigmoid_gate_backward(dx, dg, dy, x, s, n, acc); });
  }
  double adam_moments(float* m, float* v, const float* g, size_t n, float b1, float b2, float bc1, float bc2,
                      float eps) override {
    return timed("optimizer", 0, [&] { return b_->adam_moments(m, v, g, n, b1, b2, bc1, bc2, eps); });
  }
  double adam_apply(float* w, const float* m, const float* v, size_t n, float bc1, float bc2, float eps,
                    float alpha) override {
    return timed("optimizer", 0, [&] { return b_->adam_apply(w, m, v, n, bc1, bc2, eps, alpha); });
  }
  void muon_momentum(float* B, float* D, const float* G, size_t n, float mu) override {
    timed("optimizer", 0, [&] { b_->muon_momentum(B, D, G, n, mu); });
  }
  double axpy_sumsq(float* w, const float* x, size_t n, float alpha) override {
    return timed("optimizer", 0, [&] { return b_->axpy_sumsq(w, x, n, alpha); });
  }
  void newton_schulz5(float* X, int rows, int cols) override {
    timed("newton-schulz", 0, [&] { b_->newton_schulz5(X, rows, cols); });
  }

 private:
  std::unique_ptr<Backend> b_;
  std::map<std::string, OpTime> t_;
};

}  // namespace

std::unique_ptr<ProfilingBackend> make_profiling_backend(std::unique_ptr<Backend> inner) {
  return std::make_unique<Profiler>(std::move(inner));
}

}  // namespace ladder
