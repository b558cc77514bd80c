#include "ladder/timing.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <set>

#include "backend/backend.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/stats.h"
#include "ladder/store.h"
#include "train/bench.h"
#include "train/machine.h"
#include "train/trainer.h"

namespace ladder {

const TimedCell* Timing::find(const std::string& variant, int d) const {
  for (auto& c : cells)
    if (c.variant == variant && c.d == d) return &c;
  return nullptr;
}

std::vector<const PlannedRun*> timing_cells(const Plan& plan) {
  std::vector<const PlannedRun*> out;
  std::set<std::pair<std::string, int>> seen;
  for (auto& r : plan.runs)  // ordered by width, then variant, then seed: the first seed of each cell
    if (seen.insert({r.variant, r.d}).second) out.push_back(&r);
  return out;
}

bool timing_matches(const Timing& t, const Plan& plan, const TimingSettings& s) {
  if (t.rounds != s.rounds || t.steps != s.steps || t.warmup != s.warmup) return false;
  const auto cells = timing_cells(plan);
  if (cells.size() != t.cells.size()) return false;
  for (const PlannedRun* r : cells) {
    const TimedCell* c = t.find(r->variant, r->d);
    if (!c || c->run != r->id || c->config_hash != r->config_hash || int(c->tokens_per_s.size()) != t.rounds)
      return false;
  }
  return true;
}

Timing measure_timing(const Plan& plan, const TimingSettings& s, double sgemm_rate) {
  const auto runs = timing_cells(plan);
  Timing t;
  t.rounds = s.rounds, t.steps = s.steps, t.warmup = s.warmup;
  t.host = host_name();
  t.cpu = cpu_model();
  t.revision = code_revision();
  t.threads = cpu_threads();
  t.started_at = utc_now();
  // The MFU denominator beside the readings, measured now (on the CPU; a device's is its own).
  const bool host_only = std::all_of(runs.begin(), runs.end(), [](const PlannedRun* r) { return r->cfg.run.device == "cpu"; });
  t.sgemm_gflops = !host_only ? 0 : sgemm_rate > 0 ? sgemm_rate : sgemm_gflops(/*use_cache=*/false);
  for (const PlannedRun* r : runs)
    t.cells.push_back({r->variant, r->id, r->config_hash, r->d, r->compute / double(r->tokens),
                       std::vector<double>(size_t(s.rounds), 0.0), std::vector<std::vector<double>>(size_t(s.rounds))});
  std::vector<size_t> order(runs.size());
  std::iota(order.begin(), order.end(), size_t(0));
  for (int round = 0; round < s.rounds; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t k = 0; k < order.size(); ++k) {
      const size_t i = round % 2 ? order[order.size() - 1 - k] : order[k];
      const Config& cfg = runs[i]->cfg;
      const StepTimes st = time_train_steps(cfg, s.warmup, s.steps);
      const double tokens = double(cfg.run.batch_size) * cfg.model.seq_len * cfg.run.grad_accum;
      t.cells[i].tokens_per_s[size_t(round)] = tokens / median(st.wall);
      t.cells[i].step_s[size_t(round)] = st.wall;
      if (stop_requested()) fail("timing interrupted (stop signal): nothing was stored; run the sweep again to time");
    }
    fmt::print("timing: round {}/{}: {} models, {:.0f} s\n", round + 1, s.rounds, runs.size(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(stdout);
  }
  t.finished_at = utc_now();
  return t;
}

nlohmann::json timing_to_json(const Timing& t) {
  nlohmann::json cells = nlohmann::json::array();
  for (auto& c : t.cells)
    cells.push_back({{"variant", c.variant},
                     {"d", c.d},
                     {"run", c.run},
                     {"config_hash", c.config_hash},
                     {"flops_per_token", c.flops_per_token},
                     {"tokens_per_s", c.tokens_per_s},
                     {"step_s", c.step_s}});
  return {{"format", "ladder-timing"}, {"version", kTimingVersion}, {"rounds", t.rounds},
          {"steps", t.steps},           {"warmup", t.warmup},          {"host", t.host},
          {"cpu", t.cpu},               {"revision", t.revision},      {"threads", t.threads},
          {"sgemm_gflops", t.sgemm_gflops}, {"started_at", t.started_at}, {"finished_at", t.finished_at},
          {"cells", cells}};
}

Timing read_timing(const std::filesystem::path& file) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(file));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", file.string(), e.what());
  }
  if (!j.is_object() || j.value("format", "") != "ladder-timing")
    fail("{}: not a Ladder timing file (expected \"format\": \"ladder-timing\")", file.string());
  if (j.value("version", -1) != kTimingVersion)
    fail("{}: timing format version {} (this build reads {}); run `ladder sweep ... --retime` to time again",
         file.string(), j.value("version", -1), kTimingVersion);
  auto field = [&](const nlohmann::json& o, const char* key, const char* what, auto ok,
                   const std::string& where) -> const nlohmann::json& {
    if (!o.contains(key) || !ok(o[key]))
      fail("{}: {}field '{}' is {}, expected {}", file.string(), where, key,
           o.contains(key) ? o[key].dump() : std::string("missing"), what);
    return o[key];
  };
  auto num = [](const nlohmann::json& x) { return x.is_number(); };
  auto count = [](const nlohmann::json& x) { return x.is_number_integer() && x.get<int64_t>() >= 0; };
  auto str = [](const nlohmann::json& x) { return x.is_string(); };
  Timing t;
  t.rounds = field(j, "rounds", "a whole number", count, "").get<int>();
  t.steps = field(j, "steps", "a whole number", count, "").get<int>();
  t.warmup = field(j, "warmup", "a whole number", count, "").get<int>();
  t.threads = field(j, "threads", "a whole number", count, "").get<int>();
  t.sgemm_gflops = field(j, "sgemm_gflops", "a number", num, "").get<double>();
  t.host = field(j, "host", "a string", str, "").get<std::string>();
  if (j.contains("cpu")) t.cpu = field(j, "cpu", "a string", str, "").get<std::string>();
  t.revision = field(j, "revision", "a string", str, "").get<std::string>();
  t.started_at = field(j, "started_at", "a string", str, "").get<std::string>();
  t.finished_at = field(j, "finished_at", "a string", str, "").get<std::string>();
  const auto& cells = field(j, "cells", "an array", [](const nlohmann::json& x) { return x.is_array(); }, "");
  for (size_t i = 0; i < cells.size(); ++i) {
    const auto& c = cells[i];
    const std::string where = fmt::format("cells[{}]: ", i);
    if (!c.is_object()) fail("{}: cells[{}] is {}, expected an object", file.string(), i, c.dump());
    TimedCell tc;
    tc.variant = field(c, "variant", "a string", str, where).get<std::string>();
    tc.run = field(c, "run", "a string", str, where).get<std::string>();
    tc.config_hash = field(c, "config_hash", "a string", str, where).get<std::string>();
    tc.d = field(c, "d", "a whole number", count, where).get<int>();
    tc.flops_per_token = field(c, "flops_per_token", "a number > 0",
                               [](const nlohmann::json& x) { return x.is_number() && x.get<double>() > 0; }, where)
                             .get<double>();
    const auto& tps = field(
        c, "tokens_per_s", fmt::format("{} numbers > 0 (one per round)", t.rounds).c_str(),
        [&](const nlohmann::json& x) {
          return x.is_array() && int(x.size()) == t.rounds &&
                 std::all_of(x.begin(), x.end(), [](const nlohmann::json& e) { return e.is_number() && e.get<double>() > 0; });
        },
        where);
    for (auto& x : tps) tc.tokens_per_s.push_back(x.get<double>());
    if (c.contains("step_s")) {  // the raw step times (not read by the report)
      const auto& ss = field(
          c, "step_s", fmt::format("{} arrays of numbers (one per round)", t.rounds).c_str(),
          [&](const nlohmann::json& x) {
            return x.is_array() && int(x.size()) == t.rounds && std::all_of(x.begin(), x.end(), [](const nlohmann::json& e) {
                     return e.is_array() && std::all_of(e.begin(), e.end(), [](const nlohmann::json& v) { return v.is_number(); });
                   });
          },
          where);
      for (auto& round : ss) tc.step_s.push_back(round.get<std::vector<double>>());
    }
    t.cells.push_back(std::move(tc));
  }
  return t;
}

std::array<double, 3> timed_flops_ratio(const TimedCell& v, const TimedCell& b) {
  std::vector<double> r;
  for (size_t i = 0; i < v.tokens_per_s.size() && i < b.tokens_per_s.size(); ++i)
    r.push_back(v.tokens_per_s[i] * v.flops_per_token / (b.tokens_per_s[i] * b.flops_per_token));
  return median_min_max(r);
}

}  // namespace ladder
