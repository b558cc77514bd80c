// Training loop, checkpoints, resume, config handling and the CLI's error lines.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "data/prepare.h"
#include "model/flops.h"
#include "optim/schedule.h"
#include "train/checkpoint.h"
#include "train/sampler.h"
#include "train/trainer.h"
#include "test_util.h"
#include "tiny_training.h"

namespace fs = std::filesystem;

namespace ladder {
namespace {

// A small synthetic corpus of word-salad documents, tokenized once for the whole suite.
class TrainTest : public ::testing::Test {
 protected:
  static inline test::TempDir* dir = nullptr;
  static void SetUpTestSuite() {
    dir = new test::TempDir("train");
    test::make_word_salad_data(dir->path, 400, 5);
  }
  static void TearDownTestSuite() {
    delete dir;
    dir = nullptr;
  }
  static Config tiny() { return test::tiny_train_config(dir->path); }
  static TrainSummary run(const Config& c, const fs::path& run_dir, bool resume = false, int64_t stop_after = -1) {
    return test::train_quietly(c, run_dir, resume, stop_after);
  }
};

TEST_F(TrainTest, ResumeGivesBitIdenticalLosses) {
  Config c = tiny();
  fs::path a = dir->path / "run-a", b = dir->path / "run-b";
  TrainSummary full = run(c, a);
  ASSERT_EQ(full.losses.size(), 12u);
  TrainSummary first = run(c, b, false, 10);  // "killed" after step 10; newest checkpoint is step 8
  ASSERT_EQ(first.end_step, 10);
  TrainSummary rest = run(c, b, true);
  ASSERT_EQ(rest.start_step, 8);
  ASSERT_EQ(rest.losses.size(), 4u);
  for (size_t i = 0; i < rest.losses.size(); ++i) {
    EXPECT_EQ(rest.losses[i].first, full.losses[8 + i].first);
    EXPECT_EQ(rest.losses[i].second, full.losses[8 + i].second) << "step " << rest.losses[i].first;  // bit for bit
  }
  ASSERT_FALSE(rest.val_losses.empty());
  EXPECT_EQ(rest.val_losses.back().second, full.val_losses.back().second);
  // Same final weights, byte for byte.
  EXPECT_EQ(read_file(checkpoint_dir(a, 12) / "model.safetensors"), read_file(checkpoint_dir(b, 12) / "model.safetensors"));
  // metrics.jsonl of the resumed run holds each training step once.
  std::ifstream m(b / "metrics.jsonl");
  std::string line;
  std::vector<int64_t> steps;
  while (std::getline(m, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) steps.push_back(j["step"].get<int64_t>());
  }
  ASSERT_EQ(steps.size(), 12u);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(steps[i], i + 1);
}

// The MuonH recipe (momentum buffers, Adam moments, hyperball radii) resumes bit for bit too.
TEST_F(TrainTest, MuonHResumeGivesBitIdenticalLosses) {
  Config c = tiny();
  c.optim.name = "muonh";
  c.optim.adam_lr = "0.005";
  c.optim.adamh_lr = c.optim.muonh_lr = "0.02";
  c.optim.clip = 0;
  c.schedule.warmup = 0.01;
  c.schedule.final_lr_frac = 0.05;
  c.run.steps = 8;
  c.run.eval_every = 0;
  fs::path a = dir->path / "run-muonh-a", b = dir->path / "run-muonh-b";
  TrainSummary full = run(c, a);
  ASSERT_EQ(full.losses.size(), 8u);
  EXPECT_LT(full.losses.back().second, full.losses.front().second);
  run(c, b, false, 5);  // "killed" after step 5; newest checkpoint is step 4
  TrainSummary rest = run(c, b, true);
  ASSERT_EQ(rest.start_step, 4);
  ASSERT_EQ(rest.losses.size(), 4u);
  for (size_t i = 0; i < rest.losses.size(); ++i)
    EXPECT_EQ(rest.losses[i].second, full.losses[4 + i].second) << "step " << rest.losses[i].first;
  EXPECT_EQ(read_file(checkpoint_dir(a, 8) / "model.safetensors"), read_file(checkpoint_dir(b, 8) / "model.safetensors"));
  EXPECT_EQ(read_file(checkpoint_dir(a, 8) / "optimizer.safetensors"),
            read_file(checkpoint_dir(b, 8) / "optimizer.safetensors"));
  // The radii are in the checkpoint, and the weights are on their spheres.
  auto opt = SafeTensors::open(checkpoint_dir(a, 8) / "optimizer.safetensors");
  auto w = SafeTensors::open(checkpoint_dir(a, 8) / "model.safetensors");
  for (const char* n : {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"}) {
    ASSERT_TRUE(opt.has(std::string("radius.") + n)) << n;
    const float R = opt.get_f32(std::string("radius.") + n)[0];
    double ss = 0;
    for (float x : w.get_f32(n)) ss += double(x) * x;
    EXPECT_NEAR(std::sqrt(ss), R, 1e-5 * R) << n;
  }
  EXPECT_TRUE(opt.has("momentum.model.layers.0.self_attn.q_proj.weight"));
  EXPECT_TRUE(opt.has("exp_avg.model.embed_tokens.weight"));
}

TEST_F(TrainTest, LossFallsAndMetricsHaveTheFields) {
  Config c = tiny();
  c.run.steps = 40;
  c.run.ckpt_every = 0;
  c.run.eval_every = 0;
  fs::path r = dir->path / "run-fall";
  TrainSummary s = run(c, r);
  ASSERT_EQ(s.losses.size(), 40u);
  double first = s.losses[0].second, last = s.losses.back().second;
  EXPECT_GT(first, std::log(320.0) - 1.0);  // starts near uniform
  EXPECT_LT(last, first - 1.0);             // and learns
  std::ifstream m(r / "metrics.jsonl");
  std::string line;
  int train_lines = 0, val_lines = 0;
  while (std::getline(m, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) {
      ++train_lines;
      for (auto k : {"step", "loss", "lr", "tokens_per_s", "mfu", "grad_norm"}) EXPECT_TRUE(j.contains(k)) << k;
    }
    if (j.contains("val_loss")) ++val_lines;
  }
  EXPECT_EQ(train_lines, 40);
  EXPECT_EQ(val_lines, 1);
  // The final checkpoint samples text.
  SampleOptions so;
  so.prompt = "the cat";
  so.max_tokens = 10;
  so.temperature = 0;
  std::string out = sample_text(r, so);
  EXPECT_EQ(out.rfind("the cat", 0), 0u) << out;
  EXPECT_GT(out.size(), std::string("the cat").size());
  EXPECT_EQ(out, sample_text(r, so));  // greedy is deterministic
}

// A model.vocab_size padded past the tokenizer's (allowed: the rows are never targets) must not
// sample the padding ids, which the tokenizer cannot decode. After two steps the logits are near
// uniform, so the full distribution would pick a padding id (2/3 of them) almost every token.
TEST_F(TrainTest, SamplingNeverPicksAnIdPastTheTokenizer) {
  Config c = tiny();
  c.model.vocab_size = 3 * 320;
  c.run.steps = 2;
  c.run.eval_every = 0;
  fs::path r = dir->path / "run-padded-vocab";
  run(c, r);
  SampleOptions so;
  so.prompt = "the cat";
  so.max_tokens = 12;
  so.temperature = 1;
  for (int top_k : {0, 2000}) {
    so.top_k = top_k;
    for (uint64_t seed = 1; seed <= 4; ++seed) {
      so.seed = seed;
      std::string out;
      ASSERT_NO_THROW(out = sample_text(r, so)) << "top_k " << top_k << " seed " << seed;
      EXPECT_EQ(out.rfind("the cat", 0), 0u) << out;
    }
  }
}

// `ladder train` stopped by a signal writes its checkpoint and exits 130, not 0: a job script or a
// scheduler's requeue logic must not take a preempted run for a finished one. The signal is sent
// once the run has logged a step (its handler is installed by then), so the stop is the graceful one.
TEST_F(TrainTest, CliExitsNonZeroWhenASignalStopsTheRun) {
  Config c = tiny();
  c.run.steps = 1000000;
  c.run.ckpt_every = 0;
  c.run.eval_every = 0;
  const fs::path cfg = dir->path / "long.yaml", r = dir->path / "run-signal";
  write_file_atomic(cfg, to_yaml(c));
  const std::string script = fmt::format(
      "{}/ladder train {} --run-dir {} >{} 2>&1 & p=$!; "
      "for i in $(seq 600); do [ -s {} ] && break; sleep 0.1; done; kill -INT $p; "
      // bounded: a run that ignored the signal is killed (status 137) instead of hanging the suite
      "for i in $(seq 1200); do kill -0 $p 2>/dev/null || break; sleep 0.1; done; kill -KILL $p 2>/dev/null; "
      "wait $p; exit $?",
      LADDER_BINARY_DIR, cfg.string(), r.string(), (dir->path / "signal.out").string(), (r / "metrics.jsonl").string());
  const int rc = std::system(fmt::format("bash -c '{}'", script).c_str());
  ASSERT_TRUE(WIFEXITED(rc));
  const std::string out = read_file(dir->path / "signal.out");
  EXPECT_EQ(WEXITSTATUS(rc), 130) << out;
  EXPECT_NE(out.find("interrupted: checkpoint written at step"), std::string::npos) << out;
  EXPECT_NE(out.find("stopped: "), std::string::npos) << out;
  EXPECT_TRUE(latest_checkpoint(r).has_value());
}

TEST_F(TrainTest, RefusesToOverwriteARunWithoutResume) {
  Config c = tiny();
  c.run.steps = 2;
  fs::path r = dir->path / "run-over";
  run(c, r);
  std::string before = read_file(checkpoint_dir(r, 2) / "model.safetensors");
  EXPECT_THROW(run(c, r), Error);
  EXPECT_EQ(before, read_file(checkpoint_dir(r, 2) / "model.safetensors"));
}

TEST_F(TrainTest, ResumeRefusesAChangedModel) {
  Config c = tiny();
  c.run.steps = 8;
  fs::path r = dir->path / "run-changed";
  run(c, r, false, 6);  // killed after step 6; checkpoint at step 4
  ASSERT_TRUE(latest_checkpoint(r).has_value());
  c.model.d_model = 64;
  try {
    run(c, r, true);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.d_model"), std::string::npos) << e.what();
  }
}

TEST_F(TrainTest, CorruptCheckpointsGiveClearErrors) {
  Config c = tiny();
  c.run.steps = 2;
  fs::path r = dir->path / "run-corrupt";
  run(c, r);
  fs::path ck = checkpoint_dir(r, 2);
  c.run.steps = 4;
  // truncated weights
  std::string w = read_file(ck / "model.safetensors");
  write_file_atomic(ck / "model.safetensors", w.substr(0, w.size() / 2));
  try {
    run(c, r, true);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors"), std::string::npos) << e.what();
  }
  write_file_atomic(ck / "model.safetensors", w);
  write_file_atomic(ck / "state.json", "{ not json");
  try {
    run(c, r, true);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("state.json"), std::string::npos) << e.what();
  }
}

TEST(Config, ErrorsNameTheFileAndField) {
  test::TempDir d("cfg");
  auto write = [&](const std::string& name, const std::string& text) {
    write_file_atomic(d.path / name, text);
    return d.path / name;
  };
  auto expect_error = [](auto fn, std::vector<std::string> needles) {
    try {
      fn();
      FAIL() << "expected an error mentioning " << needles[0];
    } catch (const Error& e) {
      for (auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
  };
  auto bad_yaml = write("bad.yaml", "model:\n  d_model: [1, 2\n");
  expect_error([&] { load_config(bad_yaml); }, {"bad.yaml", "malformed YAML"});
  auto unknown = write("unknown.yaml", "model:\n  d_model: 64\n  n_layer: 2\n");
  expect_error([&] { load_config(unknown); }, {"unknown.yaml:3", "model.n_layer"});
  auto typed = write("typed.yaml", "model:\n  d_model: wide\n");
  expect_error([&] { load_config(typed); }, {"typed.yaml:2", "model.d_model", "integer"});
  auto heads = write("heads.yaml", "model:\n  d_model: 100\n  n_heads: 3\n");
  expect_error([&] { validate(load_config(heads)); }, {"heads.yaml", "model.n_heads"});
  auto kv = write("kv.yaml", "model:\n  d_model: 64\n  n_heads: 4\n  n_kv_heads: 3\n");
  expect_error([&] { validate(load_config(kv)); }, {"kv.yaml", "model.n_kv_heads"});
  auto ok = write("ok.yaml", "model:\n  d_model: 64\n");
  expect_error([&] { load_config(ok, {"model.nope=3"}); }, {"model.nope"});
  expect_error([&] { load_config(ok, {"model.d_model"}); }, {"key.path=value"});
  Config c = load_config(ok, {"model.n_layers=7", "optim.lr=1e-3", "model.qk_norm=false"});
  EXPECT_EQ(c.model.d_model, 64);
  EXPECT_EQ(c.model.n_layers, 7);
  EXPECT_DOUBLE_EQ(c.optim.lr, 1e-3);
  EXPECT_FALSE(c.model.qk_norm);
  // The resolved config round-trips through YAML.
  auto again = write("again.yaml", to_yaml(c));
  EXPECT_EQ(to_json(load_config(again)), to_json(c));
}

// docs/config.md is generated from the schema (`ladder config-doc > docs/config.md`), the one
// source of truth for the config keys: a key added without regenerating it fails here.
TEST(Config, DocsConfigMdIsTheSchemasMarkdown) {
  std::ifstream f(std::string(LADDER_SOURCE_DIR) + "/docs/config.md");
  ASSERT_TRUE(f) << "docs/config.md not found";
  std::stringstream doc;
  doc << f.rdbuf();
  EXPECT_EQ(doc.str(), schema_markdown())
      << "docs/config.md is stale: run ./build/ladder config-doc > docs/config.md";
}

TEST(Flops, MatchRecipeSection4ByHand) {
  ModelConfig m;
  m.vocab_size = 1000;
  m.d_model = 64;
  m.n_layers = 3;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.head_dim = 16;
  m.d_ff = 256;
  m.seq_len = 128;
  auto f = flops_per_token(m);
  // per layer: 2*64*(64 + 2*32) + 2*64*64 = 16384 + 8192 = 24576; attention 128*(4*64 + 3*4) = 34304;
  // MLP 6*64*256 = 98304; head 2*64*1000 = 128000.
  EXPECT_DOUBLE_EQ(f.forward(false), 3 * (24576.0 + 34304.0 + 98304.0));
  EXPECT_DOUBLE_EQ(f.forward(true), 3 * (24576.0 + 34304.0 + 98304.0) + 128000.0);
  EXPECT_DOUBLE_EQ(f.train(true), 3 * f.forward(true));
  EXPECT_DOUBLE_EQ(run_compute(m, 1e6), 3 * f.forward(false) * 1e6);
}

TEST(Schedule, WarmupThenDecayByHand) {
  ScheduleConfig s;
  s.type = "linear";
  s.warmup = 10;
  s.final_lr_frac = 0.1;
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 0, 110), 0.1);
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 9, 110), 1.0);
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 10, 110), 1.0);
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 60, 110), 0.1 + 0.9 * 0.5);
  s.type = "cosine";
  EXPECT_NEAR(lr_multiplier(s, 60, 110), 0.1 + 0.9 * 0.5, 1e-12);
  EXPECT_NEAR(lr_multiplier(s, 35, 110), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-12);
  s.type = "wsd";
  s.decay_frac = 0.2;  // decay over the last 22 steps
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 80, 110), 1.0);
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 99, 110), 0.1 + 0.9 * (1 - 11.0 / 22.0));
  s.warmup = 0.1;  // fraction
  EXPECT_EQ(warmup_steps(s, 110), 11);
}

