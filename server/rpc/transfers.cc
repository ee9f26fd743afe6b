// KvBankService's data path: Append (a client stream into an AppendTxn), Fetch and FetchBlocks
// (a FetchReader streamed out). Payload bytes move between gRPC's slices and the pool through the
// core's transfer seam; on memory that waits on a device, every move runs on a device worker.
#include <algorithm>
#include <atomic>
#include <functional>
#include <optional>

#include "absl/strings/str_cat.h"
#include "proto/append_message.h"
#include "proto/wire.h"
#include "server/rpc/handler_util.h"
#include "server/rpc/reactor_refs.h"
#include "server/rpc/service.h"

namespace kvbank::rpc {

// Client stream: header (+ data), data, ..., half-close. Payload bytes go straight from each
// message into the pool through the core's AppendTxn; half-close commits; an error, a cancel or
// a client that goes away destroys the uncommitted transaction, which undoes everything.
//
// The messages are AppendRequest, decoded here rather than by protobuf (the method is raw): the
// data field's bytes are written to the pool from gRPC's slices, without protobuf's copy into a
// std::string first.
class KvBankService::AppendReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer>,
                                           public ReactorRefs<AppendReactor> {
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
    bool first = false;  // the header's step: the call's work is admitted (or refused) here
    std::string tenant;
    {
      absl::MutexLock lock(&mu_);
      stream_->Progress();
      if (finished_) return;  // the idle timeout ended the call while this read waited
      first = txn_ == nullptr;
      tenant = tenant_;
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
          // A payload from a region is copied whole (a small one from host memory is copied
          // here: CopiesInline), one over NCCL waits on the peer: never in a reaction.
          const v1::AppendHeader& h = *message_decoded_.header;
          on_device_ = on_device_ || h.has_device_source() || h.has_nccl() ||
                       (h.has_source() && !CopiesInline(h.source().length()));
        }
      }
      if (!on_device_) return Step(ok);
    }
    // The pool's memory waits on a device: the copies (and the commit's) run on a worker, and
    // the next read starts from there. The worker holds a reference, so that the reactor
    // outlives it even when the call ends meanwhile (the idle timeout).
    auto step = Held([this, ok] {
      absl::MutexLock lock(&mu_);
      if (!finished_) Step(ok);
    });
    if (!first) return service_->device_work_->Continue(tenant, std::move(step));
    if (absl::Status s = service_->device_work_->Submit(tenant, WorkClass::kForeground, step);
        !s.ok()) {
      {
        absl::MutexLock lock(&mu_);
        Fail(s);
      }
      Unref();  // the step's reference: it will never run
    }
  }

  void OnDone() override {
    stream_->Done();
    Unref();
  }

 private:
  // One message read (ok) or the end of the stream (!ok).
  void Step(bool ok) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!ok) {
      // Half-close commits; a cancelled or broken call (client gone, deadline) never does.
      if (ctx_->IsCancelled()) return Fail(absl::CancelledError("append cancelled"));
      if (txn_ == nullptr) return Fail(absl::InvalidArgumentError("append stream had no header"));
      auto resp = service_->CommitAppend(std::move(txn_), model_name_, plane_);
      if (!resp.ok()) return Fail(resp.status());
      bool own = false;
      grpc::Status s = grpc::SerializationTraits<v1::AppendResponse>::Serialize(*resp, resp_, &own);
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
      plane_ = header->has_source()          ? Plane::kShm
               : header->has_device_source() ? Plane::kCudaIpc
               : header->has_nccl()          ? Plane::kNccl
                                             : Plane::kGrpc;
      if (header->has_source()) return BeginFromRegion(*header, m);
      if (header->has_device_source()) return BeginFromDevice(*header, m);
      if (header->has_nccl()) return BeginFromNccl(*header, m);
    } else if (header.has_value()) {
      return absl::InvalidArgumentError("header may appear only in the first append message");
    }
    if (from_nccl_ && !m.data.empty()) {
      return absl::InvalidArgumentError(
          "an append over NCCL (header.nccl) carries no data messages");
    }
    if (from_region_ && !m.data.empty()) {
      return absl::InvalidArgumentError(
          "an append from a region (header.source) carries no data messages");
    }
    for (absl::Span<const uint8_t> piece : m.data) {
      if (absl::Status s = txn_->Write(piece); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  absl::Status Begin(const v1::AppendHeader& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto txn = service_->BeginAppendTxn(tenant_, h);
    if (!txn.ok()) return txn.status();
    txn_ = *std::move(txn);
    model_name_ = h.model();
    return absl::OkStatus();
  }

  // The whole payload from the caller's shared-memory region; the stream then only half-closes.
  absl::Status BeginFromRegion(const v1::AppendHeader& h, const proto::AppendMessage& m)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!m.data.empty()) {
      return absl::InvalidArgumentError(
          "an append from a region (header.source) carries no data; the region holds the payload");
    }
    from_region_ = true;
    return service_->AppendFromRegions(tenant_, h, txn_.get());
  }

  // The whole payload over NCCL (nccl.cc); the stream then only half-closes. The receive waits
  // on the client's GPU, not on its stream: the idle timeout does not run meanwhile.
  absl::Status BeginFromNccl(const v1::AppendHeader& h, const proto::AppendMessage& m)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!m.data.empty()) {
      return absl::InvalidArgumentError(
          "an append over NCCL (header.nccl) carries no data; the payload comes by ncclSend");
    }
    from_nccl_ = true;
    stream_->SetWaiting(false);
    absl::Status s = service_->AppendFromNccl(tenant_, h.nccl(), txn_.get(), [this] {
      ctx_->AddInitialMetadata("kvbank-nccl", "ready");
      StartSendInitialMetadata();
    });
    stream_->SetWaiting(true);
    return s;
  }

  // The whole payload device to device from the caller's device region (the CUDA IPC plane).
  absl::Status BeginFromDevice(const v1::AppendHeader& h, const proto::AppendMessage& m)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!m.data.empty()) {
      return absl::InvalidArgumentError(
          "an append from a device region (header.device_source) carries no data");
    }
    from_region_ = true;
    return service_->AppendFromRegions(tenant_, h, txn_.get());
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
  // The model's memory waits on a device, or the payload comes from a region: steps run on a
  // worker.
  bool on_device_ ABSL_GUARDED_BY(mu_) = false;
  bool from_region_ ABSL_GUARDED_BY(mu_) = false;  // header.source: no data may follow
  bool from_nccl_ ABSL_GUARDED_BY(mu_) = false;    // header.nccl: no data may follow
  // The payload's way in (its bytes count in plane_bytes_ at the commit).
  Plane plane_ ABSL_GUARDED_BY(mu_) = Plane::kGrpc;
  std::unique_ptr<AppendTxn> txn_ ABSL_GUARDED_BY(mu_);
  std::string model_name_ ABSL_GUARDED_BY(mu_);
  std::string tenant_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // Last: its idle callback uses the members above.
  const std::shared_ptr<StreamWatchdog::Stream> stream_;
};

