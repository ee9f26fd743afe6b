// Model-based test of SequenceStore: thousands of random operations, each checked against a
// simple reference model (per sequence, per layer: the K and V rows; per block: who shares it).
// Every outcome, the pool accounting and, periodically, every byte must agree with the model.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kvbank/layout.h"
#include "server/core/sequence_store.h"
#include "tests/unit/store_testing.h"
#include "tests/unit/test_memory.h"

namespace kvbank {
namespace {

using absl::StatusCode;
using store_testing::MakeAppend;
using store_testing::MakeFetch;

constexpr uint64_t kSeed = 0x6b76626e6b;  // "kvbnk"
constexpr int kSteps = 5000;
constexpr uint32_t kLayers = 3, kHeads = 2, kHeadDim = 5, kBlockTokens = 3;
constexpr uint64_t kRow = kHeads * kHeadDim * 2;  // fp16 bytes of one token, one layer, K or V
constexpr uint64_t kPoolBlocks = 200, kMaxSequences = 40, kMaxTokens = 45;

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

struct ModelSeq {
  // Per layer, [token][head][dim].
  std::vector<std::vector<uint8_t>> k = std::vector<std::vector<uint8_t>>(kLayers);
  std::vector<std::vector<uint8_t>> v = std::vector<std::vector<uint8_t>>(kLayers);
  std::vector<int> table;  // logical block -> abstract block id (shared ids = shared blocks)
  uint64_t Len(uint32_t l) const { return k[l].size() / kRow; }
  uint64_t MinLen() const { return std::min({Len(0), Len(1), Len(2)}); }
  uint64_t MaxLen() const { return std::max({Len(0), Len(1), Len(2)}); }
};

class ModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const ModelLayout m = store_testing::GqaLayout("model-test", kLayers, kHeads, kHeadDim,
                                                   kBlockTokens, DType::kFp16);
    ASSERT_EQ(ValidateLayout(m), "");
    StoreOptions opt;
    opt.max_sequences = kMaxSequences;
    opt.max_tokens_per_sequence = kMaxTokens;
    auto store = testenv::CreateTestStore(m, kPoolBlocks, opt);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }

  int NewBlock() {
    refs_[next_block_] = 1;
    return next_block_++;
  }
  void Drop(int id) {
    if (--refs_[id] == 0) refs_.erase(id);
  }
  uint64_t FreeBlocks() { return store_->Stats().pool.free; }
  // Picks by creation order, not by id: ids are random, the run must not depend on them.
  uint64_t PickLive() { return live_order_[rng_() % live_order_.size()]; }
  void AddLive(uint64_t id, ModelSeq s) {
    live_[id] = std::move(s);
    live_order_.push_back(id);
  }

  // Dense payload of layers [l0, l1) x tokens [t0, t1) of `s`.
  static std::vector<uint8_t> Payload(const ModelSeq& s, uint32_t l0, uint32_t l1, uint64_t t0,
                                      uint64_t t1) {
    std::vector<uint8_t> out;
    const uint64_t row = kRow / kHeads;
    for (uint32_t l = l0; l < l1; ++l) {
      for (const auto* rows : {&s.k[l], &s.v[l]}) {
        for (uint32_t h = 0; h < kHeads; ++h) {
          for (uint64_t t = t0; t < t1; ++t) {
            const uint8_t* at = rows->data() + (t * kHeads + h) * row;
            out.insert(out.end(), at, at + row);
          }
        }
      }
    }
    return out;
  }
  std::vector<uint8_t> Fetch(uint64_t id, uint64_t t0, uint64_t t1, uint32_t l0, uint32_t l1,
                             absl::Status* st) {
    auto r = store_->BeginFetch(MakeFetch(id, t0, t1, l0, l1));
    *st = r.status();
    if (!r.ok()) return {};
    return store_testing::ExpectBytes(store_testing::ReadAll(**r));
  }

  void OpAppend(bool cancel);
  void OpFork();
  void OpTruncate();
  void OpFetch();
  void CheckAccounting(int step);
  void CheckAllContent();

  std::unique_ptr<SequenceStore> store_;
  std::mt19937_64 rng_{kSeed};
  std::map<uint64_t, ModelSeq> live_;
  std::vector<uint64_t> live_order_;
  std::vector<uint64_t> gone_;
  std::map<int, int> refs_;  // abstract block -> number of sequences holding it
  int next_block_ = 0;
  std::map<std::string, int> outcomes_;
};

