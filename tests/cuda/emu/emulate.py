#!/usr/bin/env python3
"""Rewrite a CUDA source file into C++ that g++ compiles against tests/cuda/emu/emu_cuda.h.

    emulate.py IN.cu OUT.cpp

Only the syntax g++ cannot parse changes; every kernel body stays as written, and line numbers are
kept (a #line directive names the .cu file), so compiler and sanitizer reports point at the .cu.

  kernel<<<g, b[, smem[, st]]>>>(args)  ->  EMU_LAUNCH(g, b, smem, st, kernel, args)
      (EMU_LAUNCH_GRID_STRIDE for the kernels in GRID_STRIDE below: launched with at most
      emu::kGridStrideCap blocks, see emu_cuda.h)
  __shared__ [__align__(n)] T name[A][B];  ->  EMU_SHARED_A(T, name, [A][B], n);   one heap block per block
  __shared__ [__align__(n)] T name;        ->  EMU_SHARED_SCALAR(T, name, n);       (n: 1 if absent)
  extern __shared__ T name[];           ->  T* name = reinterpret_cast<T*>(::emu::g_smem);
  #pragma unroll                        ->  (empty line: g++ would warn about an unknown pragma)
  reinterpret_cast<T*>(p)               ->  ::emu::aligned_cast<T*>(p)   (dies where p is misaligned for T)

Anything else that mentions __shared__ or <<< is an error, so a new construct fails loudly here
instead of compiling into something that is not what the device runs.
"""
import os
import re
import sys

# Kernels whose every loop strides over gridDim, writing each output from one iteration only: their
# result cannot depend on the grid size, so the emulation may shrink it. A name listed here that a
# file no longer defines is an error (a rename must not silently drop the cap, or keep a wrong one).
# Not listed, on purpose: fixed-grid reductions (ssq_partial_kernel, adam_*_kernel, axpy_sumsq_kernel,
# finish kernels: the grid sets the summation order and which partials exist), grids that cover the
# problem without a stride (rmsnorm_dgain_*, the attention tile kernels).
GRID_STRIDE = {
    "ops.cu": ["embedding_fwd_kernel", "iota_kernel", "embedding_bwd_segments", "rmsnorm_fwd_kernel",
               "rmsnorm_bwd_dx_kernel", "rmsnorm_fwd_regs_kernel", "rope_kernel", "swiglu_fwd_kernel",
               "swiglu_bwd_kernel", "xent_kernel",
               "add_kernel", "scale_kernel", "adamw_kernel", "scale_matrix_kernel", "cast_kernel",
               "f32_to_bf16_2d_kernel", "f32_to_bf16_rows_kernel", "fill_uniform_kernel"],
    "attention.cu": ["attn_bwd_dot_kernel"],
    "switch_ops.cu": ["pko_fwd_kernel", "pko_bwd_kernel", "qk_prep_fwd_kernel", "qk_prep_bwd_kernel",
                      "qk_prep_fwd_regs_kernel", "qk_prep_bwd_regs_kernel",
                      "xsa_fwd_kernel", "xsa_bwd_kernel",
                      "head_gate_fwd_kernel", "head_gate_bwd_kernel", "silu_fwd_kernel", "silu_bwd_kernel",
                      "sigmoid_gate_fwd_kernel", "sigmoid_gate_bwd_kernel"],
    "optim_ops.cu": ["muon_momentum_kernel", "scale_by_inv_norm_kernel", "ns_poly_init_kernel", "axpy_kernel",
                     "scale_to_radius_kernel", "batch_ns_poly_init_kernel"],
    # moe_ops.cu: not listed, on purpose: radix_select_kernel (one block per column),
    # row_tile_prefix_kernel (one block), grouped_wgrad_kernel (one block per tile, no stride),
    # capacity_overflow_kernel (one warp).
    "moe_ops.cu": ["route_kernel", "balance_values_kernel", "router_backward_kernel", "gather_kernel",
                   "combine_kernel", "combine_backward_kernel", "gather_backward_kernel", "iota_kernel",
                   "invert_perm_kernel", "offsets_from_sorted_kernel", "transpose_keys_kernel",
                   "grouped_rows_kernel", "count_load_kernel", "pko_resets_kernel", "capacity_rows_kernel",
                   "capacity_fill_kernel", "zero_rows_kernel"],
    "attention_tc.cu": ["tc_bwd_dot_kernel"],
}


def fail(msg):
    sys.exit(f"emulate.py: {msg}")


def split_top(s):
    """Split on commas outside (), [], {}."""
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return out


def keep_lines(old, new):
    """Pad `new` with the newlines `old` had, so later lines keep their numbers."""
    return new + "\n" * (old.count("\n") - new.count("\n"))


