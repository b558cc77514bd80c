// The CUDA kernels' own source (src/backend/cuda/{ops,attention,switch_ops,optim_ops}.cu, rewritten
// by emulate.py, run by emu_cuda.h) against the CPU kernels (float), with no GPU; also the emulator's
// own device checks (CudaEmuChecks: alignment, cp.async, and mma_selftest.cu's mma.sync/ldmatrix
// layouts).
// Pointers are host pointers: the emulated "device" memory is the host's. Every output is poisoned
// with 0xFF bytes (NaN) first, so an element a kernel never writes fails; buffers are exactly the
// size the launcher is told, so AddressSanitizer (run.sh asan) sees any overrun.
// Tolerances as in tests/cuda: ||emu - cpu|| / ||cpu|| <= 5e-6 for fp32, exact for copies and
// integer work, 1e-6 relative for returned double sums. Shapes are small and odd (the emulation
// runs a fiber, or under asan/tsan a std::thread, per CUDA thread); EMU_SEED=N repeats a run's inputs; EMU_QUICK=1 (run.sh's
// sanitizer modes) drops the costlier shapes.
#include "backend/cpu/kernels.h"
#include "backend/cpu/optim_kernels.h"
#include "backend/cuda/kernels.cuh"
#include "backend/cuda/moe_ops.cuh"
#include "backend/cuda/switch_optim_ops.cuh"
#include "../mma_selftest_case.h"
#include "backend/cuda/mma_selftest.cuh"
#include "emu_fixture.h"

#include <algorithm>
#include <numeric>

namespace ladder {
namespace {

using emu_test::CudaEmu;
using emu_test::kF32;
using emu_test::kSum;
using emu_test::quick;
namespace k = cuda::k;

// ---------------------------------------------------------------------------------------------
// The emulator's device checks are on in this Release (-DNDEBUG) build: a cast of a kernel source
// to a misaligned vector pointer (emulate.py turns every reinterpret_cast<T*> into
// emu::aligned_cast) and a misaligned or overrunning WMMA pointer end the process, as the access
// would fault on the device. Without them the host runs such code silently.

TEST(CudaEmuChecks, MisalignedAccessesDie) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  alignas(32) static float buf[64] = {};
  alignas(32) static __nv_bfloat16 half[512] = {};
  EXPECT_EQ(::emu::aligned_cast<const float4*>(buf + 4), reinterpret_cast<const float4*>(buf + 4));
  EXPECT_DEATH(::emu::aligned_cast<const float4*>(buf + 2), "misaligned pointer cast");
  EXPECT_DEATH(::emu::aligned_cast<__nv_bfloat162*>(half + 1), "misaligned pointer cast");
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major> fa;
  EXPECT_DEATH(nvcuda::wmma::load_matrix_sync(fa, half + 8, 16), "256-bit aligned");
  EXPECT_DEATH(nvcuda::wmma::load_matrix_sync(fa, half, 12), "ldm");
}

// cp.async (__pipeline_memcpy_async): a copy lands when its thread waits for its commit group,
// never earlier, so reading a stage too early reads its old bytes (here the 0xFF poison: NaN); and a
// thread returning with copies it never waited for ends the process. Block of 64 threads, thread t
// copies src[4t, 4t + 4) to shared [4t, 4t + 4), in two commit groups (even and odd threads' halves).
enum class AsyncMode { Correct, ReadBeforeWait, WaitOneGroup, NoBarrier, NeverWait };
void async_probe(const float* src, float* out, AsyncMode mode) {
  float* sm = reinterpret_cast<float*>(::emu::g_smem);
  const int t = int(threadIdx.x), n = int(blockDim.x), other = (t + 1) % n;
  __pipeline_memcpy_async(sm + 4 * t, src + 4 * t, 8);  // group 1: the first half
  __pipeline_commit();
  __pipeline_memcpy_async(sm + 4 * t + 2, src + 4 * t + 2, 8);  // group 2: the second half
  __pipeline_commit();
  switch (mode) {
    case AsyncMode::Correct:
      __pipeline_wait_prior(0);
      __syncthreads();
      for (int i = 0; i < 4; ++i) out[4 * t + i] = sm[4 * other + i];  // another thread's copies
      break;
    case AsyncMode::ReadBeforeWait:
      for (int i = 0; i < 4; ++i) out[4 * t + i] = sm[4 * t + i];
      __pipeline_wait_prior(0);
      break;
    case AsyncMode::WaitOneGroup:  // the older group has landed, the newer not yet
      __pipeline_wait_prior(1);
      for (int i = 0; i < 4; ++i) out[4 * t + i] = sm[4 * t + i];
      __pipeline_wait_prior(0);
      break;
    case AsyncMode::NoBarrier:  // the next thread's copies are not visible without __syncthreads
      __pipeline_wait_prior(0);
      for (int i = 0; i < 4; ++i) out[4 * t + i] = sm[4 * other + i];
      break;
    case AsyncMode::NeverWait:
      break;
  }
}

TEST(CudaEmuChecks, AsyncCopiesLandWhenWaitedFor) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const int n = 64;
  std::vector<float> src(4 * n);
  for (int i = 0; i < 4 * n; ++i) src[i] = float(i + 1);
  auto run = [&](AsyncMode mode) {
    std::vector<float> out(4 * n, 0.f);
    EMU_LAUNCH(dim3(1), dim3(n), 4 * n * sizeof(float), nullptr, async_probe, src.data(), out.data(), mode);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    return out;
  };
  const uint64_t before = ::emu::g_async_copies.load();
  const std::vector<float> ok = run(AsyncMode::Correct);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < 4; ++i) ASSERT_EQ(ok[4 * t + i], src[4 * ((t + 1) % n) + i]) << t << " " << i;
  EXPECT_EQ(::emu::g_async_copies.load() - before, uint64_t(2 * n));
  for (float v : run(AsyncMode::ReadBeforeWait)) EXPECT_TRUE(std::isnan(v));
  const std::vector<float> one = run(AsyncMode::WaitOneGroup);
  for (int t = 0; t < n; ++t) {
    EXPECT_EQ(one[4 * t], src[4 * t]);
    EXPECT_EQ(one[4 * t + 1], src[4 * t + 1]);
    EXPECT_TRUE(std::isnan(one[4 * t + 2]));
    EXPECT_TRUE(std::isnan(one[4 * t + 3]));
  }
#ifndef EMU_THREADS  // fibers run in thread order: thread t reads before thread t+1 has waited
  const std::vector<float> nb = run(AsyncMode::NoBarrier);
  for (int t = 0; t + 1 < n; ++t) EXPECT_TRUE(std::isnan(nb[4 * t])) << t;
#endif
  EXPECT_DEATH(run(AsyncMode::NeverWait), "cp.async copies outstanding");
}

// mma_ptx.cuh's emulated mma.sync / ldmatrix follow the layouts the device test (CudaMmaPtx) checks
// on a GPU: the same kernel and comparison (tests/cuda/mma_selftest_case.h).
TEST(CudaEmuChecks, MmaPtxFragmentLayoutsMatchACpuProduct) {
  std::mt19937_64 rng(std::random_device{}());
  mma_case::check_all(rng, [&](const mma_case::Operands& o, int mode, std::vector<float>& d) {
    ASSERT_EQ(k::mma_ptx_selftest(d.data(), o.a.data(), o.at.data(), o.bnk.data(), o.bkn.data(), mode, nullptr),
              cudaSuccess);
  });
  // ldmatrix's row addresses must be 16-byte aligned, as on the device.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(::emu::ptx_ldmatrix(nullptr, 4, false, reinterpret_cast<const void*>(uintptr_t(8))), "16-byte aligned");
}

// ---------------------------------------------------------------------------------------------
// ops.cu

