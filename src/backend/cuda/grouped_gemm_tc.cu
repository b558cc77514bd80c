// bf16 tensor-core grouped GEMM for the MoE experts (launchers and contract in grouped_gemm_tc.cuh;
// the fp32 CUDA-core version it replaces under bf16 precision is in moe_ops.cu).
//
// The tensor cores are driven by mma.sync m16n8k16 (bf16 in, fp32 accumulators; sm_80 and sm_90
// alike, no wgmma) with ldmatrix fragment loads, through mma_ptx.cuh's wrappers: their fragment
// layouts are the PTX ISA's documented ones (checked on a device by CudaMmaPtx.*), so each lane's
// ldmatrix row address follows from the stage layout, and the accumulators' positions are known
// (the register-resident attention built on them ran 1.3-1.7x its WMMA version on an H200). The
// previous WMMA implementation (nvcuda::wmma 16x16x16, no layout assumed) stays selectable for a
// same-run comparison: grouped_gemm_tc_set_mma(false) or LADDER_GROUPED_MMA=0 (MmaCore / WmmaCore).
// On Hopper a third implementation, on wgmma (grouped_gemm_wgmma.cu, sm_90a only), takes every call
// instead when selected (grouped_gemm_tc_set_wgmma(true) or LADDER_GROUPED_WGMMA=1; off by default)
// and the device runs it; the tile ids, epilogue and staging rules are shared (grouped_gemm_common.cuh).
//
// Tile product. A block of 256 threads (8 warps) computes a 128 x 128 fp32 output tile
//      C_tile[x_a, x_b] = alpha * sum_t opA(x_a, t) opB(t, x_b) + beta * C_tile
// walking the reduction index t in steps of 32. The two shapes differ only in how the operands are
// addressed (x the output coordinate, t the reduction index):
//   rows_out = true : opA(m, t) = A[(row0 + m) * lda + t]                      t-contiguous
//                     opB(t, n) = B_e[n * ldb + t] (transB, t-contiguous) or B_e[t * ldb + n]
//                     t runs over K; a tile is 128 of the expert's rows x 128 columns.
//   rows_out = false: opA(m, t) = A[(r0 + t) * lda + m],  opB(t, n) = B[(r0 + t) * ldb + n]
//                     (both x-contiguous); t runs over the expert's rows; a tile is 128x128 of C_e.
// An operand is fp32 or, already rounded, bf16 in global memory (grouped_gemm_tc_ex: the weights'
// bf16 mirror under bf16 precision; half the bytes to load, the same bf16 values in shared memory,
// so the same bits out). An operand tile lives in shared memory as bf16 in the layout its global
// memory has, so a thread's 4 consecutive elements (one float4 / one 8-byte load of bf16 where the
// operand is 16- / 8-byte aligned with ld % 4 == 0, else 4 scalar loads) become 4 consecutive bf16:
// t-contiguous tiles as [128 x][32 t] (ld 40), read by plain ldmatrix (a row-major A; B k-contiguous
// per column, the mma's "col" B); x-contiguous ones as [32 t][128 x] (ld 136), read by
// ldmatrix .trans. Both pitches are multiples of 16 bytes (ldmatrix rows) and conflict-free: the 8
// rows of an 8x8 matrix fall into 8 distinct 16-byte bank groups. Elements outside the operand
// (x >= its extent, t >= the reduction length) are stored as zeros, so partial tiles add exact
// zeros and need no other path.
// Pipeline: three shared stages, one barrier per step; while step s multiplies, steps s+1 and s+2
// are on their way. A bf16 operand aligned to 8 elements (16 bytes, ld % 8 == 0: the weights' bf16
// mirror, and with model.moe_bf16 the activations too) goes straight from global to shared memory
// with cp.async (16-byte copies, no registers, no conversion; edge chunks are plain stores of the
// valid elements and zeros); any other operand through registers: step s+2's loads are issued
// before step s's MMAs and converted and stored after them. Either way a stage holds the same bf16
// values, so the path taken never changes a bit of the result.
// Warps are 2 (rows) x 4 (columns), each owning a 64 x 32 block: 4 (m16) x 4 (n8) mma tiles, 64 fp32
// accumulators a lane. Per k16 slice a warp loads B's two x4 fragments, then A's four one at a time.
// Epilogue: each warp stores a 16 x 32 strip of accumulators at a time (float2 stores, positions
// from the accumulator layout) to its own staging area (which aliases the operand stages, after the
// last step's barrier) and writes it out, lane = column, 128 contiguous bytes per row:
// C = alpha * acc (+ beta * C, read only when beta != 0). Writing the registers straight to global
// memory spilled on sm_90 (MmaCore::store).
//
// Determinism: every output element is summed by one block, in 16-wide MMA chunks in increasing t,
// independent of the grid and of which block takes the tile. No atomics, no split-K (see below).
//
// Which block does which tile, with offsets on the device only (the moe_ops.cu scheme):
//   rows_out = false: the grid is E x tilesM x tilesN (known on the host); block -> (e, tile).
//     Empty experts still write C_e = beta * C_e (zeros for beta 0, C not read); beta 1 exits early.
//     The reduction over an expert's rows runs inside one block: a crowded expert with few output
//     tiles is one long block (a fixed split over rows with a fixed-order second pass would spread
//     it; not done: M x N of an MoE expert weight is many tiles already).
//   rows_out = true: k::row_tile_prefix (moe_ops.cu) writes the exclusive prefix of per-expert row tiles
//     (ceil(rows_e / 128)) into scratch; the GEMM runs a persistent grid (2 blocks per SM) striding
//     over the linear tile ids [0, row_tiles * tilesN), consecutive ids sharing a row tile; each id
//     finds its expert by binary search in the prefix. Every tile costs the same (a full K loop).
#include <cuda_bf16.h>
#include <cuda_pipeline_primitives.h>
#include <mma.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "backend/cuda/grouped_gemm_tc.cuh"
#include "backend/cuda/grouped_gemm_common.cuh"
#include "backend/cuda/grouped_gemm_wgmma.cuh"
#include "backend/cuda/device_common.cuh"
#include "backend/cuda/moe_ops.cuh"
#include "backend/cuda/mma_ptx.cuh"

