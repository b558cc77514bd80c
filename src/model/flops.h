// The one FLOP counter (RECIPE.md section 4). Everything that reports FLOPs, MFU or compute
// (progress line, bench, ladder) calls these functions.
#pragma once
#include <cstdint>

#include "model/config.h"

namespace ladder {

struct FlopsPerToken {
  double attn_proj = 0;  // 2*d*(H*hd + 2*KV*hd) + 2*d*(H*hd), summed over layers
  double attn_core = 0;  // S*(4*H*hd + 3*H): full sequence, no causal halving, no window discount
  double mlp = 0;        // dense layers 6*d*I; MoE layers routed 6*d*I*K + shared 6*d*I_s + router 2*d*E
  double head = 0;       // 2*d*V
  // Forward FLOPs per token, without / with the LM head.
  double forward(bool include_head) const { return attn_proj + attn_core + mlp + (include_head ? head : 0); }
  // Training (forward + backward = 3x forward) FLOPs per token.
  double train(bool include_head) const { return 3.0 * forward(include_head); }
};

// Counts the model FLOPs of one token, forward, per RECIPE.md section 4. model.vocab_size must be set.
FlopsPerToken flops_per_token(const ModelConfig& m);
// Compute of a run, C = 3 * (forward FLOPs per token without head) * tokens (RECIPE.md section 4).
double run_compute(const ModelConfig& m, double tokens);

// Parameter counts.
struct ParamCount {
  int64_t total = 0;       // every parameter
  int64_t embedding = 0;   // input embedding
  int64_t head = 0;        // LM head
  int64_t active = 0;      // parameters one token uses: total minus the E-K routed experts it skips
  int64_t non_embedding() const { return total - embedding; }
};
ParamCount count_params(const ModelConfig& m);

}  // namespace ladder
