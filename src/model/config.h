// The run configuration: one schema (config.cpp) is the single source of truth for every key, its
// type, default and meaning. YAML files and --set overrides go through it; unknown keys are errors.
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace ladder {

struct ModelConfig {
  int vocab_size = 0;  // 0: taken from the data directory's meta.json
  int d_model = 256;
  int n_layers = 4;
  int n_heads = 4;
  int n_kv_heads = 0;  // 0: = n_heads (no grouping)
  int head_dim = 0;    // 0: d_model / n_heads
  int d_ff = 0;        // 0: 4 * d_model (RECIPE.md: dense MLP hidden 4*d)
  int seq_len = 256;
  double rope_theta = 500000.0;
  double norm_eps = 1e-6;
  bool qk_norm = true;
  int window = 0;          // sliding window on every layer; 0 = full causal
  double init_std = 0.0;   // 0: 0.5/sqrt(d_model) (RECIPE.md), truncated at +-3 sigma
  double z_loss = 0.0;     // final-logit z-loss coefficient (recipe: 1e-4)
  // MoE V1 block (RECIPE.md section 2; src/model/moe.h). moe_experts = 0: every MLP is dense.
  int moe_experts = 0;             // routed experts E
  int moe_top_k = 4;               // active routed experts per token K
  int moe_expert_ff = 0;           // routed expert hidden I; 0: ceil(d/2/128)*128
  bool moe_shared_expert = true;   // always-on shared SwiGLU expert
  int moe_shared_ff = 0;           // shared expert hidden; 0: d_model
  std::string moe_layers = "all";  // "all" or comma-separated layer indices, e.g. "1,3"
  std::string moe_combine = "sigmoid";  // sigmoid (V1) | normalized (w = scale*sig/sum_topK sig)
  double moe_route_scale = 2.5;    // factor of the normalized combine weights
  std::string moe_balance = "auto";  // auto = quantile when MoE is on; quantile | none
  double router_z_loss = 0.0;      // router z-loss coefficient (recipe: 1e-3), averaged over MoE layers
  // Recipe switches in attention and norms (RECIPE.md section 2; all off in the dense baseline).
  bool half_rope = false;      // RoPE on head dims [0, hd/2) only
  bool qk_norm_gain = true;    // QK-norm with a learned gain; false: non-parametric (recipe V1)
  double q_scale = 1.0;        // queries *= q_scale after RoPE (recipe V1: 1.3)
  int long_every = 0;          // > 0: layer i is long (full causal) iff i % long_every == long_every-1
  bool last_layer_long = false;  // the last layer is long as well (PKO rung)
  bool pko = false;            // partial key offset on long layers
  int eod_id = -1;             // end-of-document token (PKO document starts); -1: from the data
  bool xsa = false;            // exclusive self attention
  bool attn_gate = false;      // per-head output gate 2*sigmoid(h W_g), W_g zero at init
  int gated_norm_rank = 0;     // GatedNorm after each d-wide RMSNorm; 0 = off (recipe V1: 128)
  bool recompute = false;      // activation recomputation: keep only each layer's input, re-run its forward in backward
  std::string saved_activations = "fp32";  // fp32 | bf16: storage of what the backward reads (compute stays fp32)
  bool mlp_bf16 = false;       // dense MLP layers: gate/up/SwiGLU output computed into and stored in bf16
  bool moe_bf16 = false;       // MoE layers: the experts' gate/up/SwiGLU output likewise (routed and shared)
  bool moe_bf16_grads = false; // with moe_bf16: the routed experts' activation gradients in bf16 too
  double moe_capacity = 0.0;   // > 0: capacity layout, C = this x the mean expert load rows per expert; 0 = sorted
  bool mlp_bf16_grads = false; // with mlp_bf16: the dense MLP's activation gradients in bf16 too
  bool attn_bf16 = false;      // attention block: q/k/v, their normed and rotated forms, the attention output
                               // and the XSA / gated outputs computed into and stored in bf16
  bool norm_bf16 = false;      // block norms' outputs (the attention input; the dense MLP input) written in bf16

  int kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }
  int hd() const { return head_dim > 0 ? head_dim : d_model / n_heads; }
  int ff() const { return d_ff > 0 ? d_ff : 4 * d_model; }
  bool moe() const { return moe_experts > 0; }
  // model.moe_capacity's rows per expert for a micro-batch of `tokens`: moe_capacity x the mean load
  // tokens * top_k / experts, rounded up to a multiple of 8 (16-byte rows of bf16 matrices), at most
  // `tokens` (no expert takes a token twice, so more would only pad); 0 when off.
  int expert_capacity(int64_t tokens) const;
  // ceil(d/2/128)*128 = ceil(d/256)*128 in integers (halving d first would floor an odd d's half).
  int expert_ff() const { return moe_expert_ff > 0 ? moe_expert_ff : (d_model + 255) / 256 * 128; }
  int shared_ff() const { return !moe_shared_expert ? 0 : moe_shared_ff > 0 ? moe_shared_ff : d_model; }
  bool moe_normalized() const { return moe_combine == "normalized"; }
  bool moe_quantile_balance() const { return moe() && moe_balance != "none"; }
  // Whether layer l's MLP is a MoE block (parses moe_layers; validate() reports bad lists).
  bool is_moe_layer(int l) const;
  int n_moe_layers() const;
  // Long layers attend full-causal (and are where PKO applies); the others use `window`.
  bool is_long_layer(int l) const {
    return (long_every > 0 && l % long_every == long_every - 1) || (last_layer_long && l == n_layers - 1);
  }
  int layer_window(int l) const { return is_long_layer(l) ? 0 : window; }
  int rope_dims() const { return half_rope ? hd() / 2 : hd(); }
  bool learned_qk_gain() const { return qk_norm && qk_norm_gain; }
};

