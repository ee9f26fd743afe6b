// The shared-memory plane's control frames (proto/shm_control.h).
#include "proto/shm_control.h"

#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvbank::proto {
namespace {

constexpr size_t kHeader = sizeof(ShmControlHeader);

bool KnownOp(uint16_t op) {
  return op >= static_cast<uint16_t>(ShmControlOp::kAppend) &&
         op <= static_cast<uint16_t>(ShmControlOp::kFetchBlocks);
}

const char* OpName(ShmControlOp op) {
  switch (op) {
    case ShmControlOp::kAppend:
      return "append";
    case ShmControlOp::kFetch:
      return "fetch";
    case ShmControlOp::kFetchBlocks:
      return "fetch-blocks";
  }
  return "?";
}

std::vector<uint8_t> Frame(uint16_t op, uint32_t status, uint64_t request_id, uint32_t timeout_ms,
                           const std::string& body) {
  ShmControlHeader h{};
  std::memcpy(h.magic, kShmControlMagic, sizeof(h.magic));
  h.version = kShmControlVersion;
  h.op = op;
  h.body_bytes = static_cast<uint32_t>(body.size());
  h.status = status;
  h.request_id = request_id;
  h.timeout_ms = timeout_ms;
  std::vector<uint8_t> out(kHeader + body.size());
  std::memcpy(out.data(), &h, kHeader);
  if (!body.empty()) std::memcpy(out.data() + kHeader, body.data(), body.size());
  return out;
}

// The header and the body of a whole frame, checked against each other.
absl::StatusOr<std::pair<ShmControlHeader, absl::Span<const uint8_t>>> Split(
    absl::Span<const uint8_t> frame, bool reply) {
  auto h = DecodeShmControlHeader(frame, reply);
  if (!h.ok()) return h.status();
  if (frame.size() - kHeader != h->body_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("control frame: header says ", h->body_bytes,
                                                   " body bytes, the frame has ",
                                                   frame.size() - kHeader));
  }
  return std::make_pair(*h, frame.subspan(kHeader));
}

template <typename M>
absl::StatusOr<M> Parse(absl::Span<const uint8_t> body, const char* what) {
  M m;
  if (!m.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("control frame: the body is not a serialized ", what));
  }
  return m;
}

// A fetch's request: it names the one region it is written into (dest or device_dest).
template <typename M>
absl::StatusOr<M> ParseWithDest(absl::Span<const uint8_t> body, ShmControlOp op, const char* what) {
  auto m = Parse<M>(body, what);
  if (m.ok() && m->has_dest() == m->has_device_dest()) {
    return absl::InvalidArgumentError(absl::StrCat("control frame: a ", OpName(op),
                                                   " names the one region it is written into "
                                                   "(dest or device_dest)"));
  }
  return m;
}

}  // namespace

absl::StatusOr<ShmControlHeader> DecodeShmControlHeader(absl::Span<const uint8_t> bytes,
                                                        bool reply) {
  if (bytes.size() < kHeader) {
    return absl::InvalidArgumentError(absl::StrCat(
        "control frame: ", bytes.size(), " bytes, less than its ", kHeader, "-byte header"));
  }
  ShmControlHeader h;
  std::memcpy(&h, bytes.data(), kHeader);
  if (std::memcmp(h.magic, kShmControlMagic, sizeof(h.magic)) != 0) {
    return absl::InvalidArgumentError("control frame: bad magic (not KVBC)");
  }
  if (h.version != kShmControlVersion) {
    return absl::InvalidArgumentError(absl::StrCat("control frame: version ", h.version,
                                                   ", this end speaks ", kShmControlVersion));
  }
  if (h.reserved != 0) return absl::InvalidArgumentError("control frame: reserved is not 0");
  if (reply && h.timeout_ms != 0) {
    return absl::InvalidArgumentError("control frame: a reply's timeout_ms must be 0");
  }
  const bool is_reply = (h.op & kShmControlReply) != 0;
  if (is_reply != reply || !KnownOp(h.op & ~kShmControlReply)) {
    return absl::InvalidArgumentError(absl::StrCat("control frame: op ", h.op, " is not a ",
                                                   reply ? "reply" : "request", " this end knows"));
  }
  if (!reply && h.status != 0) {
    return absl::InvalidArgumentError("control frame: a request's status must be 0");
  }
  if (reply && h.status > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("control frame: status ", h.status, " is not a gRPC status code"));
  }
  if (h.body_bytes > kShmControlMaxBody) {
    return absl::InvalidArgumentError(absl::StrCat("control frame: body of ", h.body_bytes,
                                                   " bytes, more than ", kShmControlMaxBody));
  }
  return h;
}

