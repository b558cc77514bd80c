#include "model/transformer.h"

#include <omp.h>

#include <algorithm>
#include <limits>
#include <cmath>
#include <map>

#include "core/error.h"
#include "core/rng.h"
#include "model/flops.h"

namespace ladder {

const char* role_name(Role r) {
  switch (r) {
    case Role::Embedding: return "embedding";
    case Role::AttnMatrix: return "attention";
    case Role::MlpMatrix: return "mlp";
    case Role::Head: return "lm_head";
    case Role::NormGain: return "norm";
    case Role::Router: return "router";
    case Role::ExpertMatrix: return "expert";
    case Role::SharedExpert: return "shared_expert";
    case Role::AttnGate: return "attn_gate";
    case Role::GatedNormMatrix: return "gated_norm";
  }
  return "?";
}

void Transformer::add_param(const std::string& name, Role role, std::vector<int64_t> shape) {
  params_.push_back(Param::unplaced(name, role, std::move(shape)));
}

Param& Transformer::param(const std::string& name) {
  for (auto& p : params_)
    if (p.name == name) return p;
  fail("model has no parameter named '{}'", name);
}

Transformer::Transformer(const ModelConfig& cfg, int batch, Backend& be)
    : cfg_(cfg), B_(batch), S_(cfg.seq_len), N_(int(int64_t(batch) * cfg.seq_len))  /* checked below */, be_(be), ops_{&be} {
  LADDER_ASSERT(cfg.vocab_size > 0);
  if (cfg.pko && cfg.eod_id < 0)
    fail("model.pko zeroes the shifted key half at document starts, but no end-of-document token is known: "
         "set model.eod_id or train on a data directory whose meta.json has eod_id");
  if (int64_t(batch) * cfg.seq_len > std::numeric_limits<int>::max())
    fail("{} sequences of model.seq_len {} are {} tokens in one micro-batch; the model counts them in 32-bit ints "
         "(at most 2^31 - 1): lower run.batch_size or model.seq_len", batch, cfg.seq_len, int64_t(batch) * cfg.seq_len);
  // Weights and gradients alone must fit before anything is built: an absurd size (model.n_layers
  // 10^8, say) would otherwise spend minutes and gigabytes on tensor names before the allocation fails.
  {
    const double n_params = double(count_params(cfg).total);
    const double need = 2.0 * sizeof(float) * n_params;
    const size_t avail = be_.available_bytes();
    if (need > double(avail))
      fail("out of memory: the model's {:.1f} M parameters need {:.1f} MiB for weights and gradients alone, {:.1f} "
           "MiB available ({}): lower model.d_model, model.n_layers, model.vocab_size or the MLP/expert widths",
           n_params / 1e6, need / 1048576.0, double(avail) / 1048576.0,
           be_.is_host() ? "host memory" : "device memory");
  }
  const int64_t d = cfg.d_model, V = cfg.vocab_size, H = cfg.n_heads, KV = cfg.kv_heads(), hd = cfg.hd(),
                I = cfg.ff(), R = cfg.gated_norm_rank;
  // GatedNorm's two matrices sit under the norm they follow (".gated_norm.{down,up}_proj.weight").
  auto add_gated_norm = [&](const std::string& norm) {
    if (R == 0) return;
    add_param(norm + ".gated_norm.down_proj.weight", Role::GatedNormMatrix, {R, d});
    add_param(norm + ".gated_norm.up_proj.weight", Role::GatedNormMatrix, {d, R});
  };
  // Parameters, in a fixed order (the safetensors file and the optimizer state follow it).
  add_param("model.embed_tokens.weight", Role::Embedding, {V, d});
  for (int l = 0; l < cfg.n_layers; ++l) {
    auto pre = fmt::format("model.layers.{}.", l);
    add_param(pre + "input_layernorm.weight", Role::NormGain, {d});
    add_gated_norm(pre + "input_layernorm");
    add_param(pre + "self_attn.q_proj.weight", Role::AttnMatrix, {H * hd, d});
    add_param(pre + "self_attn.k_proj.weight", Role::AttnMatrix, {KV * hd, d});
    add_param(pre + "self_attn.v_proj.weight", Role::AttnMatrix, {KV * hd, d});
    add_param(pre + "self_attn.o_proj.weight", Role::AttnMatrix, {d, H * hd});
    if (cfg.learned_qk_gain()) {
      add_param(pre + "self_attn.q_norm.weight", Role::NormGain, {hd});
      add_param(pre + "self_attn.k_norm.weight", Role::NormGain, {hd});
    }
    if (cfg.attn_gate) add_param(pre + "self_attn.attn_gate.weight", Role::AttnGate, {H, d});
    add_param(pre + "post_attention_layernorm.weight", Role::NormGain, {d});
    add_gated_norm(pre + "post_attention_layernorm");
    if (cfg.is_moe_layer(l)) {
      const int64_t E = cfg.moe_experts, Ie = cfg.expert_ff(), Is = cfg.shared_ff();
      add_param(pre + "mlp.gate.weight", Role::Router, {E, d});
      add_param(pre + "mlp.experts.gate_proj.weight", Role::ExpertMatrix, {E, Ie, d});
      add_param(pre + "mlp.experts.up_proj.weight", Role::ExpertMatrix, {E, Ie, d});
      add_param(pre + "mlp.experts.down_proj.weight", Role::ExpertMatrix, {E, d, Ie});
      if (Is > 0) {
        add_param(pre + "mlp.shared_expert.gate_proj.weight", Role::SharedExpert, {Is, d});
        add_param(pre + "mlp.shared_expert.up_proj.weight", Role::SharedExpert, {Is, d});
        add_param(pre + "mlp.shared_expert.down_proj.weight", Role::SharedExpert, {d, Is});
      }
      buffers_.push_back(Param::unplaced(pre + "mlp.gate.e_score_correction_bias", Role::Router, {E}));
    } else {
      add_param(pre + "mlp.gate_proj.weight", Role::MlpMatrix, {I, d});
      add_param(pre + "mlp.up_proj.weight", Role::MlpMatrix, {I, d});
      add_param(pre + "mlp.down_proj.weight", Role::MlpMatrix, {d, I});
    }
  }
  add_param("model.norm.weight", Role::NormGain, {d});
  add_gated_norm("model.norm");
  add_param("lm_head.weight", Role::Head, {V, d});

  size_t pbytes = 0;
  for (auto& p : params_) {
    pbytes += Arena::padded(p.numel);
    n_params_ += p.numel;
  }
  params_arena_.reserve(pbytes, be_, "parameters");
  grads_arena_.reserve(pbytes, be_, "gradients");
  for (auto& p : params_) {
    p.w = params_arena_.alloc(p.numel);
    p.g = grads_arena_.alloc(p.numel);
  }
  be_.register_weights(params_arena_.base(), params_arena_.capacity());
  size_t bbytes = 0;
  for (auto& b : buffers_) bbytes += Arena::padded(b.numel);
  buffers_arena_.reserve(bbytes, be_, "MoE selection biases");
  for (auto& b : buffers_) b.w = buffers_arena_.alloc(b.numel);  // zero: the arena starts zeroed

  // Activation plan: every saved tensor of every layer, plus backward scratch, in one arena.
  const size_t N = N_;
  // LM head chunk: the backend's logits budget in rows, at least 64, at most the batch (std::min
  // last: std::clamp would be undefined for a batch under 64 rows), and under 2^30 logits so that
  // kernels may index a chunk with 32-bit ints.
  const int64_t budget_rows = int64_t(std::min(be_.lm_head_chunk_bytes() / sizeof(float), size_t(1) << 30) / size_t(V));
  chunk_rows_ = int(std::min<int64_t>(std::max<int64_t>(budget_rows, 64), int64_t(N)));
  // pack: with model.saved_activations bf16, kept as bf16 per layer (Layer::packed), computed in an
  // fp32 set shared by the layers of one kind. Not packed: the residual stream (x, mid), norm and
  // attention statistics (rstd, lse), the gate's small per-head arrays and the MoE routing.
  struct Req { float** ptr; size_t n; bool pack = false; };
  const bool bf16_saved = cfg.saved_activations == "bf16";
  std::vector<Req> reqs;
  layers_.resize(cfg.n_layers);
  size_t pi = 1, bi = 0;
  const MoeDims md = moe_dims();
  // The kernels index the expert rows with ints (the sorted layout's N*K rows always fit: tokens
  // and slots are ints).
  if (cfg.moe() && moe_rows(md) > int64_t(std::numeric_limits<int>::max()))
    fail("model.moe_capacity {}: {} rows per expert need {} expert rows per MoE layer, more than the 2^31 - 1 the "
         "kernels index; lower model.moe_capacity or run.batch_size",
         cfg.moe_capacity, md.C, moe_rows(md));
  int moe_index = 0;
  // GatedNorm: parameters and saved activations of one norm site.
  auto plan_gated_norm = [&](GatedNormActs& gn, std::vector<Req>& into) {
    if (R == 0) return;
    gn.down = &params_[pi++];
    gn.up = &params_[pi++];
    into.insert(into.end(), {{&gn.n, N * d, true}, {&gn.u, N * R, true}, {&gn.a, N * R, true}, {&gn.s, N * d, true}});
  };
  // Activation recomputation (model.recompute): only each layer's input L.x is kept; every other
  // saved tensor of a layer lives in one set shared by all layers of the same kind (dense or MoE,
  // the only difference in what a layer saves), which the backward refills by re-running the layer's
  // forward just before its backward. `shared` maps a layer kind to the first layer that owns the
  // set; later layers of that kind alias its pointers (resolved after the arena is carved).
  std::map<int, std::vector<Req>> shared;
  std::vector<std::pair<float**, float**>> aliases;  // (layer's pointer, owner's pointer)
  for (int l = 0; l < cfg.n_layers; ++l) {
    Layer& L = layers_[l];
    std::vector<Req> lreqs;  // this layer's saved tensors except L.x
    L.ln1 = &params_[pi++];
    plan_gated_norm(L.gn1, lreqs);
    L.wq = &params_[pi++];
    L.wk = &params_[pi++];
    L.wv = &params_[pi++];
    L.wo = &params_[pi++];
    L.qn = cfg.learned_qk_gain() ? &params_[pi++] : nullptr;
    L.kn = cfg.learned_qk_gain() ? &params_[pi++] : nullptr;
    L.wgate = cfg.attn_gate ? &params_[pi++] : nullptr;
    L.ln2 = &params_[pi++];
    plan_gated_norm(L.gn2, lreqs);
    L.window = cfg.layer_window(l);
    // The attention block's [N, heads * hd] tensors: fp32 (packable), or with model.attn_bf16
    // already bf16 (half the floats, kept as they are, never packed again).
    const bool ab = cfg.attn_bf16;
    auto attn_req = [&](float** p, size_t n) { return Req{p, ab ? (n + 1) / 2 : n, !ab}; };
    // The block norms' outputs: bf16 (model.norm_bf16) for h1, and for h2 in dense layers.
    auto norm_req = [&](float** p, bool b) { return Req{p, b ? (N * d + 1) / 2 : N * d, !b}; };
    const bool moe_layer = cfg.is_moe_layer(int(l));
    if (cfg.xsa) lreqs.push_back(attn_req(&L.z, N * H * hd));
    if (cfg.attn_gate) lreqs.insert(lreqs.end(), {{&L.ga, N * H}, {&L.gf, N * H}, attn_req(&L.og, N * H * hd)});
    reqs.push_back({&L.x, N * d});
    lreqs.insert(lreqs.end(), {norm_req(&L.h1, cfg.norm_bf16), {&L.r1, N}, attn_req(&L.q, N * H * hd),
                               attn_req(&L.k, N * KV * hd), attn_req(&L.v, N * KV * hd), attn_req(&L.o, N * H * hd),
                               {&L.lse, size_t(B_) * H * S_}, {&L.mid, N * d},
                               norm_req(&L.h2, cfg.norm_bf16 && !moe_layer), {&L.r2, N}});
    if (moe_layer) {
      L.moe = true;
      L.moe_index = moe_index++;
      L.router = &params_[pi++];
      L.eg = &params_[pi++];
      L.eu = &params_[pi++];
      L.ed = &params_[pi++];
      if (cfg.shared_ff() > 0) {
        L.sg = &params_[pi++];
        L.su = &params_[pi++];
        L.sd = &params_[pi++];
      }
      L.bias = &buffers_[bi++];
      L.wg = L.wu = L.wd = nullptr;
      L.gate = L.up = L.act = nullptr;
      // MoE arrays are float, int32 or (model.moe_bf16: the experts' hidden tensors) bf16, in whole
      // floats of the same arena. The expert rows (xs, g, u, a, y) and the shared expert's
      // activations are packed, except what moe_bf16 already keeps in bf16; router logits, lse,
      // combine weights and the int32 routing arrays stay as they are.
      std::vector<void*> packable;
      if (!cfg.moe_bf16)
        packable = {&L.ma.xs, &L.ma.g, &L.ma.u, &L.ma.a, &L.ma.y, &L.ma.sgate, &L.ma.sup, &L.ma.sact};
      for (auto& [ptr, bytes] : moe_act_requests<float>(md, L.ma))
        lreqs.push_back({reinterpret_cast<float**>(ptr), (bytes + sizeof(float) - 1) / sizeof(float),
                         std::find(packable.begin(), packable.end(), static_cast<void*>(ptr)) != packable.end()});
    } else {
      L.wg = &params_[pi++];
      L.wu = &params_[pi++];
      L.wd = &params_[pi++];
      if (cfg.mlp_bf16) {
        // Already bf16 (N*I uint16_t in half the floats): kept as they are, never packed again.
        const size_t half = (N * size_t(I) + 1) / 2;
        lreqs.insert(lreqs.end(), {{&L.gate, half}, {&L.up, half}, {&L.act, half}});
      } else {
        lreqs.insert(lreqs.end(), {{&L.gate, N * I, true}, {&L.up, N * I, true}, {&L.act, N * I, true}});
      }
    }
    lreqs.insert(lreqs.end(), {attn_req(&L.qr, N * H * hd), attn_req(&L.kr, N * KV * hd)});
    if (cfg.qk_norm) {
      lreqs.insert(lreqs.end(), {{&L.qrs, N * H}, {&L.krs, N * KV}});
    } else {
      L.qrs = L.krs = nullptr;
    }
    // Same kind => same request list in the same order.
    const int kind = L.moe ? 1 : 0;
    // bf16 storage shares (and packs) only the packable part; the rest stays the layer's own.
    if (bf16_saved) {
      std::vector<Req> own, pack;
      for (auto& r : lreqs) (r.pack ? pack : own).push_back(r);
      reqs.insert(reqs.end(), own.begin(), own.end());
      for (auto& r : pack) L.packed.push_back({r.ptr, nullptr, r.n});
      lreqs = std::move(pack);
    }
    auto owner = shared.find(kind);
    const bool share = cfg.recompute || bf16_saved;
    if (!share || owner == shared.end()) {
      reqs.insert(reqs.end(), lreqs.begin(), lreqs.end());
      if (share) shared.emplace(kind, lreqs);
    } else {
      LADDER_ASSERT(owner->second.size() == lreqs.size());
      for (size_t i = 0; i < lreqs.size(); ++i) {
        LADDER_ASSERT(owner->second[i].n == lreqs[i].n);
        aliases.push_back({lreqs[i].ptr, owner->second[i].ptr});
      }
    }
  }
  const size_t Idense = moe_index == cfg.n_layers ? 0 : size_t(I);  // dense MLP scratch, if any dense layer
  embed_ = &params_[0];
  norm_f_ = &params_[pi++];
  plan_gated_norm(gnf_, reqs);
  head_ = &params_[pi++];
  LADDER_ASSERT(pi == params_.size());
  if (cfg.xsa) reqs.push_back({&d_vx_, N * KV * hd});
  if (cfg.attn_gate) reqs.push_back({&d_ga_, N * H});
  if (R > 0) reqs.insert(reqs.end(), {{&d_gn_, N * d}, {&d_gs_, N * d}, {&d_gr_, N * R}});
  reqs.insert(reqs.end(), {{&x_final_, N * d}, {&hf_, N * d}, {&rf_, N}, {&logits_, size_t(chunk_rows_) * V},
                           {&d_res_, N * d}, {&d_h_, N * d}, {&d_q_, N * H * hd}, {&d_k_, N * KV * hd},
                           {&d_v_, N * KV * hd}, {&d_qn_, N * H * hd}, {&d_kn_, N * KV * hd},
                           {&d_o_, N * H * hd}, {&d_gate_, N * Idense}, {&d_up_, N * Idense},
                           {&d_act_, N * Idense}});
  if (moe_index > 0) {
    for (auto& [ptr, bytes] : moe_scratch_requests<float>(md, ms_))  // whole floats (bf16 gradients: odd sizes)
      reqs.push_back({reinterpret_cast<float**>(ptr), (bytes + sizeof(float) - 1) / sizeof(float)});
    moe_lse_sq_.assign(size_t(moe_index), 0.0);
    stats_lse_sq_.assign(size_t(moe_index), 0.0);
  }
  n_moe_ = moe_index;
  size_t abytes = 0;
  for (auto& r : reqs) abytes += Arena::padded(r.n);
  acts_arena_.reserve(abytes, be_, "activations");
  for (auto& r : reqs) *r.ptr = acts_arena_.alloc(r.n);
  for (auto& [ptr, from] : aliases) *ptr = *from;
  // The bf16 copies: each layer's own, in their own arena (half the floats they stand for).
  size_t pk_bytes = 0;
  for (auto& L : layers_)
    for (auto& pk : L.packed) pk_bytes += Arena::padded(pk.n, sizeof(uint16_t));
  packed_arena_.reserve(pk_bytes, be_, "saved activations (bf16)");
  for (auto& L : layers_)
    for (auto& pk : L.packed) {
      pk.bf16 = packed_arena_.alloc<uint16_t>(pk.n);
      // Read by the backward only as the B of weight-gradient GEMMs: the block inputs after the
      // norms (h2 of dense MLPs; the MoE block reads its h2 in moe_backward), the SwiGLU output and
      // the gated attention output.
      pk.gemm_only = pk.fp32 == &L.h1 || pk.fp32 == &L.act || pk.fp32 == &L.og || (pk.fp32 == &L.h2 && !L.moe);
    }

  // The host edge, in backend memory: ids and targets of one micro-batch, PKO flags, the sums a
  // forward downloads once, per-tensor gradient sums of squares, MoE load counts and betas.
  n_chunks_ = int((N + size_t(chunk_rows_) - 1) / size_t(chunk_rows_));
  n_sums_ = 2 * size_t(n_chunks_) + size_t(n_moe_);
  const size_t n_ex = size_t(n_moe_) * size_t(cfg.moe_experts);
  const size_t io_bytes = 2 * Arena::padded(N, sizeof(int32_t)) + (cfg.pko ? Arena::padded(N, 1) : 0) +
                          Arena::padded(params_.size(), sizeof(double)) +
                          Arena::padded(n_ex, sizeof(int64_t)) + Arena::padded(n_ex, sizeof(double));
  io_arena_.reserve(io_bytes, be_, "token ids and step sums");
  ids_ = io_arena_.alloc<int32_t>(N);
  targets_ = io_arena_.alloc<int32_t>(N);
  if (cfg.pko) resets_ = io_arena_.alloc<uint8_t>(N);
  gnorm_ = io_arena_.alloc<double>(params_.size());
  load_ = io_arena_.alloc<int64_t>(n_ex);  // zero: the arena starts zeroed
  beta_ = io_arena_.alloc<double>(n_ex);
  reserve_micro_batches(1);
  host_gnorm_.assign(params_.size(), 0.0);
  for (const Param& p : params_) grad_ptrs_.push_back(p.g), grad_numel_.push_back(p.numel);
  host_load_.assign(n_ex, 0);
  if (cfg.moe_quantile_balance() && n_moe_ > 0) reserve_balance_tokens(N_);
}

Transformer::~Transformer() { be_.unregister_weights(params_arena_.base()); }

void Transformer::download(const Param& p, float* host) const { be_.download(host, p.w, p.numel * sizeof(float)); }
void Transformer::upload(const Param& p, const float* host) { be_.upload(p.w, host, p.numel * sizeof(float)); }
std::vector<float> Transformer::download(const Param& p) const {
  std::vector<float> h(p.numel);
  download(p, h.data());
  return h;
}
std::vector<float> Transformer::download_grad(const Param& p) const {
  LADDER_ASSERT(p.g);
  std::vector<float> h(p.numel);
  be_.download(h.data(), p.g, p.numel * sizeof(float));
  return h;
}

// Every tensor is generated on the host (one staging buffer, reused) and uploaded: the values are
// the same whatever the backend, and on the CPU the upload is a memcpy of exactly these floats.
void Transformer::init(uint64_t seed) {
  const double std = cfg_.init_std > 0 ? cfg_.init_std : 0.5 / std::sqrt(double(cfg_.d_model));
  size_t most = 0;
  for (auto& p : params_) most = std::max(most, p.numel);
  std::vector<float> host(most);
  for (auto& p : params_) {
    float* w = host.data();
    if (p.role == Role::NormGain) {
      std::fill(w, w + p.numel, 1.0f);
    } else if (p.role == Role::AttnGate) {  // RECIPE.md: W_g zero at init, so every gate starts at 2*sigmoid(0) = 1
      std::fill(w, w + p.numel, 0.0f);
    } else {
      Philox rng(seed, stream_id(p.name));
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < int64_t(p.numel); ++i) w[i] = float(std * rng.trunc_normal(uint64_t(i)));
    }
    upload(p, w);
  }
  for (auto& b : buffers_) be_.zero(b.w, b.numel * sizeof(float));  // MoE selection bias starts at 0
}

