// Device-side arithmetic shared by the per-tensor kernels (ops.cu) and the multi-tensor ones
// (optim_ops.cu): one expression each, in cpu::adamw_update's order, so both paths round alike.
#pragma once

namespace ladder::cuda::k {

// AdamW on one element: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= lr ((m / bc1) / (sqrt(v / bc2) + eps) + wd p), with the reciprocals of the bias corrections
// taken in float on the host.
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g, float lr, float b1, float b2,
                                              float eps, float wd, float inv_bc1, float inv_bc2) {
  const float mi = b1 * m + (1.f - b1) * g;
  const float vi = b2 * v + (1.f - b2) * g * g;
  m = mi;
  v = vi;
  p -= lr * ((mi * inv_bc1) / (sqrtf(vi * inv_bc2) + eps) + wd * p);
}

}  // namespace ladder::cuda::k
