#include "server/core/kv_events.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
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
  const bool for_all = event.type == KvEvent::Type::kAllCleared;
  std::string tenant = for_all ? std::string() : event.tenant;
  {
    absl::MutexLock lock(&mu_);
    event.sequence = ++last_;
    events_.push_back(std::move(event));
    while (events_.size() > capacity_) events_.pop_front();
  }
  absl::MutexLock lock(&listeners_mu_);
  if (listeners_.empty()) return;
  if (for_all) {
    pending_all_ = pending_ = true;
  } else if (by_tenant_.contains(tenant)) {
    pending_tenants_.insert(std::move(tenant));
    pending_ = true;
  } else if (!see_all_.empty()) {
    pending_ = true;  // only the listeners that see everything may see it
  }
}

void KvEventLog::NotifierLoop() {
  // Events are advice (for routers and caches), not a call's answer: their fan-out takes the CPU
  // that calls leave. Raising a thread's own nice value needs no privilege; if it fails, the
  // notifier runs at the process's priority, as before.
  setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), kNotifierNice);
  listeners_mu_.Lock();
  for (;;) {
    const auto woken = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return pending_ || stop_; };
    listeners_mu_.Await(absl::Condition(&woken));
    if (stop_) break;
    // Clearing the flag before the round: events appended from here on raise it again, so each
    // one has a Notify that starts after it.
    pending_ = false;
    std::vector<KvEventListener*> round;
    if (pending_all_) {
      for (const auto& [l, interest] : listeners_) round.push_back(l);
    } else {
      round.assign(see_all_.begin(), see_all_.end());
      for (const std::string& t : pending_tenants_) {
        auto it = by_tenant_.find(t);
        if (it != by_tenant_.end()) round.insert(round.end(), it->second.begin(), it->second.end());
      }
    }
    pending_all_ = false;
    pending_tenants_.clear();
    size_t notified = 0;
    for (KvEventListener* l : round) {
      if (!listeners_.contains(l)) continue;  // unsubscribed during this round
      ++notified;
      notifying_ = l;
      ++notifications_;
      listeners_mu_.Unlock();
      l->Notify();
      listeners_mu_.Lock();
      notifying_ = nullptr;
    }
    // Rounds at most every round_interval_, and further apart the more listeners the last one
    // woke (kPausePerListener each): events that come meanwhile go out together in the next
    // one, so the streams' messages (and their cost) follow time, not the event rate, and the
    // fan-out stays under about 1 / kPausePerListener writes a second however many watch.
    if (round_interval_ > absl::ZeroDuration()) {
      const absl::Duration pause = std::max(round_interval_, kPausePerListener * notified);
      const auto stopping = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return stop_; };
      listeners_mu_.AwaitWithTimeout(absl::Condition(&stopping), pause);
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

size_t KvEventLog::listeners() const {
  absl::MutexLock lock(&listeners_mu_);
  return listeners_.size();
}

uint64_t KvEventLog::notifications() const {
  absl::MutexLock lock(&listeners_mu_);
  return notifications_;
}

void KvEventLog::Subscribe(KvEventListener* l, const std::string& tenant, bool see_all) {
  absl::MutexLock lock(&listeners_mu_);
  listeners_[l] = Interest{tenant, see_all};
  if (see_all) {
    see_all_.insert(l);
  } else {
    by_tenant_[tenant].insert(l);
  }
  if (!notifier_.joinable()) {
    notifier_ = std::thread([this] { NotifierLoop(); });
    notifier_id_ = notifier_.get_id();
  }
}

void KvEventLog::Unsubscribe(KvEventListener* l) {
  absl::MutexLock lock(&listeners_mu_);
  if (auto it = listeners_.find(l); it != listeners_.end()) {
    if (it->second.see_all) {
      see_all_.erase(l);
    } else if (auto t = by_tenant_.find(it->second.tenant); t != by_tenant_.end()) {
      t->second.erase(l);
      if (t->second.empty()) by_tenant_.erase(t);
    }
    listeners_.erase(it);
  }
  // From inside l's own Notify there is nothing to wait for: it returns to the notifier, which
  // will not call l again.
  if (std::this_thread::get_id() == notifier_id_) return;
  const auto done = [this, l]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return notifying_ != l; };
  listeners_mu_.Await(absl::Condition(&done));
}

}  // namespace kvbank
