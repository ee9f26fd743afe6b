#include "server/rpc/service.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "proto/append_message.h"
#include "proto/wire.h"
#include "server/core/quote.h"

namespace kvbank::rpc {

namespace {

absl::StatusOr<std::shared_ptr<SequenceStore>> FindModel(const ModelRegistry& registry,
                                                         const std::string& name) {
  if (name.empty()) return absl::InvalidArgumentError("model is empty");
  return registry.Get(name);
}

absl::Status CheckSequenceId(uint64_t id) {
  if (id == 0) return absl::InvalidArgumentError("sequence_id is 0 (unset)");
  return absl::OkStatus();
}

// Writes `info` into the reply, or passes its error on.
absl::Status Reply(const absl::StatusOr<SequenceInfo>& info, const std::string& model,
                   v1::SequenceInfo* resp) {
  if (!info.ok()) return info.status();
  ToProto(*info, model, resp);
  return absl::OkStatus();
}

// A raw method's request, parsed; INVALID_ARGUMENT naming the type when it is not a `Request`.
template <typename Request>
absl::Status ParseRequest(const grpc::ByteBuffer* raw, Request* req) {
  grpc::ByteBuffer copy(*raw);  // Deserialize consumes its buffer; the slices are shared
  grpc::Status s = grpc::SerializationTraits<Request>::Deserialize(&copy, req);
  if (s.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("request is not a ", Request::descriptor()->full_name()));
}

// The server is draining: a Watch ends; the client resumes from its last sequence elsewhere.
absl::Status DrainStatus() {
  return absl::UnavailableError("kvbankd is draining (shutting down): watch again elsewhere");
}

absl::Status CheckAdmin(const Caller& caller, const char* what) {
  if (caller.admin) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(what, " is an admin act; tenant ", Quote(caller.tenant), " is not an admin"));
}

}  // namespace

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
      watchdog_(options_.stream_idle_timeout),
      device_work_(std::make_unique<WorkQueue>(std::max(1u, options_.device_workers))),
      attend_work_(std::make_unique<WorkQueue>(std::max(1u, options_.attend_workers))) {}

KvBankService::~KvBankService() = default;

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

grpc::ServerUnaryReactor* KvBankService::CreateSequence(Ctx* ctx, const Raw* raw, Raw* out) {
  return Serve<v1::CreateSequenceRequest, v1::SequenceInfo>(
      ctx, raw, out,
      [this](const Caller& caller, const v1::CreateSequenceRequest& req,
             v1::SequenceInfo* resp) -> absl::Status {
        auto model = FindModel(*registry_, req.model());
        if (!model.ok()) return model.status();
        auto lease = LeaseFromProto(req.lease_ttl_ms(), req.no_lease());
        if (!lease.ok()) return lease.status();
        CreateOptions o;
        o.lease = *lease;
        o.tenant = caller.tenant;
        o.prompt.assign(req.prompt_token_ids().begin(), req.prompt_token_ids().end());
        o.cache_salt = req.cache_salt();
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
        return Reply((*model)->Create(o), req.model(), resp);
      });
}

