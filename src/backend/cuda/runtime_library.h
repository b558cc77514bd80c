// Libraries the CUDA backend loads at run time (cuDNN, NCCL), so that its binaries start where they
// are absent and say why a feature is off instead.
#pragma once
#include <string>

namespace ladder::cuda {

struct RuntimeLibrary {
  void* handle = nullptr;  // nullptr: not loaded, `error` says why
  std::string name;        // the file asked for
  std::string error;
};

// dlopen of the file the environment variable `env` names, else of `fallback` (found on the usual
// library path). A failure's error is one line naming the file, the loader's reason and `env`.
RuntimeLibrary open_runtime_library(const char* env, const char* fallback);

}  // namespace ladder::cuda
