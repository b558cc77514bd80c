#include "ladder/store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>

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

void ResultStore::open_for_sweep(const LadderSpec& spec, const std::map<std::string, std::string>& planned_hashes) {
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
                      {"report", {{"E", spec.report.E}, {"alpha", spec.report.alpha}}},
                      {"runs", planned_hashes}};
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
    out.push_back(std::move(j));
  }
  return out;
}

RunLock::RunLock(const ResultStore& store, const std::string& id) {
  auto p = store.dir() / "locks" / (id + ".lock");
  fd_ = ::open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("{}: cannot create lock file", p.string());
  held_ = ::flock(fd_, LOCK_EX | LOCK_NB) == 0;
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // closing releases the flock
}

}  // namespace ladder
