// Emulated device memory, for testing on a machine without a GPU that the code above the backend
// never dereferences a backend pointer on the host (it must go through upload / download / copy).
//
// GuardedBackend runs the CPU kernels, but its memory is not host memory: every allocation is its
// own mmap region, kept PROT_NONE except while one of the backend's own ops runs. A host-side read
// or write of backend memory anywhere else faults at once; the handler names the address and
// prints a backtrace before aborting, so the test fails at the offending line instead of passing on
// a CPU and crashing on a GPU. Results are bit-identical to the plain CPU backend's (same kernels).
#pragma once
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>

#include "backend/backend.h"
#include "backend/forwarding_backend.h"
#include "core/error.h"

namespace ladder::testing_support {

class GuardedBackend : public ForwardingBackend {
 public:
  explicit GuardedBackend(int threads = 0) : ForwardingBackend(make_cpu_backend(threads)) { install_handler(); }
  ~GuardedBackend() override {
    for (auto& [p, len] : regions_) munmap(p, len);
  }
  std::string name() const override { return "cpu-guarded"; }
  bool is_host() const override { return false; }

  void* mem_alloc(size_t bytes, const char* what) override {
    if (bytes == 0) return nullptr;
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    const size_t len = (bytes + page - 1) / page * page;
    void* p = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);  // zero-filled
    if (p == MAP_FAILED) fail("guarded backend: cannot map {} bytes for {}", bytes, what);
    regions_[p] = len;
    if (unlocked_) mprotect(p, len, PROT_READ | PROT_WRITE);
    return p;
  }
  void mem_free(void* p) override {
    if (!p) return;
    auto it = regions_.find(p);
    LADDER_ASSERT(it != regions_.end());
    munmap(it->first, it->second);
    regions_.erase(it);
  }
  // How many ops ran: a test can check the model really went through this backend.
  long ops() const { return ops_; }

 protected:
  void around(const char*, double, const std::function<void()>& f) override {
    // Ops do not nest (ForwardingBackend calls the inner CPU backend directly), but stay safe if one does.
    const bool outer = !unlocked_;
    if (outer) protect(PROT_READ | PROT_WRITE);
    ++ops_;
    f();
    if (outer) protect(PROT_NONE);
  }

 private:
  void protect(int prot) {
    for (auto& [p, len] : regions_) mprotect(p, len, prot);
    unlocked_ = prot != PROT_NONE;
  }
  static void on_fault(int, siginfo_t* info, void*) {
    char msg[160];
    const int n = std::snprintf(msg, sizeof msg,
                                "\nGuardedBackend: host code touched backend (emulated device) memory at %p "
                                "outside a backend op. Backtrace:\n",
                                info->si_addr);
    if (n > 0) (void)!write(STDERR_FILENO, msg, size_t(n));
    void* frames[48];
    const int k = backtrace(frames, 48);
    backtrace_symbols_fd(frames, k, STDERR_FILENO);
    std::abort();
  }
  static void install_handler() {
    struct sigaction sa {};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, nullptr);
  }

  std::map<void*, size_t> regions_;
  bool unlocked_ = false;
  long ops_ = 0;
};

}  // namespace ladder::testing_support
