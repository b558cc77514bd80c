#include "train/inspect.h"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "backend/backend.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "model/config.h"
#include "model/transformer.h"
#include "optim/optimizer.h"
#include "train/checkpoint.h"

// LAPACK's symmetric eigensolver, which OpenBLAS exports (Debian builds it with LAPACK); the
// trailing lengths are the Fortran hidden lengths of the two character arguments.
extern "C" void dsyev_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda, double* w,
                       double* work, const int* lwork, int* info, size_t jobz_len, size_t uplo_len);

namespace fs = std::filesystem;

namespace ladder {

std::vector<double> singular_values(const float* a, int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return {};
  const int64_t n = std::min(rows, cols), k = std::max(rows, cols);
  if (n > 46340) fail("singular_values: a {} x {} matrix is too large for a dense Gram matrix", rows, cols);
  std::vector<double> ad(a, a + rows * cols), g(size_t(n * n), 0.0);
  // G = A^T A (cols <= rows) or A A^T: n x n, its upper triangle in row-major order, which is the
  // lower triangle of the same memory read column-major (LAPACK's order).
  if (cols <= rows)
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, int(n), int(k), 1.0, ad.data(), int(cols), 0.0, g.data(), int(n));
  else
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, int(n), int(k), 1.0, ad.data(), int(cols), 0.0, g.data(),
                int(n));
  const int ni = int(n);
  int info = 0, lwork = -1;
  double query = 0;
  std::vector<double> w(static_cast<size_t>(n));
  dsyev_("N", "L", &ni, g.data(), &ni, w.data(), &query, &lwork, &info, 1, 1);
  if (info != 0) fail("singular_values: LAPACK dsyev workspace query failed (info {})", info);
  lwork = std::max(1, int(query));
  std::vector<double> work(static_cast<size_t>(lwork));
  dsyev_("N", "L", &ni, g.data(), &ni, w.data(), work.data(), &lwork, &info, 1, 1);
  if (info != 0) fail("singular_values: LAPACK dsyev did not converge on a {} x {} matrix (info {})", rows, cols, info);
  std::vector<double> s(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) s[size_t(i)] = std::sqrt(std::max(0.0, w[size_t(n - 1 - i)]));  // ascending -> largest first
  return s;
}

namespace {

TensorStats tensor_stats(const Param& p) {
  TensorStats t;
  t.name = p.name;
  t.role = role_name(p.role);
  t.shape = p.shape;
  double ss = 0;
  for (size_t i = 0; i < p.numel; ++i) ss += double(p.w[i]) * double(p.w[i]);
  t.frobenius = std::sqrt(ss);
  t.rms = p.numel ? std::sqrt(ss / double(p.numel)) : 0.0;
  if (p.shape.size() < 2) return t;
  // A matrix [out, in], or E of them [E, out, in] (one per expert: the hyperball's unit too).
  const int64_t rows = p.shape[p.shape.size() - 2], cols = p.shape.back();
  t.matrices = p.shape.size() == 3 ? p.shape[0] : 1;
  t.rank_bound = std::min(rows, cols);
  t.stable_rank_min = 1e300;
  for (int64_t e = 0; e < t.matrices; ++e) {
    const std::vector<double> s = singular_values(p.w + e * rows * cols, rows, cols);
    double fro2 = 0;
    for (double x : s) fro2 += x * x;
    const double sr = s.empty() || s[0] == 0 ? 0.0 : fro2 / (s[0] * s[0]);
    t.sigma1 += s.empty() ? 0.0 : s[0];
    t.matrix_frobenius += std::sqrt(fro2);
    t.stable_rank += sr;
    t.stable_rank_min = std::min(t.stable_rank_min, sr);
    t.stable_rank_max = std::max(t.stable_rank_max, sr);
  }
  t.sigma1 /= double(t.matrices);
  t.matrix_frobenius /= double(t.matrices);
  t.stable_rank /= double(t.matrices);
  return t;
}

}  // namespace

