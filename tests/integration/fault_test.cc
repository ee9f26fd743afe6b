// Faults against the real kvbankd: clients SIGKILLed in the middle of appends and fetches, a
// bounded soak of random operations with every fetched token verified, messages that are not
// messages or are too large, and error messages that must not echo unbounded client input.
// Each test states what it measured in one "[fault] ..." summary line.
//
// Scale: KVBANK_FAULT_KILLS (iterations of each kill loop), KVBANK_SOAK_SECONDS and
// KVBANK_SOAK_THREADS override the defaults: 100 kills, 60 s and 4 threads in an optimized build;
// 25 kills and 15 s under AddressSanitizer, where everything runs several times slower.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "tests/integration/kv_reference.h"
#include "tests/integration/server_fixture.h"

#ifndef KVBANK_FAULT_CLIENT_PATH
#error \
    "KVBANK_FAULT_CLIENT_PATH must name the fault_client binary (tests/integration/CMakeLists.txt)"
#endif

#if defined(__SANITIZE_ADDRESS__)
#define KVBANK_FAULT_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVBANK_FAULT_SANITIZED 1
#endif
#endif
#ifndef KVBANK_FAULT_SANITIZED
#define KVBANK_FAULT_SANITIZED 0
#endif

namespace kvbank::integ {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = kKiB * 1024;
constexpr uint32_t kLayers = 2, kKvHeads = 2, kHeadDim = 32, kBlockTokens = 16;
constexpr uint64_t kRowBytes = kHeadDim * 2;                                    // one head, fp16
constexpr uint64_t kTokenBytes = uint64_t{kLayers} * 2 * kKvHeads * kRowBytes;  // 512
constexpr uint64_t kServerChunkBytes = 16 * kKiB;  // --chunk-bytes: fetches take many messages

// An integer from the environment, else the default of this build.
int64_t Knob(const char* name, int64_t optimized, int64_t sanitized) {
  int64_t v = 0;
  const char* s = std::getenv(name);
  if (s != nullptr && absl::SimpleAtoi(s, &v) && v > 0) return v;
  return KVBANK_FAULT_SANITIZED ? sanitized : optimized;
}

// 2 layers, 2 KV heads of 32, fp16, blocks of 16 tokens: 512 payload bytes per token.
ModelLayout SmallLayout(const std::string& name) {
  ModelLayout m;
  m.name = name;
  m.num_layers = kLayers;
  m.num_q_heads = 4;
  m.num_kv_heads = kKvHeads;
  m.head_dim = kHeadDim;
  m.head_dim_v = kHeadDim;
  m.block_tokens = kBlockTokens;
  m.kind = AttentionKind::kGqa;
  m.input_dtype = DType::kFp16;
  m.layer_dtypes.assign(m.num_layers, DType::kFp16);
  return m;
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

uint64_t Fnv(const std::vector<uint8_t>& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (uint8_t b : bytes) h = (h ^ b) * 1099511628211ull;
  return h;
}

// A field of /proc/<pid>/status (VmRSS, VmHWM) in KiB; -1 when it cannot be read.
int64_t ProcStatusKiB(pid_t pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) != 0) continue;
    std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    int64_t v = 0;
    if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &v)) return v;
  }
  return -1;
}
double MiB(int64_t kib) { return double(kib) / 1024.0; }

// Stats of one model; a failed call fails the test and returns zeros.
Client::ModelStats StatsOf(Client& client, const std::string& model) {
  auto stats = client.GetStats(model);
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok() || stats->size() != 1) return {};
  return (*stats)[0];
}

// Polls until `used` blocks are referenced and free + cached + used == total (a killed client's
// call is torn down once the server notices the closed connection), for up to `timeout`.
// Returns the last stats; the caller asserts on them.
Client::ModelStats AwaitPool(Client& admin, const std::string& model, uint64_t used,
                             absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + timeout;
  Client::ModelStats st = StatsOf(admin, model);
  while (!(st.blocks_used == used && st.blocks_free + st.blocks_cached + used == st.blocks_total) &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
    st = StatsOf(admin, model);
  }
  return st;
}

std::string PoolLine(const Client::ModelStats& st) {
  return absl::StrCat("used ", st.blocks_used, ", free ", st.blocks_free, ", cached ",
                      st.blocks_cached, ", total ", st.blocks_total);
}

// ---------------------------------------------------------------------------------------------
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

class FaultTest : public KvbankdTest {
 protected:
  void SetUp() override { signal(SIGPIPE, SIG_IGN); }  // writes to a killed child's stdin
  // NOTE: gRPC's Server::Shutdown waits for open client connections (up to --drain-timeout-ms),
  // so the clients go first and the drain is kept short.
  void TearDown() override {
    admin_.reset();
    KvbankdTest::TearDown();
  }
  void Start(std::vector<std::string> more = {}) {
    std::vector<std::string> flags = {"--models=", "--max-pool-bytes=1GiB",
                                      absl::StrCat("--chunk-bytes=", kServerChunkBytes),
                                      "--drain-timeout-ms=2000"};
    flags.insert(flags.end(), more.begin(), more.end());
    ASSERT_NO_FATAL_FAILURE(StartServer(flags));
    admin_ = NewClient();  // --no-auth: every caller is the admin tenant
    ASSERT_NE(admin_, nullptr);
  }
  uint64_t NewSequence(const std::string& model) {
    auto s = admin_->CreateSequence(model, absl::ZeroDuration());  // no lease: lives until freed
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->id : 0;
  }

