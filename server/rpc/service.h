// The kvbank.v1.KvBank gRPC service on the callback API: a thin adapter over the core.
#ifndef KVBANK_SERVER_RPC_SERVICE_H_
#define KVBANK_SERVER_RPC_SERVICE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "server/core/model_registry.h"
#include "server/core/tenant_ledger.h"
#include "server/plane/cuda_ipc.h"
#include "server/plane/nccl_plane.h"
#include "server/plane/shm_regions.h"
#include "server/rpc/auth.h"
#include "server/rpc/convert.h"
#include "server/rpc/fair_work.h"
#include "server/rpc/fetch_wait.h"
#include "server/rpc/plane_bytes.h"
#include "server/rpc/stream_watchdog.h"
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
  // Transfers on pool memory that waits on a device (cuda:N, host-staged), region copies, disk
  // reads, and forks there, run on this many worker threads (FairWork: fair across tenants,
  // foreground before background), so that no gRPC reaction waits on a device copy.
  uint32_t device_workers = 4;
  // A fetch into, or a plain append from, a shared-memory region of at least 1 MiB is copied by
  // the worker that runs it and, when no other such copy is under way, up to this many more
  // (server/rpc/split_copy.h; helpers the other workers do not pick up in time are not waited
  // for). 0: one thread a copy.
  uint32_t region_copy_helpers = 1;
  // A control frame's copy on host memory of at most this many bytes is made on the
  // shared-memory listener when nothing else is under way (KvBankService::ListenerCopyBytes).
  uint64_t lone_listener_copy_bytes = uint64_t{4} << 20;
  // What each tenant holds of the server-wide caps (queued work, waits, streams, regions, ...).
  // Null: the service makes one with DefaultLedger's caps and a single tenant's shares.
  std::shared_ptr<TenantLedger> ledger;
  // A stream that waits this long on its client (an Append with no next message, a Fetch or
  // Watch whose client does not read) is cancelled and releases what it holds. Zero: never.
  absl::Duration stream_idle_timeout = absl::Seconds(60);
  // The same-host shared-memory plane (--shm-socket); null: off (RegisterRegion and region
  // slices answer FAILED_PRECONDITION).
  std::shared_ptr<plane::ShmRegions> shm_regions;
  // The same-host CUDA IPC plane (a cuda:N pool in a CUDA build); null: off
  // (RegisterDeviceRegion and device slices answer FAILED_PRECONDITION).
  std::shared_ptr<plane::CudaIpcRegions> cuda_ipc;
  // The NCCL plane (a cuda:N pool, built with NCCL); null: off, and nccl_off says why (the
  // FAILED_PRECONDITION that NcclConnect and NCCL transfers answer).
  std::shared_ptr<plane::NcclPlane> nccl;
  std::string nccl_off;
  // GetServerInfoResponse.replica (--replica-name).
  std::string replica_name;
  // GetServerInfoResponse.host_id: this machine's boot id (clients compare it with theirs).
  std::string host_id;
};

// Server-wide caps of the work and the streams every tenant shares (kvbankd's flags set them; each
// tenant gets its share: TenantLedger).
inline constexpr uint64_t kDefaultMaxQueuedWork = 4096;       // foreground tasks queued
inline constexpr uint64_t kDefaultMaxQueuedBackground = 256;  // prefetches queued
inline constexpr uint64_t kDefaultMaxWatchStreams = 512;      // Watch streams open
inline constexpr uint64_t kDefaultMaxWaits = 65536;           // fetches waiting (wait_ms)
// A ledger with those caps (the planes add theirs).
std::shared_ptr<TenantLedger> DefaultLedger();

// Largest message either side accepts: a few chunks' worth; larger ones are refused by gRPC.
inline constexpr int kMaxMessageBytes = 4 << 20;
// The longest a fetch may wait for its tokens (FetchRequest.wait_ms).
inline constexpr uint32_t kMaxFetchWaitMs = 600000;
// Most queries one Match call may carry.
inline constexpr int kMaxMatchQueries = 4096;

