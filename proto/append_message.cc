#include "proto/append_message.h"

#include <string>
#include <utility>

#include "proto/wire.h"

namespace kvbank::proto {

absl::Status DecodeAppendMessage(const grpc::ByteBuffer& message, uint64_t max_header_bytes,
                                 AppendMessage* out) {
  const absl::Status bad =
      absl::InvalidArgumentError("append message is not a kvbank.v1.AppendRequest");
  out->header.reset();
  out->data.clear();
  SliceReader in(message);
  bool had_data = false;
  while (!in.done()) {
    uint32_t field = 0, wire_type = 0;
    uint64_t n = 0;
    if (!in.Field(&field, &wire_type, &n)) return bad;
    if (wire_type != 2) continue;
    if (field == 1) {
      if (out->header.has_value() || n > max_header_bytes) return bad;
      std::string serialized(n, '\0');
      out->header.emplace();
      if (!in.Copy(reinterpret_cast<uint8_t*>(serialized.data()), n) ||
          !out->header->ParseFromString(serialized)) {
        return bad;
      }
    } else if (field == 2) {
      if (had_data) return bad;
      had_data = true;
      if (!in.Spans(n, &out->data)) return bad;
    } else if (!in.Copy(nullptr, n)) {
      return bad;
    }
  }
  // Moving the vector keeps its elements where they are, so the spans stay valid.
  out->slices = std::move(in).ReleaseSlices();
  return absl::OkStatus();
}

}  // namespace kvbank::proto
