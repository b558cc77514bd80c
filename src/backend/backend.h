// The op interface the model is written against. The CPU backend (backend/cpu) implements it with
// OpenBLAS + OpenMP and doubles as the reference a CUDA backend is tested against. Pointers are
// device pointers of the backend; shapes and conventions are those of backend/cpu/kernels.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "backend/cpu/kernels.h"
#include "backend/cpu/optim_kernels.h"

namespace ladder {

using cpu::AttnShape;
using cpu::XentSums;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                    const float* B, int ldb, float beta, float* C, int ldc) = 0;
  // Grouped GEMM over per-expert row blocks (see cpu::grouped_gemm for the two shapes).
  virtual void grouped_gemm(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K,
                            float alpha, const float* A, int lda, const float* B, int ldb, size_t strideB,
                            float beta, float* C, int ldc, size_t strideC) = 0;
  virtual void embedding_forward(float* out, const float* table, const int32_t* ids, int N, int D) = 0;
  virtual void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int N, int D) = 0;
  virtual void rmsnorm_forward(float* y, float* rstd, const float* x, const float* gain, int N, int D, float eps) = 0;
  virtual void rmsnorm_backward(float* dx, float* dgain, const float* dy, const float* x, const float* gain,
                                const float* rstd, int N, int D, bool accumulate_dx) = 0;
  virtual void rope_forward(float* x, int N_tok, int S, int nheads, int hd, int rot_dims, float theta) = 0;
  virtual void rope_backward(float* dx, int N_tok, int S, int nheads, int hd, int rot_dims, float theta) = 0;
  virtual void attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                                 const AttnShape& s) = 0;
  virtual void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                                  const float* k, const float* v, const float* o, const float* lse,
                                  const AttnShape& s) = 0;
  virtual void swiglu_forward(float* h, const float* g, const float* u, size_t n) = 0;
  virtual void swiglu_backward(float* dg, float* du, const float* dh, const float* g, const float* u, size_t n) = 0;
  virtual XentSums softmax_xent(float* logits, const int32_t* targets, int N, int V, float z_coef, float grad_scale) = 0;
  virtual XentSums softmax_xent_forward(const float* logits, const int32_t* targets, int N, int V, float* losses) = 0;
  virtual void add_inplace(float* y, const float* x, size_t n) = 0;
  virtual void scale_inplace(float* x, float s, size_t n) = 0;
  virtual double sum_squares(const float* x, size_t n) = 0;
  // Recipe switches in attention and norms (contracts in backend/cpu/kernels.h).
  virtual void pko_shift_forward(float* out, const float* k, const uint8_t* reset, int N_tok, int nkv, int hd,
                                 int from_dim) = 0;
  virtual void pko_shift_backward(float* dk, const float* dout, const uint8_t* reset, int N_tok, int nkv, int hd,
                                  int from_dim) = 0;
  virtual void xsa_forward(float* z, const float* y, const float* v, int N_tok, int H, int KV, int hd) = 0;
  virtual void xsa_backward(float* dy, float* dv, const float* dz, const float* y, const float* v, int N_tok, int H,
                            int KV, int hd) = 0;
  virtual void head_gate_forward(float* out, float* factor, const float* x, const float* logit, int N_tok, int H,
                                 int hd) = 0;
  virtual void head_gate_backward(float* dx, float* dlogit, const float* dout, const float* x, const float* factor,
                                  int N_tok, int H, int hd) = 0;
  virtual void silu_forward(float* a, const float* u, size_t n) = 0;
  virtual void silu_backward(float* du, const float* da, const float* u, size_t n) = 0;
  virtual void sigmoid_gate_forward(float* y, float* g, const float* x, size_t n) = 0;
  virtual void sigmoid_gate_backward(float* dx, float* dg, const float* dy, const float* x, const float* s, size_t n,
                                     bool accumulate_dx) = 0;
  virtual void adamw_update(float* p, const float* g, float* m, float* v, size_t n, float lr, float b1,
                            float b2, float eps, float wd, float bc1, float bc2) = 0;
  // The recipe's optimizers (backend/cpu/optim_kernels.h has the contracts). Norms come back as
  // double sums of squares so the hyperball projection is taken in double.
  virtual double adam_moments(float* m, float* v, const float* g, size_t n, float b1, float b2, float bc1,
                              float bc2, float eps) = 0;
  virtual double adam_apply(float* w, const float* m, const float* v, size_t n, float bc1, float bc2, float eps,
                            float alpha) = 0;
  virtual void muon_momentum(float* B, float* D, const float* G, size_t n, float mu) = 0;
  virtual double axpy_sumsq(float* w, const float* x, size_t n, float alpha) = 0;
  // Muon's orthogonalization of one row-major [rows, cols] matrix, in place (normalization + the 5
  // Newton-Schulz steps); the backend owns the workspace.
  virtual void newton_schulz5(float* X, int rows, int cols) = 0;
};

// The CPU backend. `threads` <= 0: all cores. Sets the OpenMP and OpenBLAS thread counts.
std::unique_ptr<Backend> make_cpu_backend(int threads);
// The number of threads the CPU backend runs with.
int cpu_threads();

// The CUDA backend (backend/cuda, docs/cuda.md): pointers are device pointers. Fails with one
// clear line when this build has no CUDA, no device is found, or it is older than sm_80.
std::unique_ptr<Backend> make_cuda_backend(bool tf32 = false);
// Checks run.device before a model is built: "cpu" passes; "cuda" probes the device (the errors
// above), then fails, because the model does not run on device memory yet (docs/cuda.md).
void check_run_device(const std::string& device);

}  // namespace ladder
