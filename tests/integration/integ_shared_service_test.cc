// kvbankd as a service many tenants share, through the real server and client on loopback: one
// tenant's burst of background work does not stall another's calls, Watch streams have a
// per-tenant share and a publisher wakes only the streams that may see its events, the
// shared-memory regions have a per-tenant share, and nothing is written into a region once the
// fetch that named it has ended.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/grpcpp.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "tests/integration/prefix_support.h"
#include "tests/metrics_http.h"

namespace kvbank::integ {
namespace {

// A Watch stream held open (a callback reactor, no thread): counts the batches it gets.
class HeldWatch final : public grpc::ClientReadReactor<v1::KvEventBatch> {
 public:
  HeldWatch(v1::KvBank::Stub* stub, const std::string& token, const std::string& model) {
    ctx_.AddMetadata("authorization", "Bearer " + token);
    req_.set_model(model);
    req_.set_from_now(true);
    stub->async()->Watch(&ctx_, &req_, this);
    StartRead(&batch_);
    StartCall();
  }
  ~HeldWatch() override {
    ctx_.TryCancel();
    done_.WaitForNotification();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    batches_.fetch_add(1);
    StartRead(&batch_);
  }
  void OnDone(const grpc::Status& s) override {
    status_ = s;
    done_.Notify();
  }
  int batches() const { return batches_.load(); }
  // Waits for the stream's first batch (it is live) or its end; the end's status, else OK.
  grpc::Status WaitLive() {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (batches_.load() == 0 && !done_.HasBeenNotified() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    if (done_.HasBeenNotified()) return status_;
    if (batches_.load() == 0) return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "not live");
    return grpc::Status::OK;
  }

 private:
  grpc::ClientContext ctx_;
  v1::WatchRequest req_;
  v1::KvEventBatch batch_;
  std::atomic<int> batches_{0};
  grpc::Status status_;
  absl::Notification done_;
};

// A sample of a /metrics scrape ("name{labels}" exactly as exposed), or -1 when absent.
double Sample(const std::string& scrape, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(scrape, '\n')) {
    if (line.size() > series.size() && line.substr(0, series.size()) == series &&
        line[series.size()] == ' ') {
      double v = -1;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
    }
  }
  return -1;
}

class SharedServiceTest : public KvbankdTest {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvbank-shared-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    std::ofstream(dir_ + "/tokens") << "token-of-a a\n"
                                    << "token-of-b b\n"
                                    << "token-of-ops ops admin\n";
  }
  void TearDown() override {
    KvbankdTest::TearDown();
    std::filesystem::remove_all(dir_);
  }
  void Start(std::vector<std::string> flags) {
    flags.insert(flags.begin(),
                 {"--models=", "--auth-tokens-file=" + dir_ + "/tokens",
                  "--metrics-listen=127.0.0.1:0", "--metrics-port-file=" + dir_ + "/metrics_port"});
    ASSERT_NO_FATAL_FAILURE(StartServer(flags));
    std::ifstream(dir_ + "/metrics_port") >> metrics_port_;
    ASSERT_GT(metrics_port_, 0);
  }
  std::unique_ptr<Client> As(const std::string& tenant, ClientOptions o = {}) {
    o.bearer_token = "token-of-" + tenant;
    return NewClient(o);
  }
  std::string Scrape() {
    return testing_http::Body(testing_http::Request(metrics_port_, "/metrics"));
  }
  // `tenant`'s row of `resource` (the admin's view of the ledger).
  Client::TenantUsage::Resource Usage(const std::string& tenant, const std::string& resource) {
    auto usage = As("ops")->GetTenantUsage();
    EXPECT_TRUE(usage.ok()) << usage.status();
    if (usage.ok()) {
      for (const auto& u : *usage) {
        if (u.tenant == tenant) return u.Of(resource);
      }
    }
    return {resource};
  }
  uint64_t Held(const std::string& tenant, const std::string& resource) {
    return Usage(tenant, resource).held;
  }
  uint64_t Refused(const std::string& tenant, const std::string& resource) {
    return Usage(tenant, resource).refused;
  }