void ModelTest::OpAppend(bool cancel) {
  const uint64_t id = PickLive();
  ModelSeq& s = live_[id];
  uint32_t l0 = 0, l1 = kLayers;
  if (s.MinLen() != s.MaxLen() && rng_() % 4 != 0) {
    // Mostly catch up the layers that lag (as a layer-streaming prefill would).
    while (s.Len(l0) != s.MinLen()) ++l0;
    l1 = l0 + 1;
    while (l1 < kLayers && s.Len(l1) == s.Len(l0)) ++l1;
  } else if (rng_() % 5 < 2) {
    l0 = static_cast<uint32_t>(rng_() % kLayers);
    l1 = l0 + 1 + static_cast<uint32_t>(rng_() % (kLayers - l0));
  }
  const uint64_t n = rng_() % 8 == 0 ? 8 + rng_() % 25 : 1 + rng_() % 10;
  const uint64_t pos = s.Len(l0);
  bool even = true;
  for (uint32_t l = l0; l < l1; ++l) even = even && s.Len(l) == pos;
  const uint64_t first = pos / kBlockTokens, need = CeilDiv(pos + n, kBlockTokens);
  std::vector<size_t> cow;
  for (size_t i = first; i < std::min<size_t>(need, s.table.size()); ++i) {
    if (refs_[s.table[i]] > 1) cow.push_back(i);
  }
  const uint64_t fresh = need > s.table.size() ? need - s.table.size() : 0;
  const uint64_t free_before = FreeBlocks();
  StatusCode want = StatusCode::kOk;
  std::string why;
  if (!even) {
    want = StatusCode::kFailedPrecondition;
  } else if (pos + n > kMaxTokens) {
    want = StatusCode::kResourceExhausted;
    why = " (token limit)";
  } else if (cow.size() + fresh > free_before) {
    want = StatusCode::kResourceExhausted;
    why = " (pool)";
  }

  ModelSeq add;
  for (uint32_t l = l0; l < l1; ++l) {
    add.k[l].resize(n * kRow);
    add.v[l].resize(n * kRow);
    for (auto& b : add.k[l]) b = static_cast<uint8_t>(rng_());
    for (auto& b : add.v[l]) b = static_cast<uint8_t>(rng_());
  }
  const std::vector<uint8_t> payload = Payload(add, l0, l1, 0, n);
  absl::Status st;
  auto txn = store_->BeginAppend(MakeAppend(id, l0, l1, n));
  st = txn.status();
  if (txn.ok()) {
    // Streamed in random chunks; a cancelled append stops part way and drops the transaction.
    const uint64_t stop = cancel ? rng_() % (payload.size() + 1) : payload.size();
    for (uint64_t off = 0; off < stop && st.ok();) {
      const uint64_t len = std::min<uint64_t>(1 + rng_() % 97, stop - off);
      st = (*txn)->Write(absl::MakeConstSpan(payload.data() + off, len));
      off += len;
    }
    if (cancel) {
      txn->reset();
      ASSERT_TRUE(st.ok()) << st;
      ASSERT_EQ(FreeBlocks(), free_before) << "a cancelled append kept blocks";
      ++outcomes_["append cancelled"];
      return;
    }
    if (st.ok()) st = (*txn)->Commit().status();
  }
  ASSERT_EQ(st.code(), want) << st << " (append of " << n << " tokens to layers [" << l0 << ", "
                             << l1 << ") at " << pos << ", need " << cow.size() + fresh
                             << " blocks, " << free_before << " free)";
  ++outcomes_[std::string("append ") + absl::StatusCodeToString(st.code()) + why];
  if (!st.ok()) {
    ASSERT_EQ(FreeBlocks(), free_before) << "a failed append took blocks";
    return;
  }
  for (size_t i : cow) {
    Drop(s.table[i]);
    s.table[i] = NewBlock();
  }
  for (uint64_t i = 0; i < fresh; ++i) s.table.push_back(NewBlock());
  for (uint32_t l = l0; l < l1; ++l) {
    s.k[l].insert(s.k[l].end(), add.k[l].begin(), add.k[l].end());
    s.v[l].insert(s.v[l].end(), add.v[l].begin(), add.v[l].end());
  }
}

