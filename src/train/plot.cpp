#include "train/plot.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "core/error.h"
#include "core/fileio.h"
#include "core/stats.h"
#include "ladder/svg.h"
#include "model/config.h"
#include "model/flops.h"
#include "train/metrics.h"

namespace fs = std::filesystem;

namespace ladder {

namespace {

// One line of metrics.jsonl, reduced to what a plot reads.
struct Record {
  double step = 0;
  std::optional<double> tokens, elapsed;
  std::map<std::string, double> values;  // every plottable metric on the line
};

bool is_number(const nlohmann::json& v) { return v.is_number() && std::isfinite(v.get<double>()); }

// Every plottable value of one line: the numeric top-level fields, and the MoE layers' extremes.
std::map<std::string, double> line_values(const nlohmann::json& j) {
  std::map<std::string, double> out;
  for (auto& [k, v] : j.items())
    if (is_number(v)) out[k] = v.get<double>();
  auto moe = j.find("moe");
  if (moe != j.end() && moe->is_array()) {
    for (auto& layer : *moe) {
      if (!layer.is_object()) continue;
      for (auto& [k, v] : layer.items()) {
        if (k == "layer" || !is_number(v)) continue;
        const std::string name = "moe." + k;
        const double x = v.get<double>();
        auto it = out.find(name);
        if (it == out.end())
          out[name] = x;
        else
          it->second = k == "load_min" ? std::min(it->second, x) : std::max(it->second, x);
      }
      const double mean = is_number(layer.value("load_mean", nlohmann::json())) ? layer["load_mean"].get<double>() : 0;
      if (mean > 0) {
        if (is_number(layer.value("load_max", nlohmann::json()))) {
          const double r = layer["load_max"].get<double>() / mean;
          auto [it, fresh] = out.emplace("moe.load_max_ratio", r);
          if (!fresh) it->second = std::max(it->second, r);
        }
        if (is_number(layer.value("load_min", nlohmann::json()))) {
          const double r = layer["load_min"].get<double>() / mean;
          auto [it, fresh] = out.emplace("moe.load_min_ratio", r);
          if (!fresh) it->second = std::min(it->second, r);
        }
      }
    }
  }
  for (const char* k : {"step", "tokens", "elapsed_s"}) out.erase(k);
  return out;
}

// The run directory's name for a label: "runs/moe-d128/" and "runs/moe-d128/metrics.jsonl" both
// give "moe-d128".
std::string default_label(const fs::path& input, bool is_dir) {
  fs::path p = input.lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  if (is_dir) return p.filename().string();
  if (p.filename() == "metrics.jsonl" && !p.parent_path().filename().empty()) return p.parent_path().filename().string();
  return p.stem().string();
}

// Linear interpolation of the elapsed time at `step` from the lines that carry it (the validation
// lines do not); clamped at both ends.
double elapsed_at(const std::vector<std::pair<double, double>>& t, double step) {
  if (t.empty()) return NAN;
  if (step <= t.front().first) return t.front().second;
  if (step >= t.back().first) return t.back().second;
  auto hi = std::lower_bound(t.begin(), t.end(), step, [](const auto& p, double s) { return p.first < s; });
  auto lo = hi - 1;
  if (hi->first == lo->first) return hi->second;
  return lo->second + (hi->second - lo->second) * (step - lo->first) / (hi->first - lo->first);
}

std::string x_title(const std::string& x) {
  if (x == "tokens") return "tokens";
  if (x == "flops") return "compute C (FLOPs: 3 x forward without LM head x tokens)";
  if (x == "time") return "wall time (s)";
  return "step";
}

// Panels: the metrics in the order asked, loss and val_loss sharing the first one's panel.
std::vector<std::vector<std::string>> panel_groups(const std::vector<std::string>& y) {
  std::vector<std::vector<std::string>> g;
  int loss_panel = -1;
  for (auto& m : y) {
    const bool lossy = m == "loss" || m == "val_loss";
    if (lossy && loss_panel >= 0) {
      g[size_t(loss_panel)].push_back(m);
      continue;
    }
    if (lossy) loss_panel = int(g.size());
    g.push_back({m});
  }
  return g;
}

}  // namespace

RunCurves read_run_curves(const fs::path& input, const std::string& x, const std::vector<std::string>& metrics) {
  if (x != "step" && x != "tokens" && x != "flops" && x != "time")
    fail("--x: unknown axis '{}' (expected step, tokens, flops or time)", x);
  RunCurves rc;
  std::error_code ec;
  const bool is_dir = fs::is_directory(input, ec);
  if (is_dir) {
    rc.metrics = input / "metrics.jsonl";
    if (!fs::exists(rc.metrics, ec)) {
      if (fs::is_directory(input / "runs", ec))
        fail("{}: no metrics.jsonl here; a ladder results directory? pass its runs, e.g. {}/runs/*", input.string(),
             input.string());
      fail("{}: no metrics.jsonl (expected a run directory written by `ladder train`, or a metrics.jsonl file)",
           input.string());
    }
  } else {
    if (!fs::exists(input, ec)) fail("{}: no such file or directory", input.string());
    rc.metrics = input;
  }
  rc.label = default_label(input, is_dir);

  if (x == "flops") {
    const fs::path cfg = rc.metrics.parent_path() / "config.yaml";
    if (!fs::exists(cfg, ec))
      fail("--x flops: {} has no run config beside it ({} not found), so its compute per token is unknown",
           rc.metrics.string(), cfg.string());
    Config c = load_config(cfg);
    if (c.model.vocab_size <= 0) fail("{}: model.vocab_size is not set (expected the config `ladder train` wrote)", cfg.string());
    rc.compute_per_token = run_compute(c.model, 1.0);
  }

  std::vector<Record> recs;
  std::set<std::string> names;
  read_metrics(rc.metrics, [&](long lineno, const nlohmann::json& j) {
    auto st = j.find("step");
    if (st == j.end()) return;  // a line that is not a step's (none today; kept by the writer)
    if (!is_number(*st)) fail("{}:{}: \"step\" is not a number", rc.metrics.string(), lineno);
    Record r;
    r.step = st->get<double>();
    if (is_number(j.value("tokens", nlohmann::json()))) r.tokens = j["tokens"].get<double>();
    if (is_number(j.value("elapsed_s", nlohmann::json()))) r.elapsed = j["elapsed_s"].get<double>();
    r.values = line_values(j);
    for (auto& [k, v] : r.values) names.insert(k);
    recs.push_back(std::move(r));
  });
  rc.available.assign(names.begin(), names.end());
  std::stable_sort(recs.begin(), recs.end(), [](const Record& a, const Record& b) { return a.step < b.step; });

  std::vector<std::pair<double, double>> times;  // (step, elapsed_s) of the lines that carry it
  for (auto& r : recs)
    if (r.elapsed) times.emplace_back(r.step, *r.elapsed);

  for (auto& m : metrics) {
    auto& pts = rc.series[m];
    for (auto& r : recs) {
      auto v = r.values.find(m);
      if (v == r.values.end()) continue;
      double xv = r.step;
      if (x == "tokens" || x == "flops") {
        if (!r.tokens) continue;
        xv = *r.tokens * (x == "flops" ? rc.compute_per_token : 1.0);
      } else if (x == "time") {
        xv = r.elapsed ? *r.elapsed : elapsed_at(times, r.step);
        if (!std::isfinite(xv)) continue;
      }
      pts.emplace_back(xv, v->second);
    }
  }

  std::vector<double> rates, mfus;
  for (auto& r : recs) {
    rc.last_step = std::max(rc.last_step, (long long)r.step);
    if (r.tokens) rc.tokens = std::max(rc.tokens, *r.tokens);
    auto get = [&](const char* k) -> const double* {
      auto it = r.values.find(k);
      return it == r.values.end() ? nullptr : &it->second;
    };
    if (auto v = get("loss")) rc.last_loss = *v, rc.has_loss = true;
    if (auto v = get("val_loss")) {
      rc.best_val = rc.has_val ? std::min(rc.best_val, *v) : *v;
      rc.last_val = *v;
      rc.has_val = true;
    }
    if (auto v = get("tokens_per_s")) rates.push_back(*v);
    if (auto v = get("mfu")) mfus.push_back(*v);
  }
  rc.tokens_per_s = rates.empty() ? 0 : median(rates);
  rc.mfu = mfus.empty() ? 0 : median(mfus);
  return rc;
}

std::vector<std::pair<double, double>> ema(const std::vector<std::pair<double, double>>& pts, double a) {
  if (!(a > 0)) return pts;
  std::vector<std::pair<double, double>> out;
  out.reserve(pts.size());
  double s = 0, w = 1;  // w = a^n: the weight the zero start still has, divided out
  for (auto& [x, v] : pts) {
    s = a * s + (1 - a) * v;
    w *= a;
    out.emplace_back(x, s / (1 - w));
  }
  return out;
}

std::string curves_svg(const std::vector<RunCurves>& runs, const PlotOptions& opt) {
  std::vector<svg::Panel> panels;
  for (auto& group : panel_groups(opt.y)) {
    svg::Panel p;
    for (auto& m : group) p.y_title += (p.y_title.empty() ? "" : " / ") + m;
    if (group.size() == 2) p.y_title = "loss";
    for (size_t i = 0; i < runs.size(); ++i)
      for (auto& m : group) {
        auto it = runs[i].series.find(m);
        if (it == runs[i].series.end()) continue;
        svg::Curve cv;
        cv.label = runs[i].label, cv.color = svg::color(i);
        for (auto& pt : it->second)
          if (pt.first >= opt.xmin && pt.first <= opt.xmax) cv.pts.push_back(pt);
        if (m.rfind("val_", 0) == 0) {  // evaluated now and then: dashed, a marker per evaluation
          cv.dashed = cv.markers = true;
          cv.tooltip_prefix = fmt::format("{}: {} at {}", runs[i].label, m, opt.x);
        } else if (opt.smooth > 0 && m != "lr") {  // lr is the schedule: nothing to smooth
          svg::Curve raw = cv;  // the raw values, faint under their average
          raw.label.clear(), raw.width = 1, raw.opacity = 0.25;
          p.curves.push_back(raw);
          cv.pts.clear();  // averaged over every point, then cut: the average at xmin has its past
          for (auto& pt : ema(it->second, opt.smooth))
            if (pt.first >= opt.xmin && pt.first <= opt.xmax) cv.pts.push_back(pt);
          cv.width = 1.6;
        }
        p.curves.push_back(cv);
      }
    if (group.size() == 2)
      p.styles = {{opt.smooth > 0 ? fmt::format("train loss (EMA {:g})", opt.smooth) : "train loss", false},
                  {"validation loss", true}};
    panels.push_back(std::move(p));
  }
  std::string ys;
  for (auto& m : opt.y) ys += (ys.empty() ? "" : ", ") + m;
  const std::string title =
      opt.title.empty() ? fmt::format("{} vs {}", ys, opt.x == "flops" ? "compute" : opt.x) : opt.title;
  return svg::line_panels(title, panels, x_title(opt.x), opt.log_x, opt.log_y);
}

std::string curves_summary(const std::vector<RunCurves>& runs) {
  size_t w = 3;
  for (auto& r : runs) w = std::max(w, r.label.size());
  std::string s = fmt::format("{:<{}}  {:>7}  {:>9}  {:>9}  {:>9}  {:>9}  {:>10}  {:>6}\n", "run", w, "steps", "tokens",
                              "loss", "val_loss", "best_val", "tokens/s", "MFU");
  auto num = [](bool ok, double v) { return ok ? fmt::format("{:.4f}", v) : std::string("-"); };
  for (auto& r : runs)
    s += fmt::format("{:<{}}  {:>7}  {:>9.3g}  {:>9}  {:>9}  {:>9}  {:>10.0f}  {:>5.1f}%\n", r.label, w, r.last_step,
                     r.tokens, num(r.has_loss, r.last_loss), num(r.has_val, r.last_val),
                     num(r.has_val, r.best_val), r.tokens_per_s, 100 * r.mfu);
  return s;
}

int plot_cli(const PlotOptions& given) {
  PlotOptions opt = given;
  std::vector<std::string> ys;  // each metric once (--y loss,loss would draw it twice)
  for (auto& m : opt.y)
    if (std::find(ys.begin(), ys.end(), m) == ys.end()) ys.push_back(m);
  opt.y = ys;
  if (opt.inputs.empty()) fail("ladder plot: no run given (expected run directories or metrics.jsonl files)");
  if (!opt.labels.empty() && opt.labels.size() != opt.inputs.size())
    fail("--label: {} labels for {} runs (expected one per run, comma-separated)", opt.labels.size(), opt.inputs.size());
  if (!(opt.smooth >= 0 && opt.smooth < 1)) fail("--smooth: {} is not in [0, 1) (the EMA's weight on the past)", opt.smooth);
  if (opt.y.empty()) fail("--y: no metric given (e.g. --y loss,val_loss,lr)");
  if (!(opt.xmin < opt.xmax)) fail("--xmin {} is not below --xmax {}", opt.xmin, opt.xmax);
  std::vector<RunCurves> runs;
  for (size_t i = 0; i < opt.inputs.size(); ++i) {
    runs.push_back(read_run_curves(opt.inputs[i], opt.x, opt.y));
    if (!opt.labels.empty()) runs.back().label = opt.labels[i];
  }
  // Two runs called alike (".../s1/moe" and ".../s2/moe") get their parents' names too.
  for (size_t i = 0; i < runs.size() && opt.labels.empty(); ++i)
    for (size_t k = i + 1; k < runs.size(); ++k)
      if (runs[k].label == runs[i].label) {
        for (auto* r : {&runs[i], &runs[k]}) {
          fs::path p = fs::absolute(r->metrics).parent_path();
          r->label = p.parent_path().filename().string() + "/" + p.filename().string();
        }
      }
  // A metric on no line of any run is a typo or a metric this kind of run does not log.
  for (auto& m : opt.y) {
    bool any = false;
    for (auto& r : runs) any = any || !r.series[m].empty();
    if (!any) {
      std::set<std::string> names;
      for (auto& r : runs) names.insert(r.available.begin(), r.available.end());
      std::string list;
      for (auto& n : names) list += (list.empty() ? "" : ", ") + n;
      fail("--y {}: no run has this metric (metrics found: {})", m, list.empty() ? "none" : list);
    }
  }
  write_file_atomic(opt.out, curves_svg(runs, opt));
  fmt::print("{}written: {}\n", curves_summary(runs), opt.out.string());
  return 0;
}

}  // namespace ladder
