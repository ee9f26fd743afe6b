// What the Client's files (client_*.cc) share inside the C++ SDK: the Client's state, the
// conversions between the SDK's values and the wire messages (client_convert.cc) and the raw
// fetch stream. Not a public header.
#ifndef KVBANK_CLIENT_CLIENT_INTERNAL_H_
#define KVBANK_CLIENT_CLIENT_INTERNAL_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/fetch_decoder.h"
#include "grpcpp/grpcpp.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"

namespace kvbank {
namespace internal {

class NcclLink;
class ShmControlChannel;

absl::Status FromGrpc(const grpc::Status& s);
Client::SequenceInfo FromProto(const v1::SequenceInfo& p);
// A model's info as the server sends it; INTERNAL when its spec does not parse.
absl::StatusOr<Client::ModelInfo> ModelFromProto(const v1::ModelInfo& p);
// The header of an append of `payload_bytes` (0: the server checks a region's length).
v1::AppendHeader MakeHeader(const std::string& model, uint64_t id, const Client::AppendArgs& a,
                            uint64_t payload_bytes);
v1::FetchRequest MakeFetchRequest(const std::string& model, uint64_t id,
                                  const Client::FetchArgs& args);
// FetchBlocks of `hashes` with args' layer, dtype and head fields (its token fields do not apply).
v1::FetchBlocksRequest MakeFetchBlocksRequest(const std::string& model,
                                              const std::vector<BlockHash>& hashes,
                                              const Client::FetchArgs& args);
// A RegionSlice of the SDK as the proto message.
void SetSlice(const RegionSlice& slice, v1::RegionSlice* out);
// A block hash as the bytes of a proto field.
std::string HashBytes(const BlockHash& h);
// The bytes of a proto field as a block hash (zero-padded or cut to its size).
BlockHash HashFromBytes(const std::string& b);
// Extra keys of the SDK appended to a repeated proto field.
void AddExtraKeys(const std::vector<ExtraKey>& keys,
                  google::protobuf::RepeatedPtrField<v1::ExtraKey>* out);
// A fetch's header as the SDK's result (no payload); *dtype_ok false when it names no dtype.
Client::FetchResult ResultFromHeader(const v1::FetchHeader& h, bool* dtype_ok);

// A server-streaming call to `method` whose responses are read raw (FetchDecoder decodes them).
template <typename Request>
absl::StatusOr<Client::FetchResult> RawFetch(grpc::Channel* channel, const char* method,
                                             grpc::ClientContext* ctx, const Request& req,
                                             FetchDecoder decoder = FetchDecoder()) {
  // The generated stub's own factory, for grpc::ByteBuffer responses.
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
          channel, grpc::internal::RpcMethod(method, grpc::internal::RpcMethod::SERVER_STREAMING),
          ctx, req));
  grpc::ByteBuffer message;
  while (reader->Read(&message)) {
    if (absl::Status s = decoder.Add(message); !s.ok()) {
      ctx->TryCancel();
      reader->Finish();
      return s;
    }
  }
  if (auto s = FromGrpc(reader->Finish()); !s.ok()) return s;
  return std::move(decoder).Finish();
}

}  // namespace internal

