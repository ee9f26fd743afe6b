// Prefix sharing in the core: SequenceStore over a small host pool. Attach, publish, copy on
// write, eviction order, pins, TTL, Match, FetchBlocks, tenant isolation, quotas, stats.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "kvbank/layout.h"
#include "kvbank/prefix_hash.h"
#include "server/core/block_pool.h"
#include "server/core/kv_events.h"
#include "server/core/sequence_store.h"
#include "tests/unit/store_testing.h"
#include "tests/unit/test_memory.h"

namespace kvbank {
namespace {

using store_testing::ExpectBytes;
using store_testing::ReadAll;

#define EXPECT_INVARIANTS(h) EXPECT_EQ((h).store->CheckInvariants(), "")

// 2 layers, 2 kv heads, head_dim 8, 4 tokens a block, fp16: one token of one layer is 64 bytes.
ModelLayout TestLayout() { return store_testing::GqaLayout("tiny", 2, 2, 8, 4, DType::kFp16); }

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// KV of position t depends on the whole prefix, like a real model's: the seed of a position is a
// digest of `tag` and the ids up to and including it.
uint64_t PrefixSeed(uint64_t tag, const std::vector<uint32_t>& ids, uint64_t t) {
  uint64_t s = Mix(tag);
  for (uint64_t i = 0; i <= t; ++i) s = Mix(s ^ ids[i]);
  return s;
}

// Payload of layers [l0, l1) x positions [t0, t0 + n): layer l, position t carries bytes made
// from seed(t) and l. Layout per layer: K [heads][n][head_dim], then V [heads][n][head_dim_v].
std::vector<uint8_t> BuildPayload(const BlockLayout& bl, uint32_t l0, uint32_t l1, uint64_t t0,
                                  uint64_t n, const std::function<uint64_t(uint64_t)>& seed) {
  const PayloadLayout p = PayloadLayout::Make(bl, l0, l1, n);
  std::vector<uint8_t> out(p.total_bytes);
  for (uint32_t l = l0; l < l1; ++l) {
    const LayerView& v = bl.layers[l];
    const uint64_t base = p.layer_offset[l - l0];
    for (uint64_t t = 0; t < n; ++t) {
      uint64_t x = Mix(seed(t0 + t) ^ (uint64_t{l} << 56));
      for (uint32_t part = 0; part < 2; ++part) {
        const uint64_t row = part == 0 ? v.KRowBytes() : v.VRowBytes();
        const uint64_t part_base = base + part * uint64_t{v.num_kv_heads} * n * v.KRowBytes();
        for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
          uint8_t* dst = out.data() + part_base + (uint64_t{h} * n + t) * row;
          for (uint64_t b = 0; b < row; ++b) dst[b] = static_cast<uint8_t>(x = Mix(x));
        }
      }
    }
  }
  return out;
}

class Harness {
 public:
  explicit Harness(uint64_t blocks, bool caching = true,
                   absl::Duration ttl = absl::ZeroDuration()) {
    auto log = std::make_unique<KvEventLog>(4096);
    events = log.get();
    PoolOptions po;
    po.enable_prefix_caching = caching;
    po.events = events;
    po.clock = [this] { return now; };
    StoreOptions so;
    so.clock = [this] { return now; };
    so.prefix_cache_ttl = ttl;
    auto made = testenv::CreateTestStore(layout, blocks, so, po, std::move(log));
    EXPECT_TRUE(made.ok()) << made.status();
    if (made.ok()) store = *std::move(made);
  }

  // A sequence without a lease (the fake clock moves by hours in some tests).
  uint64_t Create(const std::string& tenant, const std::vector<uint32_t>& prompt,
                  uint64_t expect_cached = 0, std::optional<uint8_t> priority = std::nullopt) {
    CreateOptions o;
    o.lease = absl::ZeroDuration();
    o.tenant = tenant;
    o.prompt = prompt;
    o.priority = priority;
    auto info = store->Create(o);
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return 0;
    EXPECT_EQ(info->cached_tokens, expect_cached);
    EXPECT_EQ(info->length, expect_cached);
    return info->id;
  }

