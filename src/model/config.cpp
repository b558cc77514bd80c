#include "model/config.h"
#include "optim/schedule.h"

#include <yaml-cpp/yaml.h>

#include <nlohmann/json.hpp>
#include <cctype>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string_view>
#include <functional>
#include <cmath>
#include <algorithm>
#include <array>
#include <map>
#include <sstream>
#include <variant>

#include "core/error.h"
#include "core/yaml_keys.h"

namespace ladder {
namespace {

using Ref = std::variant<int*, int64_t*, uint64_t*, double*, bool*, std::string*>;

struct Field {
  std::string key;
  std::string doc;
  std::function<Ref(Config&)> ref;
  // Added after the config hash's first format (2026-12): hashed only when not at its default, and
  // optional in from_json, so runs and checkpoints written before it keep their identity.
  bool late = false;
};

#define LADDER_FIELD(sec, name, doc) \
  Field { #sec "." #name, doc, [](Config& c) -> Ref { return &c.sec.name; } }
// Every key added from now on is a late one (is_late_key).
#define LADDER_LATE_FIELD(sec, name, doc) \
  Field { #sec "." #name, doc, [](Config& c) -> Ref { return &c.sec.name; }, true }

// The schema: every configuration key, in the order it is printed.
const std::vector<Field>& schema() {
  static const std::vector<Field> fields = {
      LADDER_FIELD(model, vocab_size, "vocabulary size; 0 = read from the data directory's meta.json"),
      LADDER_FIELD(model, d_model, "residual width d"),
      LADDER_FIELD(model, n_layers, "number of transformer blocks"),
      LADDER_FIELD(model, n_heads, "query heads H"),
      LADDER_FIELD(model, n_kv_heads, "key/value heads KV (GQA); 0 = n_heads; must divide n_heads"),
      LADDER_FIELD(model, head_dim, "head dimension; 0 = d_model / n_heads"),
      LADDER_FIELD(model, d_ff, "SwiGLU hidden size I; 0 = 4 * d_model"),
      LADDER_FIELD(model, seq_len, "training sequence length S"),
      LADDER_FIELD(model, rope_theta, "RoPE base (> 0)"),
      LADDER_FIELD(model, norm_eps, "RMSNorm epsilon (> 0)"),
      LADDER_FIELD(model, qk_norm, "RMSNorm (learned gain per head dim) on queries and keys"),
      LADDER_FIELD(model, window, "sliding attention window in tokens; 0 = full causal"),
      LADDER_FIELD(model, init_std, "init std (truncated normal, +-3 sigma); 0 = 0.5/sqrt(d_model)"),
      LADDER_FIELD(model, z_loss, "final-logit z-loss coefficient (0 = off; recipe 1e-4)"),
      LADDER_FIELD(model, moe_experts, "MoE: routed experts E; 0 = dense MLPs (RECIPE.md section 2, MoE V1 block)"),
      LADDER_FIELD(model, moe_top_k, "MoE: routed experts per token K (recipe 4); 1 <= K <= E"),
      LADDER_FIELD(model, moe_expert_ff, "MoE: routed expert SwiGLU hidden I; 0 = ceil(d/2/128)*128"),
      LADDER_FIELD(model, moe_shared_expert, "MoE: one always-on shared SwiGLU expert"),
      LADDER_FIELD(model, moe_shared_ff, "MoE: shared expert hidden size; 0 = d_model"),
      LADDER_FIELD(model, moe_layers, "MoE: which layers get a MoE block: all, or comma-separated indices (e.g. \"1,3\")"),
      LADDER_FIELD(model, moe_combine, "MoE combine weights: sigmoid (V1, unnormalized) | normalized (scale*sig/sum over top-K)"),
      LADDER_FIELD(model, moe_route_scale, "MoE: factor of the normalized combine weights (recipe 2.5)"),
      LADDER_FIELD(model, moe_balance, "MoE selection-bias balancing: auto (= quantile when MoE is on and moe_top_k < moe_experts) | quantile | none"),
      LADDER_FIELD(model, router_z_loss, "router z-loss coefficient, mean over tokens and MoE layers (0 = off; recipe 1e-3)"),
      LADDER_FIELD(model, half_rope, "RoPE on head dims [0, hd/2) only (hd/4 frequencies, rotate-half pairs); [hd/2, hd) carry no position. Needs head_dim % 4 == 0 (PKO rung: with rope_theta 1e4)"),
      LADDER_FIELD(model, qk_norm_gain, "with qk_norm: true = learned gain per head dim (dense baseline); false = non-parametric RMSNorm (recipe V1)"),
      LADDER_FIELD(model, q_scale, "queries are multiplied by this after QK-norm and RoPE (recipe V1: 1.3); 1 = off"),
      LADDER_FIELD(model, long_every, "long/short layers: 0 = off (every layer uses model.window); P > 0 = layer i is long (full causal) iff i % P == P-1, the others are short (sliding model.window, which must then be >= 1; recipe: 4)"),
      LADDER_FIELD(model, last_layer_long, "the last layer is long (full causal) too (PKO rung)"),
      LADDER_FIELD(model, pko, "partial key offset on long layers: the RoPE-free key half [hd/2, hd) is the previous token's (zero at position 0 and after model.eod_id); needs half_rope and a long last layer (RECIPE.md: model.last_layer_long)"),
      LADDER_FIELD(model, eod_id, "end-of-document token id (PKO document starts); -1 = the data directory's meta.json eod_id"),
      LADDER_FIELD(model, xsa, "exclusive self attention: per head z = y - (y.v / v.v) v, v the token's own value vector"),
      LADDER_FIELD(model, attn_gate, "per-head attention output gate 2*sigmoid(h W_g), h the block's normed attention input, W_g [H, d] zero at init"),
      LADDER_FIELD(model, recompute, "activation recomputation: keep only each layer's input and re-run the layer's forward in the backward (about one more forward of compute; saved activations drop to one layer's plus the residual stream; same results bit for bit)"),
      LADDER_FIELD(model, saved_activations, "storage of the activations the backward reads: fp32, or bf16 (half the memory; the residual stream, norm statistics and MoE routing stay fp32; the forward and the loss are unchanged, gradients see bf16-rounded activations)"),
      LADDER_FIELD(model, moe_bf16, "MoE layers' experts in bf16, as model.mlp_bf16 does for dense MLPs: the gathered expert rows are rounded to bf16, the routed experts' gate and up projections are written by the grouped GEMM in bf16 (rounded fp32 accumulation), SwiGLU computes in fp32 from them into bf16, and the down projection and its weight gradient read that; the shared expert likewise; the expert outputs are written in bf16 and read so by the combine; routing and every gradient stay fp32. Halves the memory of the gathered rows and expert outputs [tokens * top_k, d] and the [tokens * top_k, expert_ff] tensors of every MoE layer; under run.precision bf16 the grouped GEMMs write and read the bf16 tensors directly (on cuda with fp32 or tf32 GEMMs they are widened and rounded in scratch); the loss changes by bf16 rounding (docs/cuda.md)"),
      LADDER_FIELD(model, moe_bf16_grads, "with model.moe_bf16: the routed experts' activation gradients in bf16 as well, as mixed-precision training keeps activation gradients: the gradient of the expert outputs (the combine's backward), of the SwiGLU output (the down projection's data-gradient GEMM) and of gate and up (SwiGLU's backward) are each rounded to bf16 and read so by the backward's grouped GEMMs, which on cuda then read their A operand as bf16 (under run.precision bf16 directly, by cp.async). Weight gradients, the gradient back to the tokens, the combine weights' and router's gradients and the shared expert's gradients stay fp32. Halves the MoE backward scratch of those four tensors; the gradients change by bf16 rounding"),
      LADDER_FIELD(model, moe_capacity, "MoE experts in a capacity layout: 0 = off (each expert's rows contiguous in routing order, every expert GEMM a grouped GEMM); f > 0 = each expert's first C rows, C = f x the mean load (tokens x top_k / experts) rounded up to a multiple of 8, at rows e*C of the expert tensors, padded with zero rows when an expert has fewer, so every expert GEMM is one strided-batched GEMM (cuBLASLt on cuda) plus a grouped GEMM over the rows past C. Still dropless: nothing is dropped, the results are the same sums in another order. Costs the padding's FLOPs and up to about twice the experts' activation memory (room for the most overflow there can be); a speed option for GPUs (docs/cuda.md; on the CPU about 10% slower: its grouped GEMM runs experts in parallel, the batched one in turn)"),
      LADDER_FIELD(model, mlp_bf16, "dense MLP layers (not MoE) in bf16: the gate and up projections are written by the GEMM in bf16 (rounded fp32 accumulation), SwiGLU reads them in bf16, computes in fp32 and writes its output in bf16, which the down projection and its weight gradient read; the backward's gradients stay fp32. Halves the memory of the three [tokens, d_ff] tensors per dense layer (on cuda with fp32 or tf32 GEMMs the widen/round passes keep three fp32 [tokens, d_ff] scratch buffers, about two layers of that saving; with bf16 GEMMs none); the loss changes by bf16 rounding (first slice of the bf16 activation path, docs/cuda.md)"),
      LADDER_FIELD(model, mlp_bf16_grads, "with model.mlp_bf16: the dense MLP's activation gradients in bf16 as well, as model.moe_bf16_grads does for the MoE experts: the gradient of the SwiGLU output (the down projection's data-gradient GEMM, written in bf16) and of gate and up (SwiGLU's backward) are each rounded to bf16 and read so by the gate and up projections' data- and weight-gradient GEMMs (under run.precision bf16 without a cast). The gradient of the MLP input, the weight gradients and the residual stream's gradient stay fp32. Halves the SwiGLU backward's traffic; the gradients change by bf16 rounding"),
      LADDER_FIELD(model, attn_bf16, "the attention block's activations in bf16, as model.mlp_bf16 does for dense MLPs: the q, k and v projections are written by the GEMM in bf16 (rounded fp32 accumulation); the PKO shift + QK-norm + RoPE op, attention, XSA and the per-head gate read bf16, compute in fp32 and write bf16; o_proj and its weight gradient read that; norm statistics, the attention lse, the gate factors and every gradient stay fp32. Halves the memory of the block's [tokens, heads * head_dim] tensors (q, k, v, the attention inputs and output, the XSA and gated outputs); under run.precision bf16 the GEMMs and the tensor-core attention read and write them directly; the loss changes by bf16 rounding (docs/cuda.md)"),
      LADDER_FIELD(model, norm_bf16, "the block norms' outputs in bf16: the attention input h1 (every layer) and the dense MLP input h2 are written by the norm in bf16 (statistics and arithmetic fp32, the result rounded; with GatedNorm its final product), and the GEMMs reading them (q, k, v, the head gate, the dense gate and up projections, and their weight gradients) read bf16. MoE layers' h2 (the router's input) and the final norm's output (the LM head's input) stay fp32, and so does the residual stream. Halves those tensors' memory; under run.precision bf16 their GEMMs read them without a cast; the loss changes by bf16 rounding (docs/cuda.md)"),
      LADDER_FIELD(model, gated_norm_rank, "GatedNorm x*sigmoid(W_up SiLU(W_down x)) after each d-wide RMSNorm (block norms and final norm) with this rank; 0 = off (recipe V1: 128)"),
      LADDER_FIELD(optim, name, "optimizer preset: adamw | adam | adamh | muon | muonh (which tensors each optimizer gets: docs/optimizers.md)"),
      LADDER_FIELD(optim, lr, "peak learning rate"),
      LADDER_FIELD(optim, beta1, "Adam beta1"),
      LADDER_FIELD(optim, beta2, "Adam beta2; in a ladder spec also `auto`: RECIPE.md's clip(0.999^(tokens per step / 131072), 0.95, 0.9999) for each rung's batch"),
      LADDER_FIELD(optim, eps, "Adam epsilon (> 0; the update is computed in float, so at least 1.4e-45)"),
      LADDER_FIELD(optim, weight_decay, "decoupled weight decay of the matrix group (attention, MLP, LM head); >= 0, 0 = off"),
      LADDER_FIELD(optim, embed_lr_mult, "learning-rate multiplier of the embedding group (>= 0; 0 freezes the embedding)"),
      LADDER_FIELD(optim, clip, "global gradient-norm clipping threshold (>= 0); 0 = off"),
      LADDER_FIELD(optim, adam_lr, "peak lr of the adam groups: a number, `auto` (RECIPE.md's fitted heuristic), `N*auto` (N times it) or empty = optim.lr"),
      LADDER_FIELD(optim, adamh_lr, "peak lr of the adamh groups (angular step): a number, `auto` (13/3 adam_lr, cap 0.05), `N*auto` or empty = optim.lr"),
      LADDER_FIELD(optim, muon_lr, "peak lr of the muon groups: a number or empty = optim.lr (no published heuristic)"),
      LADDER_FIELD(optim, muonh_lr, "peak lr of the muonh groups (angular step): a number, `auto` (as adamh: our assumption), `N*auto` or empty = optim.lr"),
      LADDER_FIELD(optim, muon_momentum, "Muon/MuonH Nesterov momentum coefficient (recipe 0.95)"),
      LADDER_FIELD(optim, adamw_params, "tensors moved to adamw: comma-separated `role:<role>` or name globs (`*.q_proj.weight`)"),
      LADDER_FIELD(optim, adam_params, "tensors moved to adam (selectors as optim.adamw_params)"),
      LADDER_FIELD(optim, adamh_params, "tensors moved to adamh (selectors as optim.adamw_params)"),
      LADDER_FIELD(optim, muon_params, "tensors moved to muon (selectors as optim.adamw_params)"),
      LADDER_FIELD(optim, muonh_params, "tensors moved to muonh (selectors as optim.adamw_params)"),
      LADDER_LATE_FIELD(optim, lr_mults, "per-tensor lr factors: comma-separated `selector=factor` (selectors as optim.adamw_params, factor >= 0), e.g. `role:expert=4`: the matched tensors' peak lr (their optimizer's, after optim.embed_lr_mult) times the factor, in a group of their own; a tensor matched twice or a selector that matches nothing is an error"),
      LADDER_FIELD(schedule, type, "learning-rate schedule: linear | cosine | wsd | constant"),
      LADDER_FIELD(schedule, warmup, "linear warmup: < 1 = fraction of steps, >= 1 = steps (a whole number, at most run.steps)"),
      LADDER_FIELD(schedule, final_lr_frac, "learning rate the decay ends at, as a fraction of the peak (reached at step run.steps, one past the last: the last step's is one decay step above it)"),
      LADDER_FIELD(schedule, decay_frac, "wsd: fraction of the steps spent in the final decay (which may not start inside the warmup)"),
      LADDER_FIELD(data, path, "data directory written by `ladder data` (relative paths: to the working directory)"),
      LADDER_FIELD(run, steps, "optimizer steps"),
      LADDER_FIELD(run, batch_size, "sequences per micro-batch"),
      LADDER_FIELD(run, grad_accum, "micro-batches per optimizer step"),
      LADDER_FIELD(run, seed, "seed of initialization and data order"),
      LADDER_FIELD(run, eval_every, "validation every N steps (and at the end); 0 = only at the end"),
      LADDER_FIELD(run, eval_batches, "validation batches per evaluation (at most the val split's full batches: each window once)"),
      LADDER_FIELD(run, ckpt_every, "checkpoint every N steps (and at the end); 0 = only at the end"),
      LADDER_FIELD(run, keep_checkpoints, "how many most recent checkpoints to keep"),
      LADDER_FIELD(run, shard_optimizer, "data parallel (mpirun -np R): each rank keeps the optimizer state of, and updates, about 1/R of the tensors: the gradients are reduce-scattered (each rank gets its tensors' sums) and each rank sends its updated weights to the others (ZeRO stage 1): the optimizer state's memory per rank drops up to R-fold (whole tensors per rank, so the largest tensor's state is a floor; the start prints the largest share) for about the traffic of the unsharded gradient allreduce; the unsharded run's results (bit for bit on the CPU with 2 ranks, tested; with more ranks the reduce may add the ranks in another order than the allreduce, and on cuda Muon's batched Newton-Schulz runs over other batches, whose GEMM algorithms may differ: the same within the last bits) and the same checkpoint files, resumable with or without it (docs/data-parallel.md). A single process ignores it"),
      LADDER_FIELD(run, log_every, "progress line and metrics every N steps"),
      LADDER_FIELD(run, precision, "GEMM precision on cuda: fp32, tf32 (tensor cores, 10-bit inputs) or bf16 (tensor cores, bf16 inputs, fp32 accumulation); the CPU computes in fp32"),
      LADDER_FIELD(run, threads, "CPU threads; 0 = all cores"),
      LADDER_FIELD(run, device, "cpu or cuda (cuda: needs a build with -DLADDER_CUDA=ON and a GPU of compute capability 8.0 or newer, docs/cuda.md)"),
      LADDER_FIELD(run, attention, "the attention kernels on cuda under run.precision bf16: ladder (Ladder's own, deterministic), cudnn (cuDNN's fused attention, loaded at run time, with its deterministic backward where that keeps no S x S matrix: cuDNN 9.25+ on Hopper; elsewhere Ladder's kernels run and stderr says why) or cudnn-nondeterministic (cuDNN's backward that adds dQ with atomics: any cuDNN 9, not bitwise reproducible run to run); LADDER_ATTN_CUDNN=1 / nondeterministic override it (docs/cuda.md, cuDNN attention)"),
  };
  return fields;
}
#undef LADDER_FIELD

const Field* find_field(const std::string& key) {
  for (auto& f : schema())
    if (f.key == key) return &f;
  return nullptr;
}

const char* type_name(const Ref& r) {
  return std::visit(
      [](auto* p) -> const char* {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) return "bool";
        else if constexpr (std::is_same_v<T, double>) return "number";
        else if constexpr (std::is_same_v<T, std::string>) return "string";
        else return "integer";
      },
      r);
}

// An integer written as digits or as an exact decimal (64, -3, 1e6, 64.0: configs write step counts
// as 1e6), read without going through double so that nothing is rounded (2^53 + 1 stays odd, a seed
// keeps every digit) and no value wraps into another. nullopt: not such a number, a fraction, or
// a magnitude past 2^64 (beyond every integer field's range; the caller names the range).
std::optional<__int128> parse_integer(std::string_view s) {
  size_t i = 0;
  bool neg = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
  std::string digits;  // the mantissa's digits, integer and fraction parts together
  int64_t exp10 = 0;   // the value is digits x 10^exp10
  bool any = false;
  for (; i < s.size() && std::isdigit((unsigned char)s[i]); ++i, any = true) digits += s[i];
  if (i < s.size() && s[i] == '.')
    for (++i; i < s.size() && std::isdigit((unsigned char)s[i]); ++i, any = true, --exp10) digits += s[i];
  if (!any) return std::nullopt;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    bool eneg = false;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) eneg = s[i++] == '-';
    if (i == s.size()) return std::nullopt;
    int64_t e = 0;
    for (; i < s.size() && std::isdigit((unsigned char)s[i]); ++i) e = std::min<int64_t>(e * 10 + (s[i] - '0'), 100000);
    exp10 += eneg ? -e : e;
  }
  if (i != s.size()) return std::nullopt;
  digits.erase(0, std::min(digits.find_first_not_of('0'), digits.size()));
  if (digits.empty()) return __int128(0);
  // A negative exponent drops digits, which must be zeros (64.0, 1.5e1); any other is a fraction.
  for (; exp10 < 0; ++exp10) {
    if (digits.back() != '0') return std::nullopt;
    digits.pop_back();
  }
  if (int64_t(digits.size()) + exp10 > 21) return std::nullopt;  // >= 10^21 > 2^64
  digits.append(size_t(exp10), '0');
  unsigned __int128 v = 0;
  for (char ch : digits) v = v * 10 + unsigned(ch - '0');
  if (v > (unsigned __int128)(1) << 64) return std::nullopt;
  return neg ? -__int128(v) : __int128(v);
}

// "an integer in [lo, hi]" for T: the range every error about an integer field states.
template <class T>
std::string integer_range() {
  return fmt::format("an integer in [{}, {}]", std::numeric_limits<T>::min(), std::numeric_limits<T>::max());
}

// Converts `text` (a YAML scalar's text, or JSON's) for an integer field of type T; nullopt if it is
// not an integer or does not fit T (the old path through double wrapped 4294967360 into an int 64).
template <class T>
std::optional<T> integer_for(std::string_view text) {
  auto v = parse_integer(text);
  if (!v || *v < __int128(std::numeric_limits<T>::min()) || *v > __int128(std::numeric_limits<T>::max()))
    return std::nullopt;
  return T(*v);
}

// Parses a scalar into the field; `where` prefixes errors ("cfg.yaml:12: model.d_model").
void set_scalar(Config& c, const Field& f, const std::string& text, const std::string& where) {
  Ref r = f.ref(c);
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) {
          // Strings are taken as written (YAML has already unquoted a file's scalar; re-parsing
          // would turn a glob like *.q_proj.weight into an alias); apply_override unquotes --set's.
          *p = text;
        } else {
          std::string expected = type_name(r);
          if constexpr (std::is_same_v<T, double>) expected = "a finite number";
          if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) expected = integer_range<T>();
          std::string scalar;  // the value as YAML read it: `auto` whether written quoted or not
          try {
            YAML::Node n = YAML::Load(text);
            if (!n.IsScalar()) throw YAML::Exception(YAML::Mark::null_mark(), "not a scalar");
            scalar = n.Scalar();
            if constexpr (std::is_same_v<T, bool>) {
              *p = n.as<bool>();
            } else if constexpr (std::is_same_v<T, double>) {
              // YAML reads .nan and .inf as numbers; no setting means them (and JSON, which the
              // checkpoint's config is written in, cannot hold them).
              const double d = n.as<double>();
              if (!std::isfinite(d)) throw YAML::Exception(YAML::Mark::null_mark(), "not finite");
              *p = d;
            } else {
              auto v = integer_for<T>(n.Scalar());
              if (!v) throw YAML::Exception(YAML::Mark::null_mark(), "not an integer of this type");
              *p = *v;
            }
          } catch (const YAML::Exception&) {
            if (f.key == "optim.beta2" && scalar == "auto")
              fail("{}: optim.beta2 expects a number here; `auto` (the recipe's beta2 from the tokens per step) is "
                   "resolved by ladder specs, which choose each rung's batch: write it in a spec's `set:` or a "
                   "variant's `set:` (not in a config file, a spec's `base:` included), or write the number "
                   "(clip(0.999^(tokens per step / 131072), 0.95, 0.9999))",
                   where);
            fail("{}: {} expects {}, got '{}'", where, f.key, expected, text);
          }
        }
      },
      r);
}