TEST_F(CudaEmu, EmbeddingForwardBackward) {
  for (auto [N, V, D] : {std::tuple{37, 11, 45}, {5, 300, 300}, {1, 3, 7}}) {
    const std::string what = fmt("embedding N=%d V=%d D=%d", N, V, D);
    std::vector<int32_t> ids(N);
    std::uniform_int_distribution<int> id(0, V - 1);
    for (auto& x : ids) x = id(rng_);
    const auto table = randv(size_t(V) * D), dout = randv(size_t(N) * D), dtable0 = randv(size_t(V) * D);

    auto out = poisoned(size_t(N) * D), ref = out;
    ok(k::embedding_forward(out.data(), table.data(), ids.data(), N, D, nullptr), what);
    cpu::embedding_forward<float>(ref.data(), table.data(), ids.data(), N, D);
    exact(out, ref, what + " fwd");

    // Exactly the scratch the launcher asks for: the CUB stand-in uses all of its temp storage.
    std::vector<unsigned char> scratch(k::embedding_backward_scratch_bytes(N));
    auto dt = dtable0, dref = dtable0;
    EXPECT_EQ(k::embedding_backward(dt.data(), dout.data(), ids.data(), N, D, scratch.data(), scratch.size() - 1,
                                    nullptr),
              cudaErrorInvalidValue);
    ok(k::embedding_backward(dt.data(), dout.data(), ids.data(), N, D, scratch.data(), scratch.size(), nullptr),
       what);
    cpu::embedding_backward<float>(dref.data(), dout.data(), ids.data(), N, D);
    exact(dt, dref, what + " bwd (the CPU's order: bitwise)");
  }
}

TEST_F(CudaEmu, RmsNormForwardBackward) {
  // N above 128 gives dgain several row chunks; D above 256 sends the block around its column loop.
  for (auto [N, D] : {std::pair{37, 45}, {131, 300}, {1, 7}}) {
    for (bool with_gain : {true, false}) {
      if (N == 131 && (!with_gain || quick())) continue;  // the row kernels cost ~1 ms per row here
      const std::string what = fmt("rmsnorm N=%d D=%d gain=%d", N, D, int(with_gain));
      const size_t n = size_t(N) * D;
      const auto x = randv(n), g = randv(size_t(D), 0.5f, 1.5f), dy = randv(n), dx0 = randv(n),
                 dg0 = randv(size_t(D));
      const float* gain = with_gain ? g.data() : nullptr;
      auto y = poisoned(n), rstd = poisoned(size_t(N));
      std::vector<float> yr(n), rr(N);
      ok(k::rmsnorm_forward(y.data(), rstd.data(), x.data(), gain, N, D, 1e-5f, nullptr), what);
      cpu::rmsnorm_forward<float>(yr.data(), rr.data(), x.data(), gain, N, D, 1e-5f);
      check(y, yr, kF32, what + " y");
      check(rstd, rr, kF32, what + " rstd");
      for (bool acc : {false, true}) {
        auto dx = acc ? dx0 : poisoned(n), dxr = dx0, dg = dg0, dgr = dg0;
        std::vector<float> scratch = poisoned(k::rmsnorm_backward_scratch_floats(N, D));
        ok(k::rmsnorm_backward(dx.data(), with_gain ? dg.data() : nullptr, dy.data(), x.data(), gain, rr.data(), N,
                               D, acc, scratch.data(), nullptr),
           what);
        cpu::rmsnorm_backward<float>(dxr.data(), with_gain ? dgr.data() : nullptr, dy.data(), x.data(), gain,
                                     rr.data(), N, D, acc);
        check(dx, dxr, kF32, what + (acc ? " dx (+=)" : " dx"));
        if (with_gain) check(dg, dgr, kF32, what + " dgain (+=)");
      }
    }
  }
}

// The backend's RoPE table (cuda_backend.cpp rope_table): cos then sin, [S, rot/2], in double.
std::vector<float> rope_table(int S, int rot, float theta) {
  const int half = rot / 2;
  std::vector<float> tab(2 * size_t(S) * (half > 0 ? half : 0));
  for (int i = 0; i < half; ++i) {
    const double inv_freq = std::pow(double(theta), -2.0 * i / double(rot));
    for (int p = 0; p < S; ++p) {
      tab[size_t(p) * half + i] = float(std::cos(double(p) * inv_freq));
      tab[size_t(S) * half + size_t(p) * half + i] = float(std::sin(double(p) * inv_freq));
    }
  }
  return tab;
}

TEST_F(CudaEmu, RopeForwardBackward) {
  const int B = 3, S = 13, nh = 3, hd = 18;
  const float theta = 10000.f;
  for (int rot : {hd, 10, 2}) {
    const std::string what = fmt("rope B=%d S=%d nh=%d hd=%d rot=%d", B, S, nh, hd, rot);
    const auto tab = rope_table(S, rot, theta);
    const auto x0 = randv(size_t(B) * S * nh * hd);
    auto x = x0, xr = x0;
    ok(k::rope_apply(x.data(), tab.data(), B * S, S, nh, hd, rot, 1.f, nullptr), what);
    cpu::rope_forward<float>(xr.data(), B * S, S, nh, hd, rot, theta);
    check(x, xr, kF32, what + " fwd");
    x = x0, xr = x0;
    ok(k::rope_apply(x.data(), tab.data(), B * S, S, nh, hd, rot, -1.f, nullptr), what);
    cpu::rope_backward<float>(xr.data(), B * S, S, nh, hd, rot, theta);
    check(x, xr, kF32, what + " bwd");
  }
}

TEST_F(CudaEmu, SwigluForwardBackward) {
  const size_t n = 1001;  // above the 3 x 256 threads of the capped grid: the stride loop runs
  const auto g = randv(n, -5.f, 5.f), u = randv(n), dh = randv(n);
  auto h = poisoned(n), dg = poisoned(n), du = poisoned(n);
  std::vector<float> hr(n), dgr(n), dur(n);
  ok(k::swiglu_forward(h.data(), g.data(), u.data(), n, nullptr), "swiglu");
  ok(k::swiglu_backward(dg.data(), du.data(), dh.data(), g.data(), u.data(), n, nullptr), "swiglu");
  cpu::swiglu_forward<float>(hr.data(), g.data(), u.data(), n);
  cpu::swiglu_backward<float>(dgr.data(), dur.data(), dh.data(), g.data(), u.data(), n);
  check(h, hr, kF32, "swiglu fwd");
  check(dg, dgr, kF32, "swiglu bwd dg");
  check(du, dur, kF32, "swiglu bwd du");
}

TEST_F(CudaEmu, SoftmaxXentAndReducePairs) {
  // V below and above the 512 threads of a row's block.
  for (auto [N, V] : {std::pair{7, 1003}, {5, 37}}) {
    const std::string what = fmt("xent N=%d V=%d", N, V);
    auto logits = randv(size_t(N) * V, -4.f, 4.f);
    // Rows far from 0, where only a kernel that subtracts the row max stays finite: row 1 + 100
    // (exp overflows fp32 above ~88.7), row 2 - 110 (exp underflows to 0 below ~-103.9), row 3 spread
    // 30x to [-180, 60] (subtracting the mean instead of the max overflows; its softmax sits on one
    // logit and its lse stays under 64, so the GPU's exp(x - lse) with lse rounded to fp32 costs at
    // most ~2e-6 there, not ~4e-6). The CPU test's +40 stays inside fp32 exp's range: it would not tell.
    for (int j = 0; j < V; ++j) {
      logits[size_t(1) * V + j] += 100.f;
      logits[size_t(2) * V + j] -= 110.f;
      logits[size_t(3) * V + j] = logits[size_t(3) * V + j] * 30.f - 60.f;
    }
    std::vector<int32_t> tgt(N);
    std::uniform_int_distribution<int> t(0, V - 1);
    for (auto& x : tgt) x = t(rng_);
    const float z = 1e-3f, gs = 1.f / float(N);

    auto grad = logits, gref = logits;
    auto rows = poisoned<double>(2 * size_t(N)), sums = poisoned<double>(2);
    ok(k::softmax_xent(grad.data(), tgt.data(), N, V, z, gs, rows.data(), nullptr), what);
    ok(k::reduce_pairs(rows.data(), N, sums.data(), nullptr), what);
    const cpu::XentSums r = cpu::softmax_xent<float>(gref.data(), tgt.data(), N, V, z, gs);
    check(grad, gref, kF32, what + " grad");
    check_sum(sums[0], r.xent, what + " sum xent");
    check_sum(sums[1], r.lse_sq, what + " sum lse^2");

    auto losses = poisoned(size_t(N));
    std::vector<float> lref(N), untouched = logits;
    ok(k::softmax_xent_forward(untouched.data(), tgt.data(), N, V, losses.data(), rows.data(), nullptr), what);
    ok(k::reduce_pairs(rows.data(), N, sums.data(), nullptr), what);
    const cpu::XentSums f = cpu::softmax_xent_forward<float>(logits.data(), tgt.data(), N, V, lref.data());
    exact(untouched, logits, what + " forward leaves logits");
    check(losses, lref, kF32, what + " losses");
    check_sum(sums[0], f.xent, what + " fwd sum xent");
  }
}

