// The problems of the fp32 device-side grouped GEMM tests (moe_ops.cu), shared by the GPU test
// (tests/cuda/test_cuda_moe.cpp, CudaMoe.GroupedGemmBothShapes) and the host-emulated one
// (tests/cuda/emu/test_emu_moe_tc.cpp, CudaEmu.MoeGroupedGemmBothShapes): the case description, the
// random expert offsets and operands (drawn from the test's seeded generator, in the order the tests
// always drew them), the CPU reference (cpu::grouped_gemm<float>), the C the kernel starts from
// (poisoned when beta is 0), and the split of a result into its logical output and every other
// element of C (padding columns, expert-stride gaps), which must keep its initial bytes. Each test
// keeps its own cases, how it runs the kernel and its tolerance. Header-only, no CUDA includes: both builds compile it.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/kernels.h"

namespace ladder::grouped_gemm_test {

struct GroupedCase {
  bool rows_out, transB;
  int E, M, N, K;  // rows_out: N x K per expert (M unused); else M x N per expert (K unused)
  int pad;         // extra floats per row of every operand
  float alpha, beta;
  int max_rows;    // rows per expert drawn from [0, max_rows]; expert 1 empty, expert 2 crowded

  std::string name() const {
    char b[200];
    std::snprintf(b, sizeof b, "grouped_gemm rows_out=%d tB=%d E=%d M=%d N=%d K=%d a=%g b=%g", int(rows_out),
                  int(transB), E, M, N, K, double(alpha), double(beta));
    return b;
  }
};

inline std::vector<int32_t> random_offsets(std::mt19937_64& rng, int E, int max_rows) {
  std::vector<int32_t> off(E + 1, 0);
  std::uniform_int_distribution<int> rows(0, max_rows), coin(0, 3);
  for (int e = 0; e < E; ++e) {
    int r = coin(rng) == 0 ? 0 : rows(rng);  // about a quarter empty
    if (e == 1) r = 0;                       // at least one empty expert
    if (e == 2) r = max_rows * 3 + 7;        // one crowded expert (several row tiles, a partial one)
    off[e + 1] = off[e] + r;
  }
  return off;
}

struct GroupedProblem {
  std::vector<int32_t> off;
  int total = 0;               // off[E]: rows over all experts
  std::vector<float> A, B, C;  // C: the initial values (read when beta != 0)
  int lda = 0, ldb = 0, ldc = 0;
  size_t sB = 0, sC = 0;
};

// Offsets, then A, B and C uniform in [-1, 1) (the fixtures' randv), every row `pad` floats longer
// than it needs and the per-expert strides a few floats longer still.
inline GroupedProblem make_problem(const GroupedCase& c, std::mt19937_64& rng) {
  GroupedProblem p;
  p.off = random_offsets(rng, c.E, c.max_rows);
  p.total = p.off[c.E];
  auto randv = [&](size_t n) {
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
  };
  p.ldc = c.N + c.pad;
  if (c.rows_out) {
    p.lda = std::max(1, c.K + c.pad);
    p.ldb = std::max(1, (c.transB ? c.K : c.N) + c.pad);
    p.sB = size_t(c.transB ? c.N : c.K) * p.ldb + 3;
    p.A = randv(size_t(p.total) * p.lda);
    p.B = randv(p.sB * c.E);
    p.C = randv(size_t(p.total) * p.ldc);
  } else {
    p.lda = c.M + c.pad;
    p.ldb = c.N + c.pad;
    p.sC = size_t(c.M) * p.ldc + 2;
    p.A = randv(size_t(p.total) * p.lda);
    p.B = randv(size_t(p.total) * p.ldb);
    p.C = randv(p.sC * c.E);
  }
  return p;
}

// cpu::grouped_gemm<float> on the problem, from its C.
inline std::vector<float> reference(const GroupedCase& c, const GroupedProblem& p) {
  std::vector<float> ref = p.C;
  cpu::grouped_gemm<float>(c.rows_out, c.transB, c.E, p.off.data(), c.M, c.N, c.K, c.alpha, p.A.data(), p.lda,
                           p.B.data(), p.ldb, p.sB, c.beta, ref.data(), p.ldc, p.sC);
  return ref;
}

// The C buffer the kernel must start from: the problem's C, or, with beta 0 (C must not be read),
// every byte 0xFF (a NaN), as the fixtures' poisoned() / DeviceBuffer::poison() leave it.
inline std::vector<float> initial_C(const GroupedCase& c, const GroupedProblem& p) {
  std::vector<float> C0 = p.C;
  if (c.beta == 0.f && !C0.empty()) std::memset(C0.data(), 0xFF, C0.size() * sizeof(float));
  return C0;
}

// The logical output of `got` and `ref`, and how many elements of `got` outside it differ bytewise
// from initial_C (whatever beta is): the padding columns (ldc > N) and, in the weight-gradient
// shape, the gap between one expert's block and the next (sC > M * ldc) must keep their bytes.
struct GroupedOutput {
  std::vector<float> got, ref;
  size_t pad_changed = 0;
};

inline GroupedOutput logical_output(const GroupedCase& c, const GroupedProblem& p, const std::vector<float>& got,
                                    const std::vector<float>& ref) {
  GroupedOutput o;
  const std::vector<float> C0 = initial_C(c, p);
  if (got.size() != C0.size() || ref.size() != C0.size()) {  // a caller's slip: count it as a failure
    o.pad_changed = size_t(-1);
    return o;
  }
  std::vector<char> is_out(C0.size(), 0);
  const int blocks = c.rows_out ? 1 : c.E, rows = c.rows_out ? p.total : c.M;
  for (int e = 0; e < blocks; ++e)
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < c.N; ++j) is_out[size_t(e) * p.sC + size_t(i) * p.ldc + j] = 1;
  for (size_t at = 0; at < C0.size(); ++at) {
    if (is_out[at]) {
      o.got.push_back(got[at]);
      o.ref.push_back(ref[at]);
    } else if (std::memcmp(&got[at], &C0[at], sizeof(float)) != 0) {
      ++o.pad_changed;
    }
  }
  return o;
}

}  // namespace ladder::grouped_gemm_test
