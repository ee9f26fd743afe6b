// Decode attention on the CPU: the kernel against the fp64 reference over odd context lengths
// (0, 1, 2, 17, 100, 1000), odd block sizes (1, 3, 16, 17), head dims 64 / 128 / 256 and MLA
// 576 / 512, GQA ratios 1 / 4 / 8, MQA, every storage dtype (blocks filled by the codecs, so both
// sides decode the same stored values), mixed-dtype batches, sliding windows with sinks, several
// thread counts (the context split and the merge), the probability sums, and the reference itself
// against a direct softmax of dequantized rows. Seeds are fixed and printed.
#include "kernels/attention.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/quant.h"
#include "kvbank/layout.h"
#include "tests/unit/attention_testing.h"

namespace kvbank::kernels {
namespace {

using testing::AllocOutputs;
using testing::AttnBatch;
using testing::AttnCase;
using testing::AttnOutputs;
using testing::ExpectMatches;
using testing::HostParams;
using testing::MakeBatch;
using testing::Tolerance;

constexpr uint64_t kSeed = 5005001;
using testing::ForEachSweepCase;
constexpr const auto& kAll = testing::kAllDTypes;

// Runs the reference and the CPU kernel (with and without probabilities) on one case.
void CheckCase(const AttnCase& c, uint64_t seed, uint32_t threads = 4) {
  const AttnBatch b = MakeBatch(c, seed);
  const std::string what =
      c.Name() + " seed " + std::to_string(seed) + " threads " + std::to_string(threads);
  AttnOutputs ref, got, got_np;
  AllocOutputs(c, true, &ref);
  AllocOutputs(c, true, &got);
  AllocOutputs(c, false, &got_np);
  DecodeAttentionParams pr = HostParams(c, b, &ref);
  ASSERT_EQ(ValidateDecodeAttention(pr), "") << what;
  DecodeAttentionReference(pr);
  DecodeAttentionCpu(HostParams(c, b, &got), threads);
  ExpectMatches(c, got, ref, Tolerance{}, what);
  DecodeAttentionCpu(HostParams(c, b, &got_np), threads);
  EXPECT_EQ(got_np.out, got.out) << what << ": token_probs changed the output";
  EXPECT_EQ(got_np.lse, got.lse) << what;
}

TEST(AttentionTest, SweepDtypesBlockSizesHeads) {
  std::printf("seed=%llu\n", static_cast<unsigned long long>(kSeed));
  ForEachSweepCase(kSeed, [&](const AttnCase& c, uint64_t seed) { CheckCase(c, seed); });
}

TEST(AttentionTest, Mla) {
  uint64_t seed = kSeed + 1000;
  std::printf("seed=%llu\n", static_cast<unsigned long long>(seed));
  for (DType d : kAll) {
    for (uint32_t bt : {1u, 3u, 16u, 17u}) {
      AttnCase c;
      c.dtype = d;
      c.mla = true;
      c.head_dim = 576;
      c.head_dim_v = 512;
      c.num_q_heads = 16;
      c.num_kv_heads = 1;
      c.block_tokens = bt;
      CheckCase(c, ++seed, 3);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(AttentionTest, SlidingWindowWithSinks) {
  uint64_t seed = kSeed + 2000;
  std::printf("seed=%llu\n", static_cast<unsigned long long>(seed));
  const uint32_t cfg[][2] = {{1, 0},   {5, 0},   {16, 4},   {64, 3},  {100, 1},
                             {999, 1}, {50, 60}, {1000, 8}, {4096, 4}};
  for (DType d : {DType::kFp16, DType::kInt8, DType::kFp8E4M3}) {
    for (const auto& wc : cfg) {
      for (uint32_t bt : {3u, 16u}) {
        AttnCase c;
        c.dtype = d;
        c.block_tokens = bt;
        c.window = wc[0];
        c.sinks = wc[1];
        c.lengths = {1, 2, 17, 100, 1000, 1500};
        CheckCase(c, ++seed);
        if (HasFatalFailure()) return;
      }
    }
  }
  // MLA with a window.
  AttnCase c;
  c.mla = true;
  c.head_dim = 576;
  c.head_dim_v = 512;
  c.num_q_heads = 8;
  c.num_kv_heads = 1;
  c.window = 33;
  c.sinks = 2;
  c.dtype = DType::kBf16;
  CheckCase(c, ++seed);
}

TEST(AttentionTest, MixedDtypesAndEmptyItems) {
  uint64_t seed = kSeed + 3000;
  std::printf("seed=%llu\n", static_cast<unsigned long long>(seed));
  for (DType d0 : {DType::kFp16, DType::kFp32}) {
    for (DType d1 : {DType::kInt8, DType::kFp8E5M2, DType::kBf16}) {
      AttnCase c;
      c.mixed = true;
      c.dtype0 = d0;
      c.dtype = d1;
      c.lengths = {0, 1000, 17, 0, 3, 2, 100};
      c.block_tokens = 17;
      CheckCase(c, ++seed);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(AttentionTest, ThreadCountsAndLongContexts) {
  uint64_t seed = kSeed + 4000;
  std::printf("seed=%llu\n", static_cast<unsigned long long>(seed));
  AttnCase c;
  c.dtype = DType::kInt8;
  c.num_q_heads = 8;
  c.num_kv_heads = 1;
  c.lengths = {5000, 1, 4097};
  for (uint32_t threads : {1u, 2u, 7u, 32u}) {
    CheckCase(c, seed, threads);
    if (HasFatalFailure()) return;
  }
}

// The reference against a direct computation from fully dequantized K / V (the codecs'
// DequantizeInt8Rows), for one head: checks that the paged view reads the right rows.
TEST(AttentionTest, ReferenceMatchesDenseSoftmax) {
  AttnCase c;
  c.dtype = DType::kInt8;
  c.num_q_heads = 2;
  c.num_kv_heads = 1;
  c.block_tokens = 3;
  c.lengths = {10};
  const AttnBatch b = MakeBatch(c, kSeed + 5000);
  AttnOutputs ref;
  AllocOutputs(c, true, &ref);
  DecodeAttentionReference(HostParams(c, b, &ref));
  const LayerView& v = b.layers[0];
  std::vector<double> s(10);
  double mx = -1e300, sum = 0;
  std::vector<float> k(128), vv(128);
  for (uint32_t t = 0; t < 10; ++t) {
    const uint8_t* blk = b.pool.data() + size_t(b.indices[t / 3]) * b.layout.block_bytes;
    DequantizeInt8Rows(blk + v.KRow(0, t % 3),
                       reinterpret_cast<const float*>(blk + v.Int8Scale(0, 0, t % 3)),
                       blk + v.Int8ZeroPoint(0, 0, t % 3), 1, 128, k.data(), DType::kFp32);
    double dot = 0;
    for (int i = 0; i < 128; ++i) dot += double(b.q[128 + i]) * k[i];  // q head 1
    s[t] = dot / std::sqrt(128.0);
    mx = std::max(mx, s[t]);
  }
  for (double x : s) sum += std::exp(x - mx);
  std::vector<double> out(128, 0.0);
  for (uint32_t t = 0; t < 10; ++t) {
    const uint8_t* blk = b.pool.data() + size_t(b.indices[t / 3]) * b.layout.block_bytes;
    DequantizeInt8Rows(blk + v.VRow(0, t % 3),
                       reinterpret_cast<const float*>(blk + v.Int8Scale(1, 0, t % 3)),
                       blk + v.Int8ZeroPoint(1, 0, t % 3), 1, 128, vv.data(), DType::kFp32);
    for (int i = 0; i < 128; ++i) out[i] += std::exp(s[t] - mx) / sum * vv[i];
  }
  for (int i = 0; i < 128; ++i) EXPECT_NEAR(ref.out[128 + i], out[i], 1e-6) << i;
  EXPECT_NEAR(ref.lse[1], mx + std::log(sum), 1e-6);
}

TEST(AttentionTest, ValidateNamesTheField) {
  AttnCase c;
  c.lengths = {5};
  const AttnBatch b = MakeBatch(c, kSeed + 6000);
  AttnOutputs o;
  AllocOutputs(c, false, &o);
  DecodeAttentionParams p = HostParams(c, b, &o);
  EXPECT_EQ(ValidateDecodeAttention(p), "");
  DecodeAttentionParams bad = p;
  bad.num_q_heads = 3;
  EXPECT_NE(ValidateDecodeAttention(bad).find("num_q_heads"), std::string::npos);
  bad = p;
  bad.head_dim = 256;
  EXPECT_NE(ValidateDecodeAttention(bad).find("layers"), std::string::npos);
  bad = p;
  bad.sm_scale = 0;
  EXPECT_NE(ValidateDecodeAttention(bad).find("sm_scale"), std::string::npos);
  std::vector<uint32_t> long_len = {17};  // one block of 16 holds 16 tokens
  bad = p;
  bad.kv.lengths = long_len.data();
  EXPECT_NE(ValidateDecodeAttention(bad).find("lengths"), std::string::npos);
}

TEST(AttentionTest, AttendSpan) {
  AttendSpan s = MakeAttendSpan(10, 0, 3);
  EXPECT_EQ(s.Count(), 10u);
  s = MakeAttendSpan(10, 4, 2);  // 0 1 | 6 7 8 9
  EXPECT_EQ(s.Count(), 6u);
  EXPECT_EQ(s.Position(1), 1u);
  EXPECT_EQ(s.Position(2), 6u);
  EXPECT_TRUE(s.Attends(0));
  EXPECT_FALSE(s.Attends(2));
  EXPECT_TRUE(s.Attends(9));
  s = MakeAttendSpan(10, 4, 8);  // sinks reach the window: everything
  EXPECT_EQ(s.Count(), 10u);
  s = MakeAttendSpan(0, 4, 8);
  EXPECT_EQ(s.Count(), 0u);
}

}  // namespace
}  // namespace kvbank::kernels