TEST_F(CudaEmu, SumSquaresAddScaleAdamW) {
  for (size_t n : {size_t(0), size_t(5003)}) {
    if (quick() && !n) continue;
    const auto x = randv(n);
    std::vector<double> scratch = poisoned<double>(k::sum_squares_scratch_doubles()), out = poisoned<double>(1);
    ok(k::sum_squares(x.data(), n, out.data(), scratch.data(), nullptr), "sum_squares");
    if (n) check_sum(out[0], cpu::sum_squares<float>(x.data(), n), fmt("sum_squares n=%zu", n));
    else EXPECT_EQ(out[0], 0.0);
  }
  const size_t n = 1001;
  const auto x = randv(n), y0 = randv(n);
  auto y = y0, yr = y0;
  ok(k::add_inplace(y.data(), x.data(), n, nullptr), "add");
  cpu::add_inplace<float>(yr.data(), x.data(), n);
  exact(y, yr, "add_inplace");
  ok(k::scale_inplace(y.data(), 0.37f, n, nullptr), "scale");
  cpu::scale_inplace<float>(yr.data(), 0.37f, n);
  exact(y, yr, "scale_inplace");

  auto p = randv(n), g = randv(n), m = randv(n, -0.1f, 0.1f), v = randv(n, 0.f, 0.01f);
  auto pr = p, mr = m, vr = v;
  ok(k::adamw_update(p.data(), g.data(), m.data(), v.data(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.19f, 0.0975f,
                     nullptr),
     "adamw");
  cpu::adamw_update<float>(pr.data(), g.data(), mr.data(), vr.data(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.19f,
                           0.0975f);
  check(p, pr, kF32, "adamw p");
  check(m, mr, kF32, "adamw m");
  check(v, vr, kF32, "adamw v");
}

TEST_F(CudaEmu, ScaleMatrixBf16FillUniform) {
  const int M = 7, N = 33, ld = 40;
  for (float beta : {0.f, 0.5f}) {
    auto C = beta == 0.f ? poisoned(size_t(M) * ld) : randv(size_t(M) * ld);
    auto ref = C;
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) ref[size_t(i) * ld + j] = beta == 0.f ? 0.f : beta * ref[size_t(i) * ld + j];
    ok(k::scale_matrix(C.data(), M, N, ld, beta, nullptr), "scale_matrix");
    exact(C, ref, fmt("scale_matrix beta=%g (columns past N untouched)", beta));
  }
  // Round to nearest even, written out here (an independent reference).
  auto bf16 = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  };
  const auto in = randv(size_t(M) * ld, -100.f, 100.f);
  auto out = poisoned<uint16_t>(in.size());
  std::vector<uint16_t> ref(in.size());
  for (size_t i = 0; i < in.size(); ++i) ref[i] = bf16(in[i]);
  ok(k::f32_to_bf16(out.data(), in.data(), in.size(), nullptr), "bf16");
  exact(out, ref, "f32_to_bf16");
  auto out2 = poisoned<uint16_t>(size_t(M) * N);
  std::vector<uint16_t> ref2(out2.size());
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) ref2[size_t(i) * N + j] = bf16(in[size_t(i) * ld + j]);
  ok(k::f32_to_bf16_2d(out2.data(), in.data(), M, N, ld, nullptr), "bf16 2d");
  exact(out2, ref2, "f32_to_bf16_2d");

  // fill_uniform depends on (seed, i) only: the same values whatever grid the emulation runs.
  const size_t n = 2049;
  auto f = poisoned(n);
  ok(k::fill_uniform(f.data(), n, 42, -2.f, 3.f, nullptr), "fill_uniform");
  std::vector<float> fr(n);
  for (size_t i = 0; i < n; ++i) {
    uint64_t z = 42 + 0x9E3779B97F4A7C15ull * (i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    fr[i] = -2.f + 5.f * float(z >> 40) * (1.0f / 16777216.0f);
  }
  exact(f, fr, "fill_uniform");
}

// ---------------------------------------------------------------------------------------------
// attention.cu (fp32 flash kernels)

TEST_F(CudaEmu, AttentionForwardBackward) {
  // hd 16 / 40 / 64 / 128 (the 32-, 64- and 128-wide kernels, with padding), S not a multiple of the
  // 32-key tiles nor of the rows per block (128 / 64 / 32), causal and windowed, MHA and GQA.
  const cpu::AttnShape shapes[] = {
      {2, 37, 2, 1, 16, 0, 0}, {1, 45, 4, 2, 40, 7, 0}, {1, 70, 2, 2, 64, 0, 0},
      {1, 33, 3, 1, 128, 20, 0}, {1, 66, 2, 1, 128, 0, 0}, {1, 1, 2, 2, 64, 0, 0},
  };
  for (cpu::AttnShape s : shapes) {
    if (quick() && (s.hd == 64 || s.S == 66)) continue;
    s.scale = 1.0 / std::sqrt(double(s.hd));
    const std::string what = fmt("attn B=%d S=%d H=%d KV=%d hd=%d W=%d", s.B, s.S, s.H, s.KV, s.hd, s.window);
    const size_t nq = size_t(s.B) * s.S * s.H * s.hd, nk = size_t(s.B) * s.S * s.KV * s.hd,
                 nl = size_t(s.B) * s.H * s.S;
    const auto q = randv(nq, -2.f, 2.f), kk = randv(nk, -2.f, 2.f), v = randv(nk), dout = randv(nq);
    auto o = poisoned(nq), lse = poisoned(nl);
    std::vector<float> orf(nq), lr(nl);
    ok(k::attention_forward(o.data(), lse.data(), q.data(), kk.data(), v.data(), s, nullptr), what);
    cpu::attention_forward<float>(orf.data(), lr.data(), q.data(), kk.data(), v.data(), s);
    check(o, orf, kF32, what + " o");
    check(lse, lr, kF32, what + " lse");

    auto dq = poisoned(nq), dk = poisoned(nk), dv = poisoned(nk);
    auto scratch = poisoned(k::attention_backward_scratch_floats(s));
    std::vector<float> dqr(nq), dkr(nk), dvr(nk);
    ok(k::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), kk.data(), v.data(), orf.data(),
                             lr.data(), s, scratch.data(), nullptr),
       what);
    cpu::attention_backward<float>(dqr.data(), dkr.data(), dvr.data(), dout.data(), q.data(), kk.data(), v.data(),
                                   orf.data(), lr.data(), s);
    // S == 1: one key per query, p = 1 and dS = dO.V - dO.O = 0, so dq and dk are rounding noise
    // on both sides; measure them against ||dv|| instead.
    double fl = 0;
    if (s.S == 1)
      for (float e : dvr) fl += double(e) * e;
    check(dq, dqr, kF32, what + " dq", std::sqrt(fl));
    check(dk, dkr, kF32, what + " dk", std::sqrt(fl));
    check(dv, dvr, kF32, what + " dv");
  }
  const cpu::AttnShape big{1, 4, 2, 2, 129, 0, 0.1};
  EXPECT_EQ(k::attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, big, nullptr), cudaErrorInvalidValue);
}

