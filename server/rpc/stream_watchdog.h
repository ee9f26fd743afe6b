// Cancels streams that stop making progress. A client that opens an Append and then sends
// nothing keeps the blocks the append reserved; one that stops reading a Fetch keeps the blocks
// its snapshot pinned (through a Free) and the chunk gRPC holds for it; both for as long as the
// connection lives, which with keepalive pings answered is forever. gRPC has no per-message
// deadline on the server, so a stream here reports its progress and the watchdog's thread cancels
// (ServerContext::TryCancel) any that waited longer than the idle timeout for its client: the
// reactor then sees its read or write fail and releases what it held.
#ifndef KVBANK_SERVER_RPC_STREAM_WATCHDOG_H_
#define KVBANK_SERVER_RPC_STREAM_WATCHDOG_H_

#include <atomic>
#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace kvbank::rpc {

class StreamWatchdog {
 public:
  // One stream's link to the watchdog. Owned by the stream's reactor (a shared_ptr the watchdog
  // also holds while it looks at it). Thread-safe.
  class Stream {
   public:
    // The stream moved (a message read or written): its idle clock starts again.
    void Progress() { last_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed); }
    // Whether the stream waits on its client now (a read or a write pending). Only a waiting
    // stream times out: a Watch with nothing to send is idle by design.
    void SetWaiting(bool waiting) {
      Progress();
      waiting_.store(waiting, std::memory_order_relaxed);
    }
    // The reactor's OnDone: after this returns the watchdog never touches the stream again.
    void Done();
    bool timed_out() const { return timed_out_.load(std::memory_order_acquire); }

   private:
    friend class StreamWatchdog;
    Stream(grpc::CallbackServerContext* ctx, std::function<void()> on_idle)
        : ctx_(ctx), on_idle_(std::move(on_idle)) {
      Progress();
    }
    // Cancels the call if it is still live; true when it did.
    bool Cancel();

    absl::Mutex mu_;
    grpc::CallbackServerContext* ctx_ ABSL_GUARDED_BY(mu_);
    std::atomic<int64_t> last_ns_{0};
    std::atomic<bool> waiting_{true};
    std::atomic<bool> timed_out_{false};
    const std::function<void()> on_idle_;
    StreamWatchdog* watchdog_ = nullptr;
  };

  // `idle`: how long a stream may wait on its client; zero or infinite: never times out (no
  // thread runs).
  explicit StreamWatchdog(absl::Duration idle);
  ~StreamWatchdog();  // REQUIRES: every stream is Done
  StreamWatchdog(const StreamWatchdog&) = delete;
  StreamWatchdog& operator=(const StreamWatchdog&) = delete;

  absl::Duration idle_timeout() const { return idle_; }
  // Starts watching a stream (its reactor's constructor). REQUIRES: ctx outlives Stream::Done.
  // When it times out, `on_idle` runs (on the watchdog's thread, before Done) if given, e.g. to
  // finish the call with a status that says why, which a cancel cannot carry; else the call is
  // cancelled.
  std::shared_ptr<Stream> Watch(grpc::CallbackServerContext* ctx,
                                std::function<void()> on_idle = nullptr);
  // Streams cancelled for idling so far.
  uint64_t timed_out() const { return timed_out_.load(std::memory_order_relaxed); }

 private:
  void Run();
  void Forget(Stream* s);

  const absl::Duration idle_;
  absl::Mutex mu_;  // never held with a Stream's
  absl::flat_hash_map<Stream*, std::shared_ptr<Stream>> streams_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> timed_out_{0};
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace kvbank::rpc

#endif  // KVBANK_SERVER_RPC_STREAM_WATCHDOG_H_