namespace ladder::cuda::k {

namespace {

using bf16 = __nv_bfloat16;
namespace wmma = nvcuda::wmma;
using gg::advance;
using gg::kBX;
using gg::Operand;
using gg::Out;
using gg::write_strip;

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kBK = 32;           // reduction step
constexpr int kWM = 64, kWN = 32;  // warp block: 2 x 4 warps cover 128 x 128
constexpr int kFM = kWM / 16, kFN = kWN / 16;
constexpr int kLdT = kBK + 8;  // t-contiguous tile [kBX][kLdT] bf16 (80-byte rows)
constexpr int kLdX = kBX + 8;  // x-contiguous tile [kBK][kLdX] bf16 (272-byte rows)
constexpr size_t kTileT = size_t(kBX) * kLdT * sizeof(bf16);
constexpr size_t kTileX = size_t(kBK) * kLdX * sizeof(bf16);
constexpr size_t kOperand = kTileT > kTileX ? kTileT : kTileX;  // one slot size for either layout
constexpr int kStages = 3;
constexpr size_t kSmem = kStages * 2 * kOperand;                  // 3 stages x (A, B): 60 KiB
// Epilogue strip [16][ld] fp32 per warp: ld kLdE for WMMA, kLdEM for mma.sync, whose float2 stores
// (lane (g, t) at row g, column 2t) then hit 16 distinct 8-byte slots of 128 bytes per half warp
// (row step 160 bytes; with 144 rows g and g + 1 would share slots).
constexpr int kLdE = kWN + 4, kLdEM = kWN + 8;
constexpr size_t kEpiWarp = size_t(16) * kLdEM * sizeof(float);
constexpr int kBlocksPerSm = 2;
constexpr int kDefaultSms = 132;
// WMMA needs 32-byte aligned sub-tiles: every slot, row step of 16 and column step of 16 keeps that.
static_assert(kTileT % 128 == 0 && kTileX % 128 == 0 && kOperand % 128 == 0, "operand slot alignment");
static_assert((16 * kLdT * sizeof(bf16)) % 32 == 0 && (16 * kLdX * sizeof(bf16)) % 32 == 0, "fragment alignment");
// ldmatrix: every row address 16-byte aligned (slots, pitches, and column steps of 8 elements).
static_assert((kLdT * sizeof(bf16)) % 16 == 0 && (kLdX * sizeof(bf16)) % 16 == 0, "ldmatrix row alignment");
static_assert(kEpiWarp % 32 == 0 && kWarps * kEpiWarp <= kSmem, "epilogue staging fits the stages");
static_assert(kBlocksPerSm * kSmem <= 160 * 1024, "two blocks per SM on sm_80 (164 KiB) and sm_90 (228 KiB)");
static_assert(kBX * kBK == 4 * 4 * kThreads, "each thread stages 4 groups of 4 elements per operand");
static_assert(kBX * kBK == 2 * 8 * kThreads, "or, with cp.async, 2 chunks of 8 bf16 per operand");

using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Thread `tid`'s q-th group of 4: t-contiguous groups walk t fastest (a warp reads 4 rows x 128
// bytes), x-contiguous ones x (a warp reads 512 contiguous bytes of one t).
template <bool TC>
__device__ __forceinline__ void group_coords(int g, int& x, int& t) {
  if (TC) {
    x = g >> 3;
    t = (g & 7) * 4;
  } else {
    t = g >> 5;
    x = (g & 31) * 4;
  }
}

template <bool TC>
__device__ __forceinline__ void load_regs(float (&r)[4][4], const Operand& op, int t0, int tlim) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    int x, t;
    group_coords<TC>(threadIdx.x + q * kThreads, x, t);
    gg::load_group4<TC>(r[q], op, x, t0 + t, tlim);
  }
}

