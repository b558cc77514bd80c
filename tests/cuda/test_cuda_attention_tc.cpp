// The tensor-core flash attention (backend/cuda/attention_tc.cu) against the CPU kernels
// cpu::attention_forward/backward<float> on fresh random inputs (seed printed). Outputs are poisoned
// first (every byte 0xFF, NaN) so an element the kernels never write fails. Measure, as in
// test_cuda_kernels.cpp: ||gpu - cpu|| / ||cpu|| over the whole output ("[ rel err ]" lines), and
// any non-finite GPU element where the CPU's is finite is a failure.
//
// Two references per case, to separate the rounding of the inputs from the kernel's own error:
//  - kTcInputs = 1e-2, against the CPU on the original fp32 inputs. bf16 keeps 8 significant bits
//    (unit roundoff u = 2^-8 = 3.9e-3; a random value's rounding error is about u/3 = 1.3e-3 rms).
//    Rounding q and k perturbs each score scale*q.k by about sqrt(2 hd) * |q_d||k_d| * scale * u/3,
//    which is ~3e-3 absolute at the inputs below (q, k uniform in [-2, 2], scale 1/sqrt(hd)), so
//    about 0.3% relative on each probability; v, dO, P and dS add ~1.3e-3 each. Expected ~2-5e-3
//    in total; 1e-2 is the bound.
//  - kTcRounded = 5e-3, against the CPU run on the bf16-rounded q, k, v, dO (the same bits the
//    kernel feeds its MMAs). What is left is the kernel's own rounding of P (forward, dV) and dS
//    (dK, dQ) to bf16 before their MMAs: independent relative errors of ~u/3 = 1.3e-3 rms per
//    element, which carry into a weighted sum as about the same relative error. 5e-3 (~4x that, or
//    1.3 u) leaves room for unlucky cancellation while still failing a wrong mask, a wrong rescale
//    or a missing tile, which give errors of order 1.
// Two outputs whose relative error is ill-conditioned get a floor under the denominator: lse
// (max(||lse||, sqrt(n)): absolute error where |lse| < 1, see run_case) and, at S = 1, dq and dk
// (exactly zero there; measured against ||dv||).
// The test also insists that bf16 is really in use: the forward's o against the fp32-input
// reference must differ by more than 1e-5 (fp32 kernels give ~1e-7).
// Without a GPU each test calls GTEST_SKIP() with "no CUDA device: GPU test skipped (<reason>)".
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cuda/attention_tc.cuh"
#include "backend/cuda/attention_wgmma.cuh"
#include "backend/cuda/cuda_backend.h"
#include "cuda_fixture.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_memory.h"
#include "core/error.h"

namespace ladder {
namespace {

using cuda::DeviceBuffer;

constexpr double kTcInputs = 1e-2;
constexpr double kTcRounded = 5e-3;

// Round to the nearest bf16 (ties to even), kept in a float: what __float2bfloat16_rn does to
// the finite values used here.
float bf16_round(float x) { return cpu::bf16_value(cpu::bf16_bits(x)); }
std::vector<float> bf16_round(std::vector<float> v) {
  for (auto& x : v) x = bf16_round(x);
  return v;
}

class CudaAttentionTc : public test::CudaFixture {
 protected:
  struct Case {
    int B, S, H, KV, hd, window;
    float qk_range = 2.f;        // q, k uniform in [-r, r]; v, dout in [-1, 1]
    bool check_inputs = true;    // also hold it to the fp32-input reference (kTcInputs)
    size_t offset = 0;           // floats: inputs at a 4-byte, not 16-byte, aligned address
  };

  struct Ref {
    std::vector<float> o, lse, dq, dk, dv;
  };
  static Ref cpu_ref(const AttnShape& s, const std::vector<float>& q, const std::vector<float>& k,
                     const std::vector<float>& v, const std::vector<float>& dout) {
    Ref r;
    r.o.resize(q.size());
    r.lse.resize(size_t(s.B) * s.H * s.S);
    r.dq.resize(q.size());
    r.dk.resize(k.size());
    r.dv.resize(k.size());
    cpu::attention_forward<float>(r.o.data(), r.lse.data(), q.data(), k.data(), v.data(), s);
    cpu::attention_backward<float>(r.dq.data(), r.dk.data(), r.dv.data(), dout.data(), q.data(), k.data(), v.data(),
                                   r.o.data(), r.lse.data(), s);
    return r;
  }