void Transformer::zero_grad() { grads_arena_.zero(); }

MoeDims Transformer::moe_dims() const {
  MoeDims D;
  D.N = N_;
  D.d = cfg_.d_model;
  D.E = cfg_.moe_experts;
  D.K = cfg_.moe_top_k;
  D.I = cfg_.expert_ff();
  D.Is = cfg_.shared_ff();
  D.normalized = cfg_.moe_normalized();
  D.route_scale = cfg_.moe_route_scale;
  D.bf16 = cfg_.moe_bf16;
  D.bf16_grads = cfg_.moe_bf16_grads;
  D.C = cfg_.expert_capacity(N_);
  return D;
}

MoeWeights<float> Transformer::moe_weights(const Layer& L) const {
  MoeWeights<float> W;
  W.router = L.router->w;
  W.bias = L.bias->w;
  W.wg = L.eg->w;
  W.wu = L.eu->w;
  W.wd = L.ed->w;
  if (L.sg) {
    W.sg = L.sg->w;
    W.su = L.su->w;
    W.sd = L.sd->w;
  }
  return W;
}

// One multi-tensor op (a fixed number of launches on a GPU) for the per-tensor sums of squares.
void Transformer::grad_sums_async() {
  be_.sum_squares_multi(grad_ptrs_.data(), grad_numel_.data(), grad_ptrs_.size(), gnorm_);
}

