#include "server/core/tenant_ledger.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvbank {

const char* ResourceName(Resource r) {
  switch (r) {
    case Resource::kWaits:
      return "waits";
    case Resource::kWatchStreams:
      return "watch_streams";
    case Resource::kShmRegions:
      return "shm_regions";
    case Resource::kShmRegionBytes:
      return "shm_region_bytes";
    case Resource::kDeviceRegions:
      return "device_regions";
    case Resource::kNcclComms:
      return "nccl_communicators";
    case Resource::kQueuedWork:
      return "queued_work";
    case Resource::kQueuedBackground:
      return "queued_background";
  }
  return "?";
}

LedgerClaim& LedgerClaim::operator=(LedgerClaim&& o) noexcept {
  if (this != &o) {
    Release();
    ledger_ = std::move(o.ledger_);
    tenant_ = std::move(o.tenant_);
    resource_ = o.resource_;
    amount_ = o.amount_;
    o.ledger_ = nullptr;
    o.amount_ = 0;
  }
  return *this;
}

void LedgerClaim::Release() {
  if (ledger_ == nullptr) return;
  ledger_->Return(tenant_, resource_, amount_);
  ledger_ = nullptr;
  amount_ = 0;
}

void TenantLedger::SetCap(Resource r, uint64_t cap) {
  absl::MutexLock lock(&mu_);
  caps_[size_t(r)] = cap;
}

uint64_t TenantLedger::cap(Resource r) const {
  absl::MutexLock lock(&mu_);
  return caps_[size_t(r)];
}

void TenantLedger::SetTenants(const std::vector<std::string>& tenants) {
  absl::MutexLock lock(&mu_);
  tenants_known_ = std::max<size_t>(1, tenants.size());
  for (const std::string& t : tenants) tenants_.try_emplace(t);
}

void TenantLedger::SetLimit(const std::string& tenant, Resource r, uint64_t limit) {
  absl::MutexLock lock(&mu_);
  tenants_[tenant].limit[size_t(r)] = limit;
}

uint64_t TenantLedger::ShareLocked(const std::string& tenant, Resource r) const {
  if (auto it = tenants_.find(tenant); it != tenants_.end() && it->second.limit[size_t(r)] > 0) {
    return it->second.limit[size_t(r)];
  }
  const uint64_t cap = caps_[size_t(r)];
  return cap == 0 ? 0 : std::max<uint64_t>(1, cap / tenants_known_);
}

uint64_t TenantLedger::Share(const std::string& tenant, Resource r) const {
  absl::MutexLock lock(&mu_);
  return ShareLocked(tenant, r);
}

absl::StatusOr<LedgerClaim> TenantLedger::Acquire(const std::string& tenant, Resource r,
                                                  uint64_t amount) {
  const size_t i = size_t(r);
  {
    absl::MutexLock lock(&mu_);
    Tenant& t = tenants_[tenant];
    const uint64_t share = ShareLocked(tenant, r), cap = caps_[i];
    if (share > 0 && t.held[i] + amount > share) {
      ++t.refused[i];
      return absl::ResourceExhaustedError(absl::StrCat("tenant '", tenant, "' holds ", t.held[i],
                                                       " of its share of ", share, " ",
                                                       ResourceName(r), "; release some first"));
    }
    if (cap > 0 && totals_[i] + amount > cap) {
      ++t.refused[i];
      return absl::ResourceExhaustedError(absl::StrCat("kvbankd holds its cap of ", cap, " ",
                                                       ResourceName(r),
                                                       " (all tenants); retry "
                                                       "later"));
    }
    t.held[i] += amount;
    totals_[i] += amount;
  }
  LedgerClaim c;
  c.ledger_ = shared_from_this();
  c.tenant_ = tenant;
  c.resource_ = r;
  c.amount_ = amount;
  return c;
}

void TenantLedger::Return(const std::string& tenant, Resource r, uint64_t amount) {
  const size_t i = size_t(r);
  absl::MutexLock lock(&mu_);
  Tenant& t = tenants_[tenant];
  t.held[i] -= std::min(t.held[i], amount);
  totals_[i] -= std::min(totals_[i], amount);
}

uint64_t TenantLedger::Held(const std::string& tenant, Resource r) const {
  absl::MutexLock lock(&mu_);
  auto it = tenants_.find(tenant);
  return it == tenants_.end() ? 0 : it->second.held[size_t(r)];
}

uint64_t TenantLedger::Total(Resource r) const {
  absl::MutexLock lock(&mu_);
  return totals_[size_t(r)];
}

void TenantLedger::CountRefused(const std::string& tenant, Resource r) {
  absl::MutexLock lock(&mu_);
  ++tenants_[tenant].refused[size_t(r)];
}

std::vector<TenantLedgerRow> TenantLedger::Rows() const {
  absl::MutexLock lock(&mu_);
  std::vector<TenantLedgerRow> rows;
  rows.reserve(tenants_.size());
  for (const auto& [name, t] : tenants_) {
    TenantLedgerRow row;
    row.tenant = name;
    row.held = t.held;
    row.refused = t.refused;
    for (size_t i = 0; i < kNumResources; ++i) row.share[i] = ShareLocked(name, Resource(i));
    rows.push_back(std::move(row));
  }
  std::sort(rows.begin(), rows.end(),
            [](const TenantLedgerRow& a, const TenantLedgerRow& b) { return a.tenant < b.tenant; });
  return rows;
}

}  // namespace kvbank
