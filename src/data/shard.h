// Token shard files.
//
// Layout (little endian): a 64-byte header, then n_tokens ids of dtype_bytes each.
//   off  0  char[8] magic "LDRTOKS1"
//   off  8  u32 version (1)
//   off 12  u32 dtype_bytes (2 = uint16 when vocab_size <= 65536, else 4 = uint32)
//   off 16  u64 n_tokens
//   off 24  u64 checksum: XXH64 (seed 0) of the payload bytes exactly as stored
//   off 32  u64 tokenizer_hash (Tokenizer::hash() of the model that produced the ids)
//   off 40  u32 vocab_size
//   off 44  zero padding to 64
#pragma once
#include <cstdint>
#include <filesystem>
#include <vector>

#include "core/fileio.h"

namespace ladder::data {

inline constexpr char kShardMagic[8] = {'L', 'D', 'R', 'T', 'O', 'K', 'S', '1'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr size_t kShardHeaderBytes = 64;

// Writes a shard atomically (temp file + fsync + rename). Every id must be in [0, vocab_size).
void write_shard(const std::filesystem::path& path, const std::vector<int32_t>& tokens, int vocab_size,
                 uint64_t tokenizer_hash);

// A shard mapped read-only (core/fileio.h MappedFile): opening it validates every byte once; the
// ids are then decoded on demand (read), so a loader holds no copy of the token stream and the ranks
// on one machine share its pages.
class Shard {
 public:
  // Maps and validates the whole shard (magic, version, dtype, size, checksum, tokenizer hash unless
  // expected_tokenizer_hash is 0, ids < vocab_size). Each failure is one error naming the file and
  // the expected vs found value.
  static Shard open(const std::filesystem::path& path, uint64_t expected_tokenizer_hash);

  size_t size() const { return n_; }
  // Decodes ids [start, start + count) into out (start + count <= size()).
  void read(size_t start, size_t count, int32_t* out) const;
  // Every id, decoded (tests and tools; the loader reads windows).
  std::vector<int32_t> tokens() const;
  int vocab_size() const { return vocab_size_; }
  uint64_t tokenizer_hash() const { return tokenizer_hash_; }
  uint64_t checksum() const { return checksum_; }

 private:
  MappedFile file_;
  const char* payload_ = nullptr;
  size_t n_ = 0;
  uint32_t dtype_ = 2;
  int vocab_size_ = 0;
  uint64_t tokenizer_hash_ = 0;
  uint64_t checksum_ = 0;
};

}  // namespace ladder::data
