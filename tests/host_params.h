// A parameter list in host memory for the optimizer tests (no model): tensors added by name, role
// and shape, then carved out of one weight and one gradient vector and filled with N(0, 0.2^2)
// weights (norm gains 1). What the CPU backend's optimizers read, with every role one chooses.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/rng.h"
#include "model/transformer.h"

namespace ladder::test {

struct HostParams {
  std::vector<Param> params;
  std::vector<float> w, g;

  void add(const std::string& name, Role role, std::vector<int64_t> shape) {
    params.push_back(Param::unplaced(name, role, std::move(shape)));
  }
  // After the last add(): weights and gradients, seeded by (seed, stream).
  void carve(uint64_t seed, const std::string& stream) {
    size_t n = 0;
    for (auto& p : params) n += p.numel;
    w.resize(n);
    g.resize(n);
    size_t off = 0;
    for (auto& p : params) {
      p.w = w.data() + off;
      p.g = g.data() + off;
      off += p.numel;
    }
    Philox r(seed, stream_id(stream));
    for (size_t i = 0; i < n; ++i) w[i] = float(0.2 * r.normal(i));
    for (auto& p : params)
      if (p.role == Role::NormGain) std::fill(p.w, p.w + p.numel, 1.0f);
  }
};

}  // namespace ladder::test
