#include "train/checkpoint.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <charconv>
#include <climits>
#include <fstream>
#include <functional>
#include <set>
#include <string_view>

#include "core/error.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "data/tokenizer.h"

namespace fs = std::filesystem;

namespace ladder {

namespace {

// Host staging between a MemorySpace and safetensors (which read and write host memory). On a host
// space the tensors are used where they are (no copy, as before); otherwise each is downloaded into
// a host buffer owned here (checkpoints are written between steps: the waits do not matter).
class HostStaging {
 public:
  explicit HostStaging(MemorySpace& space) : space_(space) {}
  const float* host(const float* p, size_t n) {
    if (space_.is_host()) return p;
    bufs_.emplace_back(n);
    space_.download(bufs_.back().data(), p, n * sizeof(float));
    return bufs_.back().data();
  }

 private:
  MemorySpace& space_;
  std::vector<std::vector<float>> bufs_;
};

size_t numel_of(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (auto s : shape) n *= size_t(s);
  return n;
}

// read_f32 (which checks name, dtype and shape, naming the file) into a tensor of `space`.
void read_into(const SafeTensors& st, const std::string& name, const std::vector<int64_t>& shape, MemorySpace& space,
               float* dst) {
  if (space.is_host()) return st.read_f32(name, shape, dst);
  std::vector<float> host(numel_of(shape));
  st.read_f32(name, shape, host.data());
  space.upload(dst, host.data(), host.size() * sizeof(float));
}

// A non-negative decimal integer that fits int64: digits only, no sign, space or suffix
// (std::stoll took "3xyz" as 3 and "-7" as -7, and threw a bare "stoll" on "abc").
std::optional<int64_t> parse_count(std::string_view s) {
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || v > uint64_t(INT64_MAX)) return std::nullopt;
  return int64_t(v);
}

// The step of a checkpoint directory's name: exactly "step_" and digits (checkpoint_dir's form;
// "step_00000003.bak" or "step_1_mybackup" are a user's copies, not checkpoints).
std::optional<int64_t> step_of_dir_name(const std::string& name) {
  if (name.rfind("step_", 0) != 0) return std::nullopt;
  return parse_count(std::string_view(name).substr(5));
}

// A non-negative integer field of state.json (get<int64_t>() would take 3.7 as 3 and -5 as -5).
int64_t count_field(const nlohmann::json& j, const char* key, const fs::path& f) {
  auto it = j.find(key);
  if (it == j.end()) fail("{}: corrupt checkpoint state: '{}' is missing", f.string(), key);
  const bool ok = it->is_number_unsigned() ? it->get<uint64_t>() <= uint64_t(INT64_MAX)
                                           : it->is_number_integer() && it->get<int64_t>() >= 0;
  if (!ok)
    fail("{}: corrupt checkpoint state: '{}' is {}, expected a non-negative integer", f.string(), key, it->dump());
  return it->get<int64_t>();
}

}  // namespace

fs::path checkpoint_dir(const fs::path& run_dir, int64_t step) {
  return run_dir / "checkpoints" / fmt::format("step_{:08d}", step);
}

void save_weights(const fs::path& file, const Transformer& model) {
  HostStaging host(model.backend());
  std::vector<TensorRef> t;
  for (auto& p : model.params()) t.push_back({p.name, DType::F32, p.shape, host.host(p.w, p.numel)});
  for (auto& b : model.buffers())  // MoE selection biases
    t.push_back({b.name, DType::F32, b.shape, host.host(b.w, b.numel)});
  save_safetensors(file, t, {{"format", "pt"}, {"producer", "ladder"}});
}

void load_weights(const fs::path& file, Transformer& model) {
  auto st = SafeTensors::open(file);
  for (auto& p : model.params()) read_into(st, p.name, p.shape, model.backend(), p.w);
  for (auto& b : model.buffers()) read_into(st, b.name, b.shape, model.backend(), b.w);
  for (auto& n : st.names()) {
    bool known = false;
    for (auto& p : model.params()) known |= p.name == n;
    for (auto& b : model.buffers()) known |= b.name == n;
    if (!known) fail("{}: tensor '{}' is not a parameter of this model (config mismatch?)", file.string(), n);
  }
}

