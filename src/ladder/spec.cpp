#include "ladder/spec.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <set>

#include "core/error.h"
#include "core/yaml_keys.h"

namespace fs = std::filesystem;

namespace ladder {

int layers_for_width(int d) {
  return std::max(1, int(std::lround(d / (64.0 + 4.0 * std::log2(double(d)) - 9.0))));
}

namespace {

struct Reader {
  std::string file;
  std::string at(const YAML::Node& n) const { return fmt::format("{}:{}", file, n.Mark().line + 1); }

  template <class T>
  T scalar(const YAML::Node& n, const std::string& key, const char* what) const {
    if (!n.IsScalar()) fail("{}: {} expects {}", at(n), key, what);
    try {
      return n.as<T>();
    } catch (const YAML::Exception&) {
      fail("{}: {} expects {}, got '{}'", at(n), key, what, n.Scalar());
    }
  }
  int64_t integer(const YAML::Node& n, const std::string& key, int64_t min) const {
    double v = scalar<double>(n, key, "an integer");
    if (v != std::floor(v) || v < double(min)) fail("{}: {} expects an integer >= {}, got '{}'", at(n), key, min, n.Scalar());
    return int64_t(v);
  }
  double number(const YAML::Node& n, const std::string& key, double min) const {
    double v = scalar<double>(n, key, "a number");
    if (!(v >= min)) fail("{}: {} expects a number >= {}, got '{}'", at(n), key, min, n.Scalar());
    return v;
  }
  void check_keys(const YAML::Node& map, const std::string& where, std::initializer_list<const char*> known) const {
    for (auto it = map.begin(); it != map.end(); ++it) {
      std::string k = it->first.as<std::string>();
      bool ok = false;
      for (auto* kk : known) ok |= k == kk;
      if (!ok) {
        std::string list;
        for (auto* kk : known) list += (list.empty() ? "" : ", ") + std::string(kk);
        fail("{}: unknown key '{}' in {} (expected one of: {})", at(it->first), k, where, list);
      }
    }
  }
};

bool valid_name(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s)
    if (!(std::isalnum((unsigned char)c) || c == '_' || c == '-')) return false;
  return true;
}

// A `set:` mapping over the entries `into` already holds: a key given again takes the new value
// (in place); where `removable` (the spec extends another), a null removes the key, which `owner`
// must have set. `what` prefixes errors ("variant 'x': ").
void merge_set(const Reader& r, const YAML::Node& st, const std::string& what, const char* owner, bool removable,
               std::vector<SetEntry>& into) {
  for (auto it = st.begin(); it != st.end(); ++it) {
    const std::string key = it->first.as<std::string>();
    auto have = std::find_if(into.begin(), into.end(), [&](const SetEntry& e) { return e.key == key; });
    if (it->second.IsNull() && removable) {
      if (have == into.end())
        fail("{}: {}{}: null removes a key {} sets, and it does not set it", r.at(it->first), what, key, owner);
      into.erase(have);
      continue;
    }
    if (!it->second.IsScalar()) fail("{}: {}{} expects a scalar value", r.at(it->first), what, key);
    SetEntry e{key, it->second.Scalar(), r.at(it->first)};
    if (have != into.end()) *have = std::move(e);
    else into.push_back(std::move(e));
  }
}

// A variant's entry over what it inherits (`base`: the extended spec's variant of that name, or
// nullptr): baseline and stacks given here replace, set merges key by key (a null value removes
// the key), as a JSON merge patch would.
VariantSpec read_variant(const Reader& r, const std::string& name, const YAML::Node& v, int line,
                         const VariantSpec* base) {
  VariantSpec vs = base ? *base : VariantSpec{};
  vs.name = name;
  vs.where = fmt::format("{}:{}", r.file, line);
  if (!valid_name(name)) fail("{}: variant name '{}' must be 1-64 letters, digits, '_' or '-'", vs.where, name);
  if (v.IsNull()) return vs;
  if (!v.IsMap()) fail("{}: variant '{}' expects a mapping (baseline, set, stacks)", vs.where, name);
  r.check_keys(v, fmt::format("variant '{}'", name), {"baseline", "set", "stacks", "note"});
  if (auto b = v["baseline"]) vs.baseline = b.IsNull() ? "" : r.scalar<std::string>(b, "baseline", "a variant name");
  if (auto s = v["set"]) {
    if (!s.IsMap()) fail("{}: variant '{}': set expects a mapping of dotted config keys to values", r.at(s), name);
    merge_set(r, s, fmt::format("variant '{}': ", name), "the extended spec's variant", base != nullptr, vs.set);
  }
  if (auto s = v["stacks"]) {
    if (!s.IsSequence()) fail("{}: variant '{}': stacks expects a list of variant names", r.at(s), name);
    vs.stacks.clear();
    for (auto x : s) vs.stacks.push_back(r.scalar<std::string>(x, "stacks", "a variant name"));
  }
  return vs;
}

// Orders variants so every baseline precedes its dependents; errors on a missing baseline or a cycle.
std::vector<VariantSpec> order_variants(const std::string& file, const std::vector<VariantSpec>& vs) {
  std::map<std::string, const VariantSpec*> by;
  for (auto& v : vs) by[v.name] = &v;
  for (auto& v : vs)
    if (!v.baseline.empty() && !by.count(v.baseline))
      fail("{}: variant '{}' is measured against baseline '{}', which is not a variant of this spec", v.where, v.name,
           v.baseline);
  std::vector<VariantSpec> out;
  std::map<std::string, int> state;  // 0 new, 1 on the path, 2 done
  std::function<void(const VariantSpec&, std::vector<std::string>&)> visit = [&](const VariantSpec& v,
                                                                                 std::vector<std::string>& path) {
    if (state[v.name] == 2) return;
    path.push_back(v.name);
    if (state[v.name] == 1) {
      std::string cyc;
      auto start = std::find(path.begin(), path.end(), v.name);
      for (auto it = start; it != path.end(); ++it) cyc += (cyc.empty() ? "" : " -> ") + *it;
      fail("{}: the baselines form a cycle: {} (every chain of baselines must end at a variant without one)", v.where,
           cyc);
    }
    state[v.name] = 1;
    if (!v.baseline.empty()) visit(*by[v.baseline], path);
    state[v.name] = 2;
    path.pop_back();
    out.push_back(v);
  };
  for (auto& v : vs) {
    std::vector<std::string> path;
    visit(v, path);
  }
  if (!vs.empty() && std::none_of(vs.begin(), vs.end(), [](auto& v) { return v.baseline.empty(); }))
    fail("{}: no variant without a baseline: one variant (the root, e.g. dense) must have none", file);
  return out;
}

}  // namespace