std::string get_scalar(Config& c, const Field& f) {
  return std::visit(
      [](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) return *p;
        else if constexpr (std::is_same_v<T, bool>) return *p ? "true" : "false";
        else if constexpr (std::is_same_v<T, double>) return fmt::format("{}", *p);
        else return std::to_string(*p);
      },
      f.ref(c));
}

void walk(Config& c, const YAML::Node& node, const std::string& prefix, const std::string& file) {
  for (auto it = node.begin(); it != node.end(); ++it) {
    const int line = it->first.Mark().line + 1;
    std::string where = fmt::format("{}:{}", file, line);
    // A key must be a name: as<std::string>() of a [list] or {map} key throws yaml-cpp's bare "bad
    // conversion", which names neither the file nor the line.
    if (!it->first.IsScalar())
      fail("{}: expected a key name{}, got a {}", where, prefix.empty() ? "" : " in section '" + prefix + "'",
           it->first.IsSequence() ? "list" : it->first.IsMap() ? "mapping" : "null key");
    std::string k = it->first.Scalar();
    std::string key = prefix.empty() ? k : prefix + "." + k;
    const YAML::Node& v = it->second;
    if (v.IsMap()) {
      bool known_section = false;
      for (auto& f : schema())
        if (f.key.rfind(key + ".", 0) == 0) known_section = true;
      if (!known_section) fail("{}: unknown config section '{}'", where, key);
      walk(c, v, key, file);
    } else {
      const Field* f = find_field(key);
      if (!f) fail("{}: unknown config key '{}' (see docs/config.md for the keys)", where, key);
      if (!v.IsScalar()) fail("{}: {} expects a {}, got a list or empty value", where, key, type_name(f->ref(c)));
      set_scalar(c, *f, v.Scalar(), where);
    }
  }
}