void ModelTest::OpFork() {
  const uint64_t id = PickLive();
  const ModelSeq& p = live_[id];
  const uint64_t full = p.MinLen() / kBlockTokens;
  const uint64_t partial = CeilDiv(p.MaxLen(), kBlockTokens) - full;
  StatusCode want = StatusCode::kOk;
  if (live_.size() >= kMaxSequences || partial > FreeBlocks())
    want = StatusCode::kResourceExhausted;
  auto r = store_->Fork(id, absl::ZeroDuration());
  ASSERT_EQ(r.status().code(), want) << r.status();
  ++outcomes_[std::string("fork ") + absl::StatusCodeToString(r.status().code())];
  if (!r.ok()) return;
  ModelSeq c = p;
  for (uint64_t i = 0; i < c.table.size(); ++i) {
    if (i < full) {
      ++refs_[c.table[i]];
    } else {
      c.table[i] = NewBlock();
    }
  }
  ASSERT_EQ(live_.count(r->id), 0u) << "a fork reused a live id";
  AddLive(r->id, std::move(c));
}

void ModelTest::OpTruncate() {
  const uint64_t id = PickLive();
  ModelSeq& s = live_[id];
  const uint64_t n = rng_() % 10 == 0 ? s.MinLen() + 1 : rng_() % (s.MinLen() + 1);
  auto r = store_->Truncate(id, n);
  const StatusCode want = n > s.MinLen() ? StatusCode::kOutOfRange : StatusCode::kOk;
  ASSERT_EQ(r.status().code(), want) << r.status();
  ++outcomes_[std::string("truncate ") + absl::StatusCodeToString(r.status().code())];
  if (!r.ok()) return;
  for (uint32_t l = 0; l < kLayers; ++l) {
    s.k[l].resize(n * kRow);
    s.v[l].resize(n * kRow);
  }
  while (s.table.size() > CeilDiv(n, kBlockTokens)) {
    Drop(s.table.back());
    s.table.pop_back();
  }
}

void ModelTest::OpFetch() {
  const uint64_t id = PickLive();
  const ModelSeq& s = live_[id];
  const uint32_t l0 = static_cast<uint32_t>(rng_() % kLayers);
  const uint32_t l1 = l0 + 1 + static_cast<uint32_t>(rng_() % (kLayers - l0));
  uint64_t avail = s.Len(l0);
  for (uint32_t l = l0; l < l1; ++l) avail = std::min(avail, s.Len(l));
  const uint64_t t0 = rng_() % (avail + 1);
  const uint64_t t1 = rng_() % 20 == 0 ? avail + 1 : t0 + rng_() % (avail - t0 + 1);
  absl::Status st;
  const std::vector<uint8_t> got = Fetch(id, t0, t1, l0, l1, &st);
  ++outcomes_[std::string("fetch ") + absl::StatusCodeToString(st.code())];
  if (t1 > avail) {
    ASSERT_EQ(st.code(), StatusCode::kOutOfRange) << st;
    return;
  }
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_TRUE(got == Payload(s, l0, l1, t0, t1))
      << "fetch [" << t0 << ", " << t1 << ") x [" << l0 << ", " << l1 << ") differs";
}

void ModelTest::CheckAccounting(int step) {
  ASSERT_EQ(store_->CheckInvariants(), "") << "step " << step;
  const StoreStats st = store_->Stats();
  ASSERT_EQ(st.pool.free + st.pool.used, st.pool.total);
  ASSERT_EQ(st.pool.used, refs_.size()) << "step " << step << ": used != distinct blocks";
  ASSERT_EQ(st.sequences, live_.size());
  // Same multiset of reference counts in the pool and in the model.
  std::map<int, int> want, got;
  for (const auto& [b, c] : refs_) ++want[c];
  for (int32_t id = 0; id < static_cast<int32_t>(kPoolBlocks); ++id) {
    if (uint32_t c = store_->pool().RefCount(id)) ++got[static_cast<int>(c)];
  }
  ASSERT_EQ(got, want) << "step " << step << ": sharing differs from the model";
  for (const auto& [id, s] : live_) {
    auto info = store_->Get(id);
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->num_blocks, s.table.size()) << "step " << step;
    for (uint32_t l = 0; l < kLayers; ++l) ASSERT_EQ(info->layer_lengths[l], s.Len(l));
  }
}