  std::string dir_;
  int metrics_port_ = 0;
};

std::shared_ptr<grpc::Channel> Channel(const std::string& target) {
  return grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
}

// Watch streams: each tenant has its share of --max-watch-streams (30 / 3 tenants = 10), and a
// tenant's publishing append wakes its own stream only, not the other tenant's ten.
TEST_F(SharedServiceTest, WatchStreamsHaveAShareAndWakeOnlyForTheirOwnEvents) {
  ASSERT_NO_FATAL_FAILURE(Start({"--max-watch-streams=30"}));
  ASSERT_TRUE(As("ops")->EnsureModel(SmallLayout("m"), 4 * kMiB).ok());
  auto channel = Channel(server_->target());
  auto stub = v1::KvBank::NewStub(channel);
  std::vector<std::unique_ptr<HeldWatch>> a_watches;
  for (int i = 0; i < 10; ++i) {
    a_watches.push_back(std::make_unique<HeldWatch>(stub.get(), "token-of-a", "m"));
    ASSERT_TRUE(a_watches.back()->WaitLive().ok()) << "watch " << i;
  }
  {
    HeldWatch over(stub.get(), "token-of-a", "m");
    const grpc::Status s = over.WaitLive();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find("tenant 'a' holds 10 of its share of 10 watch_streams"),
              std::string::npos)
        << s.error_message();
  }
  HeldWatch b_watch(stub.get(), "token-of-b", "m");
  ASSERT_TRUE(b_watch.WaitLive().ok()) << "b's share is its own";
  EXPECT_EQ(Held("a", "watch_streams"), 10u);
  EXPECT_EQ(Refused("a", "watch_streams"), 1u);

  const double before = Sample(Scrape(), "kvbank_watch_wakeups_total{model=\"m\"}");
  ASSERT_GE(before, 0);
  // b publishes 4 full blocks, in 4 appends (so several rounds of events).
  std::unique_ptr<Client> b = As("b");
  auto seq = b->CreateSequence("m");
  ASSERT_TRUE(seq.ok()) << seq.status();
  KvReference ref(SmallLayout("m"));
  Random rng(2012);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(AppendKv(*b, "m", seq->id, ref, rng, kBt, Tokens(100 + i, kBt)).ok());
  }
  ASSERT_TRUE(WaitUntil([&] { return b_watch.batches() >= 2; }))
      << "b's stream never saw b's events";
  const double after = Sample(Scrape(), "kvbank_watch_wakeups_total{model=\"m\"}");
  // One stream may see b's events: at most one wake-up per event (4 appends, 4 events).
  EXPECT_GE(after - before, 1);
  EXPECT_LE(after - before, 4) << "streams that may not see b's events were woken";
  for (const auto& w : a_watches) EXPECT_EQ(w->batches(), 1) << "a's stream got b's events";
  a_watches.clear();
  EXPECT_TRUE(WaitUntil([&] { return Held("a", "watch_streams") == 0; }))
      << "ended streams still count";
}

