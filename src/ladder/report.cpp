#include "ladder/report.h"

#include <algorithm>
#include <array>
#include <map>
#include <set>

#include "core/error.h"
#include "core/fileio.h"
#include "core/stats.h"
#include "ladder/plan.h"
#include "ladder/store.h"
#include "ladder/svg.h"
#include "train/machine.h"
#include "train/metrics.h"

namespace fs = std::filesystem;

namespace ladder {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Where a stored result was trained: the host name, and the CPU and thread count where the result
// records them (host names alone do not tell cloud VMs apart).
std::string result_machine(const nlohmann::json& r) {
  return machine_label(r.value("host", ""), r.value("cpu", ""), r.value("threads", 0));
}

struct Obs {
  double C, L, tps;
  double fps;  // model FLOP/s without the head: C / tokens * tokens/s (what realized speedups compare)
  uint64_t seed;
  std::string host;
};
// variant -> width -> one observation per seed
using Cells = std::map<std::string, std::map<int, std::vector<Obs>>>;

struct Mean {
  double C = kNaN, L = kNaN, tps = kNaN, fps = kNaN;
  int n = 0;
};
Mean mean_of(const std::vector<Obs>& v) {
  Mean m;
  if (v.empty()) return m;
  m.C = m.L = m.tps = m.fps = 0;
  for (auto& o : v) m.C += o.C, m.L += o.L, m.tps += o.tps, m.fps += o.fps;
  m.n = int(v.size());
  m.C /= m.n, m.L /= m.n, m.tps /= m.n, m.fps /= m.n;
  return m;
}

struct VariantInfo {
  std::string baseline;
  std::vector<std::string> stacks;
  std::vector<int> widths;  // planned widths (VariantLinks::widths); empty: every width
  bool planned_at(int d) const { return widths.empty() || std::find(widths.begin(), widths.end(), d) != widths.end(); }
};

// The runs of a variant and of its baseline that a speedup compares. A variant and its baseline
// trained with one seed read the same data in the same order, and a seed's runs share an offset in
// loss (seed noise); a seed present on one side only would move that side's means and law by its
// offset and show as a speedup (or a slowdown) that is noise. So only seeds both have count, and
// at a width both have, only the seeds both have there. Runs at a width the other side lacks stay
// in their own law (of the seeds both have): they carry no unpaired offset into a compared cell.
struct Paired {
  std::map<int, std::vector<Obs>> v, b;         // per width: the runs that count, each side
  std::vector<std::string> left_out;            // "<run> (<why>)", in width then seed order
};
Paired pair_up(const std::string& vname, const std::map<int, std::vector<Obs>>& v, const std::string& bname,
               const std::map<int, std::vector<Obs>>& b) {
  auto seeds_of = [](const std::map<int, std::vector<Obs>>& x) {
    std::set<uint64_t> s;
    for (auto& [d, obs] : x)
      for (auto& o : obs) s.insert(o.seed);
    return s;
  };
  const std::set<uint64_t> sv = seeds_of(v), sb = seeds_of(b);
  auto has = [](const std::vector<Obs>& obs, uint64_t seed) {
    return std::any_of(obs.begin(), obs.end(), [&](const Obs& o) { return o.seed == seed; });
  };
  Paired p;
  auto keep = [&](const std::string& name, const std::map<int, std::vector<Obs>>& mine, const std::string& oname,
                  const std::map<int, std::vector<Obs>>& other, const std::set<uint64_t>& oseeds,
                  std::map<int, std::vector<Obs>>& out) {
    for (auto& [d, obs] : mine)
      for (auto& o : obs) {
        auto od = other.find(d);
        if (!oseeds.count(o.seed))
          p.left_out.push_back(fmt::format("{}-d{}-s{} ({} has no seed {})", name, d, o.seed, oname, o.seed));
        else if (od != other.end() && !has(od->second, o.seed))
          p.left_out.push_back(fmt::format("{}-d{}-s{} (no {}-d{}-s{})", name, d, o.seed, oname, d, o.seed));
        else
          out[d].push_back(o);
      }
  };
  keep(vname, v, bname, b, sb, p.v);
  keep(bname, b, vname, v, sv, p.b);
  return p;
}

// Point estimates of one data set (all seeds pooled, or one seed's runs): per variant its law over
// all its runs and, per width, {Marin theoretical, Marin realized, law theoretical, law realized,
// interpolated theoretical, interpolated realized} from the runs paired with its baseline's
// (pair_up); `reading` where the interpolated ones lie on the baseline's curve.
constexpr int kKinds = 6;
using Speedups = std::array<double, kKinds>;
struct CurvePlace {
  int bound = 0;                 // CurveReading::bound
  int from = 0, to = 0;          // bound 0: the baseline's widths read between
  double span = kNaN;            // bound 0: their compute ratio (the straight line's stretch)
};
struct Estimates {
  std::map<std::string, PowerLaw> laws;
  std::map<std::string, bool> law_ok;
  std::map<std::string, std::map<int, Speedups>> sp;
  std::map<std::string, std::map<int, CurvePlace>> reading;
  std::map<std::string, Paired> pairs;  // per variant with a baseline
};

bool fit_law(const std::map<int, std::vector<Obs>>& byd, double E, double alpha, PowerLaw& law) {
  std::vector<LawPoint> pts;
  for (auto& [d, obs] : byd)
    for (auto& o : obs) pts.push_back({o.C, o.L});
  if (pts.empty()) return false;
  try {
    law = fit_power_law(pts, E, alpha);
    return law.alpha > 0 && law.A > 0;
  } catch (const Error&) {
    return false;
  }
}

// variant -> width -> the model-FLOP/s ratio over its baseline from the sweep's timing, where both
// were timed: {median, smallest, largest} over the rounds (timed_flops_ratio).
using TimedRatios = std::map<std::string, std::map<int, std::array<double, 3>>>;

Estimates evaluate(const Cells& cells, const std::map<std::string, VariantInfo>& info, double E, double alpha,
                   const TimedRatios& timed) {
  Estimates est;
  for (auto& [v, byd] : cells) est.law_ok[v] = fit_law(byd, E, alpha, est.laws[v]);
  static const std::map<int, std::vector<Obs>> none;
  for (auto& [v, byd] : cells) {
    const auto& b = info.at(v).baseline;
    if (b.empty()) continue;
    auto bit = cells.find(b);
    Paired& p = est.pairs[v] = pair_up(v, byd, b, bit != cells.end() ? bit->second : none);
    // The laws of the pair: each side's own when no run was left out (the same points, the same fit).
    PowerLaw lv = est.laws[v], lb = bit != cells.end() ? est.laws[b] : PowerLaw{};
    bool ok_v = est.law_ok[v], ok_b = bit != cells.end() && est.law_ok[b];
    if (!p.left_out.empty()) {
      ok_v = fit_law(p.v, E, alpha, lv);
      ok_b = fit_law(p.b, E, alpha, lb);
    }
    // The baseline's measured curve: its paired runs' mean compute and loss at each width.
    std::vector<LawPoint> curve;
    std::vector<int> widths;  // curve[i] is the baseline's mean point at widths[i]
    for (auto& [d, obs] : p.b) {
      const Mean m = mean_of(obs);
      curve.push_back({m.C, m.L});
      widths.push_back(d);
    }
    for (auto& [d, obs] : byd) {
      Speedups s;
      s.fill(kNaN);
      if (p.v.count(d) && p.b.count(d)) {
        Mean mv = mean_of(p.v.at(d)), mb = mean_of(p.b.at(d));
        // FLOP/s of the variant and of the baseline: timed side by side where the sweep did, else
        // the training runs' own (measured whenever each run happened to train).
        double fv = mv.fps, fb = mb.fps;
        if (auto tv = timed.find(v); tv != timed.end() && tv->second.count(d)) fv = tv->second.at(d)[0], fb = 1;
        s[0] = marin_theoretical_speedup(mb.C, mb.L, mv.C, mv.L, E, alpha);
        s[1] = realized_speedup(s[0], fv, fb);
        if (ok_v && ok_b) {
          s[2] = law_speedup(lb, lv, mv.C);
          s[3] = realized_speedup(s[2], fv, fb);
        }
        const CurveReading at = compute_on_curve(curve, mv.L);
        s[4] = at.C / mv.C;
        s[5] = realized_speedup(s[4], fv, fb);
        CurvePlace& place = est.reading[v][d];
        place.bound = at.bound;
        if (at.bound == 0 && at.lo >= 0)
          place.from = widths[at.lo], place.to = widths[at.hi], place.span = curve[at.hi].C / curve[at.lo].C;
      }
      est.sp[v][d] = s;
    }
  }
  return est;
}

// Two-sided 97.5% quantile of Student's t with df degrees of freedom (table; 1/df interpolation
// between entries, the normal's 1.96 beyond 30).
double t975(int df) {
  static const std::pair<int, double> tab[] = {{1, 12.706}, {2, 4.303}, {3, 3.182}, {4, 2.776}, {5, 2.571},
                                               {6, 2.447},  {7, 2.365}, {8, 2.306}, {9, 2.262}, {10, 2.228},
                                               {12, 2.179}, {15, 2.131}, {20, 2.086}, {30, 2.042}};
  if (df <= 1) return tab[0].second;
  for (size_t i = 1; i < std::size(tab); ++i)
    if (df <= tab[i].first) {
      auto [d0, t0] = tab[i - 1];
      auto [d1, t1] = tab[i];
      double f = (1.0 / df - 1.0 / d0) / (1.0 / d1 - 1.0 / d0);
      return t0 + f * (t1 - t0);
    }
  double f = 30.0 / df;  // toward the normal quantile as df grows
  return 1.960 + f * (2.042 - 1.960);
}

// Half-width of the 95% Student-t interval on the mean of xs (at least 2 values), around `mean`.
double t_half_width(const std::vector<double>& xs, double mean) {
  double q = 0;
  for (double x : xs) q += (x - mean) * (x - mean);
  return t975(int(xs.size()) - 1) * std::sqrt(q / double(xs.size() - 1) / double(xs.size()));
}

// The gate over values that may be bounds (x, bound as in CurveReading): a missing value, n/a; a
// value <= 1 or an upper bound <= 1 at some width, FAIL; else a bound that decides nothing, n/a.
std::string gate_bounded(const std::vector<std::pair<double, int>>& xs) {
  if (xs.empty()) return "n/a";
  for (auto& [x, b] : xs)
    if (std::isnan(x)) return "n/a";
  for (auto& [x, b] : xs)
    if (b <= 0 && !(x > 1)) return "FAIL";
  for (auto& [x, b] : xs)
    if (b < 0 || !(x >= 1)) return "n/a";  // < x with x > 1, or > x with x < 1
  return "pass";
}

// The gate over point values: every one > 1 ("pass"), one <= 1 ("FAIL"), one missing ("n/a").
std::string gate(const std::vector<double>& xs) {
  std::vector<std::pair<double, int>> values;
  for (double x : xs) values.push_back({x, 0});
  return gate_bounded(values);
}

std::string sci(double v) { return fmt::format("{:.3g}", v); }

std::string html_escape(const std::string& s) { return svg::escape(s); }

}  // namespace

