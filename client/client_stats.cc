// Client::GetStats and GetTenantUsage: the model statistics (pool, activity, tiers, tenants) and
// the tenants' usage of the server-wide caps, from their wire form.
#include "client/client_internal.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"

namespace kvbank {

Client::TenantUsage::Resource Client::TenantUsage::Of(const std::string& name) const {
  for (const Resource& r : resources) {
    if (r.name == name) return r;
  }
  return Resource{name};
}

absl::StatusOr<std::vector<Client::TenantUsage>> Client::GetTenantUsage() {
  v1::GetStatsRequest req;
  req.set_usage_only(true);
  v1::GetStatsResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::GetStats, req, &resp); !s.ok()) return s;
  std::vector<TenantUsage> out;
  for (const v1::TenantUsage& t : resp.tenants()) {
    TenantUsage u;
    u.tenant = t.tenant();
    for (const v1::ResourceUsage& r : t.resources()) {
      u.resources.push_back({r.resource(), r.held(), r.share(), r.refused()});
    }
    out.push_back(std::move(u));
  }
  return out;
}

absl::StatusOr<std::vector<Client::ModelStats>> Client::GetStats(const std::string& model) {
  v1::GetStatsRequest req;
  req.set_model(model);
  v1::GetStatsResponse resp;
  if (auto s = impl_->Call(&v1::KvBank::Stub::GetStats, req, &resp); !s.ok()) return s;
  std::vector<ModelStats> out;
  for (const auto& p : resp.models()) {
    ModelStats m;
    m.model = p.model();
    m.blocks_total = p.blocks_total();
    m.blocks_free = p.blocks_free();
    m.blocks_used = p.blocks_used();
    m.block_bytes = p.block_bytes();
    m.pool_bytes = p.pool_bytes();
    m.sequences = p.sequences();
    m.tokens_stored = p.tokens_stored();
    m.bytes_used = p.bytes_used();
    m.capacity_tokens = p.capacity_tokens();
    m.appends = p.appends();
    m.fetches = p.fetches();
    m.bytes_appended = p.bytes_appended();
    m.bytes_fetched = p.bytes_fetched();
    m.leases_expired = p.leases_expired();
    m.blocks_cached = p.blocks_cached();
    m.blocks_pinned = p.blocks_pinned();
    m.evictions = p.evictions();
    m.prefix_query_tokens = p.prefix_query_tokens();
    m.prefix_hit_tokens = p.prefix_hit_tokens();
    m.fetches_waiting = p.fetches_waiting();
    m.prefix_copies_in = p.prefix_copies_in();
    m.prefix_copy_bytes_in = p.prefix_copy_bytes_in();
    if (p.has_tiers()) {
      const v1::TierStats& t = p.tiers();
      ModelStats::Tiers o;
      o.host_blocks = t.host_blocks();
      o.host_capacity = t.host_capacity();
      o.disk_blocks = t.disk_blocks();
      o.disk_capacity = t.disk_capacity();
      o.spilled_to_host = t.spilled_to_host();
      o.spilled_to_disk = t.spilled_to_disk();
      o.spilled_at_eviction = t.spilled_at_eviction();
      o.promoted_from_host = t.promoted_from_host();
      o.promoted_from_disk = t.promoted_from_disk();
      o.corrupt = t.corrupt();
      o.spill_dropped = t.spill_dropped();
      o.disk_bytes_written = t.disk_bytes_written();
      o.disk_bytes_read = t.disk_bytes_read();
      o.loaded = t.loaded();
      o.load_invalid = t.load_invalid();
      o.direct_io = t.direct_io();
      o.unverified = t.unverified();
      m.tiers = o;
    }
    m.tenant_view = p.tenant_view();
    for (const auto& t : p.tenants()) {
      ModelStats::Tenant& r = m.tenants.emplace_back();
      r.tenant = t.tenant();
      r.prefix_query_tokens = t.prefix_query_tokens();
      r.prefix_hit_tokens = t.prefix_hit_tokens();
      r.blocks_referenced = t.blocks_referenced();
      r.sequences = t.sequences();
      r.tokens_stored = t.tokens_stored();
      r.appends = t.appends();
      r.fetches = t.fetches();
      r.bytes_appended = t.bytes_appended();
      r.bytes_fetched = t.bytes_fetched();
      r.leases_expired = t.leases_expired();
      r.max_blocks = t.max_blocks();
      r.max_sequences = t.max_sequences();
    }
    out.push_back(m);
  }
  return out;
}

}  // namespace kvbank
