// kvbankd under hostile or broken clients: a request sized to exhaust memory, descriptor
// exhaustion, a second server on a served port, streams whose clients stall. Each case failed
// before the fix it guards (a crash, a listener that never accepted again, a second server that
// took half the connections, blocks held until the client went away).
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "tests/integration/health_support.h"
#include "tests/integration/prefix_support.h"
#include "tests/integration/server_fixture.h"

namespace kvbank::integ {
namespace {

std::shared_ptr<grpc::Channel> NewChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(64 << 20);
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

std::chrono::system_clock::time_point In(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}

// A raw TCP connection to 127.0.0.1:port that never speaks HTTP/2; -1 when connect failed.
int RawConnect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Whether a fresh connection completes a kvbank call (ListModels) within `deadline`, trying
// again on new connections while the server refuses them.
bool NewConnectionServes(const std::string& target, absl::Duration deadline) {
  const absl::Time until = absl::Now() + deadline;
  while (absl::Now() < until) {
    auto stub = v1::KvBank::NewStub(NewChannel(target));
    grpc::ClientContext ctx;
    ctx.set_deadline(In(std::min(absl::Seconds(2), until - absl::Now())));
    v1::ListModelsRequest req;
    v1::ListModelsResponse resp;
    if (stub->ListModels(&ctx, req, &resp).ok()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

class HardeningTest : public KvbankdTest {
 protected:
  // Blocks the server's pool holds for sequences (used = referenced by live sequences and
  // readers, reserved by appends in flight).
  uint64_t BlocksUsed(Client& client, const std::string& model) {
    return StatsOf(client, model).blocks_used;
  }
};

// An AttendRequest of 2,000,000 empty items (4 MB) named items x q_heads x head_dim_v floats
// (32.8 GB for llama-3.1-8b) before the item limit was checked: std::bad_alloc aborted kvbankd.
TEST_F(HardeningTest, AttendWithMillionsOfItemsIsRefusedBeforeAnythingIsSized) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=llama-3.1-8b", "--pool-bytes=64MiB"}));
  auto stub = v1::KvBank::NewStub(NewChannel(server_->target()));
  v1::AttendRequest req;
  req.set_model("llama-3.1-8b");
  for (int i = 0; i < 2000000; ++i) req.add_items();
  ASSERT_LT(req.ByteSizeLong(), size_t{4} << 20) << "must fit the server's message limit";
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(30)));
  v1::AttendResponse resp;
  grpc::Status s = stub->Attend(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "4096")) << s.error_message();
  EXPECT_TRUE(NewConnectionServes(server_->target(), absl::Seconds(10)));
}

// Match with millions of empty queries would size a vector of MatchQuery per query (a few
// hundred bytes each for two bytes of request).
TEST_F(HardeningTest, MatchWithMillionsOfQueriesIsRefused) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=llama-3.1-8b", "--pool-bytes=64MiB"}));
  auto stub = v1::KvBank::NewStub(NewChannel(server_->target()));
  v1::MatchRequest req;
  req.set_model("llama-3.1-8b");
  for (int i = 0; i < 2000000; ++i) req.add_queries();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(30)));
  v1::MatchResponse resp;
  grpc::Status s = stub->Match(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "queries")) << s.error_message();
}

// With its descriptors exhausted, gRPC's own listener logged "Failed accept4: Too many open
// files" and never accepted again. kvbankd's listener closes what it cannot keep, reports
// NOT_SERVING meanwhile, and takes new connections as soon as descriptors are free.
// A kvbankd status figure of `pid` (/proc/PID/status, kB), or -1.
int64_t StatusKiB(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, field + ":")) {
      int64_t v = -1;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::StripSuffix(
                               absl::StripAsciiWhitespace(line.substr(field.size() + 1)), "kB")),
                           &v)) {
        return v;
      }
    }
  }
  return -1;
}

