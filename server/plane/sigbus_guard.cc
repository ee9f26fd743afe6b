#include "server/plane/sigbus_guard.h"

#include <signal.h>
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/base/call_once.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace kvbank::plane {
namespace {

// A guarded range; begin == 0: a free slot. The handler reads slots without a lock.
struct Range {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> tripped{false};
};

Range g_ranges[SigbusGuard::kMaxRanges];
absl::Mutex g_mu;  // taking and freeing slots
bool g_taken[SigbusGuard::kMaxRanges] ABSL_GUARDED_BY(g_mu) = {};
struct sigaction g_previous;
absl::once_flag g_install_once;
int g_install_errno = 0;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const auto at = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Range& r : g_ranges) {
    const uintptr_t begin = r.begin.load(std::memory_order_acquire);
    const uintptr_t end = r.end.load(std::memory_order_acquire);
    if (begin == 0 || at < begin || at >= end) continue;
    const int saved = errno;
    void* p = mmap(reinterpret_cast<void*>(begin), end - begin, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    errno = saved;
    if (p == MAP_FAILED) break;  // cannot recover: as if unguarded
    r.tripped.store(true, std::memory_order_release);
    return;  // the faulting access runs again, on the anonymous pages
  }
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if ((g_previous.sa_flags & SA_SIGINFO) == 0 && g_previous.sa_handler != SIG_DFL &&
      g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // The default action: the access faults again on return and the process ends with SIGBUS.
  struct sigaction dfl = {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGBUS, &dfl, nullptr);
}

void Install() {
  struct sigaction sa = {};
  sa.sa_sigaction = OnSigbus;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  if (sigaction(SIGBUS, &sa, &g_previous) != 0) g_install_errno = errno;
}

}  // namespace

absl::StatusOr<int> SigbusGuard::Add(uint8_t* base, uint64_t size) {
  absl::call_once(g_install_once, Install);
  if (g_install_errno != 0) {
    return absl::InternalError(
        absl::StrCat("cannot install the SIGBUS handler: ", std::strerror(g_install_errno)));
  }
  absl::MutexLock lock(&g_mu);
  for (int i = 0; i < kMaxRanges; ++i) {
    if (g_taken[i]) continue;
    g_taken[i] = true;
    Range& r = g_ranges[i];
    r.tripped.store(false, std::memory_order_relaxed);
    r.end.store(reinterpret_cast<uintptr_t>(base) + size, std::memory_order_release);
    r.begin.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    return i;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("more than ", kMaxRanges, " unsealed shared-memory regions at once"));
}

void SigbusGuard::Remove(int slot) {
  if (slot < 0 || slot >= kMaxRanges) return;
  absl::MutexLock lock(&g_mu);
  g_ranges[slot].begin.store(0, std::memory_order_release);
  g_ranges[slot].end.store(0, std::memory_order_release);
  g_taken[slot] = false;
}

bool SigbusGuard::Tripped(int slot) {
  return slot >= 0 && slot < kMaxRanges && g_ranges[slot].tripped.load(std::memory_order_acquire);
}

}  // namespace kvbank::plane