double Transformer::grad_norm() {
  grad_sums_async();
  be_.download(host_gnorm_.data(), gnorm_, host_gnorm_.size() * sizeof(double));
  double s = 0;
  for (double v : host_gnorm_) s += v;  // parameter order: the same doubles in the same order on every run
  return std::sqrt(s);
}

// The same per-tensor sums as grad_norm(), but the total and the clip factor stay in backend
// memory: nothing waits, so the optimizer step can be enqueued right behind it and the host reads
// the norm afterwards (last_grad_norm). The device sums the per-tensor doubles in parameter order
// and takes the factor as float(clip / (norm + 1e-6)) in double, as the host did; the optimizer
// multiplies each gradient element by it as it reads it, so CPU results are bitwise those of
// grad_norm() + scale_inplace + an unscaled step, without the pass that read and wrote every
// gradient (8 bytes per parameter; about 3.5 ms a step for MoE d=1024 on an H200).
const float* Transformer::grad_clip_factor_async(double clip) { return grad_clip_factor_async(clip, GradShard{}); }

const float* Transformer::grad_clip_factor_async(double clip, const GradShard& shard) {
  if (!clip_) {
    // Sized on the first call (one small allocation in the first step; the constructor's arenas are
    // planned elsewhere): [0] the norm (double), [1] the clip factor (a float in a double's slot).
    clip_arena_.reserve(Arena::padded(2, sizeof(double)), be_, "gradient clipping");
    clip_ = clip_arena_.alloc<double>(2);
  }
  if (!shard.owner) {
    grad_sums_async();
  } else {
    // A sum over 0 elements is 0: the other ranks' tensors add nothing here, their owner's sum there.
    LADDER_ASSERT(shard.owner->size() == params_.size() && shard.sum_over_ranks);
    if (owned_rank_ != shard.rank || owned_by_ != *shard.owner) {  // the same list every step (a GPU backend
      owned_numel_ = grad_numel_;                                   // caches its device copy)
      for (size_t i = 0; i < params_.size(); ++i)
        if ((*shard.owner)[i] != shard.rank) owned_numel_[i] = 0;
      owned_rank_ = shard.rank;
      owned_by_ = *shard.owner;
    }
    be_.sum_squares_multi(grad_ptrs_.data(), owned_numel_.data(), grad_ptrs_.size(), gnorm_);
    shard.sum_over_ranks(gnorm_, params_.size());
  }
  be_.grad_clip_factor(gnorm_, params_.size(), clip, clip_, reinterpret_cast<float*>(clip_ + 1));
  return last_clip_factor();
}

