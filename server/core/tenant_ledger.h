// What each tenant holds of the server-wide resources, and may hold: one ledger for every cap
// that many tenants share (waits, Watch streams, shared-memory regions and their bytes, CUDA IPC
// regions, NCCL communicators, queued device work), so that no tenant can take a cap whole and
// the figures /metrics reports per tenant come from one place.
//
// Every resource has a server-wide cap (0: none) and a per-tenant share: the tenant's own limit
// when one is set (the tokens file), else the cap divided among the tenants the server knows (at
// least 1 each). A claim past either is RESOURCE_EXHAUSTED naming the tenant's share or the cap,
// and changes nothing. A claim is a move-only handle: what it holds goes back when it goes.
#ifndef KVBANK_SERVER_CORE_TENANT_LEDGER_H_
#define KVBANK_SERVER_CORE_TENANT_LEDGER_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvbank {

enum class Resource : uint8_t {
  kWaits = 0,         // fetches waiting for their tokens (wait_ms)
  kWatchStreams,      // open Watch streams
  kShmRegions,        // shared-memory regions registered
  kShmRegionBytes,    // their bytes
  kDeviceRegions,     // CUDA IPC regions registered
  kNcclComms,         // NCCL communicators formed or forming
  kQueuedWork,        // device-worker tasks queued (a client waits on them)
  kQueuedBackground,  // background tasks queued (prefetches)
};
inline constexpr size_t kNumResources = 8;
// "waits", "watch_streams", ...: the name /metrics and error messages use.
const char* ResourceName(Resource r);

class TenantLedger;

// Holds `amount` of one resource for one tenant until destroyed (or Release). Move-only.
class LedgerClaim {
 public:
  LedgerClaim() = default;
  ~LedgerClaim() { Release(); }
  LedgerClaim(LedgerClaim&& o) noexcept { *this = std::move(o); }
  LedgerClaim& operator=(LedgerClaim&& o) noexcept;
  LedgerClaim(const LedgerClaim&) = delete;
  LedgerClaim& operator=(const LedgerClaim&) = delete;

  bool held() const { return ledger_ != nullptr; }
  uint64_t amount() const { return amount_; }
  void Release();

 private:
  friend class TenantLedger;
  std::shared_ptr<TenantLedger> ledger_;
  std::string tenant_;
  Resource resource_ = Resource::kWaits;
  uint64_t amount_ = 0;
};

// One tenant's row: held now, its share, and how many claims were refused, per resource.
struct TenantLedgerRow {
  std::string tenant;
  std::array<uint64_t, kNumResources> held{};
  std::array<uint64_t, kNumResources> share{};  // 0: no limit
  std::array<uint64_t, kNumResources> refused{};
};

// Thread-safe. Held by shared_ptr: claims keep it alive.
class TenantLedger : public std::enable_shared_from_this<TenantLedger> {
 public:
  static std::shared_ptr<TenantLedger> Create() {
    return std::shared_ptr<TenantLedger>(new TenantLedger());
  }

  // The server-wide cap of `r` (0: none).
  void SetCap(Resource r, uint64_t cap);
  uint64_t cap(Resource r) const;
  // The tenants the server knows (the tokens file's): each gets cap / tenants.size() (at least
  // 1) of every capped resource it sets no limit for. Empty: one tenant (auth off).
  void SetTenants(const std::vector<std::string>& tenants);
  // `tenant`'s own limit of `r` (0: the default share).
  void SetLimit(const std::string& tenant, Resource r, uint64_t limit);
  // What `tenant` may hold of `r`: its own limit, else the default share; 0 when r has no cap
  // and the tenant no limit.
  uint64_t Share(const std::string& tenant, Resource r) const;

  // Claims `amount` of `r` for `tenant`: RESOURCE_EXHAUSTED naming the tenant's share or the
  // server-wide cap (and `what`, e.g. "Watch streams") when it would pass either.
  absl::StatusOr<LedgerClaim> Acquire(const std::string& tenant, Resource r, uint64_t amount = 1);
  // Held now, by `tenant` and by everyone.
  uint64_t Held(const std::string& tenant, Resource r) const;
  uint64_t Total(Resource r) const;
  // Counts a refusal that did not come from Acquire (a dropped background task).
  void CountRefused(const std::string& tenant, Resource r);
  // Every tenant that holds, held, has a limit or was refused anything, by name.
  std::vector<TenantLedgerRow> Rows() const;

 private:
  TenantLedger() = default;
  friend class LedgerClaim;
  void Return(const std::string& tenant, Resource r, uint64_t amount);
  struct Tenant {
    std::array<uint64_t, kNumResources> held{};
    std::array<uint64_t, kNumResources> limit{};  // 0: the default share
    std::array<uint64_t, kNumResources> refused{};
  };
  uint64_t ShareLocked(const std::string& tenant, Resource r) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::array<uint64_t, kNumResources> caps_ ABSL_GUARDED_BY(mu_){};
  std::array<uint64_t, kNumResources> totals_ ABSL_GUARDED_BY(mu_){};
  size_t tenants_known_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<std::string, Tenant> tenants_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_TENANT_LEDGER_H_
