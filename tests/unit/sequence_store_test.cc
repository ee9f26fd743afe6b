// SequenceStore: bit-exact append / fetch, atomic appends, fork with copy on write, truncate,
// snapshot reads, free, leases with a fake clock, limits, and appends racing frees.
#include "server/core/sequence_store.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kvbank/layout.h"
#include "tests/unit/store_testing.h"
#include "tests/unit/test_memory.h"

namespace kvbank {
namespace {

using absl::StatusCode;
using store_testing::MakeAppend;
using store_testing::MakeFetch;

// 4 layers, 4 tokens per block; GQA with 2 heads of 3, or MLA with a latent of 3 + 2.
ModelLayout Layout(DType d, AttentionKind kind = AttentionKind::kGqa) {
  if (kind == AttentionKind::kMla) return store_testing::MlaLayout("test-model", 4, 3, 2, 4, d, d);
  return store_testing::GqaLayout("test-model", 4, 2, 3, 4, d, d);
}

// Reference content of one sequence: per layer, K and V rows token-major ([token][head][dim]).
struct Kv {
  std::vector<std::vector<uint8_t>> k, v;
};

class StoreTest : public ::testing::Test {
 protected:
  void Make(ModelLayout m, uint64_t blocks, StoreOptions opt = {}) {
    layout_ = m;
    const BlockLayout b = ComputeBlockLayout(m);
    const LayerView& v = b.layers[0];
    krow_ = v.num_kv_heads * v.KRowBytes();
    vrow_ = v.has_v ? v.num_kv_heads * v.VRowBytes() : 0;
    opt.clock = [c = clock_] { return *c; };
    auto store = testenv::CreateTestStore(m, blocks, opt);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }
  void SetUp() override { Make(Layout(DType::kFp16), 64); }

