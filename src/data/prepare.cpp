#include "data/prepare.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <climits>
#include <exception>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <string>

#include "core/error.h"
#include "core/fileio.h"
#include "data/shard.h"
#include "data/text_reader.h"
#include "data/tokenizer.h"

namespace ladder::data {

namespace fs = std::filesystem;

namespace {

uint64_t doc_hash(std::string_view text) { return XXH64(text.data(), text.size(), 0); }

// Accumulates one split's token stream and cuts it into fixed-size shards as it grows, so memory
// holds at most one shard's worth of tokens beyond the documents themselves.
class ShardWriter {
 public:
  ShardWriter(fs::path dir, std::string prefix, size_t shard_tokens, int vocab, uint64_t tok_hash)
      : dir_(std::move(dir)), prefix_(std::move(prefix)), shard_tokens_(shard_tokens), vocab_(vocab),
        tok_hash_(tok_hash) {}
  void append(const std::vector<int32_t>& ids) {
    size_t i = 0;
    while (i < ids.size()) {
      size_t take = std::min(ids.size() - i, shard_tokens_ - buf_.size());
      buf_.insert(buf_.end(), ids.begin() + i, ids.begin() + i + take);
      i += take;
      if (buf_.size() == shard_tokens_) flush();
    }
  }
  void finish() {
    if (!buf_.empty()) flush();
  }
  const std::vector<std::string>& names() const { return names_; }
  size_t total() const { return total_; }

