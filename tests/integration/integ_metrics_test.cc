// kvbankd's Prometheus /metrics (--metrics-listen, --metrics-port-file) against the real server:
// work through the real client (gRPC and shared-memory transfers, a prefix hit, refused calls),
// then one scrape whose figures must match what was done and what GetStats reports.
#include <unistd.h>

#include <filesystem>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "tests/integration/prefix_support.h"
#include "tests/metrics_http.h"

namespace kvbank::integ {
namespace {

// Series ("name{labels}" exactly as written) -> value, from a text exposition.
std::map<std::string, double> ParseSeries(const std::string& text) {
  std::map<std::string, double> series;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (absl::StartsWith(line, "#")) continue;
    const size_t space = line.rfind(' ');
    double v = 0;
    if (space == absl::string_view::npos || !absl::SimpleAtod(line.substr(space + 1), &v)) {
      ADD_FAILURE() << "not a sample line: " << line;
      continue;
    }
    EXPECT_TRUE(series.emplace(std::string(line.substr(0, space)), v).second)
        << "series twice: " << line;
  }
  return series;
}

class MetricsTest : public KvbankdTest {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kvbank-metrics-" + std::to_string(getpid()) + "-" +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
    std::ofstream(dir_ + "/tokens") << "token-of-a a\n"
                                    << "token-of-b b\n"
                                    << "token-of-ops ops admin\n";
  }
  void TearDown() override {
    KvbankdTest::TearDown();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  void Start() {
    ASSERT_NO_FATAL_FAILURE(StartServer(
        {"--models=", "--auth-tokens-file=" + dir_ + "/tokens", "--shm-socket=" + dir_ + "/shm",
         "--metrics-listen=127.0.0.1:0", "--metrics-port-file=" + dir_ + "/metrics_port"}));
    // Written before the gRPC port file; read with a deadline all the same.
    ASSERT_TRUE(WaitUntil([&] {
      std::ifstream in(dir_ + "/metrics_port");
      return in >> metrics_port_ && metrics_port_ > 0;
    })) << "no metrics port file";
  }
  std::unique_ptr<Client> As(const std::string& token, bool shm = false) {
    ClientOptions o;
    o.bearer_token = token;
    if (shm) o.shm_socket = dir_ + "/shm";
    return NewClient(o);
  }
  std::map<std::string, double> Scrape() {
    const std::string answer = testing_http::Request(metrics_port_, "/metrics");
    EXPECT_TRUE(absl::StartsWith(answer, "HTTP/1.1 200 OK\r\n")) << answer.substr(0, 200);
    EXPECT_TRUE(absl::StrContains(answer, "\r\nContent-Type: text/plain; version=0.0.4"));
    return ParseSeries(testing_http::Body(answer));
  }

  std::string dir_;
  int metrics_port_ = 0;
};

TEST_F(MetricsTest, ScrapeReportsTheWorkDone) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::unique_ptr<Client> ops = As("token-of-ops");
  std::unique_ptr<Client> a = As("token-of-a", /*shm=*/true);
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(ops->EnsureModel(layout, 4 * kMiB).ok());
  const uint64_t per_token = 2 * 2 * 2 * 16 * 2;  // layers x heads x (K, V) x head_dim x fp16
  Random rng(9301);
  std::cerr << "[metrics] seed 9301\n";

