// Every CUDA op against the CPU kernels (backend/cpu/kernels.h, float) on fresh random inputs.
// Outputs are poisoned with NaN first (every byte 0xFF) so an element a kernel never writes fails
// the comparison. Error measure: ||gpu - cpu|| / ||cpu|| over the whole output.
// Tolerances: kF32 = 5e-6 for fp32 paths (observed values are printed as "[ rel err ]" lines so the
// GPU session can record them); kTF32 = 5e-3 for TF32 GEMMs (10-bit mantissa inputs).
// Without a GPU each test calls GTEST_SKIP() with "no CUDA device: GPU test skipped (<reason>)".
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/profiling_backend.h"
#include "cuda_fixture.h"
#include "backend/cuda/device_memory.h"
#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "model/config.h"

namespace ladder {
namespace {

using cuda::DeviceBuffer;

constexpr double kF32 = 5e-6;
constexpr double kTF32 = 5e-3;

class CudaKernels : public test::CudaFixture {};

// ---------------------------------------------------------------------------------------------

struct GemmCase {
  bool ta, tb;
  int M, N, K, pad;
  float alpha, beta;
  int offset;  // floats: a view that is not 256-byte aligned
};

TEST_F(CudaKernels, GemmFp32AllTransposes) {
  const GemmCase cases[] = {
      {false, false, 67, 45, 33, 0, 0.7f, 0.f, 0},  {true, false, 67, 45, 33, 3, 1.f, 0.5f, 0},
      {false, true, 67, 45, 33, 5, -1.3f, 0.f, 1},  {true, true, 67, 45, 33, 0, 1.f, 1.f, 3},
      {false, true, 256, 384, 512, 0, 1.f, 0.f, 0}, {true, false, 128, 96, 1024, 16, 0.25f, 1.f, 2},
      {false, false, 5, 7, 0, 0, 1.f, 0.5f, 0},     {false, false, 5, 7, 0, 0, 1.f, 0.f, 0},
  };
  for (const auto& c : cases) {
    const std::string what = fmt::format("gemm ta={} tb={} {}x{}x{} b={} off={}", int(c.ta), int(c.tb), c.M, c.N,
                                         c.K, c.beta, c.offset);
    SCOPED_TRACE(what);
    // Leading dimensions at least 1 (BLAS rejects 0, which K = 0 would give).
    const int lda = std::max(1, (c.ta ? c.M : c.K) + c.pad), ldb = std::max(1, (c.tb ? c.K : c.N) + c.pad),
              ldc = c.N + c.pad;
    const int arows = c.ta ? c.K : c.M, brows = c.tb ? c.N : c.K;
    const size_t na = size_t(arows) * lda + c.offset, nb = size_t(brows) * ldb + c.offset,
                 nc = size_t(c.M) * ldc + c.offset;
    auto A = randv(na), B = randv(nb), C = randv(nc);
    auto dA = up(A), dB = up(B);
    DeviceBuffer<float> dC(nc);
    if (c.beta == 0.f) {
      dC.poison();  // beta = 0 must not read C
    } else {
      dC.upload(C);
    }
    be().gemm(c.ta, c.tb, c.M, c.N, c.K, c.alpha, dA.data() + c.offset, lda, dB.data() + c.offset, ldb, c.beta,
              dC.data() + c.offset, ldc);
    auto got = down(dC, nc);
    std::vector<float> ref = C;
    cpu::gemm<float>(c.ta, c.tb, c.M, c.N, c.K, c.alpha, A.data() + c.offset, lda, B.data() + c.offset, ldb, c.beta,
                     ref.data() + c.offset, ldc);
    // Compare the M x N block only (padding columns are not part of the output).
    std::vector<float> g, r;
    for (int i = 0; i < c.M; ++i)
      for (int j = 0; j < c.N; ++j) {
        g.push_back(got[c.offset + size_t(i) * ldc + j]);
        r.push_back(ref[c.offset + size_t(i) * ldc + j]);
      }
    check(g, r, kF32, what.c_str());
  }
}

TEST_F(CudaKernels, GemmTf32WithinTf32Tolerance) {
  cuda::CudaOptions o;
  o.tf32 = true;
  auto tf = cuda::make_backend(o);
  EXPECT_EQ(tf->name(), "cuda-tf32");
  const int M = 192, N = 160, K = 512;
  auto A = randv(size_t(M) * K), B = randv(size_t(N) * K);
  auto dA = up(A), dB = up(B);
  auto dC = poisoned(size_t(M) * N);
  tf->gemm(false, true, M, N, K, 1.f, dA.data(), K, dB.data(), K, 0.f, dC.data(), N);
  tf->synchronize();
  auto got = dC.download();
  std::vector<float> ref(size_t(M) * N);
  cpu::gemm<float>(false, true, M, N, K, 1.f, A.data(), K, B.data(), K, 0.f, ref.data(), N);
  const double rel = check(got, ref, kTF32, "gemm tf32 192x160x512");
  // TF32 must actually be in use: fp32-exact results would mean the option is ignored.
  EXPECT_GT(rel, 1e-6) << "TF32 gemm is as exact as fp32: the TF32 compute type is not in effect";
}

// bf16 GEMMs (CudaOptions::bf16): both operands rounded to bf16 (relative rounding error up to 2^-9
// each, so about 2^-8 per product, random in sign), fp32 accumulation: the result's relative error
// is a few 1e-3; 1e-2 is the bf16 bound. Strided, offset views in all four transposes, and
// beta != 0 (C stays fp32 and is read).
TEST_F(CudaKernels, GemmBf16WithinBf16Tolerance) {
  cuda::CudaOptions o;
  o.bf16 = true;
  auto bf = cuda::make_backend(o);
  EXPECT_EQ(bf->name(), "cuda-bf16");
  const GemmCase cases[] = {
      {false, true, 192, 160, 512, 0, 1.f, 0.f, 0}, {false, false, 67, 45, 33, 4, 0.7f, 0.f, 1},
      {true, false, 96, 80, 300, 3, 1.f, 0.5f, 2},  {true, true, 33, 65, 129, 1, -1.f, 1.f, 3},
  };
  for (const auto& c : cases) {
    const std::string what = fmt::format("gemm bf16 ta={} tb={} {}x{}x{}", int(c.ta), int(c.tb), c.M, c.N, c.K);
    SCOPED_TRACE(what);
    const int lda = (c.ta ? c.M : c.K) + c.pad, ldb = (c.tb ? c.K : c.N) + c.pad, ldc = c.N + c.pad;
    const int arows = c.ta ? c.K : c.M, brows = c.tb ? c.N : c.K;
    const size_t na = size_t(arows) * lda + c.offset, nb = size_t(brows) * ldb + c.offset,
                 nc = size_t(c.M) * ldc + c.offset;
    auto A = randv(na), B = randv(nb), C = randv(nc);
    auto dA = up(A), dB = up(B);
    DeviceBuffer<float> dC(nc);
    if (c.beta == 0.f) dC.poison(); else dC.upload(C);
    bf->gemm(c.ta, c.tb, c.M, c.N, c.K, c.alpha, dA.data() + c.offset, lda, dB.data() + c.offset, ldb, c.beta,
             dC.data() + c.offset, ldc);
    bf->synchronize();
    auto got = dC.download();
    std::vector<float> ref = C;
    cpu::gemm<float>(c.ta, c.tb, c.M, c.N, c.K, c.alpha, A.data() + c.offset, lda, B.data() + c.offset, ldb, c.beta,
                     ref.data() + c.offset, ldc);
    std::vector<float> g, r;
    for (int i = 0; i < c.M; ++i)
      for (int j = 0; j < c.N; ++j) {
        g.push_back(got[c.offset + size_t(i) * ldc + j]);
        r.push_back(ref[c.offset + size_t(i) * ldc + j]);
      }
    const double rel = check(g, r, 1e-2, what.c_str());
    // bf16 must actually be in use. Rounding both inputs (uniform rounding error, rms u/sqrt(3)) gives
    // a product error of rms sqrt(2/3) u: about 1.6e-3 for bf16 (u = 2^-9) and 4e-4 for TF32
    // (u = 2^-11), 1e-7 for fp32; the bound sits between bf16 and TF32.
    EXPECT_GT(rel, 8e-4) << "bf16 gemm is more exact than bf16 inputs allow: the option is not in effect";
  }
}

// gemm_add: D = alpha op(A) op(B) + C with D != C (the residual add in cuBLASLt's epilogue), D
// poisoned first, C unchanged; D == C; K = 0 (D = C); fp32 and bf16.
TEST_F(CudaKernels, GemmAddReadsCWritesD) {
  cuda::CudaOptions o;
  o.bf16 = true;
  auto bf = cuda::make_backend(o);
  for (cuda::CudaBackend* b : {&be(), bf.get()}) {
    const double tol = b->bf16() ? 1e-2 : kF32;
    for (int K : {70, 0}) {
      const int M = 45, N = 33, ldc = N + 3, lda = K + 1;
      auto A = randv(size_t(M) * std::max(lda, 1)), W = randv(size_t(N) * std::max(K, 1)), C = randv(size_t(M) * ldc);
      auto dA = up(A), dW = up(W), dC = up(C);
      auto dD = poisoned(size_t(M) * ldc);
      b->gemm_add(false, true, M, N, K, 0.5f, dA.data(), lda, dW.data(), K > 0 ? K : 1, dC.data(), dD.data(), ldc);
      std::vector<float> ref = C;
      cpu::gemm<float>(false, true, M, N, K, 0.5f, A.data(), lda, W.data(), K > 0 ? K : 1, 1.f, ref.data(), ldc);
      const auto got = down(dD, size_t(M) * ldc), c_after = down(dC, size_t(M) * ldc);
      std::vector<float> g, r;
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) g.push_back(got[size_t(i) * ldc + j]), r.push_back(ref[size_t(i) * ldc + j]);
      const std::string what = fmt::format("gemm_add {} K={}", b->bf16() ? "bf16" : "fp32", K);
      check(g, r, K == 0 ? 0.0 : tol, what);
      EXPECT_EQ(c_after, C) << what << ": C was written";
      // In place (D == C), as gemm with beta = 1.
      b->gemm_add(false, true, M, N, K, 0.5f, dA.data(), lda, dW.data(), K > 0 ? K : 1, dC.data(), dC.data(), ldc);
      const auto inplace = down(dC, size_t(M) * ldc);
      std::vector<float> gi;
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) gi.push_back(inplace[size_t(i) * ldc + j]);
      check(gi, r, K == 0 ? 0.0 : tol, what + " in place");
    }
  }
}

