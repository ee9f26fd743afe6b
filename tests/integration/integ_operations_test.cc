// kvbankd as an operator runs it: a plaintext health-only port for kubelet's gRPC probes that
// follows the drain, JSON-lines logs (start-up config, the memory budget and where it came
// from, failed calls with method, tenant and code, drain progress; never a token), and a rate
// limit on error records.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/integration/health_support.h"
#include "tests/integration/prefix_support.h"
#include "tests/integration/server_fixture.h"

namespace kvbank::integ {
namespace {

class OperationsTest : public KvbankdTest {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvbank-ops-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    KvbankdTest::TearDown();
    std::filesystem::remove_all(dir_);
  }

  // The number in `path` once it is there (the server writes it right after serving).
  int ReadPort(const std::string& path) {
    int port = 0;
    WaitUntil(
        [&] {
          std::ifstream in(path);
          std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
          return absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port) && port > 0;
        },
        absl::Seconds(10));
    return port;
  }

  // The server's log lines that are JSON records (kvbankd's own); `others` gets the rest.
  std::vector<nlohmann::json> JsonRecords(std::vector<std::string>* others = nullptr) {
    std::vector<nlohmann::json> out;
    for (absl::string_view line : absl::StrSplit(server_->Log(), '\n', absl::SkipEmpty())) {
      if (absl::StartsWith(line, "{")) {
        out.push_back(nlohmann::json::parse(line));  // throws (fails the test) if malformed
      } else if (others != nullptr) {
        others->push_back(std::string(line));
      }
    }
    return out;
  }

  static std::vector<nlohmann::json> OfEvent(const std::vector<nlohmann::json>& records,
                                             const std::string& event) {
    std::vector<nlohmann::json> out;
    for (const auto& r : records) {
      if (r.value("event", "") == event) out.push_back(r);
    }
    return out;
  }

  std::string dir_;
};

std::shared_ptr<grpc::Channel> Plaintext(int port) {
  return grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
}

TEST_F(OperationsTest, HealthPortServesHealthAloneAndGoesNotServingOnDrain) {
  const std::string port_file = dir_ + "/health_port";
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--models=", "--health-listen=127.0.0.1:0", "--health-port-file=" + port_file,
                   "--drain-timeout-ms=4000"}));
  const int health_port = ReadPort(port_file);
  ASSERT_GT(health_port, 0) << server_->Log();
  ASSERT_NE(health_port, server_->port());
  auto health = Plaintext(health_port);
  EXPECT_EQ(HealthOf(health.get(), ""), 1);
  EXPECT_EQ(HealthOf(health.get(), "kvbank.v1.KvBank"), 1);
  grpc::StatusCode code = grpc::StatusCode::OK;
  EXPECT_EQ(HealthOf(health.get(), "no.such.Service", &code), -1);
  EXPECT_EQ(code, grpc::StatusCode::NOT_FOUND);
  // The health port is not a way around TLS or tokens: kvbank's methods are not there.
  {
    auto stub = v1::KvBank::NewStub(health);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::ListModelsResponse resp;
    EXPECT_EQ(stub->ListModels(&ctx, v1::ListModelsRequest(), &resp).error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }

  // An append left open keeps the drain going (up to --drain-timeout-ms): meanwhile the health
  // port says NOT_SERVING, as the main one does.
  auto client = NewClient();
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(client->EnsureModel(layout, 16 * BlockBytes(layout)).ok());
  auto seq = client->CreateSequence("m");
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto stub = v1::KvBank::NewStub(
      grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  v1::AppendResponse resp;
  auto writer = stub->Append(&ctx, &resp);
  v1::AppendRequest header;
  header.mutable_header()->set_model("m");
  header.mutable_header()->set_sequence_id(seq->id);
  header.mutable_header()->set_num_tokens(kBt);
  ASSERT_TRUE(writer->Write(header));
  ASSERT_TRUE(WaitUntil([&] { return StatsOf(*client, "m").blocks_used >= 1; }, absl::Seconds(5)));

  server_->SendSignal(SIGTERM);
  int status = 1;
  ASSERT_TRUE(WaitUntil([&] { return (status = HealthOf(health.get(), "kvbank.v1.KvBank")) == 2; },
                        absl::Seconds(3)))
      << "health port answered " << status << " during the drain\n"
      << server_->Log();
  EXPECT_EQ(HealthOf(health.get(), ""), 2);
  ctx.TryCancel();
  ASSERT_TRUE(server_->WaitForExit(absl::Seconds(20)).ok()) << server_->Log();
}

// A plain TCP connection to the health port, sending `bytes` (maybe none) and then nothing: what
// a client that holds connections open without probing looks like. -1 when it cannot connect.
int IdleConnection(int port, const std::string& bytes) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 ||
      (!bytes.empty() &&
       send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) != ssize_t(bytes.size()))) {
    close(fd);
    return -1;
  }
  return fd;
}

