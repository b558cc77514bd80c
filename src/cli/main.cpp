// `ladder`: the one command. Verbs: data, train, sample, eval, inspect, bench, plot, config-doc, sweep, report.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <utility>
#include <vector>

#include "backend/cpu/openblas_cores.h"
#include "core/error.h"
#include "data/prepare.h"
#include "dist/comm.h"
#include "ladder/cli.h"
#include "model/config.h"
#include "optim/optimizer.h"
#include "train/bench.h"
#include "train/checkpoint.h"
#include "train/evaluate.h"
#include "train/inspect.h"
#include "train/optim_bench.h"
#include "train/plot.h"
#include "train/sampler.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace ladder;

// One line per error. In a data-parallel job the line names the rank, and the whole job is ended:
// the other ranks would otherwise wait forever in their next collective.
int report_error(const std::exception& e) {
  std::fflush(stdout);
  ladder::Comm* comm = ladder::process_comm_if_started();
  if (comm && comm->world() > 1) {
    std::fprintf(stderr, "\nerror (rank %d of %d): %s\n", comm->rank(), comm->world(), e.what());
    std::fflush(stderr);
    comm->abort(1);
  }
  std::fprintf(stderr, "\nerror: %s\n", e.what());
  return 1;
}

int main(int argc, char** argv) {
  ensure_openblas_kernels(argv);  // before anything else: it may restart the program
  CLI::App app{"Ladder: pretraining language models and measuring what each recipe change buys"};
  app.require_subcommand(1);

  // ladder data
  auto* data = app.add_subcommand("data", "tokenize text (txt/jsonl, .gz/.zst) into token shards");
  data::PrepareOptions dopt;
  data->add_option("--input", dopt.inputs, "input files")->required()->check(CLI::ExistingFile);
  data->add_option("--out", dopt.out_dir, "output directory")->required();
  auto* vocab_opt = data->add_option("--vocab", dopt.vocab_size, "tokenizer vocabulary size")->capture_default_str();
  data->add_option("--val-fraction", dopt.val_fraction, "fraction of documents held out")->capture_default_str();

  // ladder train
  auto* tr = app.add_subcommand("train", "train a model from a YAML config (data parallel: mpirun -np N ladder train ...)");
  std::string train_cfg, run_dir;
  std::vector<std::string> sets;
  bool resume = false;
  tr->add_option("config", train_cfg, "config YAML (e.g. configs/dense-tiny.yaml)")->required();
  // allow_extra_args(false): one value per --set, so a config path after it stays the config.
  tr->add_option("--set", sets, "override a config key: key.path=value (repeatable)")->allow_extra_args(false);
  tr->add_option("--run-dir", run_dir, "run directory (default runs/<config name>)");
  tr->add_flag("--resume", resume, "continue from the latest complete checkpoint in the run directory");
  bool dry_run = false;
  tr->add_flag("--dry-run", dry_run, "print every tensor with its optimizer group and learning rate, then exit");
  std::string train_device;
  tr->add_option("--device", train_device, "cpu | cuda (same as --set run.device=...)");

  // ladder sample
  auto* sa = app.add_subcommand("sample", "generate text from a checkpoint");
  std::string ckpt;
  SampleOptions sopt;
  sa->add_option("checkpoint", ckpt, "checkpoint directory, or a run directory (its latest checkpoint)")->required();
  sa->add_option("--prompt", sopt.prompt, "text to continue");
  sa->add_option("--temperature", sopt.temperature, "sampling temperature (0 = greedy)")->capture_default_str();
  sa->add_option("--top-k", sopt.top_k, "sample among the k most likely tokens (0 = all)")->capture_default_str();
  sa->add_option("--max-tokens", sopt.max_tokens, "tokens to generate")->capture_default_str();
  // (CLI11 would take "-1" for an unsigned seed as 2^64 - 1, and a negative thread count as "all".)
  const CLI::Validator non_negative(
      [](const std::string& v) { return v.starts_with('-') ? "expected a number >= 0, got " + v : std::string(); },
      "NON-NEGATIVE");
  sa->add_option("--seed", sopt.seed, "sampling seed")->capture_default_str()->check(non_negative);
  sa->add_option("--threads", sopt.threads, "CPU threads (0 = all)")->check(non_negative);

  // ladder eval
  auto* ev = app.add_subcommand("eval", "loss, perplexity and bits per byte of a checkpoint on a data directory");
  std::string eval_ckpt;
  EvalOptions eopt;
  bool ejson = false;
  ev->add_option("checkpoint", eval_ckpt, "checkpoint directory, or a run directory (its latest checkpoint)")->required();
  ev->add_option("--data", eopt.data, "data directory written by `ladder data` (default: the checkpoint's data.path)");
  ev->add_option("--split", eopt.split, "val | train")->capture_default_str();
  ev->add_option("--batches", eopt.batches, "batches to evaluate (0 = every full batch of the split)")
      ->capture_default_str()
      ->check(non_negative);
  ev->add_option("--batch-size", eopt.batch_size, "sequences per batch (0 = the checkpoint's run.batch_size)")
      ->capture_default_str()
      ->check(non_negative);
  ev->add_option("--threads", eopt.threads, "CPU threads (0 = all)")->check(non_negative);
  ev->add_option("--device", eopt.device, "cpu | cuda (a CUDA build; the checkpoint's run.precision)")->capture_default_str();
  ev->add_flag("--json", ejson, "print one JSON object");

  // ladder inspect (src/train/inspect.h)
  auto* in = app.add_subcommand("inspect", "each weight tensor of a checkpoint: its optimizer, norms, largest singular value, stable rank");
  std::string inspect_ckpt;
  InspectOptions iopt;
  bool ijson = false;
  in->add_option("checkpoint", inspect_ckpt, "checkpoint directory, or a run directory (its latest checkpoint)")->required();
  in->add_option("--params", iopt.params, "only these tensors: selectors as in optim.<opt>_params (\"role:gated_norm, *.q_proj.weight\")");
  in->add_option("--threads", iopt.threads, "CPU threads (0 = all)")->check(non_negative);
  in->add_flag("--json", ijson, "print one JSON object");

  // ladder bench
  auto* be = app.add_subcommand("bench", "measure sgemm rate and training throughput (MFU) of a preset");
  BenchOptions bopt;
  bopt.config = fs::path(LADDER_SOURCE_DIR) / "configs" / "dense-small.yaml";
  bool bjson = false;
  be->add_option("--config", bopt.config, "preset YAML")->capture_default_str();
  be->add_option("--set", bopt.overrides, "override a config key: key.path=value (repeatable)")->allow_extra_args(false);
  be->add_option("--steps", bopt.steps, "timed steps (median reported)")->capture_default_str()->check(CLI::Range(1, 1000000));
  be->add_flag("--torch", bopt.torch, "also time the model in PyTorch (scripts/bench-torch.py) on the same shapes, device and precision");
  be->add_option("--torch-args", bopt.torch_args, "extra arguments for scripts/bench-torch.py, as a shell string (e.g. --torch-args=--compile)");
  be->add_flag("--json", bjson, "print one JSON object");
  be->add_flag("--profile", bopt.profile, "time every backend op and print each one's share of the step");
  bool boptim = false;
  be->add_flag("--optim", boptim, "time the optimizer step's share of a step for each optimizer, and Newton-Schulz per matrix");
  std::string bench_device;
  be->add_option("--device", bench_device, "cpu | cuda (same as --set run.device=...)");

  // ladder plot (src/train/plot.h)
  auto* pl = app.add_subcommand("plot", "training curves of one or more runs (metrics.jsonl) as one SVG, and a summary table");
  PlotOptions plopt;
  pl->add_option("runs", plopt.inputs, "run directories or metrics.jsonl files")->required();
  pl->add_option("--y", plopt.y, "metrics, comma-separated: loss, val_loss, lr, grad_norm, tokens_per_s, mfu, moe.load_max_ratio, ...")
      ->delimiter(',')
      ->capture_default_str()
      ->allow_extra_args(false);
  pl->add_option("--x", plopt.x, "step | tokens | flops (compute C) | time")->capture_default_str();
  pl->add_option("--out", plopt.out, "SVG file to write")->capture_default_str();
  pl->add_option("--label", plopt.labels, "one label per run, comma-separated (default: the run directories' names)")
      ->delimiter(',')
      ->allow_extra_args(false);
  pl->add_option("--smooth", plopt.smooth, "EMA weight on the past per logged point, in [0, 1) (0.6 for a few dozen points, 0.9-0.99 for thousands)")
      ->capture_default_str();
  pl->add_option("--xmin", plopt.xmin, "leave out the points below this x (e.g. the first steps' fall)");
  pl->add_option("--xmax", plopt.xmax, "leave out the points above this x");
  pl->add_flag("--log-x", plopt.log_x, "log10 x axis");
  pl->add_flag("--log-y", plopt.log_y, "log10 y axes");
  pl->add_option("--title", plopt.title, "title above the panels");

  // ladder sweep / ladder report (src/ladder/)
  auto* sw = app.add_subcommand("sweep", "plan and run a ladder spec (resumable; --list for a cluster scheduler)");
  SweepOptions swopt;
  sw->add_option("spec", swopt.spec_file, "ladder spec YAML (e.g. configs/ladders/dense-smoke.yaml)")->required();
  sw->add_option("--out", swopt.out, "results directory (shared by every worker)")->required();
  sw->add_flag("--list", swopt.list, "print one shell command per run, then stop");
  sw->add_flag("--dry-run", swopt.dry_run, "print the plan, then stop");
  sw->add_option("--only", swopt.only, "run only this run id (repeatable)")->allow_extra_args(false);
  sw->add_flag("--verbose", swopt.verbose, "show each run's training progress");
  sw->add_option("--seeds", swopt.seeds, "seeds to run instead of the spec's (comma-separated)")
      ->delimiter(',')
      ->check(non_negative)
      ->allow_extra_args(false);
  sw->add_flag("--retime", swopt.retime, "time the models again (spec `timing:`) even when DIR/timing.json matches");
  sw->add_option("--reuse", swopt.reuse,
                 "copy in, instead of training, runs this other results directory holds with the same id, config "
                 "hash and data (repeatable)")
      ->allow_extra_args(false);
  auto* rp = app.add_subcommand("report", "speedup tables, fitted laws, plots and HTML from a results directory");
  ReportOptions rpopt;
  rp->add_option("dir", rpopt.dir, "results directory written by `ladder sweep`")->required();
  rp->add_option("--out", rpopt.out, "output directory (default DIR/report)");
  rp->add_option("--E", rpopt.E, "Marin's method: fixed E (default: the spec's report.E)");
  rp->add_option("--alpha", rpopt.alpha, "Marin's method: fixed alpha (default: the spec's report.alpha)");
  rp->add_option("--vs", rpopt.vs, "measure every variant against this one instead of its spec baseline");

  auto* doc = app.add_subcommand("config-doc", "print every config key, its type, default and meaning (Markdown)");

  // An unknown verb: CLI11 would say only "A subcommand is required".
  if (argc > 1 && argv[1][0] != '-') {
    const std::string verb = argv[1];
    std::vector<std::string> verbs;
    for (const auto* sub : app.get_subcommands({})) verbs.push_back(sub->get_name());
    if (std::find(verbs.begin(), verbs.end(), verb) == verbs.end()) {
      std::string list;
      for (const auto& v : verbs) list += (list.empty() ? "" : ", ") + v;
      std::fprintf(stderr, "error: unknown command '%s' (commands: %s; ladder --help)\n", verb.c_str(), list.c_str());
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    if (data->parsed()) {
      dopt.vocab_explicit = vocab_opt->count() > 0;  // a reused tokenizer of another size is then an error
      data::prepare_data(dopt);
    } else if (tr->parsed()) {
      TrainOptions o;
      if (!train_device.empty()) sets.push_back("run.device=" + train_device);
      o.cfg = load_config(train_cfg, sets);
      if (dry_run) {
        // The vocabulary comes from the data directory; without one the table still says everything
        // but the embedding and head shapes.
        if (o.cfg.model.vocab_size == 0) {
          try {
            resolve_data(o.cfg);
          } catch (const ladder::Error& e) {
            o.cfg.model.vocab_size = 8192;
            fmt::print("note: vocabulary unknown ({}); shapes below use vocab_size 8192\n", e.what());
          }
        }
        std::cout << dry_run_report(o.cfg, launcher_world_size());  // `auto` lrs count every rank's tokens
        return 0;
      }
      o.run_dir = run_dir.empty() ? fs::path("runs") / fs::path(train_cfg).stem() : fs::path(run_dir);
      o.resume = resume;
      // A run stopped by a signal exits 130, as `ladder sweep` does: a job script or a scheduler's
      // requeue logic must not take a preempted run for a finished one.
      if (train(o).end_step < o.cfg.run.steps) return 130;
    } else if (sa->parsed()) {
      check_sample_options(sopt);
      // The checkpoint's tokenizer first: a checkpoint saved without one gets an error that says why
      // and what to copy where (sample_text's own would only say the file is not found).
      checkpoint_tokenizer(resolve_checkpoint(ckpt));
      std::cout << sample_text(ckpt, sopt) << std::endl;
    } else if (ev->parsed()) {
      EvalResult r = evaluate_checkpoint(eval_ckpt, eopt);
      std::cout << (ejson ? to_json(r).dump() + "\n" : format_eval(r));
    } else if (in->parsed()) {
      InspectResult r = inspect_checkpoint(inspect_ckpt, iopt);
      std::cout << (ijson ? to_json(r).dump() + "\n" : format_inspect(r));
    } else if (be->parsed() && boptim) {
      // The optimizer benchmark times host buffers (Newton-Schulz on host matrices): CPU only.
      if (!bench_device.empty() && bench_device != "cpu")
        fail("ladder bench --optim runs on the CPU backend only (got --device {}); drop --device", bench_device);
      if (bopt.torch || bopt.profile)
        fail("ladder bench --optim times the optimizers alone: drop {}", bopt.torch ? "--torch" : "--profile");
      auto j = run_optim_bench(bopt);
      std::cout << (bjson ? j.dump() + "\n" : format_optim_bench(j));
    } else if (be->parsed()) {
      if (!bench_device.empty()) bopt.overrides.push_back("run.device=" + bench_device);
      auto j = run_bench(bopt);
      if (bjson) {
        std::cout << j.dump() << std::endl;
      } else {
        const bool host = j["backend"].get<std::string>().rfind("cpu", 0) == 0;
        const std::string gemm = host ? "sgemm" : "GEMM (" + j["backend"].get<std::string>() + ")";
        fmt::print("config      {}\nbackend     {} ({} CPU threads)\n{:<11} {:.1f} GFLOP/s (MFU denominator{})\n"
                   "train       {:.1f} GFLOP/s model FLOPs, {:.0f} tokens/s, step {:.3f} s (median of {})\n"
                   "MFU         {:.1f}% of the measured {}\n",
                   j["config"].get<std::string>(), j["backend"].get<std::string>(), j["threads"].get<int>(),
                   host ? "sgemm" : "gemm", j["sgemm_gflops"].get<double>(),
                   j.contains("openblas_core") ? "; OpenBLAS " + j["openblas_core"].get<std::string>() + " kernels" : "",
                   j["train_gflops"].get<double>(), j["tokens_per_s"].get<double>(), j["step_s_median"].get<double>(),
                   j["steps_timed"].get<int>(), 100 * j["mfu"].get<double>(), gemm);
        fmt::print("params      {} total, {} active per token\n", j["params"].get<int64_t>(),
                   j["params_active"].get<int64_t>());
        if (j.contains("moe_capacity")) {
          const auto& c = j["moe_capacity"];
          fmt::print("capacity    C = {} rows per expert: {:.1f}% of the expert rows overflowed (grouped GEMMs), "
                     "{:.1f}% padding (batched GEMMs), last step\n",
                     c["C"].get<int>(), 100 * c["overflow_frac"].get<double>(), 100 * c["padding_frac"].get<double>());
        }
        if (j.contains("profile")) {
          fmt::print("profile (share of the timed steps, ms/step, GFLOP/s for GEMMs):\n");
          for (auto& [op, t] : j["profile"].items())
            fmt::print("  {:<16} {:5.1f}%  {:8.1f} ms  {}\n", op, 100 * t["share"].get<double>(),
                       t["ms_per_step"].get<double>(),
                       t["gflops"].get<double>() > 0 ? fmt::format("{:.1f} GFLOP/s", t["gflops"].get<double>()) : "");
          fmt::print("  ops busy {:.1f}% of the steps' wall time (on a device: the rest is idle time between kernels)\n",
                     100 * j["profile_busy"].get<double>());
          // The ten GEMM shapes that take longest.
          std::vector<std::pair<double, std::string>> shapes;
          for (auto& [key, t] : j["profile_shapes"].items())
            shapes.emplace_back(t["ms_per_step"].get<double>(),
                                fmt::format("  {:5.1f}%  {:8.2f} ms  {:4d} calls  {:>7.1f} GFLOP/s  {}",
                                            100 * t["share"].get<double>(), t["ms_per_step"].get<double>(),
                                            t["calls"].get<long>() / std::max(1, j["steps_timed"].get<int>()),
                                            t["gflops"].get<double>(), key));
          std::sort(shapes.rbegin(), shapes.rend());
          if (!shapes.empty()) fmt::print("GEMM shapes (top 10 by time; per step):\n");
          for (size_t i = 0; i < shapes.size() && i < 10; ++i) fmt::print("{}\n", shapes[i].second);
        }
        if (j.contains("torch_tokens_per_s"))
          fmt::print("PyTorch     {:.0f} tokens/s on the same model ({} {}, {}, torch {}) -> Ladder is {:.2f}x\n",
                     j["torch_tokens_per_s"].get<double>(), j["torch"].value("impl", "?"),
                     j["torch"].value("device", "?"), j["torch"].value("precision", "?"),
                     j["torch"].value("torch", "?"), j["speedup_vs_torch"].get<double>());
      }
      if (j.contains("torch_error")) fail("{}", j["torch_error"].get<std::string>());
    } else if (pl->parsed()) {
      return plot_cli(plopt);
    } else if (sw->parsed()) {
      return sweep_cli(swopt);
    } else if (rp->parsed()) {
      return report_cli(rpopt);
    } else if (doc->parsed()) {
      std::cout << schema_markdown();
    }
  } catch (const std::exception& e) {
    return report_error(e);
  }
  return 0;
}
