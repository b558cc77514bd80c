// The machine's measured sgemm rate: the MFU denominator on CPU. Measured once per (host, threads)
// and cached under $XDG_CACHE_HOME/ladder (or ~/.cache/ladder).
#pragma once

namespace ladder {

// Median GFLOP/s of a training-shaped sgemm on the current thread count. `use_cache`: return the
// cached value if there is one. A fresh measurement always refreshes the cache.
double sgemm_gflops(bool use_cache = true);

}  // namespace ladder