std::string format_speedup(double x) {
  if (std::isnan(x)) return "n/a";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return fmt::format("{:.2f}x", x);
}

namespace {
std::string format_pair(const SpeedupCell& c, const Interval& t, const Interval& r, bool with_interval,
                        const std::string& prefix) {
  if (c.n_variant == 0) return c.n_diverged > 0 ? "diverged" : "-";
  auto interval = [&](const Interval& i) {
    return with_interval && !std::isnan(i.lo) ? fmt::format(" [{}-{}]", format_speedup(i.lo), format_speedup(i.hi))
                                              : std::string();
  };
  auto value = [&](double x) { return std::isnan(x) ? format_speedup(x) : prefix + format_speedup(x); };
  return fmt::format("{}{} ({}{})", value(t.value), interval(t), value(r.value), interval(r));
}
}  // namespace

std::string format_cell(const SpeedupCell& c, bool law, bool with_interval) {
  return law ? format_pair(c, c.law_theo, c.law_real, with_interval, "")
             : format_pair(c, c.marin_theo, c.marin_real, with_interval, "");
}

std::string format_interp_cell(const SpeedupCell& c) {
  return format_pair(c, c.interp_theo, c.interp_real, true,
                     c.interp_bound > 0 ? "> " : c.interp_bound < 0 ? "< " : "");
}

