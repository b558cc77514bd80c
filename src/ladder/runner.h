// `ladder sweep`: plan, then train every run that has no stored result. Resumable and idempotent:
// finished runs (a result file exists) are skipped, and so are runs recorded as diverged; unfinished
// ones resume from their newest checkpoint through the trainer's own resume; a run being trained by
// another worker (its lock is held) is left to that worker. With the spec's `timing.rounds` > 0, once
// every run has a stored result, the models are timed side by side (ladder/timing.h) into
// DIR/timing.json, which the report's realized speedups use.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "ladder/plan.h"

namespace ladder {

struct SweepOptions {
  std::filesystem::path spec_file, out;
  bool list = false;      // print one shell command per run (for a cluster scheduler) and stop
  bool dry_run = false;   // print the plan and stop
  bool verbose = false;   // the trainer's own progress output
  std::vector<std::string> only;  // run ids to run (default: all)
  std::vector<uint64_t> seeds;    // replaces the spec's seeds (the plan, ladder.json and so the report follow)
  double peak_gflops = 0;         // <= 0: measured (cached)
  bool retime = false;            // time the models again even when DIR/timing.json matches the plan
  // Other results directories whose stored runs are copied in instead of trained, where one has the
  // run's id, config hash and data (a ladder sharing rungs with one already swept).
  std::vector<std::filesystem::path> reuse;
  // Testing: steps after which a run's training returns as if the process were killed (-1 = never);
  // the sweep then stops, as a killed sweep would.
  std::function<int64_t(const PlannedRun&)> stop_after;
  // Testing: the step of a run during which a stop signal arrives, as if SIGINT came then (-1 = never).
  std::function<int64_t(const PlannedRun&)> interrupt_at;
};

struct SweepSummary {
  int planned = 0, trained = 0, already_done = 0, busy = 0;
  int reused = 0;            // copied from a --reuse directory (same id, config hash and data)
  int diverged = 0;          // runs recorded as diverged, now or by an earlier sweep (never retried)
  bool interrupted = false;  // a stop signal came (or a simulated kill): the sweep stopped there
};

SweepSummary sweep(const SweepOptions& opt);

// The shell commands for --list: `cd CWD && LADDER sweep SPEC --out DIR --only RUN`, absolute paths.
std::vector<std::string> sweep_commands(const Plan& plan, const std::filesystem::path& out,
                                        const std::vector<uint64_t>& seeds = {});

// The result record of a finished run, from its plan entry and the trainer's metrics.jsonl.
nlohmann::json make_result(const PlannedRun& run, const std::filesystem::path& run_dir);
// The record of a run whose loss became non-finite ("status": "diverged", `why` the trainer's
// message): stored in place of its result, so a resumed sweep skips it instead of diverging again.
nlohmann::json make_diverged_result(const PlannedRun& run, const std::string& why);

}  // namespace ladder
