#include "core/memory.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
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

std::optional<uint64_t> cgroup_memory_left(const std::string& sys_cgroup, const std::string& self_cgroup) {
  namespace fs = std::filesystem;
  // This process's cgroup, per hierarchy: "0::/path" (v2) or "N:...memory...:/path" (v1).
  std::string v2_path, v1_path;
  bool have_v2 = false, have_v1 = false;
  std::istringstream lines(self_cgroup);
  for (std::string line; std::getline(lines, line);) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string id = line.substr(0, a), ctrls = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (id == "0" && ctrls.empty()) have_v2 = true, v2_path = path;
    std::istringstream cs(ctrls);
    for (std::string c; std::getline(cs, c, ',');)
      if (c == "memory") have_v1 = true, v1_path = path;
  }
  // The limit that binds is the tightest of this cgroup's and its ancestors' (each level's limit
  // less its usage, the inactive page cache not counted: the kernel drops it before it refuses
  // memory). The walk goes from the process's own directory up to the mount's root; levels missing
  // from this mount (a cgroup namespace shows its own cgroup as the root) are skipped.
  const bool v1 = !(have_v2 && fs::exists(fs::path(sys_cgroup) / "cgroup.controllers"));
  const fs::path root = v1 ? fs::path(sys_cgroup) / "memory" : fs::path(sys_cgroup);
  const std::string rel = v1 ? (have_v1 ? v1_path : std::string()) : v2_path;
  const char* max_file = v1 ? "memory.limit_in_bytes" : "memory.max";
  const char* cur_file = v1 ? "memory.usage_in_bytes" : "memory.current";
  const char* cache_key = v1 ? "total_inactive_file" : "inactive_file";
  // The process's directory under the mount: its path normalized, without a trailing slash; a
  // path outside the mount (a namespace's view of a cgroup above its root) starts at the root.
  fs::path rel_norm = fs::path(rel).relative_path().lexically_normal();
  if (!rel_norm.empty() && rel_norm.filename().empty()) rel_norm = rel_norm.parent_path();
  const bool at_root = rel_norm.empty() || rel_norm == "." || *rel_norm.begin() == "..";
  std::optional<uint64_t> left;
  for (fs::path dir = at_root ? root : root / rel_norm;; dir = dir.parent_path()) {
    uint64_t limit = 0, usage = 0;
    if (read_bytes((dir / max_file).c_str(), limit) && limit < (uint64_t(1) << 60) &&  // v1's "none": ~2^63
        read_bytes((dir / cur_file).c_str(), usage)) {
      const uint64_t cache = stat_field((dir / "memory.stat").c_str(), cache_key).value_or(0);
      usage = usage > cache ? usage - cache : 0;
      const uint64_t l = limit > usage ? limit - usage : 0;
      if (!left || l < *left) left = l;
    }
    if (dir == root || dir == dir.parent_path()) break;  // below the root by construction: its parents lead there
  }
  return left;
}

size_t host_available_bytes(const char** source) {
  const std::optional<uint64_t> avail_kib = stat_field("/proc/meminfo", "MemAvailable:");
  const uint64_t swap_kib = stat_field("/proc/meminfo", "SwapFree:").value_or(0);
  if (source) *source = "MemAvailable + SwapFree in /proc/meminfo";
  uint64_t avail = avail_kib ? (*avail_kib + swap_kib) * 1024 : UINT64_MAX;
  // A container's or a job's limit (cgroup v2 memory.max, v1 memory.limit_in_bytes), at this
  // process's own cgroup and above (a batch scheduler's job cgroup sits below the mount's root).
  std::ifstream f("/proc/self/cgroup");
  std::stringstream self;
  self << f.rdbuf();
  const std::optional<uint64_t> left = cgroup_memory_left("/sys/fs/cgroup", self.str());
  if (left && *left < avail) {
    avail = *left;
    if (source) *source = "the cgroup's memory limit less its usage";
  }
  return avail >= uint64_t(SIZE_MAX) ? SIZE_MAX : size_t(avail);
}

MemorySpace& host_memory() {
  static HostMemory m;
  return m;
}

}  // namespace ladder
