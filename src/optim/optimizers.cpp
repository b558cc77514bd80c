// The recipe's optimizers (RECIPE.md section 3) over parameter groups: adamw, adam, adamh, muon and
// muonh, one per group, all in one Optimizer so that the trainer steps, checkpoints and resumes
// them as one.
//
// Storage convention: Linear weights are stored [out_features, in_features] (y = x W^T), expert
// tensors [E, out, in]. So a matrix's rows are its fan-out and its columns its fan-in; Muon's
// scale sqrt(max(1, fan_out/fan_in)) is sqrt(max(1, rows/cols)) here.
//
// Hyperball optimizers (adamh, muonh) keep one radius R = ||W0||_F per matrix (per expert for
// [E, out, in] tensors), taken from the weights at the first step (the trainer initializes or
// loads the weights before stepping), stored as state "radius.<name>" so a resume uses the same R.
//
// Memory: every state arena (m, v, momentum, radius) and Muon's scratch are the backend's memory.
// A step reads nothing back: the hyperball's per-matrix norms, step sizes and rescale factors are
// computed by the backend from the radii in its own memory (adamh_multi, muonh_apply_batched). Only the
// first step waits, to take the radii.
#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/safetensors.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

namespace ladder {
namespace {

enum class Kind { AdamW, Adam, AdamH, Muon, MuonH };
constexpr const char* kKindNames[] = {"adamw", "adam", "adamh", "muon", "muonh"};
const char* kind_name(Kind k) { return kKindNames[int(k)]; }
bool hyperball(Kind k) { return k == Kind::AdamH || k == Kind::MuonH; }
bool is_muon(Kind k) { return k == Kind::Muon || k == Kind::MuonH; }
bool adam_family(Kind k) { return k == Kind::AdamW || k == Kind::Adam || k == Kind::AdamH; }

Kind parse_kind(const std::string& s) {
  for (int i = 0; i < 5; ++i)
    if (s == kKindNames[i]) return Kind(i);
  fail("optim.name: unknown optimizer '{}' (expected adamw, adam, adamh, muon or muonh)", s);
}

// The hidden matrices of RECIPE.md section 3: attention, experts (routed and shared), GatedNorm.
// The dense baseline's MLP matrices sit with them (they are what the experts replace).
bool hidden_matrix(Role r) {
  return r == Role::AttnMatrix || r == Role::MlpMatrix || r == Role::ExpertMatrix || r == Role::SharedExpert ||
         r == Role::GatedNormMatrix;
}

// The presets. muonh is the recipe's table (hidden matrices -> MuonH; LM head -> AdamH;
// embeddings, router, gates, norms -> Adam); adamh is the same with AdamH on the hidden matrices
// (the recipe's AdamH list: attention, GatedNorm, LM head, routed and shared experts); muon is the
// common Muon split (hidden matrices -> Muon, everything else incl. the head -> Adam).
Kind preset_kind(Kind preset, Role r) {
  switch (preset) {
    case Kind::AdamW: return Kind::AdamW;
    case Kind::Adam: return Kind::Adam;
    case Kind::AdamH: return hidden_matrix(r) || r == Role::Head ? Kind::AdamH : Kind::Adam;
    case Kind::Muon: return hidden_matrix(r) ? Kind::Muon : Kind::Adam;
    case Kind::MuonH: return hidden_matrix(r) ? Kind::MuonH : r == Role::Head ? Kind::AdamH : Kind::Adam;
  }
  return Kind::Adam;
}

// AdamW decays matrices only (attention, MLP, experts, GatedNorm, LM head).
bool decayed(Role r) { return hidden_matrix(r) || r == Role::Head; }

const std::string& params_key(const OptimConfig& oc, Kind k) {
  switch (k) {
    case Kind::AdamW: return oc.adamw_params;
    case Kind::Adam: return oc.adam_params;
    case Kind::AdamH: return oc.adamh_params;
    case Kind::Muon: return oc.muon_params;
    case Kind::MuonH: return oc.muonh_params;
  }
  return oc.adamw_params;
}

bool selector_matches(const std::string& sel, const Param& p) {
  if (sel.rfind("role:", 0) == 0) return sel.substr(5) == role_name(p.role);
  return fnmatch(sel.c_str(), p.name.c_str(), 0) == 0;
}

constexpr Role kAllRoles[] = {Role::Embedding, Role::AttnMatrix,   Role::MlpMatrix, Role::Head,
                              Role::NormGain,  Role::Router,       Role::ExpertMatrix, Role::SharedExpert,
                              Role::AttnGate,  Role::GatedNormMatrix};

}  // namespace

std::vector<size_t> select_params(const std::string& key, const std::string& sel, const std::vector<Param>& params) {
  if (sel.rfind("role:", 0) == 0 &&
      std::none_of(std::begin(kAllRoles), std::end(kAllRoles), [&](Role r) { return sel.substr(5) == role_name(r); })) {
    std::string roles;
    for (Role r : kAllRoles) roles += std::string(roles.empty() ? "" : ", ") + role_name(r);
    fail("{}: unknown role '{}' in '{}' (roles: {})", key, sel.substr(5), sel, roles);
  }
  std::vector<size_t> out;
  for (size_t i = 0; i < params.size(); ++i)
    if (selector_matches(sel, params[i])) out.push_back(i);
  if (out.empty()) fail("{}: selector '{}' matches no parameter of this model", key, sel);
  return out;
}

namespace {

double parse_lr(const std::string& key, const std::string& v) {
  const auto x = plain_lr(v);  // the number Config::validate accepts (model/config.h)
  if (!x || !(*x >= 0))
    fail("{}: expects a learning rate >= 0, `auto`, `N*auto` or empty (= optim.lr), got '{}'", key, v);
  return *x;
}

// Resolves one optimizer's peak lr from its key ("" = optim.lr, a number, "auto" or "N*auto").
struct Lr {
  double value;
  std::string from;
};
Lr resolve_lr(const OptimConfig& oc, Kind k, const RunShape& rs) {
  auto key_value = [&](Kind kk) -> const std::string& {
    switch (kk) {
      case Kind::Adam: return oc.adam_lr;
      case Kind::AdamH: return oc.adamh_lr;
      case Kind::Muon: return oc.muon_lr;
      default: return oc.muonh_lr;
    }
  };
  auto need_shape = [&](const char* key) {
    if (rs.total_tokens <= 0 || rs.d_model <= 0)
      fail("optim.{}: `auto` needs the run's size (run.steps, run.batch_size, model.seq_len); this optimizer "
           "was built without it",
           key);
  };
  // "N*auto": N times the heuristic ("auto" is N = 1), shown as such where the lr is printed.
  auto times = [](double n) { return n == 1 ? std::string() : fmt::format("{:g} x ", n); };
  auto adam = [&]() -> Lr {
    if (oc.adam_lr.empty()) return {oc.lr, "optim.lr"};
    if (auto n = auto_lr_multiplier("optim.adam_lr", oc.adam_lr)) {
      need_shape("adam_lr");
      return {*n * auto_adam_lr(rs),
              fmt::format("{}auto: 1.63 T^-0.2813 d^-0.3678 sqrt(B), T={:.3g}, d={}, B={:.3g} (heuristic)", times(*n),
                          rs.total_tokens, rs.d_model, rs.tokens_per_step / 4096.0)};
    }
    return {parse_lr("optim.adam_lr", oc.adam_lr), "optim.adam_lr"};
  };
  if (k == Kind::AdamW) return {oc.lr, "optim.lr"};
  if (k == Kind::Adam) return adam();
  const std::string& v = key_value(k);
  const std::string key = std::string(kind_name(k)) + "_lr";
  if (v.empty()) return {oc.lr, "optim.lr"};
  const auto n = auto_lr_multiplier("optim." + key, v);
  if (!n) return {parse_lr("optim." + key, v), "optim." + key};
  if (k == Kind::Muon)
    fail("optim.muon_lr: `auto` is not available: RECIPE.md publishes no heuristic for plain Muon (give a number)");
  // adamh: the recipe's 13/3 * adam_lr (cap 0.05; N*auto multiplies the capped value). muonh: the same
  // angular step size, our assumption (the recipe gives no separate MuonH heuristic; both are relative
  // steps on the same sphere).
  Lr a = adam();
  return {*n * adamh_lr_from_adam(a.value),
          fmt::format("{}auto: min(0.05, 13/3 * adam_lr {:.4g}){} (heuristic)", times(*n), a.value,
                      k == Kind::MuonH ? ", as adamh" : "")};
}

// One tensor under its optimizer, with views into the state arenas.
struct Slot {
  Param* p = nullptr;
  Kind kind = Kind::AdamW;
  int group = 0;
  float *m = nullptr, *v = nullptr;  // Adam moments
  float* mom = nullptr;              // Muon momentum buffer B
  float* radius = nullptr;           // hyperball radii, one per matrix (backend memory)
  size_t radius_at = 0;              // where this tensor's radii sit in radius_host_
  int64_t nmat = 1;                  // matrices in the tensor (E for [E, out, in])
  int rows = 0, cols = 0;            // of one matrix
  int owner = 0;                     // sharded: the rank that holds the state and updates the tensor
  bool held = true;                  // this rank's (always, unsharded): only held slots have state
  size_t mat_numel() const { return size_t(rows) * size_t(cols); }
};

class RecipeOptimizer final : public Optimizer {
 public:
  RecipeOptimizer(const OptimConfig& oc, std::vector<Param>& params, Backend& be, const RunShape& rs,
                  const OptimizerShards* shards)
      : oc_(oc), be_(be) {
    groups_ = plan_groups(oc, params, rs);
    if (shards) {
      LADDER_ASSERT(shards->owner.size() == params.size() && shards->rank >= 0 && shards->rank < shards->world);
      shards_ = *shards;
    }
    // Slots in parameter order (state files then read in model order).
    std::map<const Param*, int> group_of;
    for (size_t gi = 0; gi < groups_.size(); ++gi)
      for (Param* p : groups_[gi].params) group_of[p] = int(gi);
    size_t adam_bytes = 0, mom_bytes = 0, rad_bytes = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      Param& p = params[i];
      Slot s;
      s.p = &p;
      if (shards_) {
        s.owner = shards_->owner[i];
        s.held = s.owner == shards_->rank;
      }
      s.group = group_of.at(&p);
      s.kind = parse_kind(groups_[s.group].optimizer);
      if (p.shape.size() == 3) {
        s.nmat = p.shape[0];
        s.rows = int(p.shape[1]);
        s.cols = int(p.shape[2]);
      } else if (p.shape.size() == 2) {
        s.rows = int(p.shape[0]);
        s.cols = int(p.shape[1]);
      }
      if (s.held) {
        if (adam_family(s.kind)) adam_bytes += Arena::padded(p.numel);
        if (is_muon(s.kind)) mom_bytes += Arena::padded(p.numel);
        if (hyperball(s.kind)) rad_bytes += Arena::padded(size_t(s.nmat));
      }
      slots_.push_back(s);
    }
    m_arena_.reserve(adam_bytes, be_, "optimizer state exp_avg");
    v_arena_.reserve(adam_bytes, be_, "optimizer state exp_avg_sq");
    mom_arena_.reserve(mom_bytes, be_, "optimizer state momentum");
    rad_arena_.reserve(rad_bytes, be_, "optimizer state radius");
    for (auto& s : slots_) {
      if (!s.held) continue;
      if (adam_family(s.kind)) {
        s.m = m_arena_.alloc(s.p->numel);
        s.v = v_arena_.alloc(s.p->numel);
      }
      if (is_muon(s.kind)) s.mom = mom_arena_.alloc(s.p->numel);
      if (hyperball(s.kind)) s.radius = rad_arena_.alloc(size_t(s.nmat));
    }
    // The radii arena is padded per tensor, so its host copy has the arena's layout: one download.
    radius_host_.assign(rad_arena_.capacity() / sizeof(float), 0.0f);
    for (auto& s : slots_)
      if (s.radius) s.radius_at = size_t(s.radius - reinterpret_cast<float*>(rad_arena_.base()));
    // Muon's directions D (the momentum buffer must survive the step), a batch of same-shape
    // matrices at a time.
    const size_t max_muon = plan_muon_batches();
    scratch_.reserve(max_muon * sizeof(float), be_, "Muon scratch");
    muon_d_ = scratch_.alloc<float>(max_muon);
    // The multi-tensor ops' descriptor lists: fixed from here on (the backend may keep a device copy).
    for (auto& s : slots_) {
      if (!s.held || !adam_family(s.kind)) continue;
      OptimTensor t;
      t.w = s.p->w;
      t.g = s.p->g;
      t.m = s.m;
      t.v = s.v;
      t.n = s.p->numel;
      t.group = s.group;
      if (s.kind == Kind::AdamH) {
        t.nmat = s.nmat;
        t.radius = s.radius;
        adamh_tab_.push_back(t);
      } else {
        adam_tab_.push_back(t);
      }
    }
    group_lr_.assign(groups_.size(), 0.0);
    group_lr_f_.assign(groups_.size(), 0.0f);
    group_wd_f_.assign(groups_.size(), 0.0f);
    for (auto& g : groups_)
      if (g.lr != oc_.lr && oc_.lr <= 0)
        fail("optim.lr must be > 0 when a group has its own learning rate ({}: {}): the schedule scales every "
             "group's lr by the fraction of optim.lr it gives",
             g.name, g.lr_from);
  }

