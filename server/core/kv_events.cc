#include "server/core/kv_events.h"

#include "absl/strings/str_cat.h"

namespace kvbank {

void KvEventLog::Append(KvEvent event) {
  {
    absl::MutexLock lock(&mu_);
    event.sequence = ++last_;
    events_.push_back(std::move(event));
    while (events_.size() > capacity_) events_.pop_front();
  }
  absl::MutexLock lock(&listeners_mu_);
  for (KvEventListener* l : listeners_) l->Notify();
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
}

void KvEventLog::Unsubscribe(KvEventListener* l) {
  absl::MutexLock lock(&listeners_mu_);
  listeners_.erase(l);
}

}  // namespace kvbank
