#include "dist/comm.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"

#ifdef LADDER_HAVE_MPI
#define OMPI_SKIP_MPICXX 1  // the C API only (the deprecated C++ bindings need their own library)
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace ladder {
namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return (end && *end == 0 && x >= 0 && x < (1L << 30)) ? int(x) : fallback;
}

class SingleComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int world() const override { return 1; }
  std::string describe() const override { return "single process"; }
  void allreduce_sum(Backend&, float*, size_t) override {}
  void allreduce_mean(Backend&, double*, size_t) override {}
  void allgather_ranges(Backend&, float*, const std::vector<size_t>&) override {}
  void allreduce_sum(Backend&, double*, size_t) override {}
  void reduce_scatter_ranges(Backend&, float*, const std::vector<size_t>&) override {}
  void send_host(const void*, size_t, int) override { fail("send_host: a single process has no other rank"); }
  void recv_host(void*, size_t, int) override { fail("recv_host: a single process has no other rank"); }
  void allreduce_sum_host(double*, size_t) override {}
  void allreduce_max_host(double*, size_t) override {}
  void broadcast_host(void*, size_t, int) override {}
  void barrier() override {}
  [[noreturn]] void abort(int code) override { std::exit(code); }
};

#ifdef LADDER_HAVE_MPI
// MPI counts are ints, and several MPI implementations have overflowed inside a collective on
// messages of 2^31 bytes or more (count x extent in an int), so buffers go in pieces of 256 MiB:
// kChunk<T> elements of T. A piece's latency is microseconds against its tens of milliseconds.
constexpr size_t kChunkBytes = size_t(1) << 28;
template <class T>
constexpr size_t kChunk = kChunkBytes / sizeof(T);

