// `ladder sweep`: plan, then train every run that has no stored result. Resumable and idempotent:
// finished runs (a result file exists) are skipped, unfinished ones resume from their newest
// checkpoint through the trainer's own resume; a run being trained by another worker (its lock is
// held) is left to that worker.
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
  double peak_gflops = 0;         // <= 0: measured (cached)
  // Testing: steps after which a run's training returns as if the process were killed (-1 = never);
  // the sweep then stops, as a killed sweep would.
  std::function<int64_t(const PlannedRun&)> stop_after;
};

struct SweepSummary {
  int planned = 0, trained = 0, already_done = 0, busy = 0;
  bool interrupted = false;
};

SweepSummary sweep(const SweepOptions& opt);

// The shell commands for --list: `cd CWD && LADDER sweep SPEC --out DIR --only RUN`, absolute paths.
std::vector<std::string> sweep_commands(const Plan& plan, const std::filesystem::path& out);

// The result record of a finished run, from its plan entry and the trainer's metrics.jsonl.
nlohmann::json make_result(const PlannedRun& run, const std::filesystem::path& run_dir);

}  // namespace ladder
