#include "data/text_reader.h"

#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"

namespace ladder::data {

namespace fs = std::filesystem;

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return s;
}

// A stream of decompressed bytes. read() returns 0 only at the end; corruption is an error.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual size_t read(char* buf, size_t n) = 0;
};

class FileSource : public ByteSource {
 public:
  explicit FileSource(const fs::path& p) : path_(p) {
    f_ = std::fopen(p.c_str(), "rb");
    if (!f_) fail("{}: cannot open: {}", p.string(), std::strerror(errno));
  }
  ~FileSource() override {
    if (f_) std::fclose(f_);
  }
  size_t read(char* buf, size_t n) override {
    size_t got = std::fread(buf, 1, n, f_);
    if (got == 0 && std::ferror(f_)) fail("{}: read error: {}", path_.string(), std::strerror(errno));
    return got;
  }

 private:
  fs::path path_;
  FILE* f_ = nullptr;
};

// Decodes with inflate directly rather than gzread: gzread silently ignores bytes after the last gzip
// member and passes non-gzip files through, so a damaged or mislabelled file would read as text.
class GzipSource : public ByteSource {
 public:
  explicit GzipSource(const fs::path& p) : file_(p), path_(p), in_buf_(1 << 20) {
    // 16 + MAX_WBITS: gzip wrapper only (no raw deflate, no zlib header).
    if (inflateInit2(&z_, 16 + MAX_WBITS) != Z_OK) fail("{}: cannot create gzip decoder", p.string());
  }
  ~GzipSource() override { inflateEnd(&z_); }
  size_t read(char* buf, size_t n) override {
    z_.next_out = reinterpret_cast<Bytef*>(buf);
    z_.avail_out = uInt(std::min<size_t>(n, 1 << 30));
    const uInt want = z_.avail_out;
    while (z_.avail_out == want) {
      if (z_.avail_in == 0) {
        size_t got = file_.read(in_buf_.data(), in_buf_.size());
        if (got == 0) {
          if (file_bytes_ == 0) fail("{}: empty file, not gzip data (the name ends in .gz)", path_.string());
          if (in_member_ && header_.done != 1 && members_ > 0) trailing_bytes();
          if (in_member_)
            fail("{}: truncated gzip data (the file ends inside a gzip stream, after {} bytes)", path_.string(),
                 file_bytes_);
          break;
        }
        file_bytes_ += got;
        z_.next_in = reinterpret_cast<Bytef*>(in_buf_.data());
        z_.avail_in = uInt(got);
      }
      if (!in_member_) {
        // More bytes after a complete member must be another member (`cat a.gz b.gz` is valid gzip).
        inflateReset(&z_);
        header_ = gz_header{};
        inflateGetHeader(&z_, &header_);  // header_.done says whether the member's header was accepted
        in_member_ = true;
        member_start_ = file_bytes_ - z_.avail_in;
      }
      int r = inflate(&z_, Z_NO_FLUSH);
      if (r == Z_STREAM_END) {
        in_member_ = false;
        ++members_;
      } else if (r != Z_OK) {
        if (header_.done != 1 && members_ == 0) fail("{}: not gzip data (the name ends in .gz)", path_.string());
        if (header_.done != 1) trailing_bytes();
        fail("{}: corrupt gzip data ({})", path_.string(), z_.msg ? z_.msg : "unknown error");
      }
    }
    return size_t(want - z_.avail_out);
  }

 private:
  [[noreturn]] void trailing_bytes() const {
    fail("{}: unexpected bytes after the end of the gzip data at byte {} (expected the end of the file or "
         "another gzip member)", path_.string(), member_start_);
  }
  FileSource file_;
  fs::path path_;
  std::vector<char> in_buf_;
  z_stream z_{};
  gz_header header_{};
  bool in_member_ = false;
  uint64_t file_bytes_ = 0, member_start_ = 0, members_ = 0;
};

class ZstdSource : public ByteSource {
 public:
  explicit ZstdSource(const fs::path& p) : file_(p), path_(p), in_buf_(ZSTD_DStreamInSize()) {
    d_ = ZSTD_createDCtx();
    if (!d_) fail("{}: cannot create zstd decoder", p.string());
  }
  ~ZstdSource() override { ZSTD_freeDCtx(d_); }
  size_t read(char* buf, size_t n) override {
    ZSTD_outBuffer out{buf, n, 0};
    while (out.pos == 0) {
      if (in_.pos == in_.size) {
        size_t got = file_.read(in_buf_.data(), in_buf_.size());
        if (got == 0) {
          // A non-zero hint at end of input means the last frame is incomplete.
          if (last_ != 0) fail("{}: truncated zstd data (frame incomplete at end of file)", path_.string());
          return 0;
        }
        in_ = ZSTD_inBuffer{in_buf_.data(), got, 0};
      }
      size_t r = ZSTD_decompressStream(d_, &out, &in_);
      if (ZSTD_isError(r)) fail("{}: corrupt zstd data ({})", path_.string(), ZSTD_getErrorName(r));
      last_ = r;
    }
    return out.pos;
  }

