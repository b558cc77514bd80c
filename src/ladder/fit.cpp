#include "ladder/fit.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "core/error.h"

namespace ladder {

double PowerLaw::loss(double C) const { return E + A * std::pow(C, -alpha); }

double PowerLaw::compute_for(double L) const {
  if (!(alpha > 0) || !(A > 0)) return std::numeric_limits<double>::quiet_NaN();
  if (L <= E) return std::numeric_limits<double>::infinity();
  return std::pow(A / (L - E), 1.0 / alpha);
}

namespace {

// Internal parametrization for conditioning: f(C) = E + exp(a - alpha * x), x = ln C - m, m the mean
// of ln C over the points, so a is the log-amplitude at the centre of the data (A = exp(a + alpha*m)).
struct Param {
  double E, a, alpha;
};

double sse(const std::vector<double>& x, const std::vector<double>& y, const Param& p) {
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    double r = p.E + std::exp(p.a - p.alpha * x[i]) - y[i];
    s += r * r;
  }
  return s;
}

// Least squares for (a, alpha) given E: ln(y - E) = a - alpha x (alpha fixed when !fit_alpha).
bool loglinear(const std::vector<double>& x, const std::vector<double>& y, double E, bool fit_alpha, Param& p) {
  const size_t n = x.size();
  std::vector<double> z(n);
  for (size_t i = 0; i < n; ++i) {
    if (y[i] - E <= 0) return false;
    z[i] = std::log(y[i] - E);
  }
  double mx = 0, mz = 0;
  for (size_t i = 0; i < n; ++i) mx += x[i] / n, mz += z[i] / n;
  p.E = E;
  if (fit_alpha) {
    double sxz = 0, sxx = 0;
    for (size_t i = 0; i < n; ++i) sxz += (x[i] - mx) * (z[i] - mz), sxx += (x[i] - mx) * (x[i] - mx);
    if (sxx <= 0) return false;
    p.alpha = -sxz / sxx;
  }
  p.a = mz + p.alpha * mx;
  return true;
}

// Solves the k x k system M d = g (k <= 3) by Gaussian elimination with partial pivoting.
bool solve(double M[3][3], double g[3], int k, double d[3]) {
  for (int c = 0; c < k; ++c) {
    int piv = c;
    for (int r = c + 1; r < k; ++r)
      if (std::fabs(M[r][c]) > std::fabs(M[piv][c])) piv = r;
    if (std::fabs(M[piv][c]) < 1e-300) return false;
    std::swap(M[c], M[piv]);
    std::swap(g[c], g[piv]);
    for (int r = c + 1; r < k; ++r) {
      double f = M[r][c] / M[c][c];
      for (int j = c; j < k; ++j) M[r][j] -= f * M[c][j];
      g[r] -= f * g[c];
    }
  }
  for (int r = k - 1; r >= 0; --r) {
    double s = g[r];
    for (int j = r + 1; j < k; ++j) s -= M[r][j] * d[j];
    d[r] = s / M[r][r];
  }
  return true;
}

// Levenberg-Marquardt over the free parameters (always a; E and alpha when flagged), E kept below
// min(y) and >= 0 by rejecting steps that leave that region.
Param levenberg_marquardt(const std::vector<double>& x, const std::vector<double>& y, Param p, bool fit_E,
                          bool fit_alpha) {
  const double ymin = *std::min_element(y.begin(), y.end());
  double lambda = 1e-3, cur = sse(x, y, p);
  for (int it = 0; it < 200; ++it) {
    // Free parameter order: a, [E], [alpha].
    int k = 1 + fit_E + fit_alpha;
    double JtJ[3][3] = {}, Jtr[3] = {};
    for (size_t i = 0; i < x.size(); ++i) {
      double e = std::exp(p.a - p.alpha * x[i]);
      double r = p.E + e - y[i];
      double J[3];
      int c = 0;
      J[c++] = e;
      if (fit_E) J[c++] = 1.0;
      if (fit_alpha) J[c++] = -x[i] * e;
      for (int u = 0; u < k; ++u) {
        Jtr[u] += J[u] * r;
        for (int v = 0; v < k; ++v) JtJ[u][v] += J[u] * J[v];
      }
    }
    bool improved = false;
    for (int tries = 0; tries < 20 && !improved; ++tries) {
      double M[3][3], g[3], d[3] = {0, 0, 0};
      for (int u = 0; u < k; ++u) {
        for (int v = 0; v < k; ++v) M[u][v] = JtJ[u][v];
        M[u][u] += lambda * (JtJ[u][u] > 0 ? JtJ[u][u] : 1.0);
        g[u] = -Jtr[u];
      }
      if (!solve(M, g, k, d)) {
        lambda *= 10;
        continue;
      }
      Param q = p;
      int c = 0;
      q.a += d[c++];
      if (fit_E) q.E += d[c++];
      if (fit_alpha) q.alpha += d[c++];
      double s = (q.E >= 0 && q.E < ymin) ? sse(x, y, q) : std::numeric_limits<double>::infinity();
      if (s < cur) {
        improved = true;
        double rel = (cur - s) / std::max(cur, 1e-300);
        p = q;
        cur = s;
        lambda = std::max(lambda / 10, 1e-12);
        if (rel < 1e-14) return p;
      } else {
        lambda *= 10;
      }
    }
    if (!improved) break;
  }
  return p;
}

}  // namespace

