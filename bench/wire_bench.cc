// wire_bench: the shipped kvbankd, measured as its own process, against a raw TCP pump and Redis
// moving the same payloads over loopback in the same run.
//
//   wire_bench [--quick] [--reps N] [--kvbankd PATH] [--redis-server PATH] [--clients N]
//
// Every party is its own process: kvbankd (this build's, or --kvbankd), started with
// --device=host and a 1 GiB pool; the client (this process, through the C++ SDK kvbank::Client);
// the TCP pump's server (this binary again, --role=pump-server); redis-server 7 (found on PATH,
// started on a free loopback port without persistence; skipped, with a line saying so, when it is
// missing); and, for the aggregate rows, N client processes (this binary, --role=agg).
//
// Payload rows (llama-3.1-8b bf16, 128 KiB per token; 256 KiB, 2 MiB, 16 MiB, 128 MiB):
//   tcp put / get: the client write()s the payload on one long-lived TCP connection; the pump's
//       server read()s it in 1 MiB pieces, memcpy's each into a store buffer and acks (put); or
//       memcpy's each piece out of the store and write()s it, the client read()ing straight into
//       a reused buffer (get). One kernel send, one kernel receive, the one copy into or out of
//       storage: the floor for a service that stores bytes.
//   redis SET / GET: the same payload as one value, over RESP (a minimal client here: GET reads
//       the bulk string straight into a reused buffer).
//   kvbank append: Client::Append of the whole payload to a fresh sequence (create and free not
//       timed). fetch: Client::Fetch (a freshly allocated vector). fetch into: Client::FetchInto
//       a reused buffer (the terms of tcp get and redis GET).
// Each repetition makes the same number of calls of every kind (enough to move about 32 MiB),
// call by call in turn (tcp put, redis SET, append, tcp get, redis GET, fetch, fetch into), and
// sums each kind's times; the ratios are medians over repetitions of per-repetition ratios
// (steadier than ratios of medians on a shared machine). Repetition 0 is a
// warm-up, not recorded, and checks every path returns the bytes it was given.
//
// Aggregate rows: N processes (default 4), each with its own connection, fetch 2 MiB values
// repeatedly (kvbank FetchInto of its own sequence, redis GET of its own key, tcp get on its own
// pump connection), started together; GB/s = all bytes / wall time from start to the last done.
//
// Small calls: median (p50) microseconds over interleaved calls, against an empty gRPC unary call
// on the same server: grpc.health.v1.Health/Check (kvbankd's default health service, a callback
// service like kvbank's) made the way the SDK makes unary calls (a blocking call on a channel
// with the SDK's arguments, its own connection).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/client_unary_call.h"
#include "kvbank/client.h"

#ifndef KVBANK_KVBANKD_PATH
#error "KVBANK_KVBANKD_PATH must name the kvbankd binary (bench/CMakeLists.txt)"
#endif

namespace kvbank {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "wire_bench[%d]: %s\n", static_cast<int>(getpid()), what.c_str());
  std::exit(1);
}

template <typename T>
T Check(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) Die(std::string(what) + ": " + v.status().ToString());
  return *std::move(v);
}

std::vector<uint8_t> Pattern(uint64_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  uint32_t x = seed;
  for (uint64_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

std::string SelfPath() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) Die("cannot read /proc/self/exe");
  return std::string(buf, static_cast<size_t>(n));
}

// ---- sockets ------------------------------------------------------------------------------------

void WriteAll(int fd, const void* data, uint64_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) Die(std::string("write: ") + std::strerror(errno));
    p += w;
    n -= static_cast<uint64_t>(w);
  }
}

// False on a clean end of stream before the first byte; dies on anything else short.
bool ReadAll(int fd, void* data, uint64_t n) {
  uint8_t* p = static_cast<uint8_t*>(data);
  const uint64_t want = n;
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0 && n == want) return false;
    if (r <= 0) Die(std::string("read: ") + (r == 0 ? "eof" : std::strerror(errno)));
    p += r;
    n -= static_cast<uint64_t>(r);
  }
  return true;
}

void NoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

int ConnectLoopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  NoDelay(fd);
  return fd;
}

// A listening socket on 127.0.0.1:<ephemeral>; *port gets the port.
int ListenLoopback(int* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 64) != 0) {
    Die(std::string("listen: ") + std::strerror(errno));
  }
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

// ---- child processes ----------------------------------------------------------------------------

struct Child {
  pid_t pid = -1;
  int to = -1;    // its stdin (-1: /dev/null)
  int from = -1;  // its stdout (-1: `log` or inherited)
};

