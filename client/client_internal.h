// What client.cc and client_planes.cc share inside the C++ SDK: the Client's state and the
// conversions between the SDK's values and the wire messages. Not a public header.
#ifndef KVBANK_CLIENT_CLIENT_INTERNAL_H_
#define KVBANK_CLIENT_CLIENT_INTERNAL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"

namespace kvbank {
namespace internal {

class NcclLink;

absl::Status FromGrpc(const grpc::Status& s);
Client::SequenceInfo FromProto(const v1::SequenceInfo& p);
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
// A fetch's header as the SDK's result (no payload); *dtype_ok false when it names no dtype.
Client::FetchResult ResultFromHeader(const v1::FetchHeader& h, bool* dtype_ok);

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

  // Streams `pieces` (concatenated, in order) as the data of append messages of at most
  // chunk_bytes each; the first message carries the header.
  absl::StatusOr<SequenceInfo> StreamAppend(const v1::AppendHeader& header,
                                            absl::Span<const absl::Span<const uint8_t>> pieces);
};

}  // namespace kvbank

#endif  // KVBANK_CLIENT_CLIENT_INTERNAL_H_
