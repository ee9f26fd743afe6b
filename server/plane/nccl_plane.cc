// The NCCL plane (nccl_plane.h) over CUDA and NCCL.
//
// Each communicator has its own thread, which runs its jobs in the order they were queued: first
// the join (ncclCommInitRankConfig), then each transfer. Communicators are non-blocking
// (ncclConfig_t::blocking = 0), so every NCCL call returns at once and the thread polls
// (ncclCommGetAsyncError, cudaStreamQuery) against the job's deadline; past it, or when the
// communicator is disconnected or the plane goes, the thread aborts the communicator
// (ncclCommAbort), which is the one way NCCL has to end an operation whose peer never comes.
//
// Device buffers come from the stream-ordered allocator (cudaMallocAsync / cudaFreeAsync on the
// communicator's stream): no device-wide sync per transfer, and the memory is given back to the
// pool's budget between transfers.
//
// Lock order: NcclPlaneImpl::mu_, then Comm::mu_. A communicator's NCCL handle and stream belong
// to its thread alone.
#include "server/plane/nccl_plane.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace kvbank::plane {
namespace {

static_assert(kNcclUniqueIdBytes == NCCL_UNIQUE_ID_BYTES, "ncclUniqueId's size");

std::string CudaText(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}
std::string NcclText(ncclResult_t r) { return ncclGetErrorString(r); }

// One communicator: its thread, its job queue and what its thread alone touches.
class Comm {
 public:
  // `failed`: called (on the communicator's thread, no lock held) when it did not form.
  Comm(uint64_t id, std::string tenant, int nranks, int rank, int device, LedgerClaim claim,
       std::function<void()> failed)
      : id_(id),
        tenant_(std::move(tenant)),
        nranks_(nranks),
        rank_(rank),
        device_(device),
        claim_(std::move(claim)),
        on_failed_(std::move(failed)) {}
  ~Comm() { Stop("destroyed"); }

  uint64_t id() const { return id_; }
  const std::string& tenant() const { return tenant_; }
  // Gives its place in the tenant's share back. Called by the plane, under its lock, as it drops
  // the communicator; idempotent.
  void ReleaseShare() { claim_.Release(); }
  int nranks() const { return nranks_; }
  int rank() const { return rank_; }

  // Starts the thread, whose first job joins the communicator.
  void Start(ncclUniqueId uid, absl::Duration init_timeout) {
    {
      absl::MutexLock lock(&mu_);
      last_used_ = absl::Now();
    }
    thread_ = std::thread([this, uid, init_timeout] { Loop(uid, init_timeout); });
  }

