// The machine's measured sgemm rate: the MFU denominator on CPU. Measured once per (host, threads)
// and cached under $XDG_CACHE_HOME/ladder (or ~/.cache/ladder).
#pragma once
#include <filesystem>
#include <string>

namespace ladder {

class Backend;

// The sgemm peak on the current thread count: the best of the median GFLOP/s of a training-shaped
// sgemm ([4096 x 512] x [512 x 2048]), a square one with a long K (2048^3) and a narrow one with a
// long K ([4096 x 8192] x [8192 x 128]). `use_cache`:
// return the cached value if there is one. A fresh measurement is returned as measured and raises
// the cached value when it is higher (the cache keeps the best rate seen: a busy VM reads low).
double sgemm_gflops(bool use_cache = true);
// Where sgemm_gflops caches the rate: $XDG_CACHE_HOME/ladder (or ~/.cache/ladder), one file per host,
// thread count and OpenBLAS kernel set.
std::filesystem::path sgemm_cache_file();

// This machine's host name, as results and timings record where they were measured.
std::string host_name();
// The CPU's model name from /proc/cpuinfo ("" where there is none). Results record it beside the host
// name: cloud VMs often share one host name ("vm") over different hardware, and tokens/s measured on
// two CPUs are not one machine's numbers.
std::string cpu_model();
// Where a result or timing was measured, as the report compares it: "host (cpu, N threads)", or the
// host name alone when the CPU is not known (results from before the CPU was recorded).
std::string machine_label(const std::string& host, const std::string& cpu, int threads);
// The current UTC time as "2026-12-02T08:00:00Z".
std::string utc_now();

// The GEMM rate of `be` itself on its own memory, median GFLOP/s of a training-shaped product
// [tokens x d] x [d x 4d] (16384 x 1024 x 4096, 137 GFLOP): the MFU denominator on a device, where
// the backend's precision (fp32, TF32, bf16) decides the ceiling. Never cached (GPUs are shared and
// clocks move); about 0.5 s on an H200 in fp32.
double backend_gemm_gflops(Backend& be);

}  // namespace ladder
