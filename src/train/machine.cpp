#include "train/machine.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/openblas_cores.h"
#include "core/fileio.h"
#include <fmt/format.h>

namespace ladder {

static std::filesystem::path cache_file() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  std::filesystem::path base = xdg && *xdg ? xdg : (home ? std::filesystem::path(home) / ".cache" : "/tmp");
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  // The rate depends on the kernels OpenBLAS runs (backend/cpu/openblas_cores.h), so they are part of
  // the key: a rate measured with other kernels is not this process's.
  return base / "ladder" / fmt::format("sgemm-{}-t{}-{}.json", host, cpu_threads(), openblas_core());
}

double sgemm_gflops(bool use_cache) {
  auto f = cache_file();
  if (use_cache && std::filesystem::exists(f)) {
    try {
      auto j = nlohmann::json::parse(read_file(f));
      double g = j.at("sgemm_gflops").get<double>();
      if (g > 0) return g;
    } catch (...) {
    }
  }
  // The shape of a training GEMM at dense-small scale: [4096 x 512] x [512 x 2048].
  const int M = 4096, N = 2048, K = 512;
  std::vector<float> A(size_t(M) * K, 0.5f), B(size_t(K) * N, 0.25f), C(size_t(M) * N);
  std::vector<double> rates;
  for (int rep = 0; rep < 45; ++rep) {  // ~1.5 s: the median of 40 is stable on a noisy VM
    auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.f, A.data(), K, B.data(), N, 0.f, C.data(), N);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep >= 5) rates.push_back(2.0 * M * N * K / s / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  double g = rates[rates.size() / 2];
  {
    try {
      std::filesystem::create_directories(f.parent_path());
      write_file_atomic(f, nlohmann::json{{"sgemm_gflops", g}, {"threads", cpu_threads()}, {"M", M}, {"N", N}, {"K", K}}.dump());
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
