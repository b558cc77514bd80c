#include "ladder/plan.h"

#include <fmt/ranges.h>
#include <xxhash.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <regex>

#include "core/error.h"
#include "data/loader.h"
#include "data/shard.h"
#include "model/flops.h"
#include "optim/optimizer.h"
#include "train/machine.h"
#include "train/metrics.h"
#include "train/trainer.h"

namespace ladder {

std::string config_hash(const Config& cfg) {
  // Keys sorted: the hash does not depend on schema order; late keys at their defaults left out.
  std::string s = identity_json(cfg).dump();
  return fmt::format("{:016x}", XXH64(s.data(), s.size(), 0));
}

std::string data_identity(const std::filesystem::path& data_dir) {
  const data::DataMeta m = data::read_meta(data_dir);
  // The content: each shard's header records the XXH64 of its tokens (data/shard.h), read here
  // without mapping or checking the shard (the trainer does that when it opens it).
  std::vector<uint64_t> sums;
  for (const auto* list : {&m.train_shards, &m.val_shards})
    for (const auto& f : *list) {
      char h[data::kShardHeaderBytes];
      std::ifstream in(f, std::ios::binary);
      if (!in.read(h, sizeof h) || std::memcmp(h, data::kShardMagic, sizeof data::kShardMagic) != 0)
        fail("{}: not a readable Ladder token shard (expected a 64-byte header starting 'LDRTOKS1'); prepare the "
             "data again with `ladder data`",
             f.string());
      uint64_t sum = 0;
      std::memcpy(&sum, h + 24, sizeof sum);  // little endian, as written (x86-64, aarch64)
      sums.push_back(sum);
    }
  return fmt::format("tok{:016x} vocab {} eod {} train {} val {} tokens {:016x}", m.tokenizer_hash, m.vocab_size,
                     m.eod_id, m.train_tokens, m.val_tokens, XXH64(sums.data(), sums.size() * sizeof(uint64_t), 0));
}

namespace {

int64_t pow2_round(double x) {
  if (x <= 1) return 1;
  return int64_t(1) << int64_t(std::lround(std::log2(x)));
}

// "N*d" (or "d") means N times the scale's width, so a variant can scale with the model
// (e.g. model.d_ff: 6*d); other values pass through unchanged.
std::string substitute_width(const std::string& v, int d) {
  static const std::regex re(R"(^\s*(?:([0-9]*\.?[0-9]+)\s*\*\s*)?d\s*$)");
  std::smatch m;
  if (!std::regex_match(v, m, re)) return v;
  double f = m[1].matched ? std::stod(m[1].str()) : 1.0;
  double x = f * d;
  if (x != std::floor(x)) return fmt::format("{}", x);
  return std::to_string(int64_t(x));
}

const VariantSpec* find_variant(const LadderSpec& spec, const std::string& name) {
  for (const auto* list : {&spec.variants, &spec.pending})
    for (const auto& v : *list)
      if (v.name == name) return &v;
  return nullptr;
}

// `optim.beta2: auto` in a spec: the recipe's beta2 for each run's tokens per step (recipe_beta2),
// which a ladder picks per rung (scales.rules batch sizes), so that no single number can be written.
// The config holds a number: `auto` is noted here and resolved once the run's batch is known.
// Returns whether `key = value` was such a setting (or a number replacing one: `beta2_auto` off).
bool note_auto_beta2(const std::string& key, const std::string& value, bool& beta2_auto) {
  if (key != "optim.beta2") return false;
  beta2_auto = trim_blanks(value) == "auto";
  return beta2_auto;
}

// Applies a variant's changes on top of its baseline's (recursively: a rung measured against MoE V1
// is MoE V1 plus its own switch); unknown keys and bad values become one line naming spec and
// variant. load_spec() has already rejected missing baselines and cycles.
void apply_variant(Config& c, const LadderSpec& spec, const VariantSpec& v, int d, bool& beta2_auto) {
  if (const VariantSpec* b = v.baseline.empty() ? nullptr : find_variant(spec, v.baseline))
    apply_variant(c, spec, *b, d, beta2_auto);
  for (auto& [k, val, where] : v.set) {
    if (note_auto_beta2(k, val, beta2_auto)) continue;
    try {
      apply_override(c, k + "=" + substitute_width(val, d));
    } catch (const Error& e) {
      fail("{}: variant '{}': {}", where, v.name, e.what());
    }
  }
}

}  // namespace

Plan make_plan(const LadderSpec& spec, double peak) {
  Plan plan;
  plan.spec = spec;
  const std::string sf = spec.file.string();
  Config base;
  bool base_beta2_auto = false;
  try {
    base = load_config(spec.base, {});
  } catch (const Error& e) {
    fail("{}: base config: {}", sf, e.what());
  }
  for (auto& [k, val, where] : spec.base_set) {
    try {
      if (note_auto_beta2(k, val, base_beta2_auto)) continue;
      apply_override(base, k + "=" + val);
    } catch (const Error& e) {
      fail("{}: set: {}", where, e.what());
    }
  }
  const auto& R = spec.rules;

  // Per scale: the base config at that width (shared by every variant), then each variant on top.
  for (const ScaleSpec& s : spec.scales) {
    auto bad_scale = [&](const std::string& why) {
      fail("{}: scale d={} cannot be built: {}", s.where, s.d, why);
    };
    Config c = base;
    c.source = fmt::format("{} (scale d={})", sf, s.d);
    auto& m = c.model;
    m.d_model = s.d;
    m.n_layers = s.layers > 0 ? s.layers : layers_for_width(s.d);
    if (s.heads > 0) {
      m.n_heads = s.heads;
    } else if (R.head_dim > 0) {
      if (s.d % R.head_dim != 0) bad_scale(fmt::format("scales.rules.head_dim {} does not divide d", R.head_dim));
      m.n_heads = s.d / R.head_dim;
    }
    m.head_dim = 0;
    if (s.d % m.n_heads != 0) bad_scale(fmt::format("{} heads do not divide d", m.n_heads));
    if (s.kv_heads > 0) {
      m.n_kv_heads = s.kv_heads;
    } else if (R.head_dim > 0 || s.heads > 0) {
      if (m.n_heads % R.kv_ratio != 0)
        bad_scale(fmt::format("scales.rules.kv_ratio {} does not divide the {} heads", R.kv_ratio, m.n_heads));
      m.n_kv_heads = m.n_heads / R.kv_ratio;
    }
    if (s.d_ff > 0) m.d_ff = s.d_ff;
    else if (R.ff_mult > 0) m.d_ff = int(std::lround(R.ff_mult * s.d));
    try {
      validate(c);
      resolve_data(c);
    } catch (const Error& e) {
      bad_scale(e.what());
    }
    // Token budget and batch: the same for every variant of this scale.
    const int64_t seq_accum = int64_t(m.seq_len) * c.run.grad_accum;
    const ParamCount pc = count_params(m);  // budget counts the blocks only: no embedding, no LM head (as C)
    double tokens = s.tokens > 0 ? double(s.tokens) : R.tokens_per_param * double(pc.non_embedding() - pc.head);
    int64_t batch = s.batch_size;
    if (batch == 0) {
      const double target = s.steps > 0 ? double(s.steps) : double(R.target_steps);
      batch = std::clamp<int64_t>(pow2_round(tokens / (target * double(seq_accum))), R.min_batch, R.max_batch);
    }
    int64_t steps = s.steps > 0 ? s.steps : std::max<int64_t>(1, int64_t(std::ceil(tokens / double(batch * seq_accum))));
    c.run.batch_size = int(batch);
    c.run.steps = steps;
    c.run.ckpt_every = std::max<int64_t>(1, (steps + R.checkpoints - 1) / R.checkpoints);
    c.run.eval_every = std::max<int64_t>(1, steps / R.evals);
    c.run.log_every = std::min<int64_t>(c.run.log_every, std::max<int64_t>(1, steps / 20));
    c.run.keep_checkpoints = 1;  // only the newest is needed to resume; keeps a ladder's disk use small
    nlohmann::json scale = {{"d", s.d},         {"layers", m.n_layers},   {"heads", m.n_heads},
                            {"kv_heads", m.kv_heads()}, {"d_ff", m.ff()}, {"batch_size", batch},
                            {"steps", steps},   {"tokens", steps * batch * seq_accum}};

    for (const VariantSpec& v : spec.variants) {
      if (!s.variants.empty() && std::find(s.variants.begin(), s.variants.end(), v.name) == s.variants.end()) continue;
      Config cv = c;
      bool beta2_auto = base_beta2_auto;
      apply_variant(cv, spec, v, s.d, beta2_auto);
      if (beta2_auto)
        cv.optim.beta2 = recipe_beta2(run_shape(cv).tokens_per_step);  // one process: the sweep's runs
      try {
        validate(cv);
        resolve_data(cv);
      } catch (const Error& e) {
        fail("{}: variant '{}' at scale d={}: {}", v.where, v.name, s.d, e.what());
      }
      const std::string data_id = data_identity(cv.data.path);  // read (and checked) by resolve_data just now
      // A ladder's result is the final validation loss: without evaluations a run would train to
      // its end and then have nothing to record (found before training, not after).
      if (cv.run.eval_batches <= 0)
        fail("{}: variant '{}' at scale d={}: run.eval_batches is {} (a ladder needs validation losses: "
             "expected > 0)",
             v.where, v.name, s.d, cv.run.eval_batches);
      for (uint64_t seed : spec.seeds) {
        PlannedRun r;
        r.variant = v.name;
        r.baseline = v.baseline;
        r.stacks = v.stacks;
        r.d = s.d;
        r.seed = seed;
        r.cfg = cv;
        r.cfg.run.seed = seed;
        r.cfg.source = fmt::format("{} ({} d={} seed={})", sf, v.name, s.d, seed);
        r.id = run_id(v.name, s.d, seed);
        r.config_hash = config_hash(r.cfg);
        r.data_id = data_id;
        const auto& rc = r.cfg.run;
        r.tokens = rc.steps * int64_t(rc.batch_size) * rc.grad_accum * r.cfg.model.seq_len;
        r.compute = run_compute(r.cfg.model, double(r.tokens));
        r.flops_with_head = flops_per_token(r.cfg.model).train(true) * double(r.tokens);
        r.scale = scale;
        r.scale["tokens"] = r.tokens;
        plan.runs.push_back(std::move(r));
      }
    }
  }
  // Pending variants: apply their changes to the base to tell the user which keys this build lacks.
  for (const VariantSpec& v : spec.pending) {
    Config c = base;
    std::vector<std::string> unknown, bad;  // keys this build lacks; known keys with values it refuses
    for (auto& [k, val, where] : v.set) {
      bool beta2_auto = false;
      if (note_auto_beta2(k, val, beta2_auto)) continue;
      if (!is_config_key(k)) {
        unknown.push_back(k);
        continue;
      }
      try {
        apply_override(c, k + "=" + substitute_width(val, spec.scales.front().d));
      } catch (const Error& e) {
        bad.push_back(e.what());
      }
    }
    std::string line = fmt::format("pending variant '{}' (vs {}): ", v.name, v.baseline);
    if (unknown.empty() && bad.empty())
      line += "every key is known to this build: move it to 'variants' to run it";
    else if (!unknown.empty())
      line += fmt::format("not run, this build lacks {}", fmt::join(unknown, ", "));
    if (!bad.empty()) line += fmt::format("{}{}", unknown.empty() ? "" : "; and ", fmt::join(bad, "; "));
    plan.pending.push_back(line);
  }
  plan.peak_gflops = peak > 0 ? peak : sgemm_gflops();
  for (auto& r : plan.runs) r.est_seconds = r.flops_with_head / (plan.peak_gflops * 1e9 * spec.report.mfu_estimate);
  return plan;
}

std::string run_id(const std::string& variant, int d, uint64_t seed) { return fmt::format("{}-d{}-s{}", variant, d, seed); }

bool parse_run_id(const std::string& id, std::string& variant, int& d) {
  static const std::regex re(R"(^(.+)-d([0-9]+)-s[0-9]+$)");  // the variant may hold '-' (greedy, anchored)
  std::smatch m;
  if (!std::regex_match(id, m, re)) return false;
  variant = m[1].str();
  d = std::stoi(m[2].str());
  return true;
}

std::string format_plan(const Plan& p) {
  std::string out = fmt::format("ladder '{}' ({}): {} runs = {} variants x {} scales x {} seeds{}\n", p.spec.name,
                                p.spec.file.string(), p.runs.size(), p.spec.variants.size(), p.spec.scales.size(),
                                p.spec.seeds.size(),
                                std::any_of(p.spec.scales.begin(), p.spec.scales.end(),
                                            [](const ScaleSpec& s) { return !s.variants.empty(); })
                                    ? " (some scales train only the variants they list)"
                                    : "");
  out += fmt::format("{:<28} {:>5} {:>3} {:>3} {:>5} {:>6} {:>6} {:>8} {:>9} {:>9} {:>8}\n", "run", "d", "L", "H",
                     "d_ff", "batch", "steps", "tokens", "C", "C+head", "est");
  double total_c = 0, total_s = 0;
  for (auto& r : p.runs) {
    out += fmt::format("{:<28} {:>5} {:>3} {:>3} {:>5} {:>6} {:>6} {:>8} {:>9} {:>9} {:>8}\n", r.id, r.d,
                       r.cfg.model.n_layers, r.cfg.model.n_heads, r.cfg.model.ff(), r.cfg.run.batch_size,
                       r.cfg.run.steps, human_count(double(r.tokens)), human_count(r.compute),
                       human_count(r.flops_with_head), format_duration(r.est_seconds));
    total_c += r.flops_with_head;
    total_s += r.est_seconds;
  }
  out += fmt::format("total: {} FLOPs (with LM head), estimated {} at {:.0f}% MFU of {:.1f} GFLOP/s sgemm\n",
                     human_count(total_c), format_duration(total_s), 100 * p.spec.report.mfu_estimate, p.peak_gflops);
  for (auto& l : p.pending) out += l + "\n";
  return out;
}

}  // namespace ladder