  std::unique_ptr<Client> admin_;
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

// 1a. A client SIGKILLed in the middle of an append: the sequence is exactly as before (length,
// layer lengths, bytes), the append's blocks go back, and after everything is freed the pool is
// whole again. Every tenth append is let commit, to show the same checks see a change.
TEST_F(FaultTest, KilledAppendsLeaveNoPartialStateAndLeakNoBlocks) {
  const int64_t iterations = Knob("KVBANK_FAULT_KILLS", 100, 25);
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
    const Client::ModelStats st = AwaitPool(*admin_, model, expected_used());
    ASSERT_EQ(st.blocks_used, expected_used()) << PoolLine(st);
    ASSERT_EQ(st.blocks_free + st.blocks_cached + st.blocks_used, st.blocks_total) << PoolLine(st);
  }

  for (const Target& t : targets) ASSERT_TRUE(admin_->Free(model, t.id).ok());
  const Client::ModelStats st = AwaitPool(*admin_, model, 0);
  EXPECT_EQ(st.blocks_used, 0u) << PoolLine(st);
  EXPECT_EQ(st.blocks_free + st.blocks_cached, st.blocks_total) << PoolLine(st);
  std::cerr << "[fault] append kill loop: " << points.Line()
            << "; sequences found changed: " << partial
            << "; after freeing everything: " << PoolLine(st) << " (leaked " << st.blocks_used
            << ")\n";
}

// 1b. A client SIGKILLed in the middle of a fetch: nothing changes, and the blocks the fetch
// holds go back once the server notices, also when the sequence was freed under the fetch.
// Every tenth fetch is let complete and its bytes compared.
TEST_F(FaultTest, KilledFetchesChangeNothingAndLeakNoBlocks) {
  const int64_t iterations = Knob("KVBANK_FAULT_KILLS", 100, 25);
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
    const Client::ModelStats st = AwaitPool(*admin_, model, expected_used());
    ASSERT_EQ(st.blocks_used, expected_used()) << PoolLine(st);
    ASSERT_EQ(st.blocks_free + st.blocks_cached + st.blocks_used, st.blocks_total) << PoolLine(st);
  }

  for (const Target& t : targets) ASSERT_TRUE(admin_->Free(model, t.id).ok());
  const Client::ModelStats st = AwaitPool(*admin_, model, 0);
  EXPECT_EQ(st.blocks_used, 0u) << PoolLine(st);
  EXPECT_EQ(st.blocks_free + st.blocks_cached, st.blocks_total) << PoolLine(st);
  // The freed-under-a-fetch case means something only when the fetch still held the blocks.
  EXPECT_GT(held_freed_blocks, 0) << "no paused fetch held its sequence's blocks past Free";
  std::cerr << "[fault] fetch kill loop: " << points.Line()
            << "; sequences found changed: " << partial << "; " << freed_under_fetch
            << " sequences freed under a paused fetch (" << held_freed_blocks
            << " of them still held by it before the kill); after freeing everything: "
            << PoolLine(st) << " (leaked " << st.blocks_used << ")\n";
}

// ---------------------------------------------------------------------------------------------
// 2. The soak. Every token's bytes and token id derive from (key, position, layer): the key of a
// position is the sequence that first wrote it there (a fork's shared positions keep the
// parent's key, a prompt's positions the key of the sequence whose tokens it replays), so any
// fetch of any range is verified without keeping copies of the payloads.

