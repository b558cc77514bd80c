// Launchers of the CUDA kernels for the recipe's attention switches (switch_ops.cu) and the recipe
// optimizers' element passes (optim_ops.cu). Plain C++ declarations, like kernels.cuh, so that the
// backend (cuda_backend.cpp, host compiler) can call them. Each launcher enqueues its kernels on `st`
// and returns cudaGetLastError() after the launches (launch errors only: faults inside a kernel
// surface at the next synchronizing call). Pointers are device pointers; shapes, conventions and
// aliasing rules are the CPU kernels' (backend/cpu/kernels.h, backend/cpu/optim_kernels.h), which
// the GPU tests (tests/cuda/test_cuda_switch_optim.cpp) hold them to. Sizes of 0 enqueue nothing,
// except the reductions, which still write their (zero) sum.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ladder::cuda::k {

// ---- attention switches (switch_ops.cu) --------------------------------------------------------

// Partial key offset: out = k except dims [from_dim, hd) of each head, which hold token t-1's (zero
// where reset[t] != 0 or t == 0). out must not alias k.
cudaError_t pko_shift_forward(float* out, const float* k, const uint8_t* reset, int N_tok, int nkv, int hd,
                              int from_dim, cudaStream_t st);
// The adjoint: dk (overwritten) from dout. dk must not alias dout.
cudaError_t pko_shift_backward(float* dk, const float* dout, const uint8_t* reset, int N_tok, int nkv, int hd,
                               int from_dim, cudaStream_t st);

// Queries / keys into attention in one pass per (token, head) row: RoPE(QK-norm(PKO shift)), the
// contract of cpu::qk_prep_forward. cos_sin: the backend's RoPE table for (S, rot_dims, theta) (cos
// then sin, [S, rot_dims/2] each). The row sum of squares is fp32 (a warp's shuffle tree), rstd in
// double from it. out must not alias x.
cudaError_t qk_prep_forward(float* out, float* rstd, const float* x, const float* gain, const uint8_t* reset,
                            const float* cos_sin, int N_tok, int S, int nheads, int hd, int rot_dims, bool norm,
                            float eps, cudaStream_t st);
// The adjoint (cpu::qk_prep_backward): dx overwritten, dgain += (when norm, gain and dgain) through
// per-chunk partials in `scratch` (qk_prep_backward_scratch_floats), added in chunk order. dx must
// not alias dout or x. With a gain gradient, hd is limited by shared memory
// (qk_prep_backward_supported: hd <= 1536).
size_t qk_prep_backward_scratch_floats(int N_tok, int nheads, int hd);
bool qk_prep_backward_supported(int hd);
cudaError_t qk_prep_backward(float* dx, float* dgain, const float* dout, const float* x, const float* gain,
                             const float* rstd, const uint8_t* reset, const float* cos_sin, int N_tok, int S,
                             int nheads, int hd, int rot_dims, bool norm, float* scratch, cudaStream_t st);

// Exclusive self attention. z may alias y.
cudaError_t xsa_forward(float* z, const float* y, const float* v, int N_tok, int H, int KV, int hd,
                        cudaStream_t st);
// dy, dv overwritten (dv sums the H/KV heads of its group in head order); dy may alias dz.
cudaError_t xsa_backward(float* dy, float* dv, const float* dz, const float* y, const float* v, int N_tok, int H,
                         int KV, int hd, cudaStream_t st);

// Per-head output gate: factor = 2 sigmoid(logit) [N_tok, H], out = x * factor. out may alias x.
cudaError_t head_gate_forward(float* out, float* factor, const float* x, const float* logit, int N_tok, int H,
                              int hd, cudaStream_t st);
// dx (may alias dout) and dlogit overwritten.
cudaError_t head_gate_backward(float* dx, float* dlogit, const float* dout, const float* x, const float* factor,
                               int N_tok, int H, int hd, cudaStream_t st);

// model.attn_bf16: the six ops above with their [tokens, heads * hd] activations as bf16 bits
// (uint16_t): x, out (qk prep), y, v, z (XSA), x, out (head gate). The same kernels, instantiated on
// bf16 storage: every bf16 input widened exactly, the fp32 arithmetic, bf16 outputs rounded to
// nearest even; rstd, factor and all gradients fp32. Same aliasing rules (z may alias y, out x,
// dy dz, dx dout).
cudaError_t qk_prep_forward_bf16(uint16_t* out, float* rstd, const uint16_t* x, const float* gain,
                                 const uint8_t* reset, const float* cos_sin, int N_tok, int S, int nheads, int hd,
                                 int rot_dims, bool norm, float eps, cudaStream_t st);
cudaError_t qk_prep_backward_bf16(float* dx, float* dgain, const float* dout, const uint16_t* x, const float* gain,
                                  const float* rstd, const uint8_t* reset, const float* cos_sin, int N_tok, int S,
                                  int nheads, int hd, int rot_dims, bool norm, float* scratch, cudaStream_t st);
