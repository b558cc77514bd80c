// `ladder bench`: training throughput of a preset on synthetic tokens, as a ratio to the machine's
// measured sgemm rate (MFU), optionally beside PyTorch on the same model, shapes, device and
// precision (`--torch`: scripts/bench-torch.py, after Ladder's run has released the device).
#pragma once
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"

namespace ladder {

class Backend;
class Optimizer;
class Transformer;

struct BenchOptions {
  std::filesystem::path config;  // preset YAML
  std::vector<std::string> overrides;
  int steps = 5;                 // timed steps (after 2 warm-up steps); the median is reported
  bool torch = false;            // also time scripts/bench-torch.py (PyTorch) on the same model
  std::string torch_args;        // extra arguments for it (e.g. "--compile")
  bool profile = false;          // time every backend op; adds "profile" to the result
};

nlohmann::json run_bench(const BenchOptions& opt);

// Wall and process-CPU seconds of `steps` training steps (forward, backward, optimizer) of `model`
// on one synthetic micro-batch, after `warmup` untimed ones; `after_warmup` runs between them.
struct StepTimes {
  std::vector<double> wall, cpu;
};
StepTimes time_train_steps(const Config& cfg, Transformer& model, Optimizer& optimizer, Backend& be, int warmup,
                           int steps, const std::function<void()>& after_warmup = {});
// The same with a backend, model (initialized with run.seed) and optimizer of its own, released on
// return: the training step of `cfg` as `ladder sweep`'s throughput timing measures it.
StepTimes time_train_steps(const Config& cfg, int warmup, int steps);
// The PyTorch baseline on the same model and batch shape (scripts/bench-torch.py: its fast
// implementation, checked against the reference by tests/reference/check_fast_model.py) at the
// config's device and precision, with $LADDER_TORCH_PYTHON (else Debian's /usr/bin/python3 on the
// CPU, python3 on a GPU machine); its JSON line. A failure is an error naming the command.
nlohmann::json run_torch_bench(const Config& cfg, const BenchOptions& opt);
// The config of a benchmark run: the preset with its overrides, validated. Synthetic tokens need no
// data directory, so a vocabulary of 8192 and the tokenizer's </s> (id 2) stand in where it leaves
// them open.
Config load_bench_config(const BenchOptions& opt);
// One synthetic micro-batch [batch_size, seq_len] of uniform random tokens (Philox keyed by run.seed).
void synthetic_batch(const Config& cfg, std::vector<int32_t>& inputs, std::vector<int32_t>& targets);
// A flat JSON description of the model and batch, as the PyTorch scripts read it.
nlohmann::json torch_model_json(const Config& cfg);
// The same plus "optim" (AdamW's hyperparameters, clip, and the schedule's warmup, total_steps and
// final_lr_frac): the config.json of the PyTorch reference and of the PyTorch baseline.
nlohmann::json torch_config_json(const Config& cfg);

}  // namespace ladder
