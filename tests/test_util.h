// Shared helpers for the tests: temporary directories and running the PyTorch reference.
#pragma once
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <initializer_list>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/rng.h"
#include "data/prepare.h"

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

// A small synthetic corpus of word-salad documents (JSONL under dir/corpus.jsonl), tokenized with a
// 320-piece vocabulary into dir/data: the data set of the training and ladder tests.
inline void make_word_salad_data(const std::filesystem::path& dir, int n_docs, uint64_t seed) {
  const char* words[] = {"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "from",
                         "home", "while", "birds", "sang", "in", "tall", "green", "trees", "of", "old",
                         "forest", "river", "stone", "light", "came", "down", "over", "hills"};
  Philox r(seed, 0);
  {
    std::ofstream f(dir / "corpus.jsonl");
    for (int d = 0; d < n_docs; ++d) {
      std::string text;
      const int n = 20 + int(r.u64(uint64_t(d) * 1000) % 60);
      for (int w = 0; w < n; ++w) {
        text += words[r.u64(uint64_t(d) * 1000 + w + 1) % 30];
        text += (w % 9 == 8) ? ". " : " ";
      }
      f << nlohmann::json{{"text", text}}.dump() << "\n";
    }
  }
  data::PrepareOptions o;
  o.inputs = {dir / "corpus.jsonl"};
  o.out_dir = dir / "data";
  o.vocab_size = 320;
  o.val_fraction = 0.05;
  data::prepare_data(o);
}

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

// The message of the ladder::Error that fn() throws; a test failure when it throws none.
template <class Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const ladder::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an error";
  return "";
}

}  // namespace ladder::test

// Every one of the strings after `msg` is in it (an error message names the file, key, value...).
#define EXPECT_ERROR_HAS(msg, ...)                                                \
  do {                                                                            \
    const std::string m_ = (msg);                                                 \
    for (const std::string& n_ : std::initializer_list<std::string>{__VA_ARGS__})  \
      EXPECT_NE(m_.find(n_), std::string::npos) << n_ << " not in: " << m_;      \
  } while (0)