// Parses model.moe_layers into a per-layer mask; errors name the field.
std::vector<bool> moe_layer_mask(const ModelConfig& m, const std::string& where) {
  std::vector<bool> mask(size_t(std::max(m.n_layers, 0)), false);
  if (m.moe_layers == "all") {
    std::fill(mask.begin(), mask.end(), true);
    return mask;
  }
  // Split on every comma by hand: std::getline drops an empty last piece, so "1," passed as "1".
  std::vector<std::string> items(1);
  for (char ch : m.moe_layers) {
    if (ch == ',') items.emplace_back();
    else items.back() += ch;
  }
  for (const std::string& item : items) {
    size_t used = 0;
    int l = -1;
    try {
      l = std::stoi(item, &used);
    } catch (...) {
      used = 0;
    }
    while (used < item.size() && item[used] == ' ') ++used;
    if (item.find_first_not_of(' ') == std::string::npos)
      fail("{}: model.moe_layers '{}' has an empty element (expected \"all\" or comma-separated layer indices, "
           "e.g. \"1,3\")", where, m.moe_layers);
    if (used == 0 || used != item.size())
      fail("{}: model.moe_layers expects \"all\" or comma-separated layer indices, got '{}'", where, m.moe_layers);
    if (l < 0 || l >= m.n_layers)
      fail("{}: model.moe_layers names layer {} but the model has layers 0..{}", where, l, m.n_layers - 1);
    mask[size_t(l)] = true;
  }
  return mask;
}

