// transfer_bench: append and fetch throughput over loopback gRPC against a raw TCP socket pump
// moving the same payload sizes in the same run.
//
//   transfer_bench [--quick] [--reps N] [--tokens N,N,...] [--chunk-bytes N]
//                  [--grpc-lookahead-bytes N] [--grpc-bdp-probe 0|1]
//
// The kvbank service runs in this process on 127.0.0.1:<ephemeral> (built as server/kvbankd builds
// kvbankd: same message-size limits); the real kvbank::Client talks to it over loopback TCP.
// Model: llama-3.1-8b bf16 (128 KiB of payload per token); default sizes 8, 128, 1024 tokens.
//
//   grpc append: Client::Append of the whole payload (sequence create and free are not timed).
//   grpc fetch:  Client::Fetch of the whole sequence (returns a freshly allocated vector).
//   grpc fetch into: Client::FetchInto a buffer reused across repetitions (the tcp fetch's
//                terms; "into ratio" is against the same pair's tcp fetch).
//   tcp append:  the client write()s the payload on a plain TCP connection; a server thread read()s
//                it in chunk-sized pieces and memcpy's each into a store buffer, then acks.
//   tcp fetch:   a server thread memcpy's each chunk out of the store buffer and write()s it; the
//                client read()s straight into a reused destination buffer.
// The TCP pump is the floor a byte-moving service cannot beat on this machine: one kernel send,
// one kernel receive and the one copy into (or out of) storage. ratio = grpc / tcp throughput, as
// the median over repetitions of pairs measured back to back (the machine is shared and noisy).
// GB/s columns are medians. faults/MiB counts minor page faults of the whole process (client and
// server) per MiB moved during the gRPC call: memory malloc'd and returned to the kernel per call.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kvbank/client.h"
#include "server/core/model_registry.h"
#include "server/rpc/service.h"
#include "server/rpc/serving.h"

namespace kvbank {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "transfer_bench: %s\n", what.c_str());
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

// ---- raw TCP pump -------------------------------------------------------------------------------

void WriteAll(int fd, const uint8_t* p, uint64_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) Die(std::string("tcp write: ") + std::strerror(errno));
    p += w;
    n -= static_cast<uint64_t>(w);
  }
}

void ReadAll(int fd, uint8_t* p, uint64_t n) {
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) Die(std::string("tcp read: ") + (r == 0 ? "eof" : std::strerror(errno)));
    p += r;
    n -= static_cast<uint64_t>(r);
  }
}

void NoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

struct PumpRequest {
  uint64_t op;  // 1: put, 2: get, 0: quit
  uint64_t bytes;
};

