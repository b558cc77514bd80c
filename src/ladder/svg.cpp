#include "ladder/svg.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace ladder::svg {

std::string escape(const std::string& s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&apos;"; break;
      default: o += c;
    }
  }
  return o;
}

namespace {
// Coordinates with two decimals: small files, no locale dependence (fmt ignores the C locale).
std::string n(double v) { return fmt::format("{:.2f}", std::isfinite(v) ? v : 0.0); }
std::string dash_attr(const std::string& d) { return d.empty() ? "" : " stroke-dasharray=\"" + escape(d) + "\""; }
}  // namespace

Canvas::Canvas(double w, double h) : w_(w), h_(h) {}

void Canvas::line(double x1, double y1, double x2, double y2, const std::string& c, double w, const std::string& d) {
  body_ += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"{}\"{}/>\n", n(x1),
                       n(y1), n(x2), n(y2), escape(c), n(w), dash_attr(d));
}

void Canvas::polyline(const std::vector<std::pair<double, double>>& pts, const std::string& c, double w,
                      const std::string& d, double opacity) {
  if (pts.size() < 2) return;
  std::string p;
  for (auto& [x, y] : pts) p += fmt::format("{}{},{}", p.empty() ? "" : " ", n(x), n(y));
  const std::string op = opacity < 1 ? fmt::format(" stroke-opacity=\"{}\"", n(opacity)) : "";
  body_ += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"{}\"{}{}/>\n", p,
                       escape(c), n(w), dash_attr(d), op);
}

void Canvas::circle(double x, double y, double r, const std::string& fill, const std::string& stroke,
                    const std::string& title) {
  std::string head = fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"{}\" fill=\"{}\" stroke=\"{}\"", n(x), n(y), n(r),
                                 escape(fill), escape(stroke));
  body_ += title.empty() ? head + "/>\n" : head + "><title>" + escape(title) + "</title></circle>\n";
}

void Canvas::rect(double x, double y, double w, double h, const std::string& fill, const std::string& stroke) {
  body_ += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\" stroke=\"{}\"/>\n", n(x), n(y),
                       n(w), n(h), escape(fill), escape(stroke));
}

void Canvas::text(double x, double y, const std::string& s, double size, const std::string& anchor,
                  const std::string& c, double rotate) {
  std::string rot = rotate != 0 ? fmt::format(" transform=\"rotate({} {} {})\"", n(rotate), n(x), n(y)) : "";
  body_ += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"{}\" text-anchor=\"{}\" fill=\"{}\"{}>{}</text>\n", n(x),
                       n(y), n(size), escape(anchor), escape(c), rot, escape(s));
}

std::string Canvas::str() const {
  return fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" viewBox=\"0 0 {} {}\" "
      "font-family=\"sans-serif\">\n<rect x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"white\"/>\n{}</svg>\n",
      n(w_), n(h_), n(w_), n(h_), n(w_), n(h_), body_);
}

double Scale::operator()(double v) const {
  double a = log ? std::log10(lo) : lo, b = log ? std::log10(hi) : hi, x = log ? std::log10(v) : v;
  if (b == a) return 0.5 * (p0 + p1);
  return p0 + (x - a) / (b - a) * (p1 - p0);
}

std::vector<double> Scale::ticks(int target) const {
  std::vector<double> t;
  if (log) {
    int a = int(std::floor(std::log10(lo))), b = int(std::ceil(std::log10(hi)));
    int step = std::max(1, (b - a) / std::max(1, target));
    for (int k = a; k <= b; k += step) {
      double v = std::pow(10.0, k);
      if (v >= lo * (1 - 1e-9) && v <= hi * (1 + 1e-9)) t.push_back(v);
    }
    if (t.size() < 2) {  // less than a decade: 1-2-5 within it
      t.clear();
      for (int k = a - 1; k <= b; ++k)
        for (double m : {1.0, 2.0, 5.0}) {
          double v = m * std::pow(10.0, k);
          if (v >= lo && v <= hi) t.push_back(v);
        }
    }
    return t;
  }
  double span = hi - lo;
  if (!(span > 0)) return {lo};
  double raw = span / std::max(1, target), mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  for (double v = std::ceil(lo / step) * step; v <= hi + 1e-9 * step; v += step) t.push_back(std::fabs(v) < 1e-12 * step ? 0 : v);
  return t;
}

std::string tick_label(double v, bool log) {
  if (log) {
    int e = int(std::floor(std::log10(v) + 1e-9));
    double m = v / std::pow(10.0, e);
    if (std::fabs(e) >= 3) return std::fabs(m - 1) < 1e-6 ? fmt::format("1e{}", e) : fmt::format("{:g}e{}", m, e);
  }
  return fmt::format("{:g}", v);
}