void validate_moe(const Config& c, const std::string& where) {
  const auto& m = c.model;
  if (m.moe_experts < 0) fail("{}: model.moe_experts must be >= 0 (0 = dense), got {}", where, m.moe_experts);
  if (m.router_z_loss < 0) fail("{}: model.router_z_loss must be >= 0, got {}", where, m.router_z_loss);
  if (m.moe_balance != "auto" && m.moe_balance != "quantile" && m.moe_balance != "none")
    fail("{}: model.moe_balance '{}' is not known (expected auto, quantile or none)", where, m.moe_balance);
  if (m.moe_combine != "sigmoid" && m.moe_combine != "normalized")
    fail("{}: model.moe_combine '{}' is not known (expected sigmoid or normalized)", where, m.moe_combine);
  if (!m.moe()) {
    // Settings that only mean something with a MoE block are errors, not silently ignored.
    if (m.moe_balance == "quantile")
      fail("{}: model.moe_balance is 'quantile' but model.moe_experts is 0 (no MoE block to balance)", where);
    if (m.router_z_loss > 0)
      fail("{}: model.router_z_loss is {} but model.moe_experts is 0 (no router)", where, m.router_z_loss);
    if (m.moe_capacity != 0)
      fail("{}: model.moe_capacity is {} but model.moe_experts is 0 (no experts to lay out)", where, m.moe_capacity);
    return;
  }
  if (m.moe_top_k < 1) fail("{}: model.moe_top_k must be >= 1, got {}", where, m.moe_top_k);
  if (m.moe_top_k > m.moe_experts)
    fail("{}: model.moe_top_k ({}) must be <= model.moe_experts ({})", where, m.moe_top_k, m.moe_experts);
  if (m.moe_balance == "quantile" && m.moe_top_k == m.moe_experts)
    fail("{}: model.moe_balance is 'quantile' but model.moe_top_k = model.moe_experts = {}: every token goes to every "
         "expert, there is nothing to balance (set model.moe_balance: none)",
         where, m.moe_experts);
  if (m.moe_expert_ff < 0) fail("{}: model.moe_expert_ff must be >= 0 (0 = ceil(d/2/128)*128), got {}", where, m.moe_expert_ff);
  if (m.moe_shared_ff < 0) fail("{}: model.moe_shared_ff must be >= 0 (0 = d_model), got {}", where, m.moe_shared_ff);
  // One expert matrix is indexed with int offsets by the kernels.
  if (int64_t(m.expert_ff()) * m.d_model * m.moe_experts >= (int64_t(1) << 31))
    fail("{}: model.moe_expert_ff ({}) x model.d_model ({}) x model.moe_experts ({}) does not fit one expert tensor "
         "(< 2^31 elements)", where, m.expert_ff(), m.d_model, m.moe_experts);
  if (!(m.moe_route_scale > 0)) fail("{}: model.moe_route_scale must be > 0, got {}", where, m.moe_route_scale);
  if (!(m.moe_capacity >= 0 && m.moe_capacity <= 1e6))
    fail("{}: model.moe_capacity must be 0 (off) or a factor of the mean expert load > 0, got {}", where,
         m.moe_capacity);
  auto mask = moe_layer_mask(m, where);
  if (std::find(mask.begin(), mask.end(), true) == mask.end())
    fail("{}: model.moe_layers '{}' selects no layer", where, m.moe_layers);
}

}  // namespace

