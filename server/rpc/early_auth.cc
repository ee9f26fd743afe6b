#include "server/rpc/early_auth.h"

#include <string>

#include "absl/strings/match.h"
#include "grpc/grpc.h"
#include "grpc/grpc_security.h"
#include "grpc/slice.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace kvbank::rpc {
namespace {

// kvbank's own methods need a token; health and reflection on the same port do not (as in the
// handlers), and unknown methods are gRPC's to answer.
constexpr absl::string_view kGuarded = "/kvbank.v1.KvBank/";

// The check on a call's metadata, as TLS credentials take it.
class TokenCheck final : public grpc::AuthMetadataProcessor {
 public:
  TokenCheck(const Authenticator* auth, RefusedCall refused)
      : auth_(auth), refused_(std::move(refused)) {}
  bool IsBlocking() const override { return false; }  // a hash and a map look-up
  grpc::Status Process(const InputMetadata& md, grpc::AuthContext*, OutputMetadata*,
                       OutputMetadata*) override {
    auto path = md.find(":path");
    if (path == md.end() ||
        !absl::StartsWith(absl::string_view(path->second.data(), path->second.size()), kGuarded)) {
      return grpc::Status::OK;
    }
    auto it = md.find("authorization");
    auto caller = auth_->FromAuthorization(it == md.end()
                                               ? std::nullopt
                                               : std::optional<absl::string_view>(absl::string_view(
                                                     it->second.data(), it->second.size())));
    if (caller.ok()) return grpc::Status::OK;
    grpc::Status no(grpc::StatusCode::UNAUTHENTICATED, std::string(caller.status().message()));
    if (refused_) refused_(absl::string_view(path->second.data(), path->second.size()), no);
    return no;
  }

 private:
  const Authenticator* const auth_;
  const RefusedCall refused_;
};

// Plaintext credentials that run the check: the C core's insecure server credentials with a
// metadata processor (the C++ InsecureServerCredentials refuses one).
class CheckedPlaintext final : public grpc::ServerCredentials {
 public:
  CheckedPlaintext(const Authenticator* auth, RefusedCall refused)
      : auth_(auth),
        refused_(std::move(refused)),
        creds_(grpc_insecure_server_credentials_create()) {
    grpc_auth_metadata_processor p;
    p.process = &CheckedPlaintext::Process;
    p.destroy = nullptr;
    p.state = this;
    grpc_server_credentials_set_auth_metadata_processor(creds_, p);
  }
  ~CheckedPlaintext() override { grpc_server_credentials_release(creds_); }

  void SetAuthMetadataProcessor(const std::shared_ptr<grpc::AuthMetadataProcessor>&) override {}

 private:
  int AddPortToServer(const std::string& addr, grpc_server* server) override {
    return grpc_server_add_http2_port(server, addr.c_str(), creds_);
  }

  static void Process(void* state, grpc_auth_context*, const grpc_metadata* md, size_t n,
                      grpc_process_auth_metadata_done_cb done, void* user_data) {
    auto* self = static_cast<CheckedPlaintext*>(state);
    std::optional<absl::string_view> authorization;
    absl::string_view method;
    bool guarded = false;
    for (size_t i = 0; i < n; ++i) {
      const absl::string_view key(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(md[i].key)),
                                  GRPC_SLICE_LENGTH(md[i].key));
      const absl::string_view value(
          reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(md[i].value)),
          GRPC_SLICE_LENGTH(md[i].value));
      if (key == ":path") {
        method = value;
        guarded = absl::StartsWith(value, kGuarded);
      }
      if (key == "authorization") authorization = value;
    }
    if (!guarded) {
      done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_OK, nullptr);
      return;
    }
    auto caller = self->auth_->FromAuthorization(authorization);
    if (caller.ok()) {
      done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_OK, nullptr);
      return;
    }
    const std::string why(caller.status().message());
    if (self->refused_) {
      self->refused_(method, grpc::Status(grpc::StatusCode::UNAUTHENTICATED, why));
    }
    done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_UNAUTHENTICATED, why.c_str());
  }

  const Authenticator* const auth_;
  const RefusedCall refused_;
  grpc_server_credentials* const creds_;
};

}  // namespace

std::shared_ptr<grpc::ServerCredentials> WithEarlyAuth(
    std::shared_ptr<grpc::ServerCredentials> base, const Authenticator* auth, RefusedCall refused) {
  if (!auth->enabled()) return base != nullptr ? base : grpc::InsecureServerCredentials();
  if (base == nullptr) return std::make_shared<CheckedPlaintext>(auth, std::move(refused));
  base->SetAuthMetadataProcessor(std::make_shared<TokenCheck>(auth, std::move(refused)));
  return base;
}

}  // namespace kvbank::rpc
