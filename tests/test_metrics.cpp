// Tests for src/train/metrics: the JSONL metrics writer and the progress-line formatting.
#include "train/metrics.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "core/fileio.h"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace ladder;

namespace {

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("ladder_metrics_{}_{}", ::getpid(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    path_ = dir_ / "metrics.jsonl";
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Every line must be a complete JSON object; returns them.
  std::vector<json> lines() const {
    std::string content = read_file(path_);
    EXPECT_TRUE(content.empty() || content.back() == '\n') << "file must end with a newline";
    std::vector<json> out;
    std::istringstream in(content);
    std::string line;
    while (std::getline(in, line)) {
      json j = json::parse(line, nullptr, false);
      EXPECT_FALSE(j.is_discarded()) << "not JSON: " << line;
      EXPECT_TRUE(j.is_object()) << line;
      out.push_back(j);
    }
    return out;
  }
  std::vector<int64_t> steps() const {
    std::vector<int64_t> out;
    for (const auto& j : lines())
      if (j.contains("step")) out.push_back(j["step"].get<int64_t>());
    return out;
  }

  fs::path dir_, path_;
};

}  // namespace

TEST_F(MetricsTest, OneJsonObjectPerLineVisibleImmediately) {
  MetricsWriter w(path_, /*append=*/false);
  w.write({{"event", "start"}, {"model", "tiny"}});
  for (int s = 1; s <= 5; ++s) w.write({{"step", s}, {"loss", 5.0 / s}, {"note", "multi\nline"}});
  // No close/sync yet: each line was flushed, so a reader (or a killed process) already sees it.
  auto ls = lines();
  ASSERT_EQ(ls.size(), 6u);
  EXPECT_EQ(ls[0]["event"], "start");
  EXPECT_EQ(ls[3]["step"], 3);
  EXPECT_DOUBLE_EQ(ls[3]["loss"].get<double>(), 5.0 / 3);
  EXPECT_EQ(ls[3]["note"], "multi\nline");  // embedded newline escaped, still one line
}

TEST_F(MetricsTest, NonFiniteAndBadUtf8DoNotBreakTheFile) {
  MetricsWriter w(path_, false, /*fsync_every_lines=*/1);
  w.write({{"step", 1}, {"loss", std::numeric_limits<double>::quiet_NaN()}});
  w.write({{"step", 2}, {"tag", std::string("bad\xff")}});
  auto ls = lines();
  ASSERT_EQ(ls.size(), 2u);
  EXPECT_TRUE(ls[0]["loss"].is_null());
  EXPECT_TRUE(ls[1]["tag"].is_string());
}

TEST_F(MetricsTest, RejectsNonObject) {
  MetricsWriter w(path_, false);
  EXPECT_THROW(w.write(json::array({1, 2})), Error);
  EXPECT_THROW(w.write(json(3)), Error);
}

TEST_F(MetricsTest, AppendVersusFresh) {
  { MetricsWriter w(path_, false); w.write({{"step", 1}}); }
  { MetricsWriter w(path_, true); w.write({{"step", 2}}); }
  EXPECT_EQ(steps(), (std::vector<int64_t>{1, 2}));
  { MetricsWriter w(path_, false); w.write({{"step", 9}}); }
  EXPECT_EQ(steps(), (std::vector<int64_t>{9}));
}

TEST_F(MetricsTest, OpenFailureNamesThePath) {
  const fs::path bad = dir_ / "missing_dir" / "m.jsonl";
  try {
    MetricsWriter w(bad, true);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(bad.string()), std::string::npos) << e.what();
  }
}

TEST_F(MetricsTest, TruncateAfterStepDropsLaterLines) {
  {
    MetricsWriter w(path_, false);
    w.write({{"event", "start"}});
    for (int s = 1; s <= 10; ++s) w.write({{"step", s}, {"loss", 1.0}});
    w.write({{"step", 10.0}, {"eval_loss", 2.0}});  // float step, also > 5
    w.write({{"step", "n/a"}});                      // non-numeric: kept
  }
  // Resume from a checkpoint at step 5: the dead run's steps 6..10 must go.
  MetricsWriter w(path_, true);
  w.truncate_after_step(5);
  EXPECT_EQ(lines().size(), 7u);  // start + 1..5 + "n/a"
  for (int s = 6; s <= 7; ++s) w.write({{"step", s}});
  auto ls = lines();
  ASSERT_EQ(ls.size(), 9u);
  EXPECT_EQ(ls[0]["event"], "start");
  EXPECT_EQ(ls[6]["step"], "n/a");
  std::vector<int64_t> numeric;
  for (const auto& j : ls)
    if (j.contains("step") && j["step"].is_number()) numeric.push_back(j["step"].get<int64_t>());
  EXPECT_EQ(numeric, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7}));
  // The rewrite is atomic: no temporary left next to the file.
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir_)) (void)e, ++n;
  EXPECT_EQ(n, 1);
}

TEST_F(MetricsTest, TruncateDropsTornTail) {
  {
    std::ofstream f(path_, std::ios::binary);
    f << R"({"step":1,"loss":3.5})" << "\n"
      << R"({"step":2,"loss":3.4})" << "\n"
      << "garbage\n"
      << R"({"step":3,"lo)";  // crash mid-line
  }
  MetricsWriter w(path_, true);
  w.truncate_after_step(100);
  w.write({{"step", 3}, {"loss", 3.3}});
  EXPECT_EQ(steps(), (std::vector<int64_t>{1, 2, 3}));
}

TEST_F(MetricsTest, TruncateNoopKeepsFile) {
  MetricsWriter w(path_, false);
  w.write({{"step", 1}});
  w.truncate_after_step(1);
  w.write({{"step", 2}});
  w.sync();
  EXPECT_EQ(steps(), (std::vector<int64_t>{1, 2}));
}