// gemm_b16: B given as bf16 bits (a view with its own leading dimension), against the CPU's GEMM on
// B widened; on the fp32 backend (B widened into scratch) and the bf16 one (B read as it is).
TEST_F(CudaKernels, GemmWithBf16BMatchesTheWidenedProduct) {
  cuda::CudaOptions o;
  o.bf16 = true;
  auto bf = cuda::make_backend(o);
  for (cuda::CudaBackend* b : {&be(), bf.get()}) {
    for (bool tb : {false, true}) {
      const int M = 40, N = 36, K = 52, ldb = (tb ? K : N) + 5, ldc = N;
      const int brows = tb ? N : K;
      auto A = randv(size_t(K) * M), Bf = randv(size_t(brows) * ldb), C = randv(size_t(M) * ldc);
      std::vector<uint16_t> B16(Bf.size());
      cpu::f32_to_bf16(B16.data(), Bf.data(), Bf.size());
      std::vector<float> Bw(Bf.size());
      cpu::bf16_to_f32(Bw.data(), B16.data(), B16.size());
      auto dA = up(A), dC = up(C);
      auto dB = up(B16, 1);  // odd offset
      b->gemm_b16(true, tb, M, N, K, 0.5f, dA.data(), M, dB.data() + 1, ldb, 1.f, dC.data(), ldc);
      std::vector<float> ref = C;
      cpu::gemm<float>(true, tb, M, N, K, 0.5f, A.data(), M, Bw.data(), ldb, 1.f, ref.data(), ldc);
      check(down(dC, ref.size()), ref, b->bf16() ? 1e-2 : kF32,
            fmt::format("gemm_b16 {} tb={}", b->bf16() ? "bf16" : "fp32", int(tb)));
    }
  }
}

// gemm_ex (model.mlp_bf16's GEMMs): every mix of fp32 / bf16 A, B and output, against the CPU
// backend's gemm_ex (the reference: widen, sgemm, round), on the fp32 backend (bf16 operands
// widened into scratch, a bf16 output rounded from an fp32 GEMM) and the bf16 one (cuBLASLt reads
// bf16 operands as they are and writes the bf16 output itself). Outputs poisoned first; a bf16 D's
// padding columns must keep their poison. fp32 backend: fp32 outputs to kF32, bf16 outputs within
// 1e-2 (the two fp32 results differ by ulps, so a few elements round to the neighbouring bf16,
// 2^-8 apart); bf16 backend: 1e-2 (bf16-rounded operands).
TEST_F(CudaKernels, GemmExTypedOperandsMatchTheCpu) {
  cuda::CudaOptions o;
  o.bf16 = true;
  auto bf = cuda::make_backend(o);
  auto cpu = make_cpu_backend(1);
  const int M = 45, N = 38, K = 70, pad = 3;
  for (cuda::CudaBackend* b : {&be(), bf.get()}) {
    for (int mask = 0; mask < 8; ++mask) {
      const bool a16 = mask & 1, b16 = mask & 2, d16 = mask & 4;
      for (int t = 0; t < 4; ++t) {
        const bool ta = t & 1, tb = t & 2;
        const int lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
        const size_t na = size_t(ta ? K : M) * lda, nb = size_t(tb ? N : K) * ldb, nc = size_t(M) * ldc;
        auto A = randv(na), B = randv(nb), C = randv(nc);
        std::vector<uint16_t> A16(na), B16(nb);
        cpu::f32_to_bf16(A16.data(), A.data(), na);
        cpu::f32_to_bf16(B16.data(), B.data(), nb);
        auto dA = up(A), dB = up(B), dC = up(C);
        auto dA16 = up(A16, 1), dB16 = up(B16, 1);  // odd offsets
        const void* ha = a16 ? static_cast<const void*>(A16.data()) : A.data();
        const void* hb = b16 ? static_cast<const void*>(B16.data()) : B.data();
        const void* da = a16 ? static_cast<const void*>(dA16.data() + 1) : dA.data();
        const void* db = b16 ? static_cast<const void*>(dB16.data() + 1) : dB.data();
        const std::string what = fmt::format("gemm_ex {} a16={} b16={} d16={} ta={} tb={}", b->bf16() ? "bf16" : "fp32",
                                             int(a16), int(b16), int(d16), int(ta), int(tb));
        const double tol = b->bf16() || d16 ? 1e-2 : kF32;
        std::vector<float> g, r;
        if (d16) {
          auto dD = poisoned<uint16_t>(nc);
          b->gemm_ex(ta, tb, M, N, K, 0.5f, da, a16, lda, db, b16, ldb, 0.f, nullptr, dD.data(), true, ldc);
          std::vector<uint16_t> ref(nc, 0xffff);
          cpu->gemm_ex(ta, tb, M, N, K, 0.5f, ha, a16, lda, hb, b16, ldb, 0.f, nullptr, ref.data(), true, ldc);
          const auto got = down(dD, nc);
          size_t pad_written = 0;
          for (int i = 0; i < M; ++i) {
            for (int j = 0; j < N; ++j) {
              const size_t e = size_t(i) * ldc + j;
              const uint32_t gu = uint32_t(got[e]) << 16, ru = uint32_t(ref[e]) << 16;
              float gf, rf;
              std::memcpy(&gf, &gu, 4);
              std::memcpy(&rf, &ru, 4);
              g.push_back(gf), r.push_back(rf);
            }
            for (int j = N; j < ldc; ++j) pad_written += got[size_t(i) * ldc + j] != 0xffff;
          }
          EXPECT_EQ(pad_written, 0u) << what << ": padding columns written";
        } else {
          // fp32 output with a separate addend: D = 0.5 op(A) op(B) + 0.25 C, D poisoned first.
          auto dD = poisoned(nc);
          b->gemm_ex(ta, tb, M, N, K, 0.5f, da, a16, lda, db, b16, ldb, 0.25f, dC.data(), dD.data(), false, ldc);
          std::vector<float> ref(nc, 0.f);
          cpu->gemm_ex(ta, tb, M, N, K, 0.5f, ha, a16, lda, hb, b16, ldb, 0.25f, C.data(), ref.data(), false, ldc);
          const auto got = down(dD, nc);
          for (int i = 0; i < M; ++i)
            for (int j = 0; j < N; ++j) g.push_back(got[size_t(i) * ldc + j]), r.push_back(ref[size_t(i) * ldc + j]);
          EXPECT_EQ(down(dC, nc), C) << what << ": C_in was written";
        }
        check(g, r, tol, what);
      }
    }
  }
}

