// Checkpoints: what a resume accepts (config changes, hand-edited or damaged files), how checkpoint
// directories are found, replaced and pruned, and what a checkpoint needs for `ladder sample`.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "backend/backend.h"
#include "optim/optimizer.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "test_util.h"
#include "tiny_training.h"

namespace fs = std::filesystem;

namespace ladder {
namespace {

class CheckpointTest : public ::testing::Test {
 protected:
  static inline test::TempDir* dir = nullptr;
  static void SetUpTestSuite() {
    dir = new test::TempDir("ckpt");
    test::make_word_salad_data(dir->path, 200, 7);
  }
  static void TearDownTestSuite() {
    delete dir;
    dir = nullptr;
  }
  static Config tiny() {
    Config c = test::tiny_train_config(dir->path);
    c.run.steps = 6;
    c.run.batch_size = 2;
    c.run.grad_accum = 1;
    c.run.ckpt_every = 3;
    c.run.eval_every = 0;
    c.run.eval_batches = 1;
    return c;
  }
  static TrainSummary run(const Config& c, const fs::path& run_dir, bool resume = false, int64_t stop_after = -1) {
    return test::train_quietly(c, run_dir, resume, stop_after);
  }
  // A fresh run directory "killed" after step 4 (newest checkpoint: step 3).
  static fs::path killed_run(const std::string& name, const Config& c) {
    fs::path r = dir->path / name;
    fs::remove_all(r);
    run(c, r, false, 4);
    return r;
  }
  static void edit_json(const fs::path& f, const std::function<void(nlohmann::json&)>& fn) {
    auto j = nlohmann::json::parse(read_file(f));
    fn(j);
    write_file_atomic(f, j.dump(2));
  }
  // Rewrites a safetensors file with its tensors (plus `extra`, a 1-element tensor when not empty)
  // and `meta` as metadata.
  static void rewrite_safetensors(const fs::path& f, const std::map<std::string, std::string>& meta,
                                  const std::string& extra = "") {
    std::vector<std::vector<float>> data;
    std::vector<TensorRef> t;
    {
      auto st = SafeTensors::open(f);
      for (auto& n : st.names()) data.push_back(st.get_f32(n));
      size_t i = 0;
      for (auto& n : st.names()) t.push_back({n, DType::F32, st.shape(n), data[i++].data()});
    }
    static const float one = 1;
    if (!extra.empty()) t.push_back({extra, DType::F32, {1}, &one});
    save_safetensors(f, t, meta);
  }
  template <class F>
  static std::string error_of(F fn) { return test::error_of(fn); }
};

#define EXPECT_HAS(haystack, needle) EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)

// Defect: a key missing from the saved config was read with the const operator[] (undefined
// behaviour: "run.seed is  in the checkpoint"), a missing section gave a bare type_error.
TEST_F(CheckpointTest, ResumeNamesAKeyMissingFromTheSavedConfig) {
  Config c = tiny();
  fs::path r = killed_run("missing-key", c);
  fs::path state = checkpoint_dir(r, 3) / "state.json";
  const std::string orig = read_file(state);
  for (auto [sec, key] : {std::pair{"run", "seed"}, {"model", "d_model"}, {"optim", "name"}}) {
    edit_json(state, [&](nlohmann::json& j) { j["config"][sec].erase(key); });
    std::string e = error_of([&] { run(c, r, true); });
    EXPECT_HAS(e, "state.json");
    EXPECT_HAS(e, fmt::format("config.{}.{} is missing in the checkpoint", sec, key));
    write_file_atomic(state, orig);
  }
  edit_json(state, [](nlohmann::json& j) { j["config"].erase("run"); });
  std::string e = error_of([&] { run(c, r, true); });
  EXPECT_HAS(e, "state.json");
  EXPECT_HAS(e, "config.run is missing");
  edit_json(state, [](nlohmann::json& j) { j["config"]["run"] = 3; });
  e = error_of([&] { run(c, r, true); });
  EXPECT_HAS(e, "config.run is number in the checkpoint, expected an object");
}

// Defect: optim.name and the group selectors changed on resume were accepted silently (adamw state
// read as adam's; lm_head's AdamW moments reused under another group's settings), or failed on a
// missing state tensor without naming the setting.
TEST_F(CheckpointTest, ResumeRefusesAChangedOptimizerStructure) {
  Config c = tiny();
  fs::path r = killed_run("optim-structure", c);
  auto expect_refused = [&](const Config& changed, const std::string& what) {
    std::string e = error_of([&] { run(changed, r, true); });
    EXPECT_HAS(e, "state.json");
    EXPECT_HAS(e, what);
  };
  Config d = c;
  d.optim.name = "adam";
  expect_refused(d, R"(optim.name is "adamw" in the checkpoint but "adam" now)");
  d.optim.name = "muonh";
  expect_refused(d, R"(optim.name is "adamw" in the checkpoint but "muonh" now)");
  d = c;
  d.optim.adam_params = "role:lm_head";
  expect_refused(d, R"(optim.adam_params is "" in the checkpoint but "role:lm_head" now)");
  // Refused before anything was written: the run still resumes unchanged.
  EXPECT_EQ(run(c, r, true).start_step, 3);
}

// Changes that only alter the update from here on are allowed, each with one warning line.
TEST_F(CheckpointTest, ResumeWarnsOncePerChangedOptimizerOrScheduleSetting) {
  Config c = tiny();
  fs::path r = killed_run("optim-warn", c);
  Config d = c;
  d.optim.lr = 1e-3;
  d.optim.weight_decay = 0.05;
  d.schedule.type = "cosine";
  d.run.steps = 8;
  d.run.log_every = 2;  // not a trajectory setting: no warning
  d.optim.lr_mults = "role:attention=2";
  // A run trained on a GPU in bf16, continued on the CPU: the arithmetic changes from here on.
  edit_json(checkpoint_dir(r, 3) / "state.json", [](nlohmann::json& j) {
    j["config"]["run"]["device"] = "cuda";
    j["config"]["run"]["precision"] = "bf16";
  });
  ::testing::internal::CaptureStderr();
  TrainSummary s = run(d, r, true);
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(s.start_step, 3);
  EXPECT_EQ(s.end_step, 8);
  int lines = 0;
  for (size_t p = 0; (p = err.find("warning: ", p)) != std::string::npos; ++p) ++lines;
  EXPECT_EQ(lines, 7) << err;
  for (const char* f : {"optim.lr = 0.001 ", "optim.lr_mults = \"role:attention=2\" ", "optim.weight_decay = 0.05 ", "schedule.type = \"cosine\" ", "run.steps = 8 ",
                        "run.device = \"cpu\" but the checkpoint", "trained with \"cuda\"",
                        "run.precision = \"fp32\" but the checkpoint", "trained with \"bf16\""})
    EXPECT_HAS(err, f);
  EXPECT_HAS(err, "trained with 0.005: the continuation is not the uninterrupted run's");
  // An unchanged resume warns about nothing; nor do GPU-only settings between two CPU runs, nor a
  // checkpoint from before run.attention was recorded, nor one from before a late key existed
  // (model/config.h: it trained with the key's default).
  fs::path r2 = killed_run("optim-nowarn", c);
  edit_json(checkpoint_dir(r2, 3) / "state.json", [](nlohmann::json& j) {
    j["config"]["run"]["precision"] = "tf32";
    j["config"]["run"]["attention"] = "cudnn";
    j["config"]["optim"].erase("lr_mults");
  });
  ::testing::internal::CaptureStderr();
  run(c, r2, true);
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("warning"), std::string::npos) << err;
  fs::path r3 = killed_run("optim-old-attention", c);
  edit_json(checkpoint_dir(r3, 3) / "state.json", [](nlohmann::json& j) {
    j["config"]["run"]["device"] = "cuda";
    j["config"]["run"].erase("attention");
  });
  ::testing::internal::CaptureStderr();
  run(c, r3, true);
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_HAS(err, "run.device = \"cpu\"");
  EXPECT_EQ(err.find("run.attention"), std::string::npos) << err;
}

// Defect: the optimizer's step counter (Adam's bias correction) was read with std::stoll: "abc" gave
// "error: stoll", "3xyz" and "-7" were accepted, and it was never checked against state.json.
TEST_F(CheckpointTest, OptimizerStepCounterIsStrictAndMatchesTheState) {
  Config c = tiny();
  fs::path r = killed_run("opt-steps", c);
  fs::path f = checkpoint_dir(r, 3) / "optimizer.safetensors";
  const std::string orig = read_file(f);
  for (const char* bad : {"abc", "3xyz", "-7", "", " 3", "+3", "99999999999999999999"}) {
    rewrite_safetensors(f, {{"optimizer_steps", bad}});
    std::string e = error_of([&] { run(c, r, true); });
    EXPECT_HAS(e, "optimizer.safetensors");
    EXPECT_HAS(e, fmt::format("'optimizer_steps' is \"{}\", expected a non-negative integer", bad));
  }
  rewrite_safetensors(f, {{"optimizer_steps", "2"}});
  std::string e = error_of([&] { run(c, r, true); });
  EXPECT_HAS(e, "optimizer.safetensors: metadata 'optimizer_steps' is 2 but");
  EXPECT_HAS(e, "state.json records 3");
  write_file_atomic(f, orig);
  EXPECT_EQ(run(c, r, true).start_step, 3);
}

// Defect: read_checkpoint_state took step: -5 (and 3.5 as 3), and never compared the step with the
// optimizer's count or the directory's name.
TEST_F(CheckpointTest, StateCountsAreCheckedAgainstEachOtherAndTheDirectory) {
  Config c = tiny();
  fs::path r = killed_run("state-steps", c);
  fs::path ck = checkpoint_dir(r, 3), state = ck / "state.json";
  const std::string orig = read_file(state);
  auto expect_bad = [&](const std::function<void(nlohmann::json&)>& edit, const std::string& what) {
    edit_json(state, edit);
    std::string e = error_of([&] { read_checkpoint_state(ck); });
    EXPECT_HAS(e, "state.json");
    EXPECT_HAS(e, what);
    write_file_atomic(state, orig);
  };
  expect_bad([](auto& j) { j["step"] = -5; }, "'step' is -5, expected a non-negative integer");
  expect_bad([](auto& j) { j["step"] = 3.5; }, "'step' is 3.5, expected a non-negative integer");
  expect_bad([](auto& j) { j["tokens_seen"] = -1; }, "'tokens_seen' is -1");
  expect_bad([](auto& j) { j.erase("optimizer_steps"); }, "'optimizer_steps' is missing");
  expect_bad([](auto& j) { j["optimizer_steps"] = 2; }, "optimizer_steps is 2 but step is 3");
  expect_bad([](auto& j) { j["optimizer_steps"] = j["step"] = 4; },
             "step is 4 but the directory is step_00000003 (step 3)");
  // A copy under another name (for sampling, say) is not held to a step name.
  fs::copy(ck, r / "best", fs::copy_options::recursive);
  EXPECT_EQ(read_checkpoint_state(r / "best").step, 3);
}

// Defect: optimizer.safetensors tensors this optimizer does not have were ignored (model.safetensors
// rejected them).
TEST_F(CheckpointTest, UnknownOptimizerTensorsAreRejected) {
  Config c = tiny();
  fs::path r = killed_run("opt-unknown", c);
  fs::path f = checkpoint_dir(r, 3) / "optimizer.safetensors";
  rewrite_safetensors(f, {{"optimizer_steps", "3"}}, "momentum.model.norm.weight");
  std::string e = error_of([&] { run(c, r, true); });
  EXPECT_HAS(e, "optimizer.safetensors: tensor 'momentum.model.norm.weight' is not a state tensor of this optimizer");
}

// Defect: any directory starting with "step_" and digits counted (std::stoll ignores a suffix): a
// step_00000003.bak copy was picked as the latest and pruning then removed the real step_00000003;
// a user's step_1_mybackup was pruned.
TEST_F(CheckpointTest, OnlyStepDigitsDirectoriesAreResumedFromOrPruned) {
  Config c = tiny();
  c.run.keep_checkpoints = 1;
  fs::path r = killed_run("strict-names", c);
  fs::path ck = r / "checkpoints";
  for (const char* copy : {"step_00000003.bak", "step_1_mybackup", "step_00000009x", "step_"})
    fs::copy(ck / "step_00000003", ck / copy, fs::copy_options::recursive);
  fs::create_directories(ck / "step_00000099");  // no state.json: not a checkpoint
  ASSERT_EQ(latest_checkpoint(r), ck / "step_00000003");
  TrainSummary s = run(c, r, true);
  EXPECT_EQ(s.start_step, 3);
  std::set<std::string> left;
  for (auto& e : fs::directory_iterator(ck)) left.insert(e.path().filename().string());
  EXPECT_EQ(left, (std::set<std::string>{"step_00000006", "step_00000003.bak", "step_1_mybackup", "step_00000009x",
                                         "step_", "step_00000099"}));
}

// A pid that is certainly not running: a child that has exited and been reaped.
static int64_t dead_pid() {
  pid_t p = fork();
  if (p == 0) _exit(0);
  waitpid(p, nullptr, 0);
  return p;
}

// Defect: the .partial_* directories of killed saves were never removed. Now those of processes that
// are gone are, at the next save; a live process's are not.
TEST_F(CheckpointTest, SavesRemoveTemporariesOfKilledSavesOnly) {
  Config c = tiny();
  fs::path r = killed_run("stale-partial", c);
  fs::path ck = r / "checkpoints";
  const std::string dead = fmt::format(".partial_step_00000005_{}", dead_pid());
  const std::string live = fmt::format(".partial_step_00000005_{}", getppid());  // our parent is alive
  const std::string dead_replaced = fmt::format(".replaced_step_00000003_{}", dead_pid());  // step 3 exists
  const std::string foreign = ".partial_notes";  // not a name save_checkpoint uses
  // Another host's temporary: its pid says nothing here (a requeued job on a shared filesystem).
  const std::string other_host = fmt::format(".partial_step_00000005_{}@another-host", dead_pid());
  const std::string dead_here = fmt::format(".partial_step_00000004_{}@{}", dead_pid(), [] {
    char h[256] = {0};
    gethostname(h, sizeof h - 1);
    return std::string(h);
  }());
  for (auto& d : {dead, live, dead_replaced, foreign, other_host, dead_here}) {
    fs::create_directories(ck / d);
    write_file_atomic(ck / d / "model.safetensors", "x");
  }
  run(c, r, true);  // saves step 6
  EXPECT_FALSE(fs::exists(ck / dead));
  EXPECT_FALSE(fs::exists(ck / dead_replaced));
  EXPECT_TRUE(fs::exists(ck / live / "model.safetensors"));
  EXPECT_TRUE(fs::exists(ck / foreign / "model.safetensors"));
  EXPECT_TRUE(fs::exists(ck / other_host / "model.safetensors"));
  EXPECT_FALSE(fs::exists(ck / dead_here));
  EXPECT_TRUE(fs::exists(ck / "step_00000006" / "state.json"));
}

// Saving a step that already has a directory replaces it without a moment where neither exists: the
// old one is moved aside, the new one renamed in, and only then the old one removed. A save killed
// in between leaves the old copy, which the next training start puts back. (Defect: the replacement
// was remove_all then rename; a second Ctrl-C in between left no checkpoint of that step.)
TEST_F(CheckpointTest, ReplacingAStepDirectoryNeverLeavesNone) {
  Config c = tiny();
  fs::path r = killed_run("replace", c);
  // Saves checkpoint `step` again from its own files.
  auto resave = [&](int64_t step) {
    fs::path ck = checkpoint_dir(r, step);
    Config rc = c;
    resolve_data(rc);
    auto be = make_backend("cpu", 1, "fp32", "ladder");
    Transformer m(rc.model, rc.run.batch_size, *be);
    auto o = make_optimizer(rc, m, *be);
    load_checkpoint_weights(ck, m, o.get());
    return save_checkpoint(r, read_checkpoint_state(ck), m, *o, dir->path / "data" / "tokenizer.model", 5);
  };
  auto entries = [&] {
    std::set<std::string> out;
    for (auto& e : fs::directory_iterator(r / "checkpoints")) out.insert(e.path().filename().string());
    return out;
  };
  const fs::path ck3 = checkpoint_dir(r, 3);
  const std::string weights = read_file(ck3 / "model.safetensors");
  // A clean replacement leaves exactly the step directory, with the same bytes (same state).
  EXPECT_EQ(resave(3), ck3);
  EXPECT_EQ(entries(), std::set<std::string>{"step_00000003"});
  EXPECT_EQ(read_file(ck3 / "model.safetensors"), weights);
  // Killed between the renames: the old copy is kept aside and put back by the next training start.
  set_checkpoint_save_hook_for_tests([](std::string_view at) {
    if (at == "moved-aside") throw std::runtime_error("simulated kill");
  });
  EXPECT_THROW(resave(3), std::runtime_error);
  set_checkpoint_save_hook_for_tests(nullptr);
  EXPECT_FALSE(fs::exists(ck3));
  TrainSummary s = run(c, r, true);
  EXPECT_EQ(s.start_step, 3);
  EXPECT_EQ(s.end_step, 6);
  // A save that fails before the renames (here: once every file is written) leaves the existing
  // checkpoint as it was and nothing beside it.
  const fs::path ck6 = checkpoint_dir(r, 6);
  const std::string w6 = read_file(ck6 / "model.safetensors");
  set_checkpoint_save_hook_for_tests([](std::string_view at) {
    if (at == "written") throw Error("simulated write error");
  });
  EXPECT_THROW(resave(6), Error);
  set_checkpoint_save_hook_for_tests(nullptr);
  EXPECT_EQ(read_file(ck6 / "model.safetensors"), w6);
  EXPECT_EQ(entries(), (std::set<std::string>{"step_00000003", "step_00000006"}));
}

// Defect: SIGINT during the last step saved that step in the loop and again after it (replacing the
// first, after the signal handler was restored), and printed "interrupted ... --resume" for a
// complete run. A signal on a periodic checkpoint's step saved that step twice too.
TEST_F(CheckpointTest, InterruptSavesEachStepOnceAndACompleteRunIsNotInterrupted) {
  TrainOptions o;
  o.cfg = tiny();  // 6 steps, a checkpoint every 3
  o.run_dir = dir->path / "sigint-last";
  o.interrupt_at = 6;
  ::testing::internal::CaptureStdout();
  TrainSummary s = train(o);
  std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(s.end_step, 6);
  EXPECT_EQ(s.checkpoint_steps, (std::vector<int64_t>{3, 6}));
  EXPECT_EQ(out.find("interrupted"), std::string::npos) << out;
  EXPECT_HAS(out, "done: 6 steps");

  o.run_dir = dir->path / "sigint-periodic";
  o.interrupt_at = 3;
  ::testing::internal::CaptureStdout();
  s = train(o);
  out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(s.end_step, 3);
  EXPECT_EQ(s.checkpoint_steps, (std::vector<int64_t>{3}));
  EXPECT_HAS(out, "interrupted: checkpoint written at step 3; continue with --resume");
  // ... and it resumes from there to the end.
  o.resume = true;
  o.interrupt_at = -1;
  o.quiet = true;
  s = train(o);
  EXPECT_EQ(s.start_step, 3);
  EXPECT_EQ(s.checkpoint_steps, (std::vector<int64_t>{6}));
}

// Defect: the data loader's restore errors said "data loader state ..." without naming the file.
TEST_F(CheckpointTest, LoaderStateErrorsNameStateJson) {
  Config c = tiny();
  fs::path r = killed_run("loader-state", c);
  fs::path state = checkpoint_dir(r, 3) / "state.json";
  const std::string orig = read_file(state);
  edit_json(state, [](nlohmann::json& j) { j["loader"]["fingerprint"] = 12345; });
  std::string e = error_of([&] { run(c, r, true); });
  EXPECT_HAS(e, state.string() + ", field 'loader': data loader state does not match this loader: 'fingerprint'");
  write_file_atomic(state, orig);
  edit_json(state, [](nlohmann::json& j) { j["loader"]["consumed"] = -3; });
  e = error_of([&] { run(c, r, true); });
  EXPECT_HAS(e, state.string() + ", field 'loader': data loader state: field 'consumed'");
}

// A damaged newest checkpoint (a truncated copy) stops a resume with the damage named, and the error
// names the older complete checkpoint to go back to; moved aside, the resume continues from that one.
TEST_F(CheckpointTest, ADamagedNewestCheckpointNamesTheOlderOne) {
  Config c = tiny();
  c.run.steps = 9;
  fs::path r = dir->path / "damaged";
  fs::remove_all(r);
  run(c, r, false, 7);  // checkpoints at steps 3 and 6
  const fs::path newest = checkpoint_dir(r, 6), older = checkpoint_dir(r, 3);
  ASSERT_TRUE(fs::exists(older / "state.json"));
  // A truncated state.json too (read before the weights; it gave no hint before).
  const std::string state = read_file(newest / "state.json");
  fs::resize_file(newest / "state.json", 40);
  std::string e = error_of([&] { run(c, r, true); });
  EXPECT_HAS(e, (newest / "state.json").string() + ": corrupt checkpoint state");
  EXPECT_HAS(e, "(the older checkpoint " + older.string() + " is complete: move " + newest.string() +
                    " aside to resume from it)");
  write_file_atomic(newest / "state.json", state);
  fs::resize_file(newest / "model.safetensors", 1000);
  e = error_of([&] { run(c, r, true); });
  EXPECT_HAS(e, (newest / "model.safetensors").string());
  EXPECT_HAS(e, "(the older checkpoint " + older.string() + " is complete: move " + newest.string() +
                    " aside to resume from it)");
  EXPECT_EQ(previous_checkpoint(older), std::nullopt);
  fs::rename(newest, r / "step_6.damaged");
  EXPECT_EQ(run(c, r, true).start_step, 3);
}

// Defect: a data directory without tokenizer.model gave checkpoints without one, silently; `ladder
// sample` then failed with "tokenizer model not found (run `ladder data` to train one)".
TEST_F(CheckpointTest, ACheckpointWithoutTokenizerSaysSoWhereSamplingNeedsIt) {
  fs::path data = dir->path / "data-no-tokenizer";
  fs::remove_all(data);
  fs::copy(dir->path / "data", data, fs::copy_options::recursive);
  fs::remove(data / "tokenizer.model");
  Config c = tiny();
  c.data.path = data.string();
  c.run.steps = 3;
  fs::path r = dir->path / "no-tokenizer";
  fs::remove_all(r);
  ::testing::internal::CaptureStderr();
  run(c, r);
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_HAS(err, "warning: " + (data / "tokenizer.model").string() + " not found: checkpoints will have no tokenizer");
  fs::path ck = checkpoint_dir(r, 3);
  ASSERT_TRUE(fs::exists(ck / "state.json"));
  std::string e = error_of([&] { checkpoint_tokenizer(ck); });
  EXPECT_HAS(e, (ck / "tokenizer.model").string() + ": missing: the checkpoint has no tokenizer (its data directory " +
                    data.string() + " had no tokenizer.model when it was saved)");
  EXPECT_HAS(e, "(hash ");
  // `ladder sample` gives that error.
  std::string cmd = fmt::format("{}/ladder sample {} --prompt hi 2>{} >/dev/null", LADDER_BINARY_DIR, r.string(),
                                (r / "err").string());
  EXPECT_NE(std::system(cmd.c_str()), 0);
  EXPECT_HAS(read_file(r / "err"), "error: " + (ck / "tokenizer.model").string() + ": missing: the checkpoint has no tokenizer");
  // A tokenizer copied in must be the data's.
  write_file_atomic(ck / "tokenizer.model", "not this one");
  EXPECT_HAS(error_of([&] { checkpoint_tokenizer(ck); }), "is not the one the training data was encoded with");
  fs::copy_file(dir->path / "data" / "tokenizer.model", ck / "tokenizer.model", fs::copy_options::overwrite_existing);
  EXPECT_EQ(checkpoint_tokenizer(ck), ck / "tokenizer.model");
  // A checkpoint trained from data with a tokenizer has it, and no warning was printed.
  ::testing::internal::CaptureStderr();
  c.data.path = (dir->path / "data").string();
  run(c, dir->path / "with-tokenizer");
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(checkpoint_tokenizer(checkpoint_dir(dir->path / "with-tokenizer", 3)),
            checkpoint_dir(dir->path / "with-tokenizer", 3) / "tokenizer.model");
}


// Defect: a fresh start wrote its config.yaml and a new metrics.jsonl over whatever the run
// directory held: `--run-dir .` replaced one's own config.yaml, and running a command again after a
// run died before its first checkpoint replaced that run's metrics without a word.
TEST_F(CheckpointTest, AFreshStartReplacesOnlyAnEarlierStartsFiles) {
  Config c = tiny();
  c.run.steps = 4;
  c.run.ckpt_every = 0;  // no checkpoint before the end
  const fs::path r = dir->path / "fresh-start";
  fs::remove_all(r);
  fs::create_directories(r);
  // Someone's own config.yaml: neither a fresh start nor --resume touches it.
  const std::string mine = "# my notes\nmodel:\n  d_model: 64\n";
  write_file_atomic(r / "config.yaml", mine);
  for (bool resume : {false, true}) {
    std::string e = error_of([&] { run(c, r, resume); });
    EXPECT_HAS(e, (r / "config.yaml").string() + ": exists and was not written by `ladder train`");
  }
  EXPECT_EQ(read_file(r / "config.yaml"), mine);
  EXPECT_FALSE(fs::exists(r / "metrics.jsonl"));
  // Moved aside, the run starts; "killed" after step 2 it leaves metrics and no checkpoint.
  fs::remove(r / "config.yaml");
  EXPECT_EQ(run(c, r, false, 2).end_step, 2);
  ASSERT_FALSE(latest_checkpoint(r));
  ASSERT_TRUE(read_file(r / "config.yaml").starts_with("# Written by `ladder train`"));
  const std::string metrics = read_file(r / "metrics.jsonl");
  ASSERT_FALSE(metrics.empty());
  // The same command again: refused, the metrics kept.
  std::string e = error_of([&] { run(c, r); });
  EXPECT_HAS(e, (r / "metrics.jsonl").string() + ": holds the metrics of an earlier run in this directory that saved "
                    "no checkpoint: pass --resume to start it over from step 0");
  EXPECT_EQ(read_file(r / "metrics.jsonl"), metrics);
  // --resume starts it over: the new metrics hold each step once, and the run's own config.yaml
  // (even one with another config) is replaced.
  c.run.seed = 11;
  TrainSummary s = run(c, r, true);
  EXPECT_EQ(s.start_step, 0);
  EXPECT_EQ(s.end_step, 4);
  std::ifstream m(r / "metrics.jsonl");
  std::string line;
  std::vector<int64_t> steps;
  while (std::getline(m, line))
    if (auto j = nlohmann::json::parse(line); j.contains("loss")) steps.push_back(j["step"].get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_HAS(read_file(r / "config.yaml"), "seed: 11");
  // A config.yaml from before the header, identical to what the run writes, is its own too.
  fs::path old = dir->path / "fresh-start-old";
  fs::remove_all(old);
  fs::create_directories(old);
  Config resolved = c;
  validate(resolved);
  resolve_data(resolved);
  write_file_atomic(old / "config.yaml", to_yaml(resolved));
  EXPECT_EQ(run(c, old).end_step, 4);
}

}  // namespace
}  // namespace ladder