// A tenant's burst of Match(prefetch) calls on the disk tier queues its background work, bounded
// (the rest dropped, counted); another tenant's create that reads its prompt from the disk runs
// next to that backlog, not behind it.
TEST_F(SharedServiceTest, APrefetchBurstDoesNotStallAnotherTenant) {
  ASSERT_NO_FATAL_FAILURE(Start({"--disk-tier-path=" + dir_ + "/tiers", "--disk-tier-bytes=1GiB",
                                 "--max-queued-prefetch=96", "--device-workers=4"}));
  // 512 KiB blocks: 8 layers x 8 kv heads x 128 x fp16 x 16 tokens x K and V.
  ModelLayout m = SmallLayout("m");
  m.num_layers = 8;
  m.num_q_heads = 8;
  m.num_kv_heads = 8;
  m.head_dim = m.head_dim_v = 128;
  m.layer_dtypes.assign(m.num_layers, DType::kFp16);
  const uint64_t block_bytes = BlockBytes(m);
  ASSERT_TRUE(As("ops")->EnsureModel(m, 64 * block_bytes).ok());
  constexpr int kBlocks = 8;  // a prompt
  auto write = [&](Client& c, uint64_t seed) -> std::vector<uint32_t> {
    std::vector<uint32_t> prompt = Tokens(seed, kBlocks * kBt);
    auto seq = c.CreateSequence("m");
    EXPECT_TRUE(seq.ok()) << seq.status();
    Client::AppendArgs args;
    args.num_tokens = prompt.size();
    args.token_ids = prompt;
    std::vector<uint8_t> payload(kBlocks * block_bytes, uint8_t(seed));
    for (size_t i = 0; i < payload.size(); i += 2) payload[i] = 0x3c;  // finite fp16
    EXPECT_TRUE(c.Append("m", seq->id, args, payload).ok());
    EXPECT_TRUE(c.Free("m", seq->id).ok());
    return prompt;
  };
  std::unique_ptr<Client> a = As("a"), b = As("b");
  const std::vector<uint32_t> b_prompt = write(*b, 7);
  std::vector<std::vector<uint32_t>> a_prompts;
  for (int i = 0; i < 24; ++i) a_prompts.push_back(write(*a, 1000 + i));
  {
    Client::MatchQuery q;
    q.tokens = b_prompt;
    auto where = b->MatchTiers("m", {q});
    ASSERT_TRUE(where.ok()) << where.status();
    ASSERT_EQ((*where)[0].disk_tokens, uint64_t{kBlocks * kBt}) << "b's prompt is on the disk";
  }
  // The burst: 4 threads of a send 150 Match(prefetch) each, 4 prompts a query.
  std::vector<std::thread> threads;
  std::atomic<int> answered{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::unique_ptr<Client> c = As("a");
      for (int i = 0; i < 150; ++i) {
        std::vector<Client::MatchQuery> qs(4);
        for (int k = 0; k < 4; ++k) qs[k].tokens = a_prompts[(t * 7 + i * 4 + k) % 24];
        if (c->MatchTiers("m", qs, /*prefetch=*/true).ok()) answered.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const absl::Time burst_end = absl::Now();
  EXPECT_EQ(answered.load(), 600) << "every Match answers, prefetch or not";
  // b's create with its prompt: the blocks come back from the disk on a device worker.
  Client::CreateArgs args;
  args.prompt = b_prompt;
  auto created = b->CreateSequence("m", args);
  const absl::Time b_done = absl::Now();
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->cached_tokens, uint64_t{kBlocks * kBt});
  const uint64_t a_queued_at_b = Held("a", "queued_background");
  // a's backlog drains meanwhile.
  ASSERT_TRUE(WaitUntil([&] { return Held("a", "queued_background") == 0; }, absl::Seconds(120)));
  const absl::Time drained = absl::Now();
  const int64_t b_ms = absl::ToInt64Milliseconds(b_done - burst_end);
  const int64_t drain_ms = absl::ToInt64Milliseconds(drained - burst_end);
  std::cerr << "[fair] b's create took " << b_ms << " ms after the burst; a's backlog drained in "
            << drain_ms << " ms (" << a_queued_at_b << " queued when b's create returned, "
            << Refused("a", "queued_background") << " prefetches dropped)\n";
  EXPECT_LE(Held("a", "queued_background"), 32u);
  EXPECT_GT(Refused("a", "queued_background"), 0u) << "the backlog is bounded: some were dropped";
  EXPECT_EQ(Refused("b", "queued_background"), 0u);
  // Behind a FIFO, b's create would have waited for a's whole backlog.
  EXPECT_GT(a_queued_at_b, 0u) << "b's create returned only once a's backlog had drained";
  EXPECT_LT(b_ms * 2, drain_ms) << "b's create waited behind a's backlog";
}

// A create whose cached prompt is all in memory runs in its reaction: it takes no device worker,
// so it never queues behind anyone's device work. One whose prompt is on the disk tier does.
TEST_F(SharedServiceTest, ACreateWhosePromptIsInMemoryTakesNoDeviceWorker) {
  ASSERT_NO_FATAL_FAILURE(Start({"--disk-tier-path=" + dir_ + "/tiers", "--disk-tier-bytes=1GiB"}));
  ModelLayout m = SmallLayout("m");
  const uint64_t block_bytes = BlockBytes(m);
  ASSERT_TRUE(As("ops")->EnsureModel(m, 16 * block_bytes).ok());
  std::unique_ptr<Client> b = As("b");
  auto write = [&](uint64_t seed) {
    std::vector<uint32_t> prompt = Tokens(seed, 4 * kBt);
    auto seq = b->CreateSequence("m");
    EXPECT_TRUE(seq.ok()) << seq.status();
    Client::AppendArgs args;
    args.num_tokens = prompt.size();
    args.token_ids = prompt;
    std::vector<uint8_t> payload(4 * block_bytes, uint8_t(seed));
    EXPECT_TRUE(b->Append("m", seq->id, args, payload).ok());
    EXPECT_TRUE(b->Free("m", seq->id).ok());
    return prompt;
  };
  const auto ran = [&] {
    return Sample(Scrape(), "kvbank_device_work_ran_total{class=\"foreground\"}");
  };
  const std::vector<uint32_t> hot = write(1);
  Client::CreateArgs args;
  args.prompt = hot;
  const double before = ran();
  auto created = b->CreateSequence("m", args);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->cached_tokens, hot.size());
  EXPECT_EQ(ran(), before) << "a create with its prompt in the pool went to a device worker";
  ASSERT_TRUE(b->Free("m", created->id).ok());
  // Other prompts push it down to the disk: now the create reads it back on a worker.
  for (uint64_t seed = 2; seed < 10; ++seed) write(seed);
  Client::MatchQuery q;
  q.tokens = hot;
  auto where = b->MatchTiers("m", {q});
  ASSERT_TRUE(where.ok()) << where.status();
  ASSERT_GT((*where)[0].disk_tokens, 0u) << "the prompt did not reach the disk tier";
  created = b->CreateSequence("m", args);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->cached_tokens, hot.size());
  // A worker counts its task once the task has answered: wait for the count.
  EXPECT_TRUE(WaitUntil([&] { return ran() >= before + 1; }, absl::Seconds(30)))
      << "a create that reads the disk ran in its reaction";
  EXPECT_EQ(ran(), before + 1) << "device tasks in all: only the create that read the disk";
}

