// Tests for src/core/safetensors: round trip, byte-level format, validation errors, atomic writes,
// and interoperability with files produced outside Ladder.
#include "core/safetensors.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fileio.h"

namespace fs = std::filesystem;
using namespace ladder;

namespace {

// A fresh directory per test, removed afterwards.
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("ladder_st_{}_{}", ::getpid(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path dir_;
};

std::string bytes_of(const void* p, size_t n) { return std::string(static_cast<const char*>(p), n); }

void write_bytes(const fs::path& p, std::string_view s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(s.data(), std::streamsize(s.size()));
}

// Assembles a file from a header text and a data buffer, the way a third-party writer would;
// the length prefix can be overridden to forge corrupt files.
std::string assemble(std::string header, size_t data_bytes, bool pad = true,
                     int64_t forced_len = -1) {
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  uint64_t n = forced_len >= 0 ? uint64_t(forced_len) : header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  out += header;
  out.append(data_bytes, '\x11');
  return out;
}

// Runs open() and returns the error message ("" if it succeeded).
std::string open_error(const fs::path& p) {
  try {
    SafeTensors::open(p);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<std::string> dir_entries(const fs::path& d) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(d)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

bool have_python_numpy() {
  return std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") == 0;
}

}  // namespace

TEST(SafetensorsDType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::F64), 8u);
  EXPECT_EQ(dtype_size(DType::I32), 4u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_EQ(dtype_size(DType::U8), 1u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::F16), 2u);
  EXPECT_EQ(dtype_size(DType::U16), 2u);
  EXPECT_STREQ(dtype_name(DType::BF16), "BF16");
  EXPECT_STREQ(dtype_name(DType::U8), "U8");
}

TEST_F(SafetensorsTest, RoundTripManyDtypesAndShapes) {
  std::vector<float> f32 = {1.5f, -2.25f, 3.0f, 1e-30f, 6.5e30f, -0.0f};
  std::vector<double> f64 = {3.141592653589793, -1e300, 0.1, 2.0};
  std::vector<int32_t> i32 = {-7, 0, 2147483647};
  std::vector<int64_t> i64 = {INT64_MIN, 1234567890123LL};
  std::vector<uint8_t> u8 = {0, 1, 2, 254, 255};  // odd byte count: the next tensor is unaligned
  std::vector<uint16_t> bf16 = {0x3f80, 0xc000, 0x7f80};
  std::vector<uint16_t> f16 = {0x3c00, 0xbc00, 0x0001, 0x7bff};
  std::vector<uint16_t> u16 = {65535};
  float scalar = 42.0f;
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "1200"}, {"note", "ünïcødé"}};

  std::vector<TensorRef> ts = {
      {"w.f32", DType::F32, {2, 3}, f32.data()},
      {"u8", DType::U8, {5}, u8.data()},
      {"x.f64", DType::F64, {4}, f64.data()},
      {"i32", DType::I32, {3, 1}, i32.data()},
      {"i64", DType::I64, {2}, i64.data()},
      {"bf16", DType::BF16, {3}, bf16.data()},
      {"f16", DType::F16, {2, 2}, f16.data()},
      {"u16", DType::U16, {1, 1, 1}, u16.data()},
      {"scalar", DType::F32, {}, &scalar},
      {"empty", DType::F32, {0, 4}, nullptr},
      {"empty_u8", DType::U8, {0}, nullptr},
  };
  const fs::path p = dir_ / "model.safetensors";
  save_safetensors(p, ts, meta);

  SafeTensors st = SafeTensors::open(p);
  EXPECT_EQ(st.metadata(), meta);
  std::vector<std::string> want_names;
  for (const auto& t : ts) want_names.push_back(t.name);
  EXPECT_EQ(st.names(), want_names);  // file order == the order given
  for (const auto& t : ts) {
    SCOPED_TRACE(t.name);
    ASSERT_TRUE(st.has(t.name));
    EXPECT_EQ(st.dtype(t.name), t.dtype);
    EXPECT_EQ(st.shape(t.name), t.shape);
    int64_t n = 1;
    for (auto d : t.shape) n *= d;
    EXPECT_EQ(st.numel(t.name), n);
    const size_t nb = size_t(n) * dtype_size(t.dtype);
    ASSERT_EQ(st.nbytes(t.name), nb);
    if (nb > 0) {
      EXPECT_EQ(bytes_of(st.data(t.name), nb), bytes_of(t.data, nb));
    }
  }
  EXPECT_FALSE(st.has("nope"));

  // Typed readers.
  std::vector<float> got(6);
  st.read_f32("w.f32", {2, 3}, got.data());
  EXPECT_EQ(bytes_of(got.data(), 24), bytes_of(f32.data(), 24));  // bit-exact (incl. -0.0)
  EXPECT_EQ(st.get_f32("w.f32"), f32);
  EXPECT_EQ(st.get_f32("scalar"), std::vector<float>{42.0f});
  EXPECT_TRUE(st.get_f32("empty").empty());
  float s = 0;
  st.read_f32("scalar", {}, &s);
  EXPECT_EQ(s, 42.0f);
  st.read_f32("empty", {0, 4}, nullptr);  // nothing to copy

  std::vector<double> d(4);
  st.read_f64("x.f64", {4}, d.data());
  EXPECT_EQ(d, f64);
  std::vector<double> widened(6);
  st.read_f64("w.f32", {2, 3}, widened.data());
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(widened[i], double(f32[i]));

  // A copy shares the mapping and outlives the original.
  SafeTensors copy = st;
  st = SafeTensors::open(p);
  EXPECT_EQ(copy.get_f32("w.f32"), f32);
}

