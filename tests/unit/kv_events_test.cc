// KV events: what the pool publishes (stored / removed / cleared), sequence numbers, resuming,
// the bounded buffer, tenant filtering, listeners; and the registry wiring a model's log.
#include "server/core/kv_events.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "kvbank/layout.h"
#include "kvbank/prefix_hash.h"
#include "server/core/block_pool.h"
#include "server/core/model_registry.h"
#include "server/core/sequence_store.h"
#include "tests/unit/store_testing.h"
#include "tests/unit/test_memory.h"

namespace kvbank {
namespace {

ModelLayout TestLayout() { return store_testing::GqaLayout("tiny", 2, 2, 8, 4, DType::kFp16); }

class Harness {
 public:
  explicit Harness(uint64_t blocks, size_t capacity = 4096,
                   absl::Duration ttl = absl::ZeroDuration()) {
    auto log = std::make_unique<KvEventLog>(capacity);
    events = log.get();
    PoolOptions po;
    po.events = events;
    po.clock = [this] { return now; };
    StoreOptions so;
    so.clock = [this] { return now; };
    so.prefix_cache_ttl = ttl;
    auto made = testenv::CreateTestStore(layout, blocks, so, po, std::move(log));
    EXPECT_TRUE(made.ok()) << made.status();
    if (made.ok()) store = *std::move(made);
  }

  // A sequence of `tenant` holding `ids` (all appended, ids given).
  uint64_t Fill(const std::string& tenant, const std::vector<uint32_t>& ids,
                const std::string& lora = "") {
    CreateOptions o;
    o.lease = absl::ZeroDuration();
    o.tenant = tenant;
    if (!lora.empty()) o.extra_keys.push_back({ExtraKeyKind::kLora, lora});
    auto info = store->Create(o);
    EXPECT_TRUE(info.ok()) << info.status();
    AppendSpec s;
    s.tenant = tenant;
    s.sequence_id = info->id;
    s.num_tokens = ids.size();
    s.token_ids = ids;
    std::vector<uint8_t> payload(store->pool().layout().PayloadBytes(0, 2, ids.size()), 0x3c);
    auto r = store->Append(s, payload);
    EXPECT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(store->CheckInvariants(), "");
    return info->id;
  }
  std::vector<KvEvent> ReadAll(uint64_t after = 0, const std::string& tenant = "",
                               bool see_all = true) {
    auto b = events->Read(after, 1 << 20, tenant, see_all);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? b->events : std::vector<KvEvent>();
  }

  absl::Time now = absl::FromUnixSeconds(1700000000);
  ModelLayout layout = TestLayout();
  KvEventLog* events = nullptr;
  std::unique_ptr<SequenceStore> store;
};

std::vector<uint32_t> Tokens(uint32_t n, uint32_t start) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = start + i;
  return v;
}

TEST(KvEventsTest, StoredEventsCarryTheChain) {
  Harness h(16);
  const auto ids = Tokens(13, 100);
  h.Fill("t", ids, "my-lora");
  const auto ev = h.ReadAll();
  ASSERT_EQ(ev.size(), 3u) << "3 full blocks, the partial one is not stored";
  std::vector<ExtraKey> keys = {{ExtraKeyKind::kLora, "my-lora"}};
  const auto want =
      PrefixHashes(h.store->options().hash, h.store->prefix().Root("t", ""), ids, 4, keys);
  for (size_t i = 0; i < ev.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(ev[i].type, KvEvent::Type::kBlockStored);
    EXPECT_EQ(ev[i].sequence, i + 1);
    EXPECT_EQ(ev[i].tenant, "t");
    ASSERT_EQ(ev[i].hashes.size(), 1u);
    EXPECT_EQ(ev[i].hashes[0], want[i]);
    EXPECT_EQ(ev[i].has_parent, i > 0);
    if (i > 0) {
      EXPECT_EQ(ev[i].parent, ev[i - 1].hashes[0]);
    }
    EXPECT_EQ(ev[i].token_ids, std::vector<uint32_t>(ids.begin() + 4 * i, ids.begin() + 4 * i + 4));
    EXPECT_EQ(ev[i].block_tokens, 4u);
    EXPECT_EQ(ev[i].lora, "my-lora");
    EXPECT_EQ(ev[i].time, h.now);
  }
  // A second sequence attaching the same prefix stores only its new block, chained on.
  CreateOptions o;
  o.tenant = "t";
  o.prompt = Tokens(16, 100);
  o.extra_keys = keys;
  auto b = h.store->Create(o);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->cached_tokens, 12u);
  AppendSpec s;
  s.tenant = "t";
  s.sequence_id = b->id;
  s.num_tokens = 4;
  std::vector<uint8_t> payload(h.store->pool().layout().PayloadBytes(0, 2, 4), 1);
  ASSERT_TRUE(h.store->Append(s, payload).ok());
  const auto more = h.ReadAll(3);
  ASSERT_EQ(more.size(), 1u);
  EXPECT_TRUE(more[0].has_parent);
  EXPECT_EQ(more[0].parent, want[2]);
  EXPECT_EQ(more[0].sequence, 4u);
}

