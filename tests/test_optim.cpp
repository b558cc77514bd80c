// The recipe's optimizers (RECIPE.md section 3): each against the independent PyTorch version
// (tests/reference/ref_optim.py) on the same gradients; the hyperball invariant; Newton-Schulz's
// singular-value band and its agreement with a float64 evaluation; the presets' group assignment;
// and the one-line errors for bad group configurations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <vector>

#include "backend/backend.h"
#include "host_params.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "optim/optimizer.h"
#include "test_util.h"

namespace ladder {
namespace {

// A parameter list with every role the recipe names, built by hand (the dense model has no MoE,
// gate or GatedNorm tensors yet). Shapes cover wide, tall and square matrices and [E, out, in]
// expert stacks (E = 3). Linear weights are [out, in].
struct HandModel : test::HostParams {
  HandModel() {
    const int64_t V = 40, d = 24, E = 3, I = 16;
    add("model.embed_tokens.weight", Role::Embedding, {V, d});
    add("model.layers.0.input_layernorm.weight", Role::NormGain, {d});
    add("model.layers.0.self_attn.q_proj.weight", Role::AttnMatrix, {32, d});  // tall
    add("model.layers.0.self_attn.o_proj.weight", Role::AttnMatrix, {d, 32});  // wide
    add("model.layers.0.self_attn.gate_proj.weight", Role::AttnGate, {4, d});
    add("model.layers.0.input_gated_norm.down_proj.weight", Role::GatedNormMatrix, {8, d});
    add("model.layers.0.input_gated_norm.up_proj.weight", Role::GatedNormMatrix, {d, 8});
    add("model.layers.0.mlp.gate.weight", Role::Router, {E, d});
    add("model.layers.0.mlp.experts.gate_proj.weight", Role::ExpertMatrix, {E, I, d});
    add("model.layers.0.mlp.experts.down_proj.weight", Role::ExpertMatrix, {E, d, I});
    add("model.layers.0.mlp.shared_expert.up_proj.weight", Role::SharedExpert, {d, d});  // square
    add("model.layers.1.mlp.down_proj.weight", Role::MlpMatrix, {d, 48});
    add("model.norm.weight", Role::NormGain, {d});
    add("lm_head.weight", Role::Head, {V, d});
    carve(7, "hand-model");
  }
  // Gradient scale per tensor (in add() order), from 1 down to 1e-9: Adam's eps (1e-8) is half or more of
  // sqrt(v_hat) + eps on the smallest (embedding, final norm, LM head, o_proj, the expert down
  // projections) and a tenth of it on the router's, so dropping eps or moving it inside the sqrt
  // changes their updates far beyond the tolerance, and Newton-Schulz's ||D|| + 1e-8 matters too.
  const std::vector<double> scale = {1e-9, 1.0, 1e-3, 3e-9, 0.3, 1e-5, 1e-2, 1e-7, 0.1, 2e-9, 1.0, 3e-4, 1e-8, 1e-9};
  // Deterministic gradients of step t, N(0, scale^2) per tensor. Expert 1 of the gate_proj stack
  // gets none (no token was routed to it): Adam's u = 0 / (0 + eps) and the hyperball's
  // ||U|| = 0 meet their floors, where a missing eps or 1e-10 floor gives NaN.
  void set_grads(int t) {
    Philox r(9, stream_id("grads") + uint64_t(t));
    for (size_t k = 0; k < params.size(); ++k) {
      const Param& p = params[k];
      const size_t off = size_t(p.g - g.data());
      for (size_t i = 0; i < p.numel; ++i) p.g[i] = float(scale.at(k) * r.normal(off + i));
    }
    Param& idle = param("model.layers.0.mlp.experts.gate_proj.weight");
    const size_t mn = idle.numel / size_t(idle.shape[0]);
    std::fill(idle.g + mn, idle.g + 2 * mn, 0.0f);
  }
  Param& param(const std::string& name) {
    for (auto& p : params)
      if (p.name == name) return p;
    throw std::runtime_error(name);
  }
};

std::map<std::string, std::string> optimizer_of(const Optimizer& opt) {
  std::map<std::string, std::string> out;
  for (auto& g : opt.groups())
    for (Param* p : g.params) out[p->name] = g.optimizer;
  return out;
}

// Explicit, distinct peak lrs per optimizer, and an embedding multiplier whose products (adam
// 0.007, adamw 0.014) equal none of them: a group run at another optimizer's lr shows.
constexpr double kLr = 0.02, kAdamLr = 0.01, kAdamhLr = 0.05, kMuonLr = 0.03, kMuonhLr = 0.04;
constexpr double kWeightDecay = 0.1, kEmbedLrMult = 0.7;

OptimConfig preset(const std::string& name) {
  OptimConfig oc;
  oc.name = name;
  oc.lr = kLr;
  oc.adam_lr = fmt::format("{}", kAdamLr);
  oc.adamh_lr = fmt::format("{}", kAdamhLr);
  oc.muon_lr = fmt::format("{}", kMuonLr);
  oc.muonh_lr = fmt::format("{}", kMuonhLr);
  oc.weight_decay = kWeightDecay;
  oc.embed_lr_mult = kEmbedLrMult;
  return oc;
}

// What docs/optimizers.md gives a tensor under preset() (its role table, "Learning rates", "No
// weight decay anywhere except in adamw, matrices only"), written out here rather than read from
// opt.groups(): the reference must not follow the code under test's assignment, lr or decay.
struct Documented {
  std::string kind;
  double lr = 0, wd = 0;  // peak lr incl. embed_lr_mult; weight decay
};
Documented documented(const std::string& preset_name, const Param& p) {
  const Role r = p.role;
  const bool hidden = r == Role::AttnMatrix || r == Role::MlpMatrix || r == Role::ExpertMatrix ||
                      r == Role::SharedExpert || r == Role::GatedNormMatrix;
  Documented d;
  if (preset_name == "adamw" || preset_name == "adam") d.kind = preset_name;
  else if (preset_name == "adamh") d.kind = hidden || r == Role::Head ? "adamh" : "adam";
  else if (preset_name == "muon") d.kind = hidden ? "muon" : "adam";
  else if (preset_name == "muonh") d.kind = hidden ? "muonh" : r == Role::Head ? "adamh" : "adam";
  else throw std::runtime_error("no documented preset " + preset_name);
  const std::map<std::string, double> peak = {
      {"adamw", kLr}, {"adam", kAdamLr}, {"adamh", kAdamhLr}, {"muon", kMuonLr}, {"muonh", kMuonhLr}};
  d.lr = peak.at(d.kind) * (r == Role::Embedding ? kEmbedLrMult : 1.0);
  d.wd = d.kind == "adamw" && (hidden || r == Role::Head) ? kWeightDecay : 0.0;
  return d;
}

// ---------------------------------------------------------------------------------------------
// Against the PyTorch reference: every preset, 5 steps with a schedule, parameters and state.

TEST(Optim, EveryOptimizerMatchesPyTorchOverSeveralSteps) {
  const std::vector<std::string> presets = {"adamw", "adam", "adamh", "muon", "muonh"};
  const std::vector<double> mults = {0.5, 1.0, 0.8, 0.6, 0.3};
  const int T = int(mults.size());
  auto be = make_cpu_backend(0);
  test::TempDir root("optim-ref");
  std::vector<HandModel> models(presets.size());
  std::vector<std::unique_ptr<Optimizer>> opts;
  std::string dirs;
  for (size_t k = 0; k < presets.size(); ++k) {
    HandModel& hm = models[k];
    OptimConfig oc = preset(presets[k]);
    auto dir = root.path / presets[k];
    std::filesystem::create_directories(dir);
    std::vector<TensorRef> in;
    for (auto& p : hm.params) in.push_back({"w." + p.name, DType::F32, p.shape, p.w});
    opts.push_back(make_optimizer(oc, hm.params, *be));
    Optimizer& opt = *opts.back();
    // The reference runs each tensor as the docs say; the optimizer's groups must say the same.
    std::map<std::string, Documented> want;
    nlohmann::json tensors = nlohmann::json::array();
    for (auto& p : hm.params) {
      const Documented d = want[p.name] = documented(presets[k], p);
      tensors.push_back({{"name", p.name}, {"kind", d.kind}, {"lr", d.lr}, {"wd", d.wd}});
    }
    std::map<std::string, int> grouped;
    for (auto& gr : opt.groups())
      for (Param* p : gr.params) {
        ++grouped[p->name];
        const Documented& d = want.at(p->name);
        EXPECT_EQ(gr.optimizer, d.kind) << presets[k] << " " << p->name;
        EXPECT_DOUBLE_EQ(gr.lr * gr.lr_mult, d.lr) << presets[k] << " " << p->name << " (group " << gr.name << ")";
        EXPECT_EQ(gr.weight_decay, d.wd) << presets[k] << " " << p->name << " (group " << gr.name << ")";
      }
    EXPECT_EQ(grouped.size(), hm.params.size()) << presets[k];
    for (auto& [name, n] : grouped) EXPECT_EQ(n, 1) << presets[k] << ": " << name << " in " << n << " groups";
    std::vector<std::vector<float>> grads;
    for (int t = 0; t < T; ++t) {
      hm.set_grads(t);
      grads.push_back(hm.g);
    }
    for (int t = 0; t < T; ++t)
      for (auto& p : hm.params)
        in.push_back({fmt::format("g.{}.{}", t, p.name), DType::F32, p.shape, grads[t].data() + (p.g - hm.g.data())});
    save_safetensors(dir / "case.safetensors", in);
    nlohmann::json c = {{"steps", T},          {"mults", mults},   {"beta1", oc.beta1}, {"beta2", oc.beta2},
                        {"eps", oc.eps},       {"muon_momentum", oc.muon_momentum}, {"tensors", tensors}};
    write_file_atomic(dir / "case.json", c.dump(2));
    for (int t = 0; t < T; ++t) {
      hm.g = grads[t];
      opt.step(oc.lr * mults[t]);
    }
    dirs += " --dir " + dir.string();
  }
  std::string cmd = fmt::format("/usr/bin/python3 {}/tests/reference/ref_optim.py{}", LADDER_SOURCE_DIR, dirs);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  for (size_t k = 0; k < presets.size(); ++k) {
    auto ref = SafeTensors::open(root.path / presets[k] / "ref_optim.safetensors");
    size_t compared = 0;
    for (auto& p : models[k].params) {
      auto w = ref.get_f32("w." + p.name);
      // fp32 on both sides: measured worst 2.6e-7 (docs/benchmarks-optim.md).
      EXPECT_LT(test::rel_err(p.w, w.data(), p.numel), 5e-6) << presets[k] << " " << p.name;
      ++compared;
    }
    for (auto& s : opts[k]->state()) {
      ASSERT_TRUE(ref.has(s.name)) << presets[k] << ": the reference has no " << s.name;
      auto v = ref.get_f32(s.name);
      size_t n = 1;
      for (auto d : s.shape) n *= size_t(d);
      ASSERT_EQ(v.size(), n) << s.name;
      EXPECT_LT(test::rel_err(s.data, v.data(), n), 5e-6) << presets[k] << " " << s.name;
      ++compared;
    }
    // the reference's state names are exactly ours
    EXPECT_EQ(ref.names().size(), compared) << presets[k];
  }
}

// ---------------------------------------------------------------------------------------------
// The hyperball: ||W||_F = R = ||W0||_F per matrix (per expert) after 100 steps.

TEST(Optim, HyperballKeepsEveryMatrixOnItsSphereFor100Steps) {
  auto be = make_cpu_backend(0);
  for (const char* name : {"muonh", "adamh"}) {
    HandModel hm;
    std::vector<float> w0 = hm.w;
    OptimConfig oc = preset(name);
    oc.adamh_lr = oc.muonh_lr = "0.1";  // large steps: the projection does all the work
    auto opt = make_optimizer(oc, hm.params, *be);
    for (int t = 0; t < 100; ++t) {
      hm.set_grads(t);
      opt->step(oc.lr);
    }
    std::map<std::string, const float*> radius;
    for (auto& s : opt->state())
      if (s.name.rfind("radius.", 0) == 0) radius[s.name.substr(7)] = s.data;
    int spheres = 0;
    for (auto& p : hm.params) {
      if (!radius.count(p.name)) continue;
      const int64_t E = p.shape.size() == 3 ? p.shape[0] : 1;
      const size_t mn = p.numel / size_t(E);
      for (int64_t e = 0; e < E; ++e) {
        double r0 = 0, r = 0, moved = 0;
        for (size_t i = 0; i < mn; ++i) {
          const double a = w0[(p.w - hm.w.data()) + e * mn + i], b = p.w[e * mn + i];
          r0 += a * a;
          r += b * b;
          moved += (a - b) * (a - b);
        }
        r0 = std::sqrt(r0);
        r = std::sqrt(r);
        EXPECT_NEAR(radius[p.name][e], r0, 1e-6 * r0) << name << " " << p.name << " expert " << e;
        EXPECT_LT(std::fabs(r - r0) / r0, 1e-5) << name << " " << p.name << " expert " << e;
        if (p.name == "model.layers.0.mlp.experts.gate_proj.weight" && e == 1)  // the idle expert (set_grads)
          EXPECT_LT(std::sqrt(moved) / r0, 1e-6) << name << ": an expert without gradient stays where it is";
        else
          EXPECT_GT(std::sqrt(moved) / r0, 0.1) << "the weights did move: " << p.name;
        ++spheres;
      }
    }
    // muonh: 10 hidden matrices incl. 2x3 experts -> 10 + head; adamh: hidden + head (same count)
    EXPECT_EQ(spheres, 2 + 2 + 2 * 3 + 1 + 1 + 1) << name;
  }
}

// ---------------------------------------------------------------------------------------------
// Newton-Schulz.

// Eigenvalues (ascending) of a symmetric n x n matrix by cyclic Jacobi rotations in double
// (small matrices only; written out so the test depends on no LAPACK build).
std::vector<double> sym_eigenvalues(std::vector<double> a, int n) {
  auto A = [&](int i, int j) -> double& { return a[size_t(i) * n + j]; };
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0, diag = 0;
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) (i == j ? diag : off) += A(i, j) * A(i, j);
    if (off <= 1e-30 * diag) break;
    for (int p = 0; p < n - 1; ++p)
      for (int q = p + 1; q < n; ++q) {
        if (A(p, q) == 0) continue;
        const double theta = (A(q, q) - A(p, p)) / (2 * A(p, q));
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int k = 0; k < n; ++k) {  // A <- A J (columns p, q)
          const double akp = A(k, p), akq = A(k, q);
          A(k, p) = c * akp - s * akq;
          A(k, q) = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {  // A <- J^T A (rows p, q)
          const double apk = A(p, k), aqk = A(q, k);
          A(p, k) = c * apk - s * aqk;
          A(q, k) = s * apk + c * aqk;
        }
      }
  }
  std::vector<double> w(n);
  for (int i = 0; i < n; ++i) w[i] = A(i, i);
  std::sort(w.begin(), w.end());
  return w;
}

