// Appends of some KV heads only (what each tensor-parallel rank of a prefill engine pushes): the
// ranks' appends of one sequence are in flight at once, and the sequence they leave is byte for
// byte the one a single all-heads append of the same values leaves, for every storage dtype. A
// token counts in the length (and its block is published) once every head holds it; a rank's
// heads can be read as soon as that rank committed them. Overlapping ranges are refused; an
// aborted rank leaves the others' heads ahead, which Truncate evens; Fork takes what every head
// holds. A fetch's waiter (layer-wise handoff) wakes on the commit that completes its range.
// Seeds are fixed.
#include <atomic>
#include <cstring>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/core/sequence_store.h"
#include "tests/unit/store_testing.h"
#include "tests/unit/test_memory.h"

namespace kvbank {
namespace {

using store_testing::RandomFp32;

constexpr uint32_t kLayers = 3, kHeads = 4;

ModelLayout Layout(DType storage) {
  return store_testing::GqaLayout("tp-prefill", kLayers, kHeads, 16, 4, storage, DType::kFp32);
}

class HeadAppendTest : public testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    m_ = Layout(GetParam());
    b_ = ComputeBlockLayout(m_);
  }

  std::unique_ptr<SequenceStore> NewStore() {
    StoreOptions o;
    o.default_lease = absl::ZeroDuration();
    auto store = testenv::CreateTestStore(m_, 256, o);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? *std::move(store) : nullptr;
  }

  static uint64_t NewSequence(SequenceStore& store) {
    auto s = store.Create(CreateOptions{});
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->id : 0;
  }

  // Heads [h0, h1) of an fp32 payload of every head (n tokens, all layers).
  std::vector<uint8_t> Slice(const std::vector<uint8_t>& full, uint64_t n, uint32_t h0,
                             uint32_t h1) const {
    const PayloadLayout pf = PayloadLayout::Make(b_, 0, kLayers, n, DType::kFp32);
    const BlockLayout nb = b_.Heads(h0, h1 - h0);
    const PayloadLayout pp = PayloadLayout::Make(nb, 0, kLayers, n, DType::kFp32);
    std::vector<uint8_t> out(pp.total_bytes);
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t kv = 0; kv < 2; ++kv) {
        const uint64_t row = pf.RowBytes(b_, l, kv);
        for (uint32_t h = h0; h < h1; ++h) {
          for (uint64_t t = 0; t < n; ++t) {
            std::memcpy(out.data() + pp.RowOffset(nb, l, kv, h - h0, t),
                        full.data() + pf.RowOffset(b_, l, kv, h, t), row);
          }
        }
      }
    }
    return out;
  }

  static AppendSpec Spec(uint64_t id, uint64_t n, uint32_t h0, std::optional<uint32_t> h1,
                         std::vector<uint32_t> ids = {}) {
    AppendSpec a;
    a.sequence_id = id;
    a.num_tokens = n;
    a.dtype = DType::kFp32;
    a.kv_head_begin = h0;
    a.kv_head_end = h1;
    a.token_ids = std::move(ids);
    return a;
  }

  // Every token and head of a sequence, as stored (the storage format for int8 / fp8).
  static absl::StatusOr<std::vector<uint8_t>> Stored(SequenceStore& store, uint64_t id,
                                                     std::optional<uint64_t> t1 = {},
                                                     uint32_t h0 = 0,
                                                     std::optional<uint32_t> h1 = {}) {
    FetchSpec f;
    f.sequence_id = id;
    f.token_end = t1;
    f.kv_head_begin = h0;
    f.kv_head_end = h1;
    return store_testing::FetchToHost(store, f);
  }

  // Writes `payload` in chunks of `chunk` bytes, alternating between the transactions.
  static void Interleave(std::vector<AppendTxn*> txns,
                         std::vector<const std::vector<uint8_t>*> payloads, size_t chunk) {
    std::vector<size_t> at(txns.size(), 0);
    for (bool more = true; more;) {
      more = false;
      for (size_t i = 0; i < txns.size(); ++i) {
        const std::vector<uint8_t>& p = *payloads[i];
        if (at[i] >= p.size()) continue;
        const size_t len = std::min(chunk, p.size() - at[i]);
        ASSERT_TRUE(txns[i]->Write(absl::MakeConstSpan(p.data() + at[i], len)).ok());
        at[i] += len;
        more = true;
      }
    }
  }

  ModelLayout m_;
  BlockLayout b_;
};

