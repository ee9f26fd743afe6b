// KvBankService's side of the NCCL plane (server/plane/nccl_plane.h): NcclConnect /
// NcclDisconnect, an Append whose header names a communicator (header.nccl) and a Fetch whose
// request does (nccl). The payload moves with ncclRecv / ncclSend between the client's GPU and a
// device buffer on the pool's GPU, and between that buffer and the blocks through the core's
// transfer seam on the device (AppendTxn::WriteFromDevice, FetchReader::ReadToDevice): no host
// copy. Everything that waits on NCCL runs on a device worker, never in a reaction.
//
// The handshake: a client must not issue its NCCL operation before kvbankd will issue the
// matching one (a refused call would leave it waiting forever), so kvbankd sends initial metadata
// kKvbankNccl = "ready" once the call is checked and its own operation is next; the client issues
// its operation then, and learns the outcome from the call's status.
//
// NOTE: a transfer holds a device worker (ServiceOptions::device_workers) while NCCL moves its
// payload, up to --nccl-transfer-timeout-ms when the peer never takes part: many transfers at
// once delay the gRPC transfers of cuda pools, which share those workers.
#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/plane/nccl_bootstrap.h"
#include "server/rpc/handler_util.h"
#include "server/rpc/reactor_refs.h"
#include "server/rpc/service.h"

namespace kvbank::rpc {
namespace {

constexpr char kKvbankNccl[] = "kvbank-nccl";
constexpr char kKvbankNcclBytes[] = "kvbank-nccl-bytes";

// The peer rank of a transfer, as NCCL's int.
absl::StatusOr<int> PeerOf(const v1::NcclTransfer& t, const char* field) {
  if (t.comm_id() == 0) return absl::InvalidArgumentError(absl::StrCat(field, ".comm_id is 0"));
  if (t.peer_rank() > static_cast<uint32_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".peer_rank ", t.peer_rank(), " is out of range"));
  }
  return static_cast<int>(t.peer_rank());
}

}  // namespace

absl::StatusOr<plane::NcclPlane*> KvBankService::Nccl() const {
  if (options_.nccl == nullptr) {
    return absl::FailedPreconditionError(options_.nccl_off.empty() ? "kvbankd serves no NCCL plane"
                                                                   : options_.nccl_off);
  }
  return options_.nccl.get();
}

absl::Status KvBankService::ConnectNccl(const Caller& caller, const std::string& peer,
                                        const v1::NcclConnectRequest& req,
                                        v1::NcclConnectResponse* resp) const {
  auto nccl = Nccl();
  if (!nccl.ok()) return nccl.status();
  if (req.nranks() > static_cast<uint32_t>(INT32_MAX) ||
      req.server_rank() > static_cast<uint32_t>(INT32_MAX)) {
    return absl::InvalidArgumentError("nranks or server_rank is out of range");
  }
  // kvbankd connects to the address the unique id names: only the caller's own.
  if (req.unique_id().size() != plane::kNcclUniqueIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("unique_id has ", req.unique_id().size(),
                                                   " bytes; an ncclUniqueId has ",
                                                   plane::kNcclUniqueIdBytes));
  }
  static const std::vector<std::string>* const local =
      new std::vector<std::string>(plane::LocalAddresses());
  if (absl::Status s = plane::CheckNcclBootstrap(req.unique_id(), peer, *local); !s.ok()) {
    return s;
  }
  auto id = (*nccl)->Connect(caller.tenant, req.unique_id(), static_cast<int>(req.nranks()),
                             static_cast<int>(req.server_rank()));
  if (!id.ok()) return id.status();
  resp->set_comm_id(*id);
  resp->set_device(static_cast<uint32_t>((*nccl)->options().device));
  resp->set_max_transfer_bytes((*nccl)->options().max_transfer_bytes);
  return absl::OkStatus();
}

absl::Status KvBankService::DisconnectNccl(const Caller& caller,
                                           const v1::NcclDisconnectRequest& req) const {
  auto nccl = Nccl();
  if (!nccl.ok()) return nccl.status();
  return (*nccl)->Disconnect(caller.tenant, req.comm_id());
}

absl::Status KvBankService::AppendFromNccl(const std::string& tenant, const v1::NcclTransfer& t,
                                           AppendTxn* txn,
                                           const std::function<void()>& ready) const {
  auto nccl = Nccl();
  if (!nccl.ok()) return nccl.status();
  auto peer = PeerOf(t, "header.nccl");
  if (!peer.ok()) return peer.status();
  const uint64_t bytes = txn->payload_bytes();
  if (bytes == 0) {
    return absl::InvalidArgumentError("an append over NCCL of 0 bytes: nothing to receive");
  }
  if (absl::Status s = (*nccl)->Check(tenant, t.comm_id(), *peer, bytes); !s.ok()) return s;
  ready();
  return (*nccl)->Receive(
      tenant, t.comm_id(), *peer, bytes,
      [txn](const uint8_t* device, uint64_t) { return txn->WriteFromDevice(device); });
}

