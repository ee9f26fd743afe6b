// The bearer token checked when a call's metadata arrives, before gRPC reads any of its messages:
// a call without a known token is refused UNAUTHENTICATED at once and its message bytes are never
// buffered. (Checked in the handler alone, a caller without a token could make kvbankd read and
// hold messages up to gRPC's memory quota before being told no.) Only kvbank.v1.KvBank's methods
// are checked: health and reflection on the same port need no token, as before. Admit still
// authenticates each call: this is the gate in front of it.
//
// TLS credentials take an AuthMetadataProcessor. gRPC 1.51's plaintext credentials do not (their
// C++ wrapper refuses one), so plaintext serving uses credentials of its own made over the C
// core's insecure credentials, which run the processor the same way.
#ifndef KVBANK_SERVER_RPC_EARLY_AUTH_H_
#define KVBANK_SERVER_RPC_EARLY_AUTH_H_

#include <functional>
#include <memory>

#include "absl/strings/string_view.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/status.h"
#include "server/rpc/auth.h"

namespace kvbank::rpc {

// `base` (TLS credentials; null: plaintext) with every call's metadata checked by `auth` first.
// When auth is off, `base` as it is (or plaintext credentials). `auth` must outlive the server.
// `refused` (may be empty) hears of every call refused there, with its method path and status
// (to count and log it: such a call never reaches the interceptors); it runs on gRPC's threads.
using RefusedCall = std::function<void(absl::string_view method, const grpc::Status& status)>;
std::shared_ptr<grpc::ServerCredentials> WithEarlyAuth(
    std::shared_ptr<grpc::ServerCredentials> base, const Authenticator* auth,
    RefusedCall refused = nullptr);

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_EARLY_AUTH_H_