// A bf16-output GEMM writing over memory whose bf16 cast the backend has cached (bf16 GEMMs): the
// cast must be dropped, as for an fp32 output. X is cached as A; a gemm_ex writes bf16 values into
// X's first bytes; the next GEMM reading X must see the new X.
TEST_F(CudaKernels, GemmExBf16OutputDropsAStaleCast) {
  cuda::CudaOptions o;
  o.bf16 = true;
  auto bf = cuda::make_backend(o);
  const int M = 64, N = 48, K = 80;
  auto X = randv(size_t(M) * K), W = randv(size_t(N) * K), Z = randv(size_t(M) * K);
  std::vector<uint16_t> Z16(Z.size());
  cpu::f32_to_bf16(Z16.data(), Z.data(), Z.size());
  auto dX = up(X), dW = up(W);
  auto dZ16 = up(Z16);
  // Everything allocated (and written from outside the backend) before the first GEMM: an
  // allocation, poison or upload in between would drop the cast by itself (device-memory epoch).
  DeviceBuffer<float> dY(size_t(M) * N), dY2(size_t(M) * N);
  auto dX0 = up(randv(X.size()));
  bf->gemm(false, true, M, N, K, 1.f, dX0.data(), K, dX0.data(), K, 0.f, dY.data(), N);  // grows the cast scratch
  bf->gemm(false, true, M, N, K, 1.f, dX.data(), K, dW.data(), K, 0.f, dY.data(), N);    // X cached as A
  // bf16 [M, N] output with ldc = 2K: row i lands in bytes [4K i, 4K i + 2N) of X's row i. Its A is
  // bf16 (read as it is) and its B is W (the cached cast of B), so X's cast stays in the cache: only
  // the overlap check can drop it.
  const uint64_t r0 = bf->bf16_cast_reuses();
  bf->gemm_ex(false, true, M, N, K, 1.f, dZ16.data(), true, K, dW.data(), false, K, 0.f, nullptr,
              reinterpret_cast<uint16_t*>(dX.data()), true, 2 * K);
  EXPECT_EQ(bf->bf16_cast_reuses(), r0 + 1) << "W's cast was not reused: the setup does not keep X cached";
  bf->gemm(false, true, M, N, K, 1.f, dX.data(), K, dW.data(), K, 0.f, dY2.data(), N);
  EXPECT_EQ(bf->bf16_cast_reuses(), r0 + 2) << "X re-cast, W's cast reused";
  bf->synchronize();
  X = dX.download();  // the new X (a download leaves the epoch alone)
  std::vector<float> ref(size_t(M) * N);
  cpu::gemm<float>(false, true, M, N, K, 1.f, X.data(), K, W.data(), K, 0.f, ref.data(), N);
  check(dY2.download(), ref, 1e-2, "bf16 cast after a bf16-output GEMM wrote into X");
}

// batched_gemm_ex (the MoE capacity layout's expert GEMMs: one strided-batched cuBLASLt GEMM over
// stacked operands): every transpose, every mix of fp32 / bf16 A, B and C, beta 0 (C poisoned) and
// 1 (fp32 C only), count 1 and 3, on the fp32 backend (bf16 operands widened, a bf16 C rounded from
// the fp32 batch) and the bf16 one (stacked casts, cuBLASLt's strides in the leading dimension it
// reads), against the CPU backend's loop of gemm_ex. Padded leading dimensions, bf16 operands at an
// odd element offset; every padding column of the stacked C must keep its initial bytes. Bounds as
// GemmExTypedOperandsMatchTheCpu: kF32 for fp32 results of fp32 GEMMs, 1e-2 where anything is bf16.
class CudaGemm : public test::CudaFixture {};

TEST_F(CudaGemm, BatchedGemmExMatchesTheCpu) {
  cuda::CudaOptions o;
  o.bf16 = true;
  auto bf = cuda::make_backend(o);
  auto cpu = make_cpu_backend(1);
  const int M = 21, N = 13, K = 18, pad = 3;
  for (cuda::CudaBackend* b : {&be(), bf.get()})
    for (int count : {1, 3})
      for (int mask = 0; mask < 16; ++mask) {
        const bool a16 = mask & 1, b16 = mask & 2, c16 = mask & 4, beta1 = mask & 8;
        if (c16 && beta1) continue;  // a bf16 C takes beta 0
        const float beta = beta1 ? 1.f : 0.f;
        for (int t = 0; t < 4; ++t) {
          const bool ta = t & 1, tb = t & 2;
          const int lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
          const size_t na = size_t(count) * (ta ? K : M) * lda, nb = size_t(count) * (tb ? N : K) * ldb;
          const size_t nc = size_t(count) * M * ldc;
          auto A = randv(na), B = randv(nb), C = randv(nc);
          std::vector<uint16_t> A16(na), B16(nb), C16(nc);
          cpu::f32_to_bf16(A16.data(), A.data(), na);
          cpu::f32_to_bf16(B16.data(), B.data(), nb);
          cpu::f32_to_bf16(C16.data(), C.data(), nc);
          auto dA = up(A), dB = up(B);
          auto dA16 = up(A16, 1), dB16 = up(B16, 1);  // odd offsets
          const void* ha = a16 ? static_cast<const void*>(A16.data()) : A.data();
          const void* hb = b16 ? static_cast<const void*>(B16.data()) : B.data();
          const void* da = a16 ? static_cast<const void*>(dA16.data() + 1) : dA.data();
          const void* db = b16 ? static_cast<const void*>(dB16.data() + 1) : dB.data();
          const std::string what =
              fmt::format("batched_gemm_ex {} count={} a16={} b16={} c16={} beta={} ta={} tb={}",
                          b->bf16() ? "bf16" : "fp32", count, int(a16), int(b16), int(c16), beta, int(ta), int(tb));
          SCOPED_TRACE(what);
          const double tol = b->bf16() || c16 ? 1e-2 : kF32;
          std::vector<float> g, r;
          size_t pad_written = 0;
          if (c16) {
            // beta 0: C is never read; the GPU's starts poisoned, the padding must stay poisoned.
            auto dC = poisoned<uint16_t>(nc);
            std::vector<uint16_t> ref(nc, 0xffff);
            b->batched_gemm_ex(count, ta, tb, M, N, K, 0.5f, da, a16, lda, db, b16, ldb, 0.f, dC.data(), true, ldc);
            cpu->batched_gemm_ex(count, ta, tb, M, N, K, 0.5f, ha, a16, lda, hb, b16, ldb, 0.f, ref.data(), true, ldc);
            const auto got = down(dC, nc);
            for (size_t i = 0; i < size_t(count) * M; ++i) {
              for (int j = 0; j < N; ++j)
                g.push_back(cpu::bf16_value(got[i * ldc + j])), r.push_back(cpu::bf16_value(ref[i * ldc + j]));
              for (int j = N; j < ldc; ++j) pad_written += got[i * ldc + j] != 0xffff;
            }
          } else {
            // beta 1: C accumulates from random values; beta 0: poisoned on the GPU (never read),
            // zeros on the CPU.
            auto dC = beta1 ? up(C) : poisoned(nc);
            const std::vector<float> init = beta1 ? C : down(dC, nc);
            std::vector<float> ref = beta1 ? C : std::vector<float>(nc, 0.f);
            b->batched_gemm_ex(count, ta, tb, M, N, K, 0.5f, da, a16, lda, db, b16, ldb, beta, dC.data(), false, ldc);
            cpu->batched_gemm_ex(count, ta, tb, M, N, K, 0.5f, ha, a16, lda, hb, b16, ldb, beta, ref.data(), false,
                                 ldc);
            const auto got = down(dC, nc);
            for (size_t i = 0; i < size_t(count) * M; ++i) {
              for (int j = 0; j < N; ++j) g.push_back(got[i * ldc + j]), r.push_back(ref[i * ldc + j]);
              for (int j = N; j < ldc; ++j)
                pad_written += std::memcmp(&got[i * ldc + j], &init[i * ldc + j], sizeof(float)) != 0;
            }
          }
          EXPECT_EQ(pad_written, 0u) << what << ": padding columns written";
          check(g, r, tol, what);
        }
      }
}

