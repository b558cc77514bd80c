// Data parallelism over MPI, run as a job of two ranks (CTest: mpiexec -np 2 ladder_dist_tests).
// Each test trains the tiny model with both ranks through train() (the job's Comm, as
// `mpirun ladder train` does), and compares with a one-process run that reads the same tokens:
// each rank runs that reference itself, with a single-process Comm, 2 micro-batches per step where
// the ranks take 1 each.
#include <gtest/gtest.h>
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "backend/cpu/openblas_cores.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "dist/comm.h"
#include "model/transformer.h"
#include "optim/optimizer.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "../guarded_backend.h"
#include "../test_util.h"
#include "../tiny_training.h"

namespace fs = std::filesystem;
using namespace ladder;

namespace {

Comm& job() { return process_comm(); }

// A directory every rank sees: rank 0 makes it (and the word-salad data in it) and sends its path.
const fs::path& shared_dir() {
  static fs::path dir = [] {
    std::string p;
    if (job().rank() == 0) {
      p = (fs::temp_directory_path() / fmt::format("ladder-dist-{}", ::getpid())).string();
      fs::remove_all(p);
      fs::create_directories(p);
      test::make_word_salad_data(p, 300, 11);
    }
    uint64_t n = p.size();
    job().broadcast_host(&n, sizeof n, 0);
    p.resize(n);
    job().broadcast_host(p.data(), n, 0);
    job().barrier();
    return fs::path(p);
  }();
  return dir;
}

// A fresh directory name under the shared one, the same on every rank (tests run in the same order).
fs::path run_dir(const std::string& name) { return shared_dir() / name; }
fs::path own_dir(const std::string& name) { return shared_dir() / fmt::format("{}-rank{}", name, job().rank()); }

Config dense_config() {
  Config c = test::tiny_train_config(shared_dir());
  c.run.batch_size = 2;  // per rank
  c.run.grad_accum = 1;
  c.run.threads = 1;     // two ranks on a two-core machine
  c.run.steps = 8;
  c.run.ckpt_every = 4;
  c.run.eval_every = 4;
  c.run.eval_batches = 2;
  return c;
}

Config moe_config() {
  Config c = dense_config();
  c.model.moe_experts = 4;
  c.model.moe_top_k = 2;
  c.model.moe_expert_ff = 32;
  c.model.moe_shared_expert = true;
  c.model.router_z_loss = 1e-3;
  return c;  // quantile balancing is the default
}

TrainSummary run(const Config& c, const fs::path& dir, Comm* comm, bool resume = false, int64_t stop_after = -1) {
  return test::train_quietly(c, dir, resume, stop_after, comm);
}

// The one-process run that reads the tokens of a 2-rank run: rank r's micro-batch is micro-batch
// r of each step (validation reads the same eval_batches batches either way: the ranks share them).
TrainSummary reference(Config c, const std::string& name) {
  c.run.grad_accum *= 2;
  auto single = make_single_comm();
  return run(c, own_dir(name), single.get());
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

// One process continuing, with 2 micro-batches per step, the 2-rank step-4 checkpoint in `mine`: it
// runs steps 5-8, each loss within `tol` of the 2-rank run `whole`'s.
void expect_one_process_continues(const Config& c, const fs::path& mine, const TrainSummary& whole, double tol) {
  auto single = make_single_comm();
  Config one = c;
  one.run.grad_accum = 2;
  TrainSummary rest = run(one, mine, single.get(), /*resume=*/true);
  EXPECT_EQ(rest.start_step, 4);
  ASSERT_EQ(rest.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_LT(rel(rest.losses[i].second, whole.losses[4 + i].second), tol) << "step " << 5 + i;
}

std::vector<float> all_weights(const fs::path& ckpt) {
  SafeTensors st = SafeTensors::open(ckpt / "model.safetensors");
  std::vector<float> w;
  for (const std::string& n : st.names()) {
    std::vector<float> t = st.get_f32(n);
    w.insert(w.end(), t.begin(), t.end());
  }
  return w;
}

// The gradient norm of every step (before clipping), from a run's metrics.jsonl (rank 0 wrote it).
std::vector<double> grad_norms(const fs::path& dir) {
  std::vector<double> g;
  std::ifstream f(dir / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("grad_norm")) g.push_back(j["grad_norm"].get<double>());
  }
  return g;
}

}  // namespace

TEST(DataParallel, TheJobHasTwoRanks) {
  ASSERT_EQ(job().world(), 2) << "run under mpiexec -np 2 (CTest does)";
  EXPECT_NE(job().describe().find("MPI: 2 ranks"), std::string::npos) << job().describe();
  double v[2] = {double(job().rank() + 1), double(job().rank())};
  job().allreduce_sum_host(v, 1);
  job().allreduce_max_host(v + 1, 1);
  EXPECT_EQ(v[0], 3.0);
  EXPECT_EQ(v[1], 1.0);
}

// Buffers larger than one MPI message (256 MiB pieces: comm.cpp) are summed and scattered in whole:
// every element, the pieces' boundaries and the tail included. 80M floats (320 MB) are two pieces.
TEST(DataParallel, BuffersLargerThanOneMessageGoInPieces) {
  auto be = make_cpu_backend(1);
  const size_t n = size_t(80) << 20;
  std::vector<float> v(n);
  const float r = float(job().rank());
  for (size_t i = 0; i < n; ++i) v[i] = float(i % 1000) + r;  // sums: 2 (i % 1000) + 1, exact in fp32
  job().allreduce_sum(*be, v.data(), n);
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad += v[i] != 2.0f * float(i % 1000) + 1.0f;
  EXPECT_EQ(bad, 0u);
  // Rank 1's range crosses a piece boundary; each rank gets its own range's sums.
  for (size_t i = 0; i < n; ++i) v[i] = 1.0f + r;
  const std::vector<size_t> offsets = {0, n / 8, n};
  job().reduce_scatter_ranges(*be, v.data(), offsets);
  bad = 0;
  for (size_t i = offsets[size_t(job().rank())]; i < offsets[size_t(job().rank()) + 1]; ++i) bad += v[i] != 3.0f;
  EXPECT_EQ(bad, 0u);
  for (size_t i = 0; i < n; ++i) v[i] = float(job().rank() == 0 ? i < n / 8 : i >= n / 8) * float(i % 7 + 1);
  job().allgather_ranges(*be, v.data(), offsets);
  bad = 0;
  for (size_t i = 0; i < n; ++i) bad += v[i] != float(i % 7 + 1);
  EXPECT_EQ(bad, 0u);
}

// Two ranks with one micro-batch each are the one-process step with two micro-batches: the same
// tokens, the mean gradient of all of them, the same update. The first loss is bitwise the same
// (the same weights and tokens; the sums are added in the same order); later ones differ only by
// the order of the gradient sums (the ranks add two partial gradients, the one process accumulates
// the second into the first inside its GEMMs).
TEST(DataParallel, DenseTrainingIsTheOneProcessRunWithAccumulation) {
  const Config c = dense_config();
  TrainSummary dp = run(c, run_dir("dense"), nullptr);
  TrainSummary ref = reference(c, "dense-ref");
  ASSERT_EQ(dp.losses.size(), 8u);
  ASSERT_EQ(ref.losses.size(), 8u);
  EXPECT_EQ(dp.losses[0].second, ref.losses[0].second);
  for (size_t i = 0; i < dp.losses.size(); ++i)
    EXPECT_LT(rel(dp.losses[i].second, ref.losses[i].second), 2e-5) << "step " << i + 1;
  ASSERT_EQ(dp.val_losses.size(), ref.val_losses.size());
  for (size_t i = 0; i < dp.val_losses.size(); ++i)
    EXPECT_LT(rel(dp.val_losses[i].second, ref.val_losses[i].second), 2e-5) << "evaluation " << i;
  // The gradient itself, not only the update (Adam's would hide a gradient off by a factor).
  std::vector<double> g_dp = grad_norms(run_dir("dense")), g_ref = grad_norms(own_dir("dense-ref"));
  ASSERT_EQ(g_dp.size(), 8u);
  ASSERT_EQ(g_ref.size(), 8u);
  for (size_t i = 0; i < g_dp.size(); ++i) EXPECT_LT(rel(g_dp[i], g_ref[i]), 2e-5) << "step " << i + 1;
  // The weights rank 0 saved against the one process's.
  std::vector<float> a = all_weights(dp.last_checkpoint), b = all_weights(ref.last_checkpoint);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_LT(test::rel_err(a.data(), b.data(), a.size()), 1e-5);
  // Every loss moved: training happened (a run that skipped its updates would match itself only).
  EXPECT_LT(dp.losses.back().second, dp.losses.front().second - 0.1);
  // Rank 0 alone wrote the run: its metrics and checkpoints, with the ranks recorded.
  if (job().rank() == 0) {
    EXPECT_TRUE(fs::exists(run_dir("dense") / "metrics.jsonl"));
    EXPECT_EQ(read_checkpoint_state(dp.last_checkpoint).world, 2);
  }
}

// The recipe's `auto` learning rates (RECIPE.md section 3) come from the tokens per step and of the
// run: two ranks count both ranks' tokens, so they get the one process's rates (and follow it).
TEST(DataParallel, AutoLearningRatesCountEveryRank) {
  Config c = dense_config();
  c.optim.name = "muonh";
  c.optim.adam_lr = c.optim.adamh_lr = c.optim.muonh_lr = "auto";
  c.optim.weight_decay = 0;
  c.optim.clip = 0;
  c.run.steps = 4;
  TrainSummary dp = run(c, run_dir("auto-lr"), nullptr);
  TrainSummary ref = reference(c, "auto-lr-ref");
  ASSERT_EQ(dp.losses.size(), ref.losses.size());
  for (size_t i = 0; i < dp.losses.size(); ++i)
    EXPECT_LT(rel(dp.losses[i].second, ref.losses[i].second), 2e-5) << "step " << i + 1;
}

// MoE: the quantile-balancing beta is each rank's, averaged over the ranks (RECIPE.md section 2), so
// the bias differs from the one process's (beta over all tokens of the step) and the runs part
// slowly; the first loss is the same (the bias starts at zero).
TEST(DataParallel, MoeTrainingFollowsTheOneProcessRun) {
  const Config c = moe_config();
  TrainSummary dp = run(c, run_dir("moe"), nullptr);
  TrainSummary ref = reference(c, "moe-ref");
  ASSERT_EQ(dp.losses.size(), ref.losses.size());
  EXPECT_EQ(dp.losses[0].second, ref.losses[0].second);
  for (size_t i = 0; i < dp.losses.size(); ++i)
    EXPECT_LT(rel(dp.losses[i].second, ref.losses[i].second), 5e-3) << "step " << i + 1;
  EXPECT_LT(dp.losses.back().second, dp.losses.front().second - 0.1);
}

// The bias after a data-parallel balancing update is computed from the mean of the ranks' betas:
// each rank's own beta (balance_beta) gathered and averaged by hand gives bitwise the same bias.
TEST(DataParallel, BalancingAveragesTheRanksBeta) {
  Config c = moe_config();
  c.model.vocab_size = 320;
  auto be = make_cpu_backend(1);
  const int N = c.run.batch_size * c.model.seq_len;
  std::vector<int32_t> in(N), tg(N);
  Philox r(5, uint64_t(job().rank()));  // each rank its own tokens
  for (int i = 0; i < N; ++i) in[i] = int32_t(r.u64(uint64_t(i)) % 320), tg[i] = int32_t(r.u64(uint64_t(i) + N) % 320);

  Transformer own(c.model, c.run.batch_size, *be);
  own.init(3);
  own.forward_backward(in.data(), tg.data(), 1.0f / N);
  std::vector<double> beta = own.balance_beta();
  ASSERT_FALSE(beta.empty());
  // Every rank's beta, in rank order.
  std::vector<double> b0 = beta, b1 = beta;
  job().broadcast_host(b0.data(), b0.size() * sizeof(double), 0);
  job().broadcast_host(b1.data(), b1.size() * sizeof(double), 1);
  std::vector<double> mean(beta.size());
  for (size_t i = 0; i < mean.size(); ++i) mean[i] = (b0[i] + b1[i]) / 2;
  EXPECT_NE(b0, b1);  // the ranks' tokens differ, so do their betas
  own.apply_balance(mean);

  Transformer dp(c.model, c.run.batch_size, *be);
  dp.init(3);
  dp.forward_backward(in.data(), tg.data(), 1.0f / N);
  dp.update_balance([&](double* b, size_t n) { job().allreduce_mean(*be, b, n); });
  ASSERT_EQ(own.buffers().size(), dp.buffers().size());
  for (size_t i = 0; i < own.buffers().size(); ++i) {
    std::vector<float> x = own.download(own.buffers()[i]), y = dp.download(dp.buffers()[i]);
    EXPECT_EQ(x, y) << own.buffers()[i].name;
  }
}

// A run killed after step 6 (its last checkpoint at step 4) and resumed by the same two ranks
// ends bitwise where the uninterrupted run ends.
TEST(DataParallel, ResumeIsExact) {
  const Config c = moe_config();
  TrainSummary whole = run(c, run_dir("whole"), nullptr);
  run(c, run_dir("killed"), nullptr, false, /*stop_after=*/6);
  TrainSummary rest = run(c, run_dir("killed"), nullptr, /*resume=*/true);
  EXPECT_EQ(rest.start_step, 4);
  ASSERT_EQ(rest.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(rest.losses[i].second, whole.losses[4 + i].second) << "step " << 5 + i;
  EXPECT_EQ(all_weights(rest.last_checkpoint), all_weights(whole.last_checkpoint));
}

// One process resumes a 2-rank checkpoint with 2 micro-batches per step: the data continue from the
// same position (the loader counts the samples of all ranks), so it follows the 2-rank run; with
// the micro-batches of one rank only it is refused.
TEST(DataParallel, OneProcessContinuesATwoRankCheckpoint) {
  const Config c = dense_config();
  TrainSummary whole = run(c, run_dir("dense-whole"), nullptr);
  run(c, run_dir("dense-half"), nullptr, false, /*stop_after=*/5);  // its last checkpoint: step 4
  const fs::path mine = own_dir("dense-continued");
  fs::copy(run_dir("dense-half"), mine, fs::copy_options::recursive);
  auto single = make_single_comm();
  // The same run.grad_accum on one rank would take half the micro-batches per step: refused.
  const std::string e = test::error_of([&] { run(c, mine, single.get(), /*resume=*/true); });
  EXPECT_NE(e.find("run.grad_accum 1 x 2 rank(s) in the checkpoint, 1 x 1 now"), std::string::npos) << e;
  expect_one_process_continues(c, mine, whole, 2e-5);
}

// Ranks whose weights differ (here: another seed on rank 1) stop at the start, every rank with
// the same error naming the rank, instead of training a mix.
TEST(DataParallel, RanksThatDisagreeStopWithAnError) {
  Config c = dense_config();
  c.run.seed = 1 + uint64_t(job().rank());
  const std::string e = test::error_of([&] { run(c, run_dir("disagree"), nullptr); });
  EXPECT_NE(e.find("the weights of rank(s) 1 differ from rank 0's after initialization"), std::string::npos) << e;
}

namespace {

// A device backend's collectives stood in for on the guarded backend (emulated device memory), over
// MPI: what the job's Comm decides about them, and that its sums are the host path's bits.
class FakeCollectives final : public DeviceCollectives {
 public:
  FakeCollectives(Backend& be, std::string why, std::string id) : be_(be), why_(std::move(why)), id_(std::move(id)) {}
  std::string unavailable() override { return why_; }
  std::string device_id() const override { return id_; }
  std::vector<uint8_t> new_job_id() override { return {1, 2, 3}; }
  void join(const std::vector<uint8_t>& id, int, int) override {
    EXPECT_EQ(id, (std::vector<uint8_t>{1, 2, 3}));  // rank 0's, on every rank
    state_ = State::kInUse;
  }
  void set_not_used() override { state_ = State::kNotUsed; }
  State state() const override { return state_; }
  std::string describe() const override { return "fake"; }
  void allreduce_sum(float* p, size_t n) override { sum(p, n, MPI_FLOAT, 1); }
  void allreduce_sum(double* p, size_t n) override { sum(p, n, MPI_DOUBLE, 1); }
  void reduce_scatter_ranges(float* p, const std::vector<size_t>& offsets) override {
    ++calls;
    std::vector<float> h(offsets.back());
    be_.download(h.data(), p, h.size() * sizeof(float));
    for (int r = 0; r < 2; ++r) {
      float* at = h.data() + offsets[size_t(r)];
      const int n = int(offsets[size_t(r) + 1] - offsets[size_t(r)]);
      MPI_Reduce(r == job().rank() ? MPI_IN_PLACE : at, r == job().rank() ? at : nullptr, n, MPI_FLOAT, MPI_SUM, r,
                 MPI_COMM_WORLD);
    }
    // The other ranks' ranges are undefined after a reduce-scatter: NaN here, so that a reader of
    // them (a norm, an update) shows in the results.
    const int other = 1 - job().rank();
    std::fill(h.begin() + long(offsets[size_t(other)]), h.begin() + long(offsets[size_t(other) + 1]), std::nanf(""));
    be_.upload(p, h.data(), h.size() * sizeof(float));
  }
  void allreduce_mean(double* p, size_t n) override { sum(p, n, MPI_DOUBLE, 2); }
  void allgather_ranges(float* p, const std::vector<size_t>& offsets) override {
    ++calls;
    std::vector<float> h(offsets.back());
    be_.download(h.data(), p, h.size() * sizeof(float));
    for (int r = 0; r < 2; ++r)
      MPI_Bcast(h.data() + offsets[size_t(r)], int(offsets[size_t(r) + 1] - offsets[size_t(r)]), MPI_FLOAT, r,
                MPI_COMM_WORLD);
    be_.upload(p, h.data(), h.size() * sizeof(float));
  }
  int calls = 0;

 private:
  // Through host memory: the sum over the ranks, divided by `divide` (2: the mean of two ranks).
  template <class T>
  void sum(T* p, size_t n, MPI_Datatype type, int divide) {
    ++calls;
    std::vector<T> h(n);
    be_.download(h.data(), p, n * sizeof(T));
    MPI_Allreduce(MPI_IN_PLACE, h.data(), int(n), type, MPI_SUM, MPI_COMM_WORLD);
    for (T& x : h) x /= T(divide);
    be_.upload(p, h.data(), n * sizeof(T));
  }
  Backend& be_;
  std::string why_, id_;
  State state_ = State::kUndecided;
};

class GuardedWithCollectives final : public testing_support::GuardedBackend {
 public:
  GuardedWithCollectives(std::string why, std::string id) : GuardedBackend(1), fake(*this, std::move(why), std::move(id)) {}
  DeviceCollectives* collectives() override { return &fake; }
  // The Comm reports every device collective's write (a real device backend drops what it derived
  // from that memory: the CUDA backend's bf16 weight mirror).
  void note_external_write(const void*, size_t) override { ++external_writes; }
  FakeCollectives fake;
  int external_writes = 0;
};

// Steps of the MoE model on `be` with the job's two ranks (train_step, each rank its own batches):
// the losses and the final weights and biases.
// `shard`: the optimizer sharded over the ranks (ZeRO stage 1).
std::pair<std::vector<double>, std::vector<float>> steps_on(Backend& be, bool shard = false) {
  Config c = moe_config();
  c.model.vocab_size = 320;
  validate(c);
  Transformer m(c.model, c.run.batch_size, be);
  m.init(4);
  const OptimizerShards sh = plan_optimizer_shards(c, m, job().rank(), job().world());
  auto opt = make_optimizer(c, m, be, job().world(), shard ? &sh : nullptr);
  const int N = c.run.batch_size * c.model.seq_len;
  std::vector<int32_t> in(N), tg(N);
  std::vector<double> losses;
  for (int t = 0; t < 3; ++t) {
    StepStats st = train_step(c, t, m, *opt, be,
                              [&](int32_t* a, int32_t* y) {
                                Philox r(uint64_t(t), uint64_t(job().rank()));
                                for (int i = 0; i < N; ++i)
                                  a[i] = int32_t(r.u64(uint64_t(i)) % 320), y[i] = int32_t(r.u64(uint64_t(i + N)) % 320);
                              },
                              in.data(), tg.data(), &job());
    losses.push_back(st.loss);
    losses.push_back(st.grad_norm);  // each rank's own (a sharded rank assembles it from the owners' sums)
  }
  std::vector<float> w;
  for (const Param& p : m.params()) {
    std::vector<float> x = m.download(p);
    w.insert(w.end(), x.begin(), x.end());
  }
  for (const Param& p : m.buffers()) {
    std::vector<float> x = m.download(p);
    w.insert(w.end(), x.begin(), x.end());
  }
  return {losses, w};
}

}  // namespace

// Ranks on device memory: the sums through host memory (the guarded backend has no collectives),
// or through the device's own when every rank has them on a device of its own; otherwise (one rank
// without, two ranks on one device) all ranks decide on host memory. Every way gives the host
// run's bits.
TEST(DataParallel, DeviceMemorySumsAreTheHostRunsBits) {
  auto cpu = make_cpu_backend(1);
  const auto host = steps_on(*cpu);
  {
    testing_support::GuardedBackend guarded(1);
    EXPECT_EQ(steps_on(guarded), host);
  }
  const std::string own_id = fmt::format("dev-{}", job().rank());
  {
    GuardedWithCollectives g("", own_id);
    EXPECT_EQ(steps_on(g), host);
    EXPECT_EQ(g.fake.state(), DeviceCollectives::State::kInUse);
    EXPECT_EQ(g.fake.calls, 6);  // the gradients and beta of 3 steps
    EXPECT_EQ(g.external_writes, 6);
  }
  {
    GuardedWithCollectives g(job().rank() == 1 ? "no NCCL here" : "", own_id);
    EXPECT_EQ(steps_on(g), host);
    EXPECT_EQ(g.fake.state(), DeviceCollectives::State::kNotUsed);
    EXPECT_EQ(g.fake.calls, 0);
  }
  {
    GuardedWithCollectives g("", "the-same-device");
    EXPECT_EQ(steps_on(g), host);
    EXPECT_EQ(g.fake.state(), DeviceCollectives::State::kNotUsed);
    EXPECT_EQ(g.fake.calls, 0);
  }
  // A sharded optimizer's weights gathered through host memory and through the device's own
  // collectives: the unsharded host run's bits.
  {
    testing_support::GuardedBackend guarded(1);
    EXPECT_EQ(steps_on(guarded, /*shard=*/true), host);
  }
  {
    GuardedWithCollectives g("", own_id);
    EXPECT_EQ(steps_on(g, /*shard=*/true), host);
    EXPECT_EQ(g.fake.calls, 12);  // the gradients, the norm's sums, beta and the weights of 3 steps
    EXPECT_EQ(g.external_writes, 12);
  }
}

namespace {

Config sharded(Config c) {
  c.run.shard_optimizer = true;
  return c;
}

std::string file_bytes(const fs::path& f) {
  std::ifstream in(f, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The checkpoint files that must not depend on the sharding: the weights and the optimizer state.
void expect_same_checkpoint(const fs::path& a, const fs::path& b) {
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string x = file_bytes(a / f), y = file_bytes(b / f);
    EXPECT_FALSE(x.empty()) << (a / f);
    EXPECT_TRUE(x == y) << (a / f) << " differs from " << (b / f);
  }
}

}  // namespace

// The ranks' shares: every tensor has one owner, each rank's tensors lie in its range of the
// weights arena, the ranges tile it, and the state (Adam moments, Muon momentum, radii) splits
// about evenly: each rank holds about half, both together what one unsharded optimizer holds.
TEST(DataParallel, ShardedOptimizerSplitsTheStateOverTheRanks) {
  for (const char* name : {"adamw", "muonh"}) {
    Config c = moe_config();
    c.optim.name = name;
    c.model.vocab_size = 320;
    validate(c);
    auto be = make_cpu_backend(1);
    Transformer m(c.model, c.run.batch_size, *be);
    const OptimizerShards sh = plan_optimizer_shards(c, m, job().rank(), 2);
    ASSERT_EQ(sh.offsets.size(), 3u);
    EXPECT_EQ(sh.offsets[0], 0u);
    EXPECT_LE(sh.offsets[1], sh.offsets[2]);
    EXPECT_EQ(sh.offsets[2], m.weights_floats());
    for (size_t i = 0; i < m.params().size(); ++i) {
      const Param& p = m.params()[i];
      const size_t at = size_t(p.w - m.weights()), r = size_t(sh.owner[i]);
      ASSERT_LT(r, 2u);
      EXPECT_GE(at, sh.offsets[r]) << p.name;
      EXPECT_LE(at + p.numel, sh.offsets[r + 1]) << p.name;
    }
    auto whole = make_optimizer(c, m, *be, 2);
    auto mine = make_optimizer(c, m, *be, 2, &sh);
    const double all = double(held_state_bytes(*whole));
    double held[2] = {double(held_state_bytes(*mine)), 0};
    held[1] = held[0];
    job().allreduce_sum_host(&held[1], 1);
    EXPECT_EQ(held[1], all) << name;  // nothing held twice, nothing lost
    size_t largest = 0;
    for (const StateTensor& s : whole->state()) {
      size_t n = sizeof(float);
      for (int64_t d : s.shape) n *= size_t(d);
      largest = std::max(largest, n);
    }
    // Each rank within one tensor's state of half (a cut falls at a tensor boundary).
    EXPECT_LE(std::abs(held[0] - all / 2), 2.0 * double(largest)) << name;
    EXPECT_LT(held[0], 0.75 * all) << name;
    // More ranks than tensors: the ranges stay ordered and tile the arena, some of them empty.
    const int many = int(m.params().size()) + 3;
    const OptimizerShards wide = plan_optimizer_shards(c, m, 0, many);
    ASSERT_EQ(wide.offsets.size(), size_t(many) + 1);
    EXPECT_EQ(wide.offsets.front(), 0u);
    EXPECT_EQ(wide.offsets.back(), m.weights_floats());
    for (int r = 0; r < many; ++r) EXPECT_LE(wide.offsets[size_t(r)], wide.offsets[size_t(r) + 1]);
    for (size_t i = 0; i < m.params().size(); ++i) {
      const size_t at = size_t(m.params()[i].w - m.weights()), r = size_t(wide.owner[i]);
      EXPECT_GE(at, wide.offsets[r]);
      EXPECT_LE(at + m.params()[i].numel, wide.offsets[r + 1]);
    }
    // The same tensors listed on both ranks, in the same order, data where held.
    std::vector<StateTensor> a = whole->state(), b = mine->state();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].name, b[i].name);
      EXPECT_EQ(b[i].data != nullptr, b[i].owner == job().rank()) << b[i].name;
    }
  }
}

