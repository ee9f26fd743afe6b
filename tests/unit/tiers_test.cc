// The tiers below a model's pool (server/core/tiers.h) through the store, as kvbankd wires them
// (ModelRegistry): evicted cached blocks move down to the host tier or the disk tier, Match
// reports where a prompt's blocks are, Create and FetchBlocks promote them back byte for byte, a
// disk tier survives a restart, and a torn or corrupt disk block is never served.
#include "server/core/tiers.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvbank/layout.h"
#include "kvbank/prefix_hash.h"
#include "server/core/core_lock.h"
#include "server/core/model_registry.h"
#include "server/core/sequence_store.h"
#include "tests/unit/store_testing.h"
#include "tests/unit/test_memory.h"

namespace kvbank {
namespace {

// 2 layers (fp16, int8: quantized bytes and scales move as stored), 2 kv heads, head_dim 8,
// 4 tokens a block.
ModelLayout TestLayout() {
  ModelLayout m = store_testing::GqaLayout("tiny", 2, 2, 8, 4, DType::kFp16);
  m.layer_dtypes = {DType::kFp16, DType::kInt8};
  return m;
}

std::string TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "kvbank-tiers-XXXXXX").string();
  EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

// Finite fp16 values (the int8 layer quantizes them), different for every prompt.
std::vector<uint8_t> Payload(const BlockLayout& bl, uint64_t n, uint64_t seed) {
  const PayloadLayout p = PayloadLayout::Make(bl, 0, bl.num_layers(), n, DType::kFp16);
  std::vector<uint8_t> out(p.total_bytes);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i + 1 < out.size(); i += 2) {
    const uint16_t h = uint16_t(0x3000 + rng() % 0x0c00) | uint16_t(rng() % 2 ? 0x8000 : 0);
    out[i] = uint8_t(h);
    out[i + 1] = uint8_t(h >> 8);
  }
  return out;
}

class TiersTest : public ::testing::Test {
 protected:
  void TearDown() override {
    registry_.reset();
    std::filesystem::remove_all(dir_);
  }

  // A registry holding the model with a pool of `pool_blocks`, a host tier of `host_blocks`
  // (0: none) and, when `disk`, a disk tier in dir_.
  // spill_ahead off unless asked for: the counts below are then exact.
  std::shared_ptr<SequenceStore> Open(uint64_t pool_blocks, uint64_t host_blocks, bool disk,
                                      uint64_t disk_blocks = 256, bool spill_ahead = false) {
    registry_.reset();
    registry_ = std::make_unique<ModelRegistry>(uint64_t{1} << 30);
    ModelConfig c;
    c.layout = TestLayout();
    const BlockLayout bl = ComputeBlockLayout(c.layout);
    c.pool_bytes = pool_blocks * bl.block_bytes;
    c.device = testenv::TestDevice();
    c.staging_bytes = 4096;
    c.tiers.host_bytes = host_blocks * bl.block_bytes;
    c.tiers.prefault_host = false;
    c.tiers.spill_ahead = spill_ahead;
    if (disk) {
      c.tiers.disk_path = dir_;
      c.tiers.disk_bytes = disk_blocks * (8192 + AlignUp(bl.block_bytes, 4096));
    }
    auto r = registry_->Ensure(c);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->model : nullptr;
  }

  std::vector<uint32_t> Prompt(int i) const {
    std::vector<uint32_t> p(kTokens);
    for (uint32_t t = 0; t < kTokens; ++t) p[t] = 1000 * uint32_t(i) + t + 1;
    return p;
  }

  // Writes prompt i (its KV from seed i), frees the sequence (its blocks stay cached), and
  // returns what fetching it read back.
  std::vector<uint8_t> Write(SequenceStore& store, int i, const std::string& tenant = "") {
    CreateOptions o;
    o.lease = absl::ZeroDuration();
    o.tenant = tenant;
    auto info = store.Create(o);
    EXPECT_TRUE(info.ok()) << info.status();
    AppendSpec a;
    a.tenant = tenant;
    a.sequence_id = info->id;
    a.num_tokens = kTokens;
    a.dtype = DType::kFp16;
    a.token_ids = Prompt(i);
    EXPECT_TRUE(store.Append(a, Payload(store.pool().layout(), kTokens, uint64_t(i))).ok());
    std::vector<uint8_t> got = Fetch(store, info->id, tenant);
    EXPECT_TRUE(store.Free(info->id, tenant).ok());
    return got;
  }

