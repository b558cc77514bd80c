// cuDNN's fused attention through its C++ frontend (graph API): one graph per shape and pass, built
// once (cuDNN's heuristics pick the engine), executed on the backend's stream. See attention_cudnn.h.
#include "backend/cuda/attention_cudnn.h"

#if LADDER_HAVE_CUDNN


#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <tuple>
#include <unordered_map>

#include <cudnn_frontend.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_memory.h"
#include "backend/cuda/runtime_library.h"
#include "core/error.h"

// The frontend, built with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING, resolves every cuDNN call through
// this handle (dlsym); open() sets it.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}

namespace ladder::cuda {
namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// Tensor ids of the variant packs (the graph's user tensors).
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// A shape's key: everything that changes a graph.
using Key = std::tuple<int, int, int, int, int, int, double>;
Key key_of(const cpu::AttnShape& s) {
  // A window that covers the whole sequence is plain causal attention: one graph, and no band mask.
  const int w = s.window > 0 && s.window < s.S ? s.window : 0;
  return {s.B, s.S, s.H, s.KV, s.hd, w, s.scale};
}

// [B*S, heads*hd] row-major bf16 activations as cuDNN's (B, heads, S, hd) with strides ("BSHD").
void as_bshd(const TensorPtr& t, const char* name, int64_t uid, const cpu::AttnShape& s, int heads) {
  const int64_t B = s.B, S = s.S, h = heads, d = s.hd;
  t->set_name(name).set_uid(uid).set_dim({B, h, S, d}).set_stride({S * h * d, d, h * d, 1}).set_data_type(
      fe::DataType_t::BFLOAT16);
}
TensorPtr bshd_input(fe::graph::Graph& g, const char* name, int64_t uid, const cpu::AttnShape& s, int heads) {
  TensorPtr t = g.tensor(fe::graph::Tensor_attributes());
  as_bshd(t, name, uid, s, heads);
  return t;
}
// lse [B, H, S] fp32: cuDNN's stats (B, H, S, 1); an output of the forward, an input of the backward.
void as_stats(const TensorPtr& t, const cpu::AttnShape& s) {
  const int64_t B = s.B, S = s.S, H = s.H;
  t->set_name("lse").set_uid(kStats).set_dim({B, H, S, 1}).set_stride({H * S, S, 1, 1}).set_data_type(
      fe::DataType_t::FLOAT);
}

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

// The forward's and the backward's graphs of a shape, not yet built. sm_version > 0 targets that
// compute capability instead of the current device's (validate_graphs: no device needed).
struct Graphs {
  std::shared_ptr<fe::graph::Graph> fwd, bwd;
};
Graphs make_graphs(const cpu::AttnShape& s, int sm_version, bool deterministic) {
  const int w = std::get<5>(key_of(s));
  Graphs out{new_graph(), new_graph()};
  if (sm_version > 0) {
    out.fwd->set_sm_version(sm_version);
    out.bwd->set_sm_version(sm_version);
  }
  {  // Forward: o and the stats (lse) from q, k, v.
    fe::graph::Graph& g = *out.fwd;
    auto q = bshd_input(g, "q", kQ, s, s.H), k = bshd_input(g, "k", kK, s, s.KV), v = bshd_input(g, "v", kV, s, s.KV);
    auto opt = fe::graph::SDPA_attributes()
                   .set_name("ladder_attention")
                   .set_generate_stats(true)
                   .set_causal_mask(true)
                   .set_attn_scale(float(s.scale));
    if (w > 0) opt.set_diagonal_band_left_bound(w);
    auto [o, stats] = g.sdpa(q, k, v, std::move(opt));
    as_bshd(o, "o", kO, s, s.H);
    o->set_output(true);
    as_stats(stats, s);
    stats->set_output(true);
  }
  {  // Backward: dq, dk, dv from q, k, v, o, dO and the stats.
    fe::graph::Graph& g = *out.bwd;
    auto q = bshd_input(g, "q", kQ, s, s.H), k = bshd_input(g, "k", kK, s, s.KV), v = bshd_input(g, "v", kV, s, s.KV);
    auto o = bshd_input(g, "o", kO, s, s.H), dO = bshd_input(g, "dO", kDO, s, s.H);
    auto stats = g.tensor(fe::graph::Tensor_attributes());
    as_stats(stats, s);
    auto opt = fe::graph::SDPA_backward_attributes()
                   .set_name("ladder_attention_backward")
                   .set_causal_mask(true)
                   .set_attn_scale(float(s.scale))
                   .set_deterministic_algorithm(deterministic);
    if (w > 0) opt.set_diagonal_band_left_bound(w);
    auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dO, stats, std::move(opt));
    as_bshd(dq, "dq", kDQ, s, s.H);
    dq->set_output(true);
    as_bshd(dk, "dk", kDK, s, s.KV);
    dk->set_output(true);
    as_bshd(dv, "dv", kDV, s, s.KV);
    dv->set_output(true);
  }
  return out;
}

