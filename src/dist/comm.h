// Data parallelism across processes: the ranks of an MPI job (`mpirun -np N ladder train ...`) and
// the few collectives the training step needs (docs/data-parallel.md).
//
// Every rank holds the whole model and optimizer state (or, with run.shard_optimizer, its share of
// the optimizer state, OptimizerShards: the gradients are then reduce-scattered and the updated
// weights broadcast, see reduce_scatter_ranges and allgather_ranges), reads its own share of each
// batch (the DataLoader's rank/world), and the ranks sum their gradients before the clip and the
// update, so every rank applies bitwise the same update and the replicas stay identical (the
// trainer checks that at start and at every checkpoint). The transport is MPI (Open MPI from Debian); nothing
// here is a home-made transport.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace ladder {

class Backend;

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  // "single process" or "MPI: 4 ranks (Open MPI v4.1.4)".
  virtual std::string describe() const = 0;

  // In-place sum over the ranks of n floats that live in `be`'s memory (the gradient arena): on a
  // host backend MPI reads them where they are; on a device backend the device's own collectives
  // (NCCL) when every rank can use them (decided by all ranks together at the first call, said on
  // stderr by rank 0), otherwise through one host buffer kept between calls (no allocation after
  // the first step). Every rank gets the same bits.
  virtual void allreduce_sum(Backend& be, float* p, size_t n) = 0;
  // The mean of n doubles (MoE balancing beta), the same way.
  virtual void allreduce_mean(Backend& be, double* p, size_t n) = 0;
  // The sum of n doubles (a sharded optimizer's per-tensor gradient sums of squares), the same way.
  virtual void allreduce_sum(Backend& be, double* p, size_t n) = 0;
  // In place, rank r gets the sum over the ranks of its floats [offsets[r], offsets[r + 1]) of p;
  // the rest of p is undefined afterwards (a sharded optimizer's gradients: each rank needs its
  // tensors' sums only, half the traffic of allreduce_sum). The same transport as allreduce_sum.
  virtual void reduce_scatter_ranges(Backend& be, float* p, const std::vector<size_t>& offsets) = 0;
  // In place, rank r's floats [offsets[r], offsets[r + 1]) of p (in `be`'s memory) to every rank
  // (offsets: world + 1 values): what a sharded optimizer's ranks updated (OptimizerShards). The
  // device's collectives or host memory, as allreduce_sum decides; every rank gets the owners' bits.
  virtual void allgather_ranges(Backend& be, float* p, const std::vector<size_t>& offsets) = 0;
  // Host values.
  // Host bytes from one rank to another (a sharded optimizer's state gathered for a checkpoint);
  // messages between two ranks arrive in the order they were sent.
  virtual void send_host(const void* p, size_t bytes, int to) = 0;
  virtual void recv_host(void* p, size_t bytes, int from) = 0;
  virtual void allreduce_sum_host(double* p, size_t n) = 0;
  virtual void allreduce_max_host(double* p, size_t n) = 0;
  virtual void broadcast_host(void* p, size_t bytes, int root) = 0;
  virtual void barrier() = 0;
  // Ends every rank of the job (a rank that fails must not leave the others waiting in a collective).
  [[noreturn]] virtual void abort(int code) = 0;
};

// The job this process was started in: an MPI job of several ranks when an MPI launcher started it
// (Open MPI's mpirun, MPICH's, or Slurm's srun with PMIx: their environment says so; MPI is
// initialized at the first call), or a single process otherwise. A process launched as one of
// several ranks by a build without MPI fails with one line saying so.
Comm& process_comm();
// process_comm() if it was created (main's error path: abort the job), else nullptr.
Comm* process_comm_if_started();
// A one-process Comm (tests run a single-process reference inside an MPI job with it).
std::unique_ptr<Comm> make_single_comm();
// The number of ranks an MPI launcher gave this process's job (1 when none did), and its rank on
// this node (0 when none): read from the launcher's environment, without initializing MPI.
int launcher_world_size();
int launcher_local_rank();

}  // namespace ladder