  std::vector<uint8_t> Fetch(SequenceStore& store, uint64_t id, const std::string& tenant = "") {
    FetchSpec f;
    f.tenant = tenant;
    f.sequence_id = id;
    f.dtype = DType::kFp16;
    auto r = store.BeginFetch(f);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    std::vector<uint8_t> out((*r)->payload_bytes());
    EXPECT_TRUE((*r)->Read(0, absl::MakeSpan(out)).ok());
    return out;
  }

  // Creates a sequence with prompt i: answers its cached tokens and (in *data) what it reads.
  uint64_t Reuse(SequenceStore& store, int i, std::vector<uint8_t>* data,
                 const std::string& tenant = "") {
    CreateOptions o;
    o.lease = absl::ZeroDuration();
    o.tenant = tenant;
    o.prompt = Prompt(i);
    auto info = store.Create(o);
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return 0;
    if (data != nullptr && info->cached_tokens > 0) *data = Fetch(store, info->id, tenant);
    EXPECT_TRUE(store.Free(info->id, tenant).ok());
    return info->cached_tokens;
  }

  MatchResult Match(SequenceStore& store, int i, const std::string& tenant = "") {
    MatchQuery q;
    q.tokens = Prompt(i);
    return store.prefix().MatchTiers(tenant, {q})[0];
  }

  std::vector<BlockHash> Hashes(SequenceStore& store, int i, const std::string& tenant = "") {
    return PrefixHashes(store.options().hash, store.prefix().Root(tenant, ""), Prompt(i),
                        store.layout().block_tokens);
  }

  static constexpr uint32_t kTokens = 8;  // two blocks a prompt
  std::string dir_ = TempDir();
  std::unique_ptr<ModelRegistry> registry_;
};

TEST_F(TiersTest, HostTierKeepsWhatThePoolEvicts) {
  auto store = Open(/*pool_blocks=*/8, /*host_blocks=*/64, /*disk=*/false);
  ASSERT_NE(store, nullptr);
  std::vector<std::vector<uint8_t>> written;
  for (int i = 0; i < 10; ++i) written.push_back(Write(*store, i));  // 20 blocks through 8
  const TierStats before = store->prefix().tiers()->Stats();
  EXPECT_EQ(before.spilled_to_host, 12u);
  EXPECT_EQ(before.host_blocks, 12u);
  // The oldest prompts are in the host tier only, the newest in the pool.
  const MatchResult oldest = Match(*store, 0), newest = Match(*store, 9);
  EXPECT_EQ(oldest.tokens, kTokens);
  EXPECT_EQ(oldest.host_tokens, kTokens);
  EXPECT_EQ(newest.pool_tokens, kTokens);
  for (int i = 0; i < 10; ++i) {
    std::vector<uint8_t> got;
    EXPECT_EQ(Reuse(*store, i, &got), kTokens) << "prompt " << i;
    EXPECT_EQ(got, written[i]) << "prompt " << i << " came back different";
  }
  const TierStats after = store->prefix().tiers()->Stats();
  EXPECT_GT(after.promoted_from_host, 0u);
  // Inclusive: a block promoted and evicted again is not copied again.
  EXPECT_LE(after.host_blocks, 20u);
  EXPECT_EQ(store->CheckInvariants(), "");
}

