#include "tests/unit/test_memory.h"

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include "gtest/gtest.h"
#include "server/core/cuda_memory.h"

namespace kvbank::testenv {

namespace {

std::string Requested() {
  const char* v = std::getenv("KVBANK_TEST_MEMORY");
  return v == nullptr || *v == '\0' ? "host" : v;
}

// Skips every test of a cuda run on a machine without a device (and fails an unknown kind).
class MemoryEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    const std::string want = Requested();
    if (want == "cuda" && CudaDeviceCount() == 0) {
      GTEST_SKIP() << "KVBANK_TEST_MEMORY=cuda but no CUDA device is visible"
                   << (CudaBuiltIn() ? "" : " (built without CUDA)");
    }
    ASSERT_TRUE(want == "host" || want == "host-staged" || want == "cuda")
        << "KVBANK_TEST_MEMORY=" << want << ": expected host, host-staged or cuda";
    std::fprintf(stderr, "store tests on %s memory\n", TestDevice().Name().c_str());
  }
};

const ::testing::Environment* const kEnvironment =
    ::testing::AddGlobalTestEnvironment(new MemoryEnvironment);

}  // namespace

DeviceSpec TestDevice() {
  const std::string want = Requested();
  DeviceSpec d;
  if (want == "host-staged") d.kind = MemoryKind::kHostStaged;
  if (want == "cuda") d.kind = MemoryKind::kCuda;
  return d;
}

absl::StatusOr<std::unique_ptr<BlockPool>> CreateTestPool(BlockLayout layout, uint64_t pool_bytes,
                                                          PoolOptions options) {
  // Staged memory with test-sized payloads: a staging budget of 4 KiB makes transfers move in
  // several pieces, some of one layer (larger than the budget) and some of several.
  if (options.staging_bytes == PoolOptions().staging_bytes) options.staging_bytes = 4096;
  return BlockPool::Create(std::move(layout), pool_bytes, TestDevice(), std::move(options));
}

absl::StatusOr<std::unique_ptr<SequenceStore>> CreateTestStore(const ModelLayout& m,
                                                               uint64_t blocks, StoreOptions store,
                                                               PoolOptions pool,
                                                               std::unique_ptr<KvEventLog> events) {
  const BlockLayout b = ComputeBlockLayout(m);
  auto p = CreateTestPool(b, blocks * b.block_bytes, std::move(pool));
  if (!p.ok()) return p.status();
  return std::make_unique<SequenceStore>(m, *std::move(p), std::move(store), std::move(events));
}

}  // namespace kvbank::testenv
