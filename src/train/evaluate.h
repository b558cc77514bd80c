// `ladder eval`: the loss of a checkpoint on a data directory's split, as nats per token,
// perplexity and bits per byte (the tokenizer-independent unit: the same text in any vocabulary).
// With the run's own batch size and `--batches run.eval_batches` on its validation split it
// reproduces the val_loss the run logged at that step (the same windows, the same order).
#pragma once
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

namespace ladder {

struct EvalOptions {
  std::string data;        // data directory; empty: the checkpoint's data.path
  std::string split = "val";
  int64_t batches = 0;     // 0: every full batch of the split
  int batch_size = 0;      // 0: the checkpoint's run.batch_size
  int threads = 0;         // CPU threads; 0: all
  std::string device = "cpu";  // cpu | cuda (with the checkpoint's run.precision and run.attention)
};

struct EvalResult {
  std::filesystem::path checkpoint, data;
  std::string split;
  int64_t step = 0;                 // the checkpoint's optimizer step
  int64_t batches = 0, batch_size = 0, seq_len = 0;
  int64_t windows = 0;              // windows of seq_len tokens in the split (batches x batch_size evaluated)
  double tokens = 0;                // target tokens evaluated
  double bytes = 0;                 // UTF-8 bytes those targets stand for (Tokenizer::text_bytes)
  double loss = 0;                  // mean cross-entropy, nats per token
  double seconds = 0;
  double perplexity() const;        // exp(loss)
  double bits_per_byte() const;     // loss x tokens / (ln 2 x bytes)
};

// Checks the options (one error naming the flag), loads the checkpoint (a checkpoint or run
// directory), checks that the data was tokenized with the checkpoint's tokenizer, and evaluates.
EvalResult evaluate_checkpoint(const std::filesystem::path& checkpoint, const EvalOptions& opt);

nlohmann::json to_json(const EvalResult& r);
std::string format_eval(const EvalResult& r);

}  // namespace ladder
