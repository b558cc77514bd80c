// `ladder eval` (src/train/evaluate): a checkpoint's loss reproduces the val_loss its run logged,
// bits per byte count the text the targets stand for, and bad input is one error naming it.
#include "train/evaluate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "core/error.h"
#include "core/fileio.h"
#include "data/loader.h"
#include "data/tokenizer.h"
#include "test_util.h"
#include "tiny_training.h"

namespace fs = std::filesystem;

namespace ladder {
namespace {

class EvalTest : public ::testing::Test {
 protected:
  static inline test::TempDir* dir = nullptr;
  static void SetUpTestSuite() {
    dir = new test::TempDir("eval");
    test::make_word_salad_data(dir->path, 300, 11);
    Config c = test::tiny_train_config(dir->path);
    c.run.steps = 6;
    c.run.ckpt_every = 3;
    c.run.eval_every = 3;
    c.run.eval_batches = 3;
    test::train_quietly(c, dir->path / "run");
  }
  static void TearDownTestSuite() {
    delete dir;
    dir = nullptr;
  }
  // The run's logged validation losses by step.
  static std::map<int64_t, double> logged_val() {
    std::map<int64_t, double> v;
    std::ifstream f(dir->path / "run" / "metrics.jsonl");
    for (std::string line; std::getline(f, line);) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("val_loss")) v[j["step"].get<int64_t>()] = j["val_loss"].get<double>();
    }
    return v;
  }
};

TEST_F(EvalTest, ReproducesTheValLossTheRunLogged) {
  auto val = logged_val();
  ASSERT_EQ(val.size(), 2u);
  EvalOptions o;
  o.batches = 3;  // run.eval_batches; the run's batch size and data are the defaults
  // The step-3 checkpoint, and the run directory (its latest, step 6).
  EvalResult r3 = evaluate_checkpoint(dir->path / "run" / "checkpoints" / "step_00000003", o);
  EXPECT_EQ(r3.step, 3);
  EXPECT_EQ(r3.loss, val.at(3));
  EvalResult r6 = evaluate_checkpoint(dir->path / "run", o);
  EXPECT_EQ(r6.step, 6);
  EXPECT_EQ(r6.loss, val.at(6));
  EXPECT_EQ(r6.tokens, 3.0 * 4 * 32);
  EXPECT_EQ(r6.batch_size, 4);
  EXPECT_EQ(r6.data, dir->path / "data");
  // Every full batch by default; the train split on request (a different loss, more windows).
  EvalResult all = evaluate_checkpoint(dir->path / "run", EvalOptions{});
  EXPECT_EQ(all.batches, all.windows / 4);
  EXPECT_GE(all.batches, 3);
  EvalOptions tr;
  tr.split = "train";
  tr.batches = 2;
  EvalResult t = evaluate_checkpoint(dir->path / "run", tr);
  EXPECT_GT(t.windows, all.windows);
  EXPECT_NE(t.loss, r6.loss);
}

// A run asking for more validation batches than the split holds evaluates the split's full batches,
// each window once (it wrapped into the loader's next epoch and counted some windows twice before):
// its logged loss is `ladder eval`'s default, every full batch.
TEST_F(EvalTest, MoreEvalBatchesThanTheSplitHoldsReadEachWindowOnce) {
  Config c = test::tiny_train_config(dir->path);
  c.run.steps = 2;
  c.run.ckpt_every = 2;
  c.run.eval_every = 2;
  const EvalResult probe = evaluate_checkpoint(dir->path / "run", EvalOptions{});
  c.run.eval_batches = int(probe.batches) * 3 + 1;  // three epochs' worth and more
  const fs::path run = dir->path / "run-over";
  test::train_quietly(c, run);
  double logged = NAN;
  std::ifstream f(run / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss") && j["step"] == 2) logged = j["val_loss"].get<double>();
  }
  const EvalResult all = evaluate_checkpoint(run, EvalOptions{});
  EXPECT_EQ(all.step, 2);
  EXPECT_EQ(all.batches, probe.batches);
  EXPECT_EQ(all.loss, logged);
}

