// The whole-payload codec (EncodePayloadCpu / DecodePayloadCpu) against the server's streaming
// RowCodec given the whole payload in one call: the same pool bytes after every transfer, the same
// payload bytes back. Sweeps int8, fp8 e4m3 / e5m2, the element conversions and a mixed layout;
// GQA, MQA and MLA; payloads at 0, on a block boundary and mid-block (after an earlier transfer
// set the block's scales). Also the fp8 scale rule spelled out, and row copies (CopyRowsCpu) that
// move rows between blocks against a byte-by-byte expectation (the fork's list:
// block_copy_test).
#include "kernels/payload_codec.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "gtest/gtest.h"
#include "kernels/block_copy.h"
#include "kernels/quant.h"
#include "kvbank/layout.h"
#include "server/core/row_codec.h"
#include "tests/unit/payload_codec_testing.h"

namespace kvbank::kernels {
namespace {

using testing::CodecCase;
using testing::CodecCases;
using testing::CodecMap;
using testing::CodecPayload;
using testing::CodecPool;
using testing::CodecShape;
using testing::MakeCodecPool;

constexpr uint64_t kSeed = 20250316;

// "block B byte O (layer L K|V|scales)" of the first byte where a and b differ; "" if none.
std::string FirstDiff(const BlockLayout& b, const std::vector<uint8_t>& x,
                      const std::vector<uint8_t>& y) {
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    if (x[i] == y[i]) continue;
    const uint64_t off = i % b.block_bytes;
    std::string where = "padding";
    for (uint32_t l = 0; l < b.num_layers(); ++l) {
      const LayerView& v = b.layers[l];
      if (off < v.k_offset || off >= v.scale_offset + v.scale_bytes) continue;
      const char* part =
          off >= v.scale_offset ? "scales" : (v.has_v && off >= v.v_offset ? "V" : "K");
      where = "layer " + std::to_string(l) + " " + part;
    }
    return "block " + std::to_string(i / b.block_bytes) + " byte " + std::to_string(off) + " (" +
           where + "): " + std::to_string(x[i]) + " vs " + std::to_string(y[i]);
  }
  return x.size() == y.size() ? "" : "sizes differ";
}

// The transfers a case makes: [0, pos) first when pos > 0, then [pos, pos + n).
std::vector<std::pair<uint64_t, uint64_t>> Transfers(const CodecCase& c) {
  std::vector<std::pair<uint64_t, uint64_t>> t;
  if (c.pos > 0) t.push_back({0, c.pos});
  t.push_back({c.pos, c.n});
  return t;
}

// Decoding returns the payload exactly when every layer stores the wire dtype or fp32.
bool Lossless(const CodecCase& c) {
  for (uint32_t l = c.l0; l < c.l1; ++l) {
    const DType d = c.layout.layer_dtypes[l];
    if (d != c.wire && d != DType::kFp32) return false;
  }
  return true;
}

TEST(PayloadCodecTest, MatchesRowCodecWholePayload) {
  std::printf("seed=%llu\n", static_cast<unsigned long long>(kSeed));
  std::mt19937_64 rng(kSeed);
  int cases = 0;
  for (const CodecCase& c : CodecCases()) {
    SCOPED_TRACE(c.Describe());
    ASSERT_EQ(ValidateLayout(c.layout), "");
    const CodecPool p = MakeCodecPool(c, rng);
    std::vector<uint8_t> pool_row = p.bytes, pool_ker = p.bytes;
    std::vector<uint8_t> last_payload;
    for (auto [pos, n] : Transfers(c)) {
      SCOPED_TRACE("transfer [" + std::to_string(pos) + ", " + std::to_string(pos + n) + ")");
      const PayloadLayout pl = PayloadLayout::Make(p.b, c.l0, c.l1, n, c.wire);
      const std::vector<uint8_t> payload = CodecPayload(p.b, pl, c.wire, rng);
      ASSERT_EQ(payload.size(), pl.total_bytes);
      RowCodec codec(p.b, pl, c.wire, pool_row.data(), p.table.data(), pos);
      codec.SetMakePrivate([](uint64_t) { return absl::OkStatus(); });  // no reader here
      const absl::Status written = codec.Write(0, payload);
      ASSERT_TRUE(written.ok()) << written;
      const PayloadMap m = CodecMap(p, pl, pos, pool_ker.data(), p.b.layers.data() + c.l0,
                                    pl.layer_offset.data(), p.table.data());
      EncodePayloadCpu(m, c.wire, payload.data());
      ASSERT_EQ(FirstDiff(p.b, pool_row, pool_ker), "") << "EncodePayloadCpu differs from RowCodec";
      last_payload = payload;
    }
    // Spare blocks (not in the table) are untouched.
    for (uint64_t blk = 0; blk < p.physical; ++blk) {
      if (std::find(p.table.begin(), p.table.end(), int32_t(blk)) != p.table.end()) continue;
      ASSERT_TRUE(std::equal(pool_ker.begin() + blk * p.b.block_bytes,
                             pool_ker.begin() + (blk + 1) * p.b.block_bytes,
                             p.bytes.begin() + blk * p.b.block_bytes))
          << "spare block " << blk << " written";
    }
    // Decode the last transfer's range and the whole sequence, against RowCodec::Read.
    for (auto [pos, n] : {std::pair<uint64_t, uint64_t>{c.pos, c.n}, {0, c.pos + c.n}}) {
      SCOPED_TRACE("decode [" + std::to_string(pos) + ", " + std::to_string(pos + n) + ")");
      const PayloadLayout pl = PayloadLayout::Make(p.b, c.l0, c.l1, n, c.wire);
      std::vector<uint8_t> want(pl.total_bytes, 0x5A), got(pl.total_bytes, 0xA5);
      RowCodec codec(p.b, pl, c.wire, pool_row.data(), p.table.data(), pos);
      codec.Read(0, absl::MakeSpan(want));
      const PayloadMap m = CodecMap(p, pl, pos, pool_ker.data(), p.b.layers.data() + c.l0,
                                    pl.layer_offset.data(), p.table.data());
      DecodePayloadCpu(m, c.wire, got.data());
      ASSERT_TRUE(got == want) << "DecodePayloadCpu differs from RowCodec::Read";
      if (pos == c.pos && Lossless(c)) {
        ASSERT_TRUE(got == last_payload) << "a lossless storage did not return the payload";
      }
    }
    ASSERT_TRUE(pool_ker == pool_row) << "decoding wrote to the pool";
    ++cases;
  }
  EXPECT_GT(cases, 300);
}

// The fp8 scale rule, computed here from the values: a block's scale is set by the transfer that
// holds its row 0, from that head's rows in it, with 4x headroom when they are fewer than a block;
// a later transfer into the block keeps it while it covers the new rows, else doubles it until it
// reaches the new rows' scale (with headroom while the block is not full) and requantizes the rows
// already there, which then decode to the same values. RowCodec stores the same bytes.
TEST(PayloadCodecTest, Fp8ScaleRule) {
  std::mt19937_64 rng(kSeed + 1);
  for (DType fp8 : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    const ModelLayout layout = CodecShape(AttentionKind::kGqa, 2, 8, 16, {fp8});
    ASSERT_EQ(ValidateLayout(layout), "");
    const BlockLayout b = ComputeBlockLayout(layout);
    const LayerView& v = b.layers[0];
    std::vector<uint8_t> pool(4 * b.block_bytes, 0), pool_row(pool.size(), 0);
    const std::vector<int32_t> table = {2, 0, 3};
    auto scale_of = [&](int32_t blk, uint32_t kv, uint32_t h) {
      float s;
      std::memcpy(&s, pool.data() + blk * b.block_bytes + v.Fp8Scale(kv, h), 4);
      return s;
    };
    // Max |x| of head h's part kv over payload tokens [t0, t1) (wire fp32).
    auto amax = [&](const PayloadLayout& pl, const std::vector<uint8_t>& payload, uint32_t kv,
                    uint32_t h, uint64_t t0, uint64_t t1) {
      const float* f = reinterpret_cast<const float*>(payload.data());
      const uint64_t part = kv * uint64_t{v.num_kv_heads} * pl.num_tokens * v.head_dim;
      float m = 0.0f;
      for (uint64_t t = t0; t < t1; ++t) {
        for (uint32_t i = 0; i < v.head_dim; ++i) {
          m = std::max(m, std::fabs(f[part + (h * pl.num_tokens + t) * v.head_dim + i]));
        }
      }
      return m;
    };
    auto transfer = [&](uint64_t pos, uint64_t n, float sigma = 3.0f) {
      const PayloadLayout pl = PayloadLayout::Make(b, 0, 1, n, DType::kFp32);
      std::vector<float> values(pl.total_bytes / 4);
      std::normal_distribution<float> gauss(0.0f, sigma);
      for (float& x : values) x = gauss(rng);
      std::vector<uint8_t> payload(pl.total_bytes);
      std::memcpy(payload.data(), values.data(), payload.size());
      PayloadMap m;
      m.pool = pool.data();
      m.block_bytes = b.block_bytes;
      m.layers = b.layers.data();
      m.layer_offset = pl.layer_offset.data();
      m.num_layers = 1;
      m.block_table = table.data();
      m.token_begin = pos;
      m.num_tokens = n;
      m.total_bytes = pl.total_bytes;
      EncodePayloadCpu(m, DType::kFp32, payload.data());
      RowCodec codec(b, pl, DType::kFp32, pool_row.data(), table.data(), pos);
      codec.SetMakePrivate([](uint64_t) { return absl::OkStatus(); });  // no reader here
      for (size_t at = 0; at < payload.size(); at += 100) {  // in pieces: no effect on the bytes
        const size_t len = std::min<size_t>(100, payload.size() - at);
        EXPECT_TRUE(codec.Write(at, absl::MakeConstSpan(payload.data() + at, len)).ok());
      }
      EXPECT_EQ(FirstDiff(b, pool_row, pool), "") << "RowCodec differs from EncodePayloadCpu";
      return std::make_pair(pl, payload);
    };
    // Block `blk`'s rows [0, rows) of (kv, h) as fp32.
    auto decoded = [&](int32_t blk, uint32_t kv, uint32_t h, uint32_t rows) {
      std::vector<float> out(rows * v.head_dim);
      const uint8_t* block = pool.data() + blk * b.block_bytes;
      DecodeFp8(block + (kv == 0 ? v.KRow(h, 0) : v.VRow(h, 0)), fp8, out.size(),
                scale_of(blk, kv, h), out.data(), DType::kFp32);
      return out;
    };
    // Tokens [0, 5): block 0 row 0 with 5 rows -> headroom.
    const auto [pl1, p1] = transfer(0, 5);
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t h = 0; h < 2; ++h) {
        EXPECT_EQ(scale_of(2, kv, h), Fp8ScaleFor(4.0f * amax(pl1, p1, kv, h, 0, 5), fp8));
      }
    }
    std::vector<float> kept(4);
    for (uint32_t i = 0; i < 4; ++i) kept[i] = scale_of(2, i / 2, i % 2);
    // Tokens [5, 41): block 0 keeps its scale; block 1 (16 rows) none; block 2 (9 rows) headroom.
    const auto [pl2, p2] = transfer(5, 36);
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t h = 0; h < 2; ++h) {
        EXPECT_EQ(scale_of(2, kv, h), kept[kv * 2 + h]);
        EXPECT_EQ(scale_of(0, kv, h), Fp8ScaleFor(amax(pl2, p2, kv, h, 11, 27), fp8));
        EXPECT_EQ(scale_of(3, kv, h), Fp8ScaleFor(4.0f * amax(pl2, p2, kv, h, 27, 36), fp8));
      }
    }
    // Tokens [41, 44): block 2 (rows 9..11) with values 1000x larger: rescaled by a power of two.
    for (uint32_t i = 0; i < 4; ++i) kept[i] = scale_of(3, i / 2, i % 2);
    std::vector<std::vector<float>> before;
    for (uint32_t i = 0; i < 4; ++i) before.push_back(decoded(3, i / 2, i % 2, 9));
    const auto [pl3, p3] = transfer(41, 3, 3000.0f);
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t h = 0; h < 2; ++h) {
        const float want = Fp8ScaleFor(4.0f * amax(pl3, p3, kv, h, 0, 3), fp8);
        const float got = scale_of(3, kv, h);
        ASSERT_GT(want, kept[kv * 2 + h]) << "the new rows must outgrow the scale";
        EXPECT_GE(got, want);
        EXPECT_LT(got / 2, want) << "the smallest doubling that reaches it";
        int e = 0;
        EXPECT_EQ(std::frexp(got / kept[kv * 2 + h], &e), 0.5f) << "a power-of-two ratio";
        // Earlier rows keep their values exactly unless they fall below the normal range of the
        // new scale, where they round to its subnormal step.
        const bool e4 = fp8 == DType::kFp8E4M3;
        const double normal = got * (e4 ? 0x1p-6 : 0x1p-14),
                     half_step = got * (e4 ? 0x1p-10 : 0x1p-17);
        const std::vector<float> after = decoded(3, kv, h, 9);
        for (size_t i = 0; i < after.size(); ++i) {
          const float x = before[kv * 2 + h][i];
          if (std::fabs(x) >= normal) {
            EXPECT_EQ(after[i], x) << "row " << i / v.head_dim << " element " << i % v.head_dim;
          } else {
            // Ties are likely: x is on the old, finer grid.
            EXPECT_LE(std::fabs(double(after[i]) - x), half_step * (1 + 0x1p-20))
                << "row " << i / v.head_dim;
          }
        }
      }
    }
  }
}