// Fetches waiting for their tokens (wait_ms): each tenant has its share of --max-waits (6 / 3 =
// 2); a third wait of a's is RESOURCE_EXHAUSTED at once while b's still waits.
TEST_F(SharedServiceTest, WaitsHaveAPerTenantShare) {
  ASSERT_NO_FATAL_FAILURE(Start({"--max-waits=6"}));
  ASSERT_TRUE(As("ops")->EnsureModel(SmallLayout("m"), 4 * kMiB).ok());
  std::unique_ptr<Client> a = As("a"), b = As("b");
  auto seq_a = a->CreateSequence("m");
  auto seq_b = b->CreateSequence("m");
  ASSERT_TRUE(seq_a.ok() && seq_b.ok());
  Client::FetchArgs f;
  f.token_end = kBt;
  f.wait = absl::Seconds(60);
  std::vector<std::thread> waiting;
  std::atomic<int> gone{0};
  auto wait_on = [&](Client* c, uint64_t id) {
    waiting.emplace_back([&, c, id] {
      auto r = c->Fetch("m", id, f);
      if (r.status().code() == absl::StatusCode::kFailedPrecondition) gone.fetch_add(1);
    });
  };
  wait_on(a.get(), seq_a->id);
  wait_on(a.get(), seq_a->id);
  ASSERT_TRUE(WaitUntil([&] { return Held("a", "waits") == 2; }));
  auto third = a->Fetch("m", seq_a->id, f);
  ASSERT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  EXPECT_NE(third.status().message().find("share of 2 waits"), std::string::npos) << third.status();
  wait_on(b.get(), seq_b->id);
  ASSERT_TRUE(WaitUntil([&] { return Held("b", "waits") == 1; })) << "b's share is its own";
  // Freed sequences end their waits, and the shares are free again.
  ASSERT_TRUE(a->Free("m", seq_a->id).ok());
  ASSERT_TRUE(b->Free("m", seq_b->id).ok());
  for (std::thread& t : waiting) t.join();
  EXPECT_EQ(gone.load(), 3);
  EXPECT_EQ(Held("a", "waits"), 0u);
  EXPECT_EQ(Refused("a", "waits"), 1u);
}