// Singular values (ascending) of a row-major r x c matrix, via the eigenvalues of the smaller Gram.
template <class T>
std::vector<double> singular_values(const T* x, int r, int c) {
  const int m = std::min(r, c);
  std::vector<double> G(size_t(m) * m, 0.0);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < m; ++j) {
      double s = 0;
      if (r <= c)
        for (int k = 0; k < c; ++k) s += double(x[size_t(i) * c + k]) * double(x[size_t(j) * c + k]);
      else
        for (int k = 0; k < r; ++k) s += double(x[size_t(k) * c + i]) * double(x[size_t(k) * c + j]);
      G[size_t(i) * m + j] = s;
    }
  auto ev = sym_eigenvalues(G, m);
  for (auto& e : ev) e = std::sqrt(std::max(e, 0.0));
  return ev;
}

// RECIPE.md section 3's coefficients, restated here (not taken from the kernel) so that a wrong
// coefficient in the kernel fails this test.
const double kRecipeNs[5][3] = {{4.0848, -6.8946, 2.9270}, {3.9505, -6.3029, 2.6377}, {3.7418, -5.5913, 2.3037},
                                {2.8769, -3.1427, 1.2046}, {2.8366, -3.0525, 1.2012}};

// The same iteration evaluated naively in double: no syrk, no transposition trick (the tall case
// is transposed explicitly, as the recipe writes it).
std::vector<double> ns5_double(const std::vector<float>& in, int r, int c) {
  const bool tall = r > c;
  const int m = tall ? c : r, n = tall ? r : c;
  std::vector<double> X(size_t(m) * n);
  double ss = 0;
  for (float v : in) ss += double(v) * v;
  const double inv = 1.0 / (std::sqrt(ss) + 1e-8);
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) {
      const double v = in[size_t(i) * c + j] * inv;
      if (tall) X[size_t(j) * n + i] = v;
      else X[size_t(i) * n + j] = v;
    }
  for (auto& co : kRecipeNs) {
    std::vector<double> A(size_t(m) * m, 0), P(size_t(m) * m, 0), Y(size_t(m) * n, 0);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < m; ++j)
        for (int k = 0; k < n; ++k) A[size_t(i) * m + j] += X[size_t(i) * n + k] * X[size_t(j) * n + k];
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < m; ++j) {
        double a2 = 0;
        for (int k = 0; k < m; ++k) a2 += A[size_t(i) * m + k] * A[size_t(k) * m + j];
        P[size_t(i) * m + j] = co[1] * A[size_t(i) * m + j] + co[2] * a2;
      }
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        double s = co[0] * X[size_t(i) * n + j];
        for (int k = 0; k < m; ++k) s += P[size_t(i) * m + k] * X[size_t(k) * n + j];
        Y[size_t(i) * n + j] = s;
      }
    X = Y;
  }
  std::vector<double> out(size_t(r) * c);
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) out[size_t(i) * c + j] = tall ? X[size_t(j) * n + i] : X[size_t(i) * n + j];
  return out;
}

