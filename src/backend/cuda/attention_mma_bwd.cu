// Register-resident tensor-core attention, backward (attention_mma.cuh). Not written yet: the
// launcher refuses, so attention_tc_kernels() must not select it.
#include "backend/cuda/attention_mma.cuh"

namespace ladder::cuda::k {

template <class E>
cudaError_t attention_mma_backward(float*, float*, float*, const float*, const E*, const E*, const E*, const float*,
                                   const float*, const cpu::AttnShape&, cudaStream_t) {
  return cudaErrorInvalidValue;
}
template cudaError_t attention_mma_backward<float>(float*, float*, float*, const float*, const float*, const float*,
                                                   const float*, const float*, const float*, const cpu::AttnShape&,
                                                   cudaStream_t);
template cudaError_t attention_mma_backward<__nv_bfloat16>(float*, float*, float*, const float*, const __nv_bfloat16*,
                                                           const __nv_bfloat16*, const __nv_bfloat16*, const float*,
                                                           const float*, const cpu::AttnShape&, cudaStream_t);

}  // namespace ladder::cuda::k
