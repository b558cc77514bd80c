// The CUDA backend: the op interface of backend/backend.h on one NVIDIA GPU (sm_80 or newer).
// Every pointer passed to it (floats, token ids, targets) is a device pointer. All ops are
// enqueued on the backend's stream and return without waiting, except the ones that return a
// value to the host (softmax_xent, softmax_xent_forward, sum_squares, adam_moments, adam_apply,
// axpy_sumsq): those wait for the stream, a host synchronization. The *_async variants below write
// the value to device memory instead, so a training step can keep the host out of the loop (the
// model integration will use them).
//
// fp32 throughout for now (docs/cuda.md): GEMMs through cuBLASLt in fp32, or TF32 when asked
// (CudaOptions::tf32, or LADDER_CUDA_TF32=1), every other op in fp32 CUDA-core kernels.
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "backend/backend.h"

namespace ladder::cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t total_mem = 0;
};

// Finds device 0 and checks that this build can run on it. Fails with one ladder::Error line:
// no device (with the runtime's reason), compute capability below 8.0, or no kernel image for it.
DeviceInfo probe_device();
// The message probe_device() would fail with, or "" when a usable device is present. Never throws.
std::string device_unavailable_reason();

struct CudaOptions {
  bool tf32 = false;  // GEMMs on the tensor cores in TF32 (about 1e-3 relative error)
  // GEMMs on the tensor cores in bf16: both operands rounded to bf16 (8-bit mantissa, about 4e-3
  // relative error per product), fp32 accumulation, fp32 output. The operands are cast into
  // scratch per call, reused by the next GEMMs that read the same operand while nothing else ran
  // (activations stay fp32 in memory). Wins over tf32.
  // Attention then runs on the tensor cores too (attention_tc.cu: bf16 MMA, fp32 softmax and
  // accumulators) for head_dim 64 and 128.
  bool bf16 = false;
  // Newton-Schulz's workspace budget (Y, A and P per matrix): a batch of matrices whose workspace
  // would exceed it runs in chunks of as many matrices as fit, at least one. Memory stays bounded
  // whatever the batch; tests set it small to run the chunking on small matrices.
  size_t ns_work_bytes = size_t(256) << 20;
  // cuDNN's fused attention under bf16 (LADDER_ATTN_CUDNN; attention_cudnn.h): where cuDNN loads and
  // runs the shape, forward and backward; elsewhere Ladder's kernels, with one line on stderr saying
  // why. Needs a build that compiled it. cudnn_nondeterministic lets cuDNN's backward add dQ with
  // atomics (not bitwise reproducible); without it only a deterministic backward that keeps no
  // S x S matrix is taken.
  bool cudnn_attention = false;
  bool cudnn_nondeterministic = false;
};

class CudaBackend : public Backend {
 public:
  virtual cudaStream_t stream() const = 0;
  virtual const DeviceInfo& device() const = 0;
  virtual bool tf32() const = 0;
  virtual bool bf16() const = 0;
  // bf16 GEMMs: how many operand casts were reused from the previous GEMM instead of redone (the
  // cast cache of cuda_backend.cpp), for tests and profiling.
  virtual uint64_t bf16_cast_reuses() const = 0;
  // How many times the bf16 mirror of registered weights was re-cast (after a write into them that
  // did not also write the mirror: adamw_multi writes both), for tests.
  virtual uint64_t bf16_mirror_casts() const = 0;
  // cuDNN attention (CudaOptions::cudnn_attention): how many attention passes (forward or backward)
  // cuDNN ran, and a line on its state: "off", "not compiled", "cuDNN 9.x.y", or why it is not used.
  virtual uint64_t cudnn_attention_calls() const = 0;
  virtual std::string cudnn_attention_status() const = 0;
  // Waits for the stream; an asynchronous fault inside a kernel becomes a ladder::Error here.
  // (Backend::synchronize.) softmax_xent_async, softmax_xent_forward_async and sum_squares_async
  // (Backend) write their sums to device memory and do not wait.

  // The recipe optimizers' three reductions without a host round trip: the same updates as
  // Backend::adam_moments, adam_apply and axpy_sumsq, but the double they return goes to *d_out
  // (device memory, overwritten) and nothing waits, so an optimizer step can keep its norms on the
  // device (e.g. for the hyperball projection) and read them, if at all, once per step.
  virtual void adam_moments_async(float* m, float* v, const float* g, size_t n, float b1, float b2, float bc1,
                                  float bc2, float eps, double* d_out) = 0;
  virtual void adam_apply_async(float* w, const float* m, const float* v, size_t n, float bc1, float bc2, float eps,
                                float alpha, double* d_out) = 0;
  virtual void axpy_sumsq_async(float* w, const float* x, size_t n, float alpha, double* d_out) = 0;
};

// Probes the device (probe_device) and builds the backend on it. Options from the environment
// override `opt`: LADDER_CUDA_TF32=1 turns TF32 GEMMs on, LADDER_CUDA_BF16=1 bf16 GEMMs, LADDER_ATTN_CUDNN=1
// cuDNN attention (=nondeterministic: with its atomic backward); LADDER_CUDA_SYNC=1 synchronizes after
// every op, so a faulting kernel is reported by the op that launched it (debugging only).
std::unique_ptr<CudaBackend> make_backend(CudaOptions opt = {});

}  // namespace ladder::cuda