TEST_F(SafetensorsTest, EmptyFileAndNoMetadata) {
  const fs::path p = dir_ / "empty.safetensors";
  save_safetensors(p, {});
  SafeTensors st = SafeTensors::open(p);
  EXPECT_TRUE(st.names().empty());
  EXPECT_TRUE(st.metadata().empty());
  std::string raw = read_file(p);
  uint64_t n;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n, 8u);  // "{}" padded to 8
  EXPECT_EQ(raw.size(), 16u);
  EXPECT_TRUE(nlohmann::json::parse(raw.substr(8)).empty());
}

TEST_F(SafetensorsTest, HeaderIsStandardAtByteLevel) {
  std::vector<float> a = {1, 2, 3};
  std::vector<uint8_t> b = {9};
  std::vector<int64_t> c = {5, 6};
  const fs::path p = dir_ / "std.safetensors";
  save_safetensors(p,
                   {{"zeta", DType::F32, {3}, a.data()},
                    {"alpha", DType::U8, {1, 1}, b.data()},
                    {"mid", DType::I64, {2}, c.data()}},
                   {{"k", "v"}});
  const std::string raw = read_file(p);
  ASSERT_GE(raw.size(), 8u);
  uint64_t n;
  std::memcpy(&n, raw.data(), 8);  // little-endian u64 (host is little-endian)
  ASSERT_LE(8 + n, raw.size());
  EXPECT_EQ((8 + n) % 8, 0u) << "data buffer must start 8-byte aligned";
  const std::string header = raw.substr(8, n);
  // Padding, if any, is trailing spaces after the closing brace.
  const size_t close = header.find_last_of('}');
  ASSERT_NE(close, std::string::npos);
  EXPECT_LT(header.size() - close - 1, 8u);
  for (size_t i = close + 1; i < header.size(); ++i) EXPECT_EQ(header[i], ' ');

  auto j = nlohmann::json::parse(header);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["__metadata__"], (nlohmann::json{{"k", "v"}}));
  EXPECT_EQ(j["zeta"]["dtype"], "F32");
  EXPECT_EQ(j["zeta"]["shape"], (nlohmann::json{3}));
  EXPECT_EQ(j["alpha"]["shape"], (nlohmann::json{1, 1}));
  // Offsets contiguous, in the order given, starting at 0 and ending at the end of the file.
  EXPECT_EQ(j["zeta"]["data_offsets"], (nlohmann::json{0, 12}));
  EXPECT_EQ(j["alpha"]["data_offsets"], (nlohmann::json{12, 13}));
  EXPECT_EQ(j["mid"]["data_offsets"], (nlohmann::json{13, 29}));
  EXPECT_EQ(raw.size(), 8 + n + 29);
  EXPECT_EQ(raw.substr(8 + n, 12), bytes_of(a.data(), 12));
  EXPECT_EQ(raw.substr(8 + n + 13, 16), bytes_of(c.data(), 16));
}