namespace {

// Reads one spec file into `s`: first the spec it `extends` (recursively), then this file's keys
// over it, as a JSON merge patch: mappings (set, scales.rules, variants and their set, report,
// timing) merge key by key, a null value removes what the extended spec gave, anything else
// (base, scales.list, seeds, a variant's baseline and stacks) replaces. `chain`: the files being
// read, for cycles. The whole is checked by load_spec.
void read_spec_file(const fs::path& file, LadderSpec& s, std::vector<fs::path>& chain) {
  Reader r{file.string()};
  const YAML::Node root = load_yaml_file(file, "ladder spec");
  if (!root.IsMap()) fail("{}: expected a mapping (name, base, set, scales, seeds, variants, report)", file.string());
  reject_duplicate_keys(root, file.string());  // node["seeds"] would silently take the first
  r.check_keys(root, "the ladder spec",
               {"format", "name", "extends", "base", "set", "scales", "seeds", "variants", "pending", "report", "timing",
                "note"});
  if (auto f = root["format"]; f && r.integer(f, "format", 0) != 1)
    fail("{}: format {} is not supported (this build reads ladder spec format 1)", r.at(f), f.Scalar());
  chain.push_back(fs::weakly_canonical(file));
  const bool extends = bool(root["extends"]);  // a null then removes what the extended spec gave
  if (auto e = root["extends"]) {
    fs::path parent = r.scalar<std::string>(e, "extends", "a ladder spec path (relative to this file)");
    if (parent.is_relative()) parent = file.parent_path() / parent;
    if (std::find(chain.begin(), chain.end(), fs::weakly_canonical(parent)) != chain.end()) {
      std::string cycle;
      for (auto& f : chain) cycle += f.filename().string() + " -> ";
      fail("{}: extends {}: the specs extend each other in a cycle ({}{})", r.at(e), parent.string(), cycle,
           parent.filename().string());
    }
    if (!fs::is_regular_file(parent)) fail("{}: extends {}: no such file", r.at(e), parent.string());
    read_spec_file(parent, s, chain);
  }
  s.name = root["name"] ? r.scalar<std::string>(root["name"], "name", "a string") : file.stem().string();
  if (auto b = root["base"]) {
    s.base = r.scalar<std::string>(b, "base", "a config file path");
    if (s.base.is_relative()) s.base = file.parent_path() / s.base;
  }
  if (auto st = root["set"]) {
    if (!st.IsMap()) fail("{}: set expects a mapping of dotted config keys to values", r.at(st));
    merge_set(r, st, "set: ", "the extended spec", extends, s.base_set);
  }
  if (auto sc = root["scales"]) {
    if (!sc.IsMap()) fail("{}: scales expects a mapping with 'rules' and 'list'", r.at(sc));
    r.check_keys(sc, "scales", {"rules", "list"});
    if (auto ru = sc["rules"]) {
      if (!ru.IsMap()) fail("{}: scales.rules expects a mapping", r.at(ru));
      r.check_keys(ru, "scales.rules", {"head_dim", "kv_ratio", "ff_mult", "tokens_per_param", "target_steps", "min_batch",
                                        "max_batch", "checkpoints", "evals"});
      auto& R = s.rules;
      if (ru["head_dim"]) R.head_dim = int(r.integer(ru["head_dim"], "scales.rules.head_dim", 0));
      if (ru["kv_ratio"]) R.kv_ratio = int(r.integer(ru["kv_ratio"], "scales.rules.kv_ratio", 1));
      if (ru["ff_mult"]) R.ff_mult = r.number(ru["ff_mult"], "scales.rules.ff_mult", 0);
      if (ru["tokens_per_param"]) R.tokens_per_param = r.number(ru["tokens_per_param"], "scales.rules.tokens_per_param", 1e-9);
      if (ru["target_steps"]) R.target_steps = r.integer(ru["target_steps"], "scales.rules.target_steps", 1);
      if (ru["min_batch"]) R.min_batch = int(r.integer(ru["min_batch"], "scales.rules.min_batch", 1));
      if (ru["max_batch"]) R.max_batch = int(r.integer(ru["max_batch"], "scales.rules.max_batch", 1));
      if (ru["checkpoints"]) R.checkpoints = int(r.integer(ru["checkpoints"], "scales.rules.checkpoints", 1));
      if (ru["evals"]) R.evals = int(r.integer(ru["evals"], "scales.rules.evals", 1));
      if (R.min_batch > R.max_batch)
        fail("{}: scales.rules.min_batch ({}) > max_batch ({})", r.at(ru), R.min_batch, R.max_batch);
    }
    if (auto list = sc["list"]) {
      if (!list.IsSequence() || list.size() == 0)
        fail("{}: scales.list expects a non-empty list of scales (each at least {{d: WIDTH}})", r.at(list));
      s.scales.clear();
      std::set<int> widths;
      for (auto e : list) {
        ScaleSpec x;
        x.where = r.at(e);
        if (e.IsScalar()) {
          x.d = int(r.integer(e, "scales.list[]", 1));
        } else if (e.IsMap()) {
          r.check_keys(e, "a scale",
                       {"d", "layers", "heads", "kv_heads", "d_ff", "batch_size", "steps", "tokens", "variants"});
          if (!e["d"]) fail("{}: a scale needs its width d", r.at(e));
          x.d = int(r.integer(e["d"], "d", 1));
          if (e["layers"]) x.layers = int(r.integer(e["layers"], "layers", 1));
          if (e["heads"]) x.heads = int(r.integer(e["heads"], "heads", 1));
          if (e["kv_heads"]) x.kv_heads = int(r.integer(e["kv_heads"], "kv_heads", 1));
          if (e["d_ff"]) x.d_ff = int(r.integer(e["d_ff"], "d_ff", 1));
          if (e["batch_size"]) x.batch_size = int(r.integer(e["batch_size"], "batch_size", 1));
          if (e["steps"]) x.steps = r.integer(e["steps"], "steps", 1);
          if (e["tokens"]) x.tokens = r.integer(e["tokens"], "tokens", 1);
          if (auto vs = e["variants"]) {
            if (!vs.IsSequence() || vs.size() == 0)
              fail("{}: scale d={}: variants expects a non-empty list of variant names (those trained at this width)",
                   r.at(vs), x.d);
            for (auto n : vs) {
              x.variants.push_back(r.scalar<std::string>(n, "variants[]", "a variant name"));
              if (std::count(x.variants.begin(), x.variants.end(), x.variants.back()) > 1)
                fail("{}: scale d={}: variant '{}' is listed twice", r.at(n), x.d, x.variants.back());
            }
          }
          // tokens = steps x batch x seq_len x grad_accum: with steps given, tokens could only pick the
          // batch (rounded to a power of two and clamped), so the run would not train the tokens asked for.
          if (x.steps > 0 && x.tokens > 0)
            fail("{}: scale d={} gives both steps and tokens: give one (tokens: the budget, steps follow from it; steps: "
                 "with batch_size, tokens = steps x batch_size x seq_len x grad_accum)",
                 r.at(e), x.d);
        } else {
          fail("{}: a scale is a width or a mapping {{d, layers, heads, kv_heads, d_ff, batch_size, steps, tokens, "
               "variants}}",
               r.at(e));
        }
        if (!widths.insert(x.d).second) fail("{}: scale d={} is listed twice", r.at(e), x.d);
        s.scales.push_back(x);
      }
    }
  }

  auto seeds = root["seeds"];
  if (!seeds) {
  } else if (seeds.IsScalar()) {
    s.seeds = {uint64_t(r.integer(seeds, "seeds", 0))};
  } else if (seeds.IsSequence() && seeds.size() > 0) {
    s.seeds.clear();
    std::set<uint64_t> seen;
    for (auto x : seeds) {
      uint64_t v = uint64_t(r.integer(x, "seeds[]", 0));
      if (!seen.insert(v).second) fail("{}: seed {} is listed twice", r.at(x), v);
      s.seeds.push_back(v);
    }
  } else {
    fail("{}: seeds expects a non-empty list of integers", r.at(seeds));
  }

  // Variants and pending variants: an entry for a name the extended spec has merges into its
  // variant (null removes it: folded into its dependents below); a new name is a new variant.
  struct Removed {
    VariantSpec v;
    std::string where;  // the null's file:line
  };
  std::vector<Removed> removed;
  auto merge_variants = [&](const YAML::Node& vs, const char* what, std::vector<VariantSpec>& into) {
    if (!vs) return;
    if (!vs.IsMap()) fail("{}: {} expects a mapping of variant names to {{baseline, set, stacks}}", r.at(vs), what);
    for (auto it = vs.begin(); it != vs.end(); ++it) {
      const std::string name = it->first.as<std::string>();
      auto have = std::find_if(into.begin(), into.end(), [&](auto& v) { return v.name == name; });
      if (extends && it->second.IsNull()) {  // in a spec of its own, `dense:` is a variant without changes
        if (have == into.end())
          fail("{}: {}: {}: null removes a variant the extended spec has, and it has none of that name (write "
               "'{}: {{}}' for a new variant without changes)",
               r.at(it->first), what, name, name);
        removed.push_back({std::move(*have), r.at(it->first)});
        into.erase(have);
        continue;
      }
      VariantSpec v = read_variant(r, name, it->second, it->first.Mark().line + 1, have != into.end() ? &*have : nullptr);
      if (have != into.end()) *have = std::move(v);
      else into.push_back(std::move(v));
    }
  };
  merge_variants(root["variants"], "variants", s.variants);
  merge_variants(root["pending"], "pending", s.pending);
  // A removed variant's dependents keep their configs: a variant is its baseline's config plus its
  // own changes, so the removed one's changes fold into theirs (theirs win on a shared key), and
  // they are measured against its baseline instead (none: they become roots). A study of the top
  // rung of a chain then nulls the rungs below it rather than writing their changes out again.
  // Folded once the whole file is read, into the variants whose baseline still names the removed
  // one (a dependent given another baseline in this file keeps only its own changes), so the order
  // of the file's entries does not matter; a removed rung a remaining variant stacks is an error.
  for (size_t i = 0; i < removed.size(); ++i) {
    const VariantSpec& gone = removed[i].v;
    auto fold = [&](VariantSpec& v) {
      if (v.baseline != gone.name) return;
      std::vector<SetEntry> set;
      for (SetEntry e : gone.set)
        if (std::none_of(v.set.begin(), v.set.end(), [&](const SetEntry& x) { return x.key == e.key; })) {
          if (e.where.find(" (from removed ") == std::string::npos)
            e.where += fmt::format(" (from removed variant '{}')", gone.name);
          set.push_back(std::move(e));
        }
      set.insert(set.end(), v.set.begin(), v.set.end());
      v.set = std::move(set);
      v.baseline = gone.baseline;
    };
    for (auto* list : {&s.variants, &s.pending})
      for (auto& v : *list) {
        if (std::find(v.stacks.begin(), v.stacks.end(), gone.name) != v.stacks.end())
          fail("{}: {}: null removes a variant that '{}' ({}) stacks; remove '{}' too, or give its stacks without "
               "'{}'",
               removed[i].where, gone.name, v.name, v.where, v.name, gone.name);
        fold(v);
      }
    for (size_t j = i + 1; j < removed.size(); ++j) fold(removed[j].v);
  }
  if (auto rep = root["report"]) {
    if (!rep.IsMap()) fail("{}: report expects a mapping (E, alpha, mfu_estimate)", r.at(rep));
    // Retired, not unknown: specs written for earlier versions keep working, and say so once.
    if (rep["bootstrap"])
      fmt::print(stderr,
                 "warning: {}: report.bootstrap is no longer used and is ignored: intervals are Student's t over "
                 "per-seed estimates, which cover the true speedup with few seeds where bootstrap percentiles did "
                 "not (docs/ladder.md, \"Intervals\")\n",
                 r.at(rep["bootstrap"]));
    r.check_keys(rep, "report", {"E", "alpha", "bootstrap", "mfu_estimate"});
    if (rep["E"]) s.report.E = r.number(rep["E"], "report.E", 0);
    if (rep["alpha"]) s.report.alpha = r.number(rep["alpha"], "report.alpha", 1e-9);
    if (rep["mfu_estimate"]) s.report.mfu_estimate = r.number(rep["mfu_estimate"], "report.mfu_estimate", 1e-6);
  }
  if (auto tm = root["timing"]) {
    if (!tm.IsMap()) fail("{}: timing expects a mapping (rounds, steps, warmup)", r.at(tm));
    r.check_keys(tm, "timing", {"rounds", "steps", "warmup"});
    auto read = [&](const char* key, int min, int& out) {
      if (!tm[key]) return;
      const int64_t v = r.integer(tm[key], fmt::format("timing.{}", key), min);
      if (v > 10000) fail("{}: timing.{} expects at most 10000, got {}", r.at(tm[key]), key, v);
      out = int(v);
    };
    read("rounds", 0, s.timing.rounds);
    read("steps", 1, s.timing.steps);
    read("warmup", 1, s.timing.warmup);
  }
}

}  // namespace