  // Nothing here waits for the backend (after the first step's radii): every Adam-family tensor is
  // in one of two multi-tensor ops, whose per-group learning rates are the only per-step inputs, and
  // the hyperball's per-matrix norms and scalars stay in backend memory (adamh_multi,
  // muonh_apply_batched).
  // Tensors are independent, so grouping them by kind instead of walking them in parameter order
  // changes no result.
  void step(double lr, const float* grad_factor) override {
    if (t_ == 0) take_radii();
    ++t_;
    const double b1 = oc_.beta1, b2 = oc_.beta2;
    const double bc1 = 1.0 - std::pow(b1, double(t_)), bc2 = 1.0 - std::pow(b2, double(t_));
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      const ParamGroup& g = groups_[gi];
      // The schedule hands us optim.lr * multiplier; each group keeps that fraction of its own lr.
      group_lr_[gi] = (g.lr == oc_.lr ? lr : g.lr * (lr / oc_.lr)) * g.lr_mult;
      group_lr_f_[gi] = float(group_lr_[gi]);
      group_wd_f_[gi] = float(g.weight_decay);
    }
    const int ng = int(groups_.size());
    if (!adam_tab_.empty())
      be_.adamw_multi(adam_tab_.data(), adam_tab_.size(), group_lr_f_.data(), group_wd_f_.data(), ng, float(b1),
                      float(b2), float(oc_.eps), float(bc1), float(bc2), grad_factor);
    if (!adamh_tab_.empty())
      be_.adamh_multi(adamh_tab_.data(), adamh_tab_.size(), group_lr_.data(), ng, float(b1), float(b2),
                      float(oc_.eps), float(bc1), float(bc2), grad_factor);
    // Muon / MuonH, a batch of same-shape matrices at a time (plan_muon_batches): the momentum of
    // each piece (elementwise, one call per piece) lands in the batch's D, one batched
    // Newton-Schulz orthogonalizes all of them, and each piece's update is one call (plain Muon:
    // one axpy, its scale being the tensor's; MuonH: muonh_apply_batched with the pieces' radii).
    // Per matrix this is the arithmetic of the former per-matrix loop, so the CPU is bitwise unchanged.
    for (const MuonBatch& b : muon_batches_) {
      for (const MuonPiece& pc : b.pieces) {
        const Slot& s = slots_[pc.slot];
        const size_t off = size_t(pc.first) * s.mat_numel();
        be_.muon_momentum(s.mom + off, muon_d_ + pc.d_at, s.p->g + off, size_t(pc.count) * s.mat_numel(),
                          float(oc_.muon_momentum), grad_factor);
      }
      be_.newton_schulz5_batched(muon_d_, b.rows, b.cols, b.count);
      for (const MuonPiece& pc : b.pieces) {
        const Slot& s = slots_[pc.slot];
        const size_t mn = s.mat_numel(), off = size_t(pc.first) * mn;
        const double glr = group_lr_[size_t(s.group)];
        const float* D = muon_d_ + pc.d_at;
        if (s.kind == Kind::Muon) {
          // Muon scale in terms of fan-out (rows) and fan-in (cols): see the storage note on top.
          const double scale = std::sqrt(std::max(1.0, double(s.rows) / double(s.cols)));
          be_.axpy(s.p->w + off, D, size_t(pc.count) * mn, float(-glr * scale));
        } else {
          be_.muonh_apply_batched(s.p->w + off, D, mn, pc.count, s.radius + pc.first, glr);
        }
      }
    }
  }
  int64_t steps_taken() const override { return t_; }
  void set_steps_taken(int64_t t) override { t_ = t; }
  // Every tensor's state, held or not (sharded: the same list on every rank), by kind of state.
  std::vector<StateTensor> state() override {
    std::vector<StateTensor> out;
    for (auto& s : slots_)
      if (adam_family(s.kind)) out.push_back({"exp_avg." + s.p->name, s.p->shape, s.m, s.owner});
    for (auto& s : slots_)
      if (adam_family(s.kind)) out.push_back({"exp_avg_sq." + s.p->name, s.p->shape, s.v, s.owner});
    for (auto& s : slots_)
      if (is_muon(s.kind)) out.push_back({"momentum." + s.p->name, s.p->shape, s.mom, s.owner});
    for (auto& s : slots_)
      if (hyperball(s.kind)) out.push_back({"radius." + s.p->name, {s.nmat}, s.radius, s.owner});
    return out;
  }
  const std::vector<ParamGroup>& groups() const override { return groups_; }
  MemorySpace& memory() const override { return be_; }
  const OptimizerShards* shards() const override { return shards_ ? &*shards_ : nullptr; }

