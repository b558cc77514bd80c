// Config input validation (src/model/config.cpp): bad input is an error that names the file or key
// and what was expected, never a value silently changed or a bare library exception.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <tuple>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fileio.h"
#include "model/config.h"
#include "train/checkpoint.h"
#include "train/sampler.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace ladder {
namespace {

// The message of the ladder::Error `fn` throws; a failure if it throws none (any other exception
// type escapes and fails the test too: users must never see a bare library error).
template <class Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an error";
  return "";
}

#define EXPECT_ERROR_HAS(msg, ...)                                                \
  do {                                                                            \
    const std::string m_ = (msg);                                                 \
    for (const std::string& n_ : std::initializer_list<std::string>{__VA_ARGS__})  \
      EXPECT_NE(m_.find(n_), std::string::npos) << n_ << " not in: " << m_;      \
  } while (0)

TEST(ConfigInput, IntegersAreReadExactlyAndRangeChecked) {
  test::TempDir d("cfg-int");
  const fs::path ok = d.path / "ok.yaml";
  write_file_atomic(ok, "model:\n  d_model: 64\n");
  // 4294967360 = 2^32 + 64: the old path through double wrapped it into an int 64.
  EXPECT_ERROR_HAS(error_of([&] { load_config(ok, {"model.d_model=4294967360"}); }), "--set", "model.d_model",
                   "an integer in [-2147483648, 2147483647]", "4294967360");
  EXPECT_ERROR_HAS(error_of([&] { load_config(ok, {"run.batch_size=4294967297"}); }), "run.batch_size", "[-2147483648");
  EXPECT_ERROR_HAS(error_of([&] { load_config(ok, {"model.n_layers=-4294967295"}); }), "model.n_layers");
  EXPECT_ERROR_HAS(error_of([&] { load_config(ok, {"run.steps=9223372036854775808"}); }), "run.steps",
                   "9223372036854775807]");
  EXPECT_ERROR_HAS(error_of([&] { load_config(ok, {"run.seed=-1"}); }), "run.seed", "[0, 18446744073709551615]");
  EXPECT_ERROR_HAS(error_of([&] { load_config(ok, {"run.seed=18446744073709551616"}); }), "run.seed");
  EXPECT_ERROR_HAS(error_of([&] { load_config(ok, {"model.d_model=64.5"}); }), "model.d_model", "integer");
  EXPECT_ERROR_HAS(error_of([&] { load_config(ok, {"model.d_model=1e400"}); }), "model.d_model", "integer");
  // In a file, the error names the line.
  const fs::path big = d.path / "big.yaml";
  write_file_atomic(big, "run:\n  steps: 10\nmodel:\n  d_model: 4294967360\n");
  EXPECT_ERROR_HAS(error_of([&] { load_config(big); }), "big.yaml:4", "model.d_model", "[-2147483648, 2147483647]");

  // Every digit of a seed past 2^53 is kept (double rounded 2^53 + 1 to 2^53), up to 2^64 - 1.
  EXPECT_EQ(load_config(ok, {"run.seed=9007199254740993"}).run.seed, (uint64_t(1) << 53) + 1);
  EXPECT_EQ(load_config(ok, {"run.seed=18446744073709551615"}).run.seed, std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(load_config(ok, {"run.steps=9223372036854775807"}).run.steps, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(load_config(ok, {"model.n_layers=-2147483648"}).model.n_layers, std::numeric_limits<int>::min());
  // Exact decimals stay accepted: step counts are written 1e6.
  EXPECT_EQ(load_config(ok, {"run.steps=1e6"}).run.steps, 1000000);
  EXPECT_EQ(load_config(ok, {"run.steps=2.5e3"}).run.steps, 2500);
  EXPECT_EQ(load_config(ok, {"model.d_model=128.0"}).model.d_model, 128);
  EXPECT_EQ(load_config(ok, {"run.seed=1.8446744073709551615e19"}).run.seed, std::numeric_limits<uint64_t>::max());
}

}  // namespace
}  // namespace ladder