const float* Transformer::last_clip_factor() const {
  LADDER_ASSERT(clip_);
  return reinterpret_cast<const float*>(clip_ + 1);
}

double Transformer::last_grad_norm() {
  LADDER_ASSERT(clip_);
  double norm = 0;
  be_.download(&norm, clip_, sizeof(double));
  return norm;
}

float* Transformer::balance_vals(int moe_index) {
  return reinterpret_cast<float*>(balance_arena_.base()) + size_t(moe_index) * size_t(balance_cap_) * cfg_.moe_experts;
}

// Called before a step (train_step) or, when a caller trains more tokens than reserved between two
// updates, from forward() (growth keeps the values already stored; it allocates, so a planned step
// reserves up front and never gets here).
void Transformer::reserve_step(int micro_batches) {
  reserve_micro_batches(micro_batches);
  reserve_balance_tokens(int64_t(N_) * micro_batches);
}

void Transformer::reserve_balance_tokens(int64_t tokens) {
  const int E = cfg_.moe_experts;
  if (!cfg_.moe_quantile_balance() || n_moe_ == 0 || cfg_.moe_top_k >= E || tokens <= balance_cap_) return;
  Arena grown(size_t(n_moe_) * size_t(tokens) * E * sizeof(float), be_, "MoE quantile-balancing router values");
  float* base = reinterpret_cast<float*>(grown.base());
  for (int m = 0; m < n_moe_; ++m)
    be_.copy(base + size_t(m) * size_t(tokens) * E, balance_vals(m), size_t(balance_tokens_) * E * sizeof(float));
  balance_arena_ = std::move(grown);
  balance_cap_ = tokens;
}

bool Transformer::compute_beta() {
  const int E = cfg_.moe_experts, K = cfg_.moe_top_k;
  if (!cfg_.moe_quantile_balance() || K >= E || balance_tokens_ == 0) return false;
  for (int m = 0; m < n_moe_; ++m) be_.moe_quantile_beta(beta_ + size_t(m) * E, balance_vals(m), balance_tokens_, E, K);
  return true;
}

void Transformer::bias_from_beta() {
  const int E = cfg_.moe_experts;
  for (auto& L : layers_)
    if (L.moe) be_.moe_balance_bias(L.bias->w, beta_ + size_t(L.moe_index) * E, E);
}

std::vector<double> Transformer::balance_beta() {
  std::vector<double> beta;
  if (!compute_beta()) return beta;
  beta.resize(size_t(n_moe_) * size_t(cfg_.moe_experts));
  be_.download(beta.data(), beta_, beta.size() * sizeof(double));
  return beta;
}

// The (possibly rank-averaged) beta goes back up; the bias is computed from it on the backend.
void Transformer::apply_balance(const std::vector<double>& beta) {
  balance_tokens_ = 0;  // forget the tokens; the store keeps its capacity
  if (beta.empty()) return;
  LADDER_ASSERT(beta.size() == size_t(n_moe_) * size_t(cfg_.moe_experts));
  be_.upload(beta_, beta.data(), beta.size() * sizeof(double));
  bias_from_beta();
}

// The training step's path: no host copy of beta or the bias at all.
void Transformer::update_balance(const BetaAverage& average) {
  if (compute_beta()) {
    if (average) average(beta_, size_t(n_moe_) * size_t(cfg_.moe_experts));  // data parallel: the ranks' mean
    bias_from_beta();
  }
  balance_tokens_ = 0;
}

std::vector<int> Transformer::capacity_overflow_rows() const {
  std::vector<int> out;
  const MoeDims md = moe_dims();
  if (md.C == 0) return out;
  // Under model.recompute the MoE layers share one set of arrays (ov included): one value then,
  // the layer that ran last.
  std::vector<const int32_t*> seen;
  for (const Layer& L : layers_) {
    if (!L.moe || std::find(seen.begin(), seen.end(), L.ma.ov) != seen.end()) continue;
    seen.push_back(L.ma.ov);
    int32_t ov = 0;
    be_.download(&ov, L.ma.ov + md.E, sizeof(int32_t));
    out.push_back(ov);
  }
  return out;
}

