// The bf16 grouped GEMM on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a only): the contract of
// grouped_gemm_tc.cuh, every call, when selected by grouped_gemm_tc_set_wgmma / LADDER_GROUPED_WGMMA=1
// (off by default: grouped_gemm_tc_ex runs the mma.sync kernels of grouped_gemm_tc.cu otherwise).
// Built only with -gencode arch=compute_90a,code=sm_90a (CMakeLists.txt: its own object library);
// where that code cannot run (another device, or a build without sm_90) grouped_gemm_wgmma_available()
// is false, the launcher says cudaErrorNotSupported and the dispatch never calls it.
//
// Tile product. A block of 256 threads = two warpgroups computes a 128 x 128 fp32 output tile, the
// warpgroup wg owning rows 64 wg .. 64 wg + 63 (one m64n128 accumulator: 64 fp32 registers a
// thread), walking the reduction index t in stages of 64 (one 128-byte swizzled row of bf16), four
// m64n128k16 wgmmas per stage, both operands read from shared memory by descriptor (wgmma_ptx.cuh
// has the layouts). Operands as in grouped_gemm_tc.cu: x the output coordinate, t the reduction
// index; a t-contiguous operand (rows_out: A, and B when transB) is staged K-major ([128 x][64 t]),
// an x-contiguous one (rows_out: B when !transB; rows_out = false: both) MN-major ([64 t][128 x] as
// two blocks of 64 x) and read with the transpose immediate. Each stage operand is 16 KiB, so every
// row of either form is one 16-byte-chunk permutation of the global row segment: cp.async copies of
// 16 bytes land each chunk at its swizzled place; chunks at the operand's edge are written as their
// valid elements and zeros by plain stores (so partial tiles add exact zeros, as in the mma.sync
// kernel). That is the path of a bf16 operand aligned for cp.async (16 bytes, ld and expert stride
// multiples of 8 elements); any other operand (fp32, misaligned bf16) is loaded into registers as
// groups of 4, rounded to bf16 and stored at the same swizzled places (load_regs / store_regs),
// one step ahead of its store so that its loads' latency overlaps a step's MMAs.
// Pipeline: kStages = 6 stages (192 KiB, one block per SM), cp.async kStages - 2 = 4 steps ahead. Step s:
//   wait for this thread's copies of step s; fence.proxy.async (its generic-proxy writes, cp.async
//   landings and plain stores, become visible to the async proxy the tensor cores read through);
//   wgmma.wait_group 1 (this warpgroup's step s-2 MMAs are done: step s-1's may still run);
//   __syncthreads (everyone's step s is in place, nobody reads step s-2's stage any more); issue the
//   copies of step s+4 into step s-2's stage; wgmma.fence, the four wgmmas of step s, commit.
// So step s's MMAs run while the block waits for step s+1's copies and issues step s+5's, and the
// copies of four steps are in flight at any time. Epilogue: wait for every MMA, then each warp stages its 16
// rows x 128 columns of accumulators (float2 stores from the documented accumulator layout) in the
// stages' memory and writes them out 32 columns at a time with grouped_gemm_common.cuh's
// write_strip (alpha, beta, bf16 C as in the mma.sync kernel).
// Determinism: every output element is summed by one block, in k16 chunks in increasing t (the
// wgmma's internal order within a chunk is the hardware's), whatever the grid.
// Scheduling (grouped_gemm_common.cuh, the same tile ids as grouped_gemm_tc.cu): rows_out = true
// runs a persistent grid of one block per SM over the linear tile ids (k::row_tile_prefix and a
// binary search); rows_out = false an E x tilesM x tilesN grid.
#include <cuda_bf16.h>
#include <cuda_pipeline_primitives.h>

#include <climits>
#include <cstdint>

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/grouped_gemm_common.cuh"
#include "backend/cuda/grouped_gemm_wgmma.cuh"
#include "backend/cuda/moe_ops.cuh"
#include "backend/cuda/wgmma_ptx.cuh"

