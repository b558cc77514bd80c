// The plan of a sweep: every (variant, scale, seed) run with its resolved config, FLOPs and an
// estimated time. Making the plan checks every config key and every scale, so a bad spec fails
// here, before any training starts.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ladder/spec.h"
#include "model/config.h"

namespace ladder {

struct PlannedRun {
  std::string id;        // "<variant>-d<width>-s<seed>": the run's directory and result file name
  std::string variant, baseline;
  std::vector<std::string> stacks;
  int d = 0;
  uint64_t seed = 0;
  Config cfg;            // resolved (vocab_size from the data directory)
  std::string config_hash;  // XXH64 of the resolved config's identity_json (model/config.h)
  std::string data_id;      // what the data directory holds (data_identity): the config names only its path
  int64_t tokens = 0;    // steps * tokens per step
  double compute = 0;    // C = 3 * forward FLOPs without the LM head * tokens (the ladder's x axis)
  double flops_with_head = 0;  // what MFU uses
  double est_seconds = 0;
  nlohmann::json scale;  // d, layers, heads, kv_heads, d_ff, batch_size, steps, tokens (as resolved)
};

struct Plan {
  LadderSpec spec;
  std::vector<PlannedRun> runs;       // ordered by scale, then variant (baselines first), then seed
  std::vector<std::string> pending;   // one line per pending variant: its state against this build's schema
  double peak_gflops = 0;             // measured sgemm rate used for the time estimates
  // Run id -> config hash for every run: what ladder.json records as the plan the report keeps.
  std::map<std::string, std::string> hashes() const {
    std::map<std::string, std::string> h;
    for (auto& r : runs) h[r.id] = r.config_hash;
    return h;
  }
  // Run id -> data identity for every run (ladder.json's "data").
  std::map<std::string, std::string> data_ids() const {
    std::map<std::string, std::string> h;
    for (auto& r : runs) h[r.id] = r.data_id;
    return h;
  }
};

// Resolves every run. `peak_gflops` <= 0: measured (cached per host). Errors name the spec file,
// the variant or scale and the problem.
Plan make_plan(const LadderSpec& spec, double peak_gflops = 0);
// The plan as a table (runs, FLOPs, estimated time, totals) for the terminal.
std::string format_plan(const Plan& plan);
// A run's id, "<variant>-d<width>-s<seed>" (PlannedRun::id), and the variant and width read back
// from one (false: not such an id).
std::string run_id(const std::string& variant, int d, uint64_t seed);
bool parse_run_id(const std::string& id, std::string& variant, int& d);
// Hash of a resolved config.
std::string config_hash(const Config& cfg);
// What a prepared data directory holds, from its meta.json and shard headers: the tokenizer's hash,
// the vocabulary, the end-of-document token, each split's token count and a hash of the shards'
// recorded checksums ("tok<hash> vocab V eod E train N val M tokens <hash>").
// A directory prepared again from another corpus keeps its path, and so every run config's hash:
// this is what tells a sweep (and the report) that its stored results were trained on other data.
std::string data_identity(const std::filesystem::path& data_dir);

}  // namespace ladder
