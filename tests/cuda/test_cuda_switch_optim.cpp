// The CUDA attention-switch ops (switch_ops.cu) and recipe-optimizer ops (optim_ops.cu, Newton-Schulz
// in cuda_backend.cpp) against the CPU kernels (backend/cpu/kernels.h, optim_kernels.h; float) on
// fresh random inputs with odd sizes (not multiples of any block or warp size).
// Outputs are poisoned with NaN first (every byte 0xFF) so an element a kernel never writes fails
// the comparison. Error measure: ||gpu - cpu|| / ||cpu|| over the whole output, printed as
// "[ rel err ]" lines so the GPU session can record them.
// Tolerances: kF32 = 5e-6 for fp32 elementwise ops and per-row dot products; returned doubles
// (sums of squares) within kSum = 1e-6 relative; Newton-Schulz kNsF32 = 1e-4 (see its test).
// Without a GPU each test calls GTEST_SKIP() with "no CUDA device: GPU test skipped (<reason>)".
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/optim_kernels.h"
#include "backend/cuda/cuda_backend.h"
#include "cuda_fixture.h"
#include "backend/cuda/device_memory.h"
#include "core/error.h"

namespace ladder {
namespace {

using cuda::DeviceBuffer;

constexpr double kF32 = 5e-6;
constexpr double kSum = 1e-6;
// Newton-Schulz in fp32. Five steps of X <- a X + (b A + c A^2) X amplify rounding: the scalar map's
// derivative is a_k (about 4) near 0 and about 2 in magnitude near 1, so a GEMM's last-bit
// differences (summation order: cuBLASLt's tiling against OpenBLAS's) grow by up to a_1...a_5 ~ 490
// in the directions of tiny singular values. Measured in a host emulation (two fp32 evaluations of
// the same iteration in different summation orders, uniform inputs, these shapes): 6e-7 to 1.1e-6
// apart, each within 9e-7 of float64. 1e-4 leaves ~100x margin for cuBLASLt's split-K orders while
// any real mistake (a coefficient, a transpose, a missing a X term, a wrong norm) is O(1e-2..1).
constexpr double kNsF32 = 1e-4;
// TF32 inputs carry 10 mantissa bits (about 5e-4 relative each): the same emulation with TF32-rounded
// GEMM inputs gives 1.1e-3 to 1.2e-3 against fp32; 1e-2 is a sanity bound, not a precision claim.
constexpr double kNsTF32 = 1e-2;
// bf16 operands (8 mantissa bits, 4x TF32's rounding): a sanity bound as well.
constexpr double kNsBf16 = 3e-2;

class CudaSwitchOptim : public test::CudaFixture {
 protected:
  // A returned double (a sum of squares) against the CPU's.
  static void check_sum(double gpu, double cpu, const std::string& what) {
    const double rel = std::abs(gpu - cpu) / std::max(std::abs(cpu), 1e-300);
    std::printf("[ rel err  ] %-36s %.3e (tol %.0e)\n", what.c_str(), rel, kSum);
    EXPECT_TRUE(std::isfinite(gpu)) << what;
    EXPECT_LE(rel, kSum) << what << ": gpu " << gpu << " cpu " << cpu;
  }
};

// ---------------------------------------------------------------------------------------------
// Attention switches

TEST_F(CudaSwitchOptim, PkoShiftForwardBackward) {
  struct Case {
    int B, S, nkv, hd;
  };
  for (const Case c : {Case{3, 41, 2, 16}, Case{2, 37, 3, 40}, Case{1, 129, 1, 128}}) {
    const int N = c.B * c.S;
    // Sequence starts plus document starts at random positions (about one token in 8).
    std::vector<uint8_t> reset(N);
    std::bernoulli_distribution doc(0.125);
    for (int t = 0; t < N; ++t) reset[t] = (t % c.S == 0 || doc(rng_)) ? 1 : 0;
    const size_t n = size_t(N) * c.nkv * c.hd;
    auto k = randv(n), dout = randv(n);
    auto d_k = up(k), d_dout = up(dout);
    auto d_reset = up(reset);
    for (int from : {c.hd / 2, 0, c.hd, 3}) {
      const std::string what = fmt::format("pko B={} S={} nkv={} hd={} from={}", c.B, c.S, c.nkv, c.hd, from);
      SCOPED_TRACE(what);
      auto d_out = poisoned(n), d_dk = poisoned(n);
      be().pko_shift_forward(d_out.data(), d_k.data(), d_reset.data(), N, c.nkv, c.hd, from);
      be().pko_shift_backward(d_dk.data(), d_dout.data(), d_reset.data(), N, c.nkv, c.hd, from);
      std::vector<float> out(n), dk(n);
      cpu::pko_shift_forward<float>(out.data(), k.data(), reset.data(), N, c.nkv, c.hd, from);
      cpu::pko_shift_backward<float>(dk.data(), dout.data(), reset.data(), N, c.nkv, c.hd, from);
      // Pure copies: bitwise.
      check(down(d_out, n), out, 0.0, what + " fwd");
      check(down(d_dk, n), dk, 0.0, what + " bwd");
    }
  }
}

TEST_F(CudaSwitchOptim, PkoShiftRejectsFromDimOutsideHead) {
  DeviceBuffer<float> a(64), b(64);
  DeviceBuffer<uint8_t> r(4);
  EXPECT_THROW(be().pko_shift_forward(a.data(), b.data(), r.data(), 4, 1, 16, 17), Error);
  EXPECT_THROW(be().pko_shift_backward(a.data(), b.data(), r.data(), 4, 1, 16, -1), Error);
}

// The fused attention input path (PKO shift + QK-norm + RoPE, one kernel each way) against the CPU
// op (the composition of the three CPU kernels). Odd head dims, half and full RoPE, a head dim with
// an unrotated odd tail, 1200 rows (several dgain chunks), query and key head counts of GQA models.
TEST_F(CudaSwitchOptim, QkPrepForwardBackward) {
  struct Case {
    int B, S, nh, hd, rot;
  };
  for (const Case c : {Case{2, 37, 8, 64, 64}, Case{3, 29, 2, 40, 20}, Case{1, 70, 4, 128, 64},
                       Case{2, 33, 3, 17, 16}, Case{1, 300, 4, 64, 32}}) {
    const int N = c.B * c.S;
    std::vector<uint8_t> reset(N);
    std::bernoulli_distribution doc(0.125);
    for (int t = 0; t < N; ++t) reset[t] = (t % c.S == 0 || doc(rng_)) ? 1 : 0;
    const size_t n = size_t(N) * c.nh * c.hd, rows = size_t(N) * c.nh;
    auto x = randv(n), dout = randv(n), gain = randv(size_t(c.hd), 0.5f, 1.5f), dgain0 = randv(size_t(c.hd));
    auto d_x = up(x), d_dout = up(dout), d_gain = up(gain);
    auto d_reset = up(reset);
    const float theta = 10000.f, eps = 1e-6f;
    for (bool norm : {true, false})
      for (bool with_gain : {true, false})
        for (bool pko : {true, false}) {
          const std::string what = fmt::format("qk_prep B={} S={} nh={} hd={} rot={} norm={} gain={} pko={}", c.B,
                                               c.S, c.nh, c.hd, c.rot, norm, with_gain, pko);
          SCOPED_TRACE(what);
          const float* g = with_gain ? d_gain.data() : nullptr;
          const uint8_t* r = pko ? d_reset.data() : nullptr;
          auto d_out = poisoned(n), d_rstd = poisoned(rows), d_dx = poisoned(n), d_dx2 = poisoned(n);
          auto d_dgain = up(dgain0);
          be().qk_prep_forward(d_out.data(), d_rstd.data(), d_x.data(), g, r, N, c.S, c.nh, c.hd, c.rot, theta, norm,
                               eps);
          be().qk_prep_backward(d_dx.data(), with_gain ? d_dgain.data() : nullptr, d_dout.data(), d_x.data(), g,
                                d_rstd.data(), r, N, c.S, c.nh, c.hd, c.rot, theta, norm);
          std::vector<float> out(n), rstd(rows), dx(n), dgain = dgain0;
          const float* hg = with_gain ? gain.data() : nullptr;
          const uint8_t* hr = pko ? reset.data() : nullptr;
          cpu::qk_prep_forward<float>(out.data(), rstd.data(), x.data(), hg, hr, N, c.S, c.nh, c.hd, c.rot, theta, norm,
                                      eps);
          cpu::qk_prep_backward<float>(dx.data(), with_gain ? dgain.data() : nullptr, dout.data(), x.data(), hg,
                                       rstd.data(), hr, N, c.S, c.nh, c.hd, c.rot, theta, norm);
          check(down(d_out, n), out, kF32, what + " out");
          if (norm) check(down(d_rstd, rows), rstd, kF32, what + " rstd");
          check(down(d_dx, n), dx, kF32, what + " dx");
          // dgain accumulates onto the random start (untouched without a gain or without the norm).
          check(down(d_dgain, size_t(c.hd)), dgain, kF32, what + " dgain");
          // dout is read only; a second backward gives bitwise the same dx (fixed reduction orders).
          EXPECT_EQ(down(d_dout, n), dout) << "dout was written";
          be().qk_prep_backward(d_dx2.data(), nullptr, d_dout.data(), d_x.data(), g, d_rstd.data(), r, N, c.S, c.nh,
                                c.hd, c.rot, theta, norm);
          EXPECT_EQ(down(d_dx2, n), down(d_dx, n)) << "dx not reproducible";
        }
  }
}

TEST_F(CudaSwitchOptim, QkPrepRejectsBadShapes) {
  DeviceBuffer<float> a(64), b(64), rs(4);
  // rot_dims above the head dim; sequence length 0.
  EXPECT_THROW(
      be().qk_prep_forward(a.data(), rs.data(), b.data(), nullptr, nullptr, 4, 4, 1, 16, 18, 1e4f, true, 1e-6f),
      Error);
  EXPECT_THROW(be().qk_prep_backward(a.data(), nullptr, b.data(), b.data(), nullptr, rs.data(), nullptr, 4, 0, 1, 16,
                                     16, 1e4f, true),
               Error);
}

TEST_F(CudaSwitchOptim, XsaForwardBackwardWithGqa) {
  struct Case {
    int N, H, KV, hd;
  };
  // H/KV = 1, 2, 4; head dims below, at and above a warp multiple, and above 128.
  for (const Case c : {Case{77, 4, 4, 64}, Case{53, 8, 4, 40}, Case{61, 8, 2, 96}, Case{33, 4, 1, 130},
                       Case{29, 6, 3, 17}}) {
    const std::string what = fmt::format("xsa N={} H={} KV={} hd={}", c.N, c.H, c.KV, c.hd);
    SCOPED_TRACE(what);
    const size_t ny = size_t(c.N) * c.H * c.hd, nv = size_t(c.N) * c.KV * c.hd;
    auto y = randv(ny), v = randv(nv), dz = randv(ny);
    auto d_y = up(y), d_v = up(v), d_dz = up(dz);

    auto d_z = poisoned(ny);
    be().xsa_forward(d_z.data(), d_y.data(), d_v.data(), c.N, c.H, c.KV, c.hd);
    std::vector<float> z(ny);
    cpu::xsa_forward<float>(z.data(), y.data(), v.data(), c.N, c.H, c.KV, c.hd);
    check(down(d_z, ny), z, kF32, what + " fwd");

    auto d_dy = poisoned(ny), d_dv = poisoned(nv);
    be().xsa_backward(d_dy.data(), d_dv.data(), d_dz.data(), d_y.data(), d_v.data(), c.N, c.H, c.KV, c.hd);
    std::vector<float> dy(ny), dv(nv);
    cpu::xsa_backward<float>(dy.data(), dv.data(), dz.data(), y.data(), v.data(), c.N, c.H, c.KV, c.hd);
    const auto gdy = down(d_dy, ny), gdv = down(d_dv, nv);
    check(gdy, dy, kF32, what + " bwd dy");
    check(gdv, dv, kF32, what + " bwd dv");

    // In place, as the contract allows: z over y, dy over dz. Same results bitwise.
    auto d_yz = up(y);
    be().xsa_forward(d_yz.data(), d_yz.data(), d_v.data(), c.N, c.H, c.KV, c.hd);
    EXPECT_EQ(down(d_yz, ny), down(d_z, ny)) << "xsa_forward in place (z == y) differs";
    auto d_dzy = up(dz);
    auto d_dv2 = poisoned(nv);
    be().xsa_backward(d_dzy.data(), d_dv2.data(), d_dzy.data(), d_y.data(), d_v.data(), c.N, c.H, c.KV, c.hd);
    EXPECT_EQ(down(d_dzy, ny), gdy) << "xsa_backward in place (dy == dz) differs";
    EXPECT_EQ(down(d_dv2, nv), gdv) << "xsa_backward dv with dy == dz differs";
  }
}

TEST_F(CudaSwitchOptim, HeadGateForwardBackward) {
  struct Case {
    int N, H, hd;
  };
  for (const Case c : {Case{53, 6, 64}, Case{41, 5, 37}, Case{7, 3, 200}}) {
    const std::string what = fmt::format("head_gate N={} H={} hd={}", c.N, c.H, c.hd);
    SCOPED_TRACE(what);
    const size_t nx = size_t(c.N) * c.H * c.hd, nl = size_t(c.N) * c.H;
    auto x = randv(nx), logit = randv(nl, -4.f, 4.f), dout = randv(nx);
    auto d_x = up(x), d_logit = up(logit), d_dout = up(dout);

    auto d_out = poisoned(nx), d_factor = poisoned(nl);
    be().head_gate_forward(d_out.data(), d_factor.data(), d_x.data(), d_logit.data(), c.N, c.H, c.hd);
    std::vector<float> out(nx), factor(nl);
    cpu::head_gate_forward<float>(out.data(), factor.data(), x.data(), logit.data(), c.N, c.H, c.hd);
    const auto gout = down(d_out, nx);
    check(gout, out, kF32, what + " fwd out");
    check(down(d_factor, nl), factor, kF32, what + " fwd factor");

    // Backward from the CPU's factor, so its error is the backward's alone.
    auto d_cfactor = up(factor);
    auto d_dx = poisoned(nx), d_dlogit = poisoned(nl);
    be().head_gate_backward(d_dx.data(), d_dlogit.data(), d_dout.data(), d_x.data(), d_cfactor.data(), c.N, c.H,
                            c.hd);
    std::vector<float> dx(nx), dlogit(nl);
    cpu::head_gate_backward<float>(dx.data(), dlogit.data(), dout.data(), x.data(), factor.data(), c.N, c.H, c.hd);
    const auto gdx = down(d_dx, nx);
    check(gdx, dx, kF32, what + " bwd dx");
    check(down(d_dlogit, nl), dlogit, kF32, what + " bwd dlogit");

    // In place: out over x, dx over dout.
    auto d_xo = up(x), d_factor2 = poisoned(nl);
    be().head_gate_forward(d_xo.data(), d_factor2.data(), d_xo.data(), d_logit.data(), c.N, c.H, c.hd);
    EXPECT_EQ(down(d_xo, nx), gout) << "head_gate_forward in place (out == x) differs";
    auto d_dd = up(dout), d_dlogit2 = poisoned(nl);
    be().head_gate_backward(d_dd.data(), d_dlogit2.data(), d_dd.data(), d_x.data(), d_cfactor.data(), c.N, c.H,
                            c.hd);
    EXPECT_EQ(down(d_dd, nx), gdx) << "head_gate_backward in place (dx == dout) differs";
  }
}

TEST_F(CudaSwitchOptim, SiluAndSigmoidGate) {
  const size_t n = 10007;
  auto u = randv(n, -6.f, 6.f), da = randv(n), x = randv(n), g0 = randv(n, -6.f, 6.f), dy = randv(n);
  auto d_u = up(u), d_da = up(da), d_x = up(x), d_dy = up(dy);

  auto d_a = poisoned(n), d_du = poisoned(n);
  be().silu_forward(d_a.data(), d_u.data(), n);
  be().silu_backward(d_du.data(), d_da.data(), d_u.data(), n);
  std::vector<float> a(n), du(n);
  cpu::silu_forward<float>(a.data(), u.data(), n);
  cpu::silu_backward<float>(du.data(), da.data(), u.data(), n);
  check(down(d_a, n), a, kF32, "silu_forward");
  const auto gdu = down(d_du, n);
  check(gdu, du, kF32, "silu_backward");
  auto d_dinplace = up(da);  // du over da
  be().silu_backward(d_dinplace.data(), d_dinplace.data(), d_u.data(), n);
  EXPECT_EQ(down(d_dinplace, n), gdu) << "silu_backward in place (du == da) differs";

  // Forward: g becomes sigmoid(g) in place.
  auto d_g = up(g0);
  auto d_y = poisoned(n);
  be().sigmoid_gate_forward(d_y.data(), d_g.data(), d_x.data(), n);
  std::vector<float> y(n), s = g0;
  cpu::sigmoid_gate_forward<float>(y.data(), s.data(), x.data(), n);
  check(down(d_y, n), y, kF32, "sigmoid_gate_forward y");
  check(down(d_g, n), s, kF32, "sigmoid_gate_forward s");

  auto d_s = up(s);  // the CPU's saved sigmoid: the backward's error alone
  for (bool acc : {false, true}) {
    SCOPED_TRACE(fmt::format("accumulate_dx={}", acc));
    auto dx0 = randv(n);
    DeviceBuffer<float> d_dx(n);
    if (acc) d_dx.upload(dx0);
    else d_dx.poison();
    auto d_dg = poisoned(n);
    be().sigmoid_gate_backward(d_dx.data(), d_dg.data(), d_dy.data(), d_x.data(), d_s.data(), n, acc);
    std::vector<float> dx = dx0, dg(n);
    cpu::sigmoid_gate_backward<float>(dx.data(), dg.data(), dy.data(), x.data(), s.data(), n, acc);
    const auto gdx = down(d_dx, n);
    check(gdx, dx, kF32, acc ? "sigmoid_gate_backward dx (+=)" : "sigmoid_gate_backward dx");
    check(down(d_dg, n), dg, kF32, acc ? "sigmoid_gate_backward dg (+=)" : "sigmoid_gate_backward dg");
    if (!acc) {  // dx over dy
      auto d_dd = up(dy), d_dg2 = poisoned(n);
      be().sigmoid_gate_backward(d_dd.data(), d_dg2.data(), d_dd.data(), d_x.data(), d_s.data(), n, false);
      EXPECT_EQ(down(d_dd, n), gdx) << "sigmoid_gate_backward in place (dx == dy) differs";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Recipe optimizers

TEST_F(CudaSwitchOptim, AdamMomentsAndApplyFiveSteps) {
  const size_t n = 100003;
  const float b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, lr = 1e-2f;
  auto w = randv(n);
  std::vector<float> m(n, 0.f), v(n, 0.f);  // fresh state, as at the first optimizer step
  auto d_w = up(w), d_m = up(m), d_v = up(v);
  for (int step = 1; step <= 5; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    const float bc1 = 1.f - float(std::pow(double(b1), step)), bc2 = 1.f - float(std::pow(double(b2), step));
    auto g = randv(n, -0.5f, 0.5f);
    auto d_g = up(g);
    const double gu = be().adam_moments(d_m.data(), d_v.data(), d_g.data(), n, b1, b2, bc1, bc2, eps);
    const double cu = cpu::adam_moments<float>(m.data(), v.data(), g.data(), n, b1, b2, bc1, bc2, eps);
    check_sum(gu, cu, fmt::format("adam_moments ||U||^2 step {}", step));
    // A hyperball-like step size (lr / ||U||), so w moves by a comparable amount each step.
    const float alpha = float(-lr / std::sqrt(cu));
    const double gw = be().adam_apply(d_w.data(), d_m.data(), d_v.data(), n, bc1, bc2, eps, alpha);
    const double cw = cpu::adam_apply<float>(w.data(), m.data(), v.data(), n, bc1, bc2, eps, alpha);
    check_sum(gw, cw, fmt::format("adam_apply ||w||^2 step {}", step));
  }
  check(down(d_m, n), m, kF32, "adam 5 steps m");
  check(down(d_v, n), v, kF32, "adam 5 steps v");
  check(down(d_w, n), w, kF32, "adam 5 steps w");
}

TEST_F(CudaSwitchOptim, AsyncReductionsEqualTheSynchronousOnesBitwise) {
  const size_t n = 65537;
  auto m0 = randv(n, -0.1f, 0.1f), v0 = randv(n, 0.f, 0.01f), g = randv(n), w0 = randv(n), x = randv(n);
  auto d_g = up(g), d_x = up(x);
  const float bc1 = 0.19f, bc2 = 0.0975f;

  auto d_m = up(m0), d_v = up(v0), d_w = up(w0);
  const double s1 = be().adam_moments(d_m.data(), d_v.data(), d_g.data(), n, 0.9f, 0.95f, bc1, bc2, 1e-8f);
  const double s2 = be().adam_apply(d_w.data(), d_m.data(), d_v.data(), n, bc1, bc2, 1e-8f, -1e-3f);
  const double s3 = be().axpy_sumsq(d_w.data(), d_x.data(), n, 0.25f);

  auto e_m = up(m0), e_v = up(v0), e_w = up(w0);
  DeviceBuffer<double> d_out(3);
  d_out.poison();
  be().adam_moments_async(e_m.data(), e_v.data(), d_g.data(), n, 0.9f, 0.95f, bc1, bc2, 1e-8f, d_out.data());
  be().adam_apply_async(e_w.data(), e_m.data(), e_v.data(), n, bc1, bc2, 1e-8f, -1e-3f, d_out.data() + 1);
  be().axpy_sumsq_async(e_w.data(), d_x.data(), n, 0.25f, d_out.data() + 2);
  be().synchronize();
  const auto got = d_out.download();
  // Same kernels, same fixed grid: the same bits (also a run-to-run reproducibility check).
  EXPECT_EQ(got[0], s1);
  EXPECT_EQ(got[1], s2);
  EXPECT_EQ(got[2], s3);
  EXPECT_EQ(down(e_w, n), down(d_w, n));
}

TEST_F(CudaSwitchOptim, MuonMomentumAndAxpySumsq) {
  const size_t n = 70001;
  auto B = randv(n), G = randv(n), w = randv(n), x = randv(n);
  auto d_B = up(B), d_G = up(G), d_w = up(w), d_x = up(x);
  auto d_D = poisoned(n);
  be().muon_momentum(d_B.data(), d_D.data(), d_G.data(), n, 0.95f, nullptr);
  std::vector<float> D(n);
  cpu::muon_momentum<float>(B.data(), D.data(), G.data(), n, 0.95f);
  check(down(d_B, n), B, kF32, "muon_momentum B");
  check(down(d_D, n), D, kF32, "muon_momentum D");
  // With a clip factor in device memory: G read as G * factor.
  const float f = 0.3713f;
  auto d_f = up(std::vector<float>{f});
  be().muon_momentum(d_B.data(), d_D.data(), d_G.data(), n, 0.95f, d_f.data());
  cpu::muon_momentum<float>(B.data(), D.data(), G.data(), n, 0.95f, f);
  check(down(d_B, n), B, kF32, "muon_momentum B (clip factor)");
  check(down(d_D, n), D, kF32, "muon_momentum D (clip factor)");

  const double gs = be().axpy_sumsq(d_w.data(), d_x.data(), n, -0.37f);
  const double cs = cpu::axpy_sumsq<float>(w.data(), x.data(), n, -0.37f);
  check(down(d_w, n), w, kF32, "axpy_sumsq w");
  check_sum(gs, cs, "axpy_sumsq ||w||^2");
}

// ---------------------------------------------------------------------------------------------
// Optimizer steps without host waits: the multi-tensor and device-scalar ops against the CPU
// backend's (which are bitwise the optimizer's former host code, tests/test_optim_device_ops.cpp).

// Every element within kF32 of the CPU's relative to max(|cpu|, the output's rms): a stricter check
// than the whole-output norm, so that one element the kernel skipped (it keeps its old value, a
// step away from the CPU's) cannot hide among 100k right ones.
void check_each(const std::vector<float>& gpu, const std::vector<float>& cpu, const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  double ss = 0;
  for (float c : cpu) ss += double(c) * double(c);
  const double rms = std::sqrt(ss / double(std::max<size_t>(cpu.size(), 1)));
  size_t bad = 0;
  for (size_t i = 0; i < cpu.size(); ++i)
    if (!(std::abs(double(gpu[i]) - double(cpu[i])) <= 1e-4 * std::max(std::abs(double(cpu[i])), rms)) &&
        bad++ < 3)
      ADD_FAILURE() << what << ": element " << i << " gpu " << gpu[i] << " cpu " << cpu[i];
  EXPECT_EQ(bad, 0u) << what;
}

struct MultiCase {
  size_t mat;    // elements per matrix
  int64_t nmat;  // matrices (E)
  int group;
};
// Sizes around the multi-tensor chunk (4096 elements per block), odd ones, a single element, and
// [E, out, in] stacks.
const MultiCase kMultiCases[] = {{1, 1, 0},       {4095, 1, 1},     {4097, 1, 2}, {16385, 1, 0},
                                 {100003, 1, 1},  {37 * 29, 3, 2},  {64 * 65, 4, 0}, {5 * 7, 8, 1}};

TEST_F(CudaSwitchOptim, MultiTensorAdamWAndAdamHMatchTheCpu) {
  auto cpu_be = make_cpu_backend(0);
  for (bool hyper : {false, true}) {
    SCOPED_TRACE(hyper ? "adamh_multi" : "adamw_multi");
    struct T {
      std::vector<float> w, g, m, v, r;
      DeviceBuffer<float> dw, dg, dm, dv, dr;
    };
    std::vector<T> ts;
    for (auto c : kMultiCases) {
      T t;
      const size_t n = c.mat * size_t(c.nmat);
      t.w = randv(n);
      t.m = randv(n, -0.01f, 0.01f);
      t.v = randv(n, 0.f, 1e-3f);
      t.r = randv(size_t(c.nmat), 0.5f, 3.f);
      t.dw = up(t.w, 1);  // unaligned, as a tensor inside an arena may be
      t.dm = up(t.m);
      t.dv = up(t.v);
      t.dr = up(t.r);
      ts.push_back(std::move(t));
    }
    const float lr_f[3] = {1e-2f, 3e-3f, 2e-2f}, wd[3] = {0.1f, 0.f, 0.01f};
    const double lr_d[3] = {0.02, 0.005, 0.05};
    // Steps 1-3: no clip factor, a factor of 1, a clip (device memory on the GPU, host on the CPU).
    const std::vector<float> factors = {1.0f, 0.3713f};
    auto d_factors = up(factors);
    for (int step = 1; step <= 3; ++step) {
      const float* cf = step == 1 ? nullptr : &factors[size_t(step - 2)];
      const float* gf = step == 1 ? nullptr : d_factors.data() + (step - 2);
      SCOPED_TRACE(fmt::format("step {}", step));
      const float bc1 = 1.f - float(std::pow(0.9, step)), bc2 = 1.f - float(std::pow(0.95, step));
      std::vector<OptimTensor> ct, gt;
      for (size_t i = 0; i < ts.size(); ++i) {
        T& t = ts[i];
        t.g = randv(t.w.size(), -0.5f, 0.5f);
        t.dg = up(t.g);
        OptimTensor c;
        c.n = t.w.size();
        c.nmat = kMultiCases[i].nmat;
        c.group = kMultiCases[i].group;
        OptimTensor d = c;
        c.w = t.w.data(), c.g = t.g.data(), c.m = t.m.data(), c.v = t.v.data(), c.radius = t.r.data();
        d.w = t.dw.data() + 1, d.g = t.dg.data(), d.m = t.dm.data(), d.v = t.dv.data(), d.radius = t.dr.data();
        ct.push_back(c);
        gt.push_back(d);
      }
      if (hyper) {
        cpu_be->adamh_multi(ct.data(), ct.size(), lr_d, 3, 0.9f, 0.95f, 1e-8f, bc1, bc2, cf);
        be().adamh_multi(gt.data(), gt.size(), lr_d, 3, 0.9f, 0.95f, 1e-8f, bc1, bc2, gf);
      } else {
        cpu_be->adamw_multi(ct.data(), ct.size(), lr_f, wd, 3, 0.9f, 0.95f, 1e-8f, bc1, bc2, cf);
        be().adamw_multi(gt.data(), gt.size(), lr_f, wd, 3, 0.9f, 0.95f, 1e-8f, bc1, bc2, gf);
      }
    }
    for (size_t i = 0; i < ts.size(); ++i) {
      T& t = ts[i];
      const size_t n = t.w.size();
      const std::string what = fmt::format("{} tensor {} ({} x {})", hyper ? "adamh" : "adamw", i,
                                           kMultiCases[i].nmat, kMultiCases[i].mat);
      const auto gw = down(t.dw, n, 1), gm = down(t.dm, n), gv = down(t.dv, n);
      check(gw, t.w, kF32, what + " w");
      check(gm, t.m, kF32, what + " m");
      check(gv, t.v, kF32, what + " v");
      check_each(gw, t.w, what + " w");
      check_each(gm, t.m, what + " m");
      check_each(gv, t.v, what + " v");
      if (hyper)  // the projection itself: every matrix back on its sphere
        for (int64_t e = 0; e < kMultiCases[i].nmat; ++e) {
          const size_t mn = kMultiCases[i].mat;
          double ss = 0;
          for (size_t j = 0; j < mn; ++j) ss += double(gw[size_t(e) * mn + j]) * double(gw[size_t(e) * mn + j]);
          EXPECT_NEAR(std::sqrt(ss), t.r[size_t(e)], 1e-5 * t.r[size_t(e)]) << what << " matrix " << e;
        }
    }
  }
}

TEST_F(CudaSwitchOptim, MultiTensorStepIsReproducibleAndFollowsANewList) {
  // The same step twice from the same state: the same bits (fixed partition, no atomics). Then a
  // different descriptor list (a subset) must be used as given, not a cached table of another list.
  const size_t n1 = 9000, n2 = 5 * 301;
  auto w1 = randv(n1), w2 = randv(n2), g1 = randv(n1), g2 = randv(n2);
  std::vector<float> m1(n1, 0.f), v1(n1, 0.f), m2(n2, 0.f), v2(n2, 0.f), r = {1.5f, 2.f, 0.7f, 1.f, 3.f};
  auto d_g1 = up(g1), d_g2 = up(g2), d_r = up(std::vector<float>{1.1f});
  auto d_r2 = up(r);
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    auto d_w1 = up(w1), d_w2 = up(w2), d_m1 = up(m1), d_v1 = up(v1), d_m2 = up(m2), d_v2 = up(v2);
    OptimTensor a{d_w1.data(), d_g1.data(), d_m1.data(), d_v1.data(), n1, 1, d_r.data(), 0};
    OptimTensor b{d_w2.data(), d_g2.data(), d_m2.data(), d_v2.data(), n2, 5, d_r2.data(), 0};
    const OptimTensor both[2] = {a, b};
    const double lr = 0.01;
    be().adamh_multi(both, 2, &lr, 1, 0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, nullptr);
    be().adamh_multi(&b, 1, &lr, 1, 0.9f, 0.95f, 1e-8f, 0.19f, 0.0975f, nullptr);  // only b moves
    auto got = down(d_w1, n1);
    const auto got2 = down(d_w2, n2);
    got.insert(got.end(), got2.begin(), got2.end());
    if (run == 0) first = got;
    else EXPECT_EQ(got, first);
    // CPU reference of the same two calls.
    auto cpu_be = make_cpu_backend(0);
    auto cw1 = w1, cw2 = w2, cm1 = m1, cv1 = v1, cm2 = m2, cv2 = v2;
    const float R1 = 1.1f;
    OptimTensor ca{cw1.data(), g1.data(), cm1.data(), cv1.data(), n1, 1, &R1, 0};
    OptimTensor cb{cw2.data(), g2.data(), cm2.data(), cv2.data(), n2, 5, r.data(), 0};
    const OptimTensor cboth[2] = {ca, cb};
    cpu_be->adamh_multi(cboth, 2, &lr, 1, 0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, nullptr);
    cpu_be->adamh_multi(&cb, 1, &lr, 1, 0.9f, 0.95f, 1e-8f, 0.19f, 0.0975f, nullptr);
    check_each(down(d_w1, n1), cw1, "adamh_multi first list w1");
    check_each(down(d_w2, n2), cw2, "adamh_multi both lists w2");
  }
}

TEST_F(CudaSwitchOptim, MuonHApplyAxpyAndDeviceClipMatchTheCpu) {
  auto cpu_be = make_cpu_backend(0);
  for (size_t n : {size_t(1), size_t(4097), size_t(70001)}) {
    SCOPED_TRACE(fmt::format("n = {}", n));
    auto w = randv(n), D = randv(n, -0.2f, 0.2f);
    const std::vector<float> R = {1.7f};
    auto d_w = up(w), d_D = up(D), d_R = up(R);
    be().muonh_apply(d_w.data(), d_D.data(), n, d_R.data(), 0.013);
    cpu_be->muonh_apply(w.data(), D.data(), n, R.data(), 0.013);
    const auto gw = down(d_w, n);
    check(gw, w, kF32, fmt::format("muonh_apply w (n = {})", n));
    check_each(gw, w, "muonh_apply w");

    auto w2 = randv(n);
    auto d_w2 = up(w2);
    be().axpy(d_w2.data(), d_D.data(), n, -0.37f);
    cpu_be->axpy(w2.data(), D.data(), n, -0.37f);
    check_each(down(d_w2, n), w2, "axpy w");
  }
  // Clipping: the same per-tensor sums give the same norm and factor bit for bit (one sequential
  // double sum in index order on both sides); outputs poisoned first.
  std::vector<double> sums;
  for (int i = 0; i < 37; ++i) sums.push_back(std::uniform_real_distribution<double>(0, 5)(rng_));
  auto d_sums = up(sums);
  double total = 0;
  for (double s : sums) total += s;
  const double norm = std::sqrt(total);
  for (double clip : {norm / 4, norm * 2, 0.0}) {
    SCOPED_TRACE(fmt::format("clip {}", clip));
    auto d_norm = poisoned<double>(1);
    auto d_factor = poisoned<float>(1);
    be().grad_clip_factor(d_sums.data(), sums.size(), clip, d_norm.data(), d_factor.data());
    double cn = 0;
    float cf = 0;
    cpu_be->grad_clip_factor(sums.data(), sums.size(), clip, &cn, &cf);
    const double gn = down(d_norm, 1)[0];
    const float gf = down(d_factor, 1)[0];
    EXPECT_EQ(gn, cn);
    EXPECT_EQ(gf, cf);
  }
}

// The per-tensor sums of squares in one call (the clip's input): every tensor's sum against the
// CPU's (double sums in another order: near 1e-12), outputs poisoned, tensors unaligned, empty and
// spanning many chunks; the same bits on a second call (fixed partition, no atomics) and on a
// different list (a cached table of another list must not be used).
TEST_F(CudaSwitchOptim, SumSquaresMultiMatchesTheCpu) {
  auto cpu_be = make_cpu_backend(0);
  const std::vector<size_t> sizes = {1, 0, 4096, 4097, 70001, 3, 1 << 20};
  std::vector<std::vector<float>> xs;
  std::vector<DeviceBuffer<float>> dx;
  std::vector<const float*> cp, gp;
  for (size_t n : sizes) {
    xs.push_back(randv(n));
    dx.push_back(up(xs.back(), 1));  // one float in: unaligned, as a tensor inside an arena may be
    cp.push_back(xs.back().data());
    gp.push_back(dx.back().data() + 1);
  }
  std::vector<double> want(sizes.size());
  cpu_be->sum_squares_multi(cp.data(), sizes.data(), sizes.size(), want.data());
  std::vector<double> first;
  for (int call = 0; call < 2; ++call) {
    auto d_out = poisoned<double>(sizes.size());
    be().sum_squares_multi(gp.data(), sizes.data(), sizes.size(), d_out.data());
    const auto got = down(d_out, sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 1e-12 * want[i]) << "tensor " << i << " (" << sizes[i] << " elements)";
    if (call == 0) first = got;
    else EXPECT_EQ(std::memcmp(got.data(), first.data(), got.size() * sizeof(double)), 0) << "not reproducible";
  }
  // A sublist (the last three tensors): its own table.
  auto d_out = poisoned<double>(3);
  be().sum_squares_multi(gp.data() + 4, sizes.data() + 4, 3, d_out.data());
  const auto got = down(d_out, 3);
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(got[i], want[4 + i], 1e-12 * want[4 + i]) << "sublist tensor " << i;
}

// Under bf16 precision the optimizer's weight updates (adamw_multi, adamh_multi,
// muonh_apply_batched, axpy) write the bf16 mirror of the registered weights they update: the next
// bf16 GEMM reads the mirror without re-casting it, and gets bitwise what the same updated weights
// give from an unregistered copy (a fresh cast). Where they cannot write the mirror (not allocated
// yet, or a tensor running past the registered range) or it is stale already (an upload), the next
// GEMM re-casts, and so it does after an op that writes the weights alone (muonh_apply, not used by
// the optimizer).
TEST_F(CudaSwitchOptim, OptimizerUpdatesKeepTheWeightMirrorCurrent) {
  auto bf = make_cuda_backend("bf16");
  auto* cb = dynamic_cast<cuda::CudaBackend*>(bf.get());
  ASSERT_NE(cb, nullptr);
  const int M = 24, N = 40, K = 56;
  // The arena: two weight matrices [N, K] with a gap between them (untouched by the optimizer).
  // Past the registered range: 32 more floats (a tensor straddling the end goes there). The gap
  // keeps the second matrix at a 128-element offset (256 bytes in the mirror) so that the mirror's
  // GEMM and the fresh cast's, whose scratch is 256-byte aligned, get the same cuBLASLt algorithm:
  // cuBLASLt picks kernels by operand alignment, and two kernels may sum in different orders (the
  // emulator cannot show this: its GEMM is the CPU's at any alignment).
  const size_t wn = size_t(N) * K, gap = 64, total = 2 * wn + gap, beyond = 32;
  static_assert((56 * 40 + 64) % 128 == 0, "the second matrix's offset must stay 128-element aligned");
  DeviceBuffer<float> W(total + beyond), Wc(total + beyond);
  const auto w0 = randv(total + beyond);
  W.upload(w0);
  bf->register_weights(W.data(), total * sizeof(float));
  auto X = up(randv(size_t(M) * K));
  float* w1 = W.data();
  float* w2 = W.data() + wn + gap;
  auto gemm_pair = [&](const std::string& what) {
    // Both matrices through the mirror, and again through a plain copy of the same weights.
    const auto cur = W.download();
    Wc.upload(cur);
    for (size_t off : {size_t(0), wn + gap}) {
      auto Y1 = poisoned(size_t(M) * N), Y2 = poisoned(size_t(M) * N);
      bf->gemm(false, true, M, N, K, 1.f, X.data(), K, W.data() + off, K, 0.f, Y1.data(), N);
      bf->gemm(false, true, M, N, K, 1.f, X.data(), K, Wc.data() + off, K, 0.f, Y2.data(), N);
      bf->synchronize();
      const auto a = Y1.download(), b = Y2.download();
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what << ", matrix at " << off;
    }
  };
  auto g1 = up(randv(wn, -0.5f, 0.5f)), g2 = up(randv(wn, -0.5f, 0.5f));
  DeviceBuffer<float> m1(wn), v1(wn), m2(wn), v2(wn), r(2), D(wn);
  for (auto* b : {&m1, &v1, &m2, &v2}) b->upload(std::vector<float>(wn, 0.f));
  r.upload(std::vector<float>{30.f, 30.f});
  D.upload(randv(wn, -0.2f, 0.2f));
  const OptimTensor t[2] = {{w1, g1.data(), m1.data(), v1.data(), wn, 1, r.data(), 0},
                            {w2, g2.data(), m2.data(), v2.data(), wn, 1, r.data() + 1, 0}};
  const float lr = 1e-2f, wd = 0.1f;
  const double lr_d = 1e-2;
  auto d_f = up(std::vector<float>{0.5f});
  // A step before any bf16 GEMM: no mirror to write yet (its table has none); the first GEMM casts.
  bf->adamw_multi(t, 2, &lr, &wd, 1, 0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, d_f.data());
  gemm_pair("after a step taken before the mirror existed");
  EXPECT_EQ(cb->bf16_mirror_casts(), 1u);
  // The two matrices are [N, K] with K > N: a batch of two for muonh_apply_batched needs them
  // back to back, so it runs on the first matrix as a batch of one (and the second stays as it is).
  const std::vector<std::pair<std::string, std::function<void()>>> updates = {
      {"adamw_multi",
       [&] { bf->adamw_multi(t, 2, &lr, &wd, 1, 0.9f, 0.95f, 1e-8f, 0.1f, 0.05f, d_f.data()); }},
      {"adamh_multi", [&] { bf->adamh_multi(t, 2, &lr_d, 1, 0.9f, 0.95f, 1e-8f, 0.19f, 0.1f, d_f.data()); }},
      {"muonh_apply_batched", [&] { bf->muonh_apply_batched(w1, D.data(), wn, 1, r.data(), 0.02); }},
      {"axpy", [&] { bf->axpy(w2, D.data(), wn, -0.03f); }},
  };
  for (int round = 0; round < 2; ++round)
    for (const auto& [name, update] : updates) {
      const uint64_t casts = cb->bf16_mirror_casts();
      const auto before = W.download();
      update();
      gemm_pair("after " + name);
      EXPECT_EQ(cb->bf16_mirror_casts(), casts) << name << " left the mirror stale";
      EXPECT_NE(W.download(), before) << name << " changed no weight";
    }
  const auto now = W.download();
  EXPECT_EQ(std::memcmp(now.data() + wn, w0.data() + wn, gap * sizeof(float)), 0) << "the gap was written";
  auto expect_recast = [&](const std::string& what, const std::function<void()>& op) {
    const uint64_t casts = cb->bf16_mirror_casts();
    op();
    gemm_pair("after " + what);
    EXPECT_EQ(cb->bf16_mirror_casts(), casts + 1) << what << ": the next GEMM must re-cast";
  };
  expect_recast("muonh_apply", [&] { bf->muonh_apply(w1, D.data(), wn, r.data(), 0.02); });
  // An upload into the weights, then an optimizer step: the mirror was stale before the step's
  // writes into it, and stays stale.
  expect_recast("an upload, then adamw_multi", [&] {
    const auto v = randv(wn);
    bf->upload(w2, v.data(), wn * sizeof(float));
    bf->adamw_multi(t, 2, &lr, &wd, 1, 0.9f, 0.95f, 1e-8f, 0.3f, 0.15f, d_f.data());
  });
  // A tensor straddling the end of the registered range: no mirror place, so its update marks it stale.
  expect_recast("axpy across the end of the registered weights",
                [&] { bf->axpy(W.data() + total - 8, D.data(), 16, -0.03f); });
  bf->unregister_weights(W.data());
}

TEST_F(CudaSwitchOptim, EmptyInputsDoNothingAndSumToZero) {
  // n = 0 / no tokens: nothing is read or written (null pointers), the reductions return 0.
  be().pko_shift_forward(nullptr, nullptr, nullptr, 0, 2, 16, 8);
  be().pko_shift_backward(nullptr, nullptr, nullptr, 0, 2, 16, 8);
  be().qk_prep_forward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 8, 2, 16, 16, 1e4f, true, 1e-6f);
  be().qk_prep_backward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 8, 2, 16, 16, 1e4f, true);
  be().xsa_forward(nullptr, nullptr, nullptr, 0, 4, 2, 16);
  be().xsa_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 4, 2, 16);
  be().head_gate_forward(nullptr, nullptr, nullptr, nullptr, 0, 4, 16);
  be().head_gate_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 4, 16);
  be().silu_forward(nullptr, nullptr, 0);
  be().silu_backward(nullptr, nullptr, nullptr, 0);
  be().sigmoid_gate_forward(nullptr, nullptr, nullptr, 0);
  be().sigmoid_gate_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 0, true);
  be().muon_momentum(nullptr, nullptr, nullptr, 0, 0.95f, nullptr);
  be().sum_squares_multi(nullptr, nullptr, 0, nullptr);
  be().newton_schulz5(nullptr, 0, 5);
  be().newton_schulz5(nullptr, 5, 0);
  be().newton_schulz5_batched(nullptr, 5, 7, 0);
  be().newton_schulz5_batched(nullptr, 0, 7, 3);
  be().muonh_apply_batched(nullptr, nullptr, 5, 0, nullptr, 0.1);
  EXPECT_EQ(be().adam_moments(nullptr, nullptr, nullptr, 0, 0.9f, 0.95f, 0.1f, 0.05f, 1e-8f), 0.0);
  EXPECT_EQ(be().adam_apply(nullptr, nullptr, nullptr, 0, 0.1f, 0.05f, 1e-8f, 1.f), 0.0);
  EXPECT_EQ(be().axpy_sumsq(nullptr, nullptr, 0, 1.f), 0.0);
  DeviceBuffer<double> d_out(1);
  d_out.poison();  // the async form still writes its (zero) sum
  be().axpy_sumsq_async(nullptr, nullptr, 0, 1.f, d_out.data());
  be().synchronize();
  EXPECT_EQ(d_out.download()[0], 0.0);
}