// Starts `args` with its stdin and stdout on pipes (`pipes`) or, else, stdin on /dev/null and
// stdout + stderr into `log` (when not empty). The child dies with this process.
Child Spawn(const std::vector<std::string>& args, bool pipes, const std::string& log = "") {
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (std::string& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  int in[2] = {-1, -1}, out[2] = {-1, -1};
  if (pipes && (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0)) Die("pipe");
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  const int log_fd =
      log.empty() ? -1 : open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {  // only async-signal-safe calls until exec (this process has gRPC threads)
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);
    dup2(pipes ? in[0] : null_fd, 0);
    if (pipes) dup2(out[1], 1);
    if (log_fd >= 0) {
      if (!pipes) dup2(log_fd, 1);
      dup2(log_fd, 2);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  if (pid < 0) Die("fork");
  if (null_fd >= 0) close(null_fd);
  if (log_fd >= 0) close(log_fd);
  Child c;
  c.pid = pid;
  if (pipes) {
    close(in[0]);
    close(out[1]);
    c.to = in[1];
    c.from = out[0];
  }
  return c;
}

// One line from a child's stdout (without the newline); empty at end of stream.
std::string ReadLineFd(int fd) {
  std::string line;
  char ch;
  while (ReadAll(fd, &ch, 1) && ch != '\n') line.push_back(ch);
  return line;
}

void StopChild(Child& c, int sig) {
  if (c.pid <= 0) return;
  kill(c.pid, sig);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  int status = 0;
  while (waitpid(c.pid, &status, WNOHANG) == 0) {
    if (absl::Now() > deadline) {
      kill(c.pid, SIGKILL);
      waitpid(c.pid, &status, 0);
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  if (c.to >= 0) close(c.to);
  if (c.from >= 0) close(c.from);
  c = Child();
}

std::string TempDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp != nullptr && *tmp ? tmp : "/tmp") + "/wire_bench-XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) Die("mkdtemp");
  return templ;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// ---- the TCP pump -------------------------------------------------------------------------------

struct PumpRequest {
  uint64_t op;  // 1: put, 2: get
  uint64_t bytes;
};
constexpr uint64_t kPumpPiece = uint64_t{1} << 20;

// The pump's server: one thread per connection, each with its own store.
void ServePumpConnection(int fd) {
  NoDelay(fd);
  std::vector<uint8_t> store, piece(kPumpPiece);
  PumpRequest req;
  while (ReadAll(fd, &req, sizeof req)) {
    if (store.size() < req.bytes) store.resize(req.bytes);
    for (uint64_t off = 0; off < req.bytes;) {
      const uint64_t n = std::min<uint64_t>(piece.size(), req.bytes - off);
      if (req.op == 1) {
        ReadAll(fd, piece.data(), n);
        std::memcpy(store.data() + off, piece.data(), n);
      } else {
        std::memcpy(piece.data(), store.data() + off, n);
        WriteAll(fd, piece.data(), n);
      }
      off += n;
    }
    if (req.op == 1) {
      const uint8_t ack = 1;
      WriteAll(fd, &ack, 1);
    }
  }
  ::close(fd);
}

int PumpServerMain() {
  int port = 0;
  const int lfd = ListenLoopback(&port);
  std::printf("%d\n", port);
  std::fflush(stdout);
  // Ends when the parent closes our stdin (or kills us).
  std::thread([] {
    char ch;
    while (::read(0, &ch, 1) > 0) {
    }
    std::_Exit(0);
  }).detach();
  for (;;) {
    const int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      Die(std::string("accept: ") + std::strerror(errno));
    }
    std::thread(ServePumpConnection, fd).detach();
  }
}

class PumpClient {
 public:
  explicit PumpClient(int port) : fd_(ConnectLoopback(port)) {
    if (fd_ < 0) Die("cannot connect to the pump");
  }
  ~PumpClient() { ::close(fd_); }
  void Put(const uint8_t* src, uint64_t n) {
    const PumpRequest req{1, n};
    WriteAll(fd_, &req, sizeof req);
    WriteAll(fd_, src, n);
    uint8_t ack = 0;
    if (!ReadAll(fd_, &ack, 1)) Die("pump closed");
  }
  void Get(uint8_t* dst, uint64_t n) {
    const PumpRequest req{2, n};
    WriteAll(fd_, &req, sizeof req);
    if (!ReadAll(fd_, dst, n)) Die("pump closed");
  }

 private:
  int fd_;
};

// ---- a minimal Redis (RESP) client --------------------------------------------------------------

class RedisClient {
 public:
  explicit RedisClient(int port) : fd_(ConnectLoopback(port)) {}
  ~RedisClient() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool connected() const { return fd_ >= 0; }

  // One inline command of short arguments; returns the reply's first line.
  std::string Command(const std::vector<std::string>& args) {
    std::string out = "*" + std::to_string(args.size()) + "\r\n";
    for (const std::string& a : args) out += "$" + std::to_string(a.size()) + "\r\n" + a + "\r\n";
    WriteAll(fd_, out.data(), out.size());
    return ReadLine();
  }
  // A command whose reply is a bulk string; returns it.
  std::string Bulk(const std::vector<std::string>& args) {
    const std::string head = Command(args);
    if (head.empty() || head[0] != '$') Die("redis: " + head);
    std::string v(static_cast<size_t>(std::max(0LL, std::atoll(head.c_str() + 1))) + 2, '\0');
    ReadExact(reinterpret_cast<uint8_t*>(v.data()), v.size());
    v.resize(v.size() - 2);
    return v;
  }
  void Set(const std::string& key, const uint8_t* data, uint64_t n) {
    const std::string head = "*3\r\n$3\r\nSET\r\n$" + std::to_string(key.size()) + "\r\n" + key +
                             "\r\n$" + std::to_string(n) + "\r\n";
    WriteAll(fd_, head.data(), head.size());
    WriteAll(fd_, data, n);
    WriteAll(fd_, "\r\n", 2);
    const std::string reply = ReadLine();
    if (reply != "+OK") Die("redis SET: " + reply);
  }
  // Reads the value into `dst`; returns its size. Dies when it does not fit.
  uint64_t Get(const std::string& key, uint8_t* dst, uint64_t cap) {
    const std::string cmd =
        "*2\r\n$3\r\nGET\r\n$" + std::to_string(key.size()) + "\r\n" + key + "\r\n";
    WriteAll(fd_, cmd.data(), cmd.size());
    const std::string head = ReadLine();
    if (head.empty() || head[0] != '$') Die("redis GET: " + head);
    const long long n = std::atoll(head.c_str() + 1);
    if (n < 0 || static_cast<uint64_t>(n) > cap) Die("redis GET: value missing or too large");
    ReadExact(dst, static_cast<uint64_t>(n));
    char crlf[2];
    ReadExact(reinterpret_cast<uint8_t*>(crlf), 2);
    return static_cast<uint64_t>(n);
  }

 private:
  std::string ReadLine() {
    for (;;) {
      const size_t end = pending_.find("\r\n");
      if (end != std::string::npos) {
        std::string line = pending_.substr(0, end);
        pending_.erase(0, end + 2);
        return line;
      }
      char buf[512];
      const ssize_t r = ::read(fd_, buf, sizeof buf);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) Die("redis closed the connection");
      pending_.append(buf, static_cast<size_t>(r));
    }
  }
  // Whatever ReadLine read past its line first, then straight from the socket.
  void ReadExact(uint8_t* dst, uint64_t n) {
    const uint64_t have = std::min<uint64_t>(n, pending_.size());
    std::memcpy(dst, pending_.data(), have);
    pending_.erase(0, have);
    if (n > have && !ReadAll(fd_, dst + have, n - have)) Die("redis closed the connection");
  }

  int fd_;
  std::string pending_;
};

// A free loopback port (bound and released: redis-server takes the number as a flag).
int FreePort() {
  int port = 0;
  const int fd = ListenLoopback(&port);
  ::close(fd);
  return port;
}

std::string FindOnPath(const std::string& name) {
  if (name.find('/') != std::string::npos) return access(name.c_str(), X_OK) == 0 ? name : "";
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string p = dir + "/" + name;
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  for (const char* d : {"/usr/sbin", "/usr/local/bin", "/usr/bin"}) {
    const std::string p = std::string(d) + "/" + name;
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

// ---- kvbank -------------------------------------------------------------------------------------

constexpr char kModel[] = "llama-3.1-8b";  // kvbankd's default model, bf16: 128 KiB per token

// Waits for kvbankd's port file; dies with its log when it does not come up.
int WaitForPortFile(const Child& server, const std::string& port_file, const std::string& log) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    int status = 0;
    if (waitpid(server.pid, &status, WNOHANG) == server.pid) {
      Die("kvbankd exited before serving; its log:\n" + ReadFile(log));
    }
    const int port = std::atoi(ReadFile(port_file).c_str());
    if (port > 0) return port;
    absl::SleepFor(absl::Milliseconds(10));
  }
  Die("kvbankd wrote no port file within 30 s; its log:\n" + ReadFile(log));
}

std::unique_ptr<Client> ConnectKvbank(int port) {
  auto client = Check(Client::Connect("127.0.0.1:" + std::to_string(port)), "Connect");
  if (absl::Status s = client->CheckServing(absl::Seconds(10)); !s.ok()) {
    Die("kvbankd is not serving: " + s.ToString());
  }
  return client;
}

uint64_t CreateAndAppend(Client& client, const std::vector<uint8_t>& payload, uint64_t tokens) {
  const auto seq = Check(client.CreateSequence(kModel, absl::ZeroDuration()), "CreateSequence");
  Client::AppendArgs a;
  a.num_tokens = tokens;
  Check(client.Append(kModel, seq.id, a, absl::MakeConstSpan(payload)), "Append");
  return seq.id;
}

// ---- aggregate client process -------------------------------------------------------------------

// --role=agg: sets up, says "ready", waits for one byte on stdin, fetches `count` times, prints
// the seconds it took.
int AggMain(const std::string& kind, int port, uint64_t tokens, int count, int id) {
  const uint64_t bytes = tokens * (uint64_t{128} << 10);
  const std::vector<uint8_t> src = Pattern(bytes, 1000 + static_cast<uint32_t>(id));
  std::vector<uint8_t> dst(bytes, 0);
  std::unique_ptr<Client> client;
  std::unique_ptr<RedisClient> redis;
  std::unique_ptr<PumpClient> pump;
  uint64_t seq = 0;
  const std::string key = "agg" + std::to_string(id);
  if (kind == "kvbank") {
    client = ConnectKvbank(port);
    seq = CreateAndAppend(*client, src, tokens);
    Check(client->FetchInto(kModel, seq, {}, absl::MakeSpan(dst)), "FetchInto");
  } else if (kind == "redis") {
    redis = std::make_unique<RedisClient>(port);
    if (!redis->connected()) Die("cannot connect to redis");
    redis->Set(key, src.data(), bytes);
    redis->Get(key, dst.data(), dst.size());
  } else if (kind == "tcp") {
    pump = std::make_unique<PumpClient>(port);
    pump->Put(src.data(), bytes);
    pump->Get(dst.data(), bytes);
  } else {
    Die("unknown --kind " + kind);
  }
  if (dst != src) Die(kind + ": the bytes read back differ from the bytes written");
  std::printf("ready\n");
  std::fflush(stdout);
  char go;
  if (!ReadAll(0, &go, 1)) return 1;
  const auto t0 = Clock::now();
  for (int i = 0; i < count; ++i) {
    if (client) {
      Check(client->FetchInto(kModel, seq, {}, absl::MakeSpan(dst)), "FetchInto");
    } else if (redis) {
      redis->Get(key, dst.data(), dst.size());
    } else {
      pump->Get(dst.data(), bytes);
    }
  }
  const auto t1 = Clock::now();
  if (client) Check(client->Free(kModel, seq), "Free");
  std::printf("%.9f\n", Seconds(t0, t1));
  std::fflush(stdout);
  return 0;
}

// ---- the driver ---------------------------------------------------------------------------------

struct Env {
  int kvbank_port = 0;
  int pump_port = 0;
  int redis_port = 0;  // 0: no redis
  std::string self;
};

struct PayloadRow {
  uint64_t bytes = 0;
  int calls = 0;  // per repetition, of each kind
  // Median GB/s over repetitions.
  double tcp_put = 0, tcp_get = 0, redis_set = 0, redis_get = 0;
  double append = 0, fetch = 0, fetch_into = 0;
  // Medians of per-repetition ratios.
  double append_tcp = 0, fetch_tcp = 0, into_tcp = 0, into_redis = 0, append_redis = 0;
  // Median minor page faults of this (the client's) process per MiB fetched by FetchInto: 256
  // means every byte received landed on a fresh 4 KiB page (buffers mapped and unmapped per call).
  double into_faults_per_mib = 0;
};

uint64_t MinorFaults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<uint64_t>(u.ru_minflt);
}

