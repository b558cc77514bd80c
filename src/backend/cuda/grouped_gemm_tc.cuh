// Launchers of the bf16 tensor-core grouped GEMM (grouped_gemm_tc.cu). Plain C++ declarations, like
// moe_ops.cuh, so cuda_backend.cpp (host compiler) can call them. Each launcher enqueues its kernels
// on `st` and returns the first error of its cudaFuncSetAttribute call (the kernels take 60 KiB of
// dynamic shared memory) or cudaGetLastError() after the launches (launch errors only).
//
// Same contract and arguments as k::grouped_gemm (moe_ops.cuh, cpu::grouped_gemm in
// backend/cpu/kernels.h), over the E expert row blocks [offsets[e], offsets[e+1]):
//  rows_out = true:  C[rows_e, :N] = alpha * A[rows_e, :K] * op(B_e) + beta * C[rows_e]
//  rows_out = false: C_e[M, N] = alpha * A[rows_e, :M]^T * B[rows_e, :N] + beta * C_e (transB unused)
// with one difference in precision: the fp32 operands are rounded to bf16 (nearest even) on their
// way into shared memory and multiplied on the tensor cores (bf16 inputs, fp32 accumulation: mma.sync
// m16n8k16, or WMMA 16x16x16, grouped_gemm_tc_set_mma below).
// Every output element is computed by one block in an order fixed by the problem shape (never by
// the grid): bitwise reproducible run to run, no atomics. `offsets` stay on the device: nothing here
// synchronizes with the host. beta == 0 never reads C. Any sizes, leading dimensions and
// alignments (16-byte vector loads only where the operand allows them).
//
// `tile_scratch`: grouped_gemm_tc_scratch_ints(E) device ints (the per-expert row-tile prefix of
// the rows_out shape). `sm_count`: the device's multiprocessor count (DeviceInfo::sm_count); it only
// sizes the persistent grid of the rows_out shape (results do not depend on it); <= 0 assumes 132.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ladder::cuda::k {

// Which implementation of the tile product the launchers run: mma.sync m16n8k16 with ldmatrix
// (true, the default) or the WMMA API (false; kept to compare with on a GPU). Both give results
// within the bounds above and deterministic as described; their bits may differ from each other.
// The starting value comes from the environment: LADDER_GROUPED_MMA unset or 1 = mma.sync, 0 = WMMA.
// Not thread-safe: set it before launching.
bool grouped_gemm_tc_mma();
void grouped_gemm_tc_set_mma(bool mma);

// The wgmma (Hopper sm_90a) implementation, grouped_gemm_wgmma.cu: off by default; starts from
// LADDER_GROUPED_WGMMA (1 = on). When on, every call runs it where the device and build have
// sm_90a code (grouped_gemm_wgmma_available); elsewhere the mma.sync / WMMA kernels run as before.
// Same contract and bounds; its bits may differ from theirs. Not thread-safe: set it before launching.
bool grouped_gemm_tc_wgmma();
void grouped_gemm_tc_set_wgmma(bool wgmma);

size_t grouped_gemm_tc_scratch_ints(int E);
cudaError_t grouped_gemm_tc(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K,
                            float alpha, const float* A, int lda, const float* B, int ldb, size_t strideB, float beta,
                            float* C, int ldc, size_t strideC, int32_t* tile_scratch, int sm_count, cudaStream_t st);
// The same with each operand fp32 or bf16 (a_bf16 / b_bf16: A / B point at bf16 bits, already
// rounded; the kernel's rounding of them is then exact, so an operand given as its bf16 rounding
// gives bitwise the result of giving it in fp32). What bf16 saves is half the operand's loads:
// the backend passes the expert weights' bf16 mirror. c_bf16: C is bf16 bits, each element the
// fp32 result rounded to nearest even (needs beta == 0: C is never read).
cudaError_t grouped_gemm_tc_ex(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K,
                               float alpha, const void* A, bool a_bf16, int lda, const void* B, bool b_bf16, int ldb,
                               size_t strideB, float beta, void* C, bool c_bf16, int ldc, size_t strideC,
                               int32_t* tile_scratch, int sm_count, cudaStream_t st);

}  // namespace ladder::cuda::k