// Callers without a token are refused as their metadata arrives: four 100 MiB messages without
// one are UNAUTHENTICATED (not read and then refused as too large), and the server's peak memory
// grows by far less than one of them (it grew by ~200 MiB when the handler checked the token).
TEST_F(HardeningTest, UnauthenticatedMessagesAreRefusedBeforeTheyAreRead) {
  char path[] = "/tmp/kvbank-tokens-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << "token-of-a a\n";
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", std::string("--auth-tokens-file=") + path}));
  std::remove(path);
  const int64_t before = StatusKiB(server_->pid(), "VmHWM");
  ASSERT_GT(before, 0);
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel =
      grpc::CreateCustomChannel(server_->target(), grpc::InsecureChannelCredentials(), args);
  grpc::GenericStub generic(channel);
  const std::string big(100 << 20, '\0');
  struct Call {
    grpc::ClientContext ctx;
    grpc::ByteBuffer resp;
    grpc::Status status;
    absl::Notification done;
  };
  std::vector<std::unique_ptr<Call>> calls;
  for (int i = 0; i < 4; ++i) {
    calls.push_back(std::make_unique<Call>());
    Call* c = calls.back().get();
    c->ctx.set_deadline(In(absl::Seconds(30)));
    if (i % 2 == 1) c->ctx.AddMetadata("authorization", "Bearer not-a-token");
    grpc::Slice slice(big);
    grpc::ByteBuffer req(&slice, 1);
    generic.UnaryCall(&c->ctx, "/kvbank.v1.KvBank/GetStats", grpc::StubOptions(), &req, &c->resp,
                      [c](grpc::Status s) {
                        c->status = std::move(s);
                        c->done.Notify();
                      });
  }
  for (const auto& c : calls) {
    c->done.WaitForNotification();
    EXPECT_EQ(c->status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << c->status.error_message();
  }
  const int64_t after = StatusKiB(server_->pid(), "VmHWM");
  std::cerr << "[auth] kvbankd's peak RSS " << before << " kB before 4 x 100 MiB unauthenticated "
            << "messages, " << after << " kB after\n";
  if (!kSanitizedBuild) {
    EXPECT_LT(after - before, 48 << 10) << "their bytes were buffered";
  }
  // A caller with its token still gets through, on the same kind of connection.
  ClientOptions o;
  o.bearer_token = "token-of-a";
  EXPECT_TRUE(NewClient(o)->ListModels().ok());
}

TEST_F(HardeningTest, ListenerSurvivesDescriptorExhaustion) {
#if defined(__SANITIZE_ADDRESS__)
  // UBSan's vptr check opens a pipe to test whether memory is readable: with no descriptor left
  // it reports a valid object as one with an invalid vptr and stops the server.
  GTEST_SKIP() << "descriptor exhaustion is not testable under the sanitizers: their runtime "
                  "needs descriptors of its own";
#endif
  // 256 descriptors in all, and a cap above them so that accept itself runs out.
  auto server = ServerProcess::Start({"--models=", "--no-auth", "--max-connections=1000"},
                                     absl::Seconds(20), /*nofile=*/256);
  ASSERT_TRUE(server.ok()) << server.status();
  server_ = *std::move(server);
  auto old = NewChannel(server_->target());
  ASSERT_EQ(HealthOf(old.get(), ""), 1);
  ASSERT_EQ(HealthOf(old.get(), "kvbank.v1.KvBank"), 1);

  std::vector<int> held;
  for (int i = 0; i < 300; ++i) {
    if (int fd = RawConnect(server_->port()); fd >= 0) held.push_back(fd);
  }
  EXPECT_GE(held.size(), 256u) << "the kernel queues what the server has not accepted";
  // Health (asked on a connection made before) says the listener cannot take connections.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  int health = 1;
  while (absl::Now() < until && (health = HealthOf(old.get(), "")) == 1) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(health, 2) << "health never reported the exhausted listener";
  for (int fd : held) close(fd);
  // Once the raw connections are gone, new clients are served again, and health recovers.
  EXPECT_TRUE(NewConnectionServes(server_->target(), absl::Seconds(15)))
      << "a new connection was not served after the descriptors came back\n"
      << server_->Log();
  const absl::Time until2 = absl::Now() + absl::Seconds(10);
  while (absl::Now() < until2 && (health = HealthOf(old.get(), "")) != 1) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(health, 1);
  EXPECT_TRUE(absl::StrContains(server_->Log(), "out of file descriptors")) << server_->Log();
}

// Over --max-connections a connection is closed at once (the client sees UNAVAILABLE without
// waiting for its deadline); under it again, new connections are served.
TEST_F(HardeningTest, ConnectionsOverTheCapAreClosedAtOnce) {
  // Started without the fixture's health check: its client's connection would close at some
  // moment during the test and free a place under the cap. Here the 8 raw connections are the
  // only ones, accepted in order before the client's.
  auto server = ServerProcess::Start({"--models=", "--no-auth", "--max-connections=8"});
  ASSERT_TRUE(server.ok()) << server.status();
  server_ = *std::move(server);
  std::vector<int> held;
  for (int i = 0; i < 8; ++i) {
    int fd = RawConnect(server_->port());
    ASSERT_GE(fd, 0);
    held.push_back(fd);
  }
  const absl::Time start = absl::Now();
  auto stub = v1::KvBank::NewStub(NewChannel(server_->target()));
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(20)));
  v1::ListModelsRequest req;
  v1::ListModelsResponse resp;
  grpc::Status s = stub->ListModels(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "refused late: it waited in the backlog";
  for (int fd : held) close(fd);
  EXPECT_TRUE(NewConnectionServes(server_->target(), absl::Seconds(15)));
}