TEST(KvEventsTest, RemovedOnEvictionAndTtlClearedOnClear) {
  Harness h(3, 4096, absl::Hours(1));
  const auto ids = Tokens(12, 7);
  ASSERT_TRUE(h.store->Free(h.Fill("", ids), "").ok());
  const auto stored = h.ReadAll();
  ASSERT_EQ(stored.size(), 3u);
  // Evicting one block for a sequence without ids: one Removed event naming the chain's tail.
  CreateOptions o;
  o.lease = absl::ZeroDuration();
  auto b = h.store->Create(o);
  AppendSpec s;
  s.sequence_id = b->id;
  s.num_tokens = 4;
  std::vector<uint8_t> payload(h.store->pool().layout().PayloadBytes(0, 2, 4), 1);
  ASSERT_TRUE(h.store->Append(s, payload).ok());
  auto ev = h.ReadAll(3);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].type, KvEvent::Type::kBlockRemoved);
  EXPECT_EQ(ev[0].hashes, std::vector<BlockHash>{stored[2].hashes[0]});
  EXPECT_EQ(ev[0].sequence, 4u);
  // TTL: both remaining blocks age out together.
  h.now += absl::Hours(2);
  EXPECT_EQ(h.store->prefix().ExpireCache(h.now), 2u);
  ev = h.ReadAll(4);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].type, KvEvent::Type::kBlockRemoved);
  ASSERT_EQ(ev[0].hashes.size(), 2u);
  for (const BlockHash& x : {stored[0].hashes[0], stored[1].hashes[0]}) {
    EXPECT_NE(std::find(ev[0].hashes.begin(), ev[0].hashes.end(), x), ev[0].hashes.end());
  }
  // ClearCache with nothing published left: AllCleared.
  ASSERT_TRUE(h.store->Free(b->id, "").ok());
  EXPECT_EQ(h.store->prefix().ClearCache(), 0u);
  ev = h.ReadAll(5);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].type, KvEvent::Type::kAllCleared);
  EXPECT_EQ(ev[0].tenant, "");
  // With a block still referenced, ClearCache drops the cached ones but clears not all.
  const uint64_t live = h.Fill("", Tokens(4, 50));
  ASSERT_TRUE(h.store->Free(h.Fill("", Tokens(4, 60)), "").ok());
  const uint64_t last = h.events->last_sequence();
  EXPECT_EQ(h.store->prefix().ClearCache(), 1u);
  ev = h.ReadAll(last);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].type, KvEvent::Type::kBlockRemoved);
  ASSERT_TRUE(h.store->Free(live, "").ok());
  EXPECT_EQ(h.store->CheckInvariants(), "");
}

