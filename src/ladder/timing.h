// Throughput timing of a sweep (docs/ladder.md, "Realized speedups"): after every run of the plan
// has finished, each (variant, width) model's training step is timed in interleaved rounds on one
// machine, and the report's realized speedups compare these side-by-side readings instead of the
// training wall-clock of runs made minutes or hours apart (on a shared VM the same model's tokens/s
// moved by 20-40% between runs, results/cpu-quick/README.md).
//   DIR/timing.json   one file, written once per timing (temp + fsync + rename) by the one worker
//                     holding DIR/locks/timing.lock
#pragma once
#include <array>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ladder/plan.h"

namespace ladder {

class ResultStore;

constexpr int kTimingVersion = 1;

// One timed model: the plan's run of the first seed at that (variant, width), whose config (less
// the seed, which changes no step's work) every seed of the cell shares.
struct TimedCell {
  std::string variant, run, config_hash;
  int d = 0;
  double flops_per_token = 0;            // C / tokens: the FLOPs (3 x forward, no LM head) a token costs
  std::vector<double> tokens_per_s;      // one reading per round: tokens per step / median step time
  std::vector<std::vector<double>> step_s;  // per round, every timed step's wall seconds (for analysis)
};

struct Timing {
  int rounds = 0, steps = 0, warmup = 0;
  std::string host, cpu, revision, started_at, finished_at;  // cpu: "" in files from before it was recorded
  int threads = 0;
  double sgemm_gflops = 0;
  std::vector<TimedCell> cells;
  const TimedCell* find(const std::string& variant, int d) const;
};

// The cells a plan's timing measures, in the order of the rounds (width, then the plan's variant order).
std::vector<const PlannedRun*> timing_cells(const Plan& plan);
// Whether `t` was measured with these settings for exactly these cells and configs (else: re-time).
bool timing_matches(const Timing& t, const Plan& plan, const TimingSettings& s);
// Times every cell: `s.rounds` rounds, each timing every cell once (`s.warmup` untimed steps, then
// `s.steps` timed; the round's reading is their median), the cells in plan order in even rounds and
// in reverse in odd ones, so that a drift of the machine's speed during a round falls on both sides
// of a comparison alike. Prints one line per round. `sgemm_gflops` <= 0: the sgemm rate recorded
// beside the readings is measured now (on a CPU plan).
Timing measure_timing(const Plan& plan, const TimingSettings& s, double sgemm_gflops = 0);

nlohmann::json timing_to_json(const Timing& t);
// Reads DIR/timing.json; errors name the file and the field that is missing or of the wrong type.
Timing read_timing(const std::filesystem::path& file);

// Median of the per-round ratios of model FLOP/s (C per token x tokens/s) of `v` over `b`, with
// their smallest and largest: {median, min, max}. Both cells have the same number of rounds.
std::array<double, 3> timed_flops_ratio(const TimedCell& v, const TimedCell& b);

}  // namespace ladder