// Client stream: header (+ data), data, ..., half-close. Payload bytes go straight from each
// message into the pool through the core's AppendTxn; half-close commits; an error, a cancel or
// a client that goes away destroys the uncommitted transaction, which undoes everything.
//
// The messages are AppendRequest, decoded here rather than by protobuf (the method is raw): the
// data field's bytes are written to the pool from gRPC's slices, without protobuf's copy into a
// std::string first.
class KvBankService::AppendReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  AppendReactor(KvBankService* service, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* resp)
      : service_(service), ctx_(ctx), resp_(resp), stream_(service->watchdog_.Watch(ctx, [this] {
          absl::MutexLock lock(&mu_);
          Fail(absl::DeadlineExceededError(
              absl::StrCat("append stream sent nothing for ",
                           absl::FormatDuration(service_->watchdog_.idle_timeout()),
                           " (--stream-idle-timeout-ms): ended, nothing appended")));
        })) {
    absl::MutexLock lock(&mu_);
    auto caller = service->Admit(*ctx);
    if (!caller.ok()) {
      Fail(caller.status());
      return;
    }
    tenant_ = caller->tenant;
    StartRead(&message_);
  }

  void OnReadDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      stream_->Progress();
      if (finished_) return;  // the idle timeout ended the call while this read waited
      if (ok) {
        message_decoded_ = proto::AppendMessage();  // its data spans point into message_'s slices
        if (absl::Status s =
                proto::DecodeAppendMessage(message_, kMaxMessageBytes, &message_decoded_);
            !s.ok()) {
          return Fail(s);
        }
        if (txn_ == nullptr && message_decoded_.header.has_value()) {
          auto model = FindModel(*service_->registry_, message_decoded_.header->model());
          on_device_ = model.ok() && (*model)->pool().memory().waits_on_device();
        }
      }
      if (!on_device_) return Step(ok);
    }
    // The pool's memory waits on a device: the copies (and the commit's) run on a worker, and
    // the next read starts from there. The worker holds a reference, so that the reactor
    // outlives it even when the call ends meanwhile (the idle timeout).
    refs_.fetch_add(1, std::memory_order_relaxed);
    service_->device_work_->Submit([this, ok] {
      {
        absl::MutexLock lock(&mu_);
        if (!finished_) Step(ok);
      }
      Unref();
    });
  }

  void OnDone() override {
    stream_->Done();
    Unref();
  }

 private:
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  // One message read (ok) or the end of the stream (!ok).
  void Step(bool ok) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!ok) {
      // Half-close commits; a cancelled or broken call (client gone, deadline) never does.
      if (ctx_->IsCancelled()) return Fail(absl::CancelledError("append cancelled"));
      if (txn_ == nullptr) return Fail(absl::InvalidArgumentError("append stream had no header"));
      auto info = txn_->Commit();
      txn_.reset();
      if (!info.ok()) return Fail(info.status());
      v1::AppendResponse resp;
      ToProto(*info, model_name_, resp.mutable_sequence());
      bool own = false;
      grpc::Status s = grpc::SerializationTraits<v1::AppendResponse>::Serialize(resp, resp_, &own);
      return End(s);
    }
    if (absl::Status s = Handle(); !s.ok()) return Fail(s);
    message_decoded_ = proto::AppendMessage();
    message_.Clear();
    StartRead(&message_);
  }

  // One decoded AppendRequest (proto::DecodeAppendMessage): the first carries the header.
  absl::Status Handle() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const proto::AppendMessage& m = message_decoded_;
    const std::optional<v1::AppendHeader>& header = m.header;
    if (txn_ == nullptr) {
      if (!header.has_value()) {
        return absl::InvalidArgumentError("the first append message must carry header");
      }
      if (absl::Status s = Begin(*header); !s.ok()) return s;
    } else if (header.has_value()) {
      return absl::InvalidArgumentError("header may appear only in the first append message");
    }
    for (absl::Span<const uint8_t> piece : m.data) {
      if (absl::Status s = txn_->Write(piece); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  absl::Status Begin(const v1::AppendHeader& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (absl::Status s = CheckSequenceId(h.sequence_id()); !s.ok()) return s;
    auto model = FindModel(*service_->registry_, h.model());
    if (!model.ok()) return model.status();
    auto dtype = FromProto(h.dtype(), "header.dtype");
    if (!dtype.ok()) return dtype.status();
    AppendSpec spec;
    spec.tenant = tenant_;
    spec.sequence_id = h.sequence_id();
    spec.layer_begin = h.layer_begin();
    if (h.has_layer_end()) spec.layer_end = h.layer_end();
    spec.num_tokens = h.num_tokens();
    spec.dtype = *dtype;
    spec.token_ids.assign(h.token_ids().begin(), h.token_ids().end());
    auto txn = (*model)->BeginAppend(spec);
    if (!txn.ok()) return txn.status();
    if (h.payload_bytes() != 0 && h.payload_bytes() != (*txn)->payload_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.payload_bytes ", h.payload_bytes(), " does not match the ",
          (*txn)->payload_bytes(), " bytes the layout takes for ", h.num_tokens(), " tokens"));
    }
    txn_ = *std::move(txn);
    model_name_ = h.model();
    return absl::OkStatus();
  }

  void Fail(const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    txn_.reset();  // undoes the append
    End(ToGrpcStatus(s));
  }
  // Finishes the call once; a read may still be pending (the idle timeout): it completes with
  // ok = false and finds finished_ set.
  void End(const grpc::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    stream_->SetWaiting(false);
    Finish(s);
  }

  KvBankService* const service_;
  grpc::CallbackServerContext* const ctx_;
  grpc::ByteBuffer* const resp_;
  // Reactions and the watchdog's idle callback; always uncontended but for that callback.
  absl::Mutex mu_;
  grpc::ByteBuffer message_ ABSL_GUARDED_BY(mu_);
  proto::AppendMessage message_decoded_ ABSL_GUARDED_BY(mu_);
  bool on_device_ ABSL_GUARDED_BY(mu_) = false;  // the model's memory waits on a device
  std::unique_ptr<AppendTxn> txn_ ABSL_GUARDED_BY(mu_);
  std::string model_name_ ABSL_GUARDED_BY(mu_);
  std::string tenant_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // gRPC's (until OnDone) and each queued worker step's: the last to go deletes the reactor.
  std::atomic<int> refs_{1};
  // Last: its idle callback uses the members above.
  const std::shared_ptr<StreamWatchdog::Stream> stream_;
};

