#include "ladder/runner.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <map>
#include <optional>
#include <set>

#include "backend/backend.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/stats.h"
#include "dist/comm.h"
#include "ladder/store.h"
#include "ladder/timing.h"
#include "train/machine.h"
#include "train/metrics.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace ladder {

namespace {

// The throughput timing of a finished plan (ladder/timing.h): measured once, again when the plan or
// the spec's timing settings change or --retime asks.
void time_plan(const Plan& plan, const ResultStore& store, const TimingSettings& ts, bool retime, double peak) {
  const fs::path file = store.dir() / "timing.json";
  int unfinished = 0;
  for (auto& r : plan.runs) unfinished += !store.read_result(r.id);
  if (unfinished > 0) {
    fmt::print("timing: waits until every run has a result ({} not yet); run the sweep again then\n", unfinished);
    return;
  }
  if (!retime && fs::exists(file)) {
    try {
      const Timing t = read_timing(file);
      if (timing_matches(t, plan, ts)) {
        fmt::print("timing: stored in {} ({} rounds on {}, {}); --retime times again\n", file.string(), t.rounds,
                   t.host, t.finished_at);
        return;
      }
      fmt::print("timing: {} was measured for another plan or other timing settings: timing again\n", file.string());
    } catch (const Error& e) {
      fmt::print("timing: {}: timing again\n", e.what());
    }
  }
  RunLock lock(store, "timing");
  if (!lock.held()) {
    fmt::print("timing: another worker is timing (its lock is held); skipped\n");
    return;
  }
  fmt::print("timing: {} models x {} interleaved rounds x ({} + {} steps) on {} threads; realized speedups will "
             "compare these\n",
             timing_cells(plan).size(), ts.rounds, ts.warmup, ts.steps, cpu_threads());
  std::fflush(stdout);
  const Timing t = measure_timing(plan, ts, peak);
  write_file_atomic(file, timing_to_json(t).dump(1) + "\n");
  fmt::print("timing: stored in {}\n", file.string());
}

}  // namespace

std::vector<std::string> sweep_commands(const Plan& plan, const fs::path& out, const std::vector<uint64_t>& seeds) {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  std::string bin = ec ? "ladder" : exe.string();
  // The seeds given to this sweep travel with each command: a run id names its seed, and the
  // command plans again (with the spec's own seeds it would not find the run).
  std::string seed_arg;
  if (!seeds.empty()) {
    seed_arg = " --seeds ";
    for (size_t i = 0; i < seeds.size(); ++i) {
      if (i) seed_arg += ',';
      seed_arg += std::to_string(seeds[i]);
    }
  }
  std::vector<std::string> cmds;
  for (auto& r : plan.runs)
    cmds.push_back(fmt::format("cd {} && {} sweep {} --out {}{} --only {}", shell_quote(fs::current_path().string()),
                               shell_quote(bin), shell_quote(fs::absolute(plan.spec.file).string()),
                               shell_quote(fs::absolute(out).string()), seed_arg, r.id));
  return cmds;
}

// What every stored result says of its run, finished or diverged: the plan's facts and where and
// when it ended.
nlohmann::json result_of(const PlannedRun& r, const char* status) {
  return {{"format", "ladder-result"},
          {"version", kResultsVersion},
          {"status", status},
          {"run", r.id},
          {"variant", r.variant},
          {"baseline", r.baseline},
          {"stacks", r.stacks},
          {"d", r.d},
          {"seed", r.seed},
          {"scale", r.scale},
          {"config", to_json(r.cfg)},
          {"config_hash", r.config_hash},
          {"data", r.data_id},
          {"revision", code_revision()},
          {"tokens", r.tokens},
          {"compute", r.compute},
          {"flops_with_head", r.flops_with_head},
          {"host", host_name()},
          {"cpu", cpu_model()},
          {"threads", cpu_threads()},
          {"finished_at", utc_now()}};
}