class MpiComm final : public Comm {
 public:
  MpiComm() {
    int ready = 0;
    MPI_Initialized(&ready);
    if (!ready) {
      int provided = 0;
      // FUNNELED: only the thread that called MPI_Init calls MPI (OpenMP threads never do).
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      owns_ = true;
      if (provided < MPI_THREAD_FUNNELED) {  // an MPI built without thread support: one line, not UB
        std::fprintf(stderr, "error: this MPI library gives thread level %d, below MPI_THREAD_FUNNELED "
                             "(%d) that ladder needs (its OpenMP threads run beside MPI calls)\n",
                     provided, MPI_THREAD_FUNNELED);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &world_);
  }
  ~MpiComm() override {
    int done = 0;
    MPI_Finalized(&done);
    if (owns_ && !done) MPI_Finalize();
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  std::string describe() const override {
    char lib[MPI_MAX_LIBRARY_VERSION_STRING] = {};
    int len = 0;
    MPI_Get_library_version(lib, &len);
    std::string v(lib, size_t(std::max(0, len)));
    v = v.substr(0, v.find_first_of(",\n"));
    return fmt::format("MPI: {} ranks ({})", world_, v);
  }

  void allreduce_sum(Backend& be, float* p, size_t n) override {
    sum_in(be, p, n, MPI_FLOAT, false, [&](DeviceCollectives& dc) { dc.allreduce_sum(p, n); });
  }
  void allreduce_sum(Backend& be, double* p, size_t n) override {
    sum_in(be, p, n, MPI_DOUBLE, false, [&](DeviceCollectives& dc) { dc.allreduce_sum(p, n); });
  }
  void allreduce_mean(Backend& be, double* p, size_t n) override {
    sum_in(be, p, n, MPI_DOUBLE, true, [&](DeviceCollectives& dc) { dc.allreduce_mean(p, n); });
  }
  // One broadcast per rank's range (MPI_Bcast takes counts up to 2^31 - 1, in pieces; an
  // MPI_Allgatherv would need every count and displacement to fit an int).
  void allgather_ranges(Backend& be, float* p, const std::vector<size_t>& offsets) override {
    LADDER_ASSERT(offsets.size() == size_t(world_) + 1);
    if (DeviceCollectives* dc = device_collectives(be)) {
      dc->allgather_ranges(p, offsets);
      // The other ranks' weights were written behind the backend's ops (its own range was not).
      for (int r = 0; r < world_; ++r)
        if (r != rank_ && offsets[size_t(r) + 1] > offsets[size_t(r)])
          be.note_external_write(p + offsets[size_t(r)], (offsets[size_t(r) + 1] - offsets[size_t(r)]) * sizeof(float));
      return;
    }
    const size_t n = offsets.back(), mine = offsets[size_t(rank_)], count = offsets[size_t(rank_) + 1] - mine;
    float* h = p;
    if (!be.is_host()) {  // only this rank's range down, everything back up
      if (host_.size() < n * sizeof(float)) host_.resize(n * sizeof(float));
      h = reinterpret_cast<float*>(host_.data());
      if (count) be.download(h + mine, p + mine, count * sizeof(float));
    }
    for (int r = 0; r < world_; ++r) {
      const size_t a = offsets[size_t(r)], b = offsets[size_t(r) + 1];
      for (size_t i = a; i < b; i += kChunk<float>)
        MPI_Bcast(h + i, int(std::min(kChunk<float>, b - i)), MPI_FLOAT, r, MPI_COMM_WORLD);
    }
    back_from_host(be, p, h, n);
  }
  void send_host(const void* p, size_t bytes, int to) override {
    const auto* c = static_cast<const char*>(p);
    for (size_t i = 0; i < bytes; i += kChunkBytes)
      MPI_Send(c + i, int(std::min(kChunkBytes, bytes - i)), MPI_BYTE, to, 0, MPI_COMM_WORLD);
  }
  void recv_host(void* p, size_t bytes, int from) override {
    auto* c = static_cast<char*>(p);
    for (size_t i = 0; i < bytes; i += kChunkBytes)
      MPI_Recv(c + i, int(std::min(kChunkBytes, bytes - i)), MPI_BYTE, from, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  }
  // One MPI_Reduce per rank's range, to that rank, in place there (an MPI_Reduce_scatter would
  // need every count to fit an int and leaves its result at the start of the buffer).
  void reduce_scatter_ranges(Backend& be, float* p, const std::vector<size_t>& offsets) override {
    LADDER_ASSERT(offsets.size() == size_t(world_) + 1);
    if (DeviceCollectives* dc = device_collectives(be)) {
      dc->reduce_scatter_ranges(p, offsets);
      return be.note_external_write(p, offsets.back() * sizeof(float));
    }
    const size_t n = offsets.back(), mine = offsets[size_t(rank_)], count = offsets[size_t(rank_) + 1] - mine;
    float* h = on_host(be, p, n);
    for (int r = 0; r < world_; ++r) {
      const size_t a = offsets[size_t(r)], b = offsets[size_t(r) + 1];
      for (size_t i = a; i < b; i += kChunk<float>) {
        const int c = int(std::min(kChunk<float>, b - i));
        if (r == rank_) MPI_Reduce(MPI_IN_PLACE, h + i, c, MPI_FLOAT, MPI_SUM, r, MPI_COMM_WORLD);
        else MPI_Reduce(h + i, nullptr, c, MPI_FLOAT, MPI_SUM, r, MPI_COMM_WORLD);
      }
    }
    if (h != p && count) be.upload(p + mine, h + mine, count * sizeof(float));  // only this rank's sums changed
  }
  void allreduce_sum_host(double* p, size_t n) override { reduce(p, n, MPI_DOUBLE, MPI_SUM); }
  void allreduce_max_host(double* p, size_t n) override { reduce(p, n, MPI_DOUBLE, MPI_MAX); }
  void broadcast_host(void* p, size_t bytes, int root) override {
    auto* c = static_cast<char*>(p);
    for (size_t i = 0; i < bytes; i += kChunkBytes) MPI_Bcast(c + i, int(std::min(kChunkBytes, bytes - i)), MPI_BYTE, root, MPI_COMM_WORLD);
  }
  void barrier() override { MPI_Barrier(MPI_COMM_WORLD); }
  [[noreturn]] void abort(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::exit(code);  // not reached
  }

 private:
  // The sum (or mean) of n values in `be`'s memory over the ranks, in place: by the device's
  // collectives (`device_op`, then the backend told what they wrote) or through host memory.
  template <class T, class DeviceOp>
  void sum_in(Backend& be, T* p, size_t n, MPI_Datatype type, bool mean, DeviceOp device_op) {
    if (DeviceCollectives* dc = device_collectives(be)) {
      device_op(*dc);
      return be.note_external_write(p, n * sizeof(T));
    }
    T* h = on_host(be, p, n);
    reduce(h, n, type, MPI_SUM);
    if (mean)
      for (size_t i = 0; i < n; ++i) h[i] /= world_;
    back_from_host(be, p, h, n);
  }
  template <class T>
  void reduce(T* p, size_t n, MPI_Datatype type, MPI_Op op) {
    for (size_t i = 0; i < n; i += kChunk<T>)
      MPI_Allreduce(MPI_IN_PLACE, p + i, int(std::min(kChunk<T>, n - i)), type, op, MPI_COMM_WORLD);
  }
  // The device backend's collectives when every rank can use them, else nullptr (host backends:
  // MPI reads their memory where it is). Decided once per
  // backend, by all ranks together (the first device-memory call comes at the same point of the
  // same step on every rank): a rank without them, or two ranks on one device (NCCL needs one per
  // rank), and all of them go through host memory; otherwise rank 0 makes the job id, every rank
  // joins.
  DeviceCollectives* device_collectives(Backend& be) {
    if (be.is_host()) return nullptr;
    DeviceCollectives* dc = be.collectives();
    if (!dc) return nullptr;  // the same backend kind on every rank: all take this path
    if (dc->state() == DeviceCollectives::State::kUndecided) decide(*dc);
    return dc->state() == DeviceCollectives::State::kInUse ? dc : nullptr;
  }
  void decide(DeviceCollectives& dc) {
    const std::string why = dc.unavailable();
    // Every rank's device id, in rank order (fixed-size records: ids are short).
    constexpr size_t kId = 128;
    std::vector<char> ids(size_t(world_) * kId, 0);
    const std::string mine = dc.device_id();
    std::memcpy(ids.data() + size_t(rank_) * kId, mine.data(), std::min(mine.size(), kId - 1));
    MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, ids.data(), int(kId), MPI_CHAR, MPI_COMM_WORLD);
    std::string shared;
    for (int a = 0; a < world_ && shared.empty(); ++a)
      for (int b = a + 1; b < world_ && shared.empty(); ++b)
        if (std::strncmp(ids.data() + size_t(a) * kId, ids.data() + size_t(b) * kId, kId) == 0)
          shared = fmt::format("ranks {} and {} share a device; NCCL needs one per rank", a, b);
    // Which ranks cannot: the first one's reason is reported.
    double cannot = why.empty() ? 0 : 1, first = why.empty() ? world_ : rank_;
    MPI_Allreduce(MPI_IN_PLACE, &cannot, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
    if (cannot > 0 || !shared.empty()) {
      dc.set_not_used();
      if (rank_ == int(first) || (cannot == 0 && rank_ == 0))
        fmt::print(stderr, "note: data parallel: device-memory sums through host memory over MPI ({})\n",
                   cannot > 0 ? fmt::format("rank {}: {}", rank_, why) : shared);
      return;
    }
    std::vector<uint8_t> id;
    if (rank_ == 0) id = dc.new_job_id();
    uint64_t len = id.size();
    broadcast_host(&len, sizeof len, 0);
    id.resize(len);
    broadcast_host(id.data(), len, 0);
    dc.join(id, rank_, world_);
    if (rank_ == 0) fmt::print(stderr, "note: data parallel: device-memory sums by {}\n", dc.describe());
  }

  // The n values at p where MPI can read them: p itself in host memory, else a download into the
  // staging buffer (kept: the same sizes come every step); back_from_host uploads what changed.
  template <class T>
  T* on_host(Backend& be, T* p, size_t n) {
    if (be.is_host()) return p;
    if (host_.size() < n * sizeof(T)) host_.resize(n * sizeof(T));
    T* h = reinterpret_cast<T*>(host_.data());
    be.download(h, p, n * sizeof(T));
    return h;
  }
  template <class T>
  void back_from_host(Backend& be, T* p, const T* h, size_t n) {
    if (h != p) be.upload(p, h, n * sizeof(T));
  }

  int rank_ = 0, world_ = 1;
  bool owns_ = false;
  std::vector<unsigned char> host_;  // the staging buffer of device-memory collectives
};
#endif

std::unique_ptr<Comm>& process_comm_slot() {
  static std::unique_ptr<Comm> comm;
  return comm;
}

}  // namespace

int launcher_world_size() {
  // Open MPI's mpirun, MPICH / Intel MPI's (PMI).
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    const int n = env_int(v, 0);
    if (n > 0) return n;
  }
  // Slurm's srun with PMIx (`srun --mpi=pmix`) names the rank, not the size: the step's task count.
  // (Not SLURM_NTASKS alone: a batch script's single process has it too.)
  if (std::getenv("PMIX_RANK")) {
    const int n = env_int("SLURM_STEP_NUM_TASKS", 0);
    if (n > 0) return n;
  }
  return 1;
}

int launcher_local_rank() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"}) {
    const int r = env_int(v, -1);
    if (r >= 0) return r;
  }
  if (std::getenv("PMIX_RANK") || std::getenv("PMI_RANK")) return std::max(0, env_int("SLURM_LOCALID", 0));
  return 0;
}

std::unique_ptr<Comm> make_single_comm() { return std::make_unique<SingleComm>(); }

Comm& process_comm() {
  auto& slot = process_comm_slot();
  if (slot) return *slot;
  const int world = launcher_world_size();
  if (world <= 1) {
    slot = make_single_comm();
    return *slot;
  }
#ifdef LADDER_HAVE_MPI
  slot = std::make_unique<MpiComm>();
#else
  fail("this process is one of {} ranks started by an MPI launcher, but this build of Ladder has no MPI (install "
       "libopenmpi-dev with scripts/install-deps.sh and rebuild; CMake says 'data parallel: MPI' when it is found)",
       world);
#endif
  return *slot;
}

Comm* process_comm_if_started() { return process_comm_slot().get(); }

}  // namespace ladder
