// Clients SIGKILLed in the middle of appends and fetches (fault_client is the child process),
// checked through the RPC after every kill: no partial state, no leaked blocks.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "tests/integration/fault_support.h"
#include "tests/integration/kv_reference.h"
#include "tests/integration/server_fixture.h"

#ifndef KVBANK_FAULT_CLIENT_PATH
#error \
    "KVBANK_FAULT_CLIENT_PATH must name the fault_client binary (tests/integration/CMakeLists.txt)"
#endif

namespace kvbank::integ {
namespace {

// A fault_client child process, paced through its stdin and reporting on its stdout.
class ChildClient {
 public:
  static std::unique_ptr<ChildClient> Start(std::vector<std::string> args) {
    args.insert(args.begin(), KVBANK_FAULT_CLIENT_PATH);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
      ADD_FAILURE() << "pipe2: " << strerror(errno);
      return nullptr;
    }
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid == 0) {  // async-signal-safe calls only until exec
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(126);
      dup2(in[0], 0);
      dup2(out[1], 1);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    if (pid < 0) {
      ADD_FAILURE() << "fork: " << strerror(errno);
      close(in[1]);
      close(out[0]);
      return nullptr;
    }
    std::unique_ptr<ChildClient> c(new ChildClient());
    c->pid_ = pid;
    c->in_ = in[1];
    c->out_ = out[0];
    return c;
  }
  ~ChildClient() {
    Kill();
    close(in_);
    close(out_);
  }

  void Send(char c, int times = 1) {
    for (int i = 0; i < times; ++i) {
      if (write(in_, &c, 1) != 1) return;  // the child is gone; its reports say how far it got
    }
  }
  // Reads reports until `cond` holds or the deadline passes; false on timeout or when the child
  // closed its stdout first.
  bool WaitUntil(const std::function<bool()>& cond, absl::Time deadline) {
    while (!cond()) {
      if (eof_ || absl::Now() >= deadline) return false;
      ReadFor(deadline);
    }
    return true;
  }
  // Reads reports until the deadline: a random moment to kill at, never a wait for an event.
  void ReadUntil(absl::Time deadline) {
    while (!eof_ && absl::Now() < deadline) ReadFor(deadline);
  }
  // SIGKILL, then reap; reads what the child reported before it died.
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    Reap();
  }
  // Waits for the child to exit (it must be finishing) and reads its last reports.
  void Reap() {
    if (pid_ <= 0) return;
    int status = 0;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    status_ = status;
    ReadUntil(absl::Now() + absl::Milliseconds(200));
  }

  bool ready() const { return ready_; }
  bool ended() const { return ended_; }
  uint64_t messages() const { return messages_; }
  bool done() const { return !done_.empty(); }
  // "CODE BYTES FNV" of the finished call.
  const std::string& done_line() const { return done_; }
  int wait_status() const { return status_; }

 private:
  ChildClient() = default;

  void ReadFor(absl::Time deadline) {
    const int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    pollfd p{out_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 100))) <= 0) return;
    char buf[4096];
    const ssize_t n = read(out_, buf, sizeof(buf));
    if (n <= 0) {
      if (n == 0 || errno != EINTR) eof_ = true;
      return;
    }
    pending_.append(buf, size_t(n));
    size_t nl;
    while ((nl = pending_.find('\n')) != std::string::npos) {
      const std::string line = pending_.substr(0, nl);
      pending_.erase(0, nl + 1);
      if (line == "ready") ready_ = true;
      if (line == "end") ended_ = true;
      if (line.rfind("msg ", 0) == 0) (void)absl::SimpleAtoi(line.substr(4), &messages_);
      if (line.rfind("done ", 0) == 0) done_ = line.substr(5);
    }
  }

  pid_t pid_ = -1;
  int in_ = -1, out_ = -1;
  int status_ = 0;
  bool eof_ = false, ready_ = false, ended_ = false;
  uint64_t messages_ = 0;
  std::string pending_, done_;
};

// A sequence of the kill loops and what it must hold.
struct Target {
  uint64_t id = 0;
  KvReference ref;
};

