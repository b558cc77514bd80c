// A host emulation of the part of CUDA that the kernels in src/backend/cuda/*.cu use, so that their
// own source runs unchanged (after tests/cuda/emu/emulate.py rewrites the launch syntax and the
// __shared__ declarations) on a machine without a GPU, against the CPU kernels (docs/cuda.md, "Kernels
// on the CPU").
//
// Model: blocks run one after another. By default the threads of a block are fibers on the launching
// host thread (each its own stack; a barrier wait switches to the next runnable fiber), which is
// 10-20x faster than threads; with EMU_THREADS defined (the asan / tsan builds) every CUDA thread is
// a std::thread (a pool of blockDim threads per launch, reused block after block), run concurrently. __syncthreads and
// __syncwarp are barrier waits; shuffles, mma.sync and ldmatrix go through a per-warp exchange array (warp_all). A thread that leaves
// the kernel drops out of its barriers, and a barrier (or full-mask shuffle) that then completes
// without it fails loudly: that is a divergent __syncthreads / shuffle, undefined on the device.
// Shared memory is heap memory of exactly the size declared (each static __shared__ array its own
// block, the dynamic buffer another), filled with 0xFF bytes (NaN as float or double), so that
// AddressSanitizer catches overflows and reads of unwritten shared memory show up as NaN in results.
// In the thread mode, ThreadSanitizer sees the barriers (a mutex for the arrivals, a futex sleep) and so
// reports shared-memory races between them the way racecheck would. WMMA fragments hold the whole
// 16x16 tile and the collective operations are done by lane 0 of the warp (other lanes' fragments
// are unused); mma.sync and ldmatrix (mma_ptx.cuh) follow the PTX ISA's per-lane layouts; wgmma
// (wgmma_ptx.cuh) is computed by each thread at issue from the shared-memory descriptors, its
// asynchrony checked at wgmma.wait_group (emu::ptx_wgmma); cp.async copies land when waited for.
// What it cannot show: whether the hardware's layouts are the documented ones (CudaMmaPtx and
// CudaWgmma check that on a GPU), the device memory model, timing, warp scheduling, or device numerics of MMA and
// of the SFU intrinsics (__expf maps to std::exp).
#pragma once
#include <algorithm>
#include <atomic>
#include <cassert>
#include <chrono>
#include <cmath>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <linux/futex.h>
// Fibers need the context switch below, written for x86-64; elsewhere the thread mode is used.
#if !defined(EMU_THREADS) && !defined(__x86_64__)
#define EMU_THREADS 1
#endif
#ifndef EMU_THREADS
#include <sys/mman.h>
// emu_fiber_switch(&save_sp, next_sp): pushes the callee-saved registers, stores the stack pointer
// in save_sp, loads next_sp and pops the next fiber's registers (no signal-mask system call, unlike
// swapcontext). Weak, so that every translation unit including this header may define it.
asm(R"(
  .text
  .weak emu_fiber_switch
  .type emu_fiber_switch,@function
emu_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_fiber_switch, .-emu_fiber_switch
)");
extern "C" void emu_fiber_switch(void** save_sp, void* next_sp);
#endif
#include <sys/syscall.h>
#include <unistd.h>

#define LADDER_CUDA_EMULATION 1  // src/backend/cuda/mma_ptx.cuh: emu:: stand-ins instead of inline PTX
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __constant__

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }

// ---- runtime API (the subset the launchers and their callers use) ------------------------------
using cudaStream_t = void*;
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorNotSupported = 801,
};
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice, cudaMemcpyDefault };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97
};
struct cudaFuncAttributes {
  size_t sharedSizeBytes = 0, constSizeBytes = 0, localSizeBytes = 0;
  int maxThreadsPerBlock = 1024, numRegs = 0, ptxVersion = 90, binaryVersion = 90;
};
constexpr size_t kEmuSmemOptin = 232448;  // H100 / H200: 227 KiB of dynamic shared memory per block
constexpr size_t kEmuSmemDefault = 48 * 1024;  // without cudaFuncSetAttribute; also the static limit

namespace emu {
[[noreturn]] inline void die(const char* what) {
  std::fprintf(stderr, "emu_cuda: %s\n", what);
  std::fflush(stderr);
  std::abort();
}
inline cudaError_t g_last_error = cudaSuccess;  // launches happen on one host thread
}  // namespace emu
namespace emu {
// reinterpret_cast to a pointer type, as emulate.py rewrites it in the kernel sources: the pointer
// must be aligned for its pointee type (alignof: 16 for float4, 8 for an 8-byte vector, 4 for
// __nv_bfloat162), or the device would fault on the access it is made for.
template <class P, class Q>
inline P aligned_cast(Q q) {
  P p = reinterpret_cast<P>(q);
  using T = std::remove_cv_t<std::remove_pointer_t<P>>;
  if constexpr (!std::is_void_v<T>)
    if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0)
      die("misaligned pointer cast (reinterpret_cast in a kernel source): the device would fault on its access");
  return p;
}
}  // namespace emu
// The emulator's own checks of what the device requires (alignment, bounds): always on, also in
// the Release build the CTest suites run (-DNDEBUG would compile a plain assert out).
#define EMU_ASSERT(cond, what) \
  do {                          \
    if (!(cond)) ::emu::die(what); \
  } while (0)