struct OptimConfig {
  std::string name = "adamw";
  double lr = 3e-3;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;  // applied to matrices only (attention, MLP, LM head)
  double embed_lr_mult = 1.0;  // learning-rate multiplier of the embedding group
  double clip = 1.0;           // global grad-norm clip; 0 = off
  // RECIPE.md section 3 (src/optim/optimizers.cpp, docs/optimizers.md). Per-optimizer peak learning
  // rates: "" = optim.lr, a number, "auto" (the recipe's fitted heuristics) or "N*auto" (N times
  // it: a tuned multiple that follows the heuristic across widths, e.g. in a ladder spec).
  std::string adam_lr, adamh_lr, muon_lr, muonh_lr;
  double muon_momentum = 0.95;
  // Group overrides: comma-separated selectors (role:<role> or a name glob) moving tensors from the
  // preset's assignment to this optimizer.
  std::string adamw_params, adam_params, adamh_params, muon_params, muonh_params;
  // Per-tensor lr factors on top of the optimizer's: "selector=factor, ..." (parse_lr_mults).
  std::string lr_mults;
};

// `x` without its leading and trailing spaces and tabs (config values as the user wrote them).
std::string trim_blanks(const std::string& x);
// A selector list (optim.<opt>_params, optim.lr_mults): the comma-separated entries, each without
// its surrounding blanks, empty ones dropped.
std::vector<std::string> split_selectors(const std::string& value);
// optim.lr_mults' entries, in order: each a selector (as in optim.<opt>_params) and its factor
// (finite, >= 0). Throws for bad text, naming the key and the entry.
std::vector<std::pair<std::string, double>> parse_lr_mults(const std::string& value);

// An lr key's `auto` form: 1 for "auto", N for "N*auto" (N > 0, finite); nothing for any other text
// (a number, empty). Throws for "N*auto" with a bad N, naming `key`.
std::optional<double> auto_lr_multiplier(const std::string& key, const std::string& value);
// An lr key's value as a plain number, if the whole text is a finite one (strtod also reads inf,
// nan); nothing otherwise. The sign is the caller's to check.
std::optional<double> plain_lr(const std::string& value);

struct ScheduleConfig {
  std::string type = "linear";  // linear | cosine | wsd | constant
  double warmup = 0.1;          // < 1: fraction of steps; >= 1: number of steps
  double final_lr_frac = 0.0;   // lr at the last step, as a fraction of the peak
  double decay_frac = 0.2;      // wsd: fraction of steps spent decaying at the end
};

struct DataConfig {
  std::string path = "data/default";
};

struct RunConfig {
  int64_t steps = 1000;
  int batch_size = 8;  // sequences per micro-batch
  int grad_accum = 1;  // micro-batches per optimizer step
  uint64_t seed = 1;
  int64_t eval_every = 100;
  int eval_batches = 4;
  int64_t ckpt_every = 500;
  int keep_checkpoints = 2;
  int64_t log_every = 10;
  int threads = 0;  // 0: all cores
  std::string device = "cpu";
  std::string precision = "fp32";  // GEMMs on cuda: fp32 | tf32 | bf16
  std::string attention = "ladder";  // on cuda under bf16: ladder | cudnn | cudnn-nondeterministic
  bool shard_optimizer = false;      // data parallel: ZeRO stage 1 (OptimizerShards)
};

struct Config {
  ModelConfig model;
  OptimConfig optim;
  ScheduleConfig schedule;
  DataConfig data;
  RunConfig run;
  std::string source;  // file it was read from, and the --set overrides applied (for error messages)
};

// Loads a YAML file (missing keys keep their defaults), then applies "key.path=value" overrides.
// Errors name the file, line and key.
Config load_config(const std::filesystem::path& file, const std::vector<std::string>& overrides = {});
// Applies one "key.path=value" override.
void apply_override(Config& cfg, const std::string& kv);
// Whether this build's config schema has the key (docs/config.md).
bool is_config_key(const std::string& key);
// Shape checks (heads divide d, kv heads divide heads, ...), ranges (every number finite, eps > 0,
// ...) and whether this build can run run.device; errors name the field.
void validate(const Config& cfg);
// The checks of the attention/norm recipe switches (part of validate()); `where` prefixes errors.
void validate_attention_switches(const ModelConfig& m, const std::string& where);
// The resolved config as YAML text (every key) and as JSON.
std::string to_yaml(const Config& cfg);
nlohmann::json to_json(const Config& cfg);
// Keys added after the config hash's first format (optim.lr_mults, ...). A file written before one
// existed (a stored run's config, a checkpoint's state.json) lacks it, which means its default.
bool is_late_key(const std::string& key);
// What a run's identity (the ladder's config hash) is taken over: to_json without the late keys
// that hold their defaults, so a run stored before a key existed keeps its hash when that key is
// not used, and any use of the key changes it.
nlohmann::json identity_json(const Config& cfg);
// The inverse of to_json, for a checkpoint's config: every value type- and range-checked (a late key
// may be missing: its default), then
// validate()'s checks except the device one (a CUDA run's checkpoint can be sampled on the CPU);
// errors name `source` (the file) and the key.
Config from_json(const nlohmann::json& j, const std::string& source);
// Markdown table of every key, type, default and meaning (docs/config.md is generated from it).
std::string schema_markdown();

}  // namespace ladder
