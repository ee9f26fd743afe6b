// A client's memory region as kvbankd maps it (shm_regions.h): the checked, shared mapping of a
// memfd handed over the shared-memory socket, and the bytes and runs of it that one transfer
// names. Its checks keep a client from making kvbankd pay for its pages (a sparse or punched
// file) or fault in a copy (a file truncated under it: sigbus_guard.h).
#ifndef KVBANK_SERVER_PLANE_SHM_MAPPING_H_
#define KVBANK_SERVER_PLANE_SHM_MAPPING_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvbank::plane {

// One mapped memfd; unmapped when the last holder lets go. Thread-safe (immutable).
class ShmMapping {
 public:
  // Checks `fd` (a memfd or other shmem file on tmpfs, size in 1..max_bytes, every page
  // allocated, mappable shared read/write) and maps it. INVALID_ARGUMENT naming what is wrong.
  // A file not sealed against shrinking (F_SEAL_SHRINK) is taken too, its mapping guarded
  // against SIGBUS (sigbus_guard.h; RESOURCE_EXHAUSTED past SigbusGuard::kMaxRanges of them).
  // Keeps a duplicate of `fd` (to check for holes and size later); the caller closes its own.
  static absl::StatusOr<std::shared_ptr<ShmMapping>> Map(int fd, uint64_t max_bytes);
  ~ShmMapping();
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  // FAILED_PRECONDITION when bytes [offset, offset + length) hold a page that is not allocated
  // (punched out since the region was mapped): a copy would allocate it on kvbankd's account.
  absl::Status CheckAllocated(uint64_t offset, uint64_t length) const;
  // Whether the file is sealed against shrinking (else its mapping is guarded).
  bool sealed() const { return guard_slot_ < 0; }
  // OK for a sealed file. For an unsealed one FAILED_PRECONDITION once its owner truncated it:
  // shorter than when mapped, or a copy hit SIGBUS (the mapping is throwaway memory since).
  // Transfers ask it after their copy: a fetch then failed, an append must not commit.
  absl::Status CheckIntact() const;

 private:
  ShmMapping(uint8_t* data, uint64_t size, int fd, int guard_slot)
      : data_(data), size_(size), fd_(fd), guard_slot_(guard_slot) {}
  uint8_t* const data_;
  const uint64_t size_;
  const int fd_;          // a duplicate of the memfd, for SEEK_HOLE and fstat
  const int guard_slot_;  // SigbusGuard's slot; -1: sealed, not guarded
};

// Bytes of a region, and the mapping that keeps them valid while this lives.
struct RegionBytes {
  std::shared_ptr<ShmMapping> mapping;
  absl::Span<uint8_t> bytes;
};

// Runs of a region in payload order (ShmRegions::ResolveRuns). A run that the next one continues
// in the region is one run with it (Add): an engine's host pool often keeps a layer's pages side
// by side, so a fetch into them copies 64 runs of 1 MiB rather than 2,048 of 32 KiB.
struct RegionRuns {
  std::shared_ptr<ShmMapping> mapping;
  std::vector<absl::Span<uint8_t>> runs;
  std::vector<uint64_t> ends;  // [i]: the payload offset just past runs[i]
  uint64_t size() const { return ends.empty() ? 0 : ends.back(); }
  // Appends the payload's next `run` bytes.
  void Add(absl::Span<uint8_t> run) {
    if (run.empty()) return;
    if (!runs.empty() && runs.back().data() + runs.back().size() == run.data()) {
      runs.back() = absl::MakeSpan(runs.back().data(), runs.back().size() + run.size());
      ends.back() += run.size();
      return;
    }
    ends.push_back(size() + run.size());
    runs.push_back(run);
  }
  // Payload bytes [at, at + n) as the pieces of runs they lie in, in order.
  // REQUIRES: at + n <= size().
  template <typename Fn>  // absl::Status(uint64_t payload_at, absl::Span<uint8_t> piece)
  absl::Status ForEachPiece(uint64_t at, uint64_t n, Fn&& fn) const {
    size_t r = size_t(std::upper_bound(ends.begin(), ends.end(), at) - ends.begin());
    while (n > 0) {
      const uint64_t within = at - (ends[r] - runs[r].size());
      const uint64_t len = std::min(n, runs[r].size() - within);
      if (absl::Status s = fn(at, runs[r].subspan(within, len)); !s.ok()) return s;
      at += len;
      n -= len;
      ++r;
    }
    return absl::OkStatus();
  }
};

}  // namespace kvbank::plane

#endif  // KVBANK_SERVER_PLANE_SHM_MAPPING_H_
