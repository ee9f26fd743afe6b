// Fetches of some KV heads only (what one tensor-parallel rank of a decode engine pulls): for every
// storage dtype, converted and as stored, over token and layer ranges, by sequence and by block
// hash, each row and scale of a head-range payload equals the same head's row and scale in the
// full payload, and the payload is exactly the size of that many heads. An MLA model's one latent
// head is read whole by any range; bad ranges are refused. Seeds are fixed.
#include <cstdio>
#include <optional>
#include <tuple>
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

ModelLayout Layout(DType storage, AttentionKind kind) {
  if (kind == AttentionKind::kMla) {
    return store_testing::MlaLayout("tp", 3, 32, 8, 5, storage, DType::kFp32);
  }
  return store_testing::GqaLayout("tp", 3, 4, 24, 5, storage, DType::kFp32);
}

class HeadRangeTest : public testing::TestWithParam<DType> {
 protected:
  void SetUp() override { Make(AttentionKind::kGqa); }
  void Make(AttentionKind kind) {
    m_ = Layout(GetParam(), kind);
    b_ = ComputeBlockLayout(m_);
    StoreOptions o;
    o.default_lease = absl::ZeroDuration();
    auto store = testenv::CreateTestStore(m_, 128, o);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }

  // A sequence of 23 tokens (one append) plus 3 one-token appends, fed fp32, with token ids so
  // that its full blocks are published.
  uint64_t Fill() {
    CreateOptions c;
    auto seq = store_->Create(c);
    EXPECT_TRUE(seq.ok()) << seq.status();
    uint32_t seed = 7;
    for (uint64_t n : {23, 1, 1, 1}) {
      AppendSpec a;
      a.sequence_id = seq->id;
      a.num_tokens = n;
      a.dtype = DType::kFp32;
      for (uint64_t i = 0; i < n; ++i) a.token_ids.push_back(uint32_t(100 + ids_++));
      const auto payload = RandomFp32(
          PayloadLayout::Make(b_, 0, m_.num_layers, n, DType::kFp32).total_bytes, seed++);
      EXPECT_TRUE(store_->Append(a, payload).ok());
    }
    return seq->id;
  }

  absl::StatusOr<std::vector<uint8_t>> Read(absl::StatusOr<std::unique_ptr<FetchReader>> r) {
    if (!r.ok()) return r.status();
    std::vector<uint8_t> out((*r)->payload_bytes());
    if (absl::Status s = (*r)->Read(0, absl::MakeSpan(out)); !s.ok()) return s;
    return out;
  }

  absl::StatusOr<std::vector<uint8_t>> Fetch(uint64_t id, std::optional<DType> dtype, uint32_t h0,
                                             std::optional<uint32_t> h1, uint32_t l0 = 0,
                                             std::optional<uint32_t> l1 = {}, uint64_t t0 = 0,
                                             std::optional<uint64_t> t1 = {}) {
    FetchSpec f;
    f.sequence_id = id;
    f.dtype = dtype;
    f.kv_head_begin = h0;
    f.kv_head_end = h1;
    f.layer_begin = l0;
    f.layer_end = l1;
    f.token_begin = t0;
    f.token_end = t1;
    return Read(store_->BeginFetch(f));
  }

  // Every row and scale of heads [h0, h0 + n) of `full` (made from the pool's layout) equals the
  // same head's in `part` (made from the layout narrowed to those heads).
  void ExpectSlice(const std::vector<uint8_t>& full, const std::vector<uint8_t>& part,
                   const PayloadLayout& pf, const PayloadLayout& pp, uint32_t h0, uint32_t n) {
    const BlockLayout nb = b_.Heads(h0, n);
    ASSERT_EQ(part.size(), pp.total_bytes);
    uint64_t compared = 0;
    for (uint32_t l = pf.layer_begin; l < pf.layer_end; ++l) {
      const LayerView& v = b_.layers[l];
      for (uint32_t kv = 0; kv < v.KvParts(); ++kv) {
        const uint64_t row = pf.RowBytes(b_, l, kv);
        ASSERT_EQ(row, pp.RowBytes(nb, l, kv));
        for (uint32_t i = 0; i < n; ++i) {
          for (uint64_t t = 0; t < pf.num_tokens; ++t) {
            const uint64_t a = pf.RowOffset(b_, l, kv, h0 + i, t);
            const uint64_t c = pp.RowOffset(nb, l, kv, i, t);
            ASSERT_EQ(std::memcmp(full.data() + a, part.data() + c, row), 0)
                << "layer " << l << " kv " << kv << " head " << h0 + i << " token " << t;
            compared += row;
            if (!pf.storage_format()) continue;
            if (v.dtype == DType::kInt8) {
              ASSERT_EQ(std::memcmp(full.data() + pf.Int8ScaleOffset(b_, l, kv, h0 + i, t),
                                    part.data() + pp.Int8ScaleOffset(nb, l, kv, i, t), 4),
                        0);
              ASSERT_EQ(full[pf.Int8ZeroPointOffset(b_, l, kv, h0 + i, t)],
                        part[pp.Int8ZeroPointOffset(nb, l, kv, i, t)]);
              compared += 5;
            }
          }
          if (pf.storage_format() && v.dtype != DType::kInt8) {
            for (uint64_t blk = pf.first_block; blk < pf.first_block + pf.num_blocks; ++blk) {
              ASSERT_EQ(std::memcmp(full.data() + pf.Fp8ScaleOffset(b_, l, kv, h0 + i, blk),
                                    part.data() + pp.Fp8ScaleOffset(nb, l, kv, i, blk), 4),
                        0);
              compared += 4;
            }
          }
        }
      }
    }
    EXPECT_EQ(compared, pp.total_bytes) << "the head-range payload holds bytes not compared";
  }