// Every target's length, layer lengths, block count and bytes, read back through the RPC.
// Returns how many targets differ from their reference (each difference is also a failure).
int ExpectTargets(Client& admin, const std::string& model, const std::vector<Target>& targets) {
  int differ = 0;
  for (const Target& t : targets) {
    SCOPED_TRACE(absl::StrCat("sequence ", t.id));
    auto info = admin.GetSequence(model, t.id);
    if (!info.ok()) {
      ADD_FAILURE() << info.status();
      ++differ;
      continue;
    }
    const uint64_t len = t.ref.length();
    bool same = info->length == len && info->layer_lengths == std::vector<uint64_t>(kLayers, len) &&
                info->num_blocks == CeilDiv(len, kBlockTokens);
    EXPECT_TRUE(same) << "length " << info->length << " (want " << len << "), layer lengths ["
                      << absl::StrJoin(info->layer_lengths, ",") << "], blocks "
                      << info->num_blocks;
    if (len > 0) {
      auto got = admin.Fetch(model, t.id, {});
      if (!got.ok()) {
        ADD_FAILURE() << got.status();
        same = false;
      } else {
        const ::testing::AssertionResult eq =
            BytesEqual(got->payload, t.ref.Payload(0, kLayers, 0, len));
        EXPECT_TRUE(eq);
        same = same && eq;
      }
    }
    if (!same) ++differ;
  }
  return differ;
}

// After a kill: the pool holds exactly the blocks the targets use (what the dead client had
// reserved or pinned is back), once the server has noticed. Fatal failure otherwise.
void ExpectPoolHolds(Client& admin, const std::string& model, uint64_t used) {
  const Client::ModelStats st = AwaitPool(admin, model, used);
  ASSERT_EQ(st.blocks_used, used) << PoolLine(st);
  ASSERT_EQ(st.blocks_free + st.blocks_cached + st.blocks_used, st.blocks_total) << PoolLine(st);
}

// The end of a loop: frees every target and expects the pool to hold nothing (no leak).
Client::ModelStats FreeAllAndAwaitEmpty(Client& admin, const std::string& model,
                                        const std::vector<Target>& targets) {
  for (const Target& t : targets) EXPECT_TRUE(admin.Free(model, t.id).ok());
  const Client::ModelStats st = AwaitPool(admin, model, 0);
  EXPECT_EQ(st.blocks_used, 0u) << PoolLine(st);
  EXPECT_EQ(st.blocks_free + st.blocks_cached, st.blocks_total) << PoolLine(st);
  return st;
}

// How far the killed calls had got, for the summary line.
struct KillPoints {
  int by_count = 0, by_time = 0, completed = 0;
  int before_first = 0, mid_stream = 0, after_last = 0;
  void Add(uint64_t at, uint64_t total) {
    if (at == 0) {
      ++before_first;
    } else if (at < total) {
      ++mid_stream;
    } else {
      ++after_last;
    }
  }
  std::string Line() const {
    return absl::StrCat(by_count + by_time, " kills (", by_count, " after a random message count, ",
                        by_time, " after a random 0-20 ms): ", before_first,
                        " before the first message, ", mid_stream, " mid-stream, ", after_last,
                        " after the last message; ", completed, " calls let complete");
  }
};

