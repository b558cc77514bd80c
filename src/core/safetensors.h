// Reading and writing the safetensors format (https://github.com/huggingface/safetensors), so that
// Ladder checkpoints and weights can be exchanged with PyTorch/JAX tooling without a converter.
//
// Layout: u64 little-endian N; N bytes of JSON header
//   {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}}
// padded with spaces so the data buffer starts on an 8-byte boundary; then the data buffer, with
// every tensor's bytes (row-major, little-endian) at [b, e) relative to the buffer start. Tensors
// are contiguous, with no gaps, and the last one ends where the file ends (the reference
// implementation rejects anything else, so we both write and require exactly that).
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ladder {

class MappedFile;  // core/fileio.h

enum class DType { F32, F64, I32, I64, U8, BF16, F16, U16 };

size_t dtype_size(DType d);
// A shape as "[2, 3, 4]" (errors and tables; "[]" for a scalar).
std::string shape_str(const std::vector<int64_t>& shape);
// The name used in the header ("F32", "BF16", ...).
const char* dtype_name(DType d);

// A tensor to be written. Not owning: `data` must stay valid (and hold numel * dtype_size bytes,
// row-major, little-endian) until save_safetensors returns. Shape [] is a scalar (one element);
// a zero in the shape is an empty tensor, for which `data` may be null.
struct TensorRef {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data;
};

// Writes `tensors` (data laid out in the order given) and `metadata` to `path` atomically: the
// bytes are streamed to a temporary file in the same directory, fsynced, then renamed over
// `path`, so a crash or error leaves either the old file or the complete new one. Everything is
// validated (names unique and non-empty, shapes non-negative, data present) before any file is
// created. Throws ladder::Error naming the path on failure.
void save_safetensors(const std::filesystem::path& path, const std::vector<TensorRef>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// A read-only view of a safetensors file. The file is memory-mapped (checkpoints can be many GB;
// mapping avoids holding a second copy) and the whole header is validated on open, so every
// accessor afterwards can only fail for a missing name or a caller's wrong expectation.
// Copies are cheap and share the mapping.
class SafeTensors {
 public:
  // Throws ladder::Error (one line: file, tensor if any, expected vs found) if the file is
  // missing, truncated, or its header is malformed or inconsistent with the file's size.
  static SafeTensors open(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  bool has(const std::string& name) const;
  // Tensor names in file order (by data offset).
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  DType dtype(const std::string& name) const;
  const std::vector<int64_t>& shape(const std::string& name) const;
  int64_t numel(const std::string& name) const;
  size_t nbytes(const std::string& name) const;
  // Raw little-endian bytes inside the mapping. NOT necessarily aligned for the dtype (the format
  // packs tensors back to back), so read through memcpy or the typed readers below.
  const void* data(const std::string& name) const;

  // Copies tensor `name` into dst (numel floats), requiring dtype F32 and exactly `shape`.
  void read_f32(const std::string& name, const std::vector<int64_t>& shape, float* dst) const;
  // As read_f32 into doubles; accepts F64, or F32 widened (exact).
  void read_f64(const std::string& name, const std::vector<int64_t>& shape, double* dst) const;
  // The whole F32 tensor, whatever its shape.
  std::vector<float> get_f32(const std::string& name) const;

 private:
  struct Entry {
    DType dtype;
    std::vector<int64_t> shape;
    int64_t numel;
    size_t begin, end;  // relative to the data buffer
  };

  const Entry& entry(const std::string& name) const;
  void check(const std::string& name, const Entry& e, const std::vector<int64_t>& shape,
             bool allow_f32_as_f64) const;

  std::filesystem::path path_;
  std::shared_ptr<const MappedFile> map_;  // shared by copies of this reader
  const unsigned char* buffer_ = nullptr;  // start of the data buffer inside the mapping
  std::map<std::string, Entry> entries_;
  std::vector<std::string> order_;  // names by offset
  std::map<std::string, std::string> metadata_;
};

}  // namespace ladder