struct Client::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KvBank::Stub> stub;
  absl::Mutex mu;
  absl::flat_hash_map<std::string, ModelInfo> models ABSL_GUARDED_BY(mu);
  // The NCCL communicator (NcclConnect); the link runs one transfer at a time itself.
  absl::Mutex nccl_mu;
  std::shared_ptr<internal::NcclLink> nccl ABSL_GUARDED_BY(nccl_mu);

  // Every call: a deadline, and the bearer token when there is one.
  void Deadline(grpc::ClientContext* ctx, bool stream) const {
    ctx->set_deadline(absl::ToChronoTime(
        absl::Now() + (stream ? options.stream_deadline : options.call_deadline)));
    if (!options.bearer_token.empty()) {
      ctx->AddMetadata("authorization", "Bearer " + options.bearer_token);
    }
  }
  // One unary call with the deadline and token every call carries.
  template <typename Req, typename Resp>
  absl::Status Call(grpc::Status (v1::KvBank::Stub::*method)(grpc::ClientContext*, const Req&,
                                                             Resp*),
                    const Req& req, Resp* resp) {
    grpc::ClientContext ctx;
    Deadline(&ctx, false);
    return internal::FromGrpc((stub.get()->*method)(&ctx, req, resp));
  }

  void Remember(const ModelInfo& m) {
    absl::MutexLock lock(&mu);
    models[m.layout.name] = m;
  }
  void Forget(const std::string& name) {
    absl::MutexLock lock(&mu);
    models.erase(name);
  }
  // EnsureModel by layout or by preset: the model the server has (remembered), and whether the
  // call created it.
  absl::StatusOr<ModelInfo> Ensure(const v1::EnsureModelRequest& req) {
    v1::EnsureModelResponse resp;
    if (auto s = Call(&v1::KvBank::Stub::EnsureModel, req, &resp); !s.ok()) return s;
    auto info = internal::ModelFromProto(resp.model());
    if (!info.ok()) return info.status();
    info->created = resp.created();
    Remember(*info);
    return info;
  }

  // Streams `pieces` (concatenated, in order) as the data of append messages of at most
  // chunk_bytes each; the first message carries the header.
  absl::StatusOr<SequenceInfo> StreamAppend(const v1::AppendHeader& header,
                                            absl::Span<const absl::Span<const uint8_t>> pieces);

  // The data planes' shared steps (client_planes.cc).
  // How long a control-frame transfer of `bytes` spins for its reply (ClientOptions::
  // shm_control_spin, kShmControlLoneSpinBytes); `others` is how many others are in flight.
  absl::Duration SpinFor(uint64_t bytes, uint64_t others) const;
  // A region transfer asked for on `channel` (AskOverSocket, counted in control_in_flight).
  template <typename Answer, typename Body>
  std::optional<absl::StatusOr<Answer>> AskControl(internal::ShmControlChannel& channel, Body body,
                                                   uint64_t bytes);
  // An append whose payload is `source`, a slice of a shared-memory region (device false) or of
  // a CUDA IPC device region: no payload on gRPC.
  absl::StatusOr<SequenceInfo> AppendFromSlice(v1::AppendHeader header, const RegionSlice& source,
                                               bool device);
  // A Fetch or FetchBlocks (`Request`) whose payload the server writes into `dest` (a slice as
  // above): only the header comes back, its payload_bytes bounded by dest's length.
  template <typename Request>
  absl::StatusOr<FetchResult> FetchToSlice(Request req, const RegionSlice& dest, bool device);
  // The control channel of the shm socket (client/shm_control_channel.h), opened by the first
  // region transfer; null when options.shm_control is off, the server takes no frames, or it
  // could not be opened (then region transfers use gRPC for good).
  std::shared_ptr<internal::ShmControlChannel> Control();
  absl::Mutex control_mu;
  std::shared_ptr<internal::ShmControlChannel> control ABSL_GUARDED_BY(control_mu);
  bool control_off ABSL_GUARDED_BY(control_mu) = false;
  std::atomic<uint64_t> control_requests{0};   // transfers asked for on the channel
  std::atomic<uint64_t> control_in_flight{0};  // transfers waiting for their reply on it
  Client* owner = nullptr;  // the Client this is the Impl of (for Control's own calls)

  // Unregister(Device)Region: one request naming the region.
  template <typename Req, typename Resp>
  absl::Status Unregister(grpc::Status (v1::KvBank::Stub::*method)(grpc::ClientContext*, const Req&,
                                                                   Resp*),
                          uint64_t region_id) {
    Req req;
    req.set_region_id(region_id);
    Resp resp;
    return Call(method, req, &resp);
  }
  // The NCCL communicator; FAILED_PRECONDITION without NcclConnect, UNIMPLEMENTED in an SDK
  // built without NCCL.
  absl::StatusOr<std::shared_ptr<internal::NcclLink>> Nccl();
};

}  // namespace kvbank

#endif  // KVBANK_CLIENT_CLIENT_INTERNAL_H_