inline cudaError_t cudaGetLastError() { return std::exchange(emu::g_last_error, cudaSuccess); }
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
  }
  return "cudaErrorUnknown";
}
inline cudaError_t cudaPeekAtLastError() { return emu::g_last_error; }
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNotSupported: return "operation not supported";
  }
  return "unknown error";
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  switch (a) {
    case cudaDevAttrMultiProcessorCount: *v = 132; break;  // H200
    case cudaDevAttrComputeCapabilityMajor: *v = 9; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = int(kEmuSmemOptin); break;
  }
  return cudaSuccess;
}
// Persistent grids sized from this (grid-stride kernels) are capped by the launch anyway.
template <class F>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, F*, int, size_t) {
  *n = 4;
  return cudaSuccess;
}
// Per kernel, the dynamic shared memory it opted into (cudaFuncAttributeMaxDynamicSharedMemorySize):
// a launch asking for more than 48 KiB without it fails on the device, and here too.
inline std::map<const void*, size_t>& smem_optin() {
  static std::map<const void*, size_t> m;
  return m;
}
template <class F>
cudaError_t cudaFuncSetAttribute(F* f, cudaFuncAttribute attr, int bytes) {
  if (size_t(bytes) > kEmuSmemOptin) return cudaErrorInvalidValue;
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) smem_optin()[reinterpret_cast<const void*>(f)] = size_t(bytes);
  return cudaSuccess;
}
template <class F>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, F*) {
  *a = cudaFuncAttributes{};
  return cudaSuccess;
}
// Device memory is host memory here; the stream is ignored (every launch completes before returning).
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t = nullptr) {
  if (n) std::memset(p, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemset(void* p, int v, size_t n) { return cudaMemsetAsync(p, v, n); }
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t = nullptr) {
  if (n) std::memmove(d, s, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind k) { return cudaMemcpyAsync(d, s, n, k); }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

// ---- the rest of the runtime a whole backend uses (tests/cuda/emu/CMakeLists.txt's
// ladder_emu_backend_tests: cuda_backend.cpp and device_memory.cpp on this header) --------------
// One device, an H200 as far as the backend can ask: sm_90, 132 SMs, 141 GiB. Device memory is
// 256-byte aligned host memory (cudaMalloc's alignment), filled with all-ones bytes (never-written
// device memory reads as NaN), counted so that cudaMemGetInfo reports what is in use and an
// allocation above the free amount fails with cudaErrorMemoryAllocation (no host memory is touched
// for it). Streams are tokens: every launch and copy completes before returning,
// so any stream order is trivially respected (what it cannot see: a missing synchronization).
struct cudaDeviceProp {
  char name[256] = "NVIDIA H200 (host emulation)";
  size_t totalGlobalMem = size_t(141) << 30;
  size_t sharedMemPerBlockOptin = kEmuSmemOptin;
  int major = 9, minor = 0, multiProcessorCount = 132;
};
namespace emu {
struct DeviceHeap {
  std::mutex m;
  std::vector<std::pair<void*, size_t>> live;  // few live allocations: a vector is enough
  size_t used = 0;
};
inline DeviceHeap& device_heap() {
  static DeviceHeap h;
  return h;
}
inline int g_stream_tokens = 0;
}  // namespace emu
inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidValue; }
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
  if (d != 0) return cudaErrorInvalidValue;
  *p = cudaDeviceProp{};
  return cudaSuccess;
}
inline cudaError_t cudaMemGetInfo(size_t* free_b, size_t* total_b) {
  auto& h = emu::device_heap();
  std::lock_guard<std::mutex> l(h.m);
  *total_b = cudaDeviceProp{}.totalGlobalMem;
  *free_b = *total_b - h.used;
  return cudaSuccess;
}
inline cudaError_t cudaMalloc(void** p, size_t bytes) {
  auto& h = emu::device_heap();
  std::lock_guard<std::mutex> l(h.m);
  *p = nullptr;
  if (bytes > cudaDeviceProp{}.totalGlobalMem - h.used) return cudaErrorMemoryAllocation;
  void* q = ::operator new(bytes ? bytes : 1, std::align_val_t{256}, std::nothrow);
  if (!q) return cudaErrorMemoryAllocation;
  // cudaMalloc'd memory holds whatever was there; fresh host pages would be zeros, which would let
  // a kernel that reads scratch it never wrote pass here. So: all-ones bytes (NaN as floats and
  // bf16, -1 as integers), as the tests poison their outputs.
  std::memset(q, 0xFF, bytes);
  h.live.emplace_back(q, bytes);
  h.used += bytes;
  *p = q;
  return cudaSuccess;
}
template <class T>
cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
inline cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  auto& h = emu::device_heap();
  std::lock_guard<std::mutex> l(h.m);
  for (auto& e : h.live)
    if (e.first == p) {
      h.used -= e.second;
      ::operator delete(p, std::align_val_t{256});
      e = h.live.back();
      h.live.pop_back();
      return cudaSuccess;
    }
  return cudaErrorInvalidValue;  // not a pointer cudaMalloc returned (or freed twice)
}
inline cudaError_t cudaMallocHost(void** p, size_t bytes) {
  *p = ::operator new(bytes ? bytes : 1, std::align_val_t{256});
  return cudaSuccess;
}
template <class T>
cudaError_t cudaMallocHost(T** p, size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(p), bytes);
}
inline cudaError_t cudaFreeHost(void* p) {
  ::operator delete(p, std::align_val_t{256});
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* s) {
  *s = &emu::g_stream_tokens;
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
// Events: a host clock reading at record time (every launch has completed by then), so elapsed
// times are the emulation's, meaningful only as "the timing code runs".
struct EmuEvent {
  std::chrono::steady_clock::time_point t;
};
using cudaEvent_t = EmuEvent*;
inline cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = new EmuEvent{};
  return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t = nullptr) {
  e->t = std::chrono::steady_clock::now();
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  *ms = std::chrono::duration<float, std::milli>(b->t - a->t).count();
  return cudaSuccess;
}

// ---- device functions ----------------------------------------------------------------------
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
// Intrinsics map to the accurate host functions: the device's fast versions differ in the last bits.
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
// A product rounded to float that no later addition may fuse into an FMA (the device intrinsic's
// promise): the empty asm makes the rounded value opaque to g++'s contraction.
inline float __fmul_rn(float a, float b) {
  float r = a * b;
  asm("" : "+x"(r));
  return r;
}
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
template <class T>
inline T __ldg(const T* p) { return *p; }
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Atomics on global or shared memory: std::atomic_ref (relaxed, as device atomics are), which
// ThreadSanitizer sees as atomic, so only non-atomic accesses racing with them are reported.
template <class T>
inline T atomicAdd(T* p, T v) {
  static_assert(std::is_arithmetic_v<T>);
  return std::atomic_ref<T>(*p).fetch_add(v, std::memory_order_relaxed);
}