// Whether the server closed connection `fd` (EOF or reset), without blocking.
bool ClosedByPeer(int fd) {
  char b[256];
  for (;;) {
    const ssize_t n = recv(fd, b, sizeof(b), MSG_DONTWAIT);
    if (n > 0) continue;  // settings, a GOAWAY: read past them
    return n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
  }
}

// Hundreds of connections held open on the health port (silent, the HTTP/2 preface alone, the
// preface and settings), re-opened as soon as the server closes them, never get a probe refused:
// every fresh probe answers SERVING within its 2 s deadline, well inside kubelet's 10 s period.
// The health port serves health alone: no reflection there.
TEST_F(OperationsTest, HealthProbesGetThroughWhileOthersHoldConnectionsOpen) {
  const std::string port_file = dir_ + "/health_port";
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--models=", "--health-listen=127.0.0.1:0", "--health-port-file=" + port_file,
                   "--max-connection-idle-ms=600000"}));
  const int port = ReadPort(port_file);
  ASSERT_GT(port, 0) << server_->Log();
  const std::string preface("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
  const std::string settings("\x00\x00\x00\x04\x00\x00\x00\x00\x00", 9);  // empty SETTINGS
  const std::vector<std::string> kinds = {"", preface, preface + settings};
  std::vector<int> held;
  auto refill = [&] {
    for (size_t i = 0; i < held.size(); ++i) {
      if (held[i] >= 0 && !ClosedByPeer(held[i])) continue;
      if (held[i] >= 0) close(held[i]);
      held[i] = IdleConnection(port, kinds[i % kinds.size()]);
    }
  };
  held.assign(192, -1);
  refill();
  int probes = 0;
  const absl::Time end = absl::Now() + absl::Seconds(12);
  while (absl::Now() < end) {
    refill();
    // A fresh connection for each probe, as kubelet makes.
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                             grpc::InsecureChannelCredentials(), args);
    grpc::StatusCode code = grpc::StatusCode::OK;
    const absl::Time start = absl::Now();
    ASSERT_EQ(HealthOf(channel.get(), "", &code), 1)
        << "probe " << probes << " failed (" << code << ") after " << MsSince(start)
        << " ms while others held the health port's connections";
    ++probes;
    absl::SleepFor(absl::Milliseconds(250));
  }
  for (int fd : held) {
    if (fd >= 0) close(fd);
  }
  EXPECT_GE(probes, 10);
  // Reflection is the main port's only.
  grpc::GenericStub generic(Plaintext(port));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  grpc::Slice empty("");
  grpc::ByteBuffer req(&empty, 1), resp;
  absl::Notification done;
  grpc::Status status;
  generic.UnaryCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                    grpc::StubOptions(), &req, &resp, [&](grpc::Status s) {
                      status = std::move(s);
                      done.Notify();
                    });
  done.WaitForNotification();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << status.error_message();
}