  std::string tag_ = "attn_tc";  // the "[ rel err ]" lines' prefix (gpu-check's table groups by it)
  // The kernels this suite runs behind the launchers (CudaAttentionTc: WMMA; the default is mma.sync),
  // selected for each test and the previous choice restored after it.
  cuda::k::AttnTcKernels want_{false, false}, saved_;
  void SetUp() override {
    test::CudaFixture::SetUp();
    if (IsSkipped()) return;
    saved_ = cuda::k::attention_tc_kernels();
    cuda::k::attention_tc_set_kernels(want_);
  }
  void TearDown() override {
    if (!IsSkipped()) cuda::k::attention_tc_set_kernels(saved_);
    test::CudaFixture::TearDown();
  }

  // The tests' bodies, run by both suites (CudaAttentionTc: the WMMA kernels; CudaAttentionMma: the
  // mma.sync kernels).
  // S 1 / 17 / 128 / 300 (a single row, less than a tile, exactly two tiles, a ragged last tile),
  // head_dim 64 and 128, MHA and GQA 4:1 (two KV groups, so the group index is exercised), windows
  // 0 (causal), 5 (inside one tile), 64 (one tile wide: tiles skipped and partly masked).
  void across_shapes() {
    for (int hd : {64, 128})
      for (int S : {1, 17, 128, 300})
        for (int gqa = 0; gqa < 2; ++gqa)
          for (int W : {0, 5, 64}) {
            Case c{2, S, gqa ? 8 : 2, 2, hd, W};
            run_case(c);
            if (HasFatalFailure()) return;
          }
  }
  // Sharp softmax (scores of tens): the online rescaling does most of the work. Only the
  // rounded-input reference applies (rounding q and k moves scores this large by more than 1e-2
  // relative in P).
  void sharp_softmax() {
    for (int hd : {64, 128}) {
      Case c{2, 300, 8, 2, hd, 0, 6.f, false};
      run_case(c);
      Case w{1, 300, 4, 4, hd, 100, 6.f, false};
      run_case(w);
    }
  }
  // Inputs at an address 4 bytes past a 16-byte boundary: the scalar load path.
  void unaligned_inputs() {
    Case c{2, 77, 8, 2, 64, 0};
    c.offset = 1;
    run_case(c);
    Case d{1, 130, 4, 1, 128, 17};
    d.offset = 3;
    run_case(d);
  }