TEST_F(TiersTest, SpillAheadCopiesBeforeTheEviction) {
  // A pool of 32 blocks keeps its 16 coldest cached blocks copied down while fewer than 16 are
  // free: evicting them then copies nothing.
  auto store = Open(/*pool_blocks=*/32, /*host_blocks=*/256, /*disk=*/false, 256,
                    /*spill_ahead=*/true);
  ASSERT_NE(store, nullptr);
  std::vector<std::vector<uint8_t>> written;
  for (int i = 0; i < 16; ++i) written.push_back(Write(*store, i));  // the pool full
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (store->prefix().tiers()->Stats().host_blocks < 16 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_GE(store->prefix().tiers()->Stats().host_blocks, 16u) << "the spill-ahead copied nothing";
  const uint64_t before = store->prefix().tiers()->Stats().spilled_at_eviction;
  EXPECT_EQ(before, 0u);
  Write(*store, 100);  // two blocks: the two coldest go, already copied
  EXPECT_EQ(store->pool().Stats().evictions, 2u);
  EXPECT_EQ(store->prefix().tiers()->Stats().spilled_at_eviction, before);
  for (int i = 0; i < 16; ++i) {
    std::vector<uint8_t> got;
    EXPECT_EQ(Reuse(*store, i, &got), kTokens) << "prompt " << i;
    EXPECT_EQ(got, written[i]) << "prompt " << i;
  }
  EXPECT_EQ(store->CheckInvariants(), "");
}

TEST_F(TiersTest, MatchSeesTiersPerTenantOnly) {
  auto store = Open(4, 64, false);
  ASSERT_NE(store, nullptr);
  Write(*store, 0, "alice");
  for (int i = 1; i < 4; ++i) Write(*store, i, "alice");  // prompt 0 leaves the pool
  EXPECT_EQ(Match(*store, 0, "alice").host_tokens, kTokens);
  EXPECT_EQ(Match(*store, 0, "bob").tokens, 0u);
  EXPECT_EQ(Reuse(*store, 0, nullptr, "bob"), 0u);
  EXPECT_EQ(store->prefix().tiers()->Stats().promoted_from_host, 0u);
}

TEST_F(TiersTest, DiskTierSurvivesARestart) {
  std::vector<std::vector<uint8_t>> written;
  {
    auto store = Open(8, 0, true);
    ASSERT_NE(store, nullptr);
    for (int i = 0; i < 10; ++i) written.push_back(Write(*store, i));
    // Warm restart: what the pool still caches goes down too.
    EXPECT_EQ(store->prefix().FlushToDisk(absl::InfiniteFuture()), 8u);
    EXPECT_EQ(store->prefix().tiers()->Stats().disk_blocks, 20u);
  }
  auto store = Open(8, 0, true);
  ASSERT_NE(store, nullptr);
  const TierStats loaded = store->prefix().tiers()->Stats();
  EXPECT_EQ(loaded.loaded, 20u);
  EXPECT_EQ(loaded.load_invalid, 0u);
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(Match(*store, i).disk_tokens, kTokens) << "prompt " << i;
  }
  for (int i = 0; i < 10; ++i) {
    std::vector<uint8_t> got;
    EXPECT_EQ(Reuse(*store, i, &got), kTokens) << "prompt " << i;
    EXPECT_EQ(got, written[i]) << "prompt " << i << " came back different";
  }
  EXPECT_GT(store->prefix().tiers()->Stats().promoted_from_disk, 0u);
  EXPECT_EQ(store->CheckInvariants(), "");
}

TEST_F(TiersTest, PrefetchBringsBlocksIntoThePool) {
  {
    auto store = Open(8, 0, true);
    ASSERT_NE(store, nullptr);
    Write(*store, 1);
    Write(*store, 2);
    store->prefix().FlushToDisk(absl::InfiniteFuture());
  }
  auto store = Open(8, 0, true);
  ASSERT_NE(store, nullptr);
  MatchQuery by_tokens, by_hashes;
  by_tokens.tokens = Prompt(1);
  by_hashes.hashes = Hashes(*store, 2);
  EXPECT_EQ(store->prefix().Prefetch("", {by_tokens, by_hashes}), 4u);
  EXPECT_EQ(store->prefix().tiers()->Stats().promoted_from_disk, 4u);
  EXPECT_EQ(Match(*store, 1).pool_tokens, kTokens);
  EXPECT_EQ(Match(*store, 2).pool_tokens, kTokens);
  EXPECT_EQ(store->pool().Stats().cached, 4u) << "prefetched blocks stay cached in the pool";
  EXPECT_EQ(Reuse(*store, 1, nullptr), kTokens);
  EXPECT_EQ(store->prefix().tiers()->Stats().promoted_from_disk, 4u)
      << "the create found them in the pool";
  EXPECT_EQ(store->prefix().Prefetch("bob", {by_tokens}), 0u) << "another tenant's blocks";
  EXPECT_EQ(store->CheckInvariants(), "");
}

