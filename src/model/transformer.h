// The dense decoder-only transformer (RECIPE.md section 2, dense baseline): token embedding;
// pre-norm blocks RMSNorm -> GQA attention (QK-norm, RoPE, causal, optional window) -> RMSNorm ->
// SwiGLU MLP; final RMSNorm; untied LM head; cross-entropy with optional final-logit z-loss.
// Recipe switches (off in the dense baseline): half-RoPE, non-parametric QK-norm with a query scale,
// long/short layers, partial key offset, XSA, per-head output gate, GatedNorm (see config.cpp).
//
// Memory is planned once: parameters, gradients and saved activations live in three arenas sized
// from the config and the micro-batch shape, all in the backend's memory (host memory for the CPU
// backend, device memory for CUDA). forward_backward() allocates nothing.
//
// Host or backend memory: Param::w / Param::g, buffers(), weights() and attention_keys() are
// pointers of the backend's memory (host code reads them with download() or Backend::download);
// token ids, targets and forward_logits()'s output are HOST memory, copied at the edges. Per
// forward_backward() / forward_loss() call the host waits once, for one download of the loss sums;
// an optimizer step's micro-batches (forward_backward_async) do not wait at all: their sums stay
// in backend memory until take_loss_sums(), after the step's optimizer update is enqueued.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/arena.h"
#include "core/error.h"
#include "model/config.h"
#include "model/moe.h"

namespace ladder {

// What a tensor is; optimizer groups are derived from it (RECIPE.md section 3).
enum class Role {
  Embedding,        // input token embedding
  AttnMatrix,       // q/k/v/o projections
  MlpMatrix,        // dense SwiGLU gate/up/down
  Head,             // LM head
  NormGain,         // RMSNorm / QK-norm gains (1-D)
  Router,           // MoE router d -> E (fp32)
  ExpertMatrix,     // routed expert gate/up/down, stored [E, out, in]: one matrix per expert
  SharedExpert,     // always-on shared expert gate/up/down
  AttnGate,         // per-head output gate W_g
  GatedNormMatrix,  // GatedNorm W_down / W_up
};
const char* role_name(Role r);

struct Param {
  std::string name;            // Hugging Face style, e.g. model.layers.3.self_attn.q_proj.weight
  Role role;
  std::vector<int64_t> shape;  // Linear weights are [out_features, in_features]; experts [E, out, in]
  size_t numel = 0;
  float* w = nullptr;          // weights (params arena; backend memory)
  float* g = nullptr;          // gradient (grads arena; backend memory)

  // A tensor not yet placed in an arena: numel from the shape, w and g null.
  static Param unplaced(std::string name, Role role, std::vector<int64_t> shape) {
    Param p;
    p.name = std::move(name);
    p.role = role;
    p.shape = std::move(shape);
    p.numel = 1;
    for (auto s : p.shape) p.numel *= size_t(s);
    return p;
  }
};

struct LossSums {
  double xent = 0, lse_sq = 0;  // sums over tokens
  // router z-loss term summed over tokens: router_z_loss / MoE layers * sum_l sum_i lse(s_il)^2,
  // so the training loss is (xent + z_loss * lse_sq + router_z) / tokens
  double router_z = 0;
  int64_t tokens = 0;
};

// Per MoE layer, since the last Transformer::take_moe_stats(): tokens per expert over the training
// forwards (min/max/mean over experts, each token counted K times) and mean logsumexp(s)^2.
struct MoeLayerStats {
  int layer = 0;
  double load_min = 0, load_max = 0, load_mean = 0;
  // 1 - (token-expert assignments counted) / (tokens x top_k): the fraction RECIPE.md asks to log.
  double dropped_frac = 0;
  double lse_sq = 0;
};

class Transformer {
 public:
  // `batch` sequences of cfg.seq_len tokens per forward pass.
  Transformer(const ModelConfig& cfg, int batch, Backend& be);
  ~Transformer();
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelConfig& config() const { return cfg_; }
  int batch() const { return B_; }
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  Param& param(const std::string& name);
  size_t num_params() const { return n_params_; }
  // The contiguous parameter arena (backend memory), for a data-parallel broadcast.
  float* weights() { return params_arena_.base() ? reinterpret_cast<float*>(params_arena_.base()) : nullptr; }
  // Its length in floats, alignment gaps included (a sharded optimizer's ranges cover it).
  size_t weights_floats() const { return params_arena_.used() / sizeof(float); }
  // The contiguous gradient arena (backend memory) and its length in floats, alignment gaps
  // included (zero_grad() zeroes them): what data-parallel ranks sum, in one call.
  float* grads_data() { return reinterpret_cast<float*>(grads_arena_.base()); }
  size_t grads_floats() const { return grads_arena_.used() / sizeof(float); }
  // The backend the model runs on; its memory holds every arena.
  Backend& backend() const { return be_; }
  // Host <-> backend copies of one tensor (a parameter's weights, or a buffer): `host` holds numel
  // floats. What checkpoints, tests and tools use instead of dereferencing Param::w.
  void download(const Param& p, float* host) const;
  void upload(const Param& p, const float* host);
  std::vector<float> download(const Param& p) const;
  std::vector<float> download_grad(const Param& p) const;