// Shared-memory regions: each tenant has its share of --shm-max-regions (6 / 3 = 2) and of
// --shm-max-total-bytes; a region past either is refused and another tenant's share stays.
TEST_F(SharedServiceTest, RegionsHaveAPerTenantShare) {
  ASSERT_NO_FATAL_FAILURE(Start(
      {"--shm-socket=" + dir_ + "/shm", "--shm-max-regions=6", "--shm-max-total-bytes=24MiB"}));
  ClientOptions o;
  o.shm_socket = dir_ + "/shm";
  std::unique_ptr<Client> a = As("a", o), b = As("b", o);
  auto r1 = a->RegisterRegion(1 << 20);
  auto r2 = a->RegisterRegion(1 << 20);
  ASSERT_TRUE(r1.ok() && r2.ok()) << r1.status() << r2.status();
  auto r3 = a->RegisterRegion(1 << 20);
  ASSERT_EQ(r3.status().code(), absl::StatusCode::kResourceExhausted) << r3.status();
  EXPECT_NE(r3.status().message().find("share of 2 shm_regions"), std::string::npos) << r3.status();
  // b: its byte share is 8 MiB.
  auto big = b->RegisterRegion(9 << 20);
  ASSERT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
  EXPECT_NE(big.status().message().find("shm_region_bytes"), std::string::npos) << big.status();
  auto fits = b->RegisterRegion(8 << 20);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(Held("a", "shm_regions"), 2u);
  EXPECT_EQ(Held("b", "shm_region_bytes"), uint64_t{8} << 20);
  r1->reset();  // a's region goes: its share has room again
  EXPECT_TRUE(WaitUntil([&] { return Held("a", "shm_regions") == 1; }));
  EXPECT_TRUE(a->RegisterRegion(1 << 20).ok());
}

