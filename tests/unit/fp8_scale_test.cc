// fp8 block scales through SequenceStore (kernels/quant_math.h, Fp8GroupScale): the stored bytes
// of an append do not depend on how its payload is cut into writes; a prefill that fills a block
// gets that block's exact scale, so rows far smaller than their neighbours are not clipped; decode
// rows that outgrow a block's scale rescale it instead of saturating, on a private copy that an
// abort drops and a reader never sees. Runs on every test memory (tests/unit/test_memory.h).
// Shapes with odd sizes; seeds fixed and printed.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "tests/unit/quant_store_testing.h"

namespace kvbank {
namespace {

using namespace quant_testing;  // NOLINT: the test support of this file

struct Shape {
  const char* name;
  AttentionKind kind;
  uint32_t layers, kv_heads, head_dim, block_tokens;
};

// First the shape the defects these tests guard against showed on (1 layer, MHA, head_dim 48,
// blocks of 16), then odd GQA and MLA shapes.
const Shape kShapes[] = {
    {"mha-1x2x48-bt16", AttentionKind::kMha, 1, 2, 48, 16},
    {"gqa-2x3x5-bt7", AttentionKind::kGqa, 2, 3, 5, 7},
    {"mla-1x40-bt3", AttentionKind::kMla, 1, 1, 40, 3},
};

ModelLayout Model(const Shape& s, DType fp8, DType input) {
  ModelLayout m;
  m.name = absl::StrCat(s.name, "-", DTypeName(fp8), "-", DTypeName(input));
  m.kind = s.kind;
  m.num_layers = s.layers;
  m.block_tokens = s.block_tokens;
  m.num_kv_heads = s.kv_heads;
  m.num_q_heads = s.kind == AttentionKind::kGqa ? 2 * s.kv_heads : s.kv_heads;
  m.head_dim = m.head_dim_v = s.head_dim;
  if (s.kind == AttentionKind::kMla) {
    m.num_q_heads = 4;
    m.kv_lora_rank = s.head_dim - 8;
    m.rope_dim = 8;
    m.head_dim_v = m.kv_lora_rank;
  }
  m.input_dtype = input;
  m.layer_dtypes.assign(s.layers, fp8);
  return m;
}

// Uniform values; in every block rows [0, bt / 2) are 100x smaller than the rest (as in the
// report), and tokens from `grow` on are 1000x larger than those before.
Ref::Gen SmallThenLarge(uint32_t seed, uint32_t bt, uint64_t grow) {
  auto rng = std::make_shared<std::mt19937>(seed);
  return [rng, bt, grow](uint32_t, uint32_t, uint32_t, uint64_t t, uint32_t) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    return u(*rng) * (t % bt < bt / 2 ? 0.01f : 1.0f) * (t >= grow ? 1000.0f : 1.0f);
  };
}

// The worst an fp8 round trip may be off for x, given the scale that bounds the block's rows.
double Fp8Bound(DType fp8, double x, double scale) {
  x = std::fabs(x);
  return fp8 == DType::kFp8E4M3 ? x * 0x1p-4 + scale * 0x1p-10 + x * 0x1p-20
                                : x * 0x1p-3 + scale * 0x1p-17 + x * 0x1p-20;
}

// Scale of (layer l, kv, head h, sequence block b) in a storage-format fetch of the whole sequence.
float StoredScale(const BlockLayout& b, const PayloadLayout& p, const std::vector<uint8_t>& f,
                  uint32_t l, uint32_t kv, uint32_t h, uint64_t block) {
  const LayerView& v = b.layers[l];
  const uint64_t at =
      p.scale_offset[l - p.layer_begin] +
      ((uint64_t{kv} * v.num_kv_heads + h) * p.num_blocks + (block - p.first_block)) * 4;
  float s;
  std::memcpy(&s, f.data() + at, 4);
  return s;
}

// Every fp32-fetched element of the sequence within Fp8Bound of what was appended, the bound's
// scale being the block's stored scale times `slack` (2 covers rows requantized by a rescale:
// the scales a block had sum to at most twice its last). Returns how many were not.
size_t CountOutOfBounds(QuantStore& store, uint64_t id, const Ref& ref, double slack) {
  const ModelLayout& m = store.layout();
  const DType fp8 = m.layer_dtypes[0];
  const BlockLayout& b = store->pool().layout();
  const std::vector<uint8_t> got = store.Fetch(id, DType::kFp32);
  const std::vector<uint8_t> raw = store.Fetch(id, fp8);
  const PayloadLayout sp = PayloadLayout::MakeStorage(b, 0, m.num_layers, 0, ref.length());
  const float* f = reinterpret_cast<const float*>(got.data());
  size_t at = 0, bad = 0;
  for (uint32_t l = 0; l < m.num_layers; ++l) {
    for (uint32_t kv = 0; kv < ref.parts(); ++kv) {
      for (uint32_t h = 0; h < m.num_kv_heads; ++h) {
        for (uint64_t t = 0; t < ref.length(); ++t) {
          const double scale = StoredScale(b, sp, raw, l, kv, h, t / m.block_tokens) * slack;
          for (uint32_t i = 0; i < ref.Dim(kv); ++i, ++at) {
            const double x = ref.X(l, kv, h, t, i);
            const double err = std::fabs(double(f[at]) - x);
            if (!(err <= Fp8Bound(fp8, x, scale)) && ++bad <= 3) {
              ADD_FAILURE() << m.name << " layer " << l << (kv ? " V" : " K") << " head " << h
                            << " token " << t << " element " << i << ": appended " << x
                            << ", fetched " << f[at] << " (relative error " << err / std::fabs(x)
                            << ", block scale " << scale / slack << ")";
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(at * 4, got.size());
  return bad;
}

// The same appends written whole, in 2 KiB writes and in writes of 1, 7 and 333 bytes store the
// same bytes: prefills that start, fill and cross blocks, decode steps, and an append that
// continues a block with rows 1000x larger (a rescale).
TEST(Fp8Scale, StoredBytesDoNotDependOnWriteSizes) {
  constexpr uint32_t kSeed = 4711;
  std::printf("seed %u\n", kSeed);
  for (const Shape& shape : kShapes) {
    for (DType fp8 : {DType::kFp8E4M3, DType::kFp8E5M2}) {
      for (DType input : {DType::kFp32, DType::kBf16}) {
        const ModelLayout m = Model(shape, fp8, input);
        SCOPED_TRACE(m.name);
        ASSERT_EQ(ValidateLayout(m), "");
        QuantStore store(m, 256);
        const uint64_t bt = m.block_tokens;
        const uint64_t grow = 37 + 2 + 1;  // inside the 20-token append, which starts mid-block
        Ref ref(m);
        std::vector<std::pair<uint64_t, std::vector<uint8_t>>> appends;
        for (uint64_t n : {37, 1, 1, 20, 1, 1, 1}) {
          appends.push_back({n, ref.Add(n, SmallThenLarge(kSeed, bt, grow))});
        }
        std::vector<uint8_t> want;
        for (size_t chunk : {0, 2048, 1, 7, 333}) {
          SCOPED_TRACE(absl::StrCat("writes of ", chunk == 0 ? "the whole payload" : "",
                                    chunk == 0 ? "" : absl::StrCat(chunk, " bytes")));
          const uint64_t id = store.NewSeq();
          for (const auto& [n, payload] : appends) {
            const absl::Status s = store.Append(id, n, payload, chunk);
            ASSERT_TRUE(s.ok()) << s;
          }
          const std::vector<uint8_t> got = store.Fetch(id, fp8);
          if (want.empty()) {
            want = got;
            EXPECT_EQ(CountOutOfBounds(store, id, ref, 2.0), 0u);
          } else {
            ASSERT_EQ(got.size(), want.size());
            size_t first = 0;
            while (first < got.size() && got[first] == want[first]) ++first;
            EXPECT_EQ(first, got.size()) << "storage-format fetch differs from the whole-payload "
                                            "append's at byte "
                                         << first << " of " << got.size();
          }
          ASSERT_TRUE(store->Free(id).ok());
        }
        EXPECT_EQ(store->CheckInvariants(), "");
      }
    }
  }
}

// The report's reproduction: one append of 512 tokens, rows 0-7 of each 16-token block 100x
// smaller than rows 8-15, fetched back as fp32. Every block gets its exact scale (the append fills
// it) and every element is within the format's bound, sent whole or in 2 KiB writes.
TEST(Fp8Scale, PrefillWithSmallFirstRowsIsNotClipped) {
  constexpr uint32_t kSeed = 512;
  std::printf("seed %u\n", kSeed);
  for (DType fp8 : {DType::kFp8E4M3, DType::kFp8E5M2}) {
    const ModelLayout m = Model(kShapes[0], fp8, DType::kFp32);
    ASSERT_EQ(ValidateLayout(m), "");
    for (size_t chunk : {0, 2048}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(fp8), ", writes of ", chunk, " bytes (0: whole)"));
      QuantStore store(m, 64);
      const uint64_t id = store.NewSeq();
      Ref ref(m);
      ASSERT_TRUE(store.Append(id, 512, ref.Add(512, SmallThenLarge(kSeed, 16, 512)), chunk).ok());
      const std::vector<uint8_t> raw = store.Fetch(id, fp8);
      const BlockLayout& b = store->pool().layout();
      const PayloadLayout sp = PayloadLayout::MakeStorage(b, 0, 1, 0, 512);
      size_t inexact = 0;
      for (uint32_t kv = 0; kv < 2; ++kv) {
        for (uint32_t h = 0; h < m.num_kv_heads; ++h) {
          for (uint64_t blk = 0; blk < 32; ++blk) {
            float amax = 0;
            for (uint64_t t = blk * 16; t < blk * 16 + 16; ++t) {
              for (uint32_t i = 0; i < m.head_dim; ++i) {
                amax = std::max(amax, std::fabs(ref.X(0, kv, h, t, i)));
              }
            }
            const float got = StoredScale(b, sp, raw, 0, kv, h, blk);
            if (got != qmath::Fp8ScaleFor(amax, fp8) && ++inexact <= 3) {
              ADD_FAILURE() << (kv ? "V" : "K") << " head " << h << " block " << blk << ": scale "
                            << got << ", the block's exact scale is "
                            << qmath::Fp8ScaleFor(amax, fp8);
            }
          }
        }
      }
      EXPECT_EQ(inexact, 0u) << "blocks without their exact scale";
      EXPECT_EQ(CountOutOfBounds(store, id, ref, 1.0), 0u) << "elements out of bounds";
    }
  }
}

// Decode, one token per append, rows growing 1000x every 4 rows of a block: the block rescales and
// no row is clipped. An append that would rescale a block and is aborted leaves the block's bytes
// as they were, and a reader that opened while it was in flight reads them as they were too.
TEST(Fp8Scale, DecodeRowsThatOutgrowTheScaleRescaleTheBlock) {
  constexpr uint32_t kSeed = 1000;
  std::printf("seed %u\n", kSeed);
  for (const Shape& shape : kShapes) {
    for (DType fp8 : {DType::kFp8E4M3, DType::kFp8E5M2}) {
      const ModelLayout m = Model(shape, fp8, DType::kFp32);
      SCOPED_TRACE(m.name);
      ASSERT_EQ(ValidateLayout(m), "");
      QuantStore store(m, 64);
      const uint64_t bt = m.block_tokens;
      const uint64_t id = store.NewSeq();
      Ref ref(m);
      auto rng = std::make_shared<std::mt19937>(kSeed);
      auto gen = [rng, bt](double extra) -> Ref::Gen {
        return [rng, bt, extra](uint32_t, uint32_t, uint32_t, uint64_t t, uint32_t) {
          std::uniform_real_distribution<float> u(-1.0f, 1.0f);
          return float(u(*rng) * std::pow(1000.0, double(t % bt / 4)) * extra);
        };
      };
      const uint64_t n = 2 * bt + 2;
      for (uint64_t t = 0; t < n; ++t) {
        ASSERT_TRUE(store.Append(id, 1, ref.Add(1, gen(1.0)), 0).ok()) << "token " << t;
      }
      EXPECT_EQ(CountOutOfBounds(store, id, ref, 2.0), 0u) << "decode rows clipped";

      // Token n continues the last block (rows 0 and 1 there) with rows 1e6x larger.
      const std::vector<uint8_t> before = store.Fetch(id, fp8);
      Ref next = ref;
      const std::vector<uint8_t> payload = next.Add(1, gen(1e6));
      {
        auto txn = store->BeginAppend(MakeAppend(id, 1));
        ASSERT_TRUE(txn.ok()) << txn.status();
        auto reader = store->BeginFetch(MakeFetch(id, fp8));
        ASSERT_TRUE(reader.ok()) << reader.status();
        ASSERT_TRUE((*txn)->Write(payload).ok());
        std::vector<uint8_t> seen((*reader)->payload_bytes());
        ASSERT_TRUE((*reader)->Read(0, absl::MakeSpan(seen)).ok());
        EXPECT_TRUE(seen == before) << "a reader saw the rescale of an append in flight";
      }  // dropped: aborted
      EXPECT_TRUE(store.Fetch(id, fp8) == before) << "an aborted append changed the block";
      ASSERT_TRUE(store.Append(id, 1, payload, 0).ok());
      ref = next;
      EXPECT_EQ(CountOutOfBounds(store, id, ref, 2.0), 0u) << "rows clipped or lost by a rescale";
      EXPECT_EQ(store->CheckInvariants(), "");
    }
  }
}

// A rescale needs a block for the private copy: with the pool full the append fails with
// RESOURCE_EXHAUSTED and changes nothing; with a block free again the same append goes in.
TEST(Fp8Scale, RescaleWithThePoolFullFailsCleanly) {
  constexpr uint32_t kSeed = 77;
  std::printf("seed %u\n", kSeed);
  const ModelLayout m = Model(kShapes[0], DType::kFp8E4M3, DType::kFp32);
  QuantStore store(m, 4);
  const uint64_t a = store.NewSeq(), b = store.NewSeq();
  Ref ra(m), rb(m);
  ASSERT_TRUE(store.Append(a, 17, ra.Add(17, SmallThenLarge(kSeed, 16, 17)), 0).ok());
  ASSERT_TRUE(store.Append(b, 32, rb.Add(32, SmallThenLarge(kSeed + 1, 16, 32)), 0).ok());
  const std::vector<uint8_t> before = store.Fetch(a, DType::kFp8E4M3);
  Ref next = ra;
  const std::vector<uint8_t> payload = next.Add(1, SmallThenLarge(kSeed + 2, 16, 0));
  const absl::Status full = store.Append(a, 1, payload, 0);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_TRUE(store.Fetch(a, DType::kFp8E4M3) == before) << "a refused append changed the block";
  EXPECT_EQ(store->CheckInvariants(), "");
  ASSERT_TRUE(store->Free(b).ok());
  ASSERT_TRUE(store.Append(a, 1, payload, 0).ok());
  EXPECT_EQ(CountOutOfBounds(store, a, next, 2.0), 0u);
  EXPECT_EQ(store->CheckInvariants(), "");
}

}  // namespace
}  // namespace kvbank
