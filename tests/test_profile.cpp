// Two things `ladder bench --profile` on a GPU relies on, held on the CPU:
// (1) the profiler's split of GEMM time by shape adds up to its split by kind, and names the shapes
//     the model runs (the LM head's chunk among them);
// (2) the LM head's chunk size is the backend's (Backend::lm_head_chunk_bytes: 16 MiB of logits on
//     the CPU, 512 MiB on a GPU), and changing it changes only the rounding of the loss and the
//     gradients, never what they are.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "backend/forwarding_backend.h"
#include "backend/profiling_backend.h"
#include "model/transformer.h"
#include "model_test_configs.h"

namespace ladder {
namespace {

// The CPU backend with another LM head chunk budget.
class ChunkedBackend final : public ForwardingBackend {
 public:
  explicit ChunkedBackend(size_t bytes) : ForwardingBackend(make_cpu_backend(0)), bytes_(bytes) {}
  size_t lm_head_chunk_bytes() const override { return bytes_; }

 private:
  size_t bytes_;
};

Config chunk_test_config() {
  Config c = test::moe_config();
  c.run.batch_size = 8;  // N = 256 tokens: four head chunks of the 64-row minimum
  return c;
}

TEST(Profiler, SplitsGemmTimeByShapeAndTheShapesAddUp) {
  const Config c = chunk_test_config();
  auto prof = make_profiling_backend(make_cpu_backend(0));
  Transformer model(c.model, c.run.batch_size, *prof);
  model.init(5);
  std::vector<int32_t> in, tg;
  test::make_batch(c, 1, in, tg);
  model.forward_backward(in.data(), tg.data(), 1.f);

  const auto& kinds = prof->times();
  const auto& shapes = prof->shape_times();
  ASSERT_FALSE(shapes.empty());
  int gemm_kinds = 0;
  for (const auto& [op, t] : kinds) {
    if (op.rfind("gemm ", 0) != 0 && op != "grouped gemm") continue;
    ++gemm_kinds;
    OpTime sum;
    for (const auto& [key, s] : shapes)
      if (key.rfind(op + " ", 0) == 0)
        sum.seconds += s.seconds, sum.flops += s.flops, sum.calls += s.calls;
    EXPECT_EQ(sum.calls, t.calls) << op;
    EXPECT_NEAR(sum.seconds, t.seconds, 1e-9 * (1 + t.seconds)) << op;
    EXPECT_DOUBLE_EQ(sum.flops, t.flops) << op;
  }
  EXPECT_GE(gemm_kinds, 4);  // NN, NT, TN and the grouped GEMMs of the MoE layers
  // The LM head's forward GEMM: all N = 256 rows in one chunk on the CPU (V = 160, d = 64).
  const int N = c.run.batch_size * c.model.seq_len, V = c.model.vocab_size, d = c.model.d_model;
  const std::string head = "gemm NT " + std::to_string(N) + "x" + std::to_string(V) + "x" + std::to_string(d) +
                           " f32,f32->f32";
  ASSERT_TRUE(shapes.count(head)) << head;
  EXPECT_EQ(shapes.at(head).calls, 1);
  // Every MoE layer's grouped GEMMs, named with the experts and the row bound N * top_k.
  const std::string rows = "E=" + std::to_string(c.model.moe_experts) +
                           " rows=" + std::to_string(N * c.model.moe_top_k) + " ";
  int grouped = 0;
  for (const auto& [key, s] : shapes)
    if (key.rfind("grouped gemm ", 0) == 0) {
      grouped += int(s.calls);
      EXPECT_NE(key.find(rows), std::string::npos) << key;
    }
  EXPECT_EQ(grouped, 2 * 9);  // two MoE layers (0 and 2): 3 GEMMs forward, 6 backward
}

TEST(LmHeadChunks, ComeFromTheBackendAndChangeOnlyRounding) {
  const Config c = chunk_test_config();
  const int N = c.run.batch_size * c.model.seq_len, V = c.model.vocab_size;
  auto whole_be = std::make_unique<ChunkedBackend>(size_t(16) << 20);  // the CPU's default: one chunk of 256 rows
  auto small_be = std::make_unique<ChunkedBackend>(size_t(64) * V * sizeof(float));  // four of 64
  auto prof = make_profiling_backend(std::move(small_be));
  Transformer whole(c.model, c.run.batch_size, *whole_be), chunked(c.model, c.run.batch_size, *prof);
  whole.init(9);
  chunked.init(9);
  std::vector<int32_t> in, tg;
  test::make_batch(c, 2, in, tg);
  const LossSums a = whole.forward_backward(in.data(), tg.data(), 1.f);
  const LossSums b = chunked.forward_backward(in.data(), tg.data(), 1.f);

  // Four head chunks of 64 rows: the forward GEMM ran four times at that shape.
  (void)prof->times();
  const std::string head64 = "gemm NT 64x" + std::to_string(V) + "x" + std::to_string(c.model.d_model) + " f32,f32->f32";
  ASSERT_TRUE(prof->shape_times().count(head64)) << head64;
  EXPECT_EQ(prof->shape_times().at(head64).calls, N / 64);

  // Per-chunk double sums of fp32 logits. Whether a row's logits are bitwise the same in a 64-row and
  // a 256-row GEMM is OpenBLAS's choice per kernel set: on an Intel Xeon (SkylakeX kernels) they
  // were (the sums then agreed to 1e-9, a reordering only); on an AMD EPYC they differ in the last
  // bits (3e-9 relative). 1e-6 still catches a dropped, doubled or misplaced chunk (a 1/256 change).
  EXPECT_NEAR(a.xent, b.xent, 1e-6 * std::abs(a.xent));
  EXPECT_NEAR(a.lse_sq, b.lse_sq, 1e-6 * std::abs(a.lse_sq));
  ASSERT_EQ(whole.params().size(), chunked.params().size());
  for (size_t i = 0; i < whole.params().size(); ++i) {
    const Param& p = whole.params()[i];
    const Param& q = chunked.params()[i];
    double num = 0, den = 0;
    for (size_t j = 0; j < p.numel; ++j) {
      num += double(p.g[j] - q.g[j]) * double(p.g[j] - q.g[j]);
      den += double(p.g[j]) * double(p.g[j]);
    }
    // fp32 sums in another order (the head gradient accumulates per chunk): ~1e-7 relative
    EXPECT_LE(std::sqrt(num), 1e-5 * std::sqrt(den) + 1e-12) << p.name;
  }
}

}  // namespace
}  // namespace ladder
