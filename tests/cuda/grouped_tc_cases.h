// The cases and comparisons of the bf16 tensor-core grouped GEMM (grouped_gemm_tc.cu), shared by the
// GPU test (tests/cuda/test_cuda_grouped_tc.cpp) and the host-emulated one
// (tests/cuda/emu/test_emu_grouped_tc.cpp): the same problems, the same references, the same bounds.
// A test supplies how to run the kernel; everything else is here.
//
// References: cpu::grouped_gemm<float> (the contract) on
//  - the original fp32 inputs, bound kTcInputs = 1e-2 on ||got - ref|| / ||ref|| over the logical
//    output. Why it holds: rounding an operand to bf16 changes it by at most 2^-9 relative (8
//    significant bits, nearest even), so each product a*b moves by at most ~2^-8 relative, with
//    independent signs from term to term; a sum of K such terms then moves by about
//    2^-9 * sqrt(2/3) * ||terms|| (the rounding errors are roughly uniform), i.e. ~1.6e-3 relative to
//    a random-sign sum, and beta*C only dilutes it. 1e-2 leaves 6x for unlucky draws, not for a bug:
//    a dropped or doubled reduction term or a wrong element costs ~1/sqrt(K) >= 5e-2 here.
//  - the same inputs rounded to bf16 first (what the tensor cores multiply), bound kTcRounded =
//    1e-4: products of two bf16 values are exact in fp32, so the only difference left is fp32
//    accumulation order (the CPU's sgemm blocks vs 16-wide MMA chunks in increasing t; on the GPU
//    also the MMA's internal adder), ~sqrt(K) * 2^-24 relative, i.e. ~1e-6 for K <= 600. A kernel that
//    truncated instead of rounding to nearest (bias ~2^-9), or that rounded C or the result to bf16,
//    is off by ~1e-3 and fails.
// Also: beta = 0 runs on a poisoned C (0xFF bytes: NaN) and must not read it; the padding columns of
// C (ld > N) and the elements of C outside the output (strideC > M * ldc) keep their bytes; a second
// run is bitwise identical to the first.
#pragma once
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
#include "backend/cuda/grouped_gemm_tc.cuh"
#include "backend/cuda/grouped_gemm_wgmma.cuh"

namespace ladder::grouped_tc {

// Whether the tests run the wgmma kernels (grouped_gemm_wgmma.cu): where the device runs them
// (grouped_gemm_wgmma_available: sm_90a code on an sm_90 device, or the host emulation), unless
// LADDER_TEST_WGMMA=0. scripts/gpu-check.sh sets that for its main test run and runs the wgmma tests
// in a process of their own, so that a wgmma kernel faulting on a device (which ends the CUDA
// context) cannot take every other test down with it.
inline bool wgmma_tests_on() {
  const char* e = std::getenv("LADDER_TEST_WGMMA");
  return cuda::k::grouped_gemm_wgmma_available() && !(e && std::strcmp(e, "0") == 0);
}

// f() once with each tile product selected: grouped_gemm_tc.cu's mma.sync, then its WMMA, then,
// where wgmma_tests_on(), grouped_gemm_wgmma.cu's wgmma; in a SCOPED_TRACE that names it. The
// previous selections are restored.
template <class F>
void for_each_tile_product(F&& f) {
  const bool prev = cuda::k::grouped_gemm_tc_mma(), prev_wg = cuda::k::grouped_gemm_tc_wgmma();
  for (const char* impl : {"mma.sync", "wmma", "wgmma"}) {
    const bool wgmma = impl[1] == 'g';
    if (wgmma && !wgmma_tests_on()) continue;
    SCOPED_TRACE(impl);
    cuda::k::grouped_gemm_tc_set_mma(impl[0] == 'm');
    cuda::k::grouped_gemm_tc_set_wgmma(wgmma);
    f();
  }
  cuda::k::grouped_gemm_tc_set_mma(prev);
  cuda::k::grouped_gemm_tc_set_wgmma(prev_wg);
}

// f() with the wgmma implementation selected (grouped_gemm_tc_set_wgmma(true); the previous
// selection restored), in a SCOPED_TRACE.
template <class F>
void with_wgmma(F&& f) {
  const bool prev = cuda::k::grouped_gemm_tc_wgmma();
  SCOPED_TRACE("wgmma");
  cuda::k::grouped_gemm_tc_set_wgmma(true);
  f();
  cuda::k::grouped_gemm_tc_set_wgmma(prev);
}

constexpr double kTcInputs = 1e-2;
constexpr double kTcRounded = 1e-4;

// Round to the nearest bf16 (ties to even), kept in a float (finite values).
inline float bf16_round(float x) { return cpu::bf16_value(cpu::bf16_bits(x)); }

struct Case {
  bool rows_out, transB;
  int E, M, N, K;  // rows_out: N x K per expert (M unused); else M x N per expert (K unused)
  int pad;         // extra floats per row of every operand (odd: no 16-byte vector loads)
  float alpha, beta;
  int max_rows;    // rows per expert drawn from [0, max_rows]; see offsets()
  int shift = 0;   // every operand starts `shift` floats into its buffer (1..3: misaligned)
  bool skewed = false;  // one expert holds almost every row, most others are empty