// A fetch into a region that is still queued when its call ends (the workers are busy with the
// same tenant's earlier copies) never writes the region: the bytes there stay as they were once
// the workers are idle again. Asked both ways: by gRPC (the call's deadline) and with control
// frames on the shm socket (the frame's timeout_ms).
TEST_F(SharedServiceTest, NothingLandsInARegionAfterItsFetchEnded) {
  // One device worker: the copies queue behind it.
  ASSERT_NO_FATAL_FAILURE(Start({"--shm-socket=" + dir_ + "/shm", "--device-workers=1"}));
  // 32 KiB a token: 1024 tokens are a 32 MiB payload.
  ModelLayout m = SmallLayout("m");
  m.num_layers = 8;
  m.num_q_heads = 8;
  m.num_kv_heads = 8;
  m.head_dim = m.head_dim_v = 128;
  m.layer_dtypes.assign(m.num_layers, DType::kFp16);
  ASSERT_TRUE(As("ops")->EnsureModel(m, 64 * kMiB).ok());
  for (const bool frames : {false, true}) {
    SCOPED_TRACE(frames ? "control frames" : "gRPC calls");
    ClientOptions o;
    o.shm_socket = dir_ + "/shm";
    o.shm_control = frames;
    std::unique_ptr<Client> a = As("a", o);
    auto seq = a->CreateSequence("m");
    ASSERT_TRUE(seq.ok()) << seq.status();
    constexpr uint64_t kTokens = 1024;
    const uint64_t payload = kTokens * 2 * 8 * 8 * 128 * 2;
    Client::AppendArgs args;
    args.num_tokens = kTokens;
    std::vector<uint8_t> bytes(payload, 0x3c);
    ASSERT_TRUE(a->Append("m", seq->id, args, bytes).ok());
    // The victim's client, connected before the burst (it must reach the server at once).
    ClientOptions impatient = o;
    impatient.stream_deadline = absl::Milliseconds(200);
    std::unique_ptr<Client> quick = As("a", impatient);
    ASSERT_TRUE(quick->ListModels().ok());
    // 192 fetches of the whole payload (into one region: what lands there does not matter)
    // keep the worker busy for a while; from 6 clients (a control connection carries at most
    // 32 requests at once).
    constexpr int kBlockers = 192, kBlockerClients = 6;
    std::vector<std::unique_ptr<Client>> blocker_clients;
    for (int i = 0; i < kBlockerClients; ++i) blocker_clients.push_back(As("a", o));
    auto sink = a->RegisterRegion(payload);
    ASSERT_TRUE(sink.ok()) << sink.status();
    auto victim = a->RegisterRegion(1 << 20);
    ASSERT_TRUE(victim.ok()) << victim.status();
    std::memset((*victim)->data(), 0xa5, (*victim)->size());
    const double ran_before =
        Sample(Scrape(), "kvbank_device_work_ran_total{class=\"foreground\"}");
    std::vector<std::thread> blockers;
    absl::Cleanup join = [&] {
      for (std::thread& t : blockers) {
        if (t.joinable()) t.join();
      }
    };
    for (int i = 0; i < kBlockers; ++i) {
      blockers.emplace_back([&, i] {
        auto r = blocker_clients[i % kBlockerClients]->FetchToRegion("m", seq->id, {},
                                                                     (*sink)->Slice(0, payload));
        EXPECT_TRUE(r.ok()) << r.status();
      });
    }
    // Wait until copies are queued behind the busy workers.
    ASSERT_TRUE(WaitUntil(
        [&] { return Sample(Scrape(), "kvbank_device_work_queued{class=\"foreground\"}") >= 96; },
        absl::Seconds(20)))
        << "the blockers never queued";
    // 1 MiB (32 tokens): more than a copy made at once, so it queues too. The victim's region
    // is registered on `a`'s connection: the same tenant may name it.
    Client::FetchArgs f;
    f.token_end = 32;
    auto late = quick->FetchToRegion("m", seq->id, f, (*victim)->Slice(0, (*victim)->size()));
    ASSERT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
    std::move(join).Invoke();
    // Every task has run (the victim's too: it was queued behind the blockers) and none waits.
    ASSERT_TRUE(WaitUntil([&] {
      const std::string s = Scrape();
      return Sample(s, "kvbank_device_work_ran_total{class=\"foreground\"}") >=
                 ran_before + kBlockers + 1 &&
             Sample(s, "kvbank_device_work_queued{class=\"foreground\"}") == 0;
    })) << "the victim's task never ran";
    const uint8_t* p = (*victim)->data();
    const size_t changed =
        std::count_if(p, p + (*victim)->size(), [](uint8_t x) { return x != 0xa5; });
    EXPECT_EQ(changed, 0u) << "a fetch wrote its region after its call had ended";
    EXPECT_EQ(quick->ShmControlRequests() + a->ShmControlRequests() > 0, frames);
    ASSERT_TRUE(a->Free("m", seq->id).ok());
  }
}

