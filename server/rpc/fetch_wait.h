// Layer-wise handoff on the wire: a Fetch (or a Fetch into a region) with wait_ms waits until
// the tokens it asks for are committed, so a decode worker pulls each layer as soon as the
// prefill worker's append of it commits. The wait holds no thread: a waiter in the store
// (SequenceStore::WhenCommitted), a timer for wait_ms and the call's cancellation race, and the
// first one decides.
#ifndef KVBANK_SERVER_RPC_FETCH_WAIT_H_
#define KVBANK_SERVER_RPC_FETCH_WAIT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/core/sequence_store.h"
#include "server/core/tenant_ledger.h"

namespace kvbank::rpc {

// Callbacks at deadlines, run one at a time on one thread. Thread-safe.
class Timers {
 public:
  Timers();
  ~Timers();  // callbacks not yet run never run
  Timers(const Timers&) = delete;
  Timers& operator=(const Timers&) = delete;

  // Runs `fn` at `when` (at once when it is past). Returns an id for Cancel.
  uint64_t At(absl::Time when, std::function<void()> fn);
  // True when the callback had not started (it never will); false when it ran or is running.
  bool Cancel(uint64_t id);

 private:
  void Run();

  absl::Mutex mu_;
  std::map<std::pair<absl::Time, uint64_t>, std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, absl::Time> when_ ABSL_GUARDED_BY(mu_);
  uint64_t last_id_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t changes_ ABSL_GUARDED_BY(mu_) = 0;  // bumped when the earliest deadline may move
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// One fetch's wait. The reactor that owns it keeps a reference count: `hold` and `release`
// take and drop one for each callback the wait leaves pending (the store's waiter, the timer),
// so the reactor outlives them. Thread-safe.
class FetchWait {
 public:
  FetchWait(Timers* timers, std::function<void()> hold, std::function<void()> release)
      : timers_(timers), hold_(std::move(hold)), release_(std::move(release)) {}

  // Waits until store has spec's tokens committed, then calls go(OK) to open the fetch; or
  // go(error): DEADLINE_EXCEEDED after `timeout`, the store's error (a bad request, a sequence
  // that is gone), CANCELLED after Cancel. `go` runs exactly once, on the thread that decided
  // (possibly this one, before Begin returns).
  // `claim`: the wait's place in its tenant's share of waits (TenantLedger), released once the
  // wait is decided.
  void Begin(std::shared_ptr<SequenceStore> store, const FetchSpec& spec, absl::Duration timeout,
             std::function<void(absl::Status)> go, LedgerClaim claim = LedgerClaim());
  // The call was cancelled (the reactor's OnCancel): a wait still pending ends CANCELLED.
  void Cancel();

 private:
  // The first call wins: cancels what is still pending and runs go_.
  void Resolve(absl::Status status);

  Timers* const timers_;
  const std::function<void()> hold_, release_;
  LedgerClaim claim_;
  std::shared_ptr<SequenceStore> store_;
  std::function<void(absl::Status)> go_;
  absl::Duration timeout_;
  std::atomic<bool> resolved_{false};
  std::atomic<uint64_t> waiter_{0}, timer_{0};  // 0: none (yet)
};

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_FETCH_WAIT_H_
