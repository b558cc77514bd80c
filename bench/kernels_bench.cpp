// Micro-benchmarks of the float CPU kernels at the shapes of a small dense model (4096 tokens per
// step, d = 512, head_dim 64, S = 512). sgemm 4096x2048x512 is the reference rate the attention
// GFLOP/s should be compared against. Times are wall-clock (the kernels are multi-threaded).
#include <benchmark/benchmark.h>

#include "backend/cpu/openblas_cores.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "backend/cpu/kernels.h"

using namespace ladder::cpu;

namespace {

std::vector<float> rand_vec(size_t n, uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

void set_flops(benchmark::State& st, double flops_per_iter) {
  st.counters["GFLOP/s"] =
      benchmark::Counter(flops_per_iter * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void set_bytes(benchmark::State& st, double bytes_per_iter) {
  st.counters["GB/s"] =
      benchmark::Counter(bytes_per_iter * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Sgemm(benchmark::State& st) {
  const int M = int(st.range(0)), N = int(st.range(1)), K = int(st.range(2));
  auto A = rand_vec(size_t(M) * K, 1), B = rand_vec(size_t(K) * N, 2);
  std::vector<float> C(size_t(M) * N);
  for (auto _ : st) {
    gemm<float>(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, C.data(), N);
    benchmark::DoNotOptimize(C.data());
  }
  set_flops(st, 2.0 * M * N * K);
}
BENCHMARK(BM_Sgemm)->Args({4096, 2048, 512})->Args({4096, 512, 512})->UseRealTime()->Unit(
    benchmark::kMillisecond);

// Args: B, S, H, KV, hd, window
AttnShape attn_shape(const benchmark::State& st) {
  AttnShape s{int(st.range(0)), int(st.range(1)), int(st.range(2)), int(st.range(3)),
              int(st.range(4)), int(st.range(5)), 0.0};
  s.scale = 1.0 / std::sqrt(double(s.hd));
  return s;
}

// Multiply-adds actually needed (masked-out scores not counted): per query row, the number of keys
// it sees, times hd, for each of QK^T and PV.
double attn_pairs(const AttnShape& s) {
  double pairs = 0;
  for (int i = 0; i < s.S; ++i) pairs += s.window > 0 ? std::min(i + 1, s.window) : i + 1;
  return pairs * s.B * s.H;
}

struct AttnData {
  std::vector<float> q, k, v, o, lse, dout, dq, dk, dv;
  explicit AttnData(const AttnShape& s) {
    const size_t nq = size_t(s.B) * s.S * s.H * s.hd, nk = size_t(s.B) * s.S * s.KV * s.hd;
    q = rand_vec(nq, 3);
    k = rand_vec(nk, 4);
    v = rand_vec(nk, 5);
    dout = rand_vec(nq, 6);
    o.resize(nq);
    dq.resize(nq);
    dk.resize(nk);
    dv.resize(nk);
    lse.resize(size_t(s.B) * s.H * s.S);
  }
};

void BM_AttentionFwd(benchmark::State& st) {
  const AttnShape s = attn_shape(st);
  AttnData d(s);
  for (auto _ : st) {
    attention_forward(d.o.data(), d.lse.data(), d.q.data(), d.k.data(), d.v.data(), s);
    benchmark::DoNotOptimize(d.o.data());
  }
  // 2 gemms (QK^T, PV) of 2 flops per multiply-add: 4 * pairs * hd (= 4*S*S*H*hd*B/2 for causal).
  set_flops(st, 4.0 * attn_pairs(s) * s.hd);
}

void BM_AttentionBwd(benchmark::State& st) {
  const AttnShape s = attn_shape(st);
  AttnData d(s);
  attention_forward(d.o.data(), d.lse.data(), d.q.data(), d.k.data(), d.v.data(), s);
  for (auto _ : st) {
    attention_backward(d.dq.data(), d.dk.data(), d.dv.data(), d.dout.data(), d.q.data(),
                       d.k.data(), d.v.data(), d.o.data(), d.lse.data(), s);
    benchmark::DoNotOptimize(d.dq.data());
  }
  // 5 gemms (QK^T recompute, dO V^T, P^T dO, dS K, dS^T Q).
  set_flops(st, 10.0 * attn_pairs(s) * s.hd);
}

#define ATTN_ARGS                                                                                  \
  Args({8, 512, 8, 8, 64, 0})                                                                      \
      ->Args({8, 512, 8, 2, 64, 0})                                                                \
      ->Args({8, 512, 8, 2, 64, 128})                                                              \
      ->Args({2, 2048, 8, 2, 64, 0})                                                               \
      ->Args({2, 2048, 8, 2, 64, 512}) /* short layer: should cost ~window/causal-average */       \
      ->ArgNames({"B", "S", "H", "KV", "hd", "win"})                                               \
      ->UseRealTime()                                                                              \
      ->Unit(benchmark::kMillisecond)
BENCHMARK(BM_AttentionFwd)->ATTN_ARGS;
BENCHMARK(BM_AttentionBwd)->ATTN_ARGS;

constexpr int kTokens = 4096, kD = 512;

void BM_RmsNormFwd(benchmark::State& st) {
  auto x = rand_vec(size_t(kTokens) * kD, 7), g = rand_vec(kD, 8);
  std::vector<float> y(x.size()), r(kTokens);
  for (auto _ : st) {
    rmsnorm_forward(y.data(), r.data(), x.data(), g.data(), kTokens, kD, 1e-6f);
    benchmark::DoNotOptimize(y.data());
  }
  set_bytes(st, 2.0 * x.size() * sizeof(float));
}
BENCHMARK(BM_RmsNormFwd)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_RmsNormBwd(benchmark::State& st) {
  auto x = rand_vec(size_t(kTokens) * kD, 7), g = rand_vec(kD, 8), dy = rand_vec(x.size(), 9);
  std::vector<float> y(x.size()), r(kTokens), dx(x.size()), dg(kD);
  rmsnorm_forward(y.data(), r.data(), x.data(), g.data(), kTokens, kD, 1e-6f);
  for (auto _ : st) {
    rmsnorm_backward(dx.data(), dg.data(), dy.data(), x.data(), g.data(), r.data(), kTokens, kD,
                     false);
    benchmark::DoNotOptimize(dx.data());
  }
  set_bytes(st, 3.0 * x.size() * sizeof(float));
}
BENCHMARK(BM_RmsNormBwd)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_RopeFwd(benchmark::State& st) {
  const int nh = 8, hd = 64, S = 512, rot = int(st.range(0));
  auto x = rand_vec(size_t(kTokens) * nh * hd, 10);
  for (auto _ : st) {
    rope_forward(x.data(), kTokens, S, nh, hd, rot, 5e5f);
    benchmark::DoNotOptimize(x.data());
  }
  set_bytes(st, 2.0 * x.size() * sizeof(float));
}
BENCHMARK(BM_RopeFwd)->Arg(64)->Arg(32)->ArgName("rot")->UseRealTime()->Unit(
    benchmark::kMicrosecond);

void BM_SwiGLUFwd(benchmark::State& st) {
  const size_t n = size_t(kTokens) * 4 * kD;
  auto g = rand_vec(n, 11), u = rand_vec(n, 12);
  std::vector<float> h(n);
  for (auto _ : st) {
    swiglu_forward(h.data(), g.data(), u.data(), n);
    benchmark::DoNotOptimize(h.data());
  }
  set_bytes(st, 3.0 * n * sizeof(float));
}
BENCHMARK(BM_SwiGLUFwd)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_SwiGLUBwd(benchmark::State& st) {
  const size_t n = size_t(kTokens) * 4 * kD;
  auto g = rand_vec(n, 11), u = rand_vec(n, 12), dh = rand_vec(n, 13);
  std::vector<float> dg(n), du(n);
  for (auto _ : st) {
    swiglu_backward(dg.data(), du.data(), dh.data(), g.data(), u.data(), n);
    benchmark::DoNotOptimize(dg.data());
  }
  set_bytes(st, 5.0 * n * sizeof(float));
}
BENCHMARK(BM_SwiGLUBwd)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_SoftmaxXent(benchmark::State& st) {
  const int N = 1024, V = 8192;
  auto logits = rand_vec(size_t(N) * V, 14, 2.0f);
  std::vector<int32_t> tgt(N);
  for (int i = 0; i < N; ++i) tgt[i] = (i * 7919) % V;
  std::vector<float> work(logits.size());
  for (auto _ : st) {
    st.PauseTiming();
    work = logits;  // the kernel overwrites its input
    st.ResumeTiming();
    benchmark::DoNotOptimize(softmax_xent(work.data(), tgt.data(), N, V, 1e-4f, 1.0f / N));
  }
  set_bytes(st, 2.0 * logits.size() * sizeof(float));
}
BENCHMARK(BM_SoftmaxXent)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_SoftmaxXentForward(benchmark::State& st) {
  const int N = 1024, V = 8192;
  auto logits = rand_vec(size_t(N) * V, 14, 2.0f);
  std::vector<int32_t> tgt(N);
  for (int i = 0; i < N; ++i) tgt[i] = (i * 7919) % V;
  for (auto _ : st)
    benchmark::DoNotOptimize(
        softmax_xent_forward(logits.data(), tgt.data(), N, V, static_cast<float*>(nullptr)));
  set_bytes(st, 1.0 * logits.size() * sizeof(float));
}
BENCHMARK(BM_SoftmaxXentForward)->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace

// OpenBLAS's kernels for this CPU first (backend/cpu/openblas_cores.h), then Google Benchmark.
int main(int argc, char** argv) {
  ladder::ensure_openblas_kernels(argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