TEST_F(TiersTest, FetchBlocksReadsFromTheDisk) {
  std::vector<uint8_t> written;
  {
    auto store = Open(8, 0, true);
    ASSERT_NE(store, nullptr);
    written = Write(*store, 3);
    store->prefix().FlushToDisk(absl::InfiniteFuture());
  }
  auto store = Open(8, 0, true);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->pool().Stats().cached, 0u);
  auto r = store->prefix().FetchBlocks("", Hashes(*store, 3), 0, std::nullopt, DType::kFp16);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->num_tokens(), kTokens);
  std::vector<uint8_t> got((*r)->payload_bytes());
  ASSERT_TRUE((*r)->Read(0, absl::MakeSpan(got)).ok());
  EXPECT_EQ(got, written);
}

// Flips one byte of a block's bytes in the disk file.
void Corrupt(const std::string& file, uint64_t offset) {
  const int fd = open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint8_t b = 0;
  ASSERT_EQ(pread(fd, &b, 1, off_t(offset)), 1);
  b ^= 0x40;
  ASSERT_EQ(pwrite(fd, &b, 1, off_t(offset)), 1);
  fsync(fd);
  close(fd);
}

TEST_F(TiersTest, CorruptBlockIsAMissCountedAndRemoved) {
  {
    auto store = Open(8, 0, true);
    ASSERT_NE(store, nullptr);
    Write(*store, 0);
    store->prefix().FlushToDisk(absl::InfiniteFuture());
  }
  auto store = Open(8, 0, true);
  ASSERT_NE(store, nullptr);
  TierCache& t = *store->prefix().tiers();
  // Checked at start (by the scrubber): the corruption below comes after, and a read finds it.
  ASSERT_TRUE(t.WaitForScrub(absl::Now() + absl::Seconds(30)));
  const std::vector<BlockHash> h = Hashes(*store, 0);
  auto slot = t.DiskSlotOf(h[1], "");
  ASSERT_TRUE(slot.has_value());
  Corrupt(t.disk_file(), *slot * t.slot_bytes() + t.header_bytes() + 17);
  // The first block comes back; the second fails its checksum: never served.
  EXPECT_EQ(Reuse(*store, 0, nullptr), 4u);
  EXPECT_EQ(t.Stats().corrupt, 1u);
  EXPECT_FALSE(t.DiskSlotOf(h[1], "").has_value()) << "a corrupt block stays indexed";
  EXPECT_EQ(Match(*store, 0).tokens, 4u);
}

TEST_F(TiersTest, TornSlotsAreSkippedAtStart) {
  std::string file;
  uint64_t slot_bytes = 0, header_bytes = 0;
  std::vector<uint64_t> slots;
  {
    auto store = Open(8, 0, true);
    ASSERT_NE(store, nullptr);
    for (int i = 0; i < 3; ++i) Write(*store, i);
    store->prefix().FlushToDisk(absl::InfiniteFuture());
    TierCache& t = *store->prefix().tiers();
    file = t.disk_file();
    slot_bytes = t.slot_bytes();
    header_bytes = t.header_bytes();
    for (int i = 0; i < 2; ++i) slots.push_back(*t.DiskSlotOf(Hashes(*store, i)[1], ""));
  }
  // One record's bytes torn (a kill mid-write), another's header torn.
  Corrupt(file, slots[0] * slot_bytes + header_bytes + 3);
  Corrupt(file, slots[1] * slot_bytes + 70);
  auto store = Open(8, 0, true);
  ASSERT_NE(store, nullptr);
  // The torn header at start; the torn bytes when the scrubber (or a read) gets to them.
  EXPECT_EQ(store->prefix().tiers()->Stats().loaded, 5u);
  ASSERT_TRUE(store->prefix().tiers()->WaitForScrub(absl::Now() + absl::Seconds(30)));
  const TierStats s = store->prefix().tiers()->Stats();
  EXPECT_EQ(s.load_invalid, 2u);
  EXPECT_EQ(s.disk_blocks, 4u);
  EXPECT_EQ(s.unverified, 0u);
  EXPECT_EQ(Match(*store, 0).tokens, 4u);
  EXPECT_EQ(Match(*store, 1).tokens, 4u);
  EXPECT_EQ(Match(*store, 2).tokens, kTokens);
}