grpc::ServerReadReactor<grpc::ByteBuffer>* KvBankService::Append(Ctx* ctx, Raw* resp) {
  return new AppendReactor(this, ctx, resp);
}

// Server stream: header with the first chunk, then one chunk per write, one write in flight and
// the next message built meanwhile, so that reading a chunk out of the pool overlaps sending the
// one before it (the reading thread is whichever thread advanced the stream: the constructor's or
// OnWriteDone's; at most one builds at a time).
// The FetchReader holds references on the blocks read, so the bytes stay as they were even if
// the sequence is truncated, appended to or freed meanwhile. It goes as soon as the last chunk is
// read, before the status is sent: a caller that saw the fetch end sees no block still held by it.
//
// The messages are FetchResponse, encoded here rather than by protobuf (the methods are raw): a
// chunk is read from the pool into a buffer that gRPC then sends as it is, as the `data` field's
// slice, so the payload is copied once on this side (protobuf would copy it again into the
// message's serialized slices).
class KvBankService::FetchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  using Open = std::function<absl::StatusOr<std::unique_ptr<FetchReader>>()>;
  // `open` makes the reader (what to send, or why not). on_device: the model's memory waits on a
  // device, so opening (which reads the first staged piece) and every read run on a device
  // worker, never in a reaction.
  FetchReactor(KvBankService* service, grpc::CallbackServerContext* ctx, Open open, bool on_device)
      : service_(service),
        chunk_bytes_(service->options_.chunk_bytes),
        on_device_(on_device),
        stream_(service->watchdog_.Watch(ctx)) {
    if (!on_device_) {
      Start(open());
      return;
    }
    refs_.fetch_add(1, std::memory_order_relaxed);
    service_->device_work_->Submit([this, open = std::move(open)] {
      Start(open());
      Unref();
    });
  }

  void OnWriteDone(bool ok) override {
    stream_->Progress();
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok && !end_.has_value()) {
        end_ = stream_->timed_out()
                   ? ToGrpcStatus(absl::DeadlineExceededError(
                         absl::StrCat("fetch client read nothing for ",
                                      absl::FormatDuration(service_->watchdog_.idle_timeout()),
                                      " (--stream-idle-timeout-ms): cancelled")))
                   : grpc::Status(grpc::StatusCode::CANCELLED, "fetch stream broke");
      }
    }
    Advance();
  }

  void OnDone() override {
    stream_->Done();
    Unref();
  }

 private:
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  // The reader is open (or failed to): the header is known, the stream starts.
  void Start(absl::StatusOr<std::unique_ptr<FetchReader>> reader) {
    if (!reader.ok()) {
      {
        absl::MutexLock lock(&mu_);
        finished_ = true;
      }
      stream_->SetWaiting(false);
      Finish(ToGrpcStatus(reader.status()));
      return;
    }
    reader_ = *std::move(reader);
    header_.set_token_begin(reader_->token_begin());
    header_.set_num_tokens(reader_->num_tokens());
    header_.set_layer_begin(reader_->layer_begin());
    header_.set_layer_end(reader_->layer_end());
    header_.set_dtype(ToProto(reader_->dtype()));
    header_.set_payload_bytes(reader_->payload_bytes());
    header_.set_kv_head_begin(reader_->kv_head_begin());
    header_.set_kv_head_end(reader_->kv_head_end());
    total_ = reader_->payload_bytes();
    Advance(on_device_);
  }

  // Starts the built message when no write is in flight, builds the next one when none is
  // built, and finishes once nothing is in flight and there is nothing more to send (or an error
  // ended the stream). Called by Start and OnWriteDone, possibly at the same time. on_worker:
  // this thread may read the pool; otherwise (memory that waits on a device, in a reaction) the
  // build goes to a device worker.
  void Advance(bool on_worker = false) {
    for (;;) {
      bool start = false, build = false, finish = false;
      uint64_t offset = 0;
      grpc::Status status;
      {
        absl::MutexLock lock(&mu_);
        if (finished_) return;
        if (!writing_ && ready_ && !end_.has_value()) {
          sending_.Swap(&next_);
          ready_ = false;
          writing_ = start = true;
        }
        // The first message is built even for an empty payload: it carries the header.
        if (!building_ && !ready_ && !end_.has_value() && (offset_ < total_ || !built_any_)) {
          building_ = build = true;
          offset = offset_;
        }
        if (!writing_ && !building_ &&
            (end_.has_value() || (!ready_ && built_any_ && offset_ == total_))) {
          finished_ = finish = true;
          status = end_.value_or(grpc::Status::OK);
        }
      }
      if (start) StartWrite(&sending_);
      if (finish) {
        stream_->SetWaiting(false);
        reader_.reset();  // on an error: the snapshot's blocks go now
        return Finish(status);
      }
      if (!build) return;
      if (on_device_ && !on_worker) {
        refs_.fetch_add(1, std::memory_order_relaxed);
        service_->device_work_->Submit([this, offset] {
          BuildAt(offset);
          Advance(/*on_worker=*/true);
          Unref();
        });
        return;
      }
      BuildAt(offset);
    }
  }

  // Builds next_ from payload byte `offset` on. REQUIRES: building_ was set by this thread.
  void BuildAt(uint64_t offset) {
    {
      const uint64_t n = std::min(chunk_bytes_, total_ - offset);
      absl::Status built = Build(offset, n, &next_);
      absl::MutexLock lock(&mu_);
      building_ = false;
      if (!built.ok()) {
        if (!end_.has_value()) end_ = ToGrpcStatus(built);  // never a wrong payload
      } else {
        offset_ = offset + n;
        ready_ = built_any_ = true;
      }
    }
  }

  // Reads payload bytes [offset, offset + n) into a new FetchResponse message. REQUIRES: the
  // caller is the only builder (building_).
  absl::Status Build(uint64_t offset, uint64_t n, grpc::ByteBuffer* message) {
    // Freed by gRPC once the bytes are sent (a slice's lifetime may outlast OnWriteDone).
    uint8_t* data = static_cast<uint8_t*>(std::malloc(std::max<uint64_t>(n, 1)));
    if (data == nullptr) return absl::ResourceExhaustedError("no memory for a fetch chunk");
    if (absl::Status s = reader_->Read(offset, absl::MakeSpan(data, n)); !s.ok()) {
      std::free(data);
      return s;
    }
    std::string prefix;
    if (offset == 0) {  // the header goes with the first chunk
      const std::string header = header_.SerializeAsString();
      proto::AppendLengthDelimitedKey(1, header.size(), &prefix);
      prefix += header;
    }
    proto::AppendLengthDelimitedKey(2, n, &prefix);
    const grpc::Slice slices[2] = {grpc::Slice(prefix), grpc::Slice(data, n, std::free)};
    *message = grpc::ByteBuffer(slices, 2);
    if (offset + n == total_) reader_.reset();  // every byte is in a message: the blocks can go
    return absl::OkStatus();
  }

  const KvBankService* const service_;
  const uint64_t chunk_bytes_;
  const bool on_device_;
  // gRPC's (until OnDone) and each queued device step's: the last to go deletes the reactor.
  std::atomic<int> refs_{1};
  const std::shared_ptr<StreamWatchdog::Stream> stream_;
  // Used by the builder only (one at a time), and by the finisher once nothing is built.
  std::unique_ptr<FetchReader> reader_;
  v1::FetchHeader header_;
  uint64_t total_ = 0;  // payload bytes

  absl::Mutex mu_;
  uint64_t offset_ ABSL_GUARDED_BY(mu_) = 0;              // payload bytes built into messages
  bool writing_ ABSL_GUARDED_BY(mu_) = false;             // sending_ is in flight
  bool building_ ABSL_GUARDED_BY(mu_) = false;            // a thread is filling next_
  bool ready_ ABSL_GUARDED_BY(mu_) = false;               // next_ holds a message not yet started
  bool built_any_ ABSL_GUARDED_BY(mu_) = false;           // the header's message is built
  bool finished_ ABSL_GUARDED_BY(mu_) = false;            // Finish was called (or is being called)
  std::optional<grpc::Status> end_ ABSL_GUARDED_BY(mu_);  // an error that ends the stream
  grpc::ByteBuffer sending_;  // touched only while no write is in flight
  grpc::ByteBuffer next_;     // touched only by the builder, or under mu_ while none builds
};

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvBankService::Fetch(Ctx* ctx, const Raw* raw) {
  // Everything but opening the reader runs here; the reader opens in the reactor (on a device
  // worker when the model's memory waits on a device).
  bool on_device = false;
  auto prepare = [&]() -> absl::StatusOr<FetchReactor::Open> {
    auto caller = Admit(*ctx);
    if (!caller.ok()) return caller.status();
    v1::FetchRequest req;
    if (absl::Status s = ParseRequest(raw, &req); !s.ok()) return s;
    if (absl::Status s = CheckSequenceId(req.sequence_id()); !s.ok()) return s;
    auto model = FindModel(*registry_, req.model());
    if (!model.ok()) return model.status();
    auto d = FromProto(req.dtype(), "dtype");
    if (!d.ok()) return d.status();
    FetchSpec spec;
    spec.tenant = caller->tenant;
    spec.sequence_id = req.sequence_id();
    spec.token_begin = req.token_begin();
    if (req.has_token_end()) spec.token_end = req.token_end();
    spec.layer_begin = req.layer_begin();
    if (req.has_layer_end()) spec.layer_end = req.layer_end();
    spec.dtype = *d;
    spec.kv_head_begin = req.kv_head_begin();
    if (req.has_kv_head_end()) spec.kv_head_end = req.kv_head_end();
    on_device = (*model)->pool().memory().waits_on_device();
    return FetchReactor::Open(
        [store = *std::move(model), spec = std::move(spec)] { return store->BeginFetch(spec); });
  };
  auto open = prepare();
  if (!open.ok()) {
    return new FetchReactor(
        this, ctx,
        [s = open.status()]() -> absl::StatusOr<std::unique_ptr<FetchReader>> { return s; }, false);
  }
  return new FetchReactor(this, ctx, *std::move(open), on_device);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvBankService::FetchBlocks(Ctx* ctx, const Raw* raw) {
  bool on_device = false;
  auto prepare = [&]() -> absl::StatusOr<FetchReactor::Open> {
    auto caller = Admit(*ctx);
    if (!caller.ok()) return caller.status();
    v1::FetchBlocksRequest req;
    if (absl::Status s = ParseRequest(raw, &req); !s.ok()) return s;
    auto model = FindModel(*registry_, req.model());
    if (!model.ok()) return model.status();
    auto hashes = HashesFromProto(req.block_hashes(), "block_hashes");
    if (!hashes.ok()) return hashes.status();
    std::optional<uint32_t> layer_end, head_end;
    if (req.has_layer_end()) layer_end = req.layer_end();
    if (req.has_kv_head_end()) head_end = req.kv_head_end();
    auto d = FromProto(req.dtype(), "dtype");
    if (!d.ok()) return d.status();
    on_device = (*model)->pool().memory().waits_on_device();
    return FetchReactor::Open([store = *std::move(model), tenant = caller->tenant,
                               hashes = *std::move(hashes), l0 = req.layer_begin(), layer_end,
                               dtype = *d, h0 = req.kv_head_begin(), head_end] {
      return store->FetchBlocks(tenant, hashes, l0, layer_end, dtype, h0, head_end);
    });
  };
  auto open = prepare();
  if (!open.ok()) {
    return new FetchReactor(
        this, ctx,
        [s = open.status()]() -> absl::StatusOr<std::unique_ptr<FetchReader>> { return s; }, false);
  }
  return new FetchReactor(this, ctx, *std::move(open), on_device);
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
        for (uint64_t n : (*model)->Match(caller.tenant, queries)) resp->add_cached_tokens(n);
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
                                 (*model)->Root(caller.tenant, req.cache_salt()), tokens,
                                 (*model)->layout().block_tokens, *keys);
        }
        if (hashes->empty()) {
          return absl::InvalidArgumentError(
              "give block_hashes or at least one full block of token_ids");
        }
        resp->set_blocks((*model)->Pin(caller.tenant, *hashes, !req.unpin()));
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
        const BlockHash root = (*model)->Root(caller.tenant, req.cache_salt());
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
  auto* call = new UnaryCall<v1::ForkRequest, v1::SequenceInfo>(out);
  auto caller = Admit(*ctx);
  if (!caller.ok()) {
    call->Reply(caller.status());
    return call;
  }
  if (absl::Status s = ParseRequest(raw, &call->request); !s.ok()) {
    call->Reply(s);
    return call;
  }
  const v1::ForkRequest& req = call->request;
  if (absl::Status s = CheckSequenceId(req.sequence_id()); !s.ok()) {
    call->Reply(s);
    return call;
  }
  auto model = FindModel(*registry_, req.model());
  if (!model.ok()) {
    call->Reply(model.status());
    return call;
  }
  auto lease = LeaseFromProto(req.lease_ttl_ms(), false);
  if (!lease.ok()) {
    call->Reply(lease.status());
    return call;
  }
  const bool on_device = (*model)->pool().memory().waits_on_device();
  auto run = [call, store = *std::move(model), lease = *lease, tenant = caller->tenant] {
    call->Reply(Reply(store->Fork(call->request.sequence_id(), lease, tenant),
                      call->request.model(), &call->response));
  };
  if (on_device) {
    device_work_->Submit(std::move(run));
  } else {
    run();
  }
  return call;
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

  WatchReactor(KvBankService* service, grpc::CallbackServerContext* ctx,
               std::shared_ptr<SequenceStore> model, Caller caller, uint64_t after)
      : service_(service),
        model_(std::move(model)),
        caller_(std::move(caller)),
        stream_(service->watchdog_.Watch(ctx)),
        cursor_(after) {
    stream_->SetWaiting(false);  // a watch with nothing to send is idle by design
    model_->events()->Subscribe(this);
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
    model_->events()->Unsubscribe(this);  // after this, no Notify runs
    service_->RemoveWatch(this);          // nor End from the service
    stream_->Done();
    delete this;
  }

 private:
  void Pump() {
    absl::MutexLock lock(&mu_);
    if (writing_ || finished_) return;
    resp_.Clear();
    for (;;) {
      auto batch = model_->events()->Read(cursor_, kMaxBatch, caller_.tenant, caller_.admin);
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
  if ((*model)->events() == nullptr) {
    return new FailedWatch(absl::UnimplementedError("this model keeps no KV events"));
  }
  const uint64_t after =
      req.from_now() ? (*model)->events()->last_sequence() : req.after_sequence();
  return new WatchReactor(this, ctx, *std::move(model), *std::move(caller), after);
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

}  // namespace kvbank::rpc