// The registers into a stage slot as bf16, rounded to nearest even (exact for a bf16 operand), as
// one 8-byte store per group (the group's first element is a multiple of 4 and both row pitches are
// multiples of 8 bytes; a warp's 32 stores: 256 bytes, no more wavefronts than needed).
template <bool TC>
__device__ __forceinline__ void store_regs(bf16* s, const float (&r)[4][4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    int x, t;
    group_coords<TC>(threadIdx.x + q * kThreads, x, t);
    bf16* d = TC ? s + x * kLdT + t : s + t * kLdX + x;
    *reinterpret_cast<Bf16x4*>(d) =
        Bf16x4{__floats2bfloat162_rn(r[q][0], r[q][1]), __floats2bfloat162_rn(r[q][2], r[q][3])};
  }
}

// cp.async staging of a bf16 operand aligned to 8 elements: thread tid's q-th chunk of 8 (q = 0, 1),
// t fastest in t-contiguous tiles (4 chunks of a row of 32 t), x in x-contiguous ones (16 chunks of
// a row of 128 x). Every chunk starts 16-byte aligned in global memory (the operand's alignment)
// and in the stage (row pitches of 80 and 272 bytes).
template <bool TC>
__device__ __forceinline__ void chunk_coords(int g, int& x, int& t) {
  if (TC) {
    x = g >> 2;
    t = (g & 3) * 8;
  } else {
    t = g >> 4;
    x = (g & 15) * 8;
  }
}

// Step t0's tile of op into stage slot s: full chunks by cp.async (landing by the wait for their
// commit group); chunks crossing the operand's edge as the valid elements and zeros, and chunks
// outside it as zeros, by plain stores.
template <bool TC>
__device__ __forceinline__ void copy_async(bf16* s, const Operand& op, int t0, int tlim) {
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    int x, t;
    chunk_coords<TC>(threadIdx.x + q * kThreads, x, t);
    gg::copy_chunk8<TC>(TC ? s + x * kLdT + t : s + t * kLdX + x, op, x, t0 + t, tlim);
  }
}

__device__ __forceinline__ bf16* slot(unsigned char* smem, int stage, int operand) {
  return reinterpret_cast<bf16*>(smem + (size_t(stage) * 2 + operand) * kOperand);
}

// The warp's share of the tile product, one implementation per struct: acc, zero(), step() (one
// stage's kBK of reduction, in increasing t) and store() (the epilogue). The pipeline around them
// (tile_product) is the same for both, so a stage holds the same bf16 values either way.
//
// mma.sync (the default): a warp block of 64 x 32 is 4 (m16) x 4 (n8) m16n8k16 tiles. Fragments
// come from the stages by ldmatrix (mma_ptx.cuh; lane l's row address from frag_a / frag_b_nk /
// frag_a_km): t-contiguous A [m][t] is a row-major m x k A (plain), x-contiguous A [t][m] is its
// transpose (.trans); t-contiguous B [n][t] is k-contiguous per n like K in attention (plain),
// x-contiguous B [t][n] is [k][n] like V (.trans). Both pitches (80 and 272 bytes) are multiples of
// 16 (ldmatrix rows) and put the 8 rows of an 8x8 matrix in 8 distinct 16-byte bank groups.
template <bool A_TC, bool B_TC>
struct MmaCore {
  static constexpr int kTN = kWN / 8;  // n8 tiles per warp
  float acc[kFM][kTN][4];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kFM; ++i)