cudaError_t xsa_forward_bf16(uint16_t* z, const uint16_t* y, const uint16_t* v, int N_tok, int H, int KV, int hd,
                             cudaStream_t st);
cudaError_t xsa_backward_bf16(float* dy, float* dv, const float* dz, const uint16_t* y, const uint16_t* v, int N_tok,
                              int H, int KV, int hd, cudaStream_t st);
cudaError_t head_gate_forward_bf16(uint16_t* out, float* factor, const uint16_t* x, const float* logit, int N_tok,
                                   int H, int hd, cudaStream_t st);
cudaError_t head_gate_backward_bf16(float* dx, float* dlogit, const float* dout, const uint16_t* x,
                                    const float* factor, int N_tok, int H, int hd, cudaStream_t st);

// GatedNorm's elementwise parts.
cudaError_t silu_forward(float* a, const float* u, size_t n, cudaStream_t st);
cudaError_t silu_backward(float* du, const float* da, const float* u, size_t n, cudaStream_t st);
cudaError_t sigmoid_gate_forward(float* y, float* g, const float* x, size_t n, cudaStream_t st);
// y as bf16 bits (GatedNorm's output under model.norm_bf16); the sigmoid g stays fp32.
cudaError_t sigmoid_gate_forward_bf16(uint16_t* y, float* g, const float* x, size_t n, cudaStream_t st);
cudaError_t sigmoid_gate_backward(float* dx, float* dg, const float* dy, const float* x, const float* s, size_t n,
                                  bool accumulate_dx, cudaStream_t st);

// ---- recipe optimizers (optim_ops.cu) ----------------------------------------------------------
//
// The three reductions run on a fixed grid (optim_reduce_blocks() blocks of 256 threads, whatever
// the device and n), each thread accumulating its grid-stride elements in double, then a tree in
// shared memory per block, then one block summing the per-block partials in a fixed tree: the same
// order every run. `partials` holds optim_reduce_blocks() doubles; the sum goes to *out (device).

int optim_reduce_blocks();

// m, v updated; *out = sum_i U_i^2 with U = (m/bc1) / (sqrt(v/bc2) + eps).
cudaError_t adam_moments(float* m, float* v, const float* g, size_t n, float b1, float b2, float bc1, float bc2,
                         float eps, double* out, double* partials, cudaStream_t st);
// w += alpha * U (U recomputed from m, v); *out = ||w||^2 after the update.
cudaError_t adam_apply(float* w, const float* m, const float* v, size_t n, float bc1, float bc2, float eps,
                       float alpha, double* out, double* partials, cudaStream_t st);
// B = mu B + G; D = G + mu B (new B), G read as G * *grad_factor where grad_factor (a device
// float) is given (the clip factor; cpu::muon_momentum's gscale).
cudaError_t muon_momentum(float* B, float* D, const float* G, size_t n, float mu, const float* grad_factor,
                          cudaStream_t st);
// w += alpha * x; *out = ||w||^2 after the update.
cudaError_t axpy_sumsq(float* w, const float* x, size_t n, float alpha, double* out, double* partials,
                       cudaStream_t st);

// Newton-Schulz pieces (the GEMMs go through LtGemm in the backend):
// y = x * float(1 / (sqrt(*sumsq) + 1e-8)), the scalar computed on the device in double from the
// device sum (no host round trip). y may alias x.
cudaError_t scale_by_inv_norm(float* y, const float* x, size_t n, const double* sumsq, cudaStream_t st);
// P = b A + a I for the m x m matrix A (row-major, contiguous): the first two terms of Newton-Schulz's
// polynomial a I + b A + c A^2; the backend's GEMM then adds c A A^T onto P.
cudaError_t ns_poly_init(float* P, const float* A, int m, float a, float b, cudaStream_t st);

// ---- optimizer steps without host waits (optim_ops.cu) ------------------------------------------
//
// Multi-tensor ops work on segments (one tensor for AdamW, one matrix for AdamH), each cut into
// chunks of optim_multi_chunk() elements, one 256-thread block per chunk. `block_seg[b]` names the
// segment of block b; a segment's blocks are [first_block, first_block + nblocks), consecutive.
// The partition depends only on the segment sizes, and a segment's sum is its chunks' partials
// summed in a fixed tree, so the per-matrix sums are bitwise reproducible run to run (no atomics).
struct OptSeg {
  float* w;
  const float* g;
  float* m;
  float* v;
  size_t n;             // elements of the segment
  const float* radius;  // AdamH: this matrix's R; nullptr for AdamW
  int group;            // index into the per-group scalars
  int first_block;
  int nblocks;          // ceil(n / optim_multi_chunk()), at least 1
  uint16_t* w16;        // the bf16 mirror of w (bits), written with the update's last pass; or nullptr
};
// Per-group scalars travel as kernel arguments (no upload per step); at most this many groups.
constexpr int kOptMaxGroups = 32;
struct OptGroupScalars {
  float lr[kOptMaxGroups];
  float wd[kOptMaxGroups];
};
struct OptGroupLr {
  double lr[kOptMaxGroups];
};

