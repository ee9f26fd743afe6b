// The shared-memory plane's control frames (proto/shm_control.h) over fuzzer-chosen bytes, read
// as a request and as a reply. Properties: the decoders never crash and refuse with
// INVALID_ARGUMENT only; a decoded request names exactly one region (an append's source or
// device_source, a fetch's dest or device_dest); whatever decodes encodes back to a frame that
// decodes to the same request or reply (same op, request id, timeout, status and message bytes).
#include <cstdint>
#include <string>
#include <variant>

#include "proto/shm_control.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace kvbank::proto;  // NOLINT: the fuzz target's one subject

template <typename Variant>
std::string Serialized(const Variant& m) {
  std::string s;
  std::visit([&](const auto& x) { x.SerializeToString(&s); }, m);
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::Span<const uint8_t> frame(data, size);

  auto request = DecodeShmControlRequest(frame);
  if (!request.ok()) {
    FUZZ_CHECK(request.status().code() == absl::StatusCode::kInvalidArgument);
  } else {
    if (const auto* a = std::get_if<kvbank::v1::AppendHeader>(&request->body)) {
      FUZZ_CHECK(a->has_source() != a->has_device_source());
    } else if (const auto* f = std::get_if<kvbank::v1::FetchRequest>(&request->body)) {
      FUZZ_CHECK(f->has_dest() != f->has_device_dest());
    } else {
      const auto& b = std::get<kvbank::v1::FetchBlocksRequest>(request->body);
      FUZZ_CHECK(b.has_dest() != b.has_device_dest());
    }
    auto again = DecodeShmControlRequest(EncodeShmControlRequest(*request));
    FUZZ_CHECK(again.ok());
    FUZZ_CHECK(again->request_id == request->request_id);
    FUZZ_CHECK(again->timeout_ms == request->timeout_ms);
    FUZZ_CHECK(again->op() == request->op());
    FUZZ_CHECK(Serialized(again->body) == Serialized(request->body));
  }

  auto reply = DecodeShmControlReply(frame);
  if (!reply.ok()) {
    FUZZ_CHECK(reply.status().code() == absl::StatusCode::kInvalidArgument);
  } else {
    FUZZ_CHECK(reply->status.message().size() <= kShmControlMaxMessage);
    auto again = DecodeShmControlReply(EncodeShmControlReply(*reply));
    FUZZ_CHECK(again.ok());
    FUZZ_CHECK(again->request_id == reply->request_id && again->op == reply->op);
    FUZZ_CHECK(again->status == reply->status);
    if (reply->status.ok()) FUZZ_CHECK(Serialized(again->answer) == Serialized(reply->answer));
  }
  return 0;
}
