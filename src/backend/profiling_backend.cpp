#include "backend/profiling_backend.h"

#include <chrono>

namespace ladder {
namespace {

class Profiler final : public ProfilingBackend {
 public:
  explicit Profiler(std::unique_ptr<Backend> b) : ProfilingBackend(std::move(b)) {}
  const std::map<std::string, OpTime>& times() const override { return t_; }
  void reset() override { t_.clear(); }
  std::string name() const override { return b_->name() + "+profile"; }

 protected:
  // Wall time of each op. On a device the op is only enqueued: time it to completion (the sync per
  // op is the price of a per-op profile; the step's own timing never pays it).
  void around(const char* op, double flops, const std::function<void()>& f) override {
    const bool dev = !b_->is_host();
    if (dev) b_->synchronize();
    auto t0 = std::chrono::steady_clock::now();
    f();
    if (dev) b_->synchronize();
    auto& e = t_[op];
    e.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    e.flops += flops;
    e.calls++;
  }

 private:
  std::map<std::string, OpTime> t_;
};

}  // namespace

std::unique_ptr<ProfilingBackend> make_profiling_backend(std::unique_ptr<Backend> inner) {
  return std::make_unique<Profiler>(std::move(inner));
}

}  // namespace ladder