 private:
  void flush() {
    std::string name = fmt::format("{}_{:06d}.bin", prefix_, names_.size());
    write_shard(dir_ / name, buf_, vocab_, tok_hash_);
    names_.push_back(name);
    total_ += buf_.size();
    buf_.clear();
  }
  fs::path dir_;
  std::string prefix_;
  size_t shard_tokens_;
  int vocab_;
  uint64_t tok_hash_;
  std::vector<int32_t> buf_;
  std::vector<std::string> names_;
  size_t total_ = 0;
};

// Encodes docs[idx[...]] (in that order) in parallel blocks and appends each, followed by eod,
// to the writer. Blocks keep the order deterministic and bound the memory of encoded ids. The work
// items are pieces of documents: a long document is cut after a "\n" when the tokenizer gives the
// same ids that way, so one huge document (a text file without blank-line separators) neither
// encodes in one call, at ~100 bytes of sentencepiece memory per input byte, nor on one thread.
void encode_split(const std::vector<std::string>& docs, const std::vector<size_t>& idx, const Tokenizer& tok,
                  ShardWriter& out) {
  constexpr size_t kBlockPieces = 4096, kBlockBytes = size_t(64) << 20;
  struct Piece {
    std::string_view text;
    bool doc_end;  // the document's last piece: eod follows
  };
  std::vector<Piece> pieces;
  std::vector<std::vector<int32_t>> enc;
  size_t next = 0;
  while (next < idx.size()) {
    pieces.clear();
    size_t bytes = 0;
    while (next < idx.size() && pieces.size() < kBlockPieces && bytes < kBlockBytes) {
      std::string_view d = docs[idx[next++]];
      const auto cut = tok.encode_pieces(d);
      for (size_t k = 0; k < cut.size(); ++k) pieces.push_back({cut[k], k + 1 == cut.size()});
      bytes += d.size();
    }
    const size_t n = pieces.size();
    enc.resize(n);
    std::exception_ptr err;
#pragma omp parallel for schedule(dynamic, 16)
    for (size_t i = 0; i < n; ++i) {
      try {
        enc[i] = tok.encode(pieces[i].text);
        if (pieces[i].doc_end) enc[i].push_back(tok.eod_id());
      } catch (...) {
#pragma omp critical(ladder_data_encode_error)
        if (!err) err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
    for (size_t i = 0; i < n; ++i) {
      out.append(enc[i]);
      std::vector<int32_t>().swap(enc[i]);
    }
  }
  out.finish();
}

// write_file_atomic's temp files ("<name>.tmp.<pid>.<n>") for the files prepare writes, left behind
// when a run was killed; m[3] is the pid.
bool is_stale_temp(const std::string& name) {
  static const std::regex temp_name(R"(((train|val)_\d{6}\.bin|meta\.json|tokenizer\.model)\.tmp\.(\d+)\.\d+)");
  std::smatch m;
  if (!std::regex_match(name, m, temp_name)) return false;
  long long pid = 0;
  const std::string digits = m[3].str();
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
  if (ec != std::errc() || pid <= 0 || pid > INT32_MAX) return true;  // no such process can exist
  // A live writer (another prepare into the same directory, or this one) still owns its file.
  if (pid == ::getpid()) return false;
  return ::kill(pid_t(pid), 0) != 0 && errno == ESRCH;
}

std::string human(size_t n) {
  if (n >= 1'000'000) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 10'000) return fmt::format("{:.1f}K", n / 1e3);
  return std::to_string(n);
}

}  // namespace

bool is_val_document(std::string_view text, double val_fraction) {
  return double(doc_hash(text) % 1'000'000) < val_fraction * 1e6;
}

void prepare_data(const PrepareOptions& opt) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  if (opt.inputs.empty()) fail("data: no input files given");
  if (opt.out_dir.empty()) fail("data: no output directory given");
  if (!(opt.val_fraction >= 0.0 && opt.val_fraction < 1.0))
    fail("data: val_fraction must be in [0, 1), got {}", opt.val_fraction);
  if (opt.shard_tokens == 0) fail("data: shard_tokens must be positive");
  check_vocab_size(opt.vocab_size);

  // An existing tokenizer is checked before anything is read or removed: a reuse that cannot give the
  // requested vocabulary should fail in a second, not after reading the corpus.
  const fs::path model_path = opt.out_dir / "tokenizer.model";
  std::optional<Tokenizer> reused;
  if (opt.reuse_tokenizer && fs::exists(model_path)) {
    reused = Tokenizer::load(model_path);
    if (reused->vocab_size() != opt.vocab_size) {
      if (opt.vocab_explicit)
        fail("{}: the existing tokenizer has vocab_size {} but vocab_size {} was requested (to train a new "
             "one, delete this file or write to another output directory)", model_path.string(),
             reused->vocab_size(), opt.vocab_size);
      fmt::print("data: note: reusing {} (vocab {}, not {}); delete it to train a new tokenizer\n",
                 model_path.string(), reused->vocab_size(), opt.vocab_size);
    }
  }

  std::error_code ec;
  fs::create_directories(opt.out_dir, ec);
  if (ec) fail("{}: cannot create output directory: {}", opt.out_dir.string(), ec.message());
  // 1. Read every document.
  std::vector<std::string> docs;
  nlohmann::ordered_json inputs = nlohmann::ordered_json::array();
  for (const auto& in : opt.inputs) {
    for_each_document(in, [&](std::string&& d) { docs.push_back(std::move(d)); });
    inputs.push_back(in.string());
  }
  if (docs.empty()) fail("data: the input files contain no documents");

  // 2. Split by text hash. Identical texts share a hash, so no text is on both sides.
  std::vector<uint64_t> hashes(docs.size());
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < docs.size(); ++i) hashes[i] = doc_hash(docs[i]);
  std::vector<char> is_val(docs.size());
  size_t n_val = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    is_val[i] = double(hashes[i] % 1'000'000) < opt.val_fraction * 1e6;
    n_val += is_val[i];
  }
  if (n_val == 0) {
    // Small corpora (or val_fraction 0) must still yield a validation set: take the text(s) whose
    // key is smallest, i.e. the ones the rule would pick first as val_fraction grows.
    size_t best = 0;
    for (size_t i = 1; i < docs.size(); ++i) {
      auto key = [&](size_t k) { return std::pair(hashes[k] % 1'000'000, hashes[k]); };
      if (key(i) < key(best)) best = i;
    }
    for (size_t i = 0; i < docs.size(); ++i)
      if (hashes[i] == hashes[best]) is_val[i] = 1, ++n_val;
  }
  if (n_val == docs.size())
    fail("data: all {} documents landed in the validation split (need at least two distinct documents and "
         "val_fraction < 1)", docs.size());
  std::vector<size_t> train_idx, val_idx;
  for (size_t i = 0; i < docs.size(); ++i) (is_val[i] ? val_idx : train_idx).push_back(i);
  const auto t_read = clock::now();