uint64_t Mix(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9e3779b97f4a7c15ull + b + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint32_t TokenId(uint64_t key, uint64_t pos) {
  return static_cast<uint32_t>(Mix(key, pos) & 0x7fffffff);
}
// One head's row of one token in one layer, K (part 0) or V (part 1).
void FillRow(uint64_t key, uint64_t pos, uint32_t layer, uint32_t part, uint32_t head,
             uint8_t* out) {
  Random r(Mix(Mix(key, pos), (uint64_t{layer} << 16) | (part << 8) | head));
  r.Fill(out, kRowBytes);
}
// The payload (kvbank/layout.h order) of tokens [t0, t1) x layers [l0, l1), keys[t] per token.
std::vector<uint8_t> SoakPayload(const std::vector<uint64_t>& keys, uint64_t t0, uint64_t t1,
                                 uint32_t l0, uint32_t l1) {
  std::vector<uint8_t> out((t1 - t0) * (l1 - l0) * 2 * kKvHeads * kRowBytes);
  uint8_t* at = out.data();
  for (uint32_t l = l0; l < l1; ++l) {
    for (uint32_t part = 0; part < 2; ++part) {
      for (uint32_t h = 0; h < kKvHeads; ++h) {
        for (uint64_t t = t0; t < t1; ++t, at += kRowBytes) FillRow(keys[t], t, l, part, h, at);
      }
    }
  }
  return out;
}

struct SoakSeq {
  uint64_t id = 0;
  uint64_t key = 0;            // this sequence's own key
  uint64_t length = 0;         // tokens stored in every layer
  std::vector<uint64_t> keys;  // per position: stored tokens, then the prompt's rest
};

struct SoakCounts {
  uint64_t creates = 0, prompt_creates = 0, appends = 0, fetches = 0, forks = 0, truncates = 0;
  uint64_t frees = 0, full = 0, cached_tokens = 0, tokens_verified = 0;
  uint64_t mismatches = 0;  // (token, layer) rows fetched with other bytes than derived
  uint64_t errors = 0;      // calls that failed other than RESOURCE_EXHAUSTED on a full pool
  std::vector<std::string> first_errors;
  uint64_t ops() const { return creates + appends + fetches + forks + truncates + frees; }
  void Add(const SoakCounts& o) {
    creates += o.creates, prompt_creates += o.prompt_creates, appends += o.appends;
    fetches += o.fetches, forks += o.forks, truncates += o.truncates, frees += o.frees;
    full += o.full, cached_tokens += o.cached_tokens, tokens_verified += o.tokens_verified;
    mismatches += o.mismatches, errors += o.errors;
    for (const std::string& e : o.first_errors) {
      if (first_errors.size() < 8) first_errors.push_back(e);
    }
  }
};

// One soak thread: its own connection and sequences, random operations until `stop`.
class SoakWorker {
 public:
  static constexpr size_t kMaxLive = 12;
  static constexpr uint64_t kMaxLength = 600;

  SoakWorker(std::unique_ptr<Client> client, std::string model, uint32_t index, uint64_t seed)
      : client_(std::move(client)), model_(std::move(model)), index_(index), rng_(seed) {}

  void Run(const std::atomic<bool>& stop) {
    while (!stop.load(std::memory_order_relaxed)) Step();
  }
  // Verifies every live sequence in full and frees it.
  void Finish() {
    for (SoakSeq& s : live_) {
      if (s.length > 0) Verify(s, 0, s.length, 0, kLayers);
      auto f = client_->Free(model_, s.id);
      if (!f.ok()) Error("free", f.status());
    }
    live_.clear();
  }
  const SoakCounts& counts() const { return c_; }

 private:
  void Step() {
    const uint64_t r = rng_.Next() % 100;
    if (live_.empty() || (r < 10 && live_.size() < kMaxLive)) return Create();
    SoakSeq& s = live_[rng_.Next() % live_.size()];
    if (r < 45) return Append(s);
    if (r < 75) return Fetch(s);
    if (r < 83) return live_.size() < kMaxLive ? Fork(s) : Fetch(s);
    if (r < 91) return Truncate(s);
    return Free(rng_.Next() % live_.size());
  }

  uint64_t NewKey() { return (uint64_t{index_ + 1} << 40) | ++keys_made_; }

  void Create() {
    Client::CreateArgs args;
    args.lease = absl::ZeroDuration();
    SoakSeq s;
    s.key = NewKey();
    // Half of them replay a prefix of an earlier sequence: its cached full blocks are attached.
    if (!lineages_.empty() && rng_.Next() % 2 == 0) {
      const std::vector<uint64_t>& from = lineages_[rng_.Next() % lineages_.size()];
      s.keys.assign(from.begin(), from.begin() + 1 + rng_.Next() % from.size());
      for (uint64_t p = 0; p < s.keys.size(); ++p) args.prompt.push_back(TokenId(s.keys[p], p));
    }
    auto info = client_->CreateSequence(model_, args);
    ++c_.creates;
    if (!info.ok()) return Error("create", info.status());
    s.id = info->id;
    s.length = info->length;
    if (info->cached_tokens != info->length || info->length > s.keys.size() ||
        info->length % kBlockTokens != 0) {
      Error("create", absl::InternalError(absl::StrCat("length ", info->length, ", cached ",
                                                       info->cached_tokens, " of a ", s.keys.size(),
                                                       "-token prompt")));
    }
    if (!args.prompt.empty()) ++c_.prompt_creates;
    c_.cached_tokens += info->cached_tokens;
    live_.push_back(std::move(s));
    if (info->length > 0) Verify(live_.back(), 0, info->length, 0, kLayers);
  }

  void Append(SoakSeq& s) {
    const uint64_t n = 1 + rng_.Next() % 64;
    if (s.length + n > kMaxLength) return Truncate(s);
    std::vector<uint64_t> keys(s.keys.begin(), s.keys.begin() + s.length);
    for (uint64_t p = s.length; p < s.length + n; ++p) {
      keys.push_back(p < s.keys.size() ? s.keys[p] : s.key);
    }
    Client::AppendArgs args;
    args.num_tokens = n;
    for (uint64_t p = s.length; p < s.length + n; ++p)
      args.token_ids.push_back(TokenId(keys[p], p));
    auto info =
        client_->Append(model_, s.id, args, SoakPayload(keys, s.length, s.length + n, 0, kLayers));
    ++c_.appends;
    if (!info.ok()) {
      if (info.status().code() == absl::StatusCode::kResourceExhausted) {
        ++c_.full;  // the pool is full: nothing changed, which later fetches verify
        return;
      }
      return Error("append", info.status());
    }
    if (info->length != s.length + n) {
      Error("append",
            absl::InternalError(absl::StrCat("length ", info->length, ", want ", s.length + n)));
    }
    if (keys.size() < s.keys.size())
      keys.insert(keys.end(), s.keys.begin() + keys.size(), s.keys.end());
    s.keys = std::move(keys);
    s.length += n;
  }

  void Fetch(const SoakSeq& s) {
    if (s.length == 0) return;
    const uint64_t t0 = rng_.Next() % s.length;
    const uint64_t t1 = t0 + 1 + rng_.Next() % (s.length - t0);
    const uint32_t l0 = static_cast<uint32_t>(rng_.Next() % kLayers);
    const uint32_t l1 = l0 + 1 + static_cast<uint32_t>(rng_.Next() % (kLayers - l0));
    Verify(s, t0, t1, l0, l1);
  }

  void Verify(const SoakSeq& s, uint64_t t0, uint64_t t1, uint32_t l0, uint32_t l1) {
    Client::FetchArgs args;
    args.token_begin = t0;
    args.token_end = t1;
    args.layer_begin = l0;
    args.layer_end = l1;
    auto got = client_->Fetch(model_, s.id, args);
    ++c_.fetches;
    if (!got.ok()) return Error("fetch", got.status());
    const std::vector<uint8_t> want = SoakPayload(s.keys, t0, t1, l0, l1);
    c_.tokens_verified += t1 - t0;
    if (got->payload.size() != want.size()) {
      c_.mismatches += (t1 - t0) * (l1 - l0);
      return;
    }
    // Count the (token, layer) rows that differ: rows of one layer and token sit at
    // [layer][part][head][token] in the payload.
    const uint64_t n = t1 - t0;
    for (uint32_t l = 0; l < l1 - l0; ++l) {
      for (uint64_t t = 0; t < n; ++t) {
        bool same = true;
        for (uint32_t ph = 0; ph < 2 * kKvHeads && same; ++ph) {
          const uint64_t at = ((uint64_t{l} * 2 * kKvHeads + ph) * n + t) * kRowBytes;
          same = std::memcmp(got->payload.data() + at, want.data() + at, kRowBytes) == 0;
        }
        if (!same) ++c_.mismatches;
      }
    }
  }

  void Fork(const SoakSeq& parent) {
    auto info = client_->Fork(model_, parent.id);
    ++c_.forks;
    if (!info.ok()) {
      if (info.status().code() == absl::StatusCode::kResourceExhausted) {
        ++c_.full;
        return;
      }
      return Error("fork", info.status());
    }
    SoakSeq child = parent;
    child.id = info->id;
    child.key = NewKey();
    live_.push_back(std::move(child));
  }

  void Truncate(SoakSeq& s) {
    const uint64_t n = s.length == 0 ? 0 : rng_.Next() % (s.length + 1);
    auto info = client_->Truncate(model_, s.id, n);
    ++c_.truncates;
    if (!info.ok()) return Error("truncate", info.status());
    s.length = n;
    if (s.keys.size() > n) s.keys.resize(n);  // the server keeps token ids up to the new length
  }

  void Free(size_t i) {
    auto f = client_->Free(model_, live_[i].id);
    ++c_.frees;
    if (!f.ok()) return Error("free", f.status());
    if (live_[i].length >= kBlockTokens) {
      std::vector<uint64_t> keys(live_[i].keys.begin(), live_[i].keys.begin() + live_[i].length);
      if (lineages_.size() < 8) {
        lineages_.push_back(std::move(keys));
      } else {
        lineages_[rng_.Next() % lineages_.size()] = std::move(keys);
      }
    }
    live_.erase(live_.begin() + static_cast<ptrdiff_t>(i));
  }

  void Error(const char* op, const absl::Status& s) {
    ++c_.errors;
    if (c_.first_errors.size() < 4) c_.first_errors.push_back(absl::StrCat(op, ": ", s.ToString()));
  }

  std::unique_ptr<Client> client_;
  const std::string model_;
  const uint32_t index_;
  Random rng_;
  uint64_t keys_made_ = 0;
  std::vector<SoakSeq> live_;
  std::vector<std::vector<uint64_t>> lineages_;  // keys of freed sequences, for prompts
  SoakCounts c_;
};

// 2. A bounded soak: threads on their own connections create, append, fetch, fork, truncate and
// free at random; every fetch is verified token by token. Then: no mismatch, no failed call, no
// leaked block, server RSS at the end within 64 MiB of RSS after the warm-up, still serving.
TEST_F(FaultTest, SoakKeepsEveryTokenAndLeaksNothing) {
  const int64_t seconds = Knob("KVBANK_SOAK_SECONDS", 60, 15);
  const int64_t threads = Knob("KVBANK_SOAK_THREADS", 4, 4);
  constexpr int64_t kRssBoundKiB = 64 * 1024;
  ASSERT_NO_FATAL_FAILURE(Start());
  const std::string model = "soak";
  // 3072 blocks: the live sequences need at most about 4 x 12 x 38, so freed sequences' cached
  // blocks fill the rest and get evicted.
  auto info = admin_->EnsureModel(SmallLayout(model), 24 * kMiB);
  ASSERT_TRUE(info.ok()) << info.status();
  const uint64_t seed = 7301;
  std::cerr << "[fault] soak: seed " << seed << ", " << seconds << " s, " << threads
            << " threads\n";

  std::vector<std::unique_ptr<SoakWorker>> workers;
  for (int64_t t = 0; t < threads; ++t) {
    auto client = NewClient();
    ASSERT_NE(client, nullptr);
    workers.push_back(std::make_unique<SoakWorker>(std::move(client), model,
                                                   static_cast<uint32_t>(t), Mix(seed, t)));
  }
  std::atomic<bool> stop{false};
  std::vector<std::thread> running;
  const absl::Time start = absl::Now();
  for (auto& w : workers) running.emplace_back([&w, &stop] { w->Run(stop); });
  // Warm-up: a tenth of the run (at least 2 s), then the RSS the end is compared with.
  const absl::Duration total = absl::Seconds(seconds);
  absl::SleepFor(std::max(absl::Seconds(2), total / 10));
  const int64_t rss_warm = ProcStatusKiB(server_->pid(), "VmRSS");
  while (absl::Now() - start < total) absl::SleepFor(absl::Milliseconds(100));
  stop = true;
  for (std::thread& t : running) t.join();
  const int64_t rss_end = ProcStatusKiB(server_->pid(), "VmRSS");
  const int64_t rss_peak = ProcStatusKiB(server_->pid(), "VmHWM");
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);

  SoakCounts sum;
  for (auto& w : workers) {
    w->Finish();
    sum.Add(w->counts());
  }
  const Client::ModelStats st = AwaitPool(*admin_, model, 0);
  // Still serving: a fresh connection creates, appends, fetches and frees.
  auto probe = NewClient();
  ASSERT_NE(probe, nullptr);
  auto seq = probe->CreateSequence(model, absl::ZeroDuration());
  ASSERT_TRUE(seq.ok()) << seq.status();
  const std::vector<uint64_t> keys(3, 99);
  Client::AppendArgs args;
  args.num_tokens = 3;
  ASSERT_TRUE(probe->Append(model, seq->id, args, SoakPayload(keys, 0, 3, 0, kLayers)).ok());
  auto back = probe->Fetch(model, seq->id, {});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(BytesEqual(back->payload, SoakPayload(keys, 0, 3, 0, kLayers)));
  ASSERT_TRUE(probe->Free(model, seq->id).ok());

  std::cerr << "[fault] soak: " << elapsed << " s, " << threads << " threads, " << sum.ops()
            << " ops (create " << sum.creates << " of which " << sum.prompt_creates
            << " with a prompt, append " << sum.appends << ", fetch " << sum.fetches << ", fork "
            << sum.forks << ", truncate " << sum.truncates << ", free " << sum.frees << "), "
            << sum.tokens_verified << " tokens verified, " << sum.cached_tokens
            << " tokens attached from the prefix cache, " << sum.full
            << " calls refused on a full pool; checksum mismatches " << sum.mismatches
            << ", errors " << sum.errors << "; server RSS after warm-up " << MiB(rss_warm)
            << " MiB, at end " << MiB(rss_end) << " MiB (peak " << MiB(rss_peak)
            << " MiB, bound warm-up + 64 MiB); leaked blocks " << st.blocks_used << " ("
            << PoolLine(st) << ", evictions " << st.evictions << ")\n";
  EXPECT_EQ(sum.mismatches, 0u);
  EXPECT_EQ(sum.errors, 0u) << absl::StrJoin(sum.first_errors, "\n");
  EXPECT_GT(sum.tokens_verified, 0u);
  EXPECT_EQ(st.blocks_used, 0u) << PoolLine(st);
  EXPECT_EQ(st.blocks_free + st.blocks_cached, st.blocks_total) << PoolLine(st);
  ASSERT_GT(rss_warm, 0) << "cannot read /proc/" << server_->pid() << "/status";
  EXPECT_LE(rss_end, rss_warm + kRssBoundKiB)
      << "server RSS grew from " << rss_warm << " KiB to " << rss_end << " KiB";
}

