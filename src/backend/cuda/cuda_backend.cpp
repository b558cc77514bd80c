// CudaBackend: the op interface on the GPU. Kernels live in ops.cu and attention.cu, GEMMs in
// lt_gemm.cpp; this file owns the stream, the scratch buffers and the error reporting.
#include "backend/cuda/cuda_backend.h"

#include <cmath>
#include <cstdlib>
#include <map>
#include <tuple>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_memory.h"
#include "backend/cuda/kernels.cuh"
#include "backend/cuda/lt_gemm.h"
#include "backend/cuda/moe_ops.cuh"

namespace ladder {
namespace cuda {

namespace {

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::string(v) != "0";
}

std::string probe_error() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return fmt::format("--device cuda: no CUDA device found (cudaGetDeviceCount: {})", cudaGetErrorString(e));
  }
  if (count == 0) return "--device cuda: no CUDA device found (cudaGetDeviceCount: 0 devices)";
  cudaDeviceProp prop{};
  const cudaError_t ep = cudaGetDeviceProperties(&prop, 0);
  if (ep != cudaSuccess)
    return fmt::format("--device cuda: cannot read device 0 (cudaGetDeviceProperties: {})", cudaGetErrorString(ep));
  if (prop.major < 8)
    return fmt::format("--device cuda: {} has compute capability {}.{}; the CUDA backend needs 8.0 or newer "
                       "(A100, H100, H200, ...)", prop.name, prop.major, prop.minor);
  // Does this binary carry code the device can run? (sm_80/sm_90 machine code and their PTX.)
  cudaFuncAttributes attr{};
  const cudaError_t ef = k::probe_kernel_attributes(&attr);
  if (ef != cudaSuccess) {
    (void)cudaGetLastError();
    return fmt::format("--device cuda: this build has no kernels for {} (sm_{}{}): {}; rebuild with "
                       "-DCMAKE_CUDA_ARCHITECTURES={}{}", prop.name, prop.major, prop.minor, cudaGetErrorString(ef),
                       prop.major, prop.minor);
  }
  return "";
}

class CudaBackendImpl final : public CudaBackend {
 public:
  CudaBackendImpl(const DeviceInfo& info, CudaOptions opt) : info_(info), opt_(opt) {
    LADDER_CUDA_CHECK(cudaSetDevice(info.index));
    // A blocking stream: the synchronous copies of device_memory.h (legacy default stream) order
    // with it, so host code can copy results without an explicit synchronize.
    LADDER_CUDA_CHECK(cudaStreamCreate(&st_));
    gemm_ = std::make_unique<LtGemm>(st_);
    sums_ = DeviceBuffer<double>(2, "reduction result");
    LADDER_CUDA_CHECK(cudaMallocHost(&host_sums_, 2 * sizeof(double)));
    sync_each_ = env_flag("LADDER_CUDA_SYNC");
  }
  ~CudaBackendImpl() override {
    gemm_.reset();
    if (host_sums_) cudaFreeHost(host_sums_);
    if (st_) cudaStreamDestroy(st_);
  }

  std::string name() const override { return opt_.tf32 ? "cuda-tf32" : "cuda"; }
  cudaStream_t stream() const override { return st_; }
  const DeviceInfo& device() const override { return info_; }
  bool tf32() const override { return opt_.tf32; }
  void synchronize() override { LADDER_CUDA_CHECK(cudaStreamSynchronize(st_)); }

