// The host block pool: sizing, all-or-nothing allocation, reference counts through BlockRef
// handles, and its invariants under random operations.
#include "server/core/block_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kvbank/layout.h"

namespace kvbank {
namespace {

BlockLayout SmallLayout() {
  ModelLayout m;
  m.name = "pool";
  m.num_layers = 3;
  m.num_q_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = m.head_dim_v = 5;
  m.block_tokens = 3;
  m.layer_dtypes.assign(3, DType::kFp16);
  EXPECT_EQ(ValidateLayout(m), "");
  return ComputeBlockLayout(m);
}

std::unique_ptr<BlockPool> MakePool(uint64_t blocks, uint64_t extra_bytes = 0) {
  const BlockLayout b = SmallLayout();
  auto pool = BlockPool::CreateHost(b, blocks * b.block_bytes + extra_bytes);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? *std::move(pool) : nullptr;
}

TEST(BlockPoolTest, SizesThePoolInWholeBlocks) {
  auto pool = MakePool(10, SmallLayout().block_bytes - 1);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->num_blocks(), 10u);
  EXPECT_EQ(pool->pool_bytes(), 10 * pool->layout().block_bytes);
  const PoolStats s = pool->Stats();
  EXPECT_EQ(s.total, 10u);
  EXPECT_EQ(s.free, 10u);
  EXPECT_EQ(s.used, 0u);
  EXPECT_EQ(pool->CheckInvariants(), "");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pool->base()) % BlockLayout::kBlockAlign, 0u);
  EXPECT_EQ(pool->BlockData(3), pool->base() + 3 * pool->layout().block_bytes);
}

TEST(BlockPoolTest, PoolSmallerThanOneBlockIsInvalidArgument) {
  const BlockLayout b = SmallLayout();
  for (uint64_t bytes : {uint64_t{0}, uint64_t{1}, b.block_bytes - 1}) {
    auto pool = BlockPool::CreateHost(b, bytes);
    ASSERT_FALSE(pool.ok()) << bytes;
    EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument) << pool.status();
    EXPECT_NE(pool.status().message().find("pool_bytes"), std::string::npos) << pool.status();
  }
  EXPECT_EQ(BlockPool::CreateHost(BlockLayout{}, 1 << 20).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(BlockPoolTest, AllocationIsAllOrNothing) {
  auto pool = MakePool(8);
  auto first = pool->Allocate(5);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->size(), 5u);
  std::set<int32_t> ids;
  for (const BlockRef& r : *first) {
    EXPECT_TRUE(r.valid());
    EXPECT_GE(r.id(), 0);
    EXPECT_LT(r.id(), 8);
    EXPECT_EQ(pool->RefCount(r.id()), 1u);
    ids.insert(r.id());
  }
  EXPECT_EQ(ids.size(), 5u) << "an id was handed out twice";

  auto too_many = pool->Allocate(4);
  ASSERT_FALSE(too_many.ok());
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->Stats().free, 3u) << "a failed allocation took blocks";
  EXPECT_EQ(pool->CheckInvariants(), "");

  auto empty = pool->Allocate(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());

  auto rest = pool->Allocate(3);
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(pool->Stats().free, 0u);
  EXPECT_EQ(pool->Allocate(1).status().code(), absl::StatusCode::kResourceExhausted);
  first->clear();
  rest->clear();
  EXPECT_EQ(pool->Stats().free, 8u);
  EXPECT_EQ(pool->CheckInvariants(), "");
}

TEST(BlockPoolTest, ShareCountsReferences) {
  auto pool = MakePool(4);
  auto a = pool->Allocate(1);
  ASSERT_TRUE(a.ok());
  const int32_t id = (*a)[0].id();
  BlockRef b = pool->Share((*a)[0]);
  BlockRef c = pool->Share(b);
  EXPECT_EQ(b.id(), id);
  EXPECT_EQ(c.id(), id);
  EXPECT_EQ(pool->RefCount(id), 3u);
  EXPECT_EQ(pool->Stats().used, 1u) << "a shared block counts once";
  (*a)[0].Reset();
  EXPECT_FALSE((*a)[0].valid());
  EXPECT_EQ(pool->RefCount(id), 2u);
  b.Reset();
  b.Reset();  // a second reset of an empty handle drops nothing
  EXPECT_EQ(pool->RefCount(id), 1u);
  EXPECT_EQ(pool->Stats().free, 3u);
  c = BlockRef();  // move-assigning an empty handle releases the old reference
  EXPECT_EQ(pool->RefCount(id), 0u);
  EXPECT_EQ(pool->Stats().free, 4u);
  EXPECT_EQ(pool->CheckInvariants(), "");
}