// bf16 GEMMs: a batched GEMM's output is the whole stack, so a cached cast of memory under any of
// its matrices is stale afterwards, not only under the first. X (cached as A) lies under matrix 1
// of a two-matrix fp32 output whose operands are bf16 (read as they are, so X's cast stays in the
// cache and only the overlap check can drop it); the next GEMM reading X must see the new X.
// The recipe's fp32 router on a bf16-GEMM backend: gemm_fp32 is the fp32 product (near 1e-6 of the
// CPU), where gemm rounds its operands to bf16 (near 1e-3: the check that the test can tell them
// apart), every transpose, beta 0 on a poisoned C and beta 1; the router's shapes (E = 64 columns).
TEST_F(CudaGemm, Fp32GemmIgnoresBf16Precision) {
  cuda::CudaOptions o;
  o.bf16 = true;
  auto bf = cuda::make_backend(o);
  auto cpu = make_cpu_backend(0);
  const int M = 96, N = 64, K = 80;
  for (int t = 0; t < 4; ++t)
    for (float beta : {0.f, 1.f}) {
      const bool ta = t & 1, tb = t & 2;
      const int lda = ta ? M : K, ldb = tb ? K : N;
      const auto A = randv(size_t(M) * K), B = randv(size_t(K) * N), C = randv(size_t(M) * N);
      auto dA = up(A), dB = up(B);
      auto dC = beta != 0.f ? up(C) : poisoned(C.size());
      std::vector<float> ref = beta != 0.f ? C : std::vector<float>(C.size(), 0.f);
      cpu->gemm(ta, tb, M, N, K, 1.f, A.data(), lda, B.data(), ldb, beta, ref.data(), N);
      bf->gemm_fp32(ta, tb, M, N, K, 1.f, dA.data(), lda, dB.data(), ldb, beta, dC.data(), N);
      bf->synchronize();
      const std::string what = std::string("gemm_fp32 ") + (ta ? "T" : "N") + (tb ? "T" : "N") + " beta " +
                               std::to_string(int(beta));
      check(down(dC, C.size()), ref, 2e-6, what);
      if (beta == 0.f) {  // the same product through gemm() is bf16's, far from the fp32 one
        auto dD = poisoned(C.size());
        bf->gemm(ta, tb, M, N, K, 1.f, dA.data(), lda, dB.data(), ldb, 0.f, dD.data(), N);
        bf->synchronize();
        const auto got = down(dD, C.size());
        double num = 0, den = 0;
        for (size_t i = 0; i < got.size(); ++i)
          num += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]), den += double(ref[i]) * ref[i];
        EXPECT_GT(std::sqrt(num / den), 1e-4) << what << ": gemm() was not bf16 here, so the test proves nothing";
      }
    }
}

TEST_F(CudaGemm, BatchedGemmOutputDropsAStaleCast) {
  cuda::CudaOptions o;
  o.bf16 = true;
  auto bf = cuda::make_backend(o);
  const int M = 32, N = 40, K = 48;
  auto W = randv(size_t(N) * K), buf = randv(size_t(M) * N + size_t(M) * K);
  std::vector<uint16_t> Z16(size_t(2) * M * K), V16(size_t(2) * N * K);
  {
    const auto z = randv(Z16.size()), v = randv(V16.size());
    cpu::f32_to_bf16(Z16.data(), z.data(), z.size());
    cpu::f32_to_bf16(V16.data(), v.data(), v.size());
  }
  // Everything allocated (and written from outside the backend) before the first GEMM: an
  // allocation or upload in between would drop the cast by itself (device-memory epoch).
  auto dW = up(W), dBuf = up(buf), dX0 = up(randv(size_t(std::max(M, N)) * K));
  auto dZ16 = up(Z16), dV16 = up(V16);
  DeviceBuffer<float> dY(size_t(M) * N), dY2(size_t(M) * N);
  float* dX = dBuf.data() + size_t(M) * N;  // X [M, K]: its first M*N floats are matrix 1 of the output
  bf->gemm(false, true, M, N, K, 1.f, dX0.data(), K, dX0.data(), K, 0.f, dY.data(), N);  // grows the cast scratch
  bf->gemm(false, true, M, N, K, 1.f, dX, K, dW.data(), K, 0.f, dY.data(), N);          // X cached as A
  bf->batched_gemm_ex(2, false, true, M, N, K, 1.f, dZ16.data(), true, K, dV16.data(), true, K, 0.f, dBuf.data(),
                      false, N);
  const uint64_t r0 = bf->bf16_cast_reuses();
  bf->gemm(false, true, M, N, K, 1.f, dX, K, dW.data(), K, 0.f, dY2.data(), N);
  EXPECT_EQ(bf->bf16_cast_reuses(), r0 + 1) << "X's cast reused after a batched GEMM wrote over it (or W's not)";
  bf->synchronize();
  const auto all = dBuf.download();  // the new X (a download leaves the epoch alone)
  const std::vector<float> X(all.begin() + long(M) * N, all.end());
  std::vector<float> ref(size_t(M) * N);
  cpu::gemm<float>(false, true, M, N, K, 1.f, X.data(), K, W.data(), K, 0.f, ref.data(), N);
  check(dY2.download(), ref, 1e-2, "bf16 cast after a batched GEMM wrote into X");
}

