// Reading a prepared data directory: meta.json and a deterministic, rank-aware batch loader.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/shard.h"

namespace ladder::data {

struct DataMeta {
  int vocab_size = 0, eod_id = 0;
  uint64_t tokenizer_hash = 0;
  std::vector<std::filesystem::path> train_shards, val_shards;  // absolute: data_dir / name
  size_t train_tokens = 0, val_tokens = 0;
};

// Parses data_dir/meta.json (errors name the file and field). If data_dir/tokenizer.model exists,
// its hash must equal meta's tokenizer_hash: a tokenizer that does not match the shards is an error.
DataMeta read_meta(const std::filesystem::path& data_dir);

// The seed of the validation order: the trainer's evaluations and `ladder eval` read the windows
// shuffled by it, whatever run.seed is, so that eval reproduces a run's logged val_loss.
inline constexpr uint64_t kValidationSeed = 0;

// Deterministic batches over one split ("train" or "val").
//
// The split's shards form one token stream; window k is the seq_len+1 tokens starting at k*seq_len
// (n_windows = (n_tokens-1)/seq_len). The loader walks a global sequence of sample slots: slot s
// belongs to epoch s / n_windows and reads window order_e[s % n_windows], where order_e is the
// identity (shuffle=false) or a Fisher-Yates permutation drawn from Philox keyed by (seed, epoch).
// Batch b of rank r takes slots [(b*world + r)*batch, +batch): ranks read disjoint windows, epochs
// roll over mid-batch when needed. inputs = window[0:seq_len], targets = window[1:seq_len+1].
//
// The position is a single count of slots consumed by all ranks together. state() records it with
// what identifies the data and order; restore() continues exactly (and also works with a different
// batch size or world size: it continues from the same global position).
class DataLoader {
 public:
  DataLoader(const std::filesystem::path& data_dir, std::string split, int seq_len, int batch_size, uint64_t seed,
             bool shuffle, int rank = 0, int world = 1);

  // Fills batch_size*seq_len ids into each of inputs and targets, row-major [batch, seq].
  void next(int32_t* inputs, int32_t* targets);
  nlohmann::json state() const;
  // Errors name `source` (e.g. "<checkpoint>/state.json, field 'loader'") when given.
  void restore(const nlohmann::json& s, const std::string& source = {});
  void reset();  // back to the first batch (validation passes)

  size_t n_windows() const { return n_windows_; }
  size_t n_tokens() const { return n_tokens_; }
  int vocab_size() const { return meta_.vocab_size; }
  int eod_id() const { return meta_.eod_id; }
  uint64_t tokenizer_hash() const { return meta_.tokenizer_hash; }
  // Slots consumed so far by all ranks together, and the epoch the next sample comes from.
  uint64_t consumed() const { return consumed_; }
  uint64_t epoch() const { return consumed_ / n_windows_; }
  const std::string& split() const { return split_; }

 private:
  size_t window_of(uint64_t slot);  // slot -> window index
  void read_tokens(size_t pos, size_t count, int32_t* out) const;  // ids [pos, pos + count) of the stream
  const std::vector<uint32_t>& order(uint64_t epoch);

  DataMeta meta_;
  std::string split_;
  int seq_len_, batch_, rank_, world_;
  uint64_t seed_;
  bool shuffle_;
  // The split's token stream: its shards, mapped (read on demand, shared with every process that
  // maps them), and where each starts in the stream.
  std::vector<Shard> shards_;
  std::vector<size_t> starts_;
  size_t n_tokens_ = 0;
  std::vector<int32_t> window_;  // one window's seq_len + 1 ids, reused by next()
  size_t n_windows_ = 0;
  uint64_t fingerprint_ = 0;  // identifies the token stream (shard checksums and sizes)
  uint64_t consumed_ = 0;
  std::map<uint64_t, std::vector<uint32_t>> orders_;  // cached permutations, at most two epochs
};

}  // namespace ladder::data
