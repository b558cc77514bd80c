// A small SVG writer: the few primitives the report's plots need, with XML escaping, plus axis
// helpers (linear and log10 scales with readable ticks). Output is a standalone <svg> element that
// can also be inlined in HTML.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace ladder::svg {

// Escapes &, <, >, " and ' for text and attribute values.
std::string escape(const std::string& s);

class Canvas {
 public:
  Canvas(double width, double height);
  void line(double x1, double y1, double x2, double y2, const std::string& color, double width = 1,
            const std::string& dash = "");
  void polyline(const std::vector<std::pair<double, double>>& pts, const std::string& color, double width = 1.5,
                const std::string& dash = "", double opacity = 1);
  void circle(double x, double y, double r, const std::string& fill, const std::string& stroke = "none",
              const std::string& title = "");
  void rect(double x, double y, double w, double h, const std::string& fill, const std::string& stroke = "none");
  // anchor: start | middle | end; rotate: degrees about (x, y)
  void text(double x, double y, const std::string& s, double size = 12, const std::string& anchor = "start",
            const std::string& color = "#222", double rotate = 0);
  std::string str() const;  // the complete <svg> element

 private:
  double w_, h_;
  std::string body_;
};

// Maps data values to pixels; log scales map log10(v).
struct Scale {
  double lo = 0, hi = 1;  // data range
  double p0 = 0, p1 = 1;  // pixel range
  bool log = false;
  double operator()(double v) const;
  // Tick values: decades (log) or 1/2/5 x 10^k steps (linear), within [lo, hi].
  std::vector<double> ticks(int target = 6) const;
};

// A figure of line panels stacked vertically, sharing one kind of x axis (`ladder plot`'s metrics,
// the report's validation curves per width). Each panel scales to its own points (positive ones
// only on a log axis) and has a legend beside it.
struct Curve {
  std::string label;                          // legend entry ("" = none; equal labels listed once)
  std::string color;
  std::vector<std::pair<double, double>> pts; // data coordinates
  bool dashed = false;
  bool markers = false;                       // a marker with a tooltip at every point
  double width = 1.5, opacity = 1;
  std::string tooltip_prefix;                 // the markers' tooltips: "<prefix> x, y"
};
struct Panel {
  std::string y_title;
  std::vector<Curve> curves;
  std::vector<std::pair<std::string, bool>> styles;  // extra legend lines: (text, dashed), in grey
};
std::string line_panels(const std::string& title, const std::vector<Panel>& panels, const std::string& x_title,
                        bool log_x, bool log_y);

// "1e12", "3.2", "0.05": short tick labels.
std::string tick_label(double v, bool log);

// A qualitative palette (distinct colours for up to 10 series; then repeats).
const std::string& color(size_t i);

}  // namespace ladder::svg
