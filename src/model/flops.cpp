#include "model/flops.h"

namespace ladder {

FlopsPerToken flops_per_token(const ModelConfig& m) {
  const double d = m.d_model, H = m.n_heads, KV = m.kv_heads(), hd = m.hd(), S = m.seq_len, I = m.ff();
  const double L = m.n_layers, V = m.vocab_size;
  FlopsPerToken f;
  f.attn_proj = L * (2 * d * (H * hd + 2 * KV * hd) + 2 * d * (H * hd));
  f.attn_core = L * (S * (4 * H * hd + 3 * H));
  // Per layer: a dense MLP, or a MoE block that counts only its K active routed experts.
  const double E = m.moe_experts, K = m.moe_top_k, Ie = m.expert_ff(), Is = m.shared_ff();
  const double Lmoe = m.n_moe_layers();
  f.mlp = (L - Lmoe) * (6 * d * I) + Lmoe * (6 * d * Ie * K + 6 * d * Is + 2 * d * E);
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
                      + (m.attn_gate ? H * d : 0)           // per-head output gate
                      + 2 * 2 * d * m.gated_norm_rank;      // GatedNorm after both block norms
  const int64_t E = m.moe_experts, K = m.moe_top_k, Ie = m.expert_ff(), Is = m.shared_ff();
  const int64_t Lmoe = m.n_moe_layers();
  const int64_t dense_mlp = 3 * d * I;                                 // gate, up, down
  const int64_t moe_total = E * d + E * 3 * d * Ie + 3 * d * Is;       // router, experts, shared
  const int64_t moe_active = E * d + K * 3 * d * Ie + 3 * d * Is;
  ParamCount p;
  p.embedding = V * d;
  p.head = V * d;
  const int64_t base = p.embedding + p.head + d + 2 * d * m.gated_norm_rank  // final norm (+ GatedNorm)
                       + m.n_layers * per_layer + (m.n_layers - Lmoe) * dense_mlp;
  p.total = base + Lmoe * moe_total;
  p.active = base + Lmoe * moe_active;
  return p;
}

}  // namespace ladder