// ---------------------------------------------------------------------------------------------
// switch_ops.cu

// Document starts for PKO: token 0 of each sequence of S, and others with probability p.
std::vector<uint8_t> random_resets(std::mt19937_64& rng, int N, int S, double p) {
  std::vector<uint8_t> reset(N);
  std::bernoulli_distribution doc(p);
  for (int t = 0; t < N; ++t) reset[t] = (t % S == 0 || doc(rng)) ? 1 : 0;
  return reset;
}

TEST_F(CudaEmu, PkoShiftForwardBackward) {
  for (auto [B, S, nkv, hd] : {std::tuple{3, 41, 2, 16}, {2, 37, 3, 40}}) {
    const int N = B * S;
    const std::vector<uint8_t> reset = random_resets(rng_, N, S, 0.125);
    const size_t n = size_t(N) * nkv * hd;
    const auto kx = randv(n), dout = randv(n);
    for (int from : {hd / 2, 0, hd, 3}) {
      const std::string what = fmt("pko B=%d S=%d nkv=%d hd=%d from=%d", B, S, nkv, hd, from);
      auto out = poisoned(n), dk = poisoned(n);
      std::vector<float> outr(n), dkr(n);
      ok(k::pko_shift_forward(out.data(), kx.data(), reset.data(), N, nkv, hd, from, nullptr), what);
      ok(k::pko_shift_backward(dk.data(), dout.data(), reset.data(), N, nkv, hd, from, nullptr), what);
      cpu::pko_shift_forward<float>(outr.data(), kx.data(), reset.data(), N, nkv, hd, from);
      cpu::pko_shift_backward<float>(dkr.data(), dout.data(), reset.data(), N, nkv, hd, from);
      exact(out, outr, what + " fwd");
      exact(dk, dkr, what + " bwd");
    }
  }
}

// The fused attention input path against the CPU composition (shift, norm, RoPE). 300 rows: two
// dgain chunks, more than the emulator's 3 blocks of a grid-stride launch see in one round.
TEST_F(CudaEmu, QkPrepForwardBackward) {
  const float theta = 10000.f, eps = 1e-6f;
  for (auto [B, S, nh, hd, rot] : {std::tuple{2, 13, 3, 18, 18}, {1, 75, 4, 40, 20}, {3, 7, 1, 17, 16}}) {
    const int N = B * S;
    const std::vector<uint8_t> reset = random_resets(rng_, N, S, 0.15);
    const size_t n = size_t(N) * nh * hd, rows = size_t(N) * nh;
    const auto x = randv(n), dout = randv(n), g = randv(size_t(hd), 0.5f, 1.5f), dg0 = randv(size_t(hd));
    const auto tab = rope_table(S, rot, theta);
    for (bool norm : {true, false})
      for (bool with_gain : {true, false})
        for (bool pko : {true, false}) {
          if (quick() && with_gain != norm) continue;
          const std::string what = fmt("qk_prep B=%d S=%d nh=%d hd=%d rot=%d norm=%d gain=%d pko=%d", B, S, nh, hd,
                                       rot, int(norm), int(with_gain), int(pko));
          const float* gain = with_gain ? g.data() : nullptr;
          const uint8_t* r = pko ? reset.data() : nullptr;
          auto out = poisoned(n), rstd = poisoned(rows), dx = poisoned(n), dg = dg0, dgr = dg0;
          std::vector<float> outr(n), rr(rows), dxr(n);
          std::vector<float> scratch = poisoned(k::qk_prep_backward_scratch_floats(N, nh, hd));
          ok(k::qk_prep_forward(out.data(), rstd.data(), x.data(), gain, r, tab.data(), N, S, nh, hd, rot, norm, eps,
                                nullptr),
             what);
          cpu::qk_prep_forward<float>(outr.data(), rr.data(), x.data(), gain, r, N, S, nh, hd, rot, theta, norm, eps);
          check(out, outr, kF32, what + " out");
          if (norm) check(rstd, rr, kF32, what + " rstd");
          ok(k::qk_prep_backward(dx.data(), with_gain ? dg.data() : nullptr, dout.data(), x.data(), gain, rr.data(), r,
                                 tab.data(), N, S, nh, hd, rot, norm, scratch.data(), nullptr),
             what);
          cpu::qk_prep_backward<float>(dxr.data(), with_gain ? dgr.data() : nullptr, dout.data(), x.data(), gain,
                                       rr.data(), r, N, S, nh, hd, rot, theta, norm);
          check(dx, dxr, kF32, what + " dx");
          check(dg, dgr, kF32, what + " dgain (+=)");
        }
  }
}

TEST_F(CudaEmu, XsaForwardBackwardWithGqa) {
  for (auto [N, H, KV, hd] : {std::tuple{13, 4, 4, 64}, {11, 8, 4, 40}, {7, 4, 1, 130}, {9, 6, 3, 17}}) {
    const std::string what = fmt("xsa N=%d H=%d KV=%d hd=%d", N, H, KV, hd);
    const size_t ny = size_t(N) * H * hd, nv = size_t(N) * KV * hd;
    const auto y = randv(ny), v = randv(nv), dz = randv(ny);
    auto z = poisoned(ny), dy = poisoned(ny), dv = poisoned(nv);
    std::vector<float> zr(ny), dyr(ny), dvr(nv);
    ok(k::xsa_forward(z.data(), y.data(), v.data(), N, H, KV, hd, nullptr), what);
    ok(k::xsa_backward(dy.data(), dv.data(), dz.data(), y.data(), v.data(), N, H, KV, hd, nullptr), what);
    cpu::xsa_forward<float>(zr.data(), y.data(), v.data(), N, H, KV, hd);
    cpu::xsa_backward<float>(dyr.data(), dvr.data(), dz.data(), y.data(), v.data(), N, H, KV, hd);
    check(z, zr, kF32, what + " fwd");
    check(dy, dyr, kF32, what + " bwd dy");
    check(dv, dvr, kF32, what + " bwd dv");
    // In place as the contract allows (z over y; dy over dz): the same bits.
    auto yz = y, dzy = dz, dv2 = poisoned(nv);
    ok(k::xsa_forward(yz.data(), yz.data(), v.data(), N, H, KV, hd, nullptr), what);
    ok(k::xsa_backward(dzy.data(), dv2.data(), dzy.data(), y.data(), v.data(), N, H, KV, hd, nullptr), what);
    exact(yz, z, what + " fwd in place");
    exact(dzy, dy, what + " bwd in place dy");
    exact(dv2, dv, what + " bwd in place dv");
  }
}

TEST_F(CudaEmu, HeadGateForwardBackward) {
  for (auto [N, H, hd] : {std::tuple{13, 4, 64}, {9, 3, 40}, {5, 2, 0}, {7, 5, 130}}) {
    const std::string what = fmt("head_gate N=%d H=%d hd=%d", N, H, hd);
    const size_t n = size_t(N) * H * hd, nr = size_t(N) * H;
    const auto x = randv(n), logit = randv(nr, -4.f, 4.f), dout = randv(n);
    auto out = poisoned(n), fac = poisoned(nr);
    std::vector<float> outr(n), facr(nr);
    ok(k::head_gate_forward(out.data(), fac.data(), x.data(), logit.data(), N, H, hd, nullptr), what);
    cpu::head_gate_forward<float>(outr.data(), facr.data(), x.data(), logit.data(), N, H, hd);
    check(out, outr, kF32, what + " fwd");
    check(fac, facr, kF32, what + " factor");
    auto dx = poisoned(n), dl = poisoned(nr);
    std::vector<float> dxr(n), dlr(nr);
    ok(k::head_gate_backward(dx.data(), dl.data(), dout.data(), x.data(), facr.data(), N, H, hd, nullptr), what);
    cpu::head_gate_backward<float>(dxr.data(), dlr.data(), dout.data(), x.data(), facr.data(), N, H, hd);
    check(dx, dxr, kF32, what + " bwd dx");
    check(dl, dlr, kF32, what + " bwd dlogit");
    auto xo = x, dd = dout, dl2 = poisoned(nr), fac2 = poisoned(nr);
    ok(k::head_gate_forward(xo.data(), fac2.data(), xo.data(), logit.data(), N, H, hd, nullptr), what);
    ok(k::head_gate_backward(dd.data(), dl2.data(), dd.data(), x.data(), facr.data(), N, H, hd, nullptr), what);
    exact(xo, out, what + " fwd in place");
    exact(dd, dx, what + " bwd in place");
  }
}