 private:
  // R = ||W0||_F per matrix, stored in float and used as stored, so a resumed run sees the same R.
  // Computed into the host copy, then uploaded once.
  void take_radii() {
    if (radius_host_.empty()) return;
    for (auto& s : slots_) {
      if (!s.radius) continue;
      const size_t mn = s.mat_numel();
      for (int64_t e = 0; e < s.nmat; ++e) {
        const double r = std::sqrt(be_.sum_squares(s.p->w + size_t(e) * mn, mn));
        if (!(r > 0))
          fail("{}: ||W0||_F is {} at the first step{}; a hyperball optimizer ({}) keeps ||W|| = ||W0||, so it "
               "cannot train a zero-initialized matrix (assign it to adam)",
               s.p->name, r, s.nmat > 1 ? fmt::format(" (expert {})", e) : "", kind_name(s.kind));
        radius_host_[s.radius_at + size_t(e)] = float(r);
      }
    }
    be_.upload(rad_arena_.base(), radius_host_.data(), rad_arena_.capacity());
  }

  // Muon's batches: the matrices of every Muon/MuonH tensor, grouped by shape (in parameter order)
  // and packed into batches of at most kMuonBatchBytes of D (at least one matrix each), so a dense
  // model's same-shape projections and an expert stack's E matrices share one Newton-Schulz call,
  // while the scratch stays bounded (a [64, 1024, 2048] stack alone would need 512 MiB). Returns
  // the largest batch in floats (the size of D).
  static constexpr size_t kMuonBatchBytes = size_t(256) << 20;
  struct MuonPiece {
    size_t slot = 0;   // index into slots_
    int64_t first = 0;  // its first matrix in the tensor
    int count = 0;      // matrices
    size_t d_at = 0;    // where they sit in D (floats)
  };
  struct MuonBatch {
    int rows = 0, cols = 0, count = 0;
    std::vector<MuonPiece> pieces;
  };
  size_t plan_muon_batches() {
    std::map<std::pair<int, int>, std::vector<size_t>> by_shape;
    std::vector<std::pair<int, int>> order;  // shapes in order of first appearance
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      if (!s.held || !is_muon(s.kind) || s.mat_numel() == 0) continue;
      auto key = std::make_pair(s.rows, s.cols);
      if (!by_shape.count(key)) order.push_back(key);
      by_shape[key].push_back(i);
    }
    size_t most = 0;
    for (const auto& key : order) {
      const size_t mn = size_t(key.first) * size_t(key.second);
      const int64_t cap = int64_t(std::max<size_t>(1, std::min<size_t>(kMuonBatchBytes / (mn * sizeof(float)),
                                                                         size_t(1) << 30)));
      MuonBatch cur;
      auto flush = [&] {
        if (cur.count == 0) return;
        most = std::max(most, size_t(cur.count) * mn);
        muon_batches_.push_back(std::move(cur));
        cur = MuonBatch{};
      };
      for (size_t si : by_shape[key]) {
        const Slot& s = slots_[si];
        for (int64_t e = 0; e < s.nmat;) {
          if (cur.count == cap) flush();
          cur.rows = key.first, cur.cols = key.second;
          const int take = int(std::min<int64_t>(s.nmat - e, cap - cur.count));
          cur.pieces.push_back({si, e, take, size_t(cur.count) * mn});
          cur.count += take;
          e += take;
        }
      }
      flush();
    }
    return most;
  }

  OptimConfig oc_;
  Backend& be_;
  std::optional<OptimizerShards> shards_;
  std::vector<ParamGroup> groups_;
  std::vector<Slot> slots_;
  Arena m_arena_, v_arena_, mom_arena_, rad_arena_;
  std::vector<float> radius_host_;  // host copy of rad_arena_ (same layout), written by take_radii()
  std::vector<OptimTensor> adam_tab_, adamh_tab_;  // adam/adamw and adamh tensors, parameter order
  std::vector<double> group_lr_;                   // this step's lr per group
  std::vector<float> group_lr_f_, group_wd_f_;     // as adamw_multi takes them
  Arena scratch_;                   // Muon's D, one batch (backend memory)
  float* muon_d_ = nullptr;
  std::vector<MuonBatch> muon_batches_;
  int64_t t_ = 0;
};

}  // namespace

