// Shared helpers for the tests: temporary directories and running the PyTorch reference.
#pragma once
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace ladder::test {

// A fresh directory under the system temp dir, removed when the object goes out of scope.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag) {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() / fmt::format("ladder-test-{}-{}-{}", tag, ::getpid(), counter++);
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    if (!std::getenv("LADDER_KEEP_TEST_DIRS")) std::filesystem::remove_all(path, ec);
  }
};

// Runs the independent PyTorch reference (tests/reference/run_ref.py) with Debian's python3.
inline int run_reference(const std::string& args) {
  std::string cmd = fmt::format("/usr/bin/python3 {}/tests/reference/run_ref.py {}", LADDER_SOURCE_DIR, args);
  return std::system(cmd.c_str());
}

// ||a - b|| / max(||b||, tiny)
template <class A, class B>
double rel_err(const A* a, const B* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

}  // namespace ladder::test
