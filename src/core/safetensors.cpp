#include "core/safetensors.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <tuple>

#include <fmt/ranges.h>

#include "core/error.h"
#include "core/fileio.h"

// The format is little-endian and we read/write tensor bytes and the length prefix verbatim.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace ladder {

namespace {

using ojson = nlohmann::ordered_json;

// A header larger than this is certainly corrupt (real headers are a few hundred bytes per
// tensor); the cap keeps a garbage length prefix from making us parse gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;

constexpr DType kAllDTypes[] = {DType::F32, DType::F64, DType::I32, DType::I64,
                                DType::U8,  DType::BF16, DType::F16, DType::U16};

bool parse_dtype(std::string_view s, DType* out) {
  for (DType d : kAllDTypes) {
    if (s == dtype_name(d)) {
      *out = d;
      return true;
    }
  }
  return false;
}

// Element count with overflow detection; false for a negative dim or overflow. Shape [] is a
// scalar: the empty product, 1.
bool checked_numel(const std::vector<int64_t>& shape, int64_t* out) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return false;
  }
  *out = n;
  return true;
}

bool checked_nbytes(int64_t numel, DType d, size_t* out) {
  return !__builtin_mul_overflow(static_cast<size_t>(numel), dtype_size(d), out);
}

}  // namespace

std::string shape_str(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

size_t dtype_size(DType d) {
  switch (d) {
    case DType::F64:
    case DType::I64: return 8;
    case DType::F32:
    case DType::I32: return 4;
    case DType::BF16:
    case DType::F16:
    case DType::U16: return 2;
    case DType::U8: return 1;
  }
  LADDER_ASSERT(false && "unknown DType");
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::U16: return "U16";
  }
  LADDER_ASSERT(false && "unknown DType");
}

// ------------------------------------------------------------------------------------------------
// Writing

void save_safetensors(const std::filesystem::path& path, const std::vector<TensorRef>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const std::string file = path.string();

  // Validate and build the header before touching the filesystem: a bad argument must never
  // disturb an existing checkpoint at `path`.
  // ordered_json keeps tensors in the header in the order given (matches the data layout, which
  // makes the header readable by eye); readers do not depend on key order.
  ojson header = ojson::object();
  if (!metadata.empty()) {
    ojson m = ojson::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = std::move(m);
  }
  std::set<std::string_view> seen;
  std::vector<size_t> sizes;
  sizes.reserve(tensors.size());
  size_t offset = 0;
  for (const TensorRef& t : tensors) {
    if (t.name.empty()) fail("{}: cannot save a tensor with an empty name", file);
    if (t.name == "__metadata__") fail("{}: '__metadata__' is reserved and cannot name a tensor", file);
    if (!seen.insert(t.name).second) fail("{}: duplicate tensor name '{}'", file, t.name);
    int64_t numel = 0;
    size_t nbytes = 0;
    if (!checked_numel(t.shape, &numel) || !checked_nbytes(numel, t.dtype, &nbytes))
      fail("{}: tensor '{}': invalid shape {} (negative or overflowing dimension)", file, t.name,
           shape_str(t.shape));
    if (nbytes > 0 && t.data == nullptr)
      fail("{}: tensor '{}': data is null for a {} {} tensor", file, t.name, dtype_name(t.dtype),
           shape_str(t.shape));
    header[t.name] = ojson{{"dtype", dtype_name(t.dtype)},
                           {"shape", t.shape},
                           {"data_offsets", {offset, offset + nbytes}}};
    sizes.push_back(nbytes);
    offset += nbytes;
  }

  std::string text;
  try {
    text = header.dump();  // strict: a name that is not valid UTF-8 cannot be represented
  } catch (const nlohmann::json::exception& e) {
    fail("{}: cannot encode header (tensor names and metadata must be valid UTF-8): {}", file, e.what());
  }
  // Pad so the data buffer starts 8-byte aligned (8-byte prefix + header length multiple of 8),
  // as the reference writer does; spaces are JSON whitespace so parsers ignore them.
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_len = text.size();

  // Stream to a temporary beside `path` (rename is atomic only within one filesystem), then
  // fsync + rename. Streaming avoids a second in-memory copy of a multi-GB checkpoint.
  AtomicFileWriter out(path);
  out.write(&header_len, 8);
  out.write(text);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (sizes[i] > 0) out.write(tensors[i].data, sizes[i]);
  }
  out.commit();
}

// ------------------------------------------------------------------------------------------------
// Reading

