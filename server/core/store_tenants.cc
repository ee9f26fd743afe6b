#include "server/core/store_tenants.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/core/block_pool.h"

namespace kvbank {

Activity& Activity::operator+=(const Activity& o) {
  prefix_query_tokens += o.prefix_query_tokens;
  prefix_hit_tokens += o.prefix_hit_tokens;
  sequences += o.sequences;
  tokens_stored += o.tokens_stored;
  appends += o.appends;
  fetches += o.fetches;
  bytes_appended += o.bytes_appended;
  bytes_fetched += o.bytes_fetched;
  leases_expired += o.leases_expired;
  prefix_copies_in += o.prefix_copies_in;
  prefix_copy_bytes_in += o.prefix_copy_bytes_in;
  return *this;
}

StoreTenants::StoreTenants(std::string model, BlockPool* pool)
    : model_(std::move(model)), pool_(pool) {}

void StoreTenants::SetLimits(const std::string& tenant, const TenantLimits& limits) {
  absl::MutexLock lock(&mu_);  // an Admit cannot slip between the two limits
  if (pool_ != nullptr) pool_->SetTenantQuota(pool_->InternTenant(tenant), limits.max_blocks);
  counters_[tenant].max_sequences = limits.max_sequences;
}

void StoreTenants::SetQuota(const std::string& tenant, uint64_t max_blocks) {
  if (pool_ != nullptr) pool_->SetTenantQuota(pool_->InternTenant(tenant), max_blocks);
}

absl::Status StoreTenants::Admit(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = counters_.find(tenant);
  if (it == counters_.end()) return absl::OkStatus();
  const Counters& c = it->second;
  if (c.max_sequences > 0 && c.sequences >= c.max_sequences) {
    return absl::ResourceExhaustedError(absl::StrCat("tenant '", tenant, "' has its limit of ",
                                                     c.max_sequences, " live sequences in model '",
                                                     model_, "'; free some first"));
  }
  return absl::OkStatus();
}

void StoreTenants::SequenceAdded(const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  ++counters_[tenant].sequences;
}

void StoreTenants::SequenceRemoved(const std::string& tenant, bool lease_expired) {
  absl::MutexLock lock(&mu_);
  Counters& c = counters_[tenant];
  --c.sequences;
  if (lease_expired) ++c.leases_expired;
}

void StoreTenants::TokensChanged(const std::string& tenant, uint64_t before, uint64_t now) {
  if (before == now) return;
  absl::MutexLock lock(&mu_);
  Counters& c = counters_[tenant];
  c.tokens_stored = c.tokens_stored - before + now;
}

void StoreTenants::PrefixLookedUp(const std::string& tenant, uint64_t query_tokens,
                                  uint64_t hit_tokens) {
  absl::MutexLock lock(&mu_);
  Counters& c = counters_[tenant];
  c.prefix_query_tokens += query_tokens;
  c.prefix_hit_tokens += hit_tokens;
}

void StoreTenants::PrefixCopyCreated(const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  ++counters_[tenant].prefix_copies_in;
}

void StoreTenants::Appended(const std::string& tenant, uint64_t bytes, bool prefix_copy) {
  absl::MutexLock lock(&mu_);
  Counters& c = counters_[tenant];
  ++c.appends;
  c.bytes_appended += bytes;
  if (prefix_copy) c.prefix_copy_bytes_in += bytes;
}

void StoreTenants::Fetched(const std::string& tenant, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  Counters& c = counters_[tenant];
  ++c.fetches;
  c.bytes_fetched += bytes;
}

TenantStats StoreTenants::MakeRow(const std::string& name, const Counters& c) const {
  TenantStats t;
  static_cast<Activity&>(t) = c;
  t.tenant = name;
  t.max_sequences = c.max_sequences;
  if (pool_ != nullptr) {
    const uint32_t id = pool_->InternTenant(name);
    t.blocks_referenced = pool_->TenantBlocks(id);
    t.max_blocks = pool_->TenantQuota(id);
  }
  return t;
}

TenantStats StoreTenants::Row(const std::string& tenant) const {
  Counters c;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = counters_.find(tenant); it != counters_.end()) c = it->second;
  }
  return MakeRow(tenant, c);  // the pool's figures outside this lock
}

std::vector<TenantStats> StoreTenants::Rows() const {
  std::vector<std::pair<std::string, Counters>> all;
  {
    absl::MutexLock lock(&mu_);
    all.assign(counters_.begin(), counters_.end());
  }
  std::vector<TenantStats> rows;
  rows.reserve(all.size());
  for (const auto& [name, c] : all) rows.push_back(MakeRow(name, c));
  std::sort(rows.begin(), rows.end(),
            [](const TenantStats& a, const TenantStats& b) { return a.tenant < b.tenant; });
  return rows;
}

Activity StoreTenants::Totals() const {
  absl::MutexLock lock(&mu_);
  Activity sum;
  for (const auto& [name, c] : counters_) sum += c;
  return sum;
}

std::string StoreTenants::CheckCounts(
    const absl::flat_hash_map<std::string, std::pair<uint64_t, uint64_t>>& recount) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [name, c] : counters_) {
    const auto it = recount.find(name);
    const auto [n, t] = it == recount.end() ? std::pair<uint64_t, uint64_t>{0, 0} : it->second;
    if (c.sequences != n || c.tokens_stored != t) {
      return absl::StrCat("tenant '", name, "' is counted with ", c.sequences, " sequences and ",
                          c.tokens_stored, " tokens; a recount finds ", n, " and ", t);
    }
  }
  for (const auto& [name, nt] : recount) {
    if (!counters_.contains(name)) {
      return absl::StrCat("tenant '", name, "' holds sequences but has no counters");
    }
  }
  return "";
}

}  // namespace kvbank
