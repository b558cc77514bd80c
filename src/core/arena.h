// Arenas: one allocation sized once from the config; layers take views into it. The step loop
// never allocates.
#pragma once
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "core/error.h"

namespace ladder {

class Arena {
 public:
  static constexpr size_t kAlign = 64;
  Arena() = default;
  explicit Arena(size_t bytes) { reserve(bytes); }
  void reserve(size_t bytes) {
    cap_ = (bytes + kAlign - 1) / kAlign * kAlign;
    used_ = 0;
    void* p = cap_ ? std::aligned_alloc(kAlign, cap_) : nullptr;
    if (cap_ && !p) fail("out of memory: could not allocate an arena of {:.1f} MiB", cap_ / 1048576.0);
    if (p) std::memset(p, 0, cap_);
    mem_.reset(static_cast<std::byte*>(p));
  }
  template <class T = float>
  T* alloc(size_t n) {
    size_t bytes = (n * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    LADDER_ASSERT(used_ + bytes <= cap_);
    T* p = reinterpret_cast<T*>(mem_.get() + used_);
    used_ += bytes;
    return p;
  }
  static size_t padded(size_t n, size_t elem = sizeof(float)) { return (n * elem + kAlign - 1) / kAlign * kAlign; }
  void zero() { if (mem_) std::memset(mem_.get(), 0, cap_); }
  size_t capacity() const { return cap_; }
  size_t used() const { return used_; }
  std::byte* base() { return mem_.get(); }

 private:
  struct Free { void operator()(std::byte* p) const { std::free(p); } };
  std::unique_ptr<std::byte, Free> mem_;
  size_t cap_ = 0, used_ = 0;
};

}  // namespace ladder
