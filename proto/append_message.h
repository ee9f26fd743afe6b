// The service's decoder of one raw AppendRequest message (the Append method is raw so that the
// data field's bytes go from gRPC's slices to the pool without protobuf's copy into a string).
#ifndef KVBANK_PROTO_APPEND_MESSAGE_H_
#define KVBANK_PROTO_APPEND_MESSAGE_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "kvbank/v1/kvbank.pb.h"

namespace kvbank::proto {

struct AppendMessage {
  std::optional<v1::AppendHeader> header;
  // The data field's bytes, in order, as spans into `slices` (valid while this struct lives and
  // is not moved from: a small slice holds its bytes inline).
  std::vector<absl::Span<const uint8_t>> data;
  std::vector<grpc::Slice> slices;  // the message's own references on its bytes
};

// Decodes one AppendRequest: the header (field 1) is taken before the data (field 2) whatever
// their order, as protobuf's parse would, and fields this server does not know are skipped.
// Unlike protobuf it refuses a repeated header or data field (a client never sends one) and a
// header longer than `max_header_bytes`. INVALID_ARGUMENT when the bytes are not such a message;
// *out is then unspecified.
absl::Status DecodeAppendMessage(const grpc::ByteBuffer& message, uint64_t max_header_bytes,
                                 AppendMessage* out);

}  // namespace kvbank::proto

#endif  // KVBANK_PROTO_APPEND_MESSAGE_H_