namespace ladder::cuda::k {

namespace {

using bf16 = __nv_bfloat16;
using gg::kBX;
using gg::Operand;
using gg::Out;

constexpr int kThreads = 256, kWarps = kThreads / 32;  // two warpgroups
// Six stages (192 KiB, one block per SM), cp.async four steps ahead: a step's MMAs take ~0.3 us on
// an H200 SM (2 MFLOP at ~7.5 TFLOP/s), a global load's latency is several times that under load.
constexpr int kStages = 6;
constexpr size_t kStageBytes = 2 * size_t(wg::kTileBytes);  // A, B: 32 KiB
// The stages start at the first 1024-byte boundary of the shared window inside the buffer (the
// swizzle pattern's alignment): up to 1 KiB of slack.
constexpr size_t kSmem = kStages * kStageBytes + wg::kPattern;
constexpr int kLdS = kBX + 8;  // epilogue staging [16][136] fp32 per warp (float2 stores of rows g, g+8)
constexpr int kDefaultSms = 132;
static_assert(kBX == wg::kTileX, "a stage operand covers the tile");
static_assert(size_t(kWarps) * 16 * kLdS * sizeof(float) <= kStages * kStageBytes, "epilogue staging fits the stages");
static_assert(wg::kTileX * wg::kStageK == 4 * 8 * kThreads, "each thread stages 4 chunks of 8 bf16 per operand");

// Step t0's tile of op into a stage operand: K-major (KM: element (x, t) at kmajor_offset) or
// MN-major. Thread tid's q-th chunk of 8 elements (q = 0..3): K-major t fastest (a warp copies 4
// rows of 128 bytes), MN-major x fastest (2 rows of 256 bytes). Full chunks by cp.async (16-byte
// aligned at both ends: the operand's alignment, chunk starts at multiples of 8 elements); chunks
// crossing the operand's edge as their valid elements and zeros, chunks outside it as zeros.
template <bool KM>
__device__ __forceinline__ void stage_async(unsigned char* s, const Operand& op, int t0, int tlim) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int id = threadIdx.x + q * kThreads;
    const int x = KM ? id >> 3 : (id & 15) * 8;
    const int t = KM ? (id & 7) * 8 : id >> 4;
    gg::copy_chunk8<KM>(reinterpret_cast<bf16*>(s + (KM ? wg::kmajor_offset(x, t) : wg::mnmajor_offset(x, t))), op, x,
                        t0 + t, tlim);
  }
}

// Register staging of an operand cp.async cannot take (fp32, or bf16 not 16-byte aligned): thread
// tid's q-th group of 4 consecutive elements (q = 0..7), t fastest in K-major tiles (a warp reads 2
// rows of 64 t), x fastest in MN-major ones (128 consecutive x of one t). Loaded as fp32 (one vector
// load where op.vec, else element by element: gg::load4; zeros outside the operand), stored as 4
// bf16 rounded to nearest even (exact for bf16) in one 8-byte store: 4 elements starting at a
// multiple of 4 lie inside one 16-byte chunk, which the swizzle moves whole. So a stage holds the
// same bf16 values whichever path filled it, and the path never changes a bit of the result.
constexpr int kRegGroups = wg::kTileX * wg::kStageK / 4 / kThreads;  // 8

template <bool KM>
__device__ __forceinline__ void reg_group(int q, int& x, int& t) {
  const int gi = threadIdx.x + q * kThreads;
  x = KM ? gi >> 4 : (gi & 31) * 4;
  t = KM ? (gi & 15) * 4 : gi >> 5;
}

template <bool KM>
__device__ __forceinline__ void load_regs(float (&r)[kRegGroups][4], const Operand& op, int t0, int tlim) {
#pragma unroll
  for (int q = 0; q < kRegGroups; ++q) {
    int x, t;
    reg_group<KM>(q, x, t);
    gg::load_group4<KM>(r[q], op, x, t0 + t, tlim);
  }
}

template <bool KM>
__device__ __forceinline__ void store_regs(unsigned char* s, const float (&r)[kRegGroups][4]) {
#pragma unroll
  for (int q = 0; q < kRegGroups; ++q) {
    int x, t;
    reg_group<KM>(q, x, t);
    *reinterpret_cast<Bf16x4*>(s + (KM ? wg::kmajor_offset(x, t) : wg::mnmajor_offset(x, t))) =
        Bf16x4{__floats2bfloat162_rn(r[q][0], r[q][1]), __floats2bfloat162_rn(r[q][2], r[q][3])};
  }
}

// The descriptor of warpgroup wg's operand slice for k16 slice kk of a stage operand at shared
// address `base`: A (IS_A) covers x 64 wg.., B all 128 x.
template <bool MN, bool IS_A>
__device__ __forceinline__ uint64_t operand_desc(uint32_t base, int wgi, int kk) {
  if (MN) {  // rows of 64 x per t: the slice starts 16 rows (2 patterns) further per kk
    const uint32_t start = base + (IS_A ? uint32_t(wgi) * wg::kMnLboBytes : 0u) + uint32_t(kk) * 2 * wg::kPattern;
    return wg::make_desc(start, wg::kMnLboBytes, wg::kSboBytes);
  }
  // K-major rows of 64 t per x: the slice starts 32 bytes further per kk; LBO unused (16).
  const uint32_t start = base + (IS_A ? uint32_t(wgi) * 64 * wg::kRowBytes : 0u) + uint32_t(kk) * 32;
  return wg::make_desc(start, 16, wg::kSboBytes);
}

