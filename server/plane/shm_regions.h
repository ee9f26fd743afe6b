// The same-host shared-memory plane's registry: client-owned memory regions that Append and
// Fetch name as (region, offset, length) instead of carrying the bytes over gRPC, so that a
// payload is copied once, between the pool and the region.
//
// A region comes in on the Unix socket (proto/shm_wire.h): a memfd (or another tmpfs file) is
// checked, mapped shared read/write and answered with a random 128-bit handle. The SDK's memfds
// are sealed against shrinking, so that the client can never truncate them under a copy (which
// would raise SIGBUS in kvbankd); an unsealed file (an engine's own host pool) is taken with its
// mapping guarded against that SIGBUS (sigbus_guard.h), each transfer failing that saw it shrink.
// The gRPC call RegisterRegion claims the handle for the caller's tenant and gets a region id; only
// that tenant can name the id (any other gets NOT_FOUND, as for an id that never was). A handle not
// claimed within claim_timeout is dropped, and so is a connection that never sent a region.
//
// Invariant: a region is registered only while the socket connection it came on is open. When
// the client closes it (exit, crash, SIGKILL) the region is unregistered; UnregisterRegion
// closes the connection. Transfers hold the mapping (shared_ptr): the munmap happens when the
// last one ends, never under a copy.
//
// The pool is never mapped into a client: a region holds only what its own client put there or
// asked for.
//
// Memory: a region's pages are the client's, charged to the client's memory cgroup. A page of a
// shared file is charged to whoever touches it first, so kvbankd maps only regions whose every
// page is written already (the SDK writes its memfds whole): a sparse memfd is refused, and so is
// a region hole-punched since (each transfer checks its slice before the copy), else a client
// could make kvbankd's own cgroup pay for its pages. Only shmem (tmpfs) memfds are taken:
// hugetlbfs ones can lose their pages under a copy.
//
// Control frames (proto/shm_control.h): once a region is claimed, its connection is a channel of
// the claiming tenant. Region transfers may be asked for on it with a small binary frame instead
// of a gRPC call; the listener reads and decodes them and hands each to the control handler (the
// service), which answers it through ShmControlCall::Reply from any thread. A connection that
// closes ends its calls in flight (ShmControlCall::ended), as a cancelled gRPC call does.
//
// Tenancy: each tenant's regions count in the ledger (shm_regions, shm_region_bytes: a share of
// --shm-max-regions and --shm-max-total-bytes each); a RegisterRegion past either is
// RESOURCE_EXHAUSTED and the handed-over memfd is dropped.
#ifndef KVBANK_SERVER_PLANE_SHM_REGIONS_H_
#define KVBANK_SERVER_PLANE_SHM_REGIONS_H_

#include <poll.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "proto/shm_control.h"
#include "server/core/tenant_ledger.h"
#include "server/plane/shm_mapping.h"

namespace kvbank::plane {

struct ShmOptions {
  std::string socket_path;  // created with mode 0600; a stale one (nobody answers) is replaced
  uint64_t max_region_bytes = uint64_t{64} << 30;
  // Regions registered or waiting to be claimed, and so socket connections, at once.
  uint32_t max_regions = 256;
  // Where each tenant's regions count (its share of the regions and of their bytes); null: a
  // ledger of its own with max_regions and max_total_bytes as caps, one tenant.
  std::shared_ptr<TenantLedger> ledger;
  uint64_t max_total_bytes = uint64_t{1} << 40;
  // A connection that sends no region, or a handle that RegisterRegion does not claim, within
  // this long is dropped.
  absl::Duration claim_timeout = absl::Seconds(10);
  // After a round in which the listener answered every frame it took itself (small copies on
  // host memory run on it), it looks at its connections without sleeping for this long before
  // it waits in poll: a client sending small transfers one after another then finds it awake
  // instead of paying its wake-up. It costs up to that much CPU time after such a round. Zero:
  // always sleep.
  absl::Duration spin = absl::Microseconds(50);
};

// The most runs a region slice may name (ShmRegions::ResolveRuns).
inline constexpr uint64_t kMaxRegionRuns = uint64_t{1} << 18;

// Where kvbankd puts its shm socket when --shm-socket is left at "auto": the folder kvbank in
// $XDG_RUNTIME_DIR, else /tmp/kvbank-<uid>; made with mode 0700 when missing, and refused when it
// is not a directory of this user that only this user can write (FAILED_PRECONDITION naming
// why). The socket is kvbankd-<pid>.sock in it (many servers may share the folder); sockets
// there named by a pid no process has are removed.
absl::StatusOr<std::string> DefaultShmSocketPath();

struct ShmControlLink;  // a claimed connection's reply side (shm_regions.cc)

// One control frame's request, from its arrival to its reply. Thread-safe.
class ShmControlCall {
 public:
  ShmControlCall(std::string tenant, proto::ShmControlRequest request,
                 std::shared_ptr<ShmControlLink> link, uint64_t serial);
  ~ShmControlCall();
  ShmControlCall(const ShmControlCall&) = delete;
  ShmControlCall& operator=(const ShmControlCall&) = delete;