SafeTensors SafeTensors::open(const std::filesystem::path& path) {
  const std::string file = path.string();
  SafeTensors st;
  st.path_ = path;

  auto map = std::make_shared<const MappedFile>(MappedFile::open(path, "safetensors file"));
  const uint64_t file_size = map->size();
  if (file_size < 8)
    fail("{}: not a safetensors file: {} bytes, expected at least 8 (the header length)", file, file_size);
  const auto* bytes = reinterpret_cast<const unsigned char*>(map->data());
  st.map_ = map;

  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes, 8);
  if (header_len > file_size - 8)
    fail("{}: header length {} exceeds the {} bytes after the length prefix (truncated, or not a "
         "safetensors file)", file, header_len, file_size - 8);
  if (header_len > kMaxHeaderBytes)
    fail("{}: header length {} exceeds the {}-byte limit (corrupt file?)", file, header_len, kMaxHeaderBytes);
  const size_t buffer_size = file_size - 8 - header_len;
  st.buffer_ = bytes + 8 + header_len;

  // Duplicate top-level keys are legal JSON but the parser would silently keep the last one;
  // in a checkpoint that means a corrupt or hand-edited file, so reject it.
  std::set<std::string> keys;
  std::string duplicate;
  auto on_event = [&](int depth, ojson::parse_event_t ev, ojson& parsed) {
    if (depth == 1 && ev == ojson::parse_event_t::key && parsed.is_string()) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!keys.insert(k).second && duplicate.empty()) duplicate = k;
    }
    return true;
  };
  ojson header;
  try {
    const char* h = reinterpret_cast<const char*>(bytes + 8);
    header = ojson::parse(h, h + header_len, on_event);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: header ({} bytes) is not valid JSON: {}", file, header_len, e.what());
  }
  if (!header.is_object()) fail("{}: header must be a JSON object, found {}", file, header.type_name());
  if (!duplicate.empty()) fail("{}: header names '{}' more than once", file, duplicate);

  struct Pending {
    std::string name;
    size_t begin, end, order;
  };
  std::vector<Pending> pending;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) fail("{}: __metadata__ must be an object of strings, found {}", file, v.type_name());
      for (const auto& [k, mv] : v.items()) {
        if (!mv.is_string())
          fail("{}: __metadata__ '{}' must be a string, found {}", file, k, mv.type_name());
        st.metadata_[k] = mv.get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) fail("{}: tensor '{}': expected an object, found {}", file, name, v.type_name());
    auto field = [&](const char* key) -> const ojson& {
      auto it = v.find(key);
      if (it == v.end()) fail("{}: tensor '{}': missing \"{}\"", file, name, key);
      return *it;
    };
    const ojson& jd = field("dtype");
    const ojson& js = field("shape");
    const ojson& jo = field("data_offsets");

    Entry e{};
    if (!jd.is_string()) fail("{}: tensor '{}': dtype must be a string, found {}", file, name, jd.dump());
    if (!parse_dtype(jd.get_ref<const std::string&>(), &e.dtype))
      fail("{}: tensor '{}': unsupported dtype {} (expected one of F32, F64, I32, I64, U8, BF16, F16, U16)",
           file, name, jd.dump());
    if (!js.is_array()) fail("{}: tensor '{}': shape must be an array, found {}", file, name, js.dump());
    for (const auto& d : js) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        fail("{}: tensor '{}': shape {} must contain non-negative integers", file, name, js.dump());
      e.shape.push_back(d.get<int64_t>());
    }
    size_t expect_bytes = 0;
    if (!checked_numel(e.shape, &e.numel) || !checked_nbytes(e.numel, e.dtype, &expect_bytes))
      fail("{}: tensor '{}': shape {} is too large", file, name, js.dump());
    if (!jo.is_array() || jo.size() != 2 || !jo[0].is_number_unsigned() || !jo[1].is_number_unsigned())
      fail("{}: tensor '{}': data_offsets must be [begin, end] (non-negative integers), found {}", file,
           name, jo.dump());
    const uint64_t b = jo[0].get<uint64_t>(), en = jo[1].get<uint64_t>();
    if (en < b) fail("{}: tensor '{}': data_offsets [{}, {}] end before they begin", file, name, b, en);
    if (en - b != expect_bytes)
      fail("{}: tensor '{}': data_offsets [{}, {}] span {} bytes, expected {} ({} {} = {} x {} bytes)",
           file, name, b, en, en - b, expect_bytes, dtype_name(e.dtype), shape_str(e.shape), e.numel,
           dtype_size(e.dtype));
    if (en > buffer_size)
      fail("{}: tensor '{}': data_offsets [{}, {}] extend past the {}-byte data buffer (truncated file?)",
           file, name, b, en, buffer_size);
    e.begin = b;
    e.end = en;
    pending.push_back({name, e.begin, e.end, pending.size()});
    st.entries_.emplace(name, std::move(e));
  }

  // The data buffer must be tiled exactly: tensors back to back from offset 0 to the end of the
  // file. Overlaps would alias two tensors; gaps or trailing bytes mean a corrupt or
  // mis-assembled file. (Sorting by (begin, end) puts an empty tensor before a non-empty one at
  // the same offset, as the reference implementation does.)
  std::sort(pending.begin(), pending.end(), [](const Pending& a, const Pending& b) {
    return std::tie(a.begin, a.end, a.order) < std::tie(b.begin, b.end, b.order);
  });
  size_t expected = 0;
  const std::string* prev = nullptr;
  for (const Pending& p : pending) {
    if (p.begin < expected)
      fail("{}: tensor '{}': data_offsets [{}, {}] overlap tensor '{}' (which ends at {})", file, p.name,
           p.begin, p.end, *prev, expected);
    if (p.begin > expected)
      fail("{}: tensor '{}': data_offsets [{}, {}] leave a gap: bytes [{}, {}) belong to no tensor", file,
           p.name, p.begin, p.end, expected, p.begin);
    expected = p.end;
    prev = &p.name;
    st.order_.push_back(p.name);
  }
  if (expected != buffer_size)
    fail("{}: data buffer is {} bytes but the tensors cover only {} ({} unexplained trailing bytes)", file,
         buffer_size, expected, buffer_size - expected);
  return st;
}

