#include "model/flops.h"

namespace ladder {

FlopsPerToken flops_per_token(const ModelConfig& m) {
  const double d = m.d_model, H = m.n_heads, KV = m.kv_heads(), hd = m.hd(), S = m.seq_len, I = m.ff();
  const double L = m.n_layers, V = m.vocab_size;
  FlopsPerToken f;
  f.attn_proj = L * (2 * d * (H * hd + 2 * KV * hd) + 2 * d * (H * hd));
  f.attn_core = L * (S * (4 * H * hd + 3 * H));
  f.mlp = L * (6 * d * I);
  f.head = 2 * d * V;
  return f;
}

double run_compute(const ModelConfig& m, double tokens) { return flops_per_token(m).train(false) * tokens; }

ParamCount count_params(const ModelConfig& m) {
  const int64_t d = m.d_model, H = m.n_heads, KV = m.kv_heads(), hd = m.hd(), I = m.ff(), V = m.vocab_size;
  int64_t per_layer = 2 * d                              // input / post-attention norm gains
                      + d * H * hd + 2 * d * KV * hd     // q, k, v
                      + H * hd * d                       // o
                      + (m.learned_qk_gain() ? 2 * hd : 0)  // q_norm, k_norm gains
                      + (m.attn_gate ? H * d : 0)        // per-head output gate
                      + 2 * 2 * d * m.gated_norm_rank    // GatedNorm after both block norms
                      + 3 * d * I;                       // gate, up, down
  ParamCount p;
  p.embedding = V * d;
  p.head = V * d;
  p.total = p.embedding + p.head + d + 2 * d * m.gated_norm_rank + m.n_layers * per_layer;
  return p;
}

}  // namespace ladder