// The complete checkpoints of a run, oldest first: directories named exactly step_<digits> that hold
// a state.json (written last but one, before the directory's rename). Anything else under
// checkpoints/ (a user's step_00000003.bak or step_1_mybackup copy, a save in progress) is neither
// resumed from nor pruned.
static std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& run_dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  fs::path dir = run_dir / "checkpoints";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (auto& e : fs::directory_iterator(dir)) {
    auto step = step_of_dir_name(e.path().filename().string());
    if (step && e.is_directory(ec) && fs::is_regular_file(e.path() / "state.json", ec)) out.emplace_back(*step, e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

// This machine's name, which save_checkpoint's temporaries carry: a pid says whether its writer is
// alive only on the host that wrote it (a run directory on a shared filesystem, a job requeued on
// another node while the old one still writes its last checkpoint).
std::string host_name() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  std::string h = host;
  std::replace(h.begin(), h.end(), '/', '-');
  return h.empty() ? "unknown-host" : h;
}

// Names of save_checkpoint's own directories beside the checkpoints: ".partial_step_N_<pid>@<host>"
// (being assembled) and ".replaced_step_N_<pid>@<host>" (an older copy of step N moved aside while
// the new one is renamed into place). Returns {step directory name, pid} for such a name written on
// this host; names from another host, whose pids mean nothing here, are not ours to judge. (Names
// without "@<host>", from before hosts were recorded, count as this host's.)
std::optional<std::pair<std::string, int64_t>> parse_temp_name(std::string name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0) return std::nullopt;
  if (const size_t at = name.rfind('@'); at != std::string::npos) {
    if (name.substr(at + 1) != host_name()) return std::nullopt;
    name.resize(at);
  }
  const size_t us = name.rfind('_');
  if (us == std::string::npos || us < prefix.size()) return std::nullopt;
  std::string step_name = name.substr(prefix.size(), us - prefix.size());
  auto pid = parse_count(std::string_view(name).substr(us + 1));
  if (!step_of_dir_name(step_name) || !pid || *pid <= 0 || *pid > INT32_MAX) return std::nullopt;
  return std::pair{step_name, *pid};
}

// Whether the process that wrote a temporary directory is gone. Our own pid counts as gone: saves are
// not concurrent within a process, so its temporaries are leftovers of a save that failed. A live
// process (including another user's: EPERM) keeps its directory; a pid reused since only delays the
// clean-up until that process exits.
bool writer_gone(int64_t pid) {
  if (pid == ::getpid()) return true;
  return ::kill(pid_t(pid), 0) != 0 && errno == ESRCH;
}

// Test hook (checkpoint.h): called at named points of save_checkpoint.
std::function<void(std::string_view)> g_save_hook;

// Removes what killed saves left: ".partial_*" directories, and ".replaced_*" ones whose checkpoint
// is in place; a ".replaced_step_N" whose step_N is missing (a save killed between its two renames)
// is renamed back, since it is then the only copy of that checkpoint. Only directories of writers
// that are gone are touched. Best effort: a directory that cannot be removed is left for next time.
void tidy_checkpoints(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  std::vector<fs::path> entries;
  for (auto& e : fs::directory_iterator(dir, ec)) entries.push_back(e.path());
  for (const fs::path& p : entries) {
    const std::string name = p.filename().string();
    if (!fs::is_directory(fs::symlink_status(p, ec))) continue;
    if (auto t = parse_temp_name(name, ".partial_"); t && writer_gone(t->second)) {
      fs::remove_all(p, ec);
    } else if (auto r = parse_temp_name(name, ".replaced_"); r && writer_gone(r->second)) {
      const fs::path step_dir = dir / r->first;
      if (!fs::exists(fs::symlink_status(step_dir, ec)) && fs::is_regular_file(p / "state.json", ec)) {
        fs::rename(p, step_dir, ec);
        if (!ec) fsync_dir(dir);  // the restored checkpoint survives a crash too
      } else {
        fs::remove_all(p, ec);
      }
    }
  }
}