#pragma unroll
      for (int j = 0; j < kTN; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;
  }

  // B's fragments of a k16 slice first (8 registers), then A's one m16 tile at a time (4 live):
  // the fewest fragment registers next to the 64 accumulators and the register path's step in
  // flight. Every row address is the lane's one for the warp's first fragment plus a constant, so
  // the step needs one address register per operand (the rest are instruction offsets).
  __device__ __forceinline__ void step(const bf16* As, const bf16* Bs, int wm0, int wn0, int lane) {
    const bf16* a = A_TC ? frag_a(As, kLdT, wm0, 0, lane) : frag_a_km(As, kLdX, 0, wm0, lane);
    const bf16* b = B_TC ? frag_b_nk(Bs, kLdT, wn0, 0, lane) : frag_a(Bs, kLdX, 0, wn0, lane);
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t fb[kWN / 16][4];  // fb[j]: the n8 tiles 2j (registers 0, 1) and 2j + 1 (2, 3)
#pragma unroll
      for (int j = 0; j < kWN / 16; ++j) {
        if (B_TC) ldmatrix_x4(fb[j], b + j * 16 * kLdT + kk);
        else ldmatrix_x4_trans(fb[j], b + kk * kLdX + j * 16);
      }
#pragma unroll
      for (int i = 0; i < kFM; ++i) {
        uint32_t fa[4];
        if (A_TC) ldmatrix_x4(fa, a + i * 16 * kLdT + kk);
        else ldmatrix_x4_trans(fa, a + kk * kLdX + i * 16);
#pragma unroll
        for (int j = 0; j < kWN / 16; ++j) mma2(acc[i][2 * j], acc[i][2 * j + 1], fa, fb[j]);
      }
    }
  }

  // Through the warp's strip (write_strip), 16 rows at a time: lane (g, t) holds rows g and g + 8,
  // columns 2t, 2t+1 of each n8 tile. Writing the registers straight to C instead (8-byte stores,
  // 8 rows x 32 bytes a warp) spilled on sm_90 in the persistent kernel with both operands by cp.async
  // (~200 bytes): the bounds and alignment cases of 32 stores kept more live than 128 registers.
  __device__ __forceinline__ void store(unsigned char* smem, int wm0, int wn0, int lane, float alpha, float beta,
                                        Out C, size_t ldc, int mlim, int nlim) {
    float* stg = reinterpret_cast<float*>(smem + size_t(threadIdx.x / 32) * kEpiWarp);
    const int g = lane >> 2, t2 = (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < kFM; ++i) {
#pragma unroll
      for (int j = 0; j < kTN; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<float2*>(stg + (g + 8 * h) * kLdEM + j * 8 + t2) =
              make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
      __syncwarp();
      write_strip(stg, kLdEM, wm0 + i * 16, wn0, lane, alpha, beta, C, ldc, mlim, nlim);
      __syncwarp();  // the strip is read before the next one overwrites it
    }
  }
};

// WMMA (LADDER_GROUPED_MMA=0; kept to compare with on a GPU): 4 x 2 16x16x16 accumulator fragments,
// whose element-to-thread mapping is unspecified, so they leave through shared memory: each warp
// stores a 16 x 32 strip at a time to its own staging area (aliasing the stages: tile_product's
// barrier after the last step first) and writes it out, lane = column, 128 contiguous bytes a row.
template <bool A_TC, bool B_TC>
struct WmmaCore {
  using LA = std::conditional_t<A_TC, wmma::row_major, wmma::col_major>;
  using LB = std::conditional_t<B_TC, wmma::col_major, wmma::row_major>;
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, LA>;
  using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, LB>;
  FragC acc[kFM][kFN];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kFM; ++i)
