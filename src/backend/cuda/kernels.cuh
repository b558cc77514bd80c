// Launchers of the CUDA kernels (ops.cu, attention.cu). Plain C++ declarations so that the backend
// (cuda_backend.cpp, compiled by the host compiler) can call them. Each launcher enqueues its
// kernels on `st` and returns cudaGetLastError() after the launches (launch errors only: faults
// inside a kernel surface at the next synchronizing call). Pointers are device pointers; shapes and
// conventions are those of backend/cpu/kernels.h, which the GPU tests hold them to.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cpu/kernels.h"

namespace ladder::cuda::k {

cudaError_t embedding_forward(float* out, const float* table, const int32_t* ids, int N, int D, cudaStream_t st);
// Deterministic: a stable radix sort of the ids groups equal ids in token order, then one block per
// distinct id adds its rows in that order (the CPU's order, so the result is bitwise the CPU's).
// `scratch` must hold embedding_backward_scratch_bytes(N) bytes.
size_t embedding_backward_scratch_bytes(int N);
cudaError_t embedding_backward(float* dtable, const float* dout, const int32_t* ids, int N, int D, void* scratch,
                               size_t scratch_bytes, cudaStream_t st);

cudaError_t rmsnorm_forward(float* y, float* rstd, const float* x, const float* gain, int N, int D, float eps,
                            cudaStream_t st);
// model.norm_bf16: y as bf16 bits, the fp32 kernel's result rounded to nearest even.
cudaError_t rmsnorm_forward_bf16(uint16_t* y, float* rstd, const float* x, const float* gain, int N, int D, float eps,
                                 cudaStream_t st);
// dgain is a sum over rows: partial sums over fixed chunks of rows, then summed in chunk order
// (deterministic). `scratch` must hold rmsnorm_backward_scratch_floats(N, D) floats.
size_t rmsnorm_backward_scratch_floats(int N, int D);
cudaError_t rmsnorm_backward(float* dx, float* dgain, const float* dy, const float* x, const float* gain,
                             const float* rstd, int N, int D, bool accumulate_dx, float* scratch, cudaStream_t st);

// cos_sin: [S, rot_dims/2] cos then [S, rot_dims/2] sin (built by the caller in double, as the CPU
// does). sign +1 forward, -1 backward (inverse rotation).
cudaError_t rope_apply(float* x, const float* cos_sin, int N_tok, int S, int nheads, int hd, int rot_dims,
                       float sign, cudaStream_t st);

cudaError_t swiglu_forward(float* h, const float* g, const float* u, size_t n, cudaStream_t st);
cudaError_t swiglu_backward(float* dg, float* du, const float* dh, const float* g, const float* u, size_t n,
                            cudaStream_t st);
// model.mlp_bf16: SwiGLU on bf16 gate / up (uint16_t bits) in fp32; h rounded to bf16, dg / du fp32.
cudaError_t swiglu_forward_bf16(uint16_t* h, const uint16_t* g, const uint16_t* u, size_t n, cudaStream_t st);
cudaError_t swiglu_backward_bf16(float* dg, float* du, const float* dh, const uint16_t* g, const uint16_t* u,
                                 size_t n, cudaStream_t st);
// model.moe_bf16_grads: swiglu_backward_bf16 with dh, dg and du bf16 bits as well (dg / du rounded).
cudaError_t swiglu_backward_bf16_grads(uint16_t* dg, uint16_t* du, const uint16_t* dh, const uint16_t* g,
                                       const uint16_t* u, size_t n, cudaStream_t st);
// Backend::swiglu_forward_rows / swiglu_backward_rows: the ops above (h16: g, u, h bf16 bits; d16: dh,
// dg, du too, which needs h16) on the first min(rows, *rows_used) rows of [rows, cols] tensors,
// rows_used one int32 in device memory read by the kernels (the grid is sized by rows * cols, so
// nothing waits for the host); the elements past them are not touched. cudaErrorInvalidValue for a
// null rows_used or d16 without h16.
cudaError_t swiglu_forward_rows(void* h, const void* g, const void* u, bool h16, int64_t rows, int cols,
                                const int32_t* rows_used, cudaStream_t st);
cudaError_t swiglu_backward_rows(void* dg, void* du, const void* dh, const void* g, const void* u, bool h16, bool d16,
                                 int64_t rows, int cols, const int32_t* rows_used, cudaStream_t st);

// Softmax cross-entropy with z-loss, in place (see cpu::softmax_xent). Per-row (xent, lse^2) go to
// row_sums [2N] doubles; then reduce_pairs sums them in a fixed order into sums[2] on the device.
cudaError_t softmax_xent(float* logits, const int32_t* targets, int N, int V, float z_coef, float grad_scale,
                         double* row_sums, cudaStream_t st);
cudaError_t softmax_xent_forward(const float* logits, const int32_t* targets, int N, int V, float* losses,
                                 double* row_sums, cudaStream_t st);
cudaError_t reduce_pairs(const double* row_sums, int N, double* sums, cudaStream_t st);

cudaError_t add_inplace(float* y, const float* x, size_t n, cudaStream_t st);
cudaError_t scale_inplace(float* x, float s, size_t n, cudaStream_t st);
// Deterministic (fixed grid whatever the device): sum of squares in double into *out (device).
// `scratch` must hold sum_squares_scratch_doubles() doubles.
size_t sum_squares_scratch_doubles();
cudaError_t sum_squares(const float* x, size_t n, double* out, double* scratch, cudaStream_t st);
cudaError_t adamw_update(float* p, const float* g, float* m, float* v, size_t n, float lr, float b1, float b2,
                         float eps, float wd, float bc1, float bc2, cudaStream_t st);
// C = beta * C for the K == 0 corner of GEMM (beta == 0 writes zeros, never reads C).
cudaError_t scale_matrix(float* C, int M, int N, int ldc, float beta, cudaStream_t st);
// For benchmarks and the bf16 path: out[i] = bf16(in[i]) (round to nearest even); out is uint16_t storage.
cudaError_t f32_to_bf16(uint16_t* out, const float* in, size_t n, cudaStream_t st);
// out[i] = float(in[i]) for bf16 bits in (exact).
cudaError_t bf16_to_f32(float* out, const uint16_t* in, size_t n, cudaStream_t st);
// f32_to_bf16 over the first min(*rows, max_rows) rows of `cols` elements, *rows a device int
// (a grouped GEMM's offsets[E]: no host round trip for the row count).
cudaError_t f32_to_bf16_rows(uint16_t* out, const float* in, const int32_t* rows, size_t cols, size_t max_rows,
                             cudaStream_t st);
// The same for a strided [rows, cols] view (leading dimension ld >= cols) into a packed [rows, cols].
cudaError_t f32_to_bf16_2d(uint16_t* out, const float* in, int rows, int cols, int ld, cudaStream_t st);

// x[i] = uniform in [lo, hi) from a counter-based hash of (seed, i): random data on the device
// without a host round trip (benchmarks: never time on zeros).
cudaError_t fill_uniform(float* x, size_t n, uint64_t seed, float lo, float hi, cudaStream_t st);

// Whether this binary holds code the current device can run (cudaFuncGetAttributes on a kernel).
cudaError_t probe_kernel_attributes(cudaFuncAttributes* attr);

// Test hook: with `on`, the launchers of the memory-bound kernels that have a vectorized or
// register-resident fast path (swiglu, rmsnorm, the casts, add / scale, qk_prep, the MoE gather /
// combine) take their scalar reference path instead: the kernels as they were before the fast paths,
// one element per thread and step. The emulated tests run both and compare them bitwise. Host-side
// state read at launch; not thread-safe; off by default.
void set_reference_paths(bool on);
bool reference_paths();

// Flash-style attention, fp32 (attention.cu). Supports head_dim <= 128 (attention_supported).
bool attention_supported(int hd);
cudaError_t attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                              const cpu::AttnShape& s, cudaStream_t st);
// `scratch` holds attention_backward_scratch_floats(s) floats (D_i = dO_i . O_i per query row).
size_t attention_backward_scratch_floats(const cpu::AttnShape& s);
cudaError_t attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                               const float* v, const float* o, const float* lse, const cpu::AttnShape& s,
                               float* scratch, cudaStream_t st);
// model.attn_bf16: q, k, v and o as bf16 bits (uint16_t), lse, dout and the gradients fp32. The same
// kernels instantiated on bf16 storage: inputs widened exactly as they are loaded, the fp32
// arithmetic, o rounded to nearest even; the backward reads the bf16 o for D.
cudaError_t attention_forward_bf16(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                   const cpu::AttnShape& s, cudaStream_t st);
cudaError_t attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const uint16_t* q,
                                    const uint16_t* k, const uint16_t* v, const uint16_t* o, const float* lse,
                                    const cpu::AttnShape& s, float* scratch, cudaStream_t st);

}  // namespace ladder::cuda::k