// Every method is registered raw: the service parses each request itself, so a message that is
// not the method's request type gets INVALID_ARGUMENT naming the type (gRPC's own parse answers
// UNIMPLEMENTED with no message), and Append, Fetch and FetchBlocks move payload bytes without
// protobuf's copies (AppendRequest decoded and FetchResponse encoded from and into gRPC's slices).
namespace internal {
using RawKvBankServiceCore = v1::KvBank::WithRawCallbackMethod_EnsureModel<
    v1::KvBank::WithRawCallbackMethod_ListModels<v1::KvBank::WithRawCallbackMethod_GetStats<
        v1::KvBank::WithRawCallbackMethod_CreateSequence<v1::KvBank::WithRawCallbackMethod_Append<
            v1::KvBank::WithRawCallbackMethod_Fetch<v1::KvBank::WithRawCallbackMethod_Fork<
                v1::KvBank::WithRawCallbackMethod_Truncate<v1::KvBank::WithRawCallbackMethod_Free<
                    v1::KvBank::WithRawCallbackMethod_RenewLease<
                        v1::KvBank::WithRawCallbackMethod_GetSequence<
                            v1::KvBank::WithRawCallbackMethod_Match<
                                v1::KvBank::WithRawCallbackMethod_FetchBlocks<
                                    v1::KvBank::WithRawCallbackMethod_Pin<
                                        v1::KvBank::WithRawCallbackMethod_GetPrefixRoot<
                                            v1::KvBank::WithRawCallbackMethod_Watch<
                                                v1::KvBank::WithRawCallbackMethod_Attend<
                                                    v1::KvBank::WithRawCallbackMethod_DropModel<
                                                        v1::KvBank::
                                                            CallbackService>>>>>>>>>>>>>>>>>>;
using RawKvBankServicePlanes = v1::KvBank::WithRawCallbackMethod_GetServerInfo<
    v1::KvBank::WithRawCallbackMethod_RegisterRegion<
        v1::KvBank::WithRawCallbackMethod_UnregisterRegion<
            v1::KvBank::WithRawCallbackMethod_RegisterDeviceRegion<
                v1::KvBank::WithRawCallbackMethod_UnregisterDeviceRegion<RawKvBankServiceCore>>>>>;
using RawKvBankService = v1::KvBank::WithRawCallbackMethod_NcclConnect<
    v1::KvBank::WithRawCallbackMethod_NcclDisconnect<RawKvBankServicePlanes>>;
}  // namespace internal

// Thread-safe; reactions never block on anything but short metadata locks. On host memory a
// payload copy (at most one chunk) runs inside the reaction; on memory that waits on a device
// (cuda:N, host-staged) every transfer step and fork runs on the device workers instead
// (transfers.cc); attention runs on its own worker pool.
class KvBankService final : public internal::RawKvBankService {
 public:
  using Raw = grpc::ByteBuffer;
  using Ctx = grpc::CallbackServerContext;
  using Unary = grpc::ServerUnaryReactor;

  KvBankService(std::shared_ptr<ModelRegistry> registry, ServiceOptions options,
                Authenticator auth = Authenticator::Disabled());
  ~KvBankService() override;