// Two ranks (heads [0, 2) and [2, 4)) push each append at once; the result equals one store fed
// the same values by all-heads appends, as stored and dequantized.
TEST_P(HeadAppendTest, TwoRanksInFlightAtOnceStoreWhatOneAllHeadsAppendStores) {
  auto ref = NewStore();
  auto tp = NewStore();
  const uint64_t rid = NewSequence(*ref), id = NewSequence(*tp);
  const bool fp8 = GetParam() == DType::kFp8E4M3;
  uint64_t len = 0;
  uint32_t seed = 11, next_id = 500;
  for (uint64_t n : {9, 1, 2, 4, 7}) {
    SCOPED_TRACE(absl::StrCat("append of ", n, " at ", len));
    const auto full =
        RandomFp32(PayloadLayout::Make(b_, 0, kLayers, n, DType::kFp32).total_bytes, seed++);
    std::vector<uint32_t> ids;
    for (uint64_t i = 0; i < n; ++i) ids.push_back(next_id++);
    ASSERT_TRUE(ref->Append(Spec(rid, n, 0, std::nullopt, ids), full).ok());

    const auto p0 = Slice(full, n, 0, 2), p1 = Slice(full, n, 2, 4);
    auto r0 = tp->BeginAppend(Spec(id, n, 0, 2, ids));
    ASSERT_TRUE(r0.ok()) << r0.status();
    // An fp8 append that continues a block may rescale stored rows: it runs alone.
    if (fp8 && len % m_.block_tokens != 0) {
      auto refused = tp->BeginAppend(Spec(id, n, 2, std::nullopt, ids));
      ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_TRUE(absl::StrContains(refused.status().message(), "runs alone")) << refused.status();
      ASSERT_TRUE((*r0)->Write(p0).ok());
      ASSERT_TRUE((*r0)->Commit().ok());
      auto r1 = tp->Append(Spec(id, n, 2, std::nullopt, ids), p1);
      ASSERT_TRUE(r1.ok()) << r1.status();
      EXPECT_EQ(r1->length, len + n);
      len += n;
      continue;
    }
    auto r1 = tp->BeginAppend(Spec(id, n, 2, std::nullopt, ids));
    ASSERT_TRUE(r1.ok()) << r1.status();
    ASSERT_NO_FATAL_FAILURE(Interleave({r0->get(), r1->get()}, {&p0, &p1}, 100));
    // Rank 1 commits first: its heads hold the new tokens, the sequence does not yet.
    auto c1 = (*r1)->Commit();
    ASSERT_TRUE(c1.ok()) << c1.status();
    EXPECT_EQ(c1->length, len);
    auto mine = Stored(*tp, id, len + n, 2, 4);
    ASSERT_TRUE(mine.ok()) << "rank 1 reads the heads it committed: " << mine.status();
    auto all = Stored(*tp, id, len + n);
    EXPECT_EQ(all.status().code(), absl::StatusCode::kOutOfRange) << "heads 0 and 1 lag";
    EXPECT_EQ(tp->CheckInvariants(), "");
    auto c0 = (*r0)->Commit();
    ASSERT_TRUE(c0.ok()) << c0.status();
    EXPECT_EQ(c0->length, len + n);
    len += n;
  }
  EXPECT_EQ(tp->CheckInvariants(), "");
  auto want = Stored(*ref, rid);
  auto got = Stored(*tp, id);
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_EQ(*got, *want) << "stored bytes differ from the all-heads appends'";
  // The same blocks were published: the prompt matches as far in both.
  std::vector<uint32_t> prompt;
  for (uint32_t t = 0; t < len; ++t) prompt.push_back(500 + t);
  MatchQuery q;
  q.tokens = prompt;
  EXPECT_EQ(tp->prefix().Match("", {q}), ref->prefix().Match("", {q}));
  EXPECT_EQ(tp->prefix().Match("", {q})[0], len / m_.block_tokens * m_.block_tokens);
}

