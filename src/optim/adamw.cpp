// AdamW: bias-corrected Adam with decoupled weight decay (Loshchilov & Hutter), per group.
#include <cmath>

#include "core/error.h"
#include "optim/optimizer.h"

namespace ladder {

std::vector<ParamGroup> default_groups(std::vector<Param>& params, const OptimConfig& oc) {
  std::vector<ParamGroup> g(3);
  g[0].name = "matrices";
  g[0].weight_decay = oc.weight_decay;
  g[1].name = "embedding";
  g[1].lr_mult = oc.embed_lr_mult;
  g[2].name = "norms";
  for (auto& p : params) {
    switch (p.role) {
      case Role::AttnMatrix:
      case Role::MlpMatrix:
      case Role::Head:
      case Role::ExpertMatrix:
      case Role::SharedExpert:
      case Role::GatedNormMatrix: g[0].params.push_back(&p); break;
      case Role::Embedding: g[1].params.push_back(&p); break;
      case Role::NormGain:
      case Role::Router:
      case Role::AttnGate: g[2].params.push_back(&p); break;
    }
  }
  return g;
}

namespace {

class AdamW final : public Optimizer {
 public:
  AdamW(const OptimConfig& oc, Transformer& model, Backend& be) : oc_(oc), be_(be) {
    groups_ = default_groups(model.params(), oc);
    size_t bytes = 0;
    for (auto& p : model.params()) bytes += Arena::padded(p.numel);
    m_arena_.reserve(bytes);
    v_arena_.reserve(bytes);
    for (auto& p : model.params()) {
      Slot s{&p, m_arena_.alloc(p.numel), v_arena_.alloc(p.numel)};
      slots_.push_back(s);
    }
  }

  void step(double lr) override {
    ++t_;
    const double bc1 = 1.0 - std::pow(oc_.beta1, double(t_)), bc2 = 1.0 - std::pow(oc_.beta2, double(t_));
    for (auto& g : groups_) {
      for (Param* p : g.params) {
        Slot& s = slot(p);
        be_.adamw_update(p->w, p->g, s.m, s.v, p->numel, float(lr * g.lr_mult), float(oc_.beta1),
                         float(oc_.beta2), float(oc_.eps), float(g.weight_decay), float(bc1), float(bc2));
      }
    }
  }
  int64_t steps_taken() const override { return t_; }
  void set_steps_taken(int64_t t) override { t_ = t; }
  std::vector<StateTensor> state() override {
    std::vector<StateTensor> out;
    for (auto& s : slots_) out.push_back({"exp_avg." + s.p->name, s.p->shape, s.m});
    for (auto& s : slots_) out.push_back({"exp_avg_sq." + s.p->name, s.p->shape, s.v});
    return out;
  }
  const std::vector<ParamGroup>& groups() const override { return groups_; }

 private:
  struct Slot {
    Param* p;
    float *m, *v;
  };
  Slot& slot(Param* p) {
    for (auto& s : slots_)
      if (s.p == p) return s;
    LADDER_ASSERT(false);
  }
  OptimConfig oc_;
  Backend& be_;
  std::vector<ParamGroup> groups_;
  std::vector<Slot> slots_;
  Arena m_arena_, v_arena_;
  int64_t t_ = 0;
};

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& oc, Transformer& model, Backend& be) {
  if (oc.name == "adamw") return std::make_unique<AdamW>(oc, model, be);
  fail("optim.name: unknown optimizer '{}' (expected adamw)", oc.name);
}

double grad_norm(Transformer& model, Backend& be) {
  double s = 0;
  for (auto& p : model.params()) s += be.sum_squares(p.g, p.numel);
  return std::sqrt(s);
}

void scale_grads(Transformer& model, Backend& be, float s) {
  for (auto& p : model.params()) be.scale_inplace(p.g, s, p.numel);
}

}  // namespace ladder
