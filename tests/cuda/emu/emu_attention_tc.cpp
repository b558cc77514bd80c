// Runs the kernels of src/backend/cuda/attention_tc.cu on the host through emu_cuda.h (built by
// tests/cuda/emu/run.sh, which rewrites the launch syntax into attention_tc_emu.inc) and compares
// them with a naive double-precision attention, on the original inputs (tolerance 1e-2) and on
// the bf16-rounded inputs (5e-3), as tests/cuda/test_cuda_attention_tc.cpp does on the GPU.
//   emu_attention_tc [quick]     quick: a few small shapes (for the sanitizer builds)
#include "emu_cuda.h"
// The kernels, with `kernel<<<g, b, smem, st>>>(args)` rewritten as EMU_LAUNCH(g, b, smem, st, kernel, args).
#include "attention_tc_emu.inc"

#include <algorithm>
#include <random>
#include <string>

using ladder::cpu::AttnShape;

namespace {

float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

struct Out {
  std::vector<double> o, lse, dq, dk, dv;
};

Out reference(const AttnShape& s, const std::vector<float>& q, const std::vector<float>& k,
              const std::vector<float>& v, const std::vector<float>& dout) {
  const int B = s.B, S = s.S, H = s.H, KV = s.KV, hd = s.hd, W = s.window, G = H / KV;
  Out r;
  r.o.assign(q.size(), 0);
  r.dq.assign(q.size(), 0);
  r.dk.assign(k.size(), 0);
  r.dv.assign(k.size(), 0);
  r.lse.assign(size_t(B) * H * S, 0);
  auto Q = [&](int b, int i, int h) { return size_t((size_t(b) * S + i) * H + h) * hd; };
  auto K = [&](int b, int j, int g) { return size_t((size_t(b) * S + j) * KV + g) * hd; };
  std::vector<double> p(S), dp(S);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int g = h / G;
      for (int i = 0; i < S; ++i) {
        const int lo = W > 0 ? std::max(0, i - W + 1) : 0;
        double m = -1e300;
        for (int j = lo; j <= i; ++j) {
          double d = 0;
          for (int x = 0; x < hd; ++x) d += double(q[Q(b, i, h) + x]) * k[K(b, j, g) + x];
          p[j] = s.scale * d;
          m = std::max(m, p[j]);
        }
        double l = 0;
        for (int j = lo; j <= i; ++j) l += (p[j] = std::exp(p[j] - m));
        for (int j = lo; j <= i; ++j) p[j] /= l;
        r.lse[(size_t(b) * H + h) * S + i] = m + std::log(l);
        for (int x = 0; x < hd; ++x) {
          double a = 0;
          for (int j = lo; j <= i; ++j) a += p[j] * v[K(b, j, g) + x];
          r.o[Q(b, i, h) + x] = a;
        }
        double D = 0;
        for (int x = 0; x < hd; ++x) D += double(dout[Q(b, i, h) + x]) * r.o[Q(b, i, h) + x];
        for (int j = lo; j <= i; ++j) {
          double d = 0;
          for (int x = 0; x < hd; ++x) d += double(dout[Q(b, i, h) + x]) * v[K(b, j, g) + x];
          const double ds = p[j] * (d - D);
          for (int x = 0; x < hd; ++x) {
            r.dq[Q(b, i, h) + x] += s.scale * ds * k[K(b, j, g) + x];
            r.dk[K(b, j, g) + x] += s.scale * ds * q[Q(b, i, h) + x];
            r.dv[K(b, j, g) + x] += p[j] * dout[Q(b, i, h) + x];
          }
        }
      }
    }
  return r;
}

int failures = 0;
double worst_inputs = 0, worst_rounded = 0;

double check(const std::vector<float>& got, const std::vector<double>& ref, double tol, const std::string& what,
             double floor = 0) {
  double num = 0, den = 0;
  size_t bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++bad;
      continue;
    }
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  const double rel = std::sqrt(num) / std::max({std::sqrt(den), floor, 1e-30});
  const bool ok = bad == 0 && rel <= tol;
  if (!ok) ++failures;
  std::printf("[ rel err  ] %-60s %.3e (tol %.0e)%s%s\n", what.c_str(), rel, tol,
              bad ? (" NONFINITE x" + std::to_string(bad)).c_str() : "", ok ? "" : "  <-- FAIL");
  return rel;
}

double norm(const std::vector<double>& x) {
  double a = 0;
  for (double e : x) a += e * e;
  return std::sqrt(a);
}