  void run_case(const Case& c) {
    const std::string shape =
        fmt::format("B={} S={} H={} KV={} hd={} W={}{}{}", c.B, c.S, c.H, c.KV, c.hd, c.window,
                    c.qk_range != 2.f ? fmt::format(" qk=+-{}", c.qk_range) : "", c.offset ? " unaligned" : "");
    SCOPED_TRACE(shape);
    const AttnShape s{c.B, c.S, c.H, c.KV, c.hd, c.window, 1.0 / std::sqrt(double(c.hd))};
    ASSERT_TRUE(cuda::k::attention_tc_supported(s)) << shape;
    const size_t nq = size_t(c.B) * c.S * c.H * c.hd, nk = size_t(c.B) * c.S * c.KV * c.hd,
                 nl = size_t(c.B) * c.H * c.S;
    auto q = randv(nq, -c.qk_range, c.qk_range), k = randv(nk, -c.qk_range, c.qk_range), v = randv(nk, -1.f, 1.f),
         dout = randv(nq, -1.f, 1.f);
    const size_t off = c.offset;
    auto d_q = up(q, off), d_k = up(k, off), d_v = up(v, off), d_dout = up(dout, off);

    // Forward twice: bitwise the same.
    std::vector<float> o, lse;
    auto d_o = poisoned(nq), d_lse = poisoned(nl);
    for (int rep = 0; rep < 2; ++rep) {
      d_o.poison();
      d_lse.poison();
      LADDER_CUDA_CHECK(cuda::k::attention_tc_forward(d_o.data(), d_lse.data(), d_q.data() + off, d_k.data() + off,
                                                      d_v.data() + off, s, st()));
      auto go = down(d_o, nq), gl = down(d_lse, nl);
      if (rep == 0) {
        o = go;
        lse = gl;
      } else {
        EXPECT_EQ(go, o) << "attention_tc_forward o is not bitwise reproducible";
        EXPECT_EQ(gl, lse) << "attention_tc_forward lse is not bitwise reproducible";
      }
    }

    // Backward twice (fresh poisoned outputs each time): bitwise the same.
    DeviceBuffer<float> scratch(std::max<size_t>(1, cuda::k::attention_tc_backward_scratch_floats(s)));
    std::vector<float> dq, dk, dv;
    for (int rep = 0; rep < 2; ++rep) {
      auto d_dq = poisoned(nq), d_dk = poisoned(nk), d_dv = poisoned(nk);
      scratch.poison();
      LADDER_CUDA_CHECK(cuda::k::attention_tc_backward(d_dq.data(), d_dk.data(), d_dv.data(), d_dout.data() + off,
                                                       d_q.data() + off, d_k.data() + off, d_v.data() + off,
                                                       d_o.data(), d_lse.data(), s, scratch.data(), st()));
      auto gq = down(d_dq, nq), gk = down(d_dk, nk), gv = down(d_dv, nk);
      if (rep == 0) {
        dq = gq;
        dk = gk;
        dv = gv;
      } else {
        EXPECT_EQ(gq, dq) << "attention_tc_backward dq is not bitwise reproducible";
        EXPECT_EQ(gk, dk) << "attention_tc_backward dk is not bitwise reproducible";
        EXPECT_EQ(gv, dv) << "attention_tc_backward dv is not bitwise reproducible";
      }
    }

    // The in16 entry points (fp32 activations under bf16 precision: the backend passes q, k, v
    // rounded to bf16 and keeps o fp32): bitwise the fp32 entry points' results, the inputs now
    // staged from bf16 (cp.async where aligned: these fresh buffers are). mma.sync kernels only; with
    // the WMMA kernels selected they refuse (cudaErrorNotSupported) and the backend does not call them.
    {
      auto bits = [](const std::vector<float>& x) {
        std::vector<uint16_t> r(x.size());
        for (size_t i = 0; i < x.size(); ++i) r[i] = cpu::bf16_bits(x[i]);
        return r;
      };
      auto q16 = up(bits(q)), k16 = up(bits(k)), v16 = up(bits(v));
      auto d_o2 = poisoned(nq), d_lse2 = poisoned(nl);
      const cudaError_t ef = cuda::k::attention_tc_forward_in16(d_o2.data(), d_lse2.data(), q16.data(), k16.data(),
                                                                v16.data(), s, st());
      if (!want_.mma_fwd) {
        EXPECT_EQ(ef, cudaErrorNotSupported);
      } else {
        LADDER_CUDA_CHECK(ef);
        EXPECT_EQ(down(d_o2, nq), o) << "attention_tc_forward_in16 o: not the fp32 entry's bits";
        EXPECT_EQ(down(d_lse2, nl), lse) << "attention_tc_forward_in16 lse: not the fp32 entry's bits";
      }
      auto d_dq2 = poisoned(nq), d_dk2 = poisoned(nk), d_dv2 = poisoned(nk);
      scratch.poison();
      const cudaError_t eb = cuda::k::attention_tc_backward_in16(
          d_dq2.data(), d_dk2.data(), d_dv2.data(), d_dout.data() + off, q16.data(), k16.data(), v16.data(),
          d_o.data(), d_lse.data(), s, scratch.data(), st());
      if (!want_.mma_bwd) {
        EXPECT_EQ(eb, cudaErrorNotSupported);
      } else {
        LADDER_CUDA_CHECK(eb);
        EXPECT_EQ(down(d_dq2, nq), dq) << "attention_tc_backward_in16 dq: not the fp32 entry's bits";
        EXPECT_EQ(down(d_dk2, nk), dk) << "attention_tc_backward_in16 dk: not the fp32 entry's bits";
        EXPECT_EQ(down(d_dv2, nk), dv) << "attention_tc_backward_in16 dv: not the fp32 entry's bits";
      }
    }

    // At S = 1 the one key has probability 1 whatever its score, so the exact dq and dk are zero and
    // both sides hold rounding noise (~1e-7 of a normal gradient): measure them against ||dv||, the
    // size a non-degenerate gradient would have (dv = dO there).
    auto nrm = [](const std::vector<float>& x) {
      double a = 0;
      for (float e : x) a += double(e) * e;
      return std::sqrt(a);
    };

    // lse enters everything downstream as exp(s - lse): an absolute error e in it is a relative error
    // e in every probability of its row. So it is held to tol in that absolute sense where |lse| < 1
    // (denominator max(||lse||, sqrt(n))): at S = 1, lse is a single score, which can be ~0.
    const double fl = std::sqrt(double(nl));

    // The same bits as the MMAs see: the kernel's own error only.
    const Ref rb = cpu_ref(s, bf16_round(q), bf16_round(k), bf16_round(v), bf16_round(dout));
    const double fb = c.S == 1 ? nrm(rb.dv) : 0.0;
    check(o, rb.o, kTcRounded, tag_ + " fwd o bf16-ref " + shape);
    check(lse, rb.lse, kTcRounded, tag_ + " fwd lse bf16-ref " + shape, fl);
    check(dq, rb.dq, kTcRounded, tag_ + " bwd dq bf16-ref " + shape, fb);
    check(dk, rb.dk, kTcRounded, tag_ + " bwd dk bf16-ref " + shape, fb);
    check(dv, rb.dv, kTcRounded, tag_ + " bwd dv bf16-ref " + shape);
    if (c.check_inputs) {
      const Ref rf = cpu_ref(s, q, k, v, dout);
      const double ff = c.S == 1 ? nrm(rf.dv) : 0.0;
      const double ro = check(o, rf.o, kTcInputs, tag_ + " fwd o " + shape);
      EXPECT_GT(ro, 1e-5) << "as exact as fp32: are the inputs really rounded to bf16?";
      check(lse, rf.lse, kTcInputs, tag_ + " fwd lse " + shape, fl);
      check(dq, rf.dq, kTcInputs, tag_ + " bwd dq " + shape, ff);
      check(dk, rf.dk, kTcInputs, tag_ + " bwd dk " + shape, ff);
      check(dv, rf.dv, kTcInputs, tag_ + " bwd dv " + shape);
    }
  }
};

TEST_F(CudaAttentionTc, Supported) {
  for (int hd : {64, 128}) {
    EXPECT_TRUE(cuda::k::attention_tc_supported(AttnShape{2, 100, 8, 8, hd, 0, 0.1})) << hd;
    EXPECT_TRUE(cuda::k::attention_tc_supported(AttnShape{2, 100, 8, 2, hd, 32, 0.1})) << hd;
    EXPECT_FALSE(cuda::k::attention_tc_supported(AttnShape{2, 100, 6, 4, hd, 0, 0.1})) << "H % KV != 0";
  }
  for (int hd : {1, 16, 32, 48, 96, 100, 127, 160, 256})
    EXPECT_FALSE(cuda::k::attention_tc_supported(AttnShape{1, 16, 2, 2, hd, 0, 0.1})) << hd;
  // Unsupported shapes are refused by the launchers without launching anything.
  const AttnShape bad{1, 4, 1, 1, 96, 0, 0.1};
  DeviceBuffer<float> x(4 * 96), lse(4);
  EXPECT_EQ(cuda::k::attention_tc_forward(x.data(), lse.data(), x.data(), x.data(), x.data(), bad, st()),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::k::attention_tc_backward(x.data(), x.data(), x.data(), x.data(), x.data(), x.data(), x.data(),
                                           x.data(), lse.data(), bad, lse.data(), st()),
            cudaErrorInvalidValue);
  be_->synchronize();
}

TEST_F(CudaAttentionTc, MatchesCpuAcrossShapes) { across_shapes(); }
TEST_F(CudaAttentionTc, SharpSoftmax) { sharp_softmax(); }
TEST_F(CudaAttentionTc, UnalignedInputs) { unaligned_inputs(); }

// The register-resident mma.sync kernels (attention_mma.cuh, the launchers' default) on the same
// cases and bounds.
class CudaAttentionMma : public CudaAttentionTc {
 protected:
  CudaAttentionMma() {
    want_ = cuda::k::AttnTcKernels{true, true};
    tag_ = "attn_mma";
  }
};

TEST_F(CudaAttentionMma, MatchesCpuAcrossShapes) { across_shapes(); }
TEST_F(CudaAttentionMma, SharpSoftmax) { sharp_softmax(); }
TEST_F(CudaAttentionMma, UnalignedInputs) { unaligned_inputs(); }

// The wgmma kernels (attention_wgmma.cuh, sm_90a; LADDER_ATTN_WGMMA=1) on the same cases and bounds;
// skipped visibly where the device or the build has no sm_90a code.
class CudaAttentionWgmma : public CudaAttentionTc {
 protected:
  CudaAttentionWgmma() {
    want_ = cuda::k::AttnTcKernels{true, true, true, true};
    tag_ = "attn_wgmma";
  }
  void SetUp() override {
    CudaAttentionTc::SetUp();
    if (IsSkipped()) return;
    if (!cuda::k::attention_wgmma_available())
      GTEST_SKIP() << "attention wgmma kernels not available (no sm_90a code in this build, or not an sm_90 device)";
    // LADDER_TEST_WGMMA=0: gpu-check's main test run, where a faulting wgmma kernel (which ends the
    // CUDA context) must not take the other tests down; they run in a process of their own.
    const char* e = std::getenv("LADDER_TEST_WGMMA");
    if (e && std::string(e) == "0") GTEST_SKIP() << "LADDER_TEST_WGMMA=0: the wgmma tests run in a process of their own";
  }
  // The launchers' o, lse, dq, dk, dv on the given inputs with the kernels `which` (the backward on
  // `which`'s own forward results).
  Ref launch(const AttnShape& s, const std::vector<float>& q, const std::vector<float>& k,
             const std::vector<float>& v, const std::vector<float>& dout, cuda::k::AttnTcKernels which) {
    cuda::k::attention_tc_set_kernels(which);
    const size_t nq = q.size(), nk = k.size(), nl = size_t(s.B) * s.H * s.S;
    auto d_q = up(q), d_k = up(k), d_v = up(v), d_dout = up(dout);
    auto d_o = poisoned(nq), d_lse = poisoned(nl), d_dq = poisoned(nq), d_dk = poisoned(nk), d_dv = poisoned(nk);
    DeviceBuffer<float> scratch(std::max<size_t>(1, cuda::k::attention_tc_backward_scratch_floats(s)));
    LADDER_CUDA_CHECK(cuda::k::attention_tc_forward(d_o.data(), d_lse.data(), d_q.data(), d_k.data(), d_v.data(), s,
                                                    st()));
    LADDER_CUDA_CHECK(cuda::k::attention_tc_backward(d_dq.data(), d_dk.data(), d_dv.data(), d_dout.data(), d_q.data(),
                                                     d_k.data(), d_v.data(), d_o.data(), d_lse.data(), s,
                                                     scratch.data(), st()));
    Ref r{down(d_o, nq), down(d_lse, nl), down(d_dq, nq), down(d_dk, nk), down(d_dv, nk)};
    cuda::k::attention_tc_set_kernels(want_);
    return r;
  }
  static double rel(const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
      den += double(b[i]) * b[i];
    }
    return std::sqrt(num / den);
  }
};

TEST_F(CudaAttentionWgmma, MatchesCpuAcrossShapes) { across_shapes(); }
TEST_F(CudaAttentionWgmma, SharpSoftmax) { sharp_softmax(); }
TEST_F(CudaAttentionWgmma, UnalignedInputs) { unaligned_inputs(); }

// wgmma against mma.sync on the same inputs: the same rounding points, so they differ only by the
// order of the fp32 sums inside the MMAs (far below kTcRounded; a layout or mask error is of order 1).
TEST_F(CudaAttentionWgmma, MatchesMmaSync) {
  for (int hd : {64, 128}) {
    const AttnShape s{2, 200, 4, 2, hd, hd == 64 ? 0 : 70, 1.0 / std::sqrt(double(hd))};
    const std::string what = fmt::format(" vs mma.sync hd={} W={}", hd, s.window);
    const size_t nq = size_t(s.B) * s.S * s.H * hd, nk = size_t(s.B) * s.S * s.KV * hd;
    auto q = randv(nq, -2.f, 2.f), k = randv(nk, -2.f, 2.f), v = randv(nk), dout = randv(nq);
    const Ref w = launch(s, q, k, v, dout, want_);
    const Ref m = launch(s, q, k, v, dout, cuda::k::AttnTcKernels{true, true, false, false});
    check(w.o, m.o, 1e-4, tag_ + " fwd o" + what);
    check(w.lse, m.lse, 1e-5, tag_ + " fwd lse" + what);
    check(w.dq, m.dq, 1e-3, tag_ + " bwd dq" + what);
    check(w.dk, m.dk, 1e-3, tag_ + " bwd dk" + what);
    check(w.dv, m.dv, 1e-3, tag_ + " bwd dv" + what);
  }
}

// The register-A wgmma the kernels' P V, dV, dK and dQ products use (wgmma_attn_ptx.cuh): one
// m64n64k16 with A loaded in the stated register fragment layout, B read K-major and MN-major from
// an attention tile, against a CPU product. Small integers: every sum is exact, so any difference
// is a layout error, and the message says which reading of the layout the device follows.
TEST_F(CudaAttentionWgmma, RegisterAFragmentLayout) {
  std::vector<uint16_t> a(64 * 16), b(16 * 64);
  std::vector<float> af(a.size()), bf(b.size());
  auto ri = randi(a.size() + b.size(), 9);
  for (size_t i = 0; i < a.size(); ++i) a[i] = cpu::bf16_bits(af[i] = float(ri[i] - 4));
  for (size_t i = 0; i < b.size(); ++i) b[i] = cpu::bf16_bits(bf[i] = float(ri[a.size() + i] - 4));
  std::vector<float> want(64 * 64, 0.f);
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < 64; ++c)
      for (int k = 0; k < 16; ++k) want[r * 64 + c] += af[r * 16 + k] * bf[k * 64 + c];
  auto d_a = up(a), d_b = up(b);
  auto run = [&](bool b_kmajor, bool swap) {
    auto d = poisoned(64 * 64);
    LADDER_CUDA_CHECK(cuda::k::wgmma_rs_selftest(d.data(), d_a.data(), d_b.data(), b_kmajor, swap, st()));
    return down(d, 64 * 64);
  };
  for (const bool b_kmajor : {true, false}) {
    const char* form = b_kmajor ? "B K-major" : "B MN-major";
    const std::vector<float> got = run(b_kmajor, false);
    size_t bad = 0;
    while (bad < got.size() && got[bad] == want[bad]) ++bad;
    if (bad == got.size()) {
      // The planted bug: the other reading of the layout must give wrong results.
      EXPECT_NE(run(b_kmajor, true), want) << form << ": a1 and a2 exchanged gave the right D: the test cannot "
                                                      "tell the register A layout";
      continue;
    }
    if (run(b_kmajor, true) == want) {
      ADD_FAILURE() << "[ wgmma    ] register A (" << form << "): the device reads a1 as (row g, k 2t + 8) and a2 as "
                    << "(row g + 8, k 2t), not mma.sync's order: pack_a's use in the wgmma kernels is wrong";
    } else {
      ADD_FAILURE() << "[ wgmma    ] register A (" << form << "): D[" << bad / 64 << "][" << bad % 64 << "] = "
                    << got[bad] << ", want " << want[bad]
                    << " (neither reading of the register A layout; if CudaWgmma.* failed too, the B operand's "
                    << "shared-memory layout is at fault)";
    }
  }
}