nlohmann::json make_result(const PlannedRun& r, const fs::path& run_dir) {
  const fs::path log = run_dir / "metrics.jsonl";
  if (!fs::exists(log)) fail("{}: missing: the run finished without a metrics log", log.string());
  nlohmann::json loss_curve = nlohmann::json::array(), val_curve = nlohmann::json::array();
  std::vector<double> tps, mfu;
  double wall = 0;
  double last_val_step = -1;
  bool last_val_finite = true;
  read_metrics(log, [&](long, const nlohmann::json& j) {
    if (j.contains("val_loss") && j["step"].is_number() && j["step"].get<double>() >= last_val_step) {
      last_val_step = j["step"].get<double>();
      last_val_finite = j["val_loss"].is_number() && std::isfinite(j["val_loss"].get<double>());
    }
    if (j.contains("elapsed_s") && j["elapsed_s"].is_number()) wall = std::max(wall, j["elapsed_s"].get<double>());
    if (j.contains("loss") && j["loss"].is_number()) {
      loss_curve.push_back({j["step"], j["tokens"], j["loss"]});
      if (j["tokens_per_s"].is_number()) tps.push_back(j["tokens_per_s"].get<double>());
      if (j["mfu"].is_number()) mfu.push_back(j["mfu"].get<double>());
    }
    if (j.contains("val_loss") && j["val_loss"].is_number()) val_curve.push_back({j["step"], j["tokens"], j["val_loss"]});
  });
  // A non-finite validation loss is logged as null; dropping it would leave an earlier evaluation
  // standing as the run's final loss.
  if (!last_val_finite)
    throw TrainingDiverged(fmt::format("validation loss is not finite at step {} ({})", int64_t(last_val_step),
                                       log.string()));
  if (val_curve.empty())
    fail("{}: no validation loss logged (run.eval_batches must be > 0 for a ladder)", log.string());
  double best = val_curve[0][2].get<double>();
  for (auto& v : val_curve) best = std::min(best, v[2].get<double>());
  nlohmann::json res = result_of(r, "finished");
  res.update({{"final_val_loss", val_curve.back()[2]},
              {"best_val_loss", best},
              {"val_curve", val_curve},
              {"loss_curve", loss_curve},
              {"tokens_per_s", median(tps)},
              {"mfu", median(mfu)},
              {"wall_s", wall}});
  return res;
}

nlohmann::json make_diverged_result(const PlannedRun& r, const std::string& why) {
  nlohmann::json res = result_of(r, "diverged");
  res["error"] = why;
  return res;
}

