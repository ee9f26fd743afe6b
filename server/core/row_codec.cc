#include "server/core/row_codec.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/payload_codec.h"
#include "kernels/quant.h"
#include "kernels/quant_math.h"

namespace kvbank {

RowCodec::RowCodec(const BlockLayout& blocks, const PayloadLayout& payload, DType wire,
                   uint8_t* pool, const int32_t* block_table, uint64_t token_begin)
    : blocks_(blocks),
      payload_(payload),
      wire_(wire),
      wire_bytes_(DTypeBytes(wire)),
      pool_(pool),
      block_table_(block_table),
      token_begin_(token_begin) {}

PayloadRow LocatePayloadRow(const BlockLayout& b, const PayloadLayout& p, uint64_t offset) {
  size_t i = 0;
  while (i + 1 < p.layer_offset.size() && p.layer_offset[i + 1] <= offset) ++i;
  PayloadRow r;
  r.layer = p.layer_begin + static_cast<uint32_t>(i);
  uint64_t rel = offset - p.layer_offset[i];
  const uint64_t k_part = p.KPartBytes(b, r.layer);
  r.kv = rel < k_part ? 0 : 1;
  if (r.kv == 1) rel -= k_part;
  r.dim = b.layers[r.layer].Dim(r.kv);
  const uint64_t index = rel / p.RowBytes(b, r.layer, r.kv);  // [head][token] within the part
  r.head = static_cast<uint32_t>(index / p.num_tokens);
  r.token = index % p.num_tokens;
  r.begin = p.RowOffset(b, r.layer, r.kv, r.head, r.token);
  return r;
}

absl::Status NonFiniteError(const PayloadRow& r, uint64_t element) {
  return absl::InvalidArgumentError(absl::StrCat(
      "payload holds NaN or Inf (layer ", r.layer, ", ", r.kv ? "V" : "K", ", head ", r.head,
      ", token ", r.token, ", element ", element, "); refused, nothing stored"));
}

RowCodec::Row RowCodec::Next(const Row& r) const {
  const LayerView& v = blocks_.layers[r.layer];
  Row n = r;
  if (++n.token == payload_.num_tokens) {
    n.token = 0;
    if (++n.head == v.num_kv_heads) {
      n.head = 0;
      if (n.kv == 0 && v.has_v) {
        n.kv = 1;
      } else {
        n.kv = 0;
        ++n.layer;
      }
    }
  }
  if (n.layer >= payload_.layer_end) {  // past the payload: only its offset means anything
    n.begin = payload_.total_bytes;
    return n;
  }
  n.dim = blocks_.layers[n.layer].Dim(n.kv);
  n.begin = payload_.RowOffset(blocks_, n.layer, n.kv, n.head, n.token);
  return n;
}

uint8_t* RowCodec::BlockOf(const Row& r, uint32_t* block_row) const {
  const uint64_t pos = token_begin_ + r.token;
  const uint32_t bt = blocks_.block_tokens;
  *block_row = static_cast<uint32_t>(pos % bt);
  return pool_ + uint64_t(block_table_[pos / bt]) * blocks_.block_bytes;
}

RowCodec::Row RowCodec::Skip(Row r, uint64_t rows) const {
  r.token += rows - 1;
  return Next(r);
}

uint64_t RowCodec::UnitRows(const Row& r) const {
  if (!kernels::qmath::IsFp8DType(blocks_.layers[r.layer].dtype)) return 1;
  const uint64_t bt = blocks_.block_tokens;
  return std::min(bt - (token_begin_ + r.token) % bt, payload_.num_tokens - r.token);
}

absl::Status RowCodec::EncodeUnit(const Row& r, uint64_t rows, const uint8_t* src) {
  // An fp8 group's scale covers all its rows: they must be finite before any is encoded.
  const int64_t bad = kernels::FindNonFinite(src, wire_, rows * r.dim);
  if (bad >= 0) {  // name the row that holds it: the same head, bad / dim tokens on
    Row at = r;
    at.token += static_cast<uint64_t>(bad) / r.dim;
    at.begin = payload_.RowOffset(blocks_, at.layer, at.kv, at.head, at.token);
    return NonFiniteError(at, static_cast<uint64_t>(bad) % r.dim);
  }
  return EncodeRows(r, rows, src);
}

kernels::BlockRows RowCodec::BlockRowsOf(const Row& r, uint64_t rows) const {
  uint32_t row = 0;
  uint8_t* block = BlockOf(r, &row);
  return kernels::BlockRows{&blocks_.layers[r.layer], block, r.kv, r.head, row, rows};
}

absl::Status RowCodec::EncodeRows(const Row& r, uint64_t rows, const uint8_t* src) {
  kernels::BlockRows at = BlockRowsOf(r, rows);
  float fp8_scale = 0.0f;
  if (kernels::qmath::IsFp8DType(at.v->dtype)) {
    fp8_scale = kernels::Fp8ScaleForRows(at, src, wire_);
    if (at.row > 0 && fp8_scale != kernels::StoredFp8Scale(at)) {
      // The rescale rewrites rows [0, row), which readers may be reading and which an aborted
      // append must leave as they were: it happens on a private copy.
      if (make_private_ == nullptr) {
        return absl::InternalError("an fp8 rescale needs a private block and the codec has none");
      }
      const uint64_t block_index = (token_begin_ + r.token) / blocks_.block_tokens;
      if (absl::Status s = make_private_(block_index); !s.ok()) return s;
      at = BlockRowsOf(r, rows);  // the table names the copy now
    }
  }
  kernels::EncodeRows(at, src, wire_, fp8_scale);
  return absl::OkStatus();
}

void RowCodec::DecodeRow(const Row& r, uint8_t* dst) const {
  kernels::DecodeRows(BlockRowsOf(r, 1), dst, wire_);
}

absl::Status RowCodec::Write(uint64_t offset, absl::Span<const uint8_t> data) {
  uint64_t at = offset;
  if (!carry_.empty()) {  // finish the unit begun by an earlier call
    const Row r = RowAt(at - carry_.size());
    const uint64_t rows = UnitRows(r);
    const uint64_t need = rows * r.dim * wire_bytes_ - carry_.size();
    const size_t take = std::min<uint64_t>(need, data.size());
    carry_.insert(carry_.end(), data.begin(), data.begin() + take);
    data.remove_prefix(take);
    at += take;
    if (take < need) return absl::OkStatus();
    const absl::Status s = EncodeUnit(r, rows, carry_.data());
    carry_.clear();
    if (!s.ok()) return s;
  }
  if (data.empty()) return absl::OkStatus();
  Row r = RowAt(at);
  while (!data.empty()) {
    const uint64_t rows = UnitRows(r);
    const uint64_t bytes = rows * r.dim * wire_bytes_;
    if (data.size() < bytes) {
      carry_.assign(data.begin(), data.end());
      break;
    }
    if (absl::Status s = EncodeUnit(r, rows, data.data()); !s.ok()) return s;
    data.remove_prefix(bytes);
    at += bytes;
    if (at < payload_.total_bytes) r = Skip(r, rows);
  }
  return absl::OkStatus();
}

void RowCodec::Read(uint64_t offset, absl::Span<uint8_t> out) const {
  if (out.empty()) return;
  std::vector<uint8_t> tmp;
  Row r = RowAt(offset);
  uint64_t at = offset;
  size_t done = 0;
  while (done < out.size()) {
    const uint64_t row_bytes = uint64_t{r.dim} * wire_bytes_;
    const uint64_t skip = at - r.begin;
    const size_t n = std::min<uint64_t>(row_bytes - skip, out.size() - done);
    if (skip == 0 && n == row_bytes) {
      DecodeRow(r, out.data() + done);
    } else {
      tmp.resize(row_bytes);
      DecodeRow(r, tmp.data());
      std::memcpy(out.data() + done, tmp.data() + skip, n);
    }
    done += n;
    at += n;
    if (at < payload_.total_bytes) r = Next(r);
  }
}

}  // namespace kvbank