int ModelConfig::expert_capacity(int64_t tokens) const {
  if (moe_capacity <= 0 || !moe() || tokens <= 0) return 0;
  const double mean = double(tokens) * moe_top_k / moe_experts;
  const int64_t c = (std::max<int64_t>(1, int64_t(std::ceil(moe_capacity * mean))) + 7) / 8 * 8;
  return int(std::min(c, tokens));
}

bool ModelConfig::is_moe_layer(int l) const {
  if (!moe()) return false;
  if (moe_layers == "all") return true;
  auto mask = moe_layer_mask(*this, "config");
  return l >= 0 && l < int(mask.size()) && mask[size_t(l)];
}

int ModelConfig::n_moe_layers() const {
  int n = 0;
  for (int l = 0; l < n_layers; ++l) n += is_moe_layer(l);
  return n;
}

bool is_config_key(const std::string& key) { return find_field(key) != nullptr; }

std::string trim_blanks(const std::string& x) {
  const auto a = x.find_first_not_of(" \t"), b = x.find_last_not_of(" \t");
  return a == std::string::npos ? std::string() : x.substr(a, b - a + 1);
}

std::vector<std::string> split_selectors(const std::string& value) {
  std::vector<std::string> out;
  std::istringstream in(value);
  for (std::string entry; std::getline(in, entry, ',');)
    if (entry = trim_blanks(entry); !entry.empty()) out.push_back(entry);
  return out;
}

std::vector<std::pair<std::string, double>> parse_lr_mults(const std::string& value) {
  std::vector<std::pair<std::string, double>> out;
  for (const std::string& entry : split_selectors(value)) {
    const auto eq = entry.rfind('=');
    const std::string sel = eq == std::string::npos ? "" : trim_blanks(entry.substr(0, eq));
    const std::string num = eq == std::string::npos ? "" : trim_blanks(entry.substr(eq + 1));
    char* end = nullptr;
    const double x = std::strtod(num.c_str(), &end);
    if (sel.empty() || num.empty() || *end != '\0' || !std::isfinite(x) || x < 0)
      fail("optim.lr_mults: entry '{}' is not `selector=factor` (a role:<role> or name glob, then a number >= 0; "
           "e.g. role:expert=4)",
           entry);
    out.emplace_back(sel, x);
  }
  return out;
}

std::optional<double> auto_lr_multiplier(const std::string& key, const std::string& value) {
  const std::string v = trim_blanks(value);
  if (v.empty()) return std::nullopt;
  if (v == "auto") return 1.0;
  const auto star = v.find('*');
  if (star == std::string::npos) return std::nullopt;
  const std::string n = trim_blanks(v.substr(0, star));
  if (trim_blanks(v.substr(star + 1)) != "auto") return std::nullopt;
  const auto x = plain_lr(n);
  if (!x || !(*x > 0)) fail("{}: '{}': the multiplier of `N*auto` must be a number > 0, got '{}'", key, value, n);
  return *x;
}

std::optional<double> plain_lr(const std::string& value) {
  char* end = nullptr;
  const double x = std::strtod(value.c_str(), &end);
  if (end == value.c_str() || *end != '\0' || !std::isfinite(x)) return std::nullopt;
  return x;
}

void apply_override(Config& c, const std::string& kv) {
  auto eq = kv.find('=');
  if (eq == std::string::npos || eq == 0) fail("--set {}: expected key.path=value", kv);
  std::string key = kv.substr(0, eq), val = kv.substr(eq + 1);
  const Field* f = find_field(key);
  if (!f) fail("--set {}: unknown config key '{}' (see docs/config.md)", kv, key);
  // --set may quote a string; a file's scalar arrives unquoted by YAML and must not be unquoted
  // again (to_yaml writes a path '"x"' as "\"x\"", which reads back as "x" in quotes).
  const bool quoted = val.size() >= 2 && (val.front() == '"' || val.front() == '\'') && val.back() == val.front();
  if (quoted && std::holds_alternative<std::string*>(f->ref(c))) val = val.substr(1, val.size() - 2);
  set_scalar(c, *f, val, "--set");
}

Config load_config(const std::filesystem::path& file, const std::vector<std::string>& overrides) {
  Config c;
  c.source = file.string();
  const YAML::Node root = load_yaml_file(file, "config file");
  if (root.IsNull()) {
    // empty file: all defaults
  } else if (!root.IsMap()) {
    fail("{}: expected a mapping of sections (model, optim, schedule, data, run) at the top level", file.string());
  } else {
    reject_duplicate_keys(root, file.string());  // before the walk, which would apply both
    walk(c, root, "", file.string());
  }
  for (auto& o : overrides) apply_override(c, o);
  // validate() and the trainer find errors after the overrides are in, and a bad value may have come
  // from a --set rather than the file: the errors name both.
  if (!overrides.empty()) c.source += fmt::format(" with --set {}", fmt::join(overrides, ", "));
  return c;
}

