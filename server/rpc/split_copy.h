// One large copy split over several threads: the thread that asks for it and helpers it spawns
// take pieces from a shared counter until none is left. A helper that has not started by the
// time the pieces are gone does nothing, so the asker never waits for a helper to be scheduled,
// only for the pieces helpers have started: when the other workers are busy, the copy costs what
// one thread's copy costs. One core's memcpy does not fill the memory system of a server, so a
// 16 MiB fetch into a shared-memory region copied by two or three threads ends sooner than one
// memcpy of it (the client waits for the whole payload either way).
#ifndef KVBANK_SERVER_RPC_SPLIT_COPY_H_
#define KVBANK_SERVER_RPC_SPLIT_COPY_H_

#include <atomic>
#include <cstdint>
#include <functional>

#include "absl/status/status.h"

namespace kvbank::rpc {

struct SplitCopyOptions {
  uint64_t piece_bytes = uint64_t{512} << 10;  // what one thread takes at a time
  uint32_t max_helpers = 0;                    // besides the asker
};

// Runs `copy(offset, length)` over [0, total) in pieces of options.piece_bytes, on the calling
// thread and on up to options.max_helpers helpers (never more than pieces - 1), each started by
// passing a task to `spawn` (which may run it on any thread, at any time, or never). Returns
// when every piece taken has been copied: the first error of `copy`, CANCELLED when `ended` was
// set between pieces (the rest are not copied), OK otherwise. `copy` and `ended` are used only
// until this returns; `copy` must allow concurrent calls on disjoint ranges.
absl::Status SplitCopy(uint64_t total, const SplitCopyOptions& options,
                       const std::function<absl::Status(uint64_t, uint64_t)>& copy,
                       const std::atomic<bool>& ended,
                       const std::function<void(std::function<void()>)>& spawn);

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_SPLIT_COPY_H_
