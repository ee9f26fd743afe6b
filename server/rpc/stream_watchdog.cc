#include "server/rpc/stream_watchdog.h"

#include <algorithm>
#include <vector>

namespace kvbank::rpc {

void StreamWatchdog::Stream::Done() {
  {
    absl::MutexLock lock(&mu_);
    ctx_ = nullptr;
  }
  if (watchdog_ != nullptr) watchdog_->Forget(this);
}

bool StreamWatchdog::Stream::Cancel() {
  // NOTE: TryCancel and on_idle_ run under mu_, so Done (the reactor's OnDone, on a gRPC thread)
  // waits for them: the reactor outlives them. gRPC never runs a reaction inline in TryCancel or
  // Finish.
  absl::MutexLock lock(&mu_);
  if (ctx_ == nullptr) return false;
  timed_out_.store(true, std::memory_order_release);
  if (on_idle_) {
    on_idle_();
  } else {
    ctx_->TryCancel();
  }
  return true;
}

StreamWatchdog::StreamWatchdog(absl::Duration idle) : idle_(idle) {
  if (idle_ > absl::ZeroDuration() && idle_ != absl::InfiniteDuration()) {
    thread_ = std::thread([this] { Run(); });
  }
}

StreamWatchdog::~StreamWatchdog() {
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<StreamWatchdog::Stream> StreamWatchdog::Watch(grpc::CallbackServerContext* ctx,
                                                              std::function<void()> on_idle) {
  std::shared_ptr<Stream> s(new Stream(ctx, std::move(on_idle)));
  if (!thread_.joinable()) return s;  // no timeout: nothing to watch
  s->watchdog_ = this;
  absl::MutexLock lock(&mu_);
  streams_.emplace(s.get(), s);
  return s;
}

void StreamWatchdog::Forget(Stream* s) {
  absl::MutexLock lock(&mu_);
  streams_.erase(s);
}

void StreamWatchdog::Run() {
  // Checks a few times per timeout: a stalled stream is cut between idle and 1.25 x idle.
  const absl::Duration every = std::clamp(idle_ / 4, absl::Milliseconds(5), absl::Seconds(1));
  const int64_t idle_ns = absl::ToInt64Nanoseconds(idle_);
  while (!stop_.WaitForNotificationWithTimeout(every)) {
    const int64_t now = absl::GetCurrentTimeNanos();
    std::vector<std::shared_ptr<Stream>> stalled;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [_, s] : streams_) {
        if (s->waiting_.load(std::memory_order_relaxed) && !s->timed_out() &&
            now - s->last_ns_.load(std::memory_order_relaxed) > idle_ns) {
          stalled.push_back(s);
        }
      }
    }
    for (const auto& s : stalled) {
      if (s->Cancel()) timed_out_.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

}  // namespace kvbank::rpc