// The scalar map the 5 steps apply to each normalized singular value.
double ns5_scalar(double s) {
  for (auto& co : kRecipeNs) s = co[0] * s + co[1] * s * s * s + co[2] * s * s * s * s * s;
  return s;
}

// Band (measured from ns5_scalar, see docs/benchmarks-optim.md): normalized input singular values
// s in [0.01, 1] map into [0.9777, 1.0318]; s in [0.003, 0.01) into [0.9777, 1.1451]. Below 0.003
// five steps do not reach 1 (s = 1e-3 -> 0.47).
TEST(Optim, NewtonSchulzSingularValuesLieInTheDesignedBand) {
  auto be = make_cpu_backend(0);
  struct Shape {
    int r, c;
  };
  int checked_narrow = 0;
  for (Shape sh : {Shape{24, 64}, Shape{64, 24}, Shape{48, 48}, Shape{96, 160}, Shape{16, 24}}) {
    Philox rng(3, stream_id("ns") + uint64_t(sh.r * 1000 + sh.c));
    std::vector<float> x(size_t(sh.r) * sh.c);
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(rng.normal(i) * 3.0);
    // input singular values, normalized as the iteration does
    auto sin = singular_values(x.data(), sh.r, sh.c);
    double fro = 0;
    for (float v : x) fro += double(v) * v;
    fro = std::sqrt(fro);
    for (auto& s : sin) s /= fro;
    std::vector<float> y = x;
    be->newton_schulz5(y.data(), sh.r, sh.c);
    // 1. against the float64 evaluation of the same iteration
    auto yd = ns5_double(x, sh.r, sh.c);
    EXPECT_LT(test::rel_err(y.data(), yd.data(), y.size()), 5e-6) << sh.r << "x" << sh.c;
    // 2. each singular value went through the scalar polynomial map
    auto sout = singular_values(y.data(), sh.r, sh.c);
    std::vector<double> want;
    for (double s : sin) want.push_back(ns5_scalar(s));
    std::sort(want.begin(), want.end());
    ASSERT_EQ(sout.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(sout[i], want[i], 2e-4) << sh.r << "x" << sh.c << " sv " << i;
    // 3. the band
    for (size_t i = 0; i < sin.size(); ++i) {
      const double o = ns5_scalar(sin[i]);
      if (sin[i] >= 0.01) {
        EXPECT_GE(o, 0.9777);
        EXPECT_LE(o, 1.0318);
        ++checked_narrow;
      } else if (sin[i] >= 0.003) {
        EXPECT_GE(o, 0.9777);
        EXPECT_LE(o, 1.1451);
      }
    }
    for (size_t i = 0; i < sout.size(); ++i) {
      // whatever the input, the output never exceeds the band's top
      EXPECT_LE(sout[i], 1.1451 + 1e-4) << sh.r << "x" << sh.c;
    }
    const double smin = sin.front();
    if (smin >= 0.003) {
      EXPECT_GE(sout.front(), 0.9777 - 1e-4) << sh.r << "x" << sh.c;
    }
  }
  EXPECT_GT(checked_narrow, 100);
}

// ---------------------------------------------------------------------------------------------
// Group assignment.

TEST(Optim, PresetsPutEachTensorWhereTheRecipeSays) {
  auto be = make_cpu_backend(0);
  HandModel hm;
  // RECIPE.md section 3, MuonH: attention, experts (routed and shared), GatedNorm -> MuonH; LM head
  // -> AdamH; embeddings, router, gates, norms -> Adam. (The dense MLP sits with the experts.)
  const std::map<Role, std::string> muonh = {
      {Role::AttnMatrix, "muonh"}, {Role::ExpertMatrix, "muonh"}, {Role::SharedExpert, "muonh"},
      {Role::GatedNormMatrix, "muonh"}, {Role::MlpMatrix, "muonh"}, {Role::Head, "adamh"},
      {Role::Embedding, "adam"}, {Role::Router, "adam"}, {Role::AttnGate, "adam"}, {Role::NormGain, "adam"}};
  auto expect = [&](const std::string& name, std::function<std::string(Role)> want) {
    auto opt = make_optimizer(preset(name), hm.params, *be);
    auto of = optimizer_of(*opt);
    ASSERT_EQ(of.size(), hm.params.size()) << name;
    for (auto& p : hm.params) EXPECT_EQ(of[p.name], want(p.role)) << name << ": " << p.name;
  };
  expect("muonh", [&](Role r) { return muonh.at(r); });
  // AdamH: the recipe's AdamH list (attention, GatedNorm, LM head, routed and shared experts) -> AdamH.
  expect("adamh", [&](Role r) { return muonh.at(r) == "adam" ? std::string("adam") : std::string("adamh"); });
  expect("muon", [&](Role r) { return muonh.at(r) == "muonh" ? std::string("muon") : std::string("adam"); });
  expect("adam", [&](Role) { return std::string("adam"); });
  expect("adamw", [&](Role) { return std::string("adamw"); });
  // AdamW keeps its decay split: matrices decay, embedding / norms / router / gate do not.
  auto aw = make_optimizer(preset("adamw"), hm.params, *be);
  for (auto& g : aw->groups())
    for (Param* p : g.params)
      EXPECT_EQ(g.weight_decay > 0, p->role != Role::Embedding && p->role != Role::NormGain &&
                                        p->role != Role::Router && p->role != Role::AttnGate)
          << p->name;
  // One radius per expert: the expert stacks get [E] radii, matrices [1].
  auto mh = make_optimizer(preset("muonh"), hm.params, *be);
  int radii_seen = 0;
  for (auto& s : mh->state()) {
    if (s.name == "radius.model.layers.0.mlp.experts.gate_proj.weight") {
      EXPECT_EQ(s.shape, std::vector<int64_t>{3});
      ++radii_seen;
    } else if (s.name == "radius.lm_head.weight") {
      EXPECT_EQ(s.shape, std::vector<int64_t>{1});
      ++radii_seen;
    }
  }
  EXPECT_EQ(radii_seen, 2);
  // Overrides by role and by name pattern.
  OptimConfig oc = preset("muonh");
  oc.adam_params = "role:lm_head";
  oc.muon_params = "*.q_proj.weight, model.layers.0.mlp.experts.*";
  auto of = optimizer_of(*make_optimizer(oc, hm.params, *be));
  EXPECT_EQ(of["lm_head.weight"], "adam");
  EXPECT_EQ(of["model.layers.0.self_attn.q_proj.weight"], "muon");
  EXPECT_EQ(of["model.layers.0.mlp.experts.down_proj.weight"], "muon");
  EXPECT_EQ(of["model.layers.0.self_attn.o_proj.weight"], "muonh");
  // Learning rates: per optimizer, `auto` from the recipe's heuristics.
  oc = preset("muonh");
  oc.adam_lr = oc.adamh_lr = oc.muonh_lr = "auto";
  RunShape rs{4096.0 * 1000, 4096, 512};
  double adam = 1.63 * std::pow(4096.0 * 1000, -0.2813) * std::pow(512.0, -0.3678);
  auto opt = make_optimizer(oc, hm.params, *be, rs);
  for (auto& g : opt->groups()) {
    if (g.optimizer == "adam") EXPECT_NEAR(g.lr, adam, 1e-12);
    else EXPECT_NEAR(g.lr, std::min(0.05, 13.0 / 3.0 * adam), 1e-12) << g.name;
  }
  // "N*auto": N times the heuristic; adamh's auto follows adam's lr as resolved (with its multiple),
  // muonh's multiple applies to the capped adamh value.
  oc.adam_lr = "2*auto";
  oc.adamh_lr = "auto";
  oc.muonh_lr = " 4 * auto ";
  opt = make_optimizer(oc, hm.params, *be, rs);
  std::set<std::string> seen;
  for (auto& g : opt->groups()) {
    double want = -1;
    if (g.optimizer == "adam") want = 2 * adam;
    if (g.optimizer == "adamh") want = std::min(0.05, 13.0 / 3.0 * 2 * adam);
    if (g.optimizer == "muonh") want = 4 * std::min(0.05, 13.0 / 3.0 * 2 * adam);
    EXPECT_NEAR(g.lr, want, 1e-12) << g.name;
    seen.insert(g.optimizer);
  }
  EXPECT_EQ(seen, (std::set<std::string>{"adam", "adamh", "muonh"}));
  // An optimizer built from an OptimConfig alone (no Config::validate before it) refuses what
  // validate would: a number that is no finite lr >= 0, named with its key.
  for (const char* bad : {"inf", "nan", "-1", "0.1x", "1e999"}) {
    OptimConfig b = preset("muonh");
    b.muonh_lr = bad;
    EXPECT_ERROR_HAS(test::error_of([&] { make_optimizer(b, hm.params, *be, rs); }),
                     "optim.muonh_lr: expects a learning rate >= 0", bad);
  }
}

// optim.lr_mults: the matched tensors step as if their optimizer's lr were that many times larger,
// and nothing else changes. Compared bitwise over 3 steps against runs whose optimizer lr is 4x
// (the factor is a power of two, so the products are the same doubles), for each preset's family.
TEST(Optim, LrMultsScaleTheMatchedTensorsAsTheirOptimizersLr) {
  auto be = make_cpu_backend(0);
  auto trained = [&](const OptimConfig& oc) {
    HandModel hm;
    auto opt = make_optimizer(oc, hm.params, *be);
    for (int t = 0; t < 3; ++t) {
      hm.set_grads(t);
      opt->step(oc.lr);
    }
    std::map<std::string, std::vector<float>> w;
    for (auto& p : hm.params) w[p.name].assign(p.w, p.w + p.numel);
    std::map<std::string, std::string> group;
    for (auto& g : opt->groups())
      for (Param* p : g.params) group[p->name] = g.name;
    return std::pair{w, group};
  };
  for (const char* name : {"adam", "adamh", "muonh", "muon"}) {
    OptimConfig plain = preset(name), mult = preset(name), fast = preset(name);
    mult.lr_mults = "role:expert=4, *.q_proj.weight=1";
    fast.adam_lr = fmt::format("{}", 4 * kAdamLr);
    fast.adamh_lr = fmt::format("{}", 4 * kAdamhLr);
    fast.muon_lr = fmt::format("{}", 4 * kMuonLr);
    fast.muonh_lr = fmt::format("{}", 4 * kMuonhLr);
    const auto [w0, g0] = trained(plain);
    const auto [w1, g1] = trained(mult);
    const auto [w4, g4] = trained(fast);
    int experts = 0;
    for (auto& [n, w] : w1) {
      const bool expert = n.find(".mlp.experts.") != std::string::npos;
      experts += expert;
      EXPECT_EQ(w, (expert ? w4 : w0).at(n)) << name << " " << n;
      EXPECT_NE(w, (expert ? w0 : w4).at(n)) << name << " " << n << ": the lr does matter to it";
      // Factor 1 keeps the tensor in its optimizer's group; others get " x<factor>" groups.
      EXPECT_EQ(g1.at(n), expert ? g0.at(n) + " x4" : g0.at(n)) << name;
    }
    EXPECT_EQ(experts, 2);
  }
}

// ---------------------------------------------------------------------------------------------
// Bad input: one clear line each.

void expect_error(const std::function<void()>& fn, std::vector<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning " << needles[0];
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << msg;
  }
}