  // Appends positions [pos, pos + n) of `ids` (content from tag + prefix) to layers [l0, l1).
  absl::StatusOr<SequenceInfo> Append(const std::string& tenant, uint64_t id,
                                      const std::vector<uint32_t>& ids, uint64_t pos, uint64_t n,
                                      uint64_t tag = 1, uint32_t l0 = 0, uint32_t l1 = 2,
                                      bool pass_ids = true) {
    AppendSpec s;
    s.tenant = tenant;
    s.sequence_id = id;
    s.layer_begin = l0;
    s.layer_end = l1;
    s.num_tokens = n;
    if (pass_ids) s.token_ids.assign(ids.begin() + pos, ids.begin() + pos + n);
    const auto payload = BuildPayload(store->pool().layout(), l0, l1, pos, n,
                                      [&](uint64_t t) { return PrefixSeed(tag, ids, t); });
    return store->Append(s, payload);
  }
  void MustAppend(const std::string& tenant, uint64_t id, const std::vector<uint32_t>& ids,
                  uint64_t pos, uint64_t n, uint64_t tag = 1) {
    auto r = Append(tenant, id, ids, pos, n, tag);
    ASSERT_TRUE(r.ok()) << r.status();
  }

  std::vector<uint8_t> Fetch(const std::string& tenant, uint64_t id, uint64_t t0, uint64_t t1) {
    FetchSpec f;
    f.tenant = tenant;
    f.sequence_id = id;
    f.token_begin = t0;
    f.token_end = t1;
    return ExpectBytes(store_testing::FetchToHost(*store, f));
  }
  // What positions [t0, t1) of a sequence appended from `ids` with `tag` must read back as.
  std::vector<uint8_t> Expected(const std::vector<uint32_t>& ids, uint64_t tag, uint64_t t0,
                                uint64_t t1, uint32_t l0 = 0, uint32_t l1 = 2) {
    return BuildPayload(store->pool().layout(), l0, l1, t0, t1 - t0,
                        [&](uint64_t t) { return PrefixSeed(tag, ids, t); });
  }
  uint64_t MatchTokens(const std::string& tenant, const std::vector<uint32_t>& tokens) {
    MatchQuery q;
    q.tokens = tokens;
    return store->prefix().Match(tenant, {q})[0];
  }
  std::vector<BlockHash> Hashes(const std::string& tenant, const std::vector<uint32_t>& tokens) {
    return PrefixHashes(store->options().hash, store->prefix().Root(tenant, ""), tokens,
                        layout.block_tokens);
  }
  PoolStats Pool() const { return store->pool().Stats(); }

  absl::Time now = absl::FromUnixSeconds(1700000000);
  ModelLayout layout = TestLayout();
  KvEventLog* events = nullptr;
  std::unique_ptr<SequenceStore> store;
};

std::vector<uint32_t> Tokens(uint32_t n, uint32_t start) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = start + i * 7;
  return v;
}

TEST(PrefixCacheTest, SamePromptSharesPhysicalBlocks) {
  Harness h(16);
  const auto prompt = Tokens(10, 100);  // 2 full blocks and a partial one
  const uint64_t a = h.Create("", prompt);
  h.MustAppend("", a, prompt, 0, 10);
  EXPECT_INVARIANTS(h);
  EXPECT_EQ(h.Pool().used, 3u);
  EXPECT_EQ(h.MatchTokens("", prompt), 8u) << "the partial block is never published";

  const uint64_t b = h.Create("", prompt, /*expect_cached=*/8);
  EXPECT_EQ(h.Pool().used, 3u) << "attaching takes no new block";
  h.MustAppend("", b, prompt, 8, 2);
  EXPECT_EQ(h.Pool().used, 4u) << "only the partial block is new";
  EXPECT_INVARIANTS(h);
  EXPECT_EQ(h.Fetch("", b, 0, 10), h.Expected(prompt, 1, 0, 10));
  EXPECT_EQ(h.Fetch("", a, 0, 10), h.Expected(prompt, 1, 0, 10));
  auto info = h.store->Get(b, "");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->cached_tokens, 8u);
  EXPECT_EQ(info->length, 10u);

  // A longer prompt with the same start attaches only the common full blocks.
  auto longer = prompt;
  longer.resize(8);
  for (uint32_t t : Tokens(6, 900)) longer.push_back(t);
  h.Create("", longer, 8);
  // A prompt differing in its first token attaches nothing.
  auto other = prompt;
  other[0] ^= 1;
  h.Create("", other, 0);
  EXPECT_INVARIANTS(h);
}

