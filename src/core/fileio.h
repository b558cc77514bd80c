// Durable file writing: write to a temporary name in the same directory, fsync, rename, fsync the
// directory. Readers never see a half-written file.
#pragma once
#include <string>
#include <string_view>
#include <vector>
#include <cstdint>
#include <filesystem>

namespace ladder {

// Writes `data` to `path` atomically. Throws ladder::Error naming the path on failure.
void write_file_atomic(const std::filesystem::path& path, std::string_view data);
// fsyncs a directory (after renames inside it).
void fsync_dir(const std::filesystem::path& dir);
// Reads a whole file; throws ladder::Error naming the path if missing/unreadable.
std::string read_file(const std::filesystem::path& path);

}  // namespace ladder