void validate_attention_switches(const ModelConfig& m, const std::string& where) {
  if (!(m.q_scale > 0)) fail("{}: model.q_scale must be > 0, got {}", where, m.q_scale);
  if (m.long_every < 0) fail("{}: model.long_every must be >= 0, got {}", where, m.long_every);
  if (m.long_every > 0 && m.window < 1)
    fail("{}: model.long_every = {} makes short layers with a sliding window, so model.window must be >= 1, got {}",
         where, m.long_every, m.window);
  if (m.gated_norm_rank < 0) fail("{}: model.gated_norm_rank must be >= 0, got {}", where, m.gated_norm_rank);
  if (m.eod_id < -1) fail("{}: model.eod_id must be a token id or -1 (take it from the data), got {}", where, m.eod_id);
  if (m.vocab_size > 0 && m.eod_id >= m.vocab_size)
    fail("{}: model.eod_id {} is outside the vocabulary [0, {})", where, m.eod_id, m.vocab_size);
  if (m.pko) {
    if (!m.half_rope)
      fail("{}: model.pko shifts the RoPE-free half of each key, which needs model.half_rope: true", where);
    // RECIPE.md's PKO: shift, "then non-parametric RMSNorm on q and k over all hd dims", then RoPE.
    if (!m.qk_norm)
      fail("{}: model.pko normalizes q and k after the shift (RECIPE.md), which needs model.qk_norm: true", where);
    bool any_long = false;
    for (int l = 0; l < m.n_layers; ++l) any_long = any_long || m.is_long_layer(l);
    if (!any_long)
      fail("{}: model.pko applies to long layers only, but none of the {} layers is long (model.long_every = {}, "
           "model.last_layer_long = {})", where, m.n_layers, m.long_every, m.last_layer_long);
    // RECIPE.md's PKO rung: "long layers only (i % 4 == 3 and always the last layer)".
    if (!m.is_long_layer(m.n_layers - 1))
      fail("{}: model.pko makes the last layer long too (RECIPE.md), but layer {} is short (model.long_every = {}): "
           "set model.last_layer_long: true", where, m.n_layers - 1, m.long_every);
  }
}

