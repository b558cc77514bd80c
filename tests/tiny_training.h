// The tiny model and quiet training run that the trainer and checkpoint suites both start from.
#pragma once
#include <cstdint>
#include <filesystem>

#include "model/config.h"
#include "train/trainer.h"

namespace ladder::test {

// A 2-layer d=32 dense model on the word-salad data in data_dir/data (test::make_word_salad_data):
// 12 steps of 4 x 2 sequences, a checkpoint every 4 steps, an evaluation every 6. Suites override
// the run settings they need.
inline Config tiny_train_config(const std::filesystem::path& data_dir) {
  Config c;
  c.source = "tiny";
  c.model.d_model = 32;
  c.model.n_layers = 2;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.seq_len = 32;
  c.optim.lr = 5e-3;
  c.data.path = (data_dir / "data").string();
  c.run.steps = 12;
  c.run.batch_size = 4;
  c.run.grad_accum = 2;
  c.run.ckpt_every = 4;
  c.run.eval_every = 6;
  c.run.eval_batches = 2;
  c.run.log_every = 1;
  c.run.keep_checkpoints = 5;
  return c;
}

// train() without the progress line (comm: the data-parallel job, nullptr: the process's).
inline TrainSummary train_quietly(const Config& c, const std::filesystem::path& run_dir, bool resume = false,
                                  int64_t stop_after = -1, Comm* comm = nullptr) {
  TrainOptions o;
  o.cfg = c;
  o.run_dir = run_dir;
  o.resume = resume;
  o.quiet = true;
  o.stop_after = stop_after;
  o.comm = comm;
  return train(o);
}

}  // namespace ladder::test
