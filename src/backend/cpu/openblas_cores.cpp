#include "backend/cpu/openblas_cores.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

extern "C" char* openblas_get_corename(void);

namespace ladder {

CpuVectorIsa cpu_vector_isa() {
  CpuVectorIsa isa;
#if defined(__x86_64__)
  __builtin_cpu_init();
  isa.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  isa.avx512 = isa.avx2_fma && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#endif
  return isa;
}

std::string better_openblas_core(const std::string& detected, const CpuVectorIsa& isa) {
  std::string d = detected;
  std::transform(d.begin(), d.end(), d.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  // OpenBLAS's names of x86 cores without AVX2 kernels: what it falls back to for a CPU it does not
  // know (Prescott), and older generations. A CPU that has AVX2 was misread if it got one of these.
  static const char* generic[] = {"prescott", "core2",    "penryn",  "dunnington", "nehalem", "atom",
                                  "sandybridge", "katmai", "coppermine", "northwood", "banias", "unknown", ""};
  if (std::find(std::begin(generic), std::end(generic), d) == std::end(generic)) return "";
  if (isa.avx512) return "SkylakeX";
  if (isa.avx2_fma) return "Haswell";
  return "";
}

std::string openblas_core() {
  const char* c = openblas_get_corename();
  return c ? c : "";
}

void ensure_openblas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE")) return;
  if (const char* k = std::getenv("LADDER_OPENBLAS_CORETYPE"); k && std::strcmp(k, "keep") == 0) return;
  const std::string detected = openblas_core();
  const std::string better = better_openblas_core(detected, cpu_vector_isa());
  if (better.empty()) return;
  // The program's own file: /proc/self/exe resolved (under valgrind the link itself names the
  // tool, but readlink is answered with the program). Not when the program was started through the
  // dynamic loader or a valgrind tool: restarting that file would not run the program.
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  std::string why;
  if (n <= 0) {
    why = std::string("cannot read /proc/self/exe: ") + std::strerror(errno);
  } else {
    self[n] = '\0';
    const char* base = std::strrchr(self, '/');
    base = base ? base + 1 : self;
    if (std::strncmp(base, "ld-", 3) == 0 || std::strstr(base, "valgrind") || std::strstr(base, "memcheck")) {
      why = std::string("the process is ") + self + ", not the program";
    } else {
      setenv("OPENBLAS_CORETYPE", better.c_str(), 1);
      setenv("LADDER_OPENBLAS_DETECTED", detected.c_str(), 1);  // what OpenBLAS chose itself, for the tests
      execv(self, argv);
      why = std::string("exec: ") + std::strerror(errno);
    }
  }
  std::fprintf(stderr,
               "ladder: OpenBLAS chose its generic %s kernels on this CPU and the restart with "
               "OPENBLAS_CORETYPE=%s did not happen (%s): CPU GEMMs run several times slower; set it yourself\n",
               detected.c_str(), better.c_str(), why.c_str());
}

}  // namespace ladder
