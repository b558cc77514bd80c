#include "backend/cuda/runtime_library.h"

#include <dlfcn.h>

#include <cstdlib>

#include "core/error.h"

namespace ladder::cuda {

RuntimeLibrary open_runtime_library(const char* env, const char* fallback) {
  RuntimeLibrary lib;
  const char* v = std::getenv(env);
  lib.name = v && *v ? v : fallback;
  dlerror();
  lib.handle = dlopen(lib.name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib.handle) {
    const char* e = dlerror();
    lib.error = fmt::format("cannot load {} ({}); {} names the library file", lib.name, e ? e : "?", env);
  }
  return lib;
}

}  // namespace ladder::cuda