Report compute_report(const std::vector<nlohmann::json>& results, double E, double alpha,
                      const std::vector<std::string>& order, const std::map<std::string, VariantLinks>& links,
                      const std::optional<Timing>& timing) {
  Report rep;
  rep.E = E;
  rep.alpha = alpha;
  rep.results = results;
  rep.timing = timing;
  Cells cells;
  std::map<std::string, VariantInfo> info;
  std::map<std::string, std::map<int, int>> diverged;  // variant -> width -> runs that diverged
  std::set<int> scales;
  std::set<std::string> revs, machines;
  for (auto& r : results) {
    std::string v = r.at("variant");
    int d = r.at("d");
    if (auto l = links.find(v); l != links.end())
      info[v] = {l->second.baseline, l->second.stacks, l->second.widths};
    else
      info[v] = {r.value("baseline", ""), r.value("stacks", std::vector<std::string>{})};
    scales.insert(d);
    revs.insert(r.value("revision", "unknown"));
    const std::string machine = result_machine(r);
    machines.insert(machine);
    if (r.value("status", "finished") == "diverged") {
      // No loss to fit: the run is listed and its seed counts as missing in every comparison.
      const std::string id = r.value("run", "");
      rep.diverged.push_back(id);
      ++diverged[v][d];
      rep.warnings.push_back(fmt::format(
          "{} diverged ({}): it is left out of every fit and speedup, and its seed out of the comparisons of that "
          "cell; to retry, change the spec (e.g. a lower lr) or delete results/{}.json and runs/{}/",
          id, r.value("error", "non-finite loss"), id, id));
      continue;
    }
    const double C = r.at("compute").get<double>(), tps = r.at("tokens_per_s").get<double>();
    const double tokens = r.value("tokens", 0.0);
    cells[v][d].push_back({C, r.at("final_val_loss").get<double>(), tps, tokens > 0 ? C / tokens * tps : kNaN,
                           r.value("seed", uint64_t(0)), machine});
  }
  rep.scales.assign(scales.begin(), scales.end());
  rep.revisions.assign(revs.begin(), revs.end());
  if (machines.size() > 1)
    rep.warnings.push_back(fmt::format("the runs were trained on {} machines ({}): their tokens/s and MFU compare the "
                                       "machines too; a realized speedup is one machine's only where the timing "
                                       "(timing.json) measured both sides",
                                       machines.size(), fmt::join(machines, "; ")));
  if (rep.revisions.size() > 1)
    rep.warnings.push_back(fmt::format("the results come from {} code revisions ({}): their compute and losses are "
                                       "compared as if one program had produced them",
                                       rep.revisions.size(), fmt::join(rep.revisions, ", ")));

  // Variant order: the spec's when known, else roots first then by name; baselines before dependents.
  std::vector<std::string> names;
  for (auto& n : order)
    if (info.count(n)) names.push_back(n);
  for (auto& [n, i] : info)
    if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
  auto depth = [&](std::string n) {
    int k = 0;
    while (info.count(n) && !info[n].baseline.empty() && k < 100) n = info[n].baseline, ++k;
    return k;
  };
  std::stable_sort(names.begin(), names.end(), [&](auto& a, auto& b) { return depth(a) < depth(b); });

  // The timed FLOP/s ratios: per variant and width where it and its baseline were both timed.
  TimedRatios timed;
  if (timing)
    for (auto& [v, byd] : cells) {
      const std::string& b = info.at(v).baseline;
      if (b.empty()) continue;
      for (auto& [d, obs] : byd) {
        const TimedCell *tv = timing->find(v, d), *tb = timing->find(b, d);
        if (!tv || !tb) continue;
        timed[v][d] = timed_flops_ratio(*tv, *tb);
      }
    }

  Estimates point = evaluate(cells, info, E, alpha, timed);

  // Intervals: one estimate per seed, and Student's t across them. Each seed's results alone (one
  // run per cell) give a law per variant and a speedup per cell, exactly as the pooled data do;
  // the interval is the pooled point estimate times exp(-/+ t(m-1) * s / sqrt(m)), s the standard
  // deviation of the m per-seed log speedups. The seed is the unit because it is what repeats: a
  // variant and its baseline trained with the same seed read the same data in the same order, so
  // the noise they share cancels inside each seed's estimate. Measured on synthetic ladders with a
  // known speedup (docs/ladder.md, "Intervals"), this covers the true value 94-99% of the time
  // with 2, 3 or 5 seeds; a bootstrap resampling the seeds covered 53-91% (with 2 seeds it has 3
  // distinct resamples), the per-cell bootstrap used before 84-97%.
  std::set<uint64_t> seed_set;
  for (auto& [v, byd] : cells)
    for (auto& [d, obs] : byd) {
      rep.intervals |= obs.size() > 1;
      for (auto& o : obs) seed_set.insert(o.seed);
    }
  rep.n_seeds = int(seed_set.size());
  // variant -> width -> per speedup kind: the log estimates of the seeds that gave a finite one,
  // and how many seeds had results in that cell.
  std::map<std::string, std::map<int, std::array<std::vector<double>, kKinds>>> per_seed;
  std::map<std::string, std::map<int, int>> seeds_in_cell;
  std::map<std::string, std::set<uint64_t>> incomplete_seeds;
  if (rep.intervals)
    for (uint64_t sd : seed_set) {
      Cells one;
      for (auto& [v, byd] : cells)
        for (auto& [d, obs] : byd)
          for (auto& o : obs)
            if (o.seed == sd) one[v][d].push_back(o);
      // A seed's law speedups are the pooled estimator's only where the seed has every cell the
      // pooled laws of the variant and its baseline were fitted to; a seed missing one (an
      // unfinished sweep, a failed run) would fit its law on fewer scales (with alpha or E held at
      // the spec's values) and enter the spread as a different estimator. Marin's speedups need
      // only the cell and the baseline's cell at the same width.
      auto complete = [&](const std::string& v) {
        for (auto& [d, obs] : cells.at(v))
          if (!one.count(v) || !one[v].count(d)) return false;
        return true;
      };
      Estimates seed_est = evaluate(one, info, E, alpha, timed);
      for (auto& [v, byd] : seed_est.sp) {
        const std::string& b = info.at(v).baseline;
        // The law speedups rest on every width of the pair: only complete seeds count. An
        // interpolated reading rests on the baseline's curve alone: a seed lacking some width of the
        // variant still reads it the pooled way, one lacking a width of the baseline does not; and
        // it counts only where it is a value, not a bound.
        const bool curve_ok = cells.count(b) && complete(b);
        const bool laws_ok = complete(v) && curve_ok;
        if (!laws_ok && !incomplete_seeds[v].count(sd)) incomplete_seeds[v].insert(sd);
        const auto places = seed_est.reading.find(v);
        for (auto& [d, s] : byd) {
          if (!one.count(b) || !one[b].count(d)) continue;  // no pair at this width for this seed
          ++seeds_in_cell[v][d];
          const bool in_range = places != seed_est.reading.end() && places->second.count(d) &&
                                places->second.at(d).bound == 0;
          for (int k = 0; k < kKinds; ++k)
            if (std::isfinite(s[k]) && s[k] > 0 && (k < 2 || (k < 4 ? laws_ok : curve_ok && in_range)))
              per_seed[v][d][k].push_back(std::log(s[k]));
        }
      }
    }
  for (auto& [v, sds] : incomplete_seeds)
    rep.warnings.push_back(fmt::format(
        "{}: seed(s) {} lack a run of {} or its baseline {} at some width; they are left out of its fitted-law "
        "intervals (their laws would rest on fewer scales)",
        v, fmt::join(sds, ", "), v, info.at(v).baseline));

  // Runs left out of a comparison (a seed one side lacks), named once per variant.
  for (auto& n : names) {
    auto p = point.pairs.find(n);
    if (p == point.pairs.end() || p->second.left_out.empty()) continue;
    const std::string& b = info[n].baseline;
    rep.warnings.push_back(fmt::format(
        "{} vs {}: the speedups compare only the seeds both have (a seed on one side alone would add its loss "
        "offset to that side); left out: {}",
        n, b, fmt::join(p->second.left_out, ", ")));
  }

  std::vector<std::string> E_at_bound;
  std::map<std::string, std::map<int, double>> base_below_E;  // baseline -> width -> its loss (<= E)
  for (auto& n : names) {
    VariantRow row;
    row.name = n;
    row.baseline = info[n].baseline;
    row.stacks = info[n].stacks;
    row.law = point.laws[n];
    row.law_ok = point.law_ok[n];
    if (row.law_ok && row.law.E_at_bound) E_at_bound.push_back(n);
    std::vector<double> gm, gl, gci;
    std::vector<std::pair<double, int>> gi;  // interpolated speedup, bound
    // Widths where this variant and its baseline were trained on different machines and not timed
    // side by side, by the machines involved: one warning per set of machines, not one per width.
    std::map<std::string, std::vector<int>> cross_machine;
    for (int d : rep.scales) {
      SpeedupCell c;
      c.d = d;
      c.n_diverged = diverged.count(n) && diverged[n].count(d) ? diverged[n][d] : 0;
      if (const TimedCell* tc = timing ? timing->find(n, d) : nullptr) {
        const auto q = median_min_max(tc->tokens_per_s);
        c.timed_tps = {q[0], q[1], q[2]};
      }
      const bool is_timed = timed.count(n) && timed[n].count(d);
      if (is_timed) {
        const auto& q = timed[n][d];
        c.timed_ratio = {q[0], q[1], q[2]};
      }
      if (cells[n].count(d)) {
        Mean mv = mean_of(cells[n][d]);
        c.n_variant = mv.n, c.C = mv.C, c.loss = mv.L, c.tps = mv.tps;
        const bool base_here = !row.baseline.empty() && cells.count(row.baseline) && cells[row.baseline].count(d);
        if (base_here) c.n_base = int(cells[row.baseline][d].size());
        const Paired* pr = point.pairs.count(n) ? &point.pairs[n] : nullptr;
        if (pr && pr->v.count(d) && pr->b.count(d)) {
          const auto &pv = pr->v.at(d), &pb = pr->b.at(d);
          mv = mean_of(pv);
          Mean mb = mean_of(pb);
          c.n_paired = mv.n, c.C = mv.C, c.loss = mv.L, c.tps = mv.tps;
          c.base_C = mb.C, c.base_loss = mb.L, c.base_tps = mb.tps;
          if (!(mb.L > E)) base_below_E[row.baseline][d] = mb.L;
          std::set<std::string> hosts;
          for (auto* obs : {&pv, &pb})
            for (auto& o : *obs) hosts.insert(o.host);
          if (timing && !is_timed)
            rep.warnings.push_back(fmt::format(
                "{} vs {} d={}: not both in the sweep's timing (timing.json): the realized speedup there compares the "
                "training runs' own tokens/s; `ladder sweep ... --retime` times every model again",
                n, row.baseline, d));
          if (hosts.size() > 1 && !is_timed) cross_machine[fmt::format("{}", fmt::join(hosts, ", "))].push_back(d);
        } else if (base_here) {
          std::set<uint64_t> sv, sb;
          for (auto& o : cells[n][d]) sv.insert(o.seed);
          for (auto& o : cells[row.baseline][d]) sb.insert(o.seed);
          rep.warnings.push_back(fmt::format("{} vs {} d={}: no seed in common ({}: {}; {}: {}): no speedup (n/a)", n,
                                             row.baseline, d, n, fmt::join(sv, ", "), row.baseline,
                                             fmt::join(sb, ", ")));
        }
        if (!row.baseline.empty()) {
          auto s = point.sp[n][d];
          const CurvePlace& place = point.reading[n][d];
          c.interp_bound = place.bound;
          c.interp_from = place.from, c.interp_to = place.to, c.interp_span = place.span;
          Interval* iv[kKinds] = {&c.marin_theo, &c.marin_real, &c.law_theo,
                                  &c.law_real,   &c.interp_theo, &c.interp_real};
          if (std::isinf(s[0]) || std::isinf(s[2]))
            rep.warnings.push_back(fmt::format(
                "{} d={}: the variant's loss is at or below the baseline law's floor E, which no baseline compute "
                "reaches: the speedup is unbounded (inf), counts as > 1 in the point-estimate gates and has no "
                "interval",
                n, d));
          for (int k = 0; k < kKinds; ++k) {
            iv[k]->value = s[k];
            const auto& ps = per_seed[n][d][k];
            // An interpolated interval needs every seed's reading: the seeds whose own loss left
            // their baseline's range are the extreme ones, and an interval without them is too narrow.
            const bool all_seeds = k < 4 || (c.interp_bound == 0 && int(ps.size()) == seeds_in_cell[n][d]);
            if (ps.size() >= 2 && std::isfinite(s[k]) && s[k] > 0 && all_seeds) {
              double m = 0;
              for (double x : ps) m += x / double(ps.size());
              const double half = t_half_width(ps, m);
              iv[k]->lo = s[k] * std::exp(-half);
              iv[k]->hi = s[k] * std::exp(half);
            }
            if (k == 2 && seeds_in_cell[n][d] > 1 && int(ps.size()) < seeds_in_cell[n][d])
              rep.warnings.push_back(fmt::format(
                  "{} d={}: {} of {} seeds gave no finite fitted-law speedup of their own (no law, unbounded, or "
                  "left out for missing runs); {}", n, d,
                  seeds_in_cell[n][d] - int(ps.size()), seeds_in_cell[n][d],
                  ps.size() >= 2 ? fmt::format("the interval is over the other {}", ps.size()) : "no interval"));
          }
        }
      }
      if (!row.baseline.empty() && info[n].planned_at(d)) {  // a width it is not planned at is no gap
        gm.push_back(c.n_variant ? c.marin_theo.value : kNaN);
        gl.push_back(c.n_variant ? c.law_theo.value : kNaN);
        gci.push_back(c.n_variant ? c.law_theo.lo : kNaN);
        gi.push_back({c.n_variant ? c.interp_theo.value : kNaN, c.interp_bound});
      }
      row.cells.push_back(c);
    }
    for (auto& [machines, ds] : cross_machine)
      rep.warnings.push_back(fmt::format(
          "{} vs {} d={}: runs from different hosts ({}); the realized speedup then also compares the machines", n,
          row.baseline, fmt::join(ds, ", "), machines));
    if (!row.baseline.empty()) {
      row.gate_marin = gate(gm);
      row.gate_law = gate(gl);
      row.gate_ci = rep.intervals ? gate(gci) : "n/a";
      row.gate_interp = gate_bounded(gi);
    }
    rep.variants.push_back(std::move(row));
  }
  // The backtest: each variant's widest width forecast from its narrower ones (pooled seeds).
  for (auto& n : names) {
    if (!cells.count(n) || cells[n].size() < 3) continue;
    const auto& byd = cells[n];
    Forecast f;
    f.variant = n;
    f.d = byd.rbegin()->first;
    f.d_prev = std::next(byd.rbegin())->first;
    f.n_widths = int(byd.size()) - 1;
    const std::vector<Obs>& held = byd.rbegin()->second;
    const Mean m = mean_of(held), mp = mean_of(byd.at(f.d_prev));
    f.C = m.C;
    f.measured.value = m.L;
    if (held.size() >= 2) {
      std::vector<double> losses;
      for (auto& o : held) losses.push_back(o.L);
      const double half = t_half_width(losses, m.L);
      f.measured.lo = m.L - half, f.measured.hi = m.L + half;
    }
    std::map<int, std::vector<Obs>> rest(byd.begin(), std::prev(byd.end()));
    f.law_ok = fit_law(rest, E, alpha, f.law);
    if (f.law_ok) {
      f.law_loss = f.law.loss(m.C);
      f.law_factor = f.law.compute_for(m.L) / m.C;
    }
    if (mp.L > E) {
      const PowerLaw marin = law_through(mp.C, mp.L, E, alpha);
      f.marin_loss = marin.loss(m.C);
      f.marin_factor = marin.compute_for(m.L) / m.C;  // marin_theoretical_speedup of the widest point over the next
    }
    rep.forecasts.push_back(f);
  }
  for (auto& [b, byd] : base_below_E) {
    std::vector<std::string> at;
    for (auto& [d, l] : byd) at.push_back(fmt::format("d={} ({:.4f})", d, l));
    rep.warnings.push_back(fmt::format(
        "baseline {}: its loss at {} is at or below E = {:g}, and no law with that floor passes through it: Marin's "
        "speedups over it there are n/a; lower --E (or report.E in the spec) below the baseline's losses",
        b, fmt::join(at, ", "), E));
  }
  if (!E_at_bound.empty())
    rep.warnings.push_back(fmt::format(
        "the fitted E of {} is at an end of its range [0, lowest loss): the data do not locate the loss floor; "
        "speedups read inside the data are interpolations, E itself is not an estimate",
        fmt::join(E_at_bound, ", ")));
  return rep;
}