// A client SIGKILLed in the middle of an append: the sequence is exactly as before (length,
// layer lengths, bytes), the append's blocks go back, and after everything is freed the pool is
// whole again. Every tenth append is let commit, to show the same checks see a change.
TEST_F(FaultTest, KilledAppendsLeaveNoPartialStateAndLeakNoBlocks) {
  const int64_t iterations = Knob("KVBANK_FAULT_KILLS", 100, 100);
  ASSERT_NO_FATAL_FAILURE(Start());
  const std::string model = "kill-append";
  auto info = admin_->EnsureModel(SmallLayout(model), 16 * kMiB);
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->payload_bytes_per_token, kTokenBytes);
  const uint64_t seed = 7101;
  std::cerr << "[fault] append kill loop: seed " << seed << ", " << iterations << " iterations\n";
  Random rng(seed);

  // Empty; a partial block; three full blocks; a fork sharing those three.
  std::vector<Target> targets;
  for (uint64_t n : {0, 5, 48}) {
    Target t{NewSequence(model), KvReference(info->layout)};
    if (n > 0) {
      Client::AppendArgs args;
      args.num_tokens = n;
      auto a = admin_->Append(model, t.id, args, t.ref.Append(0, kLayers, n, rng));
      ASSERT_TRUE(a.ok()) << a.status();
    }
    targets.push_back(std::move(t));
  }
  auto fork = admin_->Fork(model, targets[2].id);
  ASSERT_TRUE(fork.ok()) << fork.status();
  targets.push_back({fork->id, targets[2].ref});
  constexpr uint64_t kShared = 3;  // full blocks the fork shares with its parent
  auto expected_used = [&] {
    uint64_t n = 0;
    for (const Target& t : targets) n += CeilDiv(t.ref.length(), kBlockTokens);
    return n - kShared;
  };
  ASSERT_EQ(ExpectTargets(*admin_, model, targets), 0);

  constexpr uint64_t kMsgBytes = 8 * kKiB;
  KillPoints points;
  int partial = 0;  // targets found different from their reference after a kill
  for (int64_t i = 0; i < iterations; ++i) {
    SCOPED_TRACE(absl::StrCat("iteration ", i));
    Target& t = targets[rng.Next() % targets.size()];
    const uint64_t n = 1 + rng.Next() % 400;
    const uint64_t payload_seed = rng.Next();
    const uint64_t total = 1 + CeilDiv(n * kTokenBytes, kMsgBytes);  // header, then data
    auto child = ChildClient::Start({"append", server_->target(), model, absl::StrCat(t.id),
                                     absl::StrCat(n), absl::StrCat(payload_seed),
                                     absl::StrCat(kLayers), absl::StrCat(kKvHeads),
                                     absl::StrCat(kHeadDim), absl::StrCat(kMsgBytes)});
    ASSERT_NE(child, nullptr);
    ASSERT_TRUE(child->WaitUntil([&] { return child->ready(); }, absl::Now() + absl::Seconds(20)))
        << "fault_client did not connect";
    if (i % 10 == 9) {
      child->Send('g');
      child->Send('c');
      ASSERT_TRUE(child->WaitUntil([&] { return child->done(); }, absl::Now() + absl::Seconds(30)));
      EXPECT_EQ(child->done_line(), "0 0 0") << "the append let commit failed";
      child->Reap();
      EXPECT_TRUE(WIFEXITED(child->wait_status()) && WEXITSTATUS(child->wait_status()) == 0)
          << "fault_client wait status " << child->wait_status();
      Random payload_rng(payload_seed);
      t.ref.Append(0, kLayers, n, payload_rng);
      ++points.completed;
    } else {
      if (rng.Next() % 2 == 0) {
        const uint64_t k = 1 + rng.Next() % total;
        child->Send('s', static_cast<int>(k));
        ASSERT_TRUE(child->WaitUntil([&] { return child->messages() >= k; },
                                     absl::Now() + absl::Seconds(20)))
            << "the child sent " << child->messages() << " of " << k << " messages";
        ++points.by_count;
      } else {
        child->Send('g');
        child->ReadUntil(absl::Now() + absl::Microseconds(rng.Next() % 20000));
        ++points.by_time;
      }
      child->Kill();
      EXPECT_FALSE(child->done()) << "the append was never let commit";
      points.Add(child->messages(), total);
    }
    child.reset();
    const int differ = ExpectTargets(*admin_, model, targets);
    partial += differ;
    ASSERT_EQ(differ, 0);
    ASSERT_NO_FATAL_FAILURE(ExpectPoolHolds(*admin_, model, expected_used()));
  }

  const Client::ModelStats st = FreeAllAndAwaitEmpty(*admin_, model, targets);
  std::cerr << "[fault] append kill loop: " << points.Line()
            << "; sequences found changed: " << partial
            << "; after freeing everything: " << PoolLine(st) << " (leaked " << st.blocks_used
            << ")\n";
}

