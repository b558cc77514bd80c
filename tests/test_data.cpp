// Data pipeline tests: readers, tokenizer, shards, prepare, loader.
#include <gtest/gtest.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "core/fileio.h"
#include "data/loader.h"
#include "data/prepare.h"
#include "data/shard.h"
#include "data/text_reader.h"
#include "data/tokenizer.h"

namespace fs = std::filesystem;
using namespace ladder::data;

namespace {

// Own temp-dir helper (the shared test_util.h needs build-system macros this file avoids).
struct Tmp {
  fs::path path;
  explicit Tmp(const std::string& tag) {
    static int counter = 0;
    path = fs::temp_directory_path() / ("ladder-data-test-" + tag + "-" + std::to_string(::getpid()) + "-" +
                                        std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Tmp() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

void write_text(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary);
  f << s;
}

std::string read_bytes(const fs::path& p) { return ladder::read_file(p); }

void write_gz(const fs::path& p, const std::string& s) {
  gzFile g = gzopen(p.c_str(), "wb");
  ASSERT_NE(g, nullptr);
  ASSERT_EQ(gzwrite(g, s.data(), unsigned(s.size())), int(s.size()));
  gzclose(g);
}

void write_zst(const fs::path& p, const std::string& s) {
  std::string out(ZSTD_compressBound(s.size()), '\0');
  size_t n = ZSTD_compress(out.data(), out.size(), s.data(), s.size(), 3);
  ASSERT_FALSE(ZSTD_isError(n));
  out.resize(n);
  write_text(p, out);
}

std::vector<std::string> read_docs(const fs::path& p) {
  std::vector<std::string> docs;
  for_each_document(p, [&](std::string&& d) { docs.push_back(std::move(d)); });
  return docs;
}

// Runs f, expects a ladder::Error whose message contains every string in `needles`.
template <class F>
void expect_error(F&& f, std::initializer_list<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << *needles.begin() << "'";
  } catch (const ladder::Error& e) {
    std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "error should be one line: " << msg;
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

// A deterministic synthetic corpus: pseudo-English documents with unicode, tabs, repeated spaces,
// paragraph breaks, and a few exact duplicates (to exercise the split rule).
std::vector<std::string> synthetic_corpus(int n_docs) {
  uint64_t s = 12345;
  auto rnd = [&](uint64_t m) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return (s >> 33) % m;
  };
  const char* syl[] = {"ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "an", "el", "or", "the", "in", "ver", "dos"};
  std::vector<std::string> words;
  for (int i = 0; i < 120; ++i) {
    std::string w;
    int n = 1 + int(rnd(3));
    for (int k = 0; k < n; ++k) w += syl[rnd(15)];
    words.push_back(w);
  }
  for (const char* u : {"café", "naïve", "日本語", "Ωmega", "😀", "x\ty", "1984", "a  b"}) words.push_back(u);
  std::vector<std::string> docs;
  for (int d = 0; d < n_docs; ++d) {
    if (d % 37 == 36) {  // exact duplicate of an earlier document
      docs.push_back(docs[rnd(docs.size())]);
      continue;
    }
    std::string t = "Doc " + std::to_string(d) + ".";
    int n_words = 20 + int(rnd(150));
    for (int i = 0; i < n_words; ++i) {
      uint64_t r = rnd(40);
      t += r == 0 ? "\n\n" : r == 1 ? "\n" : r == 2 ? ". " : " ";
      t += words[rnd(words.size())];
    }
    t += ".";
    docs.push_back(t);
  }
  return docs;
}

// Prepared once for all tests that need it (tokenizer training dominates the cost).
struct Prepared {
  Tmp tmp{"prepared"};
  fs::path dir;
  std::vector<std::string> docs;
  Prepared() {
    docs = synthetic_corpus(400);
    nlohmann::json line;
    std::string jsonl;
    for (auto& d : docs) jsonl += nlohmann::json{{"text", d}}.dump() + "\n";
    write_text(tmp.path / "corpus.jsonl", jsonl);
    dir = tmp.path / "data";
    PrepareOptions opt;
    opt.inputs = {tmp.path / "corpus.jsonl"};
    opt.out_dir = dir;
    opt.vocab_size = 400;
    opt.val_fraction = 0.1;
    opt.shard_tokens = 5000;  // several shards, documents crossing shard boundaries
    prepare_data(opt);
  }
};
const Prepared& prepared() {
  static Prepared p;
  return p;
}

// Splits a token stream into documents at eod.
std::vector<std::vector<int32_t>> split_docs(const std::vector<int32_t>& stream, int eod) {
  std::vector<std::vector<int32_t>> out(1);
  for (int32_t t : stream) {
    if (t == eod)
      out.emplace_back();
    else
      out.back().push_back(t);
  }
  EXPECT_TRUE(out.back().empty()) << "stream must end with eod";
  out.pop_back();
  return out;
}

std::vector<int32_t> read_stream(const std::vector<fs::path>& shards, uint64_t hash) {
  std::vector<int32_t> all;
  for (auto& p : shards) {
    Shard s = Shard::open(p, hash);
    const std::vector<int32_t> t = s.tokens();
    all.insert(all.end(), t.begin(), t.end());
  }
  return all;
}

}  // namespace

// ---------------------------------------------------------------- text reader

TEST(DataReader, PlainTextSplitsOnTwoEmptyLines) {
  Tmp t("plain");
  write_text(t.path / "a.txt",
             "\n\nfirst line\nsecond line\n\nsame doc, new paragraph\n\n\ndoc two\n \n\t\n\ndoc three\r\nline\n\n\n");
  auto docs = read_docs(t.path / "a.txt");
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(docs[0], "first line\nsecond line\n\nsame doc, new paragraph");
  EXPECT_EQ(docs[1], "doc two");
  EXPECT_EQ(docs[2], "doc three\nline");
  // No separator: the whole file is one document (no trailing newline either).
  write_text(t.path / "one", "just\n\none document");
  EXPECT_EQ(read_docs(t.path / "one"), std::vector<std::string>{"just\n\none document"});
}

TEST(DataReader, CompressedAndJsonlReadTheSameDocuments) {
  Tmp t("formats");
  std::vector<std::string> docs = {"Hello world.\nSecond line", "Ünïcödé \"quotes\" and \\ backslash\n\none empty line",
                                   "tab\there"};
  // Enough text to cross the reader's 1 MiB buffer several times.
  std::string big;
  for (int i = 0; i < 60000; ++i) big += "line " + std::to_string(i) + " of a long document\n";
  big.pop_back();
  docs.push_back(big);
  std::string plain, jsonl;
  for (auto& d : docs) {
    plain += d + "\n\n\n";
    jsonl += nlohmann::json{{"text", d}, {"id", 7}}.dump() + "\n";
  }
  write_text(t.path / "c.txt", plain);
  write_gz(t.path / "c.txt.gz", plain);
  write_zst(t.path / "c.md.zst", plain);
  write_text(t.path / "c.jsonl", jsonl);
  write_gz(t.path / "c.jsonl.gz", jsonl);
  write_zst(t.path / "c.json.zst", jsonl);
  for (const char* name : {"c.txt", "c.txt.gz", "c.md.zst", "c.jsonl", "c.jsonl.gz", "c.json.zst"})
    EXPECT_EQ(read_docs(t.path / name), docs) << name;
}

TEST(DataReader, MalformedJsonlNamesFileAndLine) {
  Tmp t("badjson");
  write_text(t.path / "bad.jsonl", "{\"text\": \"ok\"}\n\n{\"text\": \"ok\" oops\n");
  expect_error([&] { read_docs(t.path / "bad.jsonl"); }, {"bad.jsonl:3:", "JSON"});
  write_text(t.path / "notext.jsonl", "{\"text\": \"ok\"}\n{\"body\": \"no text\"}\n");
  expect_error([&] { read_docs(t.path / "notext.jsonl"); }, {"notext.jsonl:2:", "\"text\""});
  write_text(t.path / "num.jsonl", "{\"text\": 5}\n");
  expect_error([&] { read_docs(t.path / "num.jsonl"); }, {"num.jsonl:1:"});
}

TEST(DataReader, JsonNumberOutOfRangeNamesFileAndLine) {
  // Valid JSON syntax, but 1e400 does not fit a double: the parser throws out_of_range, not parse_error.
  Tmp t("bignum");
  write_text(t.path / "big.jsonl", "{\"text\": \"fine\"}\n{\"text\":\"hello\",\"score\":1e400}\n");
  expect_error([&] { read_docs(t.path / "big.jsonl"); }, {"big.jsonl:2:", "1e400"});
}

TEST(DataReader, GzipMembersTrailingBytesAndEmptyFiles) {
  Tmp t("gztail");
  // Concatenated members (`cat a.gz b.gz`) are one valid gzip file and read completely.
  write_gz(t.path / "a.gz.part", "first doc\n\n\n");
  write_gz(t.path / "b.gz.part", "second doc\n");
  const std::string a = read_bytes(t.path / "a.gz.part"), b = read_bytes(t.path / "b.gz.part");
  write_text(t.path / "two.txt.gz", a + b);
  EXPECT_EQ(read_docs(t.path / "two.txt.gz"), (std::vector<std::string>{"first doc", "second doc"}));
  // An empty member between them is fine too.
  write_gz(t.path / "e.gz.part", "");
  write_text(t.path / "three.txt.gz", a + read_bytes(t.path / "e.gz.part") + b);
  EXPECT_EQ(read_docs(t.path / "three.txt.gz").size(), 2u);
  // Anything else after the last member is damage (zlib's gzread would drop it silently).
  write_text(t.path / "junk.txt.gz", a + "trailing junk\n");
  expect_error([&] { read_docs(t.path / "junk.txt.gz"); }, {"junk.txt.gz", "after the end of the gzip data"});
  write_text(t.path / "nl.txt.gz", a + "\n");  // a single stray byte
  expect_error([&] { read_docs(t.path / "nl.txt.gz"); }, {"nl.txt.gz", "after the end of the gzip data"});
  write_text(t.path / "zeros.txt.gz", a + std::string(512, '\0'));
  expect_error([&] { read_docs(t.path / "zeros.txt.gz"); }, {"zeros.txt.gz", "after the end of the gzip data"});
  // A 0-byte file is not a gzip file (gzip itself rejects it).
  write_text(t.path / "empty.txt.gz", "");
  expect_error([&] { read_docs(t.path / "empty.txt.gz"); }, {"empty.txt.gz", "not gzip"});
  // Damage inside a member is still reported as such.
  std::string bad = a;
  bad[bad.size() - 6] ^= 0x55;  // in the CRC32 trailer
  write_text(t.path / "crc.txt.gz", bad);
  expect_error([&] { read_docs(t.path / "crc.txt.gz"); }, {"crc.txt.gz", "corrupt gzip"});
}

TEST(DataReader, BadInputsAreClearErrors) {
  Tmp t("badinput");
  write_text(t.path / "x.csv", "a,b\n");
  expect_error([&] { read_docs(t.path / "x.csv"); }, {"x.csv", "unsupported"});
  expect_error([&] { read_docs(t.path / "missing.txt"); }, {"missing.txt", "not found"});
  std::string text(100000, 'a');
  write_gz(t.path / "full.txt.gz", text);
  std::string gz = read_bytes(t.path / "full.txt.gz");
  write_text(t.path / "cut.txt.gz", gz.substr(0, gz.size() / 2));
  expect_error([&] { read_docs(t.path / "cut.txt.gz"); }, {"cut.txt.gz", "gzip"});
  write_text(t.path / "plain.txt.gz", "not compressed at all\n");
  expect_error([&] { read_docs(t.path / "plain.txt.gz"); }, {"plain.txt.gz", "gzip"});
  write_zst(t.path / "full.txt.zst", text + "b");
  std::string zst = read_bytes(t.path / "full.txt.zst");
  write_text(t.path / "cut.txt.zst", zst.substr(0, zst.size() - 4));
  expect_error([&] { read_docs(t.path / "cut.txt.zst"); }, {"cut.txt.zst", "zstd"});
}

// ---------------------------------------------------------------- shards

TEST(DataShard, RoundTripUint16AndUint32) {
  Tmp t("shard");
  std::vector<int32_t> small = {0, 1, 2, 65535, 300, 7};
  write_shard(t.path / "s16.bin", small, 65536, 0xABCDu);
  Shard a = Shard::open(t.path / "s16.bin", 0xABCDu);
  EXPECT_EQ(a.tokens(), small);
  EXPECT_EQ(a.vocab_size(), 65536);
  EXPECT_EQ(a.tokenizer_hash(), 0xABCDu);
  EXPECT_EQ(fs::file_size(t.path / "s16.bin"), 64u + 2 * small.size());

  std::vector<int32_t> big;
  for (int i = 0; i < 1000; ++i) big.push_back((i * 7919) % 70000);
  big.push_back(69999);
  write_shard(t.path / "s32.bin", big, 70000, 42);
  std::string bytes = read_bytes(t.path / "s32.bin");
  ASSERT_EQ(bytes.size(), 64u + 4 * big.size());
  EXPECT_EQ(bytes.substr(0, 8), "LDRTOKS1");
  EXPECT_EQ(bytes[12], 4);  // dtype_bytes
  Shard b = Shard::open(t.path / "s32.bin", 0);
  EXPECT_EQ(b.tokens(), big);
  EXPECT_EQ(b.vocab_size(), 70000);

  expect_error([&] { write_shard(t.path / "bad.bin", {5, 10}, 10, 1); }, {"bad.bin", "outside the vocabulary"});
  EXPECT_FALSE(fs::exists(t.path / "bad.bin"));
}

TEST(DataShard, CorruptionIsDetected) {
  Tmp t("corrupt");
  std::vector<int32_t> toks;
  for (int i = 0; i < 500; ++i) toks.push_back(i % 999);
  const fs::path good = t.path / "good.bin";
  write_shard(good, toks, 1000, 77);
  const std::string bytes = read_bytes(good);

  write_text(t.path / "trunc.bin", bytes.substr(0, bytes.size() - 3));
  expect_error([&] { Shard::open(t.path / "trunc.bin", 0); }, {"trunc.bin", "truncated", "500"});
  write_text(t.path / "tiny.bin", bytes.substr(0, 20));
  expect_error([&] { Shard::open(t.path / "tiny.bin", 0); }, {"tiny.bin", "truncated"});

  std::string flipped = bytes;
  flipped[64 + 100] ^= 0x01;
  write_text(t.path / "flip.bin", flipped);
  expect_error([&] { Shard::open(t.path / "flip.bin", 0); }, {"flip.bin", "checksum"});

  std::string magic = bytes;
  magic[0] = 'X';
  write_text(t.path / "magic.bin", magic);
  expect_error([&] { Shard::open(t.path / "magic.bin", 0); }, {"magic.bin", "magic", "LDRTOKS1"});

  std::string version = bytes;
  version[8] = 9;
  write_text(t.path / "version.bin", version);
  expect_error([&] { Shard::open(t.path / "version.bin", 0); }, {"version.bin", "version", "9"});

  // Header vocab lowered below the ids present (the payload checksum still matches).
  std::string vocab = bytes;
  vocab[40] = char(100), vocab[41] = 0;
  write_text(t.path / "vocab.bin", vocab);
  expect_error([&] { Shard::open(t.path / "vocab.bin", 0); }, {"vocab.bin", "outside the vocabulary"});

  expect_error([&] { Shard::open(good, 78); }, {"good.bin", "tokenizer"});
  EXPECT_NO_THROW(Shard::open(good, 77));
}

// ---------------------------------------------------------------- tokenizer + prepare

TEST(DataPrepare, TextToShardsToTextRoundTrips) {
  const auto& p = prepared();
  DataMeta meta = read_meta(p.dir);
  Tokenizer tok = Tokenizer::load(p.dir / "tokenizer.model");
  EXPECT_EQ(tok.vocab_size(), 400);
  EXPECT_EQ(meta.vocab_size, 400);
  EXPECT_EQ(meta.eod_id, tok.eod_id());
  EXPECT_EQ(meta.tokenizer_hash, tok.hash());
  EXPECT_GT(meta.train_shards.size(), 1u);

  std::vector<std::string> want_train, want_val;
  for (auto& d : p.docs) (is_val_document(d, 0.1) ? want_val : want_train).push_back(d);
  ASSERT_FALSE(want_val.empty());

  auto train = read_stream(meta.train_shards, meta.tokenizer_hash);
  auto val = read_stream(meta.val_shards, meta.tokenizer_hash);
  EXPECT_EQ(train.size(), meta.train_tokens);
  EXPECT_EQ(val.size(), meta.val_tokens);
  std::vector<std::string> got_train, got_val;
  for (auto& ids : split_docs(train, meta.eod_id)) got_train.push_back(tok.decode(ids));
  for (auto& ids : split_docs(val, meta.eod_id)) got_val.push_back(tok.decode(ids));
  EXPECT_EQ(got_train, want_train);
  EXPECT_EQ(got_val, want_val);

  // Anything encodes and decodes back exactly (byte fallback, identity normalization), even leading
  // whitespace (no dummy prefix to strip) ...
  for (std::string s : {"  leading spaces\tand tabs\n\nnew  lines ", "unseen: Ж ☃ 𝄞 \x01", "", " ", "\n x"})
    EXPECT_EQ(tok.decode(tok.encode(s)), s);
  // ... except U+2581, sentencepiece's own symbol for a space, which comes back as a space.
  EXPECT_EQ(tok.decode(tok.encode("a\u2581b")), "a b");

  nlohmann::json m = nlohmann::json::parse(read_bytes(p.dir / "meta.json"));
  EXPECT_EQ(m["n_train_docs"].get<size_t>(), want_train.size());
  EXPECT_EQ(m["n_val_docs"].get<size_t>(), want_val.size());
  EXPECT_EQ(m["inputs"].size(), 1u);
}

TEST(DataPrepare, TrainAndValAreDisjoint) {
  const auto& p = prepared();
  DataMeta meta = read_meta(p.dir);
  Tokenizer tok = Tokenizer::load(p.dir / "tokenizer.model");
  std::set<std::string> train, val;
  for (auto& ids : split_docs(read_stream(meta.train_shards, 0), meta.eod_id)) train.insert(tok.decode(ids));
  for (auto& ids : split_docs(read_stream(meta.val_shards, 0), meta.eod_id)) val.insert(tok.decode(ids));
  ASSERT_FALSE(val.empty());
  for (auto& v : val) EXPECT_EQ(train.count(v), 0u) << "val document also in train: " << v.substr(0, 60);
}

// 60 synthetic documents as one plain-text file in `dir`, and options that prepare it into dir/d
// with a 320-piece vocabulary.
PrepareOptions plain_corpus_options(const fs::path& dir, size_t* n_docs = nullptr) {
  auto docs = synthetic_corpus(60);
  std::string plain;
  for (auto& d : docs) plain += d + "\n\n\n";
  write_text(dir / "c.txt", plain);
  if (n_docs) *n_docs = docs.size();
  PrepareOptions opt;
  opt.inputs = {dir / "c.txt"};
  opt.out_dir = dir / "d";
  opt.vocab_size = 320;
  return opt;
}

TEST(DataPrepare, AlwaysAtLeastOneValDocumentAndReuse) {
  Tmp t("tiny");
  size_t n_docs = 0;
  PrepareOptions opt = plain_corpus_options(t.path, &n_docs);
  opt.val_fraction = 0.0;
  prepare_data(opt);
  nlohmann::json m = nlohmann::json::parse(read_bytes(opt.out_dir / "meta.json"));
  EXPECT_GE(m["n_val_docs"].get<size_t>(), 1u);
  EXPECT_EQ(m["n_train_docs"].get<size_t>() + m["n_val_docs"].get<size_t>(), n_docs);
  // Second run reuses the tokenizer: same model bytes, same shards.
  std::string model = read_bytes(opt.out_dir / "tokenizer.model");
  std::string shard = read_bytes(opt.out_dir / "train_000000.bin");
  prepare_data(opt);
  EXPECT_EQ(read_bytes(opt.out_dir / "tokenizer.model"), model);
  EXPECT_EQ(read_bytes(opt.out_dir / "train_000000.bin"), shard);
}

TEST(DataPrepare, ExistingTokenizerIsCheckedBeforeReadingInputs) {
  Tmp t("reuse-vocab");
  PrepareOptions opt = plain_corpus_options(t.path);
  prepare_data(opt);
  const std::string meta = read_bytes(opt.out_dir / "meta.json");

  // The inputs do not exist: each check below must fail before they are read, and leave the
  // directory as it was.
  PrepareOptions again = opt;
  again.inputs = {t.path / "missing.txt"};
  again.vocab_size = 400;
  again.vocab_explicit = true;
  expect_error([&] { prepare_data(again); }, {"tokenizer.model", "vocab_size 320", "400", "delete"});
  again.vocab_size = 100;  // out of range even though the existing tokenizer would be reused
  expect_error([&] { prepare_data(again); }, {"vocab_size", "[300,", "100"});
  again.vocab_explicit = false;
  expect_error([&] { prepare_data(again); }, {"vocab_size", "100"});
  write_text(t.path / "junk.model", "not a model");
  fs::copy_file(opt.out_dir / "tokenizer.model", t.path / "good.model");
  fs::copy_file(t.path / "junk.model", opt.out_dir / "tokenizer.model", fs::copy_options::overwrite_existing);
  again.vocab_size = 320;
  expect_error([&] { prepare_data(again); }, {"tokenizer.model", "sentencepiece"});
  fs::copy_file(t.path / "good.model", opt.out_dir / "tokenizer.model", fs::copy_options::overwrite_existing);
  EXPECT_EQ(read_bytes(opt.out_dir / "meta.json"), meta);

  // The default vocab_size (not asked for) reuses the tokenizer as it is, with a note.
  PrepareOptions dflt;
  dflt.inputs = opt.inputs;
  dflt.out_dir = opt.out_dir;
  EXPECT_FALSE(dflt.vocab_explicit);
  prepare_data(dflt);
  EXPECT_EQ(read_meta(opt.out_dir).vocab_size, 320);
  // An explicit request that matches is fine; with reuse off a new tokenizer is trained.
  PrepareOptions same = opt;
  same.vocab_explicit = true;
  EXPECT_NO_THROW(prepare_data(same));
  PrepareOptions retrain = opt;
  retrain.vocab_size = 330;
  retrain.vocab_explicit = true;
  retrain.reuse_tokenizer = false;
  prepare_data(retrain);
  EXPECT_EQ(read_meta(opt.out_dir).vocab_size, 330);
}

// Bad input found while reading (a corrupt JSONL line, a document-less input) fails naming the file
// and leaves a complete data directory complete: meta.json, tokenizer and shards as they were (the
// old meta.json used to be removed before the inputs were read).
TEST(DataPrepare, BadInputLeavesACompleteDirectoryAsItWas) {
  Tmp t("bad-input");
  PrepareOptions opt = plain_corpus_options(t.path);
  prepare_data(opt);
  const std::string meta = read_bytes(opt.out_dir / "meta.json");
  const std::string model = read_bytes(opt.out_dir / "tokenizer.model");
  const std::string shard = read_bytes(opt.out_dir / "train_000000.bin");
  write_text(t.path / "bad.jsonl", "{\"text\": \"fine\"}\n{\"text\": oops}\n");
  write_text(t.path / "empty.txt", "\n\n");
  for (bool reuse : {true, false}) {
    PrepareOptions bad = opt;
    bad.reuse_tokenizer = reuse;
    bad.inputs = {opt.inputs[0], t.path / "bad.jsonl"};
    expect_error([&] { prepare_data(bad); }, {"bad.jsonl:2"});
    bad.inputs = {t.path / "empty.txt"};
    expect_error([&] { prepare_data(bad); }, {"no documents"});
    EXPECT_EQ(read_bytes(opt.out_dir / "meta.json"), meta) << "reuse " << reuse;
    EXPECT_EQ(read_bytes(opt.out_dir / "tokenizer.model"), model) << "reuse " << reuse;
    EXPECT_EQ(read_bytes(opt.out_dir / "train_000000.bin"), shard) << "reuse " << reuse;
  }
}

TEST(DataPrepare, RemovesStaleShardsAndTempFilesOfKilledRuns) {
  Tmp t("stale");
  auto docs = synthetic_corpus(60);
  std::string jsonl;
  for (auto& d : docs) jsonl += nlohmann::json{{"text", d}}.dump() + "\n";
  write_text(t.path / "c.jsonl", jsonl);
  PrepareOptions opt;
  opt.inputs = {t.path / "c.jsonl"};
  opt.out_dir = t.path / "d";
  opt.vocab_size = 320;
  fs::create_directories(opt.out_dir);
  const fs::path d = opt.out_dir;
  // Left by a killed run: a process id far above any pid_max, so certainly not running.
  for (const char* f : {"train_000007.bin", "train_000003.bin.tmp.999999999.0", "meta.json.tmp.999999999.4",
                        "tokenizer.model.tmp.999999999.1", "val_000000.bin.tmp.999999999.12"})
    write_text(d / f, "x");
  // Not ours to remove: other names, and a temp file of a process that is still running (this one).
  const std::string live = "train_000000.bin.tmp." + std::to_string(::getpid()) + ".99";
  for (std::string f : {std::string("notes.txt.tmp.999999999.0"), std::string("train_000000.bin.tmp.x.0"),
                        std::string("my.tmp.999999999.0.bak"), live})
    write_text(d / f, "x");
  prepare_data(opt);
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(d)) names.insert(e.path().filename().string());
  for (const char* f : {"train_000007.bin", "train_000003.bin.tmp.999999999.0", "meta.json.tmp.999999999.4",
                        "tokenizer.model.tmp.999999999.1", "val_000000.bin.tmp.999999999.12"})
    EXPECT_EQ(names.count(f), 0u) << f;
  for (std::string f : {std::string("notes.txt.tmp.999999999.0"), std::string("train_000000.bin.tmp.x.0"),
                        std::string("my.tmp.999999999.0.bak"), live})
    EXPECT_EQ(names.count(f), 1u) << f;
  EXPECT_EQ(names.count("meta.json"), 1u);
}

TEST(DataTokenizer, WordAfterNewlineEncodesAsAtDocumentStart) {
  // Training sees one line per sentence; encoding sees whole documents. A word that starts a line
  // must get the pieces training learnt for line starts, wherever the line is in the document.
  const auto& p = prepared();
  Tokenizer tok = Tokenizer::load(p.dir / "tokenizer.model");
  EXPECT_TRUE(tok.cuts_at_newlines());
  const std::vector<int32_t> prefix = tok.encode("Doc 1.\n");
  size_t start_pieces = 0, mid_pieces = 0;
  for (std::string w : {"the", "kalo", "mine", "ruta", "shipo", "anel", "verdos", "Doc", "café"}) {
    std::vector<int32_t> at_start = tok.encode(w), after_nl = tok.encode("Doc 1.\n" + w);
    ASSERT_GE(after_nl.size(), prefix.size());
    EXPECT_EQ(std::vector<int32_t>(after_nl.begin(), after_nl.begin() + prefix.size()), prefix) << w;
    EXPECT_EQ(std::vector<int32_t>(after_nl.begin() + prefix.size(), after_nl.end()), at_start) << w;
    start_pieces += at_start.size();
    mid_pieces += tok.encode("x " + w).size() - tok.encode("x").size();
  }
  // Line-initial words were seen in training (every training line starts with one), so they are not
  // split into more pieces than mid-line words, give or take.
  EXPECT_LE(start_pieces, mid_pieces + 3);
}

TEST(DataTokenizer, LongDocumentsEncodeInPiecesWithTheSameIds) {
  // newline_pieces: cut after "\n", within max_bytes unless a line alone is longer.
  auto cut = [](std::string_view s, size_t max) {
    std::vector<std::string> out;
    for (auto v : newline_pieces(s, max)) out.emplace_back(v);
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(cut("", 4), V{""});
  EXPECT_EQ(cut("abc", 4), V{"abc"});
  EXPECT_EQ(cut("ab\ncd\nef", 6), (V{"ab\ncd\n", "ef"}));
  EXPECT_EQ(cut("ab\ncd\nef", 3), (V{"ab\n", "cd\n", "ef"}));
  EXPECT_EQ(cut("abcdefgh\nij\n", 3), (V{"abcdefgh\n", "ij\n"}));  // a long line stays whole
  EXPECT_EQ(cut("abcdefgh", 3), V{"abcdefgh"});
  EXPECT_EQ(cut("\n\n\n\n", 2), (V{"\n\n", "\n\n"}));

  // A multi-line document several times kEncodePieceBytes, encoded by Tokenizer (in pieces) and by
  // sentencepiece in one call, gives the same ids.
  const auto& p = prepared();
  Tokenizer tok = Tokenizer::load(p.dir / "tokenizer.model");
  ASSERT_TRUE(tok.cuts_at_newlines());
  std::string doc;
  for (const auto& d : synthetic_corpus(400)) doc += d + "\n";
  doc += std::string(3 * kEncodePieceBytes / 2, 'q') + "\n\n  tail ";  // one line longer than a piece
  ASSERT_GT(doc.size(), 3 * kEncodePieceBytes);
  ASSERT_GT(newline_pieces(doc, kEncodePieceBytes).size(), 3u);
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load((p.dir / "tokenizer.model").string()).ok());
  std::vector<int> whole;
  ASSERT_TRUE(sp.Encode(doc, &whole).ok());
  std::vector<int32_t> got = tok.encode(doc);
  EXPECT_EQ(got, std::vector<int32_t>(whole.begin(), whole.end()));
  EXPECT_EQ(tok.decode(got), doc);

  // prepare encodes the same way: a plain-text file without blank-line separators is one document.
  Tmp t("longdoc");
  write_text(t.path / "one.txt", doc + "\n\n\n" + "another document");
  PrepareOptions opt;
  opt.inputs = {t.path / "one.txt"};
  opt.out_dir = t.path / "d";
  fs::create_directories(opt.out_dir);
  fs::copy_file(p.dir / "tokenizer.model", opt.out_dir / "tokenizer.model");
  opt.vocab_size = 400;
  opt.val_fraction = 0.0;  // the smaller hash key goes to val; find the long document on either side
  prepare_data(opt);
  DataMeta meta = read_meta(opt.out_dir);
  auto stream = read_stream(meta.train_shards, meta.tokenizer_hash);
  auto val = read_stream(meta.val_shards, meta.tokenizer_hash);
  stream.insert(stream.end(), val.begin(), val.end());
  bool found = false;
  for (auto& ids : split_docs(stream, meta.eod_id)) {
    if (ids.size() != whole.size()) continue;
    found = true;
    EXPECT_EQ(ids, std::vector<int32_t>(whole.begin(), whole.end()));
  }
  EXPECT_TRUE(found);
}

TEST(DataTokenizer, ModelWithDummyPrefixIsEncodedWhole) {
  // Tokenizers trained before add_dummy_prefix was turned off live on in existing data directories;
  // for them cutting would change the ids, so encode() must not cut.
  Tmp t("dummy");
  std::vector<std::string> lines;
  for (const auto& d : synthetic_corpus(80))
    for (size_t p = 0, q; p < d.size(); p = q + 1) {
      q = std::min(d.find('\n', p), d.size());
      if (q > p) lines.push_back(d.substr(p, q - p));
    }
  struct Lines : sentencepiece::SentenceIterator {
    const std::vector<std::string>& l;
    size_t i = 0;
    explicit Lines(const std::vector<std::string>& v) : l(v) {}
    bool done() const override { return i >= l.size(); }
    void Next() override { ++i; }
    const std::string& value() const override { return l[i]; }
    sentencepiece::util::Status status() const override { return {}; }
  } it(lines);
  std::unordered_map<std::string, std::string> args = {
      {"model_type", "bpe"}, {"vocab_size", "320"}, {"byte_fallback", "true"},
      {"normalization_rule_name", "identity"}, {"remove_extra_whitespaces", "false"},
      {"user_defined_symbols", "\n"}, {"num_threads", "1"}, {"minloglevel", "2"}};  // add_dummy_prefix: default
  std::string model;
  ASSERT_TRUE(sentencepiece::SentencePieceTrainer::Train(args, &it, &model).ok());
  write_text(t.path / "old.model", model);
  Tokenizer tok = Tokenizer::load(t.path / "old.model");
  EXPECT_FALSE(tok.cuts_at_newlines());
  std::string doc;
  while (doc.size() < 2 * kEncodePieceBytes) doc += lines[doc.size() % lines.size()] + "\n";
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.LoadFromSerializedProto(model).ok());
  std::vector<int> whole;
  ASSERT_TRUE(sp.Encode(doc, &whole).ok());
  EXPECT_EQ(tok.encode(doc), std::vector<int32_t>(whole.begin(), whole.end()));
}

TEST(DataPrepare, TokenizerMismatchIsAnError) {
  const auto& p = prepared();
  Tmp t("mismatch");
  fs::copy(p.dir, t.path / "d");
  // A different tokenizer (other vocab size) next to shards made with the first one.
  std::vector<std::string> docs = synthetic_corpus(50);
  train_tokenizer(docs, 350, t.path / "other");
  fs::copy_file(t.path / "other" / "tokenizer.model", t.path / "d" / "tokenizer.model",
                fs::copy_options::overwrite_existing);
  expect_error([&] { read_meta(t.path / "d"); }, {"tokenizer.model", "does not match"});
  expect_error([&] { DataLoader(t.path / "d", "train", 16, 2, 1, true); }, {"tokenizer"});
  // Shards checked against meta.json's hash directly too (no tokenizer.model present).
  fs::remove(t.path / "d" / "tokenizer.model");
  DataMeta meta = read_meta(t.path / "d");
  expect_error([&] { Shard::open(meta.train_shards[0], meta.tokenizer_hash + 1); }, {"train_000000.bin", "tokenizer"});
  EXPECT_NO_THROW(DataLoader(t.path / "d", "train", 16, 2, 1, true));

  expect_error([&] { Tokenizer::load(t.path / "nope.model"); }, {"nope.model", "not found"});
  write_text(t.path / "junk.model", "this is not a protobuf");
  expect_error([&] { Tokenizer::load(t.path / "junk.model"); }, {"junk.model"});
}

// ---------------------------------------------------------------- loader

namespace {

// A data directory whose token i is i (vocab 70000: the uint32 path), so a window is identified by
// its first token. No tokenizer.model; meta.json written by hand.
fs::path make_counting_dir(const fs::path& root, size_t n_train, size_t n_val, size_t shard_tokens) {
  const fs::path dir = root / "count";
  fs::create_directories(dir);
  auto write_split = [&](const std::string& name, size_t n) {
    nlohmann::json names = nlohmann::json::array();
    for (size_t start = 0, k = 0; start < n; start += shard_tokens, ++k) {
      std::vector<int32_t> toks;
      for (size_t i = start; i < std::min(n, start + shard_tokens); ++i) toks.push_back(int32_t(i % 70000));
      std::string f = name + "_" + std::to_string(100000 + k).substr(1) + ".bin";
      write_shard(dir / f, toks, 70000, 99);
      names.push_back(f);
    }
    return names;
  };
  nlohmann::json meta = {{"format_version", 1}, {"vocab_size", 70000}, {"eod_id", 0}, {"tokenizer_hash", 99},
                         {"train_tokens", n_train}, {"val_tokens", n_val}};
  meta["train_shards"] = write_split("train", n_train);
  meta["val_shards"] = write_split("val", n_val);
  ladder::write_file_atomic(dir / "meta.json", meta.dump());
  return dir;
}

struct Batch {
  std::vector<int32_t> x, y;
  bool operator==(const Batch&) const = default;
};
Batch next_batch(DataLoader& dl, int batch, int seq) {
  Batch b{std::vector<int32_t>(size_t(batch) * seq), std::vector<int32_t>(size_t(batch) * seq)};
  dl.next(b.x.data(), b.y.data());
  return b;
}

}  // namespace

TEST(DataLoader, DeterministicAndTargetsAreShiftedInputs) {
  Tmp t("det");
  // 1001 tokens, seq 10 -> 100 windows; shards of 333 make windows straddle shard boundaries.
  fs::path dir = make_counting_dir(t.path, 1001, 200, 333);
  const int B = 4, S = 10;
  DataLoader a(dir, "train", S, B, 7, true), b(dir, "train", S, B, 7, true), c(dir, "train", S, B, 8, true);
  EXPECT_EQ(a.n_windows(), 100u);
  EXPECT_EQ(a.vocab_size(), 70000);
  EXPECT_EQ(a.tokenizer_hash(), 99u);
  bool differs = false;
  for (int step = 0; step < 60; ++step) {  // 240 samples: crosses two epoch boundaries
    Batch ba = next_batch(a, B, S), bb = next_batch(b, B, S), bc = next_batch(c, B, S);
    ASSERT_EQ(ba, bb) << "step " << step;
    differs |= !(ba == bc);
    for (int r = 0; r < B; ++r) {
      int32_t first = ba.x[size_t(r) * S];
      EXPECT_EQ(first % S, 0) << "windows start at multiples of seq_len";
      for (int k = 0; k < S; ++k) {
        EXPECT_EQ(ba.x[size_t(r) * S + k], first + k);
        EXPECT_EQ(ba.y[size_t(r) * S + k], first + k + 1);
      }
    }
  }
  EXPECT_TRUE(differs) << "a different seed should give a different order";
}

// The loader reads windows from the mapped shards on demand: a window may span several shards (here
// shards of 3 tokens, windows of 11), and every id is the stream's.
TEST(DataLoader, WindowsSpanningSeveralShardsReadTheStream) {
  Tmp t("tiny-shards");
  fs::path dir = make_counting_dir(t.path, 1001, 200, 3);
  const int B = 4, S = 10;
  DataLoader dl(dir, "train", S, B, 5, true);
  EXPECT_EQ(dl.n_tokens(), 1001u);
  for (int step = 0; step < 30; ++step) {
    Batch b = next_batch(dl, B, S);
    for (int r = 0; r < B; ++r) {
      const int32_t first = b.x[size_t(r) * S];
      EXPECT_EQ(first % S, 0);
      for (int k = 0; k < S; ++k) {
        ASSERT_EQ(b.x[size_t(r) * S + k], first + k) << "step " << step << " row " << r;
        ASSERT_EQ(b.y[size_t(r) * S + k], first + k + 1) << "step " << step << " row " << r;
      }
    }
  }
}

TEST(DataLoader, EachEpochIsAPermutation) {
  Tmp t("perm");
  fs::path dir = make_counting_dir(t.path, 1001, 200, 1000);
  const int B = 5, S = 10;  // 100 windows = 20 batches per epoch
  DataLoader dl(dir, "train", S, B, 3, true);
  std::vector<std::vector<int32_t>> epochs(3);
  for (int step = 0; step < 60; ++step) {
    Batch b = next_batch(dl, B, S);
    for (int r = 0; r < B; ++r) epochs[step / 20].push_back(b.x[size_t(r) * S] / S);
  }
  for (auto& e : epochs) EXPECT_EQ(std::set<int32_t>(e.begin(), e.end()).size(), 100u);
  EXPECT_NE(epochs[0], epochs[1]) << "each epoch reshuffles";
}

TEST(DataLoader, StateRestoreContinuesExactly) {
  Tmp t("state");
  fs::path dir = make_counting_dir(t.path, 1001, 200, 400);
  const int B = 3, S = 10;
  DataLoader a(dir, "train", S, B, 11, true);
  for (int i = 0; i < 31; ++i) next_batch(a, B, S);  // mid-epoch (93 of 100 windows)
  nlohmann::json st = nlohmann::json::parse(a.state().dump());  // as stored in a checkpoint
  std::vector<Batch> want;
  for (int i = 0; i < 10; ++i) want.push_back(next_batch(a, B, S));
  DataLoader b(dir, "train", S, B, 11, true);
  b.restore(st);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(next_batch(b, B, S), want[size_t(i)]) << i;

  DataLoader other_seed(dir, "train", S, B, 12, true);
  expect_error([&] { other_seed.restore(st); }, {"seed"});
  DataLoader other_seq(dir, "train", 20, B, 11, true);
  expect_error([&] { other_seq.restore(st); }, {"does not match"});
  DataLoader val(dir, "val", S, B, 11, true);
  expect_error([&] { val.restore(st); }, {"split"});
  Tmp t2("state2");
  fs::path dir2 = make_counting_dir(t2.path, 1101, 200, 400);
  DataLoader other_data(dir2, "train", S, B, 11, true);
  expect_error([&] { other_data.restore(st); }, {"does not match"});
}

TEST(DataLoader, RanksReadDisjointWindows) {
  Tmp t("ranks");
  fs::path dir = make_counting_dir(t.path, 2001, 200, 700);
  const int B = 4, S = 10, W = 2;  // 200 windows = 25 global batches per epoch
  DataLoader r0(dir, "train", S, B, 5, true, 0, W), r1(dir, "train", S, B, 5, true, 1, W);
  DataLoader single(dir, "train", S, B * W, 5, true);
  std::set<int32_t> seen0, seen1;
  for (int step = 0; step < 25; ++step) {
    Batch a = next_batch(r0, B, S), b = next_batch(r1, B, S), g = next_batch(single, B * W, S);
    for (int r = 0; r < B; ++r) {
      seen0.insert(a.x[size_t(r) * S]);
      seen1.insert(b.x[size_t(r) * S]);
    }
    // Rank 0 and 1 together read exactly what one rank with the global batch reads.
    std::vector<int32_t> joined = a.x;
    joined.insert(joined.end(), b.x.begin(), b.x.end());
    EXPECT_EQ(joined, g.x);
  }
  for (int32_t w : seen0) EXPECT_EQ(seen1.count(w), 0u) << "window " << w / S << " read by both ranks";
  EXPECT_EQ(seen0.size() + seen1.size(), 200u);
}

TEST(DataLoader, ValidationIsSequentialAndResets) {
  Tmp t("val");
  fs::path dir = make_counting_dir(t.path, 1001, 95, 1000);
  const int B = 2, S = 10;  // 95 val tokens -> 9 windows
  DataLoader v(dir, "val", S, B, 0, false);
  EXPECT_EQ(v.n_windows(), 9u);
  std::vector<int32_t> firsts;
  for (int i = 0; i < 5; ++i) {
    Batch b = next_batch(v, B, S);
    for (int r = 0; r < B; ++r) firsts.push_back(b.x[size_t(r) * S]);
  }
  EXPECT_EQ(firsts, (std::vector<int32_t>{0, 10, 20, 30, 40, 50, 60, 70, 80, 0}));  // wraps after 9
  v.reset();
  EXPECT_EQ(next_batch(v, B, S).x[0], 0);
  expect_error([&] { DataLoader(dir, "val", 100, 1, 0, false); }, {"val", "seq_len+1"});
  expect_error([&] { DataLoader(dir, "test", 10, 1, 0, false); }, {"split"});
}

TEST(DataLoader, MetaErrorsNameFileAndField) {
  Tmp t("meta");
  expect_error([&] { read_meta(t.path); }, {"meta.json", "incomplete"});
  fs::path dir = make_counting_dir(t.path, 101, 50, 1000);
  nlohmann::json m = nlohmann::json::parse(read_bytes(dir / "meta.json"));
  m.erase("val_tokens");
  ladder::write_file_atomic(dir / "meta.json", m.dump());
  expect_error([&] { read_meta(dir); }, {"meta.json", "val_tokens"});
  m["val_tokens"] = 50;
  m["vocab_size"] = "big";
  ladder::write_file_atomic(dir / "meta.json", m.dump());
  expect_error([&] { read_meta(dir); }, {"meta.json", "vocab_size"});
  m["vocab_size"] = 70000;
  m["train_tokens"] = 102;  // disagrees with the shards
  ladder::write_file_atomic(dir / "meta.json", m.dump());
  expect_error([&] { DataLoader(dir, "train", 10, 1, 0, true); }, {"train_tokens", "102", "101"});
  // A count no shard could hold fails before memory is reserved for it.
  m["train_tokens"] = uint64_t(100'000'000'000'000'000);
  ladder::write_file_atomic(dir / "meta.json", m.dump());
  expect_error([&] { DataLoader(dir, "train", 10, 1, 0, true); }, {"meta.json", "train_tokens", "at most"});
  // A number beyond double range in any field (even one read_meta ignores) is well-formed JSON that
  // the parser cannot hold.
  m["train_tokens"] = 101;
  std::string text = m.dump();
  text.insert(text.size() - 1, ",\"val_fraction\":1e400");
  ladder::write_file_atomic(dir / "meta.json", text);
  expect_error([&] { read_meta(dir); }, {"meta.json", "1e400"});
}