LadderSpec load_spec(const fs::path& file) {
  LadderSpec s;
  std::vector<fs::path> chain;
  read_spec_file(file, s, chain);
  s.file = file;
  if (s.base.empty()) fail("{}: missing 'base' (the base config YAML, relative to the spec file)", file.string());
  if (s.scales.empty())
    fail("{}: missing scales.list (a non-empty list of scales, each at least {{d: WIDTH}})", file.string());
  std::sort(s.scales.begin(), s.scales.end(), [](auto& a, auto& b) { return a.d < b.d; });
  if (s.seeds.empty()) s.seeds = {1};
  if (s.variants.empty())
    fail("{}: variants expects at least one variant (the root, e.g. 'dense: {{}}')", file.string());
  s.variants = order_variants(file.string(), s.variants);
  std::map<std::string, const VariantSpec*> by;
  for (auto& v : s.variants) by[v.name] = &v;
  // A scale's variant list: real variants, each with its baseline and its stack's rungs (a variant
  // at a width its baseline lacks has nothing to be measured against there).
  for (auto& sc : s.scales) {
    auto listed = [&](const std::string& n) { return std::find(sc.variants.begin(), sc.variants.end(), n) != sc.variants.end(); };
    for (auto& n : sc.variants) {
      if (!by.count(n))
        fail("{}: scale d={} lists variant '{}', which is not a variant of this spec{}", sc.where, sc.d, n,
             std::any_of(s.pending.begin(), s.pending.end(), [&](auto& p) { return p.name == n; })
                 ? " (it is pending: checked, never run)"
                 : " (a spec that extends another and removes a variant gives scales.list again)");
      const VariantSpec& v = *by[n];
      if (!v.baseline.empty() && !listed(v.baseline))
        fail("{}: scale d={} lists '{}' but not its baseline '{}' (nothing to measure it against there)", sc.where,
             sc.d, n, v.baseline);
      for (auto& rung : v.stacks)
        if (by.count(rung) && !listed(rung))
          fail("{}: scale d={} lists '{}' but not '{}', a rung it stacks", sc.where, sc.d, n, rung);
    }
  }
  for (auto& v : s.variants) {
    for (auto& rung : v.stacks) {
      if (!by.count(rung)) fail("{}: variant '{}' stacks '{}', which is not a variant of this spec", v.where, v.name, rung);
      if (by[rung]->baseline != v.baseline)
        fail("{}: variant '{}' stacks '{}', whose baseline '{}' differs from its own '{}' (a stack is compared with "
             "the product of rungs measured against the same baseline)",
             v.where, v.name, rung, by[rung]->baseline, v.baseline);
    }
  }
  // Pending variants may refer to real and pending variants; their structure is checked the same way.
  const std::vector<VariantSpec> pending = std::move(s.pending);
  s.pending.clear();
  for (auto& p : pending)
    if (by.count(p.name)) fail("{}: pending variant '{}' is also a variant", p.where, p.name);
  if (!pending.empty()) {
    auto all = s.variants;
    all.insert(all.end(), pending.begin(), pending.end());
    auto ordered = order_variants(file.string(), all);
    for (auto& v : ordered)
      if (!by.count(v.name)) s.pending.push_back(v);
  }
  return s;
}

}  // namespace ladder
