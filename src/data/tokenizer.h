// Tokenizer: a thin wrapper over a SentencePiece BPE model file, plus training of such a model.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace ladder::data {

class Tokenizer {
 public:
  // Loads a sentencepiece model; a missing, unreadable or corrupt file is one error naming it.
  static Tokenizer load(const std::filesystem::path& model_file);

  // Thread-safe (sentencepiece encoding/decoding is const), so prepare can encode in parallel.
  std::vector<int32_t> encode(std::string_view text) const;
  std::string decode(const std::vector<int32_t>& ids) const;
  // The text of one token (e.g. "▁the", "<0x0A>"), for debugging and sampling output.
  std::string piece(int32_t id) const;

  int vocab_size() const { return vocab_size_; }
  int eod_id() const { return eod_id_; }  // sentencepiece </s>
  // XXH64 of the model file bytes: shards and checkpoints record it so a tokenizer that does not
  // match the tokens is caught instead of silently producing garbage.
  uint64_t hash() const { return hash_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::shared_ptr<const sentencepiece::SentencePieceProcessor> sp_;  // shared: Tokenizer is cheap to copy
  int vocab_size_ = 0;
  int eod_id_ = -1;
  uint64_t hash_ = 0;
  std::filesystem::path path_;
};

// Hash that Tokenizer::hash() would report for a model file, without loading it (used to check
// that a data directory's tokenizer.model matches its meta.json).
uint64_t tokenizer_file_hash(const std::filesystem::path& model_file);

// At most this many bytes of text are given to the trainer (an evenly spaced sample of lines);
// more barely changes the merges but costs seconds per extra MB on a 2-core machine.
inline constexpr size_t kTokenizerTrainBytes = 4'000'000;

// Trains a BPE sentencepiece model (byte_fallback, identity normalization so decode(encode(x)) == x
// for valid UTF-8 x, "\n" as an atomic symbol, digits split) on `docs` and writes
// out_dir/tokenizer.model atomically.
// Deterministic: the sample is chosen by position, not by a random seed, and the trainer is not
// asked to shuffle or subsample.
void train_tokenizer(const std::vector<std::string>& docs, int vocab_size, const std::filesystem::path& out_dir);
// Same, over views (prepare passes its train documents without copying them).
void train_tokenizer(const std::vector<std::string_view>& docs, int vocab_size,
                     const std::filesystem::path& out_dir);

}  // namespace ladder::data
