// The tenant ledger (server-wide caps with a per-tenant share) and the device workers' fair
// scheduling (server/rpc/fair_work.h): background on its own lower-priority threads, round robin
// over tenants, bounded backlogs. Tasks block on notifications the test controls, so every order is
// exact.
#include "server/rpc/fair_work.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/core/tenant_ledger.h"

namespace kvbank::rpc {
namespace {

TEST(TenantLedgerTest, EveryTenantGetsAShareOfEachCap) {
  auto ledger = TenantLedger::Create();
  ledger->SetCap(Resource::kWatchStreams, 10);
  ledger->SetTenants({"a", "b"});
  EXPECT_EQ(ledger->Share("a", Resource::kWatchStreams), 5u);
  EXPECT_EQ(ledger->Share("a", Resource::kWaits), 0u) << "no cap: no limit";
  std::vector<LedgerClaim> held;
  for (int i = 0; i < 5; ++i) {
    auto c = ledger->Acquire("a", Resource::kWatchStreams);
    ASSERT_TRUE(c.ok()) << c.status();
    held.push_back(*std::move(c));
  }
  auto over = ledger->Acquire("a", Resource::kWatchStreams);
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("tenant 'a' holds 5 of its share of 5 watch_streams"),
            std::string::npos)
      << over.status();
  // a's share is full; b still has all of its own.
  for (int i = 0; i < 5; ++i) {
    auto c = ledger->Acquire("b", Resource::kWatchStreams);
    ASSERT_TRUE(c.ok()) << c.status();
    held.push_back(*std::move(c));
  }
  EXPECT_EQ(ledger->Total(Resource::kWatchStreams), 10u);
  held.erase(held.begin());  // one of a's goes back
  EXPECT_EQ(ledger->Held("a", Resource::kWatchStreams), 4u);
  auto back = ledger->Acquire("a", Resource::kWatchStreams);
  ASSERT_TRUE(back.ok()) << back.status();
  held.push_back(*std::move(back));
  // A tenant's own limit replaces its share; the cap still binds everyone together.
  ledger->SetLimit("c", Resource::kWatchStreams, 100);
  EXPECT_EQ(ledger->Share("c", Resource::kWatchStreams), 100u);
  auto capped = ledger->Acquire("c", Resource::kWatchStreams);
  ASSERT_EQ(capped.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(capped.status().message().find("cap of 10"), std::string::npos) << capped.status();
  // Rows: what each holds, its share, its refusals.
  auto rows = ledger->Rows();
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].tenant, "a");
  EXPECT_EQ(rows[0].held[size_t(Resource::kWatchStreams)], 5u);
  EXPECT_EQ(rows[0].refused[size_t(Resource::kWatchStreams)], 1u);
  EXPECT_EQ(rows[2].refused[size_t(Resource::kWatchStreams)], 1u);
}

TEST(TenantLedgerTest, ClaimsMoveAndReleaseOnce) {
  auto ledger = TenantLedger::Create();
  ledger->SetCap(Resource::kShmRegionBytes, 100);
  auto c = ledger->Acquire("t", Resource::kShmRegionBytes, 60);
  ASSERT_TRUE(c.ok());
  LedgerClaim moved = *std::move(c);
  LedgerClaim again = std::move(moved);
  EXPECT_FALSE(moved.held());  // NOLINT(bugprone-use-after-move): a moved-from claim is empty
  EXPECT_EQ(ledger->Held("t", Resource::kShmRegionBytes), 60u);
  EXPECT_FALSE(ledger->Acquire("t", Resource::kShmRegionBytes, 41).ok());
  again.Release();
  again.Release();
  EXPECT_EQ(ledger->Held("t", Resource::kShmRegionBytes), 0u);
  EXPECT_TRUE(ledger->Acquire("t", Resource::kShmRegionBytes, 100).ok());
}

// Records the order tasks start in.
class Order {
 public:
  void Add(const std::string& s) {
    absl::MutexLock lock(&mu_);
    seen_.push_back(s);
  }
  std::vector<std::string> Get() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }
  bool WaitFor(size_t n) {
    absl::MutexLock lock(&mu_);
    const auto enough = [this, n]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return seen_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> seen_;
};

std::shared_ptr<TenantLedger> Ledger(uint64_t fg_cap, uint64_t bg_cap) {
  auto l = TenantLedger::Create();
  l->SetCap(Resource::kQueuedWork, fg_cap);
  l->SetCap(Resource::kQueuedBackground, bg_cap);
  return l;
}

