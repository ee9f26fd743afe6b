// Protobuf's wire format read straight from gRPC slices, for the few messages kvbank encodes and
// decodes itself so that payload bytes are not copied into and out of protobuf strings
// (FetchResponse in the service and the SDK, AppendRequest in the service). Header-only.
#ifndef KVBANK_PROTO_WIRE_H_
#define KVBANK_PROTO_WIRE_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "grpcpp/support/byte_buffer.h"

namespace kvbank::proto {

// A cursor over one message's bytes, held in gRPC slices that are never joined.
class SliceReader {
 public:
  explicit SliceReader(const grpc::ByteBuffer& buffer) {
    if (!buffer.Dump(&slices_).ok()) slices_.clear();
  }
  bool done() {
    while (i_ < slices_.size() && off_ == slices_[i_].size()) {
      ++i_;
      off_ = 0;
    }
    return i_ == slices_.size();
  }
  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (done()) return false;
      const uint8_t b = slices_[i_].begin()[off_++];
      *v |= uint64_t{b & 0x7fu} << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }
  // The next n bytes as spans into the slices (valid while this reader lives); false when fewer
  // are left.
  bool Spans(uint64_t n, std::vector<absl::Span<const uint8_t>>* out) {
    while (n > 0) {
      if (done()) return false;
      const uint64_t take = std::min<uint64_t>(n, slices_[i_].size() - off_);
      out->emplace_back(slices_[i_].begin() + off_, take);
      off_ += take;
      n -= take;
    }
    return true;
  }
  // The message's slices, which hold the bytes Spans pointed into (a small slice holds its bytes
  // inline, so spans into it die with the grpc::Slice; moving the vector keeps them alive).
  std::vector<grpc::Slice> ReleaseSlices() && { return std::move(slices_); }
  // Copies the next n bytes to dst (skips them when dst is null); false when fewer are left.
  bool Copy(uint8_t* dst, uint64_t n) {
    while (n > 0) {
      if (done()) return false;
      const uint64_t take = std::min<uint64_t>(n, slices_[i_].size() - off_);
      if (dst != nullptr) {
        std::memcpy(dst, slices_[i_].begin() + off_, take);
        dst += take;
      }
      off_ += take;
      n -= take;
    }
    return true;
  }
  // The next field's key, and for a length-delimited field (wire type 2) its length; other
  // wire types (varint, fixed64, fixed32) are read past and reported with *length = 0. False at
  // a malformed field (truncated, a group, an invalid wire type).
  bool Field(uint32_t* number, uint32_t* wire_type, uint64_t* length) {
    uint64_t key = 0, v = 0;
    if (!Varint(&key) || key >> 3 == 0 || key >> 3 > 0x1fffffff) return false;
    *number = static_cast<uint32_t>(key >> 3);
    *wire_type = static_cast<uint32_t>(key & 7);
    *length = 0;
    switch (*wire_type) {
      case 0:
        return Varint(&v);
      case 1:
        return Copy(nullptr, 8);
      case 5:
        return Copy(nullptr, 4);
      case 2:
        return Varint(length);
      default:
        return false;
    }
  }

 private:
  std::vector<grpc::Slice> slices_;
  size_t i_ = 0;
  size_t off_ = 0;
};

// Appends the key and length of length-delimited field `number` (protobuf's wire format).
inline void AppendLengthDelimitedKey(uint32_t number, uint64_t length, std::string* out) {
  uint64_t key = uint64_t{number} << 3 | 2;
  for (uint64_t v : {key, length}) {
    do {
      const uint8_t low = v & 0x7f;
      v >>= 7;
      out->push_back(static_cast<char>(v != 0 ? low | 0x80 : low));
    } while (v != 0);
  }
}

}  // namespace kvbank::proto

#endif  // KVBANK_PROTO_WIRE_H_
