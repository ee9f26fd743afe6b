// Layer-wise handoff's waiting room: fetches waiting for tokens of some layers and kv heads of a
// sequence to be committed (SequenceStore::WhenCommitted). A waiter is added once its sequence
// was found short of the tokens; whoever commits tokens, or frees the sequence, takes out the
// waiters that are done and runs them after releasing every lock (Fire).
#ifndef KVBANK_SERVER_CORE_COMMIT_WAITERS_H_
#define KVBANK_SERVER_CORE_COMMIT_WAITERS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvbank {

// The tokens a waiter waits for: [0, tokens) in every (layer, head) of the ranges.
struct WaitRange {
  uint32_t layer_begin = 0, layer_end = 0;
  uint32_t head_begin = 0, head_end = 0;
  uint64_t tokens = 0;
};

// Thread-safe. Its lock is taken after the store's (callers hold the store's lock while they
// add or take waiters, so that no commit slips between a look at a sequence and a wait on it);
// `ready` callbacks never run under it.
class CommitWaiters {
 public:
  using Ready = std::function<void(absl::Status)>;
  // Callbacks taken out, with the status each is to be called with.
  using Fired = std::vector<std::pair<Ready, absl::Status>>;

  // `model` names the model in errors; at most `max_waiters` wait at once.
  CommitWaiters(std::string model, size_t max_waiters);

  // A new waiter on `sequence`; its id (never 0). RESOURCE_EXHAUSTED past max_waiters.
  absl::StatusOr<uint64_t> Add(uint64_t sequence, const WaitRange& range, Ready ready);
  // Drops a waiter. True when it was still waiting (its `ready` never runs); false when it was
  // taken out already (its `ready` has run or is about to).
  bool Cancel(uint64_t waiter);
  // Takes out the waiters of `sequence` whose tokens `available` says are there (it answers the
  // tokens every (layer, head) of a range holds), to be fired OK.
  void TakeReady(uint64_t sequence, absl::FunctionRef<uint64_t(const WaitRange&)> available,
                 Fired* fired);
  // Takes out every waiter of `sequence`, to be fired with `why`.
  void TakeAll(uint64_t sequence, const absl::Status& why, Fired* fired);
  // The sequences with waiters.
  std::vector<uint64_t> Sequences() const;
  // Waiters now.
  size_t size() const;
  // Runs the callbacks. Call with no lock held.
  static void Fire(Fired fired);

 private:
  struct Waiter {
    uint64_t id = 0;
    WaitRange range;
    Ready ready;
  };
  // Takes out the waiters of `sequence` that `done` picks.
  void Take(uint64_t sequence, absl::FunctionRef<bool(const WaitRange&)> done,
            const absl::Status& status, Fired* fired);

  const std::string model_;
  const size_t max_waiters_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::vector<Waiter>> by_sequence_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, uint64_t> sequence_of_ ABSL_GUARDED_BY(mu_);  // waiter -> seq
  uint64_t last_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_COMMIT_WAITERS_H_
