// Optimizers over parameter groups. Groups are derived from each tensor's Role; the state lives in
// arenas laid out like the parameters so it checkpoints as whole buffers, and shards over
// data-parallel ranks by ranges of tensors (OptimizerShards).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/arena.h"
#include "model/config.h"
#include "model/transformer.h"

namespace ladder {

// At most this many groups (the CUDA backend's per-group scalars are kernel arguments:
// switch_optim_ops.cuh kOptMaxGroups, asserted equal there).
constexpr int kMaxOptimizerGroups = 32;

struct ParamGroup {
  // "matrices", "embedding", "norms" (adamw); else the optimizer's name (".embedding" for the
  // embedding); " x<factor>" for tensors with an optim.lr_mults factor
  std::string name;
  std::vector<Param*> params;
  double lr_mult = 1.0;
  double weight_decay = 0.0;
  std::string optimizer = "adamw";  // adamw | adam | adamh | muon | muonh (RECIPE.md section 3)
  double lr = 0;                    // peak learning rate before lr_mult and the schedule
  std::string lr_from;              // where lr came from, for --dry-run ("optim.lr", "auto: ...")
};

// A named state tensor for checkpoints (e.g. "exp_avg.model.norm.weight"). `data` is a pointer of
// the optimizer's memory() (the backend's): checkpoints copy it through host staging. With a sharded
// optimizer (OptimizerShards) every rank lists every tensor, in the same order; the ones another
// rank holds have data == nullptr and that rank as `owner`.
struct StateTensor {
  std::string name;
  std::vector<int64_t> shape;
  float* data;
  int owner = 0;
  size_t numel() const {
    size_t n = 1;
    for (int64_t d : shape) n *= size_t(d);
    return n;
  }
};

// ZeRO stage 1 (run.shard_optimizer, docs/data-parallel.md): each data-parallel rank keeps the
// optimizer state of, and updates, the tensors of one contiguous range of the parameter arena. The
// gradients are reduce-scattered (each rank gets the sum of its range only: Comm::reduce_scatter_
// ranges), the clip's per-tensor sums are each owner's, added over the ranks (so the norm is every
// rank's, bitwise), and after the update each range of weights is broadcast from its rank
// (Comm::allgather_ranges), which leaves every replica with the weights of an unsharded run
// (bitwise with 2 ranks on the CPU; with more, a reduce may add the ranks in another order). The
// ranges are cut at tensor boundaries so that the state's bytes are about equal (Muon's
// whole-matrix update needs whole tensors).
struct OptimizerShards {
  int rank = 0, world = 1;
  std::vector<int> owner;            // per model.params() index: the rank that updates it
  std::vector<size_t> offsets;       // world + 1 offsets (floats) into Transformer::weights(): rank r's
                                     // tensors lie in [offsets[r], offsets[r + 1])
  std::vector<size_t> grad_offsets;  // the same ranges of Transformer::grads_data()
};
OptimizerShards plan_optimizer_shards(const Config& cfg, Transformer& model, int rank, int world);

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update with peak-relative learning rate lr (schedule already applied) on the current grads,
  // each read as g * *grad_factor where grad_factor (backend memory) is given: the global clip
  // factor (Transformer::grad_clip_factor_async), applied without a pass over the gradients.
  virtual void step(double lr, const float* grad_factor = nullptr) = 0;
  virtual int64_t steps_taken() const = 0;
  virtual void set_steps_taken(int64_t t) = 0;
  virtual std::vector<StateTensor> state() = 0;
  virtual const std::vector<ParamGroup>& groups() const = 0;
  // Where the state tensors live (the backend's memory).
  virtual MemorySpace& memory() const = 0;
  // The ranks' shares of the update when sharded (ZeRO stage 1), else nullptr.
  virtual const OptimizerShards* shards() const { return nullptr; }
};

// Bytes of optimizer state this process holds (the tensors whose data it has).
size_t held_state_bytes(Optimizer& opt);

// What the recipe's `auto` learning rates are computed from (RECIPE.md section 3 heuristics).
struct RunShape {
  double total_tokens = 0;     // T: run.steps * tokens per step
  double tokens_per_step = 0;  // batch * grad_accum * seq_len * data-parallel ranks
  int d_model = 0;
};
// `world`: the data-parallel ranks (each reads batch_size sequences per micro-batch).
RunShape run_shape(const Config& cfg, int world = 1);
// RECIPE.md's fitted heuristics (fitted on their data; not laws for tiny models):
// adam_lr = 1.63 * T^-0.2813 * d^-0.3678 * sqrt(B), B = tokens per step / 4096.
double auto_adam_lr(const RunShape& rs);
// adamh_lr = 13/3 * adam_lr, capped at 0.05.
double adamh_lr_from_adam(double adam_lr);
// AdamH v16's beta2 = clip(0.999^(tokens per step / 131072), 0.95, 0.9999): 0.9999 up to ~13k tokens
// per step, 0.999 at 131k; rounded to 8 decimals. Ladder specs resolve `optim.beta2: auto` with it
// per rung (ladder/plan.cpp).
double recipe_beta2(double tokens_per_step);

// The parameters a selector (role:<role> or a name glob, as in optim.<opt>_params) picks, as
// indices into params. A role:<role> must name a role and a selector must match something (a typo
// would otherwise silently change nothing): errors name `key` and the selector.
std::vector<size_t> select_params(const std::string& key, const std::string& sel, const std::vector<Param>& params);

// The parameter groups of a config: the preset of optim.name (RECIPE.md section 3; table in
// docs/optimizers.md), then the tensors claimed by optim.<optimizer>_params moved. Bad input (a
// selector matching nothing, a tensor claimed twice, a vector in a Muon or hyperball group, an
// `auto` lr without a run shape) throws ladder::Error with one line naming the key.
std::vector<ParamGroup> plan_groups(const OptimConfig& oc, std::vector<Param>& params, const RunShape& rs);

// `auto` learning rates need the run's size, hence the Config overload; the OptimConfig one (kept
// for existing callers) rejects `auto` with a clear error.
std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& oc, Transformer& model, Backend& be);
// `shards`: this rank's share of a sharded optimizer (plan_optimizer_shards), or nullptr.
std::unique_ptr<Optimizer> make_optimizer(const Config& cfg, Transformer& model, Backend& be, int world = 1,
                                          const OptimizerShards* shards = nullptr);
std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& oc, std::vector<Param>& params, Backend& be,
                                          const RunShape& rs = {}, const OptimizerShards* shards = nullptr);

// `ladder train --dry-run`: every tensor with its role, shape, group, optimizer and peak learning
// rate, then the groups and the schedule. Builds the model's parameter list only (no training).
std::string dry_run_report(const Config& cfg, int world = 1);

// Global L2 norm of all gradients (deterministic): Transformer::grad_norm(), one host wait. `be` must
// be the model's backend.
double grad_norm(Transformer& model, Backend& be);
// Scales every gradient by s.
void scale_grads(Transformer& model, Backend& be, float s);

}  // namespace ladder
