// cuDNN's fused attention ("SDPA": FlashAttention-2-style forward and backward kernels tuned by
// NVIDIA for each GPU generation) behind the CUDA backend's attention ops under bf16, opt-in by
// run.attention: cudnn | cudnn-nondeterministic or LADDER_ATTN_CUDNN (docs/cuda.md "cuDNN attention"). Run 3 measured Ladder's own tensor-core
// attention at 84-108 TFLOP/s forward and 72-99 backward on the H200, about half of FlashAttention-2.
//
// libcudnn is not linked: open() loads libcudnn.so.9 at run time (LADDER_CUDNN_LIB names another
// file), so a CUDA build runs where cuDNN is absent, with Ladder's kernels. Compiled only when the
// CUDA build found cudnn.h and cuDNN's C++ frontend headers (LADDER_HAVE_CUDNN).
//
// The contract is the bf16 attention ops' (backend.h) on the same layouts: q [B*S, H*hd], k and v
// [B*S, KV*hd], o like q, all bf16 bits; lse [B, H, S] fp32, the natural-log sum of the exponentials
// of the scaled scores, which is what cuDNN calls its stats, so either implementation's forward
// serves the other's backward. Causal, with AttnShape::window as cuDNN's left band bound (key j
// visible to query i when i - window < j <= i), GQA (H a multiple of KV). The backward's gradients
// are bf16 like its inputs (dout too): the caller widens.
#pragma once
#if LADDER_HAVE_CUDNN

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "backend/cpu/kernels.h"

namespace ladder::cuda {

class CudnnAttention {
 public:
  // nullptr, with *why, when libcudnn cannot be loaded ("cannot load ...") or gives no handle on the
  // current device. Work is queued on `stream`. deterministic: the backward is cuDNN's deterministic
  // algorithm, and a shape whose deterministic backward would keep an S x S dP matrix in its
  // workspace (cuDNN before 9.25, or not Hopper) is declined; otherwise cuDNN's faster backward that
  // adds dQ with atomics (not bitwise reproducible run to run).
  static std::unique_ptr<CudnnAttention> open(cudaStream_t stream, bool deterministic, std::string* why);
  virtual ~CudnnAttention() = default;
  // Without a device: builds this shape's two graphs for compute capability sm_version (e.g. 90)
  // and runs the frontend's checks of them (layouts, types, masks); "" when they pass, else what
  // failed (also when libcudnn cannot be loaded). A CI check of the graphs that open() would build.
  static std::string validate_graphs(const cpu::AttnShape& s, int sm_version, bool deterministic = true);

  // cuDNN's version, e.g. "9.19.0".
  virtual std::string version() const = 0;
  // Whether cuDNN runs this shape, forward AND backward (so that the two passes of a layer use one
  // implementation): the first call for a shape builds both execution plans (milliseconds to
  // seconds: a training run's first step) and sizes the workspace; later calls look them up. On
  // false, *why says what cuDNN declined. *built_now (if given): whether this call built the plans.
  virtual bool supports(const cpu::AttnShape& s, std::string* why, bool* built_now = nullptr) = 0;
  // Queue the forward / backward of a supported shape (supports() true). The pointers must be
  // 16-byte aligned (the caller checks: aligned16).
  virtual void forward(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                       const cpu::AttnShape& s) = 0;
  virtual void backward(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout, const uint16_t* q,
                        const uint16_t* k, const uint16_t* v, const uint16_t* o, const float* lse,
                        const cpu::AttnShape& s) = 0;
  // Bytes of the workspace allocated so far (the largest any plan needs).
  virtual size_t workspace_bytes() const = 0;
};

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace ladder::cuda

#endif  // LADDER_HAVE_CUDNN
