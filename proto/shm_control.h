// The control frames of the same-host planes: a region transfer asked for on a Unix connection
// to kvbankd's --shm-socket whose region is registered (proto/shm_wire.h), instead of a gRPC
// call. The connection's region binds it to the tenant that claimed it (RegisterRegion, an
// authenticated call); its frames may name any region of that tenant: shared-memory regions and
// CUDA IPC device regions alike. Both ends run on one host, so integers travel in host byte
// order.
//
//   client -> server  ShmControlHeader (op kAppend / kFetch / kFetchBlocks, status 0), then
//                     body_bytes bytes: the request message the gRPC call takes, serialized
//                     (an Append stream's AppendHeader with `source` or `device_source`;
//                     FetchRequest or FetchBlocksRequest with `dest` or `device_dest`).
//                     timeout_ms: the caller's deadline (0: none): past it the server stops the
//                     transfer, as it stops a gRPC call past its deadline.
//   server -> client  ShmControlHeader (op | kReply, the request's request_id, a gRPC status
//                     code), then body_bytes bytes: on status 0 the call's answer, serialized
//                     (AppendResponse; for a fetch, the FetchResponse that carries its header);
//                     else the status message (UTF-8 text, at most kShmControlMaxMessage bytes).
//
// The body is the gRPC call's own message, so that both paths run one implementation of each
// operation with the same checks, errors, tenancy and limits; the frame adds what the socket
// needs (a length, a request id to match answers, the status, the deadline). A connection may
// carry up to kShmControlMaxInFlight requests at once; each is answered once, in the order they
// finish (match replies by request_id); past the limit the server reads no more of the
// connection until one is answered. A frame that does not decode (bad magic or version, an
// unknown op, a body over kShmControlMaxBody, a body that does not parse, a request without its
// region) is answered with INVALID_ARGUMENT naming the problem when its header was whole, and
// the connection is closed; so is a connection that does not read its replies.
#ifndef KVBANK_PROTO_SHM_CONTROL_H_
#define KVBANK_PROTO_SHM_CONTROL_H_

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvbank/v1/kvbank.pb.h"

namespace kvbank::proto {

inline constexpr char kShmControlMagic[4] = {'K', 'V', 'B', 'C'};
inline constexpr uint16_t kShmControlVersion = 1;
// A body's size limit: an append's token ids (4 bytes each) or a FetchBlocks' hashes (32 bytes
// each) of a long prompt, with room; the payload itself is in the region.
inline constexpr uint32_t kShmControlMaxBody = 4u << 20;
inline constexpr uint32_t kShmControlMaxMessage = 4096;
// Requests a connection may have in flight (their replies always fit the socket's buffer).
inline constexpr uint32_t kShmControlMaxInFlight = 32;

enum class ShmControlOp : uint16_t {
  kAppend = 1,       // AppendHeader (source or device_source) -> AppendResponse
  kFetch = 2,        // FetchRequest (dest or device_dest) -> FetchResponse (its header)
  kFetchBlocks = 3,  // FetchBlocksRequest (dest or device_dest) -> FetchResponse (its header)
};
inline constexpr uint16_t kShmControlReply = 0x8000;  // or-ed into a reply's op

struct ShmControlHeader {
  char magic[4];
  uint16_t version;
  uint16_t op;          // ShmControlOp, | kShmControlReply in a reply
  uint32_t body_bytes;  // what follows the header
  uint32_t status;      // a reply's gRPC status code; 0 in a request
  uint64_t request_id;  // the client's; echoed in the reply
  uint32_t timeout_ms;  // a request's deadline from its arrival, 0: none; 0 in a reply
  uint32_t reserved;    // 0
};
static_assert(sizeof(ShmControlHeader) == 32, "the frame header is 32 bytes on every host");

using ShmControlRequestBody =
    std::variant<v1::AppendHeader, v1::FetchRequest, v1::FetchBlocksRequest>;
struct ShmControlRequest {
  uint64_t request_id = 0;
  uint32_t timeout_ms = 0;
  ShmControlRequestBody body;
  ShmControlOp op() const { return static_cast<ShmControlOp>(body.index() + 1); }
};

using ShmControlAnswer = std::variant<v1::AppendResponse, v1::FetchResponse>;
struct ShmControlReplyFrame {
  uint64_t request_id = 0;
  ShmControlOp op = ShmControlOp::kAppend;
  absl::Status status;      // the call's status (its message is the reply's text)
  ShmControlAnswer answer;  // when status is OK: AppendResponse for kAppend, else FetchResponse
};

// The header at the start of `bytes` (at least sizeof(ShmControlHeader) of them), checked:
// magic, version, reserved 0, body_bytes within kShmControlMaxBody. `reply`: whether a reply's
// header is expected (op with kShmControlReply, any status) or a request's (status 0).
absl::StatusOr<ShmControlHeader> DecodeShmControlHeader(absl::Span<const uint8_t> bytes,
                                                        bool reply);

// A whole request frame (header and body, nothing more). INVALID_ARGUMENT naming the problem.
std::vector<uint8_t> EncodeShmControlRequest(const ShmControlRequest& request);
absl::StatusOr<ShmControlRequest> DecodeShmControlRequest(absl::Span<const uint8_t> frame);

// A whole reply frame. A non-OK status travels as its code and its message, cut to
// kShmControlMaxMessage bytes.
std::vector<uint8_t> EncodeShmControlReply(const ShmControlReplyFrame& reply);
absl::StatusOr<ShmControlReplyFrame> DecodeShmControlReply(absl::Span<const uint8_t> frame);

}  // namespace kvbank::proto

#endif  // KVBANK_PROTO_SHM_CONTROL_H_