namespace {

const VariantRow* find_row(const Report& r, const std::string& n) {
  for (auto& v : r.variants)
    if (v.name == n) return &v;
  return nullptr;
}

// Per stacked variant and width: {stacked, product of rungs} for Marin's and the law's theoretical speedups.
struct StackLine {
  std::string name, rungs;
  std::vector<std::array<double, 4>> per_scale;  // marin stacked, marin product, law stacked, law product
};
std::vector<StackLine> stack_lines(const Report& r) {
  std::vector<StackLine> out;
  for (auto& v : r.variants) {
    if (v.stacks.empty()) continue;
    StackLine s;
    s.name = v.name;
    for (auto& x : v.stacks) s.rungs += (s.rungs.empty() ? "" : " x ") + x;
    for (size_t i = 0; i < r.scales.size(); ++i) {
      std::array<double, 4> a = {v.cells[i].marin_theo.value, 1.0, v.cells[i].law_theo.value, 1.0};
      if (v.cells[i].n_variant == 0) a = {kNaN, kNaN, kNaN, kNaN};
      for (auto& rung : v.stacks) {
        const VariantRow* rr = find_row(r, rung);
        if (!rr || rr->cells[i].n_variant == 0) {
          a[1] = a[3] = kNaN;
          continue;
        }
        a[1] *= rr->cells[i].marin_theo.value;
        a[3] *= rr->cells[i].law_theo.value;
      }
      s.per_scale.push_back(a);
    }
    out.push_back(s);
  }
  return out;
}

std::string law_text(const VariantRow& v) {
  if (v.law.n_points == 0) return "no law (no finished run)";
  if (!v.law_ok) return "no law (fit failed or not decreasing)";
  return fmt::format("{:.3f} + {:.4g} * C^-{:.4f}", v.law.E, v.law.A, v.law.alpha);
}
std::string fitted_text(const PowerLaw& l) {
  return l.fit_alpha ? "E, A, alpha" : l.fit_E ? "E, A (alpha fixed)" : "A (E, alpha fixed)";
}

// The tables, as rows of cells, shared by the Markdown and the HTML so both say the same thing.
struct Table {
  std::string title, note;
  std::vector<std::string> head;
  std::vector<std::vector<std::string>> rows;
};

// The interpolated table's caveat, from the data: the longest stretch of a baseline's curve that a
// reading lies on (a straight line in log C says less about the curve the longer the stretch).
std::string longest_stretch(const Report& r) {
  const VariantRow* at = nullptr;
  const SpeedupCell* cell = nullptr;
  for (auto& v : r.variants)
    for (auto& c : v.cells)
      if (c.n_variant > 0 && c.interp_span > 1 && (!cell || c.interp_span > cell->interp_span)) at = &v, cell = &c;
  if (!cell) return "";
  std::vector<std::string> on;  // the readings on that stretch
  for (auto& v : r.variants)
    for (auto& c : v.cells)
      if (c.n_variant > 0 && v.baseline == at->baseline && c.interp_from == cell->interp_from &&
          c.interp_to == cell->interp_to && c.interp_span > 1)
        on.push_back(fmt::format("{} d={}", v.name, c.d));
  return fmt::format(" Between two widths the curve is taken as straight; the longest stretch read here is {}'s from "
                     "d={} to d={}, {:.1f}x in compute ({}).",
                     at->baseline, cell->interp_from, cell->interp_to, cell->interp_span, fmt::join(on, ", "));
}

std::vector<Table> tables(const Report& r) {
  std::vector<Table> t;
  auto scale_head = [&](std::vector<std::string> h) {
    for (int d : r.scales) h.push_back(fmt::format("d={}", d));
    return h;
  };
  Table marin{"Speedup over baseline, Marin's method: theoretical (realized)",
              fmt::format("Loss law E + A*C^-alpha with E = {:g}, alpha = {:g} fixed and A refit through the baseline's "
                          "point at each scale (RECIPE.md section 4); realized (wall-clock) = theoretical x the ratio of "
                          "model FLOP/s (C per token x tokens/s): the baseline's time to the variant's loss over the "
                          "variant's time; {}. Gate: theoretical > 1 at every scale the variant is planned at.",
                          r.E, r.alpha,
                          r.timing ? "the FLOP/s from the sweep's interleaved timing (the Throughput table), where "
                                     "both were timed"
                                   : "the FLOP/s from the training runs' own tokens/s (measured whenever each "
                                     "trained; the spec's `timing:` measures them side by side)"),
              scale_head({"variant", "vs"}),
              {}};
  marin.head.push_back("gate");
  Table law{"Speedup over baseline, Ladder's fitted laws: theoretical [95% interval] (realized [95% interval])",
            r.intervals ? fmt::format("A law E + A*C^-alpha fitted per variant over every scale and seed; speedup read "
                                      "at equal loss at the variant's compute; realized as in Marin's table. Intervals "
                                      "(95%, on each speedup): the same speedup estimated from each of the {} seeds' "
                                      "runs alone, Student's t across them around the pooled estimate (a variant and "
                                      "its baseline share a seed's data order; docs/ladder.md).",
                                      r.n_seeds)
                        : "A law E + A*C^-alpha fitted per variant over every scale and seed; speedup read at equal "
                          "loss at the variant's compute. One seed per cell: no intervals.",
            scale_head({"variant", "vs"}),
            {}};
  law.head.push_back("gate");
  law.head.push_back("gate (interval > 1)");
  Table interp{"Speedup over baseline, interpolated on the baseline's measured widths (no law): theoretical [95% "
               "interval] (realized [95% interval])",
               fmt::format("The compute at which the baseline's measured curve (its mean loss at each width against "
                           "its mean compute, straight in log C between adjacent widths) reaches the variant's mean "
                           "loss, over the variant's compute; realized as in Marin's table. No law and no "
                           "extrapolation: where the variant's loss is below the baseline's at every width, the "
                           "baseline needs more than its widest width's compute and the cell is a lower bound "
                           "(> x, if only its loss keeps falling as compute grows); above it at every width, an "
                           "upper bound (< x). The fitted laws' speedups beyond the baseline's points are read on "
                           "an extrapolation (see the backtest); these are not.{}{} Gate: > 1 at every width the "
                           "variant is planned at, a bound counting where it decides.",
                           r.intervals ? " Intervals as in the fitted-law table, where every seed has the baseline "
                                         "at every width and its own reading lies between two of them."
                                       : "",
                           longest_stretch(r)),
               scale_head({"variant", "vs"}),
               {}};
  interp.head.push_back("gate");
  for (auto& v : r.variants) {
    if (v.baseline.empty()) continue;
    std::vector<std::string> a = {v.name, v.baseline}, b = a, c = a;
    for (auto& x : v.cells) {
      a.push_back(format_cell(x, false, false));
      b.push_back(format_cell(x, true, true));
      c.push_back(format_interp_cell(x));
    }
    a.push_back(v.gate_marin);
    b.push_back(v.gate_law);
    b.push_back(v.gate_ci);
    c.push_back(v.gate_interp);
    marin.rows.push_back(a);
    law.rows.push_back(b);
    interp.rows.push_back(c);
  }
  t.push_back(marin);
  t.push_back(law);
  t.push_back(interp);

  auto st = stack_lines(r);
  if (!st.empty()) {
    Table s{"Stacked variant vs the product of its rungs (theoretical; Marin's method / fitted laws)",
            "Each cell: stacked speedup vs the product of the rungs' speedups over the same baseline.",
            scale_head({"stacked", "rungs"}),
            {}};
    for (auto& x : st) {
      std::vector<std::string> row = {x.name, x.rungs};
      for (auto& a : x.per_scale)
        row.push_back(fmt::format("{} vs {} / {} vs {}", format_speedup(a[0]), format_speedup(a[1]),
                                  format_speedup(a[2]), format_speedup(a[3])));
      s.rows.push_back(row);
    }
    t.push_back(s);
  }

  if (r.timing) {
    const Timing& tm = *r.timing;
    Table th{"Throughput, timed side by side: tokens/s [range over rounds]; model FLOP/s over the baseline's",
             fmt::format("Each model's training step (forward, backward, optimizer; synthetic tokens, the first "
                         "seed's config) timed after every run had finished: {} rounds, each timing every model once "
                         "({} untimed then {} timed steps, the median), the order reversed every other round; on {}, "
                         "revision {}, {} to {}{}. The ratio is the median of the per-round ratios "
                         "[smallest-largest]: what the realized speedups use.",
                         tm.rounds, tm.warmup, tm.steps,
                         tm.cpu.empty() ? fmt::format("{} with {} threads", tm.host, tm.threads)
                                        : machine_label(tm.host, tm.cpu, tm.threads),
                         tm.revision, tm.started_at,
                         tm.finished_at,
                         tm.sgemm_gflops > 0 ? fmt::format("; sgemm {:.0f} GFLOP/s then", tm.sgemm_gflops) : ""),
             scale_head({"variant", "vs"}),
             {}};
    for (auto& v : r.variants) {
      std::vector<std::string> row = {v.name, v.baseline.empty() ? "-" : v.baseline};
      for (auto& c : v.cells) {
        if (std::isnan(c.timed_tps.value)) {
          row.push_back("-");
          continue;
        }
        std::string cell = fmt::format("{} [{}-{}]", human_count(c.timed_tps.value), human_count(c.timed_tps.lo),
                                       human_count(c.timed_tps.hi));
        if (!std::isnan(c.timed_ratio.value))
          cell += fmt::format("; {} [{}-{}]", format_speedup(c.timed_ratio.value), format_speedup(c.timed_ratio.lo),
                              format_speedup(c.timed_ratio.hi));
        row.push_back(cell);
      }
      th.rows.push_back(row);
    }
    t.push_back(th);
  }

  Table laws{"Fitted laws (loss = E + A*C^-alpha, C in FLOPs)",
             "Free parameters depend on the distinct compute values of a variant: 3 or more: E, A, alpha; 2: E, A; 1: A. "
             "Residual dof: distinct compute values left after the free parameters (0: nothing in the data tests "
             "the law's shape; unless a bound holds E, it goes through the cells' means exactly).",
             {"variant", "law", "fitted", "points", "compute values", "residual dof", "rmse"},
             {}};
  for (auto& v : r.variants)
    laws.rows.push_back({v.name, law_text(v), fitted_text(v.law) + (v.law_ok && v.law.E_at_bound ? "; E at a bound" : ""),
                         std::to_string(v.law.n_points), std::to_string(v.law.n_distinct),
                         std::to_string(v.law.residual_dof()), fmt::format("{:.4f}", v.law.rmse)});
  t.push_back(laws);

  if (!r.forecasts.empty()) {
    Table fc{"Backtest: each variant's widest width forecast from its narrower ones",
             fmt::format("A speedup at a variant's widest width, where its loss is below every loss its baseline reached, "
                         "reads the baseline's law beyond the baseline's own points; "
                         "this table says how well such a reading held on this data. Each variant's law refit "
                         "without its widest width (fitted as in the table above), and Marin's law (E = {:g}, alpha "
                         "= {:g} fixed, A through the variant's mean at the next-widest width), forecast the mean "
                         "loss there. In parentheses the compute factor: the compute that law puts at the measured "
                         "loss over the compute the runs spent (> 1: the runs did better than forecast); a speedup "
                         "read on a law that far beyond its points can be off by a factor of this size.",
                         r.E, r.alpha),
             {"variant", "held out", "measured loss [95%]", "refit on", "refit law", "law forecast (factor)",
              "Marin forecast (factor)"},
             {}};
    for (auto& f : r.forecasts) {
      const std::string meas =
          std::isnan(f.measured.lo)
              ? fmt::format("{:.4f}", f.measured.value)
              : fmt::format("{:.4f} [{:.4f}-{:.4f}]", f.measured.value, f.measured.lo, f.measured.hi);
      auto fcst = [](double loss, double factor) {
        return std::isnan(loss) ? std::string("n/a") : fmt::format("{:.4f} ({})", loss, format_speedup(factor));
      };
      std::string law = "no law (fit failed or not decreasing)";
      if (f.law_ok)
        law = fmt::format("{:.3f} + {:.4g} * C^-{:.4f}; {}{}", f.law.E, f.law.A, f.law.alpha, fitted_text(f.law),
                          f.law.E_at_bound ? ", E at a bound" : "");
      fc.rows.push_back({f.variant, fmt::format("d={}", f.d), meas,
                         fmt::format("{} widths (d <= {})", f.n_widths, f.d_prev), law, fcst(f.law_loss, f.law_factor),
                         fcst(f.marin_loss, f.marin_factor)});
    }
    t.push_back(fc);
  }

  Table runs{"Runs", "As stored in results/ (final and best validation loss over the run's evaluations; "
             "diverged: its loss became non-finite, and it is in no fit).",
             {"run", "variant", "d", "seed", "tokens", "C", "C+head", "final val", "best val", "tokens/s", "MFU", "wall", "host", "revision"},
             {}};
  for (auto& x : r.results) {
    if (x.value("status", "finished") == "diverged") {
      runs.rows.push_back({x.value("run", ""), x.value("variant", ""), std::to_string(x.value("d", 0)),
                           std::to_string(x.value("seed", uint64_t(0))), human_count(x.value("tokens", 0.0)),
                           sci(x.value("compute", 0.0)), sci(x.value("flops_with_head", 0.0)), "diverged", "-", "-",
                           "-", "-", result_machine(x), x.value("revision", "")});
      continue;
    }
    runs.rows.push_back({x.value("run", ""), x.value("variant", ""), std::to_string(x.value("d", 0)),
                         std::to_string(x.value("seed", uint64_t(0))), human_count(x.value("tokens", 0.0)),
                         sci(x.value("compute", 0.0)), sci(x.value("flops_with_head", 0.0)),
                         fmt::format("{:.4f}", x.value("final_val_loss", kNaN)),
                         fmt::format("{:.4f}", x.value("best_val_loss", kNaN)),
                         fmt::format("{:.0f}", x.value("tokens_per_s", 0.0)),
                         fmt::format("{:.1f}%", 100 * x.value("mfu", 0.0)), format_duration(x.value("wall_s", 0.0)),
                         result_machine(x), x.value("revision", "")});
  }
  t.push_back(runs);
  return t;
}

std::string md_cell(std::string s) {
  std::string o;
  for (char c : s) o += c == '|' ? std::string("\\|") : std::string(1, c);
  return o;
}

}  // namespace

