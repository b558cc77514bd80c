#include "backend/cuda/lt_gemm.h"

#include <map>
#include <tuple>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_memory.h"
#include "backend/cuda/kernels.cuh"

namespace ladder::cuda {

namespace {

// The largest power of two (at most 256) dividing the address: cuBLASLt's heuristic otherwise
// assumes 256-byte-aligned operands, and the model passes views (heads, row blocks) into arenas.
uint32_t alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a == 0) return 256;
  const uintptr_t low = a & (~a + 1);
  return uint32_t(low < 256 ? low : 256);
}

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

// The alignment every matrix of a strided batch has: the base's, capped by the stride's (in bytes).
uint32_t batch_alignment(const void* p, int64_t stride, size_t elem, int batch) {
  const uint32_t a = alignment(p);
  if (batch <= 1) return a;
  const uint64_t s = uint64_t(stride) * elem;
  if (s == 0) return a;
  const uint64_t low = s & (~s + 1);
  return low < a ? uint32_t(low) : a;
}

// type, ta, tb, M, N, K, lda, ldb, ldc, c_bf16, alignments of A, B, C (the addend), D (the output),
// batch, strides of A, B, C.
using Key = std::tuple<int, bool, bool, int, int, int, int, int, int, bool, uint32_t, uint32_t, uint32_t, uint32_t, int,
                       int64_t, int64_t, int64_t>;

}  // namespace

struct LtGemm::Impl {
  cudaStream_t st;
  cublasLtHandle_t handle = nullptr;
  DeviceBuffer<char> workspace;
  std::map<Key, Plan> plans;

  ~Impl() {
    for (auto& [k, p] : plans) {
      cublasLtMatrixLayoutDestroy(p.a);
      cublasLtMatrixLayoutDestroy(p.b);
      cublasLtMatrixLayoutDestroy(p.c);
      cublasLtMatmulDescDestroy(p.op);
    }
    if (handle) cublasLtDestroy(handle);
  }

  const Plan& plan(GemmType type, bool ta, bool tb, int M, int N, int K, int lda, int ldb, int ldc, bool c_bf16,
                   const void* A, const void* B, const void* C, const void* D, int batch, int64_t sa, int64_t sb,
                   int64_t sc) {
    if (batch <= 1) batch = 1, sa = sb = sc = 0;  // one product: the plain plan
    const size_t in_bytes = type == GemmType::BF16 ? 2 : 4, out_bytes = (type == GemmType::BF16 && c_bf16) ? 2 : 4;
    const uint32_t al_a = batch_alignment(A, sa, in_bytes, batch), al_b = batch_alignment(B, sb, in_bytes, batch),
                   al_c = batch_alignment(C, sc, out_bytes, batch), al_d = batch_alignment(D, sc, out_bytes, batch);
    const Key key{int(type), ta, tb, M, N, K, lda, ldb, ldc, c_bf16, al_a, al_b, al_c, al_d, batch, sa, sb, sc};
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;

    const cublasComputeType_t compute = type == GemmType::TF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const cudaDataType_t in_t = type == GemmType::BF16 ? CUDA_R_16BF : CUDA_R_32F;
    const cudaDataType_t out_t = (type == GemmType::BF16 && c_bf16) ? CUDA_R_16BF : CUDA_R_32F;
    Plan p;
    LADDER_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, compute, CUDA_R_32F));
    // Column-major view: D^T[N,M] = opLt(B) * opLt(A), see the header.
    const cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    LADDER_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
    LADDER_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
    // Stored shapes (rows x cols, column-major, before the op).
    LADDER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, in_t, tb ? K : N, tb ? N : K, ldb));
    LADDER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, in_t, ta ? M : K, ta ? K : M, lda));
    LADDER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, out_t, N, M, ldc));
    if (batch > 1) {
      // Strided batch: the same count on every layout, each with its own stride (Lt's A is our B).
      const int32_t count = batch;
      const cublasLtMatrixLayout_t lays[3] = {p.a, p.b, p.c};
      const int64_t strides[3] = {sb, sa, sc};
      for (int i = 0; i < 3; ++i) {
        LADDER_CUBLAS_CHECK(
            cublasLtMatrixLayoutSetAttribute(lays[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
        LADDER_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(lays[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                             &strides[i], sizeof(strides[i])));
      }
    }

    cublasLtMatmulPreference_t pref = nullptr;
    LADDER_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = workspace.bytes();
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    // Lt's A is our B and vice versa.
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_b, sizeof(al_b));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_a, sizeof(al_a));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    const cublasStatus_t st_h =
        cublasLtMatmulAlgoGetHeuristic(handle, p.op, p.a, p.b, p.c, p.c, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st_h != CUBLAS_STATUS_SUCCESS || found == 0) {
      cublasLtMatrixLayoutDestroy(p.a);
      cublasLtMatrixLayoutDestroy(p.b);
      cublasLtMatrixLayoutDestroy(p.c);
      cublasLtMatmulDescDestroy(p.op);
      fail("cuBLASLt has no algorithm for gemm(ta={}, tb={}, M={}, N={}, K={}, lda={}, ldb={}, ldc={}, type={}, "
           "batch={}): {}",
           ta, tb, M, N, K, lda, ldb, ldc, int(type), batch, cublasLtGetStatusString(st_h));
    }
    p.algo = res.algo;
    return plans.emplace(key, p).first->second;
  }
};

