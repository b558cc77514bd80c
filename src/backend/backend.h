// The op interface the model is written against. The CPU backend (backend/cpu) implements it with
// OpenBLAS + OpenMP and doubles as the reference a CUDA backend is tested against. Pointers are
// pointers of the backend's memory (the MemorySpace it is: host memory for the CPU, device memory
// for CUDA); shapes and conventions are those of backend/cpu/kernels.h, moe_kernels.h and
// optim_kernels.h. Ops are ordered as called; only the ones returning a value to the host wait.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cpu/moe_kernels.h"
#include "backend/cpu/optim_kernels.h"
#include "core/memory.h"

namespace ladder {

using cpu::AttnShape;
using cpu::XentSums;

// Times ops on a backend's own clock (a device's stream: `ladder bench --profile` without a host
// wait per op): begin() just before an op is enqueued, end(op) just after; take_totals() waits for
// the queued work and returns the seconds per op name since its last call.
class OpTimer {
 public:
  virtual ~OpTimer() = default;
  virtual void begin() = 0;
  virtual void end(const std::string& op) = 0;
  virtual std::map<std::string, double> take_totals() = 0;
};

// One tensor of a multi-tensor optimizer op (adamw_multi, adamh_multi). Pointers are backend memory.
struct OptimTensor {
  float* w = nullptr;             // weights
  const float* g = nullptr;       // gradient
  float* m = nullptr;             // Adam's first moment
  float* v = nullptr;             // Adam's second moment
  size_t n = 0;                   // elements of the whole tensor
  int64_t nmat = 1;               // hyperball: matrices in the tensor (E for [E, out, in]), n / nmat each
  const float* radius = nullptr;  // hyperball: nmat radii
  int group = 0;                  // index into the op's per-group scalars (lr, wd)
  bool operator==(const OptimTensor& o) const {
    return w == o.w && g == o.g && m == o.m && v == o.v && n == o.n && nmat == o.nmat && radius == o.radius &&
           group == o.group;
  }
};

// Data-parallel collectives in a device backend's own memory (NCCL on the CUDA backend): what the
// job's Comm (dist/comm.h) uses when every rank can, instead of a round trip through host memory.
// Host backends have none (MPI reads their memory where it is).
class DeviceCollectives {
 public:
  enum class State { kUndecided, kInUse, kNotUsed };
  virtual ~DeviceCollectives() = default;
  // Why this process cannot use them ("" when it can), found without talking to other ranks (no
  // NCCL library, ...).
  virtual std::string unavailable() = 0;
  // This process's device, unique across machines (NCCL needs a device of its own per rank).
  virtual std::string device_id() const = 0;
  // On rank 0: a new job id (NCCL's unique id), which the caller sends to every rank.
  virtual std::vector<uint8_t> new_job_id() = 0;
  // On every rank together, with rank 0's id: joins the job (kInUse after it).
  virtual void join(const std::vector<uint8_t>& id, int rank, int world) = 0;
  virtual void set_not_used() = 0;  // kNotUsed: the ranks decided on host memory
  virtual State state() const = 0;
  virtual std::string describe() const = 0;  // e.g. "NCCL 2.28.3"
  // In place over the ranks, ordered on the backend's stream after the ops enqueued before (nothing
  // waits for the host). Every rank gets the same bits.
  virtual void allreduce_sum(float* p, size_t n) = 0;
  virtual void allreduce_sum(double* p, size_t n) = 0;
  virtual void allreduce_mean(double* p, size_t n) = 0;
  // Rank r gets the sum over the ranks of the floats [offsets[r], offsets[r + 1]) of p, in place
  // (offsets: world + 1 values); the rest of p is left undefined: a sharded optimizer's gradients.
  virtual void reduce_scatter_ranges(float* p, const std::vector<size_t>& offsets) = 0;
  // Rank r's floats [offsets[r], offsets[r + 1]) of p sent to every rank (offsets: world + 1
  // values), in place: a sharded optimizer's updated weights (Comm::allgather_ranges).
  virtual void allgather_ranges(float* p, const std::vector<size_t>& offsets) = 0;
};

class Backend : public MemorySpace {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                    const float* B, int ldb, float beta, float* C, int ldc) = 0;
  // gemm() in fp32 arithmetic whatever run.precision says (no TF32, no bf16 operands): the
  // recipe's fp32 router (RECIPE.md section 2), whose logits pick the experts. Small GEMMs (E
  // columns), so the CUDA cores' fp32 rate costs little.
  virtual void gemm_fp32(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                         int ldb, float beta, float* C, int ldc) = 0;
  // D = alpha * op(A) op(B) + C, C and D [M, N] with leading dimension ldc (D may be C): the residual
  // add fused into the GEMM (cuBLASLt reads C and writes D in its epilogue), instead of a copy of C
  // into D and a GEMM with beta = 1 — one pass over D less.
  virtual void gemm_add(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                        int ldb, const float* C, float* D, int ldc) = 0;
  // gemm() with B given as bf16 bits (uint16_t, leading dimension ldb): the product gemm() computes
  // on B's fp32 value (a bf16 widens exactly), so the result equals widening B first, without that
  // pass. For weight gradients of activations kept in bf16 (model.saved_activations) that only GEMMs
  // read; under bf16 GEMMs the copy is read as it is, with no cast either.
  virtual void gemm_b16(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const uint16_t* B,
                        int ldb, float beta, float* C, int ldc) = 0;
  // The general GEMM with typed operands: D = alpha * op(A) op(B) + beta * C_in, where A, B and D
  // are each fp32 or bf16 bits (a_bf16, b_bf16, d_bf16; uint16_t storage, leading dimensions as
  // gemm()). C_in is fp32: nullptr reads the addend from D (gemm()'s C); a bf16 D takes no addend
  // (beta 0, C_in nullptr). A bf16 operand is its exactly widened fp32 value; a bf16 D is the fp32
  // result rounded to nearest even. The CPU computes exactly that (widen, sgemm, round): the
  // reference. For the bf16 dense MLP (model.mlp_bf16); gemm, gemm_add and gemm_b16 are its fp32
  // special cases.
  virtual void gemm_ex(bool ta, bool tb, int M, int N, int K, float alpha, const void* A, bool a_bf16, int lda,
                       const void* B, bool b_bf16, int ldb, float beta, const float* C_in, void* D, bool d_bf16,
                       int ldc) = 0;
  // `count` GEMMs of one shape over stacked operands (one strided-batched launch on a GPU): product
  // i is gemm_ex on A + i * (ta ? K : M) * lda, B + i * (tb ? N : K) * ldb and C + i * M * ldc,
  // i.e. each operand is `count` matrices stored one after another with their leading dimension.
  // Types and rules as gemm_ex (a bf16 C takes beta 0). For the MoE capacity layout
  // (model.moe_capacity): every expert's first C rows at e * C, so the expert GEMMs are batches.
  virtual void batched_gemm_ex(int count, bool ta, bool tb, int M, int N, int K, float alpha, const void* A,
                               bool a_bf16, int lda, const void* B, bool b_bf16, int ldb, float beta, void* C,
                               bool c_bf16, int ldc) = 0;
  // Grouped GEMM over per-expert row blocks (see cpu::grouped_gemm for the two shapes).
  virtual void grouped_gemm(bool rows_out, bool transB, int E, const int32_t* offsets, int M, int N, int K,
                            float alpha, const float* A, int lda, const float* B, int ldb, size_t strideB,
                            float beta, float* C, int ldc, size_t strideC) = 0;
  // grouped_gemm with typed operands, for the bf16 MoE experts (model.moe_bf16): A, B and C each
  // fp32 or bf16 bits (uint16_t storage). `rows` bounds offsets[E], the row count of A (and of C
  // for rows_out) that the caller's buffers hold: a backend widening a bf16 operand into scratch
  // sizes it from `rows`, never by reading the offsets (the CPU checks offsets[E] <= rows; on a
  // device a smaller `rows` is undefined: the model passes tokens * top_k, which offsets[E] always
  // equals, every token having top_k slots). A bf16 C takes no addend (beta 0) and is
  // packed (ldc == N; rows_out = false: strideC == M * N). The values are the CPU reference's steps:
  // widen, fp32 grouped GEMM, round to nearest even; grouped_gemm is its all-fp32 case.
  virtual void grouped_gemm_ex(bool rows_out, bool transB, int E, const int32_t* offsets, int rows, int M, int N,
                               int K, float alpha, const void* A, bool a_bf16, int lda, const void* B, bool b_bf16,
                               int ldb, size_t strideB, float beta, void* C, bool c_bf16, int ldc,
                               size_t strideC) = 0;
  virtual void embedding_forward(float* out, const float* table, const int32_t* ids, int N, int D) = 0;
  virtual void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int N, int D) = 0;
  virtual void rmsnorm_forward(float* y, float* rstd, const float* x, const float* gain, int N, int D, float eps) = 0;
  virtual void rmsnorm_backward(float* dx, float* dgain, const float* dy, const float* x, const float* gain,
                                const float* rstd, int N, int D, bool accumulate_dx) = 0;
  // rmsnorm_forward with y written as bf16 bits (model.norm_bf16): the fp32 result rounded to
  // nearest even; rstd fp32.
  virtual void rmsnorm_forward_bf16(uint16_t* y, float* rstd, const float* x, const float* gain, int N, int D,
                                    float eps) = 0;
  virtual void rope_forward(float* x, int N_tok, int S, int nheads, int hd, int rot_dims, float theta) = 0;
  virtual void rope_backward(float* dx, int N_tok, int S, int nheads, int hd, int rot_dims, float theta) = 0;
  virtual void attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                                 const AttnShape& s) = 0;
  virtual void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                                  const float* k, const float* v, const float* o, const float* lse,
                                  const AttnShape& s) = 0;
  // SwiGLU over the rows in use of [rows, cols] tensors: the first min(rows, *rows_used) rows, the
  // count in backend memory (the capacity layout's, cpu::moe_capacity), the rest not touched.
  // swiglu_forward / swiglu_forward_bf16 (h16: g, u and h bf16 bits) and swiglu_backward /
  // swiglu_backward_bf16 / swiglu_backward_bf16_grads (d16: dh, dg and du bf16 bits too, needs h16)
  // on those elements. A device sizes its launch by `rows` and reads the count there, so nothing
  // waits for the host.
  virtual void swiglu_forward_rows(void* h, const void* g, const void* u, bool h16, int64_t rows, int cols,
                                   const int32_t* rows_used) = 0;
  virtual void swiglu_backward_rows(void* dg, void* du, const void* dh, const void* g, const void* u, bool h16,
                                    bool d16, int64_t rows, int cols, const int32_t* rows_used) = 0;
  // The SwiGLU op the flags name, on n elements (the dispatch the model's ops and the CPU's *_rows
  // ops share): swiglu_forward or swiglu_forward_bf16 (h16: g, u and h bf16 bits); swiglu_backward,
  // swiglu_backward_bf16 or swiglu_backward_bf16_grads (d16: dh, dg and du too; needs h16).
  void swiglu_forward_typed(void* h, const void* g, const void* u, bool h16, size_t n);
  void swiglu_backward_typed(void* dg, void* du, const void* dh, const void* g, const void* u, bool h16, bool d16,
                             size_t n);
  virtual void swiglu_forward(float* h, const float* g, const float* u, size_t n) = 0;
  virtual void swiglu_backward(float* dg, float* du, const float* dh, const float* g, const float* u, size_t n) = 0;
  // SwiGLU on bf16 gate / up (model.mlp_bf16): swiglu_forward / swiglu_backward on their widened
  // values, in fp32; the forward's output h rounded to bf16, the backward's dg / du fp32.
  virtual void swiglu_forward_bf16(uint16_t* h, const uint16_t* g, const uint16_t* u, size_t n) = 0;
  virtual void swiglu_backward_bf16(float* dg, float* du, const float* dh, const uint16_t* g, const uint16_t* u,
                                    size_t n) = 0;
  // swiglu_backward_bf16 with its gradients in bf16 too (model.moe_bf16_grads): dh widened, dg and
  // du the fp32 results rounded to nearest even.
  virtual void swiglu_backward_bf16_grads(uint16_t* dg, uint16_t* du, const uint16_t* dh, const uint16_t* g,
                                          const uint16_t* u, size_t n) = 0;
  virtual XentSums softmax_xent(float* logits, const int32_t* targets, int N, int V, float z_coef, float grad_scale) = 0;
  virtual XentSums softmax_xent_forward(const float* logits, const int32_t* targets, int N, int V, float* losses) = 0;
  virtual void add_inplace(float* y, const float* x, size_t n) = 0;
  virtual void scale_inplace(float* x, float s, size_t n) = 0;
  virtual double sum_squares(const float* x, size_t n) = 0;
  // The same three without a host round trip: the sums go to backend memory (sums[0] = sum of
  // xent, sums[1] = sum of lse^2; *out = sum of squares), overwritten, so a step can read them once.
  virtual void softmax_xent_async(float* logits, const int32_t* targets, int N, int V, float z_coef,
                                  float grad_scale, double* sums) = 0;
  virtual void softmax_xent_forward_async(const float* logits, const int32_t* targets, int N, int V,
                                          float* losses, double* sums) = 0;
  virtual void sum_squares_async(const float* x, size_t n, double* out) = 0;
  // bf16 storage of saved activations (model.saved_activations): out = bf16(in), round to nearest
  // even, as uint16_t bits; and back, exactly. Both pointers are this backend's memory.
  virtual void to_bf16(uint16_t* out, const float* in, size_t n) = 0;
  virtual void from_bf16(float* out, const uint16_t* in, size_t n) = 0;
  // Recipe switches in attention and norms (contracts in backend/cpu/kernels.h).
  virtual void pko_resets(uint8_t* reset, const int32_t* ids, int N_tok, int S, int eod_id) = 0;
  virtual void pko_shift_forward(float* out, const float* k, const uint8_t* reset, int N_tok, int nkv, int hd,
                                 int from_dim) = 0;
  virtual void pko_shift_backward(float* dk, const float* dout, const uint8_t* reset, int N_tok, int nkv, int hd,
                                  int from_dim) = 0;
  // Queries / keys into attention in one op: RoPE(QK-norm(PKO shift of dims [hd/2, hd), when reset
  // is not nullptr)) per head row; backward from the raw x and rstd (cpu::qk_prep_forward/backward).
  virtual void qk_prep_forward(float* out, float* rstd, const float* x, const float* gain, const uint8_t* reset,
                               int N_tok, int S, int nheads, int hd, int rot_dims, float theta, bool norm,
                               float eps) = 0;
  virtual void qk_prep_backward(float* dx, float* dgain, const float* dout, const float* x, const float* gain,
                                const float* rstd, const uint8_t* reset, int N_tok, int S, int nheads, int hd,
                                int rot_dims, float theta, bool norm) = 0;
  virtual void xsa_forward(float* z, const float* y, const float* v, int N_tok, int H, int KV, int hd) = 0;
  virtual void xsa_backward(float* dy, float* dv, const float* dz, const float* y, const float* v, int N_tok, int H,
                            int KV, int hd) = 0;
  virtual void head_gate_forward(float* out, float* factor, const float* x, const float* logit, int N_tok, int H,
                                 int hd) = 0;
  virtual void head_gate_backward(float* dx, float* dlogit, const float* dout, const float* x, const float* factor,
                                  int N_tok, int H, int hd) = 0;
  // The attention block in bf16 (model.attn_bf16): the ops above with their [tokens, heads * hd]
  // activations as bf16 bits (uint16_t). Each computes its fp32 form on the exactly widened bf16
  // inputs and rounds its bf16 outputs to nearest even; row statistics (rstd, lse, gate factors)
  // and every gradient stay fp32. The CPU computes exactly that (widen, fp32 kernel, round): the
  // reference. Attention's backward reads the bf16 output o (D = rowsum(dO * o)), the rounded
  // value the next op saw.
  virtual void qk_prep_forward_bf16(uint16_t* out, float* rstd, const uint16_t* x, const float* gain,
                                    const uint8_t* reset, int N_tok, int S, int nheads, int hd, int rot_dims,
                                    float theta, bool norm, float eps) = 0;
  virtual void qk_prep_backward_bf16(float* dx, float* dgain, const float* dout, const uint16_t* x, const float* gain,
                                     const float* rstd, const uint8_t* reset, int N_tok, int S, int nheads, int hd,
                                     int rot_dims, float theta, bool norm) = 0;
  virtual void attention_forward_bf16(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                      const AttnShape& s) = 0;
  virtual void attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const uint16_t* q,
                                       const uint16_t* k, const uint16_t* v, const uint16_t* o, const float* lse,
                                       const AttnShape& s) = 0;
  virtual void xsa_forward_bf16(uint16_t* z, const uint16_t* y, const uint16_t* v, int N_tok, int H, int KV,
                                int hd) = 0;
  virtual void xsa_backward_bf16(float* dy, float* dv, const float* dz, const uint16_t* y, const uint16_t* v,
                                 int N_tok, int H, int KV, int hd) = 0;
  virtual void head_gate_forward_bf16(uint16_t* out, float* factor, const uint16_t* x, const float* logit, int N_tok,
                                      int H, int hd) = 0;
  virtual void head_gate_backward_bf16(float* dx, float* dlogit, const float* dout, const uint16_t* x,
                                       const float* factor, int N_tok, int H, int hd) = 0;
  virtual void silu_forward(float* a, const float* u, size_t n) = 0;
  virtual void silu_backward(float* du, const float* da, const float* u, size_t n) = 0;
  virtual void sigmoid_gate_forward(float* y, float* g, const float* x, size_t n) = 0;
  // sigmoid_gate_forward with y written as bf16 bits (GatedNorm's output under model.norm_bf16);
  // the sigmoid g stays fp32.
  virtual void sigmoid_gate_forward_bf16(uint16_t* y, float* g, const float* x, size_t n) = 0;
  virtual void sigmoid_gate_backward(float* dx, float* dg, const float* dy, const float* x, const float* s, size_t n,
                                     bool accumulate_dx) = 0;
  // MoE dispatch (contracts in backend/cpu/moe_kernels.h). Offsets stay in backend memory:
  // grouped_gemm reads them there, so no op of a step needs the host to see the routing.
  virtual void moe_route(float* lse, int32_t* expert, float* comb, const float* logits, const float* bias, int N,
                         int E, int K, bool normalized, double route_scale) = 0;
  virtual void moe_sort(int32_t* offsets, int32_t* row, int32_t* slot, const int32_t* expert, int NK, int E) = 0;
  // The capacity layout of the sorted rows (model.moe_capacity; cpu::moe_capacity has the contract):
  // row OVERWRITTEN with each slot's row in it, cslot [R] with each row's slot, -1 (padding) or -2
  // (unused), ov [E+2] the overflow blocks' offsets and, last, the rows in use. All in backend
  // memory, like moe_sort's.
  virtual void moe_capacity(int32_t* row, int32_t* cslot, int32_t* ov, const int32_t* offsets, const int32_t* slot,
                            int NK, int E, int C, int R) = 0;
  // Zero the rows q < rows of x (cols elements each, packed; fp32, or bf16 bits when bf16) whose
  // cslot[q] is negative: the capacity layout's padding rows of a gradient the combine's backward
  // does not write.
  virtual void moe_zero_rows(void* x, bool bf16, const int32_t* cslot, int rows, int cols) = 0;
  // moe_gather / moe_gather_bf16 write NK rows; a row whose slot is -1 is zeros (the capacity
  // layout's padding), one whose slot is below -1 is left as it is (its unused rows).
  virtual void moe_gather(float* xs, const float* h, const int32_t* slot, int NK, int K, int d) = 0;
  virtual void moe_gather_bf16(uint16_t* xs, const float* h, const int32_t* slot, int NK, int K, int d) = 0;
  virtual void moe_combine(float* out, const float* y, const float* comb, const int32_t* row, int N, int K,
                           int d) = 0;
  virtual void moe_combine_backward(float* dy, float* dcomb, const float* dout, const float* y, const float* comb,
                                    const int32_t* row, int N, int K, int d) = 0;
  // moe_combine / moe_combine_backward with y in bf16 bits (model.moe_bf16's expert outputs).
  virtual void moe_combine_bf16(float* out, const uint16_t* y, const float* comb, const int32_t* row, int N, int K,
                                int d) = 0;
  virtual void moe_combine_backward_bf16(float* dy, float* dcomb, const float* dout, const uint16_t* y,
                                         const float* comb, const int32_t* row, int N, int K, int d) = 0;
  // moe_combine_backward_bf16 with the row gradients dy written as bf16 bits, the fp32 values rounded
  // to nearest even (model.moe_bf16_grads); dcomb stays fp32.
  virtual void moe_combine_backward_bf16_grads(uint16_t* dy, float* dcomb, const float* dout, const uint16_t* y,
                                               const float* comb, const int32_t* row, int N, int K, int d) = 0;
  virtual void moe_gather_backward(float* dh, const float* dx, const int32_t* row, int N, int K, int d) = 0;
  virtual void moe_router_backward(float* ds, const float* logits, const float* lse, const int32_t* expert,
                                   const float* dcomb, int N, int E, int K, bool normalized, double route_scale,
                                   float z_scale) = 0;
  virtual void moe_balance_values(float* vals, const float* logits, const float* bias, int N, int E, int K) = 0;
  // beta [E] doubles in backend memory.
  virtual void moe_quantile_beta(double* beta, const float* vals, int64_t T, int E, int K) = 0;
  // bias [E] floats from beta [E] doubles, both in backend memory (no host round trip).
  virtual void moe_balance_bias(float* bias, const double* beta, int E) = 0;
  virtual void moe_count_load(int64_t* load, const int32_t* offsets, int E) = 0;
  virtual void adamw_update(float* p, const float* g, float* m, float* v, size_t n, float lr, float b1,
                            float b2, float eps, float wd, float bc1, float bc2) = 0;
  // The recipe's optimizers (backend/cpu/optim_kernels.h has the contracts). Norms come back as
  // double sums of squares so the hyperball projection is taken in double.
  virtual double adam_moments(float* m, float* v, const float* g, size_t n, float b1, float b2, float bc1,
                              float bc2, float eps) = 0;
  virtual double adam_apply(float* w, const float* m, const float* v, size_t n, float bc1, float bc2, float eps,
                            float alpha) = 0;
  // grad_factor (here and in adamw_multi / adamh_multi): nullptr, or a float in backend memory that
  // scales every gradient element as it is read (G * *grad_factor, one float product): the global
  // clip factor (grad_clip_factor), so clipping costs no pass over the gradients. The gradients in
  // memory are left as they are.
  virtual void muon_momentum(float* B, float* D, const float* G, size_t n, float mu,
                             const float* grad_factor) = 0;
  virtual double axpy_sumsq(float* w, const float* x, size_t n, float alpha) = 0;
  // Muon's orthogonalization of one row-major [rows, cols] matrix, in place (normalization + the 5
  // Newton-Schulz steps); the backend owns the workspace.
  virtual void newton_schulz5(float* X, int rows, int cols) = 0;
  // newton_schulz5 on each of `count` equally shaped [rows, cols] matrices stored back to back
  // (matrix e at X + e * rows * cols), each normalized by its own Frobenius norm: the result is the
  // per-matrix loop's (bitwise on the CPU). One call for an [E, out, in] expert stack, so a GPU
  // backend runs strided-batched GEMMs instead of E times 15 small ones.
  virtual void newton_schulz5_batched(float* X, int rows, int cols, int count) = 0;

  // ---- Optimizer steps without host waits ---------------------------------------------------
  // The ops above that return a double make the host wait for the backend (on a GPU: a stalled
  // pipeline per matrix). The ops below take every per-matrix scalar from backend memory and
  // return nothing, so a whole optimizer step (and the gradient clipping before it) is enqueued
  // without a wait. On the CPU they compute exactly what the host-side code computed before
  // (same kernels, same double arithmetic), so CPU results are bitwise unchanged.

  // Multi-tensor AdamW: adamw_update on every tensor of `t` (w, g, m, v, n; nmat and radius
  // unused) with lr[t.group] and wd[t.group]. A GPU backend runs them in one launch (it may cache
  // a device copy of the descriptor list, keyed by its contents: pass the same list each step).
  // A GPU backend that keeps a bf16 mirror of the weights (register_weights) may write the mirror's
  // copy of each updated weight in the same pass, so the next bf16 GEMM does not re-cast them.
  virtual void adamw_multi(const OptimTensor* t, size_t count, const float* lr, const float* wd, int ngroups,
                           float b1, float b2, float eps, float bc1, float bc2,
                           const float* grad_factor) = 0;
  // Multi-tensor AdamH (hyperball Adam) over every matrix e of every tensor (t.nmat matrices of
  // n / nmat elements, radii R_e = t.radius[e] in backend memory), with lr = lr[t.group]:
  //   uu = adam_moments(...);  alpha = float(-lr * R / max(sqrt(uu), 1e-10))   (double, then float)
  //   ww = adam_apply(..., alpha);  w *= float(R / sqrt(ww)).
  virtual void adamh_multi(const OptimTensor* t, size_t count, const double* lr, int ngroups, float b1, float b2,
                           float eps, float bc1, float bc2, const float* grad_factor) = 0;
  // MuonH's projection of one matrix, R = *radius (backend memory):
  //   xx = ||D||^2;  alpha = float(-lr * R / max(sqrt(xx), 1e-10));  ww = axpy_sumsq(w, D, alpha);
  //   w *= float(R / sqrt(ww)).
  virtual void muonh_apply(float* w, const float* D, size_t n, const float* radius, double lr) = 0;
  // muonh_apply on each of `count` matrices of n elements stored back to back: matrix e is
  // w + e n and D + e n with radius[e] (backend memory). The same result as the per-matrix loop
  // (bitwise on the CPU); a GPU backend runs all matrices in a fixed number of launches.
  virtual void muonh_apply_batched(float* w, const float* D, size_t n, int count, const float* radius,
                                   double lr) = 0;
  // w += alpha * x (axpy_sumsq without the returned norm: plain Muon's update).
  virtual void axpy(float* w, const float* x, size_t n, float alpha) = 0;
  // Global-norm clipping, device side. sums[0, count): per-tensor sums of squares (backend memory).
  //   s = sums[0] + sums[1] + ... (in index order, double);  *norm = sqrt(s);
  //   *factor = clip > 0 && *norm > clip ? float(clip / (*norm + 1e-6)) : 1.0f
  // norm (double) and factor (float) are backend memory.
  virtual void grad_clip_factor(const double* sums, size_t count, double clip, double* norm, float* factor) = 0;
  // out[i] = sum_squares(x[i], n[i]) for every i < count (out: backend memory; x, n: host arrays
  // of backend pointers and sizes), in double: the per-tensor sums grad_clip_factor adds. A GPU
  // backend runs all of them in a fixed number of launches (it may cache a device copy of the
  // list, keyed by its contents: pass the same list each step); the order of each sum is fixed by
  // its n, so the result is bitwise reproducible.
  virtual void sum_squares_multi(const float* const* x, const size_t* n, size_t count, double* out) = 0;

  // The model's weights live in [base, base + bytes) of this backend's memory (the parameter arena).
  // A backend may keep a derived copy of them (the CUDA backend's bf16 mirror for bf16 GEMMs, made
  // once per optimizer step instead of once per GEMM); it must notice every write into the range
  // through its own ops. Unregister before the memory is freed.
  virtual void register_weights(const void* base, size_t bytes) { (void)base, (void)bytes; }
  // Device memory in use on the backend's device, in bytes (the CUDA backend: total minus free, as
  // the driver reports it, so other processes and the context count too); -1 where not known.
  virtual double device_memory_used() const { return -1; }
  // An OpTimer on this backend's clock; nullptr where the host clock is the op's (the CPU).
  virtual std::unique_ptr<OpTimer> make_op_timer() { return nullptr; }
  // Bytes of fp32 logits the LM head computes at once (the Transformer's rows per chunk: this over
  // 4 V, at least 64). The CPU: 16 MiB (4 Mi logits, 128 rows at V = 32768), near what its caches
  // keep between the head GEMM, the fused softmax-xent and the two gradient GEMMs that read it. A
  // GPU overrides it with far more: 128-row chunks make GEMMs too thin for the tensor cores and
  // reread the fp32 head gradient (V x d) once per chunk.
  virtual size_t lm_head_chunk_bytes() const { return size_t(16) << 20; }
  virtual void unregister_weights(const void* base) { (void)base; }
  // The backend's device-memory collectives (owned by it), or nullptr: host backends, and device
  // backends without any (their data-parallel sums go through host memory).
  virtual DeviceCollectives* collectives() { return nullptr; }
  // [p, p + bytes) of this backend's memory was written by something other than its ops (the
  // collectives' library: NCCL's sums and broadcasts, on the backend's stream): what the backend
  // derived from it is stale (the CUDA backend's bf16 weight mirror and GEMM cast cache). The Comm
  // calls it after every device collective.
  virtual void note_external_write(const void* p, size_t bytes) { (void)p, (void)bytes; }
};

