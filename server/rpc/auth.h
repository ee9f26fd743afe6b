// Bearer-token authentication: maps the `authorization: Bearer <token>` metadata of a call to
// a tenant.
#ifndef KVBANK_SERVER_RPC_AUTH_H_
#define KVBANK_SERVER_RPC_AUTH_H_

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "grpcpp/server_context.h"
#include "server/core/sequence_store.h"

namespace kvbank::rpc {

struct Caller {
  std::string tenant;  // "" when auth is off
  bool admin = false;  // sees every tenant's events and stats
};

struct TenantPolicy {
  std::string tenant;
  bool admin = false;
  double max_blocks_fraction = 0;  // of each model's pool; 0: no quota
};

// Immutable after construction; thread-safe.
class Authenticator {
 public:
  // Auth off: every call is the admin of tenant "". Only when asked for (--no-auth).
  static Authenticator Disabled();
  // Tokens file, one entry a line: `<token> <tenant> [admin] [max_blocks_fraction=F]`;
  // blank lines and lines starting with # are skipped. INVALID_ARGUMENT naming the line.
  static absl::StatusOr<Authenticator> FromFile(const std::string& path);
  static absl::StatusOr<Authenticator> FromText(const std::string& text);

  bool enabled() const { return enabled_; }
  // UNAUTHENTICATED for a call without a known bearer token.
  absl::StatusOr<Caller> Authenticate(const grpc::ServerContextBase& ctx) const;
  // Sets every tenant's block quota on the model.
  void ApplyQuotas(SequenceStore& model) const;

 private:
  bool enabled_ = false;
  // Keyed by SHA-256 of the token: a look-up's timing says nothing about a token's prefix.
  absl::flat_hash_map<std::string, TenantPolicy> by_token_digest_;
};

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_AUTH_H_
