// KV events of one model: blocks stored in and removed from the prefix cache, in order, with
// sequence numbers, in a bounded buffer that readers resume from.
#ifndef KVBANK_SERVER_CORE_KV_EVENTS_H_
#define KVBANK_SERVER_CORE_KV_EVENTS_H_

#include <cstdint>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvbank/prefix_hash.h"

namespace kvbank {

struct KvEvent {
  enum class Type : uint8_t { kBlockStored = 1, kBlockRemoved = 2, kAllCleared = 3 };
  uint64_t sequence = 0;  // 1, 2, 3, ... per model, assigned by the log
  Type type = Type::kBlockStored;
  absl::Time time;
  std::string tenant;             // owner of the blocks; empty for kAllCleared
  std::vector<BlockHash> hashes;  // stored / removed blocks, parent first
  bool has_parent = false;        // stored: the hash the first block chains from (not the root)
  BlockHash parent{};
  std::vector<uint32_t> token_ids;  // stored: the blocks' tokens
  uint32_t block_tokens = 0;
  std::string lora;  // stored: LoRA name, if the sequence had one
  std::string medium = "cpu";
};

// Woken after events are appended, on the log's notifier thread (never on the appending one):
// Notify may Read the log, but must not block: one notifier serves every listener of the log in
// turn. Notifications coalesce: a Notify that starts after an event was appended is the one for
// it, so a listener reads everything new each time. Once Unsubscribe returns, Notify is not
// running and will not run again.
class KvEventListener {
 public:
  virtual ~KvEventListener() = default;
  virtual void Notify() = 0;
};

// Thread-safe. Lock order: callers' locks (BlockPool::mu_), then mu_ or listeners_mu_ (never
// both at once). Notify runs with no lock of the log held; a listener's own lock comes before mu_
// (Notify reads the log).
// Fan-out runs off the appending thread: Append only records the event and marks its tenant as
// having news (O(1) whatever the number of listeners), and one notifier thread, started by the
// first Subscribe, calls Notify on the listeners that may see the news: those of the events'
// tenants and those that see all (admins). A publisher's cost, and its watchers' latency, do
// not depend on how many watchers other tenants have. Rounds are at least round_interval apart,
// and kPausePerListener more for each listener the last round woke (5 ms for up to 25 woken,
// ~100 ms for 512): a listener is woken at most every few milliseconds however fast events come,
// and the fan-out stays near 5,000 wake-ups a second however many watch. The notifier runs at
// a lower CPU priority (nice kNotifierNice): on busy CPUs, calls go before event fan-out.
class KvEventLog {
 public:
  static constexpr int kNotifierNice = 10;
  static constexpr absl::Duration kPausePerListener = absl::Microseconds(200);
  // `round_interval`: the notifier's rounds start at least this far apart (events appended
  // meanwhile are read together in the next): a listener's wake-ups are bounded by time, not by
  // the event rate. Zero: a round as soon as the last one ends.
  explicit KvEventLog(size_t capacity = 65536,
                      absl::Duration round_interval = absl::Milliseconds(5))
      : capacity_(capacity), round_interval_(round_interval) {}
  // REQUIRES: every listener unsubscribed; not called from inside a Notify. Stops and joins the
  // notifier thread.
  ~KvEventLog();
  KvEventLog(const KvEventLog&) = delete;
  KvEventLog& operator=(const KvEventLog&) = delete;

  // Assigns the next sequence number and keeps the event (dropping the oldest past capacity);
  // wakes the notifier when anyone listens. Does not wait for any Notify.
  void Append(KvEvent event);
  struct Batch {
    std::vector<KvEvent> events;
    uint64_t next_after = 0;  // pass as `after` next time (skips events the reader may not see)
  };
  // Events with sequence > after, among the next max_events, that `tenant` may see (all when
  // see_all). FAILED_PRECONDITION when events after `after` were already dropped, or `after` is
  // past the last event (a cursor from an earlier log): the reader must rebuild its index.
  absl::StatusOr<Batch> Read(uint64_t after, size_t max_events, const std::string& tenant,
                             bool see_all) const;
  uint64_t last_sequence() const;
  // `l` is woken for events of `tenant` (and kAllCleared); for every event when `see_all`.
  void Subscribe(KvEventListener* l, const std::string& tenant = "", bool see_all = true);
  // Listeners subscribed now (for tests and stats).
  size_t listeners() const;
  // Notify calls made so far (for tests: who was woken for what).
  uint64_t notifications() const;
  // Waits for l's Notify if it is running on the notifier thread now (except when called from
  // inside l's own Notify), so the caller may delete l once this returns.
  // NOTE: the caller must not hold a lock that l's Notify takes.
  void Unsubscribe(KvEventListener* l);

 private:
  void NotifierLoop();

  const size_t capacity_;
  const absl::Duration round_interval_;
  mutable absl::Mutex mu_;
  std::deque<KvEvent> events_ ABSL_GUARDED_BY(mu_);
  uint64_t last_ ABSL_GUARDED_BY(mu_) = 0;
  struct Interest {
    std::string tenant;
    bool see_all = false;
  };
  mutable absl::Mutex listeners_mu_;
  absl::flat_hash_map<KvEventListener*, Interest> listeners_ ABSL_GUARDED_BY(listeners_mu_);
  absl::flat_hash_map<std::string, absl::flat_hash_set<KvEventListener*>> by_tenant_
      ABSL_GUARDED_BY(listeners_mu_);
  absl::flat_hash_set<KvEventListener*> see_all_ ABSL_GUARDED_BY(listeners_mu_);
  // Since the last round: tenants with events for their listeners, and whether an event for
  // everyone (kAllCleared) came.
  absl::flat_hash_set<std::string> pending_tenants_ ABSL_GUARDED_BY(listeners_mu_);
  bool pending_all_ ABSL_GUARDED_BY(listeners_mu_) = false;
  bool pending_ ABSL_GUARDED_BY(listeners_mu_) = false;  // any of it: the notifier wakes on this
  uint64_t notifications_ ABSL_GUARDED_BY(listeners_mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(listeners_mu_) = false;
  KvEventListener* notifying_ ABSL_GUARDED_BY(listeners_mu_) = nullptr;  // whose Notify runs
  std::thread notifier_ ABSL_GUARDED_BY(listeners_mu_);
  std::thread::id notifier_id_ ABSL_GUARDED_BY(listeners_mu_);
};

}  // namespace kvbank

#endif  // KVBANK_SERVER_CORE_KV_EVENTS_H_