TEST(PrefixCacheTest, PublishesOnlyBlocksFullInAllLayers) {
  Harness h(16);
  const auto prompt = Tokens(8, 5);
  const uint64_t a = h.Create("", {});
  const uint64_t before = h.events->last_sequence();
  ASSERT_TRUE(h.Append("", a, prompt, 0, 8, 1, 0, 1).ok());  // layer 0 only
  EXPECT_INVARIANTS(h);
  EXPECT_EQ(h.MatchTokens("", prompt), 0u) << "layer 1 has nothing yet";
  EXPECT_EQ(h.events->last_sequence(), before);
  ASSERT_TRUE(h.Append("", a, prompt, 0, 6, 1, 1, 2, /*pass_ids=*/false).ok());
  EXPECT_EQ(h.MatchTokens("", prompt), 4u) << "block 0 is now full in both layers";
  ASSERT_TRUE(h.Append("", a, prompt, 6, 2, 1, 1, 2, false).ok());
  EXPECT_EQ(h.MatchTokens("", prompt), 8u);
  EXPECT_EQ(h.events->last_sequence(), before + 2);
  EXPECT_EQ(h.Fetch("", a, 0, 8), h.Expected(prompt, 1, 0, 8));
  EXPECT_INVARIANTS(h);

  // Full blocks whose token ids were never given are not published either.
  const uint64_t c = h.Create("", {});
  ASSERT_TRUE(h.Append("", c, Tokens(8, 77), 0, 8, 2, 0, 2, false).ok());
  EXPECT_EQ(h.MatchTokens("", Tokens(8, 77)), 0u);
  EXPECT_INVARIANTS(h);
}

TEST(PrefixCacheTest, SharedBlockIsNeverWritten) {
  Harness h(16);
  const auto prompt = Tokens(8, 40);
  const uint64_t a = h.Create("", prompt);
  h.MustAppend("", a, prompt, 0, 8);
  const uint64_t b = h.Create("", prompt, 8);
  EXPECT_EQ(h.Pool().used, 2u);
  // b rolls back into the middle of shared block 1 and writes different tokens there.
  ASSERT_TRUE(h.store->Truncate(b, 6, "").ok());
  EXPECT_INVARIANTS(h);
  auto b_ids = prompt;
  b_ids[6] = 1;
  b_ids[7] = 2;
  h.MustAppend("", b, b_ids, 6, 2, /*tag=*/9);
  EXPECT_INVARIANTS(h);
  EXPECT_EQ(h.Pool().used, 3u) << "block 1 was copied, not written";
  EXPECT_EQ(h.Fetch("", a, 0, 8), h.Expected(prompt, 1, 0, 8)) << "a's content changed";
  // b reads [0, 6) from a's content, [6, 8) from its own.
  EXPECT_EQ(h.Fetch("", b, 0, 6), h.Expected(prompt, 1, 0, 6));
  EXPECT_EQ(h.Fetch("", b, 6, 8), h.Expected(b_ids, 9, 6, 8));
  EXPECT_EQ(h.MatchTokens("", prompt), 8u) << "a's block 1 keeps its hash";
  EXPECT_EQ(h.MatchTokens("", b_ids), 8u) << "b's copy is published under its own hash";

  // Fork on top of shared blocks: the child shares, then writes only its own copies.
  auto child = h.store->Fork(a, std::nullopt, "");
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(h.Pool().used, 3u) << "a fork of full blocks copies nothing";
  ASSERT_TRUE(h.store->Truncate(child->id, 5, "").ok());
  auto c_ids = prompt;
  c_ids[5] = 3;
  c_ids.resize(7);
  h.MustAppend("", child->id, c_ids, 5, 2, /*tag=*/11);
  EXPECT_EQ(h.Fetch("", a, 0, 8), h.Expected(prompt, 1, 0, 8));
  EXPECT_EQ(h.Fetch("", child->id, 5, 7), h.Expected(c_ids, 11, 5, 7));
  EXPECT_EQ(h.Fetch("", child->id, 0, 5), h.Expected(prompt, 1, 0, 5));
  EXPECT_INVARIANTS(h);
  // A fork of a partial block copies it, and the parent's later appends do not show in it.
  const uint64_t p = h.Create("", {});
  const auto p_ids = Tokens(6, 500);
  h.MustAppend("", p, p_ids, 0, 6, 4);
  const uint64_t used_before_fork = h.Pool().used;
  auto pc = h.store->Fork(p, std::nullopt, "");
  ASSERT_TRUE(pc.ok());
  EXPECT_EQ(h.Pool().used, used_before_fork + 1) << "block 0 shared, the partial block 1 copied";
  auto p_more = p_ids;
  p_more.push_back(1);
  h.MustAppend("", p, p_more, 6, 1, 4);
  EXPECT_EQ(h.Fetch("", pc->id, 0, 6), h.Expected(p_ids, 4, 0, 6));
  EXPECT_EQ(h.store->Get(pc->id, "")->length, 6u);
  EXPECT_INVARIANTS(h);
}

