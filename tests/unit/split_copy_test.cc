// SplitCopy (server/rpc/split_copy.h): a copy split over the asker and helpers.
#include "server/rpc/split_copy.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"

namespace kvbank::rpc {
namespace {

using Task = std::function<void()>;

SplitCopyOptions Opts(uint64_t piece_bytes, uint32_t max_helpers) {
  SplitCopyOptions o;
  o.piece_bytes = piece_bytes;
  o.max_helpers = max_helpers;
  return o;
}

// Records every piece copied; checks that no byte is copied twice.
struct Pieces {
  explicit Pieces(uint64_t total) : copied(total) {}
  absl::Status Copy(uint64_t at, uint64_t len) {
    for (uint64_t i = at; i < at + len; ++i) copied[i].fetch_add(1);
    calls.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu);
    threads.push_back(std::this_thread::get_id());
    return absl::OkStatus();
  }
  bool EachOnce() const {
    for (const auto& c : copied) {
      if (c.load() != 1) return false;
    }
    return true;
  }
  std::vector<std::atomic<int>> copied;
  std::atomic<int> calls{0};
  std::mutex mu;
  std::vector<std::thread::id> threads;
};

TEST(SplitCopyTest, HelpersOnThreadsCopyEveryByteOnce) {
  const uint64_t total = 10 * 1000 + 7;  // not a multiple of the piece
  Pieces p(total);
  std::vector<std::thread> threads;
  const std::atomic<bool> ended{false};
  const SplitCopyOptions o = Opts(100, 3);
  const absl::Status s = SplitCopy(
      total, o, [&](uint64_t at, uint64_t len) { return p.Copy(at, len); }, ended,
      [&](Task t) { threads.emplace_back(std::move(t)); });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(threads.size(), 3u);
  EXPECT_TRUE(p.EachOnce());
  EXPECT_EQ(p.calls.load(), 101);
  for (auto& t : threads) t.join();
  EXPECT_EQ(p.calls.load(), 101);  // helpers that ran late took nothing more
}

TEST(SplitCopyTest, HelpersThatNeverRunAreNotWaitedFor) {
  Pieces p(4096);
  std::vector<Task> never;
  const std::atomic<bool> ended{false};
  const absl::Status s = SplitCopy(
      4096, Opts(512, 4), [&](uint64_t at, uint64_t len) { return p.Copy(at, len); }, ended,
      [&](Task t) { never.push_back(std::move(t)); });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(never.size(), 4u);
  EXPECT_TRUE(p.EachOnce());
  for (const auto& id : p.threads) EXPECT_EQ(id, std::this_thread::get_id());
  // A helper scheduled after the copy returned finds it closed: it copies nothing.
  for (auto& t : never) t();
  EXPECT_EQ(p.calls.load(), 8);
}

TEST(SplitCopyTest, WaitsForAPieceAHelperStarted) {
  // The helper takes the first piece and holds it until the asker has copied the rest: the
  // asker must not return before the helper's piece is done.
  const uint64_t total = 3 * 64;
  std::vector<std::atomic<int>> copied(total);
  absl::Notification helper_holds, asker_done_with_rest;
  std::atomic<bool> returned{false};
  std::atomic<bool> helper_saw_returned{false};
  std::thread helper;
  const std::atomic<bool> ended{false};
  auto copy = [&](uint64_t at, uint64_t len) {
    if (at == 0) {  // the helper's: taken before the asker starts
      helper_holds.Notify();
      asker_done_with_rest.WaitForNotification();
      helper_saw_returned = returned.load();
    } else if (at == total - 64) {
      asker_done_with_rest.Notify();
    }
    for (uint64_t i = at; i < at + len; ++i) copied[i].fetch_add(1);
    return absl::OkStatus();
  };
  const absl::Status s = SplitCopy(total, Opts(64, 1), copy, ended, [&](Task t) {
    helper = std::thread(std::move(t));
    helper_holds.WaitForNotification();
  });
  returned = true;
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_FALSE(helper_saw_returned.load());
  for (const auto& c : copied) EXPECT_EQ(c.load(), 1);
  helper.join();
}

TEST(SplitCopyTest, FirstErrorEndsTheCopy) {
  std::atomic<int> calls{0};
  const std::atomic<bool> ended{false};
  const absl::Status s = SplitCopy(
      1000, Opts(100, 0),
      [&](uint64_t at, uint64_t) {
        calls.fetch_add(1);
        return at == 300 ? absl::InternalError("device failed at 300") : absl::OkStatus();
      },
      ended, [](Task) { FAIL() << "no helper was asked for"; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.message(), "device failed at 300");
  EXPECT_EQ(calls.load(), 4);  // in order, none after the failed piece
}

TEST(SplitCopyTest, AnEndedCallCopiesNoMore) {
  std::atomic<bool> ended{false};
  std::atomic<int> calls{0};
  const absl::Status s = SplitCopy(
      1000, Opts(100, 0),
      [&](uint64_t at, uint64_t) {
        calls.fetch_add(1);
        if (at == 200) ended = true;
        return absl::OkStatus();
      },
      ended, [](Task) {});
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(calls.load(), 3);
}

TEST(SplitCopyTest, NoMoreHelpersThanPiecesAfterTheFirst) {
  int spawned = 0;
  const std::atomic<bool> ended{false};
  Pieces p(250);
  EXPECT_TRUE(SplitCopy(
                  250, Opts(100, 8), [&](uint64_t at, uint64_t len) { return p.Copy(at, len); },
                  ended, [&](Task) { ++spawned; })
                  .ok());
  EXPECT_EQ(spawned, 2);
  EXPECT_TRUE(p.EachOnce());
  spawned = 0;
  EXPECT_TRUE(SplitCopy(
                  0, Opts(100, 8),
                  [](uint64_t, uint64_t) { return absl::InternalError("nothing to copy"); }, ended,
                  [&](Task) { ++spawned; })
                  .ok());
  EXPECT_EQ(spawned, 0);
}

}  // namespace
}  // namespace kvbank::rpc
