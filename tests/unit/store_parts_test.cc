// The SequenceStore's parts that need no pool: TransferPlanner (ranges and formats), CommitWaiters
// (the waiting room of layer-wise handoff) and StoreTenants (figures and limits).
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "server/core/commit_waiters.h"
#include "server/core/store_tenants.h"
#include "server/core/transfer_planner.h"

namespace kvbank {
namespace {

ModelLayout Gqa(std::vector<DType> dtypes) {
  ModelLayout m;
  m.name = "parts";
  m.kind = AttentionKind::kGqa;
  m.num_layers = static_cast<uint32_t>(dtypes.size());
  m.num_q_heads = 8;
  m.num_kv_heads = 4;
  m.head_dim = m.head_dim_v = 16;
  m.block_tokens = 4;
  m.input_dtype = DType::kFp16;
  m.layer_dtypes = std::move(dtypes);
  return m;
}

TransferPlanner Planner(const ModelLayout& m) {
  EXPECT_EQ(ValidateLayout(m), "");
  return TransferPlanner(m, ComputeBlockLayout(m), 1 << 20);
}

TEST(TransferPlannerTest, RangesDefaultToTheWholeModel) {
  const TransferPlanner p = Planner(Gqa({DType::kFp16, DType::kFp16, DType::kFp16}));
  auto plan = p.Plan({}, /*append=*/false);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->layer_begin, 0u);
  EXPECT_EQ(plan->layer_end, 3u);
  EXPECT_EQ(plan->heads.count, 0u);  // every head: the layout is not narrowed
  EXPECT_EQ(plan->head_begin, 0u);
  EXPECT_EQ(plan->head_end, 4u);
  EXPECT_EQ(plan->dtype, DType::kFp16);
  EXPECT_EQ(plan->mode, TransferMode::kPlain);
}

TEST(TransferPlannerTest, RefusesEmptyOrOutsideRanges) {
  const TransferPlanner p = Planner(Gqa({DType::kFp16, DType::kFp16}));
  for (const TransferAsk& bad : {TransferAsk{1, 1, 0, {}, {}}, TransferAsk{0, 3, 0, {}, {}},
                                 TransferAsk{2, {}, 0, {}, {}}}) {
    auto plan = p.Plan(bad, /*append=*/false);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(plan.status().message().find("layer range"), std::string::npos) << plan.status();
  }
  for (const TransferAsk& bad : {TransferAsk{0, {}, 2, 2, {}}, TransferAsk{0, {}, 0, 5, {}},
                                 TransferAsk{0, {}, 4, {}, {}}}) {
    auto plan = p.Ranges(bad);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(plan.status().message().find("kv head range"), std::string::npos) << plan.status();
  }
}

TEST(TransferPlannerTest, HeadRangeNarrowsThePayload) {
  const TransferPlanner p = Planner(Gqa({DType::kFp16, DType::kFp16}));
  auto all = p.Plan({}, false);
  auto half = p.Plan({0, {}, 2, 4, {}}, false);
  ASSERT_TRUE(all.ok() && half.ok());
  EXPECT_EQ(half->heads.begin, 2u);
  EXPECT_EQ(half->heads.count, 2u);
  EXPECT_EQ(half->head_begin, 2u);
  EXPECT_EQ(half->head_end, 4u);
  const TransferSpec whole = p.Make(*all, 0, 8, {0, 1});
  const TransferSpec part = p.Make(*half, 0, 8, {0, 1});
  EXPECT_FALSE(whole.heads.has_value());
  ASSERT_TRUE(part.heads.has_value());
  EXPECT_EQ(part.payload.total_bytes * 2, whole.payload.total_bytes);
  EXPECT_EQ(part.staging_bytes, uint64_t{1} << 20);
  EXPECT_EQ(part.table, (std::vector<int32_t>{0, 1}));
}

TEST(TransferPlannerTest, MlaReadsItsOneLatentHeadWhole) {
  ModelLayout m;
  m.name = "mla";
  m.kind = AttentionKind::kMla;
  m.num_layers = 2;
  m.num_q_heads = 4;
  m.num_kv_heads = 1;
  m.kv_lora_rank = 32;
  m.rope_dim = 8;
  m.head_dim = 40;
  m.head_dim_v = 32;
  m.block_tokens = 4;
  m.layer_dtypes = {DType::kFp16, DType::kFp16};
  const TransferPlanner p = Planner(m);
  // A tensor-parallel rank asks for its share of heads; MLA has one, which every rank reads.
  auto plan = p.Ranges({0, {}, 3, 7, {}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->heads.count, 0u);
  EXPECT_EQ(plan->head_begin, 0u);
  EXPECT_EQ(plan->head_end, 1u);
}

TEST(TransferPlannerTest, FormatFollowsTheStoredDtypes) {
  const TransferPlanner p = Planner(Gqa({DType::kInt8, DType::kInt8, DType::kFp16}));
  // Converted when a layer stores something else than the wire dtype.
  auto fetch = p.Plan({0, {}, 0, {}, DType::kFp32}, /*append=*/false);
  ASSERT_TRUE(fetch.ok()) << fetch.status();
  EXPECT_EQ(fetch->mode, TransferMode::kConvert);
  // The storage format only where every layer of the range stores it.
  auto storage = p.Plan({0, 2, 0, {}, DType::kInt8}, false);
  ASSERT_TRUE(storage.ok()) << storage.status();
  EXPECT_EQ(storage->mode, TransferMode::kStorage);
  auto mixed = p.Plan({0, 3, 0, {}, DType::kInt8}, false);
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mixed.status().message().find("layer 2 stores fp16"), std::string::npos)
      << mixed.status();
  // Appends come in a layer's storage dtype or the model's input dtype (fp16), nothing else.
  auto bf16 = p.Plan({0, 2, 0, {}, DType::kBf16}, /*append=*/true);
  EXPECT_EQ(bf16.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(p.Plan({0, 2, 0, {}, DType::kBf16}, /*append=*/false).ok());
  auto input = p.Plan({0, 3, 0, {}, DType::kFp16}, /*append=*/true);
  ASSERT_TRUE(input.ok()) << input.status();
  EXPECT_EQ(input->mode, TransferMode::kConvert);
  // A plain copy where every layer stores the wire dtype.
  auto plain = p.Plan({2, 3, 0, {}, DType::kFp16}, true);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->mode, TransferMode::kPlain);
}

WaitRange Range(uint64_t tokens, uint32_t l0 = 0, uint32_t l1 = 2) {
  return WaitRange{l0, l1, 0, 4, tokens};
}

TEST(CommitWaitersTest, TakesOnlyWaitersWhoseTokensAreThere) {
  CommitWaiters w("m", 16);
  std::vector<std::string> ran;
  auto a = w.Add(7, Range(4), [&](absl::Status s) { ran.push_back("a " + s.ToString()); });
  auto b = w.Add(7, Range(8), [&](absl::Status s) { ran.push_back("b " + s.ToString()); });
  auto c = w.Add(9, Range(1), [&](absl::Status s) { ran.push_back("c " + s.ToString()); });
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_NE(*a, 0u);
  EXPECT_NE(*a, *b);
  EXPECT_EQ(w.size(), 3u);
  CommitWaiters::Fired fired;
  w.TakeReady(
      7, [](const WaitRange&) { return uint64_t{5}; }, &fired);
  EXPECT_TRUE(ran.empty());  // taken out, not run: the caller fires them outside its locks
  ASSERT_EQ(fired.size(), 1u);
  CommitWaiters::Fire(std::move(fired));
  EXPECT_EQ(ran, (std::vector<std::string>{"a OK"}));
  EXPECT_EQ(w.size(), 2u);
  EXPECT_FALSE(w.Cancel(*a));  // already taken
  EXPECT_TRUE(w.Cancel(*b));   // still waiting: never runs
  EXPECT_FALSE(w.Cancel(*b));
  EXPECT_EQ(w.Sequences(), (std::vector<uint64_t>{9}));
  fired.clear();
  w.TakeAll(9, absl::FailedPreconditionError("gone"), &fired);
  CommitWaiters::Fire(std::move(fired));
  EXPECT_EQ(ran.back(), "c FAILED_PRECONDITION: gone");
  EXPECT_EQ(w.size(), 0u);
  EXPECT_TRUE(w.Sequences().empty());
}

TEST(CommitWaitersTest, AvailabilityIsAskedPerRange) {
  CommitWaiters w("m", 16);
  int ran = 0;
  ASSERT_TRUE(w.Add(1, Range(4, 0, 1), [&](absl::Status) { ++ran; }).ok());
  ASSERT_TRUE(w.Add(1, Range(4, 1, 2), [&](absl::Status) { ++ran; }).ok());
  CommitWaiters::Fired fired;
  // Layer 0 holds 4 tokens, layer 1 holds 2: only the first waiter is done.
  w.TakeReady(
      1, [](const WaitRange& r) { return r.layer_begin == 0 ? uint64_t{4} : uint64_t{2}; }, &fired);
  CommitWaiters::Fire(std::move(fired));
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(w.size(), 1u);
}

TEST(CommitWaitersTest, CapsWaitersAndFreesRoomWhenTaken) {
  CommitWaiters w("llama", 2);
  ASSERT_TRUE(w.Add(1, Range(1), [](absl::Status) {}).ok());
  auto second = w.Add(2, Range(1), [](absl::Status) {});
  ASSERT_TRUE(second.ok());
  auto third = w.Add(3, Range(1), [](absl::Status) {});
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("model 'llama' has 2 fetches waiting"), std::string::npos)
      << third.status();
  ASSERT_TRUE(w.Cancel(*second));
  EXPECT_TRUE(w.Add(3, Range(1), [](absl::Status) {}).ok());
}