// Loads libcudnn (LADDER_CUDNN_LIB or libcudnn.so.9) once per process for the frontend; "" or why not.
std::string load_cudnn() {
  if (fe::cudnn_dlhandle) return "";
  const RuntimeLibrary lib = open_runtime_library("LADDER_CUDNN_LIB", "libcudnn.so.9");
  fe::cudnn_dlhandle = lib.handle;
  return lib.error;
}

class CudnnAttentionImpl final : public CudnnAttention {
 public:
  CudnnAttentionImpl(cudnnHandle_t h, cudaStream_t st, size_t version, int sm_major, bool deterministic)
      : h_(h),
        st_(st),
        version_(fmt::format("{}.{}.{}", version / 10000, version / 100 % 100, version % 100)),
        version_num_(version),
        sm_major_(sm_major),
        deterministic_(deterministic) {}
  ~CudnnAttentionImpl() override {
    if (st_) cudaStreamSynchronize(st_);  // queued work may still read the workspace
    plans_.clear();
    if (h_) fe::detail::destroy_handle(h_);
  }

  std::string version() const override { return version_; }
  size_t workspace_bytes() const override { return ws_.bytes(); }

  bool supports(const cpu::AttnShape& s, std::string* why, bool* built_now) override {
    const Key key = key_of(s);
    auto it = plans_.find(key);
    if (built_now) *built_now = it == plans_.end();
    if (it == plans_.end()) it = plans_.emplace(key, build(s)).first;
    if (!it->second.ok && why) *why = it->second.why;
    return it->second.ok;
  }

  void forward(uint16_t* o, float* lse, const uint16_t* q, const uint16_t* k, const uint16_t* v,
               const cpu::AttnShape& s) override {
    Plans& p = plans(s, "forward");
    auto& m = fwd_pack_;
    m[kQ] = const_cast<uint16_t*>(q);
    m[kK] = const_cast<uint16_t*>(k);
    m[kV] = const_cast<uint16_t*>(v);
    m[kO] = o;
    m[kStats] = lse;
    run(*p.fwd, m, "forward");
  }

  void backward(uint16_t* dq, uint16_t* dk, uint16_t* dv, const uint16_t* dout, const uint16_t* q, const uint16_t* k,
                const uint16_t* v, const uint16_t* o, const float* lse, const cpu::AttnShape& s) override {
    Plans& p = plans(s, "backward");
    auto& m = bwd_pack_;
    m[kQ] = const_cast<uint16_t*>(q);
    m[kK] = const_cast<uint16_t*>(k);
    m[kV] = const_cast<uint16_t*>(v);
    m[kO] = const_cast<uint16_t*>(o);
    m[kStats] = const_cast<float*>(lse);
    m[kDO] = const_cast<uint16_t*>(dout);
    m[kDQ] = dq;
    m[kDK] = dk;
    m[kDV] = dv;
    run(*p.bwd, m, "backward");
  }

