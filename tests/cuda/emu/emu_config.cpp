// model/config.cpp as the CUDA build compiles it (LADDER_HAVE_CUDA: run.device "cuda" is accepted),
// for ladder_emu_backend_tests; linked ahead of ladder_core like emu_device.cpp, so the archive's
// CPU-only config.o is never pulled in.
#define LADDER_HAVE_CUDA 1
#include "model/config.cpp"