// A sharded optimizer trains bitwise as the unsharded one (every rank updates its tensors with the
// same summed gradient and the same clip, then sends their weights), and its checkpoints are the
// unsharded run's files byte for byte: dense with AdamW, MoE with MuonH (Muon batches, radii).
TEST(DataParallel, ShardedOptimizerIsTheUnshardedRunBitwise) {
  Config muonh = moe_config();
  muonh.optim.name = "muonh";
  muonh.optim.lr = 0.02;
  for (const auto& [name, c] : {std::pair<std::string, Config>{"dense", dense_config()}, {"moe-muonh", muonh}}) {
    TrainSummary plain = run(c, run_dir(name + "-unsharded"), nullptr);
    TrainSummary zero = run(sharded(c), run_dir(name + "-sharded"), nullptr);
    // It did shard: each rank held part of the state.
    EXPECT_LT(zero.optimizer_state_bytes, 0.75 * double(plain.optimizer_state_bytes)) << name;
    EXPECT_GT(zero.optimizer_state_bytes, 0u) << name;
    ASSERT_EQ(zero.losses.size(), plain.losses.size());
    for (size_t i = 0; i < zero.losses.size(); ++i)
      EXPECT_EQ(zero.losses[i].second, plain.losses[i].second) << name << " step " << i + 1;
    EXPECT_EQ(grad_norms(run_dir(name + "-sharded")), grad_norms(run_dir(name + "-unsharded"))) << name;
    EXPECT_LT(zero.losses.back().second, zero.losses.front().second - 0.1) << name;
    ASSERT_EQ(zero.checkpoint_steps, plain.checkpoint_steps);
    if (job().rank() == 0) {
      expect_same_checkpoint(checkpoint_dir(run_dir(name + "-sharded"), 8), checkpoint_dir(run_dir(name + "-unsharded"), 8));
      expect_same_checkpoint(checkpoint_dir(run_dir(name + "-sharded"), 4), checkpoint_dir(run_dir(name + "-unsharded"), 4));
    }
  }
}

