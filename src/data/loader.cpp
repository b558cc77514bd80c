#include "data/loader.h"

#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>

#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "data/prepare.h"
#include "data/shard.h"
#include "data/tokenizer.h"

namespace ladder::data {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const json& field(const json& j, const std::string& file, const char* name) {
  auto it = j.find(name);
  if (it == j.end()) fail("{}: missing field '{}'", file, name);
  return *it;
}

int64_t get_int(const json& j, const std::string& file, const char* name) {
  const json& v = field(j, file, name);
  if (!v.is_number_integer()) fail("{}: field '{}' must be an integer, found {}", file, name, v.dump());
  return v.get<int64_t>();
}

size_t get_count(const json& j, const std::string& file, const char* name) {
  const json& v = field(j, file, name);
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
    fail("{}: field '{}' must be a non-negative integer, found {}", file, name, v.dump());
  return v.get<size_t>();
}

// Accepts the unsigned number prepare writes, and a hex string for tools that cannot hold 64 bits.
uint64_t get_hash(const json& j, const std::string& file, const char* name) {
  const json& v = field(j, file, name);
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_string()) {
    std::string s = v.get<std::string>();
    if (s.rfind("0x", 0) == 0) s = s.substr(2);
    char* end = nullptr;
    errno = 0;
    unsigned long long h = std::strtoull(s.c_str(), &end, 16);
    if (!s.empty() && end && *end == '\0' && errno == 0) return h;
  }
  fail("{}: field '{}' must be an unsigned 64-bit integer, found {}", file, name, v.dump());
}

std::vector<fs::path> get_shards(const json& j, const std::string& file, const char* name, const fs::path& dir) {
  const json& v = field(j, file, name);
  if (!v.is_array()) fail("{}: field '{}' must be a list of shard file names, found {}", file, name, v.dump());
  std::vector<fs::path> out;
  for (const json& e : v) {
    if (!e.is_string() || e.get<std::string>().empty())
      fail("{}: field '{}' must be a list of shard file names, found element {}", file, name, e.dump());
    fs::path p = e.get<std::string>();
    out.push_back(p.is_absolute() ? p : dir / p);  // relative names keep the directory movable
  }
  return out;
}

}  // namespace

DataMeta read_meta(const fs::path& data_dir) {
  std::error_code ec;
  if (!fs::is_directory(data_dir, ec)) fail("{}: data directory not found (run `ladder data` first)", data_dir.string());
  const fs::path path = data_dir / "meta.json";
  const std::string f = path.string();
  if (!fs::exists(path, ec))
    fail("{}: missing: the data directory is incomplete (run `ladder data` to prepare it)", f);
  json j;
  try {
    j = json::parse(read_file(path));
  } catch (const json::parse_error& e) {
    fail("{}: not valid JSON (error at byte {})", f, e.byte);
  } catch (const json::exception& e) {
    // Well-formed JSON the parser still cannot hold, e.g. a number beyond double range (1e400).
    fail("{}: cannot read the JSON: {}", f, e.what());
  }
  if (!j.is_object()) fail("{}: expected a JSON object", f);
  int64_t version = get_int(j, f, "format_version");
  if (version != kDataFormatVersion)
    fail("{}: field 'format_version': expected {}, found {}", f, kDataFormatVersion, version);
  DataMeta m;
  int64_t vocab = get_int(j, f, "vocab_size");
  if (vocab <= 0 || vocab > INT32_MAX) fail("{}: field 'vocab_size' must be positive, found {}", f, vocab);
  m.vocab_size = int(vocab);
  int64_t eod = get_int(j, f, "eod_id");
  if (eod < 0 || eod >= vocab) fail("{}: field 'eod_id' must be in [0, {}), found {}", f, vocab, eod);
  m.eod_id = int(eod);
  m.tokenizer_hash = get_hash(j, f, "tokenizer_hash");
  m.train_tokens = get_count(j, f, "train_tokens");
  m.val_tokens = get_count(j, f, "val_tokens");
  m.train_shards = get_shards(j, f, "train_shards", data_dir);
  m.val_shards = get_shards(j, f, "val_shards", data_dir);

  const fs::path model = data_dir / "tokenizer.model";
  if (fs::exists(model, ec)) {
    uint64_t h = tokenizer_file_hash(model);
    if (h != m.tokenizer_hash)
      fail("{}: tokenizer does not match the shards: its hash is {:016x} but {} records {:016x} (re-run `ladder "
           "data` to re-encode, or restore the original tokenizer.model)", model.string(), h, f, m.tokenizer_hash);
  }
  return m;
}

