// Internal to server/rpc: what the KvBankService's handlers share (service.cc, transfers.cc).
#ifndef KVBANK_SERVER_RPC_HANDLER_UTIL_H_
#define KVBANK_SERVER_RPC_HANDLER_UTIL_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "proto/wire.h"
#include "server/core/model_registry.h"
#include "server/core/quote.h"
#include "server/rpc/auth.h"
#include "server/rpc/convert.h"

namespace kvbank::rpc {

inline absl::StatusOr<std::shared_ptr<SequenceStore>> FindModel(const ModelRegistry& registry,
                                                                const std::string& name) {
  if (name.empty()) return absl::InvalidArgumentError("model is empty");
  return registry.Get(name);
}

inline absl::Status CheckSequenceId(uint64_t id) {
  if (id == 0) return absl::InvalidArgumentError("sequence_id is 0 (unset)");
  return absl::OkStatus();
}

// Writes `info` into the reply, or passes its error on.
inline absl::Status Reply(const absl::StatusOr<SequenceInfo>& info, const std::string& model,
                          v1::SequenceInfo* resp) {
  if (!info.ok()) return info.status();
  ToProto(*info, model, resp);
  return absl::OkStatus();
}

// A raw method's request, parsed; INVALID_ARGUMENT naming the type when it is not a `Request`.
template <typename Request>
absl::Status ParseRequest(const grpc::ByteBuffer* raw, Request* req) {
  grpc::ByteBuffer copy(*raw);  // Deserialize consumes its buffer; the slices are shared
  grpc::Status s = grpc::SerializationTraits<Request>::Deserialize(&copy, req);
  if (s.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("request is not a ", Request::descriptor()->full_name()));
}

// The server is draining: a Watch ends; the client resumes from its last sequence elsewhere.
inline absl::Status DrainStatus() {
  return absl::UnavailableError("kvbankd is draining (shutting down): watch again elsewhere");
}

inline absl::Status CheckAdmin(const Caller& caller, const char* what) {
  if (caller.admin) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(what, " is an admin act; tenant ", Quote(caller.tenant), " is not an admin"));
}

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_HANDLER_UTIL_H_