// ---------------------------------------------------------------------------------------------
// 3 and 4: raw and malformed requests on every method of kvbank.v1.KvBank.

const char* CodeName(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    default:
      return "OTHER";
  }
}

// Every method of the service, from its descriptor: a method added later is covered too.
std::vector<const google::protobuf::MethodDescriptor*> KvBankMethods() {
  const google::protobuf::ServiceDescriptor* service =
      v1::EnsureModelRequest::descriptor()->file()->FindServiceByName("KvBank");
  std::vector<const google::protobuf::MethodDescriptor*> out;
  for (int i = 0; service != nullptr && i < service->method_count(); ++i) {
    out.push_back(service->method(i));
  }
  return out;
}
std::string MethodPath(const google::protobuf::MethodDescriptor* m) {
  return absl::StrCat("/", m->service()->full_name(), "/", m->name());
}

// A channel without client-side size limits, so that oversized messages reach the server.
std::shared_ptr<grpc::Channel> UnlimitedChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetMaxReceiveMessageSize(-1);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

// One call of any method, unary or streaming, whose only message is `bytes` as they are (a
// generic stub does no serialization). Blocks until the call ends.
grpc::Status RawCall(grpc::GenericStub& stub, const std::string& method, const std::string& bytes,
                     absl::Duration timeout = absl::Seconds(20)) {
  class Call final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    Call(grpc::GenericStub& stub, const std::string& method, const std::string& bytes,
         absl::Duration timeout) {
      ctx_.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
      grpc::Slice slice(bytes);
      request_ = grpc::ByteBuffer(&slice, 1);
      stub.PrepareBidiStreamingCall(&ctx_, method, grpc::StubOptions(), this);
      StartWriteLast(&request_, grpc::WriteOptions());
      StartRead(&response_);
      StartCall();
    }
    void OnReadDone(bool ok) override {
      if (ok) StartRead(&response_);
    }
    void OnDone(const grpc::Status& s) override {
      absl::MutexLock lock(&mu_);
      status_ = s;
      done_ = true;
    }
    grpc::Status Await() {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&done_));
      return status_;
    }

   private:
    grpc::ClientContext ctx_;
    grpc::ByteBuffer request_, response_;
    absl::Mutex mu_;
    bool done_ ABSL_GUARDED_BY(mu_) = false;
    grpc::Status status_ ABSL_GUARDED_BY(mu_);
  };
  Call call(stub, method, bytes, timeout);
  return call.Await();
}

