// The kvbank.v1.KvBank gRPC service on the callback API: a thin adapter over the core.
#ifndef KVBANK_SERVER_RPC_SERVICE_H_
#define KVBANK_SERVER_RPC_SERVICE_H_

#include <atomic>
#include <memory>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "server/core/model_registry.h"
#include "server/rpc/auth.h"
#include "server/rpc/convert.h"
#include "server/rpc/work_queue.h"

namespace kvbank::rpc {

struct ServiceOptions {
  ModelDefaults defaults;
  // Payload bytes per streamed message. Messages stay far below kMaxMessageBytes.
  uint64_t chunk_bytes = uint64_t{1} << 20;
  // Attend runs on this many worker threads, each kernel call on attend_kernel_threads (0: the
  // cores divided among the workers).
  uint32_t attend_workers = 2;
  uint32_t attend_kernel_threads = 0;
};

// Largest message either side accepts: a few chunks' worth; larger ones are refused by gRPC.
inline constexpr int kMaxMessageBytes = 4 << 20;

// Thread-safe; reactions never block on anything but short metadata locks. Payload copies
// (at most one chunk each) run inside the reactions.
// Append, Fetch and FetchBlocks are raw methods: their reactors decode AppendRequest and encode
// FetchResponse themselves, so payload bytes move without protobuf's copies (see service.cc).
class KvBankService final
    : public v1::KvBank::WithRawCallbackMethod_Append<v1::KvBank::WithRawCallbackMethod_Fetch<
          v1::KvBank::WithRawCallbackMethod_FetchBlocks<v1::KvBank::CallbackService>>> {
 public:
  KvBankService(std::shared_ptr<ModelRegistry> registry, ServiceOptions options,
                Authenticator auth = Authenticator::Disabled());
  ~KvBankService() override;

  grpc::ServerUnaryReactor* EnsureModel(grpc::CallbackServerContext* ctx,
                                        const v1::EnsureModelRequest* req,
                                        v1::EnsureModelResponse* resp) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* ctx,
                                       const v1::ListModelsRequest* req,
                                       v1::ListModelsResponse* resp) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx,
                                     const v1::GetStatsRequest* req,
                                     v1::GetStatsResponse* resp) override;
  grpc::ServerUnaryReactor* CreateSequence(grpc::CallbackServerContext* ctx,
                                           const v1::CreateSequenceRequest* req,
                                           v1::SequenceInfo* resp) override;
  // Raw: AppendRequest messages in, an AppendResponse out.
  grpc::ServerReadReactor<grpc::ByteBuffer>* Append(grpc::CallbackServerContext* ctx,
                                                    grpc::ByteBuffer* resp) override;
  // Raw: the request is a serialized FetchRequest; the responses are FetchResponse.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Fetch(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* raw) override;
  grpc::ServerUnaryReactor* Fork(grpc::CallbackServerContext* ctx, const v1::ForkRequest* req,
                                 v1::SequenceInfo* resp) override;
  grpc::ServerUnaryReactor* Truncate(grpc::CallbackServerContext* ctx,
                                     const v1::TruncateRequest* req,
                                     v1::SequenceInfo* resp) override;
  grpc::ServerUnaryReactor* Free(grpc::CallbackServerContext* ctx, const v1::FreeRequest* req,
                                 v1::FreeResponse* resp) override;
  grpc::ServerUnaryReactor* RenewLease(grpc::CallbackServerContext* ctx,
                                       const v1::RenewLeaseRequest* req,
                                       v1::SequenceInfo* resp) override;
  grpc::ServerUnaryReactor* GetSequence(grpc::CallbackServerContext* ctx,
                                        const v1::GetSequenceRequest* req,
                                        v1::SequenceInfo* resp) override;
  grpc::ServerUnaryReactor* Match(grpc::CallbackServerContext* ctx, const v1::MatchRequest* req,
                                  v1::MatchResponse* resp) override;
  // Raw: FetchBlocksRequest in, FetchResponse out.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* FetchBlocks(grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* raw) override;
  grpc::ServerUnaryReactor* Pin(grpc::CallbackServerContext* ctx, const v1::PinRequest* req,
                                v1::PinResponse* resp) override;
  grpc::ServerUnaryReactor* GetPrefixRoot(grpc::CallbackServerContext* ctx,
                                          const v1::GetPrefixRootRequest* req,
                                          v1::GetPrefixRootResponse* resp) override;
  grpc::ServerWriteReactor<v1::KvEventBatch>* Watch(grpc::CallbackServerContext* ctx,
                                                    const v1::WatchRequest* req) override;
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* ctx, const v1::AttendRequest* req,
                                   v1::AttendResponse* resp) override;

  // Drain mode, the first step of a graceful stop (see drain.h): every call from now on fails
  // UNAVAILABLE naming the drain, and every Watch stream ends with that status. Calls already
  // admitted run to completion. There is no way back.
  void BeginDrain();

 private:
  // Every call starts here: refused while draining, else authenticated.
  absl::StatusOr<Caller> Admit(const grpc::ServerContextBase& ctx) const;

  // A unary call on one sequence: authenticates, checks the id, finds the model, then finishes
  // with op(model, tenant)'s status.
  template <typename Op>
  grpc::ServerUnaryReactor* OnSequence(grpc::CallbackServerContext* ctx, const std::string& model,
                                       uint64_t id, Op op);

  class AppendReactor;
  class FetchReactor;
  class WatchReactor;
  void AddWatch(WatchReactor* w);
  void RemoveWatch(WatchReactor* w);

  const std::shared_ptr<ModelRegistry> registry_;
  const ServiceOptions options_;
  const Authenticator auth_;
  std::atomic<bool> draining_{false};  // set under watches_mu_
  absl::Mutex watches_mu_;             // before any WatchReactor's own lock
  absl::flat_hash_set<WatchReactor*> watches_ ABSL_GUARDED_BY(watches_mu_);
  std::unique_ptr<WorkQueue> attend_work_;  // last: joined (finishing its calls) first
};

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_SERVICE_H_