// Removes a directory unless release()d: a save that fails leaves nothing beside the checkpoints.
class RemoveOnError {
 public:
  explicit RemoveOnError(fs::path p) : p_(std::move(p)) {}
  ~RemoveOnError() {
    std::error_code ec;
    if (!p_.empty()) fs::remove_all(p_, ec);
  }
  void release() { p_.clear(); }

 private:
  fs::path p_;
};

}  // namespace

void set_checkpoint_save_hook_for_tests(std::function<void(std::string_view)> hook) { g_save_hook = std::move(hook); }

void recover_checkpoints(const fs::path& run_dir) { tidy_checkpoints(run_dir / "checkpoints"); }

fs::path save_checkpoint(const fs::path& run_dir, const CheckpointState& st, const Transformer& model,
                         Optimizer& opt, const fs::path& tokenizer_model, int keep, const HostStateTensors* others) {
  // A step count the optimizer does not share would make the checkpoint unloadable (the load checks
  // they agree): refuse to write it.
  LADDER_ASSERT(opt.steps_taken() == st.step);
  LADDER_ASSERT(keep >= 1);
  const fs::path final_dir = checkpoint_dir(run_dir, st.step), parent = final_dir.parent_path();
  const std::string name = final_dir.filename().string();
  std::error_code ec;
  // A new checkpoints/ directory's own name must be durable too, or a crash could lose every
  // checkpoint whose rename below was synced.
  create_directories_durably(parent);
  tidy_checkpoints(parent);
  const fs::path tmp = parent / fmt::format(".partial_{}_{}@{}", name, ::getpid(), host_name());
  fs::create_directory(tmp, ec);
  if (ec) fail("{}: cannot create checkpoint directory: {}", tmp.string(), ec.message());
  RemoveOnError tmp_guard(tmp);

  save_weights(tmp / "model.safetensors", model);
  HostStaging host(opt.memory());
  std::vector<TensorRef> os;
  for (auto& s : opt.state()) {
    if (s.data) {
      os.push_back({s.name, DType::F32, s.shape, host.host(s.data, s.numel())});
      continue;
    }
    // Another rank's share of a sharded optimizer: the caller gathered it.
    const auto it = others ? others->find(s.name) : HostStateTensors::const_iterator{};
    LADDER_ASSERT(others && it != others->end() && it->second.size() == s.numel());
    os.push_back({s.name, DType::F32, s.shape, it->second.data()});
  }
  save_safetensors(tmp / "optimizer.safetensors", os, {{"optimizer_steps", std::to_string(opt.steps_taken())}});
  nlohmann::json j = {{"format_version", kCheckpointVersion}, {"step", st.step},
                      {"tokens_seen", st.tokens_seen},       {"threads", st.threads}, {"world", st.world},
                      {"optimizer_steps", opt.steps_taken()}, {"elapsed_s", st.elapsed_s},
                      {"loader", st.loader},                 {"config", st.config}};
  write_file_atomic(tmp / "state.json", j.dump(2));
  // Without one (data prepared elsewhere) the checkpoint has none: the trainer warns at the start,
  // and checkpoint_tokenizer says what is missing when `ladder sample` needs it.
  if (!tokenizer_model.empty() && fs::exists(tokenizer_model))
    write_file_atomic(tmp / "tokenizer.model", read_file(tokenizer_model));
  fsync_dir(tmp);
  if (g_save_hook) g_save_hook("written");

  // An existing directory of this step is moved aside, not removed, until the new one is in place:
  // killed in between, the old copy survives as .replaced_* and recover_checkpoints (at the next
  // save or training start) renames it back.
  const fs::path aside = parent / fmt::format(".replaced_{}_{}@{}", name, ::getpid(), host_name());
  const bool replacing = fs::exists(fs::symlink_status(final_dir, ec));
  if (replacing) {
    fs::rename(final_dir, aside, ec);
    if (ec) fail("{}: cannot move the existing checkpoint aside: {}", final_dir.string(), ec.message());
    if (g_save_hook) g_save_hook("moved-aside");
  }
  fs::rename(tmp, final_dir, ec);
  if (ec) {
    std::error_code ec2;
    if (replacing) fs::rename(aside, final_dir, ec2);
    fail("{}: cannot rename checkpoint into place: {}", final_dir.string(), ec.message());
  }
  tmp_guard.release();
  fsync_dir(parent);
  if (replacing) fs::remove_all(aside, ec);

  // Prune the oldest complete checkpoints beyond `keep`, never the one just written.
  auto all = list_checkpoints(run_dir);
  for (size_t i = 0; i + size_t(keep) < all.size(); ++i)
    if (all[i].second != final_dir) fs::remove_all(all[i].second, ec);
  return final_dir;
}