// bf16 GEMMs reuse an operand's cast for the next GEMMs reading it, until anything else runs or a
// GEMM writes over it. Each case changes X between two GEMMs in one of the ways that must drop the
// cast (an op, a copy, an upload, a GEMM writing into X) and checks the second result against the
// CPU on the new X: a stale cast would give the old product (relative error ~1, tolerance 1e-2).
TEST_F(CudaKernels, GemmBf16CastReuseIsExactAndNeverStale) {
  cuda::CudaOptions o;
  o.bf16 = true;
  auto bf = cuda::make_backend(o);
  const int M = 96, N = 64, K = 80;
  auto X = randv(size_t(M) * K), W1 = randv(size_t(N) * K), W2 = randv(size_t(N) * K);
  auto dX = up(X), dW1 = up(W1), dW2 = up(W2);
  DeviceBuffer<float> dY1(size_t(M) * N), dY2(size_t(M) * N);
  auto y_of = [&](const std::vector<float>& x, const std::vector<float>& w) {
    std::vector<float> y(size_t(M) * N);
    cpu::gemm<float>(false, true, M, N, K, 1.f, x.data(), K, w.data(), K, 0.f, y.data(), N);
    return y;
  };
  auto gemm = [&](DeviceBuffer<float>& Y, DeviceBuffer<float>& Wd) {
    Y.poison();
    bf->gemm(false, true, M, N, K, 1.f, dX.data(), K, Wd.data(), K, 0.f, Y.data(), N);
    bf->synchronize();
    return Y.download();
  };
  // Two GEMMs reading X: the second reuses the cast, and computes what a fresh cast would. (Outputs
  // poisoned before both: a memset outside the backend also drops the cast, see case 5.)
  dY1.poison();
  dY2.poison();
  auto dX0 = up(randv(X.size()));  // a first GEMM on other operands grows the cast scratch
  bf->gemm(false, true, M, N, K, 1.f, dX0.data(), K, dX0.data(), K, 0.f, dY2.data(), N);
  const uint64_t r0 = bf->bf16_cast_reuses();
  bf->gemm(false, true, M, N, K, 1.f, dX.data(), K, dW1.data(), K, 0.f, dY1.data(), N);
  bf->gemm(false, true, M, N, K, 1.f, dX.data(), K, dW2.data(), K, 0.f, dY2.data(), N);
  bf->synchronize();
  const auto y1 = dY1.download(), y2 = dY2.download();
  EXPECT_EQ(bf->bf16_cast_reuses(), r0 + 1) << "consecutive GEMMs on one operand did not share its cast";
  check(y1, y_of(X, W1), 1e-2, "bf16 cast reuse: first");
  check(y2, y_of(X, W2), 1e-2, "bf16 cast reuse: second (reused cast)");
  {
    auto bf2 = cuda::make_backend(o);  // a fresh backend casts anew: bitwise the same result
    DeviceBuffer<float> dY(size_t(M) * N);
    bf2->gemm(false, true, M, N, K, 1.f, dX.data(), K, dW2.data(), K, 0.f, dY.data(), N);
    bf2->synchronize();
    EXPECT_EQ(dY.download(), y2) << "the reused cast differs from a fresh one";
  }
  // 1. An op writing X (scale by -1).
  bf->scale_inplace(dX.data(), -1.f, X.size());
  for (auto& v : X) v = -v;
  check(gemm(dY1, dW1), y_of(X, W1), 1e-2, "bf16 cast after an op wrote X");
  // 2. A device copy into X.
  auto X2 = randv(X.size());
  auto dX2 = up(X2);
  bf->copy(dX.data(), dX2.data(), X.size() * sizeof(float));
  X = X2;
  check(gemm(dY1, dW1), y_of(X, W1), 1e-2, "bf16 cast after a copy into X");
  // 3. An upload into X.
  X = randv(X.size());
  bf->upload(dX.data(), X.data(), X.size() * sizeof(float));
  check(gemm(dY1, dW1), y_of(X, W1), 1e-2, "bf16 cast after an upload into X");
  // 4. A GEMM writing its output over (part of) X: X's first M x N block (K >= N) = Z W1^T, with Z
  // and W1 registered as weights, so that GEMM reads their bf16 mirror and leaves the cast of X in
  // place: only the overlap check can drop it.
  auto ZW = randv(size_t(M) * K + size_t(N) * K);
  auto dZW = up(ZW);
  bf->register_weights(dZW.data(), ZW.size() * sizeof(float));
  gemm(dY1, dW1);  // X cached as A
  const uint64_t r1 = bf->bf16_cast_reuses();
  bf->gemm(false, true, M, N, K, 1.f, dZW.data(), K, dZW.data() + size_t(M) * K, K, 0.f, dX.data(), K);  // ldc = K
  bf->synchronize();
  EXPECT_EQ(bf->bf16_cast_reuses(), r1) << "the weights came from the mirror, not the cast cache";
  X = dX.download();
  check(gemm(dY2, dW2), y_of(X, W2), 1e-2, "bf16 cast after a GEMM wrote into X");
  bf->unregister_weights(dZW.data());
  // 5. Device memory written outside the backend's ops (DeviceBuffer::upload: cudaMemcpy), or freed
  // and reallocated at the same address: the device-memory epoch drops the cast.
  gemm(dY1, dW1);  // X cached as A
  X = randv(X.size());
  dX.upload(X);
  check(gemm(dY1, dW1), y_of(X, W1), 1e-2, "bf16 cast after an upload outside the backend");
  // 6. Registered weights written by a collective library (NCCL's broadcast of a sharded optimizer's
  // weights: behind the backend's ops, no allocation, no copy through the helpers), which the Comm
  // reports with note_external_write: the mirror gets the bf16 of the written floats, no full re-cast.
  bf->register_weights(dW1.data(), W1.size() * sizeof(float));
  auto* cb = dynamic_cast<cuda::CudaBackend*>(bf.get());
  ASSERT_NE(cb, nullptr);
  check(gemm(dY1, dW1), y_of(X, W1), 1e-2, "bf16 GEMM on registered weights");
  const uint64_t casts = cb->bf16_mirror_casts();
  // Rows [8, 8 + 16) of W1 (a later rank's range), then all of it.
  for (const auto& [at, count] : {std::pair<size_t, size_t>{size_t(8) * K, size_t(16) * K}, {0, W1.size()}}) {
    const std::vector<float> part = randv(count);
    std::copy(part.begin(), part.end(), W1.begin() + long(at));
    {
      auto fresh = up(part);  // the other rank's bits, landing as a library would write them
      LADDER_CUDA_CHECK(cudaMemcpyAsync(dW1.data() + at, fresh.data(), count * sizeof(float), cudaMemcpyDeviceToDevice,
                                        bf->stream()));
      bf->synchronize();
    }
    bf->note_external_write(dW1.data() + at, count * sizeof(float));
    check(gemm(dY1, dW1), y_of(X, W1), 1e-2, "bf16 GEMM after a collective wrote the registered weights");
  }
  EXPECT_EQ(cb->bf16_mirror_casts(), casts) << "the written floats were cast, not the whole mirror";
  bf->unregister_weights(dW1.data());
}

// ---------------------------------------------------------------------------------------------

TEST_F(CudaKernels, EmbeddingForwardBackward) {
  const int V = 97, D = 70, N = 300;
  auto table = randv(size_t(V) * D);
  auto ids = randi(N, 13);  // many repeats: the backward's run-length grouping is exercised
  ids[0] = V - 1;
  auto dtable0 = randv(size_t(V) * D), dout = randv(size_t(N) * D);
  auto d_table = up(table), d_dout = up(dout);
  auto d_ids = up(ids);
  auto d_out = poisoned(size_t(N) * D);
  be().embedding_forward(d_out.data(), d_table.data(), d_ids.data(), N, D);
  std::vector<float> ref(size_t(N) * D);
  cpu::embedding_forward<float>(ref.data(), table.data(), ids.data(), N, D);
  check(down(d_out, ref.size()), ref, 0.0, "embedding_forward");

  std::vector<float> dref = dtable0;
  cpu::embedding_backward<float>(dref.data(), dout.data(), ids.data(), N, D);
  std::vector<float> first;
  for (int rep = 0; rep < 2; ++rep) {
    auto d_dtable = up(dtable0);  // accumulates (+=): start from random values, not zeros
    be().embedding_backward(d_dtable.data(), d_dout.data(), d_ids.data(), N, D);
    auto got = down(d_dtable, dref.size());
    check(got, dref, kF32, "embedding_backward");
    if (rep == 0) first = got;
    else EXPECT_EQ(got, first) << "embedding_backward is not bitwise reproducible";
  }
}

TEST_F(CudaKernels, RmsNormForwardBackward) {
  for (bool with_gain : {true, false}) {
    for (bool acc : {false, true}) {
      const int N = 300, D = 257;
      SCOPED_TRACE(fmt::format("gain={} accumulate_dx={}", with_gain, acc));
      auto x = randv(size_t(N) * D, -2.f, 2.f), gain = randv(D, 0.5f, 1.5f), dy = randv(size_t(N) * D);
      auto dx0 = randv(size_t(N) * D), dgain0 = randv(D);
      auto d_x = up(x), d_gain = up(gain), d_dy = up(dy);
      auto d_y = poisoned(size_t(N) * D), d_rstd = poisoned(N);
      const float* g = with_gain ? d_gain.data() : nullptr;
      be().rmsnorm_forward(d_y.data(), d_rstd.data(), d_x.data(), g, N, D, 1e-6f);
      std::vector<float> y(size_t(N) * D), rstd(N);
      cpu::rmsnorm_forward<float>(y.data(), rstd.data(), x.data(), with_gain ? gain.data() : nullptr, N, D, 1e-6f);
      check(down(d_y, y.size()), y, kF32, "rmsnorm_forward y");
      check(down(d_rstd, rstd.size()), rstd, kF32, "rmsnorm_forward rstd");

      DeviceBuffer<float> d_dx(size_t(N) * D);
      if (acc) d_dx.upload(dx0);
      else d_dx.poison();
      auto d_dgain = up(dgain0);
      be().rmsnorm_backward(d_dx.data(), with_gain ? d_dgain.data() : nullptr, d_dy.data(), d_x.data(), g,
                            d_rstd.data(), N, D, acc);
      std::vector<float> dx = dx0, dgain = dgain0;
      cpu::rmsnorm_backward<float>(dx.data(), with_gain ? dgain.data() : nullptr, dy.data(), x.data(),
                                   with_gain ? gain.data() : nullptr, rstd.data(), N, D, acc);
      check(down(d_dx, dx.size()), dx, kF32, "rmsnorm_backward dx");
      check(down(d_dgain, dgain.size()), dgain, kF32, "rmsnorm_backward dgain");
    }
  }
}

TEST_F(CudaKernels, RopeForwardBackward) {
  const int B = 2, S = 37, nh = 3, hd = 16;
  for (int rot : {16, 8}) {
    SCOPED_TRACE(fmt::format("rot_dims={}", rot));
    auto x = randv(size_t(B) * S * nh * hd);
    auto d_x = up(x);
    be().rope_forward(d_x.data(), B * S, S, nh, hd, rot, 10000.f);
    std::vector<float> ref = x;
    cpu::rope_forward<float>(ref.data(), B * S, S, nh, hd, rot, 10000.f);
    check(down(d_x, ref.size()), ref, kF32, "rope_forward");
    be().rope_backward(d_x.data(), B * S, S, nh, hd, rot, 10000.f);
    cpu::rope_backward<float>(ref.data(), B * S, S, nh, hd, rot, 10000.f);
    check(down(d_x, ref.size()), ref, kF32, "rope_backward");
  }
}