RunShape run_shape(const Config& cfg, int world) {
  RunShape rs;
  rs.tokens_per_step = double(cfg.run.batch_size) * cfg.run.grad_accum * cfg.model.seq_len * world;
  rs.total_tokens = rs.tokens_per_step * double(cfg.run.steps);
  rs.d_model = cfg.model.d_model;
  return rs;
}

double auto_adam_lr(const RunShape& rs) {
  const double B = rs.tokens_per_step / 4096.0;  // batch in 4096-token sequences
  return 1.63 * std::pow(rs.total_tokens, -0.2813) * std::pow(double(rs.d_model), -0.3678) * std::sqrt(B);
}

double adamh_lr_from_adam(double adam_lr) { return std::min(0.05, 13.0 / 3.0 * adam_lr); }

double recipe_beta2(double tokens_per_step) {
  // Rounded to 8 decimals: the value enters a ladder run's config and so its hash, which must not
  // depend on the last bit of the machine's pow (workers on several hosts share one results store).
  return std::round(std::clamp(std::pow(0.999, tokens_per_step / 131072.0), 0.95, 0.9999) * 1e8) / 1e8;
}

std::vector<ParamGroup> plan_groups(const OptimConfig& oc, std::vector<Param>& params, const RunShape& rs) {
  const Kind preset = parse_kind(oc.name);
  // 1. The preset.
  std::vector<Kind> kind(params.size());
  for (size_t i = 0; i < params.size(); ++i) kind[i] = preset_kind(preset, params[i].role);
  // 2. Overrides: each optim.<opt>_params claims tensors; a tensor claimed by two keys is an error,
  // and so is a selector that matches nothing (select_params).
  std::vector<int> claimed_by(params.size(), -1);
  for (int k = 0; k < 5; ++k) {
    const std::string key = std::string("optim.") + kKindNames[k] + "_params";
    for (const std::string& sel : split_selectors(params_key(oc, Kind(k))))
      for (size_t i : select_params(key, sel, params)) {
        if (claimed_by[i] >= 0 && claimed_by[i] != k)
          fail("{}: '{}' is also claimed by optim.{}_params (a tensor belongs to exactly one group)", key,
               params[i].name, kKindNames[claimed_by[i]]);
        claimed_by[i] = k;
        kind[i] = Kind(k);
      }
  }
  // 3. Muon and the hyperball work on matrices: a vector there is a configuration error.
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    if (!(is_muon(kind[i]) || hyperball(kind[i]))) continue;
    const std::string who = claimed_by[i] >= 0 ? fmt::format("optim.{}_params", kKindNames[claimed_by[i]])
                                               : fmt::format("optim.name={}", oc.name);
    if (p.shape.size() < 2)
      fail("{}: '{}' is a vector (shape {}); {} needs matrices (2-D, or [E, out, in] experts): give it to adam", who,
           p.name, shape_str(p.shape), kind_name(kind[i]));
    if (p.shape.size() > 3)
      fail("{}: '{}' has shape {}; {} takes 2-D matrices or [E, out, in] expert stacks", who, p.name,
           shape_str(p.shape), kind_name(kind[i]));
  }
  // 4. optim.lr_mults: a factor per tensor (1 where no entry matches), checked as the claims above.
  std::vector<double> factor(params.size(), 1.0);
  std::vector<std::string> factor_by(params.size());
  for (const auto& [sel, f] : parse_lr_mults(oc.lr_mults))
    for (size_t i : select_params("optim.lr_mults", sel, params)) {
      if (!factor_by[i].empty())
        fail("optim.lr_mults: '{}' is matched by both '{}' and '{}' (give each tensor one factor)", params[i].name,
             factor_by[i], sel);
      factor_by[i] = sel;
      factor[i] = f;
    }
  // 5. Groups: by optimizer; AdamW keeps its three groups (matrices decay, embedding, the rest),
  // other optimizers split off the embedding only for optim.embed_lr_mult; tensors with an
  // optim.lr_mults factor other than 1 get a group of their own per factor ("adamh x4").
  std::vector<ParamGroup> groups;
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = params[i];
    const Kind k = kind[i];
    std::string name;
    if (k == Kind::AdamW)
      name = p.role == Role::Embedding ? "embedding" : decayed(p.role) ? "matrices" : "norms";
    else
      name = std::string(kind_name(k)) + (p.role == Role::Embedding ? ".embedding" : "");
    if (factor[i] != 1.0) name += fmt::format(" x{}", factor[i]);  // shortest exact form: one group per factor
    auto it = index.find(name);
    if (it == index.end()) {
      ParamGroup g;
      g.name = name;
      g.optimizer = kind_name(k);
      Lr lr = resolve_lr(oc, k, rs);
      g.lr = lr.value;
      g.lr_from = lr.from;
      g.lr_mult = (p.role == Role::Embedding ? oc.embed_lr_mult : 1.0) * factor[i];
      g.weight_decay = k == Kind::AdamW && decayed(p.role) ? oc.weight_decay : 0.0;
      // A hyperball lr is an angle-like step relative to ||W0||: at 1 or more one step can take a
      // matrix to (or through) the origin, where the rescale to the sphere divides by ~0.
      if ((k == Kind::AdamH || k == Kind::MuonH) && !(g.lr * g.lr_mult < 1)) {
        std::string times;
        if (p.role == Role::Embedding && oc.embed_lr_mult != 1) times += fmt::format(" x optim.embed_lr_mult {}", oc.embed_lr_mult);
        if (factor[i] != 1) times += fmt::format(" x optim.lr_mults {}", factor[i]);
        fail("{} (peak{}): group {}'s lr is {}, a relative step on the hyperball: it must be < 1 (the recipe's are "
             "<= 0.05)",
             g.lr_from, times, g.name, g.lr * g.lr_mult);
      }
      it = index.emplace(name, groups.size()).first;
      groups.push_back(std::move(g));
    }
    groups[it->second].params.push_back(&p);
  }
  // The CUDA backend passes per-group scalars as kernel arguments: say so here (and in --dry-run),
  // not at a GPU run's first step.
  if (groups.size() > size_t(kMaxOptimizerGroups))
    fail("optim: {} parameter groups, at most {} (each optimizer x embedding x optim.lr_mults factor is one; use fewer "
         "distinct factors)",
         groups.size(), kMaxOptimizerGroups);
  return groups;
}

