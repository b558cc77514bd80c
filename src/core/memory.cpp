#include "core/memory.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include "core/error.h"

namespace ladder {

namespace {

// One number of bytes from a file such as memory.max; false when the file is missing or says "max".
bool read_bytes(const char* path, uint64_t& out) {
  std::ifstream f(path);
  std::string word;
  if (!(f >> word) || word == "max") return false;
  char* end = nullptr;
  out = std::strtoull(word.c_str(), &end, 10);
  return end && *end == '\0';
}

// The number after `key` on its line of a "key value [unit]" file (/proc/meminfo, memory.stat);
// nullopt when the file or the key is missing.
std::optional<uint64_t> stat_field(const char* path, std::string_view key) {
  std::ifstream f(path);
  std::string line, k;
  uint64_t v = 0;
  while (std::getline(f, line)) {
    std::istringstream in(line);
    if (in >> k >> v && k == key) return v;
  }
  return std::nullopt;
}

// Allocations under this size are not checked: they cannot decide whether a model fits, and the
// check reads files.
constexpr size_t kCheckFrom = size_t(64) << 20;

class HostMemory final : public MemorySpace {
 public:
  bool is_host() const override { return true; }
  size_t available_bytes() const override { return host_available_bytes(); }
  void* mem_alloc(size_t bytes, const char* what) override {
    if (bytes == 0) return nullptr;
    const size_t cap = (bytes + 255) / 256 * 256;
    // Linux hands out more than it has (overcommit): the memset below would then touch pages that
    // do not exist and the OOM killer would end the process without a word. Check first.
    const char* source = "";
    const size_t avail = cap >= kCheckFrom ? host_available_bytes(&source) : SIZE_MAX;
    if (cap > avail)
      fail("out of memory: {} needs {:.1f} MiB, {:.1f} MiB of host memory available ({})", what, cap / 1048576.0,
           avail / 1048576.0, source);
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

size_t host_available_bytes(const char** source) {
  const std::optional<uint64_t> avail_kib = stat_field("/proc/meminfo", "MemAvailable:");
  const uint64_t swap_kib = stat_field("/proc/meminfo", "SwapFree:").value_or(0);
  if (source) *source = "MemAvailable + SwapFree in /proc/meminfo";
  uint64_t avail = avail_kib ? (*avail_kib + swap_kib) * 1024 : UINT64_MAX;
  // A container's limit: cgroup v2 first, then v1 (whose "no limit" is a value near 2^63). Its
  // usage counts the page cache charged to it, which the kernel drops before it refuses memory: the
  // inactive file pages are taken off (after a build or a data preparation they can fill the limit).
  uint64_t limit = 0, usage = 0;
  const bool v2 = read_bytes("/sys/fs/cgroup/memory.max", limit) && read_bytes("/sys/fs/cgroup/memory.current", usage);
  const bool v1 = !v2 && read_bytes("/sys/fs/cgroup/memory/memory.limit_in_bytes", limit) &&
                  limit < (uint64_t(1) << 60) && read_bytes("/sys/fs/cgroup/memory/memory.usage_in_bytes", usage);
  if (v2 || v1) {
    const uint64_t cache = stat_field(v2 ? "/sys/fs/cgroup/memory.stat" : "/sys/fs/cgroup/memory/memory.stat",
                                      v2 ? "inactive_file" : "total_inactive_file")
                               .value_or(0);
    usage = usage > cache ? usage - cache : 0;
    const uint64_t left = limit > usage ? limit - usage : 0;
    if (left < avail) {
      avail = left;
      if (source) *source = "the cgroup's memory limit less its usage";
    }
  }
  return avail >= uint64_t(SIZE_MAX) ? SIZE_MAX : size_t(avail);
}

MemorySpace& host_memory() {
  static HostMemory m;
  return m;
}

}  // namespace ladder