std::vector<uint8_t> EncodeShmControlRequest(const ShmControlRequest& request) {
  std::string body;
  std::visit([&](const auto& m) { m.SerializeToString(&body); }, request.body);
  return Frame(static_cast<uint16_t>(request.op()), 0, request.request_id, request.timeout_ms,
               body);
}

absl::StatusOr<ShmControlRequest> DecodeShmControlRequest(absl::Span<const uint8_t> frame) {
  auto split = Split(frame, /*reply=*/false);
  if (!split.ok()) return split.status();
  const auto& [h, body] = *split;
  ShmControlRequest out;
  out.request_id = h.request_id;
  out.timeout_ms = h.timeout_ms;
  switch (static_cast<ShmControlOp>(h.op)) {
    case ShmControlOp::kAppend: {
      auto m = Parse<v1::AppendHeader>(body, "AppendHeader");
      if (!m.ok()) return m.status();
      if (m->has_source() == m->has_device_source()) {
        return absl::InvalidArgumentError(
            "control frame: an append names the one region that holds its payload (source or "
            "device_source)");
      }
      out.body = *std::move(m);
      break;
    }
    case ShmControlOp::kFetch: {
      auto m = ParseWithDest<v1::FetchRequest>(body, ShmControlOp::kFetch, "FetchRequest");
      if (!m.ok()) return m.status();
      out.body = *std::move(m);
      break;
    }
    case ShmControlOp::kFetchBlocks: {
      auto m = ParseWithDest<v1::FetchBlocksRequest>(body, ShmControlOp::kFetchBlocks,
                                                     "FetchBlocksRequest");
      if (!m.ok()) return m.status();
      out.body = *std::move(m);
      break;
    }
  }
  return out;
}

std::vector<uint8_t> EncodeShmControlReply(const ShmControlReplyFrame& reply) {
  const uint16_t op = static_cast<uint16_t>(reply.op) | kShmControlReply;
  if (!reply.status.ok()) {
    std::string text(reply.status.message().substr(0, kShmControlMaxMessage));
    return Frame(op, static_cast<uint32_t>(reply.status.code()), reply.request_id, 0, text);
  }
  std::string body;
  std::visit([&](const auto& m) { m.SerializeToString(&body); }, reply.answer);
  return Frame(op, 0, reply.request_id, 0, body);
}

absl::StatusOr<ShmControlReplyFrame> DecodeShmControlReply(absl::Span<const uint8_t> frame) {
  auto split = Split(frame, /*reply=*/true);
  if (!split.ok()) return split.status();
  const auto& [h, body] = *split;
  ShmControlReplyFrame out;
  out.request_id = h.request_id;
  out.op = static_cast<ShmControlOp>(h.op & ~kShmControlReply);
  if (h.status != 0) {
    if (body.size() > kShmControlMaxMessage) {
      return absl::InvalidArgumentError(absl::StrCat("control frame: a status message of ",
                                                     body.size(), " bytes, more than ",
                                                     kShmControlMaxMessage));
    }
    out.status = absl::Status(static_cast<absl::StatusCode>(h.status),
                              std::string(reinterpret_cast<const char*>(body.data()), body.size()));
    return out;
  }
  if (out.op == ShmControlOp::kAppend) {
    auto m = Parse<v1::AppendResponse>(body, "AppendResponse");
    if (!m.ok()) return m.status();
    out.answer = *std::move(m);
  } else {
    auto m = Parse<v1::FetchResponse>(body, "FetchResponse");
    if (!m.ok()) return m.status();
    if (!m->data().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("control frame: a ", OpName(out.op),
                       " reply carries its bytes in the region, not inline"));
    }
    out.answer = *std::move(m);
  }
  return out;
}

}  // namespace kvbank::proto
