// The same-host shared-memory plane end to end, its regions: a region is its tenant's only, an
// engine's unsealed memfd is one until its owner truncates it, garbage on the socket is refused,
// the socket is named by GetServerInfo, a server without the plane refuses region calls, and a
// client SIGKILLed while kvbankd copies to or from its region (shm_client) leaves nothing behind.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "client/shm_handshake.h"
#include "grpcpp/grpcpp.h"
#include "kvbank/v1/kvbank.grpc.pb.h"
#include "tests/integration/shm_test_support.h"

#ifndef KVBANK_SHM_CLIENT_PATH
#error "KVBANK_SHM_CLIENT_PATH must name the shm_client binary (tests/integration/CMakeLists.txt)"
#endif

namespace kvbank::integ {
namespace {

TEST_F(ShmTest, ARegionIsItsTenantsOnly) {
  ASSERT_NO_FATAL_FAILURE(Start({"--auth-tokens-file=" + dir_ + "/tokens"}));
  std::unique_ptr<Client> admin = Shm("token-of-ops");
  std::unique_ptr<Client> a = Shm("token-of-a");
  std::unique_ptr<Client> b = Shm("token-of-b");
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(admin->EnsureModel(layout, 64 * BlockBytes(layout)).ok());
  auto seq_a = a->CreateSequence("m");
  auto seq_b = b->CreateSequence("m");
  ASSERT_TRUE(seq_a.ok() && seq_b.ok());
  auto region = a->RegisterRegion(64 * 1024);
  ASSERT_TRUE(region.ok()) << region.status();
  ShmRegion& r = **region;
  Random(77).Fill(r.data(), 4096);
  Client::AppendArgs args;
  args.num_tokens = 16;
  ASSERT_TRUE(a->AppendFromRegion("m", seq_a->id, args, r.Slice(0, 4096)).ok());
  const std::vector<uint8_t> before(r.data(), r.data() + r.size());
  // b names a's region: the same answer as for an id that never was, and nothing moves.
  auto append = b->AppendFromRegion("m", seq_b->id, args, r.Slice(0, 4096));
  EXPECT_EQ(append.status().code(), absl::StatusCode::kNotFound) << append.status();
  auto fetch = b->FetchToRegion("m", seq_b->id, {}, r.Slice(0, r.size()));
  EXPECT_EQ(fetch.status().code(), absl::StatusCode::kNotFound) << fetch.status();
  EXPECT_EQ(b->UnregisterRegion(r.id()).code(), absl::StatusCode::kNotFound);
  auto info_b = b->GetSequence("m", seq_b->id);
  ASSERT_TRUE(info_b.ok());
  EXPECT_EQ(info_b->length, 0u);
  EXPECT_TRUE(BytesEqual(std::vector<uint8_t>(r.data(), r.data() + r.size()), before));
  // a's own calls still work; no token at all is UNAUTHENTICATED before any region is looked at.
  EXPECT_TRUE(a->FetchToRegion("m", seq_a->id, {}, r.Slice(8192, 4096)).ok());
  EXPECT_EQ(0, std::memcmp(r.data(), r.data() + 8192, 4096));
  std::unique_ptr<Client> nobody = Shm();
  EXPECT_EQ(nobody->RegisterRegion(4096).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(nobody->FetchToRegion("m", seq_a->id, {}, r.Slice(0, 4096)).status().code(),
            absl::StatusCode::kUnauthenticated);
}

// An engine's host pool in a memfd it made without MFD_ALLOW_SEALING (SGLang's shm allocator
// does): registered as it is, transfers land in the engine's own mapping of it; once the engine
// truncates it, transfers over it fail naming why, change nothing, and kvbankd goes on serving,
// also while the file shrinks and grows under its copies.
TEST_F(ShmTest, AnEnginesUnsealedMemfdIsARegionUntilItsOwnerTruncatesIt) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::unique_ptr<Client> c = Shm();
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(c->EnsureModel(layout, 64 * BlockBytes(layout)).ok());
  constexpr uint64_t kSize = 1 << 20;
  const int fd = memfd_create("engine-pool", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  std::vector<uint8_t> init(kSize);
  Random(5).Fill(init.data(), init.size());
  ASSERT_EQ(pwrite(fd, init.data(), kSize, 0), static_cast<ssize_t>(kSize));
  auto* mine =
      static_cast<uint8_t*>(mmap(nullptr, kSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ASSERT_NE(mine, MAP_FAILED);
  auto region = c->RegisterRegionFd(fd);
  ASSERT_TRUE(region.ok()) << region.status();
  ShmRegion& r = **region;
  EXPECT_EQ(r.size(), kSize);
  auto seq = c->CreateSequence("m");
  ASSERT_TRUE(seq.ok());
  Client::AppendArgs args;
  args.num_tokens = 16;
  ASSERT_TRUE(c->AppendFromRegion("m", seq->id, args, r.Slice(0, 4096)).ok());
  // The fetch lands in the engine's own mapping: the same pages.
  auto f = c->FetchToRegion("m", seq->id, {}, r.Slice(8192, 4096));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(0, std::memcmp(mine + 8192, init.data(), 4096));

  // Shrinking and growing under transfers: each one either works or fails cleanly.
  std::atomic<bool> stop{false};
  std::thread owner([&] {
    while (!stop.load()) {
      (void)!ftruncate(fd, 4096);
      (void)!ftruncate(fd, kSize);
      (void)!pwrite(fd, init.data(), kSize, 0);  // no hole: its pages are the owner's again
    }
  });
  int ok = 0, refused = 0;
  for (int i = 0; i < 200; ++i) {
    auto each = c->CreateSequence("m");
    ASSERT_TRUE(each.ok()) << each.status();
    absl::Status s = c->AppendFromRegion("m", each->id, args, r.Slice(kSize - 4096, 4096)).status();
    // A refused append committed nothing; a taken one all of its tokens.
    auto length = c->GetSequence("m", each->id);
    ASSERT_TRUE(length.ok()) << length.status();
    EXPECT_EQ(length->length, s.ok() ? 16u : 0u) << s;
    if (s.ok()) s = c->FetchToRegion("m", each->id, {}, r.Slice(4096, kSize - 4096)).status();
    ASSERT_TRUE(c->Free("m", each->id).ok());
    if (s.ok()) {
      ++ok;
      continue;
    }
    ++refused;
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "truncated") ||
                absl::StrContains(s.message(), "no page written"))
        << s;
  }
  stop = true;
  owner.join();
  std::cerr << "[shm] under truncation: " << ok << " transfers done, " << refused << " refused\n";

  // Truncated for good: refused before any copy, nothing changes.
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  const uint64_t before = c->GetSequence("m", seq->id)->length;
  auto append = c->AppendFromRegion("m", seq->id, args, r.Slice(0, 4096));
  EXPECT_EQ(append.status().code(), absl::StatusCode::kFailedPrecondition) << append.status();
  EXPECT_TRUE(absl::StrContains(append.status().message(),
                                "header.source: the region's file is "
                                "4096 bytes now"))
      << append.status();
  auto fetch = c->FetchToRegion("m", seq->id, {}, r.Slice(0, 4096));
  EXPECT_EQ(fetch.status().code(), absl::StatusCode::kFailedPrecondition) << fetch.status();
  EXPECT_EQ(c->GetSequence("m", seq->id)->length, before);
  // kvbankd serves on: a sealed region beside it works.
  auto sealed = c->RegisterRegion(4096);
  ASSERT_TRUE(sealed.ok()) << sealed.status();
  Random(6).Fill((*sealed)->data(), 4096);
  EXPECT_TRUE(c->AppendFromRegion("m", seq->id, args, (*sealed)->Slice(0, 4096)).ok());
  munmap(mine, kSize);
  close(fd);

  // What is not a shared-memory file is refused, by the SDK or by kvbankd, naming why.
  int pipe_fds[2];
  ASSERT_EQ(pipe2(pipe_fds, O_CLOEXEC), 0);
  EXPECT_EQ(c->RegisterRegionFd(pipe_fds[0]).status().code(), absl::StatusCode::kInvalidArgument);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  const std::string file = dir_ + "/on-disk";
  std::ofstream(file) << std::string(4096, 'x');
  const int disk = open(file.c_str(), O_RDWR | O_CLOEXEC);
  auto on_disk = c->RegisterRegionFd(disk);
  EXPECT_EQ(on_disk.status().code(), absl::StatusCode::kInvalidArgument) << on_disk.status();
  EXPECT_TRUE(absl::StrContains(on_disk.status().message(), "not a shmem memfd"))
      << on_disk.status();
  close(disk);
}

TEST_F(ShmTest, GarbageOnTheSocketIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Start());
  // Garbage: the connection is closed, nothing else happens.
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, socket_.c_str());
  for (const std::string& g : {std::string("GET / HTTP/1.1\r\n\r\n"), std::string(100000, 'z')}) {
    const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_EQ(connect(s, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    (void)!send(s, g.data(), g.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    pollfd p{s, POLLIN, 0};
    bool closed = false;
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (!closed && absl::Now() < end) {
      char buf[256];
      if (poll(&p, 1, 100) > 0) closed = recv(s, buf, sizeof(buf), MSG_DONTWAIT) <= 0;
    }
    EXPECT_TRUE(closed) << "kvbankd kept a connection that sent garbage";
    close(s);
  }
  // A handle nobody was given.
  std::unique_ptr<Client> c = Shm();
  grpc::ClientContext ctx;
  auto stub = v1::KvBank::NewStub(
      grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
  v1::RegisterRegionRequest req;
  req.set_handle(std::string(16, '\x42'));
  v1::RegisterRegionResponse resp;
  grpc::Status s = stub->RegisterRegion(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  // The server is fine: a good region registers and works.
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(c->EnsureModel(layout, 64 * BlockBytes(layout)).ok());
  auto region = c->RegisterRegion(4096);
  ASSERT_TRUE(region.ok()) << region.status();
  auto seq = c->CreateSequence("m");
  ASSERT_TRUE(seq.ok());
  Client::AppendArgs args;
  args.num_tokens = 16;
  EXPECT_TRUE(c->AppendFromRegion("m", seq->id, args, (*region)->Slice(0, 4096)).ok());
}

// GetServerInfo names the socket, so a client can find the plane without being told the path.
TEST_F(ShmTest, ServerInfoNamesTheSocket) {
  ASSERT_NO_FATAL_FAILURE(Start());
  auto info = NewClient()->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->shm_socket, socket_);
  EXPECT_FALSE(info->version.empty());
}

TEST_F(ShmTest, PlaneOffAnswersFailedPrecondition) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--models=", "--shm-socket="}));
  ClientOptions o;
  o.shm_socket = socket_;  // nothing listens there
  std::unique_ptr<Client> c = NewClient(o);
  auto info = c->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->shm_socket, "") << "no plane: no socket named";
  EXPECT_EQ(c->RegisterRegion(4096).status().code(), absl::StatusCode::kUnavailable);
  const ModelLayout layout = SmallLayout("m");
  ASSERT_TRUE(c->EnsureModel(layout, 64 * BlockBytes(layout)).ok());
  auto seq = c->CreateSequence("m");
  ASSERT_TRUE(seq.ok());
  Client::AppendArgs args;
  args.num_tokens = 1;
  auto a = c->AppendFromRegion("m", seq->id, args, {1, 0, 256});
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition) << a.status();
  EXPECT_TRUE(absl::StrContains(a.status().message(), "--shm-socket")) << a.status();
  EXPECT_EQ(c->UnregisterRegion(1).code(), absl::StatusCode::kFailedPrecondition);
}

// A shm_client child process, its stdout read line by line.
class Child {
 public:
  explicit Child(std::vector<std::string> args) {
    args.insert(args.begin(), KVBANK_SHM_CLIENT_PATH);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) return;
    const pid_t parent = getpid();
    pid_ = fork();
    if (pid_ == 0) {  // async-signal-safe calls only until exec
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(126);
      dup2(out[1], 1);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    out_ = out[0];
  }
  ~Child() {
    Kill();
    if (out_ >= 0) close(out_);
  }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    int status;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }
  // Reads lines until one starts with `prefix` (returned whole) or the deadline passes.
  std::optional<std::string> Line(const std::string& prefix,
                                  absl::Duration deadline = absl::Seconds(20)) {
    const absl::Time end = absl::Now() + deadline;
    for (;;) {
      size_t nl;
      while ((nl = pending_.find('\n')) != std::string::npos) {
        std::string line = pending_.substr(0, nl);
        pending_.erase(0, nl + 1);
        if (absl::StartsWith(line, "error")) std::cerr << "[shm_client] " << line << "\n";
        if (absl::StartsWith(line, prefix)) return line;
      }
      const int64_t ms = absl::ToInt64Milliseconds(end - absl::Now());
      if (ms <= 0) return std::nullopt;
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 100))) <= 0) continue;
      char buf[4096];
      const ssize_t n = read(out_, buf, sizeof(buf));
      if (n == 0) return std::nullopt;
      if (n > 0) pending_.append(buf, static_cast<size_t>(n));
    }
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  std::string pending_;
};

