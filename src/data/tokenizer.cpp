#include "data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <xxhash.h>

#include <algorithm>
#include <unordered_map>

#include "core/error.h"
#include "core/fileio.h"

namespace ladder::data {

namespace fs = std::filesystem;

namespace {

// Whether `sp` encodes a probe text the same whole as cut after each "\n" (see cuts_at_newlines()).
// The probe has leading, trailing and repeated spaces and empty lines, where a dummy prefix or
// whitespace normalization would show.
bool probe_newline_cuts(const sentencepiece::SentencePieceProcessor& sp) {
  const std::string_view probe = " a  b \n  c\n\nd e \n", cuts[] = {" a  b \n", "  c\n", "\n", "d e \n"};
  std::vector<int> whole, part, joined;
  if (!sp.Encode(probe, &whole).ok()) return false;
  for (std::string_view c : cuts) {
    if (!sp.Encode(c, &part).ok()) return false;
    joined.insert(joined.end(), part.begin(), part.end());
  }
  return whole == joined;
}

}  // namespace

Tokenizer Tokenizer::load(const fs::path& model_file) {
  std::error_code ec;
  if (!fs::is_regular_file(model_file, ec))
    fail("{}: tokenizer model not found (run `ladder data` to train one)", model_file.string());
  std::string bytes = read_file(model_file);
  auto sp = std::make_shared<sentencepiece::SentencePieceProcessor>();
  auto st = sp->LoadFromSerializedProto(bytes);
  if (!st.ok())
    fail("{}: not a valid sentencepiece model ({})", model_file.string(), st.ToString());
  if (sp->eos_id() < 0 || sp->eos_id() >= sp->GetPieceSize())
    fail("{}: sentencepiece model has no </s> (end-of-document) token", model_file.string());
  Tokenizer t;
  t.cuts_at_newlines_ = probe_newline_cuts(*sp);
  t.vocab_size_ = sp->GetPieceSize();
  t.eod_id_ = sp->eos_id();
  t.hash_ = XXH64(bytes.data(), bytes.size(), 0);
  t.path_ = model_file;
  t.sp_ = std::move(sp);
  return t;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  std::vector<int> ids;
  for (std::string_view piece : encode_pieces(text)) {
    auto st = sp_->Encode(piece, &ids);
    if (!st.ok()) fail("{}: encoding failed: {}", path_.string(), st.ToString());
    out.insert(out.end(), ids.begin(), ids.end());
  }
  return out;
}

std::vector<std::string_view> Tokenizer::encode_pieces(std::string_view text) const {
  return cuts_at_newlines_ ? newline_pieces(text, kEncodePieceBytes) : std::vector{text};
}

std::vector<std::string_view> newline_pieces(std::string_view text, size_t max_bytes) {
  std::vector<std::string_view> out;
  while (text.size() > max_bytes) {
    // The last newline that keeps the piece within max_bytes, else the first one after (a long line).
    size_t nl = max_bytes > 0 ? text.rfind('\n', max_bytes - 1) : std::string_view::npos;
    if (nl == std::string_view::npos) nl = text.find('\n', max_bytes);
    if (nl == std::string_view::npos || nl + 1 == text.size()) break;
    out.push_back(text.substr(0, nl + 1));
    text.remove_prefix(nl + 1);
  }
  out.push_back(text);
  return out;
}

void check_vocab_size(int vocab_size) {
  if (vocab_size < kMinVocabSize || vocab_size > kMaxVocabSize)
    fail("tokenizer vocab_size must be in [{}, {}] (byte fallback alone needs 259 ids), got {}", kMinVocabSize,
         kMaxVocabSize, vocab_size);
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  // sentencepiece aborts on some out-of-range ids; turn that into a normal error.
  for (int32_t id : ids)
    if (id < 0 || id >= vocab_size_)
      fail("{}: cannot decode token id {} (vocab size {})", path_.string(), id, vocab_size_);
  std::string out;
  auto st = sp_->Decode(std::vector<int>(ids.begin(), ids.end()), &out);
  if (!st.ok()) fail("{}: decoding failed: {}", path_.string(), st.ToString());
  return out;
}

std::string Tokenizer::piece(int32_t id) const {
  if (id < 0 || id >= vocab_size_) fail("{}: token id {} out of range (vocab size {})", path_.string(), id, vocab_size_);
  return sp_->IdToPiece(id);
}

int Tokenizer::text_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size_) fail("{}: token id {} out of range (vocab size {})", path_.string(), id, vocab_size_);
  if (sp_->IsByte(id)) return 1;
  if (sp_->IsControl(id) || sp_->IsUnknown(id)) return 0;
  const std::string p = sp_->IdToPiece(id);
  static const std::string kSpace = "\xE2\x96\x81";  // U+2581, sentencepiece's space: 3 bytes for 1
  int n = int(p.size());
  for (size_t i = p.find(kSpace); i != std::string::npos; i = p.find(kSpace, i + 3)) n -= 2;
  return n;
}

