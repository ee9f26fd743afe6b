// The store's and the pool's locks guard metadata only: no byte of a block moves while either is
// held (a block copy, a tier spill, a payload transfer), so a copy of megabytes never holds up
// the calls that only need the metadata. CoreLock is the scoped lock both take; it marks the
// thread while held. Every byte move starts with CheckNoCoreLock, which counts (and, in a build
// with assertions, aborts on) a move made under one of them.
#ifndef KVBANK_SERVER_CORE_CORE_LOCK_H_
#define KVBANK_SERVER_CORE_CORE_LOCK_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvbank {

namespace core_lock_internal {
// CoreLocks this thread holds now.
inline thread_local int held = 0;
}  // namespace core_lock_internal

class ABSL_SCOPED_LOCKABLE CoreLock {
 public:
  explicit CoreLock(absl::Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
    ++core_lock_internal::held;
  }
  ~CoreLock() ABSL_UNLOCK_FUNCTION() {
    --core_lock_internal::held;
    mu_->Unlock();
  }
  CoreLock(const CoreLock&) = delete;
  CoreLock& operator=(const CoreLock&) = delete;

 private:
  absl::Mutex* const mu_;
};

// Whether this thread holds the store's or a pool's lock now.
inline bool CoreLockHeld() { return core_lock_internal::held > 0; }

// Called where bytes of a block start to move (`what` names the move for the report).
void CheckNoCoreLock(const char* what);

// Byte moves made while a CoreLock was held, since start (0 unless a path is wrong).
uint64_t MovesUnderCoreLock();

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_CORE_LOCK_H_