LtGemm::LtGemm(cudaStream_t st, size_t workspace_bytes) : impl_(std::make_unique<Impl>()) {
  impl_->st = st;
  LADDER_CUBLAS_CHECK(cublasLtCreate(&impl_->handle));
  impl_->workspace = DeviceBuffer<char>(workspace_bytes, "cuBLASLt workspace");
}

LtGemm::~LtGemm() = default;

void LtGemm::run(GemmType type, bool ta, bool tb, int M, int N, int K, float alpha, const void* A, int lda,
                 const void* B, int ldb, float beta, void* C, int ldc, bool c_bf16, const void* C_in) {
  run_batched(type, ta, tb, M, N, K, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1, c_bf16, C_in);
}

void LtGemm::run_batched(GemmType type, bool ta, bool tb, int M, int N, int K, float alpha, const void* A, int lda,
                         int64_t stride_a, const void* B, int ldb, int64_t stride_b, float beta, void* C, int ldc,
                         int64_t stride_c, int batch, bool c_bf16, const void* C_in) {
  if (M <= 0 || N <= 0 || batch <= 0) return;
  if (!C_in) C_in = C;
  if (C_in != C && batch != 1) fail("internal error: a separate addend (C_in) with a batched gemm");
  if (K <= 0) {  // C = beta * C_in; cuBLASLt does not take k = 0
    if (type == GemmType::BF16 && c_bf16) fail("internal error: bf16-output gemm with K = 0");
    if (C_in != C && beta != 0.f)
      LADDER_CUDA_CHECK(cudaMemcpy2DAsync(C, size_t(ldc) * sizeof(float), C_in, size_t(ldc) * sizeof(float),
                                          size_t(N) * sizeof(float), size_t(M), cudaMemcpyDeviceToDevice, impl_->st));
    for (int i = 0; i < batch; ++i)
      LADDER_CUDA_CHECK(
          k::scale_matrix(static_cast<float*>(C) + size_t(i) * size_t(stride_c), M, N, ldc, beta, impl_->st));
    return;
  }
  const Plan& p =
      impl_->plan(type, ta, tb, M, N, K, lda, ldb, ldc, c_bf16, A, B, C_in, C, batch, stride_a, stride_b, stride_c);
  LADDER_CUBLAS_CHECK(cublasLtMatmul(impl_->handle, p.op, &alpha, B, p.a, A, p.b, &beta, C_in, p.c, C, p.c, &p.algo,
                                     impl_->workspace.data(), impl_->workspace.bytes(), impl_->st));
}

}  // namespace ladder::cuda
