// Arenas: one allocation sized once from the config; layers take views into it. The step loop
// never allocates. The allocation comes from a MemorySpace (host memory by default, the device's
// for the CUDA backend), so views are pointers of that space.
#pragma once
#include <cstddef>
#include <utility>

#include "core/error.h"
#include "core/memory.h"

namespace ladder {

class Arena {
 public:
  static constexpr size_t kAlign = 64;
  Arena() = default;
  explicit Arena(size_t bytes, MemorySpace& space = host_memory(), const char* what = "arena") {
    reserve(bytes, space, what);
  }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  Arena(Arena&& o) noexcept { swap(o); }
  Arena& operator=(Arena&& o) noexcept {
    Arena t(std::move(o));
    swap(t);
    return *this;
  }
  ~Arena() { release(); }

  // Replaces the allocation with `bytes` zero-filled bytes of `space`.
  void reserve(size_t bytes, MemorySpace& space = host_memory(), const char* what = "arena") {
    release();
    space_ = &space;
    cap_ = (bytes + kAlign - 1) / kAlign * kAlign;
    used_ = 0;
    mem_ = cap_ ? static_cast<std::byte*>(space.mem_alloc(cap_, what)) : nullptr;
  }
  template <class T = float>
  T* alloc(size_t n) {
    size_t bytes = (n * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    LADDER_ASSERT(used_ + bytes <= cap_);
    T* p = reinterpret_cast<T*>(mem_ + used_);
    used_ += bytes;
    return p;
  }
  static size_t padded(size_t n, size_t elem = sizeof(float)) { return (n * elem + kAlign - 1) / kAlign * kAlign; }
  void zero() { if (mem_) space_->zero(mem_, cap_); }
  size_t capacity() const { return cap_; }
  size_t used() const { return used_; }
  std::byte* base() { return mem_; }
  MemorySpace& space() const { return space_ ? *space_ : host_memory(); }

 private:
  void release() {
    if (mem_) space_->mem_free(mem_);
    mem_ = nullptr;
    cap_ = used_ = 0;
  }
  void swap(Arena& o) noexcept {
    std::swap(space_, o.space_);
    std::swap(mem_, o.mem_);
    std::swap(cap_, o.cap_);
    std::swap(used_, o.used_);
  }
  MemorySpace* space_ = nullptr;
  std::byte* mem_ = nullptr;
  size_t cap_ = 0, used_ = 0;
};

}  // namespace ladder
