#include "server/rpc/fetch_wait.h"

#include "absl/strings/str_cat.h"

namespace kvbank::rpc {

Timers::Timers() : thread_([this] { Run(); }) {}

Timers::~Timers() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

uint64_t Timers::At(absl::Time when, std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = ++last_id_;
  // The thread sleeps until the earliest deadline: only a new earliest one needs to wake it.
  const bool earliest = queue_.empty() || when < queue_.begin()->first.first;
  queue_.emplace(std::make_pair(when, id), std::move(fn));
  when_[id] = when;
  if (earliest) ++changes_;
  return id;
}

bool Timers::Cancel(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = when_.find(id);
  if (it == when_.end()) return false;
  queue_.erase(std::make_pair(it->second, id));
  when_.erase(it);
  return true;
}

void Timers::Run() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    const uint64_t seen = changes_;
    const absl::Time next = queue_.empty() ? absl::InfiniteFuture() : queue_.begin()->first.first;
    auto woken = [this, seen]()
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || changes_ != seen; };
    mu_.AwaitWithDeadline(absl::Condition(&woken), next);
    if (stop_) return;
    if (queue_.empty() || queue_.begin()->first.first > absl::Now()) continue;
    auto first = queue_.begin();
    std::function<void()> fn = std::move(first->second);
    when_.erase(first->first.second);
    queue_.erase(first);
    mu_.Unlock();
    fn();
    mu_.Lock();
  }
}

void FetchWait::Begin(std::shared_ptr<SequenceStore> store, const FetchSpec& spec,
                      absl::Duration timeout, std::function<void(absl::Status)> go,
                      LedgerClaim claim) {
  claim_ = std::move(claim);
  store_ = std::move(store);
  go_ = std::move(go);
  timeout_ = timeout;
  // Each pending callback holds the reactor; it releases through a copy of release_, as the
  // release may delete the reactor, and this with it.
  hold_();
  const uint64_t timer = timers_->At(absl::Now() + timeout, [this, release = release_] {
    Resolve(absl::DeadlineExceededError(
        absl::StrCat("the tokens this fetch waits for were not committed within wait_ms=",
                     absl::ToInt64Milliseconds(timeout_))));
    release();
  });
  timer_.store(timer);
  if (resolved_.load() && timers_->Cancel(timer)) release_();
  hold_();
  auto waiter = store_->WhenCommitted(spec, [this, release = release_](absl::Status s) {
    Resolve(std::move(s));
    release();
  });
  if (!waiter.ok() || *waiter == 0) {  // no waiter was left: its reference goes now
    Resolve(waiter.ok() ? absl::OkStatus() : waiter.status());
    release_();
    return;
  }
  waiter_.store(*waiter);
  if (resolved_.load() && store_->CancelWait(*waiter)) release_();
}

void FetchWait::Cancel() { Resolve(absl::CancelledError("the fetch was cancelled while waiting")); }

void FetchWait::Resolve(absl::Status status) {
  if (resolved_.exchange(true)) return;
  // What is still pending will never run: drop its reference. An id not stored yet is
  // cancelled by Begin, which sees resolved_.
  if (uint64_t t = timer_.load(); t != 0 && timers_->Cancel(t)) release_();
  if (uint64_t w = waiter_.load(); w != 0 && store_->CancelWait(w)) release_();
  claim_.Release();  // the tenant's share of waits has room again
  go_(std::move(status));
}

}  // namespace kvbank::rpc