  // The tenant that claimed the connection's region: the call's caller.
  const std::string& tenant() const { return tenant_; }
  const proto::ShmControlRequest& request() const { return request_; }
  // The frame's timeout_ms from its arrival; InfiniteFuture when it named none.
  absl::Time deadline() const { return deadline_; }
  // True once the connection closed or End() was called: the asker is gone.
  const std::atomic<bool>& ended() const { return ended_; }
  // Runs `fn` once the call ends (at once, here, when it has).
  void OnEnd(std::function<void()> fn);
  // Ends the call (as a cancel): ended() turns true and the OnEnd callbacks run, here.
  void End();
  // Ends the call because its deadline() passed: as End(), and a CANCELLED answer given to it
  // after this goes out as DEADLINE_EXCEEDED (as gRPC answers a call past its deadline).
  void EndAtDeadline();
  // Answers the request (AppendResponse for an append, else FetchResponse) or its error; only the
  // first answer is sent. A connection that cannot take the reply at once is closed.
  void Reply(const absl::StatusOr<proto::ShmControlAnswer>& answer);
  // Whether Reply was called.
  bool replied() const { return replied_.load(std::memory_order_acquire); }
  // Whether the listener handed this call over alone: no other frame had come with it, so work
  // done on the listener for it keeps no frame that has arrived waiting.
  bool alone_in_round() const { return alone_in_round_; }

 private:
  friend class ShmRegions;
  const std::string tenant_;
  const proto::ShmControlRequest request_;
  const absl::Time deadline_;
  const std::shared_ptr<ShmControlLink> link_;
  const uint64_t serial_;  // its key in the link's calls in flight
  std::atomic<bool> ended_{false};
  std::atomic<bool> replied_{false};
  std::atomic<bool> past_deadline_{false};  // set by EndAtDeadline
  bool alone_in_round_ = false;             // set by the listener before it hands the call over
  absl::Mutex mu_;
  std::vector<std::function<void()>> on_end_ ABSL_GUARDED_BY(mu_);
};

// The registry and its socket listener (one thread, poll). Thread-safe. Lock: mu_ alone; the
// listener holds it while it handles a connection (non-blocking socket calls, one mmap).
class ShmRegions {
 public:
  // Binds options.socket_path and starts the listener. FAILED_PRECONDITION when a server answers
  // on that path, or it names something that is not a socket; INTERNAL naming the socket call
  // that failed.
  static absl::StatusOr<std::unique_ptr<ShmRegions>> Start(ShmOptions options);
  // Stops the listener, closes every connection, removes the socket file. Mappings held by
  // transfers stay until those end.
  ~ShmRegions();
  ShmRegions(const ShmRegions&) = delete;
  ShmRegions& operator=(const ShmRegions&) = delete;

  const ShmOptions& options() const { return options_; }

  struct Claimed {
    uint64_t region_id = 0;
    uint64_t size = 0;
  };
  // Binds the region answered with `handle` to `tenant`. NOT_FOUND when the handle is unknown,
  // expired or claimed already; INVALID_ARGUMENT when it is not kShmHandleBytes long;
  // RESOURCE_EXHAUSTED past the tenant's share of regions or of their bytes (the region is
  // dropped: its connection closes).
  absl::StatusOr<Claimed> Claim(const std::string& tenant, absl::string_view handle);
  // Drops the region and closes its connection. NOT_FOUND when `tenant` has no region `id`.
  absl::Status Unregister(const std::string& tenant, uint64_t id);
  // Bytes [offset, offset + length) of `tenant`'s region `id`. `field` names the slice in errors
  // ("header.source"): INVALID_ARGUMENT for id 0 or a range past the region (overflow included),
  // NOT_FOUND for an id that is not the tenant's, FAILED_PRECONDITION for a slice with a page
  // punched out (ShmMapping::CheckAllocated).
  absl::StatusOr<RegionBytes> Resolve(const std::string& tenant, uint64_t id, uint64_t offset,
                                      uint64_t length, absl::string_view field) const;
  static constexpr uint64_t kRunCheckGap = uint64_t{64} << 10;
  // The runs of a scattered slice (v1::RegionSlice's run_bytes / run_offsets): run r at
  // offset + run_offsets[r]. Resolve's errors for the span from the first run's start to the
  // last one's end (the punched-out page check covers the runs and gaps between them of up to
  // kRunCheckGap bytes, not the whole span), and INVALID_ARGUMENT naming `field` for no runs or
  // more than kMaxRegionRuns, run_bytes 0, an offset that overflows or runs that overlap.
  absl::StatusOr<RegionRuns> ResolveRuns(const std::string& tenant, uint64_t id, uint64_t offset,
                                         uint64_t run_bytes, absl::Span<const uint64_t> run_offsets,
                                         absl::string_view field) const;

