// Survives the SIGBUS of a shared mapping whose file its owner shrinks under a copy.
//
// kvbankd maps client memfds shared. A memfd sealed against shrinking (F_SEAL_SHRINK) can never
// fault, but engines allocate their host pools in memfds they cannot seal (made without
// MFD_ALLOW_SEALING) or in shm_open files. A client that truncates such a file while kvbankd
// copies to or from it would raise SIGBUS in kvbankd. Each such mapping is guarded here: a
// SIGBUS inside a guarded range replaces the whole range with private anonymous memory
// (mmap MAP_FIXED, async-signal-safe), marks it tripped and returns, so the copy finishes on
// throwaway pages. Whoever copied then asks Tripped() and fails the transfer: a fetch's bytes
// are lost with the client's file, an append is aborted before it commits.
//
// A SIGBUS outside every guarded range goes to the disposition that was there before the first
// Add (another handler, or the default: the process dies as it would have).
//
// Invariant (the caller's): a guarded range is mapped until Remove, and copies hold its mapping
// (ShmMapping) while they run, so the handler never maps over a range that was unmapped.
#ifndef KVBANK_SERVER_PLANE_SIGBUS_GUARD_H_
#define KVBANK_SERVER_PLANE_SIGBUS_GUARD_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace kvbank::plane {

class SigbusGuard {
 public:
  static constexpr int kMaxRanges = 1024;
  // Guards [base, base + size) (a shared mapping, page-aligned); returns its slot for Tripped and
  // Remove. Installs the handler on the first call. RESOURCE_EXHAUSTED when kMaxRanges ranges are
  // guarded already; INTERNAL when the handler cannot be installed.
  static absl::StatusOr<int> Add(uint8_t* base, uint64_t size);
  // Stops guarding the slot's range (before it is unmapped).
  static void Remove(int slot);
  // Whether a SIGBUS hit the slot's range since Add: its pages are anonymous memory now.
  static bool Tripped(int slot);
};

}  // namespace kvbank::plane

#endif  // KVBANK_SERVER_PLANE_SIGBUS_GUARD_H_