  // Truncated-normal init (std cfg.init_std or 0.5/sqrt(d), +-3 sigma) of every matrix and the
  // embedding; norm gains = 1. Each tensor's values depend only on (seed, tensor name): generated
  // on the host and uploaded, so every backend starts from bitwise the same weights.
  void init(uint64_t seed);
  void zero_grad();

  // Forward and backward of one micro-batch [batch, seq_len]. Gradients ACCUMULATE into the grads
  // arena, scaled by grad_scale (1 / total tokens of the optimizer step gives mean-loss gradients).
  // inputs / targets: HOST memory (copied into the model's own buffers in backend memory).
  // Waits once, at the end, for the loss sums; needs no forward_backward_async pending.
  LossSums forward_backward(const int32_t* inputs, const int32_t* targets, float grad_scale);
  // The same without a host wait: the micro-batch's loss sums stay in backend memory, one slot per
  // micro-batch, until take_loss_sums() downloads all of them at once (and returns them in call
  // order). reserve_step() sizes the slots; without it they grow, allocating, when more are pending.
  void forward_backward_async(const int32_t* inputs, const int32_t* targets, float grad_scale);
  std::vector<LossSums> take_loss_sums();
  // What an optimizer step of `micro_batches` training micro-batches keeps in backend memory, sized
  // once (a no-op when already that large): the loss-sum slots and the MoE balancing store of its
  // router values. train_step calls it (train() and the benchmark too, before the first step).
  void reserve_step(int micro_batches);
  // Forgets an aborted step: its pending loss sums and the MoE router values it stored for
  // balancing (train_step calls it when a micro-batch throws, e.g. on a bad token id, so the next
  // step starts clean; the load statistics keep the aborted tokens).
  void discard_step();
  // Forward only: loss sums (evaluation). Host inputs/targets.
  LossSums forward_loss(const int32_t* inputs, const int32_t* targets);
  // Forward only: writes all logits [batch*seq_len, vocab] to `logits`, HOST memory. On a host
  // backend the LM head writes there directly (no copy); otherwise row chunks are downloaded.
  void forward_logits(const int32_t* inputs, float* logits);

  // Global L2 norm of all gradients: one sum of squares per tensor into backend memory, ONE
  // download, summed on the host in parameter order (deterministic, and on the CPU bitwise the sum
  // of the per-tensor Backend::sum_squares values in that order). Needs every gradient whole (not
  // after a sharded optimizer's reduce-scatter: grad_clip_factor_async with a GradShard).
  double grad_norm();
  // Global-norm clipping without a host wait: the per-tensor sums as grad_norm(), then on the backend
  // norm = sqrt(sum), factor = norm > clip ? float(clip / (norm + 1e-6)) : 1 (clip <= 0: 1).
  // Returns the factor (backend memory) for Optimizer::step, whose updates read every gradient as
  // g * factor: the gradients themselves are not scaled (no pass over them; bitwise the same
  // update as scaling them first). last_grad_norm() reads the norm afterwards (one download, which
  // waits for everything enqueued before it: call it after the optimizer step).
  const float* grad_clip_factor_async(double clip);
  // The same with a sharded optimizer's gradients (OptimizerShards): after the ranks' reduce-scatter
  // each rank holds the summed gradients of its own tensors only (owner[i] == rank). Its per-tensor
  // sums cover those (the others count 0, exactly) and `sum_over_ranks` adds the ranks' sums (backend
  // memory, in place) before the total: every rank gets the doubles of an unsharded rank, so the
  // same norm and factor, bitwise.
  struct GradShard {
    const std::vector<int>* owner = nullptr;
    int rank = 0;
    std::function<void(double* sums, size_t n)> sum_over_ranks;
  };
  const float* grad_clip_factor_async(double clip, const GradShard& shard);
  double last_grad_norm();
  // The factor the last grad_clip_factor_async left (backend memory), without computing it again.
  const float* last_clip_factor() const;