  // A prompt of 5 full blocks and 7 tokens, prefilled over gRPC, fetched back, freed.
  const std::vector<uint32_t> prompt = Tokens(9301, 5 * kBt + 7);
  Client::CreateArgs with_prompt;
  with_prompt.prompt = prompt;
  auto first = a->CreateSequence("m", with_prompt);
  ASSERT_TRUE(first.ok()) << first.status();
  KvReference ref(layout);
  ASSERT_TRUE(AppendKv(*a, "m", first->id, ref, rng, prompt.size()).ok());
  auto fetched = a->Fetch("m", first->id, {});
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  ASSERT_EQ(fetched->payload.size(), prompt.size() * per_token);
  ASSERT_TRUE(a->Free("m", first->id).ok());
  // The same prompt again: its 5 full blocks come from the cache (80 tokens hit).
  auto second = a->CreateSequence("m", with_prompt);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->cached_tokens, 5 * kBt);

  // 16 tokens through the shared-memory plane, in and out.
  auto third = a->CreateSequence("m", Client::CreateArgs());
  ASSERT_TRUE(third.ok()) << third.status();
  auto region = a->RegisterRegion(64 * 1024);
  ASSERT_TRUE(region.ok()) << region.status();
  const uint64_t shm_bytes = kBt * per_token;
  for (uint64_t i = 0; i < shm_bytes; ++i) (*region)->data()[i] = uint8_t(rng.Next());
  Client::AppendArgs append;
  append.num_tokens = kBt;
  ASSERT_TRUE(a->AppendFromRegion("m", third->id, append, (*region)->Slice(0, shm_bytes)).ok());
  auto back = a->FetchToRegion("m", third->id, {}, (*region)->Slice(shm_bytes, shm_bytes));
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->payload_bytes, shm_bytes);

  // Refused calls: a sequence that is not there, a model that is not there, no token.
  EXPECT_EQ(a->GetSequence("m", kNeverId).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(a->CreateSequence("nope", Client::CreateArgs()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(As("")->GetStats().status().code(), absl::StatusCode::kUnauthenticated);

  // Calls leave the in-flight gauge when gRPC drops them, just after their answer.
  std::map<std::string, double> m;
  ASSERT_TRUE(WaitUntil([&] {
    m = Scrape();
    for (const auto& [series, v] : m) {
      if (absl::StartsWith(series, "kvbank_rpc_in_flight{") && v != 0) return false;
    }
    return true;
  })) << "calls still in flight";
  auto at = [&](const std::string& series) {
    auto it = m.find(series);
    EXPECT_NE(it, m.end()) << "no series " << series;
    return it == m.end() ? -1.0 : it->second;
  };

  // RPCs by method and code; the latency histogram counts every call once.
  EXPECT_EQ(at("kvbank_rpc_total{method=\"EnsureModel\",code=\"OK\"}"), 1);
  EXPECT_EQ(at("kvbank_rpc_total{method=\"CreateSequence\",code=\"OK\"}"), 3);
  EXPECT_EQ(at("kvbank_rpc_total{method=\"CreateSequence\",code=\"NOT_FOUND\"}"), 1);
  // (The region append and fetch go as control frames on the shm socket: no gRPC call.)
  EXPECT_EQ(at("kvbank_rpc_total{method=\"Append\",code=\"OK\"}"), 1);
  EXPECT_EQ(at("kvbank_rpc_total{method=\"Fetch\",code=\"OK\"}"), 1);
  EXPECT_EQ(at("kvbank_shm_control_requests_total"), 2);
  EXPECT_EQ(at("kvbank_rpc_total{method=\"Free\",code=\"OK\"}"), 1);
  EXPECT_EQ(at("kvbank_rpc_total{method=\"GetSequence\",code=\"NOT_FOUND\"}"), 1);
  EXPECT_EQ(at("kvbank_rpc_total{method=\"GetSequence\",code=\"OK\"}"), 0);
  EXPECT_EQ(at("kvbank_rpc_total{method=\"GetStats\",code=\"UNAUTHENTICATED\"}"), 1);
  EXPECT_EQ(m.count("kvbank_rpc_total{method=\"Fetch\",code=\"NOT_FOUND\"}"), 0u)
      << "a code's row appears once that code was answered";
  EXPECT_EQ(at("kvbank_rpc_duration_seconds_count{method=\"CreateSequence\"}"), 4);
  EXPECT_EQ(at("kvbank_rpc_duration_seconds_bucket{method=\"CreateSequence\",le=\"+Inf\"}"), 4);
  EXPECT_GT(at("kvbank_rpc_duration_seconds_sum{method=\"CreateSequence\"}"), 0);
  EXPECT_LE(at("kvbank_rpc_duration_seconds_bucket{method=\"CreateSequence\",le=\"5e-05\"}"),
            at("kvbank_rpc_duration_seconds_bucket{method=\"CreateSequence\",le=\"60\"}"));
  EXPECT_EQ(at("kvbank_rpc_duration_seconds_count{method=\"Attend\"}"), 0);

  // Payload bytes by plane, each transfer once.
  const double grpc_bytes = double(prompt.size() * per_token);
  EXPECT_EQ(at("kvbank_bytes_received_total{plane=\"grpc\"}"), grpc_bytes);
  EXPECT_EQ(at("kvbank_bytes_sent_total{plane=\"grpc\"}"), grpc_bytes);
  EXPECT_EQ(at("kvbank_bytes_received_total{plane=\"shm\"}"), double(shm_bytes));
  EXPECT_EQ(at("kvbank_bytes_sent_total{plane=\"shm\"}"), double(shm_bytes));
  EXPECT_EQ(at("kvbank_bytes_received_total{plane=\"cuda_ipc\"}"), 0);
  EXPECT_EQ(at("kvbank_bytes_sent_total{plane=\"nccl\"}"), 0);

  // The model's figures, in tokens for the prefix cache: two prompts looked up, 80 tokens hit.
  EXPECT_EQ(at("kvbank_prefix_cache_queries_total{model=\"m\"}"), 2.0 * prompt.size());
  EXPECT_EQ(at("kvbank_prefix_cache_hits_total{model=\"m\"}"), 5.0 * kBt);
  EXPECT_EQ(at("kvbank_sequences{model=\"m\"}"), 2);
  EXPECT_EQ(at("kvbank_tokens_stored{model=\"m\"}"), 5.0 * kBt + kBt);
  EXPECT_EQ(at("kvbank_blocks{model=\"m\",state=\"used\"}"), 6);  // 5 shared + 1
  EXPECT_EQ(at("kvbank_evictions_total{model=\"m\"}"), 0);
  const double total = at("kvbank_blocks_total{model=\"m\"}");
  EXPECT_GT(total, 6);
  EXPECT_EQ(at("kvbank_blocks{model=\"m\",state=\"free\"}") +
                at("kvbank_blocks{model=\"m\",state=\"cached\"}") +
                at("kvbank_blocks{model=\"m\",state=\"used\"}"),
            total);
  EXPECT_DOUBLE_EQ(at("kvbank_kv_cache_usage_perc{model=\"m\"}"), 6 / total);
  // The tenant's own rows.
  EXPECT_EQ(at("kvbank_tenant_prefix_cache_queries_total{model=\"m\",tenant=\"a\"}"),
            2.0 * prompt.size());
  EXPECT_EQ(at("kvbank_tenant_prefix_cache_hits_total{model=\"m\",tenant=\"a\"}"), 5.0 * kBt);
  EXPECT_EQ(at("kvbank_tenant_sequences{model=\"m\",tenant=\"a\"}"), 2);
  EXPECT_EQ(at("kvbank_tenant_blocks{model=\"m\",tenant=\"a\"}"), 6);
  EXPECT_EQ(at("kvbank_tenant_bytes_appended_total{model=\"m\",tenant=\"a\"}"),
            grpc_bytes + shm_bytes);
  EXPECT_EQ(at("kvbank_tenant_bytes_fetched_total{model=\"m\",tenant=\"a\"}"),
            grpc_bytes + shm_bytes);

  // The same figures GetStats answers an admin (read after the scrape; nothing moved since).
  Client::ModelStats st = StatsOf(*ops, "m");
  EXPECT_EQ(at("kvbank_blocks_total{model=\"m\"}"), st.blocks_total);
  EXPECT_EQ(at("kvbank_blocks{model=\"m\",state=\"free\"}"), st.blocks_free);
  EXPECT_EQ(at("kvbank_blocks{model=\"m\",state=\"cached\"}"), st.blocks_cached);
  EXPECT_EQ(at("kvbank_blocks{model=\"m\",state=\"pinned\"}"), st.blocks_pinned);
  EXPECT_EQ(at("kvbank_appends_total{model=\"m\"}"), st.appends);
  EXPECT_EQ(at("kvbank_bytes_appended_total{model=\"m\"}"), st.bytes_appended);
  EXPECT_EQ(at("kvbank_bytes_fetched_total{model=\"m\"}"), st.bytes_fetched);
  // None of these sequences was a prefix copy.
  EXPECT_EQ(at("kvbank_prefix_copies_in_total{model=\"m\"}"), 0);
  EXPECT_EQ(at("kvbank_prefix_copy_bytes_in_total{model=\"m\"}"), 0);
  EXPECT_EQ(st.prefix_copies_in, 0u);
  EXPECT_EQ(st.prefix_copy_bytes_in, 0u);

  // Connections (the clients above hold theirs open) and the build.
  EXPECT_GE(at("kvbank_connections"), 1);
  EXPECT_GE(at("kvbank_connections_accepted_total"), 4);
  EXPECT_EQ(at("kvbank_connections_refused_total{reason=\"over_cap\"}"), 0);
  auto info = ops->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(at("kvbank_build_info{version=\"" + info->version + "\"}"), 1);
}

// A prefix copied in from another replica (a sequence created with prefix_copy, its blocks
// appended, then freed) counts once, with its payload bytes, in GetStats and /metrics; a plain
// sequence of the same shape counts in neither; a tenant's view holds only its own copies.
TEST_F(MetricsTest, PrefixCopiesCountOnTheReplicaTheyCameInto) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::unique_ptr<Client> ops = As("token-of-ops");
  std::unique_ptr<Client> a = As("token-of-a");
  std::unique_ptr<Client> b = As("token-of-b");
  const ModelLayout layout = SmallLayout("m");
  auto model = ops->EnsureModel(layout, 4 * kMiB);
  ASSERT_TRUE(model.ok()) << model.status();
  const uint64_t per_token = model->payload_bytes_per_token;
  ASSERT_GT(per_token, 0u);
  Random rng(4211);
  std::cerr << "[metrics] seed 4211\n";

  // As a fleet copies a prefix: the prefix's tokens as the prompt, its blocks appended, freed.
  const uint64_t copied = 3 * kBt;
  Client::CreateArgs copy;
  copy.prompt = Tokens(4211, copied);
  copy.prefix_copy = true;
  auto in = a->CreateSequence("m", copy);
  ASSERT_TRUE(in.ok()) << in.status();
  ASSERT_EQ(in->cached_tokens, 0u);
  KvReference ref_in(layout);
  ASSERT_TRUE(AppendKv(*a, "m", in->id, ref_in, rng, copied).ok());
  ASSERT_TRUE(a->Free("m", in->id).ok());

  // Tenant b's plain sequence of 2 blocks and 5 tokens: appended, not copied.
  const uint64_t plain = 2 * kBt + 5;
  Client::CreateArgs own;
  own.prompt = Tokens(4212, plain);
  auto mine = b->CreateSequence("m", own);
  ASSERT_TRUE(mine.ok()) << mine.status();
  KvReference ref_mine(layout);
  ASSERT_TRUE(AppendKv(*b, "m", mine->id, ref_mine, rng, plain).ok());

  const Client::ModelStats st = StatsOf(*ops, "m");
  EXPECT_EQ(st.prefix_copies_in, 1u);
  EXPECT_EQ(st.prefix_copy_bytes_in, copied * per_token);
  EXPECT_EQ(st.bytes_appended, (copied + plain) * per_token) << "copied bytes are appended bytes";
  EXPECT_EQ(st.appends, 2u);
  // Each tenant sees its own.
  const Client::ModelStats st_a = StatsOf(*a, "m");
  ASSERT_TRUE(st_a.tenant_view);
  EXPECT_EQ(st_a.prefix_copies_in, 1u);
  EXPECT_EQ(st_a.prefix_copy_bytes_in, copied * per_token);
  const Client::ModelStats st_b = StatsOf(*b, "m");
  ASSERT_TRUE(st_b.tenant_view);
  EXPECT_EQ(st_b.prefix_copies_in, 0u);
  EXPECT_EQ(st_b.prefix_copy_bytes_in, 0u);
  EXPECT_EQ(st_b.bytes_appended, plain * per_token);

  const std::string answer = testing_http::Request(metrics_port_, "/metrics");
  ASSERT_TRUE(absl::StartsWith(answer, "HTTP/1.1 200 OK\r\n")) << answer.substr(0, 200);
  const std::string body = testing_http::Body(answer);
  for (const std::string name :
       {"kvbank_prefix_copies_in_total", "kvbank_prefix_copy_bytes_in_total"}) {
    EXPECT_TRUE(absl::StrContains(body, "\n# HELP " + name + " ")) << name;
    EXPECT_TRUE(absl::StrContains(body, "\n# TYPE " + name + " counter\n")) << name;
  }
  const std::map<std::string, double> m = ParseSeries(body);
  auto at = [&](const std::string& series) {
    auto it = m.find(series);
    EXPECT_NE(it, m.end()) << "no series " << series;
    return it == m.end() ? -1.0 : it->second;
  };
  EXPECT_EQ(at("kvbank_prefix_copies_in_total{model=\"m\"}"), 1);
  EXPECT_EQ(at("kvbank_prefix_copy_bytes_in_total{model=\"m\"}"), double(copied * per_token));
  EXPECT_EQ(at("kvbank_bytes_appended_total{model=\"m\"}"), double((copied + plain) * per_token));
}

// A call whose client gives up (its deadline passes while the fetch waits for tokens) counts once,
// under a code that is not OK, and leaves the in-flight gauge.
TEST_F(MetricsTest, AbandonedCallCountsOnceAndLeavesInFlight) {
  ASSERT_NO_FATAL_FAILURE(Start());
  ASSERT_TRUE(As("token-of-ops")->EnsureModel(SmallLayout("m"), 4 * kMiB).ok());
  ClientOptions o;
  o.bearer_token = "token-of-a";
  o.stream_deadline = absl::Milliseconds(300);
  std::unique_ptr<Client> a = NewClient(o);
  auto seq = a->CreateSequence("m", Client::CreateArgs());
  ASSERT_TRUE(seq.ok()) << seq.status();
  Client::FetchArgs f;
  f.token_end = kBt;  // never appended
  f.wait = absl::Seconds(30);
  EXPECT_EQ(a->Fetch("m", seq->id, f).status().code(), absl::StatusCode::kDeadlineExceeded);
  std::map<std::string, double> m;
  double fetches = 0;
  ASSERT_TRUE(WaitUntil([&] {
    m = Scrape();
    fetches = 0;
    for (const auto& [series, v] : m) {
      if (absl::StartsWith(series, "kvbank_rpc_total{method=\"Fetch\",")) fetches += v;
    }
    // One scrape is not a snapshot across families: the call may be recorded between the
    // histogram's lines and the counters', so wait for all three.
    return fetches == 1 && m["kvbank_rpc_in_flight{method=\"Fetch\"}"] == 0 &&
           m["kvbank_rpc_duration_seconds_count{method=\"Fetch\"}"] == 1;
  })) << "Fetch rows "
      << fetches << ", in flight " << m["kvbank_rpc_in_flight{method=\"Fetch\"}"] << ", durations "
      << m["kvbank_rpc_duration_seconds_count{method=\"Fetch\"}"];
  EXPECT_EQ(m["kvbank_rpc_total{method=\"Fetch\",code=\"OK\"}"], 0);
  EXPECT_EQ(m["kvbank_bytes_sent_total{plane=\"grpc\"}"], 0);
}

TEST_F(MetricsTest, OnlyMetricsIsServed) {
  ASSERT_NO_FATAL_FAILURE(Start());
  EXPECT_TRUE(absl::StartsWith(testing_http::Request(metrics_port_, "/"), "HTTP/1.1 404"));
  EXPECT_TRUE(absl::StartsWith(testing_http::Request(metrics_port_, "/healthz"), "HTTP/1.1 404"));
  EXPECT_TRUE(
      absl::StartsWith(testing_http::Request(metrics_port_, "/metrics", "POST"), "HTTP/1.1 405"));
  EXPECT_TRUE(absl::StrContains(server_->Log(), "Prometheus metrics on http://127.0.0.1:" +
                                                    std::to_string(metrics_port_) + "/metrics"))
      << server_->Log();
}

// A bad --metrics-listen stops kvbankd at start, naming the flag.
TEST(MetricsFlagTest, BadAddressIsRefusedAtStart) {
  auto server =
      ServerProcess::Start({"--no-auth", "--models=", "--metrics-listen=9400"}, absl::Seconds(10));
  ASSERT_FALSE(server.ok());
  EXPECT_TRUE(absl::StrContains(server.status().message(), "--metrics-listen")) << server.status();
  EXPECT_TRUE(absl::StrContains(server.status().message(), "is not host:port")) << server.status();
}

}  // namespace
}  // namespace kvbank::integ