// ---------------------------------------------------------------------------------------------
// Newton-Schulz

// G = X X^T (rows <= cols) or X^T X (tall), in double: the m x m Gram matrix of the output.
std::vector<double> gram(const std::vector<float>& x, int r, int c) {
  const int m = std::min(r, c), n = std::max(r, c);
  std::vector<double> G(size_t(m) * m);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < m; ++j) {
      double s = 0;
      for (int k = 0; k < n; ++k)
        s += r <= c ? double(x[size_t(i) * c + k]) * x[size_t(j) * c + k]
                    : double(x[size_t(k) * c + i]) * x[size_t(k) * c + j];
      G[size_t(i) * m + j] = s;
    }
  return G;
}

double dist_to_identity(const std::vector<double>& G, int m) {
  double s = 0;
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < m; ++j) {
      const double d = G[size_t(i) * m + j] - (i == j ? 1.0 : 0.0);
      s += d * d;
    }
  return std::sqrt(s);
}

TEST_F(CudaSwitchOptim, NewtonSchulzMatchesCpuWideSquareTall) {
  struct Case {
    int r, c, offset;  // offset in floats: a view that is not 256-byte aligned
  };
  for (const Case cs : {Case{64, 256, 0}, Case{128, 128, 0}, Case{300, 70, 0}, Case{37, 91, 3}, Case{91, 37, 1},
                        Case{1, 7, 0}}) {
    const std::string what = fmt::format("ns5 {}x{} off={}", cs.r, cs.c, cs.offset);
    SCOPED_TRACE(what);
    const size_t n = size_t(cs.r) * cs.c;
    auto x = randv(n, -3.f, 3.f);
    std::vector<float> padded(cs.offset, 0.f);
    padded.insert(padded.end(), x.begin(), x.end());
    auto d_x = up(padded);
    be().newton_schulz5(d_x.data() + cs.offset, cs.r, cs.c);
    auto got = down(d_x, padded.size());
    got.erase(got.begin(), got.begin() + cs.offset);

    std::vector<float> ref = x, work(cpu::ns_work_size(cs.r, cs.c));
    cpu::newton_schulz5<float>(ref.data(), cs.r, cs.c, work.data());
    check(got, ref, kNsF32, what);

    // Orthogonal like the CPU's: the Gram matrices agree, and so do their distances to I (the
    // inputs' tiniest singular values do not reach 1 in 5 steps, so neither distance is ~0).
    const int m = std::min(cs.r, cs.c);
    const auto Gg = gram(got, cs.r, cs.c), Gc = gram(ref, cs.r, cs.c);
    double num = 0, den = 0;
    for (size_t i = 0; i < Gc.size(); ++i) {
      num += (Gg[i] - Gc[i]) * (Gg[i] - Gc[i]);
      den += Gc[i] * Gc[i];
    }
    const double dg = dist_to_identity(Gg, m), dc = dist_to_identity(Gc, m);
    std::printf("[ rel err  ] %-36s %.3e (tol %.0e); ||G-I||_F gpu %.4f cpu %.4f (m=%d)\n",
                (what + " gram").c_str(), std::sqrt(num / den), kNsF32, dg, dc, m);
    EXPECT_LE(std::sqrt(num / den), kNsF32);
    EXPECT_NEAR(dg, dc, kNsF32 * std::sqrt(den));
  }
}