std::vector<MoeLayerStats> Transformer::take_moe_stats(const HostSum& sum_over_ranks) {
  std::vector<MoeLayerStats> out;
  if (n_moe_ == 0) return out;
  const size_t E = size_t(cfg_.moe_experts), nm = size_t(n_moe_);
  be_.download(host_load_.data(), load_, host_load_.size() * sizeof(int64_t));
  be_.zero(load_, host_load_.size() * sizeof(int64_t));
  // [loads of every MoE layer, lse^2 sum per layer, tokens] as doubles (exact: counts below 2^53),
  // so that data-parallel ranks can add theirs up in one call.
  std::vector<double> v(nm * E + nm + 1);
  for (size_t i = 0; i < nm * E; ++i) v[i] = double(host_load_[i]);
  for (size_t m = 0; m < nm; ++m) v[nm * E + m] = stats_lse_sq_[m];
  v[nm * E + nm] = double(stats_tokens_);
  if (sum_over_ranks) sum_over_ranks(v.data(), v.size());
  const double tokens = v[nm * E + nm];
  for (auto& L : layers_) {
    if (!L.moe) continue;
    const double* ld = v.data() + size_t(L.moe_index) * E;
    MoeLayerStats st;
    st.layer = int(&L - layers_.data());
    if (tokens > 0) {
      st.load_min = *std::min_element(ld, ld + E);
      st.load_max = *std::max_element(ld, ld + E);
      double sum = 0;
      for (size_t e = 0; e < E; ++e) sum += ld[e];
      st.load_mean = sum / double(E);
      // Measured, not assumed: routing is dropless, so this is 0 unless a kernel lost a token.
      st.dropped_frac = 1.0 - sum / (tokens * double(cfg_.moe_top_k));
      st.lse_sq = v[nm * E + size_t(L.moe_index)] / tokens;
    }
    stats_lse_sq_[size_t(L.moe_index)] = 0;
    out.push_back(st);
  }
  stats_tokens_ = 0;
  return out;
}

// The query scale (q *= q_scale after RoPE) is folded into the score scale: the same scores,
// without another pass over q.
AttnShape Transformer::attn_shape(int window) const {
  return AttnShape{B_, S_, cfg_.n_heads, cfg_.kv_heads(), cfg_.hd(), window, cfg_.q_scale / std::sqrt(double(cfg_.hd()))};
}

// PKO shifts the keys of long layers only; nullptr elsewhere (and without model.pko).
const uint8_t* Transformer::key_resets(const Layer& L) const {
  return cfg_.pko && cfg_.is_long_layer(int(&L - layers_.data())) ? resets_ : nullptr;
}

// Order on every layer (RECIPE.md, PKO rung): [PKO shift of the raw keys, long layers only] ->
// QK-norm -> RoPE (half-RoPE: dims [0, hd/2)) -> q *= q_scale -> attention (window on short
// layers) -> [XSA] -> [per-head gate 2*sigmoid(h1 W_g)] -> o_proj. The gate reads h1, the block's
// normed attention input (after GatedNorm when on), as in the recipe's x W_g.
void Transformer::attn_forward(Layer& L) {
  if (cfg_.attn_bf16) return attn_forward_bf16(L);
  const int N = N_, d = cfg_.d_model, H = cfg_.n_heads, KV = cfg_.kv_heads(), hd = cfg_.hd();
  const int Hd = H * hd, KVd = KV * hd, rot = cfg_.rope_dims();
  const float eps = float(cfg_.norm_eps), theta = float(cfg_.rope_theta);
  input_gemm(L, L.h1, Hd, L.wq->w, L.q, false);
  input_gemm(L, L.h1, KVd, L.wk->w, L.k, false);
  input_gemm(L, L.h1, KVd, L.wv->w, L.v, false);
  // One op per tensor: [PKO shift] -> QK-norm -> RoPE. Only the raw projections and the norms' rstd
  // are kept; the backward recomputes the shifted keys from L.k and the resets.
  be_.qk_prep_forward(L.qr, L.qrs, L.q, L.qn ? L.qn->w : nullptr, nullptr, N, S_, H, hd, rot, theta, cfg_.qk_norm,
                      eps);
  be_.qk_prep_forward(L.kr, L.krs, L.k, L.kn ? L.kn->w : nullptr, key_resets(L), N, S_, KV, hd, rot, theta,
                      cfg_.qk_norm, eps);
  be_.attention_forward(L.o, L.lse, L.qr, L.kr, L.v, attn_shape(L.window));
  L.oin = L.o;
  if (cfg_.xsa) {
    be_.xsa_forward(L.z, L.o, L.v, N, H, KV, hd);
    L.oin = L.z;
  }
  if (L.wgate) {
    input_gemm(L, L.h1, H, L.wgate->w, L.ga, false);
    be_.head_gate_forward(L.og, L.gf, L.oin, L.ga, N, H, hd);
    L.oin = L.og;
  }
  be_.gemm_add(false, true, N, d, Hd, 1.f, L.oin, Hd, L.wo->w, Hd, L.x, L.mid, d);  // mid = x + o_proj(..)
}

bool Transformer::norm_b16(const Layer& L, const float* X) const {
  return cfg_.norm_bf16 && (X == L.h1 || (X == L.h2 && !L.moe));
}

void Transformer::input_gemm(const Layer& L, const float* X, int n, const float* W, float* out, bool out_bf16) {
  const int d = cfg_.d_model;
  be_.gemm_ex(false, true, N_, n, d, 1.f, X, norm_b16(L, X), d, W, false, d, 0.f, nullptr, out, out_bf16, n);
}

void Transformer::wgrad_gemm(const Layer& L, bool ta, bool tb, int M, int N, int K, const float* A, int lda,
                             const float* B, int ldb, float* C, int ldc, bool a_bf16) {
  // B as the GEMM reads it: the norm's bf16 output (norm_bf16), the layer's packed bf16 copy
  // (saved_activations bf16), or the fp32 tensor.
  const uint16_t* b_16 = norm_b16(L, B) ? b16(B) : nullptr;
  for (const auto& pk : L.packed)
    if (!b_16 && pk.gemm_only && *pk.fp32 == B) b_16 = pk.bf16;
  if (a_bf16)  // A bf16 bits (model.mlp_bf16_grads): the typed GEMM
    return be_.gemm_ex(ta, tb, M, N, K, 1.f, b16(A), true, lda, b_16 ? static_cast<const void*>(b_16) : B,
                       b_16 != nullptr, ldb, 1.f, nullptr, C, false, ldc);
  if (b_16) return be_.gemm_b16(ta, tb, M, N, K, 1.f, A, lda, b_16, ldb, 1.f, C, ldc);
  be_.gemm(ta, tb, M, N, K, 1.f, A, lda, B, ldb, 1.f, C, ldc);
}