void run(int B, int S, int H, int KV, int hd, int W, float qk, std::mt19937_64& rng, size_t off = 0) {
  const AttnShape s{B, S, H, KV, hd, W, 1.0 / std::sqrt(double(hd))};
  const std::string shape = "B=" + std::to_string(B) + " S=" + std::to_string(S) + " H=" + std::to_string(H) +
                            " KV=" + std::to_string(KV) + " hd=" + std::to_string(hd) + " W=" + std::to_string(W) +
                            (qk != 2.f ? " qk=6" : "") + (off ? " unaligned" : "");
  if (!ladder::cuda::k::attention_tc_supported(s)) {
    std::printf("unsupported %s\n", shape.c_str());
    ++failures;
    return;
  }
  const size_t nq = size_t(B) * S * H * hd, nk = size_t(B) * S * KV * hd, nl = size_t(B) * H * S;
  auto rnd = [&](size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> x(n + off, 0.f);
    for (size_t i = off; i < n + off; ++i) x[i] = d(rng);
    return x;
  };
  auto q = rnd(nq, -qk, qk), k = rnd(nk, -qk, qk), v = rnd(nk, -1, 1), dout = rnd(nq, -1, 1);
  const float nan = std::nanf("");
  std::vector<float> o(nq, nan), lse(nl, nan), dq(nq, nan), dk(nk, nan), dv(nk, nan), scratch(nl, nan);
  if (ladder::cuda::k::attention_tc_forward(o.data(), lse.data(), q.data() + off, k.data() + off, v.data() + off, s,
                                            nullptr) != cudaSuccess ||
      ladder::cuda::k::attention_tc_backward(dq.data(), dk.data(), dv.data(), dout.data() + off, q.data() + off,
                                             k.data() + off, v.data() + off, o.data(), lse.data(), s,
                                             scratch.data(), nullptr) != cudaSuccess) {
    std::printf("launch refused %s\n", shape.c_str());
    ++failures;
    return;
  }
  auto unpad = [&](const std::vector<float>& x) { return std::vector<float>(x.begin() + off, x.end()); };
  auto rounded = [&](std::vector<float> x) {
    for (auto& e : x) e = bf16r(e);
    return x;
  };
  const Out rb = reference(s, rounded(unpad(q)), rounded(unpad(k)), rounded(unpad(v)), rounded(unpad(dout)));
  const double fb = S == 1 ? norm(rb.dv) : 0, fls = std::sqrt(double(nl));  // as in the GPU test
  for (auto [g, r, n, fl] : {std::tuple{&o, &rb.o, "o", 0.0}, {&lse, &rb.lse, "lse", fls}, {&dq, &rb.dq, "dq", fb},
                             {&dk, &rb.dk, "dk", fb}, {&dv, &rb.dv, "dv", 0.0}})
    worst_rounded = std::max(worst_rounded, check(*g, *r, 5e-3, std::string(n) + " bf16-ref " + shape, fl));
  if (qk == 2.f) {
    const Out rf = reference(s, unpad(q), unpad(k), unpad(v), unpad(dout));
    const double ff = S == 1 ? norm(rf.dv) : 0;
    for (auto [g, r, n, fl] : {std::tuple{&o, &rf.o, "o", 0.0}, {&lse, &rf.lse, "lse", fls},
                               {&dq, &rf.dq, "dq", ff}, {&dk, &rf.dk, "dk", ff}, {&dv, &rf.dv, "dv", 0.0}})
      worst_inputs = std::max(worst_inputs, check(*g, *r, 1e-2, std::string(n) + " " + shape, fl));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "quick";
  const uint64_t seed = std::random_device{}();
  std::printf("[ seed     ] %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  if (quick) {
    run(1, 17, 2, 1, 64, 5, 2.f, rng);
    run(1, 80, 2, 2, 128, 0, 2.f, rng);
    run(1, 70, 4, 1, 64, 64, 2.f, rng, 1);
    run(1, 130, 4, 1, 128, 64, 2.f, rng);
  } else {
    for (int hd : {64, 128})
      for (int S : {1, 17, 128, 300})
        for (int gqa = 0; gqa < 2; ++gqa)
          for (int W : {0, 5, 64}) run(2, S, gqa ? 8 : 2, 2, hd, W, 2.f, rng);
    for (int hd : {64, 128}) {
      run(2, 300, 8, 2, hd, 0, 6.f, rng);
      run(1, 300, 4, 4, hd, 100, 6.f, rng);
    }
    run(2, 77, 8, 2, 64, 0, 2.f, rng, 1);
    run(1, 130, 4, 1, 128, 17, 2.f, rng, 3);
  }
  std::printf("worst rel err: %.3e vs fp32 inputs (tol 1e-2), %.3e vs bf16-rounded inputs (tol 5e-3)\n",
              worst_inputs, worst_rounded);
  std::printf("%s: %d failing comparisons\n", failures ? "FAIL" : "PASS", failures);
  return failures ? 1 : 0;
}
