// Test fixtures for the whole-payload codec and the row copies, shared by the CPU test
// (payload_codec_test.cc) and the GPU test (tests/gpu/gpu_payload_codec_test.cc): the sweep of
// layouts, wire dtypes and token ranges, a pool over a shuffled block table, payloads of finite
// values with the rows that stress the codecs, and RowCopy lists. Header-only; needs the kernels
// and the layout (no Abseil, no GoogleTest).
#ifndef KVBANK_TESTS_UNIT_PAYLOAD_CODEC_TESTING_H_
#define KVBANK_TESTS_UNIT_PAYLOAD_CODEC_TESTING_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/block_copy.h"
#include "kernels/quant.h"
#include "kvbank/layout.h"

namespace kvbank::kernels::testing {

// A model of `dtypes.size()` layers with q_per_kv query heads per KV head. MLA: one latent head,
// K head_dim wide, V its first head_dim - rope_dim values (rope_dim 0: head_dim / 3).
inline ModelLayout CodecShape(AttentionKind kind, uint32_t kv_heads, uint32_t head_dim,
                              uint32_t block_tokens, std::vector<DType> dtypes,
                              uint32_t rope_dim = 0, uint32_t q_per_kv = 4) {
  ModelLayout m;
  m.name = "codec";
  m.kind = kind;
  m.num_layers = static_cast<uint32_t>(dtypes.size());
  m.num_kv_heads = kv_heads;
  m.num_q_heads = kv_heads * q_per_kv;
  m.head_dim = m.head_dim_v = head_dim;
  m.block_tokens = block_tokens;
  if (kind == AttentionKind::kMla) {
    m.rope_dim = rope_dim != 0 ? rope_dim : head_dim / 3;
    m.kv_lora_rank = head_dim - m.rope_dim;
    m.head_dim_v = m.kv_lora_rank;
  }
  m.layer_dtypes = std::move(dtypes);
  return m;
}

// One transfer of layers [l0, l1) x tokens [pos, pos + n) in `wire`. When pos > 0 the tests first
// transfer [0, pos), so a mid-block start finds the scales of an earlier transfer in its block.
struct CodecCase {
  std::string name;
  ModelLayout layout;
  DType wire;
  uint32_t l0, l1;
  uint64_t pos, n;

