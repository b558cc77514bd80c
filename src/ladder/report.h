// `ladder report DIR`: speedups of every variant over its baseline at every scale, by Marin's method
// and by Ladder's fitted laws with 95% intervals over seeds (Student's t over per-seed estimates), and
// with no law, interpolated on the baseline's measured widths (bounds outside them); the gate
// verdicts; the stacked variant against the product of its rungs; a backtest of the widest width. Writes report.md, loss_vs_compute.svg, speedups.svg,
// val_curves.svg (validation loss during training, per width) and
// a self-contained report.html under DIR/report (or --out).
#pragma once
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ladder/fit.h"
#include "ladder/timing.h"

namespace ladder {

struct Interval {
  double value = std::numeric_limits<double>::quiet_NaN();
  double lo = std::numeric_limits<double>::quiet_NaN(), hi = std::numeric_limits<double>::quiet_NaN();
};

struct SpeedupCell {
  int d = 0;
  int n_variant = 0, n_base = 0;  // seeds with a finished run here, each side
  int n_paired = 0;               // seeds both sides have here: the only ones the speedups use
  int n_diverged = 0;             // runs of the variant that diverged here (in no fit)
  // Means over the paired seeds (with no baseline or no pair here: over the variant's own runs).
  double C = 0, loss = 0, base_C = 0, base_loss = 0, tps = 0, base_tps = 0;
  Interval marin_theo, marin_real, law_theo, law_real;
  // Interpolated on the baseline's measured curve, no law (compute_on_curve): interp_bound +1, the
  // variant's loss is below every width's of its baseline and the values are lower bounds (> x);
  // -1, above every width's: upper bounds (< x); 0, read between two widths.
  Interval interp_theo, interp_real;
  int interp_bound = 0;
  // Read between two widths (interp_bound 0): those widths of the baseline and how far apart in
  // compute they are (the straight line's stretch).
  int interp_from = 0, interp_to = 0;
  double interp_span = std::numeric_limits<double>::quiet_NaN();
  // From the sweep's throughput timing (timing.json), where this cell was timed: tokens/s (median,
  // smallest and largest over the rounds) and, where its baseline was timed too, the model-FLOP/s
  // ratio over it (median, smallest and largest of the per-round ratios) that the realized speedups
  // then use. value NaN: not timed.
  Interval timed_tps, timed_ratio;
};

struct VariantRow {
  std::string name, baseline;
  std::vector<std::string> stacks;
  PowerLaw law;
  bool law_ok = false;
  std::vector<SpeedupCell> cells;  // one per scale of the report (n_variant 0: no finished run there)
  std::string gate_marin, gate_law, gate_ci;  // "pass", "FAIL" or "n/a"
  // Interpolated speedups > 1 at every width ("pass"), <= 1 at one ("FAIL"); n/a where a width has
  // none, or a bound that decides nothing (> 0.8x, < 1.3x).
  std::string gate_interp;
};

// A backtest of the extrapolation that speedups at a ladder's widest width lean on: a variant's
// widest width forecast by its law refit without that width, and by Marin's law (E, alpha fixed, A
// through the variant's own mean at the next-widest width). The compute factor is the compute the
// forecasting law puts at the measured loss over the compute the runs spent: > 1, the runs reached
// a loss that law expected only at more compute (they did better than forecast); the same factor
// by which a speedup read on that law beyond its last point would be off.
struct Forecast {
  std::string variant;
  int d = 0, d_prev = 0;    // the width held out; the widest width left in
  int n_widths = 0;         // widths the refit law saw
  double C = std::numeric_limits<double>::quiet_NaN();  // the held-out runs' mean compute
  Interval measured;        // mean final validation loss over seeds there [95% t-interval, >= 2 seeds]
  PowerLaw law;             // refit without d
  bool law_ok = false;
  double law_loss = std::numeric_limits<double>::quiet_NaN(), law_factor = std::numeric_limits<double>::quiet_NaN();
  double marin_loss = std::numeric_limits<double>::quiet_NaN(), marin_factor = std::numeric_limits<double>::quiet_NaN();
};

struct Report {
  std::string name;
  double E = 1.6, alpha = 0.0941;
  bool intervals = false;  // some cell has more than one seed
  int n_seeds = 0;         // distinct seeds: the intervals' unit
  std::vector<std::string> warnings;  // what a reader must know before trusting a number, in order found
  std::vector<int> scales;
  std::vector<VariantRow> variants;        // baselines first
  std::vector<Forecast> forecasts;         // per variant with runs at >= 3 widths, in variant order
  std::vector<nlohmann::json> results;     // as stored, sorted by run id (diverged runs included)
  std::vector<std::string> diverged;       // ids of the runs that diverged (in no fit)
  std::vector<std::string> revisions;
  std::optional<Timing> timing;            // the sweep's throughput timing, when it has one
};

// A variant's baseline and the rungs it stacks, as the spec gives them.
struct VariantLinks {
  std::string baseline;
  std::vector<std::string> stacks;
  // The widths the plan trains it at (a scale may list only some variants); empty: every width of
  // the report. The gates judge these widths: elsewhere the variant was never meant to run.
  std::vector<int> widths;
};

// Computes the report from stored results (finished runs, and diverged runs: listed, left out of
// every fit). `variant_order` (optional) lists variants in spec order; `links` (optional) the
// spec's baselines and stacks, which win over those stored with the results (a spec edited since).
// `timing` (optional): the sweep's throughput timing; where a variant and its baseline were both timed,
// their realized speedups use its FLOP/s ratio instead of the training runs' tokens/s.
Report compute_report(const std::vector<nlohmann::json>& results, double E, double alpha,
                      const std::vector<std::string>& variant_order = {},
                      const std::map<std::string, VariantLinks>& links = {},
                      const std::optional<Timing>& timing = std::nullopt);

std::string format_speedup(double x);                 // "1.32x", "inf", "n/a"
// "1.32x (0.95x)"; with_interval: "1.32x [1.10x-1.50x] (0.95x [0.80x-1.10x])", the theoretical speedup
// and its interval, then the realized one and its interval (none with one seed per cell); "diverged"
// where the variant's only runs diverged, "-" where it has none.
std::string format_cell(const SpeedupCell& c, bool law, bool with_interval);
// The interpolated speedups the same way, a bound written "> 1.74x (> 1.08x)" / "< 0.50x (< 0.45x)".
std::string format_interp_cell(const SpeedupCell& c);
std::string report_markdown(const Report& r);
std::string loss_plot_svg(const Report& r);
std::string speedup_plot_svg(const Report& r);
std::string report_html(const Report& r);  // embeds both plots

struct ReportOptions {
  std::filesystem::path dir, out;           // out empty: DIR/report
  std::optional<double> E, alpha;           // default: the spec's report settings stored in DIR/ladder.json
  // Every other variant measured against this one instead of its spec baseline (stacks dropped):
  // a variant two rungs above the root read against the root directly, with its own interval.
  std::string vs;
};
// Reads DIR, writes the four files, returns the Markdown (also printed by the CLI).
std::string write_report(const ReportOptions& opt);

}  // namespace ladder
