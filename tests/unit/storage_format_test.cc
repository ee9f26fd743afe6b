// Storage-format transfers: quantized elements and their scales travel as stored, so a GPU that
// quantized KV itself can append it, and a reader can fetch it without dequantizing.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/quant.h"
#include "server/core/sequence_store.h"
#include "tests/unit/store_testing.h"
#include "tests/unit/test_memory.h"

namespace kvbank {
namespace {

using absl::StatusCode;

ModelLayout Layout(DType storage, AttentionKind kind) {
  if (kind == AttentionKind::kMla) {
    return store_testing::MlaLayout("sf", 3, 32, 8, 7, storage, DType::kFp32);
  }
  return store_testing::GqaLayout("sf", 3, 3, 72, 7, storage, DType::kFp32);
}

class StorageFormatTest : public testing::TestWithParam<std::tuple<DType, AttentionKind>> {
 protected:
  void SetUp() override {
    const ModelLayout m = Layout(std::get<0>(GetParam()), std::get<1>(GetParam()));
    StoreOptions o;
    o.default_lease = absl::ZeroDuration();
    auto store = testenv::CreateTestStore(m, 256, o);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }

  uint64_t NewSeq() { return store_->Create(WithLease(std::nullopt))->id; }

  // Appends `payload` in chunks of `chunk` bytes.
  absl::Status Append(uint64_t id, uint64_t n, std::optional<DType> dtype,
                      const std::vector<uint8_t>& payload, size_t chunk) {
    AppendSpec a;
    a.sequence_id = id;
    a.num_tokens = n;
    a.dtype = dtype;
    auto txn = store_->BeginAppend(a);
    if (!txn.ok()) return txn.status();
    for (size_t at = 0; at < payload.size(); at += chunk) {
      const size_t len = std::min(chunk, payload.size() - at);
      if (absl::Status s = (*txn)->Write(absl::MakeConstSpan(payload.data() + at, len)); !s.ok()) {
        return s;
      }
    }
    return (*txn)->Commit().status();
  }

  std::vector<uint8_t> Fetch(uint64_t id, std::optional<DType> dtype, uint64_t t0 = 0,
                             std::optional<uint64_t> t1 = std::nullopt) {
    FetchSpec f;
    f.sequence_id = id;
    f.token_begin = t0;
    f.token_end = t1;
    f.dtype = dtype;
    auto r = store_->BeginFetch(f);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    std::vector<uint8_t> out((*r)->payload_bytes());
    // Odd read windows: rows and scale sections split across reads.
    for (size_t at = 0; at < out.size(); at += 13) {
      EXPECT_TRUE(
          (*r)->Read(at, absl::MakeSpan(out.data() + at, std::min<size_t>(13, out.size() - at)))
              .ok());
    }
    return out;
  }

  std::vector<uint8_t> RandomFp32(uint64_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> g(0.f, 2.f);
    const uint64_t elems = ComputeBlockLayout(store_->layout()).PayloadBytes(0, 3, n) /
                           DTypeBytes(std::get<0>(GetParam()));
    std::vector<float> v(elems);
    for (float& x : v) x = g(rng);
    std::vector<uint8_t> bytes(v.size() * 4);
    std::memcpy(bytes.data(), v.data(), bytes.size());
    return bytes;
  }

  std::unique_ptr<SequenceStore> store_;
};

TEST_P(StorageFormatTest, FetchedStorageFormatAppendsBackBitExact) {
  const DType storage = std::get<0>(GetParam());
  std::printf("seed=%d\n", 7);
  const uint64_t n = 23;  // 3 full blocks of 7 and a partial one
  const uint64_t a = NewSeq();
  ASSERT_TRUE(Append(a, n, DType::kFp32, RandomFp32(n, 7), 1000).ok());
  const std::vector<uint8_t> stored = Fetch(a, storage);
  const PayloadLayout p =
      PayloadLayout::MakeStorage(ComputeBlockLayout(store_->layout()), 0, 3, 0, n);
  ASSERT_EQ(stored.size(), p.total_bytes);

  // A second sequence gets the stored bytes as they are, in odd chunks.
  const uint64_t b = NewSeq();
  ASSERT_TRUE(Append(b, n, storage, stored, 7).ok());
  EXPECT_EQ(Fetch(b, storage), stored);
  EXPECT_EQ(Fetch(b, DType::kFp32), Fetch(a, DType::kFp32));
  // A sub-range fetched in storage format is the same as the whole one's rows and scales.
  const std::vector<uint8_t> sub = Fetch(b, storage, 7, 21);
  EXPECT_EQ(sub, Fetch(a, storage, 7, 21));
  EXPECT_EQ(
      sub.size(),
      PayloadLayout::MakeStorage(ComputeBlockLayout(store_->layout()), 0, 3, 7, 14).total_bytes);
  EXPECT_EQ(store_->CheckInvariants(), "");
}

TEST_P(StorageFormatTest, BadScalesAndCodesAreRefusedAndChangeNothing) {
  const DType storage = std::get<0>(GetParam());
  const uint64_t n = 14;
  const uint64_t a = NewSeq();
  ASSERT_TRUE(Append(a, n, DType::kFp32, RandomFp32(n, 11), 4096).ok());
  const std::vector<uint8_t> good = Fetch(a, storage);
  const BlockLayout bl = ComputeBlockLayout(store_->layout());
  const PayloadLayout p = PayloadLayout::MakeStorage(bl, 0, 3, 0, n);

  const uint64_t b = NewSeq();
  const uint64_t used = store_->pool().Stats().used;
  std::vector<uint8_t> bad = good;
  const float nan = std::nanf("");
  std::memcpy(bad.data() + p.scale_offset[1], &nan, 4);  // layer 1's first scale
  absl::Status s = Append(b, n, storage, bad, 64);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("scale"), std::string::npos) << s;
  if (storage != DType::kInt8) {
    bad = good;
    bad[p.layer_offset[2] + 5] = 0x7f;  // NaN in both fp8 formats
    s = Append(b, n, storage, bad, 64);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("NaN"), std::string::npos) << s;
    // fp8 blocks carry one scale a head: a storage-format append must start a block.
    ASSERT_TRUE(Append(b, 3, DType::kFp32, RandomFp32(3, 12), 4096).ok());
    const std::vector<uint8_t> three =
        std::vector<uint8_t>(PayloadLayout::MakeStorage(bl, 0, 3, 3, 4).total_bytes, 0);
    s = Append(b, 4, storage, three, 64);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("block boundary"), std::string::npos) << s;
    EXPECT_EQ(store_->Get(b)->length, 3u);
  } else {
    EXPECT_EQ(store_->Get(b)->length, 0u);
    EXPECT_EQ(store_->pool().Stats().used, used);
  }
  EXPECT_EQ(store_->CheckInvariants(), "");
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, StorageFormatTest,
    testing::Combine(testing::Values(DType::kInt8, DType::kFp8E4M3, DType::kFp8E5M2),
                     testing::Values(AttentionKind::kGqa, AttentionKind::kMla)));

}  // namespace
}  // namespace kvbank