  std::string Describe() const {
    std::string s = name + " wire=" + DTypeName(wire) + " layers=[" + std::to_string(l0) + "," +
                    std::to_string(l1) + ") bt=" + std::to_string(layout.block_tokens) +
                    " hd=" + std::to_string(layout.head_dim) + " pos=" + std::to_string(pos) +
                    " n=" + std::to_string(n) + " storage=";
    for (DType d : layout.layer_dtypes) s += std::string(DTypeName(d)) + ",";
    return s;
  }
};

// int8, fp8 e4m3 / e5m2 from each wire dtype, the conversions (widening, narrowing with
// saturation), and a layout mixing every storage dtype per layer; GQA, MQA and MLA views; odd
// block sizes; starts at 0, on a block boundary and mid-block; odd token counts.
inline std::vector<CodecCase> CodecCases() {
  const DType f32 = DType::kFp32, f16 = DType::kFp16, b16 = DType::kBf16, i8 = DType::kInt8,
              e4 = DType::kFp8E4M3, e5 = DType::kFp8E5M2;
  struct Storage {
    std::string name;
    std::vector<DType> dtypes;
    std::vector<DType> wires;
  };
  const std::vector<Storage> storages = {
      {"int8", {i8, i8}, {f16, b16, f32}},
      {"e4m3", {e4, e4}, {f16, b16, f32}},
      {"e5m2", {e5, e5}, {f16, b16, f32}},
      {"bf16", {b16}, {f16, f32}},
      {"fp32", {f32}, {f16, b16}},
      {"fp16", {f16}, {b16, f32}},
      {"mixed", {f16, i8, e4, b16, e5, f32}, {f16, b16, f32}},
  };
  std::vector<CodecCase> out;
  for (uint32_t bt : {1u, 3u, 16u, 17u}) {
    // (pos, n): at 0, on a block boundary, mid-block, each with an odd count.
    const std::vector<std::pair<uint64_t, uint64_t>> ranges = {
        {0, 2 * bt + 1}, {bt, bt + 2}, {bt / 2 + 1, 2 * bt + 3}, {bt + 1, 1}};
    for (const Storage& s : storages) {
      const uint32_t nl = static_cast<uint32_t>(s.dtypes.size());
      // The mixed layout transfers a middle range of layers too.
      const uint32_t l0 = nl > 2 ? 1 : 0, l1 = nl > 2 ? nl - 1 : nl;
      for (DType wire : s.wires) {
        for (size_t r = 0; r < ranges.size(); ++r) {
          const auto [pos, n] = ranges[r];
          // Shapes rotate with the range so the sweep stays small: GQA (3 heads, odd dims), MQA,
          // MLA.
          const int shape = static_cast<int>((r + out.size()) % 3);
          const ModelLayout m =
              shape == 0   ? CodecShape(AttentionKind::kGqa, 3, r % 2 ? 3 : 72, bt, s.dtypes)
              : shape == 1 ? CodecShape(AttentionKind::kMqa, 1, 5, bt, s.dtypes)
                           : CodecShape(AttentionKind::kMla, 1, 9, bt, s.dtypes);
          out.push_back({s.name, m, wire, r % 2 ? l0 : 0, r % 2 ? l1 : nl, pos, n});
        }
      }
    }
  }
  // Model-sized rows: head_dim 128 with 8 kv heads and the 576-wide MLA latent.
  for (const Storage& s : storages) {
    const uint32_t nl = static_cast<uint32_t>(s.dtypes.size());
    out.push_back(
        {s.name, CodecShape(AttentionKind::kGqa, 8, 128, 16, s.dtypes), s.wires[0], 0, nl, 5, 61});
    out.push_back({s.name, CodecShape(AttentionKind::kMla, 1, 576, 16, s.dtypes), s.wires.back(), 0,
                   nl, 16, 33});
  }
  return out;
}

// A pool of the case's blocks over a shuffled table, with spare blocks no transfer may touch.
struct CodecPool {
  BlockLayout b;
  std::vector<int32_t> table;  // logical block -> physical block
  std::vector<uint8_t> bytes;  // [physical][block_bytes], random
  uint64_t physical = 0;
};

inline CodecPool MakeCodecPool(const CodecCase& c, std::mt19937_64& rng) {
  CodecPool p;
  p.b = ComputeBlockLayout(c.layout);
  const uint64_t bt = p.b.block_tokens;
  const uint64_t logical = (c.pos + c.n + bt - 1) / bt;
  p.physical = logical + 3;
  std::vector<int32_t> ids(p.physical);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  p.table.assign(ids.begin(), ids.begin() + logical);
  p.bytes.resize(p.physical * p.b.block_bytes);
  for (auto& x : p.bytes) x = static_cast<uint8_t>(rng());
  return p;
}

// The map of payload `pl` (tokens from `pos`) over `pool`; `views` and `layer_offset` must outlive
// it (host or device copies of pl's layers and offsets, as the caller needs).
inline PayloadMap CodecMap(const CodecPool& p, const PayloadLayout& pl, uint64_t pos, uint8_t* pool,
                           const LayerView* views, const uint64_t* layer_offset,
                           const int32_t* table) {
  PayloadMap m;
  m.pool = pool;
  m.block_bytes = p.b.block_bytes;
  m.layers = views;
  m.layer_offset = layer_offset;
  m.num_layers = pl.layer_end - pl.layer_begin;
  m.block_table = table;
  m.token_begin = pos;
  m.num_tokens = pl.num_tokens;
  m.total_bytes = pl.total_bytes;
  return m;
}

// A payload of finite values for `pl` in `wire`, row by row. Most rows are gaussian at a random
// magnitude; some are all zero (with -0s), constant, huge (saturating narrow formats), tiny
// (fp32 subnormals) or span both; some rows hold +-0 among others.
inline std::vector<uint8_t> CodecPayload(const BlockLayout& b, const PayloadLayout& pl, DType wire,
                                         std::mt19937_64& rng) {
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(-12.0f, 12.0f);
  std::vector<float> values;
  for (uint32_t l = pl.layer_begin; l < pl.layer_end; ++l) {
    const LayerView& v = b.layers[l];
    for (uint32_t kv = 0; kv < v.KvParts(); ++kv) {
      const uint32_t dim = kv == 0 ? v.head_dim : v.head_dim_v;
      for (uint64_t r = 0; r < uint64_t{v.num_kv_heads} * pl.num_tokens; ++r) {
        const int kind = static_cast<int>(rng() % 24);
        const float mag = std::exp2(uni(rng));
        const float c = gauss(rng) * mag;
        for (uint32_t i = 0; i < dim; ++i) {
          float x;
          switch (kind) {
            case 0:
              x = (i % 3 == 1) ? -0.0f : 0.0f;
              break;
            case 1:
              x = c;
              break;
            case 2:
              x = gauss(rng) * 3e5f;
              break;
            case 3:
              x = gauss(rng) * 1e-39f;
              break;
            case 4:
              x = (i % 2) ? gauss(rng) * 1e-39f : gauss(rng) * 1e4f;
              break;
            default:
              x = rng() % 11 == 0 ? ((i & 1) ? -0.0f : 0.0f) : gauss(rng) * mag + 0.1f * c;
          }
          values.push_back(x);
        }
      }
    }
  }
  std::vector<uint8_t> out(values.size() * DTypeBytes(wire));
  ConvertElements(values.data(), DType::kFp32, out.data(), wire, values.size());
  return out;
}

// RowCopy lists over a pool of `blocks` blocks (every block_tokens of `b`).
//
// Fork: the first rows[l] rows of every layer from block `src` to block `dst`, as a prefix fork
// copies a partial block (SequenceStore::Fork's list).
inline std::vector<RowCopy> ForkCopies(const BlockLayout& b, const std::vector<uint32_t>& rows,
                                       int32_t src, int32_t dst) {
  std::vector<RowCopy> out;
  for (uint32_t l = 0; l < b.num_layers(); ++l) {
    for (uint32_t t = 0; t < rows[l]; ++t) out.push_back({src, dst, t, t, l});
  }
  return out;
}

// Permutation: blocks [0, blocks / 2) are sources, the rest destinations. Every (layer,
// destination block) gets a random subset of its rows, each from a random row of one source
// block (one per (layer, destination block), so an fp8 block's scales have one origin), in
// shuffled order.
inline std::vector<RowCopy> PermutationCopies(const BlockLayout& b, int32_t blocks,
                                              std::mt19937_64& rng) {
  std::vector<RowCopy> out;
  const int32_t nsrc = blocks / 2;
  const uint32_t bt = b.block_tokens;
  for (uint32_t l = 0; l < b.num_layers(); ++l) {
    for (int32_t dst = nsrc; dst < blocks; ++dst) {
      const int32_t src = static_cast<int32_t>(rng() % nsrc);
      std::vector<uint32_t> src_rows(bt), dst_rows(bt);
      std::iota(src_rows.begin(), src_rows.end(), 0u);
      std::iota(dst_rows.begin(), dst_rows.end(), 0u);
      std::shuffle(src_rows.begin(), src_rows.end(), rng);
      std::shuffle(dst_rows.begin(), dst_rows.end(), rng);
      const uint32_t k = static_cast<uint32_t>(rng() % (bt + 1));
      for (uint32_t i = 0; i < k; ++i) out.push_back({src, dst, src_rows[i], dst_rows[i], l});
    }
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

}  // namespace kvbank::kernels::testing

#endif  // KVBANK_TESTS_UNIT_PAYLOAD_CODEC_TESTING_H_