PayloadRow RunPayload(const Env& env, Client& client, PumpClient& pump, RedisClient* redis,
                      uint64_t tokens, int reps, bool quick) {
  const uint64_t bytes = tokens * (uint64_t{128} << 10);
  const int calls =
      quick ? 1 : static_cast<int>(std::max<uint64_t>(1, (uint64_t{32} << 20) / bytes));
  const std::vector<uint8_t> src = Pattern(bytes, static_cast<uint32_t>(tokens));
  std::vector<uint8_t> dst(bytes, 0);
  std::vector<double> tp, tg, rs, rg, ka, kf, ki;
  std::vector<double> r_at, r_ft, r_it, r_ir, r_ar, faults;
  const std::string key = "payload" + std::to_string(bytes);
  for (int rep = 0; rep <= reps; ++rep) {
    const bool check = rep == 0;
    std::vector<uint64_t> seqs;
    for (int i = 0; i < calls; ++i) {
      seqs.push_back(Check(client.CreateSequence(kModel, absl::ZeroDuration()), "Create").id);
    }
    Client::AppendArgs a;
    a.num_tokens = tokens;
    // Call by call, every kind in turn: each kind's time is a sum over the same stretch of the
    // machine's load, so the ratios compare like with like.
    double s_tp = 0, s_tg = 0, s_rs = 0, s_rg = 0, s_ka = 0, s_kf = 0, s_ki = 0;
    uint64_t faults_into = 0;
    auto timed = [](double* sum, auto&& fn) {
      const auto t0 = Clock::now();
      fn();
      *sum += Seconds(t0, Clock::now());
    };
    for (int i = 0; i < calls; ++i) {
      const uint64_t id = seqs[static_cast<size_t>(i)];
      timed(&s_tp, [&] { pump.Put(src.data(), bytes); });
      if (redis != nullptr) timed(&s_rs, [&] { redis->Set(key, src.data(), bytes); });
      timed(&s_ka,
            [&] { Check(client.Append(kModel, id, a, absl::MakeConstSpan(src)), "Append"); });
      if (check) std::fill(dst.begin(), dst.end(), 0);
      timed(&s_tg, [&] { pump.Get(dst.data(), bytes); });
      if (check && dst != src) Die("tcp pump corrupted bytes");
      if (redis != nullptr) {
        if (check) std::fill(dst.begin(), dst.end(), 0);
        timed(&s_rg, [&] { redis->Get(key, dst.data(), dst.size()); });
        if (check && dst != src) Die("redis GET returned other bytes");
      }
      Client::FetchResult fetched;
      timed(&s_kf, [&] { fetched = Check(client.Fetch(kModel, id, {}), "Fetch"); });
      if (check && fetched.payload != src) Die("Fetch returned other bytes");
      fetched = {};
      if (check) std::fill(dst.begin(), dst.end(), 0);
      const uint64_t f0 = MinorFaults();
      timed(&s_ki,
            [&] { Check(client.FetchInto(kModel, id, {}, absl::MakeSpan(dst)), "FetchInto"); });
      faults_into += MinorFaults() - f0;
      if (check && dst != src) Die("FetchInto returned other bytes");
    }
    faults.push_back(double(faults_into) / (double(bytes) * calls / (1 << 20)));
    for (uint64_t id : seqs) Check(client.Free(kModel, id), "Free");
    if (rep == 0) continue;
    tp.push_back(s_tp);
    tg.push_back(s_tg);
    ka.push_back(s_ka);
    kf.push_back(s_kf);
    ki.push_back(s_ki);
    r_at.push_back(s_tp / s_ka);
    r_ft.push_back(s_tg / s_kf);
    r_it.push_back(s_tg / s_ki);
    if (redis != nullptr) {
      rs.push_back(s_rs);
      rg.push_back(s_rg);
      r_ir.push_back(s_rg / s_ki);
      r_ar.push_back(s_rs / s_ka);
    }
  }
  const double gb = double(bytes) * calls / 1e9;
  auto gbs = [&](const std::vector<double>& s) { return s.empty() ? 0 : gb / Median(s); };
  PayloadRow row;
  row.bytes = bytes;
  row.calls = calls;
  row.tcp_put = gbs(tp);
  row.tcp_get = gbs(tg);
  row.redis_set = gbs(rs);
  row.redis_get = gbs(rg);
  row.append = gbs(ka);
  row.fetch = gbs(kf);
  row.fetch_into = gbs(ki);
  row.append_tcp = Median(r_at);
  row.fetch_tcp = Median(r_ft);
  row.into_tcp = Median(r_it);
  row.into_redis = Median(r_ir);
  row.append_redis = Median(r_ar);
  faults.erase(faults.begin());  // the warm-up's
  row.into_faults_per_mib = Median(faults);
  (void)env;
  return row;
}

