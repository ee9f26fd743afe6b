// SequenceStore against a hostile neighbour: per-tenant sequence limits, statistics a tenant may
// see (its own figures only), counters that equal a recount after random operations, and leases
// that do not run out under an append still streaming in.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kvbank/layout.h"
#include "server/core/sequence_store.h"
#include "tests/unit/store_testing.h"
#include "tests/unit/test_memory.h"

namespace kvbank {
namespace {

using absl::StatusCode;

// 2 layers, 4 tokens per block, 2 KV heads of 4, fp16.
ModelLayout Layout() { return store_testing::GqaLayout("tenancy", 2, 2, 4, 4, DType::kFp16); }

TenantLimits Limits(uint64_t max_blocks, uint64_t max_sequences) {
  TenantLimits l;
  l.max_blocks = max_blocks;
  l.max_sequences = max_sequences;
  return l;
}

class TenancyTest : public ::testing::Test {
 protected:
  void Make(uint64_t blocks, StoreOptions opt = {}) {
    opt.clock = [c = clock_] { return *c; };
    auto store = testenv::CreateTestStore(Layout(), blocks, opt);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }
  void SetUp() override { Make(64); }

  absl::StatusOr<SequenceInfo> Create(const std::string& tenant,
                                      std::optional<absl::Duration> lease = absl::ZeroDuration(),
                                      std::vector<uint32_t> prompt = {},
                                      RetentionPolicy retention = {}) {
    CreateOptions o;
    o.tenant = tenant;
    o.lease = lease;
    o.prompt = std::move(prompt);
    o.retention = retention;
    return store_->Create(o);
  }
  uint64_t PayloadBytes(uint64_t n) const { return store_->pool().layout().PayloadBytes(0, 2, n); }
  AppendSpec Spec(const std::string& tenant, uint64_t id, uint64_t n,
                  std::vector<uint32_t> ids = {}) const {
    AppendSpec s;
    s.tenant = tenant;
    s.sequence_id = id;
    s.num_tokens = n;
    s.token_ids = std::move(ids);
    return s;
  }
  absl::StatusOr<SequenceInfo> Append(const std::string& tenant, uint64_t id, uint64_t n,
                                      std::vector<uint32_t> ids = {}) {
    const std::vector<uint8_t> payload(PayloadBytes(n), 0x3c);  // fp16 1.0
    return store_->Append(Spec(tenant, id, n, std::move(ids)), payload);
  }
  absl::Status Fetch(const std::string& tenant, uint64_t id) {
    FetchSpec f;
    f.tenant = tenant;
    f.sequence_id = id;
    return store_testing::FetchToHost(*store_, f).status();
  }

