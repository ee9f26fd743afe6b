#include "server/kvbankd/kvbankd_metrics.h"

#include "google/protobuf/descriptor.h"
#include "kvbank/v1/kvbank.pb.h"
#include "server/metrics/rpc_interceptor.h"
#include "server/rpc/convert.h"

namespace kvbank::metrics {
namespace {

constexpr char kService[] = "kvbank.v1.KvBank";

// A figure of one model's (or one tenant's) GetStats row.
template <typename Row>
struct Figure {
  const char* name;
  const char* help;
  MetricType type;
  double (*value)(const Row&);
};

// Per model, from v1::ModelStats as GetStats answers an admin. vLLM's names where it has them
// (kv_cache_usage_perc, prefix_cache_queries / hits in tokens).
const Figure<v1::ModelStats> kModelFigures[] = {
    {"kvbank_kv_cache_usage_perc",
     "Fraction (0..1) of the pool's blocks in use by sequences and readers (vLLM's "
     "kv_cache_usage_perc: cached, reusable blocks count as free).",
     MetricType::kGauge,
     [](const v1::ModelStats& m) {
       return m.blocks_total() == 0 ? 0.0 : double(m.blocks_used()) / double(m.blocks_total());
     }},
    {"kvbank_blocks_total", "Blocks in the model's pool.", MetricType::kGauge,
     [](const v1::ModelStats& m) { return double(m.blocks_total()); }},
    {"kvbank_block_bytes", "Bytes of one block of the model (all layers, K and V, scales).",
     MetricType::kGauge, [](const v1::ModelStats& m) { return double(m.block_bytes()); }},
    {"kvbank_sequences", "Live sequences.", MetricType::kGauge,
     [](const v1::ModelStats& m) { return double(m.sequences()); }},
    {"kvbank_tokens_stored", "Tokens of the live sequences (the sum of their lengths).",
     MetricType::kGauge, [](const v1::ModelStats& m) { return double(m.tokens_stored()); }},
    {"kvbank_fetches_waiting", "Fetches waiting for their tokens to be committed (wait_ms).",
     MetricType::kGauge, [](const v1::ModelStats& m) { return double(m.fetches_waiting()); }},
    {"kvbank_prefix_cache_queries_total",
     "Prompt tokens looked up in the prefix cache when sequences were created.",
     MetricType::kCounter, [](const v1::ModelStats& m) { return double(m.prefix_query_tokens()); }},
    {"kvbank_prefix_cache_hits_total",
     "Of the prompt tokens looked up, those attached from the prefix cache.", MetricType::kCounter,
     [](const v1::ModelStats& m) { return double(m.prefix_hit_tokens()); }},
    {"kvbank_evictions_total", "Cached blocks evicted to make room.", MetricType::kCounter,
     [](const v1::ModelStats& m) { return double(m.evictions()); }},
    {"kvbank_appends_total", "Appends committed.", MetricType::kCounter,
     [](const v1::ModelStats& m) { return double(m.appends()); }},
    {"kvbank_fetches_total", "Fetch readers handed out (by sequence or by block hash).",
     MetricType::kCounter, [](const v1::ModelStats& m) { return double(m.fetches()); }},
    {"kvbank_bytes_appended_total", "Payload bytes of the appends committed.", MetricType::kCounter,
     [](const v1::ModelStats& m) { return double(m.bytes_appended()); }},
    {"kvbank_bytes_fetched_total", "Payload bytes of the fetches handed out.", MetricType::kCounter,
     [](const v1::ModelStats& m) { return double(m.bytes_fetched()); }},
    {"kvbank_leases_expired_total", "Sequences freed because their lease ran out.",
     MetricType::kCounter, [](const v1::ModelStats& m) { return double(m.leases_expired()); }},
    {"kvbank_prefix_copies_in_total",
     "Sequences created as prefix copies from another replica (CreateSequence prefix_copy).",
     MetricType::kCounter, [](const v1::ModelStats& m) { return double(m.prefix_copies_in()); }},
    {"kvbank_prefix_copy_bytes_in_total",
     "Payload bytes of the appends committed to prefix-copy sequences (part of bytes appended).",
     MetricType::kCounter,
     [](const v1::ModelStats& m) { return double(m.prefix_copy_bytes_in()); }},
};

// Per tenant of a model, from v1::TenantStats (every figure the tenant's own).
const Figure<v1::TenantStats> kTenantFigures[] = {
    {"kvbank_tenant_sequences", "The tenant's live sequences.", MetricType::kGauge,
     [](const v1::TenantStats& t) { return double(t.sequences()); }},
    {"kvbank_tenant_tokens_stored", "Tokens of the tenant's live sequences.", MetricType::kGauge,
     [](const v1::TenantStats& t) { return double(t.tokens_stored()); }},
    {"kvbank_tenant_blocks",
     "Blocks on the tenant's quota: referenced by its sequences and readers, or pinned by it.",
     MetricType::kGauge, [](const v1::TenantStats& t) { return double(t.blocks_referenced()); }},
    {"kvbank_tenant_max_blocks", "The tenant's block quota (0: none).", MetricType::kGauge,
     [](const v1::TenantStats& t) { return double(t.max_blocks()); }},
    {"kvbank_tenant_prefix_cache_queries_total",
     "The tenant's prompt tokens looked up in the prefix cache.", MetricType::kCounter,
     [](const v1::TenantStats& t) { return double(t.prefix_query_tokens()); }},
    {"kvbank_tenant_prefix_cache_hits_total",
     "Of the tenant's prompt tokens looked up, those attached from the prefix cache.",
     MetricType::kCounter, [](const v1::TenantStats& t) { return double(t.prefix_hit_tokens()); }},
    {"kvbank_tenant_appends_total", "The tenant's appends committed.", MetricType::kCounter,
     [](const v1::TenantStats& t) { return double(t.appends()); }},
    {"kvbank_tenant_fetches_total", "The tenant's fetch readers handed out.", MetricType::kCounter,
     [](const v1::TenantStats& t) { return double(t.fetches()); }},
    {"kvbank_tenant_bytes_appended_total", "Payload bytes of the tenant's appends committed.",
     MetricType::kCounter, [](const v1::TenantStats& t) { return double(t.bytes_appended()); }},
    {"kvbank_tenant_bytes_fetched_total", "Payload bytes of the tenant's fetches handed out.",
     MetricType::kCounter, [](const v1::TenantStats& t) { return double(t.bytes_fetched()); }},
};

// The short names of the service's methods, from the generated descriptor.
std::vector<std::string> ServiceMethods() {
  std::vector<std::string> names;
  const google::protobuf::ServiceDescriptor* s =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(kService);
  if (s == nullptr) return names;
  for (int i = 0; i < s->method_count(); ++i) names.push_back(s->method(i)->name());
  return names;
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvbankdMetrics>> KvbankdMetrics::Start(
    KvbankdMetricsOptions options, std::shared_ptr<const ModelRegistry> models,
    const rpc::KvBankService* service) {
  std::unique_ptr<KvbankdMetrics> m(new KvbankdMetrics());
  m->options_ = std::move(options);
  if (m->options_.version.empty()) m->options_.version = KVBANK_VERSION_STRING;
  m->models_ = std::move(models);
  m->service_ = service;
  const std::vector<std::string> methods = ServiceMethods();
  if (methods.empty()) return absl::InternalError(absl::StrCat(kService, " has no methods"));
  auto interceptor = RpcMetrics::Create(&m->registry_, "kvbank", kService, methods);
  if (!interceptor.ok()) return interceptor.status();
  m->rpc_metrics_ = interceptor->get();
  m->interceptor_ = *std::move(interceptor);
  const KvbankdMetrics* self = m.get();
  m->registry_.AddCollector([self](std::vector<FamilySnapshot>* out) { self->CollectModels(out); });
  m->registry_.AddCollector([self](std::vector<FamilySnapshot>* out) { self->CollectServer(out); });
  auto http = HttpServer::Start(m->options_.listen, &m->registry_);
  if (!http.ok()) return http.status();
  m->http_ = *std::move(http);
  if (!m->options_.port_file.empty()) {
    if (absl::Status s = WritePortFile(m->options_.port_file, m->http_->port()); !s.ok()) return s;
  }
  return m;
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
KvbankdMetrics::TakeInterceptor() {
  return std::move(interceptor_);
}

void KvbankdMetrics::WatchListener(const rpc::Listener* listener) {
  listener_.store(listener, std::memory_order_release);
}

void KvbankdMetrics::CollectModels(std::vector<FamilySnapshot>* out) const {
  // Each model's row exactly as GetStats answers an admin: SequenceStore::Stats (every tenant)
  // through the same conversion.
  std::vector<v1::ModelStats> rows;
  for (const auto& store : models_->List()) {
    v1::ModelStats row;
    rpc::ToProto(*store, store->Stats(), &row);
    rows.push_back(std::move(row));
  }
  for (const auto& f : kModelFigures) {
    FamilySnapshot* fam = AddFamily(out, f.name, f.help, f.type);
    for (const v1::ModelStats& row : rows) {
      fam->samples.push_back({"", {{"model", row.model()}}, f.value(row)});
    }
  }
  // Every block is free, cached or used (free + cached + used = kvbank_blocks_total); pinned
  // blocks are cached or used as well.
  FamilySnapshot* blocks =
      AddFamily(out, "kvbank_blocks",
                "Blocks by state: free, cached (published, unreferenced: reusable, evictable "
                "unless pinned), used (referenced); free + cached + used = kvbank_blocks_total. "
                "pinned: blocks pinned by a tenant, counted in cached or used as well.",
                MetricType::kGauge);
  for (const v1::ModelStats& row : rows) {
    const std::pair<const char*, uint64_t> states[] = {{"free", row.blocks_free()},
                                                       {"cached", row.blocks_cached()},
                                                       {"used", row.blocks_used()},
                                                       {"pinned", row.blocks_pinned()}};
    for (const auto& [state, n] : states) {
      blocks->samples.push_back({"", {{"model", row.model()}, {"state", state}}, double(n)});
    }
  }
  // The tiers below the pools (models that have them), labelled by medium (host, disk) as the
  // KV events are.
  struct TierFigure {
    const char* name;
    const char* help;
    MetricType type;
    uint64_t (*host)(const v1::TierStats&);
    uint64_t (*disk)(const v1::TierStats&);
  };
  const TierFigure tier_figures[] = {
      {"kvbank_tier_blocks", "Blocks held in a tier below the pool.", MetricType::kGauge,
       [](const v1::TierStats& t) { return t.host_blocks(); },
       [](const v1::TierStats& t) { return t.disk_blocks(); }},
      {"kvbank_tier_capacity_blocks", "Blocks a tier below the pool can hold.", MetricType::kGauge,
       [](const v1::TierStats& t) { return t.host_capacity(); },
       [](const v1::TierStats& t) { return t.disk_capacity(); }},
      {"kvbank_tier_spilled_total", "Evicted cached blocks written into a tier.",
       MetricType::kCounter, [](const v1::TierStats& t) { return t.spilled_to_host(); },
       [](const v1::TierStats& t) { return t.spilled_to_disk(); }},
      {"kvbank_tier_promoted_total", "Blocks promoted from a tier back into the pool.",
       MetricType::kCounter, [](const v1::TierStats& t) { return t.promoted_from_host(); },
       [](const v1::TierStats& t) { return t.promoted_from_disk(); }},
  };
  for (const TierFigure& f : tier_figures) {
    FamilySnapshot* fam = AddFamily(out, f.name, f.help, f.type);
    for (const v1::ModelStats& row : rows) {
      if (!row.has_tiers()) continue;
      const v1::TierStats& t = row.tiers();
      if (t.host_capacity() > 0) {
        fam->samples.push_back(
            {"", {{"model", row.model()}, {"medium", "host"}}, double(f.host(t))});
      }
      if (t.disk_capacity() > 0) {
        fam->samples.push_back(
            {"", {{"model", row.model()}, {"medium", "disk"}}, double(f.disk(t))});
      }
    }
  }
  const Figure<v1::TierStats> tier_totals[] = {
      {"kvbank_tier_spilled_at_eviction_total",
       "Evicted blocks copied down a tier during the eviction, on the evicting call's path (the "
       "spill-ahead had not copied them yet).",
       MetricType::kCounter,
       [](const v1::TierStats& t) { return double(t.spilled_at_eviction()); }},
  };
  for (const auto& f : tier_totals) {
    FamilySnapshot* fam = AddFamily(out, f.name, f.help, f.type);
    for (const v1::ModelStats& row : rows) {
      if (row.has_tiers())
        fam->samples.push_back({"", {{"model", row.model()}}, f.value(row.tiers())});
    }
  }
  const Figure<v1::TierStats> disk_figures[] = {
      {"kvbank_tier_disk_corrupt_total",
       "Disk tier blocks that failed their checksum on a read: never served, removed.",
       MetricType::kCounter, [](const v1::TierStats& t) { return double(t.corrupt()); }},
      {"kvbank_tier_disk_spill_dropped_total",
       "Spills to the disk tier dropped because its write queue was full.", MetricType::kCounter,
       [](const v1::TierStats& t) { return double(t.spill_dropped()); }},
      {"kvbank_tier_disk_bytes_written_total", "Bytes written to the disk tier.",
       MetricType::kCounter, [](const v1::TierStats& t) { return double(t.disk_bytes_written()); }},
      {"kvbank_tier_disk_bytes_read_total", "Bytes read from the disk tier.", MetricType::kCounter,
       [](const v1::TierStats& t) { return double(t.disk_bytes_read()); }},
      {"kvbank_tier_disk_loaded_blocks", "Valid blocks found on the disk tier at start.",
       MetricType::kGauge, [](const v1::TierStats& t) { return double(t.loaded()); }},
      {"kvbank_tier_disk_load_invalid_slots", "Torn or corrupt disk tier slots skipped at start.",
       MetricType::kGauge, [](const v1::TierStats& t) { return double(t.load_invalid()); }},
  };
  for (const auto& f : disk_figures) {
    FamilySnapshot* fam = AddFamily(out, f.name, f.help, f.type);
    for (const v1::ModelStats& row : rows) {
      if (row.has_tiers() && row.tiers().disk_capacity() > 0) {
        fam->samples.push_back({"", {{"model", row.model()}}, f.value(row.tiers())});
      }
    }
  }
  for (const auto& f : kTenantFigures) {
    FamilySnapshot* fam = AddFamily(out, f.name, f.help, f.type);
    for (const v1::ModelStats& row : rows) {
      for (const v1::TenantStats& t : row.tenants()) {
        fam->samples.push_back({"", {{"model", row.model()}, {"tenant", t.tenant()}}, f.value(t)});
      }
    }
  }
  FamilySnapshot* wakeups =
      AddFamily(out, "kvbank_watch_wakeups_total",
                "Watch streams woken to read new KV events (only streams that may see them).",
                MetricType::kCounter);
  for (const auto& store : models_->List()) {
    if (store->prefix().events() == nullptr) continue;
    wakeups->samples.push_back(
        {"", {{"model", store->layout().name}}, double(store->prefix().events()->notifications())});
  }
}

void KvbankdMetrics::CollectServer(std::vector<FamilySnapshot>* out) const {
  const rpc::PlaneBytes& bytes = service_->plane_bytes();
  // Each family is filled before the next is added (AddFamily's pointer dies when `out` grows).
  FamilySnapshot* in =
      AddFamily(out, "kvbank_bytes_received_total",
                "Payload bytes of appends committed, by the data plane that carried them.",
                MetricType::kCounter);
  for (rpc::Plane p : rpc::kPlanes) {
    in->samples.push_back({"", {{"plane", rpc::PlaneName(p)}}, double(bytes.received(p))});
  }
  FamilySnapshot* sent =
      AddFamily(out, "kvbank_bytes_sent_total",
                "Payload bytes of fetches completed, by the data plane that carried them.",
                MetricType::kCounter);
  for (rpc::Plane p : rpc::kPlanes) {
    sent->samples.push_back({"", {{"plane", rpc::PlaneName(p)}}, double(bytes.sent(p))});
  }
  AddFamily(out, "kvbank_shm_control_requests_total",
            "Region transfers asked for with a control frame on the shm socket instead of a gRPC "
            "call (any outcome).",
            MetricType::kCounter)
      ->samples.push_back({"", {}, double(bytes.control_requests())});
  AddFamily(out, "kvbank_shm_control_lone_copies_total",
            "Of those, transfers over 256 KiB on host memory copied on the shm socket's listener "
            "because nothing else was under way (--shm-lone-copy-bytes).",
            MetricType::kCounter)
      ->samples.push_back({"", {}, double(bytes.lone_copies())});
  const rpc::Listener* listener = listener_.load(std::memory_order_acquire);
  const rpc::ListenerStats ls = listener != nullptr ? listener->stats() : rpc::ListenerStats();
  AddFamily(out, "kvbank_connections",
            "gRPC connections open (closed ones are noticed lazily: an upper bound, at most "
            "twice the open ones).",
            MetricType::kGauge)
      ->samples.push_back({"", {}, double(ls.open)});
  AddFamily(out, "kvbank_connections_accepted_total", "gRPC connections accepted.",
            MetricType::kCounter)
      ->samples.push_back({"", {}, double(ls.accepted)});
  FamilySnapshot* refused =
      AddFamily(out, "kvbank_connections_refused_total",
                "gRPC connections closed at once: over --max-connections, or no descriptor left.",
                MetricType::kCounter);
  refused->samples.push_back({"", {{"reason", "over_cap"}}, double(ls.refused_over_cap)});
  refused->samples.push_back({"", {{"reason", "no_descriptors"}}, double(ls.refused_no_fds)});
  // What each tenant holds of the server-wide caps (TenantLedger), its share, its refusals.
  const std::vector<TenantLedgerRow> ledger = service_->ledger().Rows();
  const std::pair<const char*, const char*> ledger_families[] = {
      {"kvbank_tenant_held", "What the tenant holds of a server-wide cap, by resource."},
      {"kvbank_tenant_share",
       "The tenant's share of a server-wide cap (0: no limit): the cap divided among the "
       "tenants, or its own limit."},
      {"kvbank_tenant_refused_total",
       "The tenant's claims on a server-wide cap refused (RESOURCE_EXHAUSTED; a background "
       "prefetch dropped)."},
  };
  for (int k = 0; k < 3; ++k) {
    FamilySnapshot* fam = AddFamily(out, ledger_families[k].first, ledger_families[k].second,
                                    k == 2 ? MetricType::kCounter : MetricType::kGauge);
    for (const TenantLedgerRow& row : ledger) {
      for (size_t i = 0; i < kNumResources; ++i) {
        const uint64_t v = k == 0 ? row.held[i] : k == 1 ? row.share[i] : row.refused[i];
        fam->samples.push_back(
            {"", {{"tenant", row.tenant}, {"resource", ResourceName(Resource(i))}}, double(v)});
      }
    }
  }
  const rpc::FairWorkStats work = service_->work_stats();
  FamilySnapshot* queued =
      AddFamily(out, "kvbank_device_work_queued",
                "Device-worker tasks waiting, by class (foreground: a client waits on it; "
                "background: prefetches).",
                MetricType::kGauge);
  queued->samples.push_back({"", {{"class", "foreground"}}, double(work.queued_foreground)});
  queued->samples.push_back({"", {{"class", "background"}}, double(work.queued_background)});
  FamilySnapshot* ran = AddFamily(out, "kvbank_device_work_ran_total",
                                  "Device-worker tasks run, by class.", MetricType::kCounter);
  ran->samples.push_back({"", {{"class", "foreground"}}, double(work.ran_foreground)});
  ran->samples.push_back({"", {{"class", "background"}}, double(work.ran_background)});
  AddFamily(out, "kvbank_build_info", "Always 1; the version label names the kvbankd build.",
            MetricType::kGauge)
      ->samples.push_back({"", {{"version", options_.version}}, 1});
}

}  // namespace kvbank::metrics