DataLoader::DataLoader(const fs::path& data_dir, std::string split, int seq_len, int batch_size, uint64_t seed,
                       bool shuffle, int rank, int world)
    : split_(std::move(split)), seq_len_(seq_len), batch_(batch_size), rank_(rank), world_(world), seed_(seed),
      shuffle_(shuffle) {
  if (split_ != "train" && split_ != "val") fail("data loader: split must be \"train\" or \"val\", got \"{}\"", split_);
  if (seq_len <= 0) fail("data loader: seq_len must be positive, got {}", seq_len);
  if (batch_size <= 0) fail("data loader: batch_size must be positive, got {}", batch_size);
  if (world <= 0 || rank < 0 || rank >= world) fail("data loader: rank {} is not in [0, world={})", rank, world);
  meta_ = read_meta(data_dir);
  const auto& shards = split_ == "train" ? meta_.train_shards : meta_.val_shards;
  const size_t expected = split_ == "train" ? meta_.train_tokens : meta_.val_tokens;
  const std::string meta_file = (data_dir / "meta.json").string();
  if (shards.empty()) fail("{}: field '{}_shards' lists no shards", meta_file, split_);

  // The count is compared with the shards after loading them; first bound it by the shard files'
  // sizes so a corrupt count fails here, naming the field, rather than as an allocation failure.
  uint64_t max_tokens = 0;
  bool sized = true;
  for (const auto& p : shards) {
    std::error_code ec;
    const uintmax_t bytes = fs::file_size(p, ec);
    if (ec) {
      sized = false;  // missing or unreadable: Shard::open below says which
      break;
    }
    if (bytes > kShardHeaderBytes) max_tokens += (bytes - kShardHeaderBytes) / 2;  // 2: the smallest dtype
  }
  if (sized && expected > max_tokens)
    fail("{}: field '{}_tokens' says {} but its {} shard file(s) can hold at most {} tokens", meta_file, split_,
         expected, shards.size(), max_tokens);

  // The fingerprint identifies the token stream cheaply (shard checksums and sizes), so restore()
  // can refuse a state saved against different data. Owned so a bad shard (an exception) cannot leak it.
  std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> st(XXH64_createState(), &XXH64_freeState);
  XXH64_reset(st.get(), 0);
  for (const auto& p : shards) {
    Shard s = Shard::open(p, meta_.tokenizer_hash);
    if (s.vocab_size() != meta_.vocab_size)
      fail("{}: shard vocab_size {} does not match {} vocab_size {}", p.string(), s.vocab_size(), meta_file,
           meta_.vocab_size);
    uint64_t id[2] = {s.checksum(), uint64_t(s.size())};
    XXH64_update(st.get(), id, sizeof(id));
    starts_.push_back(n_tokens_);
    n_tokens_ += s.size();
    shards_.push_back(std::move(s));
  }
  fingerprint_ = XXH64_digest(st.get());
  if (n_tokens_ != expected)
    fail("{}: field '{}_tokens' says {} but its shards hold {} tokens", meta_file, split_, expected, n_tokens_);
  n_windows_ = n_tokens_ == 0 ? 0 : (n_tokens_ - 1) / size_t(seq_len);
  if (n_windows_ == 0)
    fail("{}: the {} split has {} tokens, fewer than seq_len+1 = {} needed for one sample", data_dir.string(), split_,
         n_tokens_, seq_len + 1);
  window_.resize(size_t(seq_len) + 1);
  if (n_windows_ > UINT32_MAX)
    fail("{}: {} windows in the {} split exceed the 2^32 limit", data_dir.string(), n_windows_, split_);
}