std::optional<fs::path> latest_checkpoint(const fs::path& run_dir) {
  auto all = list_checkpoints(run_dir);
  if (all.empty()) return std::nullopt;
  return all.back().second;
}

std::optional<fs::path> previous_checkpoint(const fs::path& ckpt_dir) {
  const auto step = step_of_dir_name(ckpt_dir.filename().string());
  if (!step) return std::nullopt;
  std::optional<fs::path> prev;
  for (auto& [s, p] : list_checkpoints(ckpt_dir.parent_path().parent_path()))
    if (s < *step) prev = p;
  return prev;
}

fs::path resolve_checkpoint(const fs::path& path) {
  if (fs::exists(path / "state.json")) return path;
  if (auto c = latest_checkpoint(path)) return *c;
  fail("{}: not a checkpoint directory (no state.json) nor a run directory with checkpoints/step_*", path.string());
}

CheckpointState read_checkpoint_state(const fs::path& dir) {
  fs::path f = dir / "state.json";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(f));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: corrupt checkpoint state (not valid JSON: {})", f.string(), e.what());
  }
  if (!j.is_object() || !j.contains("format_version"))
    fail("{}: corrupt checkpoint state (no format_version)", f.string());
  if (j["format_version"] != kCheckpointVersion)
    fail("{}: checkpoint format_version {} is not supported (expected {})", f.string(), j["format_version"].dump(),
         kCheckpointVersion);
  CheckpointState st;
  st.step = count_field(j, "step", f);
  st.tokens_seen = count_field(j, "tokens_seen", f);
  st.optimizer_steps = count_field(j, "optimizer_steps", f);
  const int64_t threads = count_field(j, "threads", f);
  if (threads > INT32_MAX) fail("{}: corrupt checkpoint state: 'threads' is {}, expected an int", f.string(), threads);
  st.threads = int(threads);
  if (j.contains("world")) {
    const int64_t world = count_field(j, "world", f);
    if (world < 1 || world > INT32_MAX)
      fail("{}: corrupt checkpoint state: 'world' is {}, expected a rank count of at least 1", f.string(), world);
    st.world = int(world);
  }
  try {
    st.elapsed_s = j.at("elapsed_s").get<double>();
    st.loader = j.at("loader");
    st.config = j.at("config");
  } catch (const nlohmann::json::exception& e) {
    fail("{}: corrupt checkpoint state: {}", f.string(), e.what());
  }
  // The trainer steps the optimizer once per step, and names the directory after the step: files
  // that disagree were mixed from different checkpoints (or edited), and would resume a different
  // schedule position, bias correction or data position than the weights were trained to.
  if (st.optimizer_steps != st.step)
    fail("{}: corrupt checkpoint state: optimizer_steps is {} but step is {} (they must be equal)", f.string(),
         st.optimizer_steps, st.step);
  if (auto n = step_of_dir_name(dir.filename().string()); n && *n != st.step)
    fail("{}: corrupt checkpoint state: step is {} but the directory is {} (step {})", f.string(), st.step,
         dir.filename().string(), *n);
  return st;
}

