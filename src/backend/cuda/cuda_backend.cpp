// CudaBackend: the op interface on the GPU. Kernels live in ops.cu and attention.cu, GEMMs in
// lt_gemm.cpp; this file owns the stream, the scratch buffers and the error reporting.
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "backend/cuda/attention_cudnn.h"
#include "backend/cuda/attention_tc.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_memory.h"
#include "backend/cuda/grouped_gemm_tc.cuh"
#include "backend/cuda/kernels.cuh"
#include "backend/cuda/lt_gemm.h"
#include "backend/cuda/switch_optim_ops.cuh"
#include "optim/optimizer.h"
#include "backend/cuda/moe_ops.cuh"
#include "backend/cuda/nccl_collectives.h"
#include "dist/comm.h"

namespace ladder {
namespace cuda {

namespace {

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::string(v) != "0";
}

// The GPU of this process: data-parallel ranks on one machine take one each, by their rank on the
// node (the launcher's local rank), round robin when there are more ranks than GPUs.
int rank_device(int count) { return count > 0 ? launcher_local_rank() % count : 0; }

std::string probe_error() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return fmt::format("--device cuda: no CUDA device found (cudaGetDeviceCount: {})", cudaGetErrorString(e));
  }
  if (count == 0) return "--device cuda: no CUDA device found (cudaGetDeviceCount: 0 devices)";
  const int dev = rank_device(count);
  cudaDeviceProp prop{};
  const cudaError_t ep = cudaGetDeviceProperties(&prop, dev);
  if (ep != cudaSuccess)
    return fmt::format("--device cuda: cannot read device {} (cudaGetDeviceProperties: {})", dev, cudaGetErrorString(ep));
  if (const cudaError_t es = cudaSetDevice(dev); es != cudaSuccess)
    return fmt::format("--device cuda: cannot use device {} (cudaSetDevice: {})", dev, cudaGetErrorString(es));
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
    // Unwinding from an error: NCCL aborted first, or the sync below could wait for a sum that the
    // other ranks never join.
    if (std::uncaught_exceptions() > 0) collectives_.reset();
    if (st_) cudaStreamSynchronize(st_);  // queued work, staged uploads still reading their pinned slots
    collectives_.reset();  // its NCCL communicator orders work on st_
    gemm_.reset();
#if LADDER_HAVE_CUDNN
    cudnn_.reset();  // its handle is bound to st_, destroyed below
#endif
    if (stage_pinned_) cudaFreeHost(stage_pinned_);
    for (auto& s : stage_)
      if (s.done) cudaEventDestroy(s.done);
    if (host_sums_) cudaFreeHost(host_sums_);
    if (st_) cudaStreamDestroy(st_);
  }

  std::string name() const override { return opt_.bf16 ? "cuda-bf16" : opt_.tf32 ? "cuda-tf32" : "cuda"; }
  cudaStream_t stream() const override { return st_; }
  DeviceCollectives* collectives() override {
#if LADDER_HAVE_NCCL
    if (!collectives_) collectives_ = make_nccl_collectives(info_.index, st_);
#endif
    return collectives_.get();  // without nccl.h at build time: none, sums through host memory
  }
  const DeviceInfo& device() const override { return info_; }
  bool tf32() const override { return opt_.tf32; }
  bool bf16() const override { return opt_.bf16; }
  uint64_t bf16_cast_reuses() const override { return cast_reuses_; }
  uint64_t bf16_mirror_casts() const override { return mirror_casts_; }
  uint64_t cudnn_attention_calls() const override { return cudnn_calls_; }
  std::string cudnn_attention_status() const override {
#if LADDER_HAVE_CUDNN
    if (!opt_.cudnn_attention) return "off";
    if (!opt_.bf16) return "off (cuDNN attention needs run.precision bf16)";
    if (cudnn_status_.empty()) return "not yet loaded";
    return cudnn_ && opt_.cudnn_nondeterministic ? cudnn_status_ + " (nondeterministic backward)" : cudnn_status_;
#else
    return opt_.cudnn_attention ? "not compiled (this build found no cuDNN frontend headers)" : "off";
#endif
  }
  // Events on the backend's stream around each op: the device's time per op without a host wait
  // per op (the events are recycled at each take_totals).
  class StreamOpTimer final : public OpTimer {
   public:
    explicit StreamOpTimer(cudaStream_t st) : st_(st) {}
    ~StreamOpTimer() override {
      for (cudaEvent_t e : events_) cudaEventDestroy(e);
    }
    void begin() override { begin_ = record(); }
    void end(const std::string& op) override { spans_.push_back({begin_, record(), op}); }
    std::map<std::string, double> take_totals() override {
      std::map<std::string, double> out;
      LADDER_CUDA_CHECK(cudaStreamSynchronize(st_));
      for (const Span& s : spans_) {
        float ms = 0;
        LADDER_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[s.a], events_[s.b]));
        out[s.op] += 1e-3 * double(ms);
      }
      spans_.clear();
      used_ = 0;
      return out;
    }

   private:
    struct Span {
      size_t a, b;
      std::string op;
    };
    size_t record() {
      if (used_ == events_.size()) {
        events_.push_back(nullptr);
        LADDER_CUDA_CHECK(cudaEventCreate(&events_.back()));
      }
      LADDER_CUDA_CHECK(cudaEventRecord(events_[used_], st_));
      return used_++;
    }
    cudaStream_t st_;
    std::vector<cudaEvent_t> events_;
    size_t used_ = 0, begin_ = 0;
    std::vector<Span> spans_;
  };
  std::unique_ptr<OpTimer> make_op_timer() override { return std::make_unique<StreamOpTimer>(st_); }
  // 512 MiB of logits: 4096 rows at V = 32768, so the head's GEMMs are M = 4096 (the run-3 profile
  // had 128-row chunks: K = 128 weight-gradient GEMMs rereading the 128 MiB fp32 head gradient 128
  // times a step). Small next to an H200's memory, and the logits never exist whole still.
  // LADDER_HEAD_CHUNK_MIB=n sets another budget (gpu-check times 16, the CPU's, beside it).
  size_t lm_head_chunk_bytes() const override {
    const char* v = std::getenv("LADDER_HEAD_CHUNK_MIB");
    const long mib = v && *v ? std::strtol(v, nullptr, 10) : 0;
    return size_t(mib > 0 ? mib : 512) << 20;
  }

  double device_memory_used() const override {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return -1;
    return double(total_b - free_b);
  }
  void synchronize() override { LADDER_CUDA_CHECK(cudaStreamSynchronize(st_)); }

  // Device memory. Copies go on the backend's stream (ordered with the ops); download waits.
  bool is_host() const override { return false; }
  size_t available_bytes() const override {
    size_t free_b = 0, total_b = 0;
    return cudaMemGetInfo(&free_b, &total_b) == cudaSuccess ? free_b : SIZE_MAX;
  }
  void* mem_alloc(size_t bytes, const char* what) override {
    if (bytes == 0) return nullptr;
    void* p = device_alloc(bytes, what);
    LADDER_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, st_));
    return p;
  }
  void mem_free(void* p) override {
    touch(p);
    if (!p) return;
    synchronize();
    device_free(p);
  }
  void upload(void* dst, const void* src, size_t bytes) override {
    touch(dst);
    if (!bytes) return;
    if (bytes <= kStageBytes) {
      // Small uploads (a micro-batch's token ids and targets) go through a ring of pinned slots:
      // the host copies into the slot and returns, and the copy to the device runs in stream order,
      // so the host does not wait for the queued work. A slot is refilled only after the copy that
      // read it has run (its event): with kStageSlots slots and two uploads per micro-batch the host
      // waits only when it is kStageSlots / 2 micro-batches ahead of the device (the device is busy
      // then; the host is merely not allowed further ahead). All slots at once, on the first call.
      if (!stage_pinned_) {
        LADDER_CUDA_CHECK(cudaMallocHost(&stage_pinned_, kStageSlots * kStageBytes));
        for (int i = 0; i < kStageSlots; ++i) {
          stage_[i].host = static_cast<char*>(stage_pinned_) + size_t(i) * kStageBytes;
          LADDER_CUDA_CHECK(cudaEventCreate(&stage_[i].done));
        }
      }
      Stage& s = stage_[stage_next_];
      stage_next_ = (stage_next_ + 1) % kStageSlots;
      LADDER_CUDA_CHECK(cudaEventSynchronize(s.done));  // returns at once for a slot never used
      std::memcpy(s.host, src, bytes);
      LADDER_CUDA_CHECK(cudaMemcpyAsync(dst, s.host, bytes, cudaMemcpyHostToDevice, st_));
      LADDER_CUDA_CHECK(cudaEventRecord(s.done, st_));
      post("upload");
      return;
    }
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
    touch(dst);
    if (!bytes || dst == src) return;
    LADDER_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st_));
    post("copy");
  }
  void zero(void* p, size_t bytes) override {
    touch(p);
    if (!bytes) return;
    LADDER_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, st_));
    post("zero");
  }

  void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
            float beta, float* C, int ldc) override {
    gemm_into(ta, tb, M, N, K, alpha, A, nullptr, lda, B, nullptr, ldb, beta, C, C, nullptr, ldc);
  }
  // cuBLASLt's fp32 GEMM (CUDA cores) under any precision: nothing cast, no mirror.
  void gemm_fp32(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                 int ldb, float beta, float* C, int ldc) override {
    if (M <= 0 || N <= 0) return;
    touch(C);
    gemm_->run(GemmType::F32, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    post("gemm");
  }
  void gemm_b16(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const uint16_t* B,
                int ldb, float beta, float* C, int ldc) override {
    gemm_into(ta, tb, M, N, K, alpha, A, nullptr, lda, nullptr, B, ldb, beta, C, C, nullptr, ldc);
  }
  void gemm_add(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                const float* C, float* D, int ldc) override {
    gemm_into(ta, tb, M, N, K, alpha, A, nullptr, lda, B, nullptr, ldb, 1.f, C, D, nullptr, ldc);
  }
  void gemm_ex(bool ta, bool tb, int M, int N, int K, float alpha, const void* A, bool a_bf16, int lda, const void* B,
               bool b_bf16, int ldb, float beta, const float* C_in, void* D, bool d_bf16, int ldc) override {
    if (d_bf16 && (beta != 0.f || C_in)) fail("gemm_ex: a bf16 output takes no addend (beta 0, no C_in)");
    float* Df = d_bf16 ? nullptr : static_cast<float*>(D);
    gemm_into(ta, tb, M, N, K, alpha, f32_of(A, a_bf16), b16_of(A, a_bf16), lda, f32_of(B, b_bf16), b16_of(B, b_bf16),
              ldb, beta, C_in ? C_in : Df, Df, d_bf16 ? static_cast<uint16_t*>(D) : nullptr, ldc);
  }
  // One strided-batched cuBLASLt GEMM (the MoE capacity layout's expert GEMMs): gemm_into over the
  // stacks, count products in one launch.
  void batched_gemm_ex(int count, bool ta, bool tb, int M, int N, int K, float alpha, const void* A, bool a_bf16,
                       int lda, const void* B, bool b_bf16, int ldb, float beta, void* C, bool c_bf16,
                       int ldc) override {
    if (count < 0) fail("batched_gemm_ex: {} products", count);
    if (c_bf16 && beta != 0.f) fail("batched_gemm_ex: a bf16 output takes no addend (beta 0)");
    if (count == 0) return;
    float* Cf = c_bf16 ? nullptr : static_cast<float*>(C);
    gemm_into(ta, tb, M, N, K, alpha, f32_of(A, a_bf16), b16_of(A, a_bf16), lda, f32_of(B, b_bf16), b16_of(B, b_bf16),
              ldb, beta, Cf, Cf, c_bf16 ? static_cast<uint16_t*>(C) : nullptr, ldc, count);
  }
  static const float* f32_of(const void* X, bool b16) { return b16 ? nullptr : static_cast<const float*>(X); }
  static const uint16_t* b16_of(const void* X, bool b16) { return b16 ? static_cast<const uint16_t*>(X) : nullptr; }
  // count * rows as an int (the stacked operands of a batched GEMM are one matrix of that many rows).
  static int stacked_rows(int rows, int count) {
    const int64_t r = int64_t(rows) * count;
    if (r > int64_t(std::numeric_limits<int>::max())) fail("batched gemm: {} x {} rows do not fit an int", count, rows);
    return int(r);
  }
  // D = alpha op(A) op(B) + beta C_in (C_in may be C): every GEMM entry point. A and B are each
  // fp32 (A, B) or bf16 bits (A16, B16), the other nullptr; the output is fp32 C, or bf16 C16 (then
  // C and C_in are nullptr and beta is 0). count > 1: that many products over stacked operands
  // (batched_gemm_ex; then C_in is C), matrix i at i * rows * ld of each (rows: op's stored rows,
  // ta ? K : M for A, tb ? N : K for B, M for C). A stack is one matrix of count * rows rows with the
  // same leading dimension, so the casts, widenings, mirror lookups and the cast cache below treat
  // it as that, and cuBLASLt runs it as a strided batch (count == 1: its plain plan, as before).
  void gemm_into(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, const uint16_t* A16, int lda,
                 const float* B, const uint16_t* B16, int ldb, float beta, const float* C_in, float* C,
                 uint16_t* C16, int ldc, int count = 1) {
    if (C16 && (M <= 0 || N <= 0)) return;
    const int ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    const int Mc = stacked_rows(M, count);  // the output's rows, all products
    const int64_t sc = int64_t(M) * ldc;    // output stride
    if (C16 && K <= 0) {  // an empty sum: bf16 zeros (cuBLASLt does not take k = 0)
      touch(C16);
      for (int i = 0; i < (ldc == N ? 1 : Mc); ++i)
        LADDER_CUDA_CHECK(cudaMemsetAsync(C16 + size_t(i) * ldc, 0,
                                          (ldc == N ? size_t(Mc) * size_t(N) : size_t(N)) * sizeof(uint16_t), st_));
      return post("gemm");
    }
    if (opt_.bf16 && M > 0 && N > 0 && K > 0) {
      // bf16 x bf16 -> fp32 (or bf16) on the tensor cores. An operand inside the registered weights
      // is read from their bf16 mirror (cast once per optimizer step, same leading dimension); any
      // other fp32 operand is cast into packed scratch (one pass), which the next GEMMs reuse while
      // nothing else has run (CastCache below); a bf16 operand is read as it is.
      const InGemm in_gemm(*this);
      auto operand = [&](const float* X, int rows, int cols, int ld, CastCache& cache, const char* what,
                         int& ld_out) -> const uint16_t* {
        if (const uint16_t* m = mirrored(X, size_t(rows - 1) * ld + cols)) {
          ld_out = ld;
          return m;
        }
        ld_out = cols;
        if (cache.holds(X, rows, cols, ld, writes_)) {
          ++cast_reuses_;
          return cache.bf16.data();
        }
        cache.bf16.reserve(size_t(rows) * cols, what);
        check(k::f32_to_bf16_2d(cache.bf16.data(), X, rows, cols, ld, st_), what);
        cache.keep(X, rows, cols, ld, writes_);
        return cache.bf16.data();
      };
      int la = 0, lb = 0;
      const uint16_t* a = A16 ? (la = lda, A16)
                              : operand(A, stacked_rows(ar, count), ac, lda, cast_a_, "gemm (bf16 cast of A)", la);
      const uint16_t* b = B16 ? (lb = ldb, B16)
                              : operand(B, stacked_rows(br, count), bc, ldb, cast_b_, "gemm (bf16 cast of B)", lb);
      // Strides of the stacks as read: the leading dimension actually used (a packed cast's is cols).
      const int64_t sa = int64_t(ar) * la, sb = int64_t(br) * lb;
      // This GEMM writes C (or C16): a cached cast of memory it overlaps is stale now, and so is a
      // weight mirror it writes into (touch; inside the GEMM it does not count as another op).
      void* out = C16 ? static_cast<void*>(C16) : static_cast<void*>(C);
      touch(out);
      if (C16)
        gemm_->run_batched(GemmType::BF16, ta, tb, M, N, K, alpha, a, la, sa, b, lb, sb, 0.f, C16, ldc, sc, count,
                           /*c_bf16=*/true);
      else
        gemm_->run_batched(GemmType::BF16, ta, tb, M, N, K, alpha, a, la, sa, b, lb, sb, beta, C, ldc, sc, count,
                           false, C_in);
      const size_t es = C16 ? sizeof(uint16_t) : sizeof(float);
      const char* c0 = static_cast<const char*>(out);
      const char* c1 = c0 + (size_t(Mc - 1) * ldc + N) * es;  // the whole stacked output
      cast_a_.forget_if_overlaps(c0, c1);
      cast_b_.forget_if_overlaps(c0, c1);
      post("gemm");
      return;
    }
    // fp32 / TF32 GEMMs: a bf16 operand is widened (exactly) into scratch with its own leading
    // dimension; a bf16 output is the fp32 GEMM into packed scratch, then rounded (the CPU's steps).
    auto widen = [&](const uint16_t* X16, int rows, int cols, int ld, DeviceBuffer<float>& buf, const char* what) {
      const size_t span = size_t(rows - 1) * size_t(ld) + size_t(cols);
      buf.reserve(span, what);
      check(k::bf16_to_f32(buf.data(), X16, span, st_), what);
      return static_cast<const float*>(buf.data());
    };
    if (M > 0 && N > 0 && K > 0) {
      if (A16) A = widen(A16, stacked_rows(ar, count), ac, lda, a_wide_, "gemm (bf16 A widened)");
      if (B16) B = widen(B16, stacked_rows(br, count), bc, ldb, b_wide_, "gemm (bf16 B widened)");
    }
    const int64_t sa = int64_t(ar) * lda, sb = int64_t(br) * ldb;
    const GemmType type = opt_.tf32 ? GemmType::TF32 : GemmType::F32;
    if (C16) {
      d_wide_.reserve(size_t(Mc) * size_t(N), "gemm (fp32 result of a bf16 output)");
      gemm_->run_batched(type, ta, tb, M, N, K, alpha, A, lda, sa, B, ldb, sb, 0.f, d_wide_.data(), N,
                         int64_t(M) * N, count);
      post("gemm");
      touch(C16);
      if (ldc == N)
        return check(k::f32_to_bf16(C16, d_wide_.data(), size_t(Mc) * size_t(N), st_), "gemm (bf16 output)");
      for (int i = 0; i < Mc; ++i)
        check(k::f32_to_bf16(C16 + size_t(i) * ldc, d_wide_.data() + size_t(i) * N, size_t(N), st_),
              "gemm (bf16 output)");
      return;
    }
    touch(C);
    gemm_->run_batched(type, ta, tb, M, N, K, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, count, false, C_in);
    post("gemm");
  }

  // ---- the bf16 mirror of the registered weights (Backend::register_weights)
  void register_weights(const void* base, size_t bytes) override {
    unregister_weights(base);
    if (!base || bytes == 0) return;
    mirrors_.push_back(std::make_unique<Mirror>());
    mirrors_.back()->base = static_cast<const char*>(base);
    mirrors_.back()->bytes = bytes;
  }
  void unregister_weights(const void* base) override {
    for (size_t i = 0; i < mirrors_.size(); ++i)
      if (mirrors_[i]->base == base) {
        mirrors_.erase(mirrors_.begin() + long(i));
        return;
      }
  }
  // NCCL wrote [p, p + bytes) (a sharded optimizer's weights from the other ranks, the gradient
  // sum): no cast is reused (note_write), and a valid mirror it overlaps gets the bf16 of just the
  // written floats, on the stream behind NCCL's work (the rest, this rank's own update, the
  // optimizer already wrote there), instead of a re-cast of every weight at the next GEMM.
  void note_external_write(const void* p, size_t bytes) override {
    note_write();
    const char* c0 = static_cast<const char*>(p);
    const char* c1 = c0 + bytes;
    for (auto& m : mirrors_) {
      const char* a = std::max(c0, m->base);
      const char* b = std::min(c1, m->base + m->bytes);
      if (a >= b || !m->valid) continue;  // untouched, or re-cast whole at its next use anyway
      LADDER_ASSERT((a - m->base) % sizeof(float) == 0 && (b - a) % sizeof(float) == 0);
      check(k::f32_to_bf16(m->bf16.data() + (a - m->base) / sizeof(float), reinterpret_cast<const float*>(a),
                           size_t(b - a) / sizeof(float), st_),
            "bf16 weight mirror (collective)");
    }
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
  void rmsnorm_forward_bf16(uint16_t* y, float* rstd, const float* x, const float* gain, int N, int D,
                            float eps) override {
    check(k::rmsnorm_forward_bf16(y, rstd, x, gain, N, D, eps, st_), "rmsnorm_forward_bf16");
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

  // Under bf16 with the mma.sync kernels (the default), fp32 q, k, v go to the kernels as bf16 copies
  // (attn_in16): the values the kernels would round them to while staging, so bitwise the same
  // results, but staged by cp.async (attention_tc.cuh, attention_tc_forward_in16).
  void attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                         const AttnShape& s) override {
    check_attn(s);
#if LADDER_HAVE_CUDNN
    // cuDNN on the bf16 copies, its bf16 o widened into the fp32 output: of the caller's pointers it
    // sees only lse (the casts take any alignment).
    if (CudnnAttention* c = cudnn_attention(s, {lse})) {
      const AttnIn16 x = attn_in16(q, k, v, s);
      const CudnnGrads16 b = cudnn_scratch(s);
      c->forward(b.o, lse, x.q, x.k, x.v, s);
      ++cudnn_calls_;
      post("cudnn attention forward");
      return check(k::bf16_to_f32(o, b.o, size_t(s.B) * s.S * s.H * s.hd, st_), "cudnn attention forward (o)");
    }
#endif
    if (tc_attention(s) && k::attention_tc_kernels().mma_fwd) {
      const AttnIn16 x = attn_in16(q, k, v, s);
      return check(k::attention_tc_forward_in16(o, lse, x.q, x.k, x.v, s, st_), "attention_tc_forward_in16");
    }
    if (tc_attention(s)) return check(k::attention_tc_forward(o, lse, q, k, v, s, st_), "attention_tc_forward");
    check(k::attention_forward(o, lse, q, k, v, s, st_), "attention_forward");
  }
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                          const float* v, const float* o, const float* lse, const AttnShape& s) override {
    check_attn(s);
#if LADDER_HAVE_CUDNN
    if (CudnnAttention* c = cudnn_attention(s, {lse})) {  // the rest reaches cuDNN through bf16 scratch
      const AttnIn16 x = attn_in16(q, k, v, s);
      const CudnnGrads16 b = cudnn_scratch(s);
      check(k::f32_to_bf16(b.o, o, size_t(s.B) * s.S * s.H * s.hd, st_), "cudnn attention backward (bf16 o)");
      return cudnn_backward(c, dq, dk, dv, dout, x.q, x.k, x.v, b.o, lse, s);
    }
#endif
    float* scratch = attention_backward_scratch(s);
    if (tc_attention(s) && k::attention_tc_kernels().mma_bwd) {
      const AttnIn16 x = attn_in16(q, k, v, s);
      return check(k::attention_tc_backward_in16(dq, dk, dv, dout, x.q, x.k, x.v, o, lse, s, scratch, st_),
                   "attention_tc_backward_in16");
    }
    if (tc_attention(s))
      return check(k::attention_tc_backward(dq, dk, dv, dout, q, k, v, o, lse, s, scratch, st_),
                   "attention_tc_backward");
    check(k::attention_backward(dq, dk, dv, dout, q, k, v, o, lse, s, scratch, st_), "attention_backward");
  }

  // The capacity layout's rows in use (rows_used: ov + E + 1, on the device): the kernels read the
  // count themselves, so the launch is sized by rows and nothing synchronizes.
  void swiglu_forward_rows(void* h, const void* g, const void* u, bool h16, int64_t rows, int cols,
                           const int32_t* rows_used) override {
    if (!rows_used) fail("swiglu_forward_rows: no row count");
    check(k::swiglu_forward_rows(h, g, u, h16, rows, cols, rows_used, st_), "swiglu_forward_rows");
  }
  void swiglu_backward_rows(void* dg, void* du, const void* dh, const void* g, const void* u, bool h16, bool d16,
                            int64_t rows, int cols, const int32_t* rows_used) override {
    if (d16 && !h16) fail("swiglu_backward_rows: bf16 gradients need bf16 gate and up (model.moe_bf16)");
    if (!rows_used) fail("swiglu_backward_rows: no row count");
    check(k::swiglu_backward_rows(dg, du, dh, g, u, h16, d16, rows, cols, rows_used, st_), "swiglu_backward_rows");
  }
  void swiglu_forward(float* h, const float* g, const float* u, size_t n) override {
    check(k::swiglu_forward(h, g, u, n, st_), "swiglu_forward");
  }
  void swiglu_backward(float* dg, float* du, const float* dh, const float* g, const float* u, size_t n) override {
    check(k::swiglu_backward(dg, du, dh, g, u, n, st_), "swiglu_backward");
  }
  void swiglu_forward_bf16(uint16_t* h, const uint16_t* g, const uint16_t* u, size_t n) override {
    check(k::swiglu_forward_bf16(h, g, u, n, st_), "swiglu_forward_bf16");
  }
  void swiglu_backward_bf16(float* dg, float* du, const float* dh, const uint16_t* g, const uint16_t* u,
                            size_t n) override {
    check(k::swiglu_backward_bf16(dg, du, dh, g, u, n, st_), "swiglu_backward_bf16");
  }
  void swiglu_backward_bf16_grads(uint16_t* dg, uint16_t* du, const uint16_t* dh, const uint16_t* g, const uint16_t* u,
                                  size_t n) override {
    check(k::swiglu_backward_bf16_grads(dg, du, dh, g, u, n, st_), "swiglu_backward_bf16_grads");
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

  void add_inplace(float* y, const float* x, size_t n) override {
    touch(y);
    check(k::add_inplace(y, x, n, st_), "add_inplace");
  }
  void scale_inplace(float* x, float s, size_t n) override {
    touch(x);
    check(k::scale_inplace(x, s, n, st_), "scale_inplace");
  }
  // No touch(): bf16 storage is activation memory, never the registered weights.
  void to_bf16(uint16_t* out, const float* in, size_t n) override {
    check(k::f32_to_bf16(out, in, n, st_), "to_bf16");
  }
  void from_bf16(float* out, const uint16_t* in, size_t n) override {
    check(k::bf16_to_f32(out, in, n, st_), "from_bf16");
  }
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
    touch(p);
    check(k::adamw_update(p, g, m, v, n, lr, b1, b2, eps, wd, bc1, bc2, st_), "adamw_update");
  }

  // MoE dispatch and the grouped GEMM (moe_ops.cu). Offsets stay on the device; nothing here waits.
  void grouped_gemm(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K, float alpha,
                    const float* A, int lda, const float* B, int ldb, size_t strideB, float beta, float* C, int ldc,
                    size_t strideC) override {
    // All fp32: nothing is widened, so no row bound is needed.
    grouped_gemm_ex(rows_out, transB, E, offsets, 0, M, N, K, alpha, A, false, lda, B, false, ldb, strideB, beta, C,
                    false, ldc, strideC);
  }
  void grouped_gemm_ex(bool rows_out, bool transB, int E, const int32_t* offsets, int rows, int M, int N, int K,
                       float alpha, const void* A, bool a_bf16, int lda, const void* B, bool b_bf16, int ldb,
                       size_t strideB, float beta, void* C, bool c_bf16, int ldc, size_t strideC) override {
    check_grouped_gemm_ex(rows_out, E, M, N, beta, c_bf16, ldc, strideC);
    auto span = [](int r, int ld, int cols) { return r > 0 && cols > 0 ? size_t(r - 1) * size_t(ld) + size_t(cols) : 0; };
    const size_t b_span = rows_out ? (E > 0 ? size_t(E - 1) * strideB + (transB ? span(N, ldb, K) : span(K, ldb, N)) : 0)
                                   : span(rows, ldb, N);
    if (opt_.bf16) {
      // bf16 precision: the tensor-core kernel (grouped_gemm_tc.cu), fp32 operands rounded to bf16
      // on the way into shared memory, bf16 ones read as they are, fp32 accumulation; same
      // contract, scheduling and determinism. Expert weights as B (the forward and the data
      // gradient: rows_out) come from the bf16 mirror, half the bytes and bitwise the same result.
      moe_tiles_.reserve(k::grouped_gemm_tc_scratch_ints(E), "grouped gemm tile prefix");
      const void* b = B;
      bool b16 = b_bf16;
      if (!b_bf16 && rows_out && E > 0 && N > 0 && K > 0)
        if (const uint16_t* m = mirrored(static_cast<const float*>(B), b_span)) b = m, b16 = true;
      check(k::grouped_gemm_tc_ex(rows_out, transB, E, offsets, M, N, K, alpha, A, a_bf16, lda, b, b16, ldb, strideB,
                                  beta, C, c_bf16, ldc, strideC, moe_tiles_.data(), info_.sm_count, st_),
            "grouped_gemm_tc");
      return;
    }
    // fp32 CUDA-core kernel even when tf32 is on: exact fp32 is the goal here (docs/cuda.md). bf16
    // operands are widened into scratch over what `rows` bounds (the offsets stay on the device);
    // a bf16 C is the fp32 result in scratch, rounded over the offsets' own row count.
    auto widen = [&](const void* X, size_t n, DeviceBuffer<float>& buf, const char* what) -> const float* {
      buf.reserve(n ? n : 1, what);
      check(k::bf16_to_f32(buf.data(), static_cast<const uint16_t*>(X), n, st_), what);
      return buf.data();
    };
    const float* a = a_bf16 ? widen(A, rows_out ? span(rows, lda, K) : span(rows, lda, M), a_wide_,
                                    "grouped gemm (bf16 A widened)")
                            : static_cast<const float*>(A);
    const float* b = b_bf16 ? widen(B, b_span, b_wide_, "grouped gemm (bf16 B widened)") : static_cast<const float*>(B);
    float* c = static_cast<float*>(C);
    if (c_bf16) {
      const size_t n = rows_out ? size_t(std::max(rows, 0)) * size_t(std::max(N, 0)) : size_t(std::max(E, 0)) * strideC;
      d_wide_.reserve(n ? n : 1, "grouped gemm (fp32 result of a bf16 output)");
      c = d_wide_.data();
    }
    moe_tiles_.reserve(k::grouped_gemm_scratch_ints(E), "grouped gemm tile prefix");
    check(k::grouped_gemm(rows_out, transB, E, offsets, M, N, K, alpha, a, lda, b, ldb, strideB, c_bf16 ? 0.f : beta, c,
                          ldc, strideC, moe_tiles_.data(), st_),
          "grouped_gemm");
    if (!c_bf16 || E <= 0 || N <= 0) return;
    uint16_t* c16 = static_cast<uint16_t*>(C);
    if (rows_out)
      check(k::f32_to_bf16_rows(c16, c, offsets + E, size_t(N), size_t(std::max(rows, 0)), st_),
            "grouped gemm (bf16 output)");
    else if (M > 0)
      check(k::f32_to_bf16(c16, c, size_t(E) * strideC, st_), "grouped gemm (bf16 output)");
  }
  void pko_resets(uint8_t* reset, const int32_t* ids, int N_tok, int S, int eod_id) override {
    if (N_tok > 0 && S < 1) fail("pko_resets: sequence length must be >= 1 (got {})", S);
    check(k::pko_resets(reset, ids, N_tok, S, eod_id, st_), "pko_resets");
  }
  // Attention switches and GatedNorm's elementwise parts (switch_ops.cu).
  void pko_shift_forward(float* out, const float* k, const uint8_t* reset, int N_tok, int nkv, int hd,
                         int from_dim) override {
    check_pko(hd, from_dim);
    check(k::pko_shift_forward(out, k, reset, N_tok, nkv, hd, from_dim, st_), "pko_shift_forward");
  }
  void pko_shift_backward(float* dk, const float* dout, const uint8_t* reset, int N_tok, int nkv, int hd,
                          int from_dim) override {
    check_pko(hd, from_dim);
    check(k::pko_shift_backward(dk, dout, reset, N_tok, nkv, hd, from_dim, st_), "pko_shift_backward");
  }
  void qk_prep_forward(float* out, float* rstd, const float* x, const float* gain, const uint8_t* reset, int N_tok,
                       int S, int nh, int hd, int rot, float theta, bool norm, float eps) override {
    check_qk_prep("qk_prep_forward", S, hd, rot);
    check(k::qk_prep_forward(out, rstd, x, gain, reset, rope_table(S, rot, theta), N_tok, S, nh, hd, rot, norm, eps,
                             st_),
          "qk_prep_forward");
  }
  void qk_prep_backward(float* dx, float* dgain, const float* dout, const float* x, const float* gain,
                        const float* rstd, const uint8_t* reset, int N_tok, int S, int nh, int hd, int rot,
                        float theta, bool norm) override {
    float* scratch = qk_prep_backward_scratch("qk_prep_backward", N_tok, S, nh, hd, rot, norm && gain && dgain);
    check(k::qk_prep_backward(dx, dgain, dout, x, gain, rstd, reset, rope_table(S, rot, theta), N_tok, S, nh, hd, rot,
                              norm, scratch, st_),
          "qk_prep_backward");
  }
  void xsa_forward(float* z, const float* y, const float* v, int N_tok, int H, int KV, int hd) override {
    check_heads("xsa", H, KV);
    check(k::xsa_forward(z, y, v, N_tok, H, KV, hd, st_), "xsa_forward");
  }
  void xsa_backward(float* dy, float* dv, const float* dz, const float* y, const float* v, int N_tok, int H, int KV,
                    int hd) override {
    check_heads("xsa", H, KV);
    check(k::xsa_backward(dy, dv, dz, y, v, N_tok, H, KV, hd, st_), "xsa_backward");
  }
  void head_gate_forward(float* out, float* factor, const float* x, const float* logit, int N_tok, int H,
                         int hd) override {
    check(k::head_gate_forward(out, factor, x, logit, N_tok, H, hd, st_), "head_gate_forward");
  }
  void head_gate_backward(float* dx, float* dlogit, const float* dout, const float* x, const float* factor,
                          int N_tok, int H, int hd) override {
    check(k::head_gate_backward(dx, dlogit, dout, x, factor, N_tok, H, hd, st_), "head_gate_backward");
  }
  // model.attn_bf16 (Backend's contract): the kernels above and the attention kernels instantiated
  // on bf16 storage (switch_ops.cu, attention.cu, attention_tc.cu): bf16 inputs widened as they are
  // read, bf16 outputs rounded as they are written, nothing staged in fp32 scratch. The same checks,
  // scratch and kernel choice as the fp32 ops.
  void qk_prep_forward_bf16(uint16_t* out, float* rstd, const uint16_t* x, const float* gain, const uint8_t* reset,
                            int N_tok, int S, int nh, int hd, int rot, float theta, bool norm, float eps) override {
    check_qk_prep("qk_prep_forward_bf16", S, hd, rot);
    check(k::qk_prep_forward_bf16(out, rstd, x, gain, reset, rope_table(S, rot, theta), N_tok, S, nh, hd, rot, norm,
                                  eps, st_),
          "qk_prep_forward_bf16");
  }
  void qk_prep_backward_bf16(float* dx, float* dgain, const float* dout, const uint16_t* x, const float* gain,
                             const float* rstd, const uint8_t* reset, int N_tok, int S, int nh, int hd, int rot,
                             float theta, bool norm) override {
    float* scratch = qk_prep_backward_scratch("qk_prep_backward_bf16", N_tok, S, nh, hd, rot, norm && gain && dgain);
    check(k::qk_prep_backward_bf16(dx, dgain, dout, x, gain, rstd, reset, rope_table(S, rot, theta), N_tok, S, nh, hd,
                                   rot, norm, scratch, st_),
          "qk_prep_backward_bf16");
  }
  void attention_forward_bf16(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              const AttnShape& s) override {
    check_attn(s);
#if LADDER_HAVE_CUDNN
    if (CudnnAttention* c = cudnn_attention(s, {o, lse, q, k, v})) {
      c->forward(o, lse, q, k, v, s);
      ++cudnn_calls_;
      return post("cudnn attention forward");
    }
#endif
    if (tc_attention(s))
      return check(k::attention_tc_forward_bf16(o, lse, q, k, v, s, st_), "attention_tc_forward_bf16");
    check(k::attention_forward_bf16(o, lse, q, k, v, s, st_), "attention_forward_bf16");
  }
  void attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const uint16_t* q,
                               const uint16_t* k, const uint16_t* v, const uint16_t* o, const float* lse,
                               const AttnShape& s) override {
    check_attn(s);
#if LADDER_HAVE_CUDNN
    // dq, dk, dv and dout go through bf16 scratch (cudnn_backward); the rest cuDNN reads in place.
    if (CudnnAttention* c = cudnn_attention(s, {q, k, v, o, lse}))
      return cudnn_backward(c, dq, dk, dv, dout, q, k, v, o, lse, s);
#endif
    float* scratch = attention_backward_scratch(s);
    if (tc_attention(s))
      return check(k::attention_tc_backward_bf16(dq, dk, dv, dout, q, k, v, o, lse, s, scratch, st_),
                   "attention_tc_backward_bf16");
    check(k::attention_backward_bf16(dq, dk, dv, dout, q, k, v, o, lse, s, scratch, st_), "attention_backward_bf16");
  }
  void xsa_forward_bf16(uint16_t* z, const uint16_t* y, const uint16_t* v, int N_tok, int H, int KV,
                        int hd) override {
    check_heads("xsa", H, KV);
    check(k::xsa_forward_bf16(z, y, v, N_tok, H, KV, hd, st_), "xsa_forward_bf16");
  }
  void xsa_backward_bf16(float* dy, float* dv, const float* dz, const uint16_t* y, const uint16_t* v, int N_tok,
                         int H, int KV, int hd) override {
    check_heads("xsa", H, KV);
    check(k::xsa_backward_bf16(dy, dv, dz, y, v, N_tok, H, KV, hd, st_), "xsa_backward_bf16");
  }
  void head_gate_forward_bf16(uint16_t* out, float* factor, const uint16_t* x, const float* logit, int N_tok, int H,
                              int hd) override {
    check(k::head_gate_forward_bf16(out, factor, x, logit, N_tok, H, hd, st_), "head_gate_forward_bf16");
  }
  void head_gate_backward_bf16(float* dx, float* dlogit, const float* dout, const uint16_t* x, const float* factor,
                               int N_tok, int H, int hd) override {
    check(k::head_gate_backward_bf16(dx, dlogit, dout, x, factor, N_tok, H, hd, st_), "head_gate_backward_bf16");
  }
  void silu_forward(float* a, const float* u, size_t n) override {
    check(k::silu_forward(a, u, n, st_), "silu_forward");
  }
  void silu_backward(float* du, const float* da, const float* u, size_t n) override {
    check(k::silu_backward(du, da, u, n, st_), "silu_backward");
  }
  void sigmoid_gate_forward(float* y, float* g, const float* x, size_t n) override {
    check(k::sigmoid_gate_forward(y, g, x, n, st_), "sigmoid_gate_forward");
  }
  void sigmoid_gate_forward_bf16(uint16_t* y, float* g, const float* x, size_t n) override {
    check(k::sigmoid_gate_forward_bf16(y, g, x, n, st_), "sigmoid_gate_forward_bf16");
  }
  void sigmoid_gate_backward(float* dx, float* dg, const float* dy, const float* x, const float* s, size_t n,
                             bool accumulate_dx) override {
    check(k::sigmoid_gate_backward(dx, dg, dy, x, s, n, accumulate_dx, st_), "sigmoid_gate_backward");
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
  void moe_capacity(int32_t* row, int32_t* cslot, int32_t* ov, const int32_t* offsets, const int32_t* slot, int NK,
                    int E, int C, int R) override {
    if (C < 1 || E < 0 || R < 0 || (NK > 0 && E == 0) || int64_t(E) * C > R)
      fail("moe_capacity: {} slots over {} experts of capacity {} in {} rows", NK, E, C, R);
    check(k::moe_capacity(row, cslot, ov, offsets, slot, NK, E, C, R, st_), "moe_capacity");
  }
  void moe_zero_rows(void* x, bool bf16, const int32_t* cslot, int rows, int cols) override {
    check(k::moe_zero_rows(x, bf16, cslot, rows, cols, st_), "moe_zero_rows");
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
  void moe_combine_bf16(float* out, const uint16_t* y, const float* comb, const int32_t* row, int N, int K,
                        int d) override {
    check(k::moe_combine_bf16(out, y, comb, row, N, K, d, st_), "moe_combine_bf16");
  }
  void moe_combine_backward_bf16(float* dy, float* dcomb, const float* dout, const uint16_t* y, const float* comb,
                                 const int32_t* row, int N, int K, int d) override {
    check(k::moe_combine_backward_bf16(dy, dcomb, dout, y, comb, row, N, K, d, st_), "moe_combine_backward_bf16");
  }
  void moe_combine_backward_bf16_grads(uint16_t* dy, float* dcomb, const float* dout, const uint16_t* y,
                                       const float* comb, const int32_t* row, int N, int K, int d) override {
    check(k::moe_combine_backward_bf16_grads(dy, dcomb, dout, y, comb, row, N, K, d, st_),
          "moe_combine_backward_bf16_grads");
  }
  void moe_gather_bf16(uint16_t* xs, const float* h, const int32_t* slot, int NK, int K, int d) override {
    check(k::moe_gather_bf16(xs, h, slot, NK, K, d, st_), "moe_gather_bf16");
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
  void moe_balance_bias(float* bias, const double* beta, int E) override {
    check(k::moe_balance_bias(bias, beta, E, st_), "moe_balance_bias");
  }
  void moe_count_load(int64_t* load, const int32_t* offsets, int E) override {
    check(k::moe_count_load(load, offsets, E, st_), "moe_count_load");
  }
  // The recipe optimizers (optim_ops.cu; Newton-Schulz's GEMMs through LtGemm). The synchronous
  // forms run the _async ones into sums_ and wait for the one double.
  double adam_moments(float* m, float* v, const float* g, size_t n, float b1, float b2, float bc1, float bc2,
                      float eps) override {
    adam_moments_async(m, v, g, n, b1, b2, bc1, bc2, eps, sums_.data());
    return fetch_sum();
  }
  double adam_apply(float* w, const float* m, const float* v, size_t n, float bc1, float bc2, float eps,
                    float alpha) override {
    touch(w);
    adam_apply_async(w, m, v, n, bc1, bc2, eps, alpha, sums_.data());
    return fetch_sum();
  }
  double axpy_sumsq(float* w, const float* x, size_t n, float alpha) override {
    touch(w);
    axpy_sumsq_async(w, x, n, alpha, sums_.data());
    return fetch_sum();
  }
  void adam_moments_async(float* m, float* v, const float* g, size_t n, float b1, float b2, float bc1, float bc2,
                          float eps, double* d_out) override {
    check(k::adam_moments(m, v, g, n, b1, b2, bc1, bc2, eps, d_out, optim_partials(), st_), "adam_moments");
  }
  void adam_apply_async(float* w, const float* m, const float* v, size_t n, float bc1, float bc2, float eps,
                        float alpha, double* d_out) override {
    touch(w);
    check(k::adam_apply(w, m, v, n, bc1, bc2, eps, alpha, d_out, optim_partials(), st_), "adam_apply");
  }
  void axpy_sumsq_async(float* w, const float* x, size_t n, float alpha, double* d_out) override {
    touch(w);
    check(k::axpy_sumsq(w, x, n, alpha, d_out, optim_partials(), st_), "axpy_sumsq");
  }
  // The no-wait optimizer ops. The multi-tensor ones run on a device table of segments (OptSeg)
  // built from the descriptor list on its first use and kept: the optimizer passes the same list
  // every step, so a step uploads nothing (its learning rates travel as kernel arguments).
  // The optimizer's weight updates (adamw_multi, adamh_multi, muonh_apply_batched, axpy) also write
  // the bf16 mirror's copy of every weight they update, in their last pass, where the weights are
  // mirrored and the mirror is allocated; such a write leaves the mirror as valid as it was, so a
  // whole optimizer step keeps it valid and the next step's bf16 GEMMs re-cast nothing.
  void adamw_multi(const OptimTensor* t, size_t count, const float* lr, const float* wd, int ngroups, float b1,
                   float b2, float eps, float bc1, float bc2, const float* grad_factor) override {
    if (!count) return;
    OptimTable& tb = optim_table(t, count, TableKind::AdamW, ngroups, mirror_copies(t, count));
    k::OptGroupScalars gs{};
    for (int i = 0; i < ngroups; ++i) gs.lr[i] = lr[i], gs.wd[i] = wd[i];
    check(k::adamw_multi(tb.segs.data(), tb.block_seg.data(), tb.nblocks, gs, b1, b2, eps, bc1, bc2, grad_factor,
                         st_),
          "adamw_multi");
  }
  void adamh_multi(const OptimTensor* t, size_t count, const double* lr, int ngroups, float b1, float b2, float eps,
                   float bc1, float bc2, const float* grad_factor) override {
    if (!count) return;
    OptimTable& tb = optim_table(t, count, TableKind::AdamH, ngroups, mirror_copies(t, count));
    k::OptGroupLr glr{};
    for (int i = 0; i < ngroups; ++i) glr.lr[i] = lr[i];
    check(k::adamh_multi(tb.segs.data(), tb.nseg, tb.block_seg.data(), tb.nblocks, glr, b1, b2, eps, bc1, bc2,
                         grad_factor, tb.partials.data(), tb.sums.data(), tb.scal.data(), st_),
          "adamh_multi");
  }
  // The per-tensor sums of squares on the same segment tables (one segment per tensor, its g the
  // tensor): two launches for all of them instead of two per tensor.
  void sum_squares_multi(const float* const* x, const size_t* n, size_t count, double* out) override {
    if (!count) return;
    ssq_list_.resize(count);
    for (size_t i = 0; i < count; ++i) {
      ssq_list_[i] = OptimTensor{};
      ssq_list_[i].g = x[i], ssq_list_[i].n = n[i];
    }
    OptimTable& tb = optim_table(ssq_list_.data(), count, TableKind::SumSquares, 1, nullptr);
    check(k::sum_squares_multi(tb.segs.data(), tb.nseg, tb.block_seg.data(), tb.nblocks, tb.partials.data(), out,
                               st_),
          "sum_squares_multi");
  }
  void muonh_apply(float* w, const float* D, size_t n, const float* radius, double lr) override {
    touch(w);
    double* partials = optim_partials();
    check(k::muonh_apply(w, D, n, radius, lr, partials + optim_partials_count(), partials, st_), "muonh_apply");
  }
  void muonh_apply_batched(float* w, const float* D, size_t n, int count, const float* radius, double lr) override {
    if (count <= 0) return touch(w);
    uint16_t* w16 = write_with_mirror(w, n * size_t(count));
    const size_t bpm = size_t(k::batch_blocks_per_matrix(n));
    muonh_sums_.reserve(size_t(count) * (bpm + 2), "MuonH batch norms");
    double* sums = muonh_sums_.data();  // ||D_i||^2 and ||w_i||^2, then the partials
    check(k::muonh_apply_batched(w, D, n, count, radius, lr, sums, sums + 2 * size_t(count), w16, st_),
          "muonh_apply_batched");
  }
  void axpy(float* w, const float* x, size_t n, float alpha) override {
    uint16_t* w16 = write_with_mirror(w, n);
    check(k::axpy(w, x, n, alpha, w16, st_), "axpy");
  }
  void grad_clip_factor(const double* sums, size_t count, double clip, double* norm, float* factor) override {
    check(k::grad_clip_factor(sums, count, clip, norm, factor, st_), "grad_clip_factor");
  }
  void muon_momentum(float* B, float* D, const float* G, size_t n, float mu, const float* grad_factor) override {
    touch(B);
    check(k::muon_momentum(B, D, G, n, mu, grad_factor, st_), "muon_momentum");
  }
  // cpu::newton_schulz5's math on the device, nothing waiting: the norm is summed on the device and
  // applied by a kernel reading that sum. Wide matrices (rows <= cols) iterate on X [m, n] with
  // A = X X^T and X <- P X; tall ones on the same memory read as X [n, m] with A = X^T X and
  // X <- X P (the transposed iteration, no copy). P = a I + b A + c A A^T is built as b A + a I by a
  // kernel, then c A A^T is added by a GEMM with beta = 1 (A is symmetric up to rounding, so A A^T
  // is A^2 as on the CPU, whose syrk makes it exactly symmetric). Plain GEMMs rather than the CPU's
  // syrk: 4 m^2 n + 2 m^3 flops per step (m = min(rows, cols), n = max), on tensor cores with TF32.
  // One matrix is a batch of one.
  void newton_schulz5(float* X, int rows, int cols) override { newton_schulz5_batched(X, rows, cols, 1); }
  // A batch runs every step as strided-batched GEMMs over all its matrices, the norms by a
  // segmented reduction (one sum per matrix) and the polynomial by one kernel: 23 launches per batch
  // instead of per matrix. The workspace (Y, A, P per matrix) is bounded: a batch
  // whose workspace would exceed it (CudaOptions::ns_work_bytes, 256 MiB) runs in chunks of as many
  // matrices as fit (at least one, so a single matrix larger than the budget still runs, with the
  // workspace it needs).
  void newton_schulz5_batched(float* X, int rows, int cols, int count) override {
    touch(X);
    if (rows <= 0 || cols <= 0 || count <= 0) return;
    const bool tall = rows > cols;
    const int m = tall ? cols : rows;
    const size_t mn = size_t(rows) * size_t(cols), mm = size_t(m) * size_t(m);
    // bf16 GEMMs also keep bf16 copies of the iterate, A and P.
    const size_t per_matrix = (mn + 2 * mm) * (sizeof(float) + (opt_.bf16 ? sizeof(uint16_t) : 0));
    const int chunk = int(std::clamp<size_t>(opt_.ns_work_bytes / per_matrix, 1, size_t(count)));
    // Y (the other half of the ping-pong, stride mn like X), A and P (stride m^2), each starting on
    // a 256-byte boundary so that cuBLASLt gets its best-aligned kernels.
    const auto aligned = [](size_t floats) { return (floats + 63) / 64 * 64; };
    ns_work_.reserve(aligned(size_t(chunk) * mn) + 2 * aligned(size_t(chunk) * mm), "Newton-Schulz workspace");
    if (opt_.bf16)  // the layout of ns_chunk_bf16, 256-byte boundaries too
      ns_work16_.reserve(ns16_aligned(size_t(chunk) * mn) + 2 * ns16_aligned(size_t(chunk) * mm),
                         "Newton-Schulz workspace (bf16)");
    const int bpm = k::batch_blocks_per_matrix(mn);
    ns_sums_.reserve(size_t(chunk) * size_t(bpm) + size_t(chunk), "Newton-Schulz norms");
    for (int c0 = 0; c0 < count; c0 += chunk)
      ns_chunk(X + size_t(c0) * mn, rows, cols, std::min(chunk, count - c0), aligned(size_t(chunk) * mn),
               aligned(size_t(chunk) * mm));
    post("newton_schulz5");
  }
  void ns_chunk(float* X, int rows, int cols, int count, size_t y_floats, size_t mm_floats) {
    const bool tall = rows > cols;
    const int m = tall ? cols : rows, n = tall ? rows : cols;
    const int64_t mn = int64_t(m) * n, mm = int64_t(m) * m;
    float* Y = ns_work_.data();
    float* A = Y + y_floats;
    float* P = A + mm_floats;
    double* d_sumsq = ns_sums_.data();  // count sums, then the partials
    double* partials = d_sumsq + count;

    // X_i / (||X_i||_F + 1e-8) into Y, so that the 5 (odd) steps end back in X.
    check(k::batched_sum_squares(X, size_t(mn), count, d_sumsq, partials, st_), "newton_schulz5 (norm)");
    check(k::batched_scale_by_inv_norm(Y, X, size_t(mn), count, d_sumsq, st_), "newton_schulz5 (normalize)");
    // On the tensor cores: TF32 under tf32 precision (reads the fp32 iterates as they are, 10 mantissa
    // bits); under bf16 precision in bf16 as Muon is usually run (twice TF32's tensor-core rate): each
    // step casts the iterate, A and P to bf16 (8 mantissa bits) just before the GEMMs that read them;
    // the iterate, A and P themselves and every accumulation stay fp32.
    if (opt_.bf16) return ns_chunk_bf16(X, Y, A, P, m, n, tall, count);
    const GemmType type = opt_.tf32 ? GemmType::TF32 : GemmType::F32;
    float* cur = Y;
    float* nxt = X;
    for (int s = 0; s < 5; ++s) {
      const float a = float(cpu::kNsCoeffs[s][0]), b = float(cpu::kNsCoeffs[s][1]), c = float(cpu::kNsCoeffs[s][2]);
      if (tall)  // cur is [n, m]: A = cur^T cur
        gemm_->run_batched(type, true, false, m, m, n, 1.f, cur, m, mn, cur, m, mn, 0.f, A, m, mm, count);
      else  // cur is [m, n]: A = cur cur^T
        gemm_->run_batched(type, false, true, m, m, n, 1.f, cur, n, mn, cur, n, mn, 0.f, A, m, mm, count);
      check(k::batched_ns_poly_init(P, A, m, count, a, b, st_), "newton_schulz5 (polynomial)");
      gemm_->run_batched(type, false, true, m, m, m, c, A, m, mm, A, m, mm, 1.f, P, m, mm, count);  // P += c A A^T
      if (tall)  // nxt [n, m] = cur [n, m] P [m, m]
        gemm_->run_batched(type, false, false, n, m, m, 1.f, cur, m, mn, P, m, mm, 0.f, nxt, m, mn, count);
      else  // nxt [m, n] = P [m, m] cur [m, n]
        gemm_->run_batched(type, false, false, m, n, m, 1.f, P, m, mm, cur, n, mn, 0.f, nxt, n, mn, count);
      std::swap(cur, nxt);
    }
  }
  static size_t ns16_aligned(size_t values) { return (values + 127) / 128 * 128; }
  // The 5 steps with bf16 GEMM operands (see ns_chunk). Y holds the normalized matrices; the result
  // lands in X. cur16 / A16 / P16: bf16 copies (bf16 workspace, same strides as their fp32 forms).
  void ns_chunk_bf16(float* X, float* Y, float* A, float* P, int m, int n, bool tall, int count) {
    const int64_t mn = int64_t(m) * n, mm = int64_t(m) * m;
    const size_t nmn = size_t(mn) * size_t(count), nmm = size_t(mm) * size_t(count);
    uint16_t* cur16 = ns_work16_.data();
    uint16_t* A16 = cur16 + ns16_aligned(nmn);
    uint16_t* P16 = A16 + ns16_aligned(nmm);
    const GemmType bf = GemmType::BF16;
    float* cur = Y;
    float* nxt = X;
    for (int s = 0; s < 5; ++s) {
      const float a = float(cpu::kNsCoeffs[s][0]), b = float(cpu::kNsCoeffs[s][1]), c = float(cpu::kNsCoeffs[s][2]);
      check(k::f32_to_bf16(cur16, cur, nmn, st_), "newton_schulz5 (bf16 iterate)");
      if (tall)
        gemm_->run_batched(bf, true, false, m, m, n, 1.f, cur16, m, mn, cur16, m, mn, 0.f, A, m, mm, count);
      else
        gemm_->run_batched(bf, false, true, m, m, n, 1.f, cur16, n, mn, cur16, n, mn, 0.f, A, m, mm, count);
      check(k::batched_ns_poly_init(P, A, m, count, a, b, st_), "newton_schulz5 (polynomial)");
      check(k::f32_to_bf16(A16, A, nmm, st_), "newton_schulz5 (bf16 A)");
      gemm_->run_batched(bf, false, true, m, m, m, c, A16, m, mm, A16, m, mm, 1.f, P, m, mm, count);
      check(k::f32_to_bf16(P16, P, nmm, st_), "newton_schulz5 (bf16 P)");
      if (tall)
        gemm_->run_batched(bf, false, false, n, m, m, 1.f, cur16, m, mn, P16, m, mm, 0.f, nxt, m, mn, count);
      else
        gemm_->run_batched(bf, false, false, m, n, m, 1.f, P16, m, mm, cur16, n, mn, 0.f, nxt, n, mn, count);
      std::swap(cur, nxt);
    }
  }

 private:
  struct Mirror {
    const char* base = nullptr;
    size_t bytes = 0;
    DeviceBuffer<uint16_t> bf16;  // bytes / 4 values, made on first use after a write
    bool valid = false;
  };
  Mirror* mirror_of(const void* p) {
    const char* c = static_cast<const char*>(p);
    for (auto& m : mirrors_)
      if (c >= m->base && c < m->base + m->bytes) return m.get();
    return nullptr;
  }
  // Any op writing through p invalidates the mirror holding p (the optimizer's updates, uploads of
  // a checkpoint, init): the next bf16 GEMM re-casts the weights, once.
  void touch(const void* p) {
    note_write();
    if (mirrors_.empty() || !p) return;
    if (Mirror* m = mirror_of(p)) m->valid = false;
  }
  // Where the `count` floats at w lie inside registered weights whose mirror is allocated: their place
  // in the mirror (an op that writes w may write its bf16 there too, and then leave `valid` as it
  // is); else nullptr.
  uint16_t* mirror_copy(const float* w, size_t count) {
    Mirror* m = mirror_of(w);
    if (!m || !m->bf16.data() || reinterpret_cast<const char*>(w + count) > m->base + m->bytes) return nullptr;
    return m->bf16.data() + (reinterpret_cast<const char*>(w) - m->base) / sizeof(float);
  }
  // An op about to write the `count` floats at w and, where mirror_copy gives a place, their bf16
  // there too: the place (or nullptr), after noting the write (the mirror stays as valid as it was
  // where the op writes both, and goes stale where it does not).
  uint16_t* write_with_mirror(float* w, size_t count) {
    uint16_t* w16 = mirror_copy(w, count);
    w16 ? note_write() : touch(w);
    return w16;
  }
  // write_with_mirror for each tensor of a multi-tensor op: the places, in w16_ (nullptr entries
  // where a tensor has none).
  uint16_t* const* mirror_copies(const OptimTensor* t, size_t count) {
    w16_.resize(count);
    for (size_t i = 0; i < count; ++i) w16_[i] = write_with_mirror(t[i].w, t[i].n);
    return w16_.data();
  }
  // The bf16 copy of the `count` floats at X, if X lies inside registered weights; else nullptr.
  const uint16_t* mirrored(const float* X, size_t count) {
    Mirror* m = mirror_of(X);
    if (!m || reinterpret_cast<const char*>(X + count) > m->base + m->bytes) return nullptr;
    const size_t n = m->bytes / sizeof(float);
    if (!m->valid) {
      m->bf16.reserve(n, "bf16 weight mirror");
      check(k::f32_to_bf16(m->bf16.data(), reinterpret_cast<const float*>(m->base), n, st_), "bf16 weight mirror");
      m->valid = true;
      ++mirror_casts_;
    }
    return m->bf16.data() + (reinterpret_cast<const char*>(X) - m->base) / sizeof(float);
  }

  // bf16 precision runs attention on the tensor cores (attention_tc.cu) where that kernel supports
  // the shape and the device (head_dim 64 or 128, enough shared memory); elsewhere the fp32 kernel.
  bool tc_attention(const AttnShape& s) const { return opt_.bf16 && k::attention_tc_supported(s); }

#if LADDER_HAVE_CUDNN
  // cuDNN's attention for this shape and these pointers, or nullptr (CudaOptions::cudnn_attention).
  // cuDNN is loaded on the first call; a shape is built (forward and backward plans) on its first
  // call. What cannot be used is said once on stderr: a missing library, a declined shape, a
  // pointer not 16-byte aligned (`ptrs`: the caller's pointers cuDNN itself reads or writes; the
  // ones that reach it through the backend's aligned bf16 scratch need no check).
  CudnnAttention* cudnn_attention(const AttnShape& s, std::initializer_list<const void*> ptrs) {
    if (!opt_.cudnn_attention || !opt_.bf16) return nullptr;
    if (!cudnn_ && cudnn_status_.empty()) {
      std::string why;
      cudnn_ = CudnnAttention::open(st_, !opt_.cudnn_nondeterministic, &why);
      cudnn_status_ = cudnn_ ? "cuDNN " + cudnn_->version() : "unavailable: " + why;
      if (!cudnn_) cudnn_note("cuDNN attention is on (run.attention or LADDER_ATTN_CUDNN), but cuDNN is " + cudnn_status_);
    }
    if (!cudnn_) return nullptr;
    const auto shape = [&] {
      return fmt::format("B={} S={} H={} KV={} hd={} window={}", s.B, s.S, s.H, s.KV, s.hd, s.window);
    };
    for (const void* p : ptrs)
      if (!aligned16(p)) {
        cudnn_note("cuDNN attention not used for " + shape() + ": a tensor is not 16-byte aligned");
        return nullptr;
      }
    std::string why;
    bool built_now = false;
    if (!cudnn_->supports(s, &why, &built_now)) {
      if (built_now) cudnn_note("cuDNN " + cudnn_->version() + " declined attention " + shape() + " (" + why + ")");
      return nullptr;
    }
    if (built_now)
      cudnn_note(fmt::format("cuDNN {} runs attention {} ({} backward; workspace {:.1f} MiB)", cudnn_->version(),
                             shape(), opt_.cudnn_nondeterministic ? "nondeterministic" : "deterministic",
                             double(cudnn_->workspace_bytes()) / (1 << 20)),
                 false);
    return cudnn_.get();
  }
  // Scratch of the cuDNN path, bf16: dout, dq, dk, dv (its backward's inputs and outputs in bf16)
  // and o (the fp32-activation ops' o in bf16: written by the forward before widening, cast from
  // the fp32 o for the backward). Each part 16-byte aligned; valid until the next call.
  struct CudnnGrads16 {
    uint16_t *dout, *dq, *dk, *dv, *o;
  };
  CudnnGrads16 cudnn_scratch(const AttnShape& s) {
    const auto up8 = [](size_t n) { return (n + 7) / 8 * 8; };
    const size_t nq = up8(size_t(s.B) * s.S * s.H * s.hd), nk = up8(size_t(s.B) * s.S * s.KV * s.hd);
    cudnn16_.reserve(3 * nq + 2 * nk, "cuDNN attention bf16 scratch");
    uint16_t* p = cudnn16_.data();
    return {p, p + nq, p + 2 * nq, p + 2 * nq + nk, p + 2 * nq + 2 * nk};
  }
  // cuDNN's backward on bf16 q, k, v, o. Its gradients are bf16 like its inputs: dout rounded to
  // bf16 on the way in, dq, dk, dv widened into the contract's fp32 outputs (with a bf16 rounding in
  // them that Ladder's kernels, writing fp32, do not have).
  void cudnn_backward(CudnnAttention* c, float* dq, float* dk, float* dv, const float* dout, const uint16_t* q,
                      const uint16_t* k, const uint16_t* v, const uint16_t* o, const float* lse, const AttnShape& s) {
    const size_t nq = size_t(s.B) * s.S * s.H * s.hd, nk = size_t(s.B) * s.S * s.KV * s.hd;
    const CudnnGrads16 b = cudnn_scratch(s);
    check(k::f32_to_bf16(b.dout, dout, nq, st_), "cudnn attention backward (bf16 dout)");
    c->backward(b.dq, b.dk, b.dv, b.dout, q, k, v, o, lse, s);
    ++cudnn_calls_;
    post("cudnn attention backward");
    check(k::bf16_to_f32(dq, b.dq, nq, st_), "cudnn attention backward (dq)");
    check(k::bf16_to_f32(dk, b.dk, nk, st_), "cudnn attention backward (dk)");
    check(k::bf16_to_f32(dv, b.dv, nk, st_), "cudnn attention backward (dv)");
  }
  // On stderr once per distinct message (a run's logs then say which attention ran).
  void cudnn_note(const std::string& msg, bool fallback = true) {
    if (cudnn_notes_.insert(msg).second)
      std::fprintf(stderr, "%s%s\n", msg.c_str(), fallback ? "; Ladder's attention kernels run instead" : "");
  }
#endif

  // q, k, v rounded to bf16 (nearest even) into one scratch buffer, each part 16-byte aligned (cp.async),
  // valid until the next call.
  struct AttnIn16 {
    const uint16_t *q, *k, *v;
  };
  AttnIn16 attn_in16(const float* q, const float* k, const float* v, const AttnShape& s) {
    const auto up8 = [](size_t n) { return (n + 7) / 8 * 8; };
    const size_t nq = size_t(s.B) * s.S * s.H * s.hd, nk = size_t(s.B) * s.S * s.KV * s.hd;
    attn16_.reserve(up8(nq) + 2 * up8(nk), "attention bf16 inputs");
    uint16_t* const q16 = attn16_.data();
    uint16_t* const k16 = q16 + up8(nq);
    uint16_t* const v16 = k16 + up8(nk);
    check(k::f32_to_bf16(q16, q, nq, st_), "attention (bf16 q)");
    check(k::f32_to_bf16(k16, k, nk, st_), "attention (bf16 k)");
    check(k::f32_to_bf16(v16, v, nk, st_), "attention (bf16 v)");
    return {q16, k16, v16};
  }

  void post(const char* op) {
    note_write();
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
  void check_pko(int hd, int from_dim) {
    if (from_dim < 0 || from_dim > hd) fail("pko_shift: from_dim {} is outside [0, head_dim {}]", from_dim, hd);
  }
  void check_qk_prep(const char* op, int S, int hd, int rot) {
    if (S < 1) fail("{}: sequence length must be >= 1 (got {})", op, S);
    if (rot < 0 || rot > hd) fail("{}: rope dims {} outside [0, head_dim {}]", op, rot, hd);
  }
  // The argument checks of both qk_prep backwards (fp32 and bf16 x) and their scratch: the per-row
  // gain partials when a learned gain's gradient is asked for (with_gain), else none (nullptr).
  float* qk_prep_backward_scratch(const char* op, int N_tok, int S, int nh, int hd, int rot, bool with_gain) {
    check_qk_prep(op, S, hd, rot);
    if (!with_gain) return nullptr;
    if (!k::qk_prep_backward_supported(hd))
      fail("{} on CUDA supports head_dim up to 1536 with a learned QK-norm gain (got {})", op, hd);
    float_scratch_.reserve(k::qk_prep_backward_scratch_floats(N_tok, nh, hd), "qk prep backward scratch");
    return float_scratch_.data();
  }
  // Both attention backwards (fp32 and bf16 inputs): the shape checks and the scratch of the kernel
  // family tc_attention(s) picks, the forward's condition, so both passes use one family.
  float* attention_backward_scratch(const AttnShape& s) {
    check_attn(s);
    float_scratch_.reserve(tc_attention(s) ? k::attention_tc_backward_scratch_floats(s)
                                           : k::attention_backward_scratch_floats(s),
                           "attention backward scratch");
    return float_scratch_.data();
  }
  void check_heads(const char* op, int H, int KV) {
    if (KV <= 0 || H % KV != 0) fail("{}: n_heads {} is not a multiple of n_kv_heads {}", op, H, KV);
  }
  // The optimizer reductions' per-block partials, plus two more doubles after them: muonh_apply's
  // ||D||^2 and ||w||^2. (Newton-Schulz has its own per-matrix buffer, ns_sums_.)
  size_t optim_partials_count() const { return size_t(k::optim_reduce_blocks()); }
  double* optim_partials() {
    optim_scratch_.reserve(optim_partials_count() + 2, "optimizer reduction scratch");
    return optim_scratch_.data();
  }
  // A multi-tensor op's device table: segments (a tensor for AdamW and the sums of squares, a matrix
  // for AdamH), the segment of every block, the per-block partials (AdamH, sums of squares) and
  // AdamH's per-segment sums and scalars.
  enum class TableKind { AdamW, AdamH, SumSquares };
  struct OptimTable {
    std::vector<OptimTensor> key;  // the descriptor list it was built from
    std::vector<uint16_t*> w16;    // the mirror copies it was built with (empty: none)
    TableKind kind = TableKind::AdamW;
    int nseg = 0, nblocks = 0;
    DeviceBuffer<k::OptSeg> segs;
    DeviceBuffer<int> block_seg;
    DeviceBuffer<double> partials, sums;
    DeviceBuffer<float> scal;
  };
  // w16: the mirror copy of each tensor (count pointers, nullptr where none), or nullptr.
  static_assert(k::kOptMaxGroups == kMaxOptimizerGroups, "plan_groups refuses more groups than the kernels take");
  OptimTable& optim_table(const OptimTensor* t, size_t count, TableKind kind, int ngroups, uint16_t* const* w16) {
    if (ngroups > k::kOptMaxGroups)
      fail("multi-tensor optimizer step on CUDA: {} parameter groups, at most {} supported", ngroups,
           k::kOptMaxGroups);
    const bool hyper = kind == TableKind::AdamH;
    // The table's w16 is empty where no tensor has a mirror place, else the count places (the
    // lookup compares in place: nothing is allocated on a step that finds its table).
    if (w16 && std::none_of(w16, w16 + count, [](uint16_t* p) { return p != nullptr; })) w16 = nullptr;
    const auto same_w16 = [&](const OptimTable& tb) {
      return w16 ? tb.w16.size() == count && std::equal(tb.w16.begin(), tb.w16.end(), w16) : tb.w16.empty();
    };
    for (auto& tb : optim_tables_)
      if (tb->kind == kind && tb->key.size() == count && std::equal(tb->key.begin(), tb->key.end(), t) &&
          same_w16(*tb))
        return *tb;
    // A new list (in training: once per op, at the first step). Bounded, in case a caller passes a
    // different list every call: the oldest table goes (after the stream is done with it).
    if (optim_tables_.size() >= 8) {
      synchronize();
      optim_tables_.erase(optim_tables_.begin());
    }
    auto tb = std::make_unique<OptimTable>();
    tb->key.assign(t, t + count);
    if (w16) tb->w16.assign(w16, w16 + count);
    tb->kind = kind;
    const size_t chunk = k::optim_multi_chunk();
    std::vector<k::OptSeg> segs;
    std::vector<int> block_seg;
    auto add = [&](float* w, const float* g, float* m, float* v, size_t n, const float* radius, int group,
                   uint16_t* w16_seg) {
      const size_t nb = std::max<size_t>(1, (n + chunk - 1) / chunk);
      if (block_seg.size() + nb > size_t(std::numeric_limits<int>::max()))
        fail("multi-tensor optimizer step on CUDA: more than 2^31 blocks");
      k::OptSeg s{w, g, m, v, n, radius, group, int(block_seg.size()), int(nb), w16_seg};
      block_seg.insert(block_seg.end(), nb, int(segs.size()));
      segs.push_back(s);
    };
    for (size_t i = 0; i < count; ++i) {
      const OptimTensor& x = t[i];
      if (x.group < 0 || x.group >= ngroups) fail("multi-tensor optimizer step: group {} of {}", x.group, ngroups);
      if (!hyper) {
        add(x.w, x.g, x.m, x.v, x.n, nullptr, x.group, w16 ? w16[i] : nullptr);
        continue;
      }
      if (x.nmat <= 0 || x.n % size_t(x.nmat) != 0 || !x.radius)
        fail("adamh_multi: a tensor of {} elements is not {} matrices with radii", x.n, x.nmat);
      const size_t mn = x.n / size_t(x.nmat);
      for (int64_t e = 0; e < x.nmat; ++e) {
        const size_t off = size_t(e) * mn;
        add(x.w + off, x.g + off, x.m + off, x.v + off, mn, x.radius + e, x.group,
            w16 && w16[i] ? w16[i] + off : nullptr);
      }
    }
    tb->nseg = int(segs.size());
    tb->nblocks = int(block_seg.size());
    tb->segs = DeviceBuffer<k::OptSeg>(segs.size(), "optimizer segment table");
    tb->segs.upload(segs);
    tb->block_seg = DeviceBuffer<int>(block_seg.size(), "optimizer block table");
    tb->block_seg.upload(block_seg);
    if (kind == TableKind::SumSquares) tb->partials = DeviceBuffer<double>(block_seg.size(), "sum of squares partials");
    if (hyper) {
      tb->partials = DeviceBuffer<double>(block_seg.size(), "adamh partial sums");
      tb->sums = DeviceBuffer<double>(2 * segs.size(), "adamh norms");
      tb->scal = DeviceBuffer<float>(2 * segs.size(), "adamh step and rescale factors");
    }
    optim_tables_.push_back(std::move(tb));
    return *optim_tables_.back();
  }
  double fetch_sum() {
    LADDER_CUDA_CHECK(cudaMemcpyAsync(host_sums_, sums_.data(), sizeof(double), cudaMemcpyDeviceToHost, st_));
    synchronize();
    return host_sums_[0];
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
  std::unique_ptr<DeviceCollectives> collectives_;  // NCCL, made at the first data-parallel sum
  std::unique_ptr<LtGemm> gemm_;
  DeviceBuffer<char> emb_scratch_;
  // bf16 GEMM operands (CudaOptions::bf16): the last cast of each side, and what it was cast from.
  // Consecutive GEMMs often read the same activation (q/k/v projections read h1, the gate and up
  // projections h2, both head GEMMs one logits chunk, a weight gradient and the data gradient
  // d(out)); the cast is reused while no op but GEMMs has run since (writes_ unchanged: every other
  // op, copy, upload and zero passes through post() or touch()), no GEMM wrote over its source and
  // no device memory was allocated, freed or written outside the backend (device_memory_epoch).
  // The reuse is exact: the same cast of the same values.
  struct CastCache {
    DeviceBuffer<uint16_t> bf16;
    const float* src = nullptr;
    int rows = 0, cols = 0, ld = 0;
    uint64_t at = 0, epoch = 0;
    bool holds(const float* X, int r, int c, int l, uint64_t writes) const {
      return src && X == src && r == rows && c == cols && l == ld && at == writes && epoch == device_memory_epoch();
    }
    void keep(const float* X, int r, int c, int l, uint64_t writes) {
      src = X, rows = r, cols = c, ld = l, at = writes, epoch = device_memory_epoch();
    }
    void forget_if_overlaps(const char* c0, const char* c1) {
      if (!src) return;
      const char* s0 = reinterpret_cast<const char*>(src);
      const char* s1 = reinterpret_cast<const char*>(src + size_t(rows - 1) * ld + cols);
      if (c0 < s1 && s0 < c1) src = nullptr;
    }
  };
  CastCache cast_a_, cast_b_;
  // upload()'s ring of pinned staging slots (one allocation, on first use).
  static constexpr size_t kStageBytes = size_t(1) << 20;
  static constexpr int kStageSlots = 8;
  struct Stage {
    void* host = nullptr;
    cudaEvent_t done = nullptr;
  };
  void* stage_pinned_ = nullptr;
  Stage stage_[kStageSlots];
  int stage_next_ = 0;
  DeviceBuffer<float> a_wide_, b_wide_;  // bf16 A / B under fp32 / TF32 GEMMs: widened
  DeviceBuffer<float> d_wide_;  // a bf16 output under fp32 / TF32 GEMMs: the fp32 result it is rounded from
  uint64_t writes_ = 0;     // ops other than a bf16 GEMM's own steps (see CastCache)
  bool in_gemm_ = false;    // inside gemm(): its own cast, touch and post do not count
  uint64_t cast_reuses_ = 0;
  uint64_t mirror_casts_ = 0;
  void note_write() {
    if (!in_gemm_) ++writes_;
  }
  struct InGemm {
    CudaBackendImpl& b;
    explicit InGemm(CudaBackendImpl& be) : b(be) { b.in_gemm_ = true; }
    ~InGemm() { b.in_gemm_ = false; }
  };
  std::vector<std::unique_ptr<Mirror>> mirrors_;  // bf16 copies of registered weights
  DeviceBuffer<float> float_scratch_;
  DeviceBuffer<double> row_sums_, sums_, ssq_scratch_;
  DeviceBuffer<double> optim_scratch_;  // optim_partials()
  std::vector<std::unique_ptr<OptimTable>> optim_tables_;  // adamw_multi / adamh_multi / sum_squares_multi tables
  std::vector<uint16_t*> w16_;                              // mirror_copies: this call's places
  std::vector<OptimTensor> ssq_list_;                       // sum_squares_multi: this call's list
  DeviceBuffer<float> ns_work_;         // newton_schulz5: Y, A, P (per matrix of a chunk)
  DeviceBuffer<uint16_t> ns_work16_;    // newton_schulz5 under bf16 GEMMs: bf16 iterate, A, P
  DeviceBuffer<double> ns_sums_;        // newton_schulz5: per-matrix norms, then their partials
  DeviceBuffer<double> muonh_sums_;     // muonh_apply_batched: per-matrix sums, then partials
  DeviceBuffer<char> moe_scratch_;      // moe_sort (CUB + keys), moe_quantile_beta (transposed keys)
  DeviceBuffer<int32_t> moe_tiles_;     // grouped_gemm: per-expert row-tile prefix [E+1]
  DeviceBuffer<uint16_t> attn16_;       // attn_in16: q, k, v in bf16
  uint64_t cudnn_calls_ = 0;            // cudnn_attention_calls()
#if LADDER_HAVE_CUDNN
  std::unique_ptr<CudnnAttention> cudnn_;  // loaded on first use
  std::string cudnn_status_;
  std::set<std::string> cudnn_notes_;
  DeviceBuffer<uint16_t> cudnn16_;      // cudnn_scratch()
#endif
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
  int count = 0;
  LADDER_CUDA_CHECK(cudaGetDeviceCount(&count));
  DeviceInfo d;
  d.index = rank_device(count);
  cudaDeviceProp prop{};
  LADDER_CUDA_CHECK(cudaGetDeviceProperties(&prop, d.index));
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
  if (env_flag("LADDER_CUDA_BF16")) opt.bf16 = true;
  // LADDER_ATTN_CUDNN only turns cuDNN attention on, like the two above: "1" (deterministic backward)
  // or "nondeterministic"; "0" or empty leaves `opt` as it is; anything else is an error.
  if (const char* v = std::getenv("LADDER_ATTN_CUDNN"); v && *v && std::string(v) != "0") {
    const std::string mode = v;
    if (mode != "1" && mode != "nondeterministic")
      fail("LADDER_ATTN_CUDNN='{}': expected 1 (cuDNN attention, deterministic backward), nondeterministic "
           "(its atomic-dQ backward) or 0", mode);
    opt.cudnn_attention = true;
    opt.cudnn_nondeterministic = mode == "nondeterministic";
  }
  return std::make_unique<CudaBackendImpl>(info, opt);
}

}  // namespace cuda

std::unique_ptr<Backend> make_cuda_backend(const std::string& precision, const std::string& attention) {
  if (precision != "fp32" && precision != "tf32" && precision != "bf16")
    fail("--device cuda: precision '{}' is not known (expected fp32, tf32 or bf16)", precision);
  if (attention != "ladder" && attention != "cudnn" && attention != "cudnn-nondeterministic")
    fail("--device cuda: attention '{}' is not known (expected ladder, cudnn or cudnn-nondeterministic)", attention);
  cuda::CudaOptions opt;
  opt.tf32 = precision == "tf32";
  opt.bf16 = precision == "bf16";
  opt.cudnn_attention = attention != "ladder";
  opt.cudnn_nondeterministic = attention == "cudnn-nondeterministic";
  return cuda::make_backend(opt);
}

}  // namespace ladder