// One worker, held busy while the queues fill: then the picks show the order.
TEST(FairWorkTest, TenantsTakeTurns) {
  auto ledger = Ledger(1000, 1000);
  Order order;
  absl::Notification release;
  {
    FairWork work(FairWorkOptions{1}, ledger);
    ASSERT_TRUE(
        work.Submit("x", WorkClass::kForeground, [&] { release.WaitForNotification(); }).ok());
    // Wait until the blocker runs, so that everything below queues behind it.
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (work.Stats().running_foreground == 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_EQ(work.Stats().running_foreground, 1u);
    // Tenant a's burst, then b's two calls.
    for (int i = 0; i < 6; ++i) {
      ASSERT_TRUE(
          work.Submit("a", WorkClass::kForeground, [&, i] { order.Add("a" + std::to_string(i)); })
              .ok());
    }
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(
          work.Submit("b", WorkClass::kForeground, [&, i] { order.Add("b" + std::to_string(i)); })
              .ok());
    }
    EXPECT_EQ(work.Stats().queued_foreground, 8u);
    EXPECT_EQ(ledger->Held("a", Resource::kQueuedWork), 6u) << "queued work is on the ledger";
    release.Notify();
    ASSERT_TRUE(order.WaitFor(8));
  }
  // b's calls are not behind a's burst: they alternate with a's until b has none left.
  const std::vector<std::string> want = {"a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"};
  EXPECT_EQ(order.Get(), want);
  EXPECT_EQ(ledger->Total(Resource::kQueuedWork), 0u);
}

// Background tasks run on threads of their own, at a lower CPU priority: a foreground task
// never waits for a worker behind them, and they take only the CPU that foreground work leaves.
TEST(FairWorkTest, BackgroundRunsOnItsOwnLowerPriorityThreads) {
  auto ledger = Ledger(1000, 1000);
  absl::Notification release_bg;
  std::atomic<int> fg_done{0};
  std::atomic<int> bg_nice{-100}, fg_nice{-100};
  const int process_nice = getpriority(PRIO_PROCESS, 0);
  FairWorkOptions options{1};
  options.background_nice = 7;
  FairWork work(options, ledger);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(work.Submit("a", WorkClass::kBackground,
                            [&] {
                              bg_nice =
                                  getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
                              release_bg.WaitForNotification();
                            })
                    .ok());
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (work.Stats().running_background < 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(work.Stats().running_background, 1u) << "one background thread for one worker";
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(work.Submit("b", WorkClass::kForeground,
                            [&] {
                              fg_nice =
                                  getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
                              ++fg_done;
                            })
                    .ok());
  }
  while (fg_done.load() < 10 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(fg_done.load(), 10) << "foreground tasks waited behind background ones";
  EXPECT_EQ(work.Stats().running_background, 1u);
  EXPECT_EQ(work.Stats().queued_background, 2u);
  EXPECT_EQ(fg_nice.load(), process_nice);
  EXPECT_EQ(bg_nice.load(), std::min(19, process_nice + 7));
  release_bg.Notify();
}

TEST(FairWorkTest, BacklogsAreBoundedPerTenant) {
  auto ledger = Ledger(4, 2);
  ledger->SetTenants({"a", "b"});  // shares: 2 foreground, 1 background each
  absl::Notification release;
  std::atomic<int> ran{0};
  {
    FairWork work(FairWorkOptions{1}, ledger);
    ASSERT_TRUE(
        work.Submit("b", WorkClass::kForeground, [&] { release.WaitForNotification(); }).ok());
    ASSERT_TRUE(
        work.Submit("b", WorkClass::kBackground, [&] { release.WaitForNotification(); }).ok());
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while ((work.Stats().running_foreground == 0 || work.Stats().running_background == 0) &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_TRUE(work.Submit("a", WorkClass::kForeground, [&] { ++ran; }).ok());
    EXPECT_TRUE(work.Submit("a", WorkClass::kForeground, [&] { ++ran; }).ok());
    absl::Status third = work.Submit("a", WorkClass::kForeground, [&] { ++ran; });
    EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
    EXPECT_TRUE(work.Submit("a", WorkClass::kBackground, [&] { ++ran; }).ok());
    EXPECT_EQ(work.Submit("a", WorkClass::kBackground, [&] { ++ran; }).code(),
              absl::StatusCode::kResourceExhausted);
    // A step of a call already admitted is never refused.
    work.Continue("a", [&] { ++ran; });
    // b's own share is untouched by a's.
    EXPECT_TRUE(work.Submit("b", WorkClass::kForeground, [&] { ++ran; }).ok());
    release.Notify();
  }  // the destructor runs what is queued
  EXPECT_EQ(ran.load(), 5);
  auto rows = ledger->Rows();
  ASSERT_EQ(rows[0].tenant, "a");
  EXPECT_EQ(rows[0].refused[size_t(Resource::kQueuedWork)], 1u);
  EXPECT_EQ(rows[0].refused[size_t(Resource::kQueuedBackground)], 1u);
}

// Background work never takes every worker: with 4 foreground workers, 2 background threads.
TEST(FairWorkTest, BackgroundLeavesWorkersForForeground) {
  auto ledger = Ledger(1000, 1000);
  absl::Notification release_bg;
  std::atomic<int> fg_done{0};
  FairWork work(FairWorkOptions{4}, ledger);
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(
        work.Submit("a", WorkClass::kBackground, [&] { release_bg.WaitForNotification(); }).ok());
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (work.Stats().running_background < 2 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(work.Stats().running_background, 2u);
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(work.Submit("b", WorkClass::kForeground, [&] { ++fg_done; }).ok());
  }
  while (fg_done.load() < 10 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(fg_done.load(), 10) << "foreground tasks waited behind background ones";
  EXPECT_EQ(work.Stats().running_background, 2u);
  release_bg.Notify();
}

}  // namespace
}  // namespace kvbank::rpc