bool SafeTensors::has(const std::string& name) const { return entries_.count(name) != 0; }

std::vector<std::string> SafeTensors::names() const { return order_; }

const SafeTensors::Entry& SafeTensors::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    // Listing a few names makes a prefix mismatch ("model.layers.0" vs "layers.0") obvious.
    std::vector<std::string> some(order_.begin(), order_.begin() + std::min<size_t>(order_.size(), 3));
    fail("{}: no tensor '{}' (file has {} tensors{}{})", path_.string(), name, order_.size(),
         some.empty() ? "" : ", e.g. ", fmt::join(some, ", "));
  }
  return it->second;
}

DType SafeTensors::dtype(const std::string& name) const { return entry(name).dtype; }
const std::vector<int64_t>& SafeTensors::shape(const std::string& name) const { return entry(name).shape; }
int64_t SafeTensors::numel(const std::string& name) const { return entry(name).numel; }
size_t SafeTensors::nbytes(const std::string& name) const {
  const Entry& e = entry(name);
  return e.end - e.begin;
}
const void* SafeTensors::data(const std::string& name) const { return buffer_ + entry(name).begin; }

void SafeTensors::check(const std::string& name, const Entry& e, const std::vector<int64_t>& shape,
                        bool allow_f32_as_f64) const {
  const bool dtype_ok = allow_f32_as_f64 ? (e.dtype == DType::F64 || e.dtype == DType::F32)
                                         : e.dtype == DType::F32;
  if (!dtype_ok || e.shape != shape)
    fail("{}: tensor '{}': expected {} {}, found {} {}", path_.string(), name,
         allow_f32_as_f64 ? "F64 (or F32)" : "F32", shape_str(shape), dtype_name(e.dtype),
         shape_str(e.shape));
}

void SafeTensors::read_f32(const std::string& name, const std::vector<int64_t>& shape, float* dst) const {
  const Entry& e = entry(name);
  check(name, e, shape, false);
  if (e.numel > 0) std::memcpy(dst, buffer_ + e.begin, e.end - e.begin);
}

void SafeTensors::read_f64(const std::string& name, const std::vector<int64_t>& shape, double* dst) const {
  const Entry& e = entry(name);
  check(name, e, shape, true);
  if (e.numel == 0) return;
  const unsigned char* src = buffer_ + e.begin;
  if (e.dtype == DType::F64) {
    std::memcpy(dst, src, e.end - e.begin);
  } else {
    for (int64_t i = 0; i < e.numel; ++i) {
      float f;
      std::memcpy(&f, src + i * 4, 4);  // source may be unaligned
      dst[i] = f;
    }
  }
}

std::vector<float> SafeTensors::get_f32(const std::string& name) const {
  const Entry& e = entry(name);
  check(name, e, e.shape, false);
  std::vector<float> out(static_cast<size_t>(e.numel));
  if (e.numel > 0) std::memcpy(out.data(), buffer_ + e.begin, e.end - e.begin);
  return out;
}

}  // namespace ladder
