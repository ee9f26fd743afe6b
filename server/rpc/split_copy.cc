#include "server/rpc/split_copy.h"

#include <algorithm>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvbank::rpc {
namespace {

// What the asker and its helpers share. Helpers hold it by shared_ptr, so a helper that runs
// after the asker returned finds `closed` and leaves without touching `copy` or `ended`.
struct Split {
  uint64_t total = 0, piece = 0;
  std::atomic<uint64_t> next{0};
  // Valid while the asker is in SplitCopy: read only by threads counted in `active`.
  const std::function<absl::Status(uint64_t, uint64_t)>* copy = nullptr;
  const std::atomic<bool>* ended = nullptr;

  absl::Mutex mu;
  bool closed ABSL_GUARDED_BY(mu) = false;
  uint32_t active ABSL_GUARDED_BY(mu) = 0;
  absl::Status status ABSL_GUARDED_BY(mu);

  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return active == 0; }

  // Takes pieces until none is left, the copy fails or the call ends.
  void Drain() {
    for (;;) {
      const uint64_t at = next.fetch_add(piece, std::memory_order_relaxed);
      if (at >= total) return;
      absl::Status s = ended->load(std::memory_order_acquire)
                           ? absl::CancelledError("the fetch ended during its copy: stopped")
                           : (*copy)(at, std::min(piece, total - at));
      if (!s.ok()) {
        next.store(total, std::memory_order_relaxed);  // nobody takes another piece
        absl::MutexLock lock(&mu);
        if (status.ok()) status = std::move(s);
        return;
      }
    }
  }
};

}  // namespace

absl::Status SplitCopy(uint64_t total, const SplitCopyOptions& options,
                       const std::function<absl::Status(uint64_t, uint64_t)>& copy,
                       const std::atomic<bool>& ended,
                       const std::function<void(std::function<void()>)>& spawn) {
  auto split = std::make_shared<Split>();
  split->total = total;
  split->piece = std::max<uint64_t>(1, options.piece_bytes);
  split->copy = &copy;
  split->ended = &ended;
  const uint64_t pieces = (total + split->piece - 1) / split->piece;
  const uint64_t helpers = std::min<uint64_t>(options.max_helpers, pieces > 0 ? pieces - 1 : 0);
  for (uint64_t i = 0; i < helpers; ++i) {
    spawn([split] {
      {
        absl::MutexLock lock(&split->mu);
        if (split->closed) return;
        ++split->active;
      }
      split->Drain();
      absl::MutexLock lock(&split->mu);
      --split->active;
    });
  }
  split->Drain();
  absl::MutexLock lock(&split->mu);
  split->closed = true;
  split->mu.Await(absl::Condition(split.get(), &Split::Idle));
  return split->status;
}

}  // namespace kvbank::rpc
