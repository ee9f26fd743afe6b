// Bearer-token authentication: maps the `authorization: Bearer <token>` metadata of a call to
// a tenant.
#ifndef KVBANK_SERVER_RPC_AUTH_H_
#define KVBANK_SERVER_RPC_AUTH_H_

#include <optional>
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
  uint64_t max_sequences = 0;      // live sequences per model; 0: the default share
};

// Immutable after construction; thread-safe.
class Authenticator {
 public:
  // Auth off: every call is the admin of tenant "". Only when asked for (--no-auth).
  static Authenticator Disabled();
  // Tokens file, one entry a line:
  //   `<token> <tenant> [admin] [max_blocks_fraction=F] [max_sequences=N]`
  // blank lines and lines starting with # are skipped. INVALID_ARGUMENT naming the line. Several
  // tokens may name one tenant; its limits are the largest any of its lines sets.
  static absl::StatusOr<Authenticator> FromFile(const std::string& path);
  static absl::StatusOr<Authenticator> FromText(const std::string& text);

  bool enabled() const { return enabled_; }
  // The tenants the tokens file names, by name (one, "", when auth is off).
  std::vector<std::string> Tenants() const;
  // UNAUTHENTICATED for a call without a known bearer token.
  absl::StatusOr<Caller> Authenticate(const grpc::ServerContextBase& ctx) const;
  // The same from the value of the call's `authorization` metadata (nullopt: none).
  absl::StatusOr<Caller> FromAuthorization(std::optional<absl::string_view> authorization) const;
  // Sets every tenant's limits on the model (StoreTenants::SetLimits): its block quota
  // (max_blocks_fraction of the pool, at least 1 block) and its live-sequence limit: the
  // tenant's max_sequences=N, else, when the file names more than one tenant, the default share
  // DefaultMaxSequences. Call it once when the model is created.
  void ApplyQuotas(SequenceStore& model) const;
  // A tenant's live-sequence limit when its line sets none: the model's max_sequences divided
  // evenly among the `tenants` the file names (at least 1), so that no tenant can take the slots
  // every other tenant needs; 0 (no limit beyond the model's) for a single tenant.
  static uint64_t DefaultMaxSequences(uint64_t model_max_sequences, size_t tenants);

 private:
  bool enabled_ = false;
  // Keyed by SHA-256 of the token: a look-up's timing says nothing about a token's prefix.
  absl::flat_hash_map<std::string, TenantPolicy> by_token_digest_;
};

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_AUTH_H_