TEST_F(SafetensorsTest, ValidationFailuresNameTheFile) {
  struct Case {
    const char* label;
    std::string bytes;
    const char* expect;  // substring of the message besides the file name
  };
  const std::string ok_entry = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  std::vector<Case> cases = {
      {"empty", "", "at least 8"},
      {"short", "abc", "at least 8"},
      {"len_past_eof", assemble("{" + ok_entry + "}", 8, true, 1000), "exceeds"},
      {"not_json", assemble("{not json", 0), "not valid JSON"},
      {"zero_len", assemble("", 0, false), "not valid JSON"},
      {"not_object", assemble("[1,2]", 0), "must be a JSON object"},
      {"entry_not_object", assemble(R"({"t":5})", 0), "'t'"},
      {"missing_dtype", assemble(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", 8), "missing \"dtype\""},
      {"missing_shape", assemble(R"({"t":{"dtype":"F32","data_offsets":[0,8]}})", 8), "missing \"shape\""},
      {"missing_offsets", assemble(R"({"t":{"dtype":"F32","shape":[2]}})", 8), "missing \"data_offsets\""},
      {"unknown_dtype", assemble(R"({"t":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", 8),
       "unsupported dtype \"Q7\""},
      {"negative_dim", assemble(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
       "non-negative"},
      {"bad_offsets", assemble(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8),
       "data_offsets must be"},
      {"size_mismatch", assemble(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
       "span 8 bytes, expected 12"},
      {"reversed", assemble(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8), "end before"},
      {"past_buffer", assemble("{" + ok_entry + "}", 4), "past the 4-byte data buffer"},
      {"overlap",
       assemble(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                R"("b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", 8),
       "overlap tensor 'a'"},
      {"gap",
       assemble(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                R"("b":{"dtype":"U8","shape":[2],"data_offsets":[6,8]}})", 8),
       "gap"},
      {"trailing", assemble("{" + ok_entry + "}", 12), "4 unexplained trailing bytes"},
      {"duplicate",
       assemble(R"({"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                R"("t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1),
       "more than once"},
      {"meta_not_string", assemble(R"({"__metadata__":{"a":1}})", 0), "__metadata__ 'a' must be a string"},
      {"meta_not_object", assemble(R"({"__metadata__":[]})", 0), "__metadata__ must be an object"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    const fs::path p = dir_ / fmt::format("bad_{}.safetensors", c.label);
    write_bytes(p, c.bytes);
    const std::string msg = open_error(p);
    ASSERT_FALSE(msg.empty()) << "open() accepted a bad file";
    EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "message must be one line: " << msg;
  }

  // Missing file and directory.
  const fs::path missing = dir_ / "missing.safetensors";
  EXPECT_NE(open_error(missing).find(missing.string()), std::string::npos);
  EXPECT_NE(open_error(dir_).find("not a regular file"), std::string::npos);
}

TEST_F(SafetensorsTest, HugeHeaderLengthRejected) {
  // A sparse file big enough that a 150 MB header would fit, so the size cap (not the EOF
  // check) is what fires.
  const fs::path p = dir_ / "huge.safetensors";
  write_bytes(p, assemble("{}", 0, true, 150'000'000));
  fs::resize_file(p, 200'000'000);
  const std::string msg = open_error(p);
  EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("limit"), std::string::npos) << msg;
}

TEST_F(SafetensorsTest, AccessorErrorsNameFileTensorAndShapes) {
  std::vector<float> a(6, 1.0f);
  std::vector<int32_t> b(2, 3);
  const fs::path p = dir_ / "acc.safetensors";
  save_safetensors(p, {{"a", DType::F32, {2, 3}, a.data()}, {"b", DType::I32, {2}, b.data()}});
  SafeTensors st = SafeTensors::open(p);
  std::vector<float> dst(6);

  std::string m = error_of([&] { st.read_f32("a", {3, 2}, dst.data()); });
  EXPECT_NE(m.find(p.string()), std::string::npos) << m;
  EXPECT_NE(m.find("'a'"), std::string::npos) << m;
  EXPECT_NE(m.find("expected F32 [3, 2], found F32 [2, 3]"), std::string::npos) << m;

  m = error_of([&] { st.read_f32("b", {2}, dst.data()); });
  EXPECT_NE(m.find("expected F32 [2], found I32 [2]"), std::string::npos) << m;
  m = error_of([&] { st.get_f32("b"); });
  EXPECT_NE(m.find("found I32"), std::string::npos) << m;
  std::vector<double> dd(2);
  m = error_of([&] { st.read_f64("b", {2}, dd.data()); });
  EXPECT_NE(m.find("found I32 [2]"), std::string::npos) << m;

  m = error_of([&] { st.read_f32("missing", {1}, dst.data()); });
  EXPECT_NE(m.find(p.string()), std::string::npos) << m;
  EXPECT_NE(m.find("no tensor 'missing'"), std::string::npos) << m;
  EXPECT_NE(error_of([&] { st.shape("missing"); }).find("no tensor"), std::string::npos);
  EXPECT_NE(error_of([&] { st.data("missing"); }).find("no tensor"), std::string::npos);
}

TEST_F(SafetensorsTest, SaveRejectsBadInputWithoutTouchingExistingFile) {
  const fs::path p = dir_ / "ckpt.safetensors";
  std::vector<float> a = {1, 2};
  save_safetensors(p, {{"a", DType::F32, {2}, a.data()}});
  const std::string before = read_file(p);

  std::vector<float> z = {7, 7};
  std::string m = error_of([&] {
    save_safetensors(p, {{"a", DType::F32, {2}, z.data()}, {"a", DType::F32, {2}, z.data()}});
  });
  EXPECT_NE(m.find("duplicate tensor name 'a'"), std::string::npos) << m;
  EXPECT_NE(m.find(p.string()), std::string::npos) << m;
  m = error_of([&] { save_safetensors(p, {{"x", DType::F32, {-1}, z.data()}}); });
  EXPECT_NE(m.find("invalid shape"), std::string::npos) << m;
  m = error_of([&] { save_safetensors(p, {{"x", DType::F32, {2}, nullptr}}); });
  EXPECT_NE(m.find("data is null"), std::string::npos) << m;
  m = error_of([&] { save_safetensors(p, {{"", DType::F32, {2}, z.data()}}); });
  EXPECT_NE(m.find("empty name"), std::string::npos) << m;
  m = error_of([&] { save_safetensors(p, {{"__metadata__", DType::F32, {2}, z.data()}}); });
  EXPECT_NE(m.find("reserved"), std::string::npos) << m;

  EXPECT_EQ(read_file(p), before);
  EXPECT_EQ(dir_entries(dir_), std::vector<std::string>{"ckpt.safetensors"});
}

TEST_F(SafetensorsTest, SaveIsAtomic) {
  const fs::path p = dir_ / "ckpt.safetensors";
  std::vector<float> a = {1, 2, 3};
  save_safetensors(p, {{"a", DType::F32, {3}, a.data()}});
  EXPECT_EQ(dir_entries(dir_), std::vector<std::string>{"ckpt.safetensors"}) << "temp file left behind";

  // Overwriting replaces the content completely.
  std::vector<float> b = {4, 5};
  save_safetensors(p, {{"b", DType::F32, {2}, b.data()}});
  SafeTensors st = SafeTensors::open(p);
  EXPECT_EQ(st.names(), std::vector<std::string>{"b"});
  EXPECT_EQ(st.get_f32("b"), b);
  EXPECT_EQ(dir_entries(dir_), std::vector<std::string>{"ckpt.safetensors"});

  // Directory that does not exist: error naming the path, nothing created.
  const fs::path nowhere = dir_ / "no_such_dir" / "x.safetensors";
  std::string m = error_of([&] { save_safetensors(nowhere, {{"a", DType::F32, {3}, a.data()}}); });
  EXPECT_NE(m.find(nowhere.string()), std::string::npos) << m;
  EXPECT_FALSE(fs::exists(dir_ / "no_such_dir"));

  // Target is a directory: the rename fails after the data was written; the temp is removed.
  const fs::path d = dir_ / "adir";
  fs::create_directories(d / "inner");
  m = error_of([&] { save_safetensors(d, {{"a", DType::F32, {3}, a.data()}}); });
  EXPECT_NE(m.find("rename"), std::string::npos) << m;
  EXPECT_TRUE(fs::is_directory(d / "inner"));
  EXPECT_EQ(dir_entries(dir_), (std::vector<std::string>{"adir", "ckpt.safetensors"}));
}

TEST_F(SafetensorsTest, FailureMidWriteLeavesOldFileIntact) {
  const fs::path p = dir_ / "ckpt.safetensors";
  std::vector<float> a = {1, 2, 3};
  save_safetensors(p, {{"a", DType::F32, {3}, a.data()}});
  const std::string before = read_file(p);

  // In a child process, cap the file size so write(2) fails with EFBIG partway through a 4 MB
  // tensor: a real I/O error after the temp file exists.
  std::vector<float> big(1 << 20, 0.5f);
  GTEST_FLAG_SET(death_test_style, "fast");  // fork: the child shares this test's directory
  auto child = [&] {
    std::signal(SIGXFSZ, SIG_IGN);  // get EFBIG from write(2) instead of being killed
    struct rlimit rl {};
    rl.rlim_cur = rl.rlim_max = 65536;
    setrlimit(RLIMIT_FSIZE, &rl);
    try {
      save_safetensors(p, {{"big", DType::F32, {int64_t(big.size())}, big.data()}});
    } catch (const Error& e) {
      std::fprintf(stderr, "%s\n", e.what());
      std::_Exit(std::string(e.what()).find("write failed") != std::string::npos ? 0 : 2);
    }
    std::_Exit(1);
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "ckpt.safetensors");

  EXPECT_EQ(read_file(p), before);
  EXPECT_EQ(dir_entries(dir_), std::vector<std::string>{"ckpt.safetensors"}) << "temp file left behind";
  EXPECT_EQ(SafeTensors::open(p).get_f32("a"), a);
}

// The temporary is created with O_EXCL: a file (here a symlink to a victim) already sitting at the
// next temporary name is skipped, never written through, and both writers share the one helper.
TEST_F(SafetensorsTest, TemporaryNeverWritesThroughAFileAtItsName) {
  const fs::path victim = dir_ / "victim.txt";
  write_bytes(victim, "keep me");
  const fs::path p = dir_ / "out.json";
  fs::path next;
  {
    AtomicFileWriter probe(p);  // learns this process's naming; removed unwritten on scope exit
    const std::string name = probe.temp_path().filename().string();
    const auto dot = name.rfind('.');
    next = dir_ / (name.substr(0, dot + 1) + std::to_string(std::stoull(name.substr(dot + 1)) + 1));
  }
  EXPECT_EQ(dir_entries(dir_), std::vector<std::string>{"victim.txt"}) << "uncommitted temp left behind";
  fs::create_symlink(victim, next);
  write_file_atomic(p, "{}\n");
  EXPECT_EQ(read_file(victim), "keep me");
  EXPECT_EQ(read_file(p), "{}\n");
  EXPECT_TRUE(fs::is_symlink(next));
  fs::remove(next);
  EXPECT_EQ(dir_entries(dir_), (std::vector<std::string>{"out.json", "victim.txt"}));
}

TEST_F(SafetensorsTest, ReadFileNamesADirectoryAndAMissingFile) {
  fs::create_directories(dir_ / "sub");
  EXPECT_NE(error_of([&] { read_file(dir_ / "sub"); }).find("is a directory, expected a file"), std::string::npos);
  EXPECT_NE(error_of([&] { read_file(dir_ / "none"); }).find("missing or unreadable"), std::string::npos);
  write_bytes(dir_ / "f", std::string("a\0b", 3));
  EXPECT_EQ(read_file(dir_ / "f"), std::string("a\0b", 3));
}

// A file assembled by hand, byte by byte: header deliberately NOT padded (137 bytes), so the
// data buffer starts at an odd offset; a reader must accept that and cope with unaligned data.
TEST_F(SafetensorsTest, ReadsHandAssembledFile) {
  // {"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"by":"hand!"},
  //  "s":{"dtype":"U16","shape":[],"data_offsets":[8,10]}}  then 1.5f, -2.0f, u16 513.
  static const unsigned char kFile[] = {
      0x89, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x7b, 0x22, 0x77, 0x22, 0x3a, 0x7b, 0x22, 0x64,
      0x74, 0x79, 0x70, 0x65, 0x22, 0x3a, 0x22, 0x46, 0x33, 0x32, 0x22, 0x2c, 0x22, 0x73, 0x68, 0x61,
      0x70, 0x65, 0x22, 0x3a, 0x5b, 0x32, 0x5d, 0x2c, 0x22, 0x64, 0x61, 0x74, 0x61, 0x5f, 0x6f, 0x66,
      0x66, 0x73, 0x65, 0x74, 0x73, 0x22, 0x3a, 0x5b, 0x30, 0x2c, 0x38, 0x5d, 0x7d, 0x2c, 0x22, 0x5f,
      0x5f, 0x6d, 0x65, 0x74, 0x61, 0x64, 0x61, 0x74, 0x61, 0x5f, 0x5f, 0x22, 0x3a, 0x7b, 0x22, 0x62,
      0x79, 0x22, 0x3a, 0x22, 0x68, 0x61, 0x6e, 0x64, 0x21, 0x22, 0x7d, 0x2c, 0x22, 0x73, 0x22, 0x3a,
      0x7b, 0x22, 0x64, 0x74, 0x79, 0x70, 0x65, 0x22, 0x3a, 0x22, 0x55, 0x31, 0x36, 0x22, 0x2c, 0x22,
      0x73, 0x68, 0x61, 0x70, 0x65, 0x22, 0x3a, 0x5b, 0x5d, 0x2c, 0x22, 0x64, 0x61, 0x74, 0x61, 0x5f,
      0x6f, 0x66, 0x66, 0x73, 0x65, 0x74, 0x73, 0x22, 0x3a, 0x5b, 0x38, 0x2c, 0x31, 0x30, 0x5d, 0x7d,
      0x7d, 0x00, 0x00, 0xc0, 0x3f, 0x00, 0x00, 0x00, 0xc0, 0x01, 0x02,
  };
  const fs::path p = dir_ / "hand.safetensors";
  write_bytes(p, std::string_view(reinterpret_cast<const char*>(kFile), sizeof kFile));
  SafeTensors st = SafeTensors::open(p);
  EXPECT_EQ(st.names(), (std::vector<std::string>{"w", "s"}));
  EXPECT_EQ(st.metadata().at("by"), "hand!");
  EXPECT_EQ(st.get_f32("w"), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(st.dtype("s"), DType::U16);
  EXPECT_TRUE(st.shape("s").empty());
  uint16_t s;
  std::memcpy(&s, st.data("s"), 2);
  EXPECT_EQ(s, 513);
  std::vector<double> w64(2);
  st.read_f64("w", {2}, w64.data());
  EXPECT_EQ(w64, (std::vector<double>{1.5, -2.0}));
}

// Python writes a file the way the reference library lays it out (struct + json + numpy tobytes);
// we read it. Then we write one and Python parses it independently.
TEST_F(SafetensorsTest, InteroperatesWithPython) {
  if (!have_python_numpy()) GTEST_SKIP() << "/usr/bin/python3 with numpy not available";
  const fs::path script = dir_ / "st.py";
  const fs::path from_py = dir_ / "from_py.safetensors";
  const fs::path from_cpp = dir_ / "from_cpp.safetensors";
  write_bytes(script, R"PY(
import json, struct, sys
import numpy as np

def save(path, tensors, metadata):
    header, blobs, off = {"__metadata__": metadata}, [], 0
    for name, arr in tensors:
        dt = {np.float32: "F32", np.float64: "F64", np.int64: "I64", np.int32: "I32",
              np.uint8: "U8", np.float16: "F16", np.uint16: "U16"}[arr.dtype.type]
        b = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))

def load(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0, "header not padded"
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    buf = raw[8 + n:]
    dts = {"F32": "<f4", "F64": "<f8", "I64": "<i8", "U8": "u1"}
    out, end = {}, 0
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        b, en = e["data_offsets"]
        assert b == end, "not contiguous"
        end = en
        out[name] = np.frombuffer(buf[b:en], dtype=dts[e["dtype"]]).reshape(e["shape"])
    assert end == len(buf), "trailing bytes"
    return out, meta

if sys.argv[1] == "write":
    save(sys.argv[2], [
        ("emb", np.arange(12, dtype=np.float32).reshape(3, 4) * 0.5 - 1),
        ("ids", np.array([-3, 0, 1 << 40], dtype=np.int64)),
        ("mask", np.array([1, 0, 1], dtype=np.uint8)),
        ("scale", np.array(2.5, dtype=np.float64)),
        ("half", np.array([1.0, -0.5], dtype=np.float16)),
        ("none", np.zeros((0, 3), dtype=np.float32)),
    ], {"format": "pt", "source": "numpy"})
else:
    t, meta = load(sys.argv[2])
    assert meta == {"from": "ladder"}, meta
    assert t["a"].shape == (2, 2) and t["a"].tolist() == [[1.0, 2.0], [3.0, 4.0]], t["a"]
    assert t["b"].shape == () and t["b"].item() == 7, t["b"]
    assert t["c"].shape == (3,) and t["c"].tolist() == [1, 2, 3], t["c"]
    assert t["d"].shape == (1,) and t["d"].tolist() == [0.25], t["d"]
    print("python read ok")
)PY");

  ASSERT_EQ(std::system(fmt::format("/usr/bin/python3 {} write {}", script.string(), from_py.string()).c_str()), 0);
  SafeTensors st = SafeTensors::open(from_py);
  EXPECT_EQ(st.metadata().at("format"), "pt");
  EXPECT_EQ(st.metadata().at("source"), "numpy");
  EXPECT_EQ(st.names(), (std::vector<std::string>{"emb", "ids", "mask", "scale", "half", "none"}));
  std::vector<float> emb(12);
  st.read_f32("emb", {3, 4}, emb.data());
  for (int i = 0; i < 12; ++i) EXPECT_EQ(emb[i], i * 0.5f - 1) << i;
  ASSERT_EQ(st.dtype("ids"), DType::I64);
  std::vector<int64_t> ids(3);
  std::memcpy(ids.data(), st.data("ids"), 24);
  EXPECT_EQ(ids, (std::vector<int64_t>{-3, 0, int64_t(1) << 40}));
  EXPECT_EQ(bytes_of(st.data("mask"), 3), std::string("\x01\x00\x01", 3));
  double scale = 0;
  st.read_f64("scale", {}, &scale);
  EXPECT_EQ(scale, 2.5);
  EXPECT_EQ(st.dtype("half"), DType::F16);
  uint16_t half[2];
  std::memcpy(half, st.data("half"), 4);
  EXPECT_EQ(half[0], 0x3c00);
  EXPECT_EQ(half[1], 0xb800);
  EXPECT_EQ(st.shape("none"), (std::vector<int64_t>{0, 3}));

  std::vector<float> a = {1, 2, 3, 4};
  int64_t b = 7;
  std::vector<uint8_t> c = {1, 2, 3};  // makes the following tensor unaligned
  double d = 0.25;
  save_safetensors(from_cpp,
                   {{"a", DType::F32, {2, 2}, a.data()},
                    {"b", DType::I64, {}, &b},
                    {"c", DType::U8, {3}, c.data()},
                    {"d", DType::F64, {1}, &d}},
                   {{"from", "ladder"}});
  EXPECT_EQ(std::system(fmt::format("/usr/bin/python3 {} read {}", script.string(), from_cpp.string()).c_str()), 0);
}
