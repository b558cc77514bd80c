// Checkpoint layout (version 1), one directory per step under RUN_DIR/checkpoints/:
//   step_00000100/model.safetensors      weights, Hugging Face tensor names, F32
//   step_00000100/optimizer.safetensors  optimizer state tensors (exp_avg.<name>, exp_avg_sq.<name>,
//                                        momentum.<name>, radius.<name>: docs/optimizers.md)
//   step_00000100/state.json             format_version, step, resolved config, data-loader state,
//                                        tokens seen, thread count, the optimizer's step counter
//   step_00000100/tokenizer.model        copy of the data's tokenizer, so `ladder sample` needs nothing
//                                        else (absent when the data directory has none)
// The directory is assembled under a temporary name (.partial_step_N_<pid>), every file fsynced,
// then renamed: a directory named step_<digits> is always complete, and only such directories (with
// a state.json) are resumed from or pruned. RNG state is not stored: randomness is counter-based.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/transformer.h"
#include "optim/optimizer.h"

namespace ladder {

constexpr int kCheckpointVersion = 1;

struct CheckpointState {
  int64_t step = 0;          // optimizer steps completed
  int64_t tokens_seen = 0;
  int threads = 0;
  int world = 1;             // data-parallel ranks (state.json's "world"; 1 when absent: older checkpoints)
  nlohmann::json loader;     // data-loader state after `step` steps
  nlohmann::json config;     // resolved config
  double elapsed_s = 0;      // training wall time so far
  int64_t optimizer_steps = 0;  // read back from state.json (save_checkpoint writes the optimizer's own count)
};

std::filesystem::path checkpoint_dir(const std::filesystem::path& run_dir, int64_t step);
// A sharded optimizer's state tensors that other ranks hold, gathered into host memory by name
// (gather_optimizer_state in trainer.cpp), for the rank that writes the checkpoint.
using HostStateTensors = std::map<std::string, std::vector<float>>;
// Writes a checkpoint atomically; prunes all but the newest `keep` complete ones. A complete
// checkpoint is a directory named exactly step_<digits> holding a state.json; nothing else under
// checkpoints/ is pruned. An existing directory of the same step is replaced by moving it aside
// until the new one is in place. Temporaries left by killed saves (of processes that are gone) are
// cleaned up first (recover_checkpoints).
std::filesystem::path save_checkpoint(const std::filesystem::path& run_dir, const CheckpointState& st,
                                      const Transformer& model, Optimizer& opt,
                                      const std::filesystem::path& tokenizer_model, int keep,
                                      const HostStateTensors* others = nullptr);
// Cleans up after saves that were killed: removes their temporaries, and renames back a checkpoint
// that was moved aside to be replaced when its replacement never arrived. Only touches temporaries of
// processes that are gone. Call before latest_checkpoint when about to train.
void recover_checkpoints(const std::filesystem::path& run_dir);
// The newest complete checkpoint directory of a run, if any.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& run_dir);
// The newest complete checkpoint of the same run older than `ckpt_dir` (RUN/checkpoints/step_N), if
// any: named in the error when `ckpt_dir` turns out damaged, as the one to fall back to.
std::optional<std::filesystem::path> previous_checkpoint(const std::filesystem::path& ckpt_dir);
// Resolves a path given by a user: a checkpoint directory, or a run directory (-> its latest).
std::filesystem::path resolve_checkpoint(const std::filesystem::path& path);
// Reads state.json (validated: counts are non-negative integers, optimizer_steps equals step, and a
// directory named step_N holds step N). Errors name the file and field.
CheckpointState read_checkpoint_state(const std::filesystem::path& ckpt_dir);
// The model config of a checkpoint, for inference (sample, eval): the model section of state.json's
// config read and checked in full (types, ranges, shapes), every other section the defaults, so that
// a checkpoint whose optimizer or schedule settings a later version checks more strictly can still
// be used; model.vocab_size must be > 0 (the logits' width). Errors name state.json.
Config checkpoint_model_config(const std::filesystem::path& ckpt_dir, const CheckpointState& st);
// The checkpoint's tokenizer.model (what `ladder sample` needs besides the weights). A checkpoint
// saved from a data directory without one has none: the error says so, with the data directory and
// the tokenizer hash the data was encoded with; a tokenizer copied in must have that hash.
std::filesystem::path checkpoint_tokenizer(const std::filesystem::path& ckpt_dir);
// Loads weights (and optimizer state when opt != nullptr); every tensor's name, dtype and shape
// must match the model (a tensor the model or optimizer does not have is an error too), and the
// optimizer's step counter must be the one state.json records: errors name the file and tensor.
// A sharded optimizer reads the state tensors it holds (the file has every one, whoever wrote it).
void load_checkpoint_weights(const std::filesystem::path& ckpt_dir, Transformer& model, Optimizer* opt);

// Tests only: save_checkpoint calls the hook at "written" (every file of the new checkpoint written,
// nothing renamed yet) and "moved-aside" (an existing directory of the step moved aside, the new one
// not yet renamed into place); a throw there simulates a save that fails or is killed at that moment.
void set_checkpoint_save_hook_for_tests(std::function<void(std::string_view)> hook);

// Saves / loads just the weights as one safetensors file.
void save_weights(const std::filesystem::path& file, const Transformer& model);
void load_weights(const std::filesystem::path& file, Transformer& model);

}  // namespace ladder
