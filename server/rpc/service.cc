#include "server/rpc/service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvbank::rpc {

namespace {

// Finishes a unary call with `s` (the response is sent only when s is OK).
grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const absl::Status& s) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(ToGrpcStatus(s));
  return r;
}

absl::StatusOr<std::shared_ptr<SequenceStore>> FindModel(const ModelRegistry& registry,
                                                         const std::string& name) {
  if (name.empty()) return absl::InvalidArgumentError("model is empty");
  return registry.Get(name);
}

absl::Status CheckSequenceId(uint64_t id) {
  if (id == 0) return absl::InvalidArgumentError("sequence_id is 0 (unset)");
  return absl::OkStatus();
}

}  // namespace

KvBankService::KvBankService(std::shared_ptr<ModelRegistry> registry, ServiceOptions options)
    : registry_(std::move(registry)), options_(std::move(options)) {}

grpc::ServerUnaryReactor* KvBankService::EnsureModel(grpc::CallbackServerContext* ctx,
                                                     const v1::EnsureModelRequest* req,
                                                     v1::EnsureModelResponse* resp) {
  auto config = ToModelConfig(req->spec(), options_.defaults);
  if (!config.ok()) return Done(ctx, config.status());
  auto result = registry_->Ensure(*std::move(config));
  if (!result.ok()) return Done(ctx, result.status());
  ToProto(*result->model, resp->mutable_model());
  resp->set_created(result->created);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KvBankService::ListModels(grpc::CallbackServerContext* ctx,
                                                    const v1::ListModelsRequest* req,
                                                    v1::ListModelsResponse* resp) {
  for (const auto& m : registry_->List()) ToProto(*m, resp->add_models());
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KvBankService::GetStats(grpc::CallbackServerContext* ctx,
                                                  const v1::GetStatsRequest* req,
                                                  v1::GetStatsResponse* resp) {
  std::vector<std::shared_ptr<SequenceStore>> models;
  if (req->model().empty()) {
    models = registry_->List();
  } else {
    auto m = registry_->Get(req->model());
    if (!m.ok()) return Done(ctx, m.status());
    models.push_back(*m);
  }
  for (const auto& m : models) ToProto(*m, m->Stats(), resp->add_models());
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KvBankService::CreateSequence(grpc::CallbackServerContext* ctx,
                                                        const v1::CreateSequenceRequest* req,
                                                        v1::SequenceInfo* resp) {
  auto model = FindModel(*registry_, req->model());
  if (!model.ok()) return Done(ctx, model.status());
  auto lease = LeaseFromProto(req->lease_ttl_ms(), req->no_lease());
  if (!lease.ok()) return Done(ctx, lease.status());
  auto info = (*model)->Create(*lease);
  if (!info.ok()) return Done(ctx, info.status());
  ToProto(*info, req->model(), resp);
  return Done(ctx, absl::OkStatus());
}

// Client stream: header (+ data), data, ..., half-close. Payload bytes go straight from each
// message into the pool through the core's AppendTxn; half-close commits; an error, a cancel or
// a client that goes away destroys the uncommitted transaction, which undoes everything.
class KvBankService::AppendReactor final : public grpc::ServerReadReactor<v1::AppendRequest> {
 public:
  AppendReactor(const KvBankService* service, grpc::CallbackServerContext* ctx,
                v1::AppendResponse* resp)
      : service_(service), ctx_(ctx), resp_(resp) {
    StartRead(&req_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // Half-close commits; a cancelled or broken call (client gone, deadline) never does.
      if (ctx_->IsCancelled()) return Fail(absl::CancelledError("append cancelled"));
      if (txn_ == nullptr) return Fail(absl::InvalidArgumentError("append stream had no header"));
      auto info = txn_->Commit();
      txn_.reset();
      if (!info.ok()) return Fail(info.status());
      ToProto(*info, model_name_, resp_->mutable_sequence());
      return Finish(grpc::Status::OK);
    }
    if (absl::Status s = Handle(); !s.ok()) return Fail(s);
    req_.Clear();
    StartRead(&req_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Handle() {
    if (txn_ == nullptr) {
      if (!req_.has_header()) {
        return absl::InvalidArgumentError("the first append message must carry header");
      }
      const v1::AppendHeader& h = req_.header();
      if (absl::Status s = CheckSequenceId(h.sequence_id()); !s.ok()) return s;
      auto model = FindModel(*service_->registry_, h.model());
      if (!model.ok()) return model.status();
      auto dtype = FromProto(h.dtype(), "header.dtype");
      if (!dtype.ok()) return dtype.status();
      AppendSpec spec;
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
    } else if (req_.has_header()) {
      return absl::InvalidArgumentError("header may appear only in the first append message");
    }
    const std::string& data = req_.data();
    return txn_->Write(
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(data.data()), data.size()));
  }

  void Fail(const absl::Status& s) {
    txn_.reset();  // undoes the append
    Finish(ToGrpcStatus(s));
  }

  const KvBankService* const service_;
  grpc::CallbackServerContext* const ctx_;
  v1::AppendResponse* const resp_;
  v1::AppendRequest req_;
  std::unique_ptr<AppendTxn> txn_;
  std::string model_name_;
};

grpc::ServerReadReactor<v1::AppendRequest>* KvBankService::Append(grpc::CallbackServerContext* ctx,
                                                                  v1::AppendResponse* resp) {
  return new AppendReactor(this, ctx, resp);
}

// Server stream: header with the first chunk, then one chunk per write, one write in flight.
// The FetchReader holds references on the blocks read, so the bytes stay as they were even if
// the sequence is truncated, appended to or freed meanwhile.
class KvBankService::FetchReactor final : public grpc::ServerWriteReactor<v1::FetchResponse> {
 public:
  FetchReactor(const KvBankService* service, const v1::FetchRequest* req)
      : chunk_bytes_(service->options_.chunk_bytes) {
    absl::Status s = Start(*service, *req);
    if (!s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    v1::FetchHeader* h = resp_.mutable_header();
    h->set_token_begin(reader_->token_begin());
    h->set_num_tokens(reader_->num_tokens());
    h->set_layer_begin(reader_->layer_begin());
    h->set_layer_end(reader_->layer_end());
    h->set_dtype(ToProto(dtype_));
    h->set_payload_bytes(reader_->payload_bytes());
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return Finish(grpc::Status(grpc::StatusCode::CANCELLED, "fetch stream broke"));
    resp_.clear_header();
    if (offset_ == reader_->payload_bytes()) return Finish(grpc::Status::OK);
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Start(const KvBankService& service, const v1::FetchRequest& req) {
    if (absl::Status s = CheckSequenceId(req.sequence_id()); !s.ok()) return s;
    auto model = FindModel(*service.registry_, req.model());
    if (!model.ok()) return model.status();
    auto dtype = FromProto(req.dtype(), "dtype");
    if (!dtype.ok()) return dtype.status();
    FetchSpec spec;
    spec.sequence_id = req.sequence_id();
    spec.token_begin = req.token_begin();
    if (req.has_token_end()) spec.token_end = req.token_end();
    spec.layer_begin = req.layer_begin();
    if (req.has_layer_end()) spec.layer_end = req.layer_end();
    spec.dtype = *dtype;
    auto reader = (*model)->BeginFetch(spec);
    if (!reader.ok()) return reader.status();
    reader_ = *std::move(reader);
    dtype_ = (*model)->layout().layer_dtypes[reader_->layer_begin()];
    return absl::OkStatus();
  }

  void WriteNext() {
    const uint64_t n = std::min(chunk_bytes_, reader_->payload_bytes() - offset_);
    std::string* data = resp_.mutable_data();
    data->resize(n);
    reader_->Read(offset_, absl::MakeSpan(reinterpret_cast<uint8_t*>(data->data()), n));
    offset_ += n;
    StartWrite(&resp_);
  }

  const uint64_t chunk_bytes_;
  std::unique_ptr<FetchReader> reader_;
  DType dtype_ = DType::kFp16;
  v1::FetchResponse resp_;
  uint64_t offset_ = 0;
};

grpc::ServerWriteReactor<v1::FetchResponse>* KvBankService::Fetch(grpc::CallbackServerContext* ctx,
                                                                  const v1::FetchRequest* req) {
  return new FetchReactor(this, req);
}

grpc::ServerUnaryReactor* KvBankService::Fork(grpc::CallbackServerContext* ctx,
                                              const v1::ForkRequest* req, v1::SequenceInfo* resp) {
  if (absl::Status s = CheckSequenceId(req->sequence_id()); !s.ok()) return Done(ctx, s);
  auto model = FindModel(*registry_, req->model());
  if (!model.ok()) return Done(ctx, model.status());
  auto lease = LeaseFromProto(req->lease_ttl_ms(), false);
  if (!lease.ok()) return Done(ctx, lease.status());
  auto info = (*model)->Fork(req->sequence_id(), *lease);
  if (!info.ok()) return Done(ctx, info.status());
  ToProto(*info, req->model(), resp);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KvBankService::Truncate(grpc::CallbackServerContext* ctx,
                                                  const v1::TruncateRequest* req,
                                                  v1::SequenceInfo* resp) {
  if (absl::Status s = CheckSequenceId(req->sequence_id()); !s.ok()) return Done(ctx, s);
  auto model = FindModel(*registry_, req->model());
  if (!model.ok()) return Done(ctx, model.status());
  auto info = (*model)->Truncate(req->sequence_id(), req->num_tokens());
  if (!info.ok()) return Done(ctx, info.status());
  ToProto(*info, req->model(), resp);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KvBankService::Free(grpc::CallbackServerContext* ctx,
                                              const v1::FreeRequest* req, v1::FreeResponse* resp) {
  if (absl::Status s = CheckSequenceId(req->sequence_id()); !s.ok()) return Done(ctx, s);
  auto model = FindModel(*registry_, req->model());
  if (!model.ok()) return Done(ctx, model.status());
  auto released = (*model)->Free(req->sequence_id());
  if (!released.ok()) return Done(ctx, released.status());
  resp->set_blocks_released(*released);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KvBankService::RenewLease(grpc::CallbackServerContext* ctx,
                                                    const v1::RenewLeaseRequest* req,
                                                    v1::SequenceInfo* resp) {
  if (absl::Status s = CheckSequenceId(req->sequence_id()); !s.ok()) return Done(ctx, s);
  auto model = FindModel(*registry_, req->model());
  if (!model.ok()) return Done(ctx, model.status());
  auto info = (*model)->RenewLease(req->sequence_id());
  if (!info.ok()) return Done(ctx, info.status());
  ToProto(*info, req->model(), resp);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KvBankService::GetSequence(grpc::CallbackServerContext* ctx,
                                                     const v1::GetSequenceRequest* req,
                                                     v1::SequenceInfo* resp) {
  if (absl::Status s = CheckSequenceId(req->sequence_id()); !s.ok()) return Done(ctx, s);
  auto model = FindModel(*registry_, req->model());
  if (!model.ok()) return Done(ctx, model.status());
  auto info = (*model)->Get(req->sequence_id());
  if (!info.ok()) return Done(ctx, info.status());
  ToProto(*info, req->model(), resp);
  return Done(ctx, absl::OkStatus());
}

}  // namespace kvbank::rpc