  // Ends the thread: the job running now sees `why` and aborts; queued jobs fail with it.
  // Joins. Idempotent.
  void Stop(const std::string& why) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_.empty()) stop_ = why;
    }
    if (thread_.joinable()) thread_.join();
  }

  // Runs `job` on the communicator's thread after the ones queued before it; blocks until it
  // has run (or the communicator stopped). The job gets the communicator's state.
  using Job = std::function<absl::Status()>;
  absl::Status Submit(const Job& job) {
    absl::Status result;
    absl::Notification done;
    {
      absl::MutexLock lock(&mu_);
      if (!stop_.empty()) return Stopped();
      if (!failed_.ok()) return failed_;
      jobs_.push_back([&] {
        result = job();
        done.Notify();
      });
      ++pending_;
    }
    done.WaitForNotification();
    return result;
  }

  // FAILED_PRECONDITION when the communicator failed or stopped.
  absl::Status Usable() const {
    absl::MutexLock lock(&mu_);
    if (!stop_.empty()) return Stopped();
    return failed_;
  }
  // Idle: no job queued or running, and none for `idle` since the last one.
  bool IdleFor(absl::Duration idle, absl::Time now) const {
    absl::MutexLock lock(&mu_);
    return pending_ == 0 && now - last_used_ >= idle;
  }

  // ---- called on the communicator's thread only, from a job ----

  // One NCCL group: `ops` issues the operations (on comm_, stream_); then waits until the group
  // and the stream are done, aborting the communicator past `deadline` or on Stop.
  absl::Status Group(const std::function<ncclResult_t()>& ops, absl::Time deadline,
                     const char* what) {
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess) {
      r = ops();
      const ncclResult_t end = ncclGroupEnd();
      if (r == ncclSuccess) r = end;
    }
    if (r != ncclSuccess && r != ncclInProgress) {
      return Abort(absl::InternalError(absl::StrCat(what, ": ", NcclText(r))));
    }
    return Wait(deadline, what, /*stream=*/true);
  }
  // The stream's work is done (nothing NCCL).
  absl::Status Sync(const char* what) {
    const cudaError_t e = cudaStreamSynchronize(stream_);
    if (e == cudaSuccess) return absl::OkStatus();
    cudaGetLastError();
    return Abort(absl::InternalError(absl::StrCat(what, ": ", CudaText(e))));
  }
  ncclComm_t comm() const { return comm_; }
  cudaStream_t stream() const { return stream_; }

  // Aborts the communicator: every later call on it answers `why`.
  absl::Status Abort(absl::Status why) {
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    absl::MutexLock lock(&mu_);
    if (failed_.ok()) {
      failed_ = absl::FailedPreconditionError(absl::StrCat(
          "NCCL communicator ", id_, " was aborted (", why.message(), "): connect again"));
    }
    return why;
  }

 private:
  absl::Status Stopped() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return absl::FailedPreconditionError(
        absl::StrCat("NCCL communicator ", id_, " is closed (", stop_, ")"));
  }
  bool Stopping() const {
    absl::MutexLock lock(&mu_);
    return !stop_.empty();
  }

  // Polls the communicator (and the stream) until the operations issued are done. NOTE: a
  // busy-wait with short sleeps: NCCL's non-blocking API has no completion callback.
  absl::Status Wait(absl::Time deadline, const char* what, bool stream) {
    for (;;) {
      ncclResult_t async = ncclSuccess;
      if (comm_ != nullptr) ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        return Abort(absl::InternalError(absl::StrCat(what, ": ", NcclText(async))));
      }
      if (async == ncclSuccess) {
        const cudaError_t q = stream ? cudaStreamQuery(stream_) : cudaSuccess;
        if (q == cudaSuccess) return absl::OkStatus();
        if (q != cudaErrorNotReady) {
          cudaGetLastError();
          return Abort(absl::InternalError(absl::StrCat(what, ": ", CudaText(q))));
        }
      }
      if (Stopping()) {
        return Abort(absl::CancelledError(absl::StrCat(what, ": the communicator was closed")));
      }
      if (absl::Now() >= deadline) {
        return Abort(absl::DeadlineExceededError(
            absl::StrCat(what, ": the peer rank did not take part in time (ranks must issue ",
                         "matching operations in the same order)")));
      }
      absl::SleepFor(absl::Microseconds(20));
    }
  }

  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !jobs_.empty() || !stop_.empty();
  }

  void Loop(ncclUniqueId uid, absl::Duration init_timeout) {
    absl::Status init = Init(uid, init_timeout);
    if (!init.ok()) {
      {
        // Replaces what Abort recorded: the call that finds it must learn the join failed.
        absl::MutexLock lock(&mu_);
        failed_ = absl::FailedPreconditionError(
            absl::StrCat("NCCL communicator ", id_, " did not form: ", init.message()));
      }
      on_failed_();  // the plane lets it go now, not at its idle timeout
    }
    for (;;) {
      std::function<void()> job;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &Comm::HasWork));
        if (jobs_.empty()) break;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
      absl::MutexLock lock(&mu_);
      --pending_;
      last_used_ = absl::Now();
    }
    // Queued jobs after a stop: none can be added (Submit checks stop_), and the loop drained
    // them.
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);  // NOTE: abort, not destroy: a peer that is gone must not hang this
      comm_ = nullptr;
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init(ncclUniqueId uid, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    cudaError_t e = cudaSetDevice(device_);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(absl::StrCat("cuda:", device_, ": ", CudaText(e)));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&comm_, nranks_, uid, rank_, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      if (comm_ != nullptr) ncclCommAbort(comm_);
      comm_ = nullptr;
      return absl::InternalError(absl::StrCat("ncclCommInitRank: ", NcclText(r)));
    }
    return Wait(deadline, "ncclCommInitRank (waiting for every rank to join)", /*stream=*/false);
  }

  const uint64_t id_;
  const std::string tenant_;
  const int nranks_;
  const int rank_;
  const int device_;
  // Its place in the tenant's share of communicators: given back when the plane drops it (under
  // the plane's lock), not when its thread is joined, so that a Disconnect frees it at once.
  LedgerClaim claim_;
  const std::function<void()> on_failed_;
  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  uint64_t pending_ ABSL_GUARDED_BY(mu_) = 0;  // queued or running
  absl::Time last_used_ ABSL_GUARDED_BY(mu_);
  std::string stop_ ABSL_GUARDED_BY(mu_);     // why it stops; empty while it runs
  absl::Status failed_ ABSL_GUARDED_BY(mu_);  // FAILED_PRECONDITION once it cannot be used
  // The thread's own.
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::thread thread_;
};