TEST(PayloadCodecTest, EmptyPayloadAndBadWireDoNothing) {
  std::mt19937_64 rng(kSeed + 2);
  const CodecCase c{
      "int8", CodecShape(AttentionKind::kGqa, 2, 4, 3, {DType::kInt8}), DType::kFp16, 0, 1, 1, 4};
  const CodecPool p = MakeCodecPool(c, rng);
  std::vector<uint8_t> pool = p.bytes;
  const PayloadLayout pl = PayloadLayout::Make(p.b, 0, 1, c.n, c.wire);
  std::vector<uint8_t> payload = CodecPayload(p.b, pl, c.wire, rng);
  PayloadMap m = CodecMap(p, pl, c.pos, pool.data(), p.b.layers.data(), pl.layer_offset.data(),
                          p.table.data());
  EncodePayloadCpu(m, DType::kInt8, payload.data());  // not a wire dtype
  EXPECT_TRUE(pool == p.bytes);
  const std::vector<uint8_t> before = payload;
  DecodePayloadCpu(m, DType::kFp8E4M3, payload.data());
  EXPECT_TRUE(payload == before);
  m.num_tokens = 0;
  EncodePayloadCpu(m, c.wire, payload.data());
  DecodePayloadCpu(m, c.wire, payload.data());
  EXPECT_TRUE(pool == p.bytes);
  EXPECT_TRUE(payload == before);
}