TEST(CommitWaitersTest, ConcurrentAddsCancelsAndTakes) {
  CommitWaiters w("m", 1 << 20);
  std::atomic<int> ran{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        auto id = w.Add(t, Range(1), [&](absl::Status) { ran.fetch_add(1); });
        ASSERT_TRUE(id.ok());
        if (i % 2 == 0) {
          w.Cancel(*id);
        } else {
          CommitWaiters::Fired fired;
          w.TakeReady(
              t, [](const WaitRange&) { return uint64_t{1}; }, &fired);
          CommitWaiters::Fire(std::move(fired));
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ran.load(), 4 * 250);
  EXPECT_EQ(w.size(), 0u);
}

TEST(StoreTenantsTest, CountsPerTenantAndTotalsAreTheirSum) {
  StoreTenants t("m", /*pool=*/nullptr);
  t.SequenceAdded("a");
  t.SequenceAdded("a");
  t.SequenceAdded("b");
  t.TokensChanged("a", 0, 10);
  t.TokensChanged("b", 0, 3);
  t.TokensChanged("a", 10, 7);
  t.Appended("a", 100, /*prefix_copy=*/false);
  t.PrefixCopyCreated("b");
  t.Appended("b", 30, /*prefix_copy=*/true);
  t.Fetched("b", 40);
  t.Fetched("b", 2);
  t.PrefixLookedUp("a", 32, 16);
  t.SequenceRemoved("a", /*lease_expired=*/true);
  const TenantStats a = t.Row("a");
  EXPECT_EQ(a.tenant, "a");
  EXPECT_EQ(a.sequences, 1u);
  EXPECT_EQ(a.tokens_stored, 7u);
  EXPECT_EQ(a.appends, 1u);
  EXPECT_EQ(a.bytes_appended, 100u);
  EXPECT_EQ(a.leases_expired, 1u);
  EXPECT_EQ(a.prefix_query_tokens, 32u);
  EXPECT_EQ(a.prefix_hit_tokens, 16u);
  EXPECT_EQ(a.fetches, 0u);           // b's fetches are b's
  EXPECT_EQ(a.prefix_copies_in, 0u);  // b's copy is b's
  EXPECT_EQ(a.prefix_copy_bytes_in, 0u);
  const TenantStats b = t.Row("b");
  EXPECT_EQ(b.prefix_copies_in, 1u);
  EXPECT_EQ(b.prefix_copy_bytes_in, 30u);
  EXPECT_EQ(b.bytes_appended, 30u) << "copied bytes are appended bytes";
  const Activity all = t.Totals();
  EXPECT_EQ(all.sequences, 2u);
  EXPECT_EQ(all.tokens_stored, 10u);
  EXPECT_EQ(all.fetches, 2u);
  EXPECT_EQ(all.bytes_fetched, 42u);
  EXPECT_EQ(all.leases_expired, 1u);
  EXPECT_EQ(all.appends, 2u);
  EXPECT_EQ(all.bytes_appended, 130u);
  EXPECT_EQ(all.prefix_copies_in, 1u);
  EXPECT_EQ(all.prefix_copy_bytes_in, 30u);
  const std::vector<TenantStats> rows = t.Rows();
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].tenant, "a");  // by name
  EXPECT_EQ(rows[1].tenant, "b");
  EXPECT_EQ(t.Row("never").sequences, 0u);
}

