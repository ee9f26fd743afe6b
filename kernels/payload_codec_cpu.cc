// Whole-payload codec on the CPU (payload_codec.h) and the row functions it shares with the
// server's RowCodec. Works on runs: the rows of one (layer, K/V, head) that land in one block are
// contiguous both in the payload and in the block, so each run is one EncodeRows / DecodeRows.
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/payload_codec.h"
#include "kernels/quant.h"
#include "kernels/quant_math.h"

namespace kvbank::kernels {

namespace {

// One run: the rows of one (layer, K/V, head) that land in one block, and the payload offset of
// the first.
struct Run {
  BlockRows rows;
  uint64_t payload;
};

// Calls f(run) for every run of the payload, in payload order.
template <typename F>
void ForEachRun(const PayloadMap& m, uint32_t wire_bytes, F&& f) {
  for (uint32_t li = 0; li < m.num_layers; ++li) {
    const LayerView& v = m.layers[li];
    for (uint32_t kv = 0; kv < v.KvParts(); ++kv) {
      for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
        for (uint64_t t = 0; t < m.num_tokens;) {
          const uint64_t pos = m.token_begin + t;
          const uint32_t row = static_cast<uint32_t>(pos % v.block_tokens);
          const uint64_t rows = std::min<uint64_t>(v.block_tokens - row, m.num_tokens - t);
          uint8_t* block = m.pool + uint64_t(m.block_table[pos / v.block_tokens]) * m.block_bytes;
          f(Run{BlockRows{&v, block, kv, h, row, rows},
                v.PayloadRow(m.layer_offset[li], m.num_tokens, wire_bytes, kv, h, t)});
          t += rows;
        }
      }
    }
  }
}

float* ScaleSlot(const BlockRows& r, uint32_t row) {
  return reinterpret_cast<float*>(r.block + (r.v->dtype == DType::kInt8
                                                 ? r.v->Int8Scale(r.kv, r.head, row)
                                                 : r.v->Fp8Scale(r.kv, r.head)));
}

}  // namespace

float StoredFp8Scale(const BlockRows& r) {
  float stored;  // meaningful only when earlier transfers filled rows [0, r.row)
  std::memcpy(&stored, ScaleSlot(r, 0), sizeof(stored));
  return stored;
}

float Fp8ScaleForRows(const BlockRows& r, const void* src, DType wire) {
  return qmath::Fp8GroupScale(AbsMax(src, wire, r.rows * r.dim()), StoredFp8Scale(r), r.row, r.rows,
                              r.v->block_tokens, r.v->dtype);
}

void EncodeRows(const BlockRows& r, const void* src, DType wire, float fp8_scale) {
  const LayerView& v = *r.v;
  uint8_t* dst = r.block + r.RowAt(r.row);
  switch (v.dtype) {
    case DType::kInt8:
      QuantizeInt8Rows(src, wire, r.rows, r.dim(), dst, ScaleSlot(r, r.row),
                       r.block + v.Int8ZeroPoint(r.kv, r.head, r.row));
      break;
    case DType::kFp8E4M3:
    case DType::kFp8E5M2: {
      const float stored = StoredFp8Scale(r);
      if (r.row > 0 && fp8_scale != stored) {
        // fp8_scale / stored is a power of two: the codes move by whole exponents (Fp8GroupScale).
        uint8_t* head_rows = r.block + r.RowAt(0);
        std::vector<float> values(uint64_t{r.row} * r.dim());
        DecodeFp8(head_rows, v.dtype, values.size(), stored, values.data(), DType::kFp32);
        EncodeFp8(values.data(), DType::kFp32, values.size(), fp8_scale, v.dtype, head_rows);
      }
      std::memcpy(ScaleSlot(r, 0), &fp8_scale, sizeof(fp8_scale));
      EncodeFp8(src, wire, r.rows * r.dim(), fp8_scale, v.dtype, dst);
      break;
    }
    default:
      ConvertElements(src, wire, dst, v.dtype, r.rows * r.dim());
  }
}

void DecodeRows(const BlockRows& r, void* dst, DType wire) {
  const LayerView& v = *r.v;
  const uint8_t* src = r.block + r.RowAt(r.row);
  switch (v.dtype) {
    case DType::kInt8:
      DequantizeInt8Rows(src, ScaleSlot(r, r.row), r.block + v.Int8ZeroPoint(r.kv, r.head, r.row),
                         r.rows, r.dim(), dst, wire);
      break;
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:
      DecodeFp8(src, v.dtype, r.rows * r.dim(), StoredFp8Scale(r), dst, wire);
      break;
    default:
      ConvertElements(src, v.dtype, dst, wire, r.rows * r.dim());
  }
}

void EncodePayloadCpu(const PayloadMap& m, DType wire, const uint8_t* payload) {
  if (!qmath::IsElementDType(wire) || m.num_tokens == 0) return;
  ForEachRun(m, DTypeBytes(wire), [&](const Run& r) {
    const uint8_t* src = payload + r.payload;
    const float fp8_scale =
        qmath::IsFp8DType(r.rows.v->dtype) ? Fp8ScaleForRows(r.rows, src, wire) : 0.0f;
    EncodeRows(r.rows, src, wire, fp8_scale);
  });
}

void DecodePayloadCpu(const PayloadMap& m, DType wire, uint8_t* payload) {
  if (!qmath::IsElementDType(wire) || m.num_tokens == 0) return;
  ForEachRun(m, DTypeBytes(wire),
             [&](const Run& r) { DecodeRows(r.rows, payload + r.payload, wire); });
}

}  // namespace kvbank::kernels
