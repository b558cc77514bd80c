// Scaling-law fits and the speedup formulas (RECIPE.md section 4).
//
// The law is loss(C) = E + A * C^-alpha, C the run's compute (3 x forward FLOPs without the LM head x
// tokens, src/model/flops.h). Two ways to read a speedup of a variant over its baseline:
//  - Marin's: E and alpha fixed, A refit through the baseline's point at one scale; the compute the
//    baseline would need to reach the variant's loss, over the variant's compute.
//  - Ladder's: a law fitted per variant over the whole ladder (every scale and seed); the speedup at a
//    scale is read at equal loss: the baseline law's compute for the loss the variant's law gives at
//    the variant's compute, over that compute.
//  - Interpolated (no law): the baseline's measured curve, its mean loss per scale against compute,
//    read at the variant's loss between the two scales that bracket it; where no two do, a bound.
#pragma once
#include <limits>
#include <vector>

namespace ladder {

struct PowerLaw {
  double E = 0, A = 0, alpha = 0;
  // Which parameters were fitted (the others were held at the given values).
  bool fit_E = false, fit_alpha = false;
  double rmse = 0;  // root-mean-square residual in loss units over the fitted points
  int n_points = 0;
  int n_distinct = 0;  // distinct compute values among the points (seeds repeat a compute value)
  // E ended at an end of its range [0, min loss): the data did not locate the floor (the law is
  // then a near-straight line in log space, or bends at the last point); speedups read inside the
  // data are still interpolations, but E itself means nothing.
  bool E_at_bound = false;
  // Distinct compute values left over after the free parameters: 0 means the law goes exactly
  // through the cells' means and nothing in the data tests its shape.
  int residual_dof() const { return n_distinct - 1 - int(fit_E) - int(fit_alpha); }
  double loss(double C) const;
  // Compute at which the law reaches `loss`; +inf when loss <= E (unreachable), NaN when the law is
  // not decreasing (alpha <= 0 or A <= 0).
  double compute_for(double loss) const;
};

struct LawPoint {
  double C = 0, loss = 0;
};

// Fits E + A*C^-alpha by nonlinear least squares in loss units. Free parameters depend on how many
// distinct compute values there are: >= 3: E, A, alpha; 2: A and E (alpha held at alpha0); 1: A only
// (E0, alpha0 held). E is kept in [0, min loss). Method: a grid over E with a linear fit of
// log(loss - E) against log C at each grid point (a global search that needs no starting guess), then
// Levenberg-Marquardt on the loss-space residuals from the best grid point.
PowerLaw fit_power_law(const std::vector<LawPoint>& pts, double E0, double alpha0);

// Marin's law through one point: E and alpha fixed, A = (L - E) * C^alpha (A <= 0, no decreasing
// law, when L <= E).
PowerLaw law_through(double C, double L, double E, double alpha);

// Marin's method at one scale: A refit through the baseline's point (C_base, L_base) with E, alpha
// fixed; C_needed = (A / (L_variant - E))^(1/alpha); theoretical = C_needed / C_variant.
// +inf when L_variant <= E.
double marin_theoretical_speedup(double C_base, double L_base, double C_variant, double L_variant, double E,
                                 double alpha);
// Wall-clock speedup: the baseline's time to reach the variant's loss over the variant's time,
// = theoretical * model FLOP/s(variant) / model FLOP/s(baseline), FLOP/s counted as C is (no LM
// head), i.e. theoretical times the change in hardware utilization (RECIPE.md section 1: "realized is wall-clock, i.e. it includes the change in hardware
// utilization (MFU)"). Section 4 writes the ratio as tokens/s, which is the same number only when
// both models spend the same FLOPs per token (not so for dense -> MoE); Ladder passes model FLOP/s
// (C per token x tokens/s), following section 1 where the two disagree.
double realized_speedup(double theoretical, double flops_per_s_variant, double flops_per_s_base);
// The compute a measured curve needs to reach `loss`, with no law: the points (one per scale, e.g.
// the baseline's mean loss and compute there) sorted by compute and joined by straight lines in
// log C, read at the first segment whose ends bracket the loss. Outside the points' losses it is a
// bound on the compute needed, assuming only that loss falls as compute grows: bound = +1, the loss
// is below every point's (C: the largest compute measured; more is needed), -1 above every point's
// (C: the smallest; less is needed). C is NaN for no points or a non-finite value.
struct CurveReading {
  double C = std::numeric_limits<double>::quiet_NaN();
  int bound = 0;
  // Inside (bound 0): the indices (in `curve`) of the two points read between, lower compute first;
  // both the same point where the loss is that point's own. The longer that stretch in compute,
  // the less a straight line says about the curve. -1: not read between points.
  int lo = -1, hi = -1;
};
CurveReading compute_on_curve(const std::vector<LawPoint>& curve, double loss);

// Ladder's: the baseline law's compute for the loss the variant's law predicts at C_variant, over C_variant.
double law_speedup(const PowerLaw& base, const PowerLaw& variant, double C_variant);

}  // namespace ladder