class NcclPlaneImpl final : public NcclPlane {
 public:
  explicit NcclPlaneImpl(NcclOptions options)
      : options_(options),
        ledger_(options.ledger != nullptr ? options.ledger : OwnLedger(options)) {
    reaper_ = std::thread([this] { Reap(); });
  }
  ~NcclPlaneImpl() override {
    std::vector<std::shared_ptr<Comm>> all;
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      for (auto& [id, c] : comms_) all.push_back(c);
      comms_.clear();
    }
    reaper_.join();
    for (auto& c : all) c->Stop("kvbankd is stopping");
  }

  const NcclOptions& options() const override { return options_; }

  absl::StatusOr<uint64_t> Connect(const std::string& tenant, absl::string_view unique_id,
                                   int nranks, int rank) override {
    if (unique_id.size() != kNcclUniqueIdBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unique_id has ", unique_id.size(), " bytes; an ncclUniqueId has ", kNcclUniqueIdBytes));
    }
    if (nranks < 1 || static_cast<uint32_t>(nranks) > options_.max_ranks) {
      return absl::InvalidArgumentError(
          absl::StrCat("nranks ", nranks, " is not in 1..", options_.max_ranks));
    }
    if (rank < 0 || rank >= nranks) {
      return absl::InvalidArgumentError(
          absl::StrCat("server_rank ", rank, " is not in 0..", nranks - 1));
    }
    ncclUniqueId uid;
    std::memcpy(uid.internal, unique_id.data(), kNcclUniqueIdBytes);
    auto claim = ledger_->Acquire(tenant, Resource::kNcclComms);
    if (!claim.ok()) {
      return absl::Status(claim.status().code(),
                          absl::StrCat(claim.status().message(), " (--nccl-max-comms)"));
    }
    std::shared_ptr<Comm> comm;
    {
      absl::MutexLock lock(&mu_);
      const uint64_t id = next_id_++;
      comm = std::make_shared<Comm>(id, tenant, nranks, rank, options_.device, *std::move(claim),
                                    [this] {
                                      absl::MutexLock l(&mu_);
                                      wake_ = true;
                                    });
      comms_[comm->id()] = comm;
    }
    comm->Start(uid, options_.init_timeout);
    return comm->id();
  }

  absl::Status Disconnect(const std::string& tenant, uint64_t id) override {
    std::shared_ptr<Comm> comm;
    {
      absl::MutexLock lock(&mu_);
      auto it = comms_.find(id);
      if (it == comms_.end() || it->second->tenant() != tenant) {
        // One that failed and went already: disconnected.
        auto f = failed_.find(id);
        if (f == failed_.end() || f->second.first != tenant) return NotFound(id);
        failed_.erase(f);
        return absl::OkStatus();
      }
      comm = std::move(it->second);
      comms_.erase(it);
      comm->ReleaseShare();
      closing_.push_back(comm);  // the reaper joins it: this caller may be a reaction
    }
    return absl::OkStatus();
  }

  absl::Status Check(const std::string& tenant, uint64_t id, int peer,
                     uint64_t bytes) const override {
    auto comm = Find(tenant, id);
    if (!comm.ok()) return comm.status();
    return CheckOn(**comm, peer, bytes);
  }

  absl::Status Receive(const std::string& tenant, uint64_t id, int peer, uint64_t bytes,
                       const Consume& consume, const PeerOps& also) override {
    auto found = Find(tenant, id);
    if (!found.ok()) return found.status();
    Comm& c = **found;
    if (absl::Status s = CheckOn(c, peer, bytes); !s.ok()) return s;
    return c.Submit([&]() -> absl::Status {
      const absl::Time deadline = absl::Now() + options_.transfer_timeout;
      if (absl::Status s = c.Usable(); !s.ok()) return s;  // the join failed meanwhile
      void* buf = nullptr;
      cudaError_t e = cudaMallocAsync(&buf, bytes, c.stream());
      if (e != cudaSuccess) {
        cudaGetLastError();
        return absl::ResourceExhaustedError(absl::StrCat("cuda:", options_.device,
                                                         ": no device memory for a ", bytes,
                                                         "-byte NCCL receive: ", CudaText(e)));
      }
      absl::Status s = c.Group(
          [&]() -> ncclResult_t {
            ncclResult_t r = ncclRecv(buf, bytes, ncclUint8, peer, c.comm(), c.stream());
            if (r == ncclSuccess && also) {
              if (!also(c.comm(), c.stream()).ok()) r = ncclInvalidUsage;
            }
            return r;
          },
          deadline, "ncclRecv");
      // The pool's kernels read the buffer on their own streams: the receive is complete (Group
      // waited for the stream), and consume syncs its own work before it returns.
      if (s.ok()) s = consume(static_cast<const uint8_t*>(buf), bytes);
      cudaFreeAsync(buf, c.stream());
      return s;
    });
  }

  absl::Status Send(const std::string& tenant, uint64_t id, int peer, uint64_t bytes,
                    const Produce& produce, const PeerOps& also) override {
    auto found = Find(tenant, id);
    if (!found.ok()) return found.status();
    Comm& c = **found;
    if (absl::Status s = CheckOn(c, peer, bytes); !s.ok()) return s;
    return c.Submit([&]() -> absl::Status {
      const absl::Time deadline = absl::Now() + options_.transfer_timeout;
      if (absl::Status s = c.Usable(); !s.ok()) return s;
      void* buf = nullptr;
      cudaError_t e = cudaMallocAsync(&buf, bytes, c.stream());
      if (e != cudaSuccess) {
        cudaGetLastError();
        return absl::ResourceExhaustedError(absl::StrCat("cuda:", options_.device,
                                                         ": no device memory for a ", bytes,
                                                         "-byte NCCL send: ", CudaText(e)));
      }
      // The pool writes the buffer on its own streams: its allocation must be complete first.
      absl::Status s = c.Sync("allocating the send buffer");
      if (s.ok()) s = produce(static_cast<uint8_t*>(buf), bytes);
      if (s.ok()) {
        s = c.Group(
            [&]() -> ncclResult_t {
              ncclResult_t r = ncclSend(buf, bytes, ncclUint8, peer, c.comm(), c.stream());
              if (r == ncclSuccess && also) {
                if (!also(c.comm(), c.stream()).ok()) r = ncclInvalidUsage;
              }
              return r;
            },
            deadline, "ncclSend");
      }
      cudaFreeAsync(buf, c.stream());
      return s;
    });
  }

  size_t num_comms() const override {
    absl::MutexLock lock(&mu_);
    return comms_.size();
  }

 private:
  static absl::Status NotFound(uint64_t id) {
    return absl::NotFoundError(absl::StrCat("no NCCL communicator ", id));
  }

  static std::shared_ptr<TenantLedger> OwnLedger(const NcclOptions& o) {
    std::shared_ptr<TenantLedger> own = TenantLedger::Create();
    own->SetCap(Resource::kNcclComms, o.max_comms);
    return own;
  }

  absl::StatusOr<std::shared_ptr<Comm>> Find(const std::string& tenant, uint64_t id) const {
    absl::MutexLock lock(&mu_);
    auto it = comms_.find(id);
    if (it == comms_.end() || it->second->tenant() != tenant) {
      // One that failed to form and was let go: say why, as before it went.
      auto f = failed_.find(id);
      if (f != failed_.end() && f->second.first == tenant) return f->second.second;
      return NotFound(id);
    }
    return it->second;
  }

  absl::Status CheckOn(const Comm& c, int peer, uint64_t bytes) const {
    if (bytes == 0 || bytes > options_.max_transfer_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("an NCCL transfer of ", bytes, " bytes; it must be 1..",
                       options_.max_transfer_bytes, " (--nccl-max-transfer-bytes)"));
    }
    if (peer < 0 || peer >= c.nranks() || (peer == c.rank() && c.nranks() > 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer rank ", peer, " is not another rank of communicator ", c.id(), " (",
                       c.nranks(), " ranks; kvbankd is rank ", c.rank(), ")"));
    }
    return c.Usable();
  }

  // Destroys communicators idle past the lease and joins disconnected ones, once a second.
  void Reap() {
    for (;;) {
      std::vector<std::shared_ptr<Comm>> done;
      {
        absl::MutexLock lock(&mu_);
        const auto woken = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return stop_ || wake_; };
        mu_.AwaitWithTimeout(absl::Condition(&woken), absl::Seconds(1));
        wake_ = false;
        const absl::Time now = absl::Now();
        for (auto it = comms_.begin(); it != comms_.end();) {
          auto next = std::next(it);
          absl::Status usable = it->second->Usable();
          // A communicator that failed goes at once (its place in the tenant's share with it);
          // one unused past the idle timeout goes too.
          if (!usable.ok() || it->second->IdleFor(options_.idle_timeout, now)) {
            if (!usable.ok()) {
              failed_[it->first] = {it->second->tenant(), usable};
              failed_order_.push_back(it->first);
              while (failed_order_.size() > kFailedKept) {
                failed_.erase(failed_order_.front());
                failed_order_.pop_front();
              }
            }
            it->second->ReleaseShare();
            closing_.push_back(std::move(it->second));
            comms_.erase(it);
          }
          it = next;
        }
        done.swap(closing_);
        if (stop_ && done.empty()) return;
      }
      for (auto& c : done) c->Stop("disconnected, or unused past --nccl-idle-timeout-ms");
    }
  }

  // Communicators that failed and went, remembered to answer why.
  static constexpr size_t kFailedKept = 1024;

  const NcclOptions options_;
  const std::shared_ptr<TenantLedger> ledger_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Comm>> comms_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::pair<std::string, absl::Status>> failed_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> failed_order_ ABSL_GUARDED_BY(mu_);
  bool wake_ ABSL_GUARDED_BY(mu_) = false;  // a communicator failed: the reaper runs now
  std::vector<std::shared_ptr<Comm>> closing_ ABSL_GUARDED_BY(mu_);  // for the reaper to join
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;  // last: it uses the members above
};

}  // namespace

bool NcclBuiltIn() { return true; }

absl::StatusOr<std::unique_ptr<NcclPlane>> NcclPlane::Create(NcclOptions options) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    n = 0;
  }
  if (options.device < 0 || options.device >= n) {
    return absl::FailedPreconditionError(absl::StrCat("the NCCL plane needs CUDA device ",
                                                      options.device, ": this machine has ", n));
  }
  if (options.max_comms == 0) {
    return absl::InvalidArgumentError("the NCCL plane's max_comms is 0");
  }
  return std::unique_ptr<NcclPlane>(new NcclPlaneImpl(options));
}

}  // namespace kvbank::plane