TEST_F(CudaSwitchOptim, NewtonSchulzIsReproducibleAndInPlaceOnly) {
  // Two runs give the same bits; the buffer around the matrix is untouched.
  const int r = 96, c = 200;
  const size_t n = size_t(r) * c;
  auto x = randv(n + 2);
  std::vector<float> first;
  for (int rep = 0; rep < 2; ++rep) {
    auto d_x = up(x);
    be().newton_schulz5(d_x.data() + 1, r, c);
    auto got = down(d_x, n + 2);
    EXPECT_EQ(got.front(), x.front());
    EXPECT_EQ(got.back(), x.back());
    if (rep == 0) first = got;
    else EXPECT_EQ(got, first) << "newton_schulz5 is not bitwise reproducible";
  }
}

TEST_F(CudaSwitchOptim, NewtonSchulzTf32WithinSanityBound) {
  cuda::CudaOptions o;
  o.tf32 = true;
  auto tf = cuda::make_backend(o);
  for (auto [r, c] : {std::pair{64, 256}, std::pair{300, 70}}) {
    const std::string what = fmt::format("ns5 tf32 {}x{}", r, c);
    const size_t n = size_t(r) * c;
    auto x = randv(n, -3.f, 3.f);
    auto d_x = up(x);
    tf->newton_schulz5(d_x.data(), r, c);
    tf->synchronize();
    auto got = d_x.download();
    std::vector<float> ref = x, work(cpu::ns_work_size(r, c));
    cpu::newton_schulz5<float>(ref.data(), r, c, work.data());
    check(got, ref, kNsTF32, what);
  }
}

