// `ladder data`: corpus files -> tokenizer + token shards + meta.json.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string_view>
#include <vector>

namespace ladder::data {

inline constexpr int kDataFormatVersion = 1;

struct PrepareOptions {
  std::vector<std::filesystem::path> inputs;
  std::filesystem::path out_dir;
  int vocab_size = 8192;
  // Whether vocab_size was asked for (`ladder data --vocab`) rather than left at its default: then a
  // reused tokenizer.model of another vocabulary size is an error instead of a note.
  bool vocab_explicit = false;
  double val_fraction = 0.005;  // fraction of documents held out
  size_t shard_tokens = 50'000'000;
  bool reuse_tokenizer = true;
};

// The train/val rule: a document goes to val iff XXH64(text) % 1'000'000 < val_fraction * 1e6.
// It depends on the text alone, so identical documents always land on the same side.
bool is_val_document(std::string_view text, double val_fraction);

// Checks vocab_size, and an existing out_dir/tokenizer.model when reuse_tokenizer (it must load,
// and have vocab_size when vocab_explicit), before reading any input. Reads all documents; splits
// them train/val by is_val_document (at least one val document is guaranteed: if the rule selects
// none, the documents with the smallest hash key are moved); trains the tokenizer on the train
// documents unless that existing model is reused; encodes each document followed by eod_id; writes
// out_dir/train_NNNNNN.bin, out_dir/val_NNNNNN.bin and, last and atomically, out_dir/meta.json (a
// directory without meta.json is incomplete), removing shards of an earlier run that are not listed
// and temp files of killed runs. Prints a short summary to stdout.
void prepare_data(const PrepareOptions& opt);

}  // namespace ladder::data
