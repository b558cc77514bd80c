#include "train/bench.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/openblas_cores.h"
#include "backend/profiling_backend.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "model/flops.h"
#include "model/transformer.h"
#include "optim/optimizer.h"
#include "train/machine.h"
#include "train/trainer.h"

namespace ladder {

nlohmann::json torch_model_json(const Config& c) {
  const auto& m = c.model;
  return {{"vocab_size", m.vocab_size}, {"d_model", m.d_model},      {"n_layers", m.n_layers},
          {"n_heads", m.n_heads},       {"n_kv_heads", m.kv_heads()}, {"head_dim", m.hd()},
          {"d_ff", m.ff()},             {"seq_len", m.seq_len},       {"rope_theta", m.rope_theta},
          {"norm_eps", m.norm_eps},     {"window", m.window},         {"qk_norm", m.qk_norm},
          {"z_loss", m.z_loss},         {"batch_size", c.run.batch_size},
          // MoE block (tests/reference/ref_moe.py); moe_experts 0 = dense
          {"moe_experts", m.moe_experts}, {"moe_top_k", m.moe_top_k}, {"moe_expert_ff", m.expert_ff()},
          {"moe_shared_ff", m.moe() ? m.shared_ff() : 0},
          {"moe_layers", [&] {
             std::vector<int> ls;
             for (int l = 0; l < m.n_layers; ++l)
               if (m.is_moe_layer(l)) ls.push_back(l);
             return ls;
           }()},
          {"moe_normalized", m.moe_normalized()}, {"moe_route_scale", m.moe_route_scale},
          {"moe_balance", m.moe_quantile_balance()}, {"router_z_loss", m.router_z_loss},
          // attention/norm recipe switches (tests/reference/ref_attn.py)
          {"rope_dims", m.rope_dims()}, {"qk_norm_gain", m.qk_norm_gain}, {"q_scale", m.q_scale},
          {"long_every", m.long_every}, {"last_layer_long", m.last_layer_long}, {"pko", m.pko},
          {"eod_id", m.eod_id},         {"xsa", m.xsa},               {"attn_gate", m.attn_gate},
          {"gated_norm_rank", m.gated_norm_rank}};
}

nlohmann::json torch_config_json(const Config& c) {
  nlohmann::json j = torch_model_json(c);
  j["optim"] = {{"lr", c.optim.lr},
                {"beta1", c.optim.beta1},
                {"beta2", c.optim.beta2},
                {"eps", c.optim.eps},
                {"weight_decay", c.optim.weight_decay},
                {"clip", c.optim.clip},
                {"warmup", c.schedule.warmup},
                {"total_steps", c.run.steps},
                {"final_lr_frac", c.schedule.final_lr_frac}};
  return j;
}

Config load_bench_config(const BenchOptions& opt) {
  Config cfg = load_config(opt.config, opt.overrides);
  if (cfg.model.vocab_size == 0) cfg.model.vocab_size = 8192;  // synthetic tokens: no data directory needed
  if (cfg.model.eod_id < 0) cfg.model.eod_id = 2;  // the tokenizer's </s> (docs/data.md); PKO needs one
  validate(cfg);
  return cfg;
}

void synthetic_batch(const Config& cfg, std::vector<int32_t>& in, std::vector<int32_t>& tgt) {
  const int N = cfg.run.batch_size * cfg.model.seq_len;
  in.resize(N);
  tgt.resize(N);
  Philox rng(cfg.run.seed, stream_id("bench"));
  for (int i = 0; i < N; ++i) {
    in[i] = int32_t(rng.u64(2 * i) % uint64_t(cfg.model.vocab_size));
    tgt[i] = int32_t(rng.u64(2 * i + 1) % uint64_t(cfg.model.vocab_size));
  }
}

nlohmann::json run_torch_bench(const Config& cfg, const BenchOptions& opt) {
  const bool cuda = cfg.run.device == "cuda";
  // Debian's torch on the CPU; on a GPU machine the python whose torch has CUDA.
  const char* env = std::getenv("LADDER_TORCH_PYTHON");
  const std::string python = env && *env ? env : cuda ? "python3" : "/usr/bin/python3";
  // The scripts of this checkout: $LADDER_SOURCE_DIR where the binary runs away from its source tree
  // (the prebuilt GPU bundle), else the tree it was built from.
  const char* src_env = std::getenv("LADDER_SOURCE_DIR");
  const std::string src = src_env && *src_env ? src_env : LADDER_SOURCE_DIR;
  const nlohmann::json mj = torch_config_json(cfg);
  auto tmp = std::filesystem::temp_directory_path() / fmt::format("ladder-bench-{}.json", ::getpid());
  write_file_atomic(tmp, mj.dump());
  // torch_args is a shell string on purpose (several arguments); the rest is quoted.
  std::string cmd = fmt::format("{} {} --config-json {} --steps {} --threads {} --device {} --precision {} {}",
                                shell_quote(python), shell_quote(src + "/scripts/bench-torch.py"),
                                shell_quote(tmp.string()), opt.steps, cpu_threads(), cuda ? "cuda" : "cpu",
                                cuda ? cfg.run.precision : "fp32", opt.torch_args);
  std::string out;
  int rc = -1;
  if (FILE* p = popen((cmd + " 2>&1").c_str(), "r")) {
    char buf[4096];
    while (fgets(buf, sizeof buf, p)) out += buf;
    rc = pclose(p);
  }
  std::filesystem::remove(tmp);
  const std::string tail = out.size() > 4000 ? out.substr(out.size() - 4000) : out;
  if (rc != 0) {
    const std::string how = WIFEXITED(rc)     ? fmt::format("exit {}", WEXITSTATUS(rc))
                            : WIFSIGNALED(rc) ? fmt::format("killed by signal {}", WTERMSIG(rc))
                                              : fmt::format("status {}", rc);
    fail("PyTorch benchmark failed ({}): {}\n{}", how, cmd, tail);
  }
  // Its JSON is one line; stderr is mixed in (and may follow it, e.g. at interpreter exit): the last
  // line that parses as an object.
  size_t end = out.size();
  while (end > 0) {
    const size_t start = out.rfind('\n', end - 1);
    const size_t from = start == std::string::npos ? 0 : start + 1;
    if (from < end && out[from] == '{') {
      nlohmann::json tj = nlohmann::json::parse(out.substr(from, end - from), nullptr, /*allow_exceptions=*/false);
      if (tj.is_object()) return tj;
    }
    if (start == std::string::npos) break;
    end = start;
  }
  fail("PyTorch benchmark printed no JSON line: {}\n{}", cmd, tail);
}

StepTimes time_train_steps(const Config& cfg, Transformer& model, Optimizer& optimizer, Backend& be, int warmup,
                           int steps, const std::function<void()>& after_warmup) {
  std::vector<int32_t> in, tgt;
  synthetic_batch(cfg, in, tgt);
  // Process CPU time (all threads) beside wall time: on a shared, overloaded machine it tracks the
  // work of a step far better than wall time does (run with one thread to keep spin-waits out).
  auto cpu_now = [] {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  };
  StepTimes st;
  for (int s = 0; s < warmup + steps; ++s) {
    auto t0 = std::chrono::steady_clock::now();
    const double c0 = cpu_now();
    train_step(cfg, s, model, optimizer, be, [&](int32_t*, int32_t*) {}, in.data(), tgt.data());
    be.synchronize();  // a device step is over when its last kernel is (the optimizer's run async)
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= warmup) st.wall.push_back(dt), st.cpu.push_back(cpu_now() - c0);
    if (s == warmup - 1 && after_warmup) after_warmup();
  }
  return st;
}

