// Small model configurations shared by the tests that run one model on two backends: the CUDA
// model tests (tests/cuda/test_cuda_model.cpp) and the emulated-device tests
// (tests/test_device_emulation.cpp). Dense (GQA, sliding window), MoE (normalized combine, shared
// expert, quantile balancing, router z-loss, one dense layer) and every attention/norm switch.
#pragma once
#include <cstdint>
#include <vector>

#include "core/rng.h"
#include "model/config.h"

namespace ladder::test {

inline Config base_config() {
  Config c;
  c.source = "cuda-model-test";
  auto& m = c.model;
  m.vocab_size = 160;
  m.d_model = 64;
  m.n_layers = 3;
  m.n_heads = 4;
  m.n_kv_heads = 2;  // GQA 2:1
  m.head_dim = 16;
  m.d_ff = 96;
  m.seq_len = 32;
  m.rope_theta = 10000;
  m.z_loss = 1e-4;
  c.run.batch_size = 2;
  c.run.grad_accum = 2;
  c.run.seed = 3;
  c.optim.lr = 3e-3;
  c.optim.clip = 1.0;
  return c;
}

inline Config dense_config() {
  Config c = base_config();
  c.model.window = 8;       // short layers: sliding window of 8 ...
  c.model.long_every = 2;   // ... layer 1 long (full causal)
  return c;
}

inline Config moe_config() {
  Config c = base_config();
  auto& m = c.model;
  m.moe_experts = 8;
  m.moe_top_k = 2;
  m.moe_expert_ff = 32;
  m.moe_shared_expert = true;
  m.moe_shared_ff = 48;
  m.moe_combine = "normalized";
  m.moe_route_scale = 2.5;
  m.moe_balance = "quantile";
  m.router_z_loss = 1e-3;
  m.moe_layers = "0,2";  // layer 1 dense: mixed models too
  return c;
}

inline constexpr int kEod = 3;

inline Config switches_config() {
  Config c = base_config();
  auto& m = c.model;
  m.half_rope = true;
  m.qk_norm_gain = false;
  m.q_scale = 1.3;
  m.window = 8;
  m.long_every = 2;
  m.last_layer_long = true;
  m.pko = true;
  m.eod_id = kEod;
  m.xsa = true;
  m.attn_gate = true;
  m.gated_norm_rank = 8;
  return c;
}

// Every switch and a MoE block (with its shared expert, balancing, router z-loss; layer 1 dense):
// the widest model, for the memory-layout options (recompute, bf16 saved activations).
inline Config moe_switches_config() {
  Config c = switches_config();
  const Config m = moe_config();
  for (auto f : {&ModelConfig::moe_experts, &ModelConfig::moe_top_k, &ModelConfig::moe_expert_ff,
                 &ModelConfig::moe_shared_ff})
    c.model.*f = m.model.*f;
  c.model.moe_shared_expert = m.model.moe_shared_expert;
  c.model.moe_balance = m.model.moe_balance;
  c.model.router_z_loss = m.model.router_z_loss;
  c.model.moe_layers = m.model.moe_layers;
  return c;
}

// Uniform tokens; every 11th position an end-of-document id, so PKO resets inside sequences.
inline void make_batch(const Config& c, uint64_t seed, std::vector<int32_t>& in, std::vector<int32_t>& tg) {
  const size_t N = size_t(c.run.batch_size) * c.model.seq_len;
  in.resize(N);
  tg.resize(N);
  Philox r(seed, stream_id("cuda-model-batch"));
  for (size_t i = 0; i < N; ++i) {
    in[i] = i % 11 == 5 ? kEod : int32_t(r.u64(2 * i) % uint64_t(c.model.vocab_size));
    tg[i] = int32_t(r.u64(2 * i + 1) % uint64_t(c.model.vocab_size));
  }
}

}  // namespace ladder::test