// A client SIGKILLed in the middle of a fetch: nothing changes, and the blocks the fetch
// holds go back once the server notices, also when the sequence was freed under the fetch.
// Every tenth fetch is let complete and its bytes compared.
TEST_F(FaultTest, KilledFetchesChangeNothingAndLeakNoBlocks) {
  const int64_t iterations = Knob("KVBANK_FAULT_KILLS", 100, 100);
  ASSERT_NO_FATAL_FAILURE(Start());
  const std::string model = "kill-fetch";
  auto info = admin_->EnsureModel(SmallLayout(model), 40 * kMiB);
  ASSERT_TRUE(info.ok()) << info.status();
  const uint64_t seed = 7201;
  std::cerr << "[fault] fetch kill loop: seed " << seed << ", " << iterations << " iterations\n";
  Random rng(seed);

  // 8 MiB (more than gRPC's flow-control windows: the server is still sending when the client
  // dies), 1.5 MiB, and a partial block.
  std::vector<Target> targets;
  auto fill = [&](Target& t, uint64_t n) {
    t.id = NewSequence(model);
    Client::AppendArgs args;
    args.num_tokens = n;
    auto a = admin_->Append(model, t.id, args, t.ref.Payload(0, kLayers, 0, n));
    ASSERT_TRUE(a.ok()) << a.status();
  };
  for (uint64_t n : {16384, 3001, 7}) {
    Target t{0, KvReference(info->layout)};
    t.ref.Append(0, kLayers, n, rng);
    ASSERT_NO_FATAL_FAILURE(fill(t, n));
    targets.push_back(std::move(t));
  }
  auto expected_used = [&] {
    uint64_t n = 0;
    for (const Target& t : targets) n += CeilDiv(t.ref.length(), kBlockTokens);
    return n;
  };

  KillPoints points;
  int partial = 0;  // targets found different from their reference after a kill
  int freed_under_fetch = 0, held_freed_blocks = 0;
  for (int64_t i = 0; i < iterations; ++i) {
    SCOPED_TRACE(absl::StrCat("iteration ", i));
    Target& t = targets[rng.Next() % 2 == 0 ? 0 : rng.Next() % targets.size()];
    const uint64_t len = t.ref.length();
    uint64_t t0 = 0, t1 = len;
    if (rng.Next() % 2 == 0) {  // else the whole sequence
      t0 = rng.Next() % len;
      t1 = t0 + 1 + rng.Next() % (len - t0);
    }
    const uint32_t l0 = static_cast<uint32_t>(rng.Next() % kLayers);
    const uint32_t l1 = l0 + 1 + static_cast<uint32_t>(rng.Next() % (kLayers - l0));
    const uint64_t bytes = (t1 - t0) * (l1 - l0) * 2 * kKvHeads * kRowBytes;
    const uint64_t total = std::max<uint64_t>(1, CeilDiv(bytes, kServerChunkBytes));
    auto child =
        ChildClient::Start({"fetch", server_->target(), model, absl::StrCat(t.id), absl::StrCat(t0),
                            absl::StrCat(t1), absl::StrCat(l0), absl::StrCat(l1)});
    ASSERT_NE(child, nullptr);
    ASSERT_TRUE(child->WaitUntil([&] { return child->ready(); }, absl::Now() + absl::Seconds(20)))
        << "fault_client did not connect";
    if (i % 10 == 9) {
      child->Send('g');
      child->Send('c');
      ASSERT_TRUE(child->WaitUntil([&] { return child->done(); }, absl::Now() + absl::Seconds(30)));
      EXPECT_EQ(child->done_line(),
                absl::StrCat("0 ", bytes, " ", Fnv(t.ref.Payload(l0, l1, t0, t1))))
          << "fetch of tokens [" << t0 << ", " << t1 << ") layers [" << l0 << ", " << l1 << ")";
      child->Reap();
      EXPECT_TRUE(WIFEXITED(child->wait_status()) && WEXITSTATUS(child->wait_status()) == 0)
          << "fault_client wait status " << child->wait_status();
      ++points.completed;
    } else if (i % 10 == 4 && total >= 4) {
      // The sequence is freed while the paused fetch still streams it; the fetch's references
      // keep its blocks until the server sees the client die.
      const uint64_t k = 1 + rng.Next() % (total / 2);
      child->Send('s', static_cast<int>(k));
      ASSERT_TRUE(child->WaitUntil([&] { return child->messages() >= k; },
                                   absl::Now() + absl::Seconds(20)));
      ASSERT_TRUE(admin_->Free(model, t.id).ok());
      const uint64_t used_after_free = expected_used() - CeilDiv(len, kBlockTokens);
      if (StatsOf(*admin_, model).blocks_used > used_after_free) ++held_freed_blocks;
      child->Kill();
      ++points.by_count;
      ++freed_under_fetch;
      points.Add(child->messages(), total);
      const Client::ModelStats st = AwaitPool(*admin_, model, used_after_free);
      ASSERT_EQ(st.blocks_used, used_after_free) << PoolLine(st);
      ASSERT_NO_FATAL_FAILURE(fill(t, len));
    } else {
      if (rng.Next() % 2 == 0) {
        const uint64_t k = 1 + rng.Next() % total;
        child->Send('s', static_cast<int>(k));
        ASSERT_TRUE(child->WaitUntil([&] { return child->messages() >= k; },
                                     absl::Now() + absl::Seconds(20)))
            << "the child read " << child->messages() << " of " << k << " messages";
        ++points.by_count;
      } else {
        child->Send('g');
        child->ReadUntil(absl::Now() + absl::Microseconds(rng.Next() % 20000));
        ++points.by_time;
      }
      child->Kill();
      points.Add(child->messages(), total);
    }
    child.reset();
    const int differ = ExpectTargets(*admin_, model, targets);
    partial += differ;
    ASSERT_EQ(differ, 0);
    ASSERT_NO_FATAL_FAILURE(ExpectPoolHolds(*admin_, model, expected_used()));
  }

  const Client::ModelStats st = FreeAllAndAwaitEmpty(*admin_, model, targets);
  // The freed-under-a-fetch case means something only when the fetch still held the blocks.
  EXPECT_GT(held_freed_blocks, 0) << "no paused fetch held its sequence's blocks past Free";
  std::cerr << "[fault] fetch kill loop: " << points.Line()
            << "; sequences found changed: " << partial << "; " << freed_under_fetch
            << " sequences freed under a paused fetch (" << held_freed_blocks
            << " of them still held by it before the kill); after freeing everything: "
            << PoolLine(st) << " (leaked " << st.blocks_used << ")\n";
}

}  // namespace
}  // namespace kvbank::integ