TEST_F(TiersTest, HostVictimsGoToTheDisk) {
  std::vector<std::vector<uint8_t>> written;
  auto store = Open(4, 4, true);
  ASSERT_NE(store, nullptr);
  for (int i = 0; i < 8; ++i) written.push_back(Write(*store, i));  // 16 blocks: 4 + 4 + disk
  ASSERT_TRUE(store->prefix().tiers()->WaitForWrites(absl::Now() + absl::Seconds(30)));
  const TierStats s = store->prefix().tiers()->Stats();
  EXPECT_EQ(s.host_blocks, 4u);
  EXPECT_EQ(s.spilled_to_disk, 8u);
  EXPECT_EQ(Match(*store, 0).disk_tokens, kTokens);
  for (int i = 0; i < 8; ++i) {
    std::vector<uint8_t> got;
    EXPECT_EQ(Reuse(*store, i, &got), kTokens) << "prompt " << i;
    EXPECT_EQ(got, written[i]) << "prompt " << i;
  }
  EXPECT_EQ(store->CheckInvariants(), "");
}

// Inclusive tiers: a block promoted from the disk and evicted again is the disk's copy; nothing
// is written to the host tier or the disk again, and it still comes back bit for bit.
TEST_F(TiersTest, EvictingAPromotedBlockAgainCopiesNothing) {
  auto store = Open(/*pool_blocks=*/2, /*host_blocks=*/2, /*disk=*/true);
  ASSERT_NE(store, nullptr);
  TierCache& tiers = *store->prefix().tiers();
  const auto settled = [&] { return tiers.WaitForWrites(absl::Now() + absl::Seconds(30)); };
  const std::vector<uint8_t> p0 = Write(*store, 0);
  Write(*store, 1);                                  // prompt 0 to the host tier
  const std::vector<uint8_t> p2 = Write(*store, 2);  // prompt 1 to the host, 0 on to the disk
  ASSERT_TRUE(settled());
  ASSERT_EQ(Match(*store, 0).disk_tokens, kTokens);
  std::vector<uint8_t> got;
  ASSERT_EQ(Reuse(*store, 0, &got), kTokens);  // promoted from the disk (prompt 2 goes down)
  EXPECT_EQ(got, p0);
  ASSERT_TRUE(settled());
  const TierStats before = tiers.Stats();
  EXPECT_EQ(before.promoted_from_disk, 2u);

  ASSERT_EQ(Reuse(*store, 2, &got), kTokens);  // promoted from the host: prompt 0 evicted again
  EXPECT_EQ(got, p2);
  ASSERT_TRUE(settled());
  const TierStats after = tiers.Stats();
  EXPECT_EQ(store->pool().Stats().evictions, 8u);
  EXPECT_EQ(after.spilled_to_host, before.spilled_to_host);
  EXPECT_EQ(after.spilled_to_disk, before.spilled_to_disk);
  EXPECT_EQ(after.spilled_at_eviction, before.spilled_at_eviction);
  EXPECT_EQ(Match(*store, 0).disk_tokens, kTokens);
  ASSERT_EQ(Reuse(*store, 0, &got), kTokens);
  EXPECT_EQ(got, p0);
  EXPECT_EQ(store->CheckInvariants(), "");
}

