// Moves a dense payload in a wire dtype (fp32 / fp16 / bf16) to and from blocks whose layers store
// another dtype: converting, or quantizing to int8 / fp8 on the way in and dequantizing on the way
// out. Works row by row (one row = head_dim values of one layer, K/V part, head and token), in
// payload order, with any chunking of the payload; what it stores does not depend on the chunking.
// An fp8 layer goes by group instead (the rows of one layer, K/V part, head and block, contiguous
// in the payload), held until the payload has brought all of the group's rows, so that its scale
// follows the one rule (kernels/quant_math.h, Fp8GroupScale) and the bytes match
// kernels::EncodePayloadCpu's. Payloads whose wire dtype equals every layer's storage dtype do not
// come here: they are plain copies (kernels::PayloadCopyCpu).
#ifndef KVBANK_SERVER_CORE_ROW_CODEC_H_
#define KVBANK_SERVER_CORE_ROW_CODEC_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/payload_codec.h"
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

  // Called before an fp8 group's rescale rewrites rows an earlier append stored: makes block
  // `block_index` of the table private to this transfer (a copy readers cannot see, swapped in
  // at commit), after which the table names the copy. An error fails the Write that needed it.
  using MakePrivate = std::function<absl::Status(uint64_t block_index)>;
  void SetMakePrivate(MakePrivate f) { make_private_ = std::move(f); }

  // Encodes payload bytes [offset, offset + data.size()) into the pool; a row (fp8: a group)
  // split across calls is held until it is whole. REQUIRES: calls in payload order, contiguous.
  // INVALID_ARGUMENT when the data holds NaN or Inf (the row or group that holds it is not
  // written); what MakePrivate answers when it fails (INTERNAL when a rescale needs it and none
  // was set).
  absl::Status Write(uint64_t offset, absl::Span<const uint8_t> data);
  // Decodes payload bytes [offset, offset + out.size()) from the pool. Any order.
  void Read(uint64_t offset, absl::Span<uint8_t> out) const;

 private:
  using Row = PayloadRow;
  Row RowAt(uint64_t offset) const { return LocatePayloadRow(blocks_, payload_, offset); }
  Row Next(const Row& r) const;
  // The row `rows` rows after r. REQUIRES: r.token + rows <= payload_.num_tokens.
  Row Skip(Row r, uint64_t rows) const;
  // Rows in the unit that starts at r: 1, or for an fp8 layer the rows of r's group the payload
  // holds from r on.
  uint64_t UnitRows(const Row& r) const;
  uint8_t* BlockOf(const Row& r, uint32_t* block_row) const;
  // The block rows of r and the rows - 1 after it (same head, same block).
  kernels::BlockRows BlockRowsOf(const Row& r, uint64_t rows) const;
  // `src` holds `rows` rows (UnitRows(r)) from r on in the wire dtype.
  absl::Status EncodeUnit(const Row& r, uint64_t rows, const uint8_t* src);
  // EncodeUnit once the rows are known finite: kernels::EncodeRows, after making an fp8 block
  // private when the group's scale changes under rows already stored.
  absl::Status EncodeRows(const Row& r, uint64_t rows, const uint8_t* src);
  void DecodeRow(const Row& r, uint8_t* dst) const;

  const BlockLayout& blocks_;
  const PayloadLayout& payload_;
  const DType wire_;
  const uint32_t wire_bytes_;
  uint8_t* const pool_;
  const int32_t* const block_table_;
  const uint64_t token_begin_;
  MakePrivate make_private_;
  std::vector<uint8_t> carry_;  // the start of a unit whose end has not arrived yet
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_ROW_CODEC_H_