// Checkpoints carry the whole state whoever wrote them: a sharded run killed after step 6 resumes
// unsharded, an unsharded one resumes sharded, and one process continues a sharded run's
// checkpoint; each ends where the uninterrupted run ends.
TEST(DataParallel, ShardedCheckpointsResumeEitherWay) {
  Config c = moe_config();
  c.optim.name = "muonh";  // Adam moments, Muon momentum and radii all go through the gather and the load
  c.optim.lr = 0.02;
  TrainSummary whole = run(c, run_dir("zero-whole"), nullptr);
  run(sharded(c), run_dir("zero-then-plain"), nullptr, false, /*stop_after=*/6);
  TrainSummary a = run(c, run_dir("zero-then-plain"), nullptr, /*resume=*/true);
  run(c, run_dir("plain-then-zero"), nullptr, false, /*stop_after=*/6);
  TrainSummary b = run(sharded(c), run_dir("plain-then-zero"), nullptr, /*resume=*/true);
  for (const TrainSummary* t : {&a, &b}) {
    EXPECT_EQ(t->start_step, 4);
    ASSERT_EQ(t->losses.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(t->losses[i].second, whole.losses[4 + i].second) << "step " << 5 + i;
  }
  if (job().rank() == 0) {
    expect_same_checkpoint(a.last_checkpoint, whole.last_checkpoint);
    expect_same_checkpoint(b.last_checkpoint, whole.last_checkpoint);
  }
  // One process, 2 micro-batches per step, from the sharded run's step-4 checkpoint.
  const fs::path mine = own_dir("zero-continued");
  fs::create_directories(mine / "checkpoints");
  fs::copy(checkpoint_dir(run_dir("zero-then-plain"), 4), checkpoint_dir(mine, 4), fs::copy_options::recursive);
  expect_one_process_continues(c, mine, whole, 5e-3);
}

int main(int argc, char** argv) {
  ensure_openblas_kernels(argv);
  testing::InitGoogleTest(&argc, argv);
  if (launcher_world_size() < 2) {
    // CTest starts it under mpiexec and sets LADDER_DIST_REQUIRE_RANKS: a launcher that was not
    // recognized there is a failure, not a skip.
    const bool required = std::getenv("LADDER_DIST_REQUIRE_RANKS") != nullptr;
    std::printf("DataParallel tests %s: start them as 2 ranks (mpiexec -np 2 %s)\n",
                required ? "FAILED: no launcher's environment found" : "skipped", argv[0]);
    return required ? 1 : 0;
  }
  const int rc = RUN_ALL_TESTS();
  double failed = rc != 0 ? 1 : 0;
  job().allreduce_max_host(&failed, 1);  // every rank exits with the job's verdict
  if (job().rank() == 0 && !std::getenv("LADDER_KEEP_TEST_DIRS")) {
    std::error_code ec;
    fs::remove_all(shared_dir(), ec);
  }
  return failed > 0 ? 1 : 0;
}