  std::shared_ptr<absl::Time> clock_ =
      std::make_shared<absl::Time>(absl::FromUnixSeconds(1000000000));
  std::unique_ptr<SequenceStore> store_;
};

TEST_F(TenancyTest, ATenantCannotTakeEverySequenceSlot) {
  StoreOptions opt;
  opt.max_sequences = 8;
  Make(64, opt);
  store_->tenants().SetLimits("greedy", Limits(10, 3));
  std::vector<uint64_t> mine;
  for (int i = 0; i < 3; ++i) {
    auto s = Create("greedy");
    ASSERT_TRUE(s.ok()) << s.status();
    mine.push_back(s->id);
  }
  for (const absl::Status& s :
       {Create("greedy").status(), store_->Fork(mine[0], std::nullopt, "greedy").status()}) {
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("tenant 'greedy'"), std::string::npos) << s;
    EXPECT_NE(s.message().find("limit of 3 live sequences"), std::string::npos) << s;
  }
  // The others still have room: the model-wide limit is what is left.
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(Create("polite").ok());
  const absl::Status full = Create("polite").status();
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("max_sequences (8)"), std::string::npos) << full;
  // Freeing one of its own lets the tenant create again.
  ASSERT_TRUE(store_->Free(mine[0], "greedy").ok());
  EXPECT_TRUE(Create("greedy").ok());
  const StoreStats st = store_->Stats(nullptr);
  ASSERT_EQ(st.tenants.size(), 2u);
  EXPECT_EQ(st.tenants[0].tenant, "greedy");
  EXPECT_EQ(st.tenants[0].sequences, 3u);
  EXPECT_EQ(st.tenants[0].max_sequences, 3u);
  EXPECT_EQ(st.tenants[0].max_blocks, 10u);
  EXPECT_EQ(st.tenants[1].max_sequences, 0u);
  // Lowering the limit keeps what the tenant holds and refuses more.
  store_->tenants().SetLimits("greedy", Limits(0, 1));
  EXPECT_EQ(store_->Stats().tenants[0].sequences, 3u);
  EXPECT_EQ(Create("greedy").status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(store_->CheckInvariants(), "");
}

TEST_F(TenancyTest, ATenantSeesOnlyItsOwnFigures) {
  store_->tenants().SetQuota("a", 20);
  // Tenant b is busy; tenant a did one small thing.
  auto a = Create("a", absl::ZeroDuration(), {1, 2, 3, 4, 5});
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(Append("a", a->id, 4).ok());
  std::vector<uint64_t> b_ids;
  for (int i = 0; i < 3; ++i) {
    auto b = Create("b", absl::Seconds(1), {7, 8, 9, 10});
    ASSERT_TRUE(b.ok());
    ASSERT_TRUE(Append("b", b->id, 9, std::vector<uint32_t>{7, 8, 9, 10, 11, 12, 13, 14, 15}).ok());
    ASSERT_TRUE(Fetch("b", b->id).ok());
    b_ids.push_back(b->id);
  }
  *clock_ += absl::Seconds(2);
  EXPECT_EQ(store_->ExpireLeases(*clock_), 3u);
  auto b = Create("b");
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(Append("b", b->id, 6).ok());

  const std::string tenant_a = "a";
  const StoreStats va = store_->Stats(&tenant_a);
  EXPECT_TRUE(va.tenant_view);
  EXPECT_EQ(va.sequences, 1u);
  EXPECT_EQ(va.tokens_stored, 4u);
  EXPECT_EQ(va.appends, 1u);
  EXPECT_EQ(va.bytes_appended, PayloadBytes(4));
  EXPECT_EQ(va.fetches, 0u);
  EXPECT_EQ(va.bytes_fetched, 0u);
  EXPECT_EQ(va.leases_expired, 0u);
  EXPECT_EQ(va.prefix_query_tokens, 5u);
  EXPECT_EQ(va.prefix_hit_tokens, 0u);
  EXPECT_EQ(va.pool.total, 64u) << "the pool's size is configuration";
  EXPECT_EQ(va.pool.used, 1u) << "a's one block";
  EXPECT_EQ(va.pool.free, 0u) << "pool-wide figures move with b's work";
  EXPECT_EQ(va.pool.cached, 0u);
  EXPECT_EQ(va.pool.evictions, 0u);
  ASSERT_EQ(va.tenants.size(), 1u);
  EXPECT_EQ(va.tenants[0].tenant, "a");
  EXPECT_EQ(va.tenants[0].blocks_referenced, 1u);
  EXPECT_EQ(va.tenants[0].max_blocks, 20u);

  const std::string tenant_b = "b";
  const StoreStats vb = store_->Stats(&tenant_b);
  EXPECT_EQ(vb.sequences, 1u);
  EXPECT_EQ(vb.tokens_stored, 6u);
  EXPECT_EQ(vb.appends, 4u);
  EXPECT_EQ(vb.bytes_appended, 3 * PayloadBytes(9) + PayloadBytes(6));
  EXPECT_EQ(vb.fetches, 3u);
  EXPECT_EQ(vb.bytes_fetched, PayloadBytes(9) + 2 * PayloadBytes(4 + 9));
  EXPECT_EQ(vb.leases_expired, 3u);
  EXPECT_EQ(vb.prefix_query_tokens, 12u);
  EXPECT_EQ(vb.prefix_hit_tokens, 8u) << "the second and third attached the first's block";

  // A tenant that did nothing sees zeros, not the others' totals.
  const std::string nobody = "c";
  const StoreStats vc = store_->Stats(&nobody);
  EXPECT_EQ(vc.sequences, 0u);
  EXPECT_EQ(vc.tokens_stored, 0u);
  EXPECT_EQ(vc.appends, 0u);
  EXPECT_EQ(vc.pool.used, 0u);
  ASSERT_EQ(vc.tenants.size(), 1u);
  EXPECT_EQ(vc.tenants[0].tenant, "c");

  // The admin view: the model's totals.
  const StoreStats all = store_->Stats();
  EXPECT_FALSE(all.tenant_view);
  EXPECT_EQ(all.sequences, 2u);
  EXPECT_EQ(all.tokens_stored, 10u);
  EXPECT_EQ(all.appends, 5u);
  EXPECT_EQ(all.fetches, 3u);
  EXPECT_EQ(all.leases_expired, 3u);
  EXPECT_EQ(all.pool.free + all.pool.cached + all.pool.used, 64u);
  EXPECT_EQ(all.prefix_copies_in, 0u) << "no sequence was a prefix copy";
  EXPECT_EQ(all.prefix_copy_bytes_in, 0u);
  EXPECT_EQ(store_->CheckInvariants(), "");
}

// A sequence created as a prefix copy counts once at create, and every committed append to it
// counts its payload bytes (also in bytes_appended); its fork, a plain sequence and an append
// refused count nothing. Per tenant, the model's the sum.
TEST_F(TenancyTest, PrefixCopiesCountTheSequenceAndTheBytesAppendedToIt) {
  const std::vector<uint32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9};  // 2 blocks and 1 token
  CreateOptions o;
  o.tenant = "a";
  o.lease = absl::ZeroDuration();
  o.prompt = prompt;
  o.prefix_copy = true;
  auto copy = store_->Create(o);
  ASSERT_TRUE(copy.ok()) << copy.status();
  // The prefix's blocks in two appends, as a copy of blocks fetched by hash may arrive.
  ASSERT_TRUE(Append("a", copy->id, 4).ok());
  EXPECT_EQ(Append("a", copy->id, 5, {5, 6, 7, 8, 0}).status().code(), StatusCode::kInvalidArgument)
      << "ids that differ from the prompt's: refused, not counted";
  ASSERT_TRUE(Append("a", copy->id, 5).ok());
  auto fork = store_->Fork(copy->id, std::nullopt, "a");
  ASSERT_TRUE(fork.ok()) << fork.status();
  ASSERT_TRUE(Append("a", fork->id, 3).ok());
  ASSERT_TRUE(store_->Free(copy->id, "a").ok());
  auto plain = Create("b", absl::ZeroDuration(), prompt);
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_TRUE(Append("b", plain->id, 9).ok());

