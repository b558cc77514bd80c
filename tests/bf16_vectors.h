// bf16 round trips of host vectors for the tests: to_b16 rounds to nearest even (the CPU reference,
// cpu::f32_to_bf16), widen is exact.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/cpu/kernels.h"

namespace ladder::test {

inline std::vector<uint16_t> to_b16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  cpu::f32_to_bf16(b.data(), x.data(), x.size());
  return b;
}
inline std::vector<float> widen(const std::vector<uint16_t>& b) {
  std::vector<float> x(b.size());
  cpu::bf16_to_f32(x.data(), b.data(), b.size());
  return x;
}

}  // namespace ladder::test