std::string report_markdown(const Report& r) {
  std::string o = fmt::format("# Ladder report: {}\n\n{} runs, {} scales (d = {}), code revision(s): {}.\n", r.name,
                              r.results.size(), r.scales.size(), fmt::join(r.scales, ", "), fmt::join(r.revisions, ", "));
  if (!r.warnings.empty()) {
    o += "\n## Warnings\n\n";
    for (auto& w : r.warnings) o += "- " + w + "\n";
  }
  for (auto& t : tables(r)) {
    o += fmt::format("\n## {}\n\n{}\n\n|", t.title, t.note);
    for (auto& h : t.head) o += fmt::format(" {} |", md_cell(h));
    o += "\n|";
    for (size_t i = 0; i < t.head.size(); ++i) o += "---|";
    o += "\n";
    for (auto& row : t.rows) {
      o += "|";
      for (auto& c : row) o += fmt::format(" {} |", md_cell(c));
      o += "\n";
    }
  }
  return o;
}

std::string loss_plot_svg(const Report& r) {
  const double W = 720, H = 440, L = 70, R = 170, T = 30, B = 50;
  svg::Canvas c(W, H);
  double cmin = INFINITY, cmax = 0, lmin = INFINITY, lmax = -INFINITY;
  for (auto& x : r.results) {
    double C = x.value("compute", 0.0), l = x.value("final_val_loss", kNaN);
    if (!(C > 0) || !std::isfinite(l)) continue;
    cmin = std::min(cmin, C), cmax = std::max(cmax, C), lmin = std::min(lmin, l), lmax = std::max(lmax, l);
  }
  c.text(W / 2, 18, "Final validation loss vs compute, with each variant's fitted law", 14, "middle");
  if (!(cmax > 0)) {
    c.text(W / 2, H / 2, "no results", 14, "middle");
    return c.str();
  }
  svg::Scale xs{cmin / 1.6, cmax * 1.6, L, W - R, true};
  double pad = std::max(0.05 * (lmax - lmin), 0.02);
  svg::Scale ys{lmin - pad, lmax + pad, H - B, T, false};
  c.rect(L, T, W - R - L, H - B - T, "none", "#999");
  for (double t : xs.ticks()) {
    c.line(xs(t), H - B, xs(t), H - B + 5, "#666");
    c.line(xs(t), T, xs(t), H - B, "#eee");
    c.text(xs(t), H - B + 18, svg::tick_label(t, true), 11, "middle");
  }
  for (double t : ys.ticks()) {
    c.line(L - 5, ys(t), L, ys(t), "#666");
    c.line(L, ys(t), W - R, ys(t), "#eee");
    c.text(L - 8, ys(t) + 4, svg::tick_label(t, false), 11, "end");
  }
  c.text((L + W - R) / 2, H - 12, "compute C (FLOPs, 3 x forward without LM head x tokens)", 12, "middle");
  c.text(18, (T + H - B) / 2, "validation loss", 12, "middle", "#222", -90);
  for (size_t i = 0; i < r.variants.size(); ++i) {
    const auto& v = r.variants[i];
    const auto& col = svg::color(i);
    if (v.law_ok) {
      std::vector<std::pair<double, double>> pts;
      for (int k = 0; k <= 60; ++k) {
        double C = std::pow(10.0, std::log10(xs.lo) + (std::log10(xs.hi) - std::log10(xs.lo)) * k / 60.0);
        double l = v.law.loss(C);
        if (l >= ys.lo && l <= ys.hi) pts.emplace_back(xs(C), ys(l));
      }
      c.polyline(pts, col, 1.5);
    }
    for (auto& x : r.results)
      if (x.value("variant", "") == v.name && x.value("status", "finished") != "diverged")
        c.circle(xs(x.value("compute", 0.0)), ys(x.value("final_val_loss", 0.0)), 3.5, col, "white",
                 fmt::format("{}: C={:.3g}, loss {:.4f}", x.value("run", ""), x.value("compute", 0.0),
                             x.value("final_val_loss", 0.0)));
    double ly = T + 14 + 18 * double(i);
    c.line(W - R + 12, ly - 4, W - R + 32, ly - 4, col, 2);
    c.circle(W - R + 22, ly - 4, 3.5, col, "white");
    c.text(W - R + 38, ly, v.name, 12);
  }
  return c.str();
}