// Aggregate GB/s of `n` processes each fetching `count` times `tokens` tokens of `kind`.
double RunAggregate(const Env& env, const std::string& kind, int n, uint64_t tokens, int count) {
  const int port = kind == "kvbank"  ? env.kvbank_port
                   : kind == "redis" ? env.redis_port
                                     : env.pump_port;
  std::vector<Child> kids;
  for (int i = 0; i < n; ++i) {
    kids.push_back(Spawn({env.self, "--role=agg", "--kind=" + kind,
                          "--port=" + std::to_string(port), "--tokens=" + std::to_string(tokens),
                          "--count=" + std::to_string(count), "--id=" + std::to_string(i)},
                         /*pipes=*/true));
  }
  for (Child& c : kids) {
    if (ReadLineFd(c.from) != "ready") Die("an aggregate " + kind + " client failed to set up");
  }
  const auto t0 = Clock::now();
  for (Child& c : kids) WriteAll(c.to, "g", 1);
  for (Child& c : kids) {
    if (ReadLineFd(c.from).empty()) Die("an aggregate " + kind + " client failed");
  }
  const auto t1 = Clock::now();
  for (Child& c : kids) {
    int status = 0;
    waitpid(c.pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) Die("an aggregate client failed");
    close(c.to);
    close(c.from);
  }
  return double(tokens * (uint64_t{128} << 10)) * count * n / 1e9 / Seconds(t0, t1);
}

