#include "backend/profiling_backend.h"

#include <chrono>

namespace ladder {
namespace {

class Profiler final : public ProfilingBackend {
 public:
  explicit Profiler(std::unique_ptr<Backend> b) : ProfilingBackend(std::move(b)), timer_(b_->make_op_timer()) {}
  const std::map<std::string, OpTime>& times() override {
    if (timer_)
      for (const auto& [key, s] : timer_->take_totals()) {
        // The timer's key is the op, or op + kSep + shape for the ops timed with their shape.
        const size_t sep = key.find(kSep);
        t_[key.substr(0, sep)].seconds += s;
        if (sep != std::string::npos) shapes_[key.substr(0, sep) + " " + key.substr(sep + 1)].seconds += s;
      }
    return t_;
  }
  const std::map<std::string, OpTime>& shape_times() const override { return shapes_; }
  void reset() override {
    if (timer_) timer_->take_totals();
    t_.clear();
    shapes_.clear();
  }
  std::string name() const override { return b_->name() + "+profile"; }

 protected:
  // The device's time of each op where the backend has a timer (events around it on its stream);
  // else the wall time, and on a device without a timer the op is only enqueued: time it to
  // completion (a sync per op).
  void around(const char* op, double flops, const std::function<void()>& f) override { time(op, nullptr, flops, f); }
  void around_shape(const char* op, const std::string& shape, double flops, const std::function<void()>& f) override {
    time(op, &shape, flops, f);
  }

 private:
  static constexpr char kSep = '\x1f';  // op / shape separator in the timer's keys (in neither)

  void time(const char* op, const std::string* shape, double flops, const std::function<void()>& f) {
    auto count = [&](double seconds) {
      for (OpTime* e : {&t_[op], shape ? &shapes_[std::string(op) + " " + *shape] : nullptr})
        if (e) e->seconds += seconds, e->flops += flops, e->calls++;
    };
    if (timer_) {
      timer_->begin();
      f();
      timer_->end(shape ? std::string(op) + kSep + *shape : std::string(op));
      count(0);  // the device time arrives in times()
      return;
    }
    const bool dev = !b_->is_host();
    if (dev) b_->synchronize();
    auto t0 = std::chrono::steady_clock::now();
    f();
    if (dev) b_->synchronize();
    count(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }

  std::map<std::string, OpTime> t_, shapes_;
  std::unique_ptr<OpTimer> timer_;
};

}  // namespace

std::unique_ptr<ProfilingBackend> make_profiling_backend(std::unique_ptr<Backend> inner) {
  return std::make_unique<Profiler>(std::move(inner));
}

}  // namespace ladder
