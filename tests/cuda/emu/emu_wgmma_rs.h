// wgmma.mma_async with A from registers (src/backend/cuda/wgmma_attn_ptx.cuh, wg::rs), included by
// emu_cuda.h after its shared-memory-operand wgmma (emu::ptx_wgmma). From the PTX ISA's register
// fragment layout for wgmma .m64nNk16 A, as wgmma_attn_ptx.cuh reads it: warp w of the warpgroup
// holds rows 16w..16w+15 in mma.m16n8k16's A layout (lane g = l / 4, t = l % 4: a0 = (g, 2t..2t+1),
// a1 = (g + 8, 2t..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..), the lower column in the low half).
// A thread's accumulator rows g and g + 8 take their 16 k from the four lanes of its quad, so this
// is a warp-collective exchange (warp_all) of the A registers; B is read by descriptor as
// ptx_wgmma reads it (recorded, so a B tile overwritten before wait_group is caught). A register
// changed before the MMA retires is not checked (the exchange copies the values at issue).
#pragma once

namespace emu {
inline void ptx_wgmma_rs(float* d, int n, const uint32_t (&a)[4], uint64_t db, bool tb) {
  WgmmaGroups& w = wgmma_issue();
  struct Frag {
    uint32_t a[4];
  } mine{{a[0], a[1], a[2], a[3]}}, all[32];
  warp_all(mine, all, "warpgroup-collective wgmma (A from registers)");
  const int g = int(t_tid % 32) / 4;
  float A[2][16];  // this thread's rows g (h = 0) and g + 8 (h = 1), k 0..15
  for (int q = 0; q < 4; ++q) {
    const Frag& f = all[4 * g + q];  // lane (g, q) holds columns 2q, 2q + 1 and 2q + 8, 2q + 9
    for (int h = 0; h < 2; ++h)
      for (int half = 0; half < 2; ++half) {
        const uint32_t r = f.a[h + 2 * half];
        A[h][2 * q + 8 * half] = bf16_lo(r);
        A[h][2 * q + 8 * half + 1] = bf16_hi(r);
      }
  }
  wgmma_accumulate(d, n, A, db, tb, w);
}
}  // namespace emu