std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, uint64_t n) {
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = static_cast<uint8_t>(rng());
  return v;
}

const std::vector<DType> kAllDTypes = {DType::kFp16, DType::kInt8, DType::kFp8E5M2,
                                       DType::kFp32, DType::kBf16, DType::kFp8E4M3};

std::vector<ModelLayout> CopyShapes(uint32_t bt) {
  std::vector<ModelLayout> out;
  for (uint32_t hd : {1u, 3u, 72u}) {
    out.push_back(CodecShape(AttentionKind::kGqa, 3, hd, bt, kAllDTypes));
    out.push_back(CodecShape(AttentionKind::kMqa, 1, hd, bt, kAllDTypes));
    out.push_back(CodecShape(AttentionKind::kMla, 1, hd + 2, bt, kAllDTypes));
  }
  return out;
}

// Rows moved to other rows of other blocks, in shuffled order, against an expectation built one
// byte at a time from the pool before the copies; every other byte unchanged.
TEST(PayloadCodecTest, CopyRowsPermutationMatchesReference) {
  std::printf("seed=%llu\n", static_cast<unsigned long long>(kSeed + 4));
  std::mt19937_64 rng(kSeed + 4);
  for (uint32_t bt : {1u, 3u, 7u, 17u}) {
    for (const ModelLayout& m : CopyShapes(bt)) {
      const BlockLayout b = ComputeBlockLayout(m);
      SCOPED_TRACE(LayoutFingerprint(m));
      const int32_t blocks = 7;
      const std::vector<uint8_t> before = RandomBytes(rng, blocks * b.block_bytes);
      const std::vector<RowCopy> copies = testing::PermutationCopies(b, blocks, rng);
      std::vector<uint8_t> want = before;
      for (const RowCopy& c : copies) {
        const LayerView& v = b.layers[c.layer];
        const uint64_t s = c.src_block * b.block_bytes, d = c.dst_block * b.block_bytes;
        auto move = [&](uint64_t to, uint64_t from, uint64_t n) {
          for (uint64_t i = 0; i < n; ++i) want[d + to + i] = before[s + from + i];
        };
        for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
          move(v.KRow(h, c.dst_row), v.KRow(h, c.src_row), v.KRowBytes());
          if (v.has_v) move(v.VRow(h, c.dst_row), v.VRow(h, c.src_row), v.VRowBytes());
          for (uint32_t kv = 0; kv < v.KvParts(); ++kv) {
            if (v.dtype == DType::kInt8) {
              move(v.Int8Scale(kv, h, c.dst_row), v.Int8Scale(kv, h, c.src_row), 4);
              move(v.Int8ZeroPoint(kv, h, c.dst_row), v.Int8ZeroPoint(kv, h, c.src_row), 1);
            } else if (v.dtype == DType::kFp8E4M3 || v.dtype == DType::kFp8E5M2) {
              move(v.Fp8Scale(kv, h), v.Fp8Scale(kv, h), 4);
            }
          }
        }
      }
      std::vector<uint8_t> got = before;
      CopyRowsCpu(got.data(), b.block_bytes, b.layers.data(), copies.data(), copies.size());
      ASSERT_EQ(FirstDiff(b, want, got), "");
      CopyRowsCpu(got.data(), b.block_bytes, b.layers.data(), copies.data(), 0);
      ASSERT_TRUE(got == want);
    }
  }
}

}  // namespace
}  // namespace kvbank::kernels
