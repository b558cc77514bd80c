#include "ladder/svg.h"

#include <fmt/format.h>

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

const std::string& color(size_t i) {
  static const std::vector<std::string> p = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e",
                                             "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};
  return p[i % p.size()];
}

}  // namespace ladder::svg