// The spill-ahead copies the pool's coldest blocks down before their eviction; a host tier
// smaller than that passes some of them on to the disk. Evicting them later copies nothing,
// wherever their copy now is.
TEST_F(TiersTest, ABlockSpilledAheadIsNotCopiedAgainAtItsEviction) {
  auto store = Open(/*pool_blocks=*/32, /*host_blocks=*/8, /*disk=*/true, /*disk_blocks=*/256,
                    /*spill_ahead=*/true);
  ASSERT_NE(store, nullptr);
  TierCache& tiers = *store->prefix().tiers();
  std::vector<std::vector<uint8_t>> written;
  for (int i = 0; i < 16; ++i) written.push_back(Write(*store, i));  // the pool full
  // The 16 coldest (prompts 0-7) go down: the last 8 copied in the host tier, the first 8 on
  // the disk.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (tiers.Stats().spilled_to_host < 16 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_GE(tiers.Stats().spilled_to_host, 16u) << "the spill-ahead copied too little";
  ASSERT_TRUE(tiers.WaitForWrites(absl::Now() + absl::Seconds(30)));
  ASSERT_EQ(tiers.Find(Hashes(*store, 0)[0], ""), Tier::kDisk);
  ASSERT_EQ(tiers.Find(Hashes(*store, 7)[0], ""), Tier::kHost);

  for (int i = 16; i < 24; ++i) written.push_back(Write(*store, i));  // evicts prompts 0-7
  ASSERT_TRUE(tiers.WaitForWrites(absl::Now() + absl::Seconds(30)));
  const TierStats s = tiers.Stats();
  EXPECT_EQ(store->pool().Stats().evictions, 16u);
  EXPECT_EQ(s.spilled_at_eviction, 0u) << s.spilled_to_host << " copied to the host tier";
  for (int i = 0; i < 24; ++i) {
    std::vector<uint8_t> got;
    EXPECT_EQ(Reuse(*store, i, &got), kTokens) << "prompt " << i;
    EXPECT_EQ(got, written[i]) << "prompt " << i;
  }
  EXPECT_EQ(store->CheckInvariants(), "");
}

TEST_F(TiersTest, EventsCarryTheTier) {
  auto store = Open(2, 8, false);
  ASSERT_NE(store, nullptr);
  Write(*store, 0);
  Write(*store, 1);  // prompt 0's blocks go to the host tier
  auto batch = store->prefix().events()->Read(0, 1000, "", true);
  ASSERT_TRUE(batch.ok());
  int pool_stored = 0, host_stored = 0, pool_removed = 0;
  const std::string pool_medium = store->pool().medium();
  for (const KvEvent& e : batch->events) {
    if (e.type == KvEvent::Type::kBlockStored && e.medium == pool_medium) ++pool_stored;
    if (e.type == KvEvent::Type::kBlockStored && e.medium == "host") {
      ++host_stored;
      EXPECT_EQ(e.token_ids.size(), 4u);
    }
    if (e.type == KvEvent::Type::kBlockRemoved && e.medium == pool_medium) {
      pool_removed += int(e.hashes.size());
    }
  }
  EXPECT_EQ(pool_stored, 4);
  EXPECT_EQ(host_stored, 2);
  EXPECT_EQ(pool_removed, 2);
}

