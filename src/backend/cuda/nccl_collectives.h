// NCCL collectives of the CUDA backend (nccl_collectives.cpp).
#pragma once
#include <cuda_runtime.h>

#include <memory>

#include "backend/backend.h"

namespace ladder::cuda {

// The data-parallel sums on `device`, ordered on `stream` (the backend's). Loading libnccl is
// deferred to the first question (unavailable()).
std::unique_ptr<DeviceCollectives> make_nccl_collectives(int device, cudaStream_t stream);

}  // namespace ladder::cuda
