#include "data/shard.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "core/error.h"
#include "core/fileio.h"

namespace ladder::data {

namespace fs = std::filesystem;

namespace {

// Explicit byte order, so shards are identical whatever machine writes or reads them.
void put_u32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = char(v >> (8 * i));
}
void put_u64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = char(v >> (8 * i));
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}
uint64_t get_u64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

std::string printable(const char* p, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<unsigned char>(p[i]);
    s += (c >= 32 && c < 127) ? std::string(1, char(c)) : fmt::format("\\x{:02x}", c);
  }
  return s;
}

}  // namespace

void write_shard(const fs::path& path, const std::vector<int32_t>& tokens, int vocab_size, uint64_t tokenizer_hash) {
  if (vocab_size <= 0) fail("{}: cannot write shard with vocab_size {}", path.string(), vocab_size);
  const uint32_t dtype = vocab_size <= 65536 ? 2 : 4;
  std::string buf(kShardHeaderBytes + tokens.size() * dtype, '\0');
  char* payload = buf.data() + kShardHeaderBytes;
  for (size_t i = 0; i < tokens.size(); ++i) {
    int32_t t = tokens[i];
    if (t < 0 || t >= vocab_size)
      fail("{}: token {} at position {} is outside the vocabulary [0, {})", path.string(), t, i, vocab_size);
    if (dtype == 2) {
      payload[2 * i] = char(t);
      payload[2 * i + 1] = char(t >> 8);
    } else {
      put_u32(payload + 4 * i, uint32_t(t));
    }
  }
  char* h = buf.data();
  std::memcpy(h, kShardMagic, 8);
  put_u32(h + 8, kShardVersion);
  put_u32(h + 12, dtype);
  put_u64(h + 16, tokens.size());
  put_u64(h + 24, XXH64(payload, tokens.size() * dtype, 0));
  put_u64(h + 32, tokenizer_hash);
  put_u32(h + 40, uint32_t(vocab_size));
  write_file_atomic(path, buf);
}

Shard Shard::open(const fs::path& path, uint64_t expected_tokenizer_hash) {
  const std::string f = path.string();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) fail("{}: shard file not found", f);
  Shard s;
  s.file_ = MappedFile::open(path);
  const size_t size = s.file_.size();
  if (size < kShardHeaderBytes)
    fail("{}: truncated shard: expected a {}-byte header, found only {} bytes", f, kShardHeaderBytes, size);
  const char* h = s.file_.data();
  if (std::memcmp(h, kShardMagic, 8) != 0)
    fail("{}: not a Ladder token shard: expected magic \"LDRTOKS1\", found \"{}\"", f, printable(h, 8));
  uint32_t version = get_u32(h + 8);
  if (version != kShardVersion) fail("{}: unsupported shard version: expected {}, found {}", f, kShardVersion, version);
  uint32_t dtype = get_u32(h + 12);
  if (dtype != 2 && dtype != 4) fail("{}: bad shard dtype: expected 2 or 4 bytes per token, found {}", f, dtype);
  uint64_t n = get_u64(h + 16);
  uint64_t checksum = get_u64(h + 24);
  uint64_t tok_hash = get_u64(h + 32);
  uint32_t vocab = get_u32(h + 40);
  if (vocab == 0 || vocab > uint32_t(INT32_MAX)) fail("{}: bad shard vocab_size {}", f, vocab);
  if (dtype == 2 && vocab > 65536)
    fail("{}: bad shard header: vocab_size {} does not fit the 2-byte dtype", f, vocab);
  // Compare without overflow: n comes from the file and may be garbage.
  const uint64_t payload_bytes = size - kShardHeaderBytes;
  if (n > payload_bytes / dtype || n * dtype != payload_bytes) {
    if (n <= payload_bytes / dtype)
      fail("{}: shard has {} bytes after the {} tokens its header declares (expected {} bytes of payload, "
           "found {})", f, payload_bytes - n * dtype, n, n * dtype, payload_bytes);
    fail("{}: truncated shard: header declares {} tokens of {} bytes each, found only {} bytes of payload", f,
         n, dtype, payload_bytes);
  }
  const char* payload = h + kShardHeaderBytes;
  uint64_t actual = XXH64(payload, payload_bytes, 0);
  if (actual != checksum)
    fail("{}: shard checksum mismatch (corrupt file): expected {:016x}, found {:016x}", f, checksum, actual);
  if (expected_tokenizer_hash != 0 && tok_hash != expected_tokenizer_hash)
    fail("{}: shard was made with a different tokenizer: expected tokenizer hash {:016x}, found {:016x}", f,
         expected_tokenizer_hash, tok_hash);
  s.payload_ = payload;
  s.n_ = n;
  s.dtype_ = dtype;
  // Every id below the vocabulary, checked once here (read() then decodes without checks), in
  // blocks so that no copy of the shard is ever whole in memory.
  std::vector<int32_t> block(size_t(1) << 16);
  for (size_t at = 0; at < n; at += block.size()) {
    const size_t c = std::min(block.size(), size_t(n - at));
    s.read(at, c, block.data());
    for (size_t i = 0; i < c; ++i)
      if (uint32_t(block[i]) >= vocab)
        fail("{}: token {} at position {} is outside the vocabulary: expected ids < {}", f, uint32_t(block[i]),
             at + i, vocab);
  }
  s.vocab_size_ = int(vocab);
  s.tokenizer_hash_ = tok_hash;
  s.checksum_ = checksum;
  return s;
}

void Shard::read(size_t start, size_t count, int32_t* out) const {
  const auto* p = reinterpret_cast<const unsigned char*>(payload_) + start * dtype_;
  if (dtype_ == 2) {
    for (size_t i = 0; i < count; ++i) out[i] = int32_t(uint32_t(p[2 * i]) | (uint32_t(p[2 * i + 1]) << 8));
  } else {
    for (size_t i = 0; i < count; ++i) out[i] = int32_t(get_u32(reinterpret_cast<const char*>(p) + 4 * i));
  }
}

std::vector<int32_t> Shard::tokens() const {
  std::vector<int32_t> t(n_);
  read(0, n_, t.data());
  return t;
}

}  // namespace ladder::data
