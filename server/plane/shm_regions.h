// The same-host shared-memory plane's registry: client-owned memory regions that Append and
// Fetch name as (region, offset, length) instead of carrying the bytes over gRPC, so that a
// payload is copied once, between the pool and the region.
//
// A region comes in on the Unix socket (proto/shm_wire.h): a memfd, sealed against shrinking so
// that the client can never truncate it under a copy (which would raise SIGBUS in kvbankd), is
// checked, mapped shared read/write and answered with a random 128-bit handle. The gRPC call
// RegisterRegion claims the handle for the caller's tenant and gets a region id; only that tenant
// can name the id (any other gets NOT_FOUND, as for an id that never was). A handle not claimed
// within claim_timeout is dropped, and so is a connection that never sent a region.
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
// Tenancy: each tenant's regions count in the ledger (shm_regions, shm_region_bytes: a share of
// --shm-max-regions and --shm-max-total-bytes each); a RegisterRegion past either is
// RESOURCE_EXHAUSTED and the handed-over memfd is dropped.
#ifndef KVBANK_SERVER_PLANE_SHM_REGIONS_H_
#define KVBANK_SERVER_PLANE_SHM_REGIONS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/core/tenant_ledger.h"

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
};

// One mapped memfd; unmapped when the last holder lets go. Thread-safe (immutable).
class ShmMapping {
 public:
  // Checks `fd` (a memfd or other shmem file on tmpfs that takes seals, F_SEAL_SHRINK set, size
  // in 1..max_bytes, every page allocated, mappable shared read/write) and maps it.
  // INVALID_ARGUMENT naming what is wrong. Keeps a duplicate of `fd` (to check for holes later);
  // the caller closes its own.
  static absl::StatusOr<std::shared_ptr<ShmMapping>> Map(int fd, uint64_t max_bytes);
  ~ShmMapping();
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  // FAILED_PRECONDITION when bytes [offset, offset + length) hold a page that is not allocated
  // (punched out since the region was mapped): a copy would allocate it on kvbankd's account.
  absl::Status CheckAllocated(uint64_t offset, uint64_t length) const;

 private:
  ShmMapping(uint8_t* data, uint64_t size, int fd) : data_(data), size_(size), fd_(fd) {}
  uint8_t* const data_;
  const uint64_t size_;
  const int fd_;  // a duplicate of the memfd, for SEEK_HOLE
};

// Bytes of a region, and the mapping that keeps them valid while this lives.
struct RegionBytes {
  std::shared_ptr<ShmMapping> mapping;
  absl::Span<uint8_t> bytes;
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

  // For tests and stats.
  size_t num_regions() const;
  size_t num_pending() const;      // answered, not claimed yet
  size_t num_connections() const;  // open socket connections

 private:
  struct Conn {
    enum class State { kHello, kPending, kClaimed } state = State::kHello;
    absl::Time opened;
    std::string handle;      // kPending
    uint64_t region_id = 0;  // kClaimed
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
  void Accept() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The hello of connection `fd`: maps the region and answers, or closes the connection.
  void ReceiveHello(int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Anything after the hello is the end of the connection (EOF) or a protocol error.
  void ReadAfterHello(int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  absl::Time accept_paused_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::thread listener_;  // last: it uses the members above
};

}  // namespace kvbank::plane

#endif  // KVBANK_SERVER_PLANE_SHM_REGIONS_H_