TEST_F(ShmTest, ClientKilledMidTransferLeavesNoTraceAndNoLeak) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::unique_ptr<Client> c = Shm();
  // 4 layers x 8 heads x 128 dims fp16: 16 KiB a token; 256 tokens = 4 MiB a transfer.
  ModelLayout layout = SmallLayout("big");
  layout.num_layers = 4;
  layout.num_q_heads = layout.num_kv_heads = 8;
  layout.head_dim = layout.head_dim_v = 128;
  layout.layer_dtypes.assign(layout.num_layers, DType::kFp16);
  auto model = c->EnsureModel(layout, 96 * kMiB);
  ASSERT_TRUE(model.ok()) << model.status();
  const uint64_t n = 256, bytes = n * model->payload_bytes_per_token;
  const uint64_t seed = 4242;
  std::cerr << "[shm] seed " << seed << "\n";
  const std::vector<uint8_t> payload = Random(seed).Bytes(bytes);
  for (int round = 0; round < 4; ++round) {
    const bool append = round % 2 == 0;
    SCOPED_TRACE(absl::StrCat("round ", round, append ? " (append)" : " (fetch)"));
    auto seq = c->CreateSequence("big", absl::ZeroDuration());
    ASSERT_TRUE(seq.ok());
    Client::AppendArgs args;
    args.num_tokens = n;
    if (!append) {
      ASSERT_TRUE(c->Append("big", seq->id, args, payload).ok());
    }
    Child child({append ? "append" : "fetch", server_->target(), socket_, "big",
                 std::to_string(seq->id), std::to_string(n), std::to_string(seed)});
    auto region = child.Line("region ");
    ASSERT_TRUE(region.has_value()) << "the child registered no region";
    const uint64_t id = std::strtoull(region->c_str() + 7, nullptr, 10);
    // Killed once it has done a few rounds: its next transfer is under way.
    ASSERT_TRUE(child.Line("op 3").has_value()) << "the child did not get going";
    child.Kill();
    EXPECT_TRUE(WaitFor([&] { return RegionGone(*c, "big", seq->id, id); }))
        << "the killed client's region stayed registered";
    ASSERT_TRUE(c->CheckServing(absl::Seconds(10)).ok()) << "kvbankd did not survive the kill";
    // Nothing partial: the sequence holds the whole payload or nothing.
    auto info = c->GetSequence("big", seq->id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_TRUE(info->length == 0 || info->length == n) << info->length;
    if (info->length == n) {
      auto f = c->Fetch("big", seq->id, {});
      ASSERT_TRUE(f.ok()) << f.status();
      EXPECT_TRUE(BytesEqual(f->payload, payload));
    }
    ASSERT_TRUE(c->Free("big", seq->id).ok());
    // Every block comes back once the killed call's transfer has ended.
    EXPECT_TRUE(WaitFor([&] {
      auto st = c->GetStats("big");
      return st.ok() && st->size() == 1 && (*st)[0].blocks_used == 0;
    })) << "blocks leaked: "
        << StatsOf(*c, "big").blocks_used;
    ExpectAccounting(StatsOf(*c, "big"));
  }
}

}  // namespace
}  // namespace kvbank::integ