def rewrite(src, name):
    stride = set(GRID_STRIDE.get(name, []))
    for k in stride:
        if not re.search(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?" + k + r"\b", src):
            fail(f"{name}: GRID_STRIDE names {k}, which the file does not define as a kernel")

    src = re.sub(r"^[ \t]*#pragma\s+unroll.*$", "", src, flags=re.M)

    # Every cast to a pointer checks the pointer's alignment for the pointee type (emu_cuda.h,
    # emu::aligned_cast): the device faults on a misaligned vector access (a float4 load at an
    # 8-byte boundary), which the host would run without a word.
    src = re.sub(r"\breinterpret_cast<([^<>;]*\*)\s*>\s*\(", r"::emu::aligned_cast<\1>(", src)

    def dyn(m):
        return f"{m.group(1)}* {m.group(2)} = reinterpret_cast<{m.group(1)}*>(::emu::g_smem);"
    src = re.sub(r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([A-Za-z_][\w:]*(?:\s+[A-Za-z_]\w*)*?)\s+"
                 r"([A-Za-z_]\w*)\s*\[\s*\]\s*;", dyn, src)

    # One or more declarators: `__shared__ float a[N], b[N];` becomes one EMU_SHARED per array.
    decl = r"[A-Za-z_]\w*\s*(?:\[[^\]]+\]\s*)+"

    # An __align__(n) after __shared__ is passed on (emu_cuda.h allocates up to 16-byte alignment and
    # refuses more); a scalar (`__shared__ int s_rank;`) becomes a reference to a one-element block.
    def stat(m):
        out = []
        align = m.group(1) or "1"
        for d in split_top(m.group(3)):
            dm = re.fullmatch(r"([A-Za-z_]\w*)\s*((?:\[[^\]]+\]\s*)*)", d)
            dims = re.sub(r"\s+", "", dm.group(2))
            if dims:
                out.append(f"EMU_SHARED_A({m.group(2)}, {dm.group(1)}, {dims}, {align});")
            else:
                out.append(f"EMU_SHARED_SCALAR({m.group(2)}, {dm.group(1)}, {align});")
        return keep_lines(m.group(0), " ".join(out))
    decl = r"[A-Za-z_]\w*\s*(?:\[[^\]]+\]\s*)*"
    src = re.sub(rf"(?<![\w])__shared__\s+(?:__align__\(\s*(\d+)\s*\)\s+)?([A-Za-z_][\w:]*(?:<[^<>;]*>)?)\s+"
                 rf"({decl}(?:,\s*{decl})*);", stat, src)

    launches = 0

    def launch(m):
        nonlocal launches
        launches += 1
        kernel, cfg = m.group(1), split_top(m.group(2))
        if not 2 <= len(cfg) <= 4:
            fail(f"{name}: launch of {kernel} with {len(cfg)} configuration arguments")
        cfg += ["0", "nullptr"][len(cfg) - 2:]
        base = re.sub(r"<.*", "", kernel)
        macro = "EMU_LAUNCH_GRID_STRIDE" if base in stride else "EMU_LAUNCH"
        empty = m.group(3) == ")"
        return keep_lines(m.group(0), f"{macro}({', '.join(cfg)}, {kernel}" + (")" if empty else ", "))
    src = re.sub(r"([A-Za-z_][\w:]*(?:<[^<>;()]*>)?)\s*<<<(.*?)>>>\s*\(\s*(\)?)", launch, src, flags=re.S)

    code = re.sub(r"//.*", "", src)  # comments may mention them
    for bad in ("__shared__", "<<<", ">>>"):
        if bad in code:
            line = code[:code.index(bad)].count("\n") + 1
            fail(f"{name}:{line}: '{bad}' in a form emulate.py does not rewrite")
    return src, launches


def main():
    if len(sys.argv) != 3:
        fail("usage: emulate.py IN.cu OUT.cpp")
    path, out = sys.argv[1], sys.argv[2]
    with open(path) as f:
        src = f.read()
    body, n = rewrite(src, os.path.basename(path))
    text = ('// Generated by tests/cuda/emu/emulate.py from ' + os.path.basename(path) + ': do not edit.\n'
            '#include "emu_cuda.h"\n'
            f'#line 1 "{os.path.abspath(path)}"\n' + body)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    # Write only when changed, so an unchanged rewrite does not recompile.
    if not os.path.exists(out) or open(out).read() != text:
        with open(out + ".tmp", "w") as f:
            f.write(text)
        os.replace(out + ".tmp", out)
    print(f"emulate.py: {path}: {n} launches rewritten")


if __name__ == "__main__":
    main()