TEST_F(EvalTest, BitsPerByteCountTheTextTheTargetsStandFor) {
  const data::Tokenizer tok = data::Tokenizer::load(dir->path / "data" / "tokenizer.model");
  // Pieces with spaces, byte-fallback characters (none of these letters is in the word salad), new
  // lines: text_bytes summed over the ids is the text's length in bytes.
  for (std::string text : {"the cat sat on a mat", "  green  trees\n\nof old forest ", "na\xC3\xAFve caf\xC3\xA9 \xE6\xBC\xA2\xE5\xAD\x97!"}) {
    auto ids = tok.encode(text);
    size_t n = 0;
    for (int32_t id : ids) n += size_t(tok.text_bytes(id));
    EXPECT_EQ(n, text.size()) << text;
    EXPECT_EQ(tok.decode(ids), text);
  }
  EXPECT_EQ(tok.text_bytes(tok.eod_id()), 0);
  EvalOptions o;
  o.batches = 3;
  EvalResult r = evaluate_checkpoint(dir->path / "run", o);
  // The bytes evaluated are the decoded text of the same targets (ASCII word salad: no character
  // split between two windows), read here by a loader of the trainer's validation order.
  data::DataLoader loader(dir->path / "data", "val", 32, 4, data::kValidationSeed, /*shuffle=*/true);
  std::vector<int32_t> in(4 * 32), tg(4 * 32);
  double decoded = 0;
  for (int b = 0; b < 3; ++b) {
    loader.next(in.data(), tg.data());
    decoded += double(tok.decode(tg).size());
  }
  EXPECT_EQ(r.bytes, decoded);
  EXPECT_GT(r.bytes / r.tokens, 1.0);
  EXPECT_DOUBLE_EQ(r.bits_per_byte(), r.loss * r.tokens / (std::log(2.0) * r.bytes));
  EXPECT_DOUBLE_EQ(r.perplexity(), std::exp(r.loss));
}

TEST_F(EvalTest, BadInputIsOneErrorNamingIt) {
  auto expect_error = [](const EvalOptions& o, const fs::path& ckpt, const std::string& want) {
    try {
      evaluate_checkpoint(ckpt, o);
      ADD_FAILURE() << "no error; expected: " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  const fs::path run = dir->path / "run";
  EvalOptions o;
  o.split = "test";
  expect_error(o, run, "--split: 'test' (expected val or train)");
  o = {};
  o.batches = 100000;
  expect_error(o, run, "--batches 100000: the val split of");
  o = {};
  o.batch_size = 100000;
  expect_error(o, run, "fewer than one batch of 100000");
  o = {};
  o.data = (dir->path / "nowhere").string();
  expect_error(o, run, (dir->path / "nowhere").string() + ": data directory not found");
  expect_error({}, dir->path / "no-run",
               (dir->path / "no-run").string() +
                   ": not a checkpoint directory (no state.json) nor a run directory with checkpoints/step_*");
#ifndef LADDER_HAVE_CUDA
  o = {};
  o.device = "cuda";
  expect_error(o, run, "CUDA");  // this build has none: one line, before anything is loaded
#endif
  o = {};
  o.device = "tpu";
  expect_error(o, run, "--device: 'tpu' (expected cpu or cuda)");
  // Shards tokenized by another tokenizer (meta.json says so; its tokenizer.model removed).
  const fs::path other = dir->path / "other-data";
  fs::copy(dir->path / "data", other, fs::copy_options::recursive);
  fs::remove(other / "tokenizer.model");
  auto meta = nlohmann::json::parse(read_file(other / "meta.json"));
  meta["tokenizer_hash"] = meta["tokenizer_hash"].get<uint64_t>() ^ 1;
  write_file_atomic(other / "meta.json", meta.dump());
  o = {};
  o.data = other.string();
  expect_error(o, run, "tokenized with another tokenizer");
}

TEST_F(EvalTest, CommandLinePrintsTheSameNumbers) {
  const fs::path out = dir->path / "out", err = dir->path / "err";
  const std::string bin = fmt::format("{}/ladder", LADDER_BINARY_DIR);
  int rc = std::system(fmt::format("{} eval {} --batches 3 --json >{} 2>{}", bin, (dir->path / "run").string(),
                                   out.string(), err.string())
                           .c_str());
  ASSERT_EQ(rc, 0) << read_file(err);
  auto j = nlohmann::json::parse(read_file(out));
  EXPECT_EQ(j["loss"].get<double>(), logged_val().at(6));
  EXPECT_EQ(j["step"].get<int64_t>(), 6);
  for (const char* k : {"perplexity", "bits_per_byte", "tokens", "bytes", "windows"}) EXPECT_TRUE(j.contains(k)) << k;
  rc = std::system(fmt::format("{} eval {} --split test >{} 2>{}", bin, (dir->path / "run").string(), out.string(),
                               err.string())
                       .c_str());
  EXPECT_NE(rc, 0);
  EXPECT_NE(read_file(err).find("error: --split: 'test'"), std::string::npos) << read_file(err);
}

}  // namespace
}  // namespace ladder