// A connection without calls is closed after --max-connection-idle-ms (its descriptor and
// buffers go back; a client that still wants it reconnects).
TEST_F(HardeningTest, IdleConnectionsAreClosed) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--max-connection-idle-ms=300"}));
  auto channel = NewChannel(server_->target());
  auto stub = v1::KvBank::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(10)));
  v1::ListModelsRequest req;
  v1::ListModelsResponse resp;
  ASSERT_TRUE(stub->ListModels(&ctx, req, &resp).ok());
  ASSERT_EQ(channel->GetState(false), GRPC_CHANNEL_READY);
  const absl::Time sent = absl::Now();
  grpc_connectivity_state state = GRPC_CHANNEL_READY;
  while (state == GRPC_CHANNEL_READY && channel->WaitForStateChange(state, In(absl::Seconds(10)))) {
    state = channel->GetState(false);
  }
  EXPECT_NE(state, GRPC_CHANNEL_READY) << "the idle connection was never closed";
  EXPECT_GE(absl::Now() - sent, absl::Milliseconds(250)) << "closed before it was idle";
  EXPECT_TRUE(NewConnectionServes(server_->target(), absl::Seconds(10)));
}

// gRPC sets SO_REUSEPORT: a second kvbankd on a served port started and took half of the new
// connections. It must fail to start, naming the port.
TEST_F(HardeningTest, SecondServerOnTheSamePortFailsNamingIt) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models="}));
  const std::string port = std::to_string(server_->port());
  auto second = ServerProcess::Start({"--models=", "--no-auth", "--listen=127.0.0.1:" + port},
                                     absl::Seconds(20));
  ASSERT_FALSE(second.ok()) << "a second kvbankd started on port " << port;
  EXPECT_TRUE(
      absl::StrContains(second.status().message(), "port " + port + " on 127.0.0.1 is in use"))
      << second.status();
  EXPECT_TRUE(NewConnectionServes(server_->target(), absl::Seconds(10)));
}

// SIGTERM must reach the thread that drains. gRPC's own threads (started when the credentials
// were made) had SIGTERM unblocked, so the kernel could hand the signal to one of them and its
// default action ended kvbankd mid-call: clients saw "Connection reset by peer" instead of a drain.
// Every thread but the main one (which takes the signals with sigwait) must block them.
TEST_F(HardeningTest, OnlyTheMainThreadTakesTerminationSignals) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=llama-3.1-8b", "--pool-bytes=64MiB"}));
  ASSERT_TRUE(NewConnectionServes(server_->target(), absl::Seconds(10)));
  auto c = NewClient();
  (void)StatsOf(*c, "llama-3.1-8b");  // a call, so the threads serving calls exist
  const pid_t pid = server_->pid();
  const std::string tasks = absl::StrCat("/proc/", pid, "/task");
  DIR* dir = opendir(tasks.c_str());
  ASSERT_NE(dir, nullptr) << tasks;
  int checked = 0;
  const uint64_t wanted = (uint64_t{1} << (SIGTERM - 1)) | (uint64_t{1} << (SIGINT - 1));
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.' || std::string(e->d_name) == std::to_string(pid)) continue;
    std::ifstream status(absl::StrCat(tasks, "/", e->d_name, "/status"));
    std::string line, name;
    uint64_t blocked = 0;
    bool found = false;
    while (std::getline(status, line)) {
      if (absl::StartsWith(line, "Name:"))
        name = std::string(absl::StripAsciiWhitespace(line.substr(5)));
      if (absl::StartsWith(line, "SigBlk:")) {
        blocked = std::stoull(line.substr(7), nullptr, 16);
        found = true;
      }
    }
    if (!found) continue;  // the thread ended while it was read
    ++checked;
    EXPECT_EQ(blocked & wanted, wanted)
        << "thread " << e->d_name << " (" << name << ") of kvbankd does not block SIGTERM/SIGINT";
  }
  closedir(dir);
  EXPECT_GT(checked, 0) << "kvbankd has no threads besides the main one";
}

