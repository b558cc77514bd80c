#include "train/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "core/rng.h"
#include "data/tokenizer.h"
#include "model/transformer.h"
#include "train/checkpoint.h"

namespace ladder {

void check_sample_options(const SampleOptions& opt) {
  if (!std::isfinite(opt.temperature) || opt.temperature < 0)
    fail("--temperature must be a finite number >= 0 (0: greedy), got {}", opt.temperature);
  if (opt.top_k < 0) fail("--top-k must be >= 0, got {}", opt.top_k);
  if (opt.max_tokens < 0) fail("--max-tokens must be >= 0, got {}", opt.max_tokens);
}

std::string sample_text(const std::filesystem::path& path, const SampleOptions& opt) {
  check_sample_options(opt);
  auto dir = resolve_checkpoint(path);
  const std::string state_file = (dir / "state.json").string();
  Config cfg = checkpoint_model_config(dir, read_checkpoint_state(dir));
  auto tok = data::Tokenizer::load(dir / "tokenizer.model");
  // The prompt's token ids index the embedding: the model must have a row for each of them.
  if (tok.vocab_size() > cfg.model.vocab_size)
    fail("{}: model.vocab_size is {} but the checkpoint's tokenizer.model has {} tokens", state_file,
         cfg.model.vocab_size, tok.vocab_size());
  auto be = make_cpu_backend(opt.threads);
  Transformer model(cfg.model, 1, *be);
  load_checkpoint_weights(dir, model, nullptr);

  // The logits may be wider than the tokenizer (a model.vocab_size padded past the data's): ids the
  // tokenizer has no piece for cannot be decoded, so only its Vt ids are candidates.
  const int S = cfg.model.seq_len, V = cfg.model.vocab_size, Vt = tok.vocab_size();
  std::vector<int32_t> ids = tok.encode(opt.prompt);
  if (ids.empty()) ids.push_back(tok.eod_id());  // an empty prompt starts a new document
  const size_t prompt_len = ids.size();
  std::vector<int32_t> window(S, 0);
  std::vector<float> logits(size_t(S) * V);
  Philox rng(opt.seed, stream_id("sample"));
  for (int t = 0; t < opt.max_tokens; ++t) {
    const size_t n = std::min<size_t>(ids.size(), S);
    std::copy(ids.end() - n, ids.end(), window.begin());
    model.forward_logits(window.data(), logits.data());
    const float* row = logits.data() + (n - 1) * size_t(V);
    int32_t next;
    if (opt.temperature == 0) {
      next = int32_t(std::max_element(row, row + Vt) - row);
    } else {
      std::vector<int32_t> idx(Vt);
      std::iota(idx.begin(), idx.end(), 0);
      const int k = opt.top_k > 0 ? std::min(opt.top_k, Vt) : Vt;
      std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) { return row[a] > row[b]; });
      std::vector<double> p(k);
      const double mx = row[idx[0]];
      double z = 0;
      for (int i = 0; i < k; ++i) z += p[i] = std::exp((row[idx[i]] - mx) / opt.temperature);
      double u = rng.uniform(uint64_t(t)) * z;
      int i = 0;
      while (i < k - 1 && (u -= p[i]) > 0) ++i;
      next = idx[i];
    }
    if (next == tok.eod_id()) break;
    ids.push_back(next);
  }
  std::vector<int32_t> out(ids.begin() + (ids[0] == tok.eod_id() && prompt_len == 1 && opt.prompt.empty() ? 1 : 0), ids.end());
  return tok.decode(out);
}

}  // namespace ladder