TEST_P(HeadAppendTest, OverlapsAndUnequalLengthsAreRefusedDisjointRegionsRunTogether) {
  auto store = NewStore();
  const uint64_t id = NewSequence(*store);
  auto a = store->BeginAppend(Spec(id, 6, 0, 2));
  ASSERT_TRUE(a.ok()) << a.status();
  for (auto [h0, h1] : std::vector<std::pair<uint32_t, std::optional<uint32_t>>>{
           {1, 3}, {0, std::nullopt}, {0, 1}}) {
    auto b = store->BeginAppend(Spec(id, 6, h0, h1));
    ASSERT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
    EXPECT_TRUE(absl::StrContains(b.status().message(),
                                  "append in flight over layers [0, 3) kv "
                                  "heads [0, 2)"))
        << b.status();
  }
  // Heads [2, 4) in two layer ranges: disjoint from everything in flight.
  AppendSpec low = Spec(id, 6, 2, 4), high = Spec(id, 6, 2, 4);
  low.layer_end = 1;
  high.layer_begin = 1;
  auto c = store->BeginAppend(low);
  ASSERT_TRUE(c.ok()) << c.status();
  auto d = store->BeginAppend(high);
  ASSERT_TRUE(d.ok()) << d.status();
  for (auto* txn : {a->get(), c->get(), d->get()}) {
    ASSERT_TRUE(txn->Write(RandomFp32(txn->payload_bytes(), 3)).ok());
  }
  ASSERT_TRUE((*d)->Commit().ok());
  ASSERT_TRUE((*a)->Commit().ok());
  auto last = (*c)->Commit();
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->length, 6u);

  // Heads now differ: an append over heads at different lengths is refused, naming both.
  std::vector<uint8_t> three =
      RandomFp32(PayloadLayout::Make(b_.Heads(0, 2), 0, kLayers, 3, DType::kFp32).total_bytes, 4);
  ASSERT_TRUE(store->Append(Spec(id, 3, 0, 2), three).ok());
  auto uneven = store->BeginAppend(Spec(id, 3, 0, std::nullopt));
  ASSERT_EQ(uneven.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(uneven.status().message(), "kv head 2 holds 6")) << uneven.status();
  for (auto [h0, h1] : std::vector<std::pair<uint32_t, std::optional<uint32_t>>>{
           {2, 2}, {3, 9}, {4, std::nullopt}}) {
    auto bad = store->BeginAppend(Spec(id, 3, h0, h1));
    ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(bad.status().message(), "kv head range")) << bad.status();
  }
  auto info = store->Get(id, "");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->length, 6u) << "refused appends change nothing";
  EXPECT_EQ(store->CheckInvariants(), "");
}

