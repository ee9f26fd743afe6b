// kvbank::Fleet::Watch: the KV events of every replica, merged and tagged with the replica.
//
// One thread per replica runs Client::Watch in windows of at most kWindow and resumes each
// window from the sequence number the last one reached (kvbankd's first batch of a stream
// always carries it), so stopping takes at most one window and no event falls between two.
#include <algorithm>
#include <map>
#include <memory>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/fleet_internal.h"

namespace kvbank {
namespace {

constexpr absl::Duration kWindow = absl::Seconds(1);

// The user's callback, called by one stream at a time.
class Merger {
 public:
  explicit Merger(const std::function<bool(const Fleet::TaggedEvents&)>& on_batch)
      : on_batch_(on_batch) {}
  // False once the callback has asked to stop.
  bool Deliver(const std::string& replica, std::vector<Client::Event> events) {
    absl::MutexLock lock(&mu_);
    if (stopped_) return false;
    if (!on_batch_(Fleet::TaggedEvents{replica, std::move(events)})) stopped_ = true;
    return !stopped_;
  }
  // The kAllCleared the fleet reports for a replica whose events it can no longer follow.
  bool Cleared(const std::string& replica) {
    Client::Event e;
    e.type = Client::Event::Type::kAllCleared;
    return Deliver(replica, {std::move(e)});
  }
  bool stopped() const {
    absl::MutexLock lock(&mu_);
    return stopped_;
  }

 private:
  const std::function<bool(const Fleet::TaggedEvents&)>& on_batch_;
  mutable absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

absl::Status Fleet::Watch(const std::string& model, bool from_now, absl::Duration deadline,
                          const std::function<bool(const TaggedEvents&)>& on_batch) {
  const absl::Time until = absl::Now() + deadline;
  Merger merger(on_batch);
  struct Stream {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> quit = std::make_shared<std::atomic<bool>>(false);
  };
  std::map<std::string, Stream> streams;
  Impl& impl = *impl_;
  const absl::Duration probe = impl.options.probe_interval;

  auto run = [&impl, &merger, &model, until, probe](std::string replica, bool start_from_now,
                                                    std::shared_ptr<std::atomic<bool>> quit) {
    bool now_only = start_from_now;
    uint64_t after = 0;
    while (!quit->load() && !merger.stopped() && absl::Now() < until) {
      auto found = impl.Find(replica);
      if (!found.has_value()) return;  // left the fleet: the main loop reports it
      const absl::Duration window = std::min(kWindow, until - absl::Now());
      absl::Status s = found->first->Watch(
          model, after, now_only, window,
          [&](const std::vector<Client::Event>& events, uint64_t next) {
            after = next;
            now_only = false;
            if (quit->load()) return false;
            return events.empty() ? !merger.stopped() : merger.Deliver(replica, events);
          });
      if (s.ok() || absl::IsDeadlineExceeded(s)) continue;  // stopped, or the window ended
      // The stream broke (replica down or draining, resume point dropped, model gone): what the
      // router knows of this replica may be stale. Start over from now once it is back.
      if (!merger.Cleared(replica)) return;
      now_only = true;
      while (!quit->load() && !merger.stopped() && absl::Now() < until) {
        bool healthy = false;
        {
          absl::MutexLock lock(&impl.mu);
          auto m = impl.members.find(replica);
          if (m == impl.members.end()) return;
          healthy = m->second.healthy;
        }
        if (healthy) break;
        absl::SleepFor(std::min(probe, kWindow));
      }
    }
  };

  bool first_round = true;
  while (!merger.stopped() && absl::Now() < until) {
    std::vector<std::string> names;
    for (const Replica& r : Replicas()) names.push_back(r.name);
    for (const std::string& name : names) {
      if (streams.count(name)) continue;
      // A replica that joins after the first round is new: its events from the start.
      const bool start_now = first_round && from_now;
      Stream& s = streams[name];
      s.thread = std::thread(run, name, start_now, s.quit);
    }
    for (auto it = streams.begin(); it != streams.end();) {
      if (std::find(names.begin(), names.end(), it->first) != names.end()) {
        ++it;
        continue;
      }
      it->second.quit->store(true);
      it->second.thread.join();
      merger.Cleared(it->first);
      it = streams.erase(it);
    }
    first_round = false;
    absl::SleepFor(std::min({probe, kWindow, std::max(absl::ZeroDuration(), until - absl::Now())}));
  }
  for (auto& [name, s] : streams) {
    s.quit->store(true);
    s.thread.join();
  }
  return merger.stopped() ? absl::OkStatus()
                          : absl::DeadlineExceededError("fleet watch: the deadline passed");
}

}  // namespace kvbank
