// The client end of the control frames (client/shm_control_channel.h).
#include "client/shm_control_channel.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvbank::internal {

ShmControlChannel::ShmControlChannel(std::unique_ptr<ShmRegion> region, int conn)
    : region_(std::move(region)), conn_(conn) {}

bool ShmControlChannel::broken() const {
  absl::MutexLock lock(&mu_);
  return !broken_.ok();
}

ShmControlChannel::Outcome ShmControlChannel::Call(proto::ShmControlRequest request,
                                                   absl::Time deadline, absl::Duration spin) {
  {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) return {broken_, false};
    request.request_id = next_id_++;
    waiting_[request.request_id] = std::nullopt;
  }
  const absl::Duration left = deadline - absl::Now();
  if (deadline != absl::InfiniteFuture()) {
    // The server stops the transfer past the caller's deadline (rounded up, at least 1 ms).
    const int64_t ms =
        std::max<int64_t>(1, absl::ToInt64Milliseconds(left + absl::Microseconds(999)));
    request.timeout_ms = static_cast<uint32_t>(std::min<int64_t>(ms, UINT32_MAX));
  }
  const uint64_t id = request.request_id;
  const std::vector<uint8_t> frame = proto::EncodeShmControlRequest(request);
  size_t sent = 0;
  {
    absl::MutexLock lock(&write_mu_);
    while (sent < frame.size()) {
      const ssize_t n = send(conn_, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      sent += size_t(n);
    }
  }
  const absl::Time spin_until = spin > absl::ZeroDuration() ? absl::Now() + spin : absl::Time();
  absl::MutexLock lock(&mu_);
  if (sent < frame.size()) {
    if (broken_.ok()) {
      broken_ = absl::UnavailableError(
          absl::StrCat("kvbankd's shm socket took no control frame: ", std::strerror(errno)));
    }
    waiting_.erase(id);
    return {broken_, sent > 0};
  }
  for (;;) {
    auto it = waiting_.find(id);
    if (it->second.has_value()) {
      Outcome out{*std::move(it->second), true};
      waiting_.erase(it);
      // kvbankd answers a request its frame's timeout (this caller's deadline, rounded up)
      // ended DEADLINE_EXCEEDED; one that predates that answer ends it as a cancel: a cancel
      // that comes once the deadline has passed is the deadline's doing all the same.
      if (out.reply.ok() && out.reply->status.code() == absl::StatusCode::kCancelled &&
          absl::Now() >= deadline) {
        out.reply->status = absl::DeadlineExceededError(
            absl::StrCat("the call's deadline passed: ", out.reply->status.message()));
      }
      return out;
    }
    if (!broken_.ok()) {
      waiting_.erase(it);
      return {broken_, true};
    }
    if (absl::Now() >= deadline) {
      waiting_.erase(it);  // a reply that comes later is dropped
      return {absl::DeadlineExceededError("no reply to the control frame before the deadline"),
              true};
    }
    if (!reading_) {
      reading_ = true;
      mu_.Unlock();
      ReadSome(deadline, spin_until);
      mu_.Lock();
      reading_ = false;
      continue;
    }
    // Another waiter reads; it wakes this one when it files a reply or gives the reading up.
    auto filed = [this, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      auto w = waiting_.find(id);
      return !reading_ || !broken_.ok() || (w != waiting_.end() && w->second.has_value());
    };
    mu_.AwaitWithDeadline(absl::Condition(&filed), deadline);
  }
}

void ShmControlChannel::ReadSome(absl::Time deadline, absl::Time spin_until) {
  char buf[16 << 10];
  ssize_t n = -1;
  int err = EAGAIN;  // recv's errno, kept before anything else can change it
  auto again = [&] { return n < 0 && (err == EAGAIN || err == EINTR); };
  // On the CPU first while the spin lasts (and the deadline has not passed): each try is one
  // non-blocking recv, so the reply is taken the moment it lands, with no wake-up to pay.
  for (absl::Time now = absl::Now(); now < spin_until && now < deadline; now = absl::Now()) {
    n = recv(conn_, buf, sizeof(buf), MSG_DONTWAIT);
    err = n < 0 ? errno : 0;
    if (!again()) break;
    // Whoever else this CPU has goes first: kvbankd's listener may be waiting for it.
    sched_yield();
  }
  if (again()) {
    // Wait for bytes, at most until this waiter's deadline; a short wait each time, so that a
    // waiter with an earlier deadline that is not reading is not kept past it by this one.
    const absl::Duration left = std::min(deadline - absl::Now(), absl::Milliseconds(50));
    pollfd p{conn_, POLLIN, 0};
    const int ready = poll(&p, 1, int(std::max<int64_t>(0, absl::ToInt64Milliseconds(left))));
    if (ready == 0) return;
    n = ready < 0 ? -1 : recv(conn_, buf, sizeof(buf), MSG_DONTWAIT);
    err = n < 0 ? errno : 0;
  }
  absl::MutexLock lock(&mu_);
  if (again()) return;
  if (n <= 0) {
    broken_ = absl::UnavailableError(
        n == 0 ? "kvbankd closed the shm socket connection (it stopped, or took a frame it "
                 "refused)"
               : absl::StrCat("kvbankd's shm socket broke: ", std::strerror(err)));
    return;
  }
  in_.append(buf, size_t(n));
  constexpr size_t kHeader = sizeof(proto::ShmControlHeader);
  size_t used = 0;
  while (in_.size() - used >= kHeader) {
    const absl::Span<const uint8_t> rest(reinterpret_cast<const uint8_t*>(in_.data()) + used,
                                         in_.size() - used);
    auto h = proto::DecodeShmControlHeader(rest, /*reply=*/true);
    if (!h.ok()) {
      broken_ = absl::UnavailableError(absl::StrCat(
          "kvbankd's shm socket answered a frame that is not one: ", h.status().message()));
      return;
    }
    if (rest.size() < kHeader + h->body_bytes) break;
    auto reply = proto::DecodeShmControlReply(rest.subspan(0, kHeader + h->body_bytes));
    used += kHeader + h->body_bytes;
    if (!reply.ok()) {
      broken_ = absl::UnavailableError(absl::StrCat(
          "kvbankd's shm socket answered a reply that is not one: ", reply.status().message()));
      return;
    }
    auto w = waiting_.find(reply->request_id);
    if (w != waiting_.end()) w->second = *std::move(reply);
  }
  in_.erase(0, used);
}

}  // namespace kvbank::internal
