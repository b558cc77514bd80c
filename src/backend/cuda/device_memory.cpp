#include "backend/cuda/device_memory.h"

#include <atomic>

#include "backend/cuda/cuda_check.h"

namespace ladder::cuda {

namespace {
// Counts the writes to device memory made through these helpers (allocations, frees, copies into
// the device, memsets): what the backend cannot see through its own ops (device_memory_epoch).
std::atomic<uint64_t> g_epoch{0};
void bump() { g_epoch.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

uint64_t device_memory_epoch() { return g_epoch.load(std::memory_order_relaxed); }

void* device_alloc(size_t bytes, const char* what) {
  if (bytes == 0) return nullptr;
  bump();
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clear the sticky-free allocation error before asking for the sizes
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    fail("CUDA out of device memory: {} needs {:.1f} MiB, {:.1f} MiB free of {:.1f} MiB", what,
         bytes / 1048576.0, free_b / 1048576.0, total_b / 1048576.0);
  }
  LADDER_CUDA_CHECK(e);
  return p;
}

void device_free(void* p) noexcept {
  bump();
  if (p) cudaFree(p);  // errors here can only be earlier asynchronous faults; a destructor must not throw
}

void copy_h2d(void* dst, const void* src, size_t bytes) {
  bump();
  if (bytes) LADDER_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
void copy_d2h(void* dst, const void* src, size_t bytes) {
  if (bytes) LADDER_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
void copy_d2d(void* dst, const void* src, size_t bytes) {
  bump();
  if (bytes) LADDER_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice));
}
void device_memset(void* p, int byte_value, size_t bytes) {
  bump();
  if (bytes) LADDER_CUDA_CHECK(cudaMemset(p, byte_value, bytes));
}
void copy_h2d_async(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  bump();
  if (bytes) LADDER_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
}
void copy_d2h_async(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  if (bytes) LADDER_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
}
void copy_d2d_async(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  bump();
  if (bytes) LADDER_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
}
void device_memset_async(void* p, int byte_value, size_t bytes, cudaStream_t s) {
  bump();
  if (bytes) LADDER_CUDA_CHECK(cudaMemsetAsync(p, byte_value, bytes, s));
}
void device_synchronize() { LADDER_CUDA_CHECK(cudaDeviceSynchronize()); }

}  // namespace ladder::cuda