// One 128 x 128 output tile (grouped_gemm_common.cuh's Tile). Called by the whole block with
// block-uniform arguments (it synchronizes). A_MN / B_MN: the operand is x-contiguous (MN-major);
// A_ASYNC / B_ASYNC: staged by cp.async (bf16, 16-byte aligned), else through registers.
// A register-staged operand's step is loaded one step before it is stored (loads for step s + 5 are
// issued in step s, stored in step s + 1 after that step's MMAs are issued), so the MMAs of a step
// run while its loads land instead of waiting for them.
template <bool A_MN, bool B_MN, bool A_ASYNC, bool B_ASYNC>
__device__ void tile_product(unsigned char* stages, const gg::Tile& tl, float alpha, float beta, size_t ldc) {
  constexpr int kAhead = kStages - 2;  // steps between a stage's filling and its multiplication
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wgi = warp / 4;
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;

  const int tlim = tl.tlim;
  const int steps = (tlim + wg::kStageK - 1) / wg::kStageK;
  const uint32_t s0 = wg::smem_addr(stages);
  auto stage = [&](int st) { return stages + size_t(st % kStages) * kStageBytes; };
  float ra[kRegGroups][4], rb[kRegGroups][4];  // a register-staged operand's step in flight
  auto issue_async = [&](int st) {
    if constexpr (A_ASYNC) stage_async<!A_MN>(stage(st), tl.a, st * wg::kStageK, tlim);
    if constexpr (B_ASYNC) stage_async<!B_MN>(stage(st) + wg::kTileBytes, tl.b, st * wg::kStageK, tlim);
  };
  auto load = [&](int st) {
    if constexpr (!A_ASYNC) load_regs<!A_MN>(ra, tl.a, st * wg::kStageK, tlim);
    if constexpr (!B_ASYNC) load_regs<!B_MN>(rb, tl.b, st * wg::kStageK, tlim);
  };
  auto store = [&](int st) {
    if constexpr (!A_ASYNC) store_regs<!A_MN>(stage(st), ra);
    if constexpr (!B_ASYNC) store_regs<!B_MN>(stage(st) + wg::kTileBytes, rb);
  };
  constexpr bool kRegs = !A_ASYNC || !B_ASYNC;
  __syncthreads();  // the previous tile's epilogue (its staging aliases the stages) is done everywhere
  // Prologue: steps 0 .. kAhead-1, one commit group each (empty past the last step, so that every
  // thread always has committed step s's group and exactly kAhead - 1 younger ones when it waits);
  // the register path stores them at once, then loads step kAhead.
#pragma unroll
  for (int st = 0; st < kAhead; ++st) {
    if (st < steps) {
      issue_async(st);
      if constexpr (kRegs) {
        load(st);
        store(st);
      }
    }
    __pipeline_commit();
  }
  if constexpr (kRegs)
    if (kAhead < steps) load(kAhead);
  for (int s = 0; s < steps; ++s) {
    __pipeline_wait_prior(kAhead - 1);  // this thread's copies of step s have landed
    wg::fence_proxy_async();            // ... and with its plain stores, are visible to the tensor cores
    wg::wgmma_wait<1>();                // this warpgroup's MMAs of step s - 2 are done
    __syncthreads();                    // everyone's step s is in place; step s - 2's stage is free
    const int next = s + kAhead;        // the step filling step s - 2's stage
    if (next < steps) issue_async(next);
    __pipeline_commit();
    const uint32_t a_s = s0 + uint32_t(s % kStages) * uint32_t(kStageBytes), b_s = a_s + wg::kTileBytes;
    wg::wgmma_fence();
    wg::fence_operand(acc);
#pragma unroll
    for (int kk = 0; kk < wg::kStageK / 16; ++kk)
      wg::wgmma_m64n128k16<A_MN, B_MN>(acc, operand_desc<A_MN, true>(a_s, wgi, kk),
                                       operand_desc<B_MN, false>(b_s, wgi, kk));
    wg::wgmma_commit();
    wg::fence_operand(acc);
    if constexpr (kRegs) {
      if (next < steps) store(next);         // loaded in the previous step (or the prologue)
      if (next + 1 < steps) load(next + 1);  // stored in the next step
    }
  }
  wg::wgmma_wait<0>();
  wg::fence_operand(acc);
  __pipeline_wait_prior(0);  // only empty groups are left; nothing lands in the stages from here on
  __syncthreads();           // every warpgroup is done with the stages (the staging below aliases them)

  // Epilogue: warp (wg, w) holds rows 64 wg + 16 w + g and + 8 (g = lane / 4), columns 8 j + 2 t.
  float* stg = reinterpret_cast<float*>(stages + size_t(warp) * 16 * kLdS * sizeof(float));
  const int g = lane >> 2, t2 = (lane & 3) * 2;
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<float2*>(stg + (g + 8 * h) * kLdS + j * 8 + t2) =
          make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
  __syncwarp();
  const int m0 = wgi * 64 + (warp % 4) * 16;
  for (int c = 0; c < kBX / 32; ++c)
    gg::write_strip(stg + 32 * c, kLdS, m0, 32 * c, lane, alpha, beta, tl.out, ldc, tl.mlim, tl.nlim);
}