SweepSummary sweep(const SweepOptions& opt) {
  LadderSpec spec = load_spec(opt.spec_file);
  if (!opt.seeds.empty()) {
    if (std::set<uint64_t>(opt.seeds.begin(), opt.seeds.end()).size() != opt.seeds.size())
      fail("--seeds {}: a seed is listed twice", fmt::join(opt.seeds, ","));
    if (!opt.dry_run && !opt.list && opt.seeds != spec.seeds)
      fmt::print("seeds: {} (--seeds; {} lists {}): the plan and the report follow --seeds until the next sweep "
                 "without it\n", fmt::join(opt.seeds, ", "), spec.file.string(), fmt::join(spec.seeds, ", "));
    spec.seeds = opt.seeds;
  }
  // A sweep that trains measures the sgemm rate afresh (5-7 s) before its runs read the cached
  // one for their MFU: the cache keeps the best rate seen, so one reading taken while the machine
  // was busy does not stay every later run's (too low) denominator.
  if (opt.peak_gflops <= 0 && !opt.dry_run && !opt.list) sgemm_gflops(/*use_cache=*/false);
  Plan plan = make_plan(spec, opt.peak_gflops);
  const auto planned_hashes = plan.hashes();  // the whole plan, --only or not: what the report keeps
  const auto planned_data = plan.data_ids();   // (the same: each --only worker rewrites ladder.json)
  if (!opt.only.empty()) {
    std::set<std::string> want(opt.only.begin(), opt.only.end()), known;
    for (auto& r : plan.runs) known.insert(r.id);
    for (auto& w : want)
      if (!known.count(w)) fail("--only {}: no such run in {} (ids are <variant>-d<width>-s<seed>)", w, spec.file.string());
    std::erase_if(plan.runs, [&](const PlannedRun& r) { return !want.count(r.id); });
  }
  ResultStore store(opt.out);
  SweepSummary sum;
  sum.planned = int(plan.runs.size());
  for (const fs::path& d : opt.reuse)
    if (!fs::is_directory(d / "results"))
      fail("--reuse {}: not a results directory (expected {} holding <run>.json files)", d.string(),
           (d / "results").string());
  if (opt.dry_run) {
    fmt::print("{}", format_plan(plan));
    return sum;
  }
  store.check_owner(spec);
  // A directory from an earlier version of the spec: refuse before training anything, and before
  // ladder.json is rewritten (the report would otherwise read the refused plan as current).
  // Data prepared again at the same path leaves every config hash as it was: the data's identity is
  // compared too (results and runs from before it was recorded have none and pass).
  auto other_data = [&](const nlohmann::json& j, const PlannedRun& r) {
    return j.contains("data") && j["data"] != r.data_id;
  };
  auto data_fail = [&](const fs::path& file, const PlannedRun& r, const char* did, const nlohmann::json& j) {
    fail("{}: run {} was {} on other data ({}; {} now holds {}); use another --out directory or delete that run "
         "({} and {})",
         file.string(), r.id, did, j["data"].is_string() ? j["data"].get<std::string>() : j["data"].dump(),
         r.cfg.data.path, r.data_id, store.result_path(r.id).string(), store.run_dir(r.id).string());
  };
  for (auto& r : plan.runs) {
    if (auto res = store.read_result(r.id); res) {
      if (res->value("config_hash", "") != r.config_hash)
        fail("{}: run {} was made with another config (hash {}, the spec now gives {}); use another --out directory "
             "or delete that run",
             store.result_path(r.id).string(), r.id, res->value("config_hash", ""), r.config_hash);
      if (other_data(*res, r)) data_fail(store.result_path(r.id), r, "trained", *res);
    }
    auto planned = store.run_dir(r.id) / "planned.json";
    if (fs::exists(planned)) {
      auto j = nlohmann::json::parse(read_file(planned), nullptr, false);
      if (!j.is_object() || j.value("config_hash", "") != r.config_hash)
        fail("{}: run {} was started with another config (hash {}, the spec now gives {}); use another --out "
             "directory or delete that run",
             planned.string(), r.id, j.is_object() ? j.value("config_hash", "") : "?", r.config_hash);
      if (other_data(j, r)) data_fail(planned, r, "started", j);
    }
  }
  store.open_for_sweep(spec, planned_hashes, planned_data);
  if (opt.list) {
    for (auto& c : sweep_commands(plan, opt.out, opt.seeds)) fmt::print("{}\n", c);
    return sum;
  }
  // Every result records the binary's revision: say so before training when that revision is not
  // the code the user is looking at (last seen: 92 runs of a ladder trained by a stale build).
  if (const std::string w = revision_warning(code_revision(), source_tree_revision()); !w.empty())
    fmt::print("{}\n", w);
  fmt::print("{}", format_plan(plan));
  std::fflush(stdout);

  int i = 0;
  const std::unique_ptr<Comm> one_process = make_single_comm();
  for (const PlannedRun& r : plan.runs) {
    ++i;
    const std::string tag = fmt::format("[{}/{}] {}", i, plan.runs.size(), r.id);
    // A stored result ends the run for good: finished, or diverged (the same config would diverge
    // again on a resume, so it is not retried; the report lists it).
    auto stored = [&] {
      auto res = store.read_result(r.id);
      if (!res) return false;
      if (res->value("status", "finished") == "diverged") {
        ++sum.diverged;
        fmt::print("{}: diverged in an earlier sweep ({}), skipped; to retry, change the spec or delete {} and {}\n",
                   tag, res->value("error", "non-finite loss"), store.result_path(r.id).string(),
                   store.run_dir(r.id).string());
      } else {
        ++sum.already_done;
        fmt::print("{}: done (stored result)\n", tag);
      }
      return true;
    };
    if (stored()) continue;
    RunLock lock(store, r.id);
    if (!lock.held()) {
      ++sum.busy;
      fmt::print("{}: being trained by another worker (lock held), skipped\n", tag);
      continue;
    }
    if (stored()) continue;  // finished by another worker between the check and the lock
    // --reuse: the same config on the same data gives the same run (up to the machine's rounding),
    // so a result another directory holds for it is copied in, as it is, instead of trained again.
    // The id alone is not enough: ladders name their runs alike (dense-d64-s1) with other configs.
    auto reused = [&] {
      for (const fs::path& d : opt.reuse) {
        const ResultStore other(d);
        const auto res = other.read_result(r.id);
        if (!res) continue;
        const std::string hash = res->value("config_hash", "");
        if (hash != r.config_hash || other_data(*res, r)) {
          fmt::print("{}: not reused from {}: {} (the plan gives config hash {} on data {})\n", tag,
                     other.result_path(r.id).string(),
                     hash != r.config_hash ? fmt::format("another config (hash {})", hash)
                                           : fmt::format("other data ({})", (*res)["data"].dump()),
                     r.config_hash, r.data_id);
          continue;
        }
        store.write_result(r.id, *res);
        ++sum.reused;
        fmt::print("{}: reused from {} (same config hash {})\n", tag, other.result_path(r.id).string(), r.config_hash);
        return true;
      }
      return false;
    };
    if (reused()) continue;
    const fs::path rd = store.run_dir(r.id);
    fs::create_directories(rd);
    if (!fs::exists(rd / "planned.json"))
      write_file_atomic(rd / "planned.json", nlohmann::json{{"config_hash", r.config_hash}, {"data", r.data_id}, {"run", r.id}}.dump() + "\n");
    fmt::print("{}: training {} steps x {} sequences, {} tokens, C={} (est {})\n", tag, r.cfg.run.steps,
               r.cfg.run.batch_size, human_count(double(r.tokens)), human_count(r.compute),
               format_duration(r.est_seconds));
    std::fflush(stdout);
    TrainOptions to;
    to.cfg = r.cfg;
    to.run_dir = rd;
    // Each run in one process: ranks of an MPI launch (`mpirun -np 4 ladder sweep ...`) are
    // independent workers that share the store, as workers on several machines do.
    to.comm = one_process.get();
    to.resume = true;  // continues from the newest checkpoint when there is one, else starts fresh
    to.quiet = !opt.verbose;
    to.stop_after = opt.stop_after ? opt.stop_after(r) : -1;
    to.interrupt_at = opt.interrupt_at ? opt.interrupt_at(r) : -1;
    // A run whose loss becomes non-finite is an outcome of the ladder (too high a learning rate at
    // that width), not a reason to stop the others: it is recorded (atomically, as a result) and
    // the sweep goes on. Every other error (bad data, a full disk) still stops the sweep.
    auto record_diverged = [&](const std::string& why) {
      store.write_result(r.id, make_diverged_result(r, why));
      ++sum.diverged;
      fmt::print("{}: {}; recorded as diverged (left out of the report's fits), going on\n", tag, why);
      std::fflush(stdout);
    };
    TrainSummary ts;
    try {
      ts = train(to);
    } catch (const TrainingDiverged& e) {
      record_diverged(e.what());
      if (stop_requested()) {  // Ctrl-C in the step that diverged still stops the sweep
        sum.interrupted = true;
        return sum;
      }
      continue;
    }
    if (ts.end_step < r.cfg.run.steps) {
      sum.interrupted = true;
      fmt::print("{}: interrupted at step {}; run the sweep again to resume\n", tag, ts.end_step);
      return sum;
    }
    // The trainer checks the training loss only. make_result reads the run's log, where a non-finite
    // validation loss is null: a last one makes the run diverged, whether this worker trained it or
    // found it complete (killed before its result was stored).
    std::optional<nlohmann::json> res;
    try {
      res = make_result(r, rd);
    } catch (const TrainingDiverged& e) {
      record_diverged(e.what());
    }
    if (res) {
      store.write_result(r.id, *res);
      ++sum.trained;
      fmt::print("{}: val loss {:.4f} (best {:.4f}), {:.0f} tokens/s, MFU {:.1f}%, {}\n", tag,
                 (*res)["final_val_loss"].get<double>(), (*res)["best_val_loss"].get<double>(),
                 (*res)["tokens_per_s"].get<double>(), 100 * (*res)["mfu"].get<double>(),
                 format_duration((*res)["wall_s"].get<double>()));
      std::fflush(stdout);
    }
    // A stop signal during the run's last step, final evaluation or final checkpoint: the run
    // completed and its result is stored, but the user asked the sweep to stop.
    if (ts.interrupted) {
      sum.interrupted = true;
      fmt::print("{}: stop signal received; the run completed and is recorded; run the sweep again to continue\n",
                 tag);
      return sum;
    }
  }
  if (spec.timing.rounds > 0) {
    if (!opt.only.empty())
      fmt::print("timing: not with --only (run the sweep without it once every run is done)\n");
    else
      time_plan(plan, store, spec.timing, opt.retime, opt.peak_gflops);
  }
  fmt::print("sweep: {} runs: {} trained now, {}{} already done, {} diverged, {} left to other workers; next: ladder "
             "report {}\n",
             sum.planned, sum.trained, sum.reused > 0 ? fmt::format("{} reused, ", sum.reused) : "", sum.already_done,
             sum.diverged, sum.busy, opt.out.string());
  return sum;
}

}  // namespace ladder
