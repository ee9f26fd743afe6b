// Whole-payload conversion between a dense payload in a wire dtype (fp32 / fp16 / bf16) and
// blocks whose layers store another dtype: converting, quantizing to int8 / fp8 on the way in,
// dequantizing on the way out. What a pool the CPU cannot address (the CUDA backend) runs on
// each staged piece of a transfer (whole layers, each a payload of its own); the host backend
// streams chunks through the server's RowCodec instead, which writes the same bytes however the
// payload is chunked.
//
// Rows: one row = head_dim (K) or head_dim_v (V) values of one (layer, K/V part, kv head, token);
// the payload is laid out as PayloadLayout::Make(blocks, l0, l1, n, wire) says:
// per layer [K: heads][n][head_dim] then [V: heads][n][head_dim_v] (no V part for MLA).
// Per layer storage dtype:
//   fp32 / fp16 / bf16: ConvertElements of the row (round to nearest even, saturating).
//   int8:               QuantizeInt8Rows of the row: the row's scale and zero point go into the
//                       block's scale slots (LayerView::Int8Scale / Int8ZeroPoint).
//   fp8 e4m3 / e5m2:    one scale per group (block, K/V part, head), set by the rule of
//                       qmath::Fp8GroupScale (kernels/quant_math.h) from the absolute maximum of
//                       the group's rows the payload holds: exact when the payload fills the
//                       block, with headroom when it starts a block it does not fill; a payload
//                       that continues a block keeps the block's scale while it covers the new
//                       rows, else rescales the block (requantizing the rows already there), so
//                       no finite value saturates. The stored bytes depend only on the payload
//                       and the blocks, never on how the payload was cut into pieces.
//                       NOTE: a rescale rewrites rows earlier transfers stored: the caller hands
//                       in a block table whose partially filled first block is private to it.
// REQUIRES (not checked): every value finite (the caller checks first), payload made with
// wire_elem_bytes == DTypeBytes(wire), map.scale_offset null, the block table covering every
// touched token. No gRPC, protobuf or Abseil here.
#ifndef KVBANK_KERNELS_PAYLOAD_CODEC_H_
#define KVBANK_KERNELS_PAYLOAD_CODEC_H_

#include <cstdint>

#include "kernels/block_copy.h"
#include "kvbank/layout.h"

namespace kvbank::kernels {

// payload (map.total_bytes bytes, wire dtype) -> pool. Host memory.
void EncodePayloadCpu(const PayloadMap& map, DType wire, const uint8_t* payload);
// pool -> payload (map.total_bytes bytes, wire dtype). Host memory.
void DecodePayloadCpu(const PayloadMap& map, DType wire, uint8_t* payload);

// ---- rows of one block: the one host codec --------------------------------------------------
//
// Rows [row, row + rows) of one (layer, K/V part, kv head) in one block: the unit that both host
// codecs (EncodePayloadCpu / DecodePayloadCpu here, and the server's streaming RowCodec) hand to
// the functions below, so that they store and return the same bytes. The element math is
// quant.h's (quant_math.h per element, shared with the CUDA kernels).
struct BlockRows {
  const LayerView* v = nullptr;
  uint8_t* block = nullptr;  // the block's first byte
  uint32_t kv = 0;           // 0 = K, 1 = V
  uint32_t head = 0;
  uint32_t row = 0;  // first block row
  uint64_t rows = 0;

  uint32_t dim() const { return v->Dim(kv); }
  // The block offset of block row `r` of this (K/V part, head).
  uint64_t RowAt(uint32_t r) const { return kv == 0 ? v->KRow(head, r) : v->VRow(head, r); }
};

// fp8 layers: the scale the rows' group has once they are encoded: qmath::Fp8GroupScale of their
// largest magnitude (src: [rows][dim] of `wire`) and the scale the block holds. When r.row > 0 and
// the answer differs from StoredFp8Scale(r), EncodeRows requantizes rows [0, r.row) (a rescale
// of rows earlier transfers stored).
float Fp8ScaleForRows(const BlockRows& r, const void* src, DType wire);
float StoredFp8Scale(const BlockRows& r);

// src ([rows][dim] of `wire`, finite) -> the rows: converted (fp32 / fp16 / bf16), quantized per
// row with the row's scale and zero point (int8), or encoded with `fp8_scale` (fp8:
// Fp8ScaleForRows's answer for these rows, stored in the group's scale slot; other dtypes ignore
// it). REQUIRES for fp8: the rows are all the group's rows this payload holds.
void EncodeRows(const BlockRows& r, const void* src, DType wire, float fp8_scale);
// The rows -> dst ([rows][dim] of `wire`).
void DecodeRows(const BlockRows& r, void* dst, DType wire);

}  // namespace kvbank::kernels

#endif  // KVBANK_KERNELS_PAYLOAD_CODEC_H_