  // Registers a new model (admin only) or returns the existing one with the same layout.
  Unary* EnsureModel(Ctx* ctx, const Raw* req, Raw* resp) override;
  // Unregisters a model (admin only).
  Unary* DropModel(Ctx* ctx, const Raw* req, Raw* resp) override;
  Unary* ListModels(Ctx* ctx, const Raw* req, Raw* resp) override;
  Unary* GetStats(Ctx* ctx, const Raw* req, Raw* resp) override;
  Unary* GetServerInfo(Ctx* ctx, const Raw* req, Raw* resp) override;
  Unary* CreateSequence(Ctx* ctx, const Raw* req, Raw* resp) override;
  // AppendRequest messages in, an AppendResponse out.
  grpc::ServerReadReactor<Raw>* Append(Ctx* ctx, Raw* resp) override;
  // A FetchRequest in, FetchResponse messages out.
  grpc::ServerWriteReactor<Raw>* Fetch(Ctx* ctx, const Raw* req) override;
  Unary* Fork(Ctx* ctx, const Raw* req, Raw* resp) override;
  Unary* Truncate(Ctx* ctx, const Raw* req, Raw* resp) override;
  Unary* Free(Ctx* ctx, const Raw* req, Raw* resp) override;
  Unary* RenewLease(Ctx* ctx, const Raw* req, Raw* resp) override;
  Unary* GetSequence(Ctx* ctx, const Raw* req, Raw* resp) override;
  Unary* Match(Ctx* ctx, const Raw* req, Raw* resp) override;
  // A FetchBlocksRequest in, FetchResponse messages out.
  grpc::ServerWriteReactor<Raw>* FetchBlocks(Ctx* ctx, const Raw* req) override;
  Unary* Pin(Ctx* ctx, const Raw* req, Raw* resp) override;
  Unary* GetPrefixRoot(Ctx* ctx, const Raw* req, Raw* resp) override;
  // A WatchRequest in, KvEventBatch messages out.
  grpc::ServerWriteReactor<Raw>* Watch(Ctx* ctx, const Raw* req) override;
  Unary* Attend(Ctx* ctx, const Raw* req, Raw* resp) override;
  // The shared-memory plane (regions.cc).
  Unary* RegisterRegion(Ctx* ctx, const Raw* req, Raw* resp) override;
  Unary* UnregisterRegion(Ctx* ctx, const Raw* req, Raw* resp) override;
  // The CUDA IPC plane (regions.cc).
  Unary* RegisterDeviceRegion(Ctx* ctx, const Raw* req, Raw* resp) override;
  Unary* UnregisterDeviceRegion(Ctx* ctx, const Raw* req, Raw* resp) override;
  // The NCCL plane (nccl.cc).
  Unary* NcclConnect(Ctx* ctx, const Raw* req, Raw* resp) override;
  Unary* NcclDisconnect(Ctx* ctx, const Raw* req, Raw* resp) override;

  // Drain mode, the first step of a graceful stop (see drain.h): every call from now on fails
  // UNAVAILABLE naming the drain, and every Watch stream ends with that status. Calls already
  // admitted run to completion. There is no way back.
  void BeginDrain();
  // Streams cancelled because their client stopped sending or reading (--stream-idle-timeout-ms).
  uint64_t streams_timed_out() const { return watchdog_.timed_out(); }
  // Payload bytes moved by each data plane (appends committed, fetches completed).
  const PlaneBytes& plane_bytes() const { return plane_bytes_; }
  // The per-tenant ledger of the server-wide caps, and the device workers' queues.
  const TenantLedger& ledger() const { return *ledger_; }
  FairWorkStats work_stats() const { return device_work_->Stats(); }

 private:
  // Every call starts here: refused while draining, else authenticated.
  absl::StatusOr<Caller> Admit(const grpc::ServerContextBase& ctx) const;

  // A unary call: admits the caller, parses the request (INVALID_ARGUMENT naming its type when it
  // is not one), runs handler(caller, request, &response) in the reaction and answers with its
  // status (and the response when OK).
  template <typename Request, typename Response, typename Handler>
  Unary* Serve(Ctx* ctx, const Raw* raw, Raw* out, Handler handler);
  // A unary call whose work may block (disk reads, device copies): admits and parses as Serve,
  // then prepare(caller, request) answers the work (or an error, the answer then), which runs on
  // a device worker when its on_worker says so, else in the reaction.
  template <typename Response>
  struct Work {
    bool on_worker = false;
    std::function<absl::Status(Response*)> run;
  };
  template <typename Request, typename Response, typename Prepare>
  Unary* ServeWork(Ctx* ctx, const Raw* raw, Raw* out, Prepare prepare);
  // Serve for a call on one sequence: also checks the id and finds the model, then runs
  // op(model, tenant, request, &response).
  template <typename Request, typename Response, typename Op>
  Unary* ServeSequence(Ctx* ctx, const Raw* raw, Raw* out, Op op);