  uint64_t NewSeq(std::optional<absl::Duration> lease = absl::ZeroDuration()) {
    return store_testing::NewSequence(*store_, lease);
  }
  Kv Rows(uint64_t n) {
    Kv kv;
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      kv.k.emplace_back(n * krow_);
      kv.v.emplace_back(n * vrow_);
      for (auto& b : kv.k.back()) b = static_cast<uint8_t>(rng_());
      for (auto& b : kv.v.back()) b = static_cast<uint8_t>(rng_());
    }
    return kv;
  }
  // Dense payload of layers [l0, l1) x tokens [t0, t1) of `kv`.
  std::vector<uint8_t> Payload(const Kv& kv, uint32_t l0, uint32_t l1, uint64_t t0, uint64_t t1) {
    std::vector<uint8_t> out;
    const uint32_t heads = layout_.num_kv_heads;
    for (uint32_t l = l0; l < l1; ++l) {
      for (int part = 0; part < (vrow_ ? 2 : 1); ++part) {
        const std::vector<uint8_t>& rows = part == 0 ? kv.k[l] : kv.v[l];
        const uint64_t row = (part == 0 ? krow_ : vrow_) / heads;
        for (uint32_t h = 0; h < heads; ++h) {
          for (uint64_t t = t0; t < t1; ++t) {
            const uint8_t* at = rows.data() + (t * heads + h) * row;
            out.insert(out.end(), at, at + row);
          }
        }
      }
    }
    return out;
  }
  // Appends `add` (all its tokens) to layers [l0, l1) of the store and of `model`.
  absl::StatusOr<SequenceInfo> Append(uint64_t id, Kv& model, const Kv& add, uint32_t l0 = 0,
                                      std::optional<uint32_t> l1 = std::nullopt) {
    const uint64_t n = add.k[0].size() / krow_;
    auto r = store_->Append(MakeAppend(id, l0, l1, n),
                            Payload(add, l0, l1.value_or(layout_.num_layers), 0, n));
    if (r.ok()) {
      model.k.resize(layout_.num_layers);
      model.v.resize(layout_.num_layers);
      for (uint32_t l = l0; l < l1.value_or(layout_.num_layers); ++l) {
        model.k[l].insert(model.k[l].end(), add.k[l].begin(), add.k[l].end());
        model.v[l].insert(model.v[l].end(), add.v[l].begin(), add.v[l].end());
      }
    }
    return r;
  }
  absl::StatusOr<std::vector<uint8_t>> Fetch(uint64_t id, uint64_t t0, std::optional<uint64_t> t1,
                                             uint32_t l0, std::optional<uint32_t> l1) {
    auto r = store_->BeginFetch(MakeFetch(id, t0, t1, l0, l1));
    if (!r.ok()) return r.status();
    std::vector<uint8_t> out((*r)->payload_bytes());
    for (uint64_t off = 0; off < out.size(); off += 5) {  // odd chunks on the read side too
      const uint64_t len = std::min<uint64_t>(5, out.size() - off);
      if (absl::Status s = (*r)->Read(off, absl::MakeSpan(out.data() + off, len)); !s.ok()) {
        return s;
      }
    }
    return out;
  }
  // Fetches everything, layer by layer, and compares with the model.
  void ExpectContent(uint64_t id, const Kv& model) {
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      const uint64_t n = model.k.empty() ? 0 : model.k[l].size() / krow_;
      auto got = Fetch(id, 0, n, l, l + 1);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_TRUE(*got == Payload(model, l, l + 1, 0, n)) << "layer " << l << " differs";
    }
  }
  struct State {
    SequenceInfo info;
    std::vector<std::vector<uint8_t>> layers;
    PoolStats pool;
  };
  State Capture(uint64_t id) {
    State s;
    auto info = store_->Get(id);
    EXPECT_TRUE(info.ok()) << info.status();
    s.info = *info;
    for (uint32_t l = 0; l < layout_.num_layers; ++l) {
      s.layers.push_back(*Fetch(id, 0, s.info.layer_lengths[l], l, l + 1));
    }
    s.pool = store_->Stats().pool;
    return s;
  }
  void ExpectSameState(const State& a, const State& b) {
    EXPECT_EQ(a.info.length, b.info.length);
    EXPECT_EQ(a.info.layer_lengths, b.info.layer_lengths);
    EXPECT_EQ(a.info.num_blocks, b.info.num_blocks);
    EXPECT_EQ(a.info.cached_tokens, b.info.cached_tokens);
    EXPECT_TRUE(a.layers == b.layers) << "content changed";
    EXPECT_EQ(a.pool.free, b.pool.free);
    EXPECT_EQ(a.pool.used, b.pool.used);
    EXPECT_EQ(store_->CheckInvariants(), "");
  }
  // Histogram: reference count -> number of blocks with it (count 0 left out).
  std::map<uint32_t, int> RefHistogram() {
    std::map<uint32_t, int> h;
    for (int32_t id = 0; id < static_cast<int32_t>(store_->pool().num_blocks()); ++id) {
      if (uint32_t c = store_->pool().RefCount(id)) ++h[c];
    }
    return h;
  }

  ModelLayout layout_;
  uint64_t krow_ = 0, vrow_ = 0;  // bytes of one token of one layer, all heads
  std::shared_ptr<absl::Time> clock_ =
      std::make_shared<absl::Time>(absl::FromUnixSeconds(1000000000));
  std::mt19937_64 rng_{12345};  // fixed seed: the content is reproducible
  std::unique_ptr<SequenceStore> store_;
};

TEST_F(StoreTest, RoundTripIsBitExactForEveryUnquantizedDType) {
  for (DType d : {DType::kFp16, DType::kBf16, DType::kFp32}) {
    for (AttentionKind kind : {AttentionKind::kGqa, AttentionKind::kMla}) {
      SCOPED_TRACE(std::string(DTypeName(d)) + " " + AttentionKindName(kind));
      Make(Layout(d, kind), 16);
      const uint64_t id = NewSeq();
      Kv model;
      auto info = Append(id, model, Rows(10));
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->length, 10u);
      EXPECT_EQ(info->num_blocks, 3u);
      EXPECT_EQ(info->layer_lengths, std::vector<uint64_t>(4, 10));
      ExpectContent(id, model);
      auto all = Fetch(id, 0, std::nullopt, 0, std::nullopt);
      ASSERT_TRUE(all.ok());
      EXPECT_TRUE(*all == Payload(model, 0, 4, 0, 10));
      EXPECT_EQ(store_->Stats().pool.used, 3u);
    }
  }
}