std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& oc, std::vector<Param>& params, Backend& be,
                                          const RunShape& rs, const OptimizerShards* shards) {
  return std::make_unique<RecipeOptimizer>(oc, params, be, rs, shards);
}

std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& oc, Transformer& model, Backend& be) {
  RunShape rs;
  rs.d_model = model.config().d_model;  // no token budget: `auto` lrs fail with a clear line
  return make_optimizer(oc, model.params(), be, rs);
}

std::unique_ptr<Optimizer> make_optimizer(const Config& cfg, Transformer& model, Backend& be, int world,
                                          const OptimizerShards* shards) {
  return make_optimizer(cfg.optim, model.params(), be, run_shape(cfg, world), shards);
}

OptimizerShards plan_optimizer_shards(const Config& cfg, Transformer& model, int rank, int world) {
  LADDER_ASSERT(world >= 1 && rank >= 0 && rank < world);
  std::vector<Param>& params = model.params();
  const std::vector<ParamGroup> groups = plan_groups(cfg.optim, params, run_shape(cfg, world));
  // Each tensor's state in floats (what the ranks share out): Adam's two moments, Muon's momentum,
  // the hyperball's radii.
  std::map<const Param*, double> cost;
  for (const ParamGroup& g : groups) {
    const Kind k = parse_kind(g.optimizer);
    for (const Param* p : g.params)
      cost[p] = double(p->numel) * ((adam_family(k) ? 2 : 0) + (is_muon(k) ? 1 : 0)) +
                (hyperball(k) ? double(p->shape.size() == 3 ? p->shape[0] : 1) : 0.0);
  }
  // The tensors in arena order, and the prefix sums of their state.
  const float* base = model.weights();
  std::vector<size_t> order(params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return params[a].w < params[b].w; });
  std::vector<double> prefix(order.size() + 1, 0.0);
  for (size_t j = 0; j < order.size(); ++j) prefix[j + 1] = prefix[j] + cost.at(&params[order[j]]);
  // Rank r takes the tensors [cut[r], cut[r + 1]) of that order: each cut at the tensor boundary
  // nearest to r / world of the state.
  std::vector<size_t> cut(size_t(world) + 1, order.size());
  cut[0] = 0;
  for (int r = 1; r < world; ++r) {
    const double target = prefix.back() * r / world;
    size_t j = size_t(std::lower_bound(prefix.begin(), prefix.end(), target) - prefix.begin());
    if (j > 0 && target - prefix[j - 1] < prefix[j] - target) --j;
    cut[size_t(r)] = std::max(cut[size_t(r) - 1], std::min(j, order.size()));
  }
  OptimizerShards sh;
  sh.rank = rank;
  sh.world = world;
  sh.owner.assign(params.size(), 0);
  sh.offsets.assign(size_t(world) + 1, model.weights_floats());
  sh.grad_offsets.assign(size_t(world) + 1, model.grads_floats());
  sh.offsets[0] = sh.grad_offsets[0] = 0;
  for (int r = 0; r < world; ++r) {
    for (size_t j = cut[size_t(r)]; j < cut[size_t(r) + 1]; ++j) sh.owner[order[j]] = r;
    if (r > 0 && cut[size_t(r)] < order.size()) {
      const Param& first = params[order[cut[size_t(r)]]];
      sh.offsets[size_t(r)] = size_t(first.w - base);
      sh.grad_offsets[size_t(r)] = size_t(first.g - model.grads_data());
    }
  }
  // The gradient arena is laid out as the weights (the same tensors in the same order), so the
  // ranges hold the same tensors.
  for (size_t j = 1; j < order.size(); ++j) LADDER_ASSERT(params[order[j - 1]].g < params[order[j]].g);
  return sh;
}