  class AppendReactor;
  class FetchReactor;
  using OpenFetch = std::function<absl::StatusOr<std::unique_ptr<FetchReader>>()>;
  // A fetch that first waits for its tokens to be committed (FetchRequest.wait_ms): fetch_wait.h.
  struct FetchWaitSpec {
    std::shared_ptr<SequenceStore> store;
    FetchSpec spec;
    absl::Duration timeout;
    LedgerClaim claim;  // the wait's place in its tenant's share of waits
  };
  // The shared-memory plane, or FAILED_PRECONDITION naming --shm-socket when it is off.
  absl::StatusOr<plane::ShmRegions*> ShmPlane() const;
  // The CUDA IPC plane, or FAILED_PRECONDITION saying why it is off.
  absl::StatusOr<plane::CudaIpcRegions*> CudaIpcPlane() const;
  // The CUDA IPC plane's device region slice `slice` (named `field` in errors) for a transfer on
  // `model`: INVALID_ARGUMENT for region_id 0, FAILED_PRECONDITION when the plane is off or the
  // model's pool is not on its device, NOT_FOUND / INVALID_ARGUMENT as CudaIpcRegions::Resolve.
  absl::StatusOr<plane::DeviceBytes> ResolveDeviceSlice(const std::string& tenant,
                                                        const SequenceStore& model,
                                                        const v1::RegionSlice& slice,
                                                        absl::string_view field) const;

  // ---- Region transfers: one implementation for both ways of asking, a gRPC call
  // (transfers.cc, regions.cc) and a control frame on the shared-memory plane's socket
  // (control.cc, proto/shm_control.h). Every check, error, tenancy rule and limit is here.

  // A payload of at most this many bytes on host memory is copied on the thread that asked (a
  // reaction, the socket's listener): a hand-off to a worker would cost more than the copy.
  static constexpr uint64_t kInlineRegionCopyBytes = uint64_t{256} << 10;
  static bool CopiesInline(uint64_t payload_bytes);
  // The most bytes `call`'s copy may take on the socket's listener: a lone transfer (the only
  // control call being served, alone in the listener's round, no large region copy under way)
  // up to ServiceOptions::lone_listener_copy_bytes, so that it pays no hand-off to a worker and
  // its wake-up, while the listener is kept from other frames for one such copy at most (4 MiB:
  // about 200 microseconds at 20 GB/s); otherwise kInlineRegionCopyBytes.
  uint64_t ListenerCopyBytes(const plane::ShmControlCall& call);

  // A Fetch or FetchBlocks request, checked, ready to open; at most one of dest, device_dest,
  // nccl is set (none: the payload streams over gRPC).
  struct PreparedFetch {
    OpenFetch open;
    // Opening and reading wait on a device or read a disk tier: only on a worker.
    bool on_device = false;
    std::optional<v1::RegionSlice> dest;
    std::optional<absl::StatusOr<plane::DeviceBytes>> device_dest;
    std::optional<v1::NcclTransfer> nccl;
    std::optional<FetchWaitSpec> wait;
  };
  absl::StatusOr<PreparedFetch> PrepareFetch(const std::string& tenant,
                                             const v1::FetchRequest& req) const;
  absl::StatusOr<PreparedFetch> PrepareFetchBlocks(const std::string& tenant,
                                                   const v1::FetchBlocksRequest& req) const;