// Under bf16 GEMMs Newton-Schulz runs on bf16 operands (8 mantissa bits, fp32 accumulation and
// iterates): a single matrix and a batch, against the CPU's fp32 iteration within a sanity bound.
TEST_F(CudaSwitchOptim, NewtonSchulzBf16WithinSanityBound) {
  cuda::CudaOptions o;
  o.bf16 = true;
  auto bf = cuda::make_backend(o);
  for (auto [r, c, count] : {std::tuple{64, 256, 1}, std::tuple{300, 70, 1}, std::tuple{40, 72, 5}}) {
    const std::string what = fmt::format("ns5 bf16 {}x{} x{}", r, c, count);
    const size_t mn = size_t(r) * c;
    auto x = randv(mn * count, -3.f, 3.f);
    auto d_x = up(x);
    bf->newton_schulz5_batched(d_x.data(), r, c, count);
    bf->synchronize();
    auto got = d_x.download();
    std::vector<float> ref = x, work(cpu::ns_work_size(r, c));
    for (int e = 0; e < count; ++e) cpu::newton_schulz5<float>(ref.data() + e * mn, r, c, work.data());
    const double rel = check(got, ref, kNsBf16, what);
    // Seen on the emulated backend: 8.5e-3 to 8.9e-3 in bf16, 1.1e-3 in TF32 (the test above).
    EXPECT_GT(rel, 3e-3) << what << ": more exact than bf16 operands allow: is bf16 in effect?";
  }
}