void ModelTest::CheckAllContent() {
  for (const auto& [id, s] : live_) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      absl::Status st;
      const std::vector<uint8_t> got = Fetch(id, 0, s.Len(l), l, l + 1, &st);
      ASSERT_TRUE(st.ok()) << st;
      ASSERT_TRUE(got == Payload(s, l, l + 1, 0, s.Len(l))) << "sequence " << id << " layer " << l;
    }
  }
}

TEST_F(ModelTest, RandomOperationsAgreeWithTheModel) {
  std::printf("seed=%llu steps=%d\n", static_cast<unsigned long long>(kSeed), kSteps);
  for (int step = 0; step < kSteps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step) + " seed " + std::to_string(kSeed));
    const int op = static_cast<int>(rng_() % 100);
    if (live_.empty() || op < 10) {
      auto r = store_->Create(WithLease(absl::ZeroDuration()));
      const StatusCode want =
          live_.size() >= kMaxSequences ? StatusCode::kResourceExhausted : StatusCode::kOk;
      ASSERT_EQ(r.status().code(), want) << r.status();
      ++outcomes_[std::string("create ") + absl::StatusCodeToString(r.status().code())];
      if (r.ok()) {
        ASSERT_EQ(r->length, 0u);
        AddLive(r->id, ModelSeq{});
      }
    } else if (op < 45) {
      ASSERT_NO_FATAL_FAILURE(OpAppend(/*cancel=*/false));
    } else if (op < 50) {
      ASSERT_NO_FATAL_FAILURE(OpAppend(/*cancel=*/true));
    } else if (op < 58) {
      ASSERT_NO_FATAL_FAILURE(OpFork());
    } else if (op < 66) {
      ASSERT_NO_FATAL_FAILURE(OpTruncate());
    } else if (op < 74) {
      const uint64_t id = PickLive();
      auto r = store_->Free(id);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(*r, live_[id].table.size());
      for (int b : live_[id].table) Drop(b);
      live_.erase(id);
      live_order_.erase(std::find(live_order_.begin(), live_order_.end(), id));
      gone_.push_back(id);
      ++outcomes_["free"];
    } else if (op < 96) {
      ASSERT_NO_FATAL_FAILURE(OpFetch());
    } else if (op < 99 && !gone_.empty()) {
      const uint64_t id = gone_[rng_() % gone_.size()];
      for (const absl::Status& s :
           {store_->Get(id).status(), store_->Fork(id, std::nullopt).status(),
            store_->BeginAppend(MakeAppend(id, 0, std::nullopt, 1)).status()}) {
        ASSERT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
      }
      ++outcomes_["use after free"];
    } else {
      const uint64_t unknown = (uint64_t{1} << 63) | rng_();  // ids stay below 2^53
      ASSERT_EQ(store_->Get(unknown).status().code(), StatusCode::kNotFound);
      ++outcomes_["unknown id"];
    }
    ASSERT_NO_FATAL_FAILURE(CheckAccounting(step));
    if (step % 100 == 99) {
      ASSERT_NO_FATAL_FAILURE(CheckAllContent());
    }
  }
  ASSERT_NO_FATAL_FAILURE(CheckAllContent());
  for (const auto& [what, n] : outcomes_) std::printf("  %-32s %d\n", what.c_str(), n);
  // The sweep must have reached the interesting states, or it proves little.
  EXPECT_GT(outcomes_["append RESOURCE_EXHAUSTED (pool)"], 10);
  EXPECT_GT(outcomes_["append RESOURCE_EXHAUSTED (token limit)"], 10);
  EXPECT_GT(outcomes_["append FAILED_PRECONDITION"], 10);
  EXPECT_GT(outcomes_["append OK"], 500);
  EXPECT_GT(outcomes_["fork OK"], 50);
  EXPECT_GT(outcomes_["truncate OK"], 50);
  EXPECT_GT(outcomes_["fetch OK"], 500);
  EXPECT_GT(outcomes_["append cancelled"], 50);

  for (const auto& [id, s] : live_) ASSERT_TRUE(store_->Free(id).ok());
  EXPECT_EQ(store_->Stats().pool.free, kPoolBlocks) << "blocks leaked";
  EXPECT_EQ(store_->CheckInvariants(), "");
}

}  // namespace
}  // namespace kvbank
