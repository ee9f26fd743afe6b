// One model's tenants: what each did (the figures Stats reports, counted as they happen) and the
// limits each runs under. Nothing here scans sequences: the store reports every change.
#ifndef KVBANK_SERVER_CORE_STORE_TENANTS_H_
#define KVBANK_SERVER_CORE_STORE_TENANTS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace kvbank {

class BlockPool;

// What a model's sequences did, counted as it happens: the figures Stats reports for the model
// and for each tenant (every one kept per tenant, the model's the sum).
struct Activity {
  uint64_t prefix_query_tokens = 0;  // prompt tokens looked up at create
  uint64_t prefix_hit_tokens = 0;    // of those, attached from the cache
  uint64_t sequences = 0;            // live
  uint64_t tokens_stored = 0;        // sum of the live sequences' lengths
  uint64_t appends = 0;              // committed
  uint64_t fetches = 0;              // readers handed out (by sequence or by block hash)
  uint64_t bytes_appended = 0;
  uint64_t bytes_fetched = 0;
  uint64_t leases_expired = 0;
  uint64_t prefix_copies_in = 0;      // sequences created as prefix copies from another replica
  uint64_t prefix_copy_bytes_in = 0;  // of bytes_appended, those appended to such sequences

  Activity& operator+=(const Activity& o);
};

// One tenant's own figures in one model: nothing here depends on what other tenants do.
struct TenantStats : Activity {
  std::string tenant;
  uint64_t blocks_referenced = 0;  // blocks on the tenant's quota: referenced or pinned
  uint64_t max_blocks = 0;         // its block quota (0: none)
  uint64_t max_sequences = 0;      // its live-sequence limit (0: only the model's max_sequences)
};

// Per-tenant limits in one model (0: none).
struct TenantLimits {
  uint64_t max_blocks = 0;     // blocks referenced by its sequences and readers, plus its pins
  uint64_t max_sequences = 0;  // live sequences at once
};

// Thread-safe. Its lock is taken after the store's and before the pool's.
class StoreTenants {
 public:
  // `model` names the model in errors. `pool` (may be null: no block figures) keeps the block
  // quotas and counts the blocks each tenant references.
  StoreTenants(std::string model, BlockPool* pool);

  // Sets both of the tenant's limits at once (an Admit sees both or neither). Sequences it
  // already holds stay.
  void SetLimits(const std::string& tenant, const TenantLimits& limits);
  // The block quota only.
  void SetQuota(const std::string& tenant, uint64_t max_blocks);
  // RESOURCE_EXHAUSTED, naming the limit, when `tenant` may not have one more live sequence.
  absl::Status Admit(const std::string& tenant) const;

  // Changes, as they happen.
  void SequenceAdded(const std::string& tenant);
  void SequenceRemoved(const std::string& tenant, bool lease_expired);
  void TokensChanged(const std::string& tenant, uint64_t before, uint64_t now);
  void PrefixLookedUp(const std::string& tenant, uint64_t query_tokens, uint64_t hit_tokens);
  // A sequence created as a prefix copy (CreateOptions::prefix_copy).
  void PrefixCopyCreated(const std::string& tenant);
  // One committed append of `bytes` payload bytes; `prefix_copy`: to a prefix-copy sequence.
  void Appended(const std::string& tenant, uint64_t bytes, bool prefix_copy);
  void Fetched(const std::string& tenant, uint64_t bytes);

  // One tenant's row (zeros for a tenant never seen).
  TenantStats Row(const std::string& tenant) const;
  // Every tenant with any activity or limit, by name.
  std::vector<TenantStats> Rows() const;
  // The model's totals: every tenant's figures summed.
  Activity Totals() const;
  // Empty when the live counts equal a recount (tenant -> {sequences, tokens}); else what
  // differs.
  std::string CheckCounts(
      const absl::flat_hash_map<std::string, std::pair<uint64_t, uint64_t>>& recount) const;

 private:
  struct Counters : Activity {
    uint64_t max_sequences = 0;  // 0: none
  };
  TenantStats MakeRow(const std::string& name, const Counters& c) const;

  const std::string model_;
  BlockPool* const pool_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Counters> counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_STORE_TENANTS_H_
