#include "train/trainer.h"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/stats.h"
#include "data/loader.h"
#include "model/flops.h"
#include "model/transformer.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "train/checkpoint.h"
#include "train/machine.h"
#include "train/metrics.h"

namespace fs = std::filesystem;

namespace ladder {
namespace {

std::atomic<bool> g_stop{false};
// Whether this process says so on stderr: rank 0 only, as for every other line (mpirun forwards a
// signal to every rank).
std::atomic<bool> g_signal_notice{true};
// The first SIGINT/SIGTERM/SIGUSR1 asks for a checkpoint at the end of the step; a second one (a stuck final
// evaluation, a user who means it) restores the default action and re-raises it. Only
// async-signal-safe calls here: an atomic exchange, write(2), signal(), raise().
void on_signal(int sig) {
  if (g_stop.exchange(true)) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  static const char msg[] = "\nladder: stopping after this step with a checkpoint; signal again to quit now\n";
  if (g_signal_notice) {
    [[maybe_unused]] ssize_t n = ::write(2, msg, sizeof msg - 1);
  }
}

// The first line of the config.yaml a run writes into its directory: what tells a later fresh
// start that the file is a run's own, safe to replace, and not a config someone keeps there.
constexpr std::string_view kRunConfigHeader =
    "# Written by `ladder train`: this run's resolved config (every key; checkpoints hold it too).\n";

// A fresh start (no checkpoint to resume) writes config.yaml and a new metrics.jsonl into the run
// directory. Neither may replace what is not an earlier start's to replace: a config.yaml that
// `ladder train` did not write (`--run-dir .` beside one's own config.yaml), or the metrics of a
// run that died before its first checkpoint, unless --resume says to start that run over.
void check_fresh_run_dir(const fs::path& run_dir, const std::string& resolved_yaml, bool resume) {
  std::error_code ec;
  const fs::path cfg = run_dir / "config.yaml", met = run_dir / "metrics.jsonl";
  if (fs::exists(cfg, ec)) {
    const std::string text = read_file(cfg);
    // Run directories from before the header hold the bare resolved config.
    if (!text.starts_with(kRunConfigHeader) && text != resolved_yaml)
      fail("{}: exists and was not written by `ladder train` (a new run writes its resolved config there): choose "
           "another --run-dir, or move the file",
           cfg.string());
  }
  if (const auto size = fs::file_size(met, ec); !ec && size > 0 && !resume)
    fail("{}: holds the metrics of an earlier run in this directory that saved no checkpoint: pass --resume to start "
         "it over from step 0 (its metrics.jsonl is replaced), or choose another --run-dir",
         met.string());
}

// What a config change means for a resume (check_resume_compatible).
enum class OnChange {
  kRefuse,  // the weights, data order or optimizer state would not fit: refused
  kWarn,    // legitimate (extending a run, lowering the lr) but not the uninterrupted run: one warning
};

// The fields outside model.* and data.* (which are all refused) that a resume looks at. optim.name
// and the group selectors decide which state tensors exist and what they mean (an Adam moment is not
// a Muon momentum; moving a tensor between groups reinterprets its state), so they are refused like
// the model; the rest of optim.* and schedule.* only change the update from here on, and run.steps
// changes the schedule's horizon (and `auto` learning rates): a user may mean that, so it warns.
// run.device, run.precision and run.attention change the arithmetic from here on (another GEMM
// precision, another attention kernel's rounding): legitimate, e.g. moving a run from a GPU to the
// CPU, so they warn (precision and attention only where one side ran on cuda: the CPU ignores them). The other run.* keys (eval, logging, checkpointing, threads) do not change the
// trajectory's meaning and are not looked at.
OnChange on_change(const std::string& sec, const std::string& key) {
  if (sec == "model" || sec == "data") return OnChange::kRefuse;
  if (sec == "run")
    return key == "steps" || key == "device" || key == "precision" || key == "attention" ? OnChange::kWarn
                                                                                          : OnChange::kRefuse;
  if (sec == "optim" && (key == "name" || key.ends_with("_params"))) return OnChange::kRefuse;
  return OnChange::kWarn;
}

// Refuses to resume with a config that would make the continuation a different run, and warns (one
// stderr line per field) about changes that are allowed but make it differ from the uninterrupted
// run. The saved config is read with find(): a hand-edited or truncated state.json must give an
// error naming the file and the key, not undefined behaviour (operator[] on a missing key of a const
// json) or a bare nlohmann type_error.
// Data parallel: the ranks a checkpoint was written by may differ from the ranks resuming it, as long
// as the step's micro-batches are as many (run.grad_accum x ranks): the loader continues from the
// same sample of the same order, each step reads the same tokens.
void check_resume_compatible(const Config& cur, const nlohmann::json& saved, const fs::path& ckpt, int world,
                             int saved_world, bool say) {
  const std::string file = (ckpt / "state.json").string();
  const nlohmann::json now = to_json(cur);
  if (!saved.is_object()) fail("{}: cannot resume: 'config' is {}, expected an object", file, saved.type_name());
  const std::vector<std::pair<const char*, std::vector<std::string>>> checked = {
      {"model", {}}, {"data", {}},  // every key
      {"optim", {}}, {"schedule", {}},
      {"run", {"batch_size", "grad_accum", "seed", "steps", "device", "precision", "attention"}}};
  for (const auto& [sec, only] : checked) {
    std::vector<std::string> keys = only;
    if (keys.empty())
      for (auto& [k, v] : now.at(sec).items()) keys.push_back(k);
    auto s = saved.find(sec);
    if (s == saved.end()) fail("{}: cannot resume: config.{} is missing in the checkpoint", file, sec);
    if (!s->is_object())
      fail("{}: cannot resume: config.{} is {} in the checkpoint, expected an object", file, sec, s->type_name());
    for (const std::string& k : keys) {
      const nlohmann::json& v = now.at(sec).at(k);
      auto it = s->find(k);
      if (sec == std::string("run") && k == "grad_accum" && it != s->end() && it->is_number_integer() &&
          saved_world != world) {
        const int64_t before = it->get<int64_t>() * saved_world;
        if (before != v.get<int64_t>() * world)
          fail("{}: cannot resume: run.grad_accum {} x {} rank(s) in the checkpoint, {} x {} now: a step must take as "
               "many micro-batches (set run.grad_accum so that grad_accum x ranks = {})", file, it->dump(), saved_world,
               v.dump(), world, before);
        if (say)
          fmt::print(stderr, "note: {} was written by {} data-parallel rank(s) with run.grad_accum {}; {} rank(s) "
                     "with {} take the same micro-batches per step\n", file, saved_world, it->dump(), world, v.dump());
        continue;
      }
      if (it != s->end() && *it == v) continue;
      // A key added after the checkpoint was written: it trained with the key's default.
      if (it == s->end() && is_late_key(std::string(sec) + "." + k) && v == to_json(Config{}).at(sec).at(k)) continue;
      if (sec == std::string("run") && (k == "precision" || k == "attention")) {
        // They choose GPU kernels: with the CPU on both sides they change nothing. A checkpoint from
        // before run.attention existed ran Ladder's own attention.
        auto dev = s->find("device");
        const bool gpu = now.at("run").at("device") == "cuda" || (dev != s->end() && *dev == "cuda");
        if (!gpu || (k == "attention" && it == s->end() && v == "ladder")) continue;
      }
      if (on_change(sec, k) == OnChange::kRefuse) {
        if (it == s->end())
          fail("{}: cannot resume: config.{}.{} is missing in the checkpoint (it is {} now)", file, sec, k, v.dump());
        fail("{}: cannot resume: {}.{} is {} in the checkpoint but {} now{}", file, sec, k, it->dump(), v.dump(),
             sec == std::string("optim") ? " (the optimizer state would not fit; start a new run)" : "");
      }
      if (say)
        fmt::print(stderr, "warning: resuming with {}.{} = {} but the checkpoint {} {}: the continuation is not the "
                   "uninterrupted run's\n", sec, k, v.dump(), file,
                   it == s->end() ? std::string("does not record it") : "was trained with " + it->dump());
    }
  }
}

// Data-parallel replicas hold bitwise the same weights: the same init or checkpoint, then the same
// summed gradients and the same update on every rank. Checked (a hash of every parameter and
// buffer, compared with rank 0's) at the start and before every checkpoint, because what rank 0
// saves stands for all of them: a rank that drifted (another BLAS or GPU model on one node, a
// checkpoint directory that differs between nodes) would otherwise make the run silently a mix.
void check_replicas_agree(Comm& comm, Transformer& model, const std::string& when) {
  if (comm.world() == 1) return;
  uint64_t h = 0;
  std::vector<float> host;
  auto add = [&](const Param& p) {
    host.resize(p.numel);
    model.download(p, host.data());
    h = XXH64(host.data(), host.size() * sizeof(float), h);
  };
  for (const Param& p : model.params()) add(p);
  for (const Param& p : model.buffers()) add(p);
  uint64_t h0 = h;
  comm.broadcast_host(&h0, sizeof h0, 0);
  std::vector<double> differs(size_t(comm.world()), 0.0);
  differs[size_t(comm.rank())] = h != h0 ? 1 : 0;
  comm.allreduce_max_host(differs.data(), differs.size());
  std::string bad;
  for (size_t r = 0; r < differs.size(); ++r)
    if (differs[r] > 0) bad += (bad.empty() ? "" : ", ") + std::to_string(r);
  if (!bad.empty())
    fail("data parallel: the weights of rank(s) {} differ from rank 0's {} (the ranks must run the same build on the "
         "same kind of device and read the same checkpoint)", bad, when);
}

// A sharded optimizer's state tensors held by ranks other than 0, sent to rank 0 (which writes the
// checkpoint) in the order of Optimizer::state(), the same on every rank; empty on other ranks.
HostStateTensors gather_optimizer_state(Comm& comm, Optimizer& opt) {
  HostStateTensors out;
  std::vector<float> buf;
  for (const StateTensor& s : opt.state()) {
    if (s.owner == 0) continue;
    const size_t n = s.numel();
    if (comm.rank() == s.owner) {
      LADDER_ASSERT(s.data);
      buf.resize(n);
      opt.memory().download(buf.data(), s.data, n * sizeof(float));
      comm.send_host(buf.data(), n * sizeof(float), 0);
    } else if (comm.rank() == 0) {
      std::vector<float>& v = out[s.name];
      v.resize(n);
      comm.recv_host(v.data(), n * sizeof(float), s.owner);
    }
  }
  return out;
}

}  // namespace

StepStats train_step(const Config& cfg, int64_t step, Transformer& model, Optimizer& opt, Backend& be,
                     const BatchFn& next_batch, int32_t* inputs, int32_t* targets, Comm* comm) {
  const int N = model.batch() * cfg.model.seq_len;
  const int accum = cfg.run.grad_accum;
  const int world = comm ? comm->world() : 1;
  model.reserve_step(accum);  // a no-op from the second call on
  model.zero_grad();
  const float grad_scale = 1.0f / float(int64_t(N) * accum * world);
  // Nothing below waits for the backend until every op of the step is enqueued (a CUDA backend's
  // token uploads excepted, when the host is several micro-batches ahead): the micro-batches'
  // loss sums stay in backend memory, the MoE bias is updated there, the clip factor is computed
  // there; the host reads the norm, the sums and the load counts after the optimizer is queued.
  try {
    for (int micro = 0; micro < accum; ++micro) {
      next_batch(inputs, targets);
      model.forward_backward_async(inputs, targets, grad_scale);
    }
  } catch (...) {
    model.discard_step();  // a caller that goes on starts the next step clean
    throw;
  }
  // Data parallel: the ranks' gradients summed in one call over the contiguous arena (each was
  // scaled by 1 / every rank's tokens, so the sum is the mean-loss gradient of the whole step); a
  // sharded optimizer (ZeRO stage 1) needs each rank's own tensors' sums only: a reduce-scatter.
  Transformer::BetaAverage beta_average;
  const OptimizerShards* shards = opt.shards();
  LADDER_ASSERT(!shards || (comm && shards->world == world));
  if (world > 1) {
    if (shards)
      comm->reduce_scatter_ranges(be, model.grads_data(), shards->grad_offsets);
    else
      comm->allreduce_sum(be, model.grads_data(), model.grads_floats());
    beta_average = [&](double* beta, size_t n) { comm->allreduce_mean(be, beta, n); };
  }
  // MoE quantile balancing, once per step from the step's tokens (data parallel: beta averaged over
  // the ranks before the bias, RECIPE.md section 2). The bias has no gradient, so its place relative
  // to the optimizer update does not matter; the next step's selection uses the new bias.
  model.update_balance(beta_average);
  // Clip on the device and enqueue the optimizer step before reading anything back.
  // (Bitwise the host-side clip it replaced: the same per-tensor sums, order and float factor.)
  LADDER_ASSERT(&be == &model.backend());
  const float* clip_factor =
      shards ? model.grad_clip_factor_async(cfg.optim.clip, {&shards->owner, shards->rank,
                                                             [&](double* s, size_t n) { comm->allreduce_sum(be, s, n); }})
             : model.grad_clip_factor_async(cfg.optim.clip);
  StepStats st;
  st.lr = cfg.optim.lr * lr_multiplier(cfg.schedule, step, cfg.run.steps);
  opt.step(st.lr, clip_factor);  // the clip factor scales each gradient as the update reads it
  // Sharded optimizer (ZeRO stage 1): each rank updated its own tensors; their new weights go to
  // every rank (so the replicas hold bitwise what an unsharded step gives them).
  if (shards) comm->allgather_ranges(be, model.weights(), shards->offsets);
  // The step's one wait (the first download); the rest copy finished results.
  st.grad_norm = model.last_grad_norm();
  double xent = 0, lse_sq = 0, router_z = 0;
  int64_t ntok = 0;
  for (const LossSums& s : model.take_loss_sums()) {  // in micro-batch order, as they were added before
    xent += s.xent;
    lse_sq += s.lse_sq;
    router_z += s.router_z;
    ntok += s.tokens;
  }
  Transformer::HostSum sum_over_ranks;
  if (world > 1) {  // the step's numbers over every rank's tokens
    double sums[4] = {xent, lse_sq, router_z, double(ntok)};
    comm->allreduce_sum_host(sums, 4);
    xent = sums[0], lse_sq = sums[1], router_z = sums[2], ntok = int64_t(sums[3]);
    sum_over_ranks = [&](double* v, size_t n) { comm->allreduce_sum_host(v, n); };
  }
  st.moe = model.take_moe_stats(sum_over_ranks);
  st.router_z = router_z / double(ntok);
  st.loss = xent / double(ntok);
  st.lse_sq = lse_sq / double(ntok);
  st.tokens = ntok;
  return st;
}

fs::path resolve_data(Config& cfg) {
  fs::path dir = cfg.data.path;
  data::DataMeta meta = data::read_meta(dir);
  if (cfg.model.vocab_size == 0) {
    cfg.model.vocab_size = meta.vocab_size;
  } else if (cfg.model.vocab_size < meta.vocab_size) {
    fail("{}: model.vocab_size is {} but the data in {} uses a vocabulary of {}", cfg.source, cfg.model.vocab_size,
         dir.string(), meta.vocab_size);
  }
  // The end-of-document token of the data's tokenizer (PKO's document starts).
  if (cfg.model.eod_id < 0) {
    cfg.model.eod_id = meta.eod_id;
  } else if (cfg.model.eod_id != meta.eod_id) {
    fail("{}: model.eod_id is {} but the tokenizer of {} ends documents with token {}", cfg.source, cfg.model.eod_id,
         dir.string(), meta.eod_id);
  }
  return dir;
}

bool stop_requested() { return g_stop; }

TrainSummary train(const TrainOptions& opt) {
  // Data parallel: every rank runs this function on its share of each batch; rank 0 alone prints,
  // writes the metrics and saves checkpoints (the run directory is on a filesystem every rank sees).
  // The job first, so that any error below ends every rank (main's error path).
  Comm& comm = opt.comm ? *opt.comm : process_comm();
  const int rank = comm.rank(), world = comm.world();
  const bool talk = !opt.quiet && rank == 0;
  Config cfg = opt.cfg;
  validate(cfg);
  check_run_device(cfg.run.device);  // a device that cannot run here is the first thing to hear about
  fs::path data_dir = resolve_data(cfg);
  const fs::path run_dir = opt.run_dir;
  const auto& rc = cfg.run;

  // Never overwrite a run by accident. (A checkpoint that a killed save had moved aside is put back
  // first, so that it is found.)
  if (rank == 0) recover_checkpoints(run_dir);
  comm.barrier();
  auto latest = latest_checkpoint(run_dir);
  if (latest && !opt.resume)
    fail("{}: the run directory already holds checkpoints; pass --resume to continue it or choose another --run-dir",
         run_dir.string());
  if (!latest) check_fresh_run_dir(run_dir, to_yaml(cfg), opt.resume);

  auto be = make_backend(rc.device, rc.threads, rc.precision, rc.attention);  // one line if run.device cannot run here
  const int threads = cpu_threads();
  Transformer model(cfg.model, rc.batch_size, *be);
  model.reserve_step(rc.grad_accum);
  // Data parallel with run.shard_optimizer: this rank's share of the optimizer (ZeRO stage 1).
  std::optional<OptimizerShards> shards;
  if (rc.shard_optimizer && world > 1) shards = plan_optimizer_shards(cfg, model, rank, world);
  // The whole config: `auto` lrs need the run size.
  auto optimizer = make_optimizer(cfg, model, *be, world, shards ? &*shards : nullptr);
  // The optimizer state held here, and (sharded) the largest and the total over the ranks.
  double state_mib[3] = {held_state_bytes(*optimizer) / 1048576.0, 0, 0};
  state_mib[1] = state_mib[2] = state_mib[0];
  comm.allreduce_max_host(&state_mib[1], 1);
  comm.allreduce_sum_host(&state_mib[2], 1);
  data::DataLoader train_loader(data_dir, "train", cfg.model.seq_len, rc.batch_size, rc.seed, true, rank, world);
  // Validation reads the same fixed, shuffled subset of windows at every evaluation (reset() returns
  // to its start): a sample spread over the whole split rather than its first documents.
  data::DataLoader val_loader(data_dir, "val", cfg.model.seq_len, rc.batch_size, data::kValidationSeed, true, rank,
                              world);
  // An evaluation reads each validation window at most once: a request for more batches than the
  // split holds would wrap into the loader's next epoch and weigh some windows twice. It reads the
  // whole split's full batches instead (what `ladder eval` reads by default), and says so.
  int eval_batches = rc.eval_batches;
  if (eval_batches > 0) {
    const int64_t full = int64_t(val_loader.n_windows()) / rc.batch_size;
    if (full == 0)
      fail("{}: the val split has {} windows of {} tokens, fewer than one batch of run.batch_size {} (run.eval_batches "
           "{}): prepare more validation text (ladder data --val-fraction) or set run.eval_batches: 0",
           data_dir.string(), val_loader.n_windows(), cfg.model.seq_len, rc.batch_size, rc.eval_batches);
    if (eval_batches > full) {
      if (rank == 0 && !opt.quiet)
        fmt::print("note: run.eval_batches {} x run.batch_size {} is more than the val split's {} windows of {} tokens "
                   "({}): evaluating its {} full batch(es)\n",
                   eval_batches, rc.batch_size, val_loader.n_windows(), cfg.model.seq_len, data_dir.string(), full);
      eval_batches = int(full);
    }
  }

  int64_t start_step = 0, tokens_seen = 0;
  double elapsed_prev = 0;
  if (opt.resume && latest) {
    // A damaged newest checkpoint (a truncated copy, a bad disk): say where to go back to. Not for
    // check_resume_compatible's refusals (another config), which an older checkpoint shares.
    const auto with_fallback = [&](const Error& e) {
      if (auto prev = previous_checkpoint(*latest))
        fail("{} (the older checkpoint {} is complete: move {} aside to resume from it)", e.what(), prev->string(),
             latest->string());
    };
    CheckpointState st;
    try {
      st = read_checkpoint_state(*latest);
    } catch (const Error& e) {
      with_fallback(e);
      throw;
    }
    check_resume_compatible(cfg, st.config, *latest, world, st.world, /*say=*/rank == 0);
    try {
      load_checkpoint_weights(*latest, model, optimizer.get());
      train_loader.restore(st.loader, fmt::format("{}, field 'loader'", (*latest / "state.json").string()));
    } catch (const Error& e) {
      with_fallback(e);
      throw;
    }
    start_step = st.step;
    tokens_seen = st.tokens_seen;
    elapsed_prev = st.elapsed_s;
    if (st.threads != threads && talk)
      fmt::print("note: checkpoint was written with {} threads, resuming with {}: losses may differ in the last bits\n",
                 st.threads, threads);
    if (talk) fmt::print("resuming from {} (step {})\n", latest->string(), start_step);
  } else {
    // A mistyped --run-dir must not pass for a resumed run.
    if (opt.resume && talk)
      fmt::print("note: --resume: no complete checkpoint in {}: starting from step 0\n", (run_dir / "checkpoints").string());
    model.init(rc.seed);
  }
  check_replicas_agree(comm, model, start_step > 0 ? "after loading the checkpoint" : "after initialization");
  if (start_step >= rc.steps) {
    if (talk) fmt::print("{}: run already complete at step {} (raise run.steps to continue)\n", run_dir.string(), start_step);
    TrainSummary done;
    done.start_step = done.end_step = start_step;
    return done;
  }
  std::optional<MetricsWriter> metrics;  // rank 0's
  if (rank == 0) {
    create_directories_durably(run_dir);
    write_file_atomic(run_dir / "config.yaml", std::string(kRunConfigHeader) + to_yaml(cfg));
    metrics.emplace(run_dir / "metrics.jsonl", /*append=*/start_step > 0);
    if (start_step > 0) metrics->truncate_after_step(start_step);
  }

  const FlopsPerToken fpt = flops_per_token(cfg.model);
  const ParamCount pc = count_params(cfg.model);
  // MFU denominator: the machine's cached sgemm rate on the CPU; on a device, the backend's own GEMM
  // measured now at its precision (half a second; the model's arenas are already allocated). Data
  // parallel: the sum of the ranks' rates, each measured (or cached) alone with its own threads.
  // Ranks take turns (ranks on one machine or one GPU would otherwise measure, and cache, each
  // other's contention).
  double peak = 0;
  for (int r = 0; r < world; ++r) {
    if (r == rank) peak = be->is_host() ? sgemm_gflops() : backend_gemm_gflops(*be);
    comm.barrier();
  }
  comm.allreduce_sum_host(&peak, 1);
  const int64_t tokens_per_step = int64_t(run_shape(cfg, world).tokens_per_step);  // the job's, every rank's
  if (talk) {
    fmt::print("resolved config ({}):\n{}", cfg.source, to_yaml(cfg));
    if (cfg.model.moe())
      fmt::print("MoE: {} of {} layers, E={} K={} expert hidden {} shared hidden {}, combine {}; "
                 "parameters {} total, {} active per token\n",
                 cfg.model.n_moe_layers(), cfg.model.n_layers, cfg.model.moe_experts, cfg.model.moe_top_k,
                 cfg.model.expert_ff(), cfg.model.shared_ff(), cfg.model.moe_combine, human_count(double(pc.total)),
                 human_count(double(pc.active)));
    fmt::print("parameters: {} total ({} non-embedding); FLOPs/token: {} forward without head, {} training with head\n",
               human_count(double(pc.total)), human_count(double(pc.non_embedding())),
               human_count(fpt.forward(false)), human_count(fpt.train(true)));
    fmt::print("activations: {:.1f} MiB planned; backend {} ({} CPU threads); {} {:.1f} GFLOP/s (MFU denominator); "
               "{} tokens/step; run dir {}\n",
               model.activation_bytes() / 1048576.0, be->name(), threads, be->is_host() ? "sgemm" : "GEMM", peak,
               tokens_per_step, run_dir.string());
    if (world > 1)
      fmt::print("data parallel: {}, {} sequences per micro-batch on each rank; MFU against the sum of the ranks' "
                 "rates\n", comm.describe(), rc.batch_size);
    if (shards)
      fmt::print("optimizer state sharded over {} ranks (run.shard_optimizer): {:.1f} MiB on rank 0, at most {:.1f} "
                 "MiB on a rank, {:.1f} MiB in all\n", world, state_mib[0], state_mib[1], state_mib[2]);
    else
      fmt::print("optimizer state: {:.1f} MiB{}\n", state_mib[0], world > 1 ? " on every rank" : "");
  }

  const int N = rc.batch_size * cfg.model.seq_len;
  std::vector<int32_t> inputs(N), targets(N);
  const fs::path tokenizer = data_dir / "tokenizer.model";
  // Checkpoints carry the data's tokenizer for `ladder sample`; data prepared elsewhere may have none.
  if (std::error_code ec; rank == 0 && !fs::is_regular_file(tokenizer, ec))
    fmt::print(stderr, "warning: {} not found: checkpoints will have no tokenizer; `ladder sample` needs the data's "
               "tokenizer.model copied into the checkpoint directory\n", tokenizer.string());
  TrainSummary sum;
  sum.start_step = start_step;
  sum.optimizer_state_bytes = held_state_bytes(*optimizer);
  std::vector<double> rates, mfus;

  auto evaluate = [&](int64_t step) {
    if (eval_batches == 0) return;
    val_loader.reset();
    // The same eval_batches batches as one process, shared out: the loader's batch b on rank r is
    // the subset's batch b*world + r, so rank r takes those below eval_batches.
    double sums[2] = {0, 0};  // cross-entropy, tokens
    const int mine = (eval_batches - rank + world - 1) / world;
    for (int b = 0; b < mine; ++b) {
      val_loader.next(inputs.data(), targets.data());
      LossSums s = model.forward_loss(inputs.data(), targets.data());
      sums[0] += s.xent;
      sums[1] += double(s.tokens);
    }
    comm.allreduce_sum_host(sums, 2);
    double vl = sums[0] / sums[1];
    sum.val_losses.emplace_back(step, vl);
    if (metrics) metrics->write({{"step", step}, {"val_loss", vl}, {"tokens", tokens_seen}});
    if (talk) fmt::print("{}step {} | val_loss {:.4f}\n", isatty(1) ? "\r\033[K" : "", step, vl);
  };
  auto elapsed_total = [&, t0 = std::chrono::steady_clock::now()] {
    return elapsed_prev + std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto checkpoint = [&](int64_t step) {
    check_replicas_agree(comm, model, fmt::format("at step {}", step));  // what rank 0 saves is every rank's
    // The metrics up to this step reach the disk before the checkpoint does: a resume from it keeps
    // the lines up to its step and never rewrites them, so a crash must not lose them afterwards.
    if (metrics) metrics->sync();
    CheckpointState st{step, tokens_seen, threads, world, train_loader.state(), to_json(cfg), elapsed_total()};
    // Sharded: the other ranks' state to rank 0 first (the file is the unsharded run's).
    const HostStateTensors others = shards ? gather_optimizer_state(comm, *optimizer) : HostStateTensors{};
    if (rank == 0)
      sum.last_checkpoint = save_checkpoint(run_dir, st, model, *optimizer, tokenizer, rc.keep_checkpoints, &others);
    else
      sum.last_checkpoint = checkpoint_dir(run_dir, step);
    sum.checkpoint_steps.push_back(step);
  };

  g_stop = false;
  g_signal_notice = rank == 0;
  // SIGINT/SIGTERM/SIGUSR1 only set g_stop from here until train() returns (or throws): a signal during the
  // final evaluation or checkpoint is noted, not fatal. (A killed save leaves the previous checkpoint,
  // but the run would then end unfinished.)
  struct SignalGuard {
    void (*old_int)(int) = std::signal(SIGINT, on_signal);
    void (*old_term)(int) = std::signal(SIGTERM, on_signal);
    // SIGUSR1 too: what Open MPI's mpirun forwards to every rank (a Ctrl-C on mpirun ends the job
    // at once) and what Slurm sends ahead of a preemption (--signal=USR1@60).
    void (*old_usr1)(int) = std::signal(SIGUSR1, on_signal);
    ~SignalGuard() {
      std::signal(SIGINT, old_int);
      std::signal(SIGTERM, old_term);
      std::signal(SIGUSR1, old_usr1);
    }
  } signal_guard;
  const bool tty = isatty(1);
  double interval_s = 0;
  int64_t interval_tokens = 0;
  int64_t step = start_step;
  bool killed = false;
  while (step < rc.steps) {
    auto t0 = std::chrono::steady_clock::now();
    StepStats ss = train_step(cfg, step, model, *optimizer, *be,
                              [&](int32_t* in, int32_t* tg) { train_loader.next(in, tg); }, inputs.data(), targets.data(),
                              &comm);
    ++step;
    const int64_t ntok = ss.tokens;
    const double gnorm = ss.grad_norm, lr = ss.lr, lse_sq = ss.lse_sq * double(ntok);
    tokens_seen += ntok;
    const double loss = ss.loss;
    if (!std::isfinite(loss))
      throw TrainingDiverged(fmt::format("training diverged: loss is {} at step {} (lower optim.lr?)", loss, step));
    sum.losses.emplace_back(step, loss);

    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    interval_s += dt;
    interval_tokens += ntok;
    const bool log_now = step % rc.log_every == 0 || step == rc.steps;
    if (log_now) {
      const double tps = interval_tokens / interval_s;
      const double mfu = tps * fpt.train(true) / (peak * 1e9);
      rates.push_back(tps);
      mfus.push_back(mfu);
      nlohmann::json line = {{"step", step}, {"loss", loss}, {"lr", lr}, {"grad_norm", gnorm},
                             {"tokens_per_s", tps}, {"mfu", mfu}, {"tokens", tokens_seen},
                             {"elapsed_s", elapsed_total()}};
      if (cfg.model.z_loss > 0) line["lse_sq"] = lse_sq / double(ntok);
      std::string extra;
      if (!ss.moe.empty()) {
        // Per MoE layer: tokens per expert (min/max/mean over experts) and mean logsumexp^2 of the
        // router; the progress line shows the worst layer's max/mean and min/mean load.
        nlohmann::json layers = nlohmann::json::array();
        double worst_max = 0, worst_min = 1e300;
        for (auto& m : ss.moe) {
          layers.push_back({{"layer", m.layer}, {"load_min", m.load_min}, {"load_max", m.load_max},
                            {"load_mean", m.load_mean}, {"dropped_frac", m.dropped_frac},
                            {"router_lse_sq", m.lse_sq}});
          if (m.load_mean > 0) {
            worst_max = std::max(worst_max, m.load_max / m.load_mean);
            worst_min = std::min(worst_min, m.load_min / m.load_mean);
          }
        }
        line["moe"] = layers;
        line["router_z_loss"] = ss.router_z;
        extra = fmt::format("load {:.2f}-{:.2f}x", worst_min, worst_max);
        if (cfg.model.router_z_loss > 0) extra += fmt::format(" rz {:.2e}", ss.router_z);
      }
      if (metrics) metrics->write(line);
      if (talk) {
        ProgressInfo pi{step, rc.steps, loss, lr, gnorm, tps, mfu, elapsed_total(),
                        (rc.steps - step) * (interval_s / double(interval_tokens) * tokens_per_step), extra};
        fmt::print("{}{}{}", tty ? "\r\033[K" : "", format_progress(pi), tty ? "" : "\n");
        std::fflush(stdout);
      }
      interval_s = 0;
      interval_tokens = 0;
    }
    if (rc.eval_every > 0 && step % rc.eval_every == 0 && step != rc.steps) evaluate(step);
    if (opt.stop_after >= 0 && step >= opt.stop_after) {  // simulated kill (tests)
      killed = true;
      break;
    }
    if (step == opt.interrupt_at) g_stop = true;  // simulated SIGINT during this step (tests)
    // The decision to stop is the job's: a signal that reached some ranks stops them all at this
    // step, and one that lands after the flag was read counts at the next step on every rank (a
    // rank that read g_stop again here could checkpoint alone, entering collectives nobody joins).
    bool stop_now = g_stop;
    if (world > 1) {
      double stop = stop_now ? 1 : 0;
      comm.allreduce_max_host(&stop, 1);
      stop_now = stop > 0;
    }
    sum.interrupted = sum.interrupted || stop_now;
    // The last step's checkpoint is the final one below, whether or not a signal came: written once
    // (a second save of the same step replaced the first, with a window where a second Ctrl-C left
    // none), and the run is complete, not interrupted.
    if (step == rc.steps) break;
    if (stop_now) {
      checkpoint(step);
      if (talk) fmt::print("\ninterrupted: checkpoint written at step {}; continue with --resume\n", step);
      break;
    }
    if (rc.ckpt_every > 0 && step % rc.ckpt_every == 0) checkpoint(step);
  }
  sum.end_step = step;
  if (step == rc.steps && !killed) {
    evaluate(step);
    checkpoint(step);
  }
  comm.barrier();  // train() returns on no rank before rank 0's files are complete
  sum.interrupted = sum.interrupted || g_stop;  // also a signal during the final evaluation or checkpoint
  sum.tokens_per_s = median(rates);
  sum.mfu = median(mfus);
  if (talk) {
    if (tty) fmt::print("\n");
    fmt::print("{}: {} steps, median {:.0f} tokens/s, MFU {:.1f}%; metrics {}; checkpoints {}\n",
               step < rc.steps ? "stopped" : "done", step, sum.tokens_per_s, 100 * sum.mfu,
               (run_dir / "metrics.jsonl").string(), (run_dir / "checkpoints").string());
  }
  return sum;
}

}  // namespace ladder