TEST(PrefixCacheTest, PublishedBlockIsImmutableEvenForItsOnlyHolder) {
  Harness h(8);
  const auto prompt = Tokens(8, 40);
  const uint64_t a = h.Create("", prompt);
  h.MustAppend("", a, prompt, 0, 8);
  ASSERT_EQ(h.store->pool().Stats().used, 2u);
  // a alone holds block 1, but it is published: rolling back into it and writing copies it.
  ASSERT_TRUE(h.store->Truncate(a, 6, "").ok());
  auto ids = prompt;
  ids[6] = 5;
  h.MustAppend("", a, ids, 6, 2, /*tag=*/3);
  EXPECT_INVARIANTS(h);
  EXPECT_EQ(h.Pool().used, 2u);
  EXPECT_EQ(h.Pool().cached, 1u) << "the old block 1 is cached under its hash";
  auto r = h.store->prefix().FetchBlocks("", h.Hashes("", prompt), 0, std::nullopt);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ExpectBytes(ReadAll(**r)), h.Expected(prompt, 1, 0, 8))
      << "the published block was written";
  EXPECT_EQ(h.Fetch("", a, 6, 8), h.Expected(ids, 3, 6, 8));
}

TEST(PrefixCacheTest, FreedBlocksStayCachedAndEvictTailFirst) {
  Harness h(3);
  const auto prompt = Tokens(12, 1);
  const uint64_t a = h.Create("", prompt);
  h.MustAppend("", a, prompt, 0, 12);
  ASSERT_TRUE(h.store->Free(a, "").ok());
  EXPECT_INVARIANTS(h);
  PoolStats s = h.Pool();
  EXPECT_EQ(s.cached, 3u);
  EXPECT_EQ(s.free, 0u);
  EXPECT_EQ(s.used, 0u);
  EXPECT_EQ(h.MatchTokens("", prompt), 12u) << "freed hashed blocks stay matchable";

  // One new block is needed: the chain's tail goes, its head still matches.
  const uint64_t b = h.Create("", {});
  h.MustAppend("", b, Tokens(4, 999), 0, 4, 3);
  EXPECT_INVARIANTS(h);
  s = h.Pool();
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.cached, 2u);
  EXPECT_EQ(h.MatchTokens("", prompt), 8u);
  // The next one takes the new tail, then the head.
  h.MustAppend("", b, Tokens(8, 999), 4, 4, 3);
  EXPECT_EQ(h.MatchTokens("", prompt), 4u);
  h.MustAppend("", b, Tokens(12, 999), 8, 4, 3);
  EXPECT_EQ(h.MatchTokens("", prompt), 0u);
  // Nothing is left to evict: a live sequence's blocks are never taken.
  auto r = h.Append("", b, Tokens(13, 999), 12, 1, 3);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(h.store->Get(b, "")->length, 12u);
  EXPECT_EQ(h.Fetch("", b, 0, 12), h.Expected(Tokens(12, 999), 3, 0, 12));
  EXPECT_INVARIANTS(h);
}

// Two cached one-block prompts in a 2-block pool, x freed before y (x is the least recently
// used); `touch` runs, then one block is allocated: exactly one of x and y must go.
using Touch = std::function<void(Harness&, const std::vector<uint32_t>&)>;
void EvictOneAfter(const Touch& touch, bool expect_x_survives, uint8_t prio_x = 50,
                   uint8_t prio_y = 50) {
  Harness h(2);
  const auto x = Tokens(4, 10), y = Tokens(4, 20);
  const uint64_t sx = h.Create("", x, 0, prio_x), sy = h.Create("", y, 0, prio_y);
  h.MustAppend("", sx, x, 0, 4);
  h.MustAppend("", sy, y, 0, 4);
  ASSERT_TRUE(h.store->Free(sx, "").ok());
  ASSERT_TRUE(h.store->Free(sy, "").ok());
  const PoolStats before = h.Pool();
  if (touch) touch(h, x);
  EXPECT_INVARIANTS(h);
  h.MustAppend("", h.Create("", {}), Tokens(4, 30), 0, 4);
  EXPECT_EQ(h.MatchTokens("", x), expect_x_survives ? 4u : 0u);
  EXPECT_EQ(h.MatchTokens("", y), expect_x_survives ? 0u : 4u);
  EXPECT_EQ(h.Pool().evictions, before.evictions + 1);
  EXPECT_INVARIANTS(h);
}

