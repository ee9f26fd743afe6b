#include "server/core/kv_events.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvbank {

KvEventLog::~KvEventLog() {
  std::thread notifier;
  {
    absl::MutexLock lock(&listeners_mu_);
    stop_ = true;
    notifier = std::move(notifier_);
  }
  if (notifier.joinable()) notifier.join();
}

void KvEventLog::Append(KvEvent event) {
  {
    absl::MutexLock lock(&mu_);
    event.sequence = ++last_;
    events_.push_back(std::move(event));
    while (events_.size() > capacity_) events_.pop_front();
  }
  absl::MutexLock lock(&listeners_mu_);
  if (!listeners_.empty()) pending_ = true;  // the notifier wakes on this flag
}

void KvEventLog::NotifierLoop() {
  listeners_mu_.Lock();
  for (;;) {
    const auto woken = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return pending_ || stop_; };
    listeners_mu_.Await(absl::Condition(&woken));
    if (stop_) break;
    // Clearing the flag before the round: events appended from here on raise it again, so each
    // one has a Notify that starts after it.
    pending_ = false;
    const std::vector<KvEventListener*> round(listeners_.begin(), listeners_.end());
    for (KvEventListener* l : round) {
      if (!listeners_.contains(l)) continue;  // unsubscribed during this round
      notifying_ = l;
      listeners_mu_.Unlock();
      l->Notify();
      listeners_mu_.Lock();
      notifying_ = nullptr;
    }
  }
  listeners_mu_.Unlock();
}

absl::StatusOr<KvEventLog::Batch> KvEventLog::Read(uint64_t after, size_t max_events,
                                                   const std::string& tenant, bool see_all) const {
  absl::MutexLock lock(&mu_);
  Batch out;
  out.next_after = after;
  if (after > last_) {
    // A cursor from another log (the server restarted, the model was re-created): resuming from
    // it would silently skip every event up to `after`.
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", after, " is past the last event ", last_,
                     "; rebuild the index and watch again from sequence ", last_));
  }
  if (after == last_) return out;
  const uint64_t oldest = events_.empty() ? last_ + 1 : events_.front().sequence;
  if (after + 1 < oldest) {
    return absl::FailedPreconditionError(
        absl::StrCat("events after sequence ", after, " were dropped (oldest kept: ", oldest,
                     "); rebuild the index and watch again from sequence ", oldest - 1));
  }
  for (size_t i = after + 1 - oldest, n = 0; i < events_.size() && n < max_events; ++i, ++n) {
    const KvEvent& e = events_[i];
    if (see_all || e.type == KvEvent::Type::kAllCleared || e.tenant == tenant) {
      out.events.push_back(e);
    }
    out.next_after = e.sequence;
  }
  return out;
}

uint64_t KvEventLog::last_sequence() const {
  absl::MutexLock lock(&mu_);
  return last_;
}

void KvEventLog::Subscribe(KvEventListener* l) {
  absl::MutexLock lock(&listeners_mu_);
  listeners_.insert(l);
  if (!notifier_.joinable()) {
    notifier_ = std::thread([this] { NotifierLoop(); });
    notifier_id_ = notifier_.get_id();
  }
}

void KvEventLog::Unsubscribe(KvEventListener* l) {
  absl::MutexLock lock(&listeners_mu_);
  listeners_.erase(l);
  // From inside l's own Notify there is nothing to wait for: it returns to the notifier, which
  // will not call l again.
  if (std::this_thread::get_id() == notifier_id_) return;
  const auto done = [this, l]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return notifying_ != l; };
  listeners_mu_.Await(absl::Condition(&done));
}

}  // namespace kvbank