  // Moves an opened reader's whole payload into the caller's region (it holds the region open).
  // `ended` turns true when the asker is gone: a sink that copies in pieces stops between them.
  using RegionSink =
      std::function<absl::Status(FetchReader& reader, const std::atomic<bool>& ended)>;
  // The sink of a `dest` slice (NOT_FOUND / INVALID_ARGUMENT / FAILED_PRECONDITION as
  // ShmRegions::Resolve), and of a resolved device slice.
  absl::StatusOr<RegionSink> RegionSinkFor(const std::string& tenant,
                                           const v1::RegionSlice& dest) const;
  static absl::StatusOr<RegionSink> DeviceSinkFor(absl::StatusOr<plane::DeviceBytes> dest);
  // The n bytes of a region transfer, by copy(offset, length) (regions.cc): split over this
  // worker and region_copy_helpers when `concurrent` (copy takes disjoint ranges from several
  // threads), n is large and no other large region copy is under way; else in order, in
  // pieces, `ended` checked between them.
  absl::Status CopyRegionBytes(const std::string& tenant, uint64_t n, bool concurrent,
                               const std::function<absl::Status(uint64_t, uint64_t)>& copy,
                               const std::atomic<bool>& ended) const;

  class RegionFetch;  // regions.cc
  using FetchDone = std::function<void(const absl::StatusOr<v1::FetchResponse>&)>;
  // Starts a prepared fetch that names dest or device_dest: waits (wait_ms), opens, copies;
  // `done` gets the answer once, on any thread (possibly this one, before this returns). The
  // result is the asker's hold on it (null when done has run already with an error): pass it to
  // EndRegionFetch when the asker goes away before the answer. A host-memory payload of at most
  // `inline_bytes` that needs no wait is copied on this thread.
  std::shared_ptr<RegionFetch> StartRegionFetch(const std::string& tenant, PreparedFetch fetch,
                                                FetchDone done,
                                                uint64_t inline_bytes = kInlineRegionCopyBytes);
  static void EndRegionFetch(RegionFetch& f);
  // A prepared fetch (or the error preparing it) as a gRPC call: into a region, over NCCL, or
  // streamed (transfers.cc).
  grpc::ServerWriteReactor<Raw>* StartFetchCall(Ctx* ctx, const std::string& tenant,
                                                absl::StatusOr<PreparedFetch> fetch);
  class RegionFetchReactor;  // regions.cc: the gRPC call of StartRegionFetch
  grpc::ServerWriteReactor<Raw>* StartRegionFetchCall(Ctx* ctx, const std::string& tenant,
                                                      PreparedFetch fetch);

  // An append's transaction from its header: every check of the header, no payload written yet.
  absl::StatusOr<std::unique_ptr<AppendTxn>> BeginAppendTxn(const std::string& tenant,
                                                            const v1::AppendHeader& h) const;
  // Writes an append's whole payload from the caller's region (header.source) into `txn`.
  // INVALID_ARGUMENT when the slice is not exactly txn's payload or lies outside the region;
  // NOT_FOUND for a region that is not the tenant's (regions.cc).
  absl::Status AppendFromRegion(const std::string& tenant, const SequenceStore& model,
                                const v1::RegionSlice& source, AppendTxn* txn) const;
  // Writes an append's whole payload device to device from the caller's device region
  // (header.device_source) into `txn` (regions.cc).
  absl::Status AppendFromDevice(const std::string& tenant, const SequenceStore& model,
                                const v1::RegionSlice& source, AppendTxn* txn) const;
  // Writes the whole payload from the region the header names (source or device_source).
  absl::Status AppendFromRegions(const std::string& tenant, const v1::AppendHeader& h,
                                 AppendTxn* txn) const;
  // Commits `txn` (an append of `model`) and answers it; its bytes count on `plane`.
  absl::StatusOr<v1::AppendResponse> CommitAppend(std::unique_ptr<AppendTxn> txn,
                                                  const std::string& model, Plane plane) const;