// A large region transfer asked for with a control frame while nothing else is under way is
// copied on the shm socket's listener (kvbank_shm_control_lone_copies_total counts it); one asked
// for while another request is pending (a fetch waiting for its tokens) goes to a device worker,
// and so does every one with --shm-lone-copy-bytes=0. The bytes are the same either way.
class LoneCopyTest : public SharedServiceTest {
 protected:
  void Run(bool lone_on) {
    std::vector<std::string> flags = {"--shm-socket=" + dir_ + "/shm"};
    if (!lone_on) flags.push_back("--shm-lone-copy-bytes=0");
    ASSERT_NO_FATAL_FAILURE(Start(flags));
    // 32 KiB a token: 64 tokens are a 2 MiB payload.
    ModelLayout m = SmallLayout("m");
    m.num_layers = 8;
    m.num_q_heads = m.num_kv_heads = 8;
    m.head_dim = m.head_dim_v = 128;
    m.layer_dtypes.assign(m.num_layers, DType::kFp16);
    ASSERT_TRUE(As("ops")->EnsureModel(m, 64 * kMiB).ok());
    ClientOptions o;
    o.shm_socket = dir_ + "/shm";
    std::unique_ptr<Client> a = As("a", o), waiter = As("a", o);
    constexpr uint64_t kTokens = 64, kBytes = kTokens * 32 * 1024;
    auto region = a->RegisterRegion(2 * kBytes);
    ASSERT_TRUE(region.ok()) << region.status();
    Random rng(4242);
    for (uint64_t i = 0; i < kBytes; ++i) (*region)->data()[i] = uint8_t(rng.Next() % 0x3b);
    auto lone = [&] { return Sample(Scrape(), "kvbank_shm_control_lone_copies_total"); };
    ASSERT_EQ(lone(), 0);

    // Alone: the append and the fetch back.
    auto seq = a->CreateSequence("m");
    ASSERT_TRUE(seq.ok()) << seq.status();
    Client::AppendArgs append;
    append.num_tokens = kTokens;
    ASSERT_TRUE(a->AppendFromRegion("m", seq->id, append, (*region)->Slice(0, kBytes)).ok());
    auto back = a->FetchToRegion("m", seq->id, {}, (*region)->Slice(kBytes, kBytes));
    ASSERT_TRUE(back.ok()) << back.status();
    ASSERT_EQ(back->payload_bytes, kBytes);
    EXPECT_EQ(std::memcmp((*region)->data(), (*region)->data() + kBytes, kBytes), 0);
    EXPECT_EQ(lone(), lone_on ? 2 : 0);

    // Not alone: another request waits on the server for tokens not yet appended.
    auto later = a->CreateSequence("m");
    ASSERT_TRUE(later.ok()) << later.status();
    auto waiter_region = waiter->RegisterRegion(4096);
    ASSERT_TRUE(waiter_region.ok()) << waiter_region.status();
    Client::FetchArgs wait;
    wait.token_end = 1;
    wait.layer_end = 1;
    wait.wait = absl::Seconds(30);
    std::future<absl::StatusOr<Client::FetchResult>> waiting = std::async(std::launch::async, [&] {
      return waiter->FetchToRegion("m", later->id, wait, (*waiter_region)->Slice(0, 4096));
    });
    // The waiter's request is pending once it is counted and no answer came.
    ASSERT_TRUE(WaitUntil([&] {
      return Sample(Scrape(), "kvbank_shm_control_requests_total") == 3;
    })) << "the waiting fetch never reached kvbankd";
    std::memset((*region)->data() + kBytes, 0, kBytes);
    back = a->FetchToRegion("m", seq->id, {}, (*region)->Slice(kBytes, kBytes));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(std::memcmp((*region)->data(), (*region)->data() + kBytes, kBytes), 0);
    EXPECT_EQ(waiting.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
        << "the waiter was answered before the second fetch: it did not overlap";
    EXPECT_EQ(lone(), lone_on ? 2 : 0)
        << "a transfer beside a pending request went on the listener";
    // The waiter's token comes: it is answered.
    Client::AppendArgs one;
    one.num_tokens = 1;
    std::vector<uint8_t> token(32 * 1024, 0x11);
    ASSERT_TRUE(a->Append("m", later->id, one, token).ok());
    auto waited = waiting.get();
    ASSERT_TRUE(waited.ok()) << waited.status();
    EXPECT_EQ(waited->payload_bytes, 4096u);
  }
};

TEST_F(LoneCopyTest, ALoneLargeTransferIsCopiedOnTheListener) { Run(true); }
TEST_F(LoneCopyTest, WithTheFlagAtZeroNoneIs) { Run(false); }

}  // namespace
}  // namespace kvbank::integ
