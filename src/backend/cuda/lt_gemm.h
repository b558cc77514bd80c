// Row-major GEMM through cuBLASLt with the CPU kernel's contract (cpu::gemm):
//   C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C, leading dimensions lda/ldb/ldc.
// cuBLASLt is column-major; a row-major matrix is the column-major view of its transpose, so the
// product is computed as C^T = op(B)^T op(A)^T with A and B swapped (no copies).
//
// Types: F32 (fp32 in/out, fp32 arithmetic), TF32 (fp32 in/out, inputs rounded to tf32 on the
// tensor cores: about 1e-3 relative error instead of 1e-6), BF16 (A and B bf16, C fp32 or bf16,
// fp32 accumulation: the planned training path, docs/cuda.md).
//
// Plans (descriptors, layouts and the heuristic's algorithm) are cached per shape, transposes,
// pointer alignment and (strided batches) batch count and strides, so a training step's repeated
// shapes query the heuristic once.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace ladder::cuda {

enum class GemmType { F32, TF32, BF16 };

class LtGemm {
 public:
  // Workspace: 32 MiB, what NVIDIA recommends for Hopper's cuBLASLt kernels.
  explicit LtGemm(cudaStream_t st, size_t workspace_bytes = size_t(32) << 20);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // For BF16, A and B point to bf16 (uint16_t storage) and C is bf16 when c_bf16, else fp32.
  // C_in (same type and layout as C): when set, the addend beta * C is read from C_in and the result
  // written to C (cuBLASLt's separate C and D matrices), e.g. a residual add without a copy first.
  void run(GemmType type, bool ta, bool tb, int M, int N, int K, float alpha, const void* A, int lda,
           const void* B, int ldb, float beta, void* C, int ldc, bool c_bf16 = false, const void* C_in = nullptr);
  // `batch` independent products of the same shape in one launch (cuBLASLt's strided batch):
  // product i reads A + i * stride_a, B + i * stride_b and writes C + i * stride_c (strides in
  // elements of the operand's type). batch == 1 is run() (same plan, no batch attributes).
  // C_in as in run(), batch == 1 only.
  void run_batched(GemmType type, bool ta, bool tb, int M, int N, int K, float alpha, const void* A, int lda,
                   int64_t stride_a, const void* B, int ldb, int64_t stride_b, float beta, void* C, int ldc,
                   int64_t stride_c, int batch, bool c_bf16 = false, const void* C_in = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ladder::cuda