  // The shared-memory plane's control frames (control.cc): each request runs the operation its
  // gRPC call runs, as the tenant that claimed the connection's region.
  void ServeControl(std::shared_ptr<plane::ShmControlCall> call);
  void ServeControlAppend(std::shared_ptr<plane::ShmControlCall> call);
  void ServeControlFetch(std::shared_ptr<plane::ShmControlCall> call,
                         absl::StatusOr<PreparedFetch> fetch);
  // A control call's deadline timer: armed only for work that is still pending where it was
  // asked for (queued, waiting), dropped with the answer.
  struct ControlDeadline {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;  // answered
    uint64_t timer ABSL_GUARDED_BY(mu) = 0;
  };
  void ArmDeadline(const std::shared_ptr<plane::ShmControlCall>& call,
                   const std::shared_ptr<ControlDeadline>& d);
  // The call is answered: its timer goes; one call fewer in flight. (d may be null.)
  void ControlCallDone(const std::shared_ptr<ControlDeadline>& d);
  // Control calls being served; the destructor waits until none is.
  absl::Mutex control_mu_;
  uint64_t control_calls_ ABSL_GUARDED_BY(control_mu_) = 0;

  // The NCCL plane, or FAILED_PRECONDITION saying why it is off (nccl.cc).
  absl::StatusOr<plane::NcclPlane*> Nccl() const;
  // NcclConnect's and NcclDisconnect's handlers (nccl.cc).
  // `peer`: the call's gRPC peer address (the unique id's bootstrap address must be its host).
  absl::Status ConnectNccl(const Caller& caller, const std::string& peer,
                           const v1::NcclConnectRequest& req, v1::NcclConnectResponse* resp) const;
  absl::Status DisconnectNccl(const Caller& caller, const v1::NcclDisconnectRequest& req) const;
  // Receives an append's whole payload over NCCL (header.nccl) into `txn`: checks the transfer,
  // calls `ready` (which tells the client to issue its ncclSend), then blocks until the receive
  // and the device write are done. Runs on a device worker (nccl.cc).
  absl::Status AppendFromNccl(const std::string& tenant, const v1::NcclTransfer& nccl,
                              AppendTxn* txn, const std::function<void()>& ready) const;
  // A Fetch with `nccl`: `open` makes the reader on a worker, whose payload then goes to the
  // client's rank with ncclSend; the stream answers the header only (nccl.cc).
  class NcclFetchReactor;
  grpc::ServerWriteReactor<Raw>* StartNcclFetch(Ctx* ctx, OpenFetch open, const std::string& tenant,
                                                const v1::NcclTransfer& nccl);
  class WatchReactor;
  template <typename Request, typename Response>
  class UnaryCall;
  void AddWatch(WatchReactor* w);
  void RemoveWatch(WatchReactor* w);
  // Ends every Watch stream on `model` with `why`.
  void EndWatches(const SequenceStore* model, const absl::Status& why);

  const std::shared_ptr<ModelRegistry> registry_;
  const ServiceOptions options_;
  const Authenticator auth_;
  const std::shared_ptr<TenantLedger> ledger_;
  std::atomic<bool> draining_{false};  // set under watches_mu_
  // Region copies of kSplitRegionCopyBytes or more under way (regions.cc): only one that
  // starts alone takes region_copy_helpers.
  mutable std::atomic<uint32_t> region_copies_{0};
  absl::Mutex watches_mu_;  // before any WatchReactor's own lock
  absl::flat_hash_set<WatchReactor*> watches_ ABSL_GUARDED_BY(watches_mu_);
  StreamWatchdog watchdog_;
  mutable Timers timers_;  // fetches' wait_ms (thread-safe)
  // Payload bytes by data plane (thread-safe counters; plane_bytes.h).
  mutable PlaneBytes plane_bytes_;
  // Last: joined (finishing their calls) first.
  std::unique_ptr<FairWork> device_work_;
  std::unique_ptr<WorkQueue> attend_work_;
};

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_SERVICE_H_
