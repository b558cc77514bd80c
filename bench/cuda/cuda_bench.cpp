// GPU micro-benchmark (scripts/gpu-check.sh runs it): the cuBLASLt GEMM ceiling in fp32, TF32 and
// bf16 (fp32 accumulation) at 4096^3 and 8192^3, a device-to-device copy for the bandwidth ceiling,
// and the fp32 flash attention forward/backward at d=1024-like shapes, and the tensor-core (bf16)
// attention forward/backward at B=8 S=2048 H=16, head_dim 64 and 128, causal (WMMA kernels, and with
// LADDER_BENCH_ATTN_MMA=1 the same rows for the mma.sync kernels), and Muon's
// Newton-Schulz over a 64-expert stack, per matrix against batched, and the memory-bound ops (QK
// prep, SwiGLU, casts, RMSNorm, the MoE permutation) as TB/s against the copy, each also on its scalar
// reference path (" ref" rows); cuDNN's fused attention (LADDER_ATTN_CUDNN's path, rows "... cudnn"
// and, with its nondeterministic backward, "... cudnn-nd",
// where the build compiled it and libcudnn loads) through the backend's bf16 attention ops at the
// tensor-core rows' shapes (LADDER_BENCH_CUDNN=0 skips them: gpu-check sets it where cuDNN's tests did
// not pass, since a cuDNN fault would end this benchmark). Random data (never zeros),
// warm-up first, CUDA events around each repetition, the median reported. Prints a table last.
//   ladder_cuda_bench [--quick]     (--quick: 4096^3 GEMMs, one attention and one Newton-Schulz shape only)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_memory.h"
#include "backend/cuda/attention_tc.cuh"
#include "backend/cuda/attention_wgmma.cuh"
#include "backend/cuda/kernels.cuh"
#include "backend/cuda/lt_gemm.h"

using namespace ladder;
using namespace ladder::cuda;