// A promotion stores the block in the pool again and leaves it in its tier (inclusive): a
// BlockStored for the pool's medium, no BlockRemoved for the tier's.
TEST_F(TiersTest, APromotionIsStoredInThePoolAndStaysInItsTier) {
  auto store = Open(2, 8, false);
  ASSERT_NE(store, nullptr);
  Write(*store, 0);
  Write(*store, 1);  // prompt 0's blocks go to the host tier
  const std::vector<BlockHash> p0 = Hashes(*store, 0);
  const uint64_t mark = store->prefix().events()->last_sequence();
  ASSERT_EQ(Reuse(*store, 0, nullptr), kTokens);  // promoted; prompt 1 goes down
  auto batch = store->prefix().events()->Read(mark, 1000, "", true);
  ASSERT_TRUE(batch.ok());
  const std::string pool_medium = store->pool().medium();
  int p0_pool_stored = 0, p0_host_removed = 0, host_stored = 0;
  for (const KvEvent& e : batch->events) {
    for (const BlockHash& h : e.hashes) {
      const bool of_p0 = h == p0[0] || h == p0[1];
      if (of_p0 && e.type == KvEvent::Type::kBlockStored && e.medium == pool_medium) {
        ++p0_pool_stored;
      }
      if (of_p0 && e.type == KvEvent::Type::kBlockRemoved && e.medium == "host") {
        ++p0_host_removed;
      }
      if (e.type == KvEvent::Type::kBlockStored && e.medium == "host") ++host_stored;
    }
  }
  EXPECT_EQ(p0_pool_stored, 2);
  EXPECT_EQ(p0_host_removed, 0);
  EXPECT_EQ(host_stored, 2);  // prompt 1's
  EXPECT_EQ(store->prefix().tiers()->Find(p0[0], ""), Tier::kHost);
  EXPECT_EQ(store->prefix().tiers()->Find(p0[1], ""), Tier::kHost);
}

// No byte of a block moves under the store's or the pool's lock: evictions into the tiers made
// by appends, forks and copies on write are copied after those locks, and so are promotions,
// the spill-ahead and the warm-restart flush. (A build with assertions aborts at the first move
// under a lock; every build counts them.)
TEST_F(TiersTest, NoByteMovesUnderTheStoreOrPoolLock) {
  const uint64_t before = MovesUnderCoreLock();
  auto store = Open(/*pool_blocks=*/8, /*host_blocks=*/4, /*disk=*/true, /*disk_blocks=*/256,
                    /*spill_ahead=*/true);
  ASSERT_NE(store, nullptr);
  for (int i = 0; i < 12; ++i) Write(*store, i);  // appends that evict into the tiers
  // A fork copies its partial block; an append to a shared block copies it on write.
  CreateOptions o;
  o.lease = absl::ZeroDuration();
  auto parent = store->Create(o);
  ASSERT_TRUE(parent.ok());
  AppendSpec a;
  a.sequence_id = parent->id;
  a.num_tokens = kTokens + 2;  // two full blocks and a partial one
  a.dtype = DType::kFp16;
  ASSERT_TRUE(store->Append(a, Payload(store->pool().layout(), a.num_tokens, 7)).ok());
  for (int i = 12; i < 15; ++i) Write(*store, i);  // the pool full of cached blocks again
  auto child = store->Fork(parent->id, absl::ZeroDuration());
  ASSERT_TRUE(child.ok()) << child.status();
  a.sequence_id = child->id;
  a.num_tokens = 1;
  ASSERT_TRUE(store->Append(a, Payload(store->pool().layout(), 1, 8)).ok());
  ASSERT_TRUE(store->Free(child->id).ok());
  ASSERT_TRUE(store->Free(parent->id).ok());
  for (int i = 0; i < 15; ++i) {
    std::vector<uint8_t> got;
    Reuse(*store, i, &got);  // promotions, and their evictions
  }
  ASSERT_TRUE(store->prefix().tiers()->WaitForWrites(absl::Now() + absl::Seconds(30)));
  EXPECT_GT(store->pool().Stats().evictions, 0u);
  EXPECT_GT(store->prefix().tiers()->Stats().spilled_to_host, 0u);
  EXPECT_GT(store->prefix().FlushToDisk(absl::Now() + absl::Seconds(30)), 0u);
  EXPECT_EQ(MovesUnderCoreLock(), before);
  EXPECT_EQ(store->CheckInvariants(), "");
}

TEST_F(TiersTest, TiersNeedPrefixCaching) {
  ModelRegistry registry(uint64_t{1} << 30);
  ModelConfig c;
  c.layout = TestLayout();
  c.pool_bytes = 1 << 20;
  c.enable_prefix_caching = false;
  c.tiers.host_bytes = 1 << 20;
  auto r = registry.Ensure(c);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("prefix caching is off"), std::string::npos);
}

}  // namespace
}  // namespace kvbank
