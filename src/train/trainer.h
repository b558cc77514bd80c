// The training loop: data -> forward/backward (with gradient accumulation) -> gradient all-reduce
// across data-parallel ranks -> clip -> optimizer -> metrics, validation, checkpoints.
#pragma once
#include <cstdint>
#include <filesystem>
#include <utility>
#include <vector>

#include <functional>

#include "backend/backend.h"
#include "dist/comm.h"
#include "model/config.h"
#include "model/transformer.h"
#include "optim/optimizer.h"

namespace ladder {

struct TrainOptions {
  Config cfg;
  std::filesystem::path run_dir;
  bool resume = false;
  bool quiet = false;           // no progress output (tests)
  int64_t stop_after = -1;      // testing: return after this many steps as if killed (no final checkpoint)
  int64_t interrupt_at = -1;    // testing: as if SIGINT arrived during this step (1-based)
  // The data-parallel job (nullptr: process_comm(), the job mpirun started, or one process).
  Comm* comm = nullptr;
};

struct TrainSummary {
  std::vector<std::pair<int64_t, double>> losses;      // (step, training loss) of every step run here
  std::vector<std::pair<int64_t, double>> val_losses;  // (step, validation loss)
  int64_t start_step = 0, end_step = 0;
  double tokens_per_s = 0, mfu = 0;  // medians over the run
  std::filesystem::path last_checkpoint;
  std::vector<int64_t> checkpoint_steps;  // the steps checkpointed here, in order
  size_t optimizer_state_bytes = 0;       // held by this rank (run.shard_optimizer: its share)
  // A stop signal (SIGINT, SIGTERM, SIGUSR1) arrived while train() ran: the run ended early with a
  // checkpoint (end_step < run.steps), or, when it came during the last step, the final evaluation
  // or the final checkpoint, the run completed. A caller running several (ladder sweep) stops too.
  bool interrupted = false;
};

// The training loss became non-finite: an outcome of the settings (too high a learning rate, say),
// which a caller running several runs (ladder sweep) records and goes past, unlike other errors.
struct TrainingDiverged : Error {
  using Error::Error;
};

TrainSummary train(const TrainOptions& opt);
// Whether a stop signal arrived during the last train() (also when it then threw, e.g. diverged).
bool stop_requested();

// One optimizer step: zero grads; grad_accum micro-batches (each fetched by next_batch into
// inputs/targets) forward+backward; data-parallel all-reduce; global-norm clip; scheduled lr;
// optimizer update. `step` is the 0-based index of this step. The trainer, the benchmark and the
// parity tests all run exactly this function.
struct StepStats {
  double loss = 0;      // mean cross-entropy over the step's tokens
  double lse_sq = 0;    // mean logsumexp^2 (what the z-loss penalizes)
  double grad_norm = 0; // before clipping
  double lr = 0;
  int64_t tokens = 0;
  double router_z = 0;              // mean router z-loss term (already weighted by its coefficient)
  std::vector<MoeLayerStats> moe;   // per MoE layer: expert load and mean logsumexp^2 of this step
};
// With a Comm of several ranks (data parallel), each rank runs its own micro-batches, the ranks sum
// their gradients (each scaled by 1 / the tokens of all ranks: the sum is the global mean's
// gradient) and average the MoE balancing beta, then every rank clips and updates identically; the
// returned loss, tokens and MoE statistics are over all ranks.
using BatchFn = std::function<void(int32_t* inputs, int32_t* targets)>;
StepStats train_step(const Config& cfg, int64_t step, Transformer& model, Optimizer& opt, Backend& be,
                     const BatchFn& next_batch, int32_t* inputs, int32_t* targets, Comm* comm = nullptr);

// Sets the vocabulary from the data directory's meta.json when model.vocab_size is 0 and checks it
// otherwise. Returns the data directory.
std::filesystem::path resolve_data(Config& cfg);

}  // namespace ladder
