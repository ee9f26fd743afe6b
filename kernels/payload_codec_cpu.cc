// Whole-payload codec on the CPU (payload_codec.h). Works on runs: the rows of one (layer, K/V,
// head) that land in one block are contiguous both in the payload and in the block, so each run
// is one call of a quant.h codec.
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/payload_codec.h"
#include "kernels/quant.h"
#include "kernels/quant_math.h"

namespace kvbank::kernels {

namespace {

// One run: `rows` rows of `dim` values of one (layer, K/V, head), block rows [row, row + rows).
struct Run {
  const LayerView* v;
  uint32_t kv;  // 0 = K, 1 = V
  uint32_t head;
  uint32_t dim;  // head_dim or head_dim_v
  uint32_t row;  // first block row
  uint64_t rows;
  uint8_t* block;    // the block's first byte
  uint64_t payload;  // payload offset of the run's first row
};

// Calls f(run) for every run of the payload, in payload order.
template <typename F>
void ForEachRun(const PayloadMap& m, uint32_t wire_bytes, F&& f) {
  for (uint32_t li = 0; li < m.num_layers; ++li) {
    const LayerView& v = m.layers[li];
    uint64_t part_begin = m.layer_offset[li];
    for (uint32_t kv = 0; kv < v.KvParts(); ++kv) {
      const uint32_t dim = kv == 0 ? v.head_dim : v.head_dim_v;
      const uint64_t row_bytes = uint64_t{dim} * wire_bytes;
      for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
        const uint64_t head_begin = part_begin + uint64_t{h} * m.num_tokens * row_bytes;
        for (uint64_t t = 0; t < m.num_tokens;) {
          const uint64_t pos = m.token_begin + t;
          const uint32_t row = static_cast<uint32_t>(pos % v.block_tokens);
          const uint64_t rows = std::min<uint64_t>(v.block_tokens - row, m.num_tokens - t);
          uint8_t* block = m.pool + uint64_t(m.block_table[pos / v.block_tokens]) * m.block_bytes;
          f(Run{&v, kv, h, dim, row, rows, block, head_begin + t * row_bytes});
          t += rows;
        }
      }
      part_begin += uint64_t{v.num_kv_heads} * m.num_tokens * row_bytes;
    }
  }
}

uint64_t RowOffset(const Run& r) {
  return r.kv == 0 ? r.v->KRow(r.head, r.row) : r.v->VRow(r.head, r.row);
}

}  // namespace

void EncodeFp8Group(const void* src, DType wire, uint64_t row, uint64_t rows, uint32_t dim,
                    float scale, DType fp8, uint8_t* head_rows, uint8_t* scale_slot) {
  float stored;
  std::memcpy(&stored, scale_slot, sizeof(stored));
  if (row > 0 && scale != stored) {
    // scale / stored is a power of two: the codes move by whole exponents (Fp8GroupScale).
    std::vector<float> values(row * dim);
    DecodeFp8(head_rows, fp8, values.size(), stored, values.data(), DType::kFp32);
    EncodeFp8(values.data(), DType::kFp32, values.size(), scale, fp8, head_rows);
  }
  std::memcpy(scale_slot, &scale, sizeof(scale));
  EncodeFp8(src, wire, rows * dim, scale, fp8, head_rows + row * dim);
}

void EncodePayloadCpu(const PayloadMap& m, DType wire, const uint8_t* payload) {
  if (!qmath::IsElementDType(wire) || m.num_tokens == 0) return;
  ForEachRun(m, DTypeBytes(wire), [&](const Run& r) {
    const LayerView& v = *r.v;
    const uint8_t* src = payload + r.payload;
    uint8_t* dst = r.block + RowOffset(r);
    const size_t n = r.rows * r.dim;
    switch (v.dtype) {
      case DType::kInt8:
        QuantizeInt8Rows(src, wire, r.rows, r.dim, dst,
                         reinterpret_cast<float*>(r.block + v.Int8Scale(r.kv, r.head, r.row)),
                         r.block + v.Int8ZeroPoint(r.kv, r.head, r.row));
        break;
      case DType::kFp8E4M3:
      case DType::kFp8E5M2: {
        uint8_t* scale_slot = r.block + v.Fp8Scale(r.kv, r.head);
        float stored;  // meaningful only when earlier transfers filled rows [0, r.row)
        std::memcpy(&stored, scale_slot, sizeof(stored));
        const float scale = qmath::Fp8GroupScale(AbsMax(src, wire, n), stored, r.row, r.rows,
                                                 v.block_tokens, v.dtype);
        uint8_t* head_rows = r.block + (r.kv == 0 ? v.KRow(r.head, 0) : v.VRow(r.head, 0));
        EncodeFp8Group(src, wire, r.row, r.rows, r.dim, scale, v.dtype, head_rows, scale_slot);
        break;
      }
      default:
        ConvertElements(src, wire, dst, v.dtype, n);
    }
  });
}

void DecodePayloadCpu(const PayloadMap& m, DType wire, uint8_t* payload) {
  if (!qmath::IsElementDType(wire) || m.num_tokens == 0) return;
  ForEachRun(m, DTypeBytes(wire), [&](const Run& r) {
    const LayerView& v = *r.v;
    const uint8_t* src = r.block + RowOffset(r);
    uint8_t* dst = payload + r.payload;
    const size_t n = r.rows * r.dim;
    switch (v.dtype) {
      case DType::kInt8:
        DequantizeInt8Rows(
            src, reinterpret_cast<const float*>(r.block + v.Int8Scale(r.kv, r.head, r.row)),
            r.block + v.Int8ZeroPoint(r.kv, r.head, r.row), r.rows, r.dim, dst, wire);
        break;
      case DType::kFp8E4M3:
      case DType::kFp8E5M2: {
        float scale;
        std::memcpy(&scale, r.block + v.Fp8Scale(r.kv, r.head), sizeof(scale));
        DecodeFp8(src, v.dtype, n, scale, dst, wire);
        break;
      }
      default:
        ConvertElements(src, v.dtype, dst, wire, n);
    }
  });
}

}  // namespace kvbank::kernels