 private:
  FileSource file_;
  fs::path path_;
  std::vector<char> in_buf_;
  ZSTD_inBuffer in_{nullptr, 0, 0};
  ZSTD_DCtx* d_ = nullptr;
  size_t last_ = 0;
};

// Splits a byte stream into lines (without "\n" or a trailing "\r"); the last line may lack "\n".
class LineReader {
 public:
  explicit LineReader(std::unique_ptr<ByteSource> src) : src_(std::move(src)), buf_(1 << 20) {}
  bool next(std::string& line) {
    line.clear();
    for (;;) {
      if (pos_ == end_) {
        if (eof_) break;
        end_ = src_->read(buf_.data(), buf_.size());
        pos_ = 0;
        if (end_ == 0) {
          eof_ = true;
          break;
        }
      }
      const char* start = buf_.data() + pos_;
      const char* nl = static_cast<const char*>(std::memchr(start, '\n', end_ - pos_));
      if (nl) {
        line.append(start, nl);
        pos_ += size_t(nl - start) + 1;
        finish(line);
        return true;
      }
      line.append(start, end_ - pos_);
      pos_ = end_;
    }
    if (line.empty()) return false;  // end of input, no unterminated last line
    finish(line);
    return true;
  }

 private:
  void finish(std::string& line) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (first_) {
      first_ = false;
      if (line.compare(0, 3, "\xEF\xBB\xBF") == 0) line.erase(0, 3);  // UTF-8 byte-order mark
    }
    ++line_no_;
  }
  std::unique_ptr<ByteSource> src_;
  std::vector<char> buf_;
  size_t pos_ = 0, end_ = 0;
  bool eof_ = false, first_ = true;

 public:
  size_t line_no_ = 0;  // number of the line last returned (1-based)
};

bool blank(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; });
}

}  // namespace

void detect_format(const fs::path& file, TextFormat* format, Compression* compression) {
  fs::path name = file.filename();
  std::string ext = lower(name.extension().string());
  *compression = Compression::None;
  if (ext == ".gz" || ext == ".zst") {
    *compression = ext == ".gz" ? Compression::Gzip : Compression::Zstd;
    name = name.stem();
    ext = lower(name.extension().string());
  }
  if (ext.empty() || ext == ".txt" || ext == ".text" || ext == ".md")
    *format = TextFormat::Plain;
  else if (ext == ".jsonl" || ext == ".json")
    *format = TextFormat::Jsonl;
  else
    fail("{}: unsupported input extension '{}' (expected .txt, .text, .md, .jsonl or .json, optionally "
         "followed by .gz or .zst)", file.string(), ext);
}

void for_each_document(const fs::path& file, const std::function<void(std::string&&)>& fn) {
  TextFormat format;
  Compression comp;
  detect_format(file, &format, &comp);
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) fail("{}: input file not found", file.string());
  std::unique_ptr<ByteSource> src;
  switch (comp) {
    case Compression::None: src = std::make_unique<FileSource>(file); break;
    case Compression::Gzip: src = std::make_unique<GzipSource>(file); break;
    case Compression::Zstd: src = std::make_unique<ZstdSource>(file); break;
  }
  LineReader lines(std::move(src));
  std::string line;

  if (format == TextFormat::Jsonl) {
    while (lines.next(line)) {
      if (blank(line)) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::parse_error& e) {
        fail("{}:{}: not valid JSON (error at byte {} of the line)", file.string(), lines.line_no_, e.byte);
      } catch (const nlohmann::json::exception& e) {
        // Well-formed JSON the parser still cannot hold, e.g. a number beyond double range (1e400).
        fail("{}:{}: cannot read the JSON: {}", file.string(), lines.line_no_, e.what());
      }
      if (!j.is_object()) fail("{}:{}: expected a JSON object with a string field \"text\"", file.string(), lines.line_no_);
      auto it = j.find("text");
      if (it == j.end() || !it->is_string())
        fail("{}:{}: JSON object has no string field \"text\"", file.string(), lines.line_no_);
      std::string text = std::move(it->get_ref<std::string&>());
      if (!text.empty() && !std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isspace(c); }))
        fn(std::move(text));
    }
    return;
  }

  // Plain text: join non-blank lines; one blank line stays inside a document, two or more end it.
  std::string doc;
  size_t blanks = 0;
  while (lines.next(line)) {
    if (blank(line)) {
      ++blanks;
      continue;
    }
    if (!doc.empty()) {
      if (blanks >= 2) {
        fn(std::move(doc));
        doc.clear();
      } else {
        doc += '\n';
        if (blanks == 1) doc += '\n';
      }
    }
    doc += line;
    blanks = 0;
  }
  if (!doc.empty()) fn(std::move(doc));
}

}  // namespace ladder::data
