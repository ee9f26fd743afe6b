// Internal to the SDK (and its tests): the client end of the shared-memory plane's control
// frames (proto/shm_control.h). One Unix connection to kvbankd, bound to the caller's tenant by
// the region it was handed over with, carries region transfers as frames; many threads may have
// a request in flight at once: each sends its frame and waits for the reply with its request id.
// One waiter at a time reads the socket and hands the replies it finds to their waiters.
#ifndef KVBANK_CLIENT_SHM_CONTROL_CHANNEL_H_
#define KVBANK_CLIENT_SHM_CONTROL_CHANNEL_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvbank/client.h"
#include "proto/shm_control.h"

namespace kvbank::internal {

class ShmControlChannel {
 public:
  // `region` is registered; its socket connection (`conn`, which it owns) carries the frames.
  ShmControlChannel(std::unique_ptr<ShmRegion> region, int conn);
  ShmControlChannel(const ShmControlChannel&) = delete;
  ShmControlChannel& operator=(const ShmControlChannel&) = delete;

  struct Outcome {
    // The server's reply (its status is the call's), or UNAVAILABLE (the connection broke) or
    // DEADLINE_EXCEEDED (no reply by `deadline`).
    absl::StatusOr<proto::ShmControlReplyFrame> reply;
    // Whether the request may have reached the server: when false, nothing of it was sent and
    // the caller may ask again another way.
    bool sent = false;
  };
  // Sends `request` (its request_id and timeout_ms are set here) and waits for its reply; the
  // waiter that reads the socket first reads it without blocking for up to `spin` (the reply
  // of a small transfer is that close), then sleeps in poll.
  Outcome Call(proto::ShmControlRequest request, absl::Time deadline,
               absl::Duration spin = absl::ZeroDuration());

  // The connection broke (the server went away, or answered a frame it could not take).
  bool broken() const;

 private:
  // Reads what the socket has (waiting until `deadline`: on the CPU until `spin_until`, then
  // in poll), and files the whole replies.
  // REQUIRES: reading_ was set by this thread; mu_ not held.
  void ReadSome(absl::Time deadline, absl::Time spin_until);

  const std::unique_ptr<ShmRegion> region_;
  const int conn_;
  absl::Mutex write_mu_;  // one frame on the socket at a time
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;  // a waiter reads the socket
  std::string in_ ABSL_GUARDED_BY(mu_);        // bytes of replies not yet whole
  absl::Status broken_ ABSL_GUARDED_BY(mu_);   // not OK once the connection broke
  // Requests waiting for their reply: the reply once it came (replies to requests no longer
  // waited for are dropped).
  absl::flat_hash_map<uint64_t, std::optional<proto::ShmControlReplyFrame>> waiting_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace kvbank::internal

#endif  // KVBANK_CLIENT_SHM_CONTROL_CHANNEL_H_