  // Saved activations and backward scratch, fp32 and (model.saved_activations bf16) bf16.
  size_t activation_bytes() const { return acts_arena_.capacity() + packed_arena_.capacity(); }
  // The keys layer l's attention read in the last forward pass (after PKO, QK-norm and RoPE),
  // [batch*seq_len, KV*hd], backend memory; for tests and inspection. With model.recompute or
  // saved_activations bf16 the fp32 buffer is shared by the layers of one kind (the last one's).
  // Not with model.attn_bf16 (the keys are bf16 bits there; no caller needs them).
  const float* attention_keys(int l) const {
    LADDER_ASSERT(!cfg_.attn_bf16);
    return layers_.at(l).kr;
  }

  // Non-trained state saved with the weights (the MoE selection biases
  // model.layers.N.mlp.gate.e_score_correction_bias [E]): not in params(), no gradient, no
  // optimizer state. `g` is nullptr.
  std::vector<Param>& buffers() { return buffers_; }
  const std::vector<Param>& buffers() const { return buffers_; }

  // Quantile balancing of the MoE selection bias (RECIPE.md section 2), once per optimizer step,
  // from the tokens of every training forward since the previous update. balance_beta() returns
  // beta of every MoE layer ([n_moe_layers * E], empty when balancing is off); data-parallel ranks
  // average it, then apply_balance() sets bias = -(beta - mean(beta)) and forgets the tokens.
  // update_balance() is both without the host: beta and the bias computed in backend memory (the
  // training step's path; a data-parallel all-reduce of beta would run there, on the device).
  // The router values of those tokens stay in backend memory until then, in a store reserve_step()
  // sizes for a whole optimizer step. Without it the store holds one micro-batch and grows,
  // outside any planned step, when a caller runs more training forwards between updates.
  std::vector<double> balance_beta();
  void apply_balance(const std::vector<double>& beta);
  // `average`, when given, replaces beta (n doubles, backend memory) by its mean over the
  // data-parallel ranks before the bias is computed from it (RECIPE.md section 2).
  using BetaAverage = std::function<void(double* beta, size_t n)>;
  void update_balance(const BetaAverage& average = {});
  // Expert load and router z statistics per MoE layer since the previous call (resets them). The
  // load counts stay in backend memory between calls: one download here.
  // sum_over_ranks, when given, adds up the data-parallel ranks' counts (host doubles, in place).
  using HostSum = std::function<void(double* v, size_t n)>;
  std::vector<MoeLayerStats> take_moe_stats(const HostSum& sum_over_ranks = {});
  // model.moe_capacity: per MoE layer, the rows its last forward put past the capacity (the
  // overflow, ov[E] of its layout; one small download each; under model.recompute the layers share
  // their arrays, so one value, the last layer run). Empty without a capacity layout.
  // A diagnostic for benchmarks: how much of the expert work the batched GEMMs did not take.
  std::vector<int> capacity_overflow_rows() const;

 private:
  // GatedNorm after an RMSNorm: out = n * s, s = sigmoid(W_up silu(W_down n)), n the RMSNorm output.
  // All nullptr when model.gated_norm_rank is 0.
  struct GatedNormActs {
    Param *down = nullptr, *up = nullptr;  // [r, d], [d, r]
    float *n = nullptr, *u = nullptr, *a = nullptr, *s = nullptr;  // [N,d], [N,r], [N,r], [N,d]
  };
  struct Layer {
    Param *ln1, *wq, *wk, *wv, *wo, *qn, *kn, *ln2, *wg, *wu, *wd;
    // attention/norm recipe switches (nullptr when off)
    Param* wgate = nullptr;  // per-head output gate [H, d]
    GatedNormActs gn1, gn2;  // after input_layernorm / post_attention_layernorm
    int window = 0;          // 0: full causal (long layers)
    float* z = nullptr;      // XSA output [N,H*hd]
    float *ga = nullptr, *gf = nullptr, *og = nullptr;  // gate logits and factors [N,H], gated output
    const float* oin = nullptr;  // what o_proj reads: o, z or og (bf16 bits with model.attn_bf16)
    // saved activations
    float *x;            // block input (residual stream) [N,d]
    float *h1, *r1;      // ln1 out [N,d] (bf16 bits with model.norm_bf16), rstd [N]
    float *q, *k, *v;    // raw projections [N,H*hd], [N,KV*hd], [N,KV*hd]
    float *qr, *kr;      // after qk-norm and RoPE (attention inputs)
    float *qrs, *krs;    // qk-norm rstd [N*H], [N*KV]
    float *o, *lse;      // attention output [N,H*hd], lse [B,H,S]
    float *mid;          // x + attn [N,d]
    float *h2, *r2;      // ln2 out (bf16 bits with model.norm_bf16 in a dense layer), rstd
    // [N,I]; with model.mlp_bf16 they hold bf16 bits (uint16_t, in half the bytes: read via b16())
    float *gate, *up, *act;
    // MoE block (moe == true: wg/wu/wd are nullptr)
    bool moe = false;
    int moe_index = -1;  // among the MoE layers
    Param *router = nullptr, *eg = nullptr, *eu = nullptr, *ed = nullptr, *sg = nullptr, *su = nullptr, *sd = nullptr;
    Param* bias = nullptr;  // buffer
    MoeActs<float> ma;
    // model.saved_activations bf16: this layer's bf16 copy of each packable saved tensor; *fp32 is
    // the layer's pointer to it (into the set shared by its kind). Filled after the layer's
    // forward, unpacked before its backward.
    // gemm_only: the backward reads it only as a GEMM operand (wgrad_gemm), straight from the bf16
    // copy, so it is never unpacked.
    struct Packed { float** fp32; uint16_t* bf16; size_t n; bool gemm_only = false; };
    std::vector<Packed> packed;
  };

