#include "backend/profiling_backend.h"

#include <chrono>

namespace ladder {
namespace {

class Profiler final : public ProfilingBackend {
 public:
  explicit Profiler(std::unique_ptr<Backend> b) : ProfilingBackend(std::move(b)), timer_(b_->make_op_timer()) {}
  const std::map<std::string, OpTime>& times() override {
    if (timer_)
      for (const auto& [op, s] : timer_->take_totals()) t_[op].seconds += s;
    return t_;
  }
  void reset() override {
    if (timer_) timer_->take_totals();
    t_.clear();
  }
  std::string name() const override { return b_->name() + "+profile"; }

 protected:
  // The device's time of each op where the backend has a timer (events around it on its stream);
  // else the wall time, and on a device without a timer the op is only enqueued: time it to
  // completion (a sync per op).
  void around(const char* op, double flops, const std::function<void()>& f) override {
    if (timer_) {
      timer_->begin();
      f();
      timer_->end(op);
      auto& e = t_[op];
      e.flops += flops;
      e.calls++;
      return;
    }
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
  std::unique_ptr<OpTimer> timer_;
};

}  // namespace

std::unique_ptr<ProfilingBackend> make_profiling_backend(std::unique_ptr<Backend> inner) {
  return std::make_unique<Profiler>(std::move(inner));
}

}  // namespace ladder