namespace {
// Linear labels stay plain up to 1e5, then "2.5e12"; log ones as tick_label.
std::string axis_label(double v, bool log) {
  if (log) return tick_label(v, true);
  if (v == 0 || std::fabs(v) < 1e5) return fmt::format("{:g}", v);
  int e = int(std::floor(std::log10(std::fabs(v)) + 1e-9));
  return fmt::format("{:g}e{}", std::round(v / std::pow(10.0, e) * 1000) / 1000, e);
}
}  // namespace

std::string line_panels(const std::string& title, const std::vector<Panel>& panels, const std::string& x_title,
                        bool log_x, bool log_y) {
  const double W = 860, L = 80, R = 230, T = 44, PH = 300, GAP = 56;
  Canvas c(W, T + double(panels.size()) * (PH + GAP) + 10);
  c.text(W / 2, 22, title, 15, "middle");
  auto shown = [&](double x, double y) { return std::isfinite(x) && std::isfinite(y) && (!log_x || x > 0) && (!log_y || y > 0); };
  for (size_t g = 0; g < panels.size(); ++g) {
    const Panel& p = panels[g];
    const double top = T + double(g) * (PH + GAP), bottom = top + PH - 40;
    double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
    for (auto& cv : p.curves)
      for (auto& [x, y] : cv.pts)
        if (shown(x, y)) xlo = std::min(xlo, x), xhi = std::max(xhi, x), ylo = std::min(ylo, y), yhi = std::max(yhi, y);
    c.rect(L, top, W - R - L, bottom - top, "none", "#999");
    c.text(22, (top + bottom) / 2, p.y_title, 12, "middle", "#222", -90);
    if (!(xhi >= xlo)) {
      c.text((L + W - R) / 2, (top + bottom) / 2, "no " + p.y_title + " points", 13, "middle", "#888");
      continue;
    }
    if (xhi == xlo) xlo = log_x ? xlo / 2 : xlo - 1, xhi = log_x ? xhi * 2 : xhi + 1;
    if (yhi == ylo) ylo = log_y ? ylo / 2 : ylo - 1, yhi = log_y ? yhi * 2 : yhi + 1;
    Scale xs{xlo, xhi, L, W - R, log_x};
    const double pad = 0.04 * (yhi - ylo);
    Scale ys{log_y ? ylo / 1.05 : ylo - pad, log_y ? yhi * 1.05 : yhi + pad, bottom, top, log_y};
    for (double t : xs.ticks(7)) {
      c.line(xs(t), top, xs(t), bottom, "#eee");
      c.line(xs(t), bottom, xs(t), bottom + 5, "#666");
      c.text(xs(t), bottom + 18, axis_label(t, log_x), 11, "middle");
    }
    for (double t : ys.ticks(6)) {
      c.line(L, ys(t), W - R, ys(t), "#eee");
      c.line(L - 5, ys(t), L, ys(t), "#666");
      c.text(L - 8, ys(t) + 4, axis_label(t, log_y), 11, "end");
    }
    c.text((L + W - R) / 2, bottom + 36, x_title, 12, "middle");
    std::vector<std::pair<std::string, std::string>> legend;  // (label, colour) of curves with points
    for (auto& cv : p.curves) {
      std::vector<std::pair<double, double>> px;
      for (auto& [x, y] : cv.pts)
        if (shown(x, y)) px.emplace_back(xs(x), ys(y));
      if (px.empty()) continue;
      c.polyline(px, cv.color, cv.width, cv.dashed ? "5,3" : "", cv.opacity);
      if (cv.markers)
        for (auto& [x, y] : cv.pts)
          if (shown(x, y))
            c.circle(xs(x), ys(y), 2.8, cv.color, "white", fmt::format("{} {:g}, {:.4g}", cv.tooltip_prefix, x, y));
      if (!cv.label.empty() && std::none_of(legend.begin(), legend.end(), [&](auto& l) { return l.first == cv.label; }))
        legend.emplace_back(cv.label, cv.color);
    }
    double ly = top + 14;
    for (auto& [label, col] : legend) {
      c.line(W - R + 12, ly - 4, W - R + 34, ly - 4, col, 2.5);
      c.text(W - R + 40, ly, label, 12);
      ly += 18;
    }
    if (!p.styles.empty()) ly += 8;
    for (auto& [text, dashed] : p.styles) {
      c.line(W - R + 12, ly - 4, W - R + 34, ly - 4, "#444", 1.5, dashed ? "5,3" : "");
      if (dashed) c.circle(W - R + 23, ly - 4, 2.8, "#444", "white");  // the dashed curves have markers
      c.text(W - R + 40, ly, text, 12);
      ly += 18;
    }
  }
  return c.str();
}

const std::string& color(size_t i) {
  static const std::vector<std::string> p = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e",
                                             "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};
  return p[i % p.size()];
}

}  // namespace ladder::svg
