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
  // The UTF-8 bytes of text that token `id` stands for in decode()'s output: 1 for a byte-fallback
  // token, 0 for control tokens (</s>, <s>) and <unk>, else its piece with each "▁" one space byte.
  // Summed over encode(text) it is text.size() (identity normalization, no dummy prefix); bits per
  // byte divide by it.
  int text_bytes(int32_t id) const;

  // True when encoding may be cut just after any "\n" without changing the ids:
  // encode(a + "\n" + b) == encode(a + "\n") ++ encode(b). Holds for models train_tokenizer writes
  // ("\n" is a user-defined symbol, which BPE never merges with its neighbours, and no dummy prefix).
  // Models trained with sentencepiece's default add_dummy_prefix give the first word of every encode
  // call a "▁", so encode() and prepare encode their documents whole. Checked on load by encoding a
  // probe text both ways.
  bool cuts_at_newlines() const { return cuts_at_newlines_; }
  // `text` as the pieces encode() encodes one by one: cut after "\n" into pieces of at most
  // kEncodePieceBytes where cuts_at_newlines(), else whole. Encoding each and concatenating the ids
  // is encode(text); prepare encodes them in parallel.
  std::vector<std::string_view> encode_pieces(std::string_view text) const;

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
  bool cuts_at_newlines_ = false;
  uint64_t hash_ = 0;
  std::filesystem::path path_;
};

// Texts longer than this are encoded in pieces cut after a "\n" (when cuts_at_newlines()):
// sentencepiece needs about 100 bytes of memory per input byte, and pieces encode in parallel.
inline constexpr size_t kEncodePieceBytes = size_t(1) << 16;

// Cuts `text` into consecutive pieces that each end just after a "\n" (the last one may end anywhere)
// and are at most max_bytes long, except that a single line longer than max_bytes stays one piece.
// The pieces concatenated are `text`; there is always at least one piece.
std::vector<std::string_view> newline_pieces(std::string_view text, size_t max_bytes);

// The vocabulary sizes train_tokenizer accepts; anything else is one error naming the value.
inline constexpr int kMinVocabSize = 300, kMaxVocabSize = 1 << 24;
void check_vocab_size(int vocab_size);

// Hash that Tokenizer::hash() would report for a model file, without loading it (used to check
// that a data directory's tokenizer.model matches its meta.json).
uint64_t tokenizer_file_hash(const std::filesystem::path& model_file);

// At most this many bytes of text are given to the trainer (an evenly spaced sample of lines);
// more barely changes the merges but costs seconds per extra MB on a 2-core machine.
inline constexpr size_t kTokenizerTrainBytes = 4'000'000;

// Trains a BPE sentencepiece model (byte_fallback, identity normalization so decode(encode(x)) == x
// for valid UTF-8 x without U+2581, "\n" as an atomic symbol, no dummy prefix, digits split) on `docs`
// and writes out_dir/tokenizer.model atomically.
// Deterministic: the sample is chosen by position, not by a random seed, and the trainer is not
// asked to shuffle or subsample.
void train_tokenizer(const std::vector<std::string>& docs, int vocab_size, const std::filesystem::path& out_dir);
// Same, over views (prepare passes its train documents without copying them).
void train_tokenizer(const std::vector<std::string_view>& docs, int vocab_size,
                     const std::filesystem::path& out_dir);

}  // namespace ladder::data
