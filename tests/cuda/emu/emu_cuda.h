// A host emulation of the small part of CUDA that attention_tc.cu uses, so that its kernels run
// unchanged on a machine without a GPU (tests/cuda/emu/run.sh). Every CUDA thread is a std::thread;
// __syncthreads and __syncwarp are std::barrier waits; shuffles go through a per-warp exchange
// array; WMMA fragments hold the whole 16x16 tile and the collective operations (load, mma, store)
// are done by lane 0 of the warp only (the other lanes' fragments are unused), with the pointer
// alignment and ldm rules of the CUDA documentation asserted. Shared memory is a heap block of
// exactly the dynamic size asked for, so AddressSanitizer catches overflows of it; ThreadSanitizer
// sees the barriers and so reports shared-memory races the way racecheck would.
// What it cannot show: anything about real fragment layouts, timing, or device-specific numerics
// of the MMA (it accumulates each 16-term dot product in fp32 in index order).
#pragma once
#include <barrier>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr { cudaDevAttrComputeCapabilityMajor = 75, cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
constexpr size_t kEmuSmemOptin = 232448;  // H100 / H200: 227 KiB
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  *v = a == cudaDevAttrComputeCapabilityMajor ? 9 : int(kEmuSmemOptin);
  return cudaSuccess;
}
template <class F>
cudaError_t cudaFuncSetAttribute(F*, cudaFuncAttribute, int bytes) {
  return size_t(bytes) <= kEmuSmemOptin ? cudaSuccess : cudaErrorInvalidValue;
}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

// ---- bf16 ------------------------------------------------------------------------------------
struct __nv_bfloat16 {
  uint16_t bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  assert(std::isfinite(f));
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

// ---- threads -----------------------------------------------------------------------------------
namespace emu {
struct Block {
  std::unique_ptr<std::barrier<>> all;
  std::vector<std::unique_ptr<std::barrier<>>> warp;
  std::vector<float> xchg;  // [warps][32]
};
inline Block* g_block = nullptr;
inline unsigned char* g_smem = nullptr;
inline size_t g_smem_bytes = 0;
}  // namespace emu
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 gridDim, blockDim;

inline void __syncthreads() { emu::g_block->all->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::g_block->warp[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned mask, float v, int o) {
  assert(mask == 0xffffffffu);
  const unsigned w = threadIdx.x / 32, l = threadIdx.x % 32;
  float* x = emu::g_block->xchg.data() + w * 32;
  x[l] = v;
  __syncwarp();
  const float r = x[l ^ unsigned(o)];
  __syncwarp();
  return r;
}

namespace emu {
// Runs grid x block threads, one block at a time. Grid-stride kernels launched with 256 threads
// (the D kernel) run with at most 4 blocks: same result, far fewer threads.
template <class... P, class... A>
void launch(dim3 grid, dim3 block, size_t smem, void (*kernel)(P...), A... args) {
  if (block.x == 256 && grid.y == 1 && grid.z == 1 && grid.x > 4) grid.x = 4;
  assert(block.y == 1 && block.z == 1 && block.x % 32 == 0);
  gridDim = grid;
  blockDim = block;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block b;
        b.all = std::make_unique<std::barrier<>>(block.x);
        for (unsigned w = 0; w < block.x / 32; ++w) b.warp.push_back(std::make_unique<std::barrier<>>(32));
        b.xchg.assign(block.x, 0.f);
        g_block = &b;
        // Exactly the requested bytes (ASan sees an overflow), 128-byte aligned like the device's
        // dynamic shared memory, filled with NaN bytes: a read nobody wrote shows in the results.
        assert(smem % 128 == 0);
        std::unique_ptr<unsigned char, decltype(&std::free)> heap(
            smem ? static_cast<unsigned char*>(std::aligned_alloc(128, smem)) : nullptr, &std::free);
        if (smem) std::memset(heap.get(), 0xFF, smem);
        g_smem = heap.get();
        g_smem_bytes = smem;
        std::vector<std::thread> th;
        for (unsigned t = 0; t < block.x; ++t)
          th.emplace_back([&, t] {
            threadIdx = dim3(t);
            blockIdx = dim3(bx, by, bz);
            kernel(args...);
          });
        for (auto& x : th) x.join();
        g_block = nullptr;
      }
}
}  // namespace emu
#define EMU_LAUNCH(grid, block, smem, stream, kernel, ...) emu::launch(grid, block, smem, kernel, __VA_ARGS__)

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

inline bool lane0() { return threadIdx.x % 32 == 0; }
// Shared-memory pointers must lie in the block's dynamic buffer with the whole 16-row span inside.
inline void check_ptr(const void* p, unsigned ldm, size_t elem) {
  assert(reinterpret_cast<uintptr_t>(p) % 32 == 0 && "WMMA pointers must be 256-bit aligned");
  assert((ldm * elem) % 16 == 0 && "ldm: multiple of 8 for 16-bit types, of 4 for float");
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (c >= emu::g_smem && c < emu::g_smem + emu::g_smem_bytes) {
    const size_t last = (size_t(15) * ldm + 15) * elem + elem;
    assert(c + last <= emu::g_smem + emu::g_smem_bytes && "WMMA tile overruns shared memory");
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
