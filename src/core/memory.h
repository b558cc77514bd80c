// Where a tensor's bytes live. The CPU backend's memory is host memory; the CUDA backend's is device
// memory. Arenas take their one allocation from a MemorySpace, so the model code that carves views
// out of them is the same for every backend. Host code never dereferences a pointer of a space
// whose is_host() is false: it goes through upload / download.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace ladder {

class MemorySpace {
 public:
  virtual ~MemorySpace() = default;
  // True when pointers of this space are ordinary host pointers.
  virtual bool is_host() const = 0;
  // `bytes` zero-filled bytes, aligned to at least 256 bytes. `what` names the tensor in the error
  // (out of memory is one line: what, how much was asked for, how much is free).
  virtual void* mem_alloc(size_t bytes, const char* what) = 0;
  // About how many more bytes mem_alloc can hand out (SIZE_MAX when the space cannot tell): what
  // setup checks a model's size against before it builds anything (Transformer), so that a model
  // too large for the machine fails with one line instead of being killed by the kernel.
  virtual size_t available_bytes() const { return SIZE_MAX; }
  virtual void mem_free(void* p) = 0;
  // Host -> space, space -> host, within the space, zero fill. Ordered with the backend's ops;
  // download returns once the bytes are on the host (it waits for the ops before it).
  virtual void upload(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void download(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* p, size_t bytes) = 0;
  // Waits for every op enqueued so far (a no-op on the CPU).
  virtual void synchronize() {}
};

// Host memory (aligned_alloc, memcpy, memset): the CPU backend's space, and what tests use.
MemorySpace& host_memory();

// What host memory can still be allocated without the kernel's OOM killer: MemAvailable plus
// SwapFree (/proc/meminfo), capped by the cgroup's memory limit less its usage (cgroup v2
// memory.max, v1 memory.limit_in_bytes) where one is set. SIZE_MAX where /proc/meminfo is missing.
// `source` (optional) receives what the figure came from, for the error line.
size_t host_available_bytes(const char** source = nullptr);
// The cgroup part of it: the least (limit - usage + inactive page cache) over this process's
// memory cgroup and its ancestors, read under `sys_cgroup` (/sys/fs/cgroup) from the text of
// /proc/self/cgroup; v2 where the mount is unified, else v1's memory hierarchy. nullopt: no limit.
std::optional<uint64_t> cgroup_memory_left(const std::string& sys_cgroup, const std::string& self_cgroup);

}  // namespace ladder
