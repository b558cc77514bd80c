// Tests for src/core/memory: the cgroup memory limit that host_available_bytes applies, read from a
// fake /sys/fs/cgroup tree (the real one differs from machine to machine).
#include "core/memory.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "core/fileio.h"

namespace fs = std::filesystem;

namespace ladder {
namespace {

class CgroupTree : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("ladder_cgroup_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  // One cgroup level: its limit ("max" for none), usage and inactive page cache.
  void level(const fs::path& rel, const char* max_file, const std::string& limit, const char* cur_file, uint64_t usage,
             const char* cache_key, uint64_t cache) {
    const fs::path d = root_ / rel;
    fs::create_directories(d);
    write_file_atomic(d / max_file, limit + "\n");
    write_file_atomic(d / cur_file, std::to_string(usage) + "\n");
    write_file_atomic(d / "memory.stat", std::string("active_file 7\n") + cache_key + " " + std::to_string(cache) + "\n");
  }
  void v2(const fs::path& rel, const std::string& limit, uint64_t usage, uint64_t cache = 0) {
    level(rel, "memory.max", limit, "memory.current", usage, "inactive_file", cache);
  }
  void v1(const fs::path& rel, const std::string& limit, uint64_t usage, uint64_t cache = 0) {
    level(fs::path("memory") / rel, "memory.limit_in_bytes", limit, "memory.usage_in_bytes", usage,
          "total_inactive_file", cache);
  }
  fs::path root_;
};

constexpr uint64_t GiB = uint64_t(1) << 30;

// cgroup v2: a batch job's cgroup below the root carries the limit; the tightest level binds, the
// inactive page cache does not count as used.
TEST_F(CgroupTree, V2TakesTheTightestLevelFromTheProcesssOwnCgroupUp) {
  write_file_atomic(root_ / "cgroup.controllers", "cpu memory\n");
  v2("", "max", 50 * GiB);
  v2("slurm", std::to_string(64 * GiB), 20 * GiB);             // 44 GiB left
  v2("slurm/job_7", std::to_string(16 * GiB), 10 * GiB, 3 * GiB);  // 16 - (10 - 3) = 9 GiB left
  v2("slurm/job_7/step_0", "max", 9 * GiB);
  EXPECT_EQ(cgroup_memory_left(root_.string(), "0::/slurm/job_7/step_0\n"), 9 * GiB);
  EXPECT_EQ(cgroup_memory_left(root_.string(), "0::/slurm/./job_7/step_0/\n"), 9 * GiB);  // written loosely
  // The root cgroup alone (no limit anywhere on the path): none.
  EXPECT_EQ(cgroup_memory_left(root_.string(), "0::/\n"), std::nullopt);
  // A level whose usage is over its limit leaves 0, not a wrapped-around huge number.
  v2("slurm/job_8", std::to_string(GiB), 2 * GiB);
  EXPECT_EQ(cgroup_memory_left(root_.string(), "0::/slurm/job_8\n"), 0u);
}

// A cgroup namespace shows the process's own cgroup as the mount's root: the path /proc/self/cgroup
// gives is not under the mount, and the root's own files are the ones to read.
TEST_F(CgroupTree, V2InsideANamespaceReadsTheRoot) {
  write_file_atomic(root_ / "cgroup.controllers", "memory\n");
  v2("", std::to_string(8 * GiB), 3 * GiB);
  EXPECT_EQ(cgroup_memory_left(root_.string(), "0::/../../outside\n"), 5 * GiB);
  EXPECT_EQ(cgroup_memory_left(root_.string(), "0::/docker/abc\n"), 5 * GiB);
}

// cgroup v1 (or hybrid: a "0::" line but no unified mount): the memory controller's line names the
// path; v1's "no limit" is a number near 2^63.
TEST_F(CgroupTree, V1FollowsTheMemoryControllersPath) {
  v1("", "9223372036854771712", 40 * GiB);
  v1("process_api", "9223372036854771712", 30 * GiB);
  v1("process_api/abc", std::to_string(24 * GiB), 20 * GiB, 4 * GiB);  // 24 - 16 = 8 GiB left
  const std::string self = "12:pids:/\n4:memory:/process_api/abc\n2:cpu,cpuacct:/other\n0::/\n";
  EXPECT_EQ(cgroup_memory_left(root_.string(), self), 8 * GiB);
  EXPECT_EQ(cgroup_memory_left(root_.string(), "4:memory:/process_api\n0::/\n"), std::nullopt);
  // No memory controller line at all: the hierarchy's root.
  EXPECT_EQ(cgroup_memory_left(root_.string(), "0::/\n"), std::nullopt);
}

// On this machine: whatever its cgroups say, host_available_bytes is at most MemAvailable + swap
// and names its source.
TEST(HostMemory, AvailableBytesNamesItsSource) {
  const char* source = nullptr;
  const size_t avail = host_available_bytes(&source);
  ASSERT_NE(source, nullptr);
  EXPECT_GT(avail, size_t(0));
}

}  // namespace
}  // namespace ladder