#pragma unroll
      for (int j = 0; j < kFN; ++j) wmma::fill_fragment(acc[i][j], 0.f);
  }

  __device__ __forceinline__ void step(const bf16* As, const bf16* Bs, int wm0, int wn0, int) {
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      FragB fb[kFN];
#pragma unroll
      for (int j = 0; j < kFN; ++j) {
        const int n = wn0 + j * 16;
        if (B_TC) wmma::load_matrix_sync(fb[j], Bs + n * kLdT + kk, kLdT);
        else wmma::load_matrix_sync(fb[j], Bs + kk * kLdX + n, kLdX);
      }
#pragma unroll
      for (int i = 0; i < kFM; ++i) {
        const int m = wm0 + i * 16;
        FragA fa;
        if (A_TC) wmma::load_matrix_sync(fa, As + m * kLdT + kk, kLdT);
        else wmma::load_matrix_sync(fa, As + kk * kLdX + m, kLdX);
#pragma unroll
        for (int j = 0; j < kFN; ++j) wmma::mma_sync(acc[i][j], fa, fb[j], acc[i][j]);
      }
    }
  }

  __device__ __forceinline__ void store(unsigned char* smem, int wm0, int wn0, int lane, float alpha, float beta,
                                        Out C, size_t ldc, int mlim, int nlim) {
    float* stg = reinterpret_cast<float*>(smem + size_t(threadIdx.x / 32) * kEpiWarp);
#pragma unroll
    for (int i = 0; i < kFM; ++i) {
#pragma unroll
      for (int j = 0; j < kFN; ++j) wmma::store_matrix_sync(stg + j * 16, acc[i][j], kLdE, wmma::mem_row_major);
      __syncwarp();
      write_strip(stg, kLdE, wm0 + i * 16, wn0, lane, alpha, beta, C, ldc, mlim, nlim);
      __syncwarp();  // the strip is read before the next one overwrites it
    }
  }
};

// One 128 x 128 output tile; C points at its (0, 0), mlim/nlim bound its valid part, tlim is the
// reduction length. Called by the whole block with block-uniform arguments (it synchronizes).
// MMA: mma.sync (MmaCore) or WMMA (WmmaCore). A_ASYNC / B_ASYNC: that operand is bf16 aligned to 8
// elements and staged by cp.async.
template <bool MMA, bool A_TC, bool B_TC, bool A_ASYNC, bool B_ASYNC>
__device__ void tile_product(unsigned char* smem, const Operand& a, const Operand& b, int tlim, float alpha,
                             float beta, Out C, size_t ldc, int mlim, int nlim) {
  using Core = std::conditional_t<MMA, MmaCore<A_TC, B_TC>, WmmaCore<A_TC, B_TC>>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm0 = (warp >> 2) * kWM, wn0 = (warp & 3) * kWN;

  Core core;
  core.zero();

  const int steps = (tlim + kBK - 1) / kBK;
  float ra[4][4], rb[4][4];  // the register path's step in flight (unused by a cp.async operand)
  // Step `st` into its stage: issued (cp.async, or the registers' global loads) ...
  auto issue = [&](int st) {  // the copies first: they hold no registers once issued
    if constexpr (A_ASYNC) copy_async<A_TC>(slot(smem, st % kStages, 0), a, st * kBK, tlim);
    if constexpr (B_ASYNC) copy_async<B_TC>(slot(smem, st % kStages, 1), b, st * kBK, tlim);
    if constexpr (!A_ASYNC) load_regs<A_TC>(ra, a, st * kBK, tlim);
    if constexpr (!B_ASYNC) load_regs<B_TC>(rb, b, st * kBK, tlim);
  };
  // ... and the registers' part stored (after the MMAs it overlapped).
  auto finish = [&](int st) {
    if constexpr (!A_ASYNC) store_regs<A_TC>(slot(smem, st % kStages, 0), ra);
    if constexpr (!B_ASYNC) store_regs<B_TC>(slot(smem, st % kStages, 1), rb);
  };
  __syncthreads();  // the previous tile's epilogue (its strips alias the stages) is done everywhere
  // Prologue: steps 0 .. kStages-2, one commit group each (empty past the last step, so that every
  // thread always has committed step s's group and exactly kStages - 2 younger ones when it waits).
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < steps) {
      issue(st);
      finish(st);
    }
    __pipeline_commit();
  }
  for (int s = 0; s < steps; ++s) {
    __pipeline_wait_prior(kStages - 2);  // this thread's copies of step s have landed
    // Everyone's copies and stores of step s are visible, and every warp is done with step s-1,
    // whose stage step s + kStages - 1 now fills.
    __syncthreads();
    const int next = s + kStages - 1;
    const bool more = next < steps;
    if (more) issue(next);
    __pipeline_commit();
    core.step(slot(smem, s % kStages, 0), slot(smem, s % kStages, 1), wm0, wn0, lane);
    if (more) finish(next);  // step s-1's stage: no warp reads it before step `next`'s barrier
  }
  __pipeline_wait_prior(0);  // only empty groups are left; nothing lands in the stages from here on
  __syncthreads();           // every warp is done with the last step's stage (the epilogue's strips alias it)
  core.store(smem, wm0, wn0, lane, alpha, beta, C, ldc, mlim, nlim);
}

