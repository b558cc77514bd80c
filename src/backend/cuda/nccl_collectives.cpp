// NCCL for the data-parallel sums of the CUDA backend (Backend::collectives, docs/data-parallel.md).
//
// libnccl is loaded at run time (LADDER_NCCL_LIB, else libnccl.so.2), like cuDNN: the binaries
// start where it is absent, and a job whose ranks cannot all use it sums through host memory over
// MPI instead. nccl.h gives the types and constants only.
#include "backend/cuda/nccl_collectives.h"

#include <dlfcn.h>
#include <nccl.h>

#include <cstring>
#include <exception>
#include <type_traits>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/runtime_library.h"
#include "core/error.h"

namespace ladder::cuda {
namespace {

struct NcclApi {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclReduce) reduce = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  std::string error;  // why it could not be loaded ("" when loaded)
  int version = 0;
};

NcclApi load_nccl() {
  NcclApi api;
  const RuntimeLibrary lib = open_runtime_library("LADDER_NCCL_LIB", "libnccl.so.2");
  api.error = lib.error;
  if (!lib.handle) return api;
  void* h = lib.handle;
  const std::string& name = lib.name;
  auto sym = [&](auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, symbol));
    if (!fn && api.error.empty()) api.error = fmt::format("{} has no {}", name, symbol);
  };
  sym(api.get_version, "ncclGetVersion");
  sym(api.get_unique_id, "ncclGetUniqueId");
  sym(api.comm_init_rank, "ncclCommInitRank");
  sym(api.comm_destroy, "ncclCommDestroy");
  sym(api.comm_abort, "ncclCommAbort");
  sym(api.all_reduce, "ncclAllReduce");
  sym(api.broadcast, "ncclBroadcast");
  sym(api.reduce, "ncclReduce");
  sym(api.group_start, "ncclGroupStart");
  sym(api.group_end, "ncclGroupEnd");
  sym(api.error_string, "ncclGetErrorString");
  if (api.error.empty() && api.get_version(&api.version) != ncclSuccess) api.error = name + ": ncclGetVersion failed";
  // ncclAvg (the beta mean) came with NCCL 2.10.
  if (api.error.empty() && api.version < 21000)
    api.error = fmt::format("{} is NCCL {}; 2.10 or newer is needed", name, api.version);
  return api;
}

const NcclApi& nccl() {
  static const NcclApi api = load_nccl();
  return api;
}

void check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) fail("NCCL {}: {}", what, nccl().error_string ? nccl().error_string(r) : "?");
}

class NcclCollectives final : public DeviceCollectives {
 public:
  NcclCollectives(int device, cudaStream_t stream) : device_(device), st_(stream) {}
  // Unwinding from an error (the job is about to be aborted): ncclCommAbort, which only this process
  // takes part in and which ends its pending NCCL kernels; ncclCommDestroy may wait for ranks that
  // never come (it is collective within a node in recent NCCL).
  ~NcclCollectives() override {
    if (!comm_) return;
    if (std::uncaught_exceptions() > 0)
      nccl().comm_abort(comm_);
    else
      nccl().comm_destroy(comm_);
  }
  std::string unavailable() override { return nccl().error; }
  std::string device_id() const override {
    cudaDeviceProp prop{};
    LADDER_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    std::string id = "GPU-";
    for (unsigned char c : prop.uuid.bytes) id += fmt::format("{:02x}", c);
    return id;
  }
  std::vector<uint8_t> new_job_id() override {
    ncclUniqueId uid;
    check(nccl().get_unique_id(&uid), "ncclGetUniqueId");
    std::vector<uint8_t> id(sizeof uid.internal);
    std::memcpy(id.data(), uid.internal, id.size());
    return id;
  }
  void join(const std::vector<uint8_t>& id, int rank, int world) override {
    ncclUniqueId uid;
    if (id.size() != sizeof uid.internal) fail("NCCL: a job id of {} bytes, expected {}", id.size(), sizeof uid.internal);
    std::memcpy(uid.internal, id.data(), id.size());
    LADDER_CUDA_CHECK(cudaSetDevice(device_));
    check(nccl().comm_init_rank(&comm_, world, uid, rank), "ncclCommInitRank");
    state_ = State::kInUse;
  }
  void set_not_used() override { state_ = State::kNotUsed; }
  State state() const override { return state_; }
  std::string describe() const override {
    const int v = nccl().version;
    return fmt::format("NCCL {}.{}.{}", v / 10000, v / 100 % 100, v % 100);
  }
  void allreduce_sum(float* p, size_t n) override {
    check(nccl().all_reduce(p, p, n, ncclFloat32, ncclSum, comm_, st_), "ncclAllReduce (sum)");
  }
  void allreduce_sum(double* p, size_t n) override {
    check(nccl().all_reduce(p, p, n, ncclFloat64, ncclSum, comm_, st_), "ncclAllReduce (sum, double)");
  }
  void allreduce_mean(double* p, size_t n) override {
    check(nccl().all_reduce(p, p, n, ncclFloat64, ncclAvg, comm_, st_), "ncclAllReduce (mean)");
  }
  // One in-place broadcast per rank's range, grouped so that NCCL runs them as one operation (the
  // ranges differ in length, which ncclAllGather does not allow).
  void allgather_ranges(float* p, const std::vector<size_t>& offsets) override {
    per_range(p, offsets, "ncclBroadcast", [&](float* at, size_t n, int root) {
      return nccl().broadcast(at, at, n, ncclFloat32, root, comm_, st_);
    });
  }
  // One in-place reduce to each range's rank, grouped likewise (ncclReduceScatter wants equal counts).
  void reduce_scatter_ranges(float* p, const std::vector<size_t>& offsets) override {
    per_range(p, offsets, "ncclReduce", [&](float* at, size_t n, int root) {
      return nccl().reduce(at, at, n, ncclFloat32, ncclSum, root, comm_, st_);
    });
  }

 private:
  // op(p + offsets[r], its length, r) for every rank's non-empty range, inside one NCCL group.
  template <class Op>
  void per_range(float* p, const std::vector<size_t>& offsets, const char* what, Op op) {
    check(nccl().group_start(), "ncclGroupStart");
    for (size_t r = 0; r + 1 < offsets.size(); ++r) {
      const size_t n = offsets[r + 1] - offsets[r];
      if (n == 0) continue;
      const ncclResult_t e = op(p + offsets[r], n, int(r));
      if (e != ncclSuccess) {
        nccl().group_end();
        check(e, what);
      }
    }
    check(nccl().group_end(), "ncclGroupEnd");
  }

  int device_;
  cudaStream_t st_;
  ncclComm_t comm_ = nullptr;
  State state_ = State::kUndecided;
};

}  // namespace

std::unique_ptr<DeviceCollectives> make_nccl_collectives(int device, cudaStream_t stream) {
  return std::make_unique<NcclCollectives>(device, stream);
}

}  // namespace ladder::cuda