// ---- bf16 ------------------------------------------------------------------------------------
struct __nv_bfloat16 {
  uint16_t bits;
};
struct alignas(4) __nv_bfloat162 {  // 4-byte aligned, as on the device
  __nv_bfloat16 x, y;
};
// Round to nearest even; a NaN gives the device's canonical NaN (0x7FFF), so a poisoned (all-ones)
// input stays NaN instead of wrapping around to zero in the rounding add.
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return {uint16_t(0x7FFF)};
  u += 0x7FFFu + ((u >> 16) & 1u);
  return {uint16_t(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = uint32_t(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }

// ---- blocks, barriers, shared memory ---------------------------------------------------------
namespace emu {

#ifdef EMU_THREADS
// Sleeping on a 32-bit counter with the raw futex system call rather than std::atomic::wait:
// libstdc++'s wait goes through a shared pool whose seq_cst counters ThreadSanitizer would read
// as synchronization between every pair of waiting threads, hiding real races. The raw call is
// invisible to it; the only edges it sees are the counter's release/acquire, the intended ones.
inline void futex_wait(std::atomic<unsigned>& a, unsigned v) {
  static_assert(sizeof(std::atomic<unsigned>) == sizeof(unsigned));
  while (a.load(std::memory_order_acquire) == v)
    syscall(SYS_futex, reinterpret_cast<unsigned*>(&a), FUTEX_WAIT_PRIVATE, v, nullptr, nullptr, 0);
}
inline void futex_wake_all(std::atomic<unsigned>& a) {
  syscall(SYS_futex, reinterpret_cast<unsigned*>(&a), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// A barrier for `n` threads that knows which threads have left the kernel: completing a phase
// without them means a barrier in divergent code, which is reported instead of silently passing.
// Arrivals count under a mutex; waiters sleep on the generation counter (no thundering herd on the
// mutex when hundreds of threads wake).
class Barrier {
 public:
  explicit Barrier(int n) : expected_(n) {}
  void wait(const char* what) {
    std::unique_lock<std::mutex> l(m_);
    const unsigned gen = gen_.load(std::memory_order_relaxed);
    if (++arrived_ == expected_) {
      complete(what);
      l.unlock();
      futex_wake_all(gen_);
      return;
    }
    l.unlock();
    futex_wait(gen_, gen);
  }
  void drop() {  // the calling thread has returned from the kernel
    bool done = false;
    {
      std::lock_guard<std::mutex> l(m_);
      --expected_;
      ++dropped_;
      if (arrived_ > 0 && arrived_ == expected_) done = (complete("barrier"), true);
    }
    if (done) futex_wake_all(gen_);
  }

 private:
  void complete(const char* what) {
    if (dropped_) {
      std::fprintf(stderr, "emu_cuda: %s completed after %d thread(s) of the group had returned\n", what, dropped_);
      die("divergent barrier: every thread of the block (warp) must reach it");
    }
    arrived_ = 0;
    gen_.fetch_add(1, std::memory_order_release);
  }
  std::mutex m_;
  int expected_, arrived_ = 0, dropped_ = 0;
  std::atomic<unsigned> gen_{0};
};
#else
// Fiber mode (the default; EMU_THREADS selects the std::thread mode): the threads of a block are
// fibers on the launching host thread, each with its own stack. A fiber runs until it
// waits at a barrier or returns; the scheduler then resumes the next runnable one (round robin in
// thread order). A barrier wait that is not the last arrival parks the fiber until the barrier's
// generation moves on; the last arrival completes it and runs on.
struct Fiber {
  void* sp = nullptr;  // saved stack pointer while switched out
  const unsigned* wait_gen = nullptr;  // parked at a barrier until *wait_gen != gen
  unsigned gen = 0;
  unsigned parity = 0;  // the fiber's t_warp_parity while it is switched out
  bool done = false;
};
struct FiberSched {
  void* host_sp = nullptr;
  std::vector<Fiber> f;
  unsigned cur = 0;
  void (*body)(void*, unsigned) = nullptr;
  void* body_ctx = nullptr;
};
inline thread_local FiberSched* t_sched = nullptr;

// Switches from the running fiber back to the scheduler until *gen differs from its current value.
inline void fiber_park(const unsigned& gen);

class Barrier {
 public:
  explicit Barrier(int n) : expected_(n) {}
  void wait(const char* what) {
    if (++arrived_ == expected_) {
      complete(what);
      return;
    }
    fiber_park(gen_);
  }
  void drop() {  // the calling thread has returned from the kernel
    --expected_;
    ++dropped_;
    if (arrived_ > 0 && arrived_ == expected_) complete("barrier");
  }

 private:
  void complete(const char* what) {
    if (dropped_) {
      std::fprintf(stderr, "emu_cuda: %s completed after %d thread(s) of the group had returned\n", what, dropped_);
      die("divergent barrier: every thread of the block (warp) must reach it");
    }
    arrived_ = 0;
    ++gen_;
  }
  int expected_, arrived_ = 0, dropped_ = 0;
  unsigned gen_ = 0;
};

#endif  // EMU_THREADS

// cp.async (__pipeline_memcpy_async, cuda_pipeline_primitives.h): a thread's copies are recorded
// and done only when the thread waits for their group (__pipeline_wait_prior), the latest moment the
// device may complete them. So a kernel that reads a stage before waiting for it, or before the
// __syncthreads that makes the other threads' copies visible, reads the stage's old bytes (or the
// 0xFF poison) and its results show it.
struct AsyncCopy {
  void* dst;
  const void* src;
  size_t bytes;
};
struct AsyncCopies {
  std::vector<std::vector<AsyncCopy>> committed;  // oldest group first
  std::vector<AsyncCopy> open;                    // issued since the last __pipeline_commit
};

// wgmma.mma_async (see emu::ptx_wgmma): per thread, the operations of its open and committed groups,
// each with the shared-memory bytes it read at issue, compared again when the group is waited for.
struct WgmmaRead {
  uint32_t off;  // byte offset in the dynamic shared memory
  uint16_t bits;
};
struct WgmmaGroups {
  std::vector<std::vector<WgmmaRead>> committed;  // oldest group first
  std::vector<WgmmaRead> open;                    // issued since the last commit
  bool fenced = false;                            // wgmma.fence since the last wait_group
};

constexpr size_t kWarpAllBytes = 32;  // the largest value a lane publishes to warp_all (mma.sync: 6 words)

struct Block {
  explicit Block(unsigned threads)
      : all(int(threads)), async(threads), wgmma(threads), wide(2 * size_t(threads) * kWarpAllBytes) {
    for (unsigned w = 0; w < threads / 32; ++w) warp.push_back(std::make_unique<Barrier>(32));
  }
  Barrier all;
  std::vector<std::unique_ptr<Barrier>> warp;
  std::vector<AsyncCopies> async;  // per thread: its cp.async copies not yet waited for
  std::vector<WgmmaGroups> wgmma;  // per thread: its wgmma groups not yet waited for
  std::vector<unsigned char> wide;  // [2 buffers][threads][kWarpAllBytes]: warp_all's slots (shuffles, mma, ldmatrix)
  // Static __shared__ arrays, one heap block each, keyed by their declaration's address.
  std::mutex shared_m;
  std::vector<std::pair<const void*, void*>> shared;
  size_t shared_bytes = 0;
  ~Block() {
    for (auto& [k, p] : shared) ::operator delete(p, std::align_val_t{16});
  }
};

inline Block* g_block = nullptr;
inline unsigned char* g_smem = nullptr;  // dynamic shared memory of the running block
inline size_t g_smem_bytes = 0;
inline thread_local unsigned t_warp_parity = 0;
inline thread_local unsigned t_tid = 0;  // linear thread index in the block: x + X * (y + Y * z)
#ifndef EMU_THREADS
inline void fiber_park(const unsigned& gen) {
  FiberSched& s = *t_sched;
  Fiber& me = s.f[s.cur];
  me.wait_gen = &gen;
  me.gen = gen;
  me.parity = t_warp_parity;
  emu_fiber_switch(&me.sp, s.host_sp);  // the scheduler restores this fiber's thread-locals on return
}
#endif

// The static __shared__ array declared at `key` (emulate.py rewrites `__shared__ T name[N]` into
// EMU_SHARED): the first thread of the block to get there allocates it, the others get the same.
inline void* shared_static(const void* key, size_t bytes, size_t align) {
  Block& b = *g_block;
  std::lock_guard<std::mutex> l(b.shared_m);
  for (auto& [k, p] : b.shared)
    if (k == key) return p;
  if (align > 16) die("static __shared__ alignment above 16 bytes is not emulated");
  b.shared_bytes += bytes;
  if (b.shared_bytes > kEmuSmemDefault) die("static __shared__ arrays exceed 48 KiB (ptxas would refuse)");
  void* p = ::operator new(bytes, std::align_val_t{16});
  std::memset(p, 0xFF, bytes);
  b.shared.emplace_back(key, p);
  return p;
}
}  // namespace emu

#define EMU_SHARED_A(T, name, dims, align) \
  static const char emu_key_##name = 0;   \
  T(&name) dims = *static_cast<T(*) dims>(  \
      ::emu::shared_static(&emu_key_##name, sizeof(T dims), std::max<size_t>(alignof(T), align)))
#define EMU_SHARED(T, name, dims) EMU_SHARED_A(T, name, dims, 1)
#define EMU_SHARED_SCALAR(T, name, align) \
  static const char emu_key_##name = 0;  \
  T& name = *static_cast<T*>(::emu::shared_static(&emu_key_##name, sizeof(T), std::max<size_t>(alignof(T), align)))

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 gridDim, blockDim;
constexpr int warpSize = 32;

inline void __syncthreads() { emu::g_block->all.wait("__syncthreads"); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) emu::die("__syncwarp with a partial mask is not emulated");
  emu::g_block->warp[emu::t_tid / 32]->wait("__syncwarp");
}
inline void __threadfence_block() {}
inline void __threadfence() {}

// ---- cp.async (see AsyncCopies) ----------------------------------------------------------------
namespace emu {
inline std::atomic<uint64_t> g_async_copies{0};  // copies issued since the process started (tests)
inline void async_complete(std::vector<AsyncCopy>& group) {
  for (const AsyncCopy& c : group) std::memcpy(c.dst, c.src, c.bytes);
  group.clear();
}
// A thread that returns with copies it never waited for: on the device they may land after the
// block's shared memory has passed to another block.
inline void async_check_drained() {
  AsyncCopies& a = g_block->async[t_tid];
  size_t n = a.open.size();
  for (const auto& g : a.committed) n += g.size();
  if (n) {
    std::fprintf(stderr, "emu_cuda: thread %u returned with %zu cp.async copies never waited for\n", t_tid, n);
    die("cp.async copies outstanding at kernel exit (missing __pipeline_wait_prior)");
  }
}
}  // namespace emu
inline void __pipeline_memcpy_async(void* dst, const void* src, size_t size_and_align, size_t zfill = 0) {
  EMU_ASSERT(size_and_align == 4 || size_and_align == 8 || size_and_align == 16, "cp.async of 4, 8 or 16 bytes");
  EMU_ASSERT(zfill == 0, "cp.async with zero fill is not emulated");
  EMU_ASSERT(reinterpret_cast<uintptr_t>(dst) % size_and_align == 0 &&
                 reinterpret_cast<uintptr_t>(src) % size_and_align == 0,
             "cp.async source and destination aligned to the copy size");
  const auto* d = static_cast<unsigned char*>(dst);
  EMU_ASSERT(emu::g_smem && d >= emu::g_smem && d + size_and_align <= emu::g_smem + emu::g_smem_bytes,
             "cp.async into the block's dynamic shared memory");
  emu::g_block->async[emu::t_tid].open.push_back({dst, src, size_and_align});
  emu::g_async_copies.fetch_add(1, std::memory_order_relaxed);
}
inline void __pipeline_commit() {
  emu::AsyncCopies& a = emu::g_block->async[emu::t_tid];
  a.committed.push_back(std::move(a.open));
  a.open.clear();
}
// Completes every committed group but the newest `prior` (copies issued after the last commit are
// in no group and stay pending, as on the device).
inline void __pipeline_wait_prior(size_t prior) {
  emu::AsyncCopies& a = emu::g_block->async[emu::t_tid];
  while (a.committed.size() > prior) {
    emu::async_complete(a.committed.front());
    a.committed.erase(a.committed.begin());
  }
}

namespace emu {
// Every lane of the warp publishes v, waits at the warp barrier, and gets the 32 values: the one
// mechanism of the warp-collective operations (shuffles; mma.sync and ldmatrix below). Two slot
// buffers used alternately: a lane can only overwrite a slot of buffer p two collectives later,
// after the next one's barrier, which every reader of this one has reached. So one barrier per
// collective suffices.
template <class T>
void warp_all(const T& v, T (&all)[32], const char* what) {
  static_assert(sizeof(T) <= kWarpAllBytes && std::is_trivially_copyable_v<T>, "warp_all value too large");
  const unsigned lane = t_tid % 32, base = t_tid - lane;
  unsigned char* buf = g_block->wide.data() + size_t(t_warp_parity) * g_block->wide.size() / 2;
  t_warp_parity ^= 1u;
  std::memcpy(buf + size_t(base + lane) * kWarpAllBytes, &v, sizeof(T));
  g_block->warp[t_tid / 32]->wait(what);
  for (unsigned l = 0; l < 32; ++l) std::memcpy(&all[l], buf + size_t(base + l) * kWarpAllBytes, sizeof(T));
}

// A full-mask shuffle: lane src(lane)'s value.
template <class T, class Src>
T shfl(unsigned mask, T v, Src src) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a type above 8 bytes");
  if (mask != 0xffffffffu) die("shuffle with a partial mask is not emulated");
  T all[32];
  warp_all(v, all, "full-mask shuffle");
  return all[src(t_tid % 32)];
}
}  // namespace emu

template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return emu::shfl(mask, v, [&](unsigned l) {
    const unsigned s = l ^ unsigned(lane_mask);
    return (s / unsigned(width)) == (l / unsigned(width)) ? s : l;  // outside the segment: own value
  });
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return emu::shfl(mask, v, [&](unsigned l) { return (l % unsigned(width)) + delta < unsigned(width) ? l + delta : l; });
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return emu::shfl(mask, v, [&](unsigned l) { return (l % unsigned(width)) >= delta ? l - delta : l; });
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  return emu::shfl(mask, v, [&](unsigned l) { return l - l % unsigned(width) + unsigned(src_lane) % unsigned(width); });
}

// ---- mma.sync / ldmatrix (src/backend/cuda/mma_ptx.cuh) ------------------------------------------
// The PTX warp-level matrix instructions, by the fragment layouts of the PTX ISA ("Matrix Fragments
// for mma.m16n8k16 with floating point type", "ldmatrix"). Lane l: group g = l / 4, thread in group
// t = l % 4. A (16 x 16 bf16, row): a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..),
// a[3] = (g+8, 2t+8..); B (16 x 8 bf16, col): b[0] = (k 2t..2t+1, n g), b[1] = (k 2t+8.., n g);
// C, D (16 x 8 fp32): c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..). Two bf16 in a 32-bit word:
// the lower column (k) in the low half. ldmatrix .x4: lanes 8j..8j+7 give the row addresses
// (16-byte aligned, shared memory) of 8x8 matrix j, and register j gets (row g, columns 2t, 2t+1)
// of matrix j, or with .trans (rows 2t, 2t+1, column g). The products are summed in fp32 in k order
// onto c (the device's adder order is unknown; tests bound it, never compare bits with the device).
namespace emu {
inline float bf16_lo(uint32_t w) { return __bfloat162float(__nv_bfloat16{uint16_t(w & 0xFFFFu)}); }
inline float bf16_hi(uint32_t w) { return __bfloat162float(__nv_bfloat16{uint16_t(w >> 16)}); }

inline void ptx_mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  struct Frag {
    uint32_t a[4], b[2];
  } mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}}, all[32];
  warp_all(mine, all, "warp-collective mma.sync");
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    const Frag& f = all[l];
    const int ar[4] = {g, g + 8, g, g + 8}, ac[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
    for (int i = 0; i < 4; ++i) {
      A[ar[i]][ac[i]] = bf16_lo(f.a[i]);
      A[ar[i]][ac[i] + 1] = bf16_hi(f.a[i]);
    }
    for (int i = 0; i < 2; ++i) {
      B[2 * t + 8 * i][g] = bf16_lo(f.b[i]);
      B[2 * t + 8 * i + 1][g] = bf16_hi(f.b[i]);
    }
  }
  const int g = int(t_tid % 32) / 4, t = int(t_tid % 32) % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = i < 2 ? g : g + 8, col = 2 * t + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
    d[i] = acc;
  }
}

// ldmatrix .x1/.x2/.x4 (`n` matrices), `trans`: the lanes' row addresses as described above.
inline void ptx_ldmatrix(uint32_t* r, int n, bool trans, const void* row) {
  EMU_ASSERT(reinterpret_cast<uintptr_t>(row) % 16 == 0, "ldmatrix row address 16-byte aligned");
  const auto* p = static_cast<const unsigned char*>(row);
  EMU_ASSERT(g_smem && p >= g_smem && p + 16 <= g_smem + g_smem_bytes,
             "ldmatrix row inside the block's dynamic shared memory");
  const void* all[32];
  warp_all(row, all, "warp-collective ldmatrix");
  const int lane = int(t_tid % 32), g = lane / 4, t = lane % 4;
  auto at = [&](int j, int rr, int c) {  // element (rr, c) of matrix j
    uint16_t v;
    std::memcpy(&v, static_cast<const unsigned char*>(all[8 * j + rr]) + 2 * c, 2);
    return uint32_t(v);
  };
  for (int j = 0; j < n; ++j)
    r[j] = trans ? at(j, 2 * t, g) | (at(j, 2 * t + 1, g) << 16) : at(j, g, 2 * t) | (at(j, g, 2 * t + 1) << 16);
}
}  // namespace emu

// ---- wgmma (src/backend/cuda/wgmma_ptx.cuh) ---------------------------------------------------------
// wgmma.mma_async m64nNk16 .f32.bf16.bf16 with both operands in shared memory, from the PTX ISA's
// text as wgmma_ptx.cuh states it (descriptor fields, 128-byte swizzle, K-major and MN-major
// canonical layouts, the m64nN accumulator fragments). Each thread computes its own accumulators
// eagerly at issue (with A and B in shared memory they depend on nothing else), reading each
// operand element where the descriptor says it is: so no warpgroup collective is needed, and a
// kernel whose layout, swizzle or descriptor disagrees with the text gets wrong results here. The
// asynchrony is checked instead of modelled: each thread records the shared bytes its MMAs read,
// and when wgmma.wait_group retires their group compares them with shared memory again; a
// difference means the kernel overwrote an operand while the MMA reading it could still be in
// flight on the device. Also checked: a wgmma.fence since the last wait_group before an MMA (the
// accumulators were touched), the 128-byte swizzle only, base offset 0 with the start address in the
// first row of its 1024-byte pattern, K-major k16 slices inside one 128-byte row, operand bytes
// inside the dynamic shared memory, and no group left unwaited at kernel exit. Not checked:
// fence.proxy.async (a no-op here), and an accumulator read before its wait (the value is final).
// Sums: fp32, in k order onto the accumulator (the device's adder order is unknown).
namespace emu {
inline std::atomic<uint64_t> g_wgmma_ops{0};         // wgmma.mma_async issued (tests: the path ran)
inline std::atomic<uint64_t> g_wgmma_violations{0};  // rule violations counted when !g_wgmma_die
inline bool g_wgmma_die = true;                      // tests of the checks themselves set it false
inline void wgmma_violation(const char* what) {
  if (g_wgmma_die) die(what);
  g_wgmma_violations.fetch_add(1, std::memory_order_relaxed);
}
// The shared-window address of the dynamic shared memory's first byte. The device guarantees it
// only 16-byte alignment (an __align__ on the extern __shared__ array is not honoured at run time:
// NVIDIA/cccl#5122), so the emulation puts it off every 1024-byte boundary (bits 4-9 nonzero): a
// kernel that swizzles offsets from an unaligned base, instead of from the first 1024-byte
// boundary of the window (wg::pattern_aligned), reads the wrong chunks or trips the checks below.
constexpr uint32_t kSharedWindowBase = 0x2D0;
static_assert(kSharedWindowBase % 16 == 0 && kSharedWindowBase % 1024 != 0, "16-aligned, off the 1024 grid");
inline uint32_t shared_address(const void* p) {
  const auto* c = static_cast<const unsigned char*>(p);
  EMU_ASSERT(g_smem && c >= g_smem && c <= g_smem + g_smem_bytes, "shared address of a pointer outside the block's dynamic shared memory");
  return kSharedWindowBase + uint32_t(c - g_smem);
}
// Byte offset (in the dynamic shared memory) of element (mn, k) of a k16 operand slice; the
// descriptor's start address and the swizzle are shared-window addresses (shared_address).
inline uint32_t wgmma_offset(uint64_t desc, bool mn_major, int mn, int k) {
  const uint32_t start = uint32_t(desc & 0x3FFFu) << 4, lbo = uint32_t((desc >> 16) & 0x3FFFu) << 4,
                 sbo = uint32_t((desc >> 32) & 0x3FFFu) << 4;
  EMU_ASSERT((desc >> 62) == 1, "wgmma descriptor: only the 128-byte swizzle (mode 1) is emulated");
  EMU_ASSERT(((desc >> 49) & 7u) == 0, "wgmma descriptor: only base offset 0 is emulated");
  EMU_ASSERT(((start >> 7) & 7u) == 0,
             "wgmma descriptor: with the 128-byte swizzle and base offset 0 the start address must lie in the "
             "first row of a 1024-byte-aligned pattern");
  uint32_t logical;
  if (mn_major) {
    EMU_ASSERT(start % 128 == 0, "wgmma MN-major operand: the start address must be a row start");
    logical = start + uint32_t(mn / 64) * lbo + uint32_t(k / 8) * sbo + uint32_t(k % 8) * 128 + uint32_t(mn % 64) * 2;
  } else {
    EMU_ASSERT(start % 128 + 32 <= 128, "wgmma K-major operand: a k16 slice must lie inside one 128-byte row");
    logical = start + uint32_t(mn / 8) * sbo + uint32_t(mn % 8) * 128 + uint32_t(k) * 2;
  }
  const uint32_t phys = logical ^ (((logical >> 7) & 7u) << 4);
  EMU_ASSERT(phys >= kSharedWindowBase && size_t(phys - kSharedWindowBase) + 2 <= g_smem_bytes,
             "wgmma operand element outside the block's dynamic shared memory");
  return phys - kSharedWindowBase;
}
inline uint16_t smem_bits(uint32_t off) {
  uint16_t v;
  std::memcpy(&v, g_smem + off, 2);
  return v;
}
inline void ptx_wgmma_fence() { g_block->wgmma[t_tid].fenced = true; }
inline void ptx_wgmma_commit() {
  WgmmaGroups& w = g_block->wgmma[t_tid];
  w.committed.push_back(std::move(w.open));
  w.open.clear();
}
inline void ptx_wgmma_wait(int pending) {
  WgmmaGroups& w = g_block->wgmma[t_tid];
  while (w.committed.size() > size_t(pending)) {
    for (const WgmmaRead& r : w.committed.front())
      if (smem_bits(r.off) != r.bits) {
        std::fprintf(stderr, "emu_cuda: thread %u: shared byte offset %u changed under an in-flight wgmma\n", t_tid,
                     r.off);
        wgmma_violation("a wgmma operand in shared memory was overwritten before wgmma.wait_group retired the MMA");
        break;
      }
    w.committed.erase(w.committed.begin());
  }
  w.fenced = false;
}
// The checks and bookkeeping every wgmma.mma_async form does at issue; returns the thread's groups.
inline WgmmaGroups& wgmma_issue() {
  EMU_ASSERT(size_t(blockDim.x) * blockDim.y * blockDim.z % 128 == 0, "wgmma needs whole warpgroups (128 threads)");
  WgmmaGroups& w = g_block->wgmma[t_tid];
  if (!w.fenced) wgmma_violation("wgmma.mma_async without a wgmma.fence since the last wgmma.wait_group");
  g_wgmma_ops.fetch_add(1, std::memory_order_relaxed);
  return w;
}
// d (this thread's fragment: columns 8 j + 2 t + c of rows g (h = 0) and g + 8 (h = 1)) += a * B,
// a the thread's two rows of A (16 k each), B (16 x n) read by descriptor db (tb: MN-major), each
// read recorded in w.open for the in-flight overwrite check at wait_group. Shared by the
// shared-memory-A form below and the register-A form (emu_wgmma_rs.h).
inline void wgmma_accumulate(float* d, int n, const float (&a)[2][16], uint64_t db, bool tb, WgmmaGroups& w) {
  const int t = int(t_tid % 4);
  for (int j = 0; j < n / 8; ++j)
    for (int c = 0; c < 2; ++c) {
      const int col = 8 * j + 2 * t + c;
      float b[16];
      for (int k = 0; k < 16; ++k) {
        const uint32_t off = wgmma_offset(db, tb, col, k);
        const uint16_t bits = smem_bits(off);
        w.open.push_back({off, bits});
        b[k] = __bfloat162float(__nv_bfloat16{bits});
      }
      for (int h = 0; h < 2; ++h) {
        float acc = d[4 * j + 2 * h + c];
        for (int k = 0; k < 16; ++k) acc += a[h][k] * b[k];
        d[4 * j + 2 * h + c] = acc;
      }
    }
}
// d (n/2 fp32: this thread's fragment) += A (64 x 16) * B (16 x n); ta / tb: MN-major operand.
inline void ptx_wgmma(float* d, int n, uint64_t da, uint64_t db, bool ta, bool tb) {
  WgmmaGroups& w = wgmma_issue();
  const int wt = int(t_tid % 128), warp = wt / 32, g = (wt % 32) / 4;
  float a[2][16];
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 16; ++k) {
      const uint32_t off = wgmma_offset(da, ta, 16 * warp + g + 8 * h, k);
      const uint16_t bits = smem_bits(off);
      w.open.push_back({off, bits});
      a[h][k] = __bfloat162float(__nv_bfloat16{bits});
    }
  wgmma_accumulate(d, n, a, db, tb, w);
}
inline void wgmma_check_drained() {
  WgmmaGroups& w = g_block->wgmma[t_tid];
  if (!w.open.empty() || !w.committed.empty()) {
    std::fprintf(stderr, "emu_cuda: thread %u returned with wgmma groups never waited for\n", t_tid);
    die("wgmma operations outstanding at kernel exit (missing wgmma.commit_group / wgmma.wait_group)");
  }
}
}  // namespace emu
#include "emu_wgmma_rs.h"  // wgmma with A from registers (the attention kernels)

