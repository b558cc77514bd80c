// Durable file writing: write to a temporary name in the same directory, fsync, rename, fsync the
// directory. Readers never see a half-written file.
#pragma once
#include <string>
#include <string_view>
#include <vector>
#include <cstdint>
#include <filesystem>

namespace ladder {

// Streams a file into being: bytes go to a new temporary beside `path` (created with O_EXCL under a
// name unique to this process and call, so neither a concurrent writer nor a file planted at a
// guessable name is ever written through), and commit() fsyncs it, renames it over `path` and
// fsyncs the directory. Destroyed before commit() (an error, an exception), it removes the
// temporary: a failed write leaves `path` as it was and nothing beside it. Errors name `path`.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(const std::filesystem::path& path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  void write(const void* data, size_t n);
  void write(std::string_view s) { write(s.data(), s.size()); }
  void commit();
  const std::filesystem::path& temp_path() const { return tmp_; }

 private:
  std::filesystem::path path_, tmp_;
  int fd_ = -1;
  bool done_ = false;
};

// Writes `data` to `path` atomically (AtomicFileWriter). Throws ladder::Error naming the path.
void write_file_atomic(const std::filesystem::path& path, std::string_view data);
// fsyncs a directory (after renames inside it).
void fsync_dir(const std::filesystem::path& dir);
// create_directories, and each directory it created made durable in its parent (fsync_dir of the
// parent): a checkpoint renamed into place and synced must not vanish with a new run directory
// whose own name never reached the disk. Returns whether it created anything; errors are Errors.
bool create_directories_durably(const std::filesystem::path& dir);
// Reads a whole file; throws ladder::Error naming the path if missing/unreadable.
std::string read_file(const std::filesystem::path& path);
// One word for /bin/sh (a path in a command run through popen or printed for a user to paste):
// single-quoted, each ' in it written as '\'' (close, escaped quote, reopen).
std::string shell_quote(const std::string& s);

// A whole file mapped read-only (token shards): the pages live in the page cache, shared by every
// process that maps the file (the ranks of a data-parallel job on one machine), and are read on
// first touch. Move-only; unmapped when the last owner goes. Errors name the path ("PATH: cannot
// open <what>: ...", "PATH: not a regular file", "PATH: cannot map file: ...").
class MappedFile {
 public:
  static MappedFile open(const std::filesystem::path& path, const char* what = "file");
  MappedFile() = default;
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();
  const char* data() const { return static_cast<const char*>(addr_); }
  size_t size() const { return size_; }

 private:
  void* addr_ = nullptr;  // nullptr for an empty file
  size_t size_ = 0;
};

}  // namespace ladder
