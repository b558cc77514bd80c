// `ladder bench --torch`: the PyTorch baseline (scripts/bench-torch.py, its fast model checked against
// the reference by TorchFast.SameModelAsTheReference) must time the same model Ladder timed, and a
// baseline that cannot run must say which command failed.
#include <cmath>
#include <cstdlib>

#include <gtest/gtest.h>

#include "core/error.h"
#include "model/flops.h"
#include "train/bench.h"
#include "train/machine.h"
#include "core/fileio.h"
#include "test_util.h"
#include <nlohmann/json.hpp>

namespace ladder {
namespace {

BenchOptions tiny_moe_bench() {
  BenchOptions opt;
  opt.config = std::filesystem::path(LADDER_SOURCE_DIR) / "configs" / "moe-tiny.yaml";
  opt.overrides = {"model.d_model=64", "model.n_layers=2", "model.seq_len=64", "model.moe_expert_ff=32",
                   "run.batch_size=2", "run.threads=1"};
  opt.steps = 1;
  opt.torch = true;
  return opt;
}

// The cached sgemm rate (the trainer's MFU denominator) keeps the best rate measured: a fresh
// measurement returns itself, raises a lower cached value and leaves a higher one.
TEST(Bench, SgemmCacheKeepsTheBestRateMeasured) {
  test::TempDir d("sgemm-cache");
  const char* old = std::getenv("XDG_CACHE_HOME");
  const std::string saved = old ? old : "";
  setenv("XDG_CACHE_HOME", d.path.c_str(), 1);
  auto cached = [] { return nlohmann::json::parse(read_file(sgemm_cache_file())).at("sgemm_gflops").get<double>(); };
  const double g1 = sgemm_gflops(/*use_cache=*/false);
  EXPECT_GT(g1, 0.5);  // GFLOP/s: any machine that runs the suite
  EXPECT_EQ(cached(), g1);
  write_file_atomic(sgemm_cache_file(), R"({"sgemm_gflops": 1e9})");  // higher than any measurement
  const double g2 = sgemm_gflops(false);
  EXPECT_LT(g2, 1e9);
  EXPECT_EQ(cached(), 1e9);
  EXPECT_EQ(sgemm_gflops(/*use_cache=*/true), 1e9);
  write_file_atomic(sgemm_cache_file(), R"({"sgemm_gflops": 0.001})");  // a busy machine's reading
  const double g3 = sgemm_gflops(false);
  // The fresh rate, not the lower cached one (min(cached, measured) would return 0.001 and pass the
  // line below), and it replaced the cached value.
  EXPECT_GT(g3, 0.5);
  EXPECT_EQ(cached(), g3);
  if (old) setenv("XDG_CACHE_HOME", saved.c_str(), 1); else unsetenv("XDG_CACHE_HOME");
}

TEST(Bench, TorchBaselineTimesTheSameMoeModel) {
  unsetenv("LADDER_TORCH_PYTHON");
  const BenchOptions opt = tiny_moe_bench();
  const Config cfg = load_bench_config(opt);
  const nlohmann::json t = run_torch_bench(cfg, opt);
  EXPECT_EQ(t["impl"], "fast");
  EXPECT_EQ(t["device"], "cpu");
  EXPECT_EQ(t["precision"], "fp32");
  EXPECT_EQ(t["moe_gemm"], "loop");  // Debian's torch 1.13 has no grouped GEMM
  // The same parameters, tensor for tensor (the MoE experts, router, shared expert, norms) ...
  EXPECT_EQ(t["n_params"].get<long>(), long(count_params(cfg.model).total)) << t.dump();
  // ... the same batch, and a real run of it: a finite loss near ln(V) at random weights.
  EXPECT_EQ(t["tokens_per_step"].get<long>(), 2 * 64);
  const double loss = t["last_loss"].get<double>(), ln_v = std::log(double(cfg.model.vocab_size));
  EXPECT_GT(loss, 0.5 * ln_v);
  EXPECT_LT(loss, 2.0 * ln_v);
  EXPECT_GT(t["tokens_per_s"].get<double>(), 0.0);
}

TEST(Bench, TorchBaselineFailureNamesTheCommand) {
  const BenchOptions opt = tiny_moe_bench();
  const Config cfg = load_bench_config(opt);
  setenv("LADDER_TORCH_PYTHON", "/nonexistent/python3", 1);
  try {
    run_torch_bench(cfg, opt);
    unsetenv("LADDER_TORCH_PYTHON");
    FAIL() << "a baseline that cannot start must be an error";
  } catch (const Error& e) {
    unsetenv("LADDER_TORCH_PYTHON");
    const std::string what = e.what();
    EXPECT_NE(what.find("PyTorch benchmark failed"), std::string::npos) << what;
    EXPECT_NE(what.find("/nonexistent/python3"), std::string::npos) << what;
    EXPECT_NE(what.find("bench-torch.py"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace ladder
