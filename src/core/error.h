// Errors: one exception type whose message is the single line a user sees.
#pragma once
#include <fmt/format.h>
#include <stdexcept>
#include <string>

namespace ladder {

// Thrown for every user-facing error (bad config, data, checkpoint, flags). The CLI prints
// "error: <what()>" and exits non-zero. Messages name the file/field and what was expected.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class... Args>
[[noreturn]] inline void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace ladder

// Internal invariant (a bug in Ladder, not bad input).
#define LADDER_ASSERT(cond)                                                                     \
  do {                                                                                          \
    if (!(cond)) ::ladder::fail("internal error: {} ({}:{})", #cond, __FILE__, __LINE__);       \
  } while (0)
