#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

namespace ladder {

int64_t warmup_steps(const ScheduleConfig& s, int64_t total) {
  return s.warmup < 1.0 ? int64_t(std::llround(s.warmup * double(total))) : int64_t(s.warmup);
}

double lr_multiplier(const ScheduleConfig& s, int64_t t, int64_t total) {
  const int64_t w = warmup_steps(s, total);
  if (t < w) return double(t + 1) / double(w);
  const double f = s.final_lr_frac;
  const double progress = double(t - w) / double(std::max<int64_t>(1, total - w));
  if (s.type == "linear") return f + (1.0 - f) * (1.0 - progress);
  if (s.type == "cosine") return f + (1.0 - f) * 0.5 * (1.0 + std::cos(M_PI * progress));
  if (s.type == "wsd") {
    // Stable at the peak, then a linear decay over the last decay_frac of all steps.
    const double decay_start = double(total) * (1.0 - s.decay_frac);
    if (double(t) < decay_start) return 1.0;
    const double p = (double(t) - decay_start) / std::max(1.0, double(total) - decay_start);
    return f + (1.0 - f) * (1.0 - p);
  }
  return 1.0;  // constant
}

}  // namespace ladder