  // Device memory. Copies go on the backend's stream (ordered with the ops); download waits.
  bool is_host() const override { return false; }
  void* mem_alloc(size_t bytes, const char* what) override {
    if (bytes == 0) return nullptr;
    void* p = device_alloc(bytes, what);
    LADDER_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, st_));
    return p;
  }
  void mem_free(void* p) override {
    if (!p) return;
    synchronize();
    device_free(p);
  }
  void upload(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    // Synchronous with respect to the host buffer (pageable memory): the caller may reuse it at once.
    LADDER_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, st_));
    synchronize();
  }
  void download(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    LADDER_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, st_));
    synchronize();
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (!bytes || dst == src) return;
    LADDER_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st_));
    post("copy");
  }
  void zero(void* p, size_t bytes) override {
    if (!bytes) return;
    LADDER_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, st_));
    post("zero");
  }

  void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
            float beta, float* C, int ldc) override {
    gemm_->run(opt_.tf32 ? GemmType::TF32 : GemmType::F32, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    post("gemm");
  }

  void embedding_forward(float* out, const float* table, const int32_t* ids, int N, int D) override {
    check(k::embedding_forward(out, table, ids, N, D, st_), "embedding_forward");
  }
  void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int N, int D) override {
    const size_t need = k::embedding_backward_scratch_bytes(N);
    emb_scratch_.reserve(need, "embedding backward scratch");
    check(k::embedding_backward(dtable, dout, ids, N, D, emb_scratch_.data(), emb_scratch_.bytes(), st_),
          "embedding_backward");
  }

  void rmsnorm_forward(float* y, float* rstd, const float* x, const float* gain, int N, int D, float eps) override {
    check(k::rmsnorm_forward(y, rstd, x, gain, N, D, eps, st_), "rmsnorm_forward");
  }
  void rmsnorm_backward(float* dx, float* dgain, const float* dy, const float* x, const float* gain,
                        const float* rstd, int N, int D, bool acc) override {
    float_scratch_.reserve(k::rmsnorm_backward_scratch_floats(N, D), "rmsnorm backward scratch");
    check(k::rmsnorm_backward(dx, dgain, dy, x, gain, rstd, N, D, acc, float_scratch_.data(), st_),
          "rmsnorm_backward");
  }

  void rope_forward(float* x, int N_tok, int S, int nh, int hd, int rot, float theta) override {
    check(k::rope_apply(x, rope_table(S, rot, theta), N_tok, S, nh, hd, rot, 1.f, st_), "rope_forward");
  }
  void rope_backward(float* dx, int N_tok, int S, int nh, int hd, int rot, float theta) override {
    check(k::rope_apply(dx, rope_table(S, rot, theta), N_tok, S, nh, hd, rot, -1.f, st_), "rope_backward");
  }

  void attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                         const AttnShape& s) override {
    check_attn(s);
    check(k::attention_forward(o, lse, q, k, v, s, st_), "attention_forward");
  }
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                          const float* v, const float* o, const float* lse, const AttnShape& s) override {
    check_attn(s);
    float_scratch_.reserve(k::attention_backward_scratch_floats(s), "attention backward scratch");
    check(k::attention_backward(dq, dk, dv, dout, q, k, v, o, lse, s, float_scratch_.data(), st_),
          "attention_backward");
  }

  void swiglu_forward(float* h, const float* g, const float* u, size_t n) override {
    check(k::swiglu_forward(h, g, u, n, st_), "swiglu_forward");
  }
  void swiglu_backward(float* dg, float* du, const float* dh, const float* g, const float* u, size_t n) override {
    check(k::swiglu_backward(dg, du, dh, g, u, n, st_), "swiglu_backward");
  }

  XentSums softmax_xent(float* logits, const int32_t* t, int N, int V, float z, float gs) override {
    softmax_xent_async(logits, t, N, V, z, gs, sums_.data());
    return fetch_sums();
  }
  XentSums softmax_xent_forward(const float* logits, const int32_t* t, int N, int V, float* losses) override {
    softmax_xent_forward_async(logits, t, N, V, losses, sums_.data());
    return fetch_sums();
  }
  void softmax_xent_async(float* logits, const int32_t* t, int N, int V, float z, float gs,
                          double* d_sums) override {
    row_sums_.reserve(2 * size_t(N > 0 ? N : 1), "cross-entropy row sums");
    check(k::softmax_xent(logits, t, N, V, z, gs, row_sums_.data(), st_), "softmax_xent");
    check(k::reduce_pairs(row_sums_.data(), N, d_sums, st_), "softmax_xent (sums)");
  }
  void softmax_xent_forward_async(const float* logits, const int32_t* t, int N, int V, float* losses,
                                  double* d_sums) override {
    row_sums_.reserve(2 * size_t(N > 0 ? N : 1), "cross-entropy row sums");
    check(k::softmax_xent_forward(logits, t, N, V, losses, row_sums_.data(), st_), "softmax_xent_forward");
    check(k::reduce_pairs(row_sums_.data(), N, d_sums, st_), "softmax_xent_forward (sums)");
  }

  void add_inplace(float* y, const float* x, size_t n) override { check(k::add_inplace(y, x, n, st_), "add_inplace"); }
  void scale_inplace(float* x, float s, size_t n) override { check(k::scale_inplace(x, s, n, st_), "scale_inplace"); }
  double sum_squares(const float* x, size_t n) override {
    sum_squares_async(x, n, sums_.data());
    LADDER_CUDA_CHECK(cudaMemcpyAsync(host_sums_, sums_.data(), sizeof(double), cudaMemcpyDeviceToHost, st_));
    synchronize();
    return host_sums_[0];
  }
  void sum_squares_async(const float* x, size_t n, double* d_out) override {
    ssq_scratch_.reserve(k::sum_squares_scratch_doubles(), "sum of squares scratch");
    check(k::sum_squares(x, n, d_out, ssq_scratch_.data(), st_), "sum_squares");
  }
  void adamw_update(float* p, const float* g, float* m, float* v, size_t n, float lr, float b1, float b2, float eps,
                    float wd, float bc1, float bc2) override {
    check(k::adamw_update(p, g, m, v, n, lr, b1, b2, eps, wd, bc1, bc2, st_), "adamw_update");
  }

  // Ops the CPU backend gained with the MoE, attention-switch and optimizer work (issues 3, 4, 7)
  // have no CUDA kernels yet (docs/cuda.md, "remaining plan"). They fail loudly rather than fall back
  // to anything: the model is not wired to this backend yet either (check_run_device refuses).
  [[noreturn]] static void missing(const char* op) {
    fail("--device cuda: the CUDA backend has no kernel for '{}' yet (see docs/cuda.md)", op);
  }
  // MoE dispatch and the grouped GEMM (moe_ops.cu). Offsets stay on the device; nothing here waits.
  void grouped_gemm(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K, float alpha,
                    const float* A, int lda, const float* B, int ldb, size_t strideB, float beta, float* C, int ldc,
                    size_t strideC) override {
    // fp32 CUDA-core kernel even when tf32 is on: exact fp32 is the goal here (docs/cuda.md).
    moe_tiles_.reserve(k::grouped_gemm_scratch_ints(E), "grouped gemm tile prefix");
    check(k::grouped_gemm(rows_out, transB, E, offsets, M, N, K, alpha, A, lda, B, ldb, strideB, beta, C, ldc,
                          strideC, moe_tiles_.data(), st_),
          "grouped_gemm");
  }
  void pko_resets(uint8_t* reset, const int32_t* ids, int N_tok, int S, int eod_id) override {
    if (N_tok > 0 && S < 1) fail("pko_resets: sequence length must be >= 1 (got {})", S);
    check(k::pko_resets(reset, ids, N_tok, S, eod_id, st_), "pko_resets");
  }
  void pko_shift_forward(float*, const float*, const uint8_t*, int, int, int, int) override { missing("pko_shift"); }
  void pko_shift_backward(float*, const float*, const uint8_t*, int, int, int, int) override { missing("pko_shift"); }
  void xsa_forward(float*, const float*, const float*, int, int, int, int) override { missing("xsa"); }
  void xsa_backward(float*, float*, const float*, const float*, const float*, int, int, int, int) override {
    missing("xsa");
  }
  void head_gate_forward(float*, float*, const float*, const float*, int, int, int) override { missing("head_gate"); }
  void head_gate_backward(float*, float*, const float*, const float*, const float*, int, int, int) override {
    missing("head_gate");
  }
  void silu_forward(float*, const float*, size_t) override { missing("silu"); }
  void silu_backward(float*, const float*, const float*, size_t) override { missing("silu"); }
  void sigmoid_gate_forward(float*, float*, const float*, size_t) override { missing("sigmoid_gate"); }
  void sigmoid_gate_backward(float*, float*, const float*, const float*, const float*, size_t, bool) override {
    missing("sigmoid_gate");
  }
  void moe_route(float* lse, int32_t* expert, float* comb, const float* logits, const float* bias, int N, int E,
                 int K, bool normalized, double route_scale) override {
    if (N > 0 && (K < 1 || K > E)) fail("moe_route: need 1 <= K <= E (K = {}, E = {})", K, E);
    check(k::moe_route(lse, expert, comb, logits, bias, N, E, K, normalized, route_scale, st_), "moe_route");
  }
  void moe_sort(int32_t* offsets, int32_t* row, int32_t* slot, const int32_t* expert, int NK, int E) override {
    if (E < 0 || (NK > 0 && E == 0)) fail("moe_sort: {} slots over {} experts", NK, E);
    moe_scratch_.reserve(k::moe_sort_scratch_bytes(NK, E), "moe sort scratch");
    check(k::moe_sort(offsets, row, slot, expert, NK, E, moe_scratch_.data(), moe_scratch_.bytes(), st_),
          "moe_sort");
  }
  void moe_gather(float* xs, const float* h, const int32_t* slot, int NK, int K, int d) override {
    check(k::moe_gather(xs, h, slot, NK, K, d, st_), "moe_gather");
  }
  void moe_combine(float* out, const float* y, const float* comb, const int32_t* row, int N, int K, int d) override {
    check(k::moe_combine(out, y, comb, row, N, K, d, st_), "moe_combine");
  }
  void moe_combine_backward(float* dy, float* dcomb, const float* dout, const float* y, const float* comb,
                            const int32_t* row, int N, int K, int d) override {
    check(k::moe_combine_backward(dy, dcomb, dout, y, comb, row, N, K, d, st_), "moe_combine_backward");
  }
  void moe_gather_backward(float* dh, const float* dx, const int32_t* row, int N, int K, int d) override {
    check(k::moe_gather_backward(dh, dx, row, N, K, d, st_), "moe_gather_backward");
  }
  void moe_router_backward(float* ds, const float* logits, const float* lse, const int32_t* expert,
                           const float* dcomb, int N, int E, int K, bool normalized, double route_scale,
                           float z_scale) override {
    check(k::moe_router_backward(ds, logits, lse, expert, dcomb, N, E, K, normalized, route_scale, z_scale, st_),
          "moe_router_backward");
  }
  void moe_balance_values(float* vals, const float* logits, const float* bias, int N, int E, int K) override {
    if (N > 0 && (K < 0 || K >= E)) fail("moe_balance_values: need K < E (K = {}, E = {})", K, E);
    check(k::moe_balance_values(vals, logits, bias, N, E, K, st_), "moe_balance_values");
  }
  void moe_quantile_beta(double* beta, const float* vals, int64_t T, int E, int K) override {
    if (E <= 0) return;
    if (T < 1 || T > INT32_MAX || K < 0 || K > E)
      fail("moe_quantile_beta: need 1 <= T <= 2^31-1 tokens and K <= E (T = {}, K = {}, E = {})", T, K, E);
    moe_scratch_.reserve(k::moe_quantile_beta_scratch_bytes(T, E), "moe quantile scratch");
    check(k::moe_quantile_beta(beta, vals, T, E, K, moe_scratch_.data(), moe_scratch_.bytes(), st_),
          "moe_quantile_beta");
  }
  void moe_count_load(int64_t* load, const int32_t* offsets, int E) override {
    check(k::moe_count_load(load, offsets, E, st_), "moe_count_load");
  }
  double adam_moments(float*, float*, const float*, size_t, float, float, float, float, float) override {
    missing("adam_moments");
  }
  double adam_apply(float*, const float*, const float*, size_t, float, float, float, float) override {
    missing("adam_apply");
  }
  void muon_momentum(float*, float*, const float*, size_t, float) override { missing("muon_momentum"); }
  double axpy_sumsq(float*, const float*, size_t, float) override { missing("axpy_sumsq"); }
  void newton_schulz5(float*, int, int) override { missing("newton_schulz5"); }

 private:
  void post(const char* op) {
    if (!sync_each_) return;
    const cudaError_t e = cudaStreamSynchronize(st_);
    if (e != cudaSuccess) fail_cuda(e, op, __FILE__, __LINE__);
  }
  void check(cudaError_t e, const char* op) {
    if (e != cudaSuccess) fail_cuda(e, op, __FILE__, __LINE__);
    post(op);
  }
  void check_attn(const AttnShape& s) {
    if (!k::attention_supported(s.hd))
      fail("attention on CUDA supports head_dim 1..128 (got {})", s.hd);
    if (s.KV <= 0 || s.H % s.KV != 0) fail("attention: n_heads {} is not a multiple of n_kv_heads {}", s.H, s.KV);
  }
  XentSums fetch_sums() {
    LADDER_CUDA_CHECK(cudaMemcpyAsync(host_sums_, sums_.data(), 2 * sizeof(double), cudaMemcpyDeviceToHost, st_));
    synchronize();
    return XentSums{host_sums_[0], host_sums_[1]};
  }
  // cos then sin, [S, rot/2] each, computed in double on the host exactly as the CPU kernels do and
  // uploaded once per (S, rot_dims, theta).
  const float* rope_table(int S, int rot, float theta) {
    const auto key = std::make_tuple(S, rot, double(theta));
    auto it = rope_.find(key);
    if (it != rope_.end()) return it->second.data();
    const int half = rot / 2;
    std::vector<float> tab(2 * size_t(S) * (half > 0 ? half : 0));
    for (int i = 0; i < half; ++i) {
      const double inv_freq = std::pow(double(theta), -2.0 * i / double(rot));
      for (int p = 0; p < S; ++p) {
        const double a = double(p) * inv_freq;
        tab[size_t(p) * half + i] = float(std::cos(a));
        tab[size_t(S) * half + size_t(p) * half + i] = float(std::sin(a));
      }
    }
    DeviceBuffer<float> buf(tab.size() ? tab.size() : 1, "rope table");
    if (!tab.empty()) buf.upload(tab);
    return rope_.emplace(key, std::move(buf)).first->second.data();
  }

  DeviceInfo info_;
  CudaOptions opt_;
  cudaStream_t st_ = nullptr;
  bool sync_each_ = false;
  std::unique_ptr<LtGemm> gemm_;
  DeviceBuffer<char> emb_scratch_;
  DeviceBuffer<float> float_scratch_;
  DeviceBuffer<double> row_sums_, sums_, ssq_scratch_;
  DeviceBuffer<char> moe_scratch_;      // moe_sort (CUB + keys), moe_quantile_beta (transposed keys)
  DeviceBuffer<int32_t> moe_tiles_;     // grouped_gemm: per-expert row-tile prefix [E+1]
  double* host_sums_ = nullptr;
  std::map<std::tuple<int, int, double>, DeviceBuffer<float>> rope_;
};

}  // namespace

std::string device_unavailable_reason() {
  try {
    return probe_error();
  } catch (...) {
    return "--device cuda: the CUDA runtime failed while probing the device";
  }
}

DeviceInfo probe_device() {
  const std::string err = probe_error();
  if (!err.empty()) throw Error(err);
  cudaDeviceProp prop{};
  LADDER_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  DeviceInfo d;
  d.index = 0;
  d.name = prop.name;
  d.cc_major = prop.major;
  d.cc_minor = prop.minor;
  d.sm_count = prop.multiProcessorCount;
  d.total_mem = prop.totalGlobalMem;
  return d;
}

std::unique_ptr<CudaBackend> make_backend(CudaOptions opt) {
  const DeviceInfo info = probe_device();
  if (env_flag("LADDER_CUDA_TF32")) opt.tf32 = true;
  return std::make_unique<CudaBackendImpl>(info, opt);
}

}  // namespace cuda

std::unique_ptr<Backend> make_cuda_backend(bool tf32) {
  cuda::CudaOptions opt;
  opt.tf32 = tf32;
  return cuda::make_backend(opt);
}

}  // namespace ladder