namespace {

// The per-optimizer lr keys (optim.<name>) and their values: what validate() checks and
// identity_json() canonicalizes.
std::array<std::pair<const char*, const std::string*>, 4> lr_keys(const OptimConfig& o) {
  return {{{"adam_lr", &o.adam_lr}, {"adamh_lr", &o.adamh_lr}, {"muon_lr", &o.muon_lr}, {"muonh_lr", &o.muonh_lr}}};
}

// validate(); `this_build` false leaves out whether this build can run run.device: a checkpoint's
// config (from_json) may come from a CUDA run and still be sampled on the CPU.
void validate_settings(const Config& c, bool this_build) {
  const auto& m = c.model;
  auto where = c.source.empty() ? std::string("config") : c.source;
  auto pos = [&](const char* key, int64_t v) {
    if (v <= 0) fail("{}: {} must be > 0, got {}", where, key, v);
  };
  // Every number must be finite: a NaN passes every `x < 0` test below, and NaN or inf is written
  // as null in the checkpoint's JSON, which then no longer loads. (Code can set them directly;
  // load_config already refuses them.)
  {
    Config copy = c;  // the schema's references are to a mutable Config
    for (auto& f : schema())
      if (Ref r = f.ref(copy); std::holds_alternative<double*>(r) && !std::isfinite(*std::get<double*>(r)))
        fail("{}: {} must be a finite number, got {}", where, f.key, *std::get<double*>(r));
  }
  pos("model.d_model", m.d_model);
  pos("model.n_layers", m.n_layers);
  pos("model.n_heads", m.n_heads);
  pos("model.seq_len", m.seq_len);
  if (m.n_kv_heads < 0) fail("{}: model.n_kv_heads must be >= 0, got {}", where, m.n_kv_heads);
  if (m.head_dim == 0 && m.d_model % m.n_heads != 0)
    fail("{}: model.n_heads ({}) must divide model.d_model ({}) when model.head_dim is 0", where, m.n_heads, m.d_model);
  if (m.n_heads % m.kv_heads() != 0)
    fail("{}: model.n_kv_heads ({}) must divide model.n_heads ({})", where, m.kv_heads(), m.n_heads);
  if (m.half_rope && m.hd() % 4 != 0)
    fail("{}: model.half_rope rotates head dims [0, hd/2) in pairs, so the head dimension must be a multiple of 4, got {}",
         where, m.hd());
  if (m.hd() % 2 != 0) fail("{}: head dimension must be even for RoPE, got {}", where, m.hd());
  for (auto [key, v] : {std::pair{"head_dim", m.head_dim}, {"d_ff", m.d_ff}, {"window", m.window}, {"vocab_size", m.vocab_size}})
    if (v < 0) fail("{}: model.{} must be >= 0 (0: the default), got {}", where, key, v);
  if (!(m.norm_eps > 0)) fail("{}: model.norm_eps must be > 0, got {}", where, m.norm_eps);
  // RoPE's frequencies are theta^(-2i/hd): a base <= 0 has no such powers (log of it is NaN or -inf).
  if (!(m.rope_theta > 0)) fail("{}: model.rope_theta must be > 0, got {}", where, m.rope_theta);
  if (!(m.init_std >= 0)) fail("{}: model.init_std must be >= 0 (0 = 0.5/sqrt(d_model)), got {}", where, m.init_std);
  if (!(m.z_loss >= 0)) fail("{}: model.z_loss must be >= 0 (0 = off), got {}", where, m.z_loss);
  validate_moe(c, where);
  validate_attention_switches(m, where);
  if (m.saved_activations != "fp32" && m.saved_activations != "bf16")
    fail("{}: model.saved_activations '{}' is not known (expected fp32 or bf16)", where, m.saved_activations);
  if (m.saved_activations == "bf16" && m.recompute)
    fail("{}: model.saved_activations 'bf16' has nothing to store with model.recompute (only each layer's fp32 "
         "input is kept): set one of them",
         where);
  if (m.mlp_bf16 && m.n_layers > 0 && m.n_moe_layers() == m.n_layers)
    fail("{}: model.mlp_bf16 applies to dense MLP layers, but every layer is an MoE layer: turn it off", where);
  if (m.moe_bf16 && m.n_moe_layers() == 0)
    fail("{}: model.moe_bf16 applies to MoE layers, but the model has none (model.moe_experts 0 or no "
         "model.moe_layers): turn it off",
         where);
  if (m.moe_bf16_grads && m.n_moe_layers() == 0)
    fail("{}: model.moe_bf16_grads applies to MoE layers, but the model has none (model.moe_experts 0 or no "
         "model.moe_layers): turn it off",
         where);
  if (m.mlp_bf16_grads && m.n_layers > 0 && m.n_moe_layers() == m.n_layers)
    fail("{}: model.mlp_bf16_grads applies to dense MLP layers, but every layer is an MoE layer: turn it off", where);
  if (m.mlp_bf16_grads && !m.mlp_bf16)
    fail("{}: model.mlp_bf16_grads needs model.mlp_bf16 (the bf16 gradients are read with the MLP's tensors in "
         "bf16): set model.mlp_bf16: true or turn model.mlp_bf16_grads off",
         where);
  if (m.moe_bf16_grads && !m.moe_bf16)
    fail("{}: model.moe_bf16_grads needs model.moe_bf16 (the bf16 gradients are read by kernels that take the "
         "experts' tensors in bf16): set model.moe_bf16: true or turn model.moe_bf16_grads off",
         where);
  if (c.optim.name != "adamw" && c.optim.name != "adam" && c.optim.name != "adamh" && c.optim.name != "muon" &&
      c.optim.name != "muonh")
    fail("{}: optim.name: unknown optimizer '{}' (expected adamw, adam, adamh, muon or muonh)", where, c.optim.name);
  for (auto [name, v] : lr_keys(c.optim)) {
    if (v->empty()) continue;
    const std::string key = std::string("optim.") + name;
    try {
      if (auto_lr_multiplier(key, *v)) continue;
    } catch (const Error& e) {
      fail("{}: {}", where, e.what());
    }
    if (const auto x = plain_lr(*v); !x || !(*x >= 0))
      fail("{}: {} expects a learning rate >= 0, `auto`, `N*auto` or empty (= optim.lr), got '{}'", where, key, *v);
  }
  if (!(c.optim.muon_momentum >= 0 && c.optim.muon_momentum < 1))
    fail("{}: optim.muon_momentum must be in [0, 1), got {}", where, c.optim.muon_momentum);
  const auto& o = c.optim;
  if (!(o.lr >= 0)) fail("{}: optim.lr must be >= 0, got {}", where, o.lr);
  // Each group's lr follows the schedule as group lr * (scheduled lr / optim.lr): with optim.lr 0
  // that ratio is 0/0, so a group lr of its own cannot be followed.
  if (o.lr == 0)
    for (auto [key, v] : {std::pair{"optim.adam_lr", &o.adam_lr}, std::pair{"optim.adamh_lr", &o.adamh_lr},
                          std::pair{"optim.muon_lr", &o.muon_lr}, std::pair{"optim.muonh_lr", &o.muonh_lr}})
      if (!v->empty())
        fail("{}: optim.lr is 0 and {} is '{}': a group's lr is scheduled relative to optim.lr, so set optim.lr "
             "> 0 (or leave {} empty to freeze it too)",
             where, key, *v, key);
  if (!(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1))
    fail("{}: optim.beta1 and optim.beta2 must be in [0, 1), got {} and {}", where, o.beta1, o.beta2);
  // Adam divides by sqrt(v) + eps in float: an eps <= 0 (or one that rounds to 0 as a float) divides
  // by zero on a parameter whose gradient is 0.
  if (!(float(o.eps) > 0))
    fail("{}: optim.eps must be > 0 and at least {} (the smallest float; the update is computed in float), got {}",
         where, std::numeric_limits<float>::denorm_min(), o.eps);
  // Decoupled decay multiplies weights by 1 - lr * weight_decay: a negative one grows them.
  if (!(o.weight_decay >= 0)) fail("{}: optim.weight_decay must be >= 0 (0 = off), got {}", where, o.weight_decay);
  // 0 freezes the embedding, as optim.lr 0 freezes everything; a negative one climbs the loss.
  if (!(o.embed_lr_mult >= 0)) fail("{}: optim.embed_lr_mult must be >= 0, got {}", where, o.embed_lr_mult);
  if (!(o.clip >= 0)) fail("{}: optim.clip must be >= 0 (0 = off), got {}", where, o.clip);
  try {
    parse_lr_mults(o.lr_mults);
  } catch (const Error& e) {
    fail("{}: {}", where, e.what());
  }
  const auto& s = c.schedule;
  if (s.type != "linear" && s.type != "cosine" && s.type != "wsd" && s.type != "constant")
    fail("{}: schedule.type '{}' is not known (expected linear, cosine, wsd or constant)", where, s.type);
  pos("run.steps", c.run.steps);
  // warmup_steps() reads a warmup < 1 as a fraction of run.steps and one >= 1 as a step count, which
  // it converts to int64: a fraction of a step would be dropped silently, and a count past run.steps
  // never reaches the peak lr (past 2^63 the conversion is undefined).
  if (!(s.warmup >= 0)) fail("{}: schedule.warmup must be >= 0, got {}", where, s.warmup);
  if (s.warmup >= 1 && (s.warmup != std::floor(s.warmup) || s.warmup > double(c.run.steps)))
    fail("{}: schedule.warmup must be a fraction of the steps (< 1) or a whole number of steps from 1 to run.steps "
         "({}), got {}", where, c.run.steps, s.warmup);
  if (!(s.final_lr_frac >= 0 && s.final_lr_frac <= 1))
    fail("{}: schedule.final_lr_frac must be in [0, 1], got {}", where, s.final_lr_frac);
  if (!(s.decay_frac >= 0 && s.decay_frac <= 1))
    fail("{}: schedule.decay_frac must be in [0, 1], got {}", where, s.decay_frac);
  // A wsd decay that began inside the warmup would drop the lr from the warmup's peak to mid-decay
  // in one step. (The decay's first step is the first t >= its start, as lr_multiplier reads it.)
  if (const double first_decay = std::ceil(double(c.run.steps) * (1.0 - s.decay_frac));
      s.type == "wsd" && first_decay < double(warmup_steps(s, c.run.steps)))
    fail("{}: schedule.decay_frac {} starts the wsd decay at step {:.0f}, inside the {} warmup steps (schedule.warmup "
         "{}): lower one of them", where, s.decay_frac, first_decay, warmup_steps(s, c.run.steps), s.warmup);
  if (c.run.precision != "fp32" && c.run.precision != "tf32" && c.run.precision != "bf16")
    fail("{}: run.precision '{}' is not known (expected fp32, tf32 or bf16)", where, c.run.precision);
  if (c.run.precision != "fp32" && c.run.device != "cuda")
    fail("{}: run.precision '{}' needs run.device cuda (the CPU backend computes in fp32)", where, c.run.precision);
  if (c.run.attention != "ladder" && c.run.attention != "cudnn" && c.run.attention != "cudnn-nondeterministic")
    fail("{}: run.attention '{}' is not known (expected ladder, cudnn or cudnn-nondeterministic)", where,
         c.run.attention);
  if (c.run.attention != "ladder" && (c.run.device != "cuda" || c.run.precision != "bf16"))
    fail("{}: run.attention '{}' needs run.device cuda and run.precision bf16 (cuDNN's attention is bf16)", where,
         c.run.attention);
  pos("run.batch_size", c.run.batch_size);
  // The model counts a micro-batch's tokens, and an MoE layer its token-expert slots, in 32-bit ints.
  if (const int64_t n = int64_t(c.run.batch_size) * m.seq_len * (m.moe() ? std::max(1, m.moe_top_k) : 1);
      n > std::numeric_limits<int>::max())
    fail("{}: run.batch_size ({}) x model.seq_len ({}){} = {} is more than the 2^31 - 1 a micro-batch may hold: "
         "lower run.batch_size (run.grad_accum adds micro-batches to a step)",
         where, c.run.batch_size, m.seq_len, m.moe() ? fmt::format(" x model.moe_top_k ({})", m.moe_top_k) : "", n);
  pos("run.grad_accum", c.run.grad_accum);
  pos("run.log_every", c.run.log_every);
  if (c.run.eval_every < 0 || c.run.ckpt_every < 0 || c.run.eval_batches < 0 || c.run.threads < 0)
    fail("{}: run.eval_every, run.ckpt_every, run.eval_batches and run.threads must be >= 0", where);
  if (c.run.keep_checkpoints < 1) fail("{}: run.keep_checkpoints must be >= 1", where);
  if (!this_build) {
    if (c.run.device != "cpu" && c.run.device != "cuda")
      fail("{}: run.device '{}' is not known (expected cpu or cuda)", where, c.run.device);
    return;
  }
#ifdef LADDER_HAVE_CUDA
  if (c.run.device != "cpu" && c.run.device != "cuda")
    fail("{}: run.device '{}' is not known (expected cpu or cuda)", where, c.run.device);
#else
  if (c.run.device == "cuda")
    fail("{}: run.device 'cuda': this build lacks CUDA (configure with -DLADDER_CUDA=ON)", where);
  if (c.run.device != "cpu") fail("{}: run.device '{}' is not known (expected cpu)", where, c.run.device);
#endif
}

}  // namespace