TEST(KvEventsTest, SequenceNumbersResumeAndGaps) {
  KvEventLog log(4);
  for (int i = 0; i < 3; ++i) {
    KvEvent e;
    e.tenant = "a";
    log.Append(e);
  }
  auto b = log.Read(0, 100, "", true);
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(b->events.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(b->events[i].sequence, i + 1);
  EXPECT_EQ(b->next_after, 3u);
  // Resume after 1; at most 1 event at a time.
  b = log.Read(1, 1, "", true);
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(b->events.size(), 1u);
  EXPECT_EQ(b->events[0].sequence, 2u);
  EXPECT_EQ(b->next_after, 2u);
  // Caught up: nothing, cursor stays.
  b = log.Read(3, 100, "", true);
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(b->events.empty());
  EXPECT_EQ(b->next_after, 3u);
  // Past capacity the oldest go: a reader behind them must rebuild.
  for (int i = 0; i < 4; ++i) log.Append(KvEvent());
  EXPECT_EQ(log.last_sequence(), 7u);
  auto gap = log.Read(1, 100, "", true);
  EXPECT_EQ(gap.status().code(), absl::StatusCode::kFailedPrecondition) << gap.status();
  gap = log.Read(2, 100, "", true);
  EXPECT_EQ(gap.status().code(), absl::StatusCode::kFailedPrecondition) << gap.status();
  b = log.Read(3, 100, "", true);  // the oldest kept is 4: nothing was missed
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->events.size(), 4u);
  EXPECT_EQ(b->events.front().sequence, 4u);
  EXPECT_EQ(b->events.back().sequence, 7u);
  // A cursor from the future (a restarted log) cannot resume either.
  auto future = log.Read(100, 10, "", true);
  EXPECT_EQ(future.status().code(), absl::StatusCode::kFailedPrecondition) << future.status();
  // A log that keeps nothing reports the gap too.
  KvEventLog none(0);
  none.Append(KvEvent());
  EXPECT_EQ(none.Read(0, 10, "", true).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(none.Read(1, 10, "", true).ok());
}

TEST(KvEventsTest, TenantsSeeOnlyTheirOwnPlusCleared) {
  Harness h(16);
  h.Fill("a", Tokens(8, 1));
  h.Fill("b", Tokens(4, 1));
  h.Fill("a", Tokens(4, 9));
  h.store->prefix().ClearCache();  // nothing cached: everything is referenced; no AllCleared
  const uint64_t last = h.events->last_sequence();
  ASSERT_EQ(last, 4u);
  KvEvent cleared;
  cleared.type = KvEvent::Type::kAllCleared;
  h.events->Append(cleared);
  auto a = h.events->Read(0, 100, "a", false);
  ASSERT_TRUE(a.ok());
  ASSERT_EQ(a->events.size(), 4u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(a->events[i].tenant, "a");
  EXPECT_EQ(a->events[3].type, KvEvent::Type::kAllCleared);
  EXPECT_EQ(a->next_after, 5u);
  auto b = h.events->Read(0, 100, "b", false);
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(b->events.size(), 2u);
  EXPECT_EQ(b->events[0].tenant, "b");
  EXPECT_EQ(b->events[0].sequence, 3u);
  // Events b may not see still advance its cursor: a page of a's events is empty, not stuck.
  auto page = h.events->Read(0, 2, "b", false);
  ASSERT_TRUE(page.ok());
  EXPECT_TRUE(page->events.empty());
  EXPECT_EQ(page->next_after, 2u);
  auto nobody = h.events->Read(0, 100, "c", false);
  ASSERT_TRUE(nobody.ok());
  EXPECT_EQ(nobody->events.size(), 1u);
  EXPECT_EQ(nobody->next_after, 5u);
  auto admin = h.events->Read(0, 100, "c", true);
  EXPECT_EQ(admin->events.size(), 5u);
}

// Reads every new event from inside Notify, as the watch reactor does.
class Collector : public KvEventListener {
 public:
  explicit Collector(KvEventLog* log) : log_(log) {}
  void Notify() override {
    absl::MutexLock lock(&mu_);
    ++notifications_;
    auto b = log_->Read(cursor_, 1000, "", true);
    if (!b.ok()) {
      ++errors_;
      return;
    }
    for (const KvEvent& e : b->events) seen_.push_back(e.sequence);
    cursor_ = b->next_after;
  }
  int notifications() {
    absl::MutexLock lock(&mu_);
    return notifications_;
  }
  std::vector<uint64_t> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }
  int errors() {
    absl::MutexLock lock(&mu_);
    return errors_;
  }
  // Whether at least n events were seen within `limit`.
  bool AwaitSeen(size_t n, absl::Duration limit = absl::Seconds(30)) {
    absl::MutexLock lock(&mu_);
    const auto seen = [this, n]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return seen_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&seen), limit);
  }

 private:
  KvEventLog* const log_;
  absl::Mutex mu_;
  uint64_t cursor_ = 0;
  int notifications_ = 0;
  int errors_ = 0;
  std::vector<uint64_t> seen_;
};