TEST_F(CudaEmu, SiluAndSigmoidGate) {
  const size_t n = 1001;
  const auto u = randv(n, -6.f, 6.f), da = randv(n), x = randv(n), g0 = randv(n, -6.f, 6.f), dy = randv(n);
  auto a = poisoned(n), du = poisoned(n);
  std::vector<float> ar(n), dur(n);
  ok(k::silu_forward(a.data(), u.data(), n, nullptr), "silu");
  ok(k::silu_backward(du.data(), da.data(), u.data(), n, nullptr), "silu");
  cpu::silu_forward<float>(ar.data(), u.data(), n);
  cpu::silu_backward<float>(dur.data(), da.data(), u.data(), n);
  check(a, ar, kF32, "silu fwd");
  check(du, dur, kF32, "silu bwd");
  auto dd = da;
  ok(k::silu_backward(dd.data(), dd.data(), u.data(), n, nullptr), "silu");
  exact(dd, du, "silu bwd in place");

  auto g = g0, s = g0, y = poisoned(n);
  std::vector<float> yr(n);
  ok(k::sigmoid_gate_forward(y.data(), g.data(), x.data(), n, nullptr), "sigmoid_gate");
  cpu::sigmoid_gate_forward<float>(yr.data(), s.data(), x.data(), n);
  check(y, yr, kF32, "sigmoid_gate fwd y");
  check(g, s, kF32, "sigmoid_gate fwd s");
  for (bool acc : {false, true}) {
    const auto dx0 = randv(n);
    auto dx = acc ? dx0 : poisoned(n), dg = poisoned(n), dxr = dx0;
    std::vector<float> dgr(n);
    ok(k::sigmoid_gate_backward(dx.data(), dg.data(), dy.data(), x.data(), s.data(), n, acc, nullptr), "sg");
    cpu::sigmoid_gate_backward<float>(dxr.data(), dgr.data(), dy.data(), x.data(), s.data(), n, acc);
    check(dx, dxr, kF32, acc ? "sigmoid_gate bwd dx (+=)" : "sigmoid_gate bwd dx");
    check(dg, dgr, kF32, "sigmoid_gate bwd dg");
  }
}

// ---------------------------------------------------------------------------------------------
// optim_ops.cu (the fixed 512 x 256 reduction grid runs in full: it sets the summation order)

TEST_F(CudaEmu, AdamMomentsAndApply) {
  const float b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
  for (size_t n : {size_t(3001)}) {  // n == 0: axpy_sumsq below
    auto w = randv(n), m = randv(n, -0.1f, 0.1f), v = randv(n, 0.f, 0.01f);
    const auto g = randv(n, -0.5f, 0.5f);
    auto wr = w, mr = m, vr = v;
    const float bc1 = 0.19f, bc2 = 0.0975f;
    auto out = poisoned<double>(1), partials = poisoned<double>(size_t(k::optim_reduce_blocks()));
    ok(k::adam_moments(m.data(), v.data(), g.data(), n, b1, b2, bc1, bc2, eps, out.data(), partials.data(), nullptr),
       "adam_moments");
    const double cu = cpu::adam_moments<float>(mr.data(), vr.data(), g.data(), n, b1, b2, bc1, bc2, eps);
    if (n) check_sum(out[0], cu, "adam_moments ||U||^2");
    else EXPECT_EQ(out[0], 0.0);
    const float alpha = n ? float(-1e-2 / std::sqrt(cu)) : 1.f;
    out = poisoned<double>(1);
    ok(k::adam_apply(w.data(), m.data(), v.data(), n, bc1, bc2, eps, alpha, out.data(), partials.data(), nullptr),
       "adam_apply");
    const double cw = cpu::adam_apply<float>(wr.data(), mr.data(), vr.data(), n, bc1, bc2, eps, alpha);
    if (n) check_sum(out[0], cw, "adam_apply ||w||^2");
    else EXPECT_EQ(out[0], 0.0);
    check(m, mr, kF32, fmt("adam n=%zu m", n));
    check(v, vr, kF32, fmt("adam n=%zu v", n));
    check(w, wr, kF32, fmt("adam n=%zu w", n));
  }
}

TEST_F(CudaEmu, MuonMomentumAxpySumsqNewtonSchulzPieces) {
  const size_t n = 1001;
  auto B = randv(n), Br = B, D = poisoned(n), w = randv(n), wr = w;
  const auto G = randv(n), x = randv(n);
  std::vector<float> Dr(n);
  ok(k::muon_momentum(B.data(), D.data(), G.data(), n, 0.95f, nullptr, nullptr), "muon");
  cpu::muon_momentum<float>(Br.data(), Dr.data(), G.data(), n, 0.95f);
  check(B, Br, kF32, "muon_momentum B");
  check(D, Dr, kF32, "muon_momentum D");

  auto out = poisoned<double>(1), partials = poisoned<double>(size_t(k::optim_reduce_blocks()));
  ok(k::axpy_sumsq(w.data(), x.data(), n, -0.37f, out.data(), partials.data(), nullptr), "axpy");
  const double cs = cpu::axpy_sumsq<float>(wr.data(), x.data(), n, -0.37f);
  check(w, wr, kF32, "axpy_sumsq w");
  check_sum(out[0], cs, "axpy_sumsq ||w||^2");
  out = poisoned<double>(1);
  ok(k::axpy_sumsq(nullptr, nullptr, 0, 1.f, out.data(), partials.data(), nullptr), "axpy");
  EXPECT_EQ(out[0], 0.0) << "n == 0 still writes its zero sum";

  // Newton-Schulz's non-GEMM pieces (the GEMMs need cuBLASLt: not emulated).
  const double ss = 12.5;
  auto y = poisoned(n), yr = x;
  ok(k::scale_by_inv_norm(y.data(), x.data(), n, &ss, nullptr), "scale_by_inv_norm");
  const float inv = float(1.0 / (std::sqrt(ss) + 1e-8));
  for (auto& e : yr) e *= inv;
  exact(y, yr, "scale_by_inv_norm");
  const int m = 37;
  const auto A = randv(size_t(m) * m);
  auto P = poisoned(A.size()), Pr = A;
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < m; ++j) {
      const float bv = -4.7750f * A[size_t(i) * m + j];
      Pr[size_t(i) * m + j] = i == j ? bv + 3.4445f : bv;
    }
  ok(k::ns_poly_init(P.data(), A.data(), m, 3.4445f, -4.7750f, nullptr), "ns_poly_init");
  exact(P, Pr, "ns_poly_init");
}

// The emulation itself: a launch error is reported through cudaGetLastError, as on the device.
TEST_F(CudaEmu, LaunchErrorsReachCudaGetLastError) {
  std::vector<double> row(2, 0.0), sums(2);
  // reduce_pairs launches 1024 threads: fine. A grid of 0 blocks is a configuration error.
  ok(k::reduce_pairs(row.data(), 1, sums.data(), nullptr), "reduce_pairs");
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> o(4), l(1);
  const cpu::AttnShape s{1, 1, 70000, 1, 16, 0, 0.25};  // grid.y = H above 65535
  EXPECT_EQ(k::attention_forward(o.data(), l.data(), o.data(), o.data(), o.data(), s, nullptr),
            cudaErrorInvalidConfiguration);
}

// Dynamic shared memory above 48 KiB needs the kernel's opt-in (cudaFuncSetAttribute), on the
// device and in the emulation: a kernel that forgets it fails to launch on a GPU only otherwise.
void smem_probe_kernel(int* flag) {
  if (threadIdx.x == 0) *flag = 1;
}