  const std::string tenant_a = "a", tenant_b = "b";
  const StoreStats va = store_->Stats(&tenant_a);
  EXPECT_EQ(va.prefix_copies_in, 1u);
  EXPECT_EQ(va.prefix_copy_bytes_in, PayloadBytes(4) + PayloadBytes(5));
  EXPECT_EQ(va.bytes_appended, PayloadBytes(4) + PayloadBytes(5) + PayloadBytes(3));
  const StoreStats vb = store_->Stats(&tenant_b);
  EXPECT_EQ(vb.prefix_copies_in, 0u);
  EXPECT_EQ(vb.prefix_copy_bytes_in, 0u);
  EXPECT_EQ(vb.bytes_appended, PayloadBytes(9));
  const StoreStats all = store_->Stats();
  EXPECT_EQ(all.prefix_copies_in, 1u) << "counted at create; the free does not take it back";
  EXPECT_EQ(all.prefix_copy_bytes_in, PayloadBytes(9));
  EXPECT_EQ(all.bytes_appended, PayloadBytes(9) + PayloadBytes(3) + PayloadBytes(9));
  ASSERT_EQ(all.tenants.size(), 2u);
  EXPECT_EQ(all.tenants[0].prefix_copies_in, 1u);
  EXPECT_EQ(all.tenants[0].prefix_copy_bytes_in, PayloadBytes(9));
  EXPECT_EQ(all.tenants[1].prefix_copies_in, 0u);
  EXPECT_EQ(store_->CheckInvariants(), "");
}