  // A saved tensor planned as bf16 (model.mlp_bf16's gate / up / act, model.attn_bf16's q, k, v,
  // qr, kr, o, z, og, model.norm_bf16's h1 and dense h2): its storage as bf16 bits.
  static uint16_t* b16(float* p) { return reinterpret_cast<uint16_t*>(p); }
  static const uint16_t* b16(const float* p) { return reinterpret_cast<const uint16_t*>(p); }
  void add_param(const std::string& name, Role role, std::vector<int64_t> shape);
  // Checks the host token ids and uploads them into ids_ (and, when given, targets into targets_).
  void upload_batch(const int32_t* inputs, const int32_t* targets);
  // Fills saved activations up to the final norm from ids_ (uploaded by the caller). training:
  // record MoE load and balancing data.
  void forward(bool training = false);
  // Layer l's block (norms, attention, MLP or MoE) from L.x; record: MoE load and balancing data.
  void layer_forward(size_t l, bool record, bool balance);
  // One micro-batch's slot of sums (downloaded to host memory) into a LossSums; training: adds the
  // router terms to the MoE statistics.
  LossSums parse_sums(const double* host, bool training);
  // forward_loss / forward_logits / forward_backward: no forward_backward_async may be pending.
  void check_no_pending(const char* call) const;
  // The two stores reserve_step() sizes (growth keeps the values already stored).
  void reserve_micro_batches(int n);
  void reserve_balance_tokens(int64_t tokens);
  // Quantile balancing halves: beta_ from the step's router values (false: nothing to balance),
  // and every MoE layer's bias from beta_, both on the backend.
  bool compute_beta();
  void bias_from_beta();
  MoeDims moe_dims() const;
  MoeWeights<float> moe_weights(const Layer& L) const;
  float* balance_vals(int moe_index);  // [balance_cap_, E] of MoE layer moe_index
  // Attention sublayer: L.mid = L.x + o_proj(attention(L.h1)); backward reads d(mid) from d_res_
  // and leaves d(h1) in d_h_ (overwritten), parameter gradients accumulated.
  void attn_forward(Layer& L);
  // model.attn_bf16's forward and backward of the same sublayer (the block's activations bf16).
  void attn_forward_bf16(Layer& L);
  void attn_backward_bf16(Layer& L);
  // The end of both backwards: d(h1) and the q/k/v/gate weight gradients.
  void input_projections_backward(Layer& L);
  // A weight gradient C += op(A) op(B) whose B is one of L's saved activations: from its bf16 copy
  // when it is kept gemm_only (Backend::gemm_b16), else the fp32 tensor. a_bf16: A holds bf16 bits
  // (model.mlp_bf16_grads' gate and up gradients), read by Backend::gemm_ex as they are.
  void wgrad_gemm(const Layer& L, bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B,
                  int ldb, float* C, int ldc, bool a_bf16 = false);
  // Whether X is one of L's block norm outputs kept in bf16 (model.norm_bf16: h1, and h2 of a
  // dense layer); such a tensor holds bf16 bits.
  bool norm_b16(const Layer& L, const float* X) const;
  // out[N, n] = X[N, d] W^T for X = L.h1 or L.h2 (read as bf16 where norm_b16), W [n, d]; out fp32
  // or, out_bf16, bf16 bits (the projections of model.attn_bf16 and model.mlp_bf16).
  void input_gemm(const Layer& L, const float* X, int n, const float* W, float* out, bool out_bf16);
  void attn_backward(Layer& L);
  // RMSNorm followed by GatedNorm when gn.down is set (model/attn_switches.cpp). Backward writes
  // (or adds, when accumulate_dx) d(x) into dx from dout.
  // out_bf16 (model.norm_bf16): out holds bf16 bits, the fp32 result rounded.
  void norm_forward(float* out, float* rstd, const float* x, const Param* gain, GatedNormActs& gn, bool out_bf16);
  void norm_backward(float* dx, const float* dout, const float* x, Param* gain, const float* rstd,
                     GatedNormActs& gn, bool accumulate_dx);
  // PKO reset flags from the token ids: position 0 of each sequence and every token after eod_id.
  void compute_resets();
  AttnShape attn_shape(int window) const;
  // The PKO reset flags when layer L shifts its keys (model.pko, long layers), else nullptr.
  const uint8_t* key_resets(const Layer& L) const;

