#include "ladder/store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "core/fileio.h"

namespace fs = std::filesystem;

namespace ladder {

namespace {

void check_version(const nlohmann::json& j, const fs::path& file, const char* kind) {
  if (!j.is_object() || j.value("format", "") != kind)
    fail("{}: not a Ladder {} file (expected \"format\": \"{}\")", file.string(), kind, kind);
  int v = j.value("version", -1);
  if (v != kResultsVersion)
    fail("{}: written by an incompatible Ladder version (results format version {}, this build reads {}); use another "
         "--out directory",
         file.string(), v, kResultsVersion);
}

// The fields the report reads, with their types: a result edited by hand or written by a broken
// tool fails here naming the file and the field, not later as a bare JSON library error. A diverged
// run has no losses or throughput.
void check_result_fields(const nlohmann::json& j, const fs::path& file) {
  auto kind = [](const nlohmann::json& x) -> std::string {
    if (x.is_null()) return "null";
    if (x.is_string()) return "a string";
    if (x.is_boolean()) return "a boolean";
    if (x.is_number()) return "a number";
    return x.is_array() ? "an array" : "an object";
  };
  auto need = [&](const char* key, const char* what, auto ok, bool required) {
    if (!j.contains(key)) {
      if (required) fail("{}: result field '{}' is missing (expected {})", file.string(), key, what);
      return;
    }
    if (!ok(j[key])) fail("{}: result field '{}' is {}, expected {}", file.string(), key, kind(j[key]), what);
  };
  auto str = [](const nlohmann::json& x) { return x.is_string(); };
  auto num = [](const nlohmann::json& x) { return x.is_number(); };
  auto whole = [](const nlohmann::json& x) { return x.is_number_unsigned() || (x.is_number_integer() && x.get<int64_t>() >= 0); };
  auto strings = [](const nlohmann::json& x) {
    return x.is_array() && std::all_of(x.begin(), x.end(), [](const nlohmann::json& e) { return e.is_string(); });
  };
  need("status", "\"finished\" or \"diverged\"",
       [](const nlohmann::json& x) { return x == "finished" || x == "diverged"; }, false);
  const bool finished = j.value("status", "finished") == "finished";
  need("run", "a string", str, true);
  need("variant", "a string", str, true);
  need("config_hash", "a string", str, true);
  need("d", "a whole number", whole, true);
  need("seed", "a whole number", whole, true);
  need("compute", "a number", num, finished);
  need("final_val_loss", "a number", num, finished);
  need("tokens_per_s", "a number", num, finished);
  for (const char* k : {"tokens", "flops_with_head", "best_val_loss", "mfu", "wall_s"}) need(k, "a number", num, false);
  for (const char* k : {"baseline", "host", "cpu", "revision", "error", "data"}) need(k, "a string", str, false);
  need("threads", "a whole number", whole, false);
  need("stacks", "an array of strings", strings, false);
}

nlohmann::json parse_file(const fs::path& f) {
  try {
    return nlohmann::json::parse(read_file(f));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", f.string(), e.what());
  }
}

}  // namespace

void ResultStore::check_owner(const LadderSpec& spec) const {
  const fs::path m = dir_ / "ladder.json";
  if (fs::exists(m)) {
    auto j = parse_file(m);
    check_version(j, m, "ladder-results");
    if (j.value("spec_name", "") != spec.name)
      fail("{}: this directory holds the ladder '{}', not '{}'; use another --out directory", m.string(),
           j.value("spec_name", ""), spec.name);
  } else if (fs::exists(dir_) && !fs::is_empty(dir_) && !fs::exists(dir_ / "results")) {
    fail("{}: exists, is not empty and is not a Ladder results directory (no ladder.json)", dir_.string());
  }
}

void ResultStore::open_for_sweep(const LadderSpec& spec, const std::map<std::string, std::string>& planned_hashes,
                                 const std::map<std::string, std::string>& planned_data) {
  check_owner(spec);
  const fs::path m = dir_ / "ladder.json";
  fs::create_directories(dir_ / "results");
  fs::create_directories(dir_ / "runs");
  fs::create_directories(dir_ / "locks");
  // (Re)written on every sweep so the report uses the spec's current settings; concurrent workers
  // write the same content, and the write is atomic.
  nlohmann::json j = {{"format", "ladder-results"},
                      {"version", kResultsVersion},
                      {"spec_name", spec.name},
                      {"spec_file", fs::absolute(spec.file).string()},
                      {"variants", [&] {
                         std::vector<std::string> v;
                         for (auto& x : spec.variants) v.push_back(x.name);
                         return v;
                       }()},
                      // The spec's links between variants, for the report: they are not part of a run's
                      // config, so the copies stored with old results can be stale.
                      {"links", [&] {
                         nlohmann::json l = nlohmann::json::object();
                         for (auto& x : spec.variants) l[x.name] = {{"baseline", x.baseline}, {"stacks", x.stacks}};
                         return l;
                       }()},
                      {"report", {{"E", spec.report.E}, {"alpha", spec.report.alpha}}},
                      {"runs", planned_hashes},
                      {"data", planned_data}};
  write_file_atomic(m, j.dump(2) + "\n");
}

nlohmann::json ResultStore::read_manifest() const {
  const fs::path m = dir_ / "ladder.json";
  if (!fs::exists(m)) fail("{}: not a Ladder results directory (no ladder.json; run `ladder sweep SPEC --out {}`)", dir_.string(), dir_.string());
  auto j = parse_file(m);
  check_version(j, m, "ladder-results");
  return j;
}

std::optional<nlohmann::json> ResultStore::read_result(const std::string& id) const {
  auto p = result_path(id);
  if (!fs::exists(p)) return std::nullopt;
  auto j = parse_file(p);
  check_version(j, p, "ladder-result");
  return j;
}

void ResultStore::write_result(const std::string& id, const nlohmann::json& result) const {
  write_file_atomic(result_path(id), result.dump(1) + "\n");
}

std::vector<nlohmann::json> ResultStore::all_results() const {
  std::vector<fs::path> files;
  if (fs::exists(dir_ / "results"))
    for (auto& e : fs::directory_iterator(dir_ / "results"))
      if (e.path().extension() == ".json") files.push_back(e.path());  // temp files end in .tmp.<pid>.<n>
  std::sort(files.begin(), files.end());
  std::vector<nlohmann::json> out;
  for (auto& f : files) {
    auto j = parse_file(f);
    check_version(j, f, "ladder-result");
    check_result_fields(j, f);
    out.push_back(std::move(j));
  }
  return out;
}

RunLock::RunLock(const ResultStore& store, const std::string& id) {
  auto p = store.dir() / "locks" / (id + ".lock");
  fd_ = ::open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("{}: cannot create lock file: {}", p.string(), std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) {
    held_ = true;
    return;
  }
  // Only EWOULDBLOCK means another worker holds it. Any other error (a filesystem without flock:
  // ENOLCK, ENOSYS, EINVAL) would otherwise read as "held" for every run, and a sweep would skip
  // them all and report success.
  const int err = errno;
  if (err != EWOULDBLOCK) {
    ::close(fd_);
    fd_ = -1;
    fail("{}: cannot lock: {} (the results directory must be on a filesystem with flock(2) locks, e.g. a "
         "local disk, or NFS/Lustre mounted with locking)",
         p.string(), std::strerror(err));
  }
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // closing releases the flock
}

}  // namespace ladder
