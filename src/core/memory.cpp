#include "core/memory.h"

#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace ladder {

namespace {

class HostMemory final : public MemorySpace {
 public:
  bool is_host() const override { return true; }
  void* mem_alloc(size_t bytes, const char* what) override {
    if (bytes == 0) return nullptr;
    const size_t cap = (bytes + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, cap);
    if (!p) fail("out of memory: could not allocate {:.1f} MiB for {}", cap / 1048576.0, what);
    std::memset(p, 0, cap);
    return p;
  }
  void mem_free(void* p) override { std::free(p); }
  void upload(void* dst, const void* src, size_t bytes) override { if (bytes) std::memcpy(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override { if (bytes) std::memcpy(dst, src, bytes); }
  void copy(void* dst, const void* src, size_t bytes) override { if (bytes && dst != src) std::memmove(dst, src, bytes); }
  void zero(void* p, size_t bytes) override { if (bytes) std::memset(p, 0, bytes); }
};

}  // namespace

MemorySpace& host_memory() {
  static HostMemory m;
  return m;
}

}  // namespace ladder