size_t held_state_bytes(Optimizer& opt) {
  size_t n = 0;
  for (const StateTensor& s : opt.state())
    if (s.data) n += s.numel() * sizeof(float);
  return n;
}

std::string dry_run_report(const Config& cfg, int world) {
  validate(cfg);
  // Only the parameter list is needed: a backend that is never called and a batch of one.
  auto be = make_cpu_backend(1);
  Transformer model(cfg.model, 1, *be);
  auto groups = plan_groups(cfg.optim, model.params(), run_shape(cfg, world));
  std::map<const Param*, const ParamGroup*> of;
  for (auto& g : groups)
    for (Param* p : g.params) of[p] = &g;
  std::ostringstream o;
  o << fmt::format("optimizer preset: {} ({})\n", cfg.optim.name, cfg.source);
  o << fmt::format("{:<48} {:<14} {:<14} {:<20} {:<10} {:>10}\n", "tensor", "role", "shape", "group", "optimizer",
                   "peak lr");
  for (auto& p : model.params()) {
    const ParamGroup& g = *of.at(&p);
    o << fmt::format("{:<48} {:<14} {:<14} {:<20} {:<10} {:>10.4g}\n", p.name, role_name(p.role), shape_str(p.shape),
                     g.name, g.optimizer, g.lr * g.lr_mult);
  }
  o << "groups:\n";
  for (auto& g : groups) {
    size_t n = 0;
    for (Param* p : g.params) n += p->numel;
    o << fmt::format("  {:<20} {:<6} {:>3} tensors {:>11} values  lr {:.4g}{} ({}){}\n", g.name, g.optimizer,
                     g.params.size(), n, g.lr * g.lr_mult, g.lr_mult != 1.0 ? fmt::format(" (x{})", g.lr_mult) : "",
                     g.lr_from, g.weight_decay > 0 ? fmt::format(", weight decay {}", g.weight_decay) : "");
  }
  const auto& s = cfg.schedule;
  o << fmt::format("schedule: {}, warmup {} of {} steps, final lr {}x peak; grad clip {}; z-loss {}\n", s.type,
                   warmup_steps(s, cfg.run.steps), cfg.run.steps, s.final_lr_frac,
                   cfg.optim.clip > 0 ? fmt::format("{}", cfg.optim.clip) : std::string("off"),
                   cfg.model.z_loss > 0 ? fmt::format("{}", cfg.model.z_loss) : std::string("off"));
  return o.str();
}

}  // namespace ladder