std::string speedup_plot_svg(const Report& r) {
  const double W = 760, H = 420, L = 70, R = 210, T = 30, B = 50;  // R: room for "routing_norm vs moe_v1"
  svg::Canvas c(W, H);
  c.text(W / 2, 18, "Theoretical speedup over baseline per rung and scale", 14, "middle");
  std::vector<const VariantRow*> rungs;
  for (auto& v : r.variants)
    if (!v.baseline.empty()) rungs.push_back(&v);
  double lo = 0.8, hi = 1.25;
  auto widen = [&](double x) {
    if (std::isfinite(x) && x > 0) lo = std::min(lo, x), hi = std::max(hi, x);
  };
  for (auto* v : rungs)
    for (auto& cell : v->cells) {
      widen(cell.marin_theo.value), widen(cell.law_theo.value), widen(cell.law_theo.lo), widen(cell.law_theo.hi);
      widen(cell.interp_theo.value);
    }
  if (rungs.empty() || r.scales.empty()) {
    c.text(W / 2, H / 2, "no variant with a baseline", 14, "middle");
    return c.str();
  }
  svg::Scale ys{lo / 1.15, hi * 1.15, H - B, T, true};
  const double gw = (W - R - L) / double(r.scales.size());
  c.rect(L, T, W - R - L, H - B - T, "none", "#999");
  for (double t : ys.ticks()) {
    c.line(L - 5, ys(t), L, ys(t), "#666");
    c.line(L, ys(t), W - R, ys(t), "#eee");
    c.text(L - 8, ys(t) + 4, svg::tick_label(t, false) + "x", 11, "end");
  }
  c.line(L, ys(1.0), W - R, ys(1.0), "#444", 1.2, "5,4");
  c.text(18, (T + H - B) / 2, "speedup (log scale)", 12, "middle", "#222", -90);
  for (size_t si = 0; si < r.scales.size(); ++si) {
    double gx = L + gw * double(si);
    if (si > 0) c.line(gx, T, gx, H - B, "#ddd");
    c.text(gx + gw / 2, H - B + 18, fmt::format("d={}", r.scales[si]), 12, "middle");
    for (size_t k = 0; k < rungs.size(); ++k) {
      const auto& cell = rungs[k]->cells[si];
      const std::string& col = svg::color(size_t(&*rungs[k] - &r.variants[0]));
      double x = gx + gw * (double(k) + 1) / double(rungs.size() + 1);
      if (cell.n_variant == 0) continue;
      auto clampy = [&](double v) { return ys(std::clamp(v, ys.lo, ys.hi)); };
      if (!std::isnan(cell.law_theo.lo) && !std::isnan(cell.law_theo.hi)) {  // interval bar (clamped to the plot)
        c.line(x, clampy(cell.law_theo.lo), x, clampy(cell.law_theo.hi), col, 1.5);
        c.line(x - 4, clampy(cell.law_theo.lo), x + 4, clampy(cell.law_theo.lo), col, 1.5);
        c.line(x - 4, clampy(cell.law_theo.hi), x + 4, clampy(cell.law_theo.hi), col, 1.5);
      }
      if (!std::isnan(cell.law_theo.value))
        c.circle(x, clampy(cell.law_theo.value), 4.5, col, "white",
                 fmt::format("{} d={}: fitted laws {}", rungs[k]->name, cell.d, format_cell(cell, true, true)));
      if (!std::isnan(cell.marin_theo.value)) {
        double y = clampy(cell.marin_theo.value);
        c.rect(x + 6, y - 3.5, 7, 7, "white", col);
      }
      // Interpolated, no law: a diamond; a bound a triangle pointing the way the speedup lies.
      if (!std::isnan(cell.interp_theo.value)) {
        const double ix = x - 10, y = clampy(cell.interp_theo.value);
        if (cell.interp_bound == 0)
          c.polyline({{ix, y - 4.5}, {ix + 4, y}, {ix, y + 4.5}, {ix - 4, y}, {ix, y - 4.5}}, col, 1.3);
        else {
          const double tip = cell.interp_bound > 0 ? -5 : 5;
          c.polyline({{ix - 4, y}, {ix + 4, y}, {ix, y + tip}, {ix - 4, y}}, col, 1.3);
        }
      }
    }
  }
  for (size_t k = 0; k < rungs.size(); ++k) {
    const std::string& col = svg::color(size_t(rungs[k] - &r.variants[0]));
    double ly = T + 14 + 18 * double(k);
    c.circle(W - R + 20, ly - 4, 4.5, col, "white");
    c.text(W - R + 32, ly, rungs[k]->name + " vs " + rungs[k]->baseline, 12);
  }
  double ly = T + 14 + 18 * double(rungs.size()) + 10;
  c.text(W - R + 12, ly, "dot + bar: fitted laws, 95%", 10);
  c.text(W - R + 12, ly + 13, "square: Marin's method", 10);
  c.text(W - R + 12, ly + 26, "diamond: interpolated, no law;", 10);
  c.text(W - R + 12, ly + 39, "triangle: a bound (up: >, down: <)", 10);
  return c.str();
}