void Transformer::attn_backward(Layer& L) {
  if (cfg_.attn_bf16) return attn_backward_bf16(L);
  const int N = N_, d = cfg_.d_model, H = cfg_.n_heads, KV = cfg_.kv_heads(), hd = cfg_.hd();
  const int Hd = H * hd, KVd = KV * hd, rot = cfg_.rope_dims();
  const float theta = float(cfg_.rope_theta);
  // d_o_ = d(o_proj input); the switches then turn it, in place, into d(attention output).
  be_.gemm(false, false, N, Hd, d, 1.f, d_res_, d, L.wo->w, Hd, 0.f, d_o_, Hd);
  wgrad_gemm(L, true, false, d, Hd, N, d_res_, d, L.oin, Hd, L.wo->g, Hd);
  if (L.wgate) {
    be_.head_gate_backward(d_o_, d_ga_, d_o_, cfg_.xsa ? L.z : L.o, L.gf, N, H, hd);
    wgrad_gemm(L, true, false, H, d, N, d_ga_, H, L.h1, d, L.wgate->g, d);
  }
  if (cfg_.xsa) be_.xsa_backward(d_o_, d_vx_, d_o_, L.o, L.v, N, H, KV, hd);
  be_.attention_backward(d_qn_, d_kn_, d_v_, d_o_, L.qr, L.kr, L.v, L.o, L.lse, attn_shape(L.window));
  if (cfg_.xsa) be_.add_inplace(d_v_, d_vx_, size_t(N) * KVd);
  // d(attention inputs) d_qn_ / d_kn_ -> d(raw projections) d_q_ / d_k_, through RoPE, QK-norm and the shift.
  be_.qk_prep_backward(d_q_, L.qn ? L.qn->g : nullptr, d_qn_, L.q, L.qn ? L.qn->w : nullptr, L.qrs, nullptr, N, S_, H,
                       hd, rot, theta, cfg_.qk_norm);
  be_.qk_prep_backward(d_k_, L.kn ? L.kn->g : nullptr, d_kn_, L.k, L.kn ? L.kn->w : nullptr, L.krs, key_resets(L), N,
                       S_, KV, hd, rot, theta, cfg_.qk_norm);
  input_projections_backward(L);
}

// model.attn_bf16: the same sublayer and op order as attn_forward, with the block's [N, heads * hd]
// tensors in bf16. The projections' GEMMs write bf16 q, k, v (rounded fp32 accumulation); each op
// after them reads bf16, computes in fp32 and writes bf16; o_proj reads the bf16 input and adds the
// residual in fp32. The gate logits (read from h1, fp32) and every statistic stay fp32.
void Transformer::attn_forward_bf16(Layer& L) {
  const int N = N_, d = cfg_.d_model, H = cfg_.n_heads, KV = cfg_.kv_heads(), hd = cfg_.hd();
  const int Hd = H * hd, KVd = KV * hd, rot = cfg_.rope_dims();
  const float eps = float(cfg_.norm_eps), theta = float(cfg_.rope_theta);
  input_gemm(L, L.h1, Hd, L.wq->w, L.q, true);
  input_gemm(L, L.h1, KVd, L.wk->w, L.k, true);
  input_gemm(L, L.h1, KVd, L.wv->w, L.v, true);
  be_.qk_prep_forward_bf16(b16(L.qr), L.qrs, b16(L.q), L.qn ? L.qn->w : nullptr, nullptr, N, S_, H, hd, rot, theta,
                           cfg_.qk_norm, eps);
  be_.qk_prep_forward_bf16(b16(L.kr), L.krs, b16(L.k), L.kn ? L.kn->w : nullptr, key_resets(L), N, S_, KV, hd, rot,
                           theta, cfg_.qk_norm, eps);
  be_.attention_forward_bf16(b16(L.o), L.lse, b16(L.qr), b16(L.kr), b16(L.v), attn_shape(L.window));
  L.oin = L.o;
  if (cfg_.xsa) {
    be_.xsa_forward_bf16(b16(L.z), b16(L.o), b16(L.v), N, H, KV, hd);
    L.oin = L.z;
  }
  if (L.wgate) {
    input_gemm(L, L.h1, H, L.wgate->w, L.ga, false);
    be_.head_gate_forward_bf16(b16(L.og), L.gf, b16(L.oin), L.ga, N, H, hd);
    L.oin = L.og;
  }
  // mid = x + o_proj(..): the residual is gemm_ex's fp32 C_in, the bf16 input read as it is.
  be_.gemm_ex(false, true, N, d, Hd, 1.f, b16(L.oin), true, Hd, L.wo->w, false, Hd, 1.f, L.x, L.mid, false, d);
}

void Transformer::attn_backward_bf16(Layer& L) {
  const int N = N_, d = cfg_.d_model, H = cfg_.n_heads, KV = cfg_.kv_heads(), hd = cfg_.hd();
  const int Hd = H * hd, KVd = KV * hd, rot = cfg_.rope_dims();
  const float theta = float(cfg_.rope_theta);
  be_.gemm(false, false, N, Hd, d, 1.f, d_res_, d, L.wo->w, Hd, 0.f, d_o_, Hd);
  be_.gemm_b16(true, false, d, Hd, N, 1.f, d_res_, d, b16(L.oin), Hd, 1.f, L.wo->g, Hd);
  if (L.wgate) {
    be_.head_gate_backward_bf16(d_o_, d_ga_, d_o_, b16(cfg_.xsa ? L.z : L.o), L.gf, N, H, hd);
    wgrad_gemm(L, true, false, H, d, N, d_ga_, H, L.h1, d, L.wgate->g, d);
  }
  if (cfg_.xsa) be_.xsa_backward_bf16(d_o_, d_vx_, d_o_, b16(L.o), b16(L.v), N, H, KV, hd);
  be_.attention_backward_bf16(d_qn_, d_kn_, d_v_, d_o_, b16(L.qr), b16(L.kr), b16(L.v), b16(L.o), L.lse,
                              attn_shape(L.window));
  if (cfg_.xsa) be_.add_inplace(d_v_, d_vx_, size_t(N) * KVd);
  be_.qk_prep_backward_bf16(d_q_, L.qn ? L.qn->g : nullptr, d_qn_, b16(L.q), L.qn ? L.qn->w : nullptr, L.qrs, nullptr,
                            N, S_, H, hd, rot, theta, cfg_.qk_norm);
  be_.qk_prep_backward_bf16(d_k_, L.kn ? L.kn->g : nullptr, d_kn_, b16(L.k), L.kn ? L.kn->w : nullptr, L.krs,
                            key_resets(L), N, S_, KV, hd, rot, theta, cfg_.qk_norm);
  input_projections_backward(L);
}

// d(h1) into d_h_ (overwritten) from d(q), d(k), d(v) (d_q_, d_k_, d_v_) and the gate logits'
// d_ga_, and the four projections' weight gradients (h1 read as bf16 under model.norm_bf16).
void Transformer::input_projections_backward(Layer& L) {
  const int N = N_, d = cfg_.d_model, H = cfg_.n_heads, hd = cfg_.hd();
  const int Hd = H * hd, KVd = cfg_.kv_heads() * hd;
  be_.gemm(false, false, N, d, Hd, 1.f, d_q_, Hd, L.wq->w, d, 0.f, d_h_, d);
  be_.gemm(false, false, N, d, KVd, 1.f, d_k_, KVd, L.wk->w, d, 1.f, d_h_, d);
  be_.gemm(false, false, N, d, KVd, 1.f, d_v_, KVd, L.wv->w, d, 1.f, d_h_, d);
  if (L.wgate) be_.gemm(false, false, N, d, H, 1.f, d_ga_, H, L.wgate->w, d, 1.f, d_h_, d);
  wgrad_gemm(L, true, false, Hd, d, N, d_q_, Hd, L.h1, d, L.wq->g, d);
  wgrad_gemm(L, true, false, KVd, d, N, d_k_, KVd, L.h1, d, L.wk->g, d);
  wgrad_gemm(L, true, false, KVd, d, N, d_v_, KVd, L.h1, d, L.wv->g, d);
}

