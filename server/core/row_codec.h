// Moves a dense payload in a wire dtype (fp32 / fp16 / bf16) to and from blocks whose layers store
// another dtype: converting, or quantizing to int8 / fp8 on the way in and dequantizing on the way
// out. Works row by row (one row = head_dim values of one layer, K/V part, head and token), in
// payload order, with any chunking of the payload. Payloads whose wire dtype equals every layer's
// storage dtype do not come here: they are plain copies (kernels::PayloadCopyCpu).
#ifndef KVBANK_SERVER_CORE_ROW_CODEC_H_
#define KVBANK_SERVER_CORE_ROW_CODEC_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvbank/layout.h"

namespace kvbank {

// One row of a converted payload (one wire dtype for every layer, PayloadLayout::Make(..., wire)).
struct PayloadRow {
  uint32_t layer = 0;  // absolute layer index
  uint32_t kv = 0;     // 0 = K, 1 = V
  uint32_t head = 0;
  uint64_t token = 0;  // payload token index
  uint64_t begin = 0;  // payload offset of the row
  uint32_t dim = 0;
};
// The row holding payload byte `offset`. REQUIRES: offset < p.total_bytes, p not storage format.
PayloadRow LocatePayloadRow(const BlockLayout& b, const PayloadLayout& p, uint64_t offset);
// INVALID_ARGUMENT: the payload holds NaN or Inf at `element` of row `r`, so nothing is stored.
absl::Status NonFiniteError(const PayloadRow& r, uint64_t element);

// Not thread-safe; one per transfer. The block table and pool memory must outlive it.
class RowCodec {
 public:
  // `payload` must have been made with wire_elem_bytes == DTypeBytes(wire). block_table indexes
  // the sequence's blocks from block 0; token_begin is the sequence position of payload token 0.
  RowCodec(const BlockLayout& blocks, const PayloadLayout& payload, DType wire, uint8_t* pool,
           const int32_t* block_table, uint64_t token_begin);

  // Encodes payload bytes [offset, offset + data.size()) into the pool; a row split across calls
  // is held until it is whole. REQUIRES: calls in payload order, contiguous. INVALID_ARGUMENT
  // (nothing of this call written) when the data holds NaN or Inf.
  absl::Status Write(uint64_t offset, absl::Span<const uint8_t> data);
  // Decodes payload bytes [offset, offset + out.size()) from the pool. Any order.
  void Read(uint64_t offset, absl::Span<uint8_t> out) const;

 private:
  using Row = PayloadRow;
  Row RowAt(uint64_t offset) const { return LocatePayloadRow(blocks_, payload_, offset); }
  Row Next(const Row& r) const;
  uint8_t* BlockOf(const Row& r, uint32_t* block_row) const;
  // `src` holds the row in the wire dtype; `lookahead` more rows of the same head follow it
  // contiguously in `src` (for an fp8 block's scale).
  void EncodeRow(const Row& r, const uint8_t* src, uint64_t lookahead);
  void DecodeRow(const Row& r, uint8_t* dst) const;

  const BlockLayout& blocks_;
  const PayloadLayout& payload_;
  const DType wire_;
  const uint32_t wire_bytes_;
  uint8_t* const pool_;
  const int32_t* const block_table_;
  const uint64_t token_begin_;
  std::vector<uint8_t> carry_;  // the start of a row whose end has not arrived yet
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_ROW_CODEC_H_