// Validation loss during training against compute, one panel per width: each variant's curve,
// averaged over its seeds whose evaluations fall on the same steps as its first seed's (else that
// seed's alone), so that a reader sees whether the final losses the tables compare were still
// moving apart or together when the runs stopped.
std::string val_curves_svg(const Report& r) {
  std::vector<svg::Panel> panels;
  for (int d : r.scales) {
    svg::Panel p;
    p.y_title = fmt::format("validation loss, d = {}", d);
    for (size_t i = 0; i < r.variants.size(); ++i) {
      std::vector<const nlohmann::json*> runs;
      for (auto& x : r.results)
        if (x.value("variant", "") == r.variants[i].name && x.value("d", 0) == d &&
            x.value("status", "finished") == "finished" && x.contains("val_curve") && x["val_curve"].is_array() &&
            !x["val_curve"].empty() && x.value("tokens", 0.0) > 0)
          runs.push_back(&x);
      if (runs.empty()) continue;
      std::sort(runs.begin(), runs.end(), [](auto* a, auto* b) { return a->value("seed", 0) < b->value("seed", 0); });
      auto steps = [](const nlohmann::json& x) {
        std::vector<double> s;
        for (auto& e : x["val_curve"]) s.push_back(e.at(0).get<double>());
        return s;
      };
      std::erase_if(runs, [&](auto* x) { return steps(*x) != steps(*runs[0]); });
      const auto& first = (*runs[0])["val_curve"];
      const double per_token = runs[0]->value("compute", 0.0) / runs[0]->value("tokens", 1.0);
      svg::Curve cv;
      cv.label = r.variants[i].name, cv.color = svg::color(i), cv.markers = true;
      cv.tooltip_prefix = fmt::format("{} d={} ({} seed{}): C, loss", r.variants[i].name, d, runs.size(),
                                      runs.size() > 1 ? "s" : "");
      for (size_t k = 0; k < first.size(); ++k) {
        double sum = 0;
        for (auto* x : runs) sum += (*x)["val_curve"][k].at(2).get<double>();
        cv.pts.emplace_back(first[k].at(1).get<double>() * per_token, sum / double(runs.size()));
      }
      p.curves.push_back(std::move(cv));
    }
    panels.push_back(std::move(p));
  }
  const std::string title = r.n_seeds > 1 ? "Validation loss during training (mean over seeds), per width"
                                          : "Validation loss during training, per width";
  return svg::line_panels(title, panels, "compute C (FLOPs, 3 x forward without LM head x tokens)", true, false);
}