// 3a. Bytes that are not a message, on every method: INVALID_ARGUMENT naming the request type,
// nothing changed, the server still serving.
TEST_F(FaultTest, GarbageOnEveryMethodIsInvalidArgumentNamingTheRequestType) {
  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_TRUE(admin_->EnsureModel(SmallLayout("m"), 1 * kMiB).ok());
  const uint64_t id = NewSequence("m");
  grpc::GenericStub stub(UnlimitedChannel(server_->target()));
  // An unterminated varint tag; a length-delimited field 1 that claims 127 bytes and has 1.
  const std::vector<std::string> garbage = {std::string("\xff\xff\xff", 3),
                                            std::string("\x0a\x7f\x01", 3)};
  const auto methods = KvBankMethods();
  ASSERT_EQ(methods.size(), 17u) << "kvbank.v1.KvBank changed: review this test's expectations";
  int wrong = 0;
  for (const auto* m : methods) {
    for (const std::string& bytes : garbage) {
      const grpc::Status s = RawCall(stub, MethodPath(m), bytes);
      const std::string type = m->input_type()->full_name();
      const bool right = s.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
                         absl::StrContains(s.error_message(), type);
      if (!right) ++wrong;
      EXPECT_TRUE(right) << m->name() << " with " << bytes.size()
                         << " garbage bytes: " << CodeName(s.error_code()) << " '"
                         << s.error_message() << "', want INVALID_ARGUMENT naming " << type;
    }
  }
  // Nothing changed; still serving.
  const Client::ModelStats st = StatsOf(*admin_, "m");
  EXPECT_EQ(st.sequences, 1u);
  EXPECT_EQ(st.appends, 0u);
  auto info = admin_->GetSequence("m", id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->length, 0u);
  std::cerr << "[fault] garbage: " << methods.size() << " methods x " << garbage.size()
            << " payloads, " << wrong << " not answered INVALID_ARGUMENT naming the request type\n";
}