 private:
  struct Plans {
    bool ok = false;
    std::string why;
    std::shared_ptr<fe::graph::Graph> fwd, bwd;
  };

  Plans& plans(const cpu::AttnShape& s, const char* pass) {
    auto it = plans_.find(key_of(s));
    if (it == plans_.end() || !it->second.ok)
      fail("internal error: cuDNN attention {} of a shape supports() did not accept", pass);
    return it->second;
  }

  // Each pass has its own pack holding exactly its graph's tensors; the maps keep their nodes (one
  // per uid, made on the first call), so filling them allocates nothing after that.
  void run(const fe::graph::Graph& g, std::unordered_map<int64_t, void*>& pack, const char* pass) {
    fe::error_t st;
    try {
      st = g.execute(h_, pack, ws_.data());
    } catch (const std::exception& e) {
      fail("cuDNN attention {}: {}", pass, e.what());
    }
    if (st.is_bad()) fail("cuDNN attention {}: {}", pass, st.get_message());
  }

  Plans build(const cpu::AttnShape& s) {
    Plans p;
    if (const double mib = dp_workspace_mib(s); mib > 0) {
      p.why = fmt::format(
          "its deterministic backward would keep the S x S matrix dP of every batch and head ({:.0f} MiB of "
          "workspace; cuDNN 9.25+ on Hopper orders its dQ sums instead); LADDER_ATTN_CUDNN=nondeterministic "
          "takes its atomic dQ",
          mib);
      return p;
    }
    try {
      Graphs g = make_graphs(s, 0, deterministic_);
      p.fwd = std::move(g.fwd);
      p.bwd = std::move(g.bwd);
      if (!built(*p.fwd, "forward", &p.why) || !built(*p.bwd, "backward", &p.why)) return p;
      // The workspace grows to the largest plan's, here, outside any step's loop of calls. Queued
      // work may still use the old one: wait for it first.
      int64_t need = 0;
      for (auto* graph : {p.fwd.get(), p.bwd.get()}) {
        int64_t b = 0;
        if (graph->get_workspace_size(b).is_bad()) {
          p.why = "cuDNN gave no workspace size";
          return p;
        }
        need = std::max(need, b);
      }
      if (size_t(need) > ws_.bytes()) {
        LADDER_CUDA_CHECK(cudaStreamSynchronize(st_));
        ws_.reserve(size_t(need), "cuDNN attention workspace");
      }
      p.ok = true;
    } catch (const std::exception& e) {  // the frontend throws where a library or symbol is missing
      p.ok = false;
      p.why = e.what();
    }
    return p;
  }

  // The MiB of the dP matrices (S x S per batch and head, bf16) if the frontend (1.32) would build this
  // shape's deterministic backward on its "dP workspace" decomposition, else 0: it does so everywhere
  // but on Hopper with cuDNN 9.25+, and there unless CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT is below
  // those bytes (open() sets it to 0). The flash attention keeps no S x S matrix: such a
  // shape is declined before anything is built.
  double dp_workspace_mib(const cpu::AttnShape& s) const {
    if (!deterministic_) return 0;
    const auto up = [](int64_t n, int64_t m) { return (n + m - 1) / m * m; };
    const int64_t bh = int64_t(s.B) * s.H;
    const double mib = double(bh * up(s.S, 64) * up(s.S, 64) * 2) / (1 << 20);
    if (sm_major_ != 9 || version_num_ < 92500) return mib;
    const char* e = std::getenv("CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT");
    char* end = nullptr;
    const long long limit = e ? std::strtoll(e, &end, 10) : -1;
    if (!e || !end || *end || limit < 0) return mib;
    return bh * up(s.S, 64) * up(s.S, 128) * 2 > limit ? 0 : mib;
  }