TEST_F(OperationsTest, JsonLogsSayTheConfigTheBudgetAndEachFailedCallWithoutTheToken) {
  const std::string tokens = dir_ + "/tokens";
  std::ofstream(tokens) << "secret-token-of-alice alice admin\n";
  ASSERT_NO_FATAL_FAILURE(StartServer(
      {"--models=", "--auth-tokens-file=" + tokens, "--log-format=json", "--pool-bytes=8MiB"}));
  ClientOptions o;
  o.bearer_token = "secret-token-of-alice";
  auto client = NewClient(o);
  ASSERT_NE(client, nullptr);
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(client->EnsureModel(layout, 16 * BlockBytes(layout)).ok());
  auto missing = client->GetSequence("m", kNeverId);
  ASSERT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  ClientOptions wrong;
  wrong.bearer_token = "not-a-token";
  auto stranger = NewClient(wrong);
  ASSERT_EQ(stranger->ListModels().status().code(), absl::StatusCode::kUnauthenticated);

  ASSERT_TRUE(
      WaitUntil([&] { return OfEvent(JsonRecords(), "rpc_error").size() >= 2; }, absl::Seconds(5)))
      << server_->Log();
  std::vector<std::string> others;
  const std::vector<nlohmann::json> records = JsonRecords(&others);
  for (const std::string& line : others) {
    EXPECT_FALSE(absl::StartsWith(line, "kvbankd:")) << "a text record in JSON mode: " << line;
  }
  for (const auto& r : records) {
    EXPECT_TRUE(r.contains("ts") && r.contains("level") && r.contains("event") && r.contains("msg"))
        << r.dump();
  }
  const auto budget = OfEvent(records, "memory_budget");
  ASSERT_EQ(budget.size(), 1u) << server_->Log();
  EXPECT_GT(budget[0].value("max_pool_bytes", uint64_t{0}), 0u);
  EXPECT_EQ(budget[0].value("default_pool_bytes", uint64_t{0}), uint64_t{8} << 20);
  const std::string source = budget[0].value("host_memory_source", "");
  EXPECT_TRUE(source == "physical memory" || absl::StartsWith(source, "cgroup v")) << source;
  const auto serving = OfEvent(records, "serving");
  ASSERT_EQ(serving.size(), 1u) << server_->Log();
  EXPECT_EQ(serving[0].value("port", 0), server_->port());
  EXPECT_EQ(serving[0].value("auth", ""), "tokens");
  EXPECT_EQ(serving[0].value("tls", ""), "off");

  const auto errors = OfEvent(records, "rpc_error");
  bool not_found = false, unauthenticated = false;
  for (const auto& e : errors) {
    if (e.value("method", "") == "/kvbank.v1.KvBank/GetSequence") {
      not_found = true;
      EXPECT_EQ(e.value("tenant", ""), "alice") << e.dump();
      EXPECT_EQ(e.value("code", ""), "NOT_FOUND") << e.dump();
      EXPECT_EQ(e.value("level", ""), "warn") << e.dump();
    }
    if (e.value("method", "") == "/kvbank.v1.KvBank/ListModels") {
      unauthenticated = true;
      EXPECT_EQ(e.value("tenant", "?"), "") << e.dump();
      EXPECT_EQ(e.value("code", ""), "UNAUTHENTICATED") << e.dump();
    }
  }
  EXPECT_TRUE(not_found) << server_->Log();
  EXPECT_TRUE(unauthenticated) << server_->Log();
  EXPECT_FALSE(absl::StrContains(server_->Log(), "secret-token-of-alice")) << server_->Log();
  EXPECT_FALSE(absl::StrContains(server_->Log(), "not-a-token")) << server_->Log();

  // The drain is logged too.
  ASSERT_TRUE(server_->Stop().ok()) << server_->Log();
  const auto after = JsonRecords();
  EXPECT_EQ(OfEvent(after, "drain_start").size(), 1u) << server_->Log();
  EXPECT_EQ(OfEvent(after, "drain_done").size() + OfEvent(after, "drain_timeout").size(), 1u)
      << server_->Log();
  EXPECT_EQ(OfEvent(after, "stopped").size(), 1u) << server_->Log();
}

TEST_F(OperationsTest, ErrorRecordsAreRateLimitedAndCountWhatTheyLeftOut) {
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--models=", "--log-format=json", "--log-errors-per-second=3"}));
  auto client = NewClient();
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(client->EnsureModel(layout, 16 * BlockBytes(layout)).ok());
  for (int i = 0; i < 40; ++i) {
    ASSERT_EQ(client->GetSequence("m", kNeverId).status().code(), absl::StatusCode::kNotFound);
  }
  // More failures until a record reports the ones left out (the next second's first record).
  bool reported = false;
  ASSERT_TRUE(WaitUntil(
      [&] {
        (void)client->GetSequence("m", kNeverId);
        for (const auto& r : OfEvent(JsonRecords(), "rpc_error")) {
          reported |= r.value("suppressed", uint64_t{0}) > 0;
        }
        return reported;
      },
      absl::Seconds(10)))
      << server_->Log();
  const auto errors = OfEvent(JsonRecords(), "rpc_error");
  uint64_t suppressed = 0;
  for (const auto& r : errors) suppressed += r.value("suppressed", uint64_t{0});
  EXPECT_LT(errors.size(), 40u) << server_->Log();
  EXPECT_GE(errors.size() + suppressed, 40u) << server_->Log();
}

}  // namespace
}  // namespace kvbank::integ