TEST_F(CudaEmu, DynamicSharedMemoryAbove48KiBNeedsTheOptIn) {
  int flag = 0;
  (void)cudaGetLastError();
  emu::launch(false, dim3(1), dim3(32), 64 * 1024, smem_probe_kernel, &flag);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(flag, 0) << "the kernel ran without the opt-in";
  emu::launch(false, dim3(1), dim3(32), 48 * 1024, smem_probe_kernel, &flag);  // the default limit
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(flag, 1);
  flag = 0;
  ASSERT_EQ(cudaFuncSetAttribute(smem_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024),
            cudaSuccess);
  emu::launch(false, dim3(1), dim3(32), 64 * 1024, smem_probe_kernel, &flag);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(flag, 1);
}


// ---------------------------------------------------------------------------------------------
// The memory-bound kernels' fast paths (16-byte vector accesses, rows in registers, batched loads)
// against their scalar reference paths, bitwise: k::set_reference_paths(true) makes every launcher
// take the reference path (the kernels as they were before the fast paths). Shapes pick each branch:
// vector body plus scalar tail (odd sizes), misaligned pointers (the launcher falls back to the
// scalar path), 16-byte aligned sub-buffers, in-place calls, fp32 and bf16, the QK prep's register
// shapes (hd 64 / 128 / 256, rope over hd and hd / 2; PKO resets; two dgain chunks) and one it does
// not cover. The CPU comparisons of the same launchers are the tests above and in test_emu_moe_tc.cpp.

using Bytes = std::vector<std::vector<uint8_t>>;

template <class T>
std::vector<uint8_t> raw(const T* p, size_t n) {
  std::vector<uint8_t> b(n * sizeof(T));
  if (n) std::memcpy(b.data(), p, b.size());
  return b;
}
template <class T>
std::vector<uint8_t> raw(const std::vector<T>& v) {
  return raw(v.data(), v.size());
}

struct ReferencePaths {  // forces the reference paths for its lifetime (also when an ASSERT returns)
  ReferencePaths() { k::set_reference_paths(true); }
  ~ReferencePaths() { k::set_reference_paths(false); }
};

// run() launches with fresh (poisoned) outputs and returns them; fast and reference must agree.
template <class Run>
void fast_matches_reference(Run&& run, const std::string& what) {
  ASSERT_FALSE(k::reference_paths());
  const Bytes fast = run();
  Bytes ref;
  {
    ReferencePaths force;
    ref = run();
  }
  ASSERT_EQ(fast.size(), ref.size()) << what;
  for (size_t i = 0; i < fast.size(); ++i) CudaEmu::exact(fast[i], ref[i], what + CudaEmu::fmt(" output %zu", i));
}

std::vector<uint16_t> to_bf16_bits(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = __float2bfloat16_rn(v[i]).bits;
  return b;
}