  bool built(fe::graph::Graph& g, const char* pass, std::string* why) {
    fe::error_t st = g.build(h_, {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
    if (st.is_bad()) *why = fmt::format("{}: {}", pass, st.get_message());
    return st.is_good();
  }

  cudnnHandle_t h_ = nullptr;
  cudaStream_t st_ = nullptr;
  std::string version_;
  size_t version_num_;
  int sm_major_;
  bool deterministic_;
  DeviceBuffer<uint8_t> ws_;
  std::map<Key, Plans> plans_;
  std::unordered_map<int64_t, void*> fwd_pack_, bwd_pack_;
};

}  // namespace

// libcudnn.so.9 is a shim that opens its sub-libraries (libcudnn_graph, libcudnn_engines_*) by name
// through the loader's search: a library named by a path in LADDER_CUDNN_LIB loads, and then cuDNN
// fails to find the rest unless that folder is on LD_LIBRARY_PATH. Said where such a failure shows.
static std::string sublibrary_hint() {
  const char* env = std::getenv("LADDER_CUDNN_LIB");
  if (!env || !std::strchr(env, '/')) return "";
  return fmt::format(" (cuDNN 9 opens libcudnn_graph and its engine libraries by name: put the folder of "
                     "LADDER_CUDNN_LIB={} on LD_LIBRARY_PATH)",
                     env);
}

std::unique_ptr<CudnnAttention> CudnnAttention::open(cudaStream_t stream, bool deterministic, std::string* why) {
  if (std::string e = load_cudnn(); !e.empty()) {
    *why = e;
    return nullptr;
  }
  // The frontend opens a CUDA runtime of its own for a few queries, trying libcudart.so.12 before .13;
  // name the major this build was compiled against (a value the user set is kept).
  setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", fmt::format("libcudart.so.{}", CUDART_VERSION / 1000).c_str(), 0);
  try {
    const size_t v = fe::detail::get_backend_version();
    if (v < 90000) {
      *why = fmt::format("cuDNN {} is older than 9.0", v);
      return nullptr;
    }
    int dev = 0, major = 0;
    LADDER_CUDA_CHECK(cudaGetDevice(&dev));
    LADDER_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    cudnnHandle_t h = nullptr;
    const cudnnStatus_t st = fe::detail::create_handle(&h);
    if (st != CUDNN_STATUS_SUCCESS) {
      *why = fmt::format("cudnnCreate: {}{}", fe::detail::get_error_string(st), sublibrary_hint());
      return nullptr;
    }
    const cudnnStatus_t ss = fe::detail::set_stream(h, stream);
    if (ss != CUDNN_STATUS_SUCCESS) {
      fe::detail::destroy_handle(h);
      *why = fmt::format("cudnnSetStream: {}", fe::detail::get_error_string(ss));
      return nullptr;
    }
    // Where cuDNN (9.25+, Hopper) can serve the deterministic backward by ordering its dQ sums, the
    // frontend takes that route only when told the dP workspace is not allowed (its documented
    // switch, an environment variable); a value the user set is kept.
    if (deterministic) setenv("CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT", "0", 0);
    return std::make_unique<CudnnAttentionImpl>(h, stream, v, major, deterministic);
  } catch (const std::exception& e) {
    *why = e.what() + sublibrary_hint();
    return nullptr;
  }
}

std::string CudnnAttention::validate_graphs(const cpu::AttnShape& s, int sm_version, bool deterministic) {
  if (std::string e = load_cudnn(); !e.empty()) return e;
  try {
    const Graphs g = make_graphs(s, sm_version, deterministic);
    for (auto [graph, pass] : {std::pair{g.fwd.get(), "forward"}, std::pair{g.bwd.get(), "backward"}}) {
      fe::error_t st = graph->validate();
      if (st.is_bad()) return fmt::format("{}: {}", pass, st.get_message());
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace ladder::cuda

#endif  // LADDER_HAVE_CUDNN
