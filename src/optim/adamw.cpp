// The gradient-norm helpers. The optimizers themselves (adamw, adam,
// adamh, muon, muonh) are in optimizers.cpp.
#include <cmath>

#include "core/error.h"
#include "optim/optimizer.h"

namespace ladder {

double grad_norm(Transformer& model, Backend& be) {
  LADDER_ASSERT(&be == &model.backend());
  return model.grad_norm();
}

void scale_grads(Transformer& model, Backend& be, float s) {
  for (auto& p : model.params()) be.scale_inplace(p.g, s, p.numel);
}

}  // namespace ladder