void validate(const Config& c) { validate_settings(c, /*this_build=*/true); }

std::string to_yaml(const Config& cin) {
  Config c = cin;
  std::ostringstream out;
  std::string section;
  for (auto& f : schema()) {
    auto dot = f.key.find('.');
    std::string sec = f.key.substr(0, dot), name = f.key.substr(dot + 1);
    if (sec != section) {
      out << sec << ":\n";
      section = sec;
    }
    std::string v = get_scalar(c, f);
    if (std::holds_alternative<std::string*>(f.ref(c))) {
      // yaml-cpp's own double-quoted form, so that load_config reads back exactly this string: a
      // quote, backslash, control character or `: #` in data.path must neither end the scalar nor
      // change its value.
      YAML::Emitter e;
      e << YAML::DoubleQuoted << v;
      v = e.c_str();
    }
    out << "  " << name << ": " << v << "\n";
  }
  return out.str();
}

bool is_late_key(const std::string& key) {
  const Field* f = find_field(key);
  return f && f->late;
}

nlohmann::json identity_json(const Config& c) {
  nlohmann::json j = to_json(c);
  const nlohmann::json d = to_json(Config{});
  for (auto& f : schema()) {
    if (!f.late) continue;
    const auto dot = f.key.find('.');
    const std::string sec = f.key.substr(0, dot), name = f.key.substr(dot + 1);
    if (j[sec][name] == d[sec][name]) j[sec].erase(name);
  }
  // optim.lr_mults as its parsed entries, so `role:expert = 4.0` and `role:expert=4` are one run
  // (a written form that is already canonical, as every stored run's, keeps its hash).
  if (!c.optim.lr_mults.empty()) {
    std::string canon;
    for (const auto& [sel, x] : parse_lr_mults(c.optim.lr_mults))
      canon += fmt::format("{}{}={}", canon.empty() ? "" : ",", sel, x);
    j["optim"]["lr_mults"] = canon;
  }
  // The selector lists as their entries joined by ", " (the form every stored run was written in,
  // so those keep their hashes): `role:expert,role:attention` is `role:expert, role:attention`.
  for (const auto& [key, v] : {std::pair{"adamw_params", &c.optim.adamw_params},
                               std::pair{"adam_params", &c.optim.adam_params},
                               std::pair{"adamh_params", &c.optim.adamh_params},
                               std::pair{"muon_params", &c.optim.muon_params},
                               std::pair{"muonh_params", &c.optim.muonh_params}}) {
    std::string canon;
    for (const std::string& sel : split_selectors(*v)) canon += (canon.empty() ? "" : ", ") + sel;
    j["optim"][key] = canon;
  }
  // The lr keys as what they resolve to: "N*auto" with N printed shortest ("8.0 * auto" is
  // "8*auto", "1*auto" is "auto"), a number printed shortest ("1e-3" is "0.001"); "" (optim.lr) as is.
  for (const auto& [key, v] : lr_keys(c.optim)) {
    if (v->empty()) continue;
    if (const auto n = auto_lr_multiplier(std::string("optim.") + key, *v))
      j["optim"][key] = *n == 1 ? std::string("auto") : fmt::format("{}*auto", *n);
    else if (const auto x = plain_lr(*v))
      j["optim"][key] = fmt::format("{}", *x);
  }
  return j;
}

nlohmann::json to_json(const Config& cin) {
  Config c = cin;
  nlohmann::json j;
  for (auto& f : schema()) {
    auto dot = f.key.find('.');
    std::visit([&](auto* p) { j[f.key.substr(0, dot)][f.key.substr(dot + 1)] = *p; }, f.ref(c));
  }
  return j;
}

// A checkpoint's config is input like any other (state.json can be edited or damaged): each value is
// checked for its field's type and range, and the whole config goes through validate()'s checks,
// every error naming `source` and the key. Without that, `d_model: -64` surfaced as an allocation of
// 17592186044415.7 MiB and `d_model: "x"` as nlohmann's bare type_error.
Config from_json(const nlohmann::json& j, const std::string& source) {
  Config c;
  c.source = source;
  if (!j.is_object()) fail("{}: config: expected an object of sections (model, optim, ...), got {}", source, j.dump());
  for (auto& f : schema()) {
    auto dot = f.key.find('.');
    auto sec = f.key.substr(0, dot), name = f.key.substr(dot + 1);
    if (f.late && j.contains(sec) && j[sec].is_object() && !j[sec].contains(name)) continue;  // its default
    if (!j.contains(sec) || !j[sec].is_object() || !j[sec].contains(name))
      fail("{}: config is missing key {}", source, f.key);
    const nlohmann::json& v = j[sec][name];
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::string>) {
            if (!v.is_string()) fail("{}: {} expects a string, got {}", source, f.key, v.dump());
            *p = v.get<std::string>();
          } else if constexpr (std::is_same_v<T, bool>) {
            if (!v.is_boolean()) fail("{}: {} expects true or false, got {}", source, f.key, v.dump());
            *p = v.get<bool>();
          } else if constexpr (std::is_same_v<T, double>) {
            // JSON has no NaN or inf (nlohmann writes them as null), so null is refused here too.
            if (!v.is_number() || !std::isfinite(v.get<double>()))
              fail("{}: {} expects a finite number, got {}", source, f.key, v.dump());
            *p = v.get<double>();
          } else {
            // Through the number's text, as set_scalar reads YAML: get<int>() would wrap an
            // out-of-range value and truncate a fraction without a word.
            std::optional<T> x;
            if (v.is_number()) x = integer_for<T>(v.dump());
            if (!x) fail("{}: {} expects {}, got {}", source, f.key, integer_range<T>(), v.dump());
            *p = *x;
          }
        },
        f.ref(c));
  }
  validate_settings(c, /*this_build=*/false);
  return c;
}

std::string schema_markdown() {
  Config c;
  std::ostringstream out;
  out << "| key | type | default | meaning |\n|---|---|---|---|\n";
  for (auto& f : schema())
    out << "| `" << f.key << "` | " << type_name(f.ref(c)) << " | `" << get_scalar(c, f) << "` | " << f.doc << " |\n";
  return out.str();
}

}  // namespace ladder