const std::vector<uint32_t>& DataLoader::order(uint64_t epoch) {
  auto it = orders_.find(epoch);
  if (it != orders_.end()) return it->second;
  // A batch touches at most the current and the next epoch; older orders are not needed again
  // (a restore or reset recomputes them).
  while (orders_.size() >= 2)
    orders_.erase(orders_.begin()->first < epoch ? orders_.begin() : std::prev(orders_.end()));
  std::vector<uint32_t> perm(n_windows_);
  std::iota(perm.begin(), perm.end(), 0u);
  // Fisher-Yates with counter-based draws: the permutation is a pure function of (seed, epoch), so
  // it needs no RNG state in checkpoints and is the same on every rank.
  Philox rng(seed_, stream_id("ladder.data.order") + epoch);
  for (size_t i = n_windows_ - 1; i > 0; --i) {
    size_t j = size_t((static_cast<unsigned __int128>(rng.u64(i)) * (i + 1)) >> 64);  // uniform in [0, i]
    std::swap(perm[i], perm[j]);
  }
  return orders_.emplace(epoch, std::move(perm)).first->second;
}

size_t DataLoader::window_of(uint64_t slot) {
  uint64_t e = slot / n_windows_, k = slot % n_windows_;
  return shuffle_ ? order(e)[k] : size_t(k);
}

void DataLoader::next(int32_t* inputs, int32_t* targets) {
  const uint64_t base = consumed_ + uint64_t(rank_) * batch_;
  for (int i = 0; i < batch_; ++i) {
    read_tokens(window_of(base + i) * size_t(seq_len_), window_.size(), window_.data());
    std::memcpy(inputs + size_t(i) * seq_len_, window_.data(), sizeof(int32_t) * seq_len_);
    std::memcpy(targets + size_t(i) * seq_len_, window_.data() + 1, sizeof(int32_t) * seq_len_);
  }
  consumed_ += uint64_t(world_) * batch_;
}

void DataLoader::read_tokens(size_t pos, size_t count, int32_t* out) const {
  // The shard holding pos (the last one starting at or before it), then on across shard ends.
  size_t k = size_t(std::upper_bound(starts_.begin(), starts_.end(), pos) - starts_.begin()) - 1;
  while (count > 0) {
    const size_t off = pos - starts_[k], c = std::min(count, shards_[k].size() - off);
    shards_[k].read(off, c, out);
    out += c;
    pos += c;
    count -= c;
    ++k;
  }
}

void DataLoader::reset() { consumed_ = 0; }

json DataLoader::state() const {
  return json{{"version", 1},
              {"split", split_},
              {"seq_len", seq_len_},
              {"seed", seed_},
              {"shuffle", shuffle_},
              {"n_tokens", n_tokens_},
              {"n_windows", n_windows_},
              {"fingerprint", fingerprint_},
              {"tokenizer_hash", meta_.tokenizer_hash},
              {"consumed", consumed_},
              // Informational: restore() continues from `consumed` whatever these are now.
              {"batch_size", batch_},
              {"world", world_},
              {"epoch", consumed_ / n_windows_}};
}

void DataLoader::restore(const json& s, const std::string& source) {
  // Errors name where the state came from (a checkpoint's state.json), not just "data loader state".
  const std::string what = source.empty() ? "data loader state" : source + ": data loader state";
  if (!s.is_object()) fail("{}: expected a JSON object, found {}", what, s.dump());
  auto check = [&](const char* name, const json& here) {
    auto it = s.find(name);
    if (it == s.end()) fail("{}: missing field '{}'", what, name);
    if (*it != here)
      fail("{} does not match this loader: '{}' is {} in the saved state but {} here", what, name, it->dump(),
           here.dump());
  };
  check("version", 1);
  check("split", split_);
  check("tokenizer_hash", meta_.tokenizer_hash);
  check("n_tokens", n_tokens_);
  check("fingerprint", fingerprint_);
  check("seq_len", seq_len_);
  check("seed", seed_);
  check("shuffle", shuffle_);
  auto it = s.find("consumed");
  if (it == s.end() || !it->is_number_integer() || (!it->is_number_unsigned() && it->get<int64_t>() < 0))
    fail("{}: field 'consumed' missing or not a non-negative integer", what);
  consumed_ = it->get<uint64_t>();
}

}  // namespace ladder::data