// One connection, kept for the whole run (as the gRPC channel is). The server thread models a
// store that takes each received chunk into storage with one memcpy, and serves fetches with one
// memcpy per chunk out of storage.
class TcpPump {
 public:
  TcpPump(uint64_t max_bytes, uint64_t chunk_bytes) : store_(max_bytes, 0), chunk_(chunk_bytes, 0) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::listen(listen_fd_, 1) != 0) {
      Die(std::string("tcp listen: ") + std::strerror(errno));
    }
    socklen_t len = sizeof addr;
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    server_ = std::thread([this] { Serve(); });
    client_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(client_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      Die(std::string("tcp connect: ") + std::strerror(errno));
    }
    NoDelay(client_fd_);
  }
  ~TcpPump() {
    const PumpRequest quit{0, 0};
    WriteAll(client_fd_, reinterpret_cast<const uint8_t*>(&quit), sizeof quit);
    server_.join();
    ::close(client_fd_);
    ::close(listen_fd_);
  }

  void Put(const uint8_t* src, uint64_t n) {
    const PumpRequest req{1, n};
    WriteAll(client_fd_, reinterpret_cast<const uint8_t*>(&req), sizeof req);
    WriteAll(client_fd_, src, n);
    uint8_t ack = 0;
    ReadAll(client_fd_, &ack, 1);
  }
  void Get(uint8_t* dst, uint64_t n) {
    const PumpRequest req{2, n};
    WriteAll(client_fd_, reinterpret_cast<const uint8_t*>(&req), sizeof req);
    ReadAll(client_fd_, dst, n);
  }

 private:
  void Serve() {
    const int fd = ::accept(listen_fd_, nullptr, nullptr);
    if (fd < 0) Die(std::string("tcp accept: ") + std::strerror(errno));
    NoDelay(fd);
    for (;;) {
      PumpRequest req;
      ReadAll(fd, reinterpret_cast<uint8_t*>(&req), sizeof req);
      if (req.op == 0) break;
      for (uint64_t off = 0; off < req.bytes;) {
        const uint64_t n = std::min<uint64_t>(chunk_.size(), req.bytes - off);
        if (req.op == 1) {
          ReadAll(fd, chunk_.data(), n);
          std::memcpy(store_.data() + off, chunk_.data(), n);
        } else {
          std::memcpy(chunk_.data(), store_.data() + off, n);
          WriteAll(fd, chunk_.data(), n);
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

  std::vector<uint8_t> store_;
  std::vector<uint8_t> chunk_;
  int listen_fd_ = -1;
  int client_fd_ = -1;
  std::thread server_;
};

// ---- in-process kvbank server
// --------------------------------------------------------------------

class InProcessServer {
 public:
  // lookahead_bytes > 0 sets GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES on the server, bdp_probe >= 0
  // GRPC_ARG_HTTP2_BDP_PROBE (experiments: kvbankd turns the probe off and sets an 8 MiB
  // lookahead, rpc::kStreamWindowBytes).
  InProcessServer(uint64_t pool_bytes, uint64_t chunk_bytes, int lookahead_bytes, int bdp_probe) {
    registry_ = std::make_shared<ModelRegistry>(pool_bytes);
    rpc::ServiceOptions options;
    options.defaults.pool_bytes = pool_bytes;
    options.chunk_bytes = chunk_bytes;
    service_ = std::make_unique<rpc::KvBankService>(registry_, options);
    rpc::ServingOptions serving;  // as kvbankd serves, on its own listener
    if (lookahead_bytes > 0) {
      serving.channel_args.emplace_back(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, lookahead_bytes);
    }
    if (bdp_probe >= 0) serving.channel_args.emplace_back(GRPC_ARG_HTTP2_BDP_PROBE, bdp_probe);
    auto started = rpc::Serving::Start(service_.get(), std::move(serving));
    if (!started.ok()) Die("cannot start the in-process kvbank server");
    serving_ = *std::move(started);
  }
  std::string target() const { return "127.0.0.1:" + std::to_string(serving_->port()); }

 private:
  std::shared_ptr<ModelRegistry> registry_;
  std::unique_ptr<rpc::KvBankService> service_;
  std::unique_ptr<rpc::Serving> serving_;  // stopped before the service goes
};

// ---- the benchmark
// -------------------------------------------------------------------------------

// Minor page faults of the whole process so far (client and in-process server together).
uint64_t MinorFaults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<uint64_t>(u.ru_minflt);
}

struct Row {
  uint64_t bytes = 0;
  double grpc_append = 0, tcp_append = 0, grpc_fetch = 0, tcp_fetch = 0;  // median GB/s
  // Median over repetitions of grpc / tcp throughput, each pair measured back to back: steadier
  // than the ratio of the medians when the machine's load drifts.
  double append_ratio = 0, fetch_ratio = 0;
  // Median page faults per MiB of payload during the gRPC calls: 256 means every payload byte
  // landed once on a fresh 4 KiB page somewhere (a buffer malloc'd and released per call).
  double append_faults_per_mib = 0, fetch_faults_per_mib = 0;
  // Client::FetchInto a buffer reused across repetitions (as a worker's pinned staging buffer).
  double grpc_fetch_into = 0, fetch_into_ratio = 0;
};

Row RunSize(Client& client, TcpPump& pump, const std::string& model, uint64_t bytes_per_token,
            uint64_t tokens, int reps) {
  const uint64_t bytes = tokens * bytes_per_token;
  const std::vector<uint8_t> src = Pattern(bytes, static_cast<uint32_t>(tokens));
  std::vector<uint8_t> dst(bytes, 1), into(bytes, 1);
  std::vector<double> ga, gf, ta, tf, fa, ff, ra, rf, gi, ri;
  // Rep 0 is a warm-up (pool pages, socket buffers, HTTP/2 windows) and is not recorded.
  for (int r = 0; r <= reps; ++r) {
    auto t0 = Clock::now();
    pump.Put(src.data(), bytes);
    auto t1 = Clock::now();
    pump.Get(dst.data(), bytes);
    auto t2 = Clock::now();
    const double tcp_put = Seconds(t0, t1), tcp_get = Seconds(t1, t2);
    if (r == 0 && std::memcmp(src.data(), dst.data(), bytes) != 0) Die("tcp pump corrupted bytes");

    const auto seq = Check(client.CreateSequence(model, absl::ZeroDuration()), "CreateSequence");
    Client::AppendArgs a;
    a.num_tokens = tokens;
    const uint64_t f0 = MinorFaults();
    t0 = Clock::now();
    Check(client.Append(model, seq.id, a, absl::MakeConstSpan(src)), "Append");
    t1 = Clock::now();
    const uint64_t f1 = MinorFaults();
    auto fetched = Check(client.Fetch(model, seq.id, {}), "Fetch");
    t2 = Clock::now();
    const uint64_t f2 = MinorFaults();
    if (r == 0 && fetched.payload != src) Die("fetched payload differs from the appended one");
    fetched = {};
    const auto t3 = Clock::now();
    Check(client.FetchInto(model, seq.id, {}, absl::MakeSpan(into)), "FetchInto");
    const auto t4 = Clock::now();
    if (r == 0 && into != src) Die("FetchInto's bytes differ from the appended ones");
    Check(client.Free(model, seq.id), "Free");
    if (r == 0) continue;
    ta.push_back(tcp_put);
    tf.push_back(tcp_get);
    ga.push_back(Seconds(t0, t1));
    gf.push_back(Seconds(t1, t2));
    ra.push_back(tcp_put / Seconds(t0, t1));
    rf.push_back(tcp_get / Seconds(t1, t2));
    gi.push_back(Seconds(t3, t4));
    ri.push_back(tcp_get / Seconds(t3, t4));
    const double mib = double(bytes) / (1 << 20);
    fa.push_back(double(f1 - f0) / mib);
    ff.push_back(double(f2 - f1) / mib);
  }
  const double gb = double(bytes) / 1e9;
  Row row;
  row.bytes = bytes;
  row.grpc_append = gb / Median(ga);
  row.tcp_append = gb / Median(ta);
  row.grpc_fetch = gb / Median(gf);
  row.tcp_fetch = gb / Median(tf);
  row.append_ratio = Median(ra);
  row.fetch_ratio = Median(rf);
  row.append_faults_per_mib = Median(fa);
  row.fetch_faults_per_mib = Median(ff);
  row.grpc_fetch_into = gb / Median(gi);
  row.fetch_into_ratio = Median(ri);
  return row;
}

// GB/s of first-touching freshly mapped memory (page-fault bound): what a payload buffer that
// is allocated per call costs on this machine, at best.
double FirstTouchGbs(uint64_t bytes, int reps) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) Die("mmap failed");
    const auto t0 = Clock::now();
    std::memset(p, 1, bytes);
    const auto t1 = Clock::now();
    munmap(p, bytes);
    t.push_back(Seconds(t0, t1));
  }
  return double(bytes) / 1e9 / Median(t);
}

