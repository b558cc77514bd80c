// A Backend decorator that times every op (by op name and GEMM shape class), for `ladder bench
// --profile`: where a training step's time goes, measured, before optimizing. On the CPU the wall
// clock around each op; on a device the device's own clock (Backend::make_op_timer: events on its
// stream, no host wait per op, so the step runs as it would unprofiled).
#pragma once
#include <map>
#include <memory>
#include <string>

#include "backend/forwarding_backend.h"

namespace ladder {

struct OpTime {
  double seconds = 0;
  double flops = 0;  // for GEMMs
  long calls = 0;
};

class ProfilingBackend;
// Wraps `inner`; the returned backend forwards every op and records its time.
std::unique_ptr<ProfilingBackend> make_profiling_backend(std::unique_ptr<Backend> inner);

class ProfilingBackend : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  // Waits for the queued work on a device (its op times are read then).
  virtual const std::map<std::string, OpTime>& times() = 0;
  // The GEMMs again, one entry per op and shape ("gemm NT 16384x1024x1024 bf16,f32->f32"): which
  // call of a step is slow, where times() only says which kind. Read after times().
  virtual const std::map<std::string, OpTime>& shape_times() const = 0;
  virtual void reset() = 0;
};

}  // namespace ladder