InspectResult inspect_checkpoint(const fs::path& checkpoint, const InspectOptions& opt) {
  const fs::path dir = resolve_checkpoint(checkpoint);
  const CheckpointState st = read_checkpoint_state(dir);
  const Config cfg = checkpoint_model_config(dir, st);
  const std::string state_file = (dir / "state.json").string();
  InspectResult r;
  r.checkpoint = dir;
  r.step = st.step;

  auto be = make_cpu_backend(opt.threads);
  Transformer model(cfg.model, 1, *be);
  load_checkpoint_weights(dir, model, nullptr);
  std::vector<Param>& params = model.params();

  // Which optimizer trained each tensor: the checkpoint's own optimizer settings, planned as
  // training planned them. A config this build reads no longer (a later version's stricter checks)
  // leaves the column empty and says why, rather than refusing to show the weights.
  std::map<const Param*, std::string> optimizer_of;
  try {
    const Config full = from_json(st.config, state_file);
    r.optimizer_preset = full.optim.name;
    for (const ParamGroup& g : plan_groups(full.optim, params, run_shape(full, st.world)))
      for (const Param* p : g.params) optimizer_of[p] = g.optimizer;
  } catch (const Error& e) {
    r.note = fmt::format("optimizers not shown: {}", e.what());
  }

  std::vector<bool> chosen(params.size(), opt.params.empty());
  for (const std::string& sel : split_selectors(opt.params))
    for (size_t i : select_params("--params", sel, params)) chosen[i] = true;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!chosen[i]) continue;
    TensorStats t = tensor_stats(params[i]);
    if (auto it = optimizer_of.find(&params[i]); it != optimizer_of.end()) t.optimizer = it->second;
    r.tensors.push_back(std::move(t));
  }
  return r;
}

std::string format_inspect(const InspectResult& r) {
  std::string o = fmt::format("checkpoint {} (step {}{})\n", r.checkpoint.string(), r.step,
                              r.optimizer_preset.empty() ? "" : ", optim.name " + r.optimizer_preset);
  if (!r.note.empty()) o += r.note + "\n";
  size_t width = 6;
  for (const TensorStats& t : r.tensors) width = std::max(width, t.name.size());
  o += fmt::format("{:<{}} {:<13} {:<9} {:<16} {:>9} {:>9} {:>8}  {}\n", "tensor", width, "role", "optimizer", "shape",
                   "rms", "||W||_F", "sigma1", "stable rank");
  for (const TensorStats& t : r.tensors) {
    o += fmt::format("{:<{}} {:<13} {:<9} {:<16} {:>9.4g} {:>9.4g}", t.name, width, t.role,
                     t.optimizer.empty() ? "-" : t.optimizer, shape_str(t.shape), t.rms, t.frobenius);
    if (t.matrices > 0) o += fmt::format(" {:>8.4g}  {:.2f} / {}", t.sigma1, t.stable_rank, t.rank_bound);
    o += "\n";
  }
  if (std::any_of(r.tensors.begin(), r.tensors.end(), [](const TensorStats& t) { return t.matrices > 1; }))
    o += "expert tensors [E, out, in]: sigma1 and stable rank are means over the E matrices (--json: min, max)\n";
  return o;
}

nlohmann::json to_json(const InspectResult& r) {
  nlohmann::json j;
  j["checkpoint"] = r.checkpoint.string();
  j["step"] = r.step;
  j["optimizer_preset"] = r.optimizer_preset;
  if (!r.note.empty()) j["note"] = r.note;
  j["tensors"] = nlohmann::json::array();
  for (const TensorStats& t : r.tensors) {
    nlohmann::json x = {{"name", t.name},     {"role", t.role}, {"optimizer", t.optimizer}, {"shape", t.shape},
                        {"rms", t.rms},       {"frobenius", t.frobenius}};
    if (t.matrices > 0) {
      x["matrices"] = t.matrices;
      x["sigma1"] = t.sigma1;
      x["matrix_frobenius"] = t.matrix_frobenius;
      x["stable_rank"] = t.stable_rank;
      x["stable_rank_min"] = t.stable_rank_min;
      x["stable_rank_max"] = t.stable_rank_max;
      x["rank_bound"] = t.rank_bound;
    }
    j["tensors"].push_back(std::move(x));
  }
  return j;
}

}  // namespace ladder