TEST_F(CudaEmu, ElementwiseFastPathsMatchReferenceBitwise) {
  // off: elements from the start of the allocations (0 and 4: 16-byte aligned, 1: misaligned for a
  // vector, so the launcher takes the scalar path); n: vector body only, tails, shorter than a vector.
  for (size_t n : {size_t(3), size_t(64), size_t(8 * 97 + 5), size_t(4099)})
    for (size_t off : {size_t(0), size_t(1), size_t(4)}) {
      if (quick() && n == 64) continue;
      const std::string what = fmt("n=%zu off=%zu", n, off);
      const auto g = randv(n + off, -4.f, 4.f), u = randv(n + off), dh = randv(n + off);
      const auto g16 = to_bf16_bits(g), u16 = to_bf16_bits(u), dh16 = to_bf16_bits(dh);
      fast_matches_reference([&] {
        auto h = poisoned(n + off), dg = poisoned(n + off), du = poisoned(n + off), dg16 = poisoned(n + off);
        auto du16 = poisoned(n + off);
        auto h16 = poisoned<uint16_t>(n + off), dgb = poisoned<uint16_t>(n + off), dub = poisoned<uint16_t>(n + off);
        ok(k::swiglu_forward(h.data() + off, g.data() + off, u.data() + off, n, nullptr), what);
        ok(k::swiglu_backward(dg.data() + off, du.data() + off, dh.data() + off, g.data() + off, u.data() + off, n,
                              nullptr), what);
        ok(k::swiglu_forward_bf16(h16.data() + off, g16.data() + off, u16.data() + off, n, nullptr), what);
        ok(k::swiglu_backward_bf16(dg16.data() + off, du16.data() + off, dh.data() + off, g16.data() + off,
                                   u16.data() + off, n, nullptr), what);
        ok(k::swiglu_backward_bf16_grads(dgb.data() + off, dub.data() + off, dh16.data() + off, g16.data() + off,
                                         u16.data() + off, n, nullptr), what);
        // In place: h over g, dg over dh.
        auto hg = g, dgh = dh;
        ok(k::swiglu_forward(hg.data() + off, hg.data() + off, u.data() + off, n, nullptr), what);
        auto dui = poisoned(n + off);
        ok(k::swiglu_backward(dgh.data() + off, dui.data() + off, dgh.data() + off, g.data() + off, u.data() + off, n,
                              nullptr), what);
        return Bytes{raw(h), raw(dg), raw(du), raw(h16), raw(dg16), raw(du16), raw(dgb), raw(dub), raw(hg), raw(dgh),
                     raw(dui)};
      }, "swiglu " + what);
      fast_matches_reference([&] {
        auto b = poisoned<uint16_t>(n + off);
        auto f = poisoned(n + off), y = dh, ys = dh, yy = dh;
        ok(k::f32_to_bf16(b.data() + off, g.data() + off, n, nullptr), what);
        ok(k::bf16_to_f32(f.data() + off, g16.data() + off, n, nullptr), what);
        ok(k::add_inplace(y.data() + off, u.data() + off, n, nullptr), what);
        ok(k::add_inplace(yy.data() + off, yy.data() + off, n, nullptr), what);  // y += y
        ok(k::scale_inplace(ys.data() + off, -0.37f, n, nullptr), what);
        return Bytes{raw(b), raw(f), raw(y), raw(yy), raw(ys)};
      }, "casts, add, scale " + what);
      // The casts are exact operations: the fast path also equals the CPU's rounding bit for bit.
      auto b = poisoned<uint16_t>(n);
      ok(k::f32_to_bf16(b.data(), g.data() + off, n, nullptr), what);
      exact(b, std::vector<uint16_t>(g16.begin() + off, g16.end()), "f32_to_bf16 vs host rounding " + what);
    }
  // The SwiGLU over the rows in use (swiglu_*_rows: the count read on the device, the grid sized by
  // rows): fp32, h16, h16 + d16, a count below rows (cols 37: a bound off the vector width, so the
  // vector loop ends early and the scalar tail takes the rest), at, above (clamped), 0 and negative,
  // aligned, misaligned and in place. On both paths each output is bitwise the plain op's on the
  // first min(rows, used) * cols elements, the rest keeping its poison.
  for (auto [cols, off] : {std::pair{37, size_t(0)}, std::pair{37, size_t(1)}, std::pair{16, size_t(4)}})
    for (int used : {5, 11, 13, 0, -2}) {
      const int rows = 11;
      const size_t n = size_t(rows) * cols, m = size_t(std::clamp(used, 0, rows)) * cols;
      const std::string what = fmt("rows=%d cols=%d used=%d off=%zu", rows, cols, used, off);
      const auto g = randv(n + off, -4.f, 4.f), u = randv(n + off), dh = randv(n + off);
      const auto g16 = to_bf16_bits(g), u16 = to_bf16_bits(u), dh16 = to_bf16_bits(dh);
      const int32_t dev_used[1] = {used};
      fast_matches_reference([&] {
        auto h = poisoned(n + off), dg = poisoned(n + off), du = poisoned(n + off), dg16 = poisoned(n + off);
        auto du16 = poisoned(n + off);
        auto h16 = poisoned<uint16_t>(n + off), dgb = poisoned<uint16_t>(n + off), dub = poisoned<uint16_t>(n + off);
        ok(k::swiglu_forward_rows(h.data() + off, g.data() + off, u.data() + off, false, rows, cols, dev_used,
                                  nullptr), what);
        ok(k::swiglu_backward_rows(dg.data() + off, du.data() + off, dh.data() + off, g.data() + off, u.data() + off,
                                   false, false, rows, cols, dev_used, nullptr), what);
        ok(k::swiglu_forward_rows(h16.data() + off, g16.data() + off, u16.data() + off, true, rows, cols, dev_used,
                                  nullptr), what);
        ok(k::swiglu_backward_rows(dg16.data() + off, du16.data() + off, dh.data() + off, g16.data() + off,
                                   u16.data() + off, true, false, rows, cols, dev_used, nullptr), what);
        ok(k::swiglu_backward_rows(dgb.data() + off, dub.data() + off, dh16.data() + off, g16.data() + off,
                                   u16.data() + off, true, true, rows, cols, dev_used, nullptr), what);
        auto hg = g, dgh = dh, dui = poisoned(n + off);  // in place: h over g, dg over dh
        ok(k::swiglu_forward_rows(hg.data() + off, hg.data() + off, u.data() + off, false, rows, cols, dev_used,
                                  nullptr), what);
        ok(k::swiglu_backward_rows(dgh.data() + off, dui.data() + off, dgh.data() + off, g.data() + off,
                                   u.data() + off, false, false, rows, cols, dev_used, nullptr), what);
        // The plain ops on the first m elements, into outputs prepared the same way.
        auto ph = poisoned(n + off), pdg = poisoned(n + off), pdu = poisoned(n + off), pdg16 = poisoned(n + off);
        auto pdu16 = poisoned(n + off);
        auto ph16 = poisoned<uint16_t>(n + off), pdgb = poisoned<uint16_t>(n + off);
        auto pdub = poisoned<uint16_t>(n + off);
        ok(k::swiglu_forward(ph.data() + off, g.data() + off, u.data() + off, m, nullptr), what);
        ok(k::swiglu_backward(pdg.data() + off, pdu.data() + off, dh.data() + off, g.data() + off, u.data() + off, m,
                              nullptr), what);
        ok(k::swiglu_forward_bf16(ph16.data() + off, g16.data() + off, u16.data() + off, m, nullptr), what);
        ok(k::swiglu_backward_bf16(pdg16.data() + off, pdu16.data() + off, dh.data() + off, g16.data() + off,
                                   u16.data() + off, m, nullptr), what);
        ok(k::swiglu_backward_bf16_grads(pdgb.data() + off, pdub.data() + off, dh16.data() + off, g16.data() + off,
                                         u16.data() + off, m, nullptr), what);
        auto phg = g, pdgh = dh, pdui = poisoned(n + off);
        ok(k::swiglu_forward(phg.data() + off, phg.data() + off, u.data() + off, m, nullptr), what);
        ok(k::swiglu_backward(pdgh.data() + off, pdui.data() + off, pdgh.data() + off, g.data() + off, u.data() + off,
                              m, nullptr), what);
        const Bytes rows_out{raw(h), raw(dg), raw(du), raw(h16), raw(dg16), raw(du16), raw(dgb), raw(dub), raw(hg),
                             raw(dgh), raw(dui)};
        const Bytes plain{raw(ph), raw(pdg), raw(pdu), raw(ph16), raw(pdg16), raw(pdu16), raw(pdgb), raw(pdub),
                          raw(phg), raw(pdgh), raw(pdui)};
        for (size_t i = 0; i < rows_out.size(); ++i)
          exact(rows_out[i], plain[i], what + fmt(" rows op vs plain op, output %zu", i));
        return rows_out;
      }, "swiglu rows " + what);
    }
  // d16 without h16, and no count: refused before anything runs.
  {
    const int32_t dev_used[1] = {1};
    auto x = poisoned(8);
    EXPECT_EQ(k::swiglu_backward_rows(x.data(), x.data(), x.data(), x.data(), x.data(), false, true, 1, 8, dev_used,
                                      nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(k::swiglu_forward_rows(x.data(), x.data(), x.data(), false, 1, 8, nullptr, nullptr),
              cudaErrorInvalidValue);
    exact(x, poisoned(8), "refused swiglu rows calls");
  }
  // The row-count cast (rows read on the device) and the strided 2-D cast.
  for (auto [rows, cols, ld, off] : {std::tuple{5, 24, 28, 0}, {5, 24, 28, 1}, {3, 37, 40, 0}, {4, 16, 18, 0}}) {
    const std::string what = fmt("rows=%d cols=%d ld=%d off=%d", rows, cols, ld, off);
    const auto in = randv(size_t(rows) * ld + off);
    fast_matches_reference([&] {
      const int32_t dev_rows[1] = {rows - 1};
      auto r = poisoned<uint16_t>(size_t(rows) * cols + off), m = poisoned<uint16_t>(size_t(rows) * cols + off);
      ok(k::f32_to_bf16_rows(r.data() + off, in.data() + off, dev_rows, size_t(cols), size_t(rows), nullptr), what);
      ok(k::f32_to_bf16_2d(m.data() + off, in.data() + off, rows, cols, ld, nullptr), what);
      return Bytes{raw(r), raw(m)};
    }, "bf16 rows / 2d " + what);
  }
}

TEST_F(CudaEmu, RmsNormRegisterPathMatchesReferenceBitwise) {
  // D up to 2048 keeps a row in registers (8 per thread); 2049 takes the reference path either way.
  for (int D : {1, 200, 256, 300, 1024, 2048, 2049}) {
    if (quick() && (D == 256 || D == 2048)) continue;
    const int N = 5;
    const std::string what = fmt("rmsnorm N=%d D=%d", N, D);
    const auto x = randv(size_t(N) * D), dy = randv(size_t(N) * D), g = randv(size_t(D), 0.5f, 1.5f);
    const auto dx0 = randv(size_t(N) * D), dg0 = randv(size_t(D));
    fast_matches_reference([&] {
      Bytes outs;
      for (const float* gain : {g.data(), static_cast<const float*>(nullptr)}) {
        auto y = poisoned(size_t(N) * D), rstd = poisoned(size_t(N)), r16 = poisoned(size_t(N));
        auto y16 = poisoned<uint16_t>(size_t(N) * D);
        ok(k::rmsnorm_forward(y.data(), rstd.data(), x.data(), gain, N, D, 1e-5f, nullptr), what);
        ok(k::rmsnorm_forward_bf16(y16.data(), r16.data(), x.data(), gain, N, D, 1e-5f, nullptr), what);
        for (bool acc : {false, true}) {
          auto dx = acc ? dx0 : poisoned(size_t(N) * D), dg = dg0;
          std::vector<float> scratch = poisoned(k::rmsnorm_backward_scratch_floats(N, D));
          ok(k::rmsnorm_backward(dx.data(), gain ? dg.data() : nullptr, dy.data(), x.data(), gain, rstd.data(), N, D,
                                 acc, scratch.data(), nullptr), what);
          outs.push_back(raw(dx));
          outs.push_back(raw(dg));
        }
        outs.insert(outs.end(), {raw(y), raw(rstd), raw(y16), raw(r16)});
      }
      return outs;
    }, what);
  }
}

TEST_F(CudaEmu, QkPrepRegisterPathsMatchReferenceBitwise) {
  const float theta = 10000.f, eps = 1e-6f;
  // (64, 32): half = 16 is not a multiple of 32, the reference path either way. 100 x 3 rows: two
  // dgain chunks, the second with an odd number of rows for some warps (a row without a pair).
  for (auto [B, S, nh, hd, rot] : {std::tuple{2, 9, 3, 64, 64}, {1, 100, 3, 64, 64}, {2, 5, 2, 128, 128},
                                   {2, 5, 2, 128, 64}, {1, 6, 2, 256, 256}, {1, 6, 2, 256, 128}, {2, 5, 2, 64, 32}}) {
    if (quick() && (S == 100 || hd == 256)) continue;
    const int N = B * S;
    const std::vector<uint8_t> reset = random_resets(rng_, N, S, 0.2);
    const size_t n = size_t(N) * nh * hd, rows = size_t(N) * nh;
    const auto x = randv(n), dout = randv(n), g = randv(size_t(hd), 0.5f, 1.5f), dg0 = randv(size_t(hd));
    const auto x16 = to_bf16_bits(x);
    const auto tab = rope_table(S, rot, theta);
    for (bool norm : {true, false})
      for (bool with_gain : {true, false})
        for (bool pko : {true, false}) {
          if (!norm && with_gain) continue;  // the gain is the norm's
          const std::string what = fmt("qk_prep B=%d S=%d nh=%d hd=%d rot=%d norm=%d gain=%d pko=%d", B, S, nh, hd,
                                       rot, int(norm), int(with_gain), int(pko));
          const float* gain = with_gain ? g.data() : nullptr;
          const uint8_t* r = pko ? reset.data() : nullptr;
          fast_matches_reference([&] {
            auto out = poisoned(n), rstd = poisoned(rows), dx = poisoned(n), dg = dg0, rstd16 = poisoned(rows);
            auto dx16 = poisoned(n), dg16 = dg0;
            auto out16 = poisoned<uint16_t>(n);
            std::vector<float> scratch = poisoned(k::qk_prep_backward_scratch_floats(N, nh, hd));
            ok(k::qk_prep_forward(out.data(), rstd.data(), x.data(), gain, r, tab.data(), N, S, nh, hd, rot, norm,
                                  eps, nullptr), what);
            ok(k::qk_prep_backward(dx.data(), with_gain ? dg.data() : nullptr, dout.data(), x.data(), gain,
                                   rstd.data(), r, tab.data(), N, S, nh, hd, rot, norm, scratch.data(), nullptr),
               what);
            ok(k::qk_prep_forward_bf16(out16.data(), rstd16.data(), x16.data(), gain, r, tab.data(), N, S, nh, hd,
                                       rot, norm, eps, nullptr), what);
            ok(k::qk_prep_backward_bf16(dx16.data(), with_gain ? dg16.data() : nullptr, dout.data(), x16.data(), gain,
                                        rstd16.data(), r, tab.data(), N, S, nh, hd, rot, norm, scratch.data(),
                                        nullptr), what);
            Bytes o{raw(out), raw(dx), raw(dg), raw(out16), raw(dx16), raw(dg16)};
            if (norm) o.insert(o.end(), {raw(rstd), raw(rstd16)});  // written only with the norm
            return o;
          }, what);
          if (hd == 128 && rot == 64 && norm && with_gain && pko) {  // and the fast path against the CPU
            auto out = poisoned(n), rstd = poisoned(rows);
            std::vector<float> outr(n), rr(rows);
            ok(k::qk_prep_forward(out.data(), rstd.data(), x.data(), gain, r, tab.data(), N, S, nh, hd, rot, norm,
                                  eps, nullptr), what);
            cpu::qk_prep_forward<float>(outr.data(), rr.data(), x.data(), gain, r, N, S, nh, hd, rot, theta, norm,
                                        eps);
            check(out, outr, kF32, what + " out vs cpu");
            check(rstd, rr, kF32, what + " rstd vs cpu");
          }
        }
  }
}

TEST_F(CudaEmu, MoeRowFastPathsMatchReferenceBitwise) {
  const int N = 7, K = 3, NK = N * K;
  // d = 300: 4-column vectors, and 9 lane-batches of 8 plus a tail in combine_backward; 37: scalar.
  for (int d : {300, 37, 1024}) {
    if (quick() && d == 1024) continue;
    const std::string what = fmt("N=%d K=%d d=%d", N, K, d);
    std::vector<int32_t> row(NK), slot(NK);
    std::iota(row.begin(), row.end(), 0);
    std::shuffle(row.begin(), row.end(), rng_);
    for (int j = 0; j < NK; ++j) slot[row[j]] = j;
    const auto h = randv(size_t(N) * d), y = randv(size_t(NK) * d), comb = randv(size_t(NK), 0.f, 1.f);
    const auto out0 = randv(size_t(N) * d), dout = randv(size_t(N) * d), dxs = randv(size_t(NK) * d);
    const auto y16 = to_bf16_bits(y);
    // The capacity layout's gather (model.moe_capacity): slots with negative ones mixed in, -1 (zero
    // rows) and below -1 (rows left as they are: they must keep their poison on both paths).
    std::vector<int32_t> cslot;
    for (int j = 0; j < NK; ++j) cslot.insert(cslot.end(), {slot[j], -1, j % 2 ? -2 : -5});
    const int R = int(cslot.size());
    fast_matches_reference([&] {
      auto xc = poisoned(size_t(R) * d);
      auto xc16 = poisoned<uint16_t>(size_t(R) * d);
      ok(k::moe_gather(xc.data(), h.data(), cslot.data(), R, K, d, nullptr), what);
      ok(k::moe_gather_bf16(xc16.data(), h.data(), cslot.data(), R, K, d, nullptr), what);
      auto zr = dxs;  // and the padding rows of a gradient zeroed (moe_zero_rows), fp32 and bf16
      auto zr16 = to_bf16_bits(dxs);
      ok(k::moe_zero_rows(zr.data(), false, cslot.data(), NK, d, nullptr), what);
      ok(k::moe_zero_rows(zr16.data(), true, cslot.data(), NK, d, nullptr), what);
      size_t written = 0;
      for (int q = 0; q < R; ++q)
        if (cslot[size_t(q)] < -1)
          for (int c = 0; c < d; ++c) {
            float x;
            std::memcpy(&x, &xc[size_t(q) * d + size_t(c)], sizeof x);
            written += !std::isnan(x) || xc16[size_t(q) * d + size_t(c)] != 0xFFFF;
          }
      EXPECT_EQ(written, 0u) << what << ": a gather wrote a row whose slot is below -1";
      return Bytes{raw(xc), raw(xc16), raw(zr), raw(zr16)};
    }, what + " negative slots");
    fast_matches_reference([&] {
      auto xs = poisoned(size_t(NK) * d), out = out0, out16 = out0;
      auto xs16 = poisoned<uint16_t>(size_t(NK) * d);
      auto dy = poisoned(size_t(NK) * d), dc = poisoned(size_t(NK)), dy16 = poisoned(size_t(NK) * d);
      auto dc16 = poisoned(size_t(NK)), dh = poisoned(size_t(N) * d);
      auto dyb = poisoned<uint16_t>(size_t(NK) * d);
      auto dcb = poisoned(size_t(NK));
      ok(k::moe_gather(xs.data(), h.data(), slot.data(), NK, K, d, nullptr), what);
      ok(k::moe_gather_bf16(xs16.data(), h.data(), slot.data(), NK, K, d, nullptr), what);
      ok(k::moe_combine(out.data(), y.data(), comb.data(), row.data(), N, K, d, nullptr), what);
      ok(k::moe_combine_bf16(out16.data(), y16.data(), comb.data(), row.data(), N, K, d, nullptr), what);
      ok(k::moe_combine_backward(dy.data(), dc.data(), dout.data(), y.data(), comb.data(), row.data(), N, K, d,
                                 nullptr), what);
      ok(k::moe_combine_backward_bf16(dy16.data(), dc16.data(), dout.data(), y16.data(), comb.data(), row.data(), N,
                                      K, d, nullptr), what);
      ok(k::moe_combine_backward_bf16_grads(dyb.data(), dcb.data(), dout.data(), y16.data(), comb.data(), row.data(),
                                            N, K, d, nullptr), what);
      ok(k::moe_gather_backward(dh.data(), dxs.data(), row.data(), N, K, d, nullptr), what);
      return Bytes{raw(xs), raw(xs16), raw(out), raw(out16), raw(dy), raw(dc), raw(dy16), raw(dc16), raw(dyb), raw(dcb),
                   raw(dh)};
    }, what);
  }
}

}  // namespace
}  // namespace ladder
