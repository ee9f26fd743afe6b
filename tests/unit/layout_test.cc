// Tests of the one layout function: preset offsets against hand-computed numbers, a sweep of odd
// shapes against a reference written from the header comment, validation and fingerprints.
#include "kvbank/layout.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace kvbank {
namespace {

constexpr DType kAllDTypes[] = {DType::kFp32, DType::kFp16,    DType::kBf16,
                                DType::kInt8, DType::kFp8E4M3, DType::kFp8E5M2};

ModelLayout Preset(const std::string& name, DType storage = DType::kBf16) {
  ModelLayout m;
  EXPECT_TRUE(PresetLayout(name, &m, storage)) << name;
  return m;
}

// Hand-computed numbers for every preset, bf16 storage, 16 tokens per block.
struct PresetExpect {
  const char* name;
  uint32_t layers;
  uint64_t k_part;        // kv_heads * 16 * head_dim * 2
  uint64_t layer_stride;  // K + V (MLA: K only); every part already a multiple of 16
  uint64_t block_bytes;
  uint64_t payload_per_token;
};
const PresetExpect kPresetExpect[] = {
    {"llama-3.1-8b", 32, 8 * 16 * 128 * 2, 65536, 32 * 65536, 32 * 8 * 256 * 2},
    {"llama-3-70b", 80, 8 * 16 * 128 * 2, 65536, 80 * 65536, 80 * 8 * 256 * 2},
    {"qwen2.5-7b", 28, 4 * 16 * 128 * 2, 32768, 28 * 32768, 28 * 4 * 256 * 2},
    {"mistral-7b-v0.3", 32, 8 * 16 * 128 * 2, 65536, 32 * 65536, 32 * 8 * 256 * 2},
    {"gemma-2-9b", 42, 8 * 16 * 256 * 2, 131072, 42 * 131072, 42 * 8 * 512 * 2},
    {"deepseek-v3", 61, 16 * 576 * 2, 18432, 61 * 18432, 61 * 576 * 2},
};

TEST(LayoutTest, PresetNamesAreKnownAndValid) {
  const std::vector<std::string> names = PresetNames();
  ASSERT_EQ(names.size(), std::size(kPresetExpect));
  for (const std::string& n : names) {
    ModelLayout m = Preset(n);
    EXPECT_EQ(m.name, n);
    EXPECT_EQ(ValidateLayout(m), "") << n;
    EXPECT_EQ(m.block_tokens, 16u) << n;
  }
  ModelLayout m;
  EXPECT_FALSE(PresetLayout("llama-9", &m));
}

TEST(LayoutTest, PresetOffsetsMatchHandComputedNumbers) {
  for (const PresetExpect& e : kPresetExpect) {
    SCOPED_TRACE(e.name);
    const ModelLayout m = Preset(e.name);
    const BlockLayout b = ComputeBlockLayout(m);
    const bool mla = std::string(e.name) == "deepseek-v3";
    ASSERT_EQ(b.num_layers(), e.layers);
    EXPECT_EQ(b.block_tokens, 16u);
    EXPECT_EQ(b.block_bytes, e.block_bytes);
    EXPECT_EQ(b.PayloadBytesPerToken(), e.payload_per_token);
    for (uint32_t l = 0; l < e.layers; ++l) {
      const LayerView& v = b.layers[l];
      EXPECT_EQ(v.k_offset, l * e.layer_stride) << "layer " << l;
      EXPECT_EQ(v.v_offset, mla ? v.k_offset : v.k_offset + e.k_part) << "layer " << l;
      EXPECT_EQ(v.scale_bytes, 0u);
      EXPECT_EQ(v.has_v, !mla);
      EXPECT_EQ(v.elem_bytes, 2u);
    }
  }
  // The examples from the design note, spelled out.
  const BlockLayout llama = ComputeBlockLayout(Preset("llama-3.1-8b"));
  EXPECT_EQ(llama.layers[0].v_offset, 32768u);
  EXPECT_EQ(llama.block_bytes, uint64_t{2} << 20);
  const ModelLayout ds = Preset("deepseek-v3");
  EXPECT_EQ(ds.kind, AttentionKind::kMla);
  EXPECT_EQ(ds.kv_lora_rank, 512u);
  EXPECT_EQ(ds.rope_dim, 64u);
  EXPECT_EQ(ds.head_dim, 576u);
  EXPECT_EQ(ds.head_dim_v, 512u);
  EXPECT_EQ(ds.num_kv_heads, 1u);
}

TEST(LayoutTest, QuantizedPresetsHaveTheDocumentedScaleRegions) {
  // llama-3.1-8b int8: K 8*16*128 = 16384, V at 16384, f32 scales [2][8][16] = 1024 bytes at
  // 32768, u8 zero points [2][8][16] = 256 bytes at 33792; 34048 per layer.
  BlockLayout b = ComputeBlockLayout(Preset("llama-3.1-8b", DType::kInt8));
  for (uint32_t l = 0; l < 32; ++l) {
    const LayerView& v = b.layers[l];
    EXPECT_EQ(v.k_offset, l * 34048u);
    EXPECT_EQ(v.v_offset, l * 34048u + 16384);
    EXPECT_EQ(v.scale_offset, l * 34048u + 32768);
    EXPECT_EQ(v.zero_point_offset, l * 34048u + 33792);
    EXPECT_EQ(v.scale_bytes, 1280u);
    EXPECT_EQ(v.Int8Scale(1, 7, 15), v.scale_offset + 1020);
    EXPECT_EQ(v.Int8ZeroPoint(1, 7, 15), v.zero_point_offset + 255);
  }
  EXPECT_EQ(b.block_bytes, 32u * 34048);
  // fp8: one f32 scale per (K/V, head): 2 * 8 * 4 = 64 bytes after V.
  b = ComputeBlockLayout(Preset("llama-3.1-8b", DType::kFp8E4M3));
  EXPECT_EQ(b.layers[1].k_offset, 32832u);
  EXPECT_EQ(b.layers[1].scale_offset, 32832u + 32768);
  EXPECT_EQ(b.layers[1].scale_bytes, 64u);
  EXPECT_EQ(b.layers[1].Fp8Scale(1, 7), b.layers[1].scale_offset + 60);
  EXPECT_EQ(b.block_bytes, 32u * 32832);
  // deepseek-v3 fp8: K 16*576 = 9216, one scale (4 bytes), next layer at AlignUp(9220, 16).
  b = ComputeBlockLayout(Preset("deepseek-v3", DType::kFp8E5M2));
  EXPECT_EQ(b.layers[1].k_offset, 9232u);
  EXPECT_EQ(b.layers[60].scale_bytes, 4u);
  EXPECT_EQ(b.block_bytes, 563200u);  // AlignUp(60 * 9232 + 9220, 64)
  // deepseek-v3 int8: scales [1][1][16] f32 = 64 bytes, zero points 16 bytes; 9296 per layer.
  b = ComputeBlockLayout(Preset("deepseek-v3", DType::kInt8));
  EXPECT_EQ(b.layers[0].scale_offset, 9216u);
  EXPECT_EQ(b.layers[0].zero_point_offset, 9280u);
  EXPECT_EQ(b.layers[2].k_offset, 2u * 9296);
  EXPECT_EQ(b.block_bytes, 567104u);  // AlignUp(61 * 9296, 64)
}

TEST(LayoutTest, MixedPerLayerDTypes) {
  // First and last 3 layers fp16 (65536 bytes each), the 26 in between int8 (34048 each).
  ModelLayout m = Preset("llama-3.1-8b", DType::kInt8);
  for (uint32_t l : {0u, 1u, 2u, 29u, 30u, 31u}) m.layer_dtypes[l] = DType::kFp16;
  ASSERT_EQ(ValidateLayout(m), "");
  const BlockLayout b = ComputeBlockLayout(m);
  EXPECT_EQ(b.layers[2].k_offset, 2u * 65536);
  EXPECT_EQ(b.layers[3].k_offset, 3u * 65536);
  EXPECT_EQ(b.layers[3].dtype, DType::kInt8);
  EXPECT_EQ(b.layers[3].scale_bytes, 1280u);
  EXPECT_EQ(b.layers[2].scale_bytes, 0u);
  EXPECT_EQ(b.layers[29].k_offset, 3u * 65536 + 26 * 34048);
  EXPECT_EQ(b.layers[29].dtype, DType::kFp16);
  EXPECT_EQ(b.block_bytes, 6u * 65536 + 26 * 34048);
  // Payload: 6 fp16 layers at 8*256*2 bytes per token, 26 int8 ones at 8*256*1.
  EXPECT_EQ(b.PayloadBytesPerToken(), 6u * 4096 + 26 * 2048);
}

// Reference layout written from the header comment alone: every part 16-byte aligned, in the order
// K, V, scales (int8: f32 scales, then u8 zero points); the block rounded up to 64 bytes.
struct RefLayer {
  uint64_t k, v, scale, zero_point, scale_bytes;
};
uint64_t Up(uint64_t x, uint64_t a) { return x % a == 0 ? x : x + (a - x % a); }
std::vector<RefLayer> RefLayout(const ModelLayout& m, uint64_t* block_bytes) {
  std::vector<RefLayer> out;
  const bool mla = m.kind == AttentionKind::kMla;
  const uint64_t kv = mla ? 1 : 2, rows = uint64_t{m.num_kv_heads} * m.block_tokens;
  uint64_t cursor = 0;
  for (DType d : m.layer_dtypes) {
    RefLayer r{};
    const uint64_t eb = d == DType::kFp32 ? 4 : (d == DType::kFp16 || d == DType::kBf16) ? 2 : 1;
    r.k = Up(cursor, 16);
    cursor = r.k + rows * m.head_dim * eb;
    r.v = r.k;
    if (!mla) {
      r.v = Up(cursor, 16);
      cursor = r.v + rows * m.head_dim_v * eb;
    }
    r.scale = r.zero_point = cursor = Up(cursor, 16);
    if (d == DType::kInt8) {
      r.zero_point = Up(r.scale + kv * rows * 4, 16);
      cursor = r.zero_point + kv * rows;
    } else if (d == DType::kFp8E4M3 || d == DType::kFp8E5M2) {
      cursor = r.scale + kv * m.num_kv_heads * 4;
    }
    r.scale_bytes = cursor - r.scale;
    out.push_back(r);
  }
  *block_bytes = Up(cursor, 64);
  return out;
}

// Parts never overlap, start on 16 bytes, lie inside the block; every accessor lands in its part.
void CheckBlockInvariants(const ModelLayout& m, const BlockLayout& b) {
  ASSERT_EQ(b.num_layers(), m.num_layers);
  EXPECT_EQ(b.block_bytes % BlockLayout::kBlockAlign, 0u);
  struct Region {
    uint64_t begin, size;
  };
  std::vector<Region> regions;
  for (const LayerView& v : b.layers) {
    const uint64_t rows = uint64_t{v.num_kv_heads} * v.block_tokens;
    regions.push_back({v.k_offset, rows * v.KRowBytes()});
    EXPECT_EQ(v.KRow(v.num_kv_heads - 1, v.block_tokens - 1) + v.KRowBytes(),
              v.k_offset + rows * v.KRowBytes());
    if (v.has_v) {
      regions.push_back({v.v_offset, rows * v.VRowBytes()});
      EXPECT_EQ(v.VRow(v.num_kv_heads - 1, v.block_tokens - 1) + v.VRowBytes(),
                v.v_offset + rows * v.VRowBytes());
    } else {
      EXPECT_EQ(v.v_offset, v.k_offset);
    }
    const uint32_t kv = v.KvParts();
    if (v.dtype == DType::kInt8) {
      regions.push_back({v.scale_offset, kv * rows * 4});
      regions.push_back({v.zero_point_offset, kv * rows});
      EXPECT_EQ(v.Int8Scale(kv - 1, v.num_kv_heads - 1, v.block_tokens - 1) + 4,
                v.scale_offset + kv * rows * 4);
      EXPECT_EQ(v.Int8ZeroPoint(kv - 1, v.num_kv_heads - 1, v.block_tokens - 1) + 1,
                v.zero_point_offset + kv * rows);
      EXPECT_EQ(v.zero_point_offset + kv * rows, v.scale_offset + v.scale_bytes);
    } else if (v.dtype == DType::kFp8E4M3 || v.dtype == DType::kFp8E5M2) {
      regions.push_back({v.scale_offset, uint64_t{kv} * v.num_kv_heads * 4});
      EXPECT_EQ(v.scale_bytes, uint64_t{kv} * v.num_kv_heads * 4);
      EXPECT_EQ(v.Fp8Scale(kv - 1, v.num_kv_heads - 1) + 4, v.scale_offset + v.scale_bytes);
    } else {
      EXPECT_EQ(v.scale_bytes, 0u);
    }
  }
  std::sort(regions.begin(), regions.end(),
            [](const Region& a, const Region& c) { return a.begin < c.begin; });
  for (size_t i = 0; i < regions.size(); ++i) {
    EXPECT_EQ(regions[i].begin % BlockLayout::kPartAlign, 0u) << "region " << i;
    EXPECT_LE(regions[i].begin + regions[i].size, b.block_bytes) << "region " << i;
    if (i > 0) {
      EXPECT_LE(regions[i - 1].begin + regions[i - 1].size, regions[i].begin) << "overlap " << i;
    }
  }
}

ModelLayout Shape(AttentionKind kind, uint32_t layers, uint32_t kv_heads, uint32_t head_dim,
                  uint32_t block_tokens, std::vector<DType> dtypes) {
  ModelLayout m;
  m.name = "shape";
  m.kind = kind;
  m.num_layers = layers;
  m.num_kv_heads = kv_heads;
  m.num_q_heads = kind == AttentionKind::kMha ? kv_heads : kv_heads * 4;
  m.head_dim = m.head_dim_v = head_dim;
  m.block_tokens = block_tokens;
  if (kind == AttentionKind::kMla) {
    m.rope_dim = std::min<uint32_t>(head_dim - 1, 64);
    m.kv_lora_rank = head_dim - m.rope_dim;
    m.head_dim_v = m.kv_lora_rank;
  }
  m.layer_dtypes = std::move(dtypes);
  return m;
}

TEST(LayoutTest, OddShapesMatchReferenceAndInvariants) {
  const std::vector<std::vector<DType>> storages = {
      {DType::kFp16, DType::kFp16, DType::kFp16, DType::kFp16, DType::kFp16},
      {DType::kFp32, DType::kBf16, DType::kInt8, DType::kFp8E4M3, DType::kFp8E5M2},
      {DType::kInt8, DType::kInt8, DType::kInt8, DType::kInt8, DType::kInt8},
      {DType::kFp8E4M3, DType::kFp16, DType::kFp8E5M2, DType::kInt8, DType::kFp32},
  };
  int checked = 0;
  for (uint32_t bt : {1u, 3u, 7u, 16u, 17u}) {
    for (uint32_t hd : {1u, 3u, 72u, 576u}) {
      for (auto [kind, heads] : {std::pair{AttentionKind::kGqa, 3u},
                                 {AttentionKind::kMha, 5u},
                                 {AttentionKind::kMqa, 1u},
                                 {AttentionKind::kMla, 1u}}) {
        for (const auto& dtypes : storages) {
          const ModelLayout m = Shape(kind, 5, heads, hd, bt, dtypes);
          SCOPED_TRACE(LayoutFingerprint(m));
          ASSERT_EQ(ValidateLayout(m), "");
          const BlockLayout b = ComputeBlockLayout(m);
          CheckBlockInvariants(m, b);
          uint64_t ref_bytes = 0;
          const std::vector<RefLayer> ref = RefLayout(m, &ref_bytes);
          EXPECT_EQ(b.block_bytes, ref_bytes);
          for (uint32_t l = 0; l < m.num_layers; ++l) {
            EXPECT_EQ(b.layers[l].k_offset, ref[l].k) << "layer " << l;
            EXPECT_EQ(b.layers[l].v_offset, ref[l].v) << "layer " << l;
            EXPECT_EQ(b.layers[l].scale_offset, ref[l].scale) << "layer " << l;
            EXPECT_EQ(b.layers[l].scale_bytes, ref[l].scale_bytes) << "layer " << l;
            if (dtypes[l] == DType::kInt8) {
              EXPECT_EQ(b.layers[l].zero_point_offset, ref[l].zero_point) << "layer " << l;
            }
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 5 * 4 * 4 * 4);
}

TEST(LayoutTest, PayloadBytesAndPayloadLayout) {
  ModelLayout m = Shape(AttentionKind::kGqa, 4, 3, 7, 5,
                        {DType::kFp32, DType::kFp16, DType::kInt8, DType::kBf16});
  const BlockLayout b = ComputeBlockLayout(m);
  // Per token: heads * (head_dim + head_dim_v) * elem bytes.
  const uint64_t per_layer[] = {3 * 14 * 4, 3 * 14 * 2, 3 * 14 * 1, 3 * 14 * 2};
  EXPECT_EQ(b.PayloadBytesPerToken(), per_layer[0] + per_layer[1] + per_layer[2] + per_layer[3]);
  for (uint64_t n : {0u, 1u, 3u, 11u}) {
    for (uint32_t l0 = 0; l0 < 4; ++l0) {
      for (uint32_t l1 = l0; l1 <= 4; ++l1) {
        uint64_t want = 0;
        const PayloadLayout p = PayloadLayout::Make(b, l0, l1, n);
        ASSERT_EQ(p.layer_offset.size(), l1 - l0);
        for (uint32_t l = l0; l < l1; ++l) {
          EXPECT_EQ(p.layer_offset[l - l0], want);
          want += per_layer[l] * n;
        }
        EXPECT_EQ(b.PayloadBytes(l0, l1, n), want);
        EXPECT_EQ(p.total_bytes, want);
        EXPECT_EQ(p.num_tokens, n);
      }
    }
  }
  EXPECT_EQ(b.PayloadBytes(0, 4, std::numeric_limits<uint64_t>::max()), 0u) << "overflow gives 0";
  // MLA payload has no V: one latent row per token.
  const BlockLayout mla = ComputeBlockLayout(Preset("deepseek-v3"));
  EXPECT_EQ(mla.PayloadBytes(3, 5, 7), 2u * 7 * 576 * 2);
}

// Every row and scale offset the payload offset functions give, walked in the order the header
// comment documents (per layer: K [heads][n], V [heads][n], then in the storage format int8
// scales [kv][heads][n] and zero points, or fp8 scales [kv][heads][blocks]): each must be where
// the previous one ended, starting at PayloadLayout's layer_offset and scale_offset and ending at
// total_bytes. MHA, GQA with V narrower than K, MLA; every storage dtype; payloads in the layers'
// own dtypes, in a wire dtype, and in the storage format from mid-block positions.
TEST(LayoutTest, PayloadOffsetFunctionsTileThePayload) {
  const std::vector<DType> dtypes = {DType::kFp16,    DType::kInt8, DType::kFp32,
                                     DType::kFp8E4M3, DType::kBf16, DType::kFp8E5M2};
  std::vector<ModelLayout> shapes = {Shape(AttentionKind::kMha, 6, 3, 5, 4, dtypes),
                                     Shape(AttentionKind::kGqa, 6, 2, 7, 4, dtypes),
                                     Shape(AttentionKind::kMla, 6, 1, 9, 4, dtypes)};
  shapes[1].head_dim_v = 3;  // K and V of different widths
  enum class Kind { kOwn, kWire, kStorage };
  int payloads = 0;
  for (const ModelLayout& m : shapes) {
    SCOPED_TRACE(LayoutFingerprint(m));
    ASSERT_EQ(ValidateLayout(m), "");
    const BlockLayout b = ComputeBlockLayout(m);
    for (Kind kind : {Kind::kOwn, Kind::kWire, Kind::kStorage}) {
      for (auto [l0, l1] : {std::pair<uint32_t, uint32_t>{0, 6}, {2, 5}, {5, 6}}) {
        for (uint64_t token_begin : {0u, 3u, 8u}) {
          for (uint64_t n : {1u, 5u, 9u}) {
            SCOPED_TRACE("kind " + std::to_string(int(kind)) + " layers [" + std::to_string(l0) +
                         ", " + std::to_string(l1) + ") tokens [" + std::to_string(token_begin) +
                         ", +" + std::to_string(n) + ")");
            const PayloadLayout p =
                kind == Kind::kStorage ? PayloadLayout::MakeStorage(b, l0, l1, token_begin, n)
                : kind == Kind::kWire  ? PayloadLayout::Make(b, l0, l1, n, DType::kFp32)
                                       : PayloadLayout::Make(b, l0, l1, n);
            // The blocks [first, first + blocks) the tokens touch, counted one token at a time.
            const uint64_t first = token_begin / m.block_tokens;
            const uint64_t blocks = (token_begin + n - 1) / m.block_tokens - first + 1;
            uint64_t at = 0;  // where the next offset must be
            for (uint32_t l = l0; l < l1; ++l) {
              const LayerView& v = b.layers[l];
              const uint32_t parts = m.kind == AttentionKind::kMla ? 1 : 2;
              const uint64_t elem = DTypeBytes(kind == Kind::kWire ? DType::kFp32 : dtypes[l]);
              ASSERT_EQ(p.layer_offset[l - l0], at) << "layer " << l;
              for (uint32_t kv = 0; kv < parts; ++kv) {
                const uint64_t row = (kv == 0 ? m.head_dim : m.head_dim_v) * elem;
                ASSERT_EQ(p.RowBytes(b, l, kv), row);
                for (uint32_t h = 0; h < m.num_kv_heads; ++h) {
                  for (uint64_t t = 0; t < n; ++t) {
                    ASSERT_EQ(p.RowOffset(b, l, kv, h, t), at)
                        << "layer " << l << " kv " << kv << " head " << h << " token " << t;
                    ASSERT_EQ(v.PayloadRow(p.layer_offset[l - l0], n, elem, kv, h, t), at);
                    ASSERT_EQ(PayloadRowOffset(p.layer_offset[l - l0], p.KPartBytes(b, l), kv, h, n,
                                               t, row),
                              at);
                    at += row;
                  }
                }
              }
              if (kind != Kind::kStorage) continue;
              ASSERT_EQ(p.scale_offset[l - l0], at) << "layer " << l;
              if (dtypes[l] == DType::kInt8) {
                for (int zp = 0; zp < 2; ++zp) {
                  for (uint32_t kv = 0; kv < parts; ++kv) {
                    for (uint32_t h = 0; h < m.num_kv_heads; ++h) {
                      for (uint64_t t = 0; t < n; ++t) {
                        ASSERT_EQ(zp ? p.Int8ZeroPointOffset(b, l, kv, h, t)
                                     : p.Int8ScaleOffset(b, l, kv, h, t),
                                  at)
                            << (zp ? "zero point" : "scale") << " layer " << l << " kv " << kv
                            << " head " << h << " token " << t;
                        at += zp ? 1 : 4;
                      }
                    }
                  }
                }
              } else if (dtypes[l] == DType::kFp8E4M3 || dtypes[l] == DType::kFp8E5M2) {
                for (uint32_t kv = 0; kv < parts; ++kv) {
                  for (uint32_t h = 0; h < m.num_kv_heads; ++h) {
                    for (uint64_t blk = first; blk < first + blocks; ++blk) {
                      ASSERT_EQ(p.Fp8ScaleOffset(b, l, kv, h, blk), at)
                          << "layer " << l << " kv " << kv << " head " << h << " block " << blk;
                      at += 4;
                    }
                  }
                }
              }
              ASSERT_EQ(p.ScaleBytes(b, l), at - p.scale_offset[l - l0]) << "layer " << l;
            }
            EXPECT_EQ(at, p.total_bytes);
            EXPECT_EQ(BlocksTouched(token_begin, n, m.block_tokens), blocks);
            ++payloads;
          }
        }
      }
    }
  }
  EXPECT_EQ(payloads, 3 * 3 * 3 * 3 * 3);
}

TEST(LayoutTest, ValidateLayoutNamesTheBadField) {
  struct Case {
    const char* what;
    std::function<void(ModelLayout&)> mutate;
    const char* field;
  };
  const std::vector<Case> cases = {
      {"zero layers", [](ModelLayout& m) { m.num_layers = 0; }, "num_layers"},
      {"too many layers", [](ModelLayout& m) { m.num_layers = 100000; }, "num_layers"},
      {"zero kv heads", [](ModelLayout& m) { m.num_kv_heads = 0; }, "num_kv_heads"},
      {"zero q heads", [](ModelLayout& m) { m.num_q_heads = 0; }, "num_q_heads"},
      {"q not multiple of kv", [](ModelLayout& m) { m.num_q_heads = 30; }, "num_q_heads"},
      {"zero head_dim", [](ModelLayout& m) { m.head_dim = 0; }, "head_dim"},
      {"zero head_dim_v", [](ModelLayout& m) { m.head_dim_v = 0; }, "head_dim_v"},
      {"zero block_tokens", [](ModelLayout& m) { m.block_tokens = 0; }, "block_tokens"},
      {"huge block",
       [](ModelLayout& m) {
         m.block_tokens = 4096;
         m.head_dim = 4096;
       },
       "block_tokens"},
      {"dtypes short", [](ModelLayout& m) { m.layer_dtypes.pop_back(); }, "layer_dtypes"},
      {"dtypes long", [](ModelLayout& m) { m.layer_dtypes.push_back(DType::kFp16); },
       "layer_dtypes"},
      {"int8 input", [](ModelLayout& m) { m.input_dtype = DType::kInt8; }, "input_dtype"},
      {"fp8 input", [](ModelLayout& m) { m.input_dtype = DType::kFp8E4M3; }, "input_dtype"},
      {"lora on gqa", [](ModelLayout& m) { m.kv_lora_rank = 512; }, "kv_lora_rank"},
      {"mha q != kv", [](ModelLayout& m) { m.kind = AttentionKind::kMha; }, "MHA"},
      {"mqa kv != 1", [](ModelLayout& m) { m.kind = AttentionKind::kMqa; }, "MQA"},
  };
  for (const Case& c : cases) {
    ModelLayout m = Preset("llama-3.1-8b");
    c.mutate(m);
    const std::string e = ValidateLayout(m);
    EXPECT_NE(e.find(c.field), std::string::npos) << c.what << ": '" << e << "'";
  }
  const std::vector<Case> mla_cases = {
      {"head_dim != lora + rope", [](ModelLayout& m) { m.head_dim = 575; }, "head_dim"},
      {"rope changed", [](ModelLayout& m) { m.rope_dim = 32; }, "head_dim"},
      {"zero lora",
       [](ModelLayout& m) {
         m.kv_lora_rank = 0;
         m.head_dim = 64;
       },
       "kv_lora_rank"},
      {"head_dim_v != lora", [](ModelLayout& m) { m.head_dim_v = 576; }, "head_dim_v"},
      {"two kv heads", [](ModelLayout& m) { m.num_kv_heads = 2; }, "num_kv_heads"},
  };
  for (const Case& c : mla_cases) {
    ModelLayout m = Preset("deepseek-v3");
    c.mutate(m);
    const std::string e = ValidateLayout(m);
    EXPECT_NE(e.find(c.field), std::string::npos) << c.what << ": '" << e << "'";
  }
}

TEST(LayoutTest, FingerprintTracksEveryStorageDTypeAndField) {
  ModelLayout base = Shape(AttentionKind::kGqa, 6, 2, 8, 16, std::vector<DType>(6, DType::kFp16));
  const std::string fp = LayoutFingerprint(base);
  std::set<std::string> seen = {fp};
  for (uint32_t l = 0; l < base.num_layers; ++l) {
    for (DType d : kAllDTypes) {
      if (d == base.layer_dtypes[l]) continue;
      ModelLayout m = base;
      m.layer_dtypes[l] = d;
      EXPECT_TRUE(seen.insert(LayoutFingerprint(m)).second)
          << "layer " << l << " as " << DTypeName(d) << " collides";
    }
  }
  const std::vector<std::function<void(ModelLayout&)>> changes = {
      [](ModelLayout& m) {
        m.num_layers = 7;
        m.layer_dtypes.push_back(DType::kFp16);
      },
      [](ModelLayout& m) { m.num_q_heads = 16; },
      [](ModelLayout& m) { m.num_kv_heads = 4; },
      [](ModelLayout& m) { m.head_dim = 9; },
      [](ModelLayout& m) { m.head_dim_v = 9; },
      [](ModelLayout& m) { m.block_tokens = 17; },
      [](ModelLayout& m) { m.kind = AttentionKind::kMha; },
      [](ModelLayout& m) { m.input_dtype = DType::kBf16; },
  };
  for (size_t i = 0; i < changes.size(); ++i) {
    ModelLayout m = base;
    changes[i](m);
    EXPECT_TRUE(seen.insert(LayoutFingerprint(m)).second) << "change " << i << " collides";
    EXPECT_NE(m, base) << "change " << i;
  }
  ModelLayout renamed = base;
  renamed.name = "other";
  EXPECT_EQ(LayoutFingerprint(renamed), fp) << "the name does not change the bytes";
  EXPECT_EQ(renamed, base);
}

}  // namespace
}  // namespace kvbank