TEST(PrefixCacheTest, LeastRecentlyUsedAndLowerPriorityGoFirst) {
  EvictOneAfter(nullptr, /*expect_x_survives=*/false);
  // Priority beats recency: y (20) goes before the older x (80); and the other way round.
  EvictOneAfter(nullptr, /*expect_x_survives=*/true, 80, 20);
  EvictOneAfter(nullptr, /*expect_x_survives=*/false, 20, 80);
  Harness h(2);
  CreateOptions bad;
  bad.priority = 101;
  EXPECT_EQ(h.store->Create(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PrefixCacheTest, MatchHasNoSideEffects) {
  EvictOneAfter(
      [](Harness& h, const std::vector<uint32_t>& x) {
        const PoolStats before = h.Pool();
        const uint64_t ev = h.events->last_sequence();
        for (int i = 0; i < 3; ++i) EXPECT_EQ(h.MatchTokens("", x), 4u);
        MatchQuery q;
        q.hashes = h.Hashes("", x);
        EXPECT_EQ(h.store->prefix().Match("", {q, q})[1], 4u);
        EXPECT_EQ(h.Pool().cached, before.cached);
        EXPECT_EQ(h.Pool().free, before.free);
        EXPECT_EQ(h.events->last_sequence(), ev);
      },
      /*expect_x_survives=*/false);
  // Nor is reading x's block by hash (a read, not a reuse): x still goes first.
  EvictOneAfter(
      [](Harness& h, const std::vector<uint32_t>& x) {
        auto r = h.store->prefix().FetchBlocks("", h.Hashes("", x), 0, std::nullopt);
        ASSERT_TRUE(r.ok()) << r.status();
      },
      /*expect_x_survives=*/false);
  // The contrast: attaching x's block to a new sequence is a use, so y goes instead.
  EvictOneAfter(
      [](Harness& h, const std::vector<uint32_t>& x) {
        const uint64_t s = h.Create("", x, /*expect_cached=*/4);
        ASSERT_TRUE(h.store->Free(s, "").ok());
      },
      /*expect_x_survives=*/true);
}

TEST(PrefixCacheTest, PinKeepsBlocksUntilUnpinned) {
  Harness h(2);
  const auto x = Tokens(4, 10), y = Tokens(4, 20);
  const uint64_t sx = h.Create("", x), sy = h.Create("", y);
  h.MustAppend("", sx, x, 0, 4);
  h.MustAppend("", sy, y, 0, 4);
  EXPECT_EQ(h.store->prefix().Pin("", h.Hashes("", x), true), 1u)
      << "a referenced block can be pinned";
  EXPECT_EQ(h.store->prefix().Pin("", h.Hashes("", Tokens(4, 77)), true), 0u) << "unknown hash";
  ASSERT_TRUE(h.store->Free(sx, "").ok());
  ASSERT_TRUE(h.store->Free(sy, "").ok());
  EXPECT_EQ(h.Pool().pinned, 1u);
  EXPECT_INVARIANTS(h);
  const uint64_t z = h.Create("", {});
  auto two = h.Append("", z, Tokens(8, 30), 0, 8);
  EXPECT_EQ(two.status().code(), absl::StatusCode::kResourceExhausted) << "x is pinned";
  EXPECT_EQ(h.MatchTokens("", y), 4u) << "a failed allocation evicts nothing";
  h.MustAppend("", z, Tokens(4, 30), 0, 4);  // takes y, although x is older
  EXPECT_EQ(h.MatchTokens("", x), 4u);
  EXPECT_EQ(h.MatchTokens("", y), 0u);
  EXPECT_EQ(h.store->prefix().Pin("", h.Hashes("", x), false), 1u);
  EXPECT_EQ(h.Pool().pinned, 0u);
  EXPECT_INVARIANTS(h);
  h.MustAppend("", z, Tokens(8, 30), 4, 4);
  EXPECT_EQ(h.MatchTokens("", x), 0u) << "unpinned, x is evictable again";
  EXPECT_INVARIANTS(h);
}

TEST(PrefixCacheTest, TtlDropsOnlyOldCachedBlocks) {
  Harness h(16, true, absl::Hours(1));
  const auto old_free = Tokens(4, 10), old_live = Tokens(4, 20), old_pinned = Tokens(4, 30),
             young = Tokens(4, 40);
  const uint64_t a = h.Create("", old_free), b = h.Create("", old_live),
                 c = h.Create("", old_pinned);
  h.MustAppend("", a, old_free, 0, 4);
  h.MustAppend("", b, old_live, 0, 4);
  h.MustAppend("", c, old_pinned, 0, 4);
  ASSERT_EQ(h.store->prefix().Pin("", h.Hashes("", old_pinned), true), 1u);
  ASSERT_TRUE(h.store->Free(a, "").ok());
  ASSERT_TRUE(h.store->Free(c, "").ok());
  h.now += absl::Minutes(50);
  const uint64_t d = h.Create("", young);
  h.MustAppend("", d, young, 0, 4);
  ASSERT_TRUE(h.store->Free(d, "").ok());
  EXPECT_EQ(h.store->prefix().ExpireCache(h.now), 0u) << "nothing is an hour old yet";
  h.now += absl::Minutes(20);
  const uint64_t removed_before = h.events->last_sequence();
  EXPECT_EQ(h.store->prefix().ExpireCache(h.now), 1u);
  EXPECT_INVARIANTS(h);
  EXPECT_EQ(h.MatchTokens("", old_free), 0u);
  EXPECT_EQ(h.MatchTokens("", old_live), 4u) << "referenced blocks never expire";
  EXPECT_EQ(h.MatchTokens("", old_pinned), 4u) << "pinned blocks never expire";
  EXPECT_EQ(h.MatchTokens("", young), 4u);
  EXPECT_EQ(h.events->last_sequence(), removed_before + 1);
  EXPECT_EQ(h.Pool().cached, 2u);
  EXPECT_EQ(h.Pool().used, 1u);
  // Without a TTL nothing ages out.
  Harness no_ttl(4);
  const uint64_t e = no_ttl.Create("", old_free);
  no_ttl.MustAppend("", e, old_free, 0, 4);
  ASSERT_TRUE(no_ttl.store->Free(e, "").ok());
  no_ttl.now += absl::Hours(1000);
  EXPECT_EQ(no_ttl.store->prefix().ExpireCache(no_ttl.now), 0u);
  EXPECT_EQ(no_ttl.MatchTokens("", old_free), 4u);
}

TEST(PrefixCacheTest, CachingDisabledSharesNothing) {
  Harness h(8, /*caching=*/false);
  const auto prompt = Tokens(8, 3);
  const uint64_t a = h.Create("", prompt);
  h.MustAppend("", a, prompt, 0, 8);
  EXPECT_EQ(h.MatchTokens("", prompt), 0u);
  h.Create("", prompt, 0);
  ASSERT_TRUE(h.store->Free(a, "").ok());
  const PoolStats s = h.Pool();
  EXPECT_EQ(s.cached, 0u) << "unhashed blocks go straight back to the free list";
  EXPECT_EQ(s.free, 8u);
  EXPECT_EQ(h.events->last_sequence(), 0u);
  EXPECT_INVARIANTS(h);
}

TEST(PrefixCacheTest, FetchBlocksReturnsTheAppendedBytes) {
  Harness h(16);
  const auto prompt = Tokens(14, 60);
  const uint64_t a = h.Create("", prompt);
  h.MustAppend("", a, prompt, 0, 14, 5);
  const auto hashes = h.Hashes("", prompt);
  ASSERT_EQ(hashes.size(), 3u);
  auto all = h.store->prefix().FetchBlocks("", hashes, 0, std::nullopt);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ((*all)->num_tokens(), 12u);
  EXPECT_EQ(ExpectBytes(ReadAll(**all)), h.Expected(prompt, 5, 0, 12));
  // One layer only, and a run that stops at the first miss.
  BlockHash bogus{};
  bogus[0] = 1;
  auto part = h.store->prefix().FetchBlocks("", {hashes[0], hashes[1], bogus, hashes[2]}, 1, 2);
  ASSERT_TRUE(part.ok()) << part.status();
  EXPECT_EQ((*part)->num_tokens(), 8u);
  EXPECT_EQ(ExpectBytes(ReadAll(**part)), h.Expected(prompt, 5, 0, 8, 1, 2));
  // Blocks hashed from the middle of a chain read as themselves.
  auto mid = h.store->prefix().FetchBlocks("", {hashes[2]}, 0, std::nullopt);
  ASSERT_TRUE(mid.ok());
  EXPECT_EQ(ExpectBytes(ReadAll(**mid)), h.Expected(prompt, 5, 8, 12));
  EXPECT_EQ(h.store->prefix().FetchBlocks("", {bogus, hashes[0]}, 0, std::nullopt).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(h.store->prefix().FetchBlocks("", {}, 0, std::nullopt).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(h.store->prefix().FetchBlocks("", hashes, 1, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_INVARIANTS(h);
  // A reader holds its blocks: freeing the sequence and evicting everything else around it
  // changes nothing it reads.
  all->reset();
  part->reset();
  ASSERT_TRUE(h.store->Free(a, "").ok());
  EXPECT_EQ(h.Pool().used, 1u);
  const uint64_t big = h.Create("", {});
  h.MustAppend("", big, Tokens(60, 3), 0, 60, 6);  // 15 blocks: every other one
  EXPECT_EQ(h.Pool().free + h.Pool().cached, 0u);
  EXPECT_EQ(h.MatchTokens("", prompt), 0u);
  EXPECT_EQ(ExpectBytes(ReadAll(**mid)), h.Expected(prompt, 5, 8, 12));
  EXPECT_INVARIANTS(h);
  mid->reset();
  ASSERT_TRUE(h.store->Free(big, "").ok());
  EXPECT_EQ(h.Pool().used, 0u);
  EXPECT_INVARIANTS(h);
}

std::string Anonymize(const absl::Status& s, uint64_t id) {
  return absl::StrReplaceAll(s.message(), {{std::to_string(id), "ID"}});
}

TEST(PrefixCacheTest, TenantsNeverSeeEachOther) {
  Harness h(16);
  const auto prompt = Tokens(9, 70);
  const uint64_t a = h.Create("a", prompt);
  h.MustAppend("a", a, prompt, 0, 9);
  const uint64_t freed = h.Create("a", {});
  h.MustAppend("a", freed, Tokens(4, 1), 0, 4);
  ASSERT_TRUE(h.store->Free(freed, "a").ok());
  EXPECT_EQ(h.store->Get(freed, "a").status().code(), absl::StatusCode::kFailedPrecondition);

  // Prefix cache: nothing of a's is visible to b, whatever b sends.
  h.Create("b", prompt, 0);
  EXPECT_EQ(h.MatchTokens("b", prompt), 0u);
  MatchQuery q;
  q.hashes = h.Hashes("a", prompt);
  EXPECT_EQ(h.store->prefix().Match("b", {q})[0], 0u) << "a's own hashes, sent by b";
  EXPECT_EQ(h.store->prefix().Match("a", {q})[0], 8u);
  EXPECT_EQ(h.store->prefix().FetchBlocks("b", q.hashes, 0, std::nullopt).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(h.store->prefix().Pin("b", q.hashes, true), 0u);
  EXPECT_EQ(h.Pool().pinned, 0u);
  EXPECT_INVARIANTS(h);

  // Sequences: a's live and freed ids answer b exactly like an id that never existed.
  const uint64_t never = 1;
  for (uint64_t id : {a, freed}) {
    SCOPED_TRACE(id == a ? "live" : "freed");
    using Call = std::function<absl::Status(uint64_t)>;
    const std::vector<std::pair<const char*, Call>> calls = {
        {"Get", [&](uint64_t i) { return h.store->Get(i, "b").status(); }},
        {"Fork", [&](uint64_t i) { return h.store->Fork(i, std::nullopt, "b").status(); }},
        {"Truncate", [&](uint64_t i) { return h.store->Truncate(i, 0, "b").status(); }},
        {"RenewLease", [&](uint64_t i) { return h.store->RenewLease(i, "b").status(); }},
        {"BeginAppend",
         [&](uint64_t i) {
           AppendSpec s;
           s.tenant = "b";
           s.sequence_id = i;
           s.num_tokens = 1;
           return h.store->BeginAppend(s).status();
         }},
        {"BeginFetch",
         [&](uint64_t i) {
           FetchSpec f;
           f.tenant = "b";
           f.sequence_id = i;
           return h.store->BeginFetch(f).status();
         }},
        {"Free", [&](uint64_t i) { return h.store->Free(i, "b").status(); }},
    };
    for (const auto& [name, call] : calls) {
      const absl::Status got = call(id), want = call(never);
      EXPECT_EQ(got.code(), absl::StatusCode::kNotFound) << name << ": " << got;
      EXPECT_EQ(got.code(), want.code()) << name;
      EXPECT_EQ(Anonymize(got, id), Anonymize(want, never)) << name;
    }
  }
  // None of b's calls touched a's sequence.
  auto info = h.store->Get(a, "a");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->length, 9u);
  EXPECT_EQ(h.Fetch("a", a, 0, 9), h.Expected(prompt, 1, 0, 9));
  EXPECT_EQ(h.store->Get(a, "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_INVARIANTS(h);
}

TEST(PrefixCacheTest, TenantQuotaLimitsOnlyThatTenant) {
  Harness h(16);
  h.store->tenants().SetQuota("b", 2);
  const uint64_t b = h.Create("b", {});
  auto r = h.Append("b", b, Tokens(12, 1), 0, 12);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("quota"), std::string::npos) << r.status();
  EXPECT_EQ(h.store->Get(b, "b")->length, 0u);
  h.MustAppend("b", b, Tokens(8, 1), 0, 8);
  EXPECT_EQ(h.Append("b", b, Tokens(9, 1), 8, 1).status().code(),
            absl::StatusCode::kResourceExhausted);
  const uint64_t a = h.Create("a", {});
  h.MustAppend("a", a, Tokens(12, 1), 0, 12);
  EXPECT_EQ(h.store->pool().TenantBlocks(h.store->pool().InternTenant("b")), 2u);
  EXPECT_INVARIANTS(h);
  // Freeing gives the quota back; 0 lifts it.
  ASSERT_TRUE(h.store->Free(b, "b").ok());
  const uint64_t b2 = h.Create("b", {});
  h.MustAppend("b", b2, Tokens(8, 50), 0, 8);
  h.store->tenants().SetQuota("b", 0);
  h.MustAppend("b", b2, Tokens(16, 50), 8, 8);
  EXPECT_INVARIANTS(h);
}

TEST(PrefixCacheTest, PinsCountOnTheTenantQuota) {
  Harness h(16);
  h.store->tenants().SetQuota("c", 2);
  const uint32_t c = h.store->pool().InternTenant("c");
  const auto x = Tokens(8, 300);
  const uint64_t c1 = h.Create("c", {});
  h.MustAppend("c", c1, x, 0, 8);
  EXPECT_EQ(h.store->prefix().Pin("c", h.Hashes("c", x), true), 2u);
  ASSERT_TRUE(h.store->Free(c1, "c").ok());
  EXPECT_EQ(h.store->pool().TenantBlocks(c), 2u) << "pinned blocks still hold pool space";
  EXPECT_INVARIANTS(h);
  // Pin-and-free cannot take more than the quota.
  const uint64_t c2 = h.Create("c", {});
  EXPECT_EQ(h.Append("c", c2, Tokens(4, 400), 0, 4).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(h.store->prefix().Pin("c", {h.Hashes("c", x)[1]}, false), 1u);
  EXPECT_EQ(h.store->pool().TenantBlocks(c), 1u);
  h.MustAppend("c", c2, Tokens(4, 400), 0, 4);
  EXPECT_EQ(h.store->pool().TenantBlocks(c), 2u);
  EXPECT_EQ(h.store->prefix().Pin("c", h.Hashes("c", Tokens(4, 400)), true), 1u)
      << "pinning a block the tenant references costs nothing more";
  EXPECT_EQ(h.store->prefix().Pin("c", {h.Hashes("c", x)[1]}, true), 0u) << "past the quota";
  EXPECT_EQ(h.store->pool().TenantBlocks(c), 2u);
  EXPECT_INVARIANTS(h);
  // Unpinned and freed, everything goes back.
  EXPECT_EQ(h.store->prefix().Pin("c", {h.Hashes("c", x)[0]}, false), 1u);
  EXPECT_EQ(h.store->prefix().Pin("c", h.Hashes("c", Tokens(4, 400)), false), 1u);
  ASSERT_TRUE(h.store->Free(c2, "c").ok());
  EXPECT_EQ(h.store->pool().TenantBlocks(c), 0u);
  EXPECT_EQ(h.Pool().pinned, 0u);
  EXPECT_INVARIANTS(h);
}

TEST(PrefixCacheTest, StatsCountQueriedAndHitTokensPerTenant) {
  Harness h(16);
  const auto prompt = Tokens(10, 7);
  const uint64_t a = h.Create("a", prompt);
  h.MustAppend("a", a, prompt, 0, 10);
  h.Create("a", prompt, 8);
  h.Create("b", prompt, 0);
  h.Create("a", {});
  const StoreStats st = h.store->Stats();
  EXPECT_EQ(st.prefix_query_tokens, 30u);
  EXPECT_EQ(st.prefix_hit_tokens, 8u);
  ASSERT_EQ(st.tenants.size(), 2u);
  EXPECT_EQ(st.tenants[0].tenant, "a");
  EXPECT_EQ(st.tenants[0].prefix_query_tokens, 20u);
  EXPECT_EQ(st.tenants[0].prefix_hit_tokens, 8u);
  EXPECT_EQ(st.tenants[0].sequences, 3u);
  EXPECT_EQ(st.tenants[0].blocks_referenced, 3u) << "a shared block counts once";
  EXPECT_EQ(st.tenants[1].tenant, "b");
  EXPECT_EQ(st.tenants[1].prefix_query_tokens, 10u);
  EXPECT_EQ(st.tenants[1].prefix_hit_tokens, 0u);
  EXPECT_EQ(st.pool.used, 3u);
  // Match is a query, not an attach: it does not count.
  h.MatchTokens("a", prompt);
  EXPECT_EQ(h.store->Stats().prefix_query_tokens, 30u);
  EXPECT_INVARIANTS(h);
}

}  // namespace
}  // namespace kvbank
