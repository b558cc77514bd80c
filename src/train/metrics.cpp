#include "train/metrics.h"

#include <unistd.h>

#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string_view>

#include "core/error.h"
#include "core/fileio.h"

namespace ladder {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Whether a metrics line survives truncate_after_step(step).
bool keep_line(std::string_view line, int64_t step) {
  auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  // A line that does not parse is the torn tail of a crashed write (or garbage a crash left in
  // the last block): dropping it restores the one-object-per-line invariant readers rely on.
  if (j.is_discarded() || !j.is_object()) return false;
  auto it = j.find("step");
  if (it == j.end()) return true;
  if (it->is_number_integer()) return it->get<int64_t>() <= step;
  if (it->is_number_float()) return it->get<double>() <= double(step);
  return true;  // non-numeric "step": not ours to judge
}

}  // namespace

MetricsWriter::MetricsWriter(const std::filesystem::path& path, bool append, int fsync_every_lines,
                             double fsync_every_s)
    : path_(path), fsync_every_lines_(fsync_every_lines), fsync_every_s_(fsync_every_s) {
  open(append ? "ae" : "we");  // 'e': O_CLOEXEC, so child processes do not inherit the log
}

MetricsWriter::~MetricsWriter() { close(); }

void MetricsWriter::open(const char* mode) {
  f_ = std::fopen(path_.c_str(), mode);
  if (!f_) fail("{}: cannot open metrics file: {}", path_.string(), std::strerror(errno));
  unsynced_lines_ = 0;
  last_sync_s_ = now_s();
}

// Never throws (runs in the destructor): a failure to sync at exit cannot be acted on anyway.
void MetricsWriter::close() {
  if (!f_) return;
  std::fflush(f_);
  ::fsync(fileno(f_));
  std::fclose(f_);
  f_ = nullptr;
}

void MetricsWriter::write(const nlohmann::json& obj) {
  if (!obj.is_object()) fail("{}: metrics record must be a JSON object, got {}", path_.string(), obj.type_name());
  LADDER_ASSERT(f_ != nullptr);
  std::string line = obj.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  line.push_back('\n');
  // One fwrite + fflush per line: the OS then holds complete lines only, so a killed process
  // leaves a well-formed file.
  if (std::fwrite(line.data(), 1, line.size(), f_) != line.size() || std::fflush(f_) != 0)
    fail("{}: cannot write metrics: {}", path_.string(), std::strerror(errno));
  ++unsynced_lines_;
  if (unsynced_lines_ >= fsync_every_lines_ || now_s() - last_sync_s_ >= fsync_every_s_) sync();
}

void MetricsWriter::sync() {
  LADDER_ASSERT(f_ != nullptr);
  if (std::fflush(f_) != 0 || ::fsync(fileno(f_)) != 0)
    fail("{}: cannot sync metrics: {}", path_.string(), std::strerror(errno));
  unsynced_lines_ = 0;
  last_sync_s_ = now_s();
}

void read_metrics(const std::filesystem::path& path, const std::function<void(long, const nlohmann::json&)>& fn) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot be read: {}", path.string(), std::strerror(errno));
  std::string line;
  long lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    const bool unterminated = in.eof();  // no newline after it: the writer may be mid-line
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      if (unterminated) break;
      fail("{}:{}: not a JSON object (expected one metrics object per line, as `ladder train` writes)",
           path.string(), lineno);
    }
    fn(lineno, j);
  }
  if (in.bad()) fail("{}: read error: {}", path.string(), std::strerror(errno));
}

void MetricsWriter::truncate_after_step(int64_t step) {
  // Close first so every line we wrote is in the file we read, and because the atomic rewrite
  // replaces the file (a new inode): the old handle would keep appending to the unlinked one.
  close();
  std::string content = read_file(path_);
  std::string kept;
  kept.reserve(content.size());
  bool changed = false;
  size_t pos = 0;
  while (pos < content.size()) {
    size_t nl = content.find('\n', pos);
    const bool complete = nl != std::string::npos;
    size_t end = complete ? nl : content.size();
    std::string_view line(content.data() + pos, end - pos);
    // A last line without its newline was cut off mid-write; even if it happens to parse, a
    // later append would glue onto it, so drop it.
    if (complete && keep_line(line, step)) {
      kept.append(line);
      kept.push_back('\n');
    } else {
      changed = true;
    }
    pos = complete ? nl + 1 : content.size();
  }
  if (changed) write_file_atomic(path_, kept);
  open("ae");
}

// ------------------------------------------------------------------------------------------------
// Human-readable formatting

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--";
  // Clamp so the integer conversion cannot overflow (~31 million years is "a long time" anyway).
  const int64_t s = std::llround(std::min(seconds, 1e15));
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  if (s < 86400) return fmt::format("{}h{:02}m{:02}s", s / 3600, s % 3600 / 60, s % 60);
  // Seconds stop mattering past a day; keep the string short.
  return fmt::format("{}d{:02}h{:02}m", s / 86400, s % 86400 / 3600, s % 3600 / 60);
}

std::string human_count(double n) {
  if (std::isnan(n)) return "nan";
  if (std::isinf(n)) return n > 0 ? "inf" : "-inf";
  static constexpr const char* kUnits[] = {"", "k", "M", "G", "T", "P", "E"};
  constexpr int kLast = 6;
  const char* sign = n < 0 ? "-" : "";
  double a = std::fabs(n);
  if (a > 0 && a < 1) return fmt::format("{}{:.3g}", sign, a);
  int u = 0;
  while (a >= 1000 && u < kLast) {
    a /= 1000;
    ++u;
  }
  auto render = [](double v) {
    // Three significant digits for v in [1, 1000).
    int decimals = v >= 100 ? 0 : v >= 10 ? 1 : 2;
    return fmt::format("{:.{}f}", v, decimals);
  };
  std::string s = render(a);
  // Rounding can carry into the next unit (999.7k -> "1000"): re-render as 1.00M.
  if (std::stod(s) >= 1000 && u < kLast) {
    a /= 1000;
    ++u;
    s = render(a);
  }
  // "2.10G" -> "2.1G", "5.00P" -> "5P": trailing zeros carry no information here.
  if (s.find('.') != std::string::npos) {
    while (s.back() == '0') s.pop_back();
    if (s.back() == '.') s.pop_back();
  }
  return fmt::format("{}{}{}", sign, s, kUnits[u]);
}

std::string format_progress(const ProgressInfo& p) {
  const int width = static_cast<int>(fmt::formatted_size("{}", p.total_steps));
  std::string out = fmt::format("step {:>{}}/{} | loss {:.4f} | lr {:.2e} | gnorm {:.2f} | {} tok/s",
                                p.step, width, p.total_steps, p.loss, p.lr, p.grad_norm,
                                human_count(p.tokens_per_s));
  if (std::isfinite(p.mfu) && p.mfu > 0) out += fmt::format(" | MFU {:.1f}%", p.mfu * 100);
  double eta = p.eta_s;
  if (!(eta >= 0) && p.step > 0 && p.elapsed_s > 0 && p.total_steps >= p.step)
    eta = p.elapsed_s / double(p.step) * double(p.total_steps - p.step);  // mean rate so far
  out += " | ETA ";
  out += format_duration(eta);
  if (!p.extra.empty()) {
    out += " | ";
    out += p.extra;
  }
  return out;
}

}  // namespace ladder