// ---- launches ----------------------------------------------------------------------------------
namespace emu {

// Grid-stride kernels (emulate.py's list) run with at most this many blocks in x: their result does
// not depend on the grid, and 3 blocks (odd) still send some threads around the stride loop.
constexpr unsigned kGridStrideCap = 3;

inline bool bad_config(dim3 g, dim3 b, size_t smem) {
  const size_t threads = size_t(b.x) * b.y * b.z;
  return g.x == 0 || g.y == 0 || g.z == 0 || g.y > 65535 || g.z > 65535 || threads == 0 || threads > 1024 ||
         b.z > 64 || smem > kEmuSmemOptin;
}

// How long one block may run before the emulation calls it a deadlock (EMU_BLOCK_TIMEOUT seconds).
inline int block_timeout_s() {
  static const int s = [] {
    const char* e = std::getenv("EMU_BLOCK_TIMEOUT");
    return e ? std::atoi(e) : 120;
  }();
  return s;
}

#ifndef EMU_THREADS
constexpr size_t kFiberStack = 256 * 1024, kFiberGuard = 4096;
// A fiber's first frame: runs the kernel for thread t_sched->cur, then marks it done and returns to
// the scheduler for good (the context is made afresh for the next block).
inline void fiber_entry() {
  FiberSched& s = *t_sched;
  const unsigned t = s.cur;
  s.body(s.body_ctx, t);
  s.f[t].done = true;
  emu_fiber_switch(&s.f[t].sp, s.host_sp);
  die("a finished fiber was resumed");
}
#endif

// Runs the grid one block at a time: on one host thread as fibers (default), or with EMU_THREADS on a
// pool of blockDim threads. Launch errors set the error
// cudaGetLastError returns, as on the device; the kernel then does not run.
template <class... P, class... A>
void launch(bool grid_stride, dim3 grid, dim3 block, size_t smem, void (*kernel)(P...), A... args) {
  if (bad_config(grid, block, smem)) {
    g_last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (smem > kEmuSmemDefault) {  // above 48 KiB only after cudaFuncSetAttribute for this kernel
    auto it = smem_optin().find(reinterpret_cast<const void*>(kernel));
    if (it == smem_optin().end() || smem > it->second) {
      g_last_error = cudaErrorInvalidValue;
      return;
    }
  }
  // Warps are 32 consecutive linear thread indices, as on the device.
  if ((size_t(block.x) * block.y * block.z) % 32) die("only blocks of whole warps are emulated");
  if (grid_stride && grid.x > kGridStrideCap) grid.x = kGridStrideCap;
  gridDim = grid;
  blockDim = block;
  const unsigned n = block.x * block.y * block.z;
  const size_t blocks = size_t(grid.x) * grid.y * grid.z;
  if (blocks >= UINT_MAX) die("grids of 2^32 blocks or more are not emulated");
#ifdef EMU_THREADS
  std::unique_ptr<Block> cur;
  dim3 cur_idx;
  // The host starts a block by bumping `started`; the last thread to return wakes the host.
  std::atomic<unsigned> started{0};
  std::atomic<unsigned> finished{0};
  std::mutex host_m;
  std::condition_variable host_cv;
  bool host_done = false;
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < n; ++t)
    pool.emplace_back([&, t] {
      threadIdx = dim3(t % block.x, t / block.x % block.y, t / (block.x * block.y));
      t_tid = t;
      for (unsigned i = 1; i <= blocks; ++i) {
        futex_wait(started, i - 1);
        blockIdx = cur_idx;
        t_warp_parity = 0;
        kernel(args...);  // each thread its own copies of the parameters
        async_check_drained();
        wgmma_check_drained();
        cur->all.drop();
        cur->warp[t / 32]->drop();
        if (finished.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
          std::lock_guard<std::mutex> l(host_m);
          host_done = true;
          host_cv.notify_one();
        }
      }
    });
  unsigned i = 0;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        cur = std::make_unique<Block>(n);
        g_block = cur.get();
        cur_idx = dim3(bx, by, bz);
        // Exactly the requested bytes (ASan sees an overflow), 128-byte aligned like the device's
        // dynamic shared memory, filled with NaN bytes: a read nobody wrote shows in the results.
        unsigned char* heap = smem ? static_cast<unsigned char*>(::operator new(smem, std::align_val_t{128})) : nullptr;
        if (smem) std::memset(heap, 0xFF, smem);
        g_smem = heap;
        g_smem_bytes = smem;
        finished.store(0, std::memory_order_relaxed);
        host_done = false;
        started.store(++i, std::memory_order_release);
        futex_wake_all(started);
        {
          std::unique_lock<std::mutex> l(host_m);
          if (!host_cv.wait_for(l, std::chrono::seconds(block_timeout_s()), [&] { return host_done; }))
            die("a block ran too long: deadlock at a __syncthreads or shuffle some threads never reach?");
        }
        if (heap) ::operator delete(heap, std::align_val_t{128});
        g_smem = nullptr;
        g_smem_bytes = 0;
        g_block = nullptr;
        cur.reset();
      }
  for (auto& th : pool) th.join();
}
#else
  // One stack per fiber, kept for later launches (mapped lazily: only touched pages cost memory),
  // with an inaccessible guard page below it so that an overflow faults instead of corrupting.
  static thread_local std::vector<void*> stacks;
  while (stacks.size() < n) {
    void* p = mmap(nullptr, kFiberStack + kFiberGuard, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (p == MAP_FAILED) die("mmap of a fiber stack failed");
    mprotect(p, kFiberGuard, PROT_NONE);
    stacks.push_back(p);
  }
  FiberSched sched;
  sched.f.resize(n);
  std::vector<dim3> tidx(n);
  for (unsigned t = 0; t < n; ++t) {
    tidx[t] = dim3(t % block.x, t / block.x % block.y, t / (block.x * block.y));
  }
  auto run_thread = [&](unsigned t) {
    kernel(args...);  // each thread its own copies of the parameters
    async_check_drained();
    wgmma_check_drained();
    g_block->all.drop();
    g_block->warp[t / 32]->drop();
  };
  sched.body = [](void* c, unsigned t) { (*static_cast<decltype(run_thread)*>(c))(t); };
  sched.body_ctx = &run_thread;
  FiberSched* const saved = std::exchange(t_sched, &sched);
  const dim3 host_tidx = threadIdx, host_bidx = blockIdx;
  const unsigned host_tid = t_tid, host_parity = t_warp_parity;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        auto cur = std::make_unique<Block>(n);
        g_block = cur.get();
        // Exactly the requested bytes (ASan sees an overflow), 128-byte aligned like the device's
        // dynamic shared memory, filled with NaN bytes: a read nobody wrote shows in the results.
        unsigned char* heap = smem ? static_cast<unsigned char*>(::operator new(smem, std::align_val_t{128})) : nullptr;
        if (smem) std::memset(heap, 0xFF, smem);
        g_smem = heap;
        g_smem_bytes = smem;
        for (unsigned t = 0; t < n; ++t) {
          Fiber& f = sched.f[t];
          // A fresh stack whose first switch pops six zero registers and returns into fiber_entry
          // (with a zero return address above it, and the stack aligned as after a call).
          void** top = reinterpret_cast<void**>(static_cast<char*>(stacks[t]) + kFiberGuard + kFiberStack);
          top[-1] = nullptr;
          top[-2] = reinterpret_cast<void*>(&fiber_entry);
          for (int r = 3; r <= 8; ++r) top[-r] = nullptr;
          f.sp = top - 8;
          f.wait_gen = nullptr;
          f.parity = 0;
          f.done = false;
        }
        blockIdx = dim3(bx, by, bz);
        const auto t0 = std::chrono::steady_clock::now();
        for (unsigned live = n; live;) {
          bool ran = false;
          for (unsigned t = 0; t < n; ++t) {
            Fiber& f = sched.f[t];
            if (f.done || (f.wait_gen && *f.wait_gen == f.gen)) continue;
            f.wait_gen = nullptr;
            sched.cur = t;
            threadIdx = tidx[t];
            t_tid = t;
            t_warp_parity = f.parity;
            emu_fiber_switch(&sched.host_sp, f.sp);
            if (f.done) --live;
            ran = true;
          }
          if (!ran)
            die("deadlock: every live thread of the block waits at a __syncthreads or shuffle some threads never reach");
          if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(block_timeout_s()))
            die("a block ran too long: deadlock at a __syncthreads or shuffle some threads never reach?");
        }
        if (heap) ::operator delete(heap, std::align_val_t{128});
        g_smem = nullptr;
        g_smem_bytes = 0;
        g_block = nullptr;
      }
  t_sched = saved;
  threadIdx = host_tidx;
  blockIdx = host_bidx;
  t_tid = host_tid;
  t_warp_parity = host_parity;
}
#endif  // EMU_THREADS
}  // namespace emu
// `kernel<<<grid, block, smem, stream>>>(args)` as emulate.py rewrites it.
#define EMU_LAUNCH(grid, block, smem, stream, kernel, ...) \
  ::emu::launch(false, grid, block, smem, kernel __VA_OPT__(, ) __VA_ARGS__)
