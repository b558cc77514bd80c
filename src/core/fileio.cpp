#include "core/fileio.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace ladder {

void fsync_dir(const std::filesystem::path& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  const bool ok = fd >= 0 && ::fsync(fd) == 0;
  const int e = errno;
  if (fd >= 0) ::close(fd);
  // Not fatal (some filesystems refuse to fsync a directory), but not silent either: the files'
  // names, not only their bytes, must survive a machine crash. Once per process, not per file.
  static std::atomic<bool> warned{false};
  if (!ok && !warned.exchange(true))
    fmt::print(stderr, "warning: {}: cannot fsync the directory ({}): files renamed into it may not survive a "
               "machine crash\n", dir.empty() ? "." : dir.string(), std::strerror(e));
}

bool create_directories_durably(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  const fs::path abs = fs::absolute(dir).lexically_normal();
  // The nearest ancestor that exists: every level below it is new.
  fs::path existing = abs;
  std::error_code ec;
  while (!existing.empty() && !fs::exists(existing, ec) && existing != existing.root_path())
    existing = existing.parent_path();
  if (!fs::create_directories(abs, ec)) {
    if (ec) fail("{}: cannot create the directory: {}", dir.string(), ec.message());
    return false;
  }
  for (fs::path p = abs; p != existing && !p.empty() && p != p.root_path(); p = p.parent_path())
    fsync_dir(p.parent_path());
  return true;
}

AtomicFileWriter::AtomicFileWriter(const std::filesystem::path& path) : path_(path) {
  // pid + a process-wide counter keeps concurrent writers (threads or processes) apart; O_EXCL
  // makes a leftover of a crashed process whose pid was reused, or a file someone placed at
  // the name, a retry under the next name rather than a file written through.
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0; attempt < 64; ++attempt) {
    tmp_ = path;
    tmp_ += fmt::format(".tmp.{}.{}", ::getpid(), counter.fetch_add(1));
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ >= 0) return;
    if (errno != EEXIST) break;
  }
  const int e = errno;
  tmp_.clear();  // nothing of ours to remove
  fail("{}: cannot create a temporary file beside it: {}", path.string(), std::strerror(e));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!done_ && !tmp_.empty()) ::unlink(tmp_.c_str());
}

void AtomicFileWriter::write(const void* data, size_t n) {
  auto* c = static_cast<const char*>(data);
  while (n > 0) {
    // write(2) may write less than asked (at most ~2 GiB per call on Linux): loop.
    ssize_t w = ::write(fd_, c, std::min<size_t>(n, size_t(1) << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("{}: write failed: {}", path_.string(), std::strerror(errno));
    }
    c += w;
    n -= size_t(w);
  }
}

void AtomicFileWriter::commit() {
  if (::fsync(fd_) != 0) fail("{}: fsync failed: {}", path_.string(), std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("{}: close failed: {}", path_.string(), std::strerror(errno));
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    fail("{}: rename failed: {}", path_.string(), std::strerror(errno));
  done_ = true;                    // the temporary is `path` now
  fsync_dir(path_.parent_path());  // make the rename itself durable
}

void write_file_atomic(const std::filesystem::path& path, std::string_view data) {
  AtomicFileWriter w(path);
  w.write(data);
  w.commit();
}

std::string read_file(const std::filesystem::path& path) {
  // An ifstream opens a directory and reads it as empty: say what it is instead.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail("{}: is a directory, expected a file", path.string());
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("{}: cannot open file (missing or unreadable)", path.string());
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad() || ss.bad()) fail("{}: read failed", path.string());
  return ss.str();
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

MappedFile MappedFile::open(const std::filesystem::path& path, const char* what) {
  const std::string f = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open {}: {}", f, what, std::strerror(errno));
  struct stat sb {};
  if (::fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    ::close(fd);
    fail("{}: not a regular file", f);
  }
  MappedFile m;
  m.size_ = size_t(sb.st_size);
  if (m.size_ > 0) {
    m.addr_ = ::mmap(nullptr, m.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);  // the mapping keeps the file alive
    if (m.addr_ == MAP_FAILED) {
      m.addr_ = nullptr;
      fail("{}: cannot map file: {}", f, std::strerror(err));
    }
  } else {
    ::close(fd);
  }
  return m;
}

MappedFile::MappedFile(MappedFile&& o) noexcept : addr_(o.addr_), size_(o.size_) {
  o.addr_ = nullptr;
  o.size_ = 0;
}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (addr_) ::munmap(addr_, size_);
    addr_ = o.addr_;
    size_ = o.size_;
    o.addr_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (addr_) ::munmap(addr_, size_);
}

}  // namespace ladder