TEST(KvEventsTest, ListenersReadInsideNotifyAndStopOnUnsubscribe) {
  Harness h(64);
  Collector c(h.events);
  h.events->Subscribe(&c);
  h.Fill("", Tokens(12, 1));
  // Notify runs on the log's notifier thread, and may cover several events at once.
  ASSERT_TRUE(c.AwaitSeen(3));
  EXPECT_GE(c.notifications(), 1);
  EXPECT_EQ(c.seen(), (std::vector<uint64_t>{1, 2, 3}));
  // Appends from several threads at once: no deadlock, nothing missed, in order.
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&h, t] {
      for (int i = 0; i < 5; ++i) h.Fill("", Tokens(4, 1000 * (t + 1) + 10 * i));
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(h.events->last_sequence(), 23u);
  ASSERT_TRUE(c.AwaitSeen(23));
  std::vector<uint64_t> want;
  for (uint64_t i = 1; i <= 23; ++i) want.push_back(i);
  EXPECT_EQ(c.seen(), want);
  EXPECT_EQ(c.errors(), 0);
  h.events->Unsubscribe(&c);
  const int before = c.notifications();
  // A listener subscribed later sees the next event: by then the round that carried it is over.
  Collector later(h.events);
  h.events->Subscribe(&later);
  h.Fill("", Tokens(4, 77777));
  ASSERT_TRUE(later.AwaitSeen(24));
  EXPECT_EQ(c.notifications(), before);
  EXPECT_EQ(h.events->last_sequence(), 24u);
  h.events->Unsubscribe(&later);
}

// A listener is woken only for events it may see: its tenant's, or everyone's when it sees all.
// One tenant's events cost nothing for another's listeners, however many there are.
TEST(KvEventsTest, ListenersWakeOnlyForTheirTenantsEvents) {
  Harness h(64);
  Collector b(h.events), admin(h.events);
  std::vector<std::unique_ptr<Collector>> a;
  for (int i = 0; i < 50; ++i) {
    a.push_back(std::make_unique<Collector>(h.events));
    h.events->Subscribe(a.back().get(), "a", /*see_all=*/false);
  }
  h.events->Subscribe(&b, "b", /*see_all=*/false);
  h.events->Subscribe(&admin, "", /*see_all=*/true);
  EXPECT_EQ(h.events->listeners(), 52u);
  const uint64_t seq = h.Fill("b", Tokens(12, 5));  // 3 stored events of b's
  ASSERT_TRUE(b.AwaitSeen(3));
  ASSERT_TRUE(admin.AwaitSeen(3));
  // b's and the admin's listeners only: at most one wake-up each per event.
  EXPECT_LE(h.events->notifications(), 6u);
  for (const auto& l : a) EXPECT_EQ(l->notifications(), 0) << "woken for another tenant's events";
  // An event for everyone (the cache cleared) wakes every listener.
  ASSERT_TRUE(h.store->Free(seq, "b").ok());
  h.store->prefix().ClearCache();
  for (const auto& l : a) EXPECT_TRUE(l->AwaitSeen(1)) << "missed an event for everyone";
  for (const auto& l : a) h.events->Unsubscribe(l.get());
  h.events->Unsubscribe(&b);
  h.events->Unsubscribe(&admin);
  EXPECT_EQ(h.events->listeners(), 0u);
}