// Blocking grpc.health.v1.Health/Check, the way the SDK's stub makes unary calls.
class EmptyCall {
 public:
  explicit EmptyCall(int port) {
    grpc::ChannelArguments args;  // as Client::Connect sets them
    args.SetMaxReceiveMessageSize(4 << 20);
    args.SetMaxSendMessageSize(4 << 20);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
    channel_ = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                         grpc::InsecureChannelCredentials(), args);
  }
  void Call() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Slice empty;
    grpc::ByteBuffer request(&empty, 1), response;
    const grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        channel_.get(),
        grpc::internal::RpcMethod("/grpc.health.v1.Health/Check",
                                  grpc::internal::RpcMethod::NORMAL_RPC),
        &ctx, request, &response);
    if (!s.ok()) Die("Health/Check: " + s.error_message());
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
};

void RunSmallCalls(const Env& env, Client& client, int iters) {
  EmptyCall empty(env.kvbank_port);
  // A 2048-token prompt, cached: appended with its token ids, so its 128 full blocks are
  // published. The miss differs in the first token (the first block's hash misses).
  constexpr uint64_t kPrompt = 2048;
  std::vector<uint32_t> prompt(kPrompt), other(kPrompt);
  for (uint64_t i = 0; i < kPrompt; ++i) {
    prompt[i] = static_cast<uint32_t>(1000 + i * 7 % 30000);
    other[i] = prompt[i];
  }
  other[0] = 7;
  const std::vector<uint8_t> payload = Pattern(kPrompt * (uint64_t{128} << 10), 5);
  const auto seq = Check(client.CreateSequence(kModel, absl::ZeroDuration()), "CreateSequence");
  Client::AppendArgs a;
  a.num_tokens = kPrompt;
  a.token_ids = prompt;
  Check(client.Append(kModel, seq.id, a, absl::MakeConstSpan(payload)), "Append");
  Client::MatchQuery hit, miss;
  hit.tokens = prompt;
  miss.tokens = other;
  const std::vector<Client::MatchQuery> hit_q = {hit}, miss_q = {miss};
  if (Check(client.Match(kModel, hit_q), "Match")[0] != kPrompt) Die("the prompt is not cached");
  if (Check(client.Match(kModel, miss_q), "Match")[0] != 0) Die("the other prompt matches");

  std::vector<double> t_empty, t_stats, t_get, t_create, t_free, t_create_free, t_hit, t_miss;
  auto time_us = [](auto&& fn) {
    const auto t0 = Clock::now();
    fn();
    return Seconds(t0, Clock::now()) * 1e6;
  };
  for (int i = 0; i <= iters; ++i) {
    const double e = time_us([&] { empty.Call(); });
    const double st = time_us([&] { Check(client.GetStats(kModel), "GetStats"); });
    const double g = time_us([&] { Check(client.GetSequence(kModel, seq.id), "GetSequence"); });
    uint64_t fresh = 0;
    const double c = time_us(
        [&] { fresh = Check(client.CreateSequence(kModel, absl::ZeroDuration()), "Create").id; });
    const double f = time_us([&] { Check(client.Free(kModel, fresh), "Free"); });
    const double h = time_us([&] { Check(client.Match(kModel, hit_q), "Match"); });
    const double m = time_us([&] { Check(client.Match(kModel, miss_q), "Match"); });
    if (i < iters / 10) continue;  // warm-up
    t_empty.push_back(e);
    t_stats.push_back(st);
    t_get.push_back(g);
    t_create.push_back(c);
    t_free.push_back(f);
    t_create_free.push_back(c + f);
    t_hit.push_back(h);
    t_miss.push_back(m);
  }
  Check(client.Free(kModel, seq.id), "Free");
  const double base = Median(t_empty);
  std::printf(
      "\nsmall calls: p50 over %zu interleaved calls each; empty call = "
      "grpc.health.v1.Health/Check (blocking, SDK channel arguments)\n\n",
      t_empty.size());
  std::printf("| call | p50 us | ÷ empty call |\n|---|---:|---:|\n");
  auto row = [&](const char* name, const std::vector<double>& t) {
    std::printf("| %s | %.0f | %.2f |\n", name, Median(t), Median(t) / base);
  };
  row("empty: Health/Check", t_empty);
  row("GetStats (one model)", t_stats);
  row("GetSequence", t_get);
  row("CreateSequence", t_create);
  row("Free", t_free);
  row("CreateSequence + Free (2 calls; ÷ 1 empty call)", t_create_free);
  row("Match 2048 tokens, hit (128 blocks)", t_hit);
  row("Match 2048 tokens, miss (first block)", t_miss);
}