TEST(Optim, BadGroupConfigurationsGiveOneClearLine) {
  auto be = make_cpu_backend(0);
  HandModel hm;
  expect_error([&] { make_optimizer(preset("sgd"), hm.params, *be); }, {"optim.name", "unknown optimizer 'sgd'", "muonh"});
  Config c;
  c.optim.name = "lion";
  expect_error([&] { validate(c); }, {"optim.name", "'lion'"});
  OptimConfig oc = preset("muonh");
  oc.adam_params = "*.qq_proj.weight";
  expect_error([&] { make_optimizer(oc, hm.params, *be); }, {"optim.adam_params", "'*.qq_proj.weight'", "matches no parameter"});
  oc = preset("muonh");
  oc.adam_params = "role:routr";
  expect_error([&] { make_optimizer(oc, hm.params, *be); }, {"optim.adam_params", "unknown role 'routr'", "router"});
  oc = preset("muonh");
  oc.adam_params = "role:lm_head";
  oc.adamh_params = "lm_*";
  expect_error([&] { make_optimizer(oc, hm.params, *be); }, {"optim.adamh_params", "'lm_head.weight'", "optim.adam_params"});
  oc = preset("adam");
  oc.muon_params = "role:norm";
  expect_error([&] { make_optimizer(oc, hm.params, *be); }, {"optim.muon_params", "is a vector", "[24]"});
  oc = preset("muonh");
  oc.adamh_params = "model.norm.weight";
  expect_error([&] { make_optimizer(oc, hm.params, *be); }, {"optim.adamh_params", "'model.norm.weight'", "vector"});
  oc = preset("muon");
  oc.muon_lr = "auto";
  expect_error([&] { make_optimizer(oc, hm.params, *be, RunShape{1e6, 4096, 24}); }, {"optim.muon_lr", "auto"});
  oc = preset("muonh");
  oc.adam_lr = "fast";
  expect_error([&] { make_optimizer(oc, hm.params, *be); }, {"optim.adam_lr", "'fast'"});
  oc.adam_lr = "auto";
  expect_error([&] { make_optimizer(oc, hm.params, *be); }, {"optim.adam_lr", "run's size"});
  oc.adam_lr = "auto*2";  // the multiple comes first, as in a ladder spec's `0.5*d`
  expect_error([&] { make_optimizer(oc, hm.params, *be); }, {"optim.adam_lr", "'auto*2'"});
  oc.adam_lr = "0*auto";
  expect_error([&] { make_optimizer(oc, hm.params, *be, RunShape{1e6, 4096, 24}); }, {"optim.adam_lr", "N*auto", "> 0", "'0'"});
  oc = preset("muon");
  oc.muon_lr = "3*auto";
  expect_error([&] { make_optimizer(oc, hm.params, *be, RunShape{1e6, 4096, 24}); }, {"optim.muon_lr", "no heuristic"});
  // A hyperball lr is a step relative to ||W0||: 1 or more is refused, naming where it came from.
  oc = preset("muonh");
  oc.muonh_lr = "1.5";
  expect_error([&] { make_optimizer(oc, hm.params, *be); }, {"optim.muonh_lr (peak): group muonh's lr is 1.5", "< 1"});
  oc = preset("adamh");
  oc.adamh_lr = "";
  oc.lr = 2;
  expect_error([&] { make_optimizer(oc, hm.params, *be); }, {"optim.lr (peak): group adamh's lr is 2", "< 1"});
  oc.lr = 0.5;
  EXPECT_NO_THROW(make_optimizer(oc, hm.params, *be));
  // optim.lr_mults: each selector must match, each tensor gets one factor, the product stays < 1 on
  // the hyperball.
  oc = preset("muonh");
  oc.lr_mults = "role:expert=2, *.q_projj.weight=3";
  expect_error([&] { make_optimizer(oc, hm.params, *be); }, {"optim.lr_mults", "'*.q_projj.weight'", "matches no parameter"});
  oc.lr_mults = "role:experts=2";
  expect_error([&] { make_optimizer(oc, hm.params, *be); }, {"optim.lr_mults", "unknown role 'experts'", "expert"});
  oc.lr_mults = "role:expert=2, *.experts.gate_proj.weight=3";
  expect_error([&] { make_optimizer(oc, hm.params, *be); },
               {"optim.lr_mults", "'model.layers.0.mlp.experts.gate_proj.weight'", "'role:expert'", "'*.experts.gate_proj.weight'"});
  oc.lr_mults = "role:expert=30";
  expect_error([&] { make_optimizer(oc, hm.params, *be); }, {"optim.muonh_lr (peak x optim.lr_mults 30): group muonh x30's lr is 1.2", "< 1"});
  // Factors that print alike at 6 digits are still two groups; more groups than the CUDA
  // backend's kernels take is refused here, not at a GPU run's first step.
  oc.lr_mults = "*.q_proj.weight=0.1234567, *.o_proj.weight=0.1234568";
  std::set<std::string> names;
  auto two = make_optimizer(oc, hm.params, *be);
  for (auto& g : two->groups()) names.insert(g.name);
  EXPECT_TRUE(names.count("muonh x0.1234567") && names.count("muonh x0.1234568")) << fmt::format("{}", fmt::join(names, ", "));
  struct ManyMatrices : test::HostParams {
    ManyMatrices() {
      for (int i = 0; i < 40; ++i) add(fmt::format("m{}.weight", i), Role::AttnMatrix, {4, 4});
      carve(3, "many");
    }
  } many;
  OptimConfig mo = preset("adam");
  for (int i = 0; i < 31; ++i) mo.lr_mults += fmt::format("{}m{}.weight={}", i ? "," : "", i, 2 + i);
  EXPECT_EQ(make_optimizer(mo, many.params, *be)->groups().size(), 32u);  // 31 factors and the rest
  mo.lr_mults += ",m31.weight=40";
  expect_error([&] { make_optimizer(mo, many.params, *be); }, {"optim: 33 parameter groups, at most 32", "optim.lr_mults"});
  for (const char* bad : {"role:expert", "role:expert=", "=4", "role:expert=four", "role:expert=-1", "role:expert=inf"}) {
    oc.lr_mults = bad;
    expect_error([&] { make_optimizer(oc, hm.params, *be); }, {"optim.lr_mults", "selector=factor"});
    c = Config{};
    c.optim.lr_mults = bad;
    expect_error([&] { validate(c); }, {"optim.lr_mults", "selector=factor"});
  }
  // A zero-initialized matrix cannot live on a sphere of radius 0.
  oc = preset("muonh");
  Param& q = hm.param("model.layers.0.self_attn.q_proj.weight");
  std::fill(q.w, q.w + q.numel, 0.0f);
  auto opt = make_optimizer(oc, hm.params, *be);
  expect_error([&] { opt->step(0.01); }, {"q_proj", "zero-initialized"});
}

}  // namespace
}  // namespace ladder