// The CLI turns bad input into one "error:" line and a non-zero exit.
TEST(Cli, BadInputGivesOneErrorLine) {
  test::TempDir d("cli");
  write_file_atomic(d.path / "bad.yaml", "model:\n  d_model: 64\n  heads: 2\n");
  std::string cmd = fmt::format("{}/ladder train {} --run-dir {} 2>{} >/dev/null", LADDER_BINARY_DIR,
                                (d.path / "bad.yaml").string(), (d.path / "run").string(), (d.path / "err").string());
  int rc = std::system(cmd.c_str());
  EXPECT_NE(rc, 0);
  std::string err = read_file(d.path / "err");
  EXPECT_NE(err.find("error: "), std::string::npos) << err;
  EXPECT_NE(err.find("bad.yaml:3"), std::string::npos) << err;
  EXPECT_NE(err.find("model.heads"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(d.path / "run"));
}

// Argument mistakes a user makes: each one line naming the flag, path or verb, and a non-zero exit;
// and a --set before the config path leaves the path the config (CLI11 would have taken it as a
// second --set value).
TEST(Cli, ArgumentMistakesGetOneLineNamingWhatIsWrong) {
  test::TempDir d("cli-args");
  const std::string bin = fmt::format("{}/ladder", LADDER_BINARY_DIR);
  const fs::path err = d.path / "err", out = d.path / "out";
  auto run = [&](const std::string& args) {
    const int rc = std::system(fmt::format("{} {} >{} 2>{}", bin, args, out.string(), err.string()).c_str());
    return std::pair{rc, read_file(err)};
  };
  auto expect_error = [&](const std::string& args, const std::string& want) {
    auto [rc, e] = run(args);
    EXPECT_NE(rc, 0) << args;
    EXPECT_NE(e.find(want), std::string::npos) << args << "\n" << e;
    EXPECT_EQ(e.find("terminate called"), std::string::npos) << args;
  };
  const std::string cfg = (fs::path(LADDER_SOURCE_DIR) / "configs" / "dense-tiny.yaml").string();
  expect_error("bogus", "unknown command 'bogus'");
  expect_error(fmt::format("train {}", d.path.string()), d.path.string() + ": is a directory, expected a config file");
  expect_error(fmt::format("sweep {} --out {}", d.path.string(), (d.path / "o").string()),
               d.path.string() + ": is a directory, expected a ladder spec");
  expect_error("sample nowhere --seed -1", "--seed: expected a number >= 0, got -1");
  expect_error("sweep nowhere.yaml --out o --seeds 2,-1", "--seeds: expected a number >= 0, got -1");
  expect_error("sample nowhere --threads -3", "--threads: expected a number >= 0, got -3");
  expect_error("sample nowhere --temperature nan", "--temperature must be a finite number >= 0");  // the flag first
  expect_error("bench --optim --torch", "drop --torch");
  auto [rc, e] = run(fmt::format("train --set model.d_model=64 --set model.n_heads=2 {} --dry-run", cfg));
  EXPECT_EQ(rc, 0) << e;
  EXPECT_NE(read_file(out).find("model.layers.0.self_attn.q_proj.weight"), std::string::npos);
  EXPECT_NE(read_file(out).find("[64, 64]"), std::string::npos) << "the --set values before the path were not applied";
}

}  // namespace
}  // namespace ladder