  ModelConfig cfg_;
  int B_, S_, N_;
  Backend& be_;
  std::vector<Param> params_;
  size_t n_params_ = 0;
  Arena params_arena_, grads_arena_, acts_arena_, packed_arena_;
  std::vector<Layer> layers_;
  Param *embed_ = nullptr, *norm_f_ = nullptr, *head_ = nullptr;
  // activations of the final part and scratch for backward
  float *x_final_, *hf_, *rf_, *logits_;
  int chunk_rows_;
  float *d_res_, *d_h_, *d_q_, *d_k_, *d_v_, *d_qn_, *d_kn_, *d_o_, *d_gate_, *d_up_, *d_act_;
  // switch scratch (nullptr when unused)
  GatedNormActs gnf_;                         // GatedNorm after the final norm
  float *d_vx_ = nullptr, *d_ga_ = nullptr;   // XSA's d(v) [N,KV*hd]; gate logits' gradient [N,H]
  float *d_gn_ = nullptr, *d_gs_ = nullptr, *d_gr_ = nullptr;  // GatedNorm [N,d], [N,d], [N,r]
  // Small backend-memory arrays at the host edge (io_arena_): the micro-batch's token ids and
  // targets, PKO flags, the sums a forward downloads once, MoE load counts and quantile betas.
  Arena io_arena_;
  int32_t *ids_ = nullptr, *targets_ = nullptr;  // [N] each
  uint8_t* resets_ = nullptr;                    // PKO: [N] sequence/document starts
  // sums_arena_: sums_cap_ slots of n_sums_ doubles, one per pending micro-batch: [2 * chunks]
  // (xent, lse^2) per LM-head row chunk, then [n_moe] router sum of lse^2 per MoE layer. cur_sums_
  // is the slot the running forward writes; host_sums_ the host copy (sized with the slots).
  Arena sums_arena_;
  double* sums_ = nullptr;
  double* cur_sums_ = nullptr;
  size_t n_sums_ = 0;
  int sums_cap_ = 0, pending_ = 0;
  std::vector<double> host_sums_;
  int n_chunks_ = 0;
  double* gnorm_ = nullptr;  // [params] per-tensor gradient sums of squares (grad_norm)
  std::vector<double> host_gnorm_;
  std::vector<const float*> grad_ptrs_;  // the sum_squares_multi list: every gradient, parameter order
  std::vector<size_t> grad_numel_;
  std::vector<size_t> owned_numel_;  // GradShard: grad_numel_ where this rank owns the tensor, else 0
  std::vector<int> owned_by_;        // the owner list owned_numel_ was made from
  int owned_rank_ = -1;              // and the rank
  void grad_sums_async();  // gnorm_[i] = ||params_[i].g||^2
  Arena clip_arena_;          // grad_clip_factor_async: the norm and the clip factor (backend memory)
  double* clip_ = nullptr;
  // MoE state
  std::vector<Param> buffers_;
  Arena buffers_arena_;
  BackendOps ops_;
  MoeScratch<float> ms_;
  int n_moe_ = 0;
  std::vector<double> moe_lse_sq_;  // per MoE layer: sum of lse^2 of the last forward (host copy)
  int64_t* load_ = nullptr;         // [n_moe, E] tokens per expert since the last take_moe_stats
  std::vector<int64_t> host_load_;
  double* beta_ = nullptr;          // [n_moe, E] quantile-balancing beta
  Arena balance_arena_;             // per MoE layer [balance_cap_, E] of s - alpha (backend memory)
  int64_t balance_cap_ = 0, balance_tokens_ = 0;
  std::vector<double> stats_lse_sq_;
  int64_t stats_tokens_ = 0;
};

}  // namespace ladder