// Server stream of one message: the FetchResponse header, once the payload went out over NCCL.
// Opens the reader, checks, sends "ready" and the payload on a device worker.
class KvBankService::NcclFetchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                                              public ReactorRefs<NcclFetchReactor> {
 public:
  NcclFetchReactor(KvBankService* service, grpc::CallbackServerContext* ctx, OpenFetch open,
                   std::string tenant, v1::NcclTransfer nccl)
      : service_(service), ctx_(ctx) {
    const std::string who = tenant;
    if (absl::Status s = service_->device_work_->Submit(
            who, WorkClass::kForeground,
            Held(
                [this, open = std::move(open), tenant = std::move(tenant), nccl = std::move(nccl)] {
                  absl::StatusOr<v1::FetchResponse> resp = Move(open, tenant, nccl);
                  if (resp.ok()) {
                    service_->plane_bytes_.AddSent(Plane::kNccl, resp->header().payload_bytes());
                  }
                  Answer(resp);
                }));
        !s.ok()) {
      Answer(s);  // the tenant's backlog is full: nothing was sent
      Unref();    // the move's reference: it will never run
    }
  }

  void OnDone() override { Unref(); }

 private:
  absl::StatusOr<v1::FetchResponse> Move(const OpenFetch& open, const std::string& tenant,
                                         const v1::NcclTransfer& t) {
    auto nccl = service_->Nccl();
    if (!nccl.ok()) return nccl.status();
    auto peer = PeerOf(t, "nccl");
    if (!peer.ok()) return peer.status();
    // The reader was opened for a device destination (FetchSpec::device_dest): nothing staged.
    auto reader = open();
    if (!reader.ok()) return reader.status();
    const uint64_t n = (*reader)->payload_bytes();
    if (t.max_bytes() != 0 && n > t.max_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat("nccl.max_bytes ", t.max_bytes(),
                                                     " is less than the payload's ", n,
                                                     " bytes; nothing was sent"));
    }
    if (n == 0) return absl::InvalidArgumentError("a fetch over NCCL of 0 bytes: nothing to send");
    if (absl::Status s = (*nccl)->Check(tenant, t.comm_id(), *peer, n); !s.ok()) return s;
    ctx_->AddInitialMetadata(kKvbankNccl, "ready");
    ctx_->AddInitialMetadata(kKvbankNcclBytes, std::to_string(n));
    StartSendInitialMetadata();
    FetchReader* r = reader->get();
    if (absl::Status s =
            (*nccl)->Send(tenant, t.comm_id(), *peer, n,
                          [r](uint8_t* device, uint64_t) { return r->ReadToDevice(device); });
        !s.ok()) {
      return s;
    }
    v1::FetchResponse resp;
    v1::FetchHeader* h = resp.mutable_header();
    h->set_token_begin(r->token_begin());
    h->set_num_tokens(r->num_tokens());
    h->set_layer_begin(r->layer_begin());
    h->set_layer_end(r->layer_end());
    h->set_dtype(ToProto(r->dtype()));
    h->set_payload_bytes(n);
    h->set_kv_head_begin(r->kv_head_begin());
    h->set_kv_head_end(r->kv_head_end());
    return resp;  // the reader goes here: a caller that saw the answer sees no block held by it
  }

  void Answer(const absl::StatusOr<v1::FetchResponse>& resp) {
    if (!resp.ok()) return Finish(ToGrpcStatus(resp.status()));
    bool own = false;
    grpc::Status s =
        grpc::SerializationTraits<v1::FetchResponse>::Serialize(*resp, &message_, &own);
    if (!s.ok()) return Finish(s);
    StartWriteAndFinish(&message_, grpc::WriteOptions(), grpc::Status::OK);
  }

  KvBankService* const service_;
  grpc::CallbackServerContext* const ctx_;
  grpc::ByteBuffer message_;
};

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvBankService::StartNcclFetch(
    Ctx* ctx, OpenFetch open, const std::string& tenant, const v1::NcclTransfer& nccl) {
  return new NcclFetchReactor(this, ctx, std::move(open), tenant, nccl);
}

}  // namespace kvbank::rpc