// The elements swiglu_*_rows covers with its row count in host memory: min(rows, *rows_used) rows
// of cols (the CPU's; a device reads the count in its kernels).
inline size_t rows_in_use(int64_t rows, int cols, const int32_t* rows_used) {
  const int64_t r = *rows_used < 0 ? 0 : *rows_used < rows ? *rows_used : rows;
  return r > 0 && cols > 0 ? size_t(r) * size_t(cols) : 0;
}

// Backend::grouped_gemm_ex's shape rules for a bf16 C (beta 0, packed), one clear error each;
// every backend calls it first.
void check_grouped_gemm_ex(bool rows_out, int E, int M, int N, float beta, bool c_bf16, int ldc, size_t strideC);

// The CPU backend. `threads` <= 0: all cores. Sets the OpenMP and OpenBLAS thread counts.
std::unique_ptr<Backend> make_cpu_backend(int threads);
// The number of threads the CPU backend runs with.
int cpu_threads();

// The CUDA backend (backend/cuda, docs/cuda.md): pointers are device pointers. Fails with one
// clear line when this build has no CUDA, no device is found, or it is older than sm_80.
// `precision` (run.precision): "fp32", "tf32" or "bf16" GEMMs (docs/cuda.md); `attention`
// (run.attention): "ladder", "cudnn" or "cudnn-nondeterministic".
std::unique_ptr<Backend> make_cuda_backend(const std::string& precision = "fp32", const std::string& attention = "ladder");
// Checks run.device before a model is built: "cpu" passes; "cuda" probes the device and fails with
// the one-line errors above when this build or this machine cannot run it; anything else is named.
void check_run_device(const std::string& device);
// The backend run.device names: "cpu" (`threads` as make_cpu_backend) or "cuda" (make_cuda_backend
// with run.precision and run.attention; LADDER_CUDA_TF32=1 / LADDER_CUDA_BF16=1 / LADDER_ATTN_CUDNN
// override them). What the trainer and `ladder bench` run on.
std::unique_ptr<Backend> make_backend(const std::string& device, int threads, const std::string& precision = "fp32",
                                      const std::string& attention = "ladder");

}  // namespace ladder