size_t optim_multi_chunk();
// Every segment: cpu::adamw_update's arithmetic with lr/wd of its group, g read as g * *grad_factor
// where grad_factor is given; where a segment has w16, the updated w rounded to bf16 (nearest even,
// as f32_to_bf16) is stored there too. One launch.
cudaError_t adamw_multi(const OptSeg* segs, const int* block_seg, int nblocks, const OptGroupScalars& gs, float b1,
                        float b2, float eps, float bc1, float bc2, const float* grad_factor, cudaStream_t st);
// AdamH over every segment (matrix), all scalars on the device:
//   moments (per-block partials of sum U^2) -> uu[s] = sum of partials, alpha[s] = float(-lr R / max(sqrt uu, 1e-10))
//   apply w += alpha U (partials of ||w||^2) -> ww[s], factor[s] = float(R / sqrt ww) -> w *= factor.
// partials: nblocks doubles; sums: 2 nseg doubles (uu then ww); scal: 2 nseg floats (alpha then factor).
// g read as g * *grad_factor where grad_factor is given; the last pass writes a segment's w16 too.
cudaError_t adamh_multi(const OptSeg* segs, int nseg, const int* block_seg, int nblocks, const OptGroupLr& glr,
                        float b1, float b2, float eps, float bc1, float bc2, const float* grad_factor, double* partials,
                        double* sums, float* scal, cudaStream_t st);
// sums[s] = ||g of segment s||^2 (double) for every segment (one per tensor): the chunks' partials
// (nblocks doubles) summed per segment in a fixed tree. Two launches.
cudaError_t sum_squares_multi(const OptSeg* segs, int nseg, const int* block_seg, int nblocks, double* partials,
                              double* sums, cudaStream_t st);
// MuonH's projection of one matrix: xx = ||D||^2, alpha = float(-lr R / max(sqrt xx, 1e-10)) with R = *radius,
// w += alpha D with ww = ||w||^2, w *= float(R / sqrt ww). sums: 2 doubles (xx, ww); partials as above.
cudaError_t muonh_apply(float* w, const float* D, size_t n, const float* radius, double lr, double* sums,
                        double* partials, cudaStream_t st);

// Batches of `count` equally shaped matrices of mn elements stored back to back (matrix i at
// x + i mn), for Muon over an [E, out, in] stack. Per-matrix sums by a segmented reduction: each
// matrix in batch_blocks_per_matrix(mn) chunks of optim_multi_chunk() elements, one block each, the
// chunks' partials summed per matrix in a fixed tree (bitwise reproducible, no atomics).
// `partials` holds count * batch_blocks_per_matrix(mn) doubles; sums are device memory.
int batch_blocks_per_matrix(size_t mn);
// sums[i] = ||matrix i||^2 (double).
cudaError_t batched_sum_squares(const float* x, size_t mn, int count, double* sums, double* partials,
                                cudaStream_t st);
// scale_by_inv_norm per matrix: y_i = x_i * float(1 / (sqrt(sumsq[i]) + 1e-8)). y may alias x.
cudaError_t batched_scale_by_inv_norm(float* y, const float* x, size_t mn, int count, const double* sumsq,
                                      cudaStream_t st);
// ns_poly_init on `count` m x m matrices back to back.
cudaError_t batched_ns_poly_init(float* P, const float* A, int m, int count, float a, float b, cudaStream_t st);
// muonh_apply on each matrix i (w + i mn, D + i mn, radius[i]) in five launches for the batch.
// sums: 2 count doubles (||D_i||^2, then ||w_i||^2 after the axpy). w16: where given, the bf16
// mirror of the batch's weights (count * mn values), written in the last pass (nearest even).
cudaError_t muonh_apply_batched(float* w, const float* D, size_t mn, int count, const float* radius, double lr,
                                double* sums, double* partials, uint16_t* w16, cudaStream_t st);
// w += alpha * x; w16 (or nullptr): w's bf16 mirror, written with it.
cudaError_t axpy(float* w, const float* x, size_t n, float alpha, uint16_t* w16, cudaStream_t st);
// *norm = sqrt(sums[0] + ... + sums[count-1]) (in index order), *factor = clip > 0 && norm > clip ?
// float(clip / (norm + 1e-6)) : 1.
cudaError_t grad_clip_factor(const double* sums, size_t count, double clip, double* norm, float* factor,
                             cudaStream_t st);

}  // namespace ladder::cuda::k