StepTimes time_train_steps(const Config& cfg, int warmup, int steps) {
  std::unique_ptr<Backend> be = make_backend(cfg.run.device, cfg.run.threads, cfg.run.precision, cfg.run.attention);
  Transformer model(cfg.model, cfg.run.batch_size, *be);
  model.init(cfg.run.seed);
  model.reserve_step(cfg.run.grad_accum);
  auto optimizer = make_optimizer(cfg, model, *be);
  return time_train_steps(cfg, model, *optimizer, *be, warmup, steps);
}

namespace {

// Ladder's side of `ladder bench`: the backend, model and optimizer live only in here, so their
// device memory is released when it returns (before PyTorch's run, which shares the GPU).
nlohmann::json bench_ladder(const Config& cfg, const BenchOptions& opt) {
  std::unique_ptr<Backend> be = make_backend(cfg.run.device, cfg.run.threads, cfg.run.precision, cfg.run.attention);
  ProfilingBackend* prof = nullptr;
  if (opt.profile) {
    auto p = make_profiling_backend(std::move(be));
    prof = p.get();
    be = std::move(p);
  }
  // The MFU denominator, measured in this run: OpenBLAS sgemm on the CPU; on a device the backend's
  // own GEMM at its precision (fp32, TF32 or bf16), so MFU says how close the step gets to what
  // this GPU's GEMMs reach today.
  const double peak = be->is_host() ? sgemm_gflops(/*use_cache=*/false) : backend_gemm_gflops(*be);
  Transformer model(cfg.model, cfg.run.batch_size, *be);
  model.init(cfg.run.seed);
  model.reserve_step(cfg.run.grad_accum);
  auto optimizer = make_optimizer(cfg, model, *be);
  const int N = cfg.run.batch_size * cfg.model.seq_len;
  StepTimes st = time_train_steps(cfg, model, *optimizer, *be, 2, opt.steps, [&] {
    if (prof) prof->reset();  // profile only the timed steps
  });
  std::vector<double>& times = st.wall;
  std::vector<double>& cpu_times = st.cpu;
  std::sort(times.begin(), times.end());
  std::sort(cpu_times.begin(), cpu_times.end());
  const double step_s = times[times.size() / 2];
  const double tps = double(N) * cfg.run.grad_accum / step_s;
  const auto fpt = flops_per_token(cfg.model);
  const double train_gflops = tps * fpt.train(true) / 1e9;
  nlohmann::json j = {{"config", opt.config.string()},  {"threads", cpu_threads()},
                      {"backend", be->name()},          {"precision", cfg.run.precision},
                      {"sgemm_gflops", peak},           {"train_gflops", train_gflops},
                      {"tokens_per_s", tps},            {"mfu", train_gflops / peak},
                      {"step_s_median", step_s},        {"step_cpu_s_median", cpu_times[cpu_times.size() / 2]},        {"steps_timed", opt.steps},
                      {"flops_per_token_train", fpt.train(true)}, {"params", count_params(cfg.model).total},
                      {"params_active", count_params(cfg.model).active},
                      {"activation_mib", double(model.activation_bytes()) / 1048576.0},
                      {"device_mem_used_mib", be->device_memory_used() < 0 ? -1.0 : be->device_memory_used() / 1048576.0},
                      {"saved_activations", cfg.model.saved_activations},
                      {"mlp_bf16", cfg.model.mlp_bf16},
                      {"moe_bf16", cfg.model.moe_bf16},
                      {"moe_bf16_grads", cfg.model.moe_bf16_grads},
                      {"mlp_bf16_grads", cfg.model.mlp_bf16_grads},
                      {"attn_bf16", cfg.model.attn_bf16},
                      {"norm_bf16", cfg.model.norm_bf16}};
  // The capacity layout's split of the expert rows in the last step (all MoE layers): rows the
  // batched GEMMs took, their padding, and the overflow left to the grouped GEMMs.
  if (const std::vector<int> ov = model.capacity_overflow_rows(); !ov.empty()) {
    const int C = cfg.model.expert_capacity(N);
    const double rows = double(N) * cfg.model.moe_top_k * double(ov.size());
    double over = 0;
    for (int o : ov) over += o;
    const double padding = double(cfg.model.moe_experts) * C * double(ov.size()) - (rows - over);
    j["moe_capacity"] = {{"C", C}, {"rows", rows}, {"overflow_frac", over / rows}, {"padding_frac", padding / rows}};
  }
  if (prof) {
    double total = 0;
    for (auto& t : times) total += t;
    // One entry per op (and again per GEMM shape): its share of the timed steps, ms per step, calls
    // over all timed steps and, for GEMMs, GFLOP/s.
    auto entry = [&](const OpTime& t) {
      return nlohmann::json{{"share", t.seconds / total},
                            {"ms_per_step", 1e3 * t.seconds / opt.steps},
                            {"calls", t.calls},
                            {"gflops", t.flops > 0 && t.seconds > 0 ? t.flops / t.seconds / 1e9 : 0.0}};
    };
    nlohmann::json p = nlohmann::json::object(), ps = nlohmann::json::object();
    double busy = 0;
    for (auto& [op, t] : prof->times()) {
      p[op] = entry(t);
      busy += t.seconds;
    }
    j["profile"] = p;
    for (auto& [key, t] : prof->shape_times()) ps[key] = entry(t);
    j["profile_shapes"] = ps;
    // The ops' time over the steps' wall time. On a device the op times come from events on the
    // stream, so the rest is the device idling inside a step: gaps between kernels (the host not
    // keeping ahead, or waiting) plus the timer's own events. On the CPU: the rest is host-side
    // model code between ops.
    j["profile_busy"] = busy / total;
  }
  if (be->is_host()) j["openblas_core"] = openblas_core();  // the kernels the CPU's sgemms ran
  return j;
}

}  // namespace

nlohmann::json run_bench(const BenchOptions& opt) {
  const Config cfg = load_bench_config(opt);
  nlohmann::json j = bench_ladder(cfg, opt);
  if (opt.torch) {
    // A baseline that fails (no torch, out of memory) must not take Ladder's measurement with it:
    // the error goes into the result, and the CLI prints both and exits non-zero.
    try {
      nlohmann::json tj = run_torch_bench(cfg, opt);
      const double ttps = tj.at("tokens_per_s").get<double>();
      j["torch_tokens_per_s"] = ttps;
      j["speedup_vs_torch"] = j["tokens_per_s"].get<double>() / ttps;
      j["torch"] = tj;
    } catch (const std::exception& e) {
      j["torch_error"] = e.what();
    }
  }
  return j;
}

}  // namespace ladder
