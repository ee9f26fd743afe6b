#include "server/rpc/service.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "proto/wire.h"
#include "server/rpc/handler_util.h"

namespace kvbank::rpc {

// One unary call: owns its request and response, so that a handler may answer later (Attend
// answers from a worker). Reply is called once; the response is serialized only when OK.
template <typename Request, typename Response>
class KvBankService::UnaryCall final : public grpc::ServerUnaryReactor {
 public:
  explicit UnaryCall(grpc::ByteBuffer* out) : out_(out) {}
  void Reply(const absl::Status& s) {
    if (!s.ok()) return Finish(ToGrpcStatus(s));
    bool own = false;
    Finish(grpc::SerializationTraits<Response>::Serialize(response, out_, &own));
  }
  void OnDone() override { delete this; }

  Request request;
  Response response;

 private:
  grpc::ByteBuffer* const out_;
};

template <typename Request, typename Response, typename Handler>
grpc::ServerUnaryReactor* KvBankService::Serve(Ctx* ctx, const Raw* raw, Raw* out,
                                               Handler handler) {
  auto* call = new UnaryCall<Request, Response>(out);
  auto caller = Admit(*ctx);
  if (!caller.ok()) {
    call->Reply(caller.status());
  } else if (absl::Status s = ParseRequest(raw, &call->request); !s.ok()) {
    call->Reply(s);
  } else {
    call->Reply(handler(*caller, call->request, &call->response));
  }
  return call;
}

template <typename Request, typename Response, typename Prepare>
grpc::ServerUnaryReactor* KvBankService::ServeWork(Ctx* ctx, const Raw* raw, Raw* out,
                                                   Prepare prepare) {
  auto* call = new UnaryCall<Request, Response>(out);
  auto caller = Admit(*ctx);
  if (!caller.ok()) {
    call->Reply(caller.status());
    return call;
  }
  if (absl::Status s = ParseRequest(raw, &call->request); !s.ok()) {
    call->Reply(s);
    return call;
  }
  absl::StatusOr<Work<Response>> work = prepare(*caller, call->request);
  if (!work.ok()) {
    call->Reply(work.status());
    return call;
  }
  auto run = [call, fn = std::move(work->run)] { call->Reply(fn(&call->response)); };
  if (!work->on_worker) {
    run();
  } else if (absl::Status s = device_work_->Submit(caller->tenant, WorkClass::kForeground, run);
             !s.ok()) {
    call->Reply(s);  // the tenant's backlog is full: the task was dropped, never run
  }
  return call;
}

template <typename Request, typename Response, typename Op>
grpc::ServerUnaryReactor* KvBankService::ServeSequence(Ctx* ctx, const Raw* raw, Raw* out, Op op) {
  return Serve<Request, Response>(
      ctx, raw, out, [&](const Caller& caller, const Request& req, Response* resp) -> absl::Status {
        if (absl::Status s = CheckSequenceId(req.sequence_id()); !s.ok()) return s;
        auto store = FindModel(*registry_, req.model());
        if (!store.ok()) return store.status();
        return op(**store, caller.tenant, req, resp);
      });
}

KvBankService::KvBankService(std::shared_ptr<ModelRegistry> registry, ServiceOptions options,
                             Authenticator auth)
    : registry_(std::move(registry)),
      options_(std::move(options)),
      auth_(std::move(auth)),
      ledger_(options_.ledger != nullptr ? options_.ledger : DefaultLedger()),
      watchdog_(options_.stream_idle_timeout),
      device_work_(std::make_unique<FairWork>(
          FairWorkOptions{std::max(1u, options_.device_workers)}, ledger_)),
      attend_work_(std::make_unique<WorkQueue>(std::max(1u, options_.attend_workers))) {
  if (options_.shm_regions != nullptr) {
    options_.shm_regions->SetControlHandler(
        [this](std::shared_ptr<plane::ShmControlCall> call) { ServeControl(std::move(call)); });
  }
}

KvBankService::~KvBankService() {
  if (options_.shm_regions != nullptr) {
    // No new control call from here on; the ones in flight end (as cancelled calls) and are
    // waited for, before the workers and timers they use go.
    options_.shm_regions->SetControlHandler(nullptr);
    options_.shm_regions->EndControlCalls();
    absl::MutexLock lock(&control_mu_);
    control_mu_.Await(absl::Condition(
        +[](uint64_t* n) { return *n == 0; }, &control_calls_));
  }
}

std::shared_ptr<TenantLedger> DefaultLedger() {
  std::shared_ptr<TenantLedger> ledger = TenantLedger::Create();
  ledger->SetCap(Resource::kQueuedWork, kDefaultMaxQueuedWork);
  ledger->SetCap(Resource::kQueuedBackground, kDefaultMaxQueuedBackground);
  ledger->SetCap(Resource::kWatchStreams, kDefaultMaxWatchStreams);
  ledger->SetCap(Resource::kWaits, kDefaultMaxWaits);
  return ledger;
}

absl::StatusOr<Caller> KvBankService::Admit(const grpc::ServerContextBase& ctx) const {
  if (draining_.load(std::memory_order_acquire)) {
    return absl::UnavailableError("kvbankd is draining (shutting down): retry on another replica");
  }
  return auth_.Authenticate(ctx);
}

grpc::ServerUnaryReactor* KvBankService::EnsureModel(Ctx* ctx, const Raw* raw, Raw* out) {
  return Serve<v1::EnsureModelRequest, v1::EnsureModelResponse>(
      ctx, raw, out,
      [this](const Caller& caller, const v1::EnsureModelRequest& req,
             v1::EnsureModelResponse* resp) -> absl::Status {
        auto config = ToModelConfig(req.spec(), options_.defaults);
        if (!config.ok()) return config.status();
        // Any tenant may ensure a model that is there with this layout; only an admin adds one
        // (a pool is prefaulted memory out of the server-wide budget, and names are global).
        auto existing = registry_->Get(config->layout.name);
        if (!existing.ok()) {
          if (absl::Status s = CheckAdmin(caller, "registering a model"); !s.ok()) return s;
        }
        auto result = registry_->Ensure(*std::move(config));
        if (!result.ok()) return result.status();
        if (result->created) auth_.ApplyQuotas(*result->model);
        ToProto(*result->model, resp->mutable_model());
        resp->set_created(result->created);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvBankService::DropModel(Ctx* ctx, const Raw* raw, Raw* out) {
  return Serve<v1::DropModelRequest, v1::DropModelResponse>(
      ctx, raw, out,
      [this](const Caller& caller, const v1::DropModelRequest& req,
             v1::DropModelResponse*) -> absl::Status {
        if (absl::Status s = CheckAdmin(caller, "dropping a model"); !s.ok()) return s;
        if (req.name().empty()) return absl::InvalidArgumentError("name is empty");
        auto model = registry_->Get(req.name());
        if (!model.ok()) return model.status();
        if (absl::Status s = registry_->Drop(req.name()); !s.ok()) return s;
        // Watch streams hold the model (and its pool) too: they end now.
        EndWatches(model->get(),
                   absl::NotFoundError(absl::StrCat("model ", Quote(req.name()), " was dropped")));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvBankService::ListModels(Ctx* ctx, const Raw* raw, Raw* out) {
  return Serve<v1::ListModelsRequest, v1::ListModelsResponse>(
      ctx, raw, out,
      [this](const Caller&, const v1::ListModelsRequest&, v1::ListModelsResponse* resp) {
        for (const auto& m : registry_->List()) ToProto(*m, resp->add_models());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvBankService::GetStats(Ctx* ctx, const Raw* raw, Raw* out) {
  return Serve<v1::GetStatsRequest, v1::GetStatsResponse>(
      ctx, raw, out,
      [this](const Caller& caller, const v1::GetStatsRequest& req,
             v1::GetStatsResponse* resp) -> absl::Status {
        for (const TenantLedgerRow& row : ledger_->Rows()) {
          if (!caller.admin && row.tenant != caller.tenant) continue;
          v1::TenantUsage* u = resp->add_tenants();
          u->set_tenant(row.tenant);
          for (size_t i = 0; i < kNumResources; ++i) {
            v1::ResourceUsage* r = u->add_resources();
            r->set_resource(ResourceName(Resource(i)));
            r->set_held(row.held[i]);
            r->set_share(row.share[i]);
            r->set_refused(row.refused[i]);
          }
        }
        if (req.usage_only()) return absl::OkStatus();
        std::vector<std::shared_ptr<SequenceStore>> models;
        if (req.model().empty()) {
          models = registry_->List();
        } else {
          auto m = registry_->Get(req.model());
          if (!m.ok()) return m.status();
          models.push_back(*m);
        }
        for (const auto& m : models) {
          // A tenant sees its own figures only; an admin sees the model's and every tenant's.
          const StoreStats st = m->Stats(caller.admin ? nullptr : &caller.tenant);
          ToProto(*m, st, resp->add_models());
        }
        return absl::OkStatus();
      });
}

namespace {

// A CreateSequenceRequest as the store takes it; INVALID_ARGUMENT naming the field.
absl::StatusOr<CreateOptions> ToCreateOptions(const v1::CreateSequenceRequest& req,
                                              const std::string& tenant) {
  auto lease = LeaseFromProto(req.lease_ttl_ms(), req.no_lease());
  if (!lease.ok()) return lease.status();
  CreateOptions o;
  o.lease = *lease;
  o.tenant = tenant;
  o.prompt.assign(req.prompt_token_ids().begin(), req.prompt_token_ids().end());
  o.cache_salt = req.cache_salt();
  o.prefix_copy = req.prefix_copy();
  auto keys = ExtraKeysFromProto(req.extra_keys());
  if (!keys.ok()) return keys.status();
  o.extra_keys = *std::move(keys);
  if (req.has_priority()) {
    if (req.priority() > 100) {
      return absl::InvalidArgumentError(
          absl::StrCat("priority ", req.priority(), " is outside [0, 100]"));
    }
    o.priority = static_cast<uint8_t>(req.priority());
  }
  const v1::Retention& rt = req.retention();
  if (!v1::Retention::Kind_IsValid(rt.kind())) {
    return absl::InvalidArgumentError("retention.kind is unknown");
  }
  o.retention.kind = static_cast<RetentionPolicy::Kind>(rt.kind());
  o.retention.window = rt.window();
  o.retention.sinks = rt.sinks();
  o.retention.budget = rt.budget();
  return o;
}

}  // namespace

grpc::ServerUnaryReactor* KvBankService::CreateSequence(Ctx* ctx, const Raw* raw, Raw* out) {
  // A prompt's blocks may come back from a disk tier (or be copied to a device): such a create
  // runs on a worker, not in this reaction. One whose cached blocks are all in memory (the pool
  // or the host tier: the common case of a hot prefix) runs here, without two thread hops. (A
  // block that moves to the disk between this look-up and the create is read here: rare, and
  // one read.)
  using Response = v1::SequenceInfo;
  return ServeWork<v1::CreateSequenceRequest, Response>(
      ctx, raw, out,
      [this](const Caller& caller,
             const v1::CreateSequenceRequest& req) -> absl::StatusOr<Work<Response>> {
        auto model = FindModel(*registry_, req.model());
        if (!model.ok()) return model.status();
        auto options = ToCreateOptions(req, caller.tenant);
        if (!options.ok()) return options.status();
        const TierCache* tiers = (*model)->prefix().tiers();
        Work<Response> w;
        w.on_worker = false;
        if (!req.prompt_token_ids().empty() && tiers != nullptr) {
          if ((*model)->pool().memory().waits_on_device()) {
            w.on_worker = true;
          } else if (tiers->has_disk()) {
            MatchQuery q;
            q.tokens = options->prompt;
            q.cache_salt = options->cache_salt;
            q.extra_keys = options->extra_keys;
            w.on_worker = (*model)->prefix().MatchTiers(caller.tenant, {q})[0].disk_tokens > 0;
          }
        }
        w.run = [store = *std::move(model), o = *std::move(options), name = req.model()](
                    Response* resp) { return Reply(store->Create(o), name, resp); };
        return w;
      });
}

grpc::ServerUnaryReactor* KvBankService::Match(Ctx* ctx, const Raw* raw, Raw* out) {
  return Serve<v1::MatchRequest, v1::MatchResponse>(
      ctx, raw, out,
      [this](const Caller& caller, const v1::MatchRequest& req,
             v1::MatchResponse* resp) -> absl::Status {
        auto model = FindModel(*registry_, req.model());
        if (!model.ok()) return model.status();
        if (req.queries_size() > kMaxMatchQueries) {
          return absl::InvalidArgumentError(absl::StrCat(
              "queries: ", req.queries_size(), " in one call; at most ", kMaxMatchQueries));
        }
        std::vector<MatchQuery> queries;
        queries.reserve(req.queries_size());
        for (const v1::MatchQuery& q : req.queries()) {
          MatchQuery m;
          m.tokens.assign(q.token_ids().begin(), q.token_ids().end());
          auto hashes = HashesFromProto(q.block_hashes(), "queries.block_hashes");
          if (!hashes.ok()) return hashes.status();
          if (!m.tokens.empty() && !hashes->empty()) {
            return absl::InvalidArgumentError(
                "a query gives either token_ids or block_hashes, not both");
          }
          m.hashes = *std::move(hashes);
          m.cache_salt = q.cache_salt();
          auto keys = ExtraKeysFromProto(q.extra_keys());
          if (!keys.ok()) return keys.status();
          m.extra_keys = *std::move(keys);
          queries.push_back(std::move(m));
        }
        bool in_tiers = false;
        for (const MatchResult& r : (*model)->prefix().MatchTiers(caller.tenant, queries)) {
          resp->add_cached_tokens(r.tokens);
          resp->add_pool_tokens(r.pool_tokens);
          resp->add_host_tokens(r.host_tokens);
          resp->add_disk_tokens(r.disk_tokens);
          in_tiers |= r.host_tokens + r.disk_tokens > 0;
        }
        if (req.prefetch() && in_tiers) {
          // After the answer, in the background on a worker: the caller's next call finds the
          // blocks in the pool. A prefetch is a hint: past the tenant's share of queued
          // background work it is dropped (counted in the ledger), and the answer stands.
          uint64_t blocks = 0;
          for (const MatchQuery& q : queries) {
            blocks += q.hashes.size() + q.tokens.size() / (*model)->layout().block_tokens;
          }
          device_work_
              ->Submit(
                  caller.tenant, WorkClass::kBackground,
                  [store = *std::move(model), tenant = caller.tenant,
                   queries = std::move(queries)] { store->prefix().Prefetch(tenant, queries); },
                  blocks)
              .IgnoreError();
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvBankService::Pin(Ctx* ctx, const Raw* raw, Raw* out) {
  return Serve<v1::PinRequest, v1::PinResponse>(
      ctx, raw, out,
      [this](const Caller& caller, const v1::PinRequest& req,
             v1::PinResponse* resp) -> absl::Status {
        auto model = FindModel(*registry_, req.model());
        if (!model.ok()) return model.status();
        auto hashes = HashesFromProto(req.block_hashes(), "block_hashes");
        if (!hashes.ok()) return hashes.status();
        if (hashes->empty()) {
          auto keys = ExtraKeysFromProto(req.extra_keys());
          if (!keys.ok()) return keys.status();
          const std::vector<uint32_t> tokens(req.token_ids().begin(), req.token_ids().end());
          *hashes = PrefixHashes((*model)->options().hash,
                                 (*model)->prefix().Root(caller.tenant, req.cache_salt()), tokens,
                                 (*model)->layout().block_tokens, *keys);
        }
        if (hashes->empty()) {
          return absl::InvalidArgumentError(
              "give block_hashes or at least one full block of token_ids");
        }
        resp->set_blocks((*model)->prefix().Pin(caller.tenant, *hashes, !req.unpin()));
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvBankService::GetPrefixRoot(Ctx* ctx, const Raw* raw, Raw* out) {
  return Serve<v1::GetPrefixRootRequest, v1::GetPrefixRootResponse>(
      ctx, raw, out,
      [this](const Caller& caller, const v1::GetPrefixRootRequest& req,
             v1::GetPrefixRootResponse* resp) -> absl::Status {
        auto model = FindModel(*registry_, req.model());
        if (!model.ok()) return model.status();
        const BlockHash root = (*model)->prefix().Root(caller.tenant, req.cache_salt());
        resp->set_root_hash(root.data(), root.size());
        resp->set_hash_algorithm(HashAlgorithmName((*model)->options().hash));
        resp->set_block_tokens((*model)->layout().block_tokens);
        resp->set_layout_fingerprint(LayoutFingerprint((*model)->layout()));
        resp->set_tenant(caller.tenant);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvBankService::Fork(Ctx* ctx, const Raw* raw, Raw* out) {
  // A fork copies the parent's partial blocks: on memory that waits on a device the copy runs on
  // a worker, not in this reaction.
  using Response = v1::SequenceInfo;
  return ServeWork<v1::ForkRequest, Response>(
      ctx, raw, out,
      [this](const Caller& caller, const v1::ForkRequest& req) -> absl::StatusOr<Work<Response>> {
        if (absl::Status s = CheckSequenceId(req.sequence_id()); !s.ok()) return s;
        auto model = FindModel(*registry_, req.model());
        if (!model.ok()) return model.status();
        auto lease = LeaseFromProto(req.lease_ttl_ms(), false);
        if (!lease.ok()) return lease.status();
        Work<Response> w;
        w.on_worker = (*model)->pool().memory().waits_on_device();
        w.run = [store = *std::move(model), lease = *lease, tenant = caller.tenant,
                 id = req.sequence_id(), name = req.model()](Response* resp) {
          return Reply(store->Fork(id, lease, tenant), name, resp);
        };
        return w;
      });
}

grpc::ServerUnaryReactor* KvBankService::Truncate(Ctx* ctx, const Raw* raw, Raw* out) {
  return ServeSequence<v1::TruncateRequest, v1::SequenceInfo>(
      ctx, raw, out,
      [](SequenceStore& m, const std::string& tenant, const v1::TruncateRequest& req,
         v1::SequenceInfo* resp) {
        return Reply(m.Truncate(req.sequence_id(), req.num_tokens(), tenant), req.model(), resp);
      });
}

grpc::ServerUnaryReactor* KvBankService::Free(Ctx* ctx, const Raw* raw, Raw* out) {
  return ServeSequence<v1::FreeRequest, v1::FreeResponse>(
      ctx, raw, out,
      [](SequenceStore& m, const std::string& tenant, const v1::FreeRequest& req,
         v1::FreeResponse* resp) -> absl::Status {
        auto released = m.Free(req.sequence_id(), tenant);
        if (!released.ok()) return released.status();
        resp->set_blocks_released(*released);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvBankService::RenewLease(Ctx* ctx, const Raw* raw, Raw* out) {
  return ServeSequence<v1::RenewLeaseRequest, v1::SequenceInfo>(
      ctx, raw, out,
      [](SequenceStore& m, const std::string& tenant, const v1::RenewLeaseRequest& req,
         v1::SequenceInfo* resp) {
        return Reply(m.RenewLease(req.sequence_id(), tenant), req.model(), resp);
      });
}

grpc::ServerUnaryReactor* KvBankService::GetSequence(Ctx* ctx, const Raw* raw, Raw* out) {
  return ServeSequence<v1::GetSequenceRequest, v1::SequenceInfo>(
      ctx, raw, out,
      [](SequenceStore& m, const std::string& tenant, const v1::GetSequenceRequest& req,
         v1::SequenceInfo* resp) {
        return Reply(m.Get(req.sequence_id(), tenant), req.model(), resp);
      });
}

// Server stream of KV events. Wakes on KvEventLog::Notify (from whichever thread appended) and
// on OnWriteDone; one write in flight. The first message is sent at once (maybe empty): from then
// on the watch is live.
class KvBankService::WatchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                                          public KvEventListener {
 public:
  static constexpr size_t kMaxBatch = 256;

  // `claim`: the stream's place in its tenant's share of Watch streams, held until it ends.
  WatchReactor(KvBankService* service, grpc::CallbackServerContext* ctx,
               std::shared_ptr<SequenceStore> model, Caller caller, uint64_t after,
               LedgerClaim claim)
      : service_(service),
        model_(std::move(model)),
        caller_(std::move(caller)),
        claim_(std::move(claim)),
        stream_(service->watchdog_.Watch(ctx)),
        cursor_(after) {
    stream_->SetWaiting(false);  // a watch with nothing to send is idle by design
    // Woken only for events this caller may see: its tenant's (everything, for an admin).
    model_->prefix().events()->Subscribe(this, caller_.tenant, caller_.admin);
    service_->AddWatch(this);
    Pump();
  }

  // Ends the stream (the server drains, the model was dropped); no-op once it ended.
  void End(const absl::Status& why) {
    absl::MutexLock lock(&mu_);
    FinishLocked(ToGrpcStatus(why));
  }
  const SequenceStore* model() const { return model_.get(); }

  void Notify() override { Pump(); }

  void OnWriteDone(bool ok) override {
    stream_->SetWaiting(false);
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {
        FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "watch stream broke"));
        return;
      }
    }
    Pump();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
  }

  void OnDone() override {
    model_->prefix().events()->Unsubscribe(this);  // after this, no Notify runs
    service_->RemoveWatch(this);                   // nor End from the service
    stream_->Done();
    delete this;
  }

 private:
  void Pump() {
    absl::MutexLock lock(&mu_);
    if (writing_ || finished_) return;
    resp_.Clear();
    for (;;) {
      auto batch =
          model_->prefix().events()->Read(cursor_, kMaxBatch, caller_.tenant, caller_.admin);
      if (!batch.ok()) return FinishLocked(ToGrpcStatus(batch.status()));
      const bool advanced = batch->next_after != cursor_;
      cursor_ = batch->next_after;
      for (const KvEvent& e : batch->events) ToProto(e, caller_.admin, resp_.add_events());
      // Events this tenant may not see advance the cursor without filling the batch: read on.
      if (resp_.events_size() > 0 || !advanced) break;
    }
    if (resp_.events_size() == 0 && sent_first_) return;
    resp_.set_last_sequence(cursor_);
    sent_first_ = true;
    bool own = false;
    message_.Clear();  // Serialize needs an empty buffer; the last write is done with this one
    grpc::Status s = grpc::SerializationTraits<v1::KvEventBatch>::Serialize(resp_, &message_, &own);
    if (!s.ok()) return FinishLocked(s);
    writing_ = true;
    stream_->SetWaiting(true);  // a client that stops reading is cut after the idle timeout
    StartWrite(&message_);
  }

  void FinishLocked(const grpc::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(s);
  }

  KvBankService* const service_;
  const std::shared_ptr<SequenceStore> model_;
  const Caller caller_;
  const LedgerClaim claim_;
  const std::shared_ptr<StreamWatchdog::Stream> stream_;
  absl::Mutex mu_;
  uint64_t cursor_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool sent_first_ ABSL_GUARDED_BY(mu_) = false;
  v1::KvEventBatch resp_ ABSL_GUARDED_BY(mu_);
  grpc::ByteBuffer message_ ABSL_GUARDED_BY(mu_);  // resp_, serialized; gRPC reads it until
                                                   // OnWriteDone
};

namespace {
// A write reactor that only reports an error.
class FailedWatch final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit FailedWatch(const absl::Status& s) { Finish(ToGrpcStatus(s)); }
  void OnDone() override { delete this; }
};
}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvBankService::Watch(Ctx* ctx, const Raw* raw) {
  auto caller = Admit(*ctx);
  if (!caller.ok()) return new FailedWatch(caller.status());
  v1::WatchRequest req;
  if (absl::Status s = ParseRequest(raw, &req); !s.ok()) return new FailedWatch(s);
  auto model = FindModel(*registry_, req.model());
  if (!model.ok()) return new FailedWatch(model.status());
  if ((*model)->prefix().events() == nullptr) {
    return new FailedWatch(absl::UnimplementedError("this model keeps no KV events"));
  }
  auto claim = ledger_->Acquire(caller->tenant, Resource::kWatchStreams);
  if (!claim.ok()) return new FailedWatch(claim.status());
  const uint64_t after =
      req.from_now() ? (*model)->prefix().events()->last_sequence() : req.after_sequence();
  return new WatchReactor(this, ctx, *std::move(model), *std::move(caller), after,
                          *std::move(claim));
}

void KvBankService::AddWatch(WatchReactor* w) {
  absl::MutexLock lock(&watches_mu_);
  watches_.insert(w);
  if (draining_.load(std::memory_order_relaxed)) w->End(DrainStatus());  // admitted just before
}

void KvBankService::EndWatches(const SequenceStore* model, const absl::Status& why) {
  absl::MutexLock lock(&watches_mu_);
  for (WatchReactor* w : watches_) {
    if (w->model() == model) w->End(why);
  }
}

void KvBankService::RemoveWatch(WatchReactor* w) {
  absl::MutexLock lock(&watches_mu_);
  watches_.erase(w);
}

void KvBankService::BeginDrain() {
  absl::MutexLock lock(&watches_mu_);
  draining_.store(true, std::memory_order_release);
  for (WatchReactor* w : watches_) w->End(DrainStatus());
}

grpc::ServerUnaryReactor* KvBankService::Attend(Ctx* ctx, const Raw* raw, Raw* out) {
  auto* call = new UnaryCall<v1::AttendRequest, v1::AttendResponse>(out);
  std::string tenant;
  auto start = [&]() -> absl::StatusOr<std::shared_ptr<SequenceStore>> {
    auto caller = Admit(*ctx);
    if (!caller.ok()) return caller.status();
    if (absl::Status s = ParseRequest(raw, &call->request); !s.ok()) return s;
    // Every limit before anything is sized from the request: the outputs below are items x
    // q_heads x head_dim_v floats, and a 4 MB message can name millions of empty items.
    if (size_t n = call->request.items_size(); n > SequenceStore::kMaxAttendItems) {
      return absl::InvalidArgumentError(
          absl::StrCat("items: ", n, " in one call; at most ", SequenceStore::kMaxAttendItems));
    }
    auto model = FindModel(*registry_, call->request.model());
    if (!model.ok()) return model.status();
    tenant = caller->tenant;
    return model;
  };
  auto model = start();
  if (!model.ok()) {
    call->Reply(model.status());
    return call;
  }
  // The kernel's time grows with the context: it runs on a worker, never in this reaction.
  attend_work_->Submit([this, call, store = *std::move(model), tenant = std::move(tenant)] {
    const v1::AttendRequest& req = call->request;
    const ModelLayout& m = store->layout();
    std::vector<SequenceStore::AttendItem> items;
    items.reserve(req.items_size());
    for (const v1::AttendItem& it : req.items()) {
      items.push_back({it.sequence_id(), it.layer(),
                       absl::MakeConstSpan(it.query().data(), it.query().size())});
    }
    SequenceStore::AttendOptions o;
    o.tenant = tenant;
    o.sm_scale = req.softmax_scale();
    o.window = req.window();
    o.sinks = req.sinks();
    const uint32_t cores = std::max(1u, std::thread::hardware_concurrency());
    o.num_threads = options_.attend_kernel_threads
                        ? options_.attend_kernel_threads
                        : std::max(1u, cores / std::max(1u, options_.attend_workers));
    const uint64_t out_per = uint64_t{m.num_q_heads} * m.head_dim_v;
    std::vector<float> out(items.size() * out_per), lse(items.size() * m.num_q_heads);
    absl::Status s = store->Attend(o, items, absl::MakeSpan(out), absl::MakeSpan(lse));
    if (s.ok()) {
      for (size_t i = 0; i < items.size(); ++i) {
        v1::AttendResult* r = call->response.add_results();
        r->mutable_output()->Add(out.begin() + i * out_per, out.begin() + (i + 1) * out_per);
        r->mutable_lse()->Add(lse.begin() + i * m.num_q_heads,
                              lse.begin() + (i + 1) * m.num_q_heads);
      }
    }
    call->Reply(s);
  });
  return call;
}

grpc::ServerUnaryReactor* KvBankService::GetServerInfo(Ctx* ctx, const Raw* raw, Raw* out) {
  return Serve<v1::GetServerInfoRequest, v1::GetServerInfoResponse>(
      ctx, raw, out,
      [this](const Caller&, const v1::GetServerInfoRequest&, v1::GetServerInfoResponse* resp) {
        resp->set_version(KVBANK_VERSION_STRING);
        resp->set_replica(options_.replica_name);
        if (options_.shm_regions != nullptr) {
          resp->set_shm_socket(options_.shm_regions->options().socket_path);
          resp->set_shm_control_version(proto::kShmControlVersion);
        }
        if (options_.cuda_ipc != nullptr) {
          resp->set_cuda_ipc_device(options_.cuda_ipc->options().device);
        }
        resp->set_nccl(options_.nccl != nullptr);
        if (options_.nccl == nullptr) {
          resp->set_nccl_off(options_.nccl_off.empty() ? "kvbankd serves no NCCL plane"
                                                       : options_.nccl_off);
        }
        resp->set_host_id(options_.host_id);
        return absl::OkStatus();
      });
}

// The shared-memory plane: the handle comes from the Unix socket (server/plane/shm_regions.h).
grpc::ServerUnaryReactor* KvBankService::RegisterRegion(Ctx* ctx, const Raw* raw, Raw* out) {
  return Serve<v1::RegisterRegionRequest, v1::RegisterRegionResponse>(
      ctx, raw, out,
      [this](const Caller& caller, const v1::RegisterRegionRequest& req,
             v1::RegisterRegionResponse* resp) -> absl::Status {
        auto regions = ShmPlane();
        if (!regions.ok()) return regions.status();
        auto claimed = (*regions)->Claim(caller.tenant, req.handle());
        if (!claimed.ok()) return claimed.status();
        resp->set_region_id(claimed->region_id);
        resp->set_size(claimed->size);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvBankService::UnregisterRegion(Ctx* ctx, const Raw* raw, Raw* out) {
  return Serve<v1::UnregisterRegionRequest, v1::UnregisterRegionResponse>(
      ctx, raw, out,
      [this](const Caller& caller, const v1::UnregisterRegionRequest& req,
             v1::UnregisterRegionResponse*) -> absl::Status {
        auto regions = ShmPlane();
        if (!regions.ok()) return regions.status();
        return (*regions)->Unregister(caller.tenant, req.region_id());
      });
}

// The CUDA IPC plane: the handle is the client's cudaIpcMemHandle_t (server/plane/cuda_ipc.h).
grpc::ServerUnaryReactor* KvBankService::RegisterDeviceRegion(Ctx* ctx, const Raw* raw, Raw* out) {
  return Serve<v1::RegisterDeviceRegionRequest, v1::RegisterDeviceRegionResponse>(
      ctx, raw, out,
      [this](const Caller& caller, const v1::RegisterDeviceRegionRequest& req,
             v1::RegisterDeviceRegionResponse* resp) -> absl::Status {
        auto ipc = CudaIpcPlane();
        if (!ipc.ok()) return ipc.status();
        auto id = (*ipc)->Register(caller.tenant, req.handle(), req.offset(), req.size());
        if (!id.ok()) return id.status();
        resp->set_region_id(*id);
        resp->set_size(req.size());
        resp->set_device((*ipc)->options().device);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* KvBankService::UnregisterDeviceRegion(Ctx* ctx, const Raw* raw,
                                                                Raw* out) {
  return Serve<v1::UnregisterDeviceRegionRequest, v1::UnregisterDeviceRegionResponse>(
      ctx, raw, out,
      [this](const Caller& caller, const v1::UnregisterDeviceRegionRequest& req,
             v1::UnregisterDeviceRegionResponse*) -> absl::Status {
        auto ipc = CudaIpcPlane();
        if (!ipc.ok()) return ipc.status();
        return (*ipc)->Unregister(caller.tenant, req.region_id());
      });
}

grpc::ServerUnaryReactor* KvBankService::NcclConnect(Ctx* ctx, const Raw* raw, Raw* out) {
  return Serve<v1::NcclConnectRequest, v1::NcclConnectResponse>(
      ctx, raw, out,
      [this, ctx](const Caller& caller, const v1::NcclConnectRequest& req,
                  v1::NcclConnectResponse* resp) {
        return ConnectNccl(caller, ctx->peer(), req, resp);
      });
}

grpc::ServerUnaryReactor* KvBankService::NcclDisconnect(Ctx* ctx, const Raw* raw, Raw* out) {
  return Serve<v1::NcclDisconnectRequest, v1::NcclDisconnectResponse>(
      ctx, raw, out,
      [this](const Caller& caller, const v1::NcclDisconnectRequest& req,
             v1::NcclDisconnectResponse*) { return DisconnectNccl(caller, req); });
}

}  // namespace kvbank::rpc