namespace ladder {
namespace {

// `ladder train --dry-run` prints every tensor's group, optimizer and lr and trains nothing; a bad
// group configuration is one "error:" line.
TEST(OptimCli, DryRunPrintsEveryTensorAndBadGroupsGiveOneLine) {
  test::TempDir d("dryrun");
  const std::string cfg = std::string(LADDER_SOURCE_DIR) + "/configs/dense-tiny-muonh.yaml";
  auto run = [&](const std::string& extra) {
    std::string cmd = fmt::format("{}/ladder train {} --run-dir {} --dry-run {} >{} 2>{}", LADDER_BINARY_DIR, cfg,
                                  (d.path / "run").string(), extra, (d.path / "out").string(), (d.path / "err").string());
    return std::system(cmd.c_str());
  };
  ASSERT_EQ(run(""), 0) << read_file(d.path / "err");
  const std::string out = read_file(d.path / "out");
  for (const char* want : {"model.layers.0.self_attn.q_proj.weight", "attention", "muonh", "lm_head.weight", "adamh",
                           "model.embed_tokens.weight", "adam.embedding", "warmup 2 of 200", "grad clip off"})
    EXPECT_NE(out.find(want), std::string::npos) << want << "\n" << out;
  // one line per tensor: 4 layers x 11, embedding, final norm (lm_head checked above)
  size_t lines = 0;
  for (size_t p = out.find("model."); p != std::string::npos; p = out.find("\nmodel.", p + 1)) ++lines;
  EXPECT_EQ(lines, 4u * 11 + 2);
  EXPECT_FALSE(std::filesystem::exists(d.path / "run"));
  EXPECT_NE(run("--set optim.muon_params=role:norm"), 0);
  const std::string err = read_file(d.path / "err");
  EXPECT_NE(err.find("error: optim.muon_params: "), std::string::npos) << err;
  EXPECT_NE(err.find("is a vector"), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 2) << err;  // the blank line the CLI prints, then the error
}

}  // namespace
}  // namespace ladder