Config checkpoint_model_config(const fs::path& dir, const CheckpointState& st) {
  const std::string state_file = (dir / "state.json").string();
  if (!st.config.is_object() || !st.config.contains("model") || !st.config["model"].is_object())
    fail("{}: the checkpoint's config has no model section", state_file);
  nlohmann::json model_only = to_json(Config{});
  model_only["model"] = st.config["model"];
  Config cfg = from_json(model_only, state_file);
  // Training resolves vocab_size 0 from the data before the first checkpoint, so a checkpoint's is
  // the logits' width; 0 would leave nothing to compute.
  if (cfg.model.vocab_size <= 0)
    fail("{}: model.vocab_size must be > 0 in a checkpoint's config (training resolves it from the data), got {}",
         state_file, cfg.model.vocab_size);
  return cfg;
}

fs::path checkpoint_tokenizer(const fs::path& dir) {
  const fs::path f = dir / "tokenizer.model";
  const CheckpointState st = read_checkpoint_state(dir);
  // The hash the training data was encoded with (0: not recorded).
  uint64_t want = 0;
  if (auto h = st.loader.find("tokenizer_hash"); h != st.loader.end() && h->is_number_unsigned()) want = h->get<uint64_t>();
  std::error_code ec;
  if (!fs::is_regular_file(f, ec)) {
    std::string data = "its data directory";
    if (auto d = st.config.find("data"); d != st.config.end() && d->is_object() && d->contains("path") &&
                                         (*d)["path"].is_string())
      data = fmt::format("its data directory {}", (*d)["path"].get<std::string>());
    fail("{}: missing: the checkpoint has no tokenizer ({} had no tokenizer.model when it was saved); copy there "
         "the tokenizer.model the data was encoded with{}",
         f.string(), data, want ? fmt::format(" (hash {:016x})", want) : "");
  }
  if (want) {
    const uint64_t h = data::tokenizer_file_hash(f);
    if (h != want)
      fail("{}: tokenizer hash {:016x} is not the one the training data was encoded with ({:016x}, state.json "
           "loader.tokenizer_hash)", f.string(), h, want);
  }
  return f;
}

void load_checkpoint_weights(const fs::path& dir, Transformer& model, Optimizer* opt) {
  load_weights(dir / "model.safetensors", model);
  if (!opt) return;
  fs::path f = dir / "optimizer.safetensors";
  auto st = SafeTensors::open(f);
  // The step counter first: nothing of the optimizer is touched when it is bad. It sets Adam's bias
  // correction, so it must be a count and the one state.json (and the directory name) records.
  auto it = st.metadata().find("optimizer_steps");
  if (it == st.metadata().end()) fail("{}: missing metadata 'optimizer_steps'", f.string());
  auto steps = parse_count(it->second);
  if (!steps)
    fail("{}: metadata 'optimizer_steps' is \"{}\", expected a non-negative integer", f.string(), it->second);
  const CheckpointState state = read_checkpoint_state(dir);
  if (*steps != state.optimizer_steps)
    fail("{}: metadata 'optimizer_steps' is {} but {} records {} (files from different checkpoints?)", f.string(),
         *steps, (dir / "state.json").string(), state.optimizer_steps);
  // Like load_weights: a tensor this optimizer does not have means a different optimizer or grouping
  // wrote the file (its state would be silently dropped).
  std::set<std::string> known;
  for (auto& s : opt->state()) known.insert(s.name);
  for (auto& n : st.names())
    if (!known.count(n))
      fail("{}: tensor '{}' is not a state tensor of this optimizer (optim.name or optim.*_params mismatch?)",
           f.string(), n);
  for (auto& s : opt->state())
    if (s.data) read_into(st, s.name, s.shape, opt->memory(), s.data);
  opt->set_steps_taken(*steps);
}

}  // namespace ladder