PowerLaw fit_power_law(const std::vector<LawPoint>& pts, double E0, double alpha0) {
  if (pts.empty()) fail("internal error: power-law fit of no points");
  std::vector<double> lx, y;
  std::set<double> distinct;
  double m = 0;
  for (auto& p : pts) {
    if (!(p.C > 0) || !std::isfinite(p.loss)) fail("power-law fit: compute must be > 0 and loss finite (C={}, loss={})", p.C, p.loss);
    lx.push_back(std::log(p.C));
    y.push_back(p.loss);
    distinct.insert(p.C);
    m += std::log(p.C) / double(pts.size());
  }
  for (auto& v : lx) v -= m;
  const double ymin = *std::min_element(y.begin(), y.end());
  PowerLaw law;
  law.n_points = int(pts.size());
  law.n_distinct = int(distinct.size());
  law.fit_E = distinct.size() >= 2;
  law.fit_alpha = distinct.size() >= 3;

  Param best{E0, 0, alpha0};
  double best_sse = std::numeric_limits<double>::infinity();
  if (!law.fit_E) {
    // One compute value: only A, through the mean loss (needs E0 below it).
    if (!(ymin > E0)) fail("power-law fit: one compute value and every loss ({}) <= E ({}): raise the losses or lower E", ymin, E0);
    loglinear(lx, y, E0, false, best);
    best = levenberg_marquardt(lx, y, best, false, false);  // least squares in loss units, not log units
  } else {
    // Grid over E in [0, min loss): 400 points, denser near min loss where the fit bends sharply.
    const int K = 400;
    for (int k = 0; k < K; ++k) {
      double t = double(k) / K;
      double E = ymin * (1 - (1 - t) * (1 - t)) * (1 - 1e-9);
      Param p{E, 0, alpha0};
      if (!loglinear(lx, y, E, law.fit_alpha, p)) continue;
      double s = sse(lx, y, p);
      if (s < best_sse) best_sse = s, best = p;
    }
    best = levenberg_marquardt(lx, y, best, true, law.fit_alpha);
  }
  law.E = best.E;
  law.alpha = best.alpha;
  law.A = std::exp(best.a + best.alpha * m);
  law.rmse = std::sqrt(sse(lx, y, best) / double(pts.size()));
  // Relative to the loss scale: the grid's first point is E = 0 exactly and its last 1e-9 below
  // the lowest loss; a fit that stays within 0.1% of either end did not find an interior floor.
  law.E_at_bound = law.fit_E && (law.E < 1e-3 * ymin || law.E > ymin * (1 - 1e-3));
  return law;
}

PowerLaw law_through(double C, double L, double E, double alpha) {
  return PowerLaw{E, (L - E) * std::pow(C, alpha), alpha};
}

double marin_theoretical_speedup(double C_base, double L_base, double C_variant, double L_variant, double E,
                                 double alpha) {
  if (!(L_base > E)) return std::numeric_limits<double>::quiet_NaN();  // the baseline point is below the law's floor
  return law_through(C_base, L_base, E, alpha).compute_for(L_variant) / C_variant;
}

double realized_speedup(double theoretical, double flops_per_s_variant, double flops_per_s_base) {
  return theoretical * flops_per_s_variant / flops_per_s_base;
}

CurveReading compute_on_curve(const std::vector<LawPoint>& curve, double loss) {
  CurveReading r;
  if (curve.empty() || !std::isfinite(loss)) return r;
  for (auto& p : curve)
    if (!(p.C > 0) || !std::isfinite(p.C) || !std::isfinite(p.loss)) return r;
  std::vector<int> order(curve.size());  // indices in compute order (the caller's indices come back)
  for (size_t i = 0; i < order.size(); ++i) order[i] = int(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return curve[a].C < curve[b].C; });
  auto at_point = [&](int i) { return r.C = curve[i].C, r.lo = r.hi = i, r; };
  for (size_t k = 0; k + 1 < order.size(); ++k) {
    const LawPoint &a = curve[order[k]], &b = curve[order[k + 1]];
    if ((a.loss - loss) * (b.loss - loss) > 0) continue;  // both ends on one side
    if (a.loss == loss) return at_point(order[k]);
    if (b.loss == loss) return at_point(order[k + 1]);
    const double t = (a.loss - loss) / (a.loss - b.loss);
    r.C = std::exp(std::log(a.C) + t * (std::log(b.C) - std::log(a.C)));
    r.lo = order[k], r.hi = order[k + 1];
    return r;
  }
  if (curve.size() == 1 && curve[0].loss == loss) return at_point(0);
  const bool below = std::all_of(curve.begin(), curve.end(), [&](const LawPoint& p) { return loss < p.loss; });
  r.bound = below ? +1 : -1;
  r.C = curve[below ? order.back() : order.front()].C;
  return r;
}

double law_speedup(const PowerLaw& base, const PowerLaw& variant, double C_variant) {
  return base.compute_for(variant.loss(C_variant)) / C_variant;
}

}  // namespace ladder