// Median microseconds of a small unary call (GetSequence) and of a 1-byte TCP ping-pong: the
// fixed cost every append or fetch pays on top of moving bytes.
void PrintRoundTrips(Client& client, TcpPump& pump, const std::string& model, int reps) {
  const auto seq = Check(client.CreateSequence(model, absl::ZeroDuration()), "CreateSequence");
  std::vector<double> grpc_us, tcp_us;
  uint8_t byte = 0;
  for (int r = 0; r <= reps; ++r) {
    auto t0 = Clock::now();
    Check(client.GetSequence(model, seq.id), "GetSequence");
    auto t1 = Clock::now();
    pump.Put(&byte, 1);
    auto t2 = Clock::now();
    if (r == 0) continue;
    grpc_us.push_back(Seconds(t0, t1) * 1e6);
    tcp_us.push_back(Seconds(t1, t2) * 1e6);
  }
  Check(client.Free(model, seq.id), "Free");
  std::printf("round trip: grpc unary GetSequence %.0f us, tcp 1-byte put+ack %.0f us\n",
              Median(grpc_us), Median(tcp_us));
}

std::vector<uint64_t> ParseTokens(const char* text) {
  std::vector<uint64_t> out;
  for (const char* p = text; *p != '\0';) {
    char* end = nullptr;
    const uint64_t v = std::strtoull(p, &end, 10);
    if (end == p || v == 0) Die(std::string("--tokens: not a list of positive counts: ") + text);
    out.push_back(v);
    p = *end == ',' ? end + 1 : end;
  }
  if (out.empty()) Die("--tokens is empty");
  return out;
}

