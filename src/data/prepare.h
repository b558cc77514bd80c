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
  double val_fraction = 0.005;  // fraction of documents held out
  size_t shard_tokens = 50'000'000;
  bool reuse_tokenizer = true;
};

// The train/val rule: a document goes to val iff XXH64(text) % 1'000'000 < val_fraction * 1e6.
// It depends on the text alone, so identical documents always land on the same side.
bool is_val_document(std::string_view text, double val_fraction);

// Reads all documents; splits them train/val by is_val_document (at least one val document is
// guaranteed: if the rule selects none, the documents with the smallest hash key are moved);
// trains the tokenizer on the train documents unless out_dir/tokenizer.model exists and
// reuse_tokenizer; encodes each document followed by eod_id; writes out_dir/train_NNNNNN.bin,
// out_dir/val_NNNNNN.bin and, last and atomically, out_dir/meta.json (a directory without
// meta.json is incomplete). Prints a short summary to stdout.
void prepare_data(const PrepareOptions& opt);

}  // namespace ladder::data
