// CPU kernels of the recipe's optimizers (RECIPE.md section 3), templated on the scalar type like
// kernels.h: float is what training runs, double is what the tests compare against. Each works on
// one tensor slice (one matrix, or one expert's matrix); the optimizer loops over slices.
//
// Reductions (the Frobenius norms the hyperball needs) are accumulated in double over static
// chunks whose partition depends only on n and the OpenMP team size, so a step is bit-reproducible
// for a fixed thread count (resume is exact).
#pragma once
#include <cstddef>

namespace ladder::cpu {

// gscale (adam_moments, muon_momentum; kernels.h's adamw_update): every gradient element is read as
// g * gscale, one product in T, which is bitwise what scaling the gradient in memory first gave
// (the global clip factor without a pass over the gradients; 1 leaves g exactly as it is).

// Adam moments and the squared norm of Adam's direction, without storing the direction:
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;   returns sum_i U_i^2,
//   U = (m/bc1) / (sqrt(v/bc2) + eps)   (bias corrections bc = 1 - b^t passed in).
template <class T>
double adam_moments(T* m, T* v, const T* g, size_t n, T b1, T b2, T bc1, T bc2, T eps, T gscale = T(1));

// w += alpha * U with U recomputed from (m, v) as above; returns ||w||^2 after the update.
// (Recomputing U costs one sqrt per element and saves a tensor-sized scratch buffer.)
template <class T>
double adam_apply(T* w, const T* m, const T* v, size_t n, T bc1, T bc2, T eps, T alpha);

// Muon's Nesterov momentum: B = mu B + G; D = G + mu B (with the new B).
template <class T>
void muon_momentum(T* B, T* D, const T* G, size_t n, T mu, T gscale = T(1));

// w += alpha * x; returns ||w||^2 after the update.
template <class T>
double axpy_sumsq(T* w, const T* x, size_t n, T alpha);

// The 5 Newton-Schulz steps of Muon with the recipe's per-step coefficients, IN PLACE on the
// row-major [rows, cols] matrix X: X <- X / (||X||_F + 1e-8), then for each step k
//   A = X X^T,  X <- a_k X + (b_k A + c_k A^2) X.
// Tall matrices (rows > cols) are handled as their transpose without moving data: with A = X^T X
// the step is X <- a_k X + X (b_k A + c_k A^2), which is the transposed iteration.
// Cost per step with m = min(rows, cols), n = max: X X^T by syrk (m^2 n, one triangle, it is
// symmetric), A^2 by symm (2 m^3), the product with X by gemm (2 m^2 n): 3 m^2 n + 2 m^3 flops,
// against 4 m^2 n + 2 m^3 for two general products. `work` holds ns_work_size(rows, cols) values.
template <class T>
void newton_schulz5(T* X, int rows, int cols, T* work);
size_t ns_work_size(int rows, int cols);

// The recipe's per-step Newton-Schulz coefficients (a, b, c), RECIPE.md section 3.
extern const double kNsCoeffs[5][3];

}  // namespace ladder::cpu