TEST(StoreTenantsTest, AdmitsUpToTheTenantsLimit) {
  StoreTenants t("m", nullptr);
  EXPECT_TRUE(t.Admit("a").ok());
  t.SetLimits("a", TenantLimits{0, 2});
  t.SequenceAdded("a");
  EXPECT_TRUE(t.Admit("a").ok());
  t.SequenceAdded("a");
  const absl::Status full = t.Admit("a");
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("tenant 'a' has its limit of 2 live sequences in model 'm'"),
            std::string::npos)
      << full;
  EXPECT_TRUE(t.Admit("b").ok());  // another tenant's limit is its own
  EXPECT_EQ(t.Row("a").max_sequences, 2u);
  t.SequenceRemoved("a", false);
  EXPECT_TRUE(t.Admit("a").ok());
  t.SetLimits("a", TenantLimits{0, 0});  // 0: no limit of its own
  t.SequenceAdded("a");
  t.SequenceAdded("a");
  EXPECT_TRUE(t.Admit("a").ok());
}

TEST(StoreTenantsTest, CheckCountsFindsADrift) {
  StoreTenants t("m", nullptr);
  t.SequenceAdded("a");
  t.TokensChanged("a", 0, 5);
  EXPECT_EQ(t.CheckCounts({{"a", {1, 5}}}), "");
  EXPECT_NE(t.CheckCounts({{"a", {1, 6}}}), "");
  EXPECT_NE(t.CheckCounts({{"a", {1, 5}}, {"b", {1, 1}}}), "");
  EXPECT_NE(t.CheckCounts({}), "");
}

}  // namespace
}  // namespace kvbank
