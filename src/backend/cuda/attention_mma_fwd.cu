// Register-resident tensor-core attention, forward (attention_mma.cuh). Not written yet: the
// launcher refuses, so attention_tc_kernels() must not select it.
#include "backend/cuda/attention_mma.cuh"

namespace ladder::cuda::k {

template <class E>
cudaError_t attention_mma_forward(E*, float*, const E*, const E*, const E*, const cpu::AttnShape&, cudaStream_t) {
  return cudaErrorInvalidValue;
}
template cudaError_t attention_mma_forward<float>(float*, float*, const float*, const float*, const float*,
                                                  const cpu::AttnShape&, cudaStream_t);
template cudaError_t attention_mma_forward<__nv_bfloat16>(__nv_bfloat16*, float*, const __nv_bfloat16*,
                                                          const __nv_bfloat16*, const __nv_bfloat16*,
                                                          const cpu::AttnShape&, cudaStream_t);

}  // namespace ladder::cuda::k
