// Device memory for the CUDA backend and, later, the model's device arenas (docs/cuda.md).
//
// Plain cudaMalloc (never managed memory: oversubscribing managed memory can hang the GPU). The
// synchronous copies go through cudaMemcpy on the legacy default stream, which waits for and
// blocks every blocking stream (the backend's stream is one), so a copy after backend ops sees
// their results and ops issued after it see the copy: no explicit synchronization is needed around
// them. The *_async variants run on the given stream and do not wait for the host.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace ladder::cuda {

// Allocates `bytes` of device memory. Out of memory is one ladder::Error line naming `what`, the
// size asked for and the free/total memory of the device.
void* device_alloc(size_t bytes, const char* what);
void device_free(void* p) noexcept;

void copy_h2d(void* dst, const void* src, size_t bytes);
void copy_d2h(void* dst, const void* src, size_t bytes);
void copy_d2d(void* dst, const void* src, size_t bytes);
void device_memset(void* p, int byte_value, size_t bytes);
void copy_h2d_async(void* dst, const void* src, size_t bytes, cudaStream_t s);
void copy_d2h_async(void* dst, const void* src, size_t bytes, cudaStream_t s);
void copy_d2d_async(void* dst, const void* src, size_t bytes, cudaStream_t s);
void device_memset_async(void* p, int byte_value, size_t bytes, cudaStream_t s);
// Waits for all work on the device and turns an asynchronous kernel fault into a ladder::Error.
void device_synchronize();
// A number that changes whenever device memory is allocated, freed, copied into or set through the
// helpers above (DeviceBuffer too), for caches that must not outlive such writes (the bf16 GEMM
// cast cache of cuda_backend.cpp: a buffer freed and reallocated at the same address, or uploaded
// to outside the backend's ops, must not meet an old cast).
uint64_t device_memory_epoch();

// A typed, move-only owner of n elements of device memory.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n, const char* what = "buffer")
      : p_(n ? static_cast<T*>(device_alloc(n * sizeof(T), what)) : nullptr), n_(n) {}
  ~DeviceBuffer() { device_free(p_); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      device_free(p_);
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() const { return p_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }
  // Grows (never shrinks) to at least n elements; the contents are lost when it grows.
  void reserve(size_t n, const char* what = "scratch") {
    if (n > n_) *this = DeviceBuffer(n, what);
  }
  void upload(const T* host, size_t n) { copy_h2d(p_, host, n * sizeof(T)); }
  void upload(const std::vector<T>& host) { upload(host.data(), host.size()); }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    if (n_) copy_d2h(h.data(), p_, bytes());
    return h;
  }
  // Every byte 0xFF: for float this is a NaN, which tests use to catch elements a kernel never writes.
  void poison() { device_memset(p_, 0xFF, bytes()); }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace ladder::cuda