TEST_F(StoreTest, LayerRangeAppendsThenTheRest) {
  const uint64_t id = NewSeq();
  Kv model;
  const Kv rows = Rows(6);
  ASSERT_TRUE(Append(id, model, rows, 0, 2).ok());
  auto info = store_->Get(id);
  EXPECT_EQ(info->layer_lengths, (std::vector<uint64_t>{6, 6, 0, 0}));
  EXPECT_EQ(info->length, 0u) << "length counts tokens every layer holds";
  EXPECT_EQ(Fetch(id, 0, std::nullopt, 0, std::nullopt)->size(), 0u);
  EXPECT_TRUE(*Fetch(id, 1, 5, 0, 2) == Payload(model, 0, 2, 1, 5));
  // Layers 1 and 2 hold 6 and 0 tokens: a range across them is refused.
  EXPECT_EQ(Append(id, model, Rows(1), 1, 3).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(Append(id, model, rows, 2, 4).ok());
  EXPECT_EQ(store_->Get(id)->length, 6u);
  ExpectContent(id, model);
  EXPECT_EQ(store_->Stats().pool.used, 2u) << "both halves land in the same blocks";
}

TEST_F(StoreTest, AppendsCrossingBlocksAndSubRangeFetches) {
  const uint64_t id = NewSeq();
  Kv model;
  for (uint64_t n : {1, 2, 3, 5, 7}) ASSERT_TRUE(Append(id, model, Rows(n)).ok());
  EXPECT_EQ(store_->Get(id)->num_blocks, 5u);  // 18 tokens, 4 per block
  for (uint64_t t0 = 0; t0 <= 18; ++t0) {
    for (uint64_t t1 = t0; t1 <= 18; ++t1) {
      for (uint32_t l0 = 0; l0 < 4; ++l0) {
        for (uint32_t l1 = l0 + 1; l1 <= 4; ++l1) {
          auto got = Fetch(id, t0, t1, l0, l1);
          ASSERT_TRUE(got.ok()) << got.status();
          ASSERT_TRUE(*got == Payload(model, l0, l1, t0, t1))
              << "[" << t0 << "," << t1 << ") x [" << l0 << "," << l1 << ")";
        }
      }
    }
  }
  EXPECT_EQ(Fetch(id, 5, 19, 0, 4).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(Fetch(id, 6, 5, 0, 4).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(Fetch(id, 0, 1, 2, 2).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Fetch(id, 0, 1, 0, 5).status().code(), StatusCode::kInvalidArgument);
  // Payloads travel as fp32 / fp16 / bf16; a storage-format (quantized) fetch is refused.
  auto quantized = store_->BeginFetch(MakeFetch(id, 0, 1, 0, 4, DType::kInt8));
  EXPECT_EQ(quantized.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(quantized.status().message().find("storage format"), std::string::npos);
}

TEST_F(StoreTest, StreamedAppendWithOddChunks) {
  std::printf("seed=12345\n");
  const uint64_t id = NewSeq();
  Kv model;
  ASSERT_TRUE(Append(id, model, Rows(3)).ok());
  for (uint64_t chunk : {1, 7, 13, 0}) {
    const Kv add = Rows(5);
    auto txn = store_->BeginAppend(MakeAppend(id, 0, std::nullopt, 5));
    ASSERT_TRUE(txn.ok()) << txn.status();
    const std::vector<uint8_t> p = Payload(add, 0, 4, 0, 5);
    ASSERT_EQ((*txn)->payload_bytes(), p.size());
    for (uint64_t off = 0; off < p.size();) {
      const uint64_t len = std::min<uint64_t>(chunk ? chunk : 1 + rng_() % 40, p.size() - off);
      ASSERT_TRUE((*txn)->Write(absl::MakeConstSpan(p.data() + off, len)).ok());
      off += len;
      EXPECT_EQ((*txn)->bytes_written(), off);
    }
    auto info = (*txn)->Commit();
    ASSERT_TRUE(info.ok()) << info.status();
    for (uint32_t l = 0; l < 4; ++l) {
      model.k[l].insert(model.k[l].end(), add.k[l].begin(), add.k[l].end());
      model.v[l].insert(model.v[l].end(), add.v[l].begin(), add.v[l].end());
    }
    EXPECT_EQ((*txn)->Commit().status().code(), StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(store_->Get(id)->length, 23u);
  ExpectContent(id, model);
}

// A payload written by ranges, out of order and from several threads (host memory: a region
// append split over copy helpers), then counted: the same content as written in order. Ranges
// outside [written, end) are refused; a converted payload, or staged memory, takes none.
TEST_F(StoreTest, AppendWrittenByRangesFromSeveralThreads) {
  std::printf("seed=12345\n");
  const uint64_t id = NewSeq();
  Kv model;
  ASSERT_TRUE(Append(id, model, Rows(3)).ok());
  const Kv add = Rows(9);
  auto txn = store_->BeginAppend(MakeAppend(id, 0, std::nullopt, 9));
  ASSERT_TRUE(txn.ok()) << txn.status();
  const std::vector<uint8_t> p = Payload(add, 0, 4, 0, 9);
  if (!(*txn)->ConcurrentWrites()) {
    EXPECT_EQ((*txn)->WriteRange(0, absl::MakeConstSpan(p.data(), 8)).code(),
              StatusCode::kFailedPrecondition);
    GTEST_SKIP() << "this pool memory writes payloads in order only";
  }
  // Pieces of 37 bytes, the last first, on four threads.
  constexpr uint64_t kPiece = 37;
  const uint64_t pieces = (p.size() + kPiece - 1) / kPiece;
  std::atomic<uint64_t> next{0};
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (uint64_t i; (i = next.fetch_add(1)) < pieces;) {
        const uint64_t at = (pieces - 1 - i) * kPiece;
        const uint64_t len = std::min<uint64_t>(kPiece, p.size() - at);
        if (!(*txn)->WriteRange(at, absl::MakeConstSpan(p.data() + at, len)).ok()) ++bad;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ((*txn)->bytes_written(), 0u) << "ranges are counted by Advance";
  EXPECT_EQ((*txn)->WriteRange(p.size() - 4, absl::MakeConstSpan(p.data(), 8)).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE((*txn)->Advance(p.size()).ok());
  EXPECT_EQ((*txn)->WriteRange(0, absl::MakeConstSpan(p.data(), 8)).code(),
            StatusCode::kInvalidArgument)
      << "before what was counted";
  EXPECT_EQ((*txn)->Advance(1).code(), StatusCode::kInvalidArgument);
  auto info = (*txn)->Commit();
  ASSERT_TRUE(info.ok()) << info.status();
  for (uint32_t l = 0; l < 4; ++l) {
    model.k[l].insert(model.k[l].end(), add.k[l].begin(), add.k[l].end());
    model.v[l].insert(model.v[l].end(), add.v[l].begin(), add.v[l].end());
  }
  ExpectContent(id, model);

  // A converted payload (fp16 quantized into int8 storage) is written in order only.
  txn->reset();  // before its store goes
  Make(store_testing::GqaLayout("test-model", 4, 2, 3, 4, DType::kInt8, DType::kFp16), 64);
  auto conv = store_->BeginAppend(MakeAppend(NewSeq(), 0, std::nullopt, 2, DType::kFp16));
  ASSERT_TRUE(conv.ok()) << conv.status();
  EXPECT_FALSE((*conv)->ConcurrentWrites());
  EXPECT_EQ((*conv)->WriteRange(0, absl::MakeConstSpan(p.data(), 8)).code(),
            StatusCode::kFailedPrecondition);
}

TEST_F(StoreTest, FailedOrCancelledAppendsChangeNothing) {
  const uint64_t id = NewSeq();
  Kv model;
  ASSERT_TRUE(Append(id, model, Rows(6)).ok());
  const uint64_t child = store_->Fork(id, absl::ZeroDuration())->id;  // block 0 is shared
  ASSERT_TRUE(store_->Truncate(id, 2).ok());  // so the next append copies block 0 first
  for (uint32_t l = 0; l < 4; ++l) {
    model.k[l].resize(2 * krow_);
    model.v[l].resize(2 * vrow_);
  }
  const State before = Capture(id), child_before = Capture(child);
  const Kv add = Rows(7);
  const std::vector<uint8_t> p = Payload(add, 0, 4, 0, 7);

  // Write past the end: refused, nothing written.
  auto txn = store_->BeginAppend(MakeAppend(id, 0, std::nullopt, 7));
  ASSERT_TRUE(txn.ok());
  std::vector<uint8_t> big = p;
  big.push_back(0);
  EXPECT_EQ((*txn)->Write(big).code(), StatusCode::kInvalidArgument);
  txn->reset();
  ExpectSameState(before, Capture(id));
  EXPECT_EQ(store_->Append(MakeAppend(id, 0, std::nullopt, 7), big).status().code(),
            StatusCode::kInvalidArgument);
  ExpectSameState(before, Capture(id));

  // Commit with too few bytes.
  txn = store_->BeginAppend(MakeAppend(id, 0, std::nullopt, 7));
  ASSERT_TRUE((*txn)->Write(absl::MakeConstSpan(p.data(), p.size() - 1)).ok());
  EXPECT_EQ((*txn)->Commit().status().code(), StatusCode::kInvalidArgument);
  ExpectSameState(before, Capture(id));
  txn->reset();
  ExpectSameState(before, Capture(id));

  // Cancel: everything written, then the transaction goes without Commit.
  txn = store_->BeginAppend(MakeAppend(id, 0, std::nullopt, 7));
  ASSERT_TRUE((*txn)->Write(p).ok());
  txn->reset();
  ExpectSameState(before, Capture(id));

  // Bad specs are refused up front.
  for (AppendSpec bad : {MakeAppend(id, 0, std::nullopt, 0), MakeAppend(id, 3, 2, 1),
                         MakeAppend(id, 0, 5, 1), MakeAppend(id, 0, std::nullopt, 1, DType::kBf16),
                         MakeAppend(id, 0, std::nullopt, 2, std::nullopt, {1, 2, 3})}) {
    EXPECT_EQ(store_->BeginAppend(bad).status().code(), StatusCode::kInvalidArgument);
  }
  ExpectSameState(before, Capture(id));
  ExpectSameState(child_before, Capture(child));
  ASSERT_TRUE(Append(id, model, add).ok());  // and a good append still works afterwards
  ExpectContent(id, model);
}

TEST_F(StoreTest, PoolExhaustionTakesNothing) {
  Make(Layout(DType::kFp16), 5);
  const uint64_t id = NewSeq();
  Kv model;
  ASSERT_TRUE(Append(id, model, Rows(3)).ok());
  const State before = Capture(id);
  auto r = Append(id, model, Rows(18));  // needs 5 more blocks, 4 are free
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status();
  ExpectSameState(before, Capture(id));
  EXPECT_EQ(store_->Stats().pool.free, 4u);
  ASSERT_TRUE(Append(id, model, Rows(17)).ok());  // exactly fills the pool
  EXPECT_EQ(store_->Stats().pool.free, 0u);
  EXPECT_EQ(store_->Fork(id, absl::ZeroDuration()).status().code(), StatusCode::kOk)
      << "20 tokens: every block is full, a fork copies nothing";
  ExpectContent(id, model);
}

TEST_F(StoreTest, ForkSharesFullBlocksAndCopiesOnWrite) {
  const uint64_t parent = NewSeq();
  Kv pm;
  ASSERT_TRUE(Append(parent, pm, Rows(10)).ok());  // blocks: full, full, partial (2 rows)
  EXPECT_EQ(store_->Stats().pool.used, 3u);
  auto forked = store_->Fork(parent, std::nullopt);
  ASSERT_TRUE(forked.ok()) << forked.status();
  const uint64_t child = forked->id;
  EXPECT_EQ(forked->length, 10u);
  EXPECT_EQ(forked->num_blocks, 3u);
  EXPECT_EQ(store_->Stats().pool.used, 4u) << "only the partial block is copied";
  EXPECT_EQ(RefHistogram(), (std::map<uint32_t, int>{{1, 2}, {2, 2}}));
  Kv cm = pm;
  ExpectContent(child, cm);

  ASSERT_TRUE(Append(parent, pm, Rows(3)).ok());  // fills the parent's private partial block
  ASSERT_TRUE(Append(child, cm, Rows(5)).ok());
  ExpectContent(parent, pm);
  ExpectContent(child, cm);
  // Truncating into a shared block and appending must copy it, not write it.
  ASSERT_TRUE(store_->Truncate(parent, 5).ok());
  for (uint32_t l = 0; l < 4; ++l) {
    pm.k[l].resize(5 * krow_);
    pm.v[l].resize(5 * vrow_);
  }
  ASSERT_TRUE(Append(parent, pm, Rows(2)).ok());
  ExpectContent(parent, pm);
  ExpectContent(child, cm);
  EXPECT_EQ(store_->CheckInvariants(), "");
}

TEST_F(StoreTest, ForkWithUnevenLayerLengths) {
  const uint64_t parent = NewSeq();
  Kv pm;
  ASSERT_TRUE(Append(parent, pm, Rows(10), 0, 2).ok());
  ASSERT_TRUE(Append(parent, pm, Rows(5), 2, 4).ok());
  const uint64_t before = store_->Stats().pool.used;
  auto child = store_->Fork(parent, absl::ZeroDuration());
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(child->layer_lengths, (std::vector<uint64_t>{10, 10, 5, 5}));
  EXPECT_EQ(store_->Stats().pool.used, before + 2) << "blocks 1 and 2 hold partial layers";
  Kv cm = pm;
  ExpectContent(child->id, cm);
  ASSERT_TRUE(Append(child->id, cm, Rows(5), 2, 4).ok());
  ASSERT_TRUE(Append(parent, pm, Rows(5), 2, 4).ok());
  ExpectContent(child->id, cm);
  ExpectContent(parent, pm);
}

TEST_F(StoreTest, TruncateThenAppend) {
  const uint64_t id = NewSeq();
  Kv model;
  ASSERT_TRUE(Append(id, model, Rows(10)).ok());
  EXPECT_EQ(store_->Truncate(id, 11).status().code(), StatusCode::kOutOfRange);
  auto info = store_->Truncate(id, 5);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->length, 5u);
  EXPECT_EQ(info->num_blocks, 2u);
  EXPECT_EQ(store_->Stats().pool.used, 2u);
  for (uint32_t l = 0; l < 4; ++l) {
    model.k[l].resize(5 * krow_);
    model.v[l].resize(5 * vrow_);
  }
  ASSERT_TRUE(Append(id, model, Rows(4)).ok());
  ExpectContent(id, model);
  ASSERT_TRUE(store_->Truncate(id, 0).ok());
  EXPECT_EQ(store_->Stats().pool.used, 0u);
  ASSERT_TRUE(Append(id, model = Kv{}, Rows(1)).ok());
  ExpectContent(id, model);
}

TEST_F(StoreTest, FetchReaderIsASnapshot) {
  const uint64_t id = NewSeq();
  Kv model;
  ASSERT_TRUE(Append(id, model, Rows(10)).ok());
  const std::vector<uint8_t> old = Payload(model, 0, 4, 0, 10);
  auto reader = store_->BeginFetch(MakeFetch(id, 0, std::nullopt, 0, std::nullopt));
  ASSERT_TRUE(reader.ok());
  ASSERT_TRUE(store_->Truncate(id, 2).ok());
  Kv fresh;
  ASSERT_TRUE(Append(id, fresh, Rows(9)).ok());
  std::vector<uint8_t> got((*reader)->payload_bytes());
  ASSERT_TRUE((*reader)->Read(0, absl::MakeSpan(got)).ok());
  EXPECT_TRUE(got == old) << "a reader saw a write made after it began";
  ASSERT_TRUE(store_->Free(id).ok());
  ASSERT_TRUE((*reader)->Read(0, absl::MakeSpan(got)).ok());
  EXPECT_TRUE(got == old) << "a reader saw its blocks go";
  EXPECT_GT(store_->Stats().pool.used, 0u);
  reader->reset();
  EXPECT_EQ(store_->Stats().pool.used, 0u);
  EXPECT_EQ(store_->CheckInvariants(), "");
}

TEST_F(StoreTest, FreeReleasesAndLaterUseIsFailedPrecondition) {
  const uint64_t id = NewSeq();
  Kv model;
  ASSERT_TRUE(Append(id, model, Rows(9)).ok());
  auto freed = store_->Free(id);
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 3u);
  EXPECT_EQ(store_->Stats().pool.used, 0u);
  EXPECT_EQ(store_->Stats().sequences, 0u);
  std::vector<absl::Status> after = {
      store_->Free(id).status(),
      store_->Get(id).status(),
      store_->RenewLease(id).status(),
      store_->Fork(id, std::nullopt).status(),
      store_->Truncate(id, 0).status(),
      store_->BeginAppend(MakeAppend(id, 0, std::nullopt, 1)).status(),
      store_->BeginFetch(MakeFetch(id)).status(),
  };
  for (const absl::Status& s : after) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("freed"), std::string::npos) << s;
  }
  const uint64_t unknown = id ^ 0x5555;
  for (const absl::Status& s : {store_->Get(unknown).status(), store_->Free(unknown).status(),
                                store_->BeginFetch(MakeFetch(unknown)).status()}) {
    EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
    EXPECT_NE(s.message().find("sequence_id"), std::string::npos) << s;
  }
}

TEST_F(StoreTest, LeasesExpireOnAFakeClock) {
  StoreOptions opt;
  opt.default_lease = absl::Seconds(10);
  opt.max_lease = absl::Minutes(1);
  Make(Layout(DType::kFp16), 32, opt);
  const uint64_t a = NewSeq(std::nullopt), b = NewSeq(absl::Seconds(30)), forever = NewSeq();
  Kv model;
  ASSERT_TRUE(Append(a, model, Rows(5)).ok());
  EXPECT_EQ(store_->Get(a)->lease_ttl, absl::Seconds(10));
  EXPECT_EQ(store_->Create(WithLease(absl::Seconds(-1))).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Create(WithLease(absl::Minutes(2))).status().code(),
            StatusCode::kInvalidArgument);

  *clock_ += absl::Seconds(8);
  ASSERT_TRUE(store_->RenewLease(a).ok());  // deadline now t=18
  *clock_ += absl::Seconds(8);
  EXPECT_EQ(store_->ExpireLeases(*clock_), 0u) << "a renewed lease expired";
  ASSERT_TRUE(store_->Get(a).ok());
  *clock_ += absl::Seconds(3);  // t=19
  EXPECT_EQ(store_->ExpireLeases(*clock_), 1u);
  EXPECT_EQ(store_->Stats().pool.used, 0u) << "an expired sequence kept its blocks";
  EXPECT_EQ(store_->Stats().leases_expired, 1u);
  for (const absl::Status& s : {store_->Get(a).status(), store_->RenewLease(a).status()}) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("lease"), std::string::npos) << s;
  }
  // b runs out at t=30 and is expired on first touch, before any reaper runs.
  *clock_ += absl::Seconds(12);
  auto touched = store_->Get(b);
  EXPECT_EQ(touched.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(touched.status().message().find("lease"), std::string::npos) << touched.status();
  *clock_ += absl::Hours(100);
  EXPECT_EQ(store_->ExpireLeases(*clock_), 0u);
  EXPECT_TRUE(store_->Get(forever).ok()) << "a zero lease never expires";
  EXPECT_EQ(store_->Stats().leases_expired, 2u);
}

TEST_F(StoreTest, SequenceAndTokenLimits) {
  StoreOptions opt;
  opt.max_sequences = 3;
  opt.max_tokens_per_sequence = 10;
  Make(Layout(DType::kFp16), 32, opt);
  const uint64_t a = NewSeq();
  NewSeq();
  NewSeq();
  EXPECT_EQ(store_->Create(WithLease(absl::ZeroDuration())).status().code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(store_->Fork(a, absl::ZeroDuration()).status().code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(store_->Free(a).ok());
  const uint64_t d = NewSeq();
  Kv model;
  EXPECT_EQ(Append(d, model, Rows(11)).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(Append(d, model, Rows(6)).ok());
  EXPECT_EQ(Append(d, model, Rows(5)).status().code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(Append(d, model, Rows(4)).ok());
  ExpectContent(d, model);
}

TEST_F(StoreTest, OneAppendInFlightPerSequence) {
  const uint64_t id = NewSeq();
  Kv model;
  const Kv add = Rows(3);
  auto first = store_->BeginAppend(MakeAppend(id, 0, std::nullopt, 3));
  ASSERT_TRUE(first.ok());
  auto second = store_->BeginAppend(MakeAppend(id, 0, std::nullopt, 3));
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_->Truncate(id, 0).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*first)->Write(Payload(add, 0, 4, 0, 3)).ok());
  ASSERT_TRUE((*first)->Commit().ok());
  ASSERT_TRUE(Append(id, model = add, Rows(2)).ok());
  ExpectContent(id, model);
}

TEST_F(StoreTest, FreeDuringAppendAbortsItAndReturnsEveryBlock) {
  const Kv add = Rows(9);
  const std::vector<uint8_t> p = Payload(add, 0, 4, 0, 9);
  // Ends of the transaction after the Free: a full Commit, a short Commit, or none at all.
  enum End { kCommit, kShortCommit, kDrop };
  for (End end : {kCommit, kShortCommit, kDrop}) {
    SCOPED_TRACE(end);
    const uint64_t id = NewSeq();
    Kv model;
    ASSERT_TRUE(Append(id, model, Rows(10)).ok());           // blocks 0 and 1 full, 2 partial
    auto reader = store_->BeginFetch(MakeFetch(id, 8, 10));  // pins block 2: copied on write
    ASSERT_TRUE(reader.ok());
    auto txn = store_->BeginAppend(MakeAppend(id, 0, std::nullopt, 9));
    ASSERT_TRUE(txn.ok());
    ASSERT_TRUE((*txn)->Write(absl::MakeConstSpan(p.data(), p.size() - 1)).ok());
    EXPECT_EQ(store_->Free(id).value_or(0), 3u);
    if (end == kCommit) {
      ASSERT_TRUE((*txn)->Write(absl::MakeConstSpan(p.data() + p.size() - 1, 1)).ok());
      auto r = (*txn)->Commit();
      EXPECT_EQ(r.status().code(), StatusCode::kAborted) << r.status();
    } else if (end == kShortCommit) {
      EXPECT_EQ((*txn)->Commit().status().code(), StatusCode::kInvalidArgument);
    }
    if (end != kDrop) {
      // The transaction is finished: nothing may stay pinned until the caller drops it.
      EXPECT_EQ(store_->Stats().pool.used, 1u) << "a finished transaction kept blocks";
    }
    txn->reset();
    EXPECT_EQ(store_->Stats().pool.used, 1u) << "only the reader's block stays";
    EXPECT_EQ(store_->CheckInvariants(), "");
    EXPECT_EQ(store_->Get(id).status().code(), StatusCode::kFailedPrecondition);
    reader->reset();
    EXPECT_EQ(store_->Stats().pool.used, 0u);
  }
}

TEST_F(StoreTest, ConcurrentSequencesStayIntact) {
  Make(Layout(DType::kBf16), 512);
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t, &errors] {
      std::mt19937_64 rng(1000 + t);
      for (int iter = 0; iter < 150 && errors[t].empty(); ++iter) {
        auto s = store_->Create(WithLease(absl::ZeroDuration()));
        if (!s.ok()) {
          errors[t] = s.status().ToString();
          return;
        }
        std::vector<uint8_t> all;
        const uint64_t n = 1 + rng() % 9;
        const uint64_t bytes = store_->pool().layout().PayloadBytes(0, 4, n);
        for (uint64_t i = 0; i < bytes; ++i) all.push_back(static_cast<uint8_t>(rng()));
        if (!store_->Append(MakeAppend(s->id, 0, std::nullopt, n), all).ok()) {
          errors[t] = "append failed";
          return;
        }
        // Read the parent, or a fork of it after the parent is gone (its blocks must survive).
        uint64_t read_id = s->id;
        if (rng() % 2) {
          auto child = store_->Fork(s->id, absl::ZeroDuration());
          if (!child.ok() || !store_->Free(s->id).ok()) {
            errors[t] = "fork or free failed";
            return;
          }
          read_id = child->id;
        }
        auto r = store_->BeginFetch(MakeFetch(read_id));
        std::vector<uint8_t> got(all.size());
        const bool read = r.ok() && (*r)->payload_bytes() == got.size() &&
                          (*r)->Read(0, absl::MakeSpan(got)).ok();
        if (!read || got != all) errors[t] = "fetched bytes differ";
        if (!store_->Free(read_id).ok()) errors[t] = "free failed";
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
  EXPECT_EQ(store_->CheckInvariants(), "");
  EXPECT_EQ(store_->Stats().pool.used, 0u);
  EXPECT_EQ(store_->Stats().sequences, 0u);
}

}  // namespace
}  // namespace kvbank
