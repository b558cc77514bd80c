// Text generation from a checkpoint (no KV cache: each new token re-runs the causal forward over
// the current context window, which is plenty for the small models Ladder trains on CPU).
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

namespace ladder {

struct SampleOptions {
  std::string prompt;
  double temperature = 0.8;  // 0: greedy
  int top_k = 40;            // 0: full distribution
  int max_tokens = 100;
  uint64_t seed = 1;
  int threads = 0;
};

// Fails naming the flag when an option is out of range (sample_text checks them first too; the CLI
// calls this before it looks at the checkpoint).
void check_sample_options(const SampleOptions& opt);
// Loads the checkpoint (a checkpoint directory or a run directory) and returns prompt + continuation.
std::string sample_text(const std::filesystem::path& checkpoint, const SampleOptions& opt);

}  // namespace ladder