std::string report_html(const Report& r) {
  std::string o =
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n<title>Ladder report: " +
      html_escape(r.name) +
      "</title>\n<style>\nbody{font-family:sans-serif;margin:2em;max-width:1100px;color:#222}\n"
      "table{border-collapse:collapse;margin:0.5em 0 1.5em}\nth,td{border:1px solid #ccc;padding:3px 8px;text-align:left;"
      "font-size:13px}\nth{background:#f3f3f3}\n.note{color:#555;font-size:13px}\n</style>\n</head>\n<body>\n";
  o += fmt::format("<h1>Ladder report: {}</h1>\n<p>{} runs, {} scales, code revision(s): {}.</p>\n", html_escape(r.name),
                   r.results.size(), r.scales.size(), html_escape(fmt::format("{}", fmt::join(r.revisions, ", "))));
  if (!r.warnings.empty()) {
    o += "<h2>Warnings</h2>\n<ul>\n";
    for (auto& w : r.warnings) o += "<li>" + html_escape(w) + "</li>\n";
    o += "</ul>\n";
  }
  o += "<h2>Plots</h2>\n" + loss_plot_svg(r) + speedup_plot_svg(r) + val_curves_svg(r);
  int ti = 0;
  for (auto& t : tables(r)) {
    o += fmt::format("<h2>{}</h2>\n<p class=\"note\">{}</p>\n<table id=\"t{}\">\n<tr>", html_escape(t.title),
                     html_escape(t.note), ti++);
    for (auto& h : t.head) o += "<th>" + html_escape(h) + "</th>";
    o += "</tr>\n";
    for (auto& row : t.rows) {
      o += "<tr>";
      for (auto& cell : row) o += "<td>" + html_escape(cell) + "</td>";
      o += "</tr>\n";
    }
    o += "</table>\n";
  }
  o += "</body>\n</html>\n";
  return o;
}

std::string write_report(const ReportOptions& opt) {
  ResultStore store(opt.dir);
  auto manifest = store.read_manifest();
  auto results = store.all_results();
  if (results.empty()) fail("{}: no finished runs yet (results/ is empty); run `ladder sweep` first", opt.dir.string());
  // Only the results of the spec's current plan: a seed, scale or variant since removed from the
  // spec, or a run made with another config, would otherwise enter the fits and the intervals.
  // (ladder.json of directories from before the plan was recorded has no "runs": all are kept.)
  std::vector<std::string> excluded;
  if (manifest.contains("runs") && manifest["runs"].is_object()) {
    const auto& planned = manifest["runs"];
    // The data each run of the plan reads (ladder.json's "data"; absent in directories and results
    // from before it was recorded, which are kept).
    const nlohmann::json data = manifest.contains("data") && manifest["data"].is_object() ? manifest["data"]
                                                                                          : nlohmann::json::object();
    std::erase_if(results, [&](const nlohmann::json& x) {
      const std::string id = x.value("run", "");
      std::string why;
      if (!planned.contains(id)) why = " (not in the plan)";
      else if (planned[id] != x.value("config_hash", "")) why = " (made with another config)";
      else if (x.contains("data") && data.contains(id) && data[id] != x["data"]) why = " (trained on other data)";
      if (!why.empty()) excluded.push_back(id + why);
      return !why.empty();
    });
    if (results.empty())
      fail("{}: none of the {} stored results belongs to the current plan of {} ({}); run `ladder sweep` first",
           opt.dir.string(), excluded.size(), manifest.value("spec_file", "the spec"), fmt::join(excluded, ", "));
  }
  // Marin's fixed E and alpha: the flags, else ladder.json's report settings (the spec's).
  const std::string manifest_file = (opt.dir / "ladder.json").string();
  const auto& rs = manifest.value("report", nlohmann::json::object());
  auto setting = [&](const char* key, const std::optional<double>& flag, double dflt) {
    if (flag) return *flag;
    if (!rs.is_object() || !rs.contains(key)) return dflt;
    if (!rs[key].is_number()) fail("{}: report.{} is {}, expected a number", manifest_file, key, rs[key].dump());
    return rs[key].get<double>();
  };
  const double E = setting("E", opt.E, 1.6), alpha = setting("alpha", opt.alpha, 0.0941);
  const std::string E_from = opt.E ? "--E" : manifest_file + ": report.E";
  const std::string alpha_from = opt.alpha ? "--alpha" : manifest_file + ": report.alpha";
  // L = E + A C^-alpha: alpha > 0 for a loss that falls with compute, E >= 0 (a loss floor).
  if (!std::isfinite(alpha) || alpha <= 0) fail("{} {}: expected a finite exponent > 0", alpha_from, alpha);
  if (!std::isfinite(E) || E < 0) fail("{} {}: expected a finite irreducible loss >= 0", E_from, E);
  // Baselines and stacks as the spec gives them now (recorded by `ladder sweep`): an edited `stacks:`
  // leaves the config, and so the stored results, unchanged, and a baseline can change with the
  // config staying the same; the copies stored with each result are what they were when it ran.
  // (Directories from before ladder.json recorded them: the stored copies.)
  std::map<std::string, VariantLinks> links;
  if (manifest.contains("links") && manifest["links"].is_object())
    for (auto& [v, l] : manifest["links"].items()) {
      if (!l.is_object()) continue;
      if (l.contains("baseline") && l["baseline"].is_string()) links[v].baseline = l["baseline"].get<std::string>();
      if (l.contains("stacks") && l["stacks"].is_array())
        for (auto& x : l["stacks"])
          if (x.is_string()) links[v].stacks.push_back(x.get<std::string>());
    }
  // The widths each variant is planned at, from the plan's run ids (`<variant>-d<width>-s<seed>`).
  if (manifest.contains("runs") && manifest["runs"].is_object()) {
    std::map<std::string, std::set<int>> widths;
    for (auto& [id, h] : manifest["runs"].items()) {
      std::string v;
      int d = 0;
      if (parse_run_id(id, v, d)) widths[v].insert(d);
    }
    for (auto& [v, ds] : widths)  // (a variant without recorded links keeps its results' own)
      if (auto l = links.find(v); l != links.end()) l->second.widths.assign(ds.begin(), ds.end());
  }
  if (!opt.vs.empty()) {
    std::set<std::string> present;
    for (auto& x : results) present.insert(x.value("variant", ""));
    if (!present.count(opt.vs))
      fail("--vs {}: {} has no finished run of a variant '{}' (it has: {})", opt.vs, opt.dir.string(), opt.vs,
           fmt::join(present, ", "));
    for (auto& v : present) {  // (the planned widths stay)
      links[v].baseline = v == opt.vs ? "" : opt.vs;
      links[v].stacks.clear();
    }
  }
  // The sweep's throughput timing, for the cells timed with the config their results were made with.
  std::optional<Timing> timing;
  std::vector<std::string> stale;
  if (const fs::path tf = opt.dir / "timing.json"; fs::exists(tf)) {
    timing = read_timing(tf);
    std::map<std::string, std::string> hash_of;
    for (auto& x : results) hash_of[x.value("run", "")] = x.value("config_hash", "");
    std::erase_if(timing->cells, [&](const TimedCell& c) {
      auto h = hash_of.find(c.run);
      const bool keep = h != hash_of.end() && h->second == c.config_hash;
      if (!keep) stale.push_back(c.run);
      return !keep;
    });
  }
  Report r = compute_report(results, E, alpha, manifest.value("variants", std::vector<std::string>{}), links, timing);
  if (!stale.empty())
    r.warnings.insert(r.warnings.begin(),
                      fmt::format("timing.json: {} timed model(s) left out, timed with a config no stored result of the "
                                  "plan has: {} (`ladder sweep ... --retime` times again)",
                                  stale.size(), fmt::join(stale, ", ")));
  r.name = manifest.value("spec_name", opt.dir.filename().string());
  if (!opt.vs.empty())
    r.warnings.insert(r.warnings.begin(), fmt::format("--vs {}: every variant is measured against {}, not against its "
                                                      "spec baseline (no stacks)",
                                                      opt.vs, opt.vs));
  if (!excluded.empty())
    r.warnings.insert(r.warnings.begin(),
                      fmt::format("{} stored result(s) left out, not part of the spec's current plan: {}", excluded.size(),
                                  fmt::join(excluded, ", ")));
  fs::path out = opt.out.empty() ? opt.dir / "report" : opt.out;
  fs::create_directories(out);
  std::string md = report_markdown(r);
  write_file_atomic(out / "report.md", md);
  write_file_atomic(out / "loss_vs_compute.svg", loss_plot_svg(r));
  write_file_atomic(out / "speedups.svg", speedup_plot_svg(r));
  write_file_atomic(out / "val_curves.svg", val_curves_svg(r));
  write_file_atomic(out / "report.html", report_html(r));
  return md;
}

}  // namespace ladder