// CPU seconds (user + system) a process has used so far; 0 when unreadable.
double ProcessCpuSeconds(pid_t pid) {
  std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  const size_t close = stat.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return 0;
  std::istringstream in(stat.substr(close + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && in >> field; ++i) {  // fields 14 and 15: utime, stime
    if (i == 14) utime = std::strtoull(field.c_str(), nullptr, 10);
    if (i == 15) stime = std::strtoull(field.c_str(), nullptr, 10);
  }
  return double(utime + stime) / double(sysconf(_SC_CLK_TCK));
}

// --loop: one kind of call, over and over for `seconds`, for a profiler (perf record -p on the
// pids printed first); prints calls per second.
int Loop(Client& client, pid_t server, const std::string& kind, uint64_t tokens, double seconds) {
  const uint64_t bytes = tokens * (uint64_t{128} << 10);
  const std::vector<uint8_t> src = Pattern(bytes, 3);
  std::vector<uint8_t> dst(bytes);
  const uint64_t seq = CreateAndAppend(client, src, tokens);
  std::vector<uint32_t> prompt(2048);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<uint32_t>(i * 7 + 1);
  Client::MatchQuery q;
  q.tokens = prompt;
  if (kind == "match_hit") {
    const std::vector<uint8_t> payload = Pattern(2048 * (uint64_t{128} << 10), 5);
    const auto s = Check(client.CreateSequence(kModel, absl::ZeroDuration()), "Create");
    Client::AppendArgs a;
    a.num_tokens = 2048;
    a.token_ids = prompt;
    Check(client.Append(kModel, s.id, a, absl::MakeConstSpan(payload)), "Append");
  }
  std::printf("loop %s: kvbankd pid %d, client pid %d\n", kind.c_str(), static_cast<int>(server),
              static_cast<int>(getpid()));
  std::fflush(stdout);
  const uint64_t f0 = MinorFaults();
  const double server_cpu0 = ProcessCpuSeconds(server), client_cpu0 = ProcessCpuSeconds(getpid());
  const auto t0 = Clock::now();
  uint64_t n = 0;
  Client::AppendArgs a;
  a.num_tokens = tokens;
  while (Seconds(t0, Clock::now()) < seconds) {
    if (kind == "fetch") {
      if (Check(client.Fetch(kModel, seq, {}), "Fetch").payload.size() != bytes) Die("Fetch");
    } else if (kind == "fetch_into") {
      Check(client.FetchInto(kModel, seq, {}, absl::MakeSpan(dst)), "FetchInto");
    } else if (kind == "append") {
      const auto s = Check(client.CreateSequence(kModel, absl::ZeroDuration()), "Create");
      Check(client.Append(kModel, s.id, a, absl::MakeConstSpan(src)), "Append");
      Check(client.Free(kModel, s.id), "Free");
    } else if (kind == "match_hit") {
      Check(client.Match(kModel, {q}), "Match");
    } else if (kind == "create_free") {
      const auto s = Check(client.CreateSequence(kModel, absl::ZeroDuration()), "Create");
      Check(client.Free(kModel, s.id), "Free");
    } else {
      Die("unknown --loop " + kind);
    }
    ++n;
  }
  const double wall = Seconds(t0, Clock::now());
  // CPU time per call holds steadier than calls/s on a shared machine: other load stretches the
  // wall clock more than the work each call does.
  std::printf(
      "loop %s: %.1f calls/s, %.1f client page faults per call, CPU us per call: kvbankd %.1f, "
      "client %.1f\n",
      kind.c_str(), n / wall, double(MinorFaults() - f0) / n,
      (ProcessCpuSeconds(server) - server_cpu0) * 1e6 / n,
      (ProcessCpuSeconds(getpid()) - client_cpu0) * 1e6 / n);
  return 0;
}

int Main(int argc, char** argv) {
  bool quick = false, only_payload = false;
  std::string loop;
  double loop_seconds = 10;
  int reps = 3, clients = 4;
  std::string kvbankd = KVBANK_KVBANKD_PATH, redis_server = "redis-server";
  std::string role, kind;
  std::vector<std::string> kvbankd_args;  // appended to kvbankd's command line (later flags win)
  int port = 0, count = 0, id = 0;
  uint64_t tokens_flag = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string prefix = std::string(name) + "=";
      if (arg.rfind(prefix, 0) == 0) return argv[i] + prefix.size();
      if (arg == name && i + 1 < argc) return argv[++i];
      return nullptr;
    };
    const char* v = nullptr;
    if (arg == "--quick") {
      quick = true;
    } else if ((v = value("--reps"))) {
      reps = std::max(1, std::atoi(v));
    } else if ((v = value("--clients"))) {
      clients = std::max(1, std::atoi(v));
    } else if ((v = value("--kvbankd"))) {
      kvbankd = v;
    } else if ((v = value("--kvbankd-arg"))) {
      kvbankd_args.push_back(v);
    } else if ((v = value("--redis-server"))) {
      redis_server = v;
    } else if ((v = value("--loop"))) {
      loop = v;
    } else if ((v = value("--loop-seconds"))) {
      loop_seconds = std::atof(v);
    } else if (arg == "--only-payload") {
      only_payload = true;
    } else if ((v = value("--role"))) {
      role = v;
    } else if ((v = value("--kind"))) {
      kind = v;
    } else if ((v = value("--port"))) {
      port = std::atoi(v);
    } else if ((v = value("--tokens"))) {
      tokens_flag = std::strtoull(v, nullptr, 10);
    } else if ((v = value("--count"))) {
      count = std::atoi(v);
    } else if ((v = value("--id"))) {
      id = std::atoi(v);
    } else {
      std::fprintf(
          stderr,
          "usage: wire_bench [--quick] [--reps N] [--clients N] [--kvbankd PATH] "
          "[--kvbankd-arg FLAG]... [--redis-server PATH] [--tokens N (one payload size)] "
          "[--only-payload]\n"
          "       [--loop append|fetch|fetch_into|match_hit|create_free --loop-seconds S]\n");
      return 2;
    }
  }
  if (role == "pump-server") return PumpServerMain();
  if (role == "agg") return AggMain(kind, port, tokens_flag, count, id);
  if (!role.empty()) Die("unknown --role " + role);
  signal(SIGPIPE, SIG_IGN);

  Env env;
  env.self = SelfPath();
  const std::string dir = TempDir();
  // kvbankd: host memory, a pool for the largest payload's sequences, the cached prompt and the
  // aggregate clients' sequences.
  const std::string kv_log = dir + "/kvbankd.log", port_file = dir + "/port";
  std::vector<std::string> server_argv = {
      kvbankd,         "--listen=127.0.0.1:0",  "--port-file=" + port_file, "--no-auth",
      "--device=host", "--models=llama-3.1-8b", "--pool-bytes=1GiB"};
  server_argv.insert(server_argv.end(), kvbankd_args.begin(), kvbankd_args.end());
  Child server = Spawn(server_argv, /*pipes=*/false, kv_log);
  env.kvbank_port = WaitForPortFile(server, port_file, kv_log);
  Child pump_server = Spawn({env.self, "--role=pump-server"}, /*pipes=*/true);
  env.pump_port = std::atoi(ReadLineFd(pump_server.from).c_str());
  if (env.pump_port <= 0) Die("the pump server did not start");

  Child redis_child;
  std::unique_ptr<RedisClient> redis;
  const std::string redis_path = FindOnPath(redis_server);
  std::string redis_version;
  if (redis_path.empty()) {
    std::printf(
        "redis: SKIPPED: %s not found (apt-get install redis-server); Redis columns "
        "are 0\n",
        redis_server.c_str());
  } else {
    env.redis_port = FreePort();
    redis_child = Spawn({redis_path, "--port", std::to_string(env.redis_port), "--bind",
                         "127.0.0.1", "--save", "", "--appendonly", "no", "--protected-mode", "no",
                         "--daemonize", "no", "--dir", dir, "--loglevel", "warning"},
                        /*pipes=*/false, dir + "/redis.log");
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      auto r = std::make_unique<RedisClient>(env.redis_port);
      if (r->connected() && r->Command({"PING"}) == "+PONG") {
        redis = std::move(r);
        break;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    if (!redis)
      Die("redis-server did not answer PING within 20 s: " + ReadFile(dir + "/redis.log"));
    const std::string info = redis->Bulk({"INFO", "server"});
    const size_t at = info.find("redis_version:");
    redis_version =
        at == std::string::npos ? "?" : info.substr(at + 14, info.find('\r', at) - at - 14);
  }

  auto client = ConnectKvbank(env.kvbank_port);
  auto stop_all = [&] {
    client.reset();
    redis.reset();
    StopChild(redis_child, SIGTERM);
    StopChild(server, SIGTERM);
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  };
  if (!loop.empty()) {
    const int rc =
        Loop(*client, server.pid, loop, tokens_flag > 0 ? tokens_flag : 16, loop_seconds);
    StopChild(pump_server, SIGTERM);
    stop_all();
    return rc;
  }
  PumpClient pump(env.pump_port);
  std::printf(
      "wire_bench: %s, loopback; kvbankd pid %d (%s), pump pid %d, redis %s; "
      "llama-3.1-8b bf16 (128 KiB/token); GB/s = 1e9 B/s; medians of %d reps after a "
      "warm-up\n\n",
      quick ? "quick" : "full", static_cast<int>(server.pid), kvbankd.c_str(),
      static_cast<int>(pump_server.pid),
      redis ? (redis_version + ", pid " + std::to_string(redis_child.pid)).c_str() : "skipped",
      reps);

  std::printf(
      "| payload | calls/rep | tcp put | tcp get | redis SET | redis GET | kvbank append | fetch "
      "| fetch into | append ÷ tcp | fetch ÷ tcp | into ÷ tcp | into ÷ redis GET | append ÷ "
      "redis SET | into faults/MiB |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  std::fflush(stdout);  // the pids, for a profiler to attach to
  std::vector<uint64_t> sizes =
      quick ? std::vector<uint64_t>{2, 16} : std::vector<uint64_t>{2, 16, 128, 1024};
  if (tokens_flag > 0) sizes = {tokens_flag};
  for (uint64_t t : sizes) {
    const PayloadRow r = RunPayload(env, *client, pump, redis.get(), t, quick ? 1 : reps, quick);
    std::printf(
        "| %g MiB | %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | "
        "%.2f | %.2f | %.2f | %.0f |\n",
        double(r.bytes) / (1 << 20), r.calls, r.tcp_put, r.tcp_get, r.redis_set, r.redis_get,
        r.append, r.fetch, r.fetch_into, r.append_tcp, r.fetch_tcp, r.into_tcp, r.into_redis,
        r.append_redis, r.into_faults_per_mib);
    std::fflush(stdout);
  }

  if (only_payload) {
    StopChild(pump_server, SIGTERM);
    stop_all();
    return 0;
  }
  // Aggregate: `clients` processes fetching 2 MiB each.
  const int agg_count = quick ? 5 : 100;
  std::vector<double> g_kv, g_redis, g_tcp, r_kv_redis, r_kv_tcp;
  for (int rep = 0; rep < (quick ? 1 : reps); ++rep) {
    const double tcp = RunAggregate(env, "tcp", clients, 16, agg_count);
    const double rd = redis ? RunAggregate(env, "redis", clients, 16, agg_count) : 0;
    const double kv = RunAggregate(env, "kvbank", clients, 16, agg_count);
    g_tcp.push_back(tcp);
    g_redis.push_back(rd);
    g_kv.push_back(kv);
    r_kv_tcp.push_back(kv / tcp);
    if (redis) r_kv_redis.push_back(kv / rd);
  }
  std::printf("\naggregate: %d processes, each %d fetches of 2 MiB on its own connection\n\n",
              clients, agg_count);
  std::printf(
      "| tcp get GB/s | redis GET GB/s | kvbank FetchInto GB/s | kvbank ÷ redis | kvbank "
      "÷ tcp |\n|---:|---:|---:|---:|---:|\n");
  std::printf("| %.2f | %.2f | %.2f | %.2f | %.2f |\n", Median(g_tcp), Median(g_redis),
              Median(g_kv), Median(r_kv_redis), Median(r_kv_tcp));
  std::fflush(stdout);

  RunSmallCalls(env, *client, quick ? 20 : 500);

  StopChild(pump_server, SIGTERM);
  stop_all();
  return 0;
}

}  // namespace
}  // namespace kvbank

int main(int argc, char** argv) { return kvbank::Main(argc, argv); }