// The planted bug: tiles staged without the 128-byte swizzle the descriptors declare, in the forward
// (the mma.sync backward then runs on its wrong o and lse) and in the backward alone. The results
// must be far off: the tests can see a layout error, and the wgmma kernels are the ones that ran.
TEST_F(CudaAttentionWgmma, PlantedLayoutBugFails) {
  for (int hd : {64, 128}) {
    const AttnShape s{1, 130, 2, 2, hd, 0, 1.0 / std::sqrt(double(hd))};
    const size_t nq = size_t(s.B) * s.S * s.H * hd;
    auto q = randv(nq, -2.f, 2.f), k = randv(nq, -2.f, 2.f), v = randv(nq), dout = randv(nq);
    const Ref good = launch(s, q, k, v, dout, want_);
    cuda::k::attention_wgmma_plant_layout_bug(true);
    const Ref f = launch(s, q, k, v, dout, cuda::k::AttnTcKernels{true, true, true, false});
    const Ref b = launch(s, q, k, v, dout, cuda::k::AttnTcKernels{true, true, false, true});
    cuda::k::attention_wgmma_plant_layout_bug(false);
    const char* msg = ": unswizzled tiles gave the right result: the swizzle (or the wgmma path) is not what the "
                      "kernel reads";
    EXPECT_GT(rel(f.o, good.o), 0.1) << "hd " << hd << " forward" << msg;
    EXPECT_GT(rel(b.dq, good.dq), 0.1) << "hd " << hd << " backward dq" << msg;
    EXPECT_GT(rel(b.dk, good.dk), 0.1) << "hd " << hd << " backward dk" << msg;
    EXPECT_GT(rel(b.dv, good.dv), 0.1) << "hd " << hd << " backward dv" << msg;
  }
}

}  // namespace
}  // namespace ladder