absl::StatusOr<std::unique_ptr<AppendTxn>> KvBankService::BeginAppendTxn(
    const std::string& tenant, const v1::AppendHeader& h) const {
  if (absl::Status s = CheckSequenceId(h.sequence_id()); !s.ok()) return s;
  if (h.has_source() && h.has_device_source()) {
    return absl::InvalidArgumentError("header.source and header.device_source: name one");
  }
  if (h.has_nccl() && (h.has_source() || h.has_device_source())) {
    return absl::InvalidArgumentError(
        "header.nccl excludes header.source and header.device_source: name one");
  }
  auto model = FindModel(*registry_, h.model());
  if (!model.ok()) return model.status();
  auto dtype = FromProto(h.dtype(), "header.dtype");
  if (!dtype.ok()) return dtype.status();
  AppendSpec spec;
  spec.tenant = tenant;
  spec.sequence_id = h.sequence_id();
  spec.layer_begin = h.layer_begin();
  if (h.has_layer_end()) spec.layer_end = h.layer_end();
  spec.num_tokens = h.num_tokens();
  spec.dtype = *dtype;
  spec.token_ids.assign(h.token_ids().begin(), h.token_ids().end());
  spec.kv_head_begin = h.kv_head_begin();
  if (h.has_kv_head_end()) spec.kv_head_end = h.kv_head_end();
  auto txn = (*model)->BeginAppend(spec);
  if (!txn.ok()) return txn.status();
  if (h.payload_bytes() != 0 && h.payload_bytes() != (*txn)->payload_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.payload_bytes ", h.payload_bytes(), " does not match the ", (*txn)->payload_bytes(),
        " bytes the layout takes for ", h.num_tokens(), " tokens"));
  }
  return txn;
}