// 3b. A message over the server's 4 MiB limit on every method: RESOURCE_EXHAUSTED, the server
// still serving. Then many at once: the server's RSS comes back within 64 MiB of where it was.
TEST_F(FaultTest, OversizedMessagesAreRefusedAndTheirMemoryReturns) {
  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_TRUE(admin_->EnsureModel(SmallLayout("m"), 1 * kMiB).ok());
  auto channel = UnlimitedChannel(server_->target());
  grpc::GenericStub stub(channel);
  const auto methods = KvBankMethods();
  ASSERT_FALSE(methods.empty());
  const std::string five_mib(5 * kMiB, 'x');
  for (const auto* m : methods) {
    const grpc::Status s = RawCall(stub, MethodPath(m), five_mib);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << m->name() << ": " << CodeName(s.error_code()) << " '" << s.error_message() << "'";
    ASSERT_TRUE(admin_->GetStats("m").ok()) << "kvbankd stopped serving after " << m->name();
  }

  // Two bursts, each of 8 connections sending 3 messages of 32 MiB to rotating methods at once.
  // The second shows whether the first's memory is reused or kept on top.
  constexpr int kSenders = 8, kEach = 3, kBursts = 2;
  constexpr int64_t kBoundKiB = 64 * 1024;
  const pid_t pid = server_->pid();
  const int64_t before = ProcStatusKiB(pid, "VmRSS");
  ASSERT_GT(before, 0) << "cannot read /proc/" << pid << "/status";
  const std::string big(32 * kMiB, 'y');
  std::string report;
  for (int burst = 0; burst < kBursts; ++burst) {
    std::atomic<bool> sampling{true};
    std::atomic<int64_t> peak{ProcStatusKiB(pid, "VmRSS")};
    std::thread sampler([&] {
      while (sampling.load()) {
        const int64_t rss = ProcStatusKiB(pid, "VmRSS");
        if (rss > peak.load()) peak = rss;
        absl::SleepFor(absl::Milliseconds(2));
      }
    });
    std::atomic<int> refused{0}, other{0};
    std::vector<std::thread> senders;
    const absl::Time start = absl::Now();
    for (int t = 0; t < kSenders; ++t) {
      senders.emplace_back([&, t] {
        grpc::GenericStub own(UnlimitedChannel(server_->target()));
        for (int i = 0; i < kEach; ++i) {
          const auto* m = methods[(t * kEach + i) % methods.size()];
          const grpc::Status s = RawCall(own, MethodPath(m), big, absl::Seconds(60));
          (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED ? refused : other)++;
        }
      });
    }
    for (std::thread& t : senders) t.join();
    const int64_t send_ms = MsSince(start);
    // The server's memory settles once the calls and connections are gone: poll with a deadline.
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    int64_t after = ProcStatusKiB(pid, "VmRSS");
    while (after > before + kBoundKiB && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
      after = ProcStatusKiB(pid, "VmRSS");
    }
    sampling = false;
    sampler.join();
    absl::StrAppend(&report, "; burst ", burst + 1, ": ", kSenders * kEach,
                    " concurrent 32 MiB messages in ", send_ms, " ms, ", refused.load(),
                    " RESOURCE_EXHAUSTED, ", other.load(), " other, RSS peak ", MiB(peak.load()),
                    " MiB, after ", MiB(after), " MiB");
    EXPECT_EQ(refused.load(), kSenders * kEach) << "burst " << burst + 1;
    EXPECT_LE(after, before + kBoundKiB) << "burst " << burst + 1 << ": server RSS " << after
                                         << " KiB, before the bursts " << before << " KiB";
    EXPECT_TRUE(admin_->GetStats("m").ok());
  }
  std::cerr << "[fault] oversized: server RSS before " << MiB(before) << " MiB" << report
            << " (bound: before + 64 MiB)\n";
}

