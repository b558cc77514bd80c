// run.device handling shared by the CPU-only and the CUDA builds.
#include "backend/backend.h"
#include "core/error.h"

namespace ladder {

#ifndef LADDER_HAVE_CUDA
std::unique_ptr<Backend> make_cuda_backend(bool) {
  fail("--device cuda: this build has no CUDA backend (configure with -DLADDER_CUDA=ON; it needs nvcc and a GPU "
       "of compute capability 8.0 or newer)");
}
#endif

void check_run_device(const std::string& device) {
  if (device == "cpu") return;
  if (device != "cuda") fail("run.device '{}' is not known (expected cpu or cuda)", device);
  auto be = make_cuda_backend();  // fails with its own line when there is no usable GPU
  fail("run.device cuda: the CUDA backend is built and the GPU is usable, but the model does not run on device "
       "memory yet (issue 6, docs/cuda.md: model integration); use run.device cpu for now");
}

}  // namespace ladder