  // meta.json marks a complete directory. The inputs are read and split: from here on the directory
  // changes (a new tokenizer, then shards), so drop an old meta.json first, and an interrupted rewrite
  // never looks complete with a mix of old and new files. (Not earlier: bad input, found above,
  // leaves a complete directory as it was.)
  const fs::path meta_path = opt.out_dir / "meta.json";
  fs::remove(meta_path, ec);
  if (ec) fail("{}: cannot remove old file: {}", meta_path.string(), ec.message());

  // 3. Tokenizer: reuse (loaded above) or train on the train documents only (val stays unseen).
  if (!reused) {
    std::vector<std::string_view> train_views;
    train_views.reserve(train_idx.size());
    for (size_t i : train_idx) train_views.emplace_back(docs[i]);
    train_tokenizer(train_views, opt.vocab_size, opt.out_dir);
  }
  const Tokenizer tok = reused ? *reused : Tokenizer::load(model_path);
  const auto t_tok = clock::now();

  // 4. Encode and write shards.
  ShardWriter train_out(opt.out_dir, "train", opt.shard_tokens, tok.vocab_size(), tok.hash());
  encode_split(docs, train_idx, tok, train_out);
  ShardWriter val_out(opt.out_dir, "val", opt.shard_tokens, tok.vocab_size(), tok.hash());
  encode_split(docs, val_idx, tok, val_out);

  // Shards left over from an earlier, larger run would be ignored by the loader (meta.json lists
  // the live ones) but are confusing, and temp files of a killed run only take space; remove them.
  std::set<std::string> live(train_out.names().begin(), train_out.names().end());
  live.insert(val_out.names().begin(), val_out.names().end());
  static const std::regex shard_name(R"((train|val)_\d{6}\.bin)");
  for (const auto& e : fs::directory_iterator(opt.out_dir)) {
    std::string name = e.path().filename().string();
    if ((std::regex_match(name, shard_name) && !live.count(name)) || is_stale_temp(name)) fs::remove(e.path(), ec);
  }

  // 5. meta.json last: its presence means the directory is complete.
  nlohmann::ordered_json meta;
  meta["format_version"] = kDataFormatVersion;
  meta["vocab_size"] = tok.vocab_size();
  meta["eod_id"] = tok.eod_id();
  meta["tokenizer_hash"] = tok.hash();
  meta["tokenizer"] = "tokenizer.model";
  meta["dtype_bytes"] = tok.vocab_size() <= 65536 ? 2 : 4;
  meta["train_tokens"] = train_out.total();
  meta["val_tokens"] = val_out.total();
  meta["n_train_docs"] = train_idx.size();
  meta["n_val_docs"] = val_idx.size();
  meta["train_shards"] = train_out.names();
  meta["val_shards"] = val_out.names();
  meta["inputs"] = inputs;
  meta["val_fraction"] = opt.val_fraction;
  meta["shard_tokens"] = opt.shard_tokens;
  write_file_atomic(meta_path, meta.dump(2) + "\n");
  const auto t_end = clock::now();

  auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  fmt::print("data: {} documents ({} train, {} val) from {} file(s)\n", docs.size(), train_idx.size(),
             val_idx.size(), opt.inputs.size());
  fmt::print("data: tokenizer {} vocab {} (eod {}), {}\n", model_path.string(), tok.vocab_size(), tok.eod_id(),
             reused ? "reused" : "trained");
  fmt::print("data: {} train tokens in {} shard(s), {} val tokens in {} shard(s) -> {}\n", human(train_out.total()),
             train_out.names().size(), human(val_out.total()), val_out.names().size(), opt.out_dir.string());
  fmt::print("data: read {:.1f}s, tokenizer {:.1f}s, encode+write {:.1f}s, total {:.1f}s\n", secs(t0, t_read),
             secs(t_read, t_tok), secs(t_tok, t_end), secs(t0, t_end));
}

}  // namespace ladder::data