uint64_t tokenizer_file_hash(const fs::path& model_file) {
  std::string bytes = read_file(model_file);
  return XXH64(bytes.data(), bytes.size(), 0);
}

namespace {

// Feeds a prepared list of lines to the trainer without copying them again.
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::vector<std::string>& lines) : lines_(lines) {}
  bool done() const override { return i_ >= lines_.size(); }
  void Next() override { ++i_; }
  const std::string& value() const override { return lines_[i_]; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const std::vector<std::string>& lines_;
  size_t i_ = 0;
};

constexpr size_t kMaxLineBytes = 8192;

// Back up from `pos` to the start of a UTF-8 character so a split never cuts one in two.
size_t utf8_boundary(std::string_view s, size_t pos) {
  while (pos > 0 && pos < s.size() && (static_cast<unsigned char>(s[pos]) & 0xC0) == 0x80) --pos;
  return pos;
}

}  // namespace

void train_tokenizer(const std::vector<std::string_view>& docs, int vocab_size, const fs::path& out_dir) {
  check_vocab_size(vocab_size);
  // The trainer learns merges within lines; newlines are a dedicated symbol instead (below), so the
  // natural unit is a line. Count them first so the sample can be spread evenly over the corpus.
  size_t total_bytes = 0, total_lines = 0;
  for (std::string_view d : docs) {
    size_t p = 0;
    while (p < d.size()) {
      size_t q = std::min(d.find('\n', p), d.size());
      if (q > p) total_bytes += q - p, ++total_lines;
      p = q + 1;
    }
  }
  if (total_bytes == 0) fail("cannot train a tokenizer: the training documents contain no text");
  // Deterministic, evenly spaced subsample: keep a line whenever the running quota reaches one.
  // (sentencepiece's own sampling draws from a random device, which would break reproducibility.)
  constexpr size_t kMaxLines = 2'000'000;
  double keep = std::min({1.0, double(kTokenizerTrainBytes) / double(total_bytes), double(kMaxLines) / double(total_lines)});
  std::vector<std::string> lines;
  double quota = 0;
  for (std::string_view d : docs) {
    size_t p = 0;
    while (p < d.size()) {
      size_t q = std::min(d.find('\n', p), d.size());
      if (q > p) {
        quota += keep;
        if (quota >= 1.0 - 1e-12) {
          quota -= 1.0;
          std::string_view line = d.substr(p, q - p);
          // Very long lines would be dropped by the trainer; cut them at character boundaries.
          while (line.size() > kMaxLineBytes) {
            size_t cut = utf8_boundary(line, kMaxLineBytes);
            if (cut == 0) cut = kMaxLineBytes;
            lines.emplace_back(line.substr(0, cut));
            line.remove_prefix(cut);
          }
          if (!line.empty()) lines.emplace_back(line);
        }
      }
      p = q + 1;
    }
  }

  std::unordered_map<std::string, std::string> args = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(vocab_size)},
      // Any byte sequence stays encodable: characters outside the vocabulary become <0xNN> pieces.
      {"byte_fallback", "true"},
      {"character_coverage", "0.9995"},
      // Identity normalization and kept whitespace make decode(encode(text)) == text exactly.
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"allow_whitespace_only_pieces", "true"},
      // Training sees one line per sentence, but a document is encoded whole: with the default dummy
      // prefix every training line starts with "▁" while a line after "\n" in a document does not, so
      // line-initial words were learnt in a form encoding never uses and split into extra pieces.
      // Without it a word after "\n" encodes exactly as at the start of a document (both without
      // "▁"), and a document can be encoded in pieces cut after "\n" with the same ids.
      {"add_dummy_prefix", "false"},
      // Newline is one token of its own (training lines never contain it).
      {"user_defined_symbols", "\n"},
      {"split_digits", "true"},
      {"max_sentence_length", std::to_string(kMaxLineBytes + 16)},
      {"input_sentence_size", "0"},
      {"shuffle_input_sentence", "false"},
      {"num_threads", "2"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"minloglevel", "2"},
  };
  LineIterator it(lines);
  std::string model;
  auto st = sentencepiece::SentencePieceTrainer::Train(args, &it, &model);
  if (!st.ok()) fail("tokenizer training (vocab_size {}) failed: {}", vocab_size, st.ToString());
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) fail("{}: cannot create directory: {}", out_dir.string(), ec.message());
  write_file_atomic(out_dir / "tokenizer.model", model);
}

void train_tokenizer(const std::vector<std::string>& docs, int vocab_size, const fs::path& out_dir) {
  std::vector<std::string_view> views(docs.begin(), docs.end());
  train_tokenizer(views, vocab_size, out_dir);
}

}  // namespace ladder::data
