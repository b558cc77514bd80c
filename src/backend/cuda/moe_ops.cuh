// Launchers of the MoE dispatch kernels and of the device-side grouped GEMM (moe_ops.cu). Plain C++
// declarations, like kernels.cuh, so cuda_backend.cpp (host compiler) can call them. Each launcher
// enqueues its kernels on `st` and returns cudaGetLastError() after the launches (launch errors
// only: faults inside a kernel surface at the next synchronizing call).
//
// Every pointer is a device pointer, including the expert `offsets`: nothing here reads device
// memory back to the host, so a whole MoE block runs without a host synchronization. Contracts are
// the CPU kernels' (backend/cpu/moe_kernels.h; grouped_gemm in backend/cpu/kernels.h), which the
// GPU tests (tests/cuda/test_cuda_moe.cpp) hold these to. Callers validate shapes (K <= E, ...).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ladder::cuda::k {

// Grouped GEMM over the E expert row blocks [offsets[e], offsets[e+1]) (cpu::grouped_gemm):
//  rows_out = true:  C[rows_e, :N] = alpha * A[rows_e, :K] * op(B_e) + beta * C[rows_e]
//  rows_out = false: C_e[M, N] = alpha * A[rows_e, :M]^T * B[rows_e, :N] + beta * C_e (transB unused)
// fp32 on the CUDA cores with fp32 accumulation; every output element is owned by one thread of one
// block and summed in increasing reduction index: deterministic, no atomics. `tile_scratch` holds
// grouped_gemm_scratch_ints(E) ints (per-expert tile prefix, rows_out = true only).
size_t grouped_gemm_scratch_ints(int E);
// tile_start[e] = sum over experts e' < e of ceil(rows_e' / tile_rows), tile_start[E] = the total
// (E + 1 ints, on the device, from the device-side offsets): how a grouped GEMM over row tiles of
// tile_rows rows maps its blocks to experts without the host seeing the routing. Both grouped GEMMs
// (this file's and grouped_gemm_tc.cu's) use it.
cudaError_t row_tile_prefix(int32_t* tile_start, const int32_t* offsets, int E, int tile_rows, cudaStream_t st);
cudaError_t grouped_gemm(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K, float alpha,
                         const float* A, int lda, const float* B, int ldb, size_t strideB, float beta, float* C,
                         int ldc, size_t strideC, int32_t* tile_scratch, cudaStream_t st);

// Routing: lse, top-K experts (ties to the lower index), combine weights (cpu::moe_route).
// Requires 1 <= K <= E.
cudaError_t moe_route(float* lse, int32_t* expert, float* comb, const float* logits, const float* bias, int N, int E,
                      int K, bool normalized, double route_scale, cudaStream_t st);

// Stable counting sort of the NK slots by expert (cpu::moe_sort, bit for bit): a CUB radix sort of
// (expert, slot) pairs over the bits E needs, offsets by binary search in the sorted experts.
// `scratch` holds moe_sort_scratch_bytes(NK, E) bytes. Experts must lie in [0, E).
size_t moe_sort_scratch_bytes(int NK, int E);
cudaError_t moe_sort(int32_t* offsets, int32_t* row, int32_t* slot, const int32_t* expert, int NK, int E,
                     void* scratch, size_t scratch_bytes, cudaStream_t st);

// The capacity layout of moe_sort's rows (cpu::moe_capacity, bit for bit): ov [E+2] the overflow
// prefix and the rows in use, cslot [R] each row's slot, -1 (padding) or -2 (unused), row [NK]
// overwritten with each slot's row. Three launches (a fill of cslot, a one-warp prefix, one thread
// per sorted row), nothing read back. Requires C >= 1 and E*C + ov[E] <= R (cpu::moe_capacity_rows
// gives the bound; E*C > R is cudaErrorInvalidValue).
cudaError_t moe_capacity(int32_t* row, int32_t* cslot, int32_t* ov, const int32_t* offsets, const int32_t* slot,
                         int NK, int E, int C, int R, cudaStream_t st);
// Zero the rows q < rows of x (cols elements each, packed; fp32, or bf16 bits when bf16) whose
// cslot[q] < 0 (cpu::moe_zero_rows).
cudaError_t moe_zero_rows(void* x, bool bf16, const int32_t* cslot, int rows, int cols, cudaStream_t st);
// xs[r] = h[slot[r] / K], rows of d; slot[r] == -1 gives a zero row (the capacity layout's padding,
// gathered through cslot), slot[r] < -1 leaves the row as it is (its unused rows).
cudaError_t moe_gather(float* xs, const float* h, const int32_t* slot, int NK, int K, int d, cudaStream_t st);
// moe_combine / moe_combine_backward with y as bf16 bits.
cudaError_t moe_combine_bf16(float* out, const uint16_t* y, const float* comb, const int32_t* row, int N, int K, int d,
                             cudaStream_t st);
cudaError_t moe_combine_backward_bf16(float* dy, float* dcomb, const float* dout, const uint16_t* y, const float* comb,
                                      const int32_t* row, int N, int K, int d, cudaStream_t st);
// moe_combine_backward_bf16 with dy as bf16 bits (rounded to nearest even; model.moe_bf16_grads).
cudaError_t moe_combine_backward_bf16_grads(uint16_t* dy, float* dcomb, const float* dout, const uint16_t* y,
                                            const float* comb, const int32_t* row, int N, int K, int d,
                                            cudaStream_t st);
// The same with each element rounded to bf16 (nearest even): xs holds bf16 bits.
cudaError_t moe_gather_bf16(uint16_t* xs, const float* h, const int32_t* slot, int NK, int K, int d, cudaStream_t st);
cudaError_t moe_combine(float* out, const float* y, const float* comb, const int32_t* row, int N, int K, int d,
                        cudaStream_t st);
cudaError_t moe_combine_backward(float* dy, float* dcomb, const float* dout, const float* y, const float* comb,
                                 const int32_t* row, int N, int K, int d, cudaStream_t st);
cudaError_t moe_gather_backward(float* dh, const float* dx, const int32_t* row, int N, int K, int d, cudaStream_t st);
cudaError_t moe_router_backward(float* ds, const float* logits, const float* lse, const int32_t* expert,
                                const float* dcomb, int N, int E, int K, bool normalized, double route_scale,
                                float z_scale, cudaStream_t st);
// Requires K < E.
cudaError_t moe_balance_values(float* vals, const float* logits, const float* bias, int N, int E, int K,
                               cudaStream_t st);
// Exact q-th largest per column (a radix select on a transposed, order-preserving integer copy).
// beta [E] doubles. Requires 1 <= T <= INT32_MAX and K <= E. `scratch` holds
// moe_quantile_beta_scratch_bytes(T, E) bytes: the keys of as many columns as fit in 64 MiB (at
// least one), processed chunk after chunk.
size_t moe_quantile_beta_scratch_bytes(int64_t T, int E);
cudaError_t moe_quantile_beta(double* beta, const float* vals, int64_t T, int E, int K, void* scratch,
                              size_t scratch_bytes, cudaStream_t st);
// One thread: the CPU's expert-order double sum, so the bias is bitwise the CPU's.
cudaError_t moe_balance_bias(float* bias, const double* beta, int E, cudaStream_t st);
cudaError_t moe_count_load(int64_t* load, const int32_t* offsets, int E, cudaStream_t st);
// Requires S >= 1.
cudaError_t pko_resets(uint8_t* reset, const int32_t* ids, int N_tok, int S, int eod_id, cudaStream_t st);

}  // namespace ladder::cuda::k
