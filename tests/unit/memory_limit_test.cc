// HostMemoryLimit against fake cgroup trees (v2, v1, nested limits, no limit, no cgroups).
#include "server/core/memory_limit.h"

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace kvbank {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

class MemoryLimitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvbank_cgroup_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    paths_.proc_self_cgroup = root_ + "/proc_self_cgroup";
    paths_.cgroup_root = root_ + "/fs";
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  void Write(const std::string& relative, const std::string& text) {
    const std::filesystem::path p = root_ + "/" + relative;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }

  std::string root_;
  CgroupPaths paths_;
};

TEST_F(MemoryLimitTest, NoCgroupFileGivesPhysicalMemory) {
  const MemoryLimit l = HostMemoryLimit(64 * kGiB, paths_);
  EXPECT_EQ(l.bytes, 64 * kGiB);
  EXPECT_EQ(l.source, "physical memory");
}

TEST_F(MemoryLimitTest, V2LimitOfTheContainerBinds) {
  Write("proc_self_cgroup", "0::/kubepods/pod1/c1\n");
  Write("fs/kubepods/pod1/c1/memory.max", "4294967296\n");
  const MemoryLimit l = HostMemoryLimit(64 * kGiB, paths_);
  EXPECT_EQ(l.bytes, 4 * kGiB);
  EXPECT_NE(l.source.find("cgroup v2 memory.max"), std::string::npos) << l.source;
  EXPECT_NE(l.source.find("kubepods/pod1/c1/memory.max"), std::string::npos) << l.source;
}

TEST_F(MemoryLimitTest, V2TightestAncestorBindsAndMaxMeansNone) {
  Write("proc_self_cgroup", "0::/kubepods/pod1/c1\n");
  Write("fs/kubepods/pod1/c1/memory.max", "max\n");
  Write("fs/kubepods/pod1/memory.max", "2147483648\n");
  Write("fs/kubepods/memory.max", "8589934592\n");
  EXPECT_EQ(HostMemoryLimit(64 * kGiB, paths_).bytes, 2 * kGiB);
}

TEST_F(MemoryLimitTest, V2NamespacedContainerReadsTheRoot) {
  // With a cgroup namespace the path is "/" and the mount's root is the container's cgroup.
  Write("proc_self_cgroup", "0::/\n");
  Write("fs/memory.max", "1073741824\n");
  EXPECT_EQ(HostMemoryLimit(64 * kGiB, paths_).bytes, kGiB);
}

TEST_F(MemoryLimitTest, V2UnlimitedEverywhereGivesPhysicalMemory) {
  Write("proc_self_cgroup", "0::/a\n");
  Write("fs/a/memory.max", "max\n");
  Write("fs/memory.max", "max\n");
  EXPECT_EQ(HostMemoryLimit(16 * kGiB, paths_).source, "physical memory");
}

TEST_F(MemoryLimitTest, V1MemoryControllerLimit) {
  Write("proc_self_cgroup", "12:pids:/x\n4:cpu,cpuacct:/x\n3:memory:/docker/abc\n0::/\n");
  Write("fs/memory/docker/abc/memory.limit_in_bytes", "3221225472\n");
  Write("fs/memory/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "none"
  const MemoryLimit l = HostMemoryLimit(64 * kGiB, paths_);
  EXPECT_EQ(l.bytes, 3 * kGiB);
  EXPECT_NE(l.source.find("cgroup v1 memory.limit_in_bytes"), std::string::npos) << l.source;
}

TEST_F(MemoryLimitTest, V1NoLimitValueMeansNone) {
  Write("proc_self_cgroup", "3:memory:/\n");
  Write("fs/memory/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(HostMemoryLimit(64 * kGiB, paths_).bytes, 64 * kGiB);
}

TEST_F(MemoryLimitTest, LimitAbovePhysicalMemoryDoesNotRaiseIt) {
  Write("proc_self_cgroup", "0::/\n");
  Write("fs/memory.max", "137438953472\n");  // 128 GiB on a 64 GiB host
  const MemoryLimit l = HostMemoryLimit(64 * kGiB, paths_);
  EXPECT_EQ(l.bytes, 64 * kGiB);
  EXPECT_EQ(l.source, "physical memory");
}

TEST_F(MemoryLimitTest, GarbageInLimitFilesIsSkipped) {
  Write("proc_self_cgroup", "not a cgroup line\n0::/a\n");
  Write("fs/a/memory.max", "lots\n");
  Write("fs/memory.max", "0\n");
  EXPECT_EQ(HostMemoryLimit(8 * kGiB, paths_).bytes, 8 * kGiB);
}

TEST(MemoryLimitHostTest, ThisProcessGetsAPositiveLimitNoLargerThanRam) {
  const uint64_t ram = PhysicalMemoryBytes();
  ASSERT_GT(ram, 0u);
  const MemoryLimit l = HostMemoryLimit(ram);
  EXPECT_GT(l.bytes, 0u);
  EXPECT_LE(l.bytes, ram);
}

}  // namespace
}  // namespace kvbank
