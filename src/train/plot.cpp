#include "train/plot.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "core/error.h"
#include "core/fileio.h"
#include "core/stats.h"
#include "ladder/svg.h"
#include "model/config.h"
#include "model/flops.h"

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

std::string axis_label(double v, bool log) {
  if (log) return svg::tick_label(v, true);
  if (v == 0 || std::fabs(v) < 1e5) return fmt::format("{:g}", v);
  int e = int(std::floor(std::log10(std::fabs(v)) + 1e-9));
  return fmt::format("{:g}e{}", std::round(v / std::pow(10.0, e) * 1000) / 1000, e);
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

  std::ifstream in(rc.metrics, std::ios::binary);
  if (!in) fail("{}: cannot be read", rc.metrics.string());
  std::vector<Record> recs;
  std::set<std::string> names;
  std::string line;
  long lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    const bool last_unterminated = in.eof();  // a live run's line still being written
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      if (last_unterminated) break;
      fail("{}:{}: not a JSON object (expected one metrics object per line, as `ladder train` writes)",
           rc.metrics.string(), lineno);
    }
    auto st = j.find("step");
    if (st == j.end()) continue;  // a line that is not a step's (none today; kept by the writer)
    if (!is_number(*st)) fail("{}:{}: \"step\" is not a number", rc.metrics.string(), lineno);
    Record r;
    r.step = st->get<double>();
    if (is_number(j.value("tokens", nlohmann::json()))) r.tokens = j["tokens"].get<double>();
    if (is_number(j.value("elapsed_s", nlohmann::json()))) r.elapsed = j["elapsed_s"].get<double>();
    r.values = line_values(j);
    for (auto& [k, v] : r.values) names.insert(k);
    recs.push_back(std::move(r));
  }
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
  const auto groups = panel_groups(opt.y);
  const double W = 860, L = 80, R = 230, T = 44, PH = 300, GAP = 56;
  const double H = T + double(groups.size()) * (PH + GAP) + 10;
  svg::Canvas c(W, H);
  std::string ys;
  for (auto& m : opt.y) ys += (ys.empty() ? "" : ", ") + m;
  c.text(W / 2, 22, opt.title.empty() ? fmt::format("{} vs {}", ys, opt.x == "flops" ? "compute" : opt.x) : opt.title,
         15, "middle");

  for (size_t g = 0; g < groups.size(); ++g) {
    const double top = T + double(g) * (PH + GAP), bottom = top + PH - 40;
    // Ranges over every run's points of this panel (positive ones on a log axis).
    double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
    for (auto& r : runs)
      for (auto& m : groups[g]) {
        auto it = r.series.find(m);
        if (it == r.series.end()) continue;
        for (auto& [x, y] : it->second) {
          if ((opt.log_x && !(x > 0)) || (opt.log_y && !(y > 0))) continue;
          xlo = std::min(xlo, x), xhi = std::max(xhi, x), ylo = std::min(ylo, y), yhi = std::max(yhi, y);
        }
      }
    std::string panel;
    for (auto& m : groups[g]) panel += (panel.empty() ? "" : " / ") + m;
    c.rect(L, top, W - R - L, bottom - top, "none", "#999");
    c.text(22, (top + bottom) / 2, groups[g].size() == 2 ? "loss" : panel, 12, "middle", "#222", -90);
    if (!(xhi >= xlo)) {
      c.text((L + W - R) / 2, (top + bottom) / 2, fmt::format("no {} points", panel), 13, "middle", "#888");
      continue;
    }
    if (xhi == xlo) xlo = opt.log_x ? xlo / 2 : xlo - 1, xhi = opt.log_x ? xhi * 2 : xhi + 1;
    if (yhi == ylo) ylo = opt.log_y ? ylo / 2 : ylo - 1, yhi = opt.log_y ? yhi * 2 : yhi + 1;
    svg::Scale xs{xlo, xhi, L, W - R, opt.log_x};
    const double pad = opt.log_y ? 0 : 0.04 * (yhi - ylo);
    svg::Scale yv{opt.log_y ? ylo / 1.05 : ylo - pad, opt.log_y ? yhi * 1.05 : yhi + pad, bottom, top, opt.log_y};
    for (double t : xs.ticks(7)) {
      c.line(xs(t), top, xs(t), bottom, "#eee");
      c.line(xs(t), bottom, xs(t), bottom + 5, "#666");
      c.text(xs(t), bottom + 18, axis_label(t, opt.log_x), 11, "middle");
    }
    for (double t : yv.ticks(6)) {
      c.line(L, yv(t), W - R, yv(t), "#eee");
      c.line(L - 5, yv(t), L, yv(t), "#666");
      c.text(L - 8, yv(t) + 4, axis_label(t, opt.log_y), 11, "end");
    }
    c.text((L + W - R) / 2, bottom + 36, x_title(opt.x), 12, "middle");

    for (size_t i = 0; i < runs.size(); ++i) {
      const std::string& col = svg::color(i);
      for (auto& m : groups[g]) {
        auto it = runs[i].series.find(m);
        if (it == runs[i].series.end()) continue;
        const bool val = m.rfind("val_", 0) == 0;  // evaluated now and then: dashed, with markers
        auto to_px = [&](const std::vector<std::pair<double, double>>& pts) {
          std::vector<std::pair<double, double>> px;
          for (auto& [x, y] : pts)
            if ((!opt.log_x || x > 0) && (!opt.log_y || y > 0)) px.emplace_back(xs(x), yv(y));
          return px;
        };
        if (val) {
          c.polyline(to_px(it->second), col, 1.5, "5,3");
          for (auto& [x, y] : it->second)
            if ((!opt.log_x || x > 0) && (!opt.log_y || y > 0))
              c.circle(xs(x), yv(y), 2.8, col, "white", fmt::format("{}: {} {:.4g}, {} {:g}", runs[i].label, m, y, opt.x, x));
        } else if (opt.smooth > 0 && m != "lr") {  // lr is the schedule: nothing to smooth
          c.polyline(to_px(it->second), col, 1, "", 0.25);  // the raw values, faint under their average
          c.polyline(to_px(ema(it->second, opt.smooth)), col, 1.6);
        } else {
          c.polyline(to_px(it->second), col, 1.5);
        }
      }
    }
    // Legend, beside each panel: the runs with points in it, then the line styles where the panel
    // mixes them.
    double ly = top + 14;
    for (size_t i = 0; i < runs.size(); ++i) {
      bool any = false;
      for (auto& m : groups[g]) {
        auto it = runs[i].series.find(m);
        any = any || (it != runs[i].series.end() && !it->second.empty());
      }
      if (!any) continue;
      c.line(W - R + 12, ly - 4, W - R + 34, ly - 4, svg::color(i), 2.5);
      c.text(W - R + 40, ly, runs[i].label, 12);
      ly += 18;
    }
    if (groups[g].size() == 2) {
      ly += 8;
      c.line(W - R + 12, ly - 4, W - R + 34, ly - 4, "#444", 1.5);
      c.text(W - R + 40, ly, opt.smooth > 0 ? fmt::format("train loss (EMA {:g})", opt.smooth) : "train loss", 12);
      ly += 18;
      c.line(W - R + 12, ly - 4, W - R + 34, ly - 4, "#444", 1.5, "5,3");
      c.circle(W - R + 23, ly - 4, 2.8, "#444", "white");
      c.text(W - R + 40, ly, "validation loss", 12);
    }
  }
  return c.str();
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

int plot_cli(const PlotOptions& opt) {
  if (opt.inputs.empty()) fail("ladder plot: no run given (expected run directories or metrics.jsonl files)");
  if (!opt.labels.empty() && opt.labels.size() != opt.inputs.size())
    fail("--label: {} labels for {} runs (expected one per run, comma-separated)", opt.labels.size(), opt.inputs.size());
  if (!(opt.smooth >= 0 && opt.smooth < 1)) fail("--smooth: {} is not in [0, 1) (the EMA's weight on the past)", opt.smooth);
  if (opt.y.empty()) fail("--y: no metric given (e.g. --y loss,val_loss,lr)");
  std::vector<RunCurves> runs;
  for (size_t i = 0; i < opt.inputs.size(); ++i) {
    runs.push_back(read_run_curves(opt.inputs[i], opt.x, opt.y));
    if (!opt.labels.empty()) runs.back().label = opt.labels[i];
  }
  // Two runs called alike (".../s1/moe" and ".../s2/moe") get their parents' names too.
  for (size_t i = 0; i < runs.size(); ++i)
    for (size_t k = 0; k < runs.size() && opt.labels.empty(); ++k)
      if (k != i && runs[k].label == runs[i].label) {
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