template <bool TRANSB, bool A_ASYNC, bool B_ASYNC>
__global__ void __launch_bounds__(kThreads, 1)
    wg_rows_kernel(const int32_t* offsets, const int32_t* tile_start, int E, int N, int K, float alpha, const void* A,
                   bool a16, int lda, bool vecA, const void* B, bool b16, int ldb, size_t strideB, bool vecB,
                   float beta, void* C, bool c16, int ldc) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* stages = wg::pattern_aligned(smem);
  const int tilesN = (N + kBX - 1) / kBX;
  const int64_t total = int64_t(tile_start[E]) * tilesN;
  for (int64_t id = blockIdx.x; id < total; id += gridDim.x) {
    const gg::Tile t = gg::rows_tile(id, tilesN, offsets, tile_start, E, TRANSB, N, K, A, a16, lda, vecA, B, b16, ldb,
                                     strideB, vecB, C, c16, ldc);
    tile_product<false, !TRANSB, A_ASYNC, B_ASYNC>(stages, t, alpha, beta, size_t(ldc));
  }
}

template <bool A_ASYNC, bool B_ASYNC>
__global__ void __launch_bounds__(kThreads, 1)
    wg_wgrad_kernel(const int32_t* offsets, int M, int N, float alpha, const void* A, bool a16, int lda, bool vecA,
                    const void* B, bool b16, int ldb, bool vecB, float beta, void* C, bool c16, int ldc,
                    size_t strideC) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* stages = wg::pattern_aligned(smem);
  const gg::Tile t =
      gg::wgrad_tile(blockIdx.x, offsets, M, N, A, a16, lda, vecA, B, b16, ldb, vecB, C, c16, ldc, strideC);
  if (t.tlim == 0 && beta == 1.f) return;  // C_e = 1 * C_e: nothing to write (block-uniform exit)
  tile_product<true, true, A_ASYNC, B_ASYNC>(stages, t, alpha, beta, size_t(ldc));
}

// The instantiation for the operands' staging paths, chosen at launch (block-uniform).
template <bool TRANSB>
auto rows_kernel(bool a_async, bool b_async) {
  return a_async ? (b_async ? wg_rows_kernel<TRANSB, true, true> : wg_rows_kernel<TRANSB, true, false>)
                 : (b_async ? wg_rows_kernel<TRANSB, false, true> : wg_rows_kernel<TRANSB, false, false>);
}
auto wgrad_kernel(bool a_async, bool b_async) {
  return a_async ? (b_async ? wg_wgrad_kernel<true, true> : wg_wgrad_kernel<true, false>)
                 : (b_async ? wg_wgrad_kernel<false, true> : wg_wgrad_kernel<false, false>);
}

// ---- the layout self-test (CudaWgmma.*) ----------------------------------------------------------
constexpr size_t kSelftestSmem = 2 * size_t(wg::kTileBytes) + wg::kPattern;

// Byte offset of element (x, t) of a stage operand in its form, swizzled or (plain) not.
__device__ __forceinline__ uint32_t selftest_offset(bool mn, bool plain, int x, int t) {
  const uint32_t off = mn ? wg::mnmajor_offset(x, t) : wg::kmajor_offset(x, t);
  return plain ? wg::swizzle128(off) : off;  // the swizzle is its own inverse
}

