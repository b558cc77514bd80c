// Small statistics shared by the trainer, the benchmarks and the ladder.
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

namespace ladder {

// The median (the mean of the middle two for an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// {median, smallest, largest}; NaNs for none.
inline std::array<double, 3> median_min_max(const std::vector<double>& v) {
  if (v.empty()) return {NAN, NAN, NAN};
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return {median(v), *lo, *hi};
}

}  // namespace ladder