// An append that sends its header (reserving every block it needs) and then nothing held the
// blocks until the client went away. The stream idle timeout cancels it and the blocks return.
TEST_F(HardeningTest, StalledAppendReleasesItsBlocksAfterTheIdleTimeout) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--stream-idle-timeout-ms=500"}));
  auto client = NewClient();
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(client->EnsureModel(layout, 64 * BlockBytes(layout)).ok());
  auto stalled_seq = client->CreateSequence("m");
  ASSERT_TRUE(stalled_seq.ok());

  auto stub = v1::KvBank::NewStub(NewChannel(server_->target()));
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(60)));
  v1::AppendResponse resp;
  auto writer = stub->Append(&ctx, &resp);
  v1::AppendRequest header;
  header.mutable_header()->set_model("m");
  header.mutable_header()->set_sequence_id(stalled_seq->id);
  header.mutable_header()->set_num_tokens(63 * kBt);  // 63 of 64 blocks
  ASSERT_TRUE(writer->Write(header));
  const absl::Time sent = absl::Now();
  // The reservation shows once the server has read the header.
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (absl::Now() < until && BlocksUsed(*client, "m") < 63) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(BlocksUsed(*client, "m"), 63u);

  // Another sequence waits for blocks: it gets them once the idle timeout cut the stalled one.
  auto other = client->CreateSequence("m");
  ASSERT_TRUE(other.ok());
  KvReference ref(layout);
  Random rng(9101);
  std::cerr << "[stall] seed 9101\n";
  absl::StatusOr<Client::SequenceInfo> appended = absl::UnknownError("not tried");
  const absl::Time until2 = absl::Now() + absl::Seconds(10);
  while (absl::Now() < until2) {
    appended = AppendKv(*client, "m", other->id, ref, rng, 8 * kBt);
    if (appended.ok() || appended.status().code() != absl::StatusCode::kResourceExhausted) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_GE(absl::Now() - sent, absl::Milliseconds(500)) << "cut before the timeout";
  grpc::Status s = writer->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "--stream-idle-timeout-ms"))
      << s.error_message();
  auto info = client->GetSequence("m", stalled_seq->id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->length, 0u) << "the cut append left nothing behind";
  EXPECT_EQ(BlocksUsed(*client, "m"), 8u);
}

// A fetch whose client read one message and stopped kept its snapshot's blocks pinned, through a
// Free, for as long as the client stayed connected. The idle timeout releases them.
TEST_F(HardeningTest, StalledFetchReleasesItsSnapshotAfterTheIdleTimeout) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--stream-idle-timeout-ms=500"}));
  auto client = NewClient();
  ModelLayout layout = SmallLayout("m");
  layout.num_layers = 8;  // 32 KiB per token: the fetch is 32 MiB, far more than a client buffers
  layout.num_q_heads = layout.num_kv_heads = 8;
  layout.head_dim = layout.head_dim_v = 128;
  layout.kind = AttentionKind::kMha;
  layout.layer_dtypes.assign(layout.num_layers, DType::kFp16);
  ASSERT_TRUE(client->EnsureModel(layout, 80 * BlockBytes(layout)).ok());
  auto seq = client->CreateSequence("m");
  ASSERT_TRUE(seq.ok());
  KvReference ref(layout);
  Random rng(9102);
  std::cerr << "[stall] seed 9102\n";
  ASSERT_TRUE(AppendKv(*client, "m", seq->id, ref, rng, 64 * kBt).ok());

  auto stub = v1::KvBank::NewStub(NewChannel(server_->target()));
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(60)));
  v1::FetchRequest req;
  req.set_model("m");
  req.set_sequence_id(seq->id);
  auto reader = stub->Fetch(&ctx, req);
  v1::FetchResponse first;
  ASSERT_TRUE(reader->Read(&first));  // then the client reads no more
  ASSERT_TRUE(client->Free("m", seq->id).ok());
  EXPECT_EQ(BlocksUsed(*client, "m"), 64u) << "the snapshot pins the freed sequence's blocks";
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (absl::Now() < until && BlocksUsed(*client, "m") != 0) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(BlocksUsed(*client, "m"), 0u) << "the stalled fetch still pins its blocks";
  ctx.TryCancel();
  reader->Finish();
}

}  // namespace
}  // namespace kvbank::integ