TEST_P(HeadAppendTest, AnAbortedRankLeavesTheOthersAheadForkTakesWhatAllHoldTruncateEvens) {
  auto store = NewStore();
  const uint64_t id = NewSequence(*store);
  const auto full = RandomFp32(PayloadLayout::Make(b_, 0, kLayers, 8, DType::kFp32).total_bytes, 5);
  ASSERT_TRUE(store->Append(Spec(id, 8, 0, std::nullopt), full).ok());
  const uint64_t used0 = store->pool().Stats().used;
  const auto more = RandomFp32(PayloadLayout::Make(b_, 0, kLayers, 4, DType::kFp32).total_bytes, 6);
  const auto p0 = Slice(more, 4, 0, 2), p1 = Slice(more, 4, 2, 4);
  {
    auto r0 = store->BeginAppend(Spec(id, 4, 0, 2));
    auto r1 = store->BeginAppend(Spec(id, 4, 2, 4));
    ASSERT_TRUE(r0.ok() && r1.ok());
    ASSERT_NO_FATAL_FAILURE(Interleave({r0->get(), r1->get()}, {&p0, &p1}, 64));
    ASSERT_TRUE((*r0)->Commit().ok());
    // Rank 1 goes away before its commit: its heads stay at 8 tokens.
  }
  auto info = store->Get(id, "");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->length, 8u);
  EXPECT_EQ(store->CheckInvariants(), "");
  EXPECT_EQ(store->pool().Stats().used, used0 + 1) << "rank 0's tokens 8..11 keep one more block";
  auto ahead = Stored(*store, id, 12, 0, 2);
  ASSERT_TRUE(ahead.ok()) << ahead.status();

  // A fork takes the 8 tokens every head holds.
  auto child = store->Fork(id, std::nullopt);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(child->length, 8u);
  auto parent8 = Stored(*store, id, 8);
  auto child8 = Stored(*store, child->id);
  ASSERT_TRUE(parent8.ok() && child8.ok());
  EXPECT_EQ(*child8, *parent8);
  EXPECT_EQ(store->CheckInvariants(), "");

  // Rank 1 retries and the sequence is whole again.
  auto retried = store->Append(Spec(id, 4, 2, std::nullopt), p1);
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(retried->length, 12u);

  // Rank 0 runs ahead once more; a truncate to the common length evens the heads.
  ASSERT_TRUE(store->Append(Spec(id, 4, 0, 2), p0).ok());
  auto cut = store->Truncate(id, 12, "");
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(store->CheckInvariants(), "");
  ASSERT_TRUE(store->Append(Spec(id, 4, 0, std::nullopt), more).ok())
      << "after the truncate every head is at 12 again";

  // Freed with both ranks in flight: each commit says so, every block goes back.
  auto r0 = store->BeginAppend(Spec(id, 4, 0, 2));
  auto r1 = store->BeginAppend(Spec(id, 4, 2, 4));
  ASSERT_TRUE(r0.ok() && r1.ok());
  ASSERT_TRUE((*r0)->Write(p0).ok());
  ASSERT_TRUE((*r1)->Write(p1).ok());
  ASSERT_TRUE(store->Free(id, "").ok());
  ASSERT_TRUE(store->Free(child->id, "").ok());
  EXPECT_EQ((*r0)->Commit().status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ((*r1)->Commit().status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(store->pool().Stats().used, 0u);
  EXPECT_EQ(store->CheckInvariants(), "");
}

// A prefill streaming layer by layer while a decode reads the layers already there: the next
// layer goes in place into the blocks the reader holds (no block copied), and the reader's bytes
// stay as they were. After a truncate, the cut block is copied before a write under a reader.
TEST_P(HeadAppendTest, ALayerGoesInPlaceBesideAReaderOfAnother) {
  auto store = NewStore();
  const uint64_t id = NewSequence(*store);
  const auto layer = [&](uint32_t l, uint64_t n, uint32_t seed) {
    AppendSpec a = Spec(id, n, 0, std::nullopt);
    a.layer_begin = l;
    a.layer_end = l + 1;
    return store->Append(
        a, RandomFp32(PayloadLayout::Make(b_, l, l + 1, n, DType::kFp32).total_bytes, seed));
  };
  ASSERT_TRUE(layer(0, 14, 1).ok());
  FetchSpec f;
  f.sequence_id = id;
  f.layer_end = 1;
  auto reader = store->BeginFetch(f);
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::vector<uint8_t> before((*reader)->payload_bytes()), after(before.size());
  ASSERT_TRUE((*reader)->Read(0, absl::MakeSpan(before)).ok());
  const uint64_t used = store->pool().Stats().used;
  ASSERT_TRUE(layer(1, 14, 2).ok());
  ASSERT_TRUE(layer(2, 14, 3).ok());
  EXPECT_EQ(store->pool().Stats().used, used) << "blocks were copied for rows no reader reads";
  ASSERT_TRUE((*reader)->Read(0, absl::MakeSpan(after)).ok());
  EXPECT_EQ(after, before);

  // Truncate to 10 under the reader (which holds tokens 10..13 of block 2), then append: block 2
  // is copied, and the reader still reads what it read.
  ASSERT_TRUE(store->Truncate(id, 10, "").ok());
  ASSERT_TRUE(
      store
          ->Append(Spec(id, 4, 0, std::nullopt),
                   RandomFp32(PayloadLayout::Make(b_, 0, kLayers, 4, DType::kFp32).total_bytes, 4))
          .ok());
  // Block 3 stays the reader's; tokens 12..13 go into a new one, and block 2 is copied.
  EXPECT_EQ(store->pool().Stats().used, used + 2) << "the cut block is copied";
  ASSERT_TRUE((*reader)->Read(0, absl::MakeSpan(after)).ok());
  EXPECT_EQ(after, before);
  reader->reset();
  EXPECT_EQ(store->CheckInvariants(), "");
}

// Layer-wise handoff: a waiter for layer 1's first 8 tokens of heads [2, 4) wakes on the commit
// that completes them, not before (not on another layer's, another head range's, nor a shorter
// one); one already satisfied answers 0; a freed sequence wakes its waiters with
// FAILED_PRECONDITION; a cancelled waiter never runs; bad requests are refused.
TEST_P(HeadAppendTest, WhenCommittedWakesOnTheCommitThatCompletesTheRange) {
  auto store = NewStore();
  const uint64_t id = NewSequence(*store);
  FetchSpec want;
  want.sequence_id = id;
  want.layer_begin = 1;
  want.layer_end = 2;
  want.kv_head_begin = 2;
  want.token_end = 8;
  std::vector<absl::Status> woken;
  auto waiter = store->WhenCommitted(want, [&](absl::Status s) { woken.push_back(s); });
  ASSERT_TRUE(waiter.ok()) << waiter.status();
  ASSERT_NE(*waiter, 0u);
  const auto append = [&](uint32_t l0, uint32_t l1, uint32_t h0, uint32_t h1, uint64_t n) {
    AppendSpec a = Spec(id, n, h0, h1);
    a.layer_begin = l0;
    a.layer_end = l1;
    const BlockLayout nb = b_.Heads(h0, h1 - h0);
    auto done = store->Append(
        a, RandomFp32(PayloadLayout::Make(nb, l0, l1, n, DType::kFp32).total_bytes, 8));
    ASSERT_TRUE(done.ok()) << done.status();
  };
  append(0, 1, 0, 4, 8);  // another layer
  append(1, 2, 0, 2, 8);  // other heads of the layer
  append(1, 2, 2, 4, 4);  // the heads, but 4 tokens of 8
  EXPECT_TRUE(woken.empty());
  append(1, 2, 2, 4, 4);
  ASSERT_EQ(woken.size(), 1u);
  EXPECT_TRUE(woken[0].ok()) << woken[0];
  auto again = store->WhenCommitted(want, [&](absl::Status s) { woken.push_back(s); });
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 0u) << "committed already: no waiter";
  EXPECT_FALSE(store->CancelWait(*waiter)) << "it ran";

  want.token_end = 12;
  auto cancelled = store->WhenCommitted(want, [&](absl::Status s) { woken.push_back(s); });
  auto freed = store->WhenCommitted(want, [&](absl::Status s) { woken.push_back(s); });
  ASSERT_TRUE(cancelled.ok() && freed.ok());
  EXPECT_TRUE(store->CancelWait(*cancelled));
  ASSERT_TRUE(store->Free(id, "").ok());
  ASSERT_EQ(woken.size(), 2u);
  EXPECT_EQ(woken[1].code(), absl::StatusCode::kFailedPrecondition) << woken[1];
  EXPECT_TRUE(absl::StrContains(woken[1].message(), "freed")) << woken[1];

  const uint64_t other = NewSequence(*store);
  FetchSpec bad;
  bad.sequence_id = other;
  EXPECT_EQ(store->WhenCommitted(bad, [](absl::Status) {}).status().code(),
            absl::StatusCode::kInvalidArgument)
      << "no token_end";
  bad.token_end = 4;
  bad.kv_head_begin = 5;
  EXPECT_EQ(store->WhenCommitted(bad, [](absl::Status) {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad.kv_head_begin = 0;
  bad.sequence_id = other + 100;
  EXPECT_EQ(store->WhenCommitted(bad, [](absl::Status) {}).status().code(),
            absl::StatusCode::kNotFound);
}

// An append knows whether its sequence is handed off layer by layer (the RPC layer then keeps its
// bytes in the caches for the reader): not before any fetch waited on it, not for another
// sequence's wait; yes once a fetch waited, and still after that fetch has woken (a reader that
// falls behind no longer waits). A fetch that asks with a wait for committed tokens counts too.
TEST_P(HeadAppendTest, AnAppendKnowsWhetherItsSequenceIsHandedOff) {
  auto store = NewStore();
  const uint64_t id = NewSequence(*store), other = NewSequence(*store);
  const uint64_t bytes = PayloadLayout::Make(b_, 0, kLayers, 4, DType::kFp32).total_bytes;
  auto begin = [&](uint64_t seq) {
    auto txn = store->BeginAppend(Spec(seq, 4, 0, std::nullopt));
    EXPECT_TRUE(txn.ok()) << txn.status();
    return *std::move(txn);
  };
  auto commit = [&](std::unique_ptr<AppendTxn> txn) {
    ASSERT_TRUE(txn->Write(RandomFp32(bytes, 4)).ok());
    ASSERT_TRUE(txn->Commit().ok());
  };
  EXPECT_FALSE(begin(id)->awaited()) << "no fetch waited";
  FetchSpec want;
  want.sequence_id = other;
  want.token_end = 4;
  std::vector<absl::Status> woken;
  auto waiter = store->WhenCommitted(want, [&](absl::Status s) { woken.push_back(s); });
  ASSERT_TRUE(waiter.ok() && *waiter != 0) << waiter.status();
  EXPECT_FALSE(begin(id)->awaited()) << "a fetch waits for another sequence";
  want.sequence_id = id;
  waiter = store->WhenCommitted(want, [&](absl::Status s) { woken.push_back(s); });
  ASSERT_TRUE(waiter.ok() && *waiter != 0) << waiter.status();
  std::unique_ptr<AppendTxn> txn = begin(id);
  EXPECT_TRUE(txn->awaited()) << "a fetch waits for these tokens";
  commit(std::move(txn));
  ASSERT_EQ(woken.size(), 1u);
  EXPECT_TRUE(begin(id)->awaited()) << "the fetch has woken; the handoff goes on";

  // `other` holds the 4 tokens once its append commits; a wait for them answers at once.
  ASSERT_NO_FATAL_FAILURE(commit(begin(other)));
  ASSERT_EQ(woken.size(), 2u);
  const uint64_t third = NewSequence(*store);
  ASSERT_NO_FATAL_FAILURE(commit(begin(third)));
  want.sequence_id = third;
  auto answered = store->WhenCommitted(want, [&](absl::Status s) { woken.push_back(s); });
  ASSERT_TRUE(answered.ok() && *answered == 0) << answered.status();
  EXPECT_TRUE(begin(third)->awaited()) << "a fetch asked with a wait";
}

INSTANTIATE_TEST_SUITE_P(Storage, HeadAppendTest,
                         testing::Values(DType::kFp16, DType::kBf16, DType::kInt8, DType::kFp8E4M3),
                         [](const testing::TestParamInfo<DType>& i) {
                           return std::string(DTypeName(i.param));
                         });

// Four ranks, one head each, append at their own pace from their own threads (a rank may run
// ahead of the others by several appends) while another thread forks and reads; the sequence
// ends equal to one all-heads append of the same values. Meant for the ThreadSanitizer build too.
TEST(HeadAppendThreadsTest, RanksAtTheirOwnPaceWithForksAlongside) {
  for (DType storage : {DType::kFp16, DType::kInt8}) {
    SCOPED_TRACE(DTypeName(storage));
    const ModelLayout m = Layout(storage);
    const BlockLayout b = ComputeBlockLayout(m);
    auto make = [&]() -> std::unique_ptr<SequenceStore> {
      StoreOptions o;
      o.default_lease = absl::ZeroDuration();
      auto store = testenv::CreateTestStore(m, 512, o);
      EXPECT_TRUE(store.ok());
      return store.ok() ? *std::move(store) : nullptr;
    };
    auto ref = make();
    auto tp = make();
    constexpr uint64_t kTokens = 120;
    const auto full =
        RandomFp32(PayloadLayout::Make(b, 0, kLayers, kTokens, DType::kFp32).total_bytes, 9);
    auto rseq = ref->Create(CreateOptions{});
    auto seq = tp->Create(CreateOptions{});
    ASSERT_TRUE(rseq.ok() && seq.ok());
    AppendSpec all;
    all.sequence_id = rseq->id;
    all.num_tokens = kTokens;
    all.dtype = DType::kFp32;
    ASSERT_TRUE(ref->Append(all, full).ok());

    const PayloadLayout pf = PayloadLayout::Make(b, 0, kLayers, kTokens, DType::kFp32);
    std::atomic<int> failures{0}, ranks_done{0};
    std::vector<std::thread> threads;
    for (uint32_t h = 0; h < kHeads; ++h) {
      threads.emplace_back([&, h] {
        std::mt19937 rng(100 + h);
        const BlockLayout nb = b.Heads(h, 1);
        for (uint64_t at = 0; at < kTokens;) {
          const uint64_t n = std::min<uint64_t>(kTokens - at, 1 + rng() % 9);
          const PayloadLayout pp = PayloadLayout::Make(nb, 0, kLayers, n, DType::kFp32);
          std::vector<uint8_t> part(pp.total_bytes);
          for (uint32_t l = 0; l < kLayers; ++l) {
            for (uint32_t kv = 0; kv < 2; ++kv) {
              for (uint64_t t = 0; t < n; ++t) {
                std::memcpy(part.data() + pp.RowOffset(nb, l, kv, 0, t),
                            full.data() + pf.RowOffset(b, l, kv, h, at + t), pf.RowBytes(b, l, kv));
              }
            }
          }
          AppendSpec a;
          a.sequence_id = seq->id;
          a.num_tokens = n;
          a.dtype = DType::kFp32;
          a.kv_head_begin = h;
          a.kv_head_end = h + 1;
          auto done = tp->Append(a, part);
          if (!done.ok()) {
            ++failures;
            break;
          }
          at += n;
        }
        ++ranks_done;
      });
    }
    std::vector<uint64_t> children;
    threads.emplace_back([&] {
      while (ranks_done.load() < int(kHeads)) {
        auto child = tp->Fork(seq->id, std::nullopt);
        if (!child.ok()) {
          ++failures;
          return;
        }
        children.push_back(child->id);
        FetchSpec f;
        f.sequence_id = child->id;
        auto r = tp->BeginFetch(f);
        if (!r.ok()) {
          ++failures;
          return;
        }
        std::vector<uint8_t> out((*r)->payload_bytes());
        if (!(*r)->Read(0, absl::MakeSpan(out)).ok()) ++failures;
        if (children.size() > 40) {
          if (!tp->Free(children.front(), "").ok()) ++failures;
          children.erase(children.begin());
        }
      }
    });
    for (std::thread& t : threads) t.join();
    ASSERT_EQ(failures.load(), 0);
    auto info = tp->Get(seq->id, "");
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->length, kTokens);
    EXPECT_EQ(tp->CheckInvariants(), "");
    FetchSpec f;
    f.sequence_id = seq->id;
    auto got = tp->BeginFetch(f);
    f.sequence_id = rseq->id;
    auto want = ref->BeginFetch(f);
    ASSERT_TRUE(got.ok() && want.ok());
    std::vector<uint8_t> g((*got)->payload_bytes()), w((*want)->payload_bytes());
    ASSERT_TRUE((*got)->Read(0, absl::MakeSpan(g)).ok());
    ASSERT_TRUE((*want)->Read(0, absl::MakeSpan(w)).ok());
    EXPECT_EQ(g, w);
    // Every fork holds a prefix of the same values.
    for (uint64_t c : children) {
      FetchSpec cf;
      cf.sequence_id = c;
      auto r = tp->BeginFetch(cf);
      ASSERT_TRUE(r.ok());
      const uint64_t n = (*r)->num_tokens();
      if (n == 0) continue;
      std::vector<uint8_t> cb((*r)->payload_bytes());
      ASSERT_TRUE((*r)->Read(0, absl::MakeSpan(cb)).ok());
      FetchSpec pfs;
      pfs.sequence_id = seq->id;
      pfs.token_end = n;
      auto pr = tp->BeginFetch(pfs);
      ASSERT_TRUE(pr.ok());
      std::vector<uint8_t> pb((*pr)->payload_bytes());
      ASSERT_TRUE((*pr)->Read(0, absl::MakeSpan(pb)).ok());
      EXPECT_EQ(cb, pb) << "fork of " << n << " tokens";
    }
  }
}

}  // namespace
}  // namespace kvbank