// ---------------------------------------------------------------------------------------------

TEST_F(CudaKernels, AttentionForwardBackward) {
  struct Case {
    int B, S, H, KV, hd, window;
  };
  const Case cases[] = {
      {2, 77, 4, 2, 64, 0}, {1, 130, 6, 2, 32, 17}, {1, 65, 2, 1, 128, 0},
      {1, 50, 4, 4, 48, 0}, {2, 33, 2, 1, 16, 5},   {1, 200, 2, 2, 64, 64},
  };
  for (const auto& c : cases) {
    const std::string what = fmt::format("B={} S={} H={} KV={} hd={} W={}", c.B, c.S, c.H, c.KV, c.hd, c.window);
    SCOPED_TRACE(what);
    const AttnShape s{c.B, c.S, c.H, c.KV, c.hd, c.window, 1.0 / std::sqrt(double(c.hd))};
    const size_t nq = size_t(c.B) * c.S * c.H * c.hd, nk = size_t(c.B) * c.S * c.KV * c.hd,
                 nl = size_t(c.B) * c.H * c.S;
    auto q = randv(nq, -2.f, 2.f), k = randv(nk, -2.f, 2.f), v = randv(nk), dout = randv(nq);
    auto d_q = up(q), d_k = up(k), d_v = up(v), d_dout = up(dout);
    auto d_o = poisoned(nq), d_lse = poisoned(nl);
    be().attention_forward(d_o.data(), d_lse.data(), d_q.data(), d_k.data(), d_v.data(), s);
    std::vector<float> o(nq), lse(nl);
    cpu::attention_forward<float>(o.data(), lse.data(), q.data(), k.data(), v.data(), s);
    check(down(d_o, nq), o, kF32, ("attn fwd o " + what).c_str());
    check(down(d_lse, nl), lse, kF32, ("attn fwd lse " + what).c_str());

    std::vector<float> dq(nq), dk(nk), dv(nk);
    cpu::attention_backward<float>(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                                   o.data(), lse.data(), s);
    std::vector<float> first;
    for (int rep = 0; rep < 2; ++rep) {
      auto d_dq = poisoned(nq), d_dk = poisoned(nk), d_dv = poisoned(nk);
      be().attention_backward(d_dq.data(), d_dk.data(), d_dv.data(), d_dout.data(), d_q.data(), d_k.data(),
                              d_v.data(), d_o.data(), d_lse.data(), s);
      auto gq = down(d_dq, nq);
      check(gq, dq, kF32, ("attn bwd dq " + what).c_str());
      check(down(d_dk, nk), dk, kF32, ("attn bwd dk " + what).c_str());
      check(down(d_dv, nk), dv, kF32, ("attn bwd dv " + what).c_str());
      if (rep == 0) first = gq;
      else EXPECT_EQ(gq, first) << "attention_backward is not bitwise reproducible";
    }
  }
}

