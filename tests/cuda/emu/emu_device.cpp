// backend/device.cpp as the CUDA build compiles it (LADDER_HAVE_CUDA: make_cuda_backend comes from
// cuda_backend.cpp, run.device "cuda" probes the device). Linked into ladder_emu_backend_tests ahead
// of ladder_core, so the archive's CPU-only device.o (whose make_cuda_backend fails) is never pulled in.
#define LADDER_HAVE_CUDA 1
#include "backend/device.cpp"