#define EMU_LAUNCH_GRID_STRIDE(grid, block, smem, stream, kernel, ...) \
  ::emu::launch(true, grid, block, smem, kernel __VA_OPT__(, ) __VA_ARGS__)

// ---- WMMA --------------------------------------------------------------------------------------
namespace nvcuda::wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  float x[16][16];  // the logical matrix (lane 0's copy is the one used)
};

inline bool lane0() { return emu::t_tid % 32 == 0; }
// Shared-memory pointers must lie in the block's dynamic buffer with the whole 16-row span inside.
inline void check_ptr(const void* p, unsigned ldm, size_t elem) {
  EMU_ASSERT(reinterpret_cast<uintptr_t>(p) % 32 == 0, "WMMA pointers must be 256-bit aligned");
  EMU_ASSERT((ldm * elem) % 16 == 0, "WMMA ldm: a multiple of 8 for 16-bit types, of 4 for float");
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (c >= emu::g_smem && c < emu::g_smem + emu::g_smem_bytes) {
    [[maybe_unused]] const size_t last = (size_t(15) * ldm + 15) * elem + elem;
    EMU_ASSERT(c + last <= emu::g_smem + emu::g_smem_bytes, "WMMA tile overruns shared memory");
  }
}

template <class Use, class L>
void load_matrix_sync(fragment<Use, 16, 16, 16, __nv_bfloat16, L>& f, const __nv_bfloat16* p, unsigned ldm) {
  check_ptr(p, ldm, 2);
  if (lane0()) {
    constexpr bool col = std::is_same_v<L, col_major>;
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < 16; ++c) f.x[r][c] = __bfloat162float(col ? p[c * ldm + r] : p[r * ldm + c]);
  }
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t l) {
  check_ptr(p, ldm, 4);
  if (lane0())
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < 16; ++c) f.x[r][c] = l == mem_col_major ? p[c * ldm + r] : p[r * ldm + c];
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t l) {
  check_ptr(p, ldm, 4);
  if (lane0())
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < 16; ++c) (l == mem_col_major ? p[c * ldm + r] : p[r * ldm + c]) = f.x[r][c];
}
inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float v) {
  for (auto& row : f.x)
    for (auto& e : row) e = v;
}
template <class LA, class LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA>& a,
              const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  if (lane0()) {
    float t[16][16];
    for (int r = 0; r < 16; ++r)
      for (int n = 0; n < 16; ++n) {
        float s = c.x[r][n];
        for (int k = 0; k < 16; ++k) s += a.x[r][k] * b.x[k][n];
        t[r][n] = s;
      }
    std::memcpy(d.x, t, sizeof t);
  }
}
}  // namespace nvcuda::wmma
