// Bounded-load placement over 3 and 8 real kvbankd on loopback: a hot shared system prompt
// spreads within the load bound, its prefix is copied where its load goes (once per replica,
// even under 64 concurrent creates), the hit rate stays that of one replica with the same total
// pool, Route explains the choice, and adding a replica moves only its share of the keys.
#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "kvbank/fleet.h"
#include "tests/integration/fleet_support.h"

namespace kvbank::integ {
namespace {

constexpr uint64_t kPoolPerReplica = 24 * kMiB;

// `n` token ids from `seed`, none of them shared with another seed's.
std::vector<uint32_t> Tokens(uint32_t seed, size_t n) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = seed * 100003u + static_cast<uint32_t>(i) + 1;
  return t;
}

struct TraceResult {
  std::map<std::string, uint64_t> placed;  // sequences per replica
  uint64_t prompt_tokens = 0, cached_tokens = 0;
  double HitRate() const { return double(cached_tokens) / double(prompt_tokens); }
};

// Runs the prompts in order, each as a request whose uncached KV is appended; the last `live`
// stay alive (0: all of them), as a serving engine's running batch.
absl::StatusOr<TraceResult> RunTrace(Fleet& fleet, const Client::ModelInfo& m,
                                     const std::vector<std::vector<uint32_t>>& prompts,
                                     size_t live) {
  TraceResult out;
  std::deque<Fleet::Sequence> running;
  for (const auto& prompt : prompts) {
    Client::CreateArgs args;
    args.prompt = prompt;
    auto seq = fleet.CreateSequence(kModel, args);
    if (!seq.ok()) return seq.status();
    ++out.placed[seq->replica];
    out.prompt_tokens += prompt.size();
    out.cached_tokens += seq->info.cached_tokens;
    Client::AppendArgs append;
    append.num_tokens = prompt.size() - seq->info.cached_tokens;
    append.token_ids = Slice(prompt, seq->info.cached_tokens, prompt.size());
    if (append.num_tokens > 0) {
      auto a = fleet.Append(*seq, append, Payload(m, append.num_tokens));
      if (!a.ok()) return a.status();
    }
    running.push_back(*seq);
    if (live > 0 && running.size() > live) {
      if (auto f = fleet.Free(running.front()); !f.ok()) return f.status();
      running.pop_front();
    }
  }
  return out;
}

// One shared 64-token system prompt, then a distinct 200-token user turn per request.
std::vector<std::vector<uint32_t>> SystemPromptTrace(size_t requests) {
  const std::vector<uint32_t> system = Tokens(1, 64);
  std::vector<std::vector<uint32_t>> out;
  for (size_t i = 0; i < requests; ++i) out.push_back(Concat(system, Tokens(1000 + i, 200)));
  return out;
}

// Three tenants (cache salts are not in the prompt, so distinct system prompts stand for them),
// each with two hot system prompts taking most requests and many cold ones used once or twice.
std::vector<std::vector<uint32_t>> HotAndColdTrace(size_t requests) {
  std::mt19937 rng(7);
  std::vector<std::vector<uint32_t>> out;
  for (size_t i = 0; i < requests; ++i) {
    const uint32_t tenant = rng() % 3;
    const bool hot = rng() % 10 < 7;
    const uint32_t prefix = hot ? 10 + tenant * 2 + rng() % 2 : 100 + rng() % 150;
    out.push_back(Concat(Tokens(prefix, hot ? 96 : 48), Tokens(5000 + i, 80)));
  }
  return out;
}

class FleetBalanceTest : public FleetTest, public ::testing::WithParamInterface<int> {
 protected:
  // A fleet over the replicas started so far, with the test model ensured.
  std::unique_ptr<Fleet> Connect(FleetOptions o = FastOptions()) {
    auto fleet = Fleet::Connect(StaticTarget(), o);
    EXPECT_TRUE(fleet.ok()) << fleet.status();
    if (!fleet.ok()) return nullptr;
    auto m = (*fleet)->EnsureModel(SmallLayout(kModel), kPoolPerReplica);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return nullptr;
    model_ = *m;
    return *std::move(fleet);
  }
  // The same trace on one more replica alone with the fleet's total pool (the baseline).
  double OneReplicaHitRate(const std::vector<std::vector<uint32_t>>& trace, int replicas,
                           size_t live) {
    auto server = ServerProcess::Start({"--no-auth", "--models="});
    EXPECT_TRUE(server.ok()) << server.status();
    if (!server.ok()) return 0;
    auto fleet = Fleet::Connect((*server)->target(), FastOptions());
    EXPECT_TRUE(fleet.ok()) << fleet.status();
    auto m = (*fleet)->EnsureModel(SmallLayout(kModel), kPoolPerReplica * replicas);
    EXPECT_TRUE(m.ok()) << m.status();
    auto r = RunTrace(**fleet, *m, trace, live);
    EXPECT_TRUE(r.ok()) << r.status();
    fleet->reset();
    EXPECT_TRUE((*server)->Stop().ok());
    return r.ok() ? r->HitRate() : 0;
  }
  static void ExpectWithinBound(const TraceResult& r, int replicas, double bound) {
    ASSERT_EQ(r.placed.size(), size_t(replicas));
    uint64_t total = 0;
    for (const auto& [name, n] : r.placed) total += n;
    const double mean = double(total) / replicas;
    for (const auto& [name, n] : r.placed) {
      EXPECT_LE(std::abs(double(n) - mean), bound * mean)
          << name << " holds " << n << " sequences; mean " << mean;
    }
  }

