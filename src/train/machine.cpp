#include "train/machine.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/openblas_cores.h"
#include "core/fileio.h"
#include <fmt/format.h>

namespace ladder {

std::string host_name() {
  char h[256] = {0};
  ::gethostname(h, sizeof(h) - 1);
  return h;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const auto a = line.find_first_not_of(" \t", colon + 1);
    const auto b = line.find_last_not_of(" \t\r");
    return a == std::string::npos ? std::string() : line.substr(a, b - a + 1);
  }
  return "";
}

std::string machine_label(const std::string& host, const std::string& cpu, int threads) {
  if (cpu.empty()) return host;
  return threads > 0 ? fmt::format("{} ({}, {} threads)", host, cpu, threads) : fmt::format("{} ({})", host, cpu);
}

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

std::filesystem::path sgemm_cache_file() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  std::filesystem::path base = xdg && *xdg ? xdg : (home ? std::filesystem::path(home) / ".cache" : "/tmp");
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  // The rate depends on the kernels OpenBLAS runs (backend/cpu/openblas_cores.h), so they are part of
  // the key: a rate measured with other kernels is not this process's.
  // v3: the rate is the best of three shapes (below); a v2 file held the better of the first two, a
  // v1 file the training shape's alone.
  return base / "ladder" / fmt::format("sgemm-v3-{}-t{}-{}.json", host, cpu_threads(), openblas_core());
}

namespace {
// Median GFLOP/s of `reps` sgemms of [M x K] x [K x N] after `warm` untimed ones.
double sgemm_median(int M, int N, int K, int warm, int reps) {
  std::vector<float> A(size_t(M) * K, 0.5f), B(size_t(K) * N, 0.25f), C(size_t(M) * N);
  std::vector<double> rates;
  for (int rep = 0; rep < warm + reps; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.f, A.data(), K, B.data(), N, 0.f, C.data(), N);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep >= warm) rates.push_back(2.0 * M * N * K / s / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

// The cached rate, or 0 when there is none (or it does not parse).
double cached_rate(const std::filesystem::path& f) {
  if (!std::filesystem::exists(f)) return 0;
  try {
    const double g = nlohmann::json::parse(read_file(f)).at("sgemm_gflops").get<double>();
    return g > 0 ? g : 0;
  } catch (...) {
    return 0;
  }
}
}  // namespace

double sgemm_gflops(bool use_cache) {
  auto f = sgemm_cache_file();
  const double cached = cached_rate(f);
  if (use_cache && cached > 0) return cached;
  // Three shapes, and the best median is the peak: a training GEMM at dense-small scale,
  // [4096 x 512] x [512 x 2048]; a square one with a long K, 2048^3; and a narrow one with a long
  // K, [4096 x 8192] x [8192 x 128], the shape of a small model's LM-head input gradient (and, K
  // being the tokens, of its weight gradients). OpenBLAS runs a long K faster (on this project's
  // 2-core VM: 190-260 against 165-180 GFLOP/s for 2048^3; 205-218 for the narrow one against
  // 144-194 for 2048^3 in the same minutes), so a model's own GEMMs beat the first shape alone
  // (MFU 120% at d_model 4096) and the first two (102% at d_model 96, where the LM head is 80% of
  // the FLOPs): a denominator the model's own GEMMs can exceed is not a peak. 5-7 s on 2 cores.
  const double train_shape = sgemm_median(4096, 2048, 512, 5, 40);
  const double long_k = sgemm_median(2048, 2048, 2048, 3, 20);
  const double narrow = sgemm_median(4096, 128, 8192, 3, 20);
  const double g = std::max({train_shape, long_k, narrow});
  // The cache keeps the best rate any measurement saw: a VM measured while busy reads low, and a
  // low denominator would inflate every later run's MFU; no measurement can exceed what the
  // machine does. (This call still returns its own measurement: `ladder bench` reports the rate
  // measured in the same run.)
  if (cached < g) {
    try {
      std::filesystem::create_directories(f.parent_path());
      write_file_atomic(f, nlohmann::json{{"sgemm_gflops", g},
                                          {"threads", cpu_threads()},
                                          {"train_shape_4096x2048x512", train_shape},
                                          {"long_k_2048x2048x2048", long_k},
                                          {"narrow_long_k_4096x128x8192", narrow}}
                               .dump());
    } catch (...) {
    }
  }
  return g;
}

double backend_gemm_gflops(Backend& be) {
  const int M = 16384, N = 4096, K = 1024;
  std::vector<float> host(size_t(M) * K);
  for (size_t i = 0; i < host.size(); ++i) host[i] = float(int(i % 1999) - 999) * 1e-3f;  // never time on zeros
  auto* A = static_cast<float*>(be.mem_alloc(sizeof(float) * size_t(M) * K, "GEMM benchmark A"));
  auto* B = static_cast<float*>(be.mem_alloc(sizeof(float) * size_t(K) * N, "GEMM benchmark B"));
  auto* C = static_cast<float*>(be.mem_alloc(sizeof(float) * size_t(M) * N, "GEMM benchmark C"));
  be.upload(A, host.data(), sizeof(float) * size_t(M) * K);
  be.upload(B, host.data(), sizeof(float) * size_t(K) * N);
  std::vector<double> rates;
  for (int rep = 0; rep < 13; ++rep) {
    be.synchronize();
    auto t0 = std::chrono::steady_clock::now();
    be.gemm(false, false, M, N, K, 1.f, A, K, B, N, 0.f, C, N);
    be.synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep >= 3) rates.push_back(2.0 * M * N * K / s / 1e9);  // the first calls pick plans, warm clocks
  }
  be.mem_free(A);
  be.mem_free(B);
  be.mem_free(C);
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

}  // namespace ladder
