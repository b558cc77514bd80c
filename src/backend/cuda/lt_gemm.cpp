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

using Key = std::tuple<int, bool, bool, int, int, int, int, int, int, bool, uint32_t, uint32_t, uint32_t, uint32_t>;

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
                   const void* A, const void* B, const void* C, const void* D) {
    const uint32_t al_a = alignment(A), al_b = alignment(B), al_c = alignment(C), al_d = alignment(D);
    const Key key{int(type), ta, tb, M, N, K, lda, ldb, ldc, c_bf16, al_a, al_b, al_c, al_d};
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
      fail("cuBLASLt has no algorithm for gemm(ta={}, tb={}, M={}, N={}, K={}, lda={}, ldb={}, ldc={}, type={}): {}",
           ta, tb, M, N, K, lda, ldb, ldc, int(type), cublasLtGetStatusString(st_h));
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
  if (M <= 0 || N <= 0) return;
  if (!C_in) C_in = C;
  if (K <= 0) {  // C = beta * C_in; cuBLASLt does not take k = 0
    if (type == GemmType::BF16 && c_bf16) fail("internal error: bf16-output gemm with K = 0");
    if (C_in != C && beta != 0.f)
      LADDER_CUDA_CHECK(cudaMemcpy2DAsync(C, size_t(ldc) * sizeof(float), C_in, size_t(ldc) * sizeof(float),
                                          size_t(N) * sizeof(float), size_t(M), cudaMemcpyDeviceToDevice, impl_->st));
    LADDER_CUDA_CHECK(k::scale_matrix(static_cast<float*>(C), M, N, ldc, beta, impl_->st));
    return;
  }
  const Plan& p = impl_->plan(type, ta, tb, M, N, K, lda, ldb, ldc, c_bf16, A, B, C_in, C);
  LADDER_CUBLAS_CHECK(cublasLtMatmul(impl_->handle, p.op, &alpha, B, p.a, A, p.b, &beta, C_in, p.c, C, p.c, &p.algo,
                                     impl_->workspace.data(), impl_->workspace.bytes(), impl_->st));
}

}  // namespace ladder::cuda
