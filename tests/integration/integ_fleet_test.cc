// kvbank::Fleet over several real kvbankd on loopback: placement by prefix, the prefix-cache hit
// rate of a sharded shared-prefix trace, a replica SIGKILLed mid-run, a replica added and one
// removed, roots equal on every replica, Match routed, merged KV events.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvbank/client.h"
#include "kvbank/fleet.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "tests/integration/fleet_support.h"

namespace kvbank::integ {
namespace {

TEST_F(FleetTest, RootsAgreeAndMatchIsRouted) {
  ASSERT_NO_FATAL_FAILURE(StartReplicas(3));
  auto fleet = Fleet::Connect(StaticTarget(), ByKeyOptions());
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  ASSERT_EQ((*fleet)->Replicas().size(), 3u);
  for (const auto& r : (*fleet)->Replicas()) EXPECT_TRUE(r.healthy) << r.name << ": " << r.reason;
  auto m = (*fleet)->EnsureModel(SmallLayout(kModel), 4 * kMiB);
  ASSERT_TRUE(m.ok()) << m.status();

  // The root is the same on every replica, and the one the SDK computes, with and without salt.
  for (const std::string salt : {"", "salt-a"}) {
    auto mine = (*fleet)->PrefixRoot(kModel, salt);
    ASSERT_TRUE(mine.ok()) << mine.status();
    for (const auto& r : (*fleet)->Replicas()) {
      auto theirs = (*fleet)->ReplicaClient(r.name)->GetPrefixRoot(kModel, salt);
      ASSERT_TRUE(theirs.ok()) << theirs.status();
      EXPECT_EQ(HashToHex(theirs->root), HashToHex(mine->root)) << r.name << " salt " << salt;
    }
    auto routed = (*fleet)->GetPrefixRoot(kModel, salt);
    ASSERT_TRUE(routed.ok()) << routed.status();
    EXPECT_EQ(routed->root, mine->root);
  }

  // Prompts sharing a first block land on one replica; Match through the fleet answers what
  // that replica answers, and the other replicas hold nothing of it.
  std::set<std::string> used;
  for (uint64_t p = 0; p < 12; ++p) {
    const std::vector<uint32_t> prefix = Tokens(100 + p, 3 * kBt);
    std::string first, second;
    auto c1 = Serve(**fleet, *m, Concat(prefix, Tokens(200 + p, 7)), &first);
    ASSERT_TRUE(c1.ok()) << c1.status();
    auto c2 = Serve(**fleet, *m, Concat(prefix, Tokens(300 + p, 21)), &second);
    ASSERT_TRUE(c2.ok()) << c2.status();
    EXPECT_EQ(first, second);
    EXPECT_EQ(*c2, 3 * kBt) << "the shared prefix was not found on " << second;
    used.insert(first);
    Client::MatchQuery q;
    q.tokens = Concat(prefix, Tokens(400 + p, 40));
    auto routed = (*fleet)->Match(kModel, {q});
    ASSERT_TRUE(routed.ok()) << routed.status();
    EXPECT_EQ((*routed)[0], 3 * kBt);
    for (const auto& r : (*fleet)->Replicas()) {
      auto direct = (*fleet)->ReplicaClient(r.name)->Match(kModel, {q});
      ASSERT_TRUE(direct.ok()) << direct.status();
      EXPECT_EQ((*direct)[0], r.name == first ? 3 * kBt : 0u) << r.name;
    }
    auto key = (*fleet)->PlacementKey(kModel, prefix);
    ASSERT_TRUE(key.ok());
    EXPECT_EQ(*(*fleet)->ReplicaFor(*key), first);
  }
  EXPECT_EQ(used.size(), 3u) << "12 prefixes all on " << *used.begin();
}

TEST_F(FleetTest, ReplicaNameDefaultsToHostName) {
  auto server = ServerProcess::Start({"--no-auth", "--models="});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Client::Connect((*server)->target());
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->WaitForServing(absl::Seconds(20)));
  auto info = (*client)->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof(host) - 1), 0);
  EXPECT_EQ(info->replica, host);
  EXPECT_TRUE((*server)->Stop().ok());
}