void Transformer::upload_batch(const int32_t* inputs, const int32_t* targets) {
  const int N = N_;
  for (int i = 0; i < N; ++i)
    if (inputs[i] < 0 || inputs[i] >= cfg_.vocab_size)
      fail("token id {} at position {} is outside the vocabulary [0, {})", inputs[i], i, cfg_.vocab_size);
  be_.upload(ids_, inputs, sizeof(int32_t) * size_t(N));
  if (targets) be_.upload(targets_, targets, sizeof(int32_t) * size_t(N));
}

// One block: fills layer l's saved activations from L.x and writes the next layer's input (or
// x_final_). With recomputation the backward calls it again for the same layer, with the same input
// and so the same results bit for bit, and with record = false (no load/balance statistics twice).
void Transformer::layer_forward(size_t l, bool record, bool balance) {
  const int N = N_, d = cfg_.d_model, I = cfg_.ff();
  Layer& L = layers_[l];
  norm_forward(L.h1, L.r1, L.x, L.ln1, L.gn1, norm_b16(L, L.h1));
  attn_forward(L);
  norm_forward(L.h2, L.r2, L.mid, L.ln2, L.gn2, norm_b16(L, L.h2));
  float* next = l + 1 < layers_.size() ? layers_[l + 1].x : x_final_;
  if (L.moe) {
    be_.copy(next, L.mid, sizeof(float) * size_t(N) * d);  // the MoE block adds its output onto it
    const MoeDims md = moe_dims();
    const size_t mi = size_t(L.moe_index);
    moe_forward<float>(ops_, md, moe_weights(L), L.ma, L.h2, next);
    // Router z term of this layer: a device double, read with the loss sums (parse_sums).
    be_.sum_squares_async(L.ma.lse, size_t(N), cur_sums_ + 2 * size_t(n_chunks_) + mi);
    if (record) {
      be_.moe_count_load(load_ + mi * size_t(md.E), L.ma.offsets, md.E);
      if (balance)
        be_.moe_balance_values(balance_vals(L.moe_index) + size_t(balance_tokens_) * md.E, L.ma.logits, L.bias->w, N,
                               md.E, md.K);
    }
    return;
  }
  if (cfg_.mlp_bf16) {
    // The GEMMs write gate and up in bf16 (rounded fp32 accumulation), SwiGLU computes in fp32 from
    // them and writes act in bf16, which the down projection reads as it is.
    input_gemm(L, L.h2, I, L.wg->w, L.gate, true);
    input_gemm(L, L.h2, I, L.wu->w, L.up, true);
    be_.swiglu_forward_bf16(b16(L.act), b16(L.gate), b16(L.up), size_t(N) * I);
    be_.gemm_ex(false, true, N, d, I, 1.f, b16(L.act), true, I, L.wd->w, false, I, 1.f, L.mid, next, false, d);
    return;
  }
  input_gemm(L, L.h2, I, L.wg->w, L.gate, false);
  input_gemm(L, L.h2, I, L.wu->w, L.up, false);
  be_.swiglu_forward(L.act, L.gate, L.up, size_t(N) * I);
  be_.gemm_add(false, true, N, d, I, 1.f, L.act, I, L.wd->w, I, L.mid, next, d);  // next = mid + down(..)
}

void Transformer::forward(bool training) {
  const int N = N_, d = cfg_.d_model;
  const MoeDims md = moe_dims();
  const bool balance = training && cfg_.moe_quantile_balance() && n_moe_ > 0 && md.K < md.E;
  if (balance && balance_tokens_ + N > balance_cap_)  // unplanned: see reserve_balance_tokens
    reserve_balance_tokens(std::max<int64_t>(balance_tokens_ + N, 2 * balance_cap_));
  be_.embedding_forward(layers_[0].x, embed_->w, ids_, N, d);
  if (cfg_.pko) compute_resets();
  for (size_t l = 0; l < layers_.size(); ++l) {
    layer_forward(l, training, balance);
    if (training)  // bf16 storage: keep what the backward reads before the next layer reuses the fp32 set
      for (auto& pk : layers_[l].packed) be_.to_bf16(pk.bf16, *pk.fp32, pk.n);
  }
  if (training && !layers_.empty() && cfg_.moe()) {
    stats_tokens_ += N;
    if (balance) balance_tokens_ += N;
  }
  norm_forward(hf_, rf_, x_final_, norm_f_, gnf_, false);
}

// One micro-batch's sums, downloaded: (xent, lse^2) of each head chunk and each MoE layer's router
// sum of lse^2, summed on the host in chunk / layer order (the order the synchronous sums were
// added in before, so CPU results are bitwise unchanged).
LossSums Transformer::parse_sums(const double* host, bool training) {
  LossSums sums;
  sums.tokens = N_;
  for (int c = 0; c < n_chunks_; ++c) {
    sums.xent += host[2 * size_t(c)];
    sums.lse_sq += host[2 * size_t(c) + 1];
  }
  for (int m = 0; m < n_moe_; ++m) {
    moe_lse_sq_[size_t(m)] = host[2 * size_t(n_chunks_) + size_t(m)];
    if (training) stats_lse_sq_[size_t(m)] += moe_lse_sq_[size_t(m)];
  }
  if (cfg_.router_z_loss > 0 && n_moe_ > 0) {
    double s = 0;
    for (double v : moe_lse_sq_) s += v;
    sums.router_z = cfg_.router_z_loss / double(n_moe_) * s;
  }
  return sums;
}

void Transformer::check_no_pending(const char* call) const {
  if (pending_ > 0)
    fail("Transformer::{}: {} micro-batch(es) of forward_backward_async still wait for take_loss_sums()", call,
         pending_);
}

// Grows the slots (keeping the pending ones); allocates, so a planned step reserves up front.
void Transformer::reserve_micro_batches(int n) {
  if (n <= sums_cap_) return;
  Arena grown(Arena::padded(size_t(n) * n_sums_, sizeof(double)), be_, "loss sums of an optimizer step");
  double* base = grown.alloc<double>(size_t(n) * n_sums_);
  if (pending_ > 0) be_.copy(base, sums_, size_t(pending_) * n_sums_ * sizeof(double));
  sums_arena_ = std::move(grown);
  sums_ = base;
  sums_cap_ = n;
  host_sums_.assign(size_t(n) * n_sums_, 0.0);
}

std::vector<LossSums> Transformer::take_loss_sums() {
  std::vector<LossSums> out;
  if (pending_ == 0) return out;
  // The one host wait: everything enqueued before it has run when the sums arrive.
  be_.download(host_sums_.data(), sums_, size_t(pending_) * n_sums_ * sizeof(double));
  for (int i = 0; i < pending_; ++i) out.push_back(parse_sums(host_sums_.data() + size_t(i) * n_sums_, true));
  pending_ = 0;
  return out;
}

void Transformer::discard_step() {
  pending_ = 0;
  balance_tokens_ = 0;
  // The aborted micro-batches' statistics: their expert loads were counted on the device, their
  // tokens (and, where their sums were read, their router lse^2) on the host. The next step's
  // take_moe_stats reports its own micro-batches only.
  stats_tokens_ = 0;
  std::fill(stats_lse_sq_.begin(), stats_lse_sq_.end(), 0.0);
  if (n_moe_ > 0) be_.zero(load_, host_load_.size() * sizeof(int64_t));
}

LossSums Transformer::forward_backward(const int32_t* inputs, const int32_t* targets, float grad_scale) {
  check_no_pending("forward_backward");
  forward_backward_async(inputs, targets, grad_scale);
  return take_loss_sums().front();
}