// Rounds spread out with the listeners they wake (KvEventLog::kPausePerListener each): the
// fan-out's writes a second stay bounded however many watch. 150 listeners: the next round
// starts at least 30 ms after the last.
TEST(KvEventsTest, RoundsSpreadOutWithTheListenersTheyWake) {
  KvEventLog log(1024, absl::Milliseconds(1));
  std::vector<std::unique_ptr<Collector>> listeners;
  for (int i = 0; i < 150; ++i) {
    listeners.push_back(std::make_unique<Collector>(&log));
    log.Subscribe(listeners.back().get(), "a", /*see_all=*/false);
  }
  KvEvent e;
  e.tenant = "a";
  log.Append(e);
  for (const auto& l : listeners) ASSERT_TRUE(l->AwaitSeen(1));
  const absl::Time first = absl::Now();
  log.Append(e);
  ASSERT_TRUE(listeners.front()->AwaitSeen(2));
  const absl::Duration gap = absl::Now() - first;
  EXPECT_GE(gap, 150 * KvEventLog::kPausePerListener - absl::Milliseconds(5))
      << "the next round came " << gap << " after a round that woke 150 listeners";
  for (const auto& l : listeners) ASSERT_TRUE(l->AwaitSeen(2));
  for (const auto& l : listeners) log.Unsubscribe(l.get());
}

// A listener whose Notify blocks until the gate opens (no listener should, but a slow one must
// not hold up the appending thread). Counts its calls, and any call after Unsubscribe returned.
struct Gate {
  absl::Mutex mu;
  bool open ABSL_GUARDED_BY(mu) = false;
  void Set(bool o) {
    absl::MutexLock lock(&mu);
    open = o;
  }
  void Pass() {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&open));
  }
};

class SlowListener : public KvEventListener {
 public:
  explicit SlowListener(Gate* gate) : gate_(gate) {}
  void Notify() override {
    {
      absl::MutexLock lock(&mu_);
      ++calls_;
      if (unsubscribed_) ++late_calls_;
      in_notify_ = true;
    }
    gate_->Pass();
    absl::MutexLock lock(&mu_);
    in_notify_ = false;
  }
  int calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  int late_calls() {
    absl::MutexLock lock(&mu_);
    return late_calls_;
  }
  bool in_notify() {
    absl::MutexLock lock(&mu_);
    return in_notify_;
  }
  void MarkUnsubscribed() {
    absl::MutexLock lock(&mu_);
    unsubscribed_ = true;
  }

 private:
  Gate* const gate_;
  absl::Mutex mu_;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  int late_calls_ ABSL_GUARDED_BY(mu_) = 0;
  bool in_notify_ ABSL_GUARDED_BY(mu_) = false;
  bool unsubscribed_ ABSL_GUARDED_BY(mu_) = false;
};

// Runs fn on a thread; true when it returned within `limit`. The thread is joined either way
// (`unblock` runs first when it did not return, so a failing check cannot hang the test).
bool ReturnsWithin(absl::Duration limit, const std::function<void()>& fn,
                   const std::function<void()>& unblock) {
  absl::Notification done;
  std::thread t([&] {
    fn();
    done.Notify();
  });
  const bool in_time = done.WaitForNotificationWithTimeout(limit);
  if (!in_time) unblock();
  t.join();
  return in_time;
}