namespace {

struct Row {
  std::string what, shape;
  double ms, rate;
  const char* unit;
};

// Median milliseconds of `reps` timed runs of fn after `warm` untimed ones.
double time_ms(cudaStream_t st, int warm, int reps, const std::function<void()>& fn) {
  for (int i = 0; i < warm; ++i) fn();
  LADDER_CUDA_CHECK(cudaStreamSynchronize(st));
  cudaEvent_t a, b;
  LADDER_CUDA_CHECK(cudaEventCreate(&a));
  LADDER_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    LADDER_CUDA_CHECK(cudaEventRecord(a, st));
    fn();
    LADDER_CUDA_CHECK(cudaEventRecord(b, st));
    LADDER_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    LADDER_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// A memory-bound op timed as a rate: `bytes` read + written per call (each tensor counted once, as
// if every reuse hit the cache), against the d2d copy's TB/s. Each op is timed twice: as the backend
// runs it, then with k::set_reference_paths(true) (row name + " ref": the scalar kernels the fast
// paths replaced, bitwise the same results), so one run measures what the fast paths gain.
struct BandwidthRow {
  const char* what;
  std::string shape;
  double bytes;
  std::function<void()> fn;
};

void time_bandwidth_rows(cudaStream_t st, const std::vector<BandwidthRow>& list, std::vector<Row>& rows) {
  for (const auto& r : list)
    for (bool ref : {false, true}) {
      k::set_reference_paths(ref);
      const double ms = time_ms(st, 2, 10, r.fn);
      k::set_reference_paths(false);
      const std::string what = std::string(r.what) + (ref ? " ref" : "");
      rows.push_back({what, r.shape, ms, r.bytes / (ms * 1e-3) / 1e12, "TB/s"});
      std::printf("%-26s %-22s %9.3f ms %8.2f TB/s\n", what.c_str(), r.shape.c_str(), ms, rows.back().rate);
    }
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  try {
    const DeviceInfo dev = probe_device();
    std::printf("device: %s, sm_%d%d, %d SMs, %.1f GiB\n", dev.name.c_str(), dev.cc_major, dev.cc_minor,
                dev.sm_count, dev.total_mem / 1073741824.0);
    auto be = make_backend();
    cudaStream_t st = be->stream();
    std::vector<Row> rows;

    // Copy bandwidth: 2 GiB device to device, bytes read + written.
    {
      const size_t n = size_t(512) << 20;  // floats
      DeviceBuffer<float> a(n, "copy src"), b(n, "copy dst");
      LADDER_CUDA_CHECK(k::fill_uniform(a.data(), n, 1, -1.f, 1.f, st));
      const double ms = time_ms(st, 2, 10, [&] { copy_d2d_async(b.data(), a.data(), n * 4, st); });
      rows.push_back({"d2d copy", "2 GiB", ms, 2.0 * n * 4 / (ms * 1e-3) / 1e12, "TB/s"});
      std::printf("%-22s %-26s %9.3f ms %8.2f TB/s\n", "d2d copy", "2 GiB", ms, rows.back().rate);
    }

    // GEMM ceiling: C[n,n] = A[n,n] B[n,n]^T (the model's x W^T form).
    LtGemm lt(st);
    std::vector<int> sizes = quick ? std::vector<int>{4096} : std::vector<int>{4096, 8192};
    for (int n : sizes) {
      const size_t nn = size_t(n) * n;
      DeviceBuffer<float> A(nn, "gemm A"), B(nn, "gemm B"), C(nn, "gemm C");
      DeviceBuffer<uint16_t> Ah(nn, "gemm A bf16"), Bh(nn, "gemm B bf16"), Ch(nn, "gemm C bf16");
      LADDER_CUDA_CHECK(k::fill_uniform(A.data(), nn, 2, -1.f, 1.f, st));
      LADDER_CUDA_CHECK(k::fill_uniform(B.data(), nn, 3, -1.f, 1.f, st));
      LADDER_CUDA_CHECK(k::f32_to_bf16(Ah.data(), A.data(), nn, st));
      LADDER_CUDA_CHECK(k::f32_to_bf16(Bh.data(), B.data(), nn, st));
      const double flop = 2.0 * n * double(n) * n;
      const std::string shape = std::to_string(n) + "^3";
      struct V {
        const char* name;
        GemmType t;
        const void *a, *b;
        void* c;
        bool cb;
      } vs[] = {{"gemm fp32", GemmType::F32, A.data(), B.data(), C.data(), false},
                {"gemm tf32", GemmType::TF32, A.data(), B.data(), C.data(), false},
                {"gemm bf16 (fp32 acc)", GemmType::BF16, Ah.data(), Bh.data(), Ch.data(), true}};
      for (auto& v : vs) {
        const int reps = n >= 8192 ? 10 : 20;
        const double ms = time_ms(st, 3, reps, [&] {
          lt.run(v.t, false, true, n, n, n, 1.f, v.a, n, v.b, n, 0.f, v.c, n, v.cb);
        });
        rows.push_back({v.name, shape, ms, flop / (ms * 1e-3) / 1e12, "TFLOP/s"});
        std::printf("%-22s %-26s %9.3f ms %8.1f TFLOP/s\n", v.name, shape.c_str(), ms, rows.back().rate);
      }
    }

    // Attention, fp32 flash kernels: d_model 1024 as 16 heads x 64, causal; GQA and a window too.
    struct A {
      int B, S, H, KV, hd, W;
    };
    std::vector<A> shapes = {{8, 2048, 16, 16, 64, 0}};
    if (!quick) {
      shapes.push_back({8, 2048, 16, 4, 64, 0});
      shapes.push_back({8, 2048, 16, 4, 64, 512});
      shapes.push_back({4, 2048, 8, 8, 128, 0});
    }
    for (const auto& a : shapes) {
      const AttnShape s{a.B, a.S, a.H, a.KV, a.hd, a.W, 1.0 / std::sqrt(double(a.hd))};
      const size_t nq = size_t(a.B) * a.S * a.H * a.hd, nk = size_t(a.B) * a.S * a.KV * a.hd;
      DeviceBuffer<float> q(nq), k(nk), v(nk), o(nq), lse(size_t(a.B) * a.H * a.S), dout(nq), dq(nq), dk(nk),
          dv(nk);
      LADDER_CUDA_CHECK(k::fill_uniform(q.data(), nq, 4, -1.f, 1.f, st));
      LADDER_CUDA_CHECK(k::fill_uniform(k.data(), nk, 5, -1.f, 1.f, st));
      LADDER_CUDA_CHECK(k::fill_uniform(v.data(), nk, 6, -1.f, 1.f, st));
      LADDER_CUDA_CHECK(k::fill_uniform(dout.data(), nq, 7, -1.f, 1.f, st));
      // Visible (query, key) pairs, counted exactly: causal with an optional window.
      double pairs = 0;
      for (int i = 0; i < a.S; ++i) pairs += a.W > 0 ? std::min(i + 1, a.W) : i + 1;
      const double fwd_flop = 4.0 * a.B * a.H * pairs * a.hd;  // QK^T and PV
      char shape[96];
      std::snprintf(shape, sizeof shape, "B%d S%d H%d KV%d hd%d W%d", a.B, a.S, a.H, a.KV, a.hd, a.W);
      const double fms = time_ms(st, 2, 5, [&] {
        be->attention_forward(o.data(), lse.data(), q.data(), k.data(), v.data(), s);
      });
      rows.push_back({"attn fwd fp32", shape, fms, fwd_flop / (fms * 1e-3) / 1e12, "TFLOP/s"});
      std::printf("%-22s %-26s %9.3f ms %8.2f TFLOP/s\n", "attn fwd fp32", shape, fms, rows.back().rate);
      // Backward: 2.5x the forward's FLOPs by the usual count (5 products against 2); the kernels
      // recompute P twice, so the hardware does more.
      const double bms = time_ms(st, 2, 5, [&] {
        be->attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(), o.data(),
                               lse.data(), s);
      });
      rows.push_back({"attn bwd fp32", shape, bms, 2.5 * fwd_flop / (bms * 1e-3) / 1e12, "TFLOP/s"});
      std::printf("%-22s %-26s %9.3f ms %8.2f TFLOP/s\n", "attn bwd fp32", shape, bms, rows.back().rate);
    }

    // Tensor-core attention (attention_tc.cu: bf16 MMA inputs, fp32 accumulation), causal, no window.
    // FLOPs counted as for the fp32 rows: the causal half only (visible pairs S(S+1)/2 per head),
    // forward 4 * pairs * hd (QK^T and PV), backward 2.5x that (5 products; the kernels do 7: QK^T and
    // dO V^T are recomputed by both the dK/dV and the dQ kernel).
    // MHA, then the d=1024 presets' GQA (16 query heads on 4 KV heads: the model's attention rows).
#if LADDER_HAVE_CUDNN
    // cuDNN attention behind the backend's bf16 ops (what the model calls with LADDER_ATTN_CUDNN=1):
    // the backward's times include its dO cast to bf16 and the three gradients' widening.
    // Both backward modes: "cudnn" (deterministic: cuDNN may decline it, see attention_cudnn.h) and
    // "cudnn-nd" (its atomic dQ).
    std::unique_ptr<CudaBackend> dnns[2];
    const char* env_dnn = std::getenv("LADDER_BENCH_CUDNN");
    const bool with_dnn = !(env_dnn && std::string(env_dnn) == "0");
    if (!with_dnn)
      std::printf("attn cudnn rows skipped: LADDER_BENCH_CUDNN=0 (cuDNN's tests did not pass in this run)\n");
    for (int i = 0; i < 2 && with_dnn; ++i) {
      CudaOptions o;
      o.bf16 = true;
      o.cudnn_attention = true;
      o.cudnn_nondeterministic = i == 1;
      dnns[i] = make_backend(o);
    }
#endif
    std::vector<A> tc_shapes = {{8, 2048, 16, 16, 64, 0}, {8, 2048, 16, 4, 64, 0}};
    if (!quick) tc_shapes.push_back({8, 2048, 16, 16, 128, 0});
    for (const auto& a : tc_shapes) {
      const AttnShape s{a.B, a.S, a.H, a.KV, a.hd, a.W, 1.0 / std::sqrt(double(a.hd))};
      char shape[96];
      std::snprintf(shape, sizeof shape, "B%d S%d H%d KV%d hd%d W%d", a.B, a.S, a.H, a.KV, a.hd, a.W);
      if (!k::attention_tc_supported(s)) {
        std::printf("%-22s %-26s not supported on this device\n", "attn tc bf16", shape);
        continue;
      }
      const size_t nq = size_t(a.B) * a.S * a.H * a.hd, nk = size_t(a.B) * a.S * a.KV * a.hd;
      DeviceBuffer<float> q(nq), k(nk), v(nk), o(nq), lse(size_t(a.B) * a.H * a.S), dout(nq), dq(nq), dk(nk),
          dv(nk), scratch(k::attention_tc_backward_scratch_floats(s));
      LADDER_CUDA_CHECK(k::fill_uniform(q.data(), nq, 14, -1.f, 1.f, st));
      LADDER_CUDA_CHECK(k::fill_uniform(k.data(), nk, 15, -1.f, 1.f, st));
      LADDER_CUDA_CHECK(k::fill_uniform(v.data(), nk, 16, -1.f, 1.f, st));
      LADDER_CUDA_CHECK(k::fill_uniform(dout.data(), nq, 17, -1.f, 1.f, st));
      const double pairs = double(a.S) * (a.S + 1) / 2;
      const double fwd_flop = 4.0 * a.B * a.H * pairs * a.hd;
      auto fwd = [&] { LADDER_CUDA_CHECK(k::attention_tc_forward(o.data(), lse.data(), q.data(), k.data(), v.data(), s, st)); };
      auto bwd = [&] {
        LADDER_CUDA_CHECK(k::attention_tc_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                                                   v.data(), o.data(), lse.data(), s, scratch.data(), st));
      };
      // bf16 inputs and output (model.attn_bf16): the launchers' other entry points, where the mma
      // forward stages K and V by cp.async (16-byte aligned bf16) instead of through registers.
      DeviceBuffer<uint16_t> q16(nq), k16(nk), v16(nk), o16(nq);
      LADDER_CUDA_CHECK(k::f32_to_bf16(q16.data(), q.data(), nq, st));
      LADDER_CUDA_CHECK(k::f32_to_bf16(k16.data(), k.data(), nk, st));
      LADDER_CUDA_CHECK(k::f32_to_bf16(v16.data(), v.data(), nk, st));
      auto fwd16 = [&] {
        LADDER_CUDA_CHECK(
            k::attention_tc_forward_bf16(o16.data(), lse.data(), q16.data(), k16.data(), v16.data(), s, st));
      };
      auto bwd16 = [&] {
        LADDER_CUDA_CHECK(k::attention_tc_backward_bf16(dq.data(), dk.data(), dv.data(), dout.data(), q16.data(),
                                                        k16.data(), v16.data(), o16.data(), lse.data(), s,
                                                        scratch.data(), st));
      };
      // Both kernel families behind the launchers: the WMMA kernels, then the register-resident
      // mma.sync ones (attention_mma.cuh), the latter only with LADDER_BENCH_ATTN_MMA=1 (gpu-check
      // sets it once CudaAttentionMma.* has passed on this device: a kernel that faulted would end
      // this benchmark); each with fp32 inputs (the model's default: rows "... bf16", the MMA
      // precision) and with bf16 inputs (rows "... in16"); the launchers' choice is restored after.
      const k::AttnTcKernels saved = k::attention_tc_kernels();
      const char* env_mma = std::getenv("LADDER_BENCH_ATTN_MMA");
      const bool with_mma = env_mma && std::string(env_mma) == "1";
      // Then the wgmma kernels (rows "... wgmma ..."), with LADDER_BENCH_ATTN_WGMMA=1 (gpu-check: once
      // CudaAttentionWgmma.* passed) where they are available.
      const char* env_wg = std::getenv("LADDER_BENCH_ATTN_WGMMA");
      const bool with_wg = env_wg && std::string(env_wg) == "1" && k::attention_wgmma_available();
      for (const int family : {0, 1, 2}) {  // WMMA, mma.sync, wgmma
        const bool mma = family > 0, wg = family == 2;
        if ((mma && !with_mma) || (wg && !with_wg)) break;
        k::attention_tc_set_kernels(k::AttnTcKernels{mma, mma, wg, wg});
        for (const bool in16 : {false, true}) {
          const std::function<void()> f = in16 ? std::function<void()>(fwd16) : std::function<void()>(fwd);
          const std::function<void()> g = in16 ? std::function<void()>(bwd16) : std::function<void()>(bwd);
          if (in16) f();  // o16 for the backward (its D = dO . O reads it)
          const double fms = time_ms(st, 2, 5, f);
          const double bms = time_ms(st, 2, 5, g);
          const double tms = time_ms(st, 2, 5, [&] {
            f();
            g();
          });
          const std::string fam = wg ? "wgmma" : mma ? "mma" : "tc", ty = in16 ? "in16" : "bf16";
          const struct {
            std::string what;
            double ms, flop;
          } tr[] = {{"attn fwd " + fam + " " + ty, fms, fwd_flop},
                    {"attn bwd " + fam + " " + ty, bms, 2.5 * fwd_flop},
                    {"attn fwd+bwd " + fam + " " + ty, tms, 3.5 * fwd_flop}};
          for (const auto& t : tr) {
            rows.push_back({t.what, shape, t.ms, t.flop / (t.ms * 1e-3) / 1e12, "TFLOP/s"});
            std::printf("%-22s %-26s %9.3f ms %8.2f TFLOP/s\n", t.what.c_str(), shape, t.ms, rows.back().rate);
          }
        }
      }
      k::attention_tc_set_kernels(saved);
#if LADDER_HAVE_CUDNN
      for (int i = 0; i < 2 && with_dnn; ++i) {
        CudaBackend* dnn = dnns[i].get();
        const std::string fam = i ? "cudnn-nd" : "cudnn";
        const uint64_t c0 = dnn->cudnn_attention_calls();
        auto f = [&] { dnn->attention_forward_bf16(o16.data(), lse.data(), q16.data(), k16.data(), v16.data(), s); };
        auto g = [&] {
          dnn->attention_backward_bf16(dq.data(), dk.data(), dv.data(), dout.data(), q16.data(), k16.data(),
                                       v16.data(), o16.data(), lse.data(), s);
        };
        f();
        g();
        dnn->synchronize();
        if (dnn->cudnn_attention_calls() - c0 != 2) {
          std::printf("%-22s %-26s not run: %s\n", ("attn " + fam).c_str(), shape,
                      dnn->cudnn_attention_status().c_str());
          continue;
        }
        const cudaStream_t ds = dnn->stream();
        const double fms = time_ms(ds, 2, 5, f), bms = time_ms(ds, 2, 5, g);
        const double tms = time_ms(ds, 2, 5, [&] {
          f();
          g();
        });
        const struct {
          std::string what;
          double ms, flop;
        } tr[] = {{"attn fwd " + fam + " in16", fms, fwd_flop},
                  {"attn bwd " + fam + " in16", bms, 2.5 * fwd_flop},
                  {"attn fwd+bwd " + fam + " in16", tms, 3.5 * fwd_flop}};
        for (const auto& t : tr) {
          rows.push_back({t.what, shape, t.ms, t.flop / (t.ms * 1e-3) / 1e12, "TFLOP/s"});
          std::printf("%-22s %-26s %9.3f ms %8.2f TFLOP/s\n", t.what.c_str(), shape, t.ms, rows.back().rate);
        }
      }
#endif
    }
    be->synchronize();

    // Muon's Newton-Schulz over an expert stack: TF32 (run.precision tf32), E matrices one call each
    // against one batched call (strided-batched GEMMs); and batched on bf16 operands (run.precision
    // bf16). FLOPs: 5 steps of 4 m^2 n + 2 m^3 per
    // matrix (m = min(rows, cols), n = max), the GEMMs the CUDA backend runs.
    {
      CudaOptions o;
      o.tf32 = true;
      auto ns = make_backend(o);
      CudaOptions o16;
      o16.bf16 = true;
      auto ns16 = make_backend(o16);
      struct S {
        int E, r, c;
      };
      std::vector<S> ns_shapes = {{64, 512, 1024}};
      if (!quick) ns_shapes.push_back({64, 1024, 2048});
      for (const S& x : ns_shapes) {
        const size_t mn = size_t(x.r) * x.c, n = mn * size_t(x.E);
        DeviceBuffer<float> X(n, "Newton-Schulz stack");
        const double m = std::min(x.r, x.c), nn = std::max(x.r, x.c);
        const double flop = x.E * 5.0 * (4 * m * m * nn + 2 * m * m * m);
        char shape[96];
        std::snprintf(shape, sizeof shape, "E%d %dx%d", x.E, x.r, x.c);
        // Fresh random input per repetition would time the fill; NS of its own output stays finite
        // (orthogonalized matrices are normalized again), so the repetitions reuse X.
        LADDER_CUDA_CHECK(k::fill_uniform(X.data(), n, 21, -1.f, 1.f, ns->stream()));
        const double lms = time_ms(ns->stream(), 1, 5, [&] {
          for (int e = 0; e < x.E; ++e) ns->newton_schulz5(X.data() + size_t(e) * mn, x.r, x.c);
        });
        const double bms = time_ms(ns->stream(), 1, 5, [&] { ns->newton_schulz5_batched(X.data(), x.r, x.c, x.E); });
        ns->synchronize();
        const double b16 =
            time_ms(ns16->stream(), 1, 5, [&] { ns16->newton_schulz5_batched(X.data(), x.r, x.c, x.E); });
        ns16->synchronize();
        const struct {
          const char* what;
          double ms;
        } nr[] = {{"ns5 per matrix tf32", lms}, {"ns5 batched tf32", bms}, {"ns5 batched bf16", b16}};
        for (const auto& t : nr) {
          rows.push_back({t.what, shape, t.ms, flop / (t.ms * 1e-3) / 1e12, "TFLOP/s"});
          std::printf("%-22s %-26s %9.3f ms %8.2f TFLOP/s\n", t.what, shape, t.ms, rows.back().rate);
        }
      }
      ns->synchronize();
    }

    // Memory-bound ops at the d=2048 presets' sizes (8192 tokens): rate = bytes read + written per
    // second, against the d2d copy above. qk_prep: PKO-free q path (16 heads of 128, learned gain).
    {
      const int N = 8192, H = 16, hd = 128, S = 2048, I = 5632;
      const size_t nq = size_t(N) * H * hd, ni = size_t(N) * I;
      DeviceBuffer<float> x(nq, "qk x"), out(nq, "qk out"), rstd(size_t(N) * H, "qk rstd"), gain(hd, "qk gain"),
          dgain(hd, "qk dgain"), dx(nq, "qk dx");
      LADDER_CUDA_CHECK(k::fill_uniform(x.data(), nq, 31, -1.f, 1.f, st));
      LADDER_CUDA_CHECK(k::fill_uniform(gain.data(), hd, 32, 0.5f, 1.5f, st));
      DeviceBuffer<float> g(ni, "swiglu g"), u(ni, "swiglu u"), h(ni, "swiglu h");
      DeviceBuffer<uint16_t> g16(ni, "swiglu g bf16"), u16(ni, "swiglu u bf16"), h16(ni, "swiglu h bf16");
      LADDER_CUDA_CHECK(k::fill_uniform(g.data(), ni, 33, -2.f, 2.f, st));
      LADDER_CUDA_CHECK(k::fill_uniform(u.data(), ni, 34, -2.f, 2.f, st));
      be->to_bf16(g16.data(), g.data(), ni);
      be->to_bf16(u16.data(), u.data(), ni);
      const double qkb = 2.0 * nq * 4, qkbb = 3.0 * nq * 4;  // fwd: x in, out; bwd: dout, x in, dx out
      DeviceBuffer<float> dg(ni, "swiglu dg"), du(ni, "swiglu du");
      time_bandwidth_rows(st, {
          {"qk_prep fwd", "8192 x 16 x 128", qkb,
           [&] { be->qk_prep_forward(out.data(), rstd.data(), x.data(), gain.data(), nullptr, N, S, H, hd, hd, 5e5f, true, 1e-6f); }},
          {"qk_prep bwd", "8192 x 16 x 128", qkbb,
           [&] { be->qk_prep_backward(dx.data(), dgain.data(), out.data(), x.data(), gain.data(), rstd.data(), nullptr, N, S,
                                      H, hd, hd, 5e5f, true); }},
          {"swiglu fwd fp32", "8192 x 5632", 3.0 * ni * 4, [&] { be->swiglu_forward(h.data(), g.data(), u.data(), ni); }},
          {"swiglu fwd bf16", "8192 x 5632", 3.0 * ni * 2,
           [&] { be->swiglu_forward_bf16(h16.data(), g16.data(), u16.data(), ni); }},
          {"to_bf16", "8192 x 5632", ni * 6.0, [&] { be->to_bf16(h16.data(), g.data(), ni); }},
          {"from_bf16", "8192 x 5632", ni * 6.0, [&] { be->from_bf16(h.data(), g16.data(), ni); }},
          // g, u, dh in; dg, du out (bf16: g and u 2 bytes each).
          {"swiglu bwd fp32", "8192 x 5632", 5.0 * ni * 4,
           [&] { be->swiglu_backward(dg.data(), du.data(), h.data(), g.data(), u.data(), ni); }},
          {"swiglu bwd bf16", "8192 x 5632", ni * (2.0 * 2 + 3.0 * 4),
           [&] { be->swiglu_backward_bf16(dg.data(), du.data(), h.data(), g16.data(), u16.data(), ni); }},
          {"add_inplace", "8192 x 5632", ni * 12.0, [&] { be->add_inplace(h.data(), g.data(), ni); }},
      }, rows);
    }

    // The MoE d=1024 preset's other memory-bound ops (configs/gpu/moe-d1024.yaml: 16 heads of 64,
    // K = 4 of 64 experts, a 16k-token step): RMSNorm over d, the QK prep of the queries, and the
    // MoE permutation (gather into expert order, combine back, and their backward) on a random
    // permutation of the N K slots.
    {
      const int N = 16384, D = 1024, H = 16, hd = 64, S = 2048, K = 4, NK = N * K;
      const size_t nd = size_t(N) * D, nkd = size_t(NK) * D, nq = size_t(N) * H * hd;
      DeviceBuffer<float> x(nd, "norm x"), y(nd, "norm y"), dy(nd, "norm dy"), dx(nd, "norm dx"),
          rstd(size_t(N), "norm rstd"), gain(size_t(D), "norm gain"), dgain(size_t(D), "norm dgain");
      DeviceBuffer<uint16_t> y16(nd, "norm y bf16");
      LADDER_CUDA_CHECK(k::fill_uniform(x.data(), nd, 41, -1.f, 1.f, st));
      LADDER_CUDA_CHECK(k::fill_uniform(dy.data(), nd, 42, -1.f, 1.f, st));
      LADDER_CUDA_CHECK(k::fill_uniform(gain.data(), size_t(D), 43, 0.5f, 1.5f, st));
      DeviceBuffer<float> qx(nq, "qk x"), qo(nq, "qk out"), qr(size_t(N) * H, "qk rstd"), qg(size_t(hd), "qk gain"),
          qdg(size_t(hd), "qk dgain"), qdx(nq, "qk dx");
      LADDER_CUDA_CHECK(k::fill_uniform(qx.data(), nq, 44, -1.f, 1.f, st));
      LADDER_CUDA_CHECK(k::fill_uniform(qg.data(), size_t(hd), 45, 0.5f, 1.5f, st));
      std::vector<int32_t> perm(NK), inv(NK);
      for (int j = 0; j < NK; ++j) perm[j] = j;
      uint64_t z = 46;
      for (int j = NK - 1; j > 0; --j) {  // Fisher-Yates driven by an LCG: the same permutation every run
        z = z * 6364136223846793005ull + 1442695040888963407ull;
        std::swap(perm[j], perm[int((z >> 33) % uint64_t(j + 1))]);
      }
      for (int j = 0; j < NK; ++j) inv[perm[j]] = j;
      DeviceBuffer<int32_t> row(size_t(NK), "moe row"), slot(size_t(NK), "moe slot");
      row.upload(perm);
      slot.upload(inv);
      DeviceBuffer<float> xs(nkd, "moe xs"), ys(nkd, "moe y"), dys(nkd, "moe dy"), comb(size_t(NK), "moe comb"),
          dcomb(size_t(NK), "moe dcomb");
      DeviceBuffer<uint16_t> xs16(nkd, "moe xs bf16");
      LADDER_CUDA_CHECK(k::fill_uniform(ys.data(), nkd, 47, -1.f, 1.f, st));
      LADDER_CUDA_CHECK(k::fill_uniform(comb.data(), size_t(NK), 48, 0.f, 1.f, st));
      be->to_bf16(xs16.data(), ys.data(), nkd);
      const std::string nds = "16384 x 1024", moes = "16384 x 4 x 1024", qks = "16384 x 16 x 64";
      const double f = 4.0;  // bytes per fp32
      time_bandwidth_rows(st, {
          // x in, y out (bf16: y 2 bytes); rstd and the gain are negligible.
          {"rmsnorm fwd fp32", nds, 2.0 * nd * f,
           [&] { be->rmsnorm_forward(y.data(), rstd.data(), x.data(), gain.data(), N, D, 1e-6f); }},
          {"rmsnorm fwd bf16", nds, nd * (f + 2),
           [&] { be->rmsnorm_forward_bf16(y16.data(), rstd.data(), x.data(), gain.data(), N, D, 1e-6f); }},
          // dy, x in, dx out (the dgain pass reads dy and x a second time: not counted).
          {"rmsnorm bwd", nds, 3.0 * nd * f,
           [&] { be->rmsnorm_backward(dx.data(), dgain.data(), dy.data(), x.data(), gain.data(), rstd.data(), N, D,
                                      false); }},
          {"qk_prep fwd hd64", qks, 2.0 * nq * f,
           [&] { be->qk_prep_forward(qo.data(), qr.data(), qx.data(), qg.data(), nullptr, N, S, H, hd, hd, 5e5f, true,
                                     1e-6f); }},
          {"qk_prep bwd hd64", qks, 3.0 * nq * f,
           [&] { be->qk_prep_backward(qdx.data(), qdg.data(), qo.data(), qx.data(), qg.data(), qr.data(), nullptr, N, S,
                                      H, hd, hd, 5e5f, true); }},
          // Token rows in (each read K times: counted once), expert rows out.
          {"moe gather fp32", moes, (double(nd) + double(nkd)) * f,
           [&] { be->moe_gather(xs.data(), x.data(), slot.data(), NK, K, D); }},
          {"moe gather bf16", moes, double(nd) * f + double(nkd) * 2,
           [&] { be->moe_gather_bf16(xs16.data(), x.data(), slot.data(), NK, K, D); }},
          // out read and written, the K expert rows read.
          {"moe combine fp32", moes, (2.0 * nd + double(nkd)) * f,
           [&] { be->moe_combine(y.data(), ys.data(), comb.data(), row.data(), N, K, D); }},
          {"moe combine bf16", moes, 2.0 * nd * f + double(nkd) * 2,
           [&] { be->moe_combine_bf16(y.data(), xs16.data(), comb.data(), row.data(), N, K, D); }},
          // dout in (K times, counted once), y in, dy out.
          {"moe combine bwd fp32", moes, (double(nd) + 2.0 * nkd) * f,
           [&] { be->moe_combine_backward(dys.data(), dcomb.data(), dy.data(), ys.data(), comb.data(), row.data(), N,
                                          K, D); }},
          {"moe combine bwd bf16", moes, (double(nd) + double(nkd)) * f + double(nkd) * 2,
           [&] { be->moe_combine_backward_bf16(dys.data(), dcomb.data(), dy.data(), xs16.data(), comb.data(),
                                               row.data(), N, K, D); }},
          // The K expert rows in, the token row out.
          {"moe gather bwd", moes, (double(nkd) + double(nd)) * f,
           [&] { be->moe_gather_backward(dx.data(), dys.data(), row.data(), N, K, D); }},
      }, rows);
    }

    std::printf("\n| what | shape | ms (median) | rate |\n|---|---|---|---|\n");
    for (auto& r : rows)
      std::printf("| %s | %s | %.3f | %.2f %s |\n", r.what.c_str(), r.shape.c_str(), r.ms, r.rate, r.unit);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
