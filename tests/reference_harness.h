// The C++ side of the PyTorch parity tests: what the reference (tests/reference/run_ref.py) reads,
// written from a Config and a model, and what it writes back. Shared by test_parity (dense),
// test_moe and test_attn_switches.
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <vector>

#include "core/fileio.h"
#include "core/safetensors.h"
#include "model/transformer.h"
#include "train/bench.h"
#include "train/checkpoint.h"
#include "test_util.h"

namespace ladder::test {

// config.json as the reference reads it: the model, the optimizer and schedule (torch_config_json).
inline void write_reference_config(const std::filesystem::path& dir, const Config& c) {
  const auto j = torch_config_json(c);
  write_file_atomic(dir / "config.json", j.dump(2));
}

// Writes config, weights and `batches` batches of [B, S] tokens (the leading dimension is dropped
// when batches == 0), and runs the reference with `args`. Throws (a test failure) if it fails.
// Training (batches > 0) with run.grad_accum = A: each step's A micro-batches of [B, S], stored one
// after the other, are the reference's one batch of [A x B, S] (the same mean loss and gradient
// over the step's tokens, which is what accumulation must compute).
inline void run_reference_on(const std::filesystem::path& dir, const Config& c, const Transformer& model,
                             const std::vector<int32_t>& inputs, const std::vector<int32_t>& targets,
                             int batches, const std::string& file, const std::string& args) {
  const int64_t B = c.run.batch_size * (batches > 0 ? c.run.grad_accum : 1), S = c.model.seq_len;
  std::vector<int64_t> shape = batches > 0 ? std::vector<int64_t>{batches, B, S} : std::vector<int64_t>{B, S};
  write_reference_config(dir, c);
  save_weights(dir / "model.safetensors", model);
  save_safetensors(dir / file, {{"inputs", DType::I32, shape, inputs.data()},
                                {"targets", DType::I32, shape, targets.data()}});
  if (run_reference(args + " --dir " + dir.string()) != 0) throw std::runtime_error("PyTorch reference failed: " + args);
}

// The reference's logits, loss and every gradient on one batch (ref_out.safetensors).
inline SafeTensors reference_forward_backward(const std::filesystem::path& dir, const Config& c,
                                              const Transformer& model, const std::vector<int32_t>& inputs,
                                              const std::vector<int32_t>& targets) {
  run_reference_on(dir, c, model, inputs, targets, 0, "batch.safetensors", "forward-backward");
  return SafeTensors::open(dir / "ref_out.safetensors");
}

// The reference's losses and grad norms over `steps` optimizer steps (ref_train.json); its final
// weights are in dir/ref_final.safetensors.
inline nlohmann::json reference_train(const std::filesystem::path& dir, const Config& c, const Transformer& model,
                                      const std::vector<int32_t>& inputs, const std::vector<int32_t>& targets,
                                      int steps) {
  run_reference_on(dir, c, model, inputs, targets, steps, "batches.safetensors",
                   "train --steps " + std::to_string(steps));
  return nlohmann::json::parse(read_file(dir / "ref_train.json"));
}

// Relative error of the model's logits on `inputs` against the reference's.
inline double logits_rel_err(Transformer& model, const std::vector<int32_t>& inputs, const SafeTensors& ref) {
  const auto& m = model.config();
  std::vector<float> logits(size_t(model.batch()) * m.seq_len * m.vocab_size);
  model.forward_logits(inputs.data(), logits.data());
  auto ref_logits = ref.get_f32("logits");
  if (ref_logits.size() != logits.size()) throw std::runtime_error("reference logits have another shape");
  return rel_err(logits.data(), ref_logits.data(), logits.size());
}

}  // namespace ladder::test