// 4. A 9000-character string in every string (and bytes) field of every request that has one:
// the proper code, a status message under 1 KiB, and the same stock channel (default metadata
// limits) still working after each call. A message that echoes the whole input arrives as
// RESOURCE_EXHAUSTED (metadata too large) at such a client.
TEST_F(FaultTest, ErrorMessagesDoNotEchoLongInput) {
  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_TRUE(admin_->EnsureModel(SmallLayout("m"), 1 * kMiB).ok());
  const uint64_t id = NewSequence("m");
  auto stub = v1::KvBank::NewStub(
      grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
  const std::string big(9000, 'x');
  const std::string big_hash(9000, '\x01');
  const std::string hash(32, '\x02');
  using Code = grpc::StatusCode;
  const std::set<Code> kUnknownModel = {Code::NOT_FOUND, Code::INVALID_ARGUMENT};
  const std::set<Code> kAllowedOrRefused = {Code::OK, Code::INVALID_ARGUMENT};
  const std::set<Code> kRefused = {Code::INVALID_ARGUMENT};

  auto deadline = [](grpc::ClientContext* ctx) {
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  };
  std::vector<uint64_t> created;  // sequences a long cache_salt was allowed to create
  auto create = [&](const v1::CreateSequenceRequest& req) {
    grpc::ClientContext ctx;
    deadline(&ctx);
    v1::SequenceInfo resp;
    grpc::Status s = stub->CreateSequence(&ctx, req, &resp);
    if (s.ok()) created.push_back(resp.sequence_id());
    return s;
  };
  auto create_req = [&](const std::string& model) {
    v1::CreateSequenceRequest r;
    r.set_model(model);
    r.set_no_lease(true);
    return r;
  };
  auto spec = [&](const std::string& name) {
    v1::ModelSpec s;
    s.set_name(name);
    s.set_num_layers(2);
    s.set_num_kv_heads(2);
    s.set_head_dim(32);
    s.set_storage_dtype(v1::DTYPE_FP16);
    s.set_pool_bytes(1 * kMiB);
    return s;
  };
  auto match = [&](const v1::MatchRequest& req) {
    grpc::ClientContext ctx;
    deadline(&ctx);
    v1::MatchResponse resp;
    return stub->Match(&ctx, req, &resp);
  };
  auto pin = [&](const v1::PinRequest& req) {
    grpc::ClientContext ctx;
    deadline(&ctx);
    v1::PinResponse resp;
    return stub->Pin(&ctx, req, &resp);
  };
  auto fetch_blocks = [&](const v1::FetchBlocksRequest& req) {
    grpc::ClientContext ctx;
    deadline(&ctx);
    auto reader = stub->FetchBlocks(&ctx, req);
    v1::FetchResponse resp;
    while (reader->Read(&resp)) {
    }
    return reader->Finish();
  };
  auto prefix_root = [&](const v1::GetPrefixRootRequest& req) {
    grpc::ClientContext ctx;
    deadline(&ctx);
    v1::GetPrefixRootResponse resp;
    return stub->GetPrefixRoot(&ctx, req, &resp);
  };
  // A request for model "m" with one field made long.
  auto extra_key = [&](auto* keys) {
    v1::ExtraKey* k = keys->Add();
    k->set_kind(v1::EXTRA_KEY_KIND_LORA);
    k->set_value(big);
  };
  std::vector<uint32_t> block_of_tokens(kBlockTokens, 5);

  struct LongCase {
    std::string field;
    std::set<Code> codes;
    std::function<grpc::Status()> call;
  };
  const std::vector<LongCase> cases = {
      {"EnsureModel spec.name", kRefused,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::EnsureModelRequest req;
         *req.mutable_spec() = spec(big);
         v1::EnsureModelResponse resp;
         return stub->EnsureModel(&ctx, req, &resp);
       }},
      {"EnsureModel spec.preset", kRefused,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::EnsureModelRequest req;
         req.mutable_spec()->set_name("p");
         req.mutable_spec()->set_preset(big);
         v1::EnsureModelResponse resp;
         return stub->EnsureModel(&ctx, req, &resp);
       }},
      {"GetStats model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::GetStatsRequest req;
         req.set_model(big);
         v1::GetStatsResponse resp;
         return stub->GetStats(&ctx, req, &resp);
       }},
      {"CreateSequence model", kUnknownModel, [&] { return create(create_req(big)); }},
      {"CreateSequence cache_salt", kAllowedOrRefused,
       [&] {
         auto r = create_req("m");
         r.set_cache_salt(big);
         return create(r);
       }},
      {"CreateSequence extra_keys[0].value", kRefused,
       [&] {
         auto r = create_req("m");
         extra_key(r.mutable_extra_keys());
         return create(r);
       }},
      {"Append header.model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::AppendResponse resp;
         auto writer = stub->Append(&ctx, &resp);
         v1::AppendRequest req;
         req.mutable_header()->set_model(big);
         req.mutable_header()->set_sequence_id(id);
         req.mutable_header()->set_num_tokens(1);
         req.set_data(std::string(kTokenBytes, '\x11'));
         writer->Write(req);
         writer->WritesDone();
         return writer->Finish();
       }},
      {"Fetch model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::FetchRequest req;
         req.set_model(big);
         req.set_sequence_id(id);
         auto reader = stub->Fetch(&ctx, req);
         v1::FetchResponse resp;
         while (reader->Read(&resp)) {
         }
         return reader->Finish();
       }},
      {"Fork model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::ForkRequest req;
         req.set_model(big);
         req.set_sequence_id(id);
         v1::SequenceInfo resp;
         return stub->Fork(&ctx, req, &resp);
       }},
      {"Truncate model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::TruncateRequest req;
         req.set_model(big);
         req.set_sequence_id(id);
         v1::SequenceInfo resp;
         return stub->Truncate(&ctx, req, &resp);
       }},
      {"Free model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::FreeRequest req;
         req.set_model(big);
         req.set_sequence_id(id);
         v1::FreeResponse resp;
         return stub->Free(&ctx, req, &resp);
       }},
      {"RenewLease model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::RenewLeaseRequest req;
         req.set_model(big);
         req.set_sequence_id(id);
         v1::SequenceInfo resp;
         return stub->RenewLease(&ctx, req, &resp);
       }},
      {"GetSequence model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::GetSequenceRequest req;
         req.set_model(big);
         req.set_sequence_id(id);
         v1::SequenceInfo resp;
         return stub->GetSequence(&ctx, req, &resp);
       }},
      {"Match model", kUnknownModel,
       [&] {
         v1::MatchRequest req;
         req.set_model(big);
         req.add_queries()->add_token_ids(1);
         return match(req);
       }},
      {"Match queries[0].cache_salt", kAllowedOrRefused,
       [&] {
         v1::MatchRequest req;
         req.set_model("m");
         v1::MatchQuery* q = req.add_queries();
         q->add_token_ids(1);
         q->set_cache_salt(big);
         return match(req);
       }},
      {"Match queries[0].extra_keys[0].value", kRefused,
       [&] {
         v1::MatchRequest req;
         req.set_model("m");
         v1::MatchQuery* q = req.add_queries();
         q->add_token_ids(1);
         extra_key(q->mutable_extra_keys());
         return match(req);
       }},
      {"Match queries[0].block_hashes[0]", kRefused,
       [&] {
         v1::MatchRequest req;
         req.set_model("m");
         req.add_queries()->add_block_hashes(big_hash);
         return match(req);
       }},
      {"FetchBlocks model", kUnknownModel,
       [&] {
         v1::FetchBlocksRequest req;
         req.set_model(big);
         req.add_block_hashes(hash);
         return fetch_blocks(req);
       }},
      {"FetchBlocks block_hashes[0]", kRefused,
       [&] {
         v1::FetchBlocksRequest req;
         req.set_model("m");
         req.add_block_hashes(big_hash);
         return fetch_blocks(req);
       }},
      {"Pin model", kUnknownModel,
       [&] {
         v1::PinRequest req;
         req.set_model(big);
         req.add_block_hashes(hash);
         return pin(req);
       }},
      {"Pin block_hashes[0]", kRefused,
       [&] {
         v1::PinRequest req;
         req.set_model("m");
         req.add_block_hashes(big_hash);
         return pin(req);
       }},
      {"Pin cache_salt", kAllowedOrRefused,
       [&] {
         v1::PinRequest req;
         req.set_model("m");
         for (uint32_t t : block_of_tokens) req.add_token_ids(t);
         req.set_cache_salt(big);
         return pin(req);
       }},
      {"Pin extra_keys[0].value", kRefused,
       [&] {
         v1::PinRequest req;
         req.set_model("m");
         for (uint32_t t : block_of_tokens) req.add_token_ids(t);
         extra_key(req.mutable_extra_keys());
         return pin(req);
       }},
      {"GetPrefixRoot model", kUnknownModel,
       [&] {
         v1::GetPrefixRootRequest req;
         req.set_model(big);
         return prefix_root(req);
       }},
      {"GetPrefixRoot cache_salt", kAllowedOrRefused,
       [&] {
         v1::GetPrefixRootRequest req;
         req.set_model("m");
         req.set_cache_salt(big);
         return prefix_root(req);
       }},
      {"Watch model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::WatchRequest req;
         req.set_model(big);
         auto reader = stub->Watch(&ctx, req);
         v1::KvEventBatch batch;
         while (reader->Read(&batch)) {
         }
         return reader->Finish();
       }},
      {"Attend model", kUnknownModel,
       [&] {
         grpc::ClientContext ctx;
         deadline(&ctx);
         v1::AttendRequest req;
         req.set_model(big);
         v1::AttendItem* item = req.add_items();
         item->set_sequence_id(id);
         for (uint32_t i = 0; i < 4 * kHeadDim; ++i) item->add_query(0.5f);
         v1::AttendResponse resp;
         return stub->Attend(&ctx, req, &resp);
       }},
  };

  int wrong = 0;
  size_t longest = 0;
  for (const LongCase& c : cases) {
    const grpc::Status s = c.call();
    longest = std::max(longest, s.error_message().size());
    const bool code_ok = c.codes.count(s.error_code()) > 0;
    const bool message_ok =
        s.error_message().size() < 1024 && (s.ok() || !s.error_message().empty());
    // The same channel must still work: a GetStats of model "m".
    grpc::ClientContext ctx;
    deadline(&ctx);
    v1::GetStatsRequest req;
    req.set_model("m");
    v1::GetStatsResponse resp;
    const grpc::Status after = stub->GetStats(&ctx, req, &resp);
    if (!code_ok || !message_ok || !after.ok()) ++wrong;
    EXPECT_TRUE(code_ok) << c.field << ": " << CodeName(s.error_code()) << " '"
                         << s.error_message().substr(0, 200) << "'";
    EXPECT_TRUE(message_ok) << c.field << ": a " << s.error_message().size()
                            << "-character message";
    EXPECT_TRUE(after.ok()) << "after " << c.field
                            << " the channel fails: " << CodeName(after.error_code()) << " '"
                            << after.error_message() << "'";
  }
  for (uint64_t s : created) EXPECT_TRUE(admin_->Free("m", s).ok());
  // Nothing else changed: one model, one sequence.
  auto models = admin_->ListModels();
  ASSERT_TRUE(models.ok()) << models.status();
  ASSERT_EQ(models->size(), 1u);
  EXPECT_EQ((*models)[0].layout.name, "m");
  EXPECT_EQ(StatsOf(*admin_, "m").sequences, 1u);
  std::cerr << "[fault] long strings: " << cases.size() << " fields, " << wrong
            << " with a wrong code, a message of 1 KiB or more, or a broken channel after; the "
               "longest message had "
            << longest << " characters\n";
}

}  // namespace
}  // namespace kvbank::integ