template <bool MMA, bool TRANSB, bool A_ASYNC, bool B_ASYNC>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    tc_rows_kernel(const int32_t* offsets, const int32_t* tile_start, int E, int N, int K, float alpha,
                   const void* A, bool a16, int lda, bool vecA, const void* B, bool b16, int ldb, size_t strideB,
                   bool vecB, float beta, void* C, bool c16, int ldc) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tilesN = (N + kBX - 1) / kBX;
  const int64_t total = int64_t(tile_start[E]) * tilesN;
  for (int64_t id = blockIdx.x; id < total; id += gridDim.x) {
    const gg::Tile t = gg::rows_tile(id, tilesN, offsets, tile_start, E, TRANSB, N, K, A, a16, lda, vecA, B, b16, ldb,
                                     strideB, vecB, C, c16, ldc);
    tile_product<MMA, true, TRANSB, A_ASYNC, B_ASYNC>(smem, t.a, t.b, t.tlim, alpha, beta, t.out, size_t(ldc), t.mlim,
                                                      t.nlim);
  }
}

template <bool MMA, bool A_ASYNC, bool B_ASYNC>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    tc_wgrad_kernel(const int32_t* offsets, int M, int N, float alpha, const void* A, bool a16, int lda, bool vecA,
                    const void* B, bool b16, int ldb, bool vecB, float beta, void* C, bool c16, int ldc,
                    size_t strideC) {
  extern __shared__ __align__(128) unsigned char smem[];
  const gg::Tile t = gg::wgrad_tile(blockIdx.x, offsets, M, N, A, a16, lda, vecA, B, b16, ldb, vecB, C, c16, ldc,
                                    strideC);
  if (t.tlim == 0 && beta == 1.f) return;  // C_e = 1 * C_e: nothing to write (block-uniform exit)
  tile_product<MMA, false, false, A_ASYNC, B_ASYNC>(smem, t.a, t.b, t.tlim, alpha, beta, t.out, size_t(ldc), t.mlim,
                                                    t.nlim);
}

// The instantiation for the implementation and the operands' staging paths, chosen at launch
// (block-uniform for the kernel).
template <bool MMA, bool TRANSB>
auto rows_kernel_of(bool a_async, bool b_async) {
  return a_async ? (b_async ? tc_rows_kernel<MMA, TRANSB, true, true> : tc_rows_kernel<MMA, TRANSB, true, false>)
                 : (b_async ? tc_rows_kernel<MMA, TRANSB, false, true> : tc_rows_kernel<MMA, TRANSB, false, false>);
}
template <bool TRANSB>
auto rows_kernel(bool mma, bool a_async, bool b_async) {
  return mma ? rows_kernel_of<true, TRANSB>(a_async, b_async) : rows_kernel_of<false, TRANSB>(a_async, b_async);
}
template <bool MMA>
auto wgrad_kernel_of(bool a_async, bool b_async) {
  return a_async ? (b_async ? tc_wgrad_kernel<MMA, true, true> : tc_wgrad_kernel<MMA, true, false>)
                 : (b_async ? tc_wgrad_kernel<MMA, false, true> : tc_wgrad_kernel<MMA, false, false>);
}
auto wgrad_kernel(bool mma, bool a_async, bool b_async) {
  return mma ? wgrad_kernel_of<true>(a_async, b_async) : wgrad_kernel_of<false>(a_async, b_async);
}

// The implementation the launchers run (grouped_gemm_tc_set_mma); starts from LADDER_GROUPED_MMA.
bool& use_mma() {
  static bool mma = [] {
    const char* e = std::getenv("LADDER_GROUPED_MMA");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return mma;
}

// grouped_gemm_tc_set_wgmma; starts from LADDER_GROUPED_WGMMA (off unless "1").
bool& use_wgmma() {
  static bool on = [] {
    const char* e = std::getenv("LADDER_GROUPED_WGMMA");
    return e && std::strcmp(e, "1") == 0;
  }();
  return on;
}

}  // namespace