void Transformer::forward_backward_async(const int32_t* inputs, const int32_t* targets, float grad_scale) {
  const int N = N_, d = cfg_.d_model, I = cfg_.ff();
  const int V = cfg_.vocab_size;
  if (pending_ == sums_cap_) reserve_micro_batches(2 * sums_cap_);  // unplanned: see reserve_micro_batches
  cur_sums_ = sums_ + size_t(pending_) * n_sums_;
  upload_batch(inputs, targets);
  forward(/*training=*/true);

  // LM head and loss, in row chunks: the full [N, V] logits never exist. Each chunk's logits are
  // turned into their gradient in place and immediately consumed by the two head GEMMs.
  int chunk = 0;
  for (int r0 = 0; r0 < N; r0 += chunk_rows_, ++chunk) {
    const int rows = std::min(chunk_rows_, N - r0);
    be_.gemm(false, true, rows, V, d, 1.f, hf_ + size_t(r0) * d, d, head_->w, d, 0.f, logits_, V);
    be_.softmax_xent_async(logits_, targets_ + r0, rows, V, float(cfg_.z_loss), grad_scale,
                           cur_sums_ + 2 * size_t(chunk));
    be_.gemm(false, false, rows, d, V, 1.f, logits_, V, head_->w, d, 0.f, d_h_ + size_t(r0) * d, d);
    be_.gemm(true, false, V, d, rows, 1.f, logits_, V, hf_ + size_t(r0) * d, d, 1.f, head_->g, d);
  }
  norm_backward(d_res_, d_h_, x_final_, norm_f_, rf_, gnf_, false);

  // The router z-loss gradient scale is known without the forward's sums: no wait here.
  const float z_scale = n_moe_ > 0 ? float(cfg_.router_z_loss / double(n_moe_)) * grad_scale : 0.f;
  for (int l = int(layers_.size()) - 1; l >= 0; --l) {
    Layer& L = layers_[l];
    // Recomputation: the shared activations hold the last layer's after the forward; every other
    // layer is re-run from its saved input. Its output lands in layer l+1's input buffer (or
    // x_final_), which the backward has finished with.
    if (cfg_.recompute && l + 1 < int(layers_.size())) layer_forward(size_t(l), /*record=*/false, false);
    // bf16 storage: back into the shared fp32 set, for every layer (the last one's fp32 values
    // are still there, but its backward reads the same rounded values as every other layer's).
    for (auto& pk : L.packed)
      if (!pk.gemm_only) be_.from_bf16(*pk.fp32, pk.bf16, pk.n);
    if (L.moe) {
      // MoE: next = mid + MoE(h2); d_h = d(h2).
      MoeGrads<float> G{L.router->g, L.eg->g, L.eu->g, L.ed->g, L.sg ? L.sg->g : nullptr,
                        L.su ? L.su->g : nullptr, L.sd ? L.sd->g : nullptr};
      moe_backward<float>(ops_, moe_dims(), moe_weights(L), G, L.ma, ms_, L.h2, d_res_, d_h_, z_scale);
    } else {
    // MLP: next = mid + down(silu(gate(h2)) * up(h2)); d_res holds d(next). model.mlp_bf16_grads
    // (g16, with mlp_bf16): d(act), d(gate) and d(up) in bf16 too (bits in the fp32-sized scratch),
    // each the fp32 value rounded, and read so by the GEMMs; d(h2) and the weight gradients stay
    // fp32. (gemm_ex with every operand fp32 is gemm.)
    const bool g16 = cfg_.mlp_bf16_grads;
    be_.gemm_ex(false, false, N, I, d, 1.f, d_res_, false, d, L.wd->w, false, I, 0.f, nullptr, d_act_, g16, I);
    if (cfg_.mlp_bf16) {  // act, gate and up are bf16: read as they are
      be_.gemm_b16(true, false, d, I, N, 1.f, d_res_, d, b16(L.act), I, 1.f, L.wd->g, I);
      if (g16)
        be_.swiglu_backward_bf16_grads(b16(d_gate_), b16(d_up_), b16(d_act_), b16(L.gate), b16(L.up), size_t(N) * I);
      else
        be_.swiglu_backward_bf16(d_gate_, d_up_, d_act_, b16(L.gate), b16(L.up), size_t(N) * I);
    } else {
      wgrad_gemm(L, true, false, d, I, N, d_res_, d, L.act, I, L.wd->g, I);
      be_.swiglu_backward(d_gate_, d_up_, d_act_, L.gate, L.up, size_t(N) * I);
    }
    be_.gemm_ex(false, false, N, d, I, 1.f, d_gate_, g16, I, L.wg->w, false, d, 0.f, nullptr, d_h_, false, d);
    be_.gemm_ex(false, false, N, d, I, 1.f, d_up_, g16, I, L.wu->w, false, d, 1.f, nullptr, d_h_, false, d);
    wgrad_gemm(L, true, false, I, d, N, d_gate_, I, L.h2, d, L.wg->g, d, g16);
    wgrad_gemm(L, true, false, I, d, N, d_up_, I, L.h2, d, L.wu->g, d, g16);
    }
    norm_backward(d_res_, d_h_, L.mid, L.ln2, L.r2, L.gn2, true);  // d_res = d(mid)
    attn_backward(L);                                              // d_h = d(h1)
    norm_backward(d_res_, d_h_, L.x, L.ln1, L.r1, L.gn1, true);    // d_res = d(x)
  }
  be_.embedding_backward(embed_->g, d_res_, ids_, N, d);
  // The sums wait in their slot (forward_backward: read at once; a step: after its optimizer).
  ++pending_;
}

LossSums Transformer::forward_loss(const int32_t* inputs, const int32_t* targets) {
  const int N = N_, d = cfg_.d_model, V = cfg_.vocab_size;
  check_no_pending("forward_loss");
  cur_sums_ = sums_;
  upload_batch(inputs, targets);
  forward();
  int chunk = 0;
  for (int r0 = 0; r0 < N; r0 += chunk_rows_, ++chunk) {
    const int rows = std::min(chunk_rows_, N - r0);
    be_.gemm(false, true, rows, V, d, 1.f, hf_ + size_t(r0) * d, d, head_->w, d, 0.f, logits_, V);
    be_.softmax_xent_forward_async(logits_, targets_ + r0, rows, V, nullptr, sums_ + 2 * size_t(chunk));
  }
  be_.download(host_sums_.data(), sums_, n_sums_ * sizeof(double));  // the one wait
  return parse_sums(host_sums_.data(), /*training=*/false);
}

void Transformer::forward_logits(const int32_t* inputs, float* logits) {
  const int N = N_, d = cfg_.d_model, V = cfg_.vocab_size;
  check_no_pending("forward_logits");
  cur_sums_ = sums_;
  upload_batch(inputs, nullptr);
  forward();
  if (be_.is_host()) {  // `logits` is host memory, which is this backend's: one GEMM straight into it
    be_.gemm(false, true, N, V, d, 1.f, hf_, d, head_->w, d, 0.f, logits, V);
    return;
  }
  // Otherwise through the head's chunk buffer, one download per chunk (sampling, tests: not a step).
  for (int r0 = 0; r0 < N; r0 += chunk_rows_) {
    const int rows = std::min(chunk_rows_, N - r0);
    be_.gemm(false, true, rows, V, d, 1.f, hf_ + size_t(r0) * d, d, head_->w, d, 0.f, logits_, V);
    be_.download(logits + size_t(r0) * V, logits_, sizeof(float) * size_t(rows) * V);
  }
}

}  // namespace ladder