  ModelLayout m_;
  BlockLayout b_;
  std::unique_ptr<SequenceStore> store_;
  uint64_t ids_ = 0;
};

TEST_P(HeadRangeTest, EachHeadRangeIsTheSliceOfTheFullPayload) {
  const uint64_t id = Fill();
  const DType stored = GetParam();
  std::vector<std::optional<DType>> dtypes = {DType::kFp32, stored};
  for (std::optional<DType> dtype : dtypes) {
    for (auto [h0, h1] :
         std::vector<std::pair<uint32_t, uint32_t>>{{0, 1}, {1, 3}, {3, 4}, {2, 4}}) {
      for (auto [l0, l1, t0, t1] : std::vector<std::tuple<uint32_t, uint32_t, uint64_t, uint64_t>>{
               {0, 3, 0, 26}, {1, 3, 5, 21}}) {
        SCOPED_TRACE(absl::StrCat(DTypeName(*dtype), " heads [", h0, ", ", h1, ") layers [", l0,
                                  ", ", l1, ") tokens [", t0, ", ", t1, ")"));
        const bool storage = IsQuantized(*dtype);
        auto full = Fetch(id, dtype, 0, std::nullopt, l0, l1, t0, t1);
        ASSERT_TRUE(full.ok()) << full.status();
        auto part = Fetch(id, dtype, h0, h1 == 4 && h0 == 2 ? std::optional<uint32_t>() : h1, l0,
                          l1, t0, t1);
        ASSERT_TRUE(part.ok()) << part.status();
        const uint64_t n = t1 - t0;
        const BlockLayout nb = b_.Heads(h0, h1 - h0);
        const PayloadLayout pf =
            storage ? PayloadLayout::MakeStorage(b_, l0, l1, t0, n)
                    : PayloadLayout::Make(b_, l0, l1, n, *dtype == stored ? std::nullopt : dtype);
        const PayloadLayout pp =
            storage ? PayloadLayout::MakeStorage(nb, l0, l1, t0, n)
                    : PayloadLayout::Make(nb, l0, l1, n, *dtype == stored ? std::nullopt : dtype);
        ASSERT_EQ(full->size(), pf.total_bytes);
        ASSERT_NO_FATAL_FAILURE(ExpectSlice(*full, *part, pf, pp, h0, h1 - h0));
      }
    }
  }
}

TEST_P(HeadRangeTest, FetchBlocksTakesAHeadRange) {
  ASSERT_NE(Fill(), 0u);  // publishes blocks 0..4 (tokens 0..24 with ids 100..124)
  std::vector<uint32_t> prompt;
  for (uint32_t t = 0; t < 20; ++t) prompt.push_back(100 + t);
  const std::vector<BlockHash> hashes = PrefixHashes(
      store_->options().hash, store_->prefix().Root("", ""), prompt, m_.block_tokens, {});
  auto full = Read(store_->prefix().FetchBlocks("", hashes, 0, std::nullopt, DType::kFp32));
  ASSERT_TRUE(full.ok()) << full.status();
  auto part = Read(store_->prefix().FetchBlocks("", hashes, 0, std::nullopt, DType::kFp32, 1, 3));
  ASSERT_TRUE(part.ok()) << part.status();
  const PayloadLayout pf = PayloadLayout::Make(b_, 0, 3, 20, DType::kFp32);
  const PayloadLayout pp = PayloadLayout::Make(b_.Heads(1, 2), 0, 3, 20, DType::kFp32);
  ASSERT_NO_FATAL_FAILURE(ExpectSlice(*full, *part, pf, pp, 1, 2));
}

TEST_P(HeadRangeTest, BadRangesAreRefusedAndMlaReadsItsLatentHeadWhole) {
  const uint64_t id = Fill();
  for (auto [h0, h1] : std::vector<std::pair<uint32_t, std::optional<uint32_t>>>{
           {2, 2}, {3, 9}, {5, std::nullopt}, {4, std::nullopt}}) {
    auto r = Fetch(id, DType::kFp32, h0, h1);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(r.status().message(), "kv head range")) << r.status();
  }
  Make(AttentionKind::kMla);
  const uint64_t mla = Fill();
  auto whole = Fetch(mla, DType::kFp32, 0, std::nullopt);
  ASSERT_TRUE(whole.ok()) << whole.status();
  for (auto [h0, h1] : std::vector<std::pair<uint32_t, uint32_t>>{{0, 1}, {1, 2}}) {
    auto r = Fetch(mla, DType::kFp32, h0, h1);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(*r, *whole) << "rank range [" << h0 << ", " << h1 << ") of an MLA model";
  }
}

INSTANTIATE_TEST_SUITE_P(Storage, HeadRangeTest,
                         testing::Values(DType::kFp16, DType::kBf16, DType::kInt8, DType::kFp8E4M3),
                         [](const testing::TestParamInfo<DType>& i) {
                           return std::string(DTypeName(i.param));
                         });

}  // namespace
}  // namespace kvbank