// Random operations from three tenants; after each, the counters Stats reads equal a recount
// (CheckInvariants) and what Get reports.
TEST_F(TenancyTest, CountersEqualARecountAfterRandomOperations) {
  StoreOptions opt;
  opt.max_sequences = 40;
  opt.max_lease = absl::Hours(1);
  Make(96, opt);
  const uint32_t seed = 20240611;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  const std::vector<std::string> tenants = {"", "x", "y"};
  store_->tenants().SetLimits("y", Limits(30, 6));
  std::map<uint64_t, std::string> live;  // id -> tenant
  auto pick = [&]() -> std::pair<uint64_t, std::string> {
    auto it = live.begin();
    std::advance(it, rng() % live.size());
    return *it;
  };
  for (int step = 0; step < 1500; ++step) {
    SCOPED_TRACE(step);
    const int op = live.empty() ? 0 : static_cast<int>(rng() % 8);
    if (op == 0 || op == 1) {
      const std::string& t = tenants[rng() % tenants.size()];
      std::vector<uint32_t> prompt;
      for (uint32_t i = 0, n = rng() % 10; i < n; ++i) prompt.push_back(i % 5);
      RetentionPolicy rp;
      if (rng() % 5 == 0) {
        rp.kind = RetentionPolicy::Kind::kSlidingWindow;
        rp.window = 5;
        rp.sinks = 1;
      } else if (rng() % 5 == 0) {
        rp.kind = RetentionPolicy::Kind::kHeavyHitter;
        rp.budget = 6;
        rp.window = 2;
      }
      const std::optional<absl::Duration> lease =
          rng() % 3 == 0 ? std::optional<absl::Duration>(absl::Seconds(1 + rng() % 5))
                         : std::optional<absl::Duration>(absl::ZeroDuration());
      auto s = Create(t, lease, prompt, rp);
      if (s.ok()) live[s->id] = t;
    } else if (op == 2 || op == 3) {
      auto [id, t] = pick();
      auto r = Append(t, id, 1 + rng() % 7);
      if (!r.ok() && r.status().code() == StatusCode::kFailedPrecondition) live.erase(id);
    } else if (op == 4) {
      auto [id, t] = pick();
      auto s = store_->Fork(id, std::nullopt, t);
      if (s.ok()) live[s->id] = t;
      if (s.status().code() == StatusCode::kFailedPrecondition) live.erase(id);
    } else if (op == 5) {
      auto [id, t] = pick();
      auto info = store_->Get(id, t);
      if (info.ok() && info->length > 0) (void)store_->Truncate(id, rng() % info->length, t);
      if (info.status().code() == StatusCode::kFailedPrecondition) live.erase(id);
    } else if (op == 6) {
      auto [id, t] = pick();
      (void)store_->Free(id, t);
      live.erase(id);
    } else {
      *clock_ += absl::Milliseconds(rng() % 1500);
      store_->ExpireLeases(*clock_);
    }
    ASSERT_EQ(store_->CheckInvariants(), "");
    if (step % 50 == 0) {
      // Stats against what Get says of every sequence still live.
      uint64_t tokens = 0, sequences = 0;
      std::map<std::string, uint64_t> per;
      for (auto it = live.begin(); it != live.end();) {
        auto info = store_->Get(it->first, it->second);
        if (!info.ok()) {
          it = live.erase(it);
          continue;
        }
        tokens += info->length;
        ++sequences;
        per[it->second] += info->length;
        ++it;
      }
      const StoreStats st = store_->Stats();
      EXPECT_EQ(st.tokens_stored, tokens);
      EXPECT_EQ(st.sequences, sequences);
      for (const std::string& t : tenants) {
        EXPECT_EQ(store_->Stats(&t).tokens_stored, per[t]) << "tenant '" << t << "'";
      }
    }
  }
}

// An append that streams for longer than the lease keeps its sequence; the lease runs again from
// the end of the append (commit or abort).
TEST_F(TenancyTest, AnAppendInFlightKeepsItsSequenceAlive) {
  auto s = Create("t", absl::Seconds(1));
  ASSERT_TRUE(s.ok());
  const uint64_t n = 8;
  const std::vector<uint8_t> payload(PayloadBytes(n), 0x3c);
  auto txn = store_->BeginAppend(Spec("t", s->id, n));
  ASSERT_TRUE(txn.ok()) << txn.status();
  const size_t chunk = payload.size() / 8;
  for (size_t at = 0; at < payload.size(); at += chunk) {
    *clock_ += absl::Milliseconds(400);  // 3.2 s in all on a 1 s lease
    EXPECT_EQ(store_->ExpireLeases(*clock_), 0u) << "expired under an append in flight";
    ASSERT_TRUE(store_->Get(s->id, "t").ok()) << "expired on touch under an append in flight";
    const size_t len = std::min(chunk, payload.size() - at);
    ASSERT_TRUE((*txn)->Write(absl::MakeConstSpan(payload.data() + at, len)).ok());
  }
  auto done = (*txn)->Commit();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->length, n);
  // The commit renewed the lease: it runs a full second from now.
  *clock_ += absl::Milliseconds(900);
  EXPECT_EQ(store_->ExpireLeases(*clock_), 0u);
  *clock_ += absl::Milliseconds(200);
  EXPECT_EQ(store_->ExpireLeases(*clock_), 1u);

  // An aborted append renews it too.
  auto t = Create("t", absl::Seconds(1));
  ASSERT_TRUE(t.ok());
  auto aborted = store_->BeginAppend(Spec("t", t->id, n));
  ASSERT_TRUE(aborted.ok());
  *clock_ += absl::Seconds(5);
  EXPECT_EQ(store_->ExpireLeases(*clock_), 0u);
  aborted->reset();
  *clock_ += absl::Milliseconds(900);
  EXPECT_EQ(store_->ExpireLeases(*clock_), 0u);
  ASSERT_TRUE(store_->Get(t->id, "t").ok());
  EXPECT_EQ(store_->CheckInvariants(), "");
}

}  // namespace
}  // namespace kvbank
