// CUB's DeviceRadixSort::SortPairs for the host emulation (tests/cuda/emu): a stable sort of the
// pairs by the key bits [begin_bit, end_bit), with CUB's two-call protocol (a null temp pointer asks
// for the temp size). The temp storage is really used (overwritten whole), so a caller that carves
// less than it asked for, or carves it over another buffer, is caught by ASan or by wrong results.
#pragma once
#include <algorithm>
#include <numeric>
#include <vector>

#include "../../emu_cuda.h"

namespace cub {
struct DeviceRadixSort {
  template <class K, class V>
  static cudaError_t SortPairs(void* temp, size_t& temp_bytes, const K* keys_in, K* keys_out, const V* values_in,
                               V* values_out, int n, int begin_bit = 0, int end_bit = int(sizeof(K) * 8),
                               cudaStream_t = nullptr, bool = false) {
    static_assert(std::is_unsigned_v<K>, "the emulation sorts unsigned keys only");
    const size_t need = size_t(n > 0 ? n : 0) * (sizeof(K) + sizeof(V)) + 256;
    if (!temp) {
      temp_bytes = need;
      return cudaSuccess;
    }
    if (temp_bytes < need || n < 0) return cudaErrorInvalidValue;
    const int bits = end_bit - begin_bit;
    const K mask = bits >= int(sizeof(K) * 8) ? K(~K(0)) : K((K(1) << bits) - 1);
    auto key = [&](int i) { return K((keys_in[i] >> begin_bit) & mask); };
    std::vector<int> idx(size_t(n > 0 ? n : 0));
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return key(a) < key(b); });
    // Stage the sorted pairs in the temp storage, then copy out: every byte of it is used.
    std::memset(temp, 0xFF, temp_bytes);
    K* tk = static_cast<K*>(temp);
    V* tv = reinterpret_cast<V*>(tk + n);
    for (int i = 0; i < n; ++i) {
      tk[i] = keys_in[idx[i]];
      tv[i] = values_in[idx[i]];
    }
    std::memcpy(keys_out, tk, sizeof(K) * size_t(n));
    std::memcpy(values_out, tv, sizeof(V) * size_t(n));
    return cudaSuccess;
  }
};
}  // namespace cub
