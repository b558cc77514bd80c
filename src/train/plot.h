// `ladder plot`: training curves of one or more runs, read from their metrics.jsonl, as one SVG
// (one panel per metric, train loss and validation loss sharing a panel) and a summary table.
// The x axis is the step, the tokens seen, the compute C (RECIPE.md section 4, from the run's own
// config.yaml through the one FLOP counter) or the wall time.
#pragma once
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace ladder {

struct PlotOptions {
  std::vector<std::string> inputs;                 // run directories or metrics.jsonl files
  std::vector<std::string> labels;                 // one per input (default: the run directory's name)
  std::vector<std::string> y = {"loss", "val_loss"};  // metrics, one panel each (loss + val_loss share one)
  std::string x = "step";                          // step | tokens | flops | time
  std::filesystem::path out = "plot.svg";
  double smooth = 0;                               // EMA weight in [0, 1) for the training-step metrics
  bool log_x = false, log_y = false;
  double xmin = -INFINITY, xmax = INFINITY;        // points outside [xmin, xmax] are left out (zoom)
  std::string title;
};

// One run's curves: for each requested metric, (x, value) points in step order.
struct RunCurves {
  std::string label;
  std::filesystem::path metrics;       // the metrics.jsonl read
  double compute_per_token = 0;        // C per token (3 x forward without head); 0 if no config was read
  std::map<std::string, std::vector<std::pair<double, double>>> series;
  std::vector<std::string> available;  // every metric name the file offers (for the error on a typo)
  // Summary: last step, tokens, last train loss, last and best validation loss, medians of the rates.
  long long last_step = 0;
  double tokens = 0, last_loss = 0, last_val = 0, best_val = 0, tokens_per_s = 0, mfu = 0;
  bool has_loss = false, has_val = false;
};

// Metric names: any numeric top-level field of a metrics line (loss, val_loss, lr, grad_norm,
// tokens_per_s, mfu, lse_sq, router_z_loss, ...); for MoE runs `moe.<field>` (the extreme layer:
// the minimum for load_min, the maximum for every other field) and `moe.load_max_ratio` /
// `moe.load_min_ratio` (the worst layer's max / mean and min / mean tokens per expert, as the
// progress line shows them).
//
// Reads `input` (a run directory holding metrics.jsonl, or the file itself). x = "flops" needs the
// run's config.yaml beside the metrics. Throws ladder::Error naming the file (and line) on bad
// input, and naming the metrics that exist when a requested one appears on no line.
RunCurves read_run_curves(const std::filesystem::path& input, const std::string& x,
                          const std::vector<std::string>& metrics);

// Exponential moving average with bias correction (weight a on the past; a = 0 returns the input).
std::vector<std::pair<double, double>> ema(const std::vector<std::pair<double, double>>& pts, double a);

// The SVG document: one panel per metric group, a legend with each run's label.
std::string curves_svg(const std::vector<RunCurves>& runs, const PlotOptions& opt);

// A fixed-width table: run, steps, tokens, last loss, last / best validation loss, tokens/s, MFU.
std::string curves_summary(const std::vector<RunCurves>& runs);

// The verb: reads every input, writes opt.out atomically, prints the summary. Returns the exit code.
int plot_cli(const PlotOptions& opt);

}  // namespace ladder
