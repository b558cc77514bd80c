// AdamW's default grouping and the gradient-norm helpers. The optimizers themselves (adamw, adam,
// adamh, muon, muonh) are in optimizers.cpp.
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

double grad_norm(Transformer& model, Backend& be) {
  LADDER_ASSERT(&be == &model.backend());
  return model.grad_norm();
}

void scale_grads(Transformer& model, Backend& be, float s) {
  for (auto& p : model.params()) be.scale_inplace(p.g, s, p.numel);
}

}  // namespace ladder
