// The code revision recorded in every result: generated at build time by cmake/revision.cmake.
#include "ladder_revision.h"
#include "ladder/store.h"

namespace ladder {
const char* code_revision() { return LADDER_REVISION; }
}  // namespace ladder