  std::string name() const {
    char b[200];
    std::snprintf(b, sizeof b, "rows_out=%d tB=%d E=%d M=%d N=%d K=%d pad=%d a=%g b=%g rows<=%d shift=%d%s",
                  int(rows_out), int(transB), E, M, N, K, pad, double(alpha), double(beta), max_rows, shift,
                  skewed ? " skewed" : "");
    return b;
  }
};

// About a quarter of the experts empty (expert 1 always), expert 2 crowded (several row tiles of
// 128 and a partial one when max_rows >= 40); skewed: expert E/2 gets 10x max_rows + 3 rows, the
// others 0 or 1 row.
inline std::vector<int32_t> offsets(std::mt19937_64& rng, const Case& c) {
  std::vector<int32_t> off(c.E + 1, 0);
  std::uniform_int_distribution<int> rows(0, c.max_rows), coin(0, 3);
  for (int e = 0; e < c.E; ++e) {
    int r;
    if (c.skewed) {
      r = e == c.E / 2 ? 10 * c.max_rows + 3 : coin(rng) == 0;
    } else {
      r = coin(rng) == 0 ? 0 : rows(rng);
      if (e == 1) r = 0;
      if (e == 2) r = c.max_rows * 3 + 7;
    }
    off[e + 1] = off[e] + r;
  }
  return off;
}

struct Problem {
  std::vector<int32_t> off;
  std::vector<float> A, B, C;  // C: the initial values (beta != 0)
  int lda = 0, ldb = 0, ldc = 0;
  size_t sB = 0, sC = 0;
  int shift = 0;  // A, B and C start at .data() + shift
};

// C's buffer goes on past its last output element by a full tile of rows (plus a tile's width),
// checked untouched: a kernel writing past the valid rows of its last tile is caught even where
// another block would overwrite the same elements correctly afterwards (the emulation runs blocks
// in order).
inline size_t guard(int ldc) { return size_t(128) * ldc + 128; }

inline Problem make_problem(const Case& c, std::mt19937_64& rng) {
  Problem p;
  p.off = offsets(rng, c);
  p.shift = c.shift;
  const int total = p.off[c.E];
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  auto randv = [&](size_t n) {
    std::vector<float> v(n + size_t(c.shift));
    for (auto& x : v) x = d(rng);
    return v;
  };
  if (c.rows_out) {
    p.lda = std::max(1, c.K + c.pad);
    p.ldb = std::max(1, (c.transB ? c.K : c.N) + c.pad);
    p.ldc = c.N + c.pad;
    // Padded: an expert stride off by 3 elements (no vector loads of B), except where ld keeps 8
    // elements' alignment: then off by 8, so that a bf16 B is staged by cp.async.
    p.sB = size_t(c.transB ? c.N : c.K) * p.ldb + (c.pad ? (p.ldb % 8 == 0 ? 8 : 3) : 0);
    p.A = randv(size_t(total) * p.lda);
    p.B = randv(p.sB * c.E);
    p.C = randv(size_t(total) * p.ldc + guard(p.ldc));
  } else {
    p.lda = c.M + c.pad;
    p.ldb = c.N + c.pad;
    p.ldc = c.N + c.pad;
    p.sC = size_t(c.M) * p.ldc + (c.pad ? 2 : 0);
    p.A = randv(size_t(total) * p.lda);
    p.B = randv(size_t(total) * p.ldb);
    p.C = randv(p.sC * c.E + guard(p.ldc));
  }
  return p;
}

// cpu::grouped_gemm<float> on the problem's inputs (bf16-rounded first when `rounded`), from C0.
inline std::vector<float> reference(const Case& c, const Problem& p, const std::vector<float>& C0, bool rounded) {
  std::vector<float> A = p.A, B = p.B, C = C0;
  if (rounded) {
    for (auto& x : A) x = bf16_round(x);
    for (auto& x : B) x = bf16_round(x);
  }
  const int s = p.shift;
  cpu::grouped_gemm<float>(c.rows_out, c.transB, c.E, p.off.data(), c.M, c.N, c.K, c.alpha, A.data() + s, p.lda,
                           B.data() + s, p.ldb, p.sB, c.beta, C.data() + s, p.ldc, p.sC);
  return C;
}

inline double rel_err(const std::vector<float>& got, const std::vector<float>& ref, double tol,
                      const std::string& what) {
  size_t bad = 0;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) {
      if (bad++ < 3) ADD_FAILURE() << what << ": element " << i << " is " << got[i] << " (ref " << ref[i] << ")";
      continue;
    }
    const double d = double(got[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " elements not written or not finite";
  const double rel = std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
  std::printf("[ rel err  ] %-100s %.3e (tol %.0e)\n", what.c_str(), rel, tol);
  EXPECT_LE(rel, tol) << what;
  return rel;
}

// Runs case `c` twice through `run(problem, C)` (C: the whole C buffer including the shift, poisoned
// when beta == 0; the kernel's result replaces it) and checks as described at the top.
template <class Run>
void run_case(const Case& c, std::mt19937_64& rng, Run&& run) {
  const std::string what = c.name();
  SCOPED_TRACE(what);
  const Problem p = make_problem(c, rng);
  const int total = p.off[c.E];
  std::vector<float> C0 = p.C;
  if (c.beta == 0.f) std::memset(C0.data(), 0xFF, C0.size() * sizeof(float));
  // Logical output elements vs everything else in C.
  std::vector<char> is_out(C0.size(), 0);
  const int blocks = c.rows_out ? 1 : c.E, rows = c.rows_out ? total : c.M;
  for (int e = 0; e < blocks; ++e)
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < c.N; ++j) is_out[size_t(p.shift) + size_t(e) * p.sC + size_t(i) * p.ldc + j] = 1;
  // The references start from the unpoisoned C (beta 0 makes it irrelevant to the output).
  const std::vector<float> ref_in = reference(c, p, p.C, false), ref_bf = reference(c, p, p.C, true);
  std::vector<float> first;
  for (int rep = 0; rep < 2; ++rep) {
    std::vector<float> C = C0;
    run(p, C);
    if (::testing::Test::HasFatalFailure()) return;
    std::vector<float> g, ri, rb;
    size_t outside = 0;
    for (size_t i = 0; i < C.size(); ++i) {
      if (is_out[i]) {
        g.push_back(C[i]);
        ri.push_back(ref_in[i]);
        rb.push_back(ref_bf[i]);
      } else if (std::memcmp(&C[i], &C0[i], sizeof(float)) != 0) {
        ++outside;
      }
    }
    EXPECT_EQ(outside, 0u) << "elements outside the output were written";
    if (rep == 0) {
      if (!g.empty()) {
        rel_err(g, ri, kTcInputs, what + " vs fp32 inputs");
        rel_err(g, rb, kTcRounded, what + " vs bf16 inputs");
      }
      first = C;
    } else {
      EXPECT_EQ(std::memcmp(first.data(), C.data(), C.size() * sizeof(float)), 0)
          << "not bitwise reproducible run to run";
    }
  }
}

// The cases both tests run (sizes kept small for the emulation; `quick` drops the costlier ones).
inline std::vector<Case> cases(bool quick) {
  std::vector<Case> v = {
      // rows_out = true (forward / data gradient): both transB, beta 0 on poisoned C, beta != 0,
      // odd N and K (not multiples of 4, 16 or 32), N over one tile, aligned and misaligned.
      {true, true, 8, 0, 75, 37, 3, 1.f, 0.f, 50},  // ld 40: float4 loads, a partial group at K
      {true, false, 8, 0, 75, 37, 3, 0.7f, 0.f, 50, 1},
      {true, true, 6, 0, 136, 67, 1, -1.3f, 0.5f, 40, 3},
      {true, false, 5, 0, 33, 129, 0, 1.f, 1.f, 45},
      {true, true, 4, 0, 128, 64, 0, 1.f, 0.f, 64},
      {true, false, 4, 0, 130, 96, 6, 0.25f, -0.75f, 20, 0, true},  // B: float4, partial group at N
      {true, false, 5, 0, 77, 45, 3, 0.5f, 0.5f, 60},  // ld 48, 80: bf16 A and B by cp.async, edge chunks
      {true, true, 4, 0, 70, 39, 1, 1.f, 0.f, 50},     // ld 40: both by cp.async, 7 of 8 valid at K
      {true, true, 3, 0, 5, 1, 0, 1.f, 0.5f, 10},
      {true, true, 8, 0, 5, 0, 0, 1.f, 0.5f, 10},  // K = 0: C = beta C
      {true, false, 8, 0, 7, 0, 0, 2.f, 0.f, 10},  // K = 0, beta 0: zeros
      // rows_out = false (weight gradient): beta 0 poisoned, 1 (accumulate) and other; empty experts
      // still get C_e = beta C_e.
      {false, false, 6, 70, 45, 0, 0, 1.f, 0.f, 50},
      {false, true, 6, 70, 45, 0, 5, 0.7f, 1.f, 50, 2},  // transB is unused by this shape
      {false, false, 5, 33, 130, 0, 1, -1.3f, 0.5f, 20, 1},
      {false, false, 4, 64, 64, 0, 0, 1.f, 1.f, 64},
      {false, false, 3, 66, 70, 0, 2, 1.f, 0.f, 70},  // ld 68, 72: float4, partial groups at M, N
      {false, false, 4, 129, 17, 0, 0, 0.5f, 0.f, 30, 0, true},
      {false, false, 3, 1, 3, 0, 3, 1.f, -2.f, 9},
      {false, false, 3, 70, 78, 0, 2, 1.f, 0.f, 70},  // ld 72, 80: bf16 A and B by cp.async, edge chunks
  };
  if (!quick) {
    v.push_back({true, false, 4, 0, 260, 300, 0, 1.f, 0.f, 60});
    v.push_back({true, true, 2, 0, 200, 513, 2, 0.5f, 0.25f, 50, 1});
    v.push_back({false, false, 2, 200, 260, 0, 0, 1.f, 0.5f, 100});
  }
  return v;
}

// A case's operands as the tensor-core kernels stage by cp.async: their bf16 rounding (so the
// references above hold unchanged), each row block repacked with ld rounded up to a multiple of 8
// elements and B's expert stride too, from the start of a fresh (16-byte aligned) buffer. (The
// cases' own operands are fp32, mostly misaligned: the register path.)
struct Bf16Operands {
  std::vector<uint16_t> A, B;
  int lda = 0, ldb = 0;
  size_t sB = 0;
};
inline Bf16Operands wgmma_operands(const Case& c, const Problem& p) {
  auto pack = [](const float* src, int blocks, int rows, int ld, size_t stride, int& ld8, size_t& stride8) {
    ld8 = (ld + 7) / 8 * 8;
    stride8 = (size_t(rows) * ld8 + 7) / 8 * 8;
    std::vector<uint16_t> v(stride8 * size_t(std::max(blocks, 1)) + 8, 0);
    for (int e = 0; e < blocks; ++e)
      for (int r = 0; r < rows; ++r)
        for (int j = 0; j < ld; ++j) v[e * stride8 + size_t(r) * ld8 + j] = cpu::bf16_bits(src[e * stride + size_t(r) * ld + j]);
    return v;
  };
  const int s = p.shift, total = p.off[c.E];
  Bf16Operands o;
  size_t unused = 0;
  o.A = pack(p.A.data() + s, 1, total, p.lda, 0, o.lda, unused);
  if (c.rows_out) o.B = pack(p.B.data() + s, c.E, c.transB ? c.N : c.K, p.ldb, p.sB, o.ldb, o.sB);
  else o.B = pack(p.B.data() + s, 1, total, p.ldb, 0, o.ldb, unused);
  return o;
}

// A bf16-output run (c_bf16) against the fp32-output run `ref` of the same case (beta 0): every
// output element must be the round-to-nearest-even of ref's, every other element keep its 0xFFFF
// poison. Adds gtest failures; returns whether the case had any output element.
inline bool check_bf16_output(const Case& c, const Problem& p, const std::vector<uint16_t>& got,
                              const std::vector<float>& ref) {
  const int s = p.shift, total = p.off[c.E];
  std::vector<char> is_out(got.size(), 0);
  const int blocks = c.rows_out ? 1 : c.E, rows = c.rows_out ? total : c.M;
  for (int e = 0; e < blocks; ++e)
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < c.N; ++j) is_out[size_t(s) + size_t(e) * p.sC + size_t(r) * p.ldc + j] = 1;
  size_t bad = 0, outside = 0, outs = 0;
  for (size_t x = 0; x < got.size(); ++x) {
    if (!is_out[x]) {
      outside += got[x] != 0xFFFF;
      continue;
    }
    ++outs;
    const uint16_t want = cpu::bf16_bits(ref[x]);
    if (got[x] != want && bad++ < 3)
      ADD_FAILURE() << "element " << x << ": bf16 bits 0x" << std::hex << got[x] << ", the fp32 run's " << ref[x]
                    << " rounds to 0x" << want << std::dec;
  }
  EXPECT_EQ(bad, 0u) << "bf16 output elements differ from the rounded fp32 output";
  EXPECT_EQ(outside, 0u) << "elements outside the output were written";
  return outs > 0;
}

}  // namespace ladder::grouped_tc
