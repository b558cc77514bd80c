// LtGemm (lt_gemm.h) for the host emulation of the whole CUDA backend (ladder_emu_backend_tests):
// cpu::gemm<float> in place of cuBLASLt, with the operands rounded the way the device's compute type
// sees them, so the backend's GEMM wiring (transposes, leading dimensions, offsets, scratch) is
// checked against the same contract (cpu::gemm's), and the tests' TF32 and bf16 tolerances see a
// real rounding error. Not emulated: cuBLASLt's own summation order and its
// algorithm choice; K = 0 goes through k::scale_matrix as in lt_gemm.cpp. Strided batches run as a
// loop over the batch (the batch attributes are cuBLASLt's business, not emulated).
#include <cstring>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.cuh"
#include "backend/cuda/lt_gemm.h"
#include "core/error.h"

namespace ladder::cuda {

namespace {
// TF32: 10 explicit mantissa bits, round to nearest even (what cuBLAS's TF32 conversion does).
float tf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0xFFFu + ((u >> 13) & 1u)) & ~0x1FFFu;
  std::memcpy(&x, &u, 4);
  return x;
}
// bf16 <-> fp32 as the CPU backend converts (round to nearest even; cuBLASLt's bf16 output does too).
using cpu::bf16_bits;
using cpu::bf16_value;
// A strided operand of `rows` rows, `cols` used columns, leading dimension ld, as fp32.
template <class Src, class F>
std::vector<float> widen(const void* p, int rows, int cols, int ld, F f) {
  const size_t n = rows > 0 && cols > 0 ? size_t(rows - 1) * ld + cols : 0;
  std::vector<float> v(n);
  const Src* s = static_cast<const Src*>(p);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) v[size_t(r) * ld + c] = f(s[size_t(r) * ld + c]);
  return v;
}
}  // namespace

struct LtGemm::Impl {
  cudaStream_t st;
};

LtGemm::LtGemm(cudaStream_t st, size_t) : impl_(std::make_unique<Impl>(Impl{st})) {}
LtGemm::~LtGemm() = default;

void LtGemm::run(GemmType type, bool ta, bool tb, int M, int N, int K, float alpha, const void* A, int lda,
                 const void* B, int ldb, float beta, void* C, int ldc, bool c_bf16, const void* C_in) {
  if (M <= 0 || N <= 0) return;
  // A separate addend (C_in): copied into C first, then the in-place contract below.
  if (C_in && C_in != C && beta != 0.f) {
    const size_t es = c_bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int i = 0; i < M; ++i)
      std::memcpy(static_cast<char*>(C) + size_t(i) * ldc * es, static_cast<const char*>(C_in) + size_t(i) * ldc * es,
                  size_t(N) * es);
  }
  if (K <= 0) {
    if (type == GemmType::BF16 && c_bf16) fail("internal error: bf16-output gemm with K = 0");
    LADDER_CUDA_CHECK(k::scale_matrix(static_cast<float*>(C), M, N, ldc, beta, impl_->st));
    return;
  }
  if (c_bf16 && type != GemmType::BF16) fail("internal error: bf16 output needs bf16 operands");
  const int ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
  std::vector<float> a, b;
  if (type == GemmType::BF16) {
    a = widen<uint16_t>(A, ar, ac, lda, bf16_value);
    b = widen<uint16_t>(B, br, bc, ldb, bf16_value);
  } else {
    const bool t = type == GemmType::TF32;
    auto f = [t](float x) { return t ? tf32(x) : x; };
    a = widen<float>(A, ar, ac, lda, f);
    b = widen<float>(B, br, bc, ldb, f);
  }
  if (!c_bf16) {
    cpu::gemm<float>(ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, static_cast<float*>(C), ldc);
    return;
  }
  uint16_t* c16 = static_cast<uint16_t*>(C);
  std::vector<float> c(size_t(M) * N, 0.f);
  if (beta != 0.f)
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) c[size_t(i) * N + j] = bf16_value(c16[size_t(i) * ldc + j]);
  cpu::gemm<float>(ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), N);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) c16[size_t(i) * ldc + j] = bf16_bits(c[size_t(i) * N + j]);
}

// The strided batch as a loop of run()s: each product is checked against cpu::gemm's contract at
// its own offset, which is what cuBLASLt's batch attributes (lt_gemm.cpp) promise.
void LtGemm::run_batched(GemmType type, bool ta, bool tb, int M, int N, int K, float alpha, const void* A, int lda,
                         int64_t stride_a, const void* B, int ldb, int64_t stride_b, float beta, void* C, int ldc,
                         int64_t stride_c, int batch, bool c_bf16, const void* C_in) {
  if (C_in && C_in != C && batch != 1) fail("internal error: a separate addend (C_in) with a batched gemm");
  if (batch == 1) return run(type, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, c_bf16, C_in);
  const size_t in_bytes = type == GemmType::BF16 ? 2 : 4, out_bytes = c_bf16 ? 2 : 4;
  for (int i = 0; i < batch; ++i)
    run(type, ta, tb, M, N, K, alpha, static_cast<const char*>(A) + size_t(i) * size_t(stride_a) * in_bytes, lda,
        static_cast<const char*>(B) + size_t(i) * size_t(stride_b) * in_bytes, ldb, beta,
        static_cast<char*>(C) + size_t(i) * size_t(stride_c) * out_bytes, ldc, c_bf16);
}

}  // namespace ladder::cuda