TEST(BlockPoolTest, BlockRefMoveSemantics) {
  auto pool = MakePool(4);
  auto got = pool->Allocate(2);
  ASSERT_TRUE(got.ok());
  const int32_t id0 = (*got)[0].id(), id1 = (*got)[1].id();

  BlockRef moved(std::move((*got)[0]));
  EXPECT_FALSE((*got)[0].valid());
  EXPECT_EQ((*got)[0].id(), -1);
  EXPECT_TRUE(moved.valid());
  EXPECT_EQ(moved.id(), id0);
  EXPECT_EQ(pool->RefCount(id0), 1u) << "a move does not add a reference";

  // Move-assigning over a live handle releases what it held.
  moved = std::move((*got)[1]);
  EXPECT_EQ(moved.id(), id1);
  EXPECT_EQ(pool->RefCount(id0), 0u);
  EXPECT_EQ(pool->RefCount(id1), 1u);

  // Self move-assignment keeps the reference.
  BlockRef& alias = moved;
  moved = std::move(alias);
  EXPECT_TRUE(moved.valid());
  EXPECT_EQ(pool->RefCount(id1), 1u);

  {
    std::vector<BlockRef> v;
    v.push_back(std::move(moved));
    for (int i = 0; i < 20; ++i) v.push_back(pool->Share(v[0]));  // growth moves the handles
    EXPECT_EQ(pool->RefCount(id1), 21u);
  }
  EXPECT_EQ(pool->RefCount(id1), 0u);
  EXPECT_EQ(pool->Stats().free, 4u);
  EXPECT_EQ(pool->CheckInvariants(), "");
}

TEST(BlockPoolTest, BlocksHoldTheirBytes) {
  auto pool = MakePool(6);
  auto got = pool->Allocate(6);
  ASSERT_TRUE(got.ok());
  const uint64_t bb = pool->layout().block_bytes;
  for (const BlockRef& r : *got) std::memset(pool->BlockData(r.id()), r.id() + 1, bb);
  for (const BlockRef& r : *got) {
    const uint8_t* d = pool->BlockData(r.id());
    for (uint64_t i = 0; i < bb; ++i) ASSERT_EQ(d[i], r.id() + 1) << "block " << r.id();
  }
}

TEST(BlockPoolTest, InvariantsHoldUnderRandomOperations) {
  const uint64_t seed = 77;
  std::printf("seed=%llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const uint64_t total = 37;
  auto pool = MakePool(total);
  std::vector<BlockRef> held;
  int exhausted = 0;
  for (int step = 0; step < 20000; ++step) {
    const int op = static_cast<int>(rng() % 10);
    if (op < 3) {
      const size_t n = rng() % 6;
      const uint64_t free_before = pool->Stats().free;
      auto got = pool->Allocate(n);
      ASSERT_EQ(got.ok(), n <= free_before) << "step " << step;
      if (got.ok()) {
        for (BlockRef& r : *got) held.push_back(std::move(r));
      } else {
        ++exhausted;
        ASSERT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted);
        ASSERT_EQ(pool->Stats().free, free_before);
      }
    } else if (op < 5 && !held.empty()) {
      held.push_back(pool->Share(held[rng() % held.size()]));
    } else if (op < 8 && !held.empty()) {
      const size_t i = rng() % held.size();
      std::swap(held[i], held.back());
      held.pop_back();
    } else if (!held.empty()) {
      const size_t i = rng() % held.size(), j = rng() % held.size();
      held[i] = std::move(held[j]);  // i == j is a self move; else drops i's reference
      if (!held[i].valid() || i != j) {
        held.erase(
            std::remove_if(held.begin(), held.end(), [](const BlockRef& r) { return !r.valid(); }),
            held.end());
      }
    }
    ASSERT_EQ(pool->CheckInvariants(), "") << "step " << step;
    std::map<int32_t, uint32_t> counts;
    for (const BlockRef& r : held) ++counts[r.id()];
    const PoolStats s = pool->Stats();
    ASSERT_EQ(s.used, counts.size()) << "step " << step;
    ASSERT_EQ(s.free + s.used, s.total);
    if (step % 97 == 0) {
      for (int32_t id = 0; id < static_cast<int32_t>(total); ++id) {
        ASSERT_EQ(pool->RefCount(id), counts.count(id) ? counts[id] : 0u) << "block " << id;
      }
    }
  }
  EXPECT_GT(exhausted, 0) << "the sweep never filled the pool";
  held.clear();
  EXPECT_EQ(pool->Stats().free, total);
  EXPECT_EQ(pool->CheckInvariants(), "");
}

}  // namespace
}  // namespace kvbank