// read_metrics, the one reader: what the writer wrote comes back in order with its line numbers;
// blank lines are skipped; a live writer's unterminated, unparseable last line is left out.
TEST_F(MetricsTest, ReadSkipsBlankLinesAndATornLastLine) {
  {
    std::ofstream f(path_, std::ios::binary);
    f << R"({"step":1,"loss":3.5})" << "\n\n"
      << R"({"step":2,"val_loss":3.4})" << "\n"
      << R"({"step":3,"lo)";  // being written
  }
  std::vector<std::pair<long, int64_t>> got;
  read_metrics(path_, [&](long line, const json& j) { got.emplace_back(line, j["step"].get<int64_t>()); });
  EXPECT_EQ(got, (std::vector<std::pair<long, int64_t>>{{1, 1}, {3, 2}}));
}

// Anything else that is not one JSON object per line is an error naming file:line, never skipped
// (a ladder result built from a log with a hole in it would be silently wrong).
TEST_F(MetricsTest, ReadRejectsABadLineNamingIt) {
  const auto read_error = [&](const std::string& content) {
    {
      std::ofstream f(path_, std::ios::binary);
      f << content;
    }
    try {
      read_metrics(path_, [](long, const json&) {});
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string file = path_.string();
  EXPECT_EQ(read_error("{\"step\":1}\ngarbage\n{\"step\":2}\n"),
            file + ":2: not a JSON object (expected one metrics object per line, as `ladder train` writes)");
  // A terminated last line is complete: garbage there is not a torn write.
  EXPECT_NE(read_error("{\"step\":1}\n[1,2]\n").find(file + ":2: not a JSON object"), std::string::npos);
  EXPECT_NE(read_error("{\"step\":1}\n{\"step\":2,\n").find(file + ":2: not a JSON object"), std::string::npos);
  fs::remove(path_);
  try {
    read_metrics(path_, [](long, const json&) {});
    ADD_FAILURE() << "a missing file read without an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(file + ": cannot be read"), std::string::npos) << e.what();
  }
}

TEST(MetricsFormat, HumanCount) {
  EXPECT_EQ(human_count(0), "0");
  EXPECT_EQ(human_count(7), "7");
  EXPECT_EQ(human_count(12.5), "12.5");
  EXPECT_EQ(human_count(950), "950");
  EXPECT_EQ(human_count(1000), "1k");
  EXPECT_EQ(human_count(12345), "12.3k");
  EXPECT_EQ(human_count(45600), "45.6k");
  EXPECT_EQ(human_count(124e6), "124M");
  EXPECT_EQ(human_count(1.234e6), "1.23M");
  EXPECT_EQ(human_count(999.7e3), "1M");  // rounding carries into the next unit
  EXPECT_EQ(human_count(2.1e9), "2.1G");
  EXPECT_EQ(human_count(3.4e12), "3.4T");
  EXPECT_EQ(human_count(5e15), "5P");
  EXPECT_EQ(human_count(-1500), "-1.5k");
  EXPECT_EQ(human_count(0.5), "0.5");
  EXPECT_EQ(human_count(std::nan("")), "nan");
}

TEST(MetricsFormat, Duration) {
  EXPECT_EQ(format_duration(0), "0s");
  EXPECT_EQ(format_duration(45.2), "45s");
  EXPECT_EQ(format_duration(59.6), "1m00s");
  EXPECT_EQ(format_duration(192), "3m12s");
  EXPECT_EQ(format_duration(3600), "1h00m00s");
  EXPECT_EQ(format_duration(7507), "2h05m07s");
  EXPECT_EQ(format_duration(3 * 86400 + 4 * 3600 + 10 * 60 + 5), "3d04h10m");
  EXPECT_EQ(format_duration(-1), "--");
  EXPECT_EQ(format_duration(std::numeric_limits<double>::infinity()), "--");
  EXPECT_EQ(format_duration(std::nan("")), "--");
}

TEST(MetricsFormat, ProgressLine) {
  ProgressInfo p;
  p.step = 120;
  p.total_steps = 2000;
  p.loss = 4.23151;
  p.lr = 3e-4;
  p.grad_norm = 0.8412;
  p.tokens_per_s = 12345;
  p.mfu = 0.612;
  p.elapsed_s = 30;
  p.eta_s = 192;
  EXPECT_EQ(format_progress(p),
            "step  120/2000 | loss 4.2315 | lr 3.00e-04 | gnorm 0.84 | 12.3k tok/s | MFU 61.2% | ETA 3m12s");

  // Unknown MFU is omitted; a negative ETA is derived from the mean step time so far;
  // extra goes at the end.
  p.mfu = -1;
  p.eta_s = -1;
  p.step = 100;
  p.total_steps = 200;
  p.elapsed_s = 60;
  p.tokens_per_s = 2.5e6;
  p.extra = "val 3.91";
  std::string s = format_progress(p);
  EXPECT_EQ(s.find("MFU"), std::string::npos) << s;
  EXPECT_NE(s.find("step 100/200"), std::string::npos) << s;
  EXPECT_NE(s.find("2.5M tok/s"), std::string::npos) << s;
  EXPECT_NE(s.find("| ETA 1m00s | val 3.91"), std::string::npos) << s;
  EXPECT_EQ(s.substr(s.size() - 8), "val 3.91");

  // Nothing to estimate from yet.
  p.step = 0;
  p.elapsed_s = 0;
  p.extra.clear();
  s = format_progress(p);
  EXPECT_NE(s.find("ETA --"), std::string::npos) << s;
  EXPECT_NE(s.find("step   0/200"), std::string::npos) << s;
}
