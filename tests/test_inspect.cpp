// `ladder inspect` (src/train/inspect): singular values against matrices whose spectrum is known,
// and a trained checkpoint's table against what the checkpoint's files say (the hyperball's radii,
// the optimizer plan, the weights themselves).
#include "train/inspect.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/error.h"
#include "core/safetensors.h"
#include "optim/optimizer.h"
#include "test_util.h"
#include "tiny_training.h"

namespace fs = std::filesystem;

namespace ladder {
namespace {

TEST(Inspect, SingularValuesOfMatricesWithAKnownSpectrum) {
  // diag(3, 2, 1) inside a 3 x 5 matrix, and its 5 x 3 transpose (the other Gram side).
  std::vector<float> wide(15, 0.f), tall(15, 0.f);
  const float d[3] = {2.f, 3.f, 1.f};  // out of order: the result is sorted
  for (int i = 0; i < 3; ++i) wide[i * 5 + (i + 1)] = tall[(i + 1) * 3 + i] = d[i];
  for (const auto& [m, rows, cols] : {std::tuple{&wide, 3, 5}, std::tuple{&tall, 5, 3}}) {
    const std::vector<double> s = singular_values(m->data(), rows, cols);
    ASSERT_EQ(s.size(), 3u);
    EXPECT_NEAR(s[0], 3.0, 1e-12);
    EXPECT_NEAR(s[1], 2.0, 1e-12);
    EXPECT_NEAR(s[2], 1.0, 1e-12);
  }
  // A rank-1 matrix u v^T: sigma1 = |u| |v| = 3 * 5, the rest 0.
  const float u[3] = {1.f, 2.f, 2.f}, v[3] = {0.f, 3.f, 4.f};
  std::vector<float> outer(9);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 3; ++j) outer[i * 3 + j] = u[i] * v[j];
  const std::vector<double> s1 = singular_values(outer.data(), 3, 3);
  EXPECT_NEAR(s1[0], 15.0, 1e-9);
  EXPECT_NEAR(s1[1], 0.0, 1e-6);
  // 2 x 2 in closed form: sigma1,2 = (sqrt((a+d)^2 + (c-b)^2) +- sqrt((a-d)^2 + (b+c)^2)) / 2.
  const float a = 1.5f, b = -0.25f, c = 0.75f, dd = 2.0f;
  const std::vector<float> m2 = {a, b, c, dd};
  const double p = std::hypot(double(a) + dd, double(c) - b), q = std::hypot(double(a) - dd, double(b) + c);
  const std::vector<double> s2 = singular_values(m2.data(), 2, 2);
  EXPECT_NEAR(s2[0], (p + q) / 2, 1e-12);
  EXPECT_NEAR(s2[1], (p - q) / 2, 1e-12);
  // A random 7 x 19: the squares sum to ||A||_F^2 and no unit vector is stretched beyond sigma1.
  std::mt19937 rng(5);
  std::normal_distribution<float> n01;
  std::vector<float> r(7 * 19);
  for (float& x : r) x = n01(rng);
  const std::vector<double> s3 = singular_values(r.data(), 7, 19);
  double fro2 = 0, sum2 = 0;
  for (float x : r) fro2 += double(x) * x;
  for (double x : s3) sum2 += x * x;
  EXPECT_NEAR(sum2, fro2, 1e-9 * fro2);
  for (size_t i = 1; i < s3.size(); ++i) EXPECT_GE(s3[i - 1], s3[i]);
  for (int t = 0; t < 20; ++t) {
    std::vector<double> x(19);
    double nx = 0, ny = 0;
    for (double& e : x) {
      e = n01(rng);
      nx += e * e;
    }
    for (int i = 0; i < 7; ++i) {
      double y = 0;
      for (int j = 0; j < 19; ++j) y += double(r[i * 19 + j]) * x[j];
      ny += y * y;
    }
    EXPECT_LE(std::sqrt(ny / nx), s3[0] * (1 + 1e-12));
  }
  EXPECT_TRUE(singular_values(r.data(), 0, 19).empty());
}

class InspectTest : public ::testing::Test {
 protected:
  static inline test::TempDir* dir = nullptr;
  static void SetUpTestSuite() {
    dir = new test::TempDir("inspect");
    test::make_word_salad_data(dir->path, 300, 11);
    Config c = test::tiny_train_config(dir->path);
    c.optim.name = "adamh";  // hyperball matrices (||W||_F = its radius), Adam for the rest
    c.optim.adam_lr = "0.005";
    c.optim.adamh_lr = "0.02";
    c.run.steps = 4;
    c.run.eval_every = 0;
    test::train_quietly(c, dir->path / "run");
  }
  static void TearDownTestSuite() {
    delete dir;
    dir = nullptr;
  }
  static fs::path ckpt() { return dir->path / "run" / "checkpoints" / "step_00000004"; }
};

TEST_F(InspectTest, EveryTensorWithItsOptimizerNormsAndSpectrum) {
  const InspectResult r = inspect_checkpoint(dir->path / "run");  // the run directory: its latest checkpoint
  EXPECT_EQ(r.checkpoint, ckpt());
  EXPECT_EQ(r.step, 4);
  EXPECT_EQ(r.optimizer_preset, "adamh");
  EXPECT_TRUE(r.note.empty()) << r.note;
  const SafeTensors w = SafeTensors::open(ckpt() / "model.safetensors");
  const SafeTensors o = SafeTensors::open(ckpt() / "optimizer.safetensors");
  ASSERT_EQ(r.tensors.size(), w.names().size());
  int hyperball = 0;
  for (const TensorStats& t : r.tensors) {
    SCOPED_TRACE(t.name);
    ASSERT_TRUE(w.has(t.name));
    EXPECT_EQ(t.shape, w.shape(t.name));
    const std::vector<float> x = w.get_f32(t.name);
    double ss = 0;
    for (float v : x) ss += double(v) * v;
    EXPECT_NEAR(t.frobenius, std::sqrt(ss), 1e-12 * std::sqrt(ss));
    EXPECT_NEAR(t.rms, std::sqrt(ss / double(x.size())), 1e-12);
    // The docs/optimizers.md table for adamh: matrices on AdamH, embedding and norm gains on Adam.
    const std::string want = t.role == "embedding" || t.role == "norm" ? "adam" : "adamh";
    EXPECT_EQ(t.optimizer, want);
    if (t.shape.size() < 2) {
      EXPECT_EQ(t.matrices, 0);
      continue;
    }
    EXPECT_EQ(t.matrices, 1);
    EXPECT_EQ(t.rank_bound, std::min(t.shape[0], t.shape[1]));
    EXPECT_LE(t.sigma1, t.frobenius * (1 + 1e-12));
    EXPECT_NEAR(t.stable_rank, t.frobenius * t.frobenius / (t.sigma1 * t.sigma1), 1e-9 * t.stable_rank);
    EXPECT_GE(t.stable_rank, 1.0 - 1e-9);
    EXPECT_LE(t.stable_rank, double(t.rank_bound) + 1e-9);
    // A hyperball matrix keeps ||W||_F at the radius the optimizer froze at its first step.
    if (t.optimizer == "adamh") {
      ++hyperball;
      const std::vector<float> radius = o.get_f32("radius." + t.name);
      ASSERT_EQ(radius.size(), 1u);
      EXPECT_NEAR(t.frobenius, radius[0], 1e-5 * radius[0]);
    }
  }
  EXPECT_GE(hyperball, 9);  // 2 layers x q/k/v/o/gate/up/down, and the head
  const nlohmann::json j = to_json(r);
  EXPECT_EQ(j["tensors"].size(), r.tensors.size());
  EXPECT_EQ(j["tensors"][1]["optimizer"], r.tensors[1].optimizer);
  const std::string text = format_inspect(r);
  EXPECT_NE(text.find("model.layers.1.self_attn.q_proj.weight"), std::string::npos) << text;
  EXPECT_NE(text.find("stable rank"), std::string::npos) << text;
}

TEST_F(InspectTest, SelectorsPickTensorsAndBadOnesAreNamed) {
  InspectOptions o;
  o.params = "role:attention, *.input_layernorm.weight";
  const InspectResult r = inspect_checkpoint(ckpt(), o);
  ASSERT_EQ(r.tensors.size(), 10u);  // 2 layers x (q, k, v, o + the norm gain)
  for (const TensorStats& t : r.tensors)
    EXPECT_TRUE(t.role == "attention" || t.name.find("input_layernorm") != std::string::npos) << t.name;
  o.params = "role:nope";
  EXPECT_ERROR_HAS(test::error_of([&] { inspect_checkpoint(ckpt(), o); }), "--params", "unknown role 'nope'",
                   "gated_norm");
  o.params = "role:attention, *.no_such.weight";
  EXPECT_ERROR_HAS(test::error_of([&] { inspect_checkpoint(ckpt(), o); }), "--params", "'*.no_such.weight'",
                   "matches no parameter");
  EXPECT_ERROR_HAS(test::error_of([&] { inspect_checkpoint(dir->path / "nowhere", {}); }), "nowhere");
}

}  // namespace
}  // namespace ladder
