// Optimizers over parameter groups. Groups are derived from each tensor's Role; the state lives in
// arenas laid out like the parameters so it checkpoints (and, later, shards) as whole buffers.
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

struct ParamGroup {
  std::string name;  // "matrices", "embedding", "norms"
  std::vector<Param*> params;
  double lr_mult = 1.0;
  double weight_decay = 0.0;
};

// Default AdamW grouping: matrices (attention, MLP, LM head) decay; embeddings and norm gains do not.
std::vector<ParamGroup> default_groups(std::vector<Param>& params, const OptimConfig& oc);

// A named state tensor for checkpoints (e.g. "exp_avg.model.norm.weight").
struct StateTensor {
  std::string name;
  std::vector<int64_t> shape;
  float* data;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update with peak-relative learning rate lr (schedule already applied) on the current grads.
  virtual void step(double lr) = 0;
  virtual int64_t steps_taken() const = 0;
  virtual void set_steps_taken(int64_t t) = 0;
  virtual std::vector<StateTensor> state() = 0;
  virtual const std::vector<ParamGroup>& groups() const = 0;
};

std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& oc, Transformer& model, Backend& be);

// Global L2 norm of all gradients (deterministic).
double grad_norm(Transformer& model, Backend& be);
// Scales every gradient by s.
void scale_grads(Transformer& model, Backend& be, float s);

}  // namespace ladder
