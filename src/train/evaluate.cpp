#include "train/evaluate.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "data/loader.h"
#include "data/tokenizer.h"
#include "model/transformer.h"
#include "train/checkpoint.h"

namespace fs = std::filesystem;

namespace ladder {

double EvalResult::perplexity() const { return std::exp(loss); }
double EvalResult::bits_per_byte() const { return bytes > 0 ? loss * tokens / (std::log(2.0) * bytes) : NAN; }

EvalResult evaluate_checkpoint(const fs::path& checkpoint, const EvalOptions& opt) {
  if (opt.split != "val" && opt.split != "train") fail("--split: '{}' (expected val or train)", opt.split);
  if (opt.batches < 0) fail("--batches must be >= 0 (0: every full batch of the split), got {}", opt.batches);
  if (opt.batch_size < 0) fail("--batch-size must be >= 0 (0: the checkpoint's run.batch_size), got {}", opt.batch_size);
  if (opt.device != "cpu" && opt.device != "cuda") fail("--device: '{}' (expected cpu or cuda)", opt.device);
  check_run_device(opt.device);  // one line where this build or machine cannot run it
  const fs::path dir = resolve_checkpoint(checkpoint);
  const CheckpointState st = read_checkpoint_state(dir);
  const Config cfg = checkpoint_model_config(dir, st);
  const std::string state_file = (dir / "state.json").string();

  EvalResult r;
  r.checkpoint = dir;
  r.step = st.step;
  r.split = opt.split;
  r.seq_len = cfg.model.seq_len;
  // The run's data and batch size unless given: what its logged val_loss was measured with.
  const nlohmann::json run_cfg = st.config.value("run", nlohmann::json::object());
  r.batch_size = opt.batch_size > 0 ? opt.batch_size : run_cfg.value("batch_size", 0);
  if (r.batch_size <= 0) fail("{}: no run.batch_size in the checkpoint's config; pass --batch-size", state_file);
  if (opt.data.empty()) {
    const auto& data_cfg = st.config.value("data", nlohmann::json::object());
    const std::string path = data_cfg.is_object() ? data_cfg.value("path", "") : "";
    if (path.empty()) fail("{}: no data.path in the checkpoint's config; pass --data DIR", state_file);
    if (!fs::is_directory(path))
      fail("{}: the checkpoint's data.path '{}' is not a directory here (relative paths are taken from the current "
           "directory); pass --data DIR",
           state_file, path);
    r.data = path;
  } else {
    r.data = opt.data;
  }

  // The tokens must be the checkpoint's tokenizer's: another vocabulary gives a loss of nothing.
  const data::DataMeta meta = data::read_meta(r.data);
  const data::Tokenizer tok = data::Tokenizer::load(checkpoint_tokenizer(dir));
  if (meta.tokenizer_hash != tok.hash())
    fail("{}: tokenized with another tokenizer (hash {:016x}) than the checkpoint's {} (hash {:016x})",
         (r.data / "meta.json").string(), meta.tokenizer_hash, (dir / "tokenizer.model").string(), tok.hash());
  if (meta.vocab_size > cfg.model.vocab_size)
    fail("{}: vocabulary {} is wider than the model's model.vocab_size {}", (r.data / "meta.json").string(),
         meta.vocab_size, cfg.model.vocab_size);

  // The trainer's validation order (one process).
  data::DataLoader loader(r.data, opt.split, int(r.seq_len), int(r.batch_size), data::kValidationSeed,
                          /*shuffle=*/true);
  r.windows = int64_t(loader.n_windows());
  const int64_t full = r.windows / r.batch_size;
  if (full == 0)
    fail("{}: the {} split has {} windows of {} tokens, fewer than one batch of {} (lower --batch-size)",
         r.data.string(), opt.split, r.windows, r.seq_len, r.batch_size);
  r.batches = opt.batches > 0 ? opt.batches : full;
  if (r.batches > full)
    fail("--batches {}: the {} split of {} has {} full batches of {} x {} tokens", r.batches, opt.split,
         r.data.string(), full, r.batch_size, r.seq_len);

  // On a GPU, the precision and attention kernels the run trained with.
  auto run_str = [&](const char* key, const char* dflt) {
    return run_cfg.is_object() && run_cfg.contains(key) && run_cfg[key].is_string() ? run_cfg[key].get<std::string>()
                                                                                     : std::string(dflt);
  };
  auto be = make_backend(opt.device, opt.threads, run_str("precision", "fp32"), run_str("attention", "ladder"));
  Transformer model(cfg.model, int(r.batch_size), *be);
  load_checkpoint_weights(dir, model, nullptr);
  // Bytes per token id, once: the targets' text length for bits per byte.
  std::vector<int> bytes_of(size_t(meta.vocab_size));
  for (int id = 0; id < meta.vocab_size && id < tok.vocab_size(); ++id) bytes_of[size_t(id)] = tok.text_bytes(id);

  const size_t n = size_t(r.batch_size * r.seq_len);
  std::vector<int32_t> inputs(n), targets(n);
  double xent = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t b = 0; b < r.batches; ++b) {
    loader.next(inputs.data(), targets.data());
    LossSums s = model.forward_loss(inputs.data(), targets.data());
    xent += s.xent;
    r.tokens += double(s.tokens);
    for (int32_t t : targets) r.bytes += t >= 0 && size_t(t) < bytes_of.size() ? bytes_of[size_t(t)] : 0;
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.loss = xent / r.tokens;
  return r;
}

nlohmann::json to_json(const EvalResult& r) {
  return {{"checkpoint", r.checkpoint.string()},
          {"step", r.step},
          {"data", r.data.string()},
          {"split", r.split},
          {"batches", r.batches},
          {"batch_size", r.batch_size},
          {"seq_len", r.seq_len},
          {"windows", r.windows},
          {"tokens", r.tokens},
          {"bytes", r.bytes},
          {"loss", r.loss},
          {"perplexity", r.perplexity()},
          {"bits_per_byte", r.bits_per_byte()},
          {"seconds", r.seconds}};
}

std::string format_eval(const EvalResult& r) {
  return fmt::format(
      "checkpoint  {} (step {})\n"
      "data        {}, {} split: {} batches x {} x {} tokens = {:.0f} tokens ({} of its {} windows)\n"
      "loss        {:.4f} nats/token, perplexity {:.2f}, {:.4f} bits/byte ({:.0f} bytes of text, {:.2f} per token)\n"
      "time        {:.1f} s ({:.0f} tokens/s)\n",
      r.checkpoint.string(), r.step, r.data.string(), r.split, r.batches, r.batch_size, r.seq_len, r.tokens,
      r.batches * r.batch_size, r.windows, r.loss, r.perplexity(), r.bits_per_byte(), r.bytes,
      r.tokens > 0 ? r.bytes / r.tokens : 0.0, r.seconds, r.seconds > 0 ? r.tokens / r.seconds : 0.0);
}

}  // namespace ladder