TEST_F(FleetTest, ReplicaWithAnotherHashIsRefused) {
  ASSERT_NO_FATAL_FAILURE(StartReplicas(1));
  ASSERT_NO_FATAL_FAILURE(StartReplicas(1, {"--hash-algorithm=xxh3_128"}));
  auto fleet = Fleet::Connect(StaticTarget(), ByKeyOptions());
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  ASSERT_TRUE((*fleet)->EnsureModel(SmallLayout(kModel), 4 * kMiB).ok());
  auto root = (*fleet)->PrefixRoot(kModel);
  ASSERT_EQ(root.status().code(), absl::StatusCode::kFailedPrecondition) << root.status();
  EXPECT_TRUE(absl::StrContains(root.status().message(), "kvbank-0")) << root.status();
  EXPECT_TRUE(absl::StrContains(root.status().message(), "kvbank-1")) << root.status();
  EXPECT_TRUE(absl::StrContains(root.status().message(), "hash algorithm")) << root.status();
}

TEST_F(FleetTest, DnsTargetKeysReplicasByName) {
  ASSERT_NO_FATAL_FAILURE(StartReplicas(1));
  // localhost resolves to 127.0.0.1 (and maybe ::1, where nothing listens): one replica.
  auto fleet =
      Fleet::Connect(absl::StrCat("dns:///localhost:", servers_[0]->port()), ByKeyOptions());
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  auto replicas = (*fleet)->Replicas();
  ASSERT_EQ(replicas.size(), 1u);
  EXPECT_EQ(replicas[0].name, "kvbank-0");
  EXPECT_EQ(replicas[0].address, servers_[0]->target());
  EXPECT_EQ(Fleet::Connect("dns://authority/x:1").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Fleet::Connect("127.0.0.1").status().code(), absl::StatusCode::kInvalidArgument);
}

// A shared-prefix trace: many requests over a few long system prompts with distinct suffixes.
// 3 replicas of a third of the pool each against 1 replica with the whole pool: the sharded hit
// rate must be at least 90% of the single replica's, although the prefixes do not fit in one
// replica's pool.
TEST_F(FleetTest, ShardedHitRateMatchesOneBigReplica) {
  constexpr int kPrefixes = 24;
  constexpr int kPrefixBlocks = 8;
  constexpr int kRequests = 600;
  const uint64_t block_bytes = BlockBytes(SmallLayout(kModel));
  const uint64_t total_blocks = 480;
  ASSERT_GT(uint64_t{kPrefixes} * kPrefixBlocks, total_blocks / 3)
      << "the prefixes must not fit in one replica's third";
  std::vector<std::vector<uint32_t>> prefixes;
  for (int p = 0; p < kPrefixes; ++p) prefixes.push_back(Tokens(1000 + p, kPrefixBlocks * kBt));
  Random rng(42);
  std::vector<std::vector<uint32_t>> trace;
  for (int i = 0; i < kRequests; ++i) {
    const auto& prefix = prefixes[rng.Next() % kPrefixes];
    trace.push_back(Concat(prefix, Tokens(5000 + i, 20 + rng.Next() % 21)));
  }
  uint64_t prompt_tokens = 0;
  for (const auto& t : trace) prompt_tokens += t.size();

  ASSERT_NO_FATAL_FAILURE(StartReplicas(4));
  auto run = [&](const std::string& target, uint64_t pool_bytes,
                 std::map<std::string, int>* per_replica) -> double {
    auto fleet = Fleet::Connect(target, ByKeyOptions());
    EXPECT_TRUE(fleet.ok()) << fleet.status();
    if (!fleet.ok()) return 0;
    auto m = (*fleet)->EnsureModel(SmallLayout(kModel), pool_bytes);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return 0;
    EXPECT_LE(m->num_blocks * m->block_bytes, pool_bytes);
    uint64_t cached = 0;
    for (const auto& prompt : trace) {
      std::string replica;
      auto c = Serve(**fleet, *m, prompt, &replica);
      EXPECT_TRUE(c.ok()) << c.status();
      if (!c.ok()) return 0;
      cached += *c;
      ++(*per_replica)[replica];
    }
    return double(cached) / double(prompt_tokens);
  };
  std::map<std::string, int> one, three;
  const double single = run(servers_[3]->target(), total_blocks * block_bytes, &one);
  const std::string sharded_target =
      absl::StrCat(servers_[0]->target(), ",", servers_[1]->target(), ",", servers_[2]->target());
  const double sharded = run(sharded_target, total_blocks / 3 * block_bytes, &three);
  std::cerr << "hit rate: 1 replica " << single << ", 3 replicas " << sharded << ", ratio "
            << sharded / single << "; requests per replica:";
  for (const auto& [name, n] : three) std::cerr << " " << name << "=" << n;
  std::cerr << "\n";
  EXPECT_EQ(three.size(), 3u);
  ASSERT_GT(single, 0.5);
  EXPECT_GE(sharded / single, 0.9);
}