  // Control frames go to `handler`, called on the listener thread (it must not block: work that
  // may goes to other threads). Null: frames are answered UNAVAILABLE. Setting it waits until no
  // call of the previous handler is running.
  using ControlHandler = std::function<void(std::shared_ptr<ShmControlCall>)>;
  void SetControlHandler(ControlHandler handler);
  // Ends every control call in flight (ShmControlCall::End), for a service that stops.
  void EndControlCalls();

  // For tests and stats.
  size_t num_regions() const;
  size_t num_pending() const;      // answered, not claimed yet
  size_t num_connections() const;  // open socket connections

 private:
  // Resolve, with the punched-out page check only when check_allocated.
  absl::StatusOr<RegionBytes> ResolveSpan(const std::string& tenant, uint64_t id, uint64_t offset,
                                          uint64_t length, absl::string_view field,
                                          bool check_allocated) const;

  struct Conn {
    enum class State { kHello, kPending, kClaimed } state = State::kHello;
    absl::Time opened;
    std::string handle;                    // kPending
    uint64_t region_id = 0;                // kClaimed
    std::shared_ptr<ShmControlLink> link;  // kClaimed: where replies go
    std::string in;                        // kClaimed: bytes of frames not yet whole
  };
  struct Pending {
    std::shared_ptr<ShmMapping> mapping;
    int conn = -1;
  };
  struct Region {
    std::string tenant;
    std::shared_ptr<ShmMapping> mapping;
    int conn = -1;
    LedgerClaim count, bytes;  // the tenant's share of regions and of their bytes
  };

  ShmRegions(ShmOptions options, int listen_fd, int wake_fd);
  void Loop();
  // The events of one poll: connections read, new ones accepted, late ones expired.
  void HandleEvents(const std::vector<pollfd>& polled, int n) ABSL_LOCKS_EXCLUDED(mu_);
  void Accept() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The hello of connection `fd`: maps the region and answers, or closes the connection.
  void ReceiveHello(int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After the hello: control frames on a claimed connection (read, decoded, queued in
  // dispatch_), else the end of the connection (EOF) or a protocol error.
  void ReadAfterHello(int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Decodes the whole frames in connection fd's buffer while it has room for more calls.
  void TakeFrames(int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands dispatch_ to the control handler, and runs the ends of calls whose connection closed.
  // Hands the frames taken to the handler; true when there were some and every one was
  // answered before it returned (the listener copied them itself).
  bool Dispatch() ABSL_LOCKS_EXCLUDED(mu_);
  // Closes connection `fd` and drops what came on it.
  void Close(int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Expire(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ShmOptions options_;
  const std::shared_ptr<TenantLedger> ledger_;
  const int listen_fd_;
  const int wake_fd_;  // an eventfd: the destructor wakes the listener
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<int, Conn> conns_ ABSL_GUARDED_BY(mu_);               // by descriptor
  absl::flat_hash_map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);  // by handle
  absl::flat_hash_map<uint64_t, Region> regions_ ABSL_GUARDED_BY(mu_);      // by id
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_call_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<std::shared_ptr<ShmControlCall>> dispatch_ ABSL_GUARDED_BY(mu_);  // to hand out
  std::vector<std::shared_ptr<ShmControlCall>> ending_ ABSL_GUARDED_BY(mu_);    // to End()
  absl::Mutex handler_mu_;  // held (shared) while the handler runs; never with mu_
  ControlHandler handler_ ABSL_GUARDED_BY(handler_mu_);
  absl::Time accept_paused_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::thread listener_;  // last: it uses the members above
};

}  // namespace kvbank::plane

#endif  // KVBANK_SERVER_PLANE_SHM_REGIONS_H_
