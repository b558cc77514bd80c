// A ladder spec (YAML): a base config, named variants (config changes + the variant each is measured
// against), scales (by width d; layers, heads, batch and token budget derived by stated rules, or
// given), seeds and report settings. docs/ladder.md describes the format; configs/ladders/ holds presets.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace ladder {

// How a width d becomes a model and a run (each rule can be overridden per scale).
struct ScaleRules {
  int head_dim = 64;              // n_heads = d / head_dim; 0 = keep the base config's heads
  int kv_ratio = 1;               // n_kv_heads = n_heads / kv_ratio (1 = no grouping)
  double ff_mult = 4;             // model.d_ff = ff_mult * d; 0 = keep the base config's d_ff
  double tokens_per_param = 20;   // token budget = tokens_per_param * parameters of the blocks (no embedding, no LM head; base config)
  int64_t target_steps = 200;     // batch = tokens / (target_steps * seq_len * grad_accum), a power of 2 ...
  int min_batch = 1, max_batch = 256;  // ... clamped to [min_batch, max_batch] sequences
  int checkpoints = 4;            // checkpoints per run (resume granularity)
  int evals = 4;                  // validation evaluations per run (the validation loss curve)
};

struct ScaleSpec {
  int d = 0;
  // Given values (0 = derived by the rules).
  int layers = 0, heads = 0, kv_heads = 0, d_ff = 0, batch_size = 0;
  int64_t steps = 0, tokens = 0;
  // The variants trained at this width; empty: every one. A baseline measured one width beyond its
  // variants lets the report read their widest width between two of its points, with no law.
  std::vector<std::string> variants;
  std::string where;  // "file:line" of its entry (error messages; a spec may extend another)
};

// One `set:` entry: a dotted config key, its value ("N*d": N times the width) and the "file:line"
// that gave it (a spec may extend another).
struct SetEntry {
  std::string key, value, where;
};

struct VariantSpec {
  std::string name, baseline;                             // baseline empty: a root (e.g. dense)
  std::vector<SetEntry> set;                              // its changes, in order
  std::vector<std::string> stacks;                        // for a stacked variant: the rungs it combines
  std::string where;                                      // "file:line" of its (last) entry
};

struct ReportSettings {
  double E = 1.6, alpha = 0.0941;  // Marin's fixed law constants (RECIPE.md 4); tiny models need others
  double mfu_estimate = 0.3;       // plan: assumed MFU for the time estimate
};

// The throughput timing after training (docs/ladder.md, "Realized speedups"): every (variant,
// width) model's training step timed in `rounds` interleaved rounds on one machine, so that the
// realized speedups compare throughputs measured side by side rather than the wall-clock of runs
// trained minutes or hours apart on a machine whose speed drifts.
struct TimingSettings {
  int rounds = 0;  // 0: no timing (realized speedups from the runs' training tokens/s)
  int steps = 3;   // timed steps per model and round (their median is the round's reading)
  int warmup = 1;  // untimed steps before them (first-touch of the arenas, caches)
};

struct LadderSpec {
  std::filesystem::path file;
  std::string name;
  std::filesystem::path base;             // base config (relative paths: to the spec file)
  std::vector<SetEntry> base_set;         // applied to the base for every run
  ScaleRules rules;
  std::vector<ScaleSpec> scales;
  std::vector<uint64_t> seeds;
  std::vector<VariantSpec> variants;      // ordered: every baseline before the variants measured against it
  std::vector<VariantSpec> pending;       // rungs whose config keys arrive with other branches: checked, not run
  ReportSettings report;
  TimingSettings timing;
};

// Parses and checks the structure (names, baselines exist, no cycles, stacks). Config keys and
// scales are checked when the plan is made (make_plan), also before any training.
LadderSpec load_spec(const std::filesystem::path& file);

// L = round(d / (64 + 4*log2(d) - 9)), at least 1 (RECIPE.md section 2, their ladder).
int layers_for_width(int d);

}  // namespace ladder