  Client::ModelInfo model_;
};

TEST_P(FleetBalanceTest, SharedSystemPromptSpreadsWithinTheBound) {
  const int n = GetParam();
  ASSERT_NO_FATAL_FAILURE(StartReplicas(n));
  auto fleet = Connect();
  ASSERT_NE(fleet, nullptr);
  const auto trace = SystemPromptTrace(300);
  auto r = RunTrace(*fleet, model_, trace, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectWithinBound(*r, n, 0.15);
  // Every sequence past the first found the system prompt cached where it landed.
  EXPECT_EQ(r->cached_tokens, 64u * (trace.size() - 1));
  const Fleet::Stats stats = fleet->GetStats();
  EXPECT_EQ(stats.placements, trace.size());
  EXPECT_GT(stats.bounded_placements, 0u);
  // The system prompt (4 blocks) went once to every other replica.
  EXPECT_EQ(stats.prefix_copies, uint64_t(n - 1));
  EXPECT_EQ(stats.copied_blocks, 4u * (n - 1));
  EXPECT_EQ(stats.copy_failures, 0u);
  uint64_t copies_in = 0, bytes_in = 0;
  for (const auto& rep : fleet->Replicas()) {
    auto st = fleet->ReplicaClient(rep.name)->GetStats(kModel);
    ASSERT_TRUE(st.ok()) << st.status();
    copies_in += st->front().prefix_copies_in;
    bytes_in += st->front().prefix_copy_bytes_in;
  }
  EXPECT_EQ(copies_in, stats.prefix_copies);
  EXPECT_EQ(bytes_in, stats.copied_bytes);
  // The fleet's load figures become the replicas' own counts (at the next health check).
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto loads_agree = [&] {
    for (const auto& rep : fleet->Replicas()) {
      if (rep.load != r->placed[rep.name]) return false;
    }
    return true;
  };
  while (!loads_agree() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  for (const auto& rep : fleet->Replicas()) EXPECT_EQ(rep.load, r->placed[rep.name]) << rep.name;

  const double one = OneReplicaHitRate(trace, n, 0);
  EXPECT_GE(r->HitRate(), 0.9 * one) << "fleet " << r->HitRate() << ", one replica " << one;
}

TEST_P(FleetBalanceTest, TwoSdkInstancesConvergeThroughTheReplicasReports) {
  const int n = GetParam();
  ASSERT_NO_FATAL_FAILURE(StartReplicas(n));
  auto a = Connect();
  auto b = Connect();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  // Two routers, no coordinator: each learns the other's sequences only from the replicas'
  // load reports (every 100 ms here). Each keeps its own placements within the bound and spreads
  // the rest evenly, so the sum stays near it; between two reports a view lags the other's
  // placements, which may take the home a few sequences past (1 + epsilon) x the mean.
  const auto trace = SystemPromptTrace(300);
  std::vector<std::vector<uint32_t>> odd, even;
  for (size_t i = 0; i < trace.size(); ++i) (i % 2 ? odd : even).push_back(trace[i]);
  absl::StatusOr<TraceResult> ra, rb;
  std::thread x([&] { ra = RunTrace(*a, model_, even, 0); });
  std::thread y([&] { rb = RunTrace(*b, model_, odd, 0); });
  x.join();
  y.join();
  ASSERT_TRUE(ra.ok()) << ra.status();
  ASSERT_TRUE(rb.ok()) << rb.status();
  TraceResult both;
  for (const TraceResult* r : {&*ra, &*rb}) {
    for (const auto& [name, count] : r->placed) both.placed[name] += count;
  }
  ExpectWithinBound(both, n, 0.2);
}

TEST_P(FleetBalanceTest, HotAndColdPrefixesKeepTheHitRateOfOneReplica) {
  const int n = GetParam();
  ASSERT_NO_FATAL_FAILURE(StartReplicas(n));
  auto fleet = Connect();
  ASSERT_NE(fleet, nullptr);
  const auto trace = HotAndColdTrace(400);
  const size_t live = 12 * n;  // a running batch of 12 per replica
  auto r = RunTrace(*fleet, model_, trace, live);
  ASSERT_TRUE(r.ok()) << r.status();
  const double one = OneReplicaHitRate(trace, n, live);
  EXPECT_GT(one, 0.3);  // the trace shares prefixes
  EXPECT_GE(r->HitRate(), 0.9 * one) << "fleet " << r->HitRate() << ", one replica " << one;
  ExpectWithinBound(*r, n, 0.15);
  EXPECT_EQ(fleet->GetStats().copy_failures, 0u);
}

TEST_P(FleetBalanceTest, ConcurrentCreatesCopyAHotPrefixOncePerReplica) {
  const int n = GetParam();
  ASSERT_NO_FATAL_FAILURE(StartReplicas(n));
  auto fleet = Connect();
  ASSERT_NE(fleet, nullptr);
  const std::vector<uint32_t> system = Tokens(2, 128);  // 8 blocks
  // Its first request fills it in on its home.
  auto first = RunTrace(*fleet, model_, {Concat(system, Tokens(3, 40))}, 0);
  ASSERT_TRUE(first.ok()) << first.status();

  constexpr int kCreates = 64;
  std::vector<std::thread> threads;
  absl::Mutex mu;
  std::vector<Fleet::Sequence> seqs;
  std::vector<absl::Status> errors;
  for (int i = 0; i < kCreates; ++i) {
    threads.emplace_back([&, i] {
      Client::CreateArgs args;
      args.prompt = Concat(system, Tokens(4000 + i, 40));
      auto seq = fleet->CreateSequence(kModel, args);
      absl::MutexLock lock(&mu);
      if (seq.ok()) {
        seqs.push_back(*seq);
      } else {
        errors.push_back(seq.status());
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(errors.empty()) << errors.front();
  std::map<std::string, int> per_replica;
  for (const auto& s : seqs) {
    ++per_replica[s.replica];
    // Copied before the create, never recomputed: every one attaches the whole system prompt.
    EXPECT_EQ(s.info.cached_tokens, system.size()) << s.replica;
  }
  EXPECT_GT(per_replica.size(), 1u);
  const Fleet::Stats stats = fleet->GetStats();
  const uint64_t prefix_bytes = system.size() * model_.payload_bytes_per_token;
  EXPECT_LE(stats.copied_bytes, uint64_t(n - 1) * prefix_bytes);
  EXPECT_EQ(stats.copied_bytes, (per_replica.size() - 1) * prefix_bytes);
  EXPECT_EQ(stats.prefix_copies, per_replica.size() - 1);
  EXPECT_EQ(stats.copy_failures, 0u);
  // The replicas count the same copies and bytes as having come in (GetStats, /metrics).
  uint64_t copies_in = 0, bytes_in = 0;
  for (const auto& r : fleet->Replicas()) {
    auto st = fleet->ReplicaClient(r.name)->GetStats(kModel);
    ASSERT_TRUE(st.ok()) << st.status();
    copies_in += st->front().prefix_copies_in;
    bytes_in += st->front().prefix_copy_bytes_in;
  }
  EXPECT_EQ(copies_in, stats.prefix_copies);
  EXPECT_EQ(bytes_in, stats.copied_bytes);
  // The replicas agree: each one the sequences landed on holds the system prompt.
  for (const auto& [name, count] : per_replica) {
    Client::MatchQuery q;
    q.tokens = system;
    auto held = fleet->ReplicaClient(name)->Match(kModel, {q});
    ASSERT_TRUE(held.ok()) << held.status();
    EXPECT_EQ(held->front(), system.size()) << name;
  }
}

TEST_P(FleetBalanceTest, RouteExplainsThePlacement) {
  const int n = GetParam();
  ASSERT_NO_FATAL_FAILURE(StartReplicas(n));
  auto fleet = Connect();
  ASSERT_NE(fleet, nullptr);
  const std::vector<uint32_t> system = Tokens(9, 64);
  Client::MatchQuery q;
  q.tokens = Concat(system, Tokens(10, 30));
  auto empty = fleet->Route(kModel, q);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->reason, "home");
  EXPECT_EQ(empty->replica, empty->home);
  EXPECT_EQ(empty->cached_tokens, 0u);
  EXPECT_EQ(empty->cost, q.tokens.size());
  EXPECT_EQ(*fleet->ReplicaFor(empty->key), empty->home);

  // The system prompt cached on the home, and the home loaded past the bound (sequences made
  // beside the fleet: it learns of them from the replica's report).
  ASSERT_TRUE(RunTrace(*fleet, model_, {Concat(system, Tokens(11, 30))}, 0).ok());
  auto home = fleet->ReplicaClient(empty->home);
  for (int i = 0; i < 2 * n; ++i)
    ASSERT_TRUE(home->CreateSequence(kModel, Client::CreateArgs{}).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto home_load = [&] {
    for (const auto& r : fleet->Replicas()) {
      if (r.name == empty->home) return r.load;
    }
    return uint64_t{0};
  };
  while (home_load() < uint64_t(2 * n + 1) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(home_load(), uint64_t(2 * n + 1));
  auto routed = fleet->Route(kModel, q);
  ASSERT_TRUE(routed.ok()) << routed.status();
  EXPECT_EQ(routed->home, empty->home);
  EXPECT_EQ(routed->reason, "over_load_bound");
  EXPECT_NE(routed->replica, routed->home);
  EXPECT_EQ(routed->home_load, uint64_t(2 * n + 1));
  EXPECT_EQ(routed->load, 0u);
  EXPECT_EQ(routed->load_bound, uint64_t(std::floor(1.15 * double(2 * n + 2) / n)));
  EXPECT_DOUBLE_EQ(routed->mean_load, double(2 * n + 2) / n);
  EXPECT_EQ(routed->cached_tokens, 0u);
  EXPECT_EQ(routed->copy_from, routed->home);
  EXPECT_EQ(routed->copy_from_cached_tokens, system.size());
  EXPECT_EQ(routed->copy_tokens, system.size());
  // CreateSequence goes where Route said.
  Client::CreateArgs args;
  args.prompt = q.tokens;
  auto seq = fleet->CreateSequence(kModel, args);
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(seq->replica, routed->replica);
  EXPECT_EQ(seq->info.cached_tokens, system.size());

  // Without a bound, placement is by key alone.
  FleetOptions by_key = FastOptions();
  by_key.load_epsilon.reset();
  auto plain = Connect(by_key);
  ASSERT_NE(plain, nullptr);
  auto r = plain->Route(kModel, q);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->reason, "by_key");
  EXPECT_EQ(r->replica, empty->home);
}

TEST_P(FleetBalanceTest, ConversationHistoryFollowsItsNextTurn) {
  const int n = GetParam();
  ASSERT_NO_FATAL_FAILURE(StartReplicas(n));
  auto fleet = Connect();
  ASSERT_NE(fleet, nullptr);
  // Turn 1 lands on its key's home; its prompt and answer are appended there.
  const std::vector<uint32_t> turn1 = Concat(Tokens(20, 64), Tokens(21, 90));
  Client::CreateArgs args;
  args.prompt = turn1;
  auto first = fleet->CreateSequence(kModel, args);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::vector<uint32_t> history = Concat(turn1, Tokens(22, 40));  // + the answer
  Client::AppendArgs append;
  append.num_tokens = history.size();
  append.token_ids = history;
  ASSERT_TRUE(fleet->Append(*first, append, Payload(model_, history.size())).ok());
  ASSERT_TRUE(fleet->Free(*first).ok());
  // The home gets busy (sequences made beside the fleet), so turn 2 goes elsewhere: its history
  // is copied there from the replica turn 1 was placed on, not recomputed.
  auto home = fleet->ReplicaClient(first->replica);
  for (int i = 0; i < 2 * n; ++i) {
    ASSERT_TRUE(home->CreateSequence(kModel, Client::CreateArgs{}).ok());
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto home_load = [&] {
    for (const auto& r : fleet->Replicas()) {
      if (r.name == first->replica) return r.load;
    }
    return uint64_t{0};
  };
  while (home_load() < uint64_t(2 * n) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  args.prompt = Concat(history, Tokens(23, 30));
  const uint64_t history_blocks = history.size() / kBt * kBt;
  auto routed = fleet->Route(kModel, {args.prompt, {}, "", {}});
  ASSERT_TRUE(routed.ok()) << routed.status();
  EXPECT_EQ(routed->copy_from, first->replica);
  EXPECT_EQ(routed->copy_tokens, history_blocks);
  EXPECT_EQ(routed->cost, args.prompt.size() - history_blocks);
  auto second = fleet->CreateSequence(kModel, args);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(second->replica, first->replica);
  EXPECT_EQ(second->info.cached_tokens, history_blocks);

  // Without copies the same turn on another replica recomputes its history.
  FleetOptions no_copies = FastOptions();
  no_copies.copy_prefixes = false;
  auto plain = Connect(no_copies);
  ASSERT_NE(plain, nullptr);
  args.prompt = Concat(history, Tokens(24, 30));
  auto third = plain->CreateSequence(kModel, args);
  ASSERT_TRUE(third.ok()) << third.status();
  // The home is past the bound and `second`'s replica holds one sequence: the third goes to an
  // idle replica, which has nothing of the history.
  EXPECT_NE(third->replica, first->replica);
  EXPECT_NE(third->replica, second->replica);
  EXPECT_EQ(third->info.cached_tokens, 0u);
  EXPECT_EQ(plain->GetStats().prefix_copies, 0u);
}

TEST_P(FleetBalanceTest, AddingAReplicaMovesItsShareOfKeys) {
  const int n = GetParam();
  ASSERT_NO_FATAL_FAILURE(StartReplicas(n + 1));
  std::vector<std::string> targets;
  for (const auto& s : servers_) targets.push_back(s->target());
  absl::Mutex mu;
  size_t members = n;
  FleetOptions o = FastOptions();
  o.resolver = [&]() -> absl::StatusOr<std::vector<std::string>> {
    absl::MutexLock lock(&mu);
    return std::vector<std::string>(targets.begin(), targets.begin() + members);
  };
  auto fleet = Fleet::Connect("replicas", o);
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  ASSERT_TRUE((*fleet)->EnsureModel(SmallLayout(kModel), kPoolPerReplica).ok());
  constexpr int kKeys = 3000;
  std::vector<std::string> before;
  for (int i = 0; i < kKeys; ++i) {
    auto key = (*fleet)->PlacementKey(kModel, Tokens(7000 + i, 32));
    ASSERT_TRUE(key.ok()) << key.status();
    before.push_back(*(*fleet)->ReplicaFor(*key));
  }
  {
    absl::MutexLock lock(&mu);
    members = n + 1;
  }
  ASSERT_TRUE((*fleet)->Refresh().ok());
  ASSERT_EQ((*fleet)->Replicas().size(), size_t(n + 1));
  const std::string added = absl::StrCat("kvbank-", n);
  int moved = 0;
  for (int i = 0; i < kKeys; ++i) {
    auto key = (*fleet)->PlacementKey(kModel, Tokens(7000 + i, 32));
    const std::string now = *(*fleet)->ReplicaFor(*key);
    if (now != before[i]) {
      ++moved;
      EXPECT_EQ(now, added) << "a key moved between two old replicas";
    }
  }
  const double expected = double(kKeys) / (n + 1);
  EXPECT_NEAR(moved, expected, 0.3 * expected);
}

INSTANTIATE_TEST_SUITE_P(Replicas, FleetBalanceTest, ::testing::Values(3, 8),
                         [](const auto& info) { return absl::StrCat(info.param, "Replicas"); });

}  // namespace
}  // namespace kvbank::integ
