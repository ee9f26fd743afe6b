// The layer-wise handoff's wait (server/rpc/fetch_wait.h) without gRPC: Timers run callbacks in
// deadline order and never a cancelled one; a FetchWait goes on exactly once, whichever of the
// commit, the timeout and the cancel comes first, and leaves no reference held. Threads race the
// three many times (meant for the ThreadSanitizer build too).
#include "server/rpc/fetch_wait.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "tests/unit/store_testing.h"
#include "tests/unit/test_memory.h"

namespace kvbank::rpc {
namespace {

TEST(TimersTest, RunInDeadlineOrderAndNotWhenCancelled) {
  Timers timers;
  std::vector<int> order;
  absl::Mutex mu;
  absl::Notification last;
  const absl::Time now = absl::Now();
  timers.At(now + absl::Milliseconds(60), [&] {
    absl::MutexLock lock(&mu);
    order.push_back(3);
    last.Notify();
  });
  timers.At(now + absl::Milliseconds(20), [&] {
    absl::MutexLock lock(&mu);
    order.push_back(2);
  });
  const uint64_t dropped = timers.At(now + absl::Milliseconds(10), [&] {
    absl::MutexLock lock(&mu);
    order.push_back(99);
  });
  timers.At(now - absl::Seconds(1), [&] {
    absl::MutexLock lock(&mu);
    order.push_back(1);
  });
  EXPECT_TRUE(timers.Cancel(dropped));
  EXPECT_FALSE(timers.Cancel(dropped));
  ASSERT_TRUE(last.WaitForNotificationWithTimeout(absl::Seconds(20)));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
}

ModelLayout Tiny() {
  ModelLayout m = store_testing::GqaLayout("wait", 2, 2, 8, 4, DType::kFp16);
  m.num_q_heads = 2;  // one query head per KV head
  return m;
}

TEST(FetchWaitTest, GoesOnOnceWhicheverComesFirst) {
  const ModelLayout m = Tiny();
  const BlockLayout b = ComputeBlockLayout(m);
  StoreOptions o;
  o.default_lease = absl::ZeroDuration();
  auto made = testenv::CreateTestStore(m, 4096, o);
  ASSERT_TRUE(made.ok());
  std::shared_ptr<SequenceStore> store = *std::move(made);
  Timers timers;
  const std::vector<uint8_t> payload(PayloadLayout::Make(b, 0, 2, 4).total_bytes, 0x11);
  int ok = 0, timed_out = 0, cancelled = 0;
  for (int round = 0; round < 300; ++round) {
    auto seq = store->Create(WithLease(std::optional<absl::Duration>()));
    ASSERT_TRUE(seq.ok());
    std::atomic<int> refs{1}, goes{0};
    std::atomic<int> code{-1};
    absl::Notification done;
    FetchWait wait(
        &timers, [&] { refs.fetch_add(1); },
        [&] {
          if (refs.fetch_sub(1) == 1) done.Notify();
        });
    FetchSpec spec;
    spec.sequence_id = seq->id;
    spec.token_end = 4;
    wait.Begin(store, spec, absl::Microseconds(round % 7 * 150), [&](absl::Status s) {
      goes.fetch_add(1);
      code.store(int(s.code()));
    });
    // Race a commit and a cancel against the timer.
    std::thread committer([&] {
      AppendSpec a;
      a.sequence_id = seq->id;
      a.num_tokens = 4;
      EXPECT_TRUE(store->Append(a, payload).ok());
    });
    std::thread canceller([&] {
      if (round % 3 == 0) wait.Cancel();
    });
    committer.join();
    canceller.join();
    if (refs.fetch_sub(1) == 1) done.Notify();  // the caller's own reference
    ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(20))) << "a reference leaked";
    ASSERT_EQ(goes.load(), 1) << "round " << round;
    switch (absl::StatusCode(code.load())) {
      case absl::StatusCode::kOk:
        ++ok;
        break;
      case absl::StatusCode::kDeadlineExceeded:
        ++timed_out;
        break;
      case absl::StatusCode::kCancelled:
        ++cancelled;
        break;
      default:
        FAIL() << "go got " << code.load();
    }
  }
  EXPECT_EQ(store->Stats().fetches_waiting, 0u);
  std::printf("[fetch_wait] 300 races: %d committed first, %d timed out, %d cancelled\n", ok,
              timed_out, cancelled);
  EXPECT_GT(ok, 0);
}

}  // namespace
}  // namespace kvbank::rpc
