// Training metrics log (JSON Lines) and the human-readable progress line.
#pragma once
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

namespace ladder {

// Appends one JSON object per line to a metrics file. Each line is flushed to the OS as soon as
// it is written (so another process can tail it and a killed process loses nothing), and fsynced
// every `fsync_every_lines` lines or `fsync_every_s` seconds, so a machine crash loses at most
// that tail. Not thread-safe: one writer, the training loop.
class MetricsWriter {
 public:
  // append=false starts a fresh file (truncating any existing one); append=true continues one
  // (resume), typically followed by truncate_after_step(resumed_step).
  MetricsWriter(const std::filesystem::path& path, bool append, int fsync_every_lines = 100,
                double fsync_every_s = 10.0);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // Writes `obj` (must be a JSON object) as one line. Non-finite numbers become null (JSON has no
  // NaN); invalid UTF-8 in strings is replaced rather than aborting a training run.
  void write(const nlohmann::json& obj);
  // For resume from a checkpoint at `step`: atomically rewrites the file without lines whose
  // "step" is > step (written after that checkpoint by the run that died), and without a torn or
  // unparseable line, so the resumed run never duplicates or interleaves steps. Lines without a
  // numeric "step" (e.g. a run header) are kept.
  void truncate_after_step(int64_t step);
  // Forces the pending lines to stable storage.
  void sync();

  const std::filesystem::path& path() const { return path_; }

 private:
  void open(const char* mode);
  void close();

  std::filesystem::path path_;
  std::FILE* f_ = nullptr;
  int fsync_every_lines_;
  double fsync_every_s_;
  int unsynced_lines_ = 0;
  double last_sync_s_ = 0;
};

// Reads a metrics log, the one reader of the format MetricsWriter writes: fn(line number, object)
// for each line that holds a JSON object, in file order. Blank lines are skipped. A last line
// without its newline that does not parse is a live (or killed) writer's torn line and is left
// out; any other line that is not a JSON object is an error naming file:line.
void read_metrics(const std::filesystem::path& path, const std::function<void(long, const nlohmann::json&)>& fn);

struct ProgressInfo {
  int64_t step = 0, total_steps = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  double tokens_per_s = 0;
  double mfu = -1;        // fraction of peak (0.612 -> "61.2%"); <= 0 or non-finite: omitted
  double elapsed_s = 0;   // wall time so far, used to estimate the ETA when eta_s < 0
  double eta_s = -1;      // seconds to completion; < 0: derived from elapsed_s and the step rate
  std::string extra;      // appended as " | extra" when non-empty
};

// "step   120/2000 | loss 4.2315 | lr 3.00e-04 | gnorm 0.84 | 12.3k tok/s | MFU 61.2% | ETA 3m12s"
// The step is right-aligned to the width of total_steps so consecutive lines line up.
std::string format_progress(const ProgressInfo& p);
// "45s", "3m12s", "2h05m07s", "3d04h10m"; "--" for negative or non-finite values.
std::string format_duration(double seconds);
// Three significant digits with an SI-style suffix: 950, 45.6k, 1.23M, 2.1G, 3.4T, 5P.
std::string human_count(double n);

}  // namespace ladder
