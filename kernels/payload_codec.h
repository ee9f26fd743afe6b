// Whole-payload conversion between a dense payload in a wire dtype (fp32 / fp16 / bf16) and
// blocks whose layers store another dtype: converting, quantizing to int8 / fp8 on the way in,
// dequantizing on the way out. What a pool the CPU cannot address (the CUDA backend) runs on
// each staged piece of a transfer (whole layers, each a payload of its own); the host backend
// streams chunks through the server's RowCodec instead, which writes the same bytes when it is
// given the whole payload in one call.
//
// Rows: one row = head_dim (K) or head_dim_v (V) values of one (layer, K/V part, kv head, token);
// the payload is laid out as PayloadLayout::Make(blocks, l0, l1, n, wire) says:
// per layer [K: heads][n][head_dim] then [V: heads][n][head_dim_v] (no V part for MLA).
// Per layer storage dtype:
//   fp32 / fp16 / bf16: ConvertElements of the row (round to nearest even, saturating).
//   int8:               QuantizeInt8Rows of the row: the row's scale and zero point go into the
//                       block's scale slots (LayerView::Int8Scale / Int8ZeroPoint).
//   fp8 e4m3 / e5m2:    one scale per (block, K/V part, head). When the payload holds a block's
//                       row 0 of that head, the scale is set from the absolute maximum of that
//                       head's rows the payload holds in that block (rows r .. min(end of block,
//                       end of payload)); when those rows are fewer than block_tokens the
//                       maximum is multiplied by 4 (headroom for decode rows still to come):
//                       scale = Fp8ScaleFor(amax, dtype). Rows of a block whose row 0 came in an
//                       earlier transfer use the scale already stored in the block.
// REQUIRES (not checked): every value finite (the caller checks first), payload made with
// wire_elem_bytes == DTypeBytes(wire), map.scale_offset null, the block table covering every
// touched token. No gRPC, protobuf or Abseil here.
#ifndef KVBANK_KERNELS_PAYLOAD_CODEC_H_
#define KVBANK_KERNELS_PAYLOAD_CODEC_H_

#include <cstdint>

#include "kernels/block_copy.h"
#include "kvbank/layout.h"

namespace kvbank::kernels {

// The headroom an fp8 block's scale leaves when the rows that set it are fewer than a block.
inline constexpr float kFp8ScaleHeadroom = 4.0f;

// payload (map.total_bytes bytes, wire dtype) -> pool. Host memory.
void EncodePayloadCpu(const PayloadMap& map, DType wire, const uint8_t* payload);
// pool -> payload (map.total_bytes bytes, wire dtype). Host memory.
void DecodePayloadCpu(const PayloadMap& map, DType wire, uint8_t* payload);

}  // namespace kvbank::kernels

#endif  // KVBANK_KERNELS_PAYLOAD_CODEC_H_