template <bool A_MN, bool B_MN>
__global__ void __launch_bounds__(128, 1)
    wgmma_selftest_kernel(float* d, const uint16_t* a, const uint16_t* b, WgmmaSelftest cfg) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* sa = wg::pattern_aligned(smem);
  unsigned char* sb = sa + wg::kTileBytes;
  // A: x = m (64), t = k (64); B: x = n (128), t = k (64). Plain stores, then the proxy fence.
  for (int i = threadIdx.x; i < 64 * 64; i += 128) {
    const int m = i / 64, kq = i % 64;
    *reinterpret_cast<uint16_t*>(sa + selftest_offset(A_MN, cfg.plain_store, m, kq)) = a[i];
  }
  for (int i = threadIdx.x; i < 64 * 128; i += 128) {
    const int kq = i / 128, n = i % 128;
    *reinterpret_cast<uint16_t*>(sb + selftest_offset(B_MN, cfg.plain_store, n, kq)) = b[i];
  }
  wg::fence_proxy_async();
  __syncthreads();
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  const uint32_t a_s = wg::smem_addr(sa), b_s = wg::smem_addr(sb);
  wg::wgmma_fence();
  wg::fence_operand(acc);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint32_t a_start = a_s + (A_MN ? kk * 2 * wg::kPattern : kk * 32);
    const uint32_t b_start = b_s + (B_MN ? kk * 2 * wg::kPattern : kk * 32);
    wg::wgmma_m64n128k16<A_MN, B_MN>(acc, wg::make_desc(a_start, cfg.lbo_a, cfg.sbo_a),
                                     wg::make_desc(b_start, cfg.lbo_b, cfg.sbo_b));
  }
  wg::wgmma_commit();
  wg::wgmma_wait<0>();
  wg::fence_operand(acc);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) d[(16 * warp + g + 8 * (i / 2)) * 128 + 8 * j + 2 * t + (i % 2)] = acc[4 * j + i];
}

}  // namespace

bool grouped_gemm_wgmma_available() {
  static const bool ok = device_runs(wg_rows_kernel<true, true, true>);
  return ok;
}

cudaError_t grouped_gemm_wgmma(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K,
                               float alpha, const void* A, bool a_bf16, int lda, const void* B, bool b_bf16, int ldb,
                               size_t strideB, float beta, void* C, bool c_bf16, int ldc, size_t strideC,
                               int32_t* tile_scratch, int sm_count, cudaStream_t st) {
  if (!grouped_gemm_wgmma_available()) return cudaErrorNotSupported;
  if (E <= 0 || N <= 0) return cudaSuccess;
  if (c_bf16 && beta != 0.f) return cudaErrorInvalidValue;
  const auto [vecA, vecB, a_async, b_async] = gg::staging(rows_out, A, a_bf16, lda, B, b_bf16, ldb, strideB);
  if (rows_out) {
    if (K < 0) return cudaErrorInvalidValue;
    if (const cudaError_t e = row_tile_prefix(tile_scratch, offsets, E, kBX, st); e != cudaSuccess) return e;
    const unsigned grid = unsigned(sm_count > 0 ? sm_count : kDefaultSms);  // one block per SM (193 KiB)
    const auto kernel = transB ? rows_kernel<true>(a_async, b_async) : rows_kernel<false>(a_async, b_async);
    if (const cudaError_t e = allow_smem(kernel, kSmem); e != cudaSuccess) return e;
    kernel<<<grid, kThreads, kSmem, st>>>(offsets, tile_scratch, E, N, K, alpha, A, a_bf16, lda, vecA, B, b_bf16, ldb,
                                          strideB, vecB, beta, C, c_bf16, ldc);
  } else {
    if (M <= 0) return cudaSuccess;
    const int64_t blocks = gg::wgrad_blocks(E, M, N);
    if (blocks < 0) return cudaErrorInvalidConfiguration;
    const auto kernel = wgrad_kernel(a_async, b_async);
    if (const cudaError_t e = allow_smem(kernel, kSmem); e != cudaSuccess) return e;
    kernel<<<unsigned(blocks), kThreads, kSmem, st>>>(offsets, M, N, alpha, A, a_bf16, lda, vecA, B, b_bf16, ldb, vecB,
                                                      beta, C, c_bf16, ldc, strideC);
  }
  return cudaGetLastError();
}

cudaError_t wgmma_selftest(float* d, const uint16_t* a, const uint16_t* b, const WgmmaSelftest& cfg,
                           cudaStream_t st) {
  if (!grouped_gemm_wgmma_available()) return cudaErrorNotSupported;
  const auto kernel = cfg.a_mn ? (cfg.b_mn ? wgmma_selftest_kernel<true, true> : wgmma_selftest_kernel<true, false>)
                               : (cfg.b_mn ? wgmma_selftest_kernel<false, true> : wgmma_selftest_kernel<false, false>);
  if (const cudaError_t e = allow_smem(kernel, kSelftestSmem); e != cudaSuccess) return e;
  kernel<<<1, 128, kSelftestSmem, st>>>(d, a, b, cfg);
  return cudaGetLastError();
}

}  // namespace ladder::cuda::k
