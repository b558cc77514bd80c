#include "train/optim_bench.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <vector>

#include "backend/backend.h"
#include "core/rng.h"
#include "core/stats.h"
#include "model/transformer.h"
#include "optim/optimizer.h"
#include "train/trainer.h"

namespace ladder {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

nlohmann::json run_optim_bench(const BenchOptions& opt) {
  Config cfg = load_bench_config(opt);
  auto be = make_cpu_backend(cfg.run.threads);
  Transformer model(cfg.model, cfg.run.batch_size, *be);
  std::vector<int32_t> in, tgt;
  synthetic_batch(cfg, in, tgt);
  nlohmann::json j = {{"config", opt.config.string()}, {"threads", cpu_threads()}, {"steps_timed", opt.steps}};
  nlohmann::json rows = nlohmann::json::array();
  for (const char* name : {"adamw", "adam", "adamh", "muon", "muonh"}) {
    Config c = cfg;
    c.optim.name = name;
    c.optim.adam_lr = c.optim.adamh_lr = c.optim.muon_lr = c.optim.muonh_lr = "";  // timing only: optim.lr
    model.init(c.run.seed);
    auto o = make_optimizer(c, model, *be);
    std::vector<double> step_t, opt_t;
    for (int s = 0; s < opt.steps + 1; ++s) {
      // The training step as the trainer runs it (forward, backward, clip, optimizer) ...
      double t0 = now_s();
      train_step(c, s, model, *o, *be, [](int32_t*, int32_t*) {}, in.data(), tgt.data());
      double t1 = now_s();
      // ... and the optimizer update alone, 3 more times on the same gradients (it is the small
      // part: more samples make its median steadier on a shared machine), with the clip factor the
      // trainer's step passed it (the updates multiply it into each gradient they read).
      for (int k = 0; k < 3; ++k) {
        double t2 = now_s();
        o->step(c.optim.lr, model.last_clip_factor());
        if (s >= 1) opt_t.push_back(now_s() - t2);
      }
      if (s >= 1) step_t.push_back(t1 - t0);  // the first step warms caches and thread pools
    }
    const double st = median(step_t), ot = median(opt_t);
    rows.push_back({{"optimizer", name}, {"step_s", st}, {"optim_s", ot}, {"share", ot / st}});
  }
  j["optimizers"] = rows;
  // Orthogonalization per distinct matrix shape of the model ([out, in] storage).
  std::set<std::pair<int, int>> shapes;
  std::map<std::pair<int, int>, int> count;
  for (auto& p : model.params())
    if (p.shape.size() == 2 && p.role != Role::Embedding && p.role != Role::Head) {
      shapes.insert({int(p.shape[0]), int(p.shape[1])});
      ++count[{int(p.shape[0]), int(p.shape[1])}];
    }
  nlohmann::json ns = nlohmann::json::array();
  Philox rng(cfg.run.seed, stream_id("bench"));  // random matrices, past the synthetic tokens' counters
  for (auto [r, c] : shapes) {
    std::vector<float> x(size_t(r) * c), y;
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(rng.normal(1000000 + i));
    std::vector<double> t;
    for (int k = 0; k < 3 + std::max(15, 4 * opt.steps); ++k) {
      y = x;
      double t0 = now_s();
      be->newton_schulz5(y.data(), r, c);
      if (k >= 3) t.push_back(now_s() - t0);
    }
    const double m = std::min(r, c), n = std::max(r, c);
    const double flops = 5 * (3 * m * m * n + m * m * m);  // syrk + syrk(A) + gemm per step
    const double med = median(t), best = *std::min_element(t.begin(), t.end());
    ns.push_back({{"rows", r}, {"cols", c}, {"count", count[{r, c}]}, {"ms", med * 1e3}, {"ms_min", best * 1e3},
                  {"gflops", flops / med / 1e9}, {"gflops_best", flops / best / 1e9}});
  }
  j["newton_schulz"] = ns;
  return j;
}

std::string format_optim_bench(const nlohmann::json& j) {
  std::string out = fmt::format("config {}  threads {}  medians of {} steps\n", j["config"].get<std::string>(),
                                j["threads"].get<int>(), j["steps_timed"].get<int>());
  out += fmt::format("{:<8} {:>10} {:>12} {:>8}\n", "optim", "step [s]", "optimizer [s]", "share");
  for (auto& r : j["optimizers"])
    out += fmt::format("{:<8} {:>10.3f} {:>12.4f} {:>7.1f}%\n", r["optimizer"].get<std::string>(), r["step_s"].get<double>(),
                       r["optim_s"].get<double>(), 100 * r["share"].get<double>());
  out += "Newton-Schulz (normalize + 5 steps) per matrix [out, in]:\n";
  for (auto& r : j["newton_schulz"])
    out += fmt::format("  [{:>5}, {:>5}] x{:<3} median {:>8.2f} ms ({:>5.1f} GFLOP/s), best {:>8.2f} ms ({:>5.1f} GFLOP/s)\n",
                       r["rows"].get<int>(), r["cols"].get<int>(), r["count"].get<int>(), r["ms"].get<double>(),
                       r["gflops"].get<double>(), r["ms_min"].get<double>(), r["gflops_best"].get<double>());
  return out;
}

}  // namespace ladder