TEST_F(FleetTest, KilledReplicaFailsOnlyItsOwnSequences) {
  ASSERT_NO_FATAL_FAILURE(StartReplicas(3));
  auto fleet = Fleet::Connect(StaticTarget(), ByKeyOptions());
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  auto m = (*fleet)->EnsureModel(SmallLayout(kModel), 4 * kMiB);
  ASSERT_TRUE(m.ok()) << m.status();

  // Live sequences on every replica.
  std::vector<Fleet::Sequence> seqs;
  std::map<std::string, int> per_replica;
  for (int i = 0; i < 60; ++i) {
    Client::CreateArgs args;
    args.prompt = Tokens(7000 + i, 2 * kBt);
    auto seq = (*fleet)->CreateSequence(kModel, args);
    ASSERT_TRUE(seq.ok()) << seq.status();
    Client::AppendArgs append;
    append.num_tokens = 2 * kBt;
    append.token_ids = args.prompt;
    ASSERT_TRUE((*fleet)->Append(*seq, append, Payload(*m, 2 * kBt)).ok());
    ++per_replica[seq->replica];
    seqs.push_back(*seq);
  }
  ASSERT_EQ(per_replica.size(), 3u);
  const std::string victim = seqs[0].replica;
  const int victim_index = victim.back() - '0';

  // Requests run on two threads while the victim is killed.
  std::atomic<bool> killed{false}, stop{false};
  std::atomic<int> ok_after_kill{0}, failed{0};
  absl::Mutex mu;
  std::vector<std::string> bad;  // failures that are not the victim's in-flight requests
  auto worker = [&](int w) {
    for (int i = 0; !stop.load(); ++i) {
      const bool after = killed.load();
      std::string replica;
      auto c = Serve(**fleet, *m, Tokens(90000 + i * 2 + w, kBt + 18), &replica);
      if (c.ok()) {
        if (after) ++ok_after_kill;
        continue;
      }
      ++failed;
      // Only a request whose sequence was already on the victim may fail, and says so.
      if (!absl::IsUnavailable(c.status()) ||
          !absl::StrContains(c.status().message(), "replica " + victim)) {
        absl::MutexLock lock(&mu);
        bad.push_back(c.status().ToString());
      }
    }
  };
  std::thread t0(worker, 0), t1(worker, 1);
  absl::SleepFor(absl::Milliseconds(200));  // let the workers run before the kill
  servers_[victim_index]->SendSignal(SIGKILL);
  EXPECT_FALSE(servers_[victim_index]->WaitForExit(absl::Seconds(10)).ok());
  killed = true;
  const bool enough = WaitUntil([&] { return ok_after_kill.load() >= 100; }, absl::Seconds(60));
  stop = true;
  t0.join();
  t1.join();
  EXPECT_TRUE(enough) << ok_after_kill.load() << " requests succeeded after the kill";
  EXPECT_LE(failed.load(), 2) << "more than the in-flight requests failed";
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(bad.empty()) << absl::StrJoin(bad, "\n");
  }

  // Sequences: the victim's fail clearly, every other one still works.
  for (const Fleet::Sequence& seq : seqs) {
    auto got = (*fleet)->GetSequence(seq);
    auto fetched = (*fleet)->Fetch(seq, {});
    if (seq.replica == victim) {
      for (const absl::Status& s : {got.status(), fetched.status()}) {
        EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
        EXPECT_TRUE(absl::StrContains(s.message(), "replica " + victim)) << s;
        EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat("sequence ", seq.id))) << s;
      }
    } else {
      ASSERT_TRUE(got.ok()) << seq.replica << ": " << got.status();
      EXPECT_EQ(got->length, 2 * kBt);
      ASSERT_TRUE(fetched.ok()) << fetched.status();
      EXPECT_EQ(fetched->payload, Payload(*m, 2 * kBt));
    }
  }
  // New placements skip the victim: keys whose first choice it was go to their second.
  std::vector<std::string> names;
  for (const auto& r : (*fleet)->Replicas()) names.push_back(r.name);
  int moved = 0;
  for (int i = 0; i < 60; ++i) {
    const auto prompt = Tokens(20000 + i, 2 * kBt);
    auto key = (*fleet)->PlacementKey(kModel, prompt);
    ASSERT_TRUE(key.ok());
    std::string replica;
    auto c = Serve(**fleet, *m, prompt, &replica);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_NE(replica, victim);
    const auto order = RendezvousOrder(names, *key);
    if (names[order[0]] == victim) {
      ++moved;
      EXPECT_EQ(replica, names[order[1]]);
    } else {
      EXPECT_EQ(replica, names[order[0]]) << "a key that was not the victim's moved";
    }
  }
  EXPECT_GT(moved, 0);
  for (const auto& r : (*fleet)->Replicas()) {
    EXPECT_EQ(r.healthy, r.name != victim) << r.name << ": " << r.reason;
  }
}