// Muon over an [E, out, in] stack: newton_schulz5_batched and muonh_apply_batched (strided-batched
// GEMMs, per-matrix norms by a segmented reduction) against the CPU's per-matrix loop, matrix by
// matrix, so a matrix skipped or normalized by its neighbour's norm fails on its own (a skipped one
// keeps its input: O(1) error). The batch sits one float into its buffer (views at odd offsets, not
// 16-byte aligned) between two guard values that must survive; sizes are not multiples of 16.
// In-place ops: the "output" is the input, so poisoning it is not possible; the per-matrix
// comparison plays that role. A second backend with a tiny workspace budget runs the same batches
// in chunks of 3 matrices (8 = 3 + 3 + 2).
TEST_F(CudaSwitchOptim, BatchedNewtonSchulzAndMuonHMatchTheCpuPerMatrix) {
  auto cpu_be = make_cpu_backend(0);
  struct Shape {
    int r, c;
  };
  const float kGuard = 12345.f;
  for (const Shape sh : {Shape{40, 40}, Shape{23, 57}, Shape{61, 19}}) {  // square, wide, tall
    const int m = std::min(sh.r, sh.c);
    const size_t mn = size_t(sh.r) * sh.c;
    cuda::CudaOptions small;
    small.ns_work_bytes = 3 * (mn + 2 * size_t(m) * m) * sizeof(float);  // 3 matrices per chunk
    auto chunked = cuda::make_backend(small);
    for (int count : {1, 3, 8}) {
      const size_t total = mn * size_t(count);
      auto x = randv(total, -3.f, 3.f);
      // Matrix scales differ by 10x from one matrix to the next: a norm taken over the wrong
      // matrix (or the whole batch) shows as an O(1) error.
      for (int e = 0; e < count; ++e)
        for (size_t i = 0; i < mn; ++i) x[size_t(e) * mn + i] *= std::pow(10.f, float(e % 3) - 1.f);
      std::vector<float> ref = x;
      cpu_be->newton_schulz5_batched(ref.data(), sh.r, sh.c, count);
      for (int variant = 0; variant < 2; ++variant) {
        cuda::CudaBackend& gb = variant == 0 ? be() : *chunked;
        const std::string what = fmt::format("ns5 batch {}x{} x{}{}", sh.r, sh.c, count, variant ? " chunked" : "");
        SCOPED_TRACE(what);
        std::vector<float> padded = {kGuard};
        padded.insert(padded.end(), x.begin(), x.end());
        padded.push_back(kGuard);
        auto d_x = up(padded);
        gb.newton_schulz5_batched(d_x.data() + 1, sh.r, sh.c, count);
        gb.synchronize();
        auto got = d_x.download();
        EXPECT_EQ(got.front(), kGuard);
        EXPECT_EQ(got.back(), kGuard);
        for (int e = 0; e < count; ++e) {
          const auto at = got.begin() + 1 + long(size_t(e) * mn);
          const auto rt = ref.begin() + long(size_t(e) * mn);
          check(std::vector<float>(at, at + long(mn)), std::vector<float>(rt, rt + long(mn)), kNsF32,
                fmt::format("{} [{}]", what, e));
        }
      }

      // MuonH's projection of every matrix, D = the CPU's orthogonalized batch on both sides.
      const std::string what = fmt::format("muonh batch {}x{} x{}", sh.r, sh.c, count);
      SCOPED_TRACE(what);
      auto w = randv(total);
      std::vector<float> R(static_cast<size_t>(count));
      for (auto& r : R) r = std::uniform_real_distribution<float>(0.5f, 3.f)(rng_);
      std::vector<float> pw = {kGuard};
      pw.insert(pw.end(), w.begin(), w.end());
      pw.push_back(kGuard);
      auto d_w = up(pw), d_D = up(ref, 1), d_R = up(R);
      be().muonh_apply_batched(d_w.data() + 1, d_D.data() + 1, mn, count, d_R.data(), 0.013);
      cpu_be->muonh_apply_batched(w.data(), ref.data(), mn, count, R.data(), 0.013);
      const auto gw = down(d_w, total + 2);
      EXPECT_EQ(gw.front(), kGuard);
      EXPECT_EQ(gw.back(), kGuard);
      for (int e = 0; e < count; ++e) {
        const auto at = gw.begin() + 1 + long(size_t(e) * mn);
        const auto wt = w.begin() + long(size_t(e) * mn);
        const std::vector<float> ge(at, at + long(mn)), ce(wt, wt + long(mn));
        check(ge, ce, kF32, fmt::format("{} [{}]", what, e));
        check_each(ge, ce, what);
        double ss = 0;  // back on its own sphere
        for (float v : ge) ss += double(v) * double(v);
        EXPECT_NEAR(std::sqrt(ss), R[size_t(e)], 1e-5 * R[size_t(e)]) << what << " [" << e << "]";
      }
    }
  }
}

TEST_F(CudaSwitchOptim, BatchedNewtonSchulzIsReproducible) {
  const int r = 37, c = 45, count = 5;
  const size_t n = size_t(r) * c * count;
  auto x = randv(n);
  std::vector<float> first;
  for (int rep = 0; rep < 2; ++rep) {
    auto d_x = up(x);
    be().newton_schulz5_batched(d_x.data(), r, c, count);
    auto got = down(d_x, n);
    if (rep == 0) first = got;
    else EXPECT_EQ(got, first) << "newton_schulz5_batched is not bitwise reproducible";
  }
}

}  // namespace
}  // namespace ladder
