// The results store of a sweep: one JSON file per finished run, written atomically, under one
// directory that many workers (processes, machines with a shared file system) may use at once.
//   DIR/ladder.json           store format version, spec name and the report settings
//   DIR/results/<run>.json    the result of one finished run, or the record of a run that diverged
//                             ("status": "diverged"; written once, atomically: temp + fsync + rename)
//   DIR/runs/<run>/           the run's trainer directory (checkpoints, metrics.jsonl, config.yaml)
//   DIR/runs/<run>/planned.json  the config hash the run was started with (a changed spec is refused)
//   DIR/locks/<run>.lock      flock()ed by the worker training the run; released when it exits or dies
// Why files and not SQLite: README.md, "Ladder sweeps".
#pragma once
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ladder/spec.h"

namespace ladder {

constexpr int kResultsVersion = 1;

// The revision the binary was built from (`git describe --always --dirty`, or "unknown").
const char* code_revision();
// The revision of the source tree the binary was built from, as it is now (`git describe` there, or
// "" where that cannot be read: no git, no checkout, the binary moved to another machine). `dir` is
// another checkout's (any path: it reaches the shell quoted).
std::string source_tree_revision(const std::string& dir = LADDER_SOURCE_DIR);
// What a sweep says before it trains when its results would not name the code that made them: a
// binary built from uncommitted changes (`...-dirty`), or one whose source tree has moved on since
// (a stale build). "" when `binary` is a clean build of `tree` (or `tree` is unknown).
std::string revision_warning(const std::string& binary, const std::string& tree);

class ResultStore {
 public:
  explicit ResultStore(std::filesystem::path dir) : dir_(std::move(dir)) {}
  const std::filesystem::path& dir() const { return dir_; }

  // Creates the layout (or checks an existing DIR/ladder.json: format and version, and that it belongs
  // to the spec of the same name). Errors before anything is trained.
  // Refuses a directory that holds another ladder, or is not a results directory and not empty.
  void check_owner(const LadderSpec& spec) const;
  // Creates the layout and (re)writes ladder.json with the spec's report settings, its variants'
  // baselines and stacks, and the plan's runs (id -> config hash), from which the report keeps only
  // the results of the current plan.
  // `planned_hashes` and `planned_data`: run id -> config hash and -> data identity for the whole plan
  // (Plan::hashes, Plan::data_ids; not only the runs of an --only worker), recorded for the report.
  void open_for_sweep(const LadderSpec& spec, const std::map<std::string, std::string>& planned_hashes,
                      const std::map<std::string, std::string>& planned_data);
  // Reads DIR/ladder.json for the report; errors if missing or from an incompatible version.
  nlohmann::json read_manifest() const;

  std::filesystem::path result_path(const std::string& id) const { return dir_ / "results" / (id + ".json"); }
  std::filesystem::path run_dir(const std::string& id) const { return dir_ / "runs" / id; }
  // The stored result of a run (validated: version), if any.
  std::optional<nlohmann::json> read_result(const std::string& id) const;
  void write_result(const std::string& id, const nlohmann::json& result) const;
  // Every stored result (finished or diverged runs), sorted by run id. Errors name a file from another
  // version, a torn file, or a file and the field the report needs that it lacks or holds as another type.
  std::vector<nlohmann::json> all_results() const;

 private:
  std::filesystem::path dir_;
};

// An exclusive, non-blocking lock on DIR/locks/<id>.lock (flock): held while a worker trains a run.
class RunLock {
 public:
  RunLock(const ResultStore& store, const std::string& id);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  bool held() const { return fd_ >= 0 && held_; }

 private:
  int fd_ = -1;
  bool held_ = false;
};

}  // namespace ladder
