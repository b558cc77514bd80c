// `ladder bench`: training throughput of a preset on synthetic tokens, as a ratio to the machine's
// measured sgemm rate (MFU), optionally beside the independent PyTorch model on the same shapes.
#pragma once
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"

namespace ladder {

struct BenchOptions {
  std::filesystem::path config;  // preset YAML
  std::vector<std::string> overrides;
  int steps = 5;                 // timed steps (after 2 warm-up steps); the median is reported
  bool torch = false;            // also time scripts/bench-torch.py on the same model
  bool profile = false;          // time every backend op; adds "profile" to the result
};

nlohmann::json run_bench(const BenchOptions& opt);
// A flat JSON description of the model and batch, as the PyTorch scripts read it.
nlohmann::json torch_model_json(const Config& cfg);

}  // namespace ladder