TEST_F(CudaKernels, AttentionRejectsHeadDimAbove128) {
  const AttnShape s{1, 4, 1, 1, 160, 0, 0.1};
  DeviceBuffer<float> q(4 * 160), o(4 * 160), lse(4);
  try {
    be().attention_forward(o.data(), lse.data(), q.data(), q.data(), q.data(), s);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------

TEST_F(CudaKernels, SwigluForwardBackward) {
  const size_t n = 10007;
  auto g = randv(n, -4.f, 4.f), u = randv(n), dh = randv(n);
  auto d_g = up(g), d_u = up(u), d_dh = up(dh);
  auto d_h = poisoned(n), d_dg = poisoned(n), d_du = poisoned(n);
  be().swiglu_forward(d_h.data(), d_g.data(), d_u.data(), n);
  be().swiglu_backward(d_dg.data(), d_du.data(), d_dh.data(), d_g.data(), d_u.data(), n);
  std::vector<float> h(n), dg(n), du(n);
  cpu::swiglu_forward<float>(h.data(), g.data(), u.data(), n);
  cpu::swiglu_backward<float>(dg.data(), du.data(), dh.data(), g.data(), u.data(), n);
  check(down(d_h, n), h, kF32, "swiglu_forward");
  check(down(d_dg, n), dg, kF32, "swiglu_backward dg");
  check(down(d_du, n), du, kF32, "swiglu_backward du");
}

TEST_F(CudaKernels, SoftmaxXentWithZLoss) {
  for (int V : {1000, 50257}) {
    const int N = 37;
    SCOPED_TRACE(fmt::format("V={}", V));
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
    auto tgt = randi(N, V);
    const float z = 1e-4f, gs = 1.f / N;
    auto d_t = up(tgt);

    // Forward only, per-row losses poisoned first.
    auto d_logits = up(logits);
    auto d_losses = poisoned(N);
    const XentSums fs = be().softmax_xent_forward(d_logits.data(), d_t.data(), N, V, d_losses.data());
    std::vector<float> losses(N);
    const XentSums fr = cpu::softmax_xent_forward<float>(logits.data(), tgt.data(), N, V, losses.data());
    check(down(d_losses, N), losses, kF32, "softmax_xent_forward losses");
    EXPECT_NEAR(fs.xent, fr.xent, 1e-6 * std::abs(fr.xent));
    EXPECT_NEAR(fs.lse_sq, fr.lse_sq, 1e-6 * std::abs(fr.lse_sq));

    // Fused, in place, synchronous sums.
    const XentSums gsum = be().softmax_xent(d_logits.data(), d_t.data(), N, V, z, gs);
    std::vector<float> ref = logits;
    const XentSums rsum = cpu::softmax_xent<float>(ref.data(), tgt.data(), N, V, z, gs);
    check(down(d_logits, ref.size()), ref, kF32, "softmax_xent grad");
    std::printf("[ rel err  ] %-28s %.3e %.3e\n", "softmax_xent sums", std::abs(gsum.xent - rsum.xent) / rsum.xent,
                std::abs(gsum.lse_sq - rsum.lse_sq) / rsum.lse_sq);
    EXPECT_NEAR(gsum.xent, rsum.xent, 1e-6 * std::abs(rsum.xent));
    EXPECT_NEAR(gsum.lse_sq, rsum.lse_sq, 1e-6 * std::abs(rsum.lse_sq));

    // Asynchronous sums land in device memory and equal the synchronous ones bitwise.
    auto d_logits2 = up(logits);
    DeviceBuffer<double> d_sums(2);
    d_sums.poison();
    be().softmax_xent_async(d_logits2.data(), d_t.data(), N, V, z, gs, d_sums.data());
    be().synchronize();
    auto hs = d_sums.download();
    EXPECT_EQ(hs[0], gsum.xent);
    EXPECT_EQ(hs[1], gsum.lse_sq);
  }
}

TEST_F(CudaKernels, VectorHelpersAndAdamW) {
  const size_t n = 100003;
  auto x = randv(n), y = randv(n);
  auto d_x = up(x), d_y = up(y);
  be().add_inplace(d_y.data(), d_x.data(), n);
  cpu::add_inplace<float>(y.data(), x.data(), n);
  check(down(d_y, n), y, 0.0, "add_inplace");
  be().scale_inplace(d_y.data(), -0.37f, n);
  cpu::scale_inplace<float>(y.data(), -0.37f, n);
  check(down(d_y, n), y, 0.0, "scale_inplace");
  const double ss = be().sum_squares(d_y.data(), n), sr = cpu::sum_squares<float>(y.data(), n);
  EXPECT_NEAR(ss, sr, 1e-12 * sr);
  DeviceBuffer<double> d_out(1);
  d_out.poison();
  be().sum_squares_async(d_y.data(), n, d_out.data());
  be().synchronize();
  EXPECT_EQ(d_out.download()[0], ss);

  auto p = randv(n), g = randv(n), m = randv(n, -0.1f, 0.1f), v = randv(n, 0.f, 0.01f);
  auto d_p = up(p), d_g = up(g), d_m = up(m), d_v = up(v);
  be().adamw_update(d_p.data(), d_g.data(), d_m.data(), d_v.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.19f,
                    0.0975f);
  cpu::adamw_update<float>(p.data(), g.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.19f,
                           0.0975f);
  check(down(d_p, n), p, kF32, "adamw p");
  check(down(d_m, n), m, kF32, "adamw m");
  check(down(d_v, n), v, kF32, "adamw v");
}
// SwiGLU on bf16 gate / up (model.mlp_bf16) against the CPU backend's ops. The arithmetic is the
// fp32 kernels' on exactly widened inputs, but expf and the CPU's exp differ by ulps, so h (rounded
// to bf16) may land on the neighbouring bf16 in a few elements: 1e-2 relative on h widened, kF32 on
// the fp32 gradients. Outputs poisoned first (bf16 0xffff is a NaN: an unwritten element fails).
TEST_F(CudaKernels, SwigluBf16MatchesTheCpu) {
  auto cpu = make_cpu_backend(1);
  const size_t n = 10007;
  auto gf = randv(n, -4.f, 4.f), uf = randv(n), dh = randv(n);
  std::vector<uint16_t> g(n), u(n);
  cpu::f32_to_bf16(g.data(), gf.data(), n);
  cpu::f32_to_bf16(u.data(), uf.data(), n);
  auto d_g = up(g, 1), d_u = up(u);
  auto d_dh = up(dh);
  auto d_h = poisoned<uint16_t>(n);
  auto d_dg = poisoned(n), d_du = poisoned(n);
  be().swiglu_forward_bf16(d_h.data(), d_g.data() + 1, d_u.data(), n);
  be().swiglu_backward_bf16(d_dg.data(), d_du.data(), d_dh.data(), d_g.data() + 1, d_u.data(), n);
  std::vector<uint16_t> h(n);
  std::vector<float> dg(n), du(n), hw(n), ghw(n);
  cpu->swiglu_forward_bf16(h.data(), g.data(), u.data(), n);
  cpu->swiglu_backward_bf16(dg.data(), du.data(), dh.data(), g.data(), u.data(), n);
  const auto gh = down(d_h, n);
  cpu::bf16_to_f32(hw.data(), h.data(), n);
  cpu::bf16_to_f32(ghw.data(), gh.data(), n);
  size_t flips = 0;
  for (size_t i = 0; i < n; ++i) flips += gh[i] != h[i];
  std::printf("[ bf16 flip ] swiglu_forward_bf16: %zu of %zu elements differ from the CPU's\n", flips, n);
  check(ghw, hw, 1e-2, "swiglu_forward_bf16");
  check(down(d_dg, n), dg, kF32, "swiglu_backward_bf16 dg");
  check(down(d_du, n), du, kF32, "swiglu_backward_bf16 du");
}

// swiglu_forward_rows / swiglu_backward_rows (the MoE capacity layout's SwiGLU over its rows in use,
// the count in device memory) in each storage: fp32; bf16 g, u and h (h16); bf16 gradients too
// (h16 + d16). Counts below, at and above `rows` (clamped), 0 and negative (nothing): the first
// min(rows, max(used, 0)) rows are bitwise the device's plain op on those elements, within the plain
// ops' tolerances of the CPU backend's swiglu_*_rows (SwigluForwardBackward, SwigluBf16MatchesTheCpu,
// CudaMoe.Bf16GradientOpsMatchTheirFp32FormsRounded: expf and the CPU's exp differ by ulps), and
// every byte past them keeps its poison. cols 37 aligned: the vector path with scalar tails, at an
// odd element offset the scalar path; cols 64: vectors only.
TEST_F(CudaKernels, SwigluRowsMatchTheCpu) {
  auto cpu = make_cpu_backend(1);
  const int rows = 53;
  auto bytes_of = [](const std::vector<float>& v, bool b16) {  // fp32, or bf16 bits rounded
    std::vector<uint8_t> b(v.size() * (b16 ? 2 : 4));
    if (b16) {
      std::vector<uint16_t> h(v.size());
      cpu::f32_to_bf16(h.data(), v.data(), v.size());
      std::memcpy(b.data(), h.data(), b.size());
    } else {
      std::memcpy(b.data(), v.data(), b.size());
    }
    return b;
  };
  auto widen = [](const std::vector<uint8_t>& b, size_t n, bool b16) {  // the first n elements as fp32
    std::vector<float> v(n);
    if (b16) {
      std::vector<uint16_t> h(n);
      std::memcpy(h.data(), b.data(), n * 2);
      cpu::bf16_to_f32(v.data(), h.data(), n);
    } else {
      std::memcpy(v.data(), b.data(), n * 4);
    }
    return v;
  };
  auto untouched = [](const std::vector<uint8_t>& b, size_t from, const std::string& what) {
    const size_t bad = size_t(std::count_if(b.begin() + long(from), b.end(), [](uint8_t x) { return x != 0xFF; }));
    EXPECT_EQ(bad, 0u) << what << ": bytes past the rows in use written";
  };
  struct Flags {
    bool h16, d16;
  };
  for (const Flags f : {Flags{false, false}, Flags{true, false}, Flags{true, true}})
    for (auto [cols, off] : {std::pair{37, 0}, std::pair{37, 1}, std::pair{64, 0}})
      for (int used : {20, rows, rows + 27, 0, -3}) {
        const std::string what = fmt::format("h16={} d16={} cols={} off={} used={}", f.h16, f.d16, cols, off, used);
        SCOPED_TRACE(what);
        const size_t n = size_t(rows) * cols, m = size_t(std::clamp(used, 0, rows)) * cols;
        const size_t eh = f.h16 ? 2 : 4, ed = f.d16 ? 2 : 4;  // bytes per element: g, u, h; dh, dg, du
        const auto g = bytes_of(randv(n, -4.f, 4.f), f.h16), u = bytes_of(randv(n), f.h16);
        const auto dh = bytes_of(randv(n), f.d16);
        auto d_g = up(g, off * eh), d_u = up(u, off * eh), d_dh = up(dh, off * ed);
        auto d_used = up(std::vector<int32_t>{used});
        const void* G = d_g.data() + off * eh;
        const void* U = d_u.data() + off * eh;
        const void* DH = d_dh.data() + off * ed;
        // The rows ops and, into their own poisoned outputs, the plain ops on the first m elements.
        auto d_h = poisoned<uint8_t>((n + off) * eh), d_hp = poisoned<uint8_t>((n + off) * eh);
        auto d_dg = poisoned<uint8_t>((n + off) * ed), d_du = poisoned<uint8_t>((n + off) * ed);
        auto d_dgp = poisoned<uint8_t>((n + off) * ed), d_dup = poisoned<uint8_t>((n + off) * ed);
        uint8_t *H = d_h.data() + off * eh, *HP = d_hp.data() + off * eh;
        uint8_t *DG = d_dg.data() + off * ed, *DU = d_du.data() + off * ed;
        uint8_t *DGP = d_dgp.data() + off * ed, *DUP = d_dup.data() + off * ed;
        be().swiglu_forward_rows(H, G, U, f.h16, rows, cols, d_used.data());
        be().swiglu_backward_rows(DG, DU, DH, G, U, f.h16, f.d16, rows, cols, d_used.data());
        auto b16 = [](const void* p) { return static_cast<const uint16_t*>(p); };
        auto f32 = [](const void* p) { return static_cast<const float*>(p); };
        if (f.h16) {
          be().swiglu_forward_bf16(reinterpret_cast<uint16_t*>(HP), b16(G), b16(U), m);
          if (f.d16)
            be().swiglu_backward_bf16_grads(reinterpret_cast<uint16_t*>(DGP), reinterpret_cast<uint16_t*>(DUP),
                                            b16(DH), b16(G), b16(U), m);
          else
            be().swiglu_backward_bf16(reinterpret_cast<float*>(DGP), reinterpret_cast<float*>(DUP), f32(DH), b16(G),
                                      b16(U), m);
        } else {
          be().swiglu_forward(reinterpret_cast<float*>(HP), f32(G), f32(U), m);
          be().swiglu_backward(reinterpret_cast<float*>(DGP), reinterpret_cast<float*>(DUP), f32(DH), f32(G),
                               f32(U), m);
        }
        const auto h = down(d_h, n * eh, off * eh), dg = down(d_dg, n * ed, off * ed);
        const auto du = down(d_du, n * ed, off * ed);
        EXPECT_TRUE(h == down(d_hp, n * eh, off * eh)) << what << ": h is not the plain forward's on the rows in use";
        EXPECT_TRUE(dg == down(d_dgp, n * ed, off * ed)) << what << ": dg is not the plain backward's";
        EXPECT_TRUE(du == down(d_dup, n * ed, off * ed)) << what << ": du is not the plain backward's";
        untouched(h, m * eh, what + " h");
        untouched(dg, m * ed, what + " dg");
        untouched(du, m * ed, what + " du");
        // The CPU backend's, count in host memory, outputs poisoned the same way.
        std::vector<uint8_t> ch(n * eh, 0xFF), cdg(n * ed, 0xFF), cdu(n * ed, 0xFF);
        cpu->swiglu_forward_rows(ch.data(), g.data(), u.data(), f.h16, rows, cols, &used);
        cpu->swiglu_backward_rows(cdg.data(), cdu.data(), dh.data(), g.data(), u.data(), f.h16, f.d16, rows, cols,
                                  &used);
        check(widen(h, m, f.h16), widen(ch, m, f.h16), f.h16 ? 1e-2 : kF32, "swiglu_forward_rows " + what);
        const double tol_d = f.d16 ? 1.0 / 256 : kF32;
        check(widen(dg, m, f.d16), widen(cdg, m, f.d16), tol_d, "swiglu_backward_rows dg " + what);
        check(widen(du, m, f.d16), widen(cdu, m, f.d16), tol_d, "swiglu_backward_rows du " + what);
      }
  // bf16 gradients need bf16 gate and up: one ladder::Error line, nothing written.
  const int cols = 8;
  auto d_used = up(std::vector<int32_t>{rows});
  auto d_x = poisoned<float>(size_t(rows) * cols);
  auto d_dg = poisoned<uint16_t>(size_t(rows) * cols);
  EXPECT_THROW(be().swiglu_backward_rows(d_dg.data(), d_dg.data(), d_dg.data(), d_x.data(), d_x.data(), false, true,
                                         rows, cols, d_used.data()),
               Error);
  const auto after = down(d_dg, size_t(rows) * cols);
  EXPECT_TRUE(std::all_of(after.begin(), after.end(), [](uint16_t v) { return v == 0xFFFF; }))
      << "a refused call wrote its output";
}

// bf16 storage of saved activations: the same bits as the CPU's round-to-nearest-even, both ways,
// including ties, values that round up into the next binade, subnormals and infinities.
TEST_F(CudaKernels, Bf16StorageMatchesTheCpuBitForBit) {
  const size_t n = 70001;
  auto x = randv(n, -3.f, 3.f);
  const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x00000001u, 0x807fffffu, 0x7f7fffffu,
                              0x7f800000u, 0xff800000u, 0x80000000u, 0x00000000u, 0x3fffffffu};
  for (size_t i = 0; i < std::size(special); ++i) std::memcpy(&x[i * 7], &special[i], 4);
  auto d_x = up(x, 1);  // odd offset: not 16-byte aligned
  auto d_b = poisoned<uint16_t>(n);
  be().to_bf16(d_b.data(), d_x.data() + 1, n);
  std::vector<uint16_t> b(n);
  cpu::f32_to_bf16(b.data(), x.data(), n);
  const auto gb = down(d_b, n);
  size_t diff = 0;
  for (size_t i = 0; i < n; ++i) diff += gb[i] != b[i];
  EXPECT_EQ(diff, 0u) << "to_bf16 differs from the CPU's rounding";
  auto d_y = poisoned(n);
  be().from_bf16(d_y.data(), d_b.data(), n);
  std::vector<float> y(n);
  cpu::bf16_to_f32(y.data(), b.data(), n);
  const auto gy = down(d_y, n);
  EXPECT_EQ(0, std::memcmp(gy.data(), y.data(), n * sizeof(float))) << "from_bf16";
}

// Small uploads go through pinned staging and return before the copy runs: the host buffer is
// reused at once, and every copy must still land in stream order with the values it had at the
// call. 200 uploads of a counter into one device buffer, each followed by an op reading it (a sum
// into an accumulator); the host overwrites its buffer right after each upload.
TEST_F(CudaKernels, SmallUploadsAreStagedInStreamOrder) {
  const size_t n = 4096;  // like a micro-batch's token ids
  DeviceBuffer<float> d_x(n), d_acc(n);
  be().zero(d_acc.data(), n * sizeof(float));
  std::vector<float> h(n);
  double expect = 0;
  for (int i = 1; i <= 200; ++i) {
    std::fill(h.begin(), h.end(), float(i));
    be().upload(d_x.data(), h.data(), n * sizeof(float));
    std::fill(h.begin(), h.end(), -1e9f);  // reused at once: must not reach the device
    be().add_inplace(d_acc.data(), d_x.data(), n);
    expect += i;
  }
  const auto acc = down(d_acc, n);
  for (size_t j = 0; j < n; j += 997) ASSERT_EQ(acc[j], float(expect)) << j;
  // A large upload (above the staging size) is synchronous as before.
  std::vector<float> big(size_t(1) << 19, 3.f);
  DeviceBuffer<float> d_big(big.size());
  be().upload(d_big.data(), big.data(), big.size() * sizeof(float));
  EXPECT_EQ(down(d_big, big.size()), big);
}

// `ladder bench --profile` on the device: the profiler times each op with events on the backend's
// stream (Backend::make_op_timer), so every op is counted and timed without a host wait per op;
// reset() forgets what came before.
TEST_F(CudaKernels, ProfilerTimesOpsOnTheDeviceClock) {
  auto prof = make_profiling_backend(make_cuda_backend("fp32"));
  const int n = 256;
  DeviceBuffer<float> A(size_t(n) * n), B(size_t(n) * n), C(size_t(n) * n);
  A.upload(randv(A.size()));
  B.upload(randv(B.size()));
  prof->gemm(false, false, n, n, n, 1.f, A.data(), n, B.data(), n, 0.f, C.data(), n);
  prof->reset();
  for (int i = 0; i < 3; ++i) prof->gemm(false, false, n, n, n, 1.f, A.data(), n, B.data(), n, 0.f, C.data(), n);
  prof->add_inplace(C.data(), A.data(), A.size());
  const auto& t = prof->times();
  ASSERT_EQ(t.count("gemm NN"), 1u);
  EXPECT_EQ(t.at("gemm NN").calls, 3);
  EXPECT_GT(t.at("gemm NN").seconds, 0.0);
  EXPECT_DOUBLE_EQ(t.at("gemm NN").flops, 3 * 2.0 * n * n * n);
  ASSERT_EQ(t.size(), 2u) << "the op before reset() is forgotten; one more op kind (add)";
  // Read once more without new ops: nothing is added twice.
  const double s = t.at("gemm NN").seconds;
  EXPECT_EQ(prof->times().at("gemm NN").seconds, s);
}

TEST_F(CudaKernels, OutOfMemoryIsOneLine) {
  try {
    DeviceBuffer<float> huge(size_t(1) << 45, "test tensor");  // 128 TiB
    FAIL() << "expected an out-of-memory error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("out of device memory"), std::string::npos) << msg;
    EXPECT_NE(msg.find("test tensor"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  // The device stays usable afterwards.
  DeviceBuffer<float> small(16);
  small.poison();
  be().synchronize();
}

// ---------------------------------------------------------------------------------------------
// These run with or without a GPU.

TEST(CudaProbe, ClearLineWithoutUsableDevice) {
  const std::string reason = cuda::device_unavailable_reason();
  if (reason.empty()) {
    EXPECT_NO_THROW(make_cuda_backend());
    return;
  }
  std::printf("[ probe    ] %s\n", reason.c_str());
  EXPECT_EQ(reason.rfind("--device cuda: ", 0), 0u) << reason;
  EXPECT_EQ(reason.find('\n'), std::string::npos) << reason;
  try {
    make_cuda_backend();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), reason);
  }
  try {
    check_run_device("cuda");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), reason);
  }
}

TEST(CudaProbe, CudaBuildAcceptsRunDeviceCuda) {
  Config c;
  c.model.vocab_size = 256;
  c.run.device = "cuda";
  EXPECT_NO_THROW(validate(c));
  c.run.device = "tpu";
  EXPECT_THROW(validate(c), Error);
  // With a usable GPU run.device cuda is accepted (the model runs on device memory); without one,
  // CudaProbe.ClearLineWithoutUsableDevice checks the one-line refusal.
  if (cuda::device_unavailable_reason().empty()) EXPECT_NO_THROW(check_run_device("cuda"));
  else EXPECT_THROW(check_run_device("cuda"), Error);
  EXPECT_NO_THROW(check_run_device("cpu"));
}

}  // namespace
}  // namespace ladder
