// `ladder bench --optim`: the optimizer step's share of a training step, for each optimizer preset,
// and the cost of Muon's orthogonalization (normalization + 5 Newton-Schulz steps) per matrix shape.
// Medians over timed repetitions (the machine may be shared and noisy).
#pragma once
#include <nlohmann/json.hpp>

#include "train/bench.h"

namespace ladder {

nlohmann::json run_optim_bench(const BenchOptions& opt);
// Human-readable table of run_optim_bench's JSON.
std::string format_optim_bench(const nlohmann::json& j);

}  // namespace ladder
