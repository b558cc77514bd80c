// Counter-based randomness (Philox4x32-10). A random number is a pure function of
// (seed, stream, counter): initialization, data order and sampling come out identical across
// thread counts, backends and resumes, and no RNG state needs to be checkpointed.
#pragma once
#include <array>
#include <cmath>
#include <cstdint>
#include <string_view>

namespace ladder {

inline std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    uint64_t p0 = uint64_t(M0) * ctr[0], p1 = uint64_t(M1) * ctr[2];
    ctr = {uint32_t(p1 >> 32) ^ ctr[1] ^ key[0], uint32_t(p1), uint32_t(p0 >> 32) ^ ctr[3] ^ key[1],
           uint32_t(p0)};
    key[0] += W0;
    key[1] += W1;
  }
  return ctr;
}

// 64-bit FNV-1a, to derive a stream id from a name (e.g. a tensor name).
inline uint64_t stream_id(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

class Philox {
 public:
  Philox(uint64_t seed, uint64_t stream) : key_{uint32_t(seed), uint32_t(seed >> 32)}, stream_(stream) {}
  // Four 32-bit words for block `i`.
  std::array<uint32_t, 4> block(uint64_t i) const {
    return philox4x32({uint32_t(i), uint32_t(i >> 32), uint32_t(stream_), uint32_t(stream_ >> 32)}, key_);
  }
  uint64_t u64(uint64_t i) const {
    auto b = block(i);
    return (uint64_t(b[0]) << 32) | b[1];
  }
  // Uniform in (0, 1), open at both ends.
  double uniform(uint64_t i) const { return (double(u64(i) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  // Standard normal via Box-Muller from one block.
  double normal(uint64_t i) const {
    auto b = block(i);
    double u1 = (double((uint64_t(b[0]) << 21) ^ b[1]) + 0.5) / 9007199254740992.0;
    double u2 = (double((uint64_t(b[2]) << 21) ^ b[3]) + 0.5) / 9007199254740992.0;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // Normal truncated to [-3, 3] (resampled, counters offset by a stride so element i is still a
  // pure function of i).
  double trunc_normal(uint64_t i) const {
    for (uint64_t t = 0;; ++t) {
      double z = normal(i + t * 0x100000000000ull);
      if (std::fabs(z) <= 3.0) return z;
    }
  }

 private:
  std::array<uint32_t, 2> key_;
  uint64_t stream_;
};

}  // namespace ladder
