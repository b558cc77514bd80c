// The code revision recorded in every result: generated at build time by cmake/revision.cmake.
#include <fmt/format.h>

#include <array>
#include <cstdio>
#include <string>

#include "core/fileio.h"
#include "ladder_revision.h"
#include "ladder/store.h"

namespace ladder {

const char* code_revision() { return LADDER_REVISION; }

std::string source_tree_revision(const std::string& dir) {
  // The same command as cmake/revision.cmake, so that the two compare as equal when nothing changed.
  const std::string cmd = fmt::format("git -C {} describe --always --dirty --tags 2>/dev/null", shell_quote(dir));
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return "";
  std::string out;
  std::array<char, 256> buf{};
  while (fgets(buf.data(), int(buf.size()), p)) out += buf.data();
  if (pclose(p) != 0) return "";
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r' || out.back() == ' ')) out.pop_back();
  return out;
}

std::string revision_warning(const std::string& binary, const std::string& tree) {
  const std::string dirty = "-dirty";
  if (binary.size() > dirty.size() && binary.compare(binary.size() - dirty.size(), dirty.size(), dirty) == 0)
    return fmt::format("warning: this ladder was built from uncommitted changes ({}): every run trained now records "
                       "that revision, which no commit reproduces; commit and rebuild first unless this is a trial",
                       binary);
  if (!tree.empty() && binary != "unknown" && tree != binary)
    return fmt::format("warning: this ladder was built at {}, but its source tree ({}) is now at {}: a stale build "
                       "trains with the old code (and records {}); rebuild (cmake --build) unless that is meant",
                       binary, LADDER_SOURCE_DIR, tree, binary);
  return "";
}

}  // namespace ladder