absl::Status KvBankService::AppendFromRegions(const std::string& tenant, const v1::AppendHeader& h,
                                              AppendTxn* txn) const {
  auto model = FindModel(*registry_, h.model());
  if (!model.ok()) return model.status();
  if (h.has_device_source()) return AppendFromDevice(tenant, **model, h.device_source(), txn);
  return AppendFromRegion(tenant, **model, h.source(), txn);
}

absl::StatusOr<v1::AppendResponse> KvBankService::CommitAppend(std::unique_ptr<AppendTxn> txn,
                                                               const std::string& model,
                                                               Plane plane) const {
  const uint64_t payload_bytes = txn->payload_bytes();
  auto info = txn->Commit();
  txn.reset();
  if (!info.ok()) return info.status();
  plane_bytes_.AddReceived(plane, payload_bytes);
  v1::AppendResponse resp;
  ToProto(*info, model, resp.mutable_sequence());
  return resp;
}

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
class KvBankService::FetchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                                          public ReactorRefs<FetchReactor> {
 public:
  using Open = std::function<absl::StatusOr<std::unique_ptr<FetchReader>>()>;
  // `open` makes the reader (what to send, or why not). on_device: the model's memory waits on a
  // device, so opening (which reads the first staged piece) and every read run on a device
  // worker, never in a reaction.
  // wait: open only once the tokens are committed (FetchRequest.wait_ms).
  FetchReactor(KvBankService* service, grpc::CallbackServerContext* ctx, std::string tenant,
               Open open, bool on_device, std::optional<FetchWaitSpec> wait)
      : service_(service),
        tenant_(std::move(tenant)),
        chunk_bytes_(service->options_.chunk_bytes),
        on_device_(on_device),
        stream_(service->watchdog_.Watch(ctx)) {
    if (!wait.has_value()) {
      OpenNow(std::move(open));
      return;
    }
    stream_->SetWaiting(false);  // it waits for the sequence, not for its client
    wait_ = std::make_unique<FetchWait>(
        &service_->timers_, [this] { Ref(); }, [this] { Unref(); });
    // The wait may end on the thread of the commit it waited for, inside that append's
    // reaction: opening the fetch there (and reading its first chunk) would delay the append's
    // answer, so the fetch opens on a worker.
    wait_->Begin(
        std::move(wait->store), wait->spec, wait->timeout,
        [this, open = std::move(open)](absl::Status s) {
          // The waits are bounded (the tenant's share of waits): the open that
          // follows one belongs to the admitted call.
          service_->device_work_->Continue(tenant_, Held([this, s = std::move(s), open] {
                                             if (s.ok()) stream_->SetWaiting(true);
                                             Start(s.ok() ? open() : s);
                                           }));
        },
        std::move(wait->claim));
  }

  // The reactor of a fetch that `open` opens, or that answers open's error (which needs no
  // device worker).
  static FetchReactor* Start(KvBankService* service, grpc::CallbackServerContext* ctx,
                             std::string tenant, absl::StatusOr<Open> open, bool on_device,
                             std::optional<FetchWaitSpec> wait) {
    if (!open.ok()) {
      return new FetchReactor(
          service, ctx, std::move(tenant),
          [s = open.status()]() -> absl::StatusOr<std::unique_ptr<FetchReader>> { return s; },
          false, std::nullopt);
    }
    return new FetchReactor(service, ctx, std::move(tenant), *std::move(open), on_device,
                            std::move(wait));
  }