// A replica that died and comes back under its name (a StatefulSet pod restarted) takes its keys
// back once healthy, with the fleet's model ensured on it first.
TEST_F(FleetTest, RestartedReplicaComesBackUnderItsName) {
  ASSERT_NO_FATAL_FAILURE(StartReplicas(2));
  auto fleet = Fleet::Connect(StaticTarget(), ByKeyOptions());
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  auto m = (*fleet)->EnsureModel(SmallLayout(kModel), 4 * kMiB);
  ASSERT_TRUE(m.ok()) << m.status();
  // Prompts whose first choice is kvbank-1.
  std::vector<std::vector<uint32_t>> prompts;
  for (int i = 0; prompts.size() < 10 && i < 1000; ++i) {
    auto prompt = Tokens(60000 + i, kBt);
    auto key = (*fleet)->PlacementKey(kModel, prompt);
    ASSERT_TRUE(key.ok());
    if (*(*fleet)->ReplicaFor(*key) == "kvbank-1") prompts.push_back(prompt);
  }
  ASSERT_EQ(prompts.size(), 10u);
  const int port = servers_[1]->port();
  servers_[1]->SendSignal(SIGKILL);
  EXPECT_FALSE(servers_[1]->WaitForExit(absl::Seconds(10)).ok());
  for (const auto& p : prompts) {
    std::string replica;
    auto c = Serve(**fleet, *m, p, &replica);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(replica, "kvbank-0");
  }
  auto back = ServerProcess::Start({"--no-auth", "--models=", "--replica-name=kvbank-1",
                                    absl::StrCat("--listen=127.0.0.1:", port)});
  ASSERT_TRUE(back.ok()) << back.status();
  servers_[1] = *std::move(back);
  ASSERT_TRUE(WaitUntil([&] {
    for (const auto& r : (*fleet)->Replicas()) {
      if (r.name == "kvbank-1") return r.healthy;
    }
    return false;
  })) << "kvbank-1 did not come back";
  for (const auto& p : prompts) {
    std::string replica;
    auto c = Serve(**fleet, *m, p, &replica);
    ASSERT_TRUE(c.ok()) << c.status();  // the model was ensured on the new process
    EXPECT_EQ(replica, "kvbank-1");
  }
}

