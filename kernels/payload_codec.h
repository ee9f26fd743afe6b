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

// One fp8 group's share of a payload, as EncodePayloadCpu writes it (and the host RowCodec, which
// decides `scale` first): rows [row, row + rows) of the group from src ([rows][dim] of `wire`).
// head_rows: the group's row 0 in the block ([block_tokens][dim] codes); scale_slot: its f32
// scale. scale: qmath::Fp8GroupScale's answer for these rows; when row > 0 and it differs from the
// stored scale, rows [0, row) are requantized to it first. Host memory.
void EncodeFp8Group(const void* src, DType wire, uint64_t row, uint64_t rows, uint32_t dim,
                    float scale, DType fp8, uint8_t* head_rows, uint8_t* scale_slot);

}  // namespace kvbank::kernels

#endif  // KVBANK_KERNELS_PAYLOAD_CODEC_H_