  void OnCancel() override {
    if (wait_ != nullptr) wait_->Cancel();
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
  // Opens the reader here, or on a device worker when the memory waits on a device.
  void OpenNow(Open open) {
    if (!on_device_) return Start(open());
    if (absl::Status s =
            service_->device_work_->Submit(tenant_, WorkClass::kForeground,
                                           Held([this, open = std::move(open)] { Start(open()); }));
        !s.ok()) {
      Start(s);  // the tenant's backlog is full: the call ends with that
      Unref();   // the step's reference: it will never run
    }
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
        if (status.ok()) service_->plane_bytes_.AddSent(Plane::kGrpc, total_);
        return Finish(status);
      }
      if (!build) return;
      if (on_device_ && !on_worker) {
        service_->device_work_->Continue(tenant_, Held([this, offset] {
                                           BuildAt(offset);
                                           Advance(/*on_worker=*/true);
                                         }));
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
  const std::string tenant_;  // whose work the device steps are
  const uint64_t chunk_bytes_;
  const bool on_device_;
  const std::shared_ptr<StreamWatchdog::Stream> stream_;
  std::unique_ptr<FetchWait> wait_;  // set by the constructor, or never
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

absl::StatusOr<KvBankService::PreparedFetch> KvBankService::PrepareFetch(
    const std::string& tenant, const v1::FetchRequest& req) const {
  PreparedFetch out;
  if (req.has_dest() && req.has_device_dest()) {
    return absl::InvalidArgumentError("dest and device_dest: name one");
  }
  if (req.has_dest()) out.dest = req.dest();
  if (req.has_nccl()) out.nccl = req.nccl();
  if (out.nccl.has_value() && (req.has_dest() || req.has_device_dest())) {
    return absl::InvalidArgumentError("nccl excludes dest and device_dest: name one");
  }
  if (out.nccl.has_value() && req.wait_ms() > 0) {
    return absl::InvalidArgumentError("wait_ms is not supported with nccl");
  }
  if (absl::Status s = CheckSequenceId(req.sequence_id()); !s.ok()) return s;
  auto model = FindModel(*registry_, req.model());
  if (!model.ok()) return model.status();
  auto d = FromProto(req.dtype(), "dtype");
  if (!d.ok()) return d.status();
  FetchSpec spec;
  spec.tenant = tenant;
  spec.sequence_id = req.sequence_id();
  spec.token_begin = req.token_begin();
  if (req.has_token_end()) spec.token_end = req.token_end();
  spec.layer_begin = req.layer_begin();
  if (req.has_layer_end()) spec.layer_end = req.layer_end();
  spec.dtype = *d;
  spec.kv_head_begin = req.kv_head_begin();
  if (req.has_kv_head_end()) spec.kv_head_end = req.kv_head_end();
  out.on_device = (*model)->pool().memory().waits_on_device();
  // NCCL sends the payload from the device: the reader stages nothing on the host.
  spec.device_dest = out.nccl.has_value();
  if (req.has_device_dest()) {
    spec.device_dest = true;
    out.device_dest = ResolveDeviceSlice(tenant, **model, req.device_dest(), "device_dest");
  }
  if (req.wait_ms() > kMaxFetchWaitMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("wait_ms ", req.wait_ms(), " exceeds ", kMaxFetchWaitMs));
  }
  if (req.wait_ms() > 0) {
    if (!spec.token_end.has_value()) {
      return absl::InvalidArgumentError("wait_ms needs token_end: the tokens to wait for");
    }
    auto claim = ledger_->Acquire(tenant, Resource::kWaits);
    if (!claim.ok()) return claim.status();
    out.wait = FetchWaitSpec{*model, spec, absl::Milliseconds(req.wait_ms()), *std::move(claim)};
  }
  out.open = [store = *std::move(model), spec = std::move(spec)] {
    return store->BeginFetch(spec);
  };
  return out;
}

absl::StatusOr<KvBankService::PreparedFetch> KvBankService::PrepareFetchBlocks(
    const std::string& tenant, const v1::FetchBlocksRequest& req) const {
  PreparedFetch out;
  if (req.has_dest() && req.has_device_dest()) {
    return absl::InvalidArgumentError("dest and device_dest: name one");
  }
  if (req.has_dest()) out.dest = req.dest();
  auto model = FindModel(*registry_, req.model());
  if (!model.ok()) return model.status();
  if (req.has_device_dest()) {
    out.device_dest = ResolveDeviceSlice(tenant, **model, req.device_dest(), "device_dest");
  }
  auto hashes = HashesFromProto(req.block_hashes(), "block_hashes");
  if (!hashes.ok()) return hashes.status();
  std::optional<uint32_t> layer_end, head_end;
  if (req.has_layer_end()) layer_end = req.layer_end();
  if (req.has_kv_head_end()) head_end = req.kv_head_end();
  auto d = FromProto(req.dtype(), "dtype");
  if (!d.ok()) return d.status();
  // Blocks may come back from a disk tier first: then the open runs on a worker too.
  const TierCache* tiers = (*model)->prefix().tiers();
  out.on_device =
      (*model)->pool().memory().waits_on_device() || (tiers != nullptr && tiers->has_disk());
  out.open = [store = *std::move(model), tenant, hashes = *std::move(hashes),
              l0 = req.layer_begin(), layer_end, dtype = *d, h0 = req.kv_head_begin(), head_end,
              to_device = req.has_device_dest()] {
    return store->prefix().FetchBlocks(tenant, hashes, l0, layer_end, dtype, h0, head_end,
                                       to_device);
  };
  return out;
}

// A prepared fetch as a gRPC call: into a region, over NCCL, or streamed.
grpc::ServerWriteReactor<grpc::ByteBuffer>* KvBankService::StartFetchCall(
    Ctx* ctx, const std::string& tenant, absl::StatusOr<PreparedFetch> fetch) {
  if (fetch.ok() && (fetch->dest.has_value() || fetch->device_dest.has_value())) {
    return StartRegionFetchCall(ctx, tenant, *std::move(fetch));
  }
  if (fetch.ok() && fetch->nccl.has_value()) {
    return StartNcclFetch(ctx, std::move(fetch->open), tenant, *fetch->nccl);
  }
  if (!fetch.ok()) {
    return FetchReactor::Start(this, ctx, tenant, fetch.status(), false, std::nullopt);
  }
  return FetchReactor::Start(this, ctx, tenant, std::move(fetch->open), fetch->on_device,
                             std::move(fetch->wait));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvBankService::Fetch(Ctx* ctx, const Raw* raw) {
  // Everything but opening the reader runs here; the reader opens in the reactor (on a device
  // worker when the model's memory waits on a device).
  std::string tenant;
  auto prepare = [&]() -> absl::StatusOr<PreparedFetch> {
    auto caller = Admit(*ctx);
    if (!caller.ok()) return caller.status();
    v1::FetchRequest req;
    if (absl::Status s = ParseRequest(raw, &req); !s.ok()) return s;
    tenant = caller->tenant;
    return PrepareFetch(tenant, req);
  };
  return StartFetchCall(ctx, tenant, prepare());
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvBankService::FetchBlocks(Ctx* ctx, const Raw* raw) {
  std::string tenant;
  auto prepare = [&]() -> absl::StatusOr<PreparedFetch> {
    auto caller = Admit(*ctx);
    if (!caller.ok()) return caller.status();
    v1::FetchBlocksRequest req;
    if (absl::Status s = ParseRequest(raw, &req); !s.ok()) return s;
    tenant = caller->tenant;
    return PrepareFetchBlocks(tenant, req);
  };
  return StartFetchCall(ctx, tenant, prepare());
}

}  // namespace kvbank::rpc