TEST_F(FleetTest, DrainingReplicaIsSkippedForNewSequences) {
  // kvbank-1 drains for up to 5 s, held open by an append its client never ends: meanwhile it
  // answers UNAVAILABLE naming the drain and health NOT_SERVING, and the fleet places its keys
  // on kvbank-0 instead.
  ASSERT_NO_FATAL_FAILURE(StartReplicas(2, {"--drain-timeout-ms=5000"}));
  auto fleet = Fleet::Connect(StaticTarget(), ByKeyOptions());
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  auto m = (*fleet)->EnsureModel(SmallLayout(kModel), 4 * kMiB);
  ASSERT_TRUE(m.ok()) << m.status();
  std::vector<std::vector<uint32_t>> prompts;
  for (int i = 0; prompts.size() < 8 && i < 1000; ++i) {
    auto prompt = Tokens(70000 + i, 2 * kBt);
    auto key = (*fleet)->PlacementKey(kModel, prompt);
    ASSERT_TRUE(key.ok());
    if (*(*fleet)->ReplicaFor(*key) == "kvbank-1") prompts.push_back(prompt);
  }
  ASSERT_EQ(prompts.size(), 8u);
  Client::CreateArgs held_args;
  held_args.prompt = prompts[0];
  auto held = (*fleet)->CreateSequence(kModel, held_args);
  ASSERT_TRUE(held.ok()) << held.status();
  ASSERT_EQ(held->replica, "kvbank-1");
  auto stub = v1::KvBank::NewStub(
      grpc::CreateChannel(servers_[1]->target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  v1::AppendResponse resp;
  auto writer = stub->Append(&ctx, &resp);
  v1::AppendRequest header;
  header.mutable_header()->set_model(kModel);
  header.mutable_header()->set_sequence_id(held->id);
  header.mutable_header()->set_num_tokens(kBt);
  ASSERT_TRUE(writer->Write(header));
  auto direct = Client::Connect(servers_[1]->target());
  ASSERT_TRUE(direct.ok());
  ASSERT_TRUE(
      WaitUntil([&] { return StatsOf(**direct, kModel).blocks_used >= 1; }, absl::Seconds(5)));

  servers_[1]->SendSignal(SIGTERM);
  // The signal is taken asynchronously: wait until kvbank-1 refuses calls for its drain (a
  // sequence created just before would be its own, and its append would fail naming it).
  ASSERT_TRUE(WaitUntil([&] {
    auto s = (*direct)->ListModels();
    return s.status().code() == absl::StatusCode::kUnavailable &&
           absl::StrContains(s.status().message(), "draining");
  }));
  // Placed while kvbank-1 drains: on kvbank-0, every one.
  for (size_t i = 1; i < prompts.size(); ++i) {
    std::string replica;
    auto c = Serve(**fleet, *m, prompts[i], &replica);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(replica, "kvbank-0") << "prompt " << i;
  }
  EXPECT_FALSE(servers_[1]->exited()) << "the drain ended before the placements were checked";
  // The held sequence's replica is draining: calls on it fail naming it, never go elsewhere.
  auto info = (*fleet)->GetSequence(*held);
  EXPECT_EQ(info.status().code(), absl::StatusCode::kUnavailable) << info.status();
  EXPECT_TRUE(absl::StrContains(info.status().message(), "kvbank-1")) << info.status();
  ctx.TryCancel();
  EXPECT_TRUE(servers_[1]->WaitForExit(absl::Seconds(20)).ok()) << servers_[1]->Log();
}

TEST_F(FleetTest, AddedReplicaTakesAQuarterAndRemovedOneLeaves) {
  ASSERT_NO_FATAL_FAILURE(StartReplicas(3));
  absl::Mutex mu;
  std::vector<std::string> members;
  for (const auto& s : servers_) members.push_back(s->target());
  FleetOptions options = ByKeyOptions();
  options.resolver = [&]() -> absl::StatusOr<std::vector<std::string>> {
    absl::MutexLock lock(&mu);
    return members;
  };
  auto fleet = Fleet::Connect("test-membership", options);
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  auto m = (*fleet)->EnsureModel(SmallLayout(kModel), 4 * kMiB);
  ASSERT_TRUE(m.ok()) << m.status();

  constexpr int kKeys = 3000;
  std::vector<BlockHash> keys;
  std::vector<std::string> before;
  for (int i = 0; i < kKeys; ++i) {
    auto key = (*fleet)->PlacementKey(kModel, Tokens(30000 + i, kBt + 3));
    ASSERT_TRUE(key.ok()) << key.status();
    keys.push_back(*key);
    before.push_back(*(*fleet)->ReplicaFor(*key));
  }
  // A live sequence on each replica, to check the removal below.
  std::map<std::string, Fleet::Sequence> live;
  for (int i = 0; live.size() < 3 && i < 200; ++i) {
    Client::CreateArgs args;
    args.prompt = Tokens(40000 + i, kBt);
    auto seq = (*fleet)->CreateSequence(kModel, args);
    ASSERT_TRUE(seq.ok()) << seq.status();
    live.emplace(seq->replica, *seq);
  }
  ASSERT_EQ(live.size(), 3u);

  ASSERT_NO_FATAL_FAILURE(StartReplicas(1));
  {
    absl::MutexLock lock(&mu);
    members.push_back(servers_[3]->target());
  }
  ASSERT_TRUE((*fleet)->Refresh().ok());
  ASSERT_EQ((*fleet)->Replicas().size(), 4u);
  int moved = 0;
  for (int i = 0; i < kKeys; ++i) {
    const std::string now = *(*fleet)->ReplicaFor(keys[i]);
    if (now == before[i]) continue;
    ++moved;
    ASSERT_EQ(now, "kvbank-3") << "a key moved between two old replicas";
  }
  const double fraction = double(moved) / kKeys;
  std::cerr << "a 4th replica took " << fraction << " of the keys\n";
  EXPECT_GE(fraction, 0.25 * 0.7);
  EXPECT_LE(fraction, 0.25 * 1.3);
  // The new replica got the fleet's model before its first placement, and serves it.
  {
    std::string replica;
    for (int i = 0; i < kKeys && replica != "kvbank-3"; ++i) {
      auto c = Serve(**fleet, *m, Tokens(30000 + i, kBt + 3), &replica);
      ASSERT_TRUE(c.ok()) << c.status();
    }
    EXPECT_EQ(replica, "kvbank-3");
  }

  // kvbank-1 leaves the resolution: its sequence fails naming it, the others' still work.
  {
    absl::MutexLock lock(&mu);
    members.erase(members.begin() + 1);
  }
  ASSERT_TRUE((*fleet)->Refresh().ok());
  ASSERT_EQ((*fleet)->Replicas().size(), 3u);
  for (const auto& [replica, seq] : live) {
    auto got = (*fleet)->GetSequence(seq);
    if (replica == "kvbank-1") {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
      EXPECT_TRUE(absl::StrContains(got.status().message(),
                                    "replica kvbank-1 holding sequence " + std::to_string(seq.id)))
          << got.status();
    } else {
      EXPECT_TRUE(got.ok()) << replica << ": " << got.status();
    }
  }
  for (int i = 0; i < 300; ++i) {
    auto now = (*fleet)->ReplicaFor(keys[i]);
    ASSERT_TRUE(now.ok());
    EXPECT_NE(*now, "kvbank-1");
  }
}

TEST_F(FleetTest, WatchMergesEventsTaggedByReplica) {
  ASSERT_NO_FATAL_FAILURE(StartReplicas(3));
  auto fleet = Fleet::Connect(StaticTarget(), ByKeyOptions());
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  auto m = (*fleet)->EnsureModel(SmallLayout(kModel), 4 * kMiB);
  ASSERT_TRUE(m.ok()) << m.status();

  // Where each prompt's first block will be published.
  std::map<std::string, std::string> want;  // first block hash (hex) -> replica
  std::vector<std::vector<uint32_t>> prompts;
  for (int i = 0; i < 12; ++i) {
    prompts.push_back(Tokens(50000 + i, 2 * kBt));
    auto key = (*fleet)->PlacementKey(kModel, prompts.back());
    ASSERT_TRUE(key.ok());
    want[HashToHex(*key)] = *(*fleet)->ReplicaFor(*key);
  }
  absl::Mutex mu;
  std::map<std::string, std::string> seen;  // hash -> replica of its BlockStored
  absl::Status watch_status;
  std::thread watcher([&] {
    watch_status = (*fleet)->Watch(kModel, /*from_now=*/false, absl::Seconds(60),
                                   [&](const Fleet::TaggedEvents& batch) {
                                     absl::MutexLock lock(&mu);
                                     for (const auto& e : batch.events) {
                                       if (e.type != Client::Event::Type::kStored) continue;
                                       for (const auto& h : e.hashes)
                                         seen[HashToHex(h)] = batch.replica;
                                     }
                                     size_t found = 0;
                                     for (const auto& [h, r] : want) found += seen.count(h);
                                     return found < want.size();
                                   });
  });
  for (const auto& p : prompts) {
    auto c = Serve(**fleet, *m, p);
    ASSERT_TRUE(c.ok()) << c.status();
  }
  watcher.join();
  EXPECT_TRUE(watch_status.ok()) << watch_status;
  absl::MutexLock lock(&mu);
  for (const auto& [hash, replica] : want) {
    ASSERT_TRUE(seen.count(hash)) << "no BlockStored for " << hash;
    EXPECT_EQ(seen[hash], replica) << hash;
  }
}

}  // namespace
}  // namespace kvbank::integ