int Main(int argc, char** argv) {
  bool quick = false;
  int reps = 0;
  int lookahead = 0;
  int bdp_probe = -1;
  uint64_t chunk_bytes = uint64_t{1} << 20;
  std::vector<uint64_t> tokens;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--reps") == 0 && has_value) {
      reps = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--chunk-bytes") == 0 && has_value) {
      chunk_bytes = std::strtoull(argv[++i], nullptr, 10);
    } else if (std::strcmp(argv[i], "--tokens") == 0 && has_value) {
      tokens = ParseTokens(argv[++i]);
    } else if (std::strcmp(argv[i], "--grpc-lookahead-bytes") == 0 && has_value) {
      lookahead = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--grpc-bdp-probe") == 0 && has_value) {
      bdp_probe = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: transfer_bench [--quick] [--reps N] [--tokens N,N,...] "
                   "[--chunk-bytes N] [--grpc-lookahead-bytes N] [--grpc-bdp-probe 0|1]\n");
      return 2;
    }
  }
  if (chunk_bytes == 0 || chunk_bytes > uint64_t(rpc::kMaxMessageBytes) / 2) {
    Die("--chunk-bytes must be in (0, " + std::to_string(rpc::kMaxMessageBytes / 2) + "]");
  }
  if (tokens.empty())
    tokens = quick ? std::vector<uint64_t>{8, 32} : std::vector<uint64_t>{8, 128, 1024};
  const uint64_t max_tokens = *std::max_element(tokens.begin(), tokens.end());
  // A pool that holds the largest sequence twice over (llama-3.1-8b bf16: 128 KiB per token), at
  // least 256 MiB; only the blocks used get touched.
  const uint64_t pool_bytes = std::max<uint64_t>(
      uint64_t{256} << 20, uint64_t{2} * (max_tokens + 16) * (uint64_t{128} << 10));

  InProcessServer server(pool_bytes, chunk_bytes, lookahead, bdp_probe);
  ClientOptions copts;
  copts.chunk_bytes = chunk_bytes;
  auto client = Check(Client::Connect(server.target(), copts), "Connect");
  if (!client->WaitForServing(absl::Seconds(10))) Die("server is not SERVING");
  const std::string model = "llama";
  const auto info =
      Check(client->EnsurePreset(model, "llama-3.1-8b", DType::kBf16, pool_bytes), "EnsurePreset");
  const uint64_t per_token = info.payload_bytes_per_token;
  TcpPump pump(max_tokens * per_token, chunk_bytes);

  std::printf("transfer_bench: %s, loopback, llama-3.1-8b bf16 (%" PRIu64
              " B/token), chunk %" PRIu64 " B, grpc lookahead %s, GB/s = 1e9 bytes/s, medians\n",
              quick ? "quick" : "full", per_token, chunk_bytes,
              lookahead > 0 ? std::to_string(lookahead).c_str() : "default");
  PrintRoundTrips(*client, pump, model, quick ? 20 : 200);
  std::printf("first touch of fresh memory (page faults, 4 KiB pages): %.2f GB/s\n\n",
              FirstTouchGbs(uint64_t{32} << 20, quick ? 3 : 9));
  std::printf(
      "| payload | tokens | reps | grpc append | tcp | append ratio | grpc fetch | tcp | "
      "fetch ratio | append faults/MiB | fetch faults/MiB | grpc fetch into | into ratio |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (uint64_t t : tokens) {
    const uint64_t bytes = t * per_token;
    const int n = reps > 0 ? reps : quick ? 3 : bytes >= (uint64_t{64} << 20) ? 9 : 15;
    const Row r = RunSize(*client, pump, model, per_token, t, n);
    std::printf("| %.3g MiB | %" PRIu64
                " | %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f | %.0f | %.2f | %.2f |\n",
                double(bytes) / (1 << 20), t, n, r.grpc_append, r.tcp_append, r.append_ratio,
                r.grpc_fetch, r.tcp_fetch, r.fetch_ratio, r.append_faults_per_mib,
                r.fetch_faults_per_mib, r.grpc_fetch_into, r.fetch_into_ratio);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace kvbank

int main(int argc, char** argv) { return kvbank::Main(argc, argv); }