TEST(KvEventsTest, PublishingDoesNotWaitForListeners) {
  Harness h(256);
  Gate gate;
  constexpr int kListeners = 200;
  std::vector<std::unique_ptr<SlowListener>> listeners;
  for (int i = 0; i < kListeners; ++i) {
    listeners.push_back(std::make_unique<SlowListener>(&gate));
    h.events->Subscribe(listeners.back().get());
  }
  // Each Notify blocks until the gate opens; the append that publishes 3 blocks must not.
  EXPECT_TRUE(ReturnsWithin(
      absl::Seconds(5), [&] { h.Fill("", Tokens(12, 1)); }, [&] { gate.Set(true); }))
      << "the publishing append waited for the listeners";
  EXPECT_EQ(h.events->last_sequence(), 3u);
  gate.Set(true);
  for (auto& l : listeners) {
    const auto called = [&l] { return l->calls() >= 1; };
    const absl::Time end = absl::Now() + absl::Seconds(30);
    while (!called() && absl::Now() < end) absl::SleepFor(absl::Milliseconds(1));
    ASSERT_TRUE(called()) << "a listener was never notified";
  }

  // Unsubscribe while the notifier is blocked inside one listener's Notify: the others return at
  // once; that one returns only after its Notify has finished.
  gate.Set(false);
  ASSERT_TRUE(ReturnsWithin(
      absl::Seconds(5), [&] { h.Fill("", Tokens(4, 500)); }, [&] { gate.Set(true); }));
  SlowListener* busy = nullptr;
  for (const absl::Time end = absl::Now() + absl::Seconds(30); busy == nullptr;) {
    for (auto& l : listeners) {
      if (l->in_notify()) busy = l.get();
    }
    ASSERT_LT(absl::Now(), end) << "no listener was notified of the second append";
    if (busy == nullptr) absl::SleepFor(absl::Milliseconds(1));
  }
  for (auto& l : listeners) {
    if (l.get() == busy) continue;
    h.events->Unsubscribe(l.get());
    l->MarkUnsubscribed();
  }
  bool busy_was_running = true;
  std::thread unsubscriber([&] {
    h.events->Unsubscribe(busy);
    busy_was_running = busy->in_notify();
    busy->MarkUnsubscribed();
  });
  gate.Set(true);
  unsubscriber.join();
  EXPECT_FALSE(busy_was_running) << "Unsubscribe returned while the listener's Notify ran";

  // Nothing is notified after Unsubscribe: a listener subscribed now sees the next event, and by
  // then the round that carried it is over.
  Collector later(h.events);
  h.events->Subscribe(&later);
  h.Fill("", Tokens(4, 900));
  ASSERT_TRUE(later.AwaitSeen(5));
  for (auto& l : listeners) EXPECT_EQ(l->late_calls(), 0);
  h.events->Unsubscribe(&later);
}

TEST(KvEventsTest, RegistryWiresTheModelsLog) {
  ModelRegistry reg(uint64_t{1} << 20);
  ModelConfig cfg;
  cfg.layout = TestLayout();
  cfg.pool_bytes = 64 * ComputeBlockLayout(cfg.layout).block_bytes;
  cfg.event_capacity = 8;
  auto m = reg.Ensure(cfg);
  ASSERT_TRUE(m.ok()) << m.status();
  SequenceStore& store = *m->model;
  ASSERT_NE(store.prefix().events(), nullptr) << "the model keeps no KV events";
  CreateOptions o;
  o.lease = absl::ZeroDuration();
  auto info = store.Create(o);
  ASSERT_TRUE(info.ok());
  AppendSpec s;
  s.sequence_id = info->id;
  s.num_tokens = 40;
  s.token_ids = Tokens(40, 5);
  std::vector<uint8_t> payload(store.pool().layout().PayloadBytes(0, 2, 40), 2);
  ASSERT_TRUE(store.Append(s, payload).ok());
  EXPECT_EQ(store.prefix().events()->last_sequence(), 10u);
  EXPECT_EQ(store.prefix().events()->Read(0, 100, "", true).status().code(),
            absl::StatusCode::kFailedPrecondition)
      << "capacity 8 keeps only the last 8";
  auto tail = store.prefix().events()->Read(2, 100, "", true);
  ASSERT_TRUE(tail.ok());
  EXPECT_EQ(tail->events.size(), 8u);
  // Same layout again: the same model; another layout under the name: ALREADY_EXISTS.
  auto again = reg.Ensure(cfg);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created);
  EXPECT_EQ(again->model.get(), &store);
  cfg.layout.layer_dtypes[1] = DType::kBf16;
  EXPECT_EQ(reg.Ensure(cfg).status().code(), absl::StatusCode::kAlreadyExists);
  // Without prefix caching the model publishes nothing.
  ModelConfig plain;
  plain.layout = TestLayout();
  plain.layout.name = "plain";
  plain.pool_bytes = cfg.pool_bytes;
  plain.enable_prefix_caching = false;
  auto p = reg.Ensure(plain);
  ASSERT_TRUE(p.ok()) << p.status();
  auto pi = p->model->Create(o);
  s.sequence_id = pi->id;
  ASSERT_TRUE(p->model->Append(s, payload).ok());
  EXPECT_EQ(p->model->prefix().events()->last_sequence(), 0u);
  EXPECT_EQ(store.CheckInvariants(), "");
}

}  // namespace
}  // namespace kvbank
