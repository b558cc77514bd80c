// Config input validation (src/model/config.cpp): bad input is an error that names the file or key
// and what was expected, never a value silently changed or a bare library exception.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <tuple>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "core/error.h"
#include "core/fileio.h"
#include "ladder/plan.h"
#include "model/config.h"
#include "model/transformer.h"
#include "train/checkpoint.h"
#include "train/sampler.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace ladder {
namespace {

// The message of the ladder::Error `fn` throws; a failure if it throws none (any other exception
// type escapes and fails the test too: users must never see a bare library error).
using test::error_of;

// A small config that validates on this build.
Config small() {
  Config c;
  c.source = "small";
  c.model.d_model = 32;
  c.model.n_layers = 4;
  c.model.n_heads = 4;
  c.run.steps = 1000;
  return c;
}

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

// An error found after the overrides names the --set values beside the file: the bad value may be theirs.
TEST(ConfigInput, AnErrorFromASetValueNamesTheSet) {
  test::TempDir d("cfg-set-where");
  const fs::path ok = d.path / "ok.yaml";
  write_file_atomic(ok, "model:\n  d_model: 64\n");
  // The value is a number (load_config takes it); only validate() knows q_scale must be > 0.
  const Config c = load_config(ok, {"model.q_scale=-1", "run.steps=7"});
  EXPECT_ERROR_HAS(error_of([&] { validate(c); }), ok.string(), "with --set model.q_scale=-1, run.steps=7",
                   "model.q_scale must be > 0");
  EXPECT_EQ(load_config(ok).source, ok.string());  // no overrides: the file alone
}

// Every number of the schema (the float fields of to_json) refuses NaN and inf, from a file or --set.
TEST(ConfigInput, EveryNumberMustBeFinite) {
  test::TempDir d("cfg-finite");
  const fs::path ok = d.path / "ok.yaml";
  write_file_atomic(ok, "model:\n  d_model: 64\n");
  int numbers = 0;
  const nlohmann::json defaults = to_json(Config{});
  for (auto& [sec, fields] : defaults.items())
    for (auto& [name, v] : fields.items()) {
      if (!v.is_number_float()) continue;
      ++numbers;
      const std::string key = sec + "." + name;
      for (const char* bad : {".nan", ".inf", "-.inf", ".NaN"})
        EXPECT_ERROR_HAS(error_of([&] { load_config(ok, {key + "=" + bad}); }), key.c_str(), "a finite number", bad);
      const fs::path f = d.path / (name + ".yaml");
      write_file_atomic(f, fmt::format("{}:\n  {}: .nan\n", sec, name));
      EXPECT_ERROR_HAS(error_of([&] { load_config(f); }), (name + ".yaml:2").c_str(), key.c_str(), "finite");
    }
  EXPECT_GT(numbers, 10);  // the schema's doubles were found (the loop is not vacuous)

  // validate() refuses them in a config built by code, where a NaN passed every `x < 0` check.
  auto nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  std::vector<std::pair<const char*, std::function<void(Config&)>>> cases = {
      {"model.norm_eps", [&](Config& c) { c.model.norm_eps = nan; }},
      {"model.z_loss", [&](Config& c) { c.model.z_loss = nan; }},
      {"model.rope_theta", [&](Config& c) { c.model.rope_theta = inf; }},
      {"optim.lr", [&](Config& c) { c.optim.lr = nan; }},
      {"optim.clip", [&](Config& c) { c.optim.clip = inf; }},
      {"optim.embed_lr_mult", [&](Config& c) { c.optim.embed_lr_mult = nan; }},
      {"schedule.warmup", [&](Config& c) { c.schedule.warmup = nan; }},
      {"schedule.final_lr_frac", [&](Config& c) { c.schedule.final_lr_frac = nan; }},
  };
  for (auto& [key, set] : cases) {
    Config c = small();
    set(c);
    EXPECT_ERROR_HAS(error_of([&] { validate(c); }), "small", key, "finite");
  }
}

TEST(ConfigInput, RecipeNumbersOutOfRangeNameTheField) {
  std::vector<std::tuple<const char*, std::function<void(Config&)>, const char*>> bad = {
      {"model.rope_theta", [](Config& c) { c.model.rope_theta = 0; }, "> 0"},
      {"model.rope_theta", [](Config& c) { c.model.rope_theta = -10000; }, "> 0"},
      {"optim.eps", [](Config& c) { c.optim.eps = -1; }, "> 0"},
      {"optim.eps", [](Config& c) { c.optim.eps = 0; }, "> 0"},
      {"optim.eps", [](Config& c) { c.optim.eps = 1e-50; }, "smallest float"},  // 0 as a float
      {"optim.weight_decay", [](Config& c) { c.optim.weight_decay = -10; }, ">= 0"},
      {"optim.embed_lr_mult", [](Config& c) { c.optim.embed_lr_mult = -1; }, ">= 0"},
      {"optim.clip", [](Config& c) { c.optim.clip = -1; }, ">= 0"},
      {"optim.adam_lr", [](Config& c) { c.optim.adam_lr = "inf"; }, "learning rate >= 0"},
      {"optim.muon_lr", [](Config& c) { c.optim.muon_lr = "nan"; }, "learning rate >= 0"},
      {"schedule.warmup", [](Config& c) { c.schedule.warmup = 1e30; }, "from 1 to run.steps"},
      {"schedule.warmup", [](Config& c) { c.schedule.warmup = 1001; }, "(1000)"},
      {"schedule.warmup", [](Config& c) { c.schedule.warmup = 10.5; }, "whole number"},
      {"schedule.warmup", [](Config& c) { c.schedule.warmup = -0.1; }, ">= 0"},
      // wsd's decay (the last 90% of 1000 steps) would start at step 100, inside 200 warmup steps.
      {"schedule.decay_frac", [](Config& c) { c.schedule.type = "wsd", c.schedule.warmup = 200,
                                                c.schedule.decay_frac = 0.9; }, "inside the 200 warmup steps"},
      // A micro-batch's tokens (and an MoE layer's token-expert slots) are counted in 32-bit ints.
      {"run.batch_size", [](Config& c) { c.run.batch_size = 100000, c.model.seq_len = 100000; }, "2^31 - 1"},
      {"model.moe_top_k", [](Config& c) { c.model.moe_experts = 8, c.model.moe_top_k = 4,
                                            c.run.batch_size = 1 << 20, c.model.seq_len = 1024; }, "2^31 - 1"},
      // Every token to every expert: an explicit quantile balancing has nothing to do.
      {"model.moe_balance", [](Config& c) { c.model.moe_experts = 4, c.model.moe_top_k = 4,
                                              c.model.moe_balance = "quantile"; }, "nothing to balance"},
  };
  for (auto& [key, set, why] : bad) {
    Config c = small();
    set(c);
    EXPECT_ERROR_HAS(error_of([&] { validate(c); }), "small", key, why);
  }
  // The ends of each range are settings, not errors: 0 turns clipping, decay, the embedding's
  // updates and warmup off; a warmup of every step is allowed.
  std::vector<std::function<void(Config&)>> good = {
      [](Config& c) { c.optim.clip = 0; },          [](Config& c) { c.optim.weight_decay = 0; },
      [](Config& c) { c.optim.embed_lr_mult = 0; }, [](Config& c) { c.schedule.warmup = 0; },
      [](Config& c) { c.schedule.warmup = 0.999; }, [](Config& c) { c.schedule.warmup = 1; },
      [](Config& c) { c.schedule.warmup = 1000; },  [](Config& c) { c.model.rope_theta = 1e4; },
      [](Config& c) { c.optim.eps = 1e-30; },
      [](Config& c) { c.schedule.type = "wsd", c.schedule.warmup = 100, c.schedule.decay_frac = 0.9; },
      [](Config& c) { c.run.batch_size = 1 << 20, c.model.seq_len = 2047; },  // 2^31 - 2^20 tokens
      [](Config& c) { c.model.moe_experts = 4, c.model.moe_top_k = 4; },  // auto balancing: none to do
  };
  for (auto& set : good) {
    Config c = small();
    set(c);
    EXPECT_NO_THROW(validate(c));
  }
}

// A model too large for the machine is one error line before anything is built: weights and
// gradients are checked against the memory available first (without it, a million layers spent
// seconds and gigabytes on tensor names before failing), and any large host allocation is checked
// before it is touched (Linux overcommits: the memset would end in the OOM killer, without a word).
TEST(ConfigInput, AModelTooLargeForTheMachineIsOneErrorLine) {
  ModelConfig m = small().model;
  m.vocab_size = 1000;
  m.d_model = 4096;
  m.n_heads = 32;
  m.n_layers = 1000000;
  auto be = make_cpu_backend(1);
  EXPECT_ERROR_HAS(error_of([&] { Transformer t(m, 1, *be); }), "out of memory", "weights and gradients",
                   "MiB available");
  EXPECT_ERROR_HAS(error_of([&] { host_memory().mem_alloc(size_t(1) << 60, "a test tensor"); }), "out of memory",
                   "a test tensor", "of host memory available");
  EXPECT_GT(host_memory().available_bytes(), size_t(1) << 20);  // this machine has some
}

// A checkpoint's config is checked as a YAML file's is, and errors name the file and the key.
TEST(ConfigInput, FromJsonChecksTypesRangesAndShapes) {
  Config base = small();
  base.model.vocab_size = 320;
  const nlohmann::json good = to_json(base);
  EXPECT_EQ(to_json(from_json(good, "ck/state.json")), good);
  auto with = [&](const char* sec, const char* name, nlohmann::json v) {
    nlohmann::json j = good;
    j[sec][name] = std::move(v);
    return error_of([&] { from_json(j, "ck/state.json"); });
  };
  EXPECT_ERROR_HAS(with("model", "d_model", -64), "ck/state.json", "model.d_model must be > 0");
  EXPECT_ERROR_HAS(with("model", "d_model", "x"), "ck/state.json", "model.d_model expects an integer");
  EXPECT_ERROR_HAS(with("model", "d_model", 4294967360LL), "ck/state.json", "model.d_model", "[-2147483648");
  EXPECT_ERROR_HAS(with("model", "d_model", 64.5), "ck/state.json", "model.d_model", "integer");
  EXPECT_ERROR_HAS(with("run", "seed", -1), "ck/state.json", "run.seed", "[0, 18446744073709551615]");
  EXPECT_ERROR_HAS(with("model", "qk_norm", 1), "ck/state.json", "model.qk_norm", "true or false");
  EXPECT_ERROR_HAS(with("optim", "clip", nullptr), "ck/state.json", "optim.clip", "finite number");
  EXPECT_ERROR_HAS(with("optim", "name", 3), "ck/state.json", "optim.name", "string");
  EXPECT_ERROR_HAS(with("model", "n_heads", 3), "ck/state.json", "model.n_heads (3) must divide");
  EXPECT_ERROR_HAS(with("optim", "eps", -1.0), "ck/state.json", "optim.eps must be > 0");
  EXPECT_ERROR_HAS(error_of([&] { from_json(nlohmann::json::array(), "ck/state.json"); }), "ck/state.json", "object");
  {
    nlohmann::json j = good;
    j["model"] = 5;
    EXPECT_ERROR_HAS(error_of([&] { from_json(j, "ck/state.json"); }), "ck/state.json", "missing key model.");
  }
  // A CUDA run's checkpoint is readable on any build (sampling runs on the CPU).
  nlohmann::json cuda = good;
  cuda["run"]["device"] = "cuda";
  cuda["run"]["precision"] = "bf16";
  EXPECT_NO_THROW(from_json(cuda, "ck/state.json"));
  EXPECT_ERROR_HAS(with("run", "device", "tpu"), "ck/state.json", "run.device 'tpu' is not known");
}

// `ladder sample` reads the checkpoint's config through from_json: a damaged one is one clear line,
// not an allocation of petabytes or an internal assertion.
TEST(ConfigInput, SampleRefusesABadCheckpointConfig) {
  test::TempDir d("cfg-sample");
  test::make_word_salad_data(d.path, 400, 5);  // a 320-token tokenizer.model
  Config base = small();
  base.model.vocab_size = 320;
  const fs::path ck = d.path / "ck";
  fs::create_directories(ck);
  fs::copy_file(d.path / "data" / "tokenizer.model", ck / "tokenizer.model");
  auto sample_with = [&](const char* sec, const char* name, nlohmann::json v) {
    nlohmann::json cfg = to_json(base);
    cfg[sec][name] = std::move(v);
    nlohmann::json st = {{"format_version", kCheckpointVersion}, {"step", 1}, {"optimizer_steps", 1}, {"tokens_seen", 1}, {"threads", 1},
                         {"elapsed_s", 0.0}, {"loader", nlohmann::json::object()}, {"config", cfg}};
    write_file_atomic(ck / "state.json", st.dump(2));
    SampleOptions so;
    so.max_tokens = 1;
    return error_of([&] { sample_text(ck, so); });
  };
  const std::string state = (ck / "state.json").string();
  EXPECT_ERROR_HAS(sample_with("model", "d_model", -64), state.c_str(), "model.d_model must be > 0");
  EXPECT_ERROR_HAS(sample_with("model", "vocab_size", 0), state.c_str(), "model.vocab_size must be > 0");
  EXPECT_ERROR_HAS(sample_with("model", "d_model", "x"), state.c_str(), "model.d_model expects an integer");
  EXPECT_ERROR_HAS(sample_with("model", "vocab_size", 100), state.c_str(), "model.vocab_size is 100",
                   "tokenizer.model has 320 tokens");
  // Only the model section matters to sampling: training settings a later version checks more
  // strictly (here an eps it now refuses) do not stop it; it goes on to the weights (none here).
  const std::string later = sample_with("optim", "eps", -1.0);
  EXPECT_EQ(later.find("optim.eps"), std::string::npos) << later;
  EXPECT_NE(later.find("model.safetensors"), std::string::npos) << later;
}

// The configs, ladder rungs and committed ladder runs the project ships still pass every check (the
// device one aside: configs/gpu needs a CUDA build; from_json leaves that check out).
TEST(ConfigInput, ShippedConfigsStillValidate) {
  int n = 0;
  for (const char* sub : {"configs", "configs/gpu", "configs/ladder"})
    for (auto& e : fs::directory_iterator(fs::path(LADDER_SOURCE_DIR) / sub)) {
      if (e.path().extension() != ".yaml") continue;
      ++n;
      EXPECT_NO_THROW(from_json(to_json(load_config(e.path())), e.path().string())) << e.path();
    }
  EXPECT_GE(n, 10);
  // The resolved configs of the committed ladder runs (steps, batch and warmup as planned), each
  // still with its recorded config hash: a schema addition must leave stored runs their identity
  // (late keys, model/config.h), or `--reuse`, resuming a sweep into an old directory and the
  // results READMEs' reproduction commands would retrain them all.
  int runs = 0;
  for (auto& e : fs::recursive_directory_iterator(fs::path(LADDER_SOURCE_DIR) / "results")) {
    if (e.path().extension() != ".json" || e.path().parent_path().filename() != "results") continue;
    const auto j = nlohmann::json::parse(read_file(e.path()));
    if (!j.contains("config")) continue;
    ++runs;
    // Written before some keys existed: those take their defaults, as in a YAML file.
    nlohmann::json cfg = to_json(Config{});
    cfg.merge_patch(j["config"]);
    try {
      EXPECT_EQ(config_hash(from_json(cfg, e.path().string())), j.at("config_hash").get<std::string>()) << e.path();
    } catch (const Error& err) {
      ADD_FAILURE() << err.what();
    }
  }
  EXPECT_GT(runs, 100);
}

// Late keys (added after the config hash's first format) leave a run's identity unchanged while at
// their defaults, and a file written before one existed reads as its default; any other key stays
// required, and setting a late key changes the identity.
TEST(ConfigInput, LateKeysAtTheirDefaultsLeaveTheIdentityAsBefore) {
  EXPECT_TRUE(is_late_key("optim.lr_mults"));
  EXPECT_FALSE(is_late_key("optim.muonh_params"));
  EXPECT_FALSE(is_late_key("optim.no_such_key"));
  Config c;
  nlohmann::json before = to_json(c);
  before["optim"].erase("lr_mults");  // what a file written before the key holds
  EXPECT_EQ(identity_json(c), before);
  EXPECT_EQ(from_json(before, "old.json").optim.lr_mults, "");
  c.optim.lr_mults = "role:expert=4";
  EXPECT_EQ(identity_json(c)["optim"]["lr_mults"], "role:expert=4");
  EXPECT_EQ(identity_json(c), to_json(c));
  // The identity takes the parsed entries: blanks and the factor's spelling do not make another run.
  Config same = c, other = c;
  same.optim.lr_mults = " role:expert = 4.0 ";
  EXPECT_EQ(identity_json(same), identity_json(c));
  same.optim.lr_mults = "role:expert=4, *.q_proj.weight=0.50";
  EXPECT_EQ(identity_json(same)["optim"]["lr_mults"], "role:expert=4,*.q_proj.weight=0.5");
  other.optim.lr_mults = "role:expert=4.5";
  EXPECT_NE(identity_json(other), identity_json(c));
  // The selector lists and the lr keys likewise: entries joined by ", " and N / numbers printed
  // shortest, the forms stored runs were written in (those keep their hashes).
  Config lists = c;  // lr_mults set: to_json and the identity then hold the same keys
  lists.optim.muonh_params = "role:expert, role:attention";
  lists.optim.adamh_params = "role:gated_norm";
  lists.optim.muonh_lr = "8*auto";
  lists.optim.adamh_lr = "auto";
  lists.optim.adam_lr = "0.001";
  EXPECT_EQ(identity_json(lists), to_json(lists)) << "a stored form is already canonical";
  Config spelled = lists;
  spelled.optim.muonh_params = " role:expert ,,role:attention ";
  spelled.optim.adamh_params = "role:gated_norm,";
  spelled.optim.muonh_lr = " 8.0 * auto";
  spelled.optim.adamh_lr = "1*auto";
  spelled.optim.adam_lr = "1e-3";
  EXPECT_EQ(identity_json(spelled), identity_json(lists));
  for (auto [key, value] : {std::pair{"optim.muonh_params", "role:attention, role:expert"},
                            std::pair{"optim.adamh_params", ""}, std::pair{"optim.muonh_lr", "16*auto"},
                            std::pair{"optim.adamh_lr", ""}, std::pair{"optim.adam_lr", "0.002"},
                            std::pair{"optim.muon_lr", "0.001"}}) {
    Config changed = lists;
    apply_override(changed, std::string(key) + "=" + value);
    EXPECT_NE(identity_json(changed), identity_json(lists)) << key << "=" << value;
  }
  nlohmann::json older = to_json(Config{});
  older["optim"].erase("muonh_params");
  EXPECT_ERROR_HAS(test::error_of([&] { from_json(older, "old.json"); }), "old.json", "missing key optim.muonh_params");
}

// to_yaml's strings read back as written, whatever they hold.
TEST(ConfigInput, YamlRoundTripsAnyString) {
  test::TempDir d("cfg-yaml");
  const std::vector<std::string> paths = {
      "a\"b",           "back\\slash\\",   "c:\\data\\x",        "key: value # not a comment",
      "  lead and trail  ", "h\xc3\xa9llo \xe2\x9c\x93 \xe6\x97\xa5\xe6\x9c\xac", "tab\there\nnewline\r",
      "'single'",       "\"\"",            "null",               "*alias",
      "&anchor",        "- dash",          "{a: 1}",             "[x]",
      "%YAML",          "@at",             "`tick`",             "",
      "~",              "true",            "0x10",               "#hash",
      "\x01\x7f",       "trailing\\",      "\\\"",               "a\\nb",
  };
  int i = 0;
  for (const std::string& p : paths) {
    Config c = small();
    c.data.path = p;
    c.optim.adamw_params = "*.q_proj.weight," + p;
    const fs::path f = d.path / fmt::format("c{}.yaml", i++);
    write_file_atomic(f, to_yaml(c));
    Config back;
    ASSERT_NO_THROW(back = load_config(f)) << p << "\n" << to_yaml(c);
    EXPECT_EQ(back.data.path, p);
    EXPECT_EQ(back.optim.adamw_params, c.optim.adamw_params);
    EXPECT_EQ(to_json(back), to_json(c)) << p;
  }
}

TEST(ConfigInput, DuplicateAndNonNameKeysNameTheLines) {
  test::TempDir d("cfg-keys");
  auto load = [&](const std::string& name, const std::string& text) {
    write_file_atomic(d.path / name, text);
    return error_of([&] { load_config(d.path / name); });
  };
  EXPECT_ERROR_HAS(load("dup.yaml", "model:\n  d_model: 64\n  n_layers: 2\n  d_model: 128\n"), "dup.yaml:4",
                   "model.d_model", "lines 2 and 4");
  EXPECT_ERROR_HAS(load("dupsec.yaml", "model:\n  d_model: 64\nrun:\n  steps: 3\nmodel:\n  n_layers: 2\n"),
                   "dupsec.yaml:5", "'model'", "lines 1 and 5");
  EXPECT_ERROR_HAS(load("list.yaml", "model:\n  ? [a, b]\n  : 1\n"), "list.yaml:2", "key name", "section 'model'",
                   "list");
  EXPECT_ERROR_HAS(load("map.yaml", "? {a: 1}\n: 2\n"), "map.yaml:1", "key name", "mapping");
  EXPECT_ERROR_HAS(load("null.yaml", "model:\n  ~: 1\n"), "null.yaml:2", "key name");
}

TEST(ConfigInput, MoeLayersRefusesEmptyElements) {
  for (const char* layers : {"1,", ",1", "1,,2", "1, ", ""}) {
    Config c = small();
    c.model.moe_experts = 8;
    c.model.moe_top_k = 2;
    c.model.moe_layers = layers;
    EXPECT_ERROR_HAS(error_of([&] { validate(c); }), "small", "model.moe_layers", "empty element");
  }
  Config c = small();
  c.model.moe_experts = 8;
  c.model.moe_top_k = 2;
  c.model.moe_layers = "1, 3";
  EXPECT_NO_THROW(validate(c));
  EXPECT_EQ(c.model.n_moe_layers(), 2);
}

// RECIPE.md section 2: expert hidden I = ceil(d/2/128)*128 by default, exactly, also for odd d.
TEST(ConfigInput, DefaultExpertHiddenIsTheRecipesRounding) {
  ModelConfig m;
  for (auto [d, want] : {std::pair{64, 128}, {256, 128}, {257, 256}, {511, 256}, {513, 384}, {1024, 512}, {2048, 1024}}) {
    m.d_model = d;
    EXPECT_EQ(m.expert_ff(), want) << "d=" << d;
    EXPECT_EQ(m.expert_ff(), int(std::ceil(d / 2.0 / 128) * 128)) << "d=" << d;
  }
  m.moe_expert_ff = 96;
  EXPECT_EQ(m.expert_ff(), 96);
}

// optim.lr 0 with a group lr of its own would schedule that group by 0/0 (NaN weights at step 1).
TEST(ConfigInput, ZeroLrWithAGroupLrIsRefused) {
  Config c = small();
  c.optim.lr = 0;
  EXPECT_NO_THROW(validate(c));  // everything frozen: allowed
  c.optim.adam_lr = "0.001";
  EXPECT_ERROR_HAS(error_of([&] { validate(c); }), "small", "optim.lr is 0 and optim.adam_lr is '0.001'");
  c.optim.adam_lr = "auto";
  EXPECT_ERROR_HAS(error_of([&] { validate(c); }), "optim.adam_lr is 'auto'");
}

// `N*auto` lr keys: a positive finite multiple of the heuristic; anything else names the key.
TEST(ConfigInput, AutoLrMultiplesAreCheckedWhereTheyAreRead) {
  Config c = small();
  c.optim.muonh_lr = "4*auto";
  c.optim.adamh_lr = "0.5 * auto";
  EXPECT_NO_THROW(validate(c));
  EXPECT_EQ(auto_lr_multiplier("k", "auto").value_or(-1), 1.0);
  EXPECT_EQ(auto_lr_multiplier("k", " 2.5*auto").value_or(-1), 2.5);
  EXPECT_FALSE(auto_lr_multiplier("k", "0.01").has_value());
  EXPECT_FALSE(auto_lr_multiplier("k", "").has_value());
  for (const char* bad : {"-1*auto", "0*auto", "x*auto", "*auto", "inf*auto", "nan*auto"}) {
    c.optim.muonh_lr = bad;
    EXPECT_ERROR_HAS(error_of([&] { validate(c); }), "small", "optim.muonh_lr", bad, "N*auto", "> 0");
  }
  c.optim.muonh_lr = "4*autos";
  EXPECT_ERROR_HAS(error_of([&] { validate(c); }), "optim.muonh_lr", "N*auto", "'4*autos'");
  c.optim.muonh_lr = "4*auto";  // a run's config.yaml keeps it as given (and so does its hash)
  test::TempDir d("cfg-autolr");
  write_file_atomic(d.path / "c.yaml", to_yaml(c));
  EXPECT_EQ(load_config(d.path / "c.yaml").optim.muonh_lr, "4*auto");
}

}  // namespace
}  // namespace ladder
