#include "server/core/core_lock.h"

#include <atomic>
#include <cassert>
#include <cstdio>

namespace kvbank {
namespace {
std::atomic<uint64_t> moves_under_lock{0};
}  // namespace

void CheckNoCoreLock(const char* what) {
  if (!CoreLockHeld()) return;
  // The first few are named; the count says how many.
  if (moves_under_lock.fetch_add(1, std::memory_order_relaxed) < 10) {
    std::fprintf(stderr, "kvbank: %s under the store's or the pool's lock\n", what);
  }
  assert(false && "a byte move under a CoreLock");
}

uint64_t MovesUnderCoreLock() { return moves_under_lock.load(std::memory_order_relaxed); }

}  // namespace kvbank