bool grouped_gemm_tc_mma() { return use_mma(); }
void grouped_gemm_tc_set_mma(bool mma) { use_mma() = mma; }
bool grouped_gemm_tc_wgmma() { return use_wgmma(); }
void grouped_gemm_tc_set_wgmma(bool wgmma) { use_wgmma() = wgmma; }

#ifndef LADDER_WGMMA
// This build has no sm_90a code (CMAKE_CUDA_ARCHITECTURES without 90): grouped_gemm_wgmma.cu is not
// compiled, and these stand in for it.
bool grouped_gemm_wgmma_available() { return false; }
cudaError_t grouped_gemm_wgmma(bool, bool, int, const int32_t*, int, int, int, float, const void*, bool, int, const void*,
                               bool, int, size_t, float, void*, bool, int, size_t, int32_t*, int, cudaStream_t) {
  return cudaErrorNotSupported;
}
cudaError_t wgmma_selftest(float*, const uint16_t*, const uint16_t*, const WgmmaSelftest&, cudaStream_t) {
  return cudaErrorNotSupported;
}
#endif

size_t grouped_gemm_tc_scratch_ints(int E) { return size_t(E > 0 ? E : 0) + 1; }

cudaError_t grouped_gemm_tc(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K,
                            float alpha, const float* A, int lda, const float* B, int ldb, size_t strideB, float beta,
                            float* C, int ldc, size_t strideC, int32_t* tile_scratch, int sm_count, cudaStream_t st) {
  return grouped_gemm_tc_ex(rows_out, transB, E, offsets, M, N, K, alpha, A, false, lda, B, false, ldb, strideB, beta,
                            C, false, ldc, strideC, tile_scratch, sm_count, st);
}

cudaError_t grouped_gemm_tc_ex(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K,
                               float alpha, const void* A, bool a_bf16, int lda, const void* B, bool b_bf16, int ldb,
                               size_t strideB, float beta, void* C, bool c_bf16, int ldc, size_t strideC,
                               int32_t* tile_scratch,
                               int sm_count, cudaStream_t st) {
  if (E <= 0 || N <= 0) return cudaSuccess;
  if (c_bf16 && beta != 0.f) return cudaErrorInvalidValue;
  // The wgmma kernels where selected and the device runs them (grouped_gemm_tc.cuh).
  if (use_wgmma() && grouped_gemm_wgmma_available())
    return grouped_gemm_wgmma(rows_out, transB, E, offsets, M, N, K, alpha, A, a_bf16, lda, B, b_bf16, ldb, strideB,
                              beta, C, c_bf16, ldc, strideC, tile_scratch, sm_count, st);
  const bool mma = use_mma();
  const auto [vecA, vecB, a_async, b_async] = gg::staging(rows_out, A, a_bf16, lda, B, b_bf16, ldb, strideB);
  if (rows_out) {
    if (K < 0) return cudaErrorInvalidValue;
    if (const cudaError_t e = row_tile_prefix(tile_scratch, offsets, E, kBX, st); e != cudaSuccess) return e;
    const unsigned grid = unsigned(sm_count > 0 ? sm_count : kDefaultSms) * kBlocksPerSm;
    const auto kernel = transB ? rows_kernel<true>(mma, a_async, b_async)
                                : rows_kernel<false>(mma, a_async, b_async);
    if (const cudaError_t e = allow_smem(kernel, kSmem); e != cudaSuccess) return e;  // 60 KiB of stages
    kernel<<<grid, kThreads, kSmem, st>>>(offsets, tile_scratch, E, N, K, alpha, A, a_bf16, lda, vecA, B, b_bf16, ldb,
                                          strideB, vecB, beta, C, c_bf16, ldc);
  } else {
    if (M <= 0) return cudaSuccess;
    const int64_t blocks = gg::wgrad_blocks(E, M, N);
    if (blocks < 0) return cudaErrorInvalidConfiguration;
    const auto kernel = wgrad_kernel(mma, a_async, b_async);
    if (const cudaError_t e = allow_smem(kernel, kSmem); e != cudaSuccess) return e;
    kernel<<<unsigned(blocks), kThreads, kSmem, st>>>(offsets, M, N, alpha, A, a_bf16, lda, vecA, B, b_bf16, ldb, vecB,
                                                      beta, C, c_bf16, ldc, strideC);
  }
  return cudaGetLastError();
}

}  // namespace ladder::cuda::k
