// shm_bench: the same-host shared-memory plane of the shipped kvbankd, measured as its own
// process, against memcpy of the same bytes in the same run, with the gRPC path beside it.
//
//   shm_bench [--quick] [--reps N] [--kvbankd PATH] [--mib N] [--in-flight N] [--in-flight-iters N]
//             [--server-arg FLAG]...   (each FLAG is passed on to kvbankd)
//             [--small-only N]         (only the 4 KiB rows, N calls each)
//             [--client-spin-us N]     (ClientOptions::shm_control_spin; kvbankd's is
//                                       --server-arg --shm-control-spin-us=N)
//
// kvbankd (this build's, or --kvbankd) runs with --device=host, a 1 GiB llama-3.1-8b pool (bf16,
// 128 KiB of payload per token) and --shm-socket in a temp dir; this process is the client
// (kvbank::Client with ClientOptions::shm_socket) and registers one region of the largest size.
// Payloads of 2, 16 and 128 MiB (16, 128, 1024 tokens; --mib N: N MiB only); per size and
// repetition, in turn:
//   shm append:  Client::AppendFromRegion of the whole payload to a fresh sequence (create and
//                free not timed): kvbankd copies region -> pool, one copy.
//   shm fetch:   Client::FetchToRegion of that sequence: pool -> region, one copy.
//   grpc append: Client::Append of the same bytes from a buffer, over loopback TCP.
//   grpc fetch:  Client::FetchInto a reused buffer (no fresh pages), over loopback TCP.
//   memcpy:      one memcpy of the same number of bytes between two touched buffers, measured
//                right before each of the four calls (the pair's baseline).
// ratio = throughput / the paired memcpy's, the median over repetitions of per-repetition
// ratios (steadier than a ratio of medians on a shared machine). GB/s columns are medians.
// Repetition 0 is a warm-up, not recorded; it checks that every path returns the bytes given.
// Then the same as microseconds a call, and the control plane's floor: a unary GetSequence on the
// same connection (every shm transfer is one gRPC call too).
// Last, 2 MiB transfers with several in flight (--in-flight N threads, default 4, on the one
// Client, each with its own sequences and slice of a second region: an engine fetching layers of
// several requests at once, as the vLLM connector's fetch threads do): aggregate GB/s of shm
// append and shm fetch ÷ aggregate GB/s of as many threads each memcpy'ing 2 MiB at once
// (--in-flight-iters transfers a thread per repetition; each memcpy from another 2 MiB, as each
// fetch reads other pool blocks).
// Last, 4 KiB transfers (SmallTransfers): p50 of a region fetch and append asked for with a
// control frame on the shm socket, and the same asked by gRPC, against a Unix-socket ping-pong
// between two processes measured in the same rounds (and, beside it, the same ping-pong with
// both ends waiting on the CPU, as the SDK and kvbankd wait for small transfers).
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/child_process.h"
#include "kvbank/client.h"

#ifndef KVBANK_KVBANKD_PATH
#error "KVBANK_KVBANKD_PATH must name the kvbankd binary (bench/CMakeLists.txt)"
#endif

namespace kvbank {
using bench::ReadFile;
using bench::SpawnServer;
using bench::WaitForPortFile;
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kModel[] = "llama-3.1-8b";
constexpr uint64_t kMiB = uint64_t{1} << 20;

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
  std::fprintf(stderr, "shm_bench: %s\n", what.c_str());
  std::exit(1);
}

template <typename T>
T Check(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) Die(std::string(what) + ": " + v.status().ToString());
  return *std::move(v);
}

// Pages touched up front: no first-touch faults are timed.
void Touch(uint8_t* p, uint64_t n) {
  for (uint64_t i = 0; i < n; i += 4096) p[i] = static_cast<uint8_t>(i >> 12);
}

double MemcpySeconds(uint8_t* dst, const uint8_t* src, uint64_t n) {
  const auto t0 = Clock::now();
  std::memcpy(dst, src, n);
  const auto t1 = Clock::now();
  // Keeps the copy from being elided.
  if (dst[n / 2] != src[n / 2]) Die("memcpy");
  return Seconds(t0, t1);
}

// Runs body(t) on `threads` threads started together; answers the seconds until the last ends.
template <typename F>
double TimedThreads(int threads, F body) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      body(t);
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  const auto t0 = Clock::now();
  go.store(true, std::memory_order_release);
  for (std::thread& th : pool) th.join();
  return Seconds(t0, Clock::now());
}

// Microseconds of `n` round trips of a 64-byte message between this process and a child that
// echoes it over a Unix socket pair (blocking reads and writes): what one request and its
// answer cost between two processes, with no server work. spin: both ends read without
// blocking, yielding the CPU between tries (as the SDK and kvbankd wait for small transfers),
// the floor of that way of waiting.
std::vector<double> UnixPingPong(int n, bool spin = false) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) Die("socketpair");
  const pid_t child = fork();
  if (child < 0) Die("fork");
  char msg[64] = {};
  auto full = [spin](int fd, char* p, size_t len, bool reading) {
    while (len > 0) {
      const ssize_t k = reading ? recv(fd, p, len, spin ? MSG_DONTWAIT : 0) : write(fd, p, len);
      if (k < 0 && spin && reading && errno == EAGAIN) {
        sched_yield();
        continue;
      }
      if (k <= 0) return false;
      p += k;
      len -= size_t(k);
    }
    return true;
  };
  if (child == 0) {
    close(sv[0]);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    while (full(sv[1], msg, sizeof(msg), true) && full(sv[1], msg, sizeof(msg), false)) {
    }
    _exit(0);
  }
  close(sv[1]);
  std::vector<double> us;
  for (int i = 0; i < n; ++i) {
    const auto t0 = Clock::now();
    if (!full(sv[0], msg, sizeof(msg), false) || !full(sv[0], msg, sizeof(msg), true)) {
      Die("ping-pong");
    }
    us.push_back(Seconds(t0, Clock::now()) * 1e6);
  }
  close(sv[0]);
  waitpid(child, nullptr, 0);
  return us;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(q * double(v.size())))];
}

// 4 KiB transfers into and out of a registered region (one token of one layer of llama-3.1-8b,
// 8 KV heads x 512 bytes): the cost of asking. Frames on the shm socket (the default client)
// against the same transfers asked by gRPC (a second client with shm_control off, on the same
// server and region), and a Unix-socket ping-pong between two processes, in rounds that
// interleave the four so that the machine's noise falls on all alike. p50 and p90 of `n` each.
void SmallTransfers(Client* frames, const std::string& target, const std::string& socket,
                    ShmRegion* region, int n) {
  ClientOptions o;
  o.shm_socket = socket;
  o.shm_control = false;
  auto grpc = Check(Client::Connect(target, o), "Connect (gRPC control)");
  constexpr uint64_t kSmall = 4096;
  const uint32_t layers = 32;
  std::vector<double> ping, spin_ping, fetch[2], append[2];  // [0]: frames, [1]: gRPC
  Client* clients[2] = {frames, grpc.get()};
  const uint64_t before = frames->ShmControlRequests();
  const int rounds = 10;
  for (int round = 0; round < rounds; ++round) {
    const int per = n / rounds;
    for (double us : UnixPingPong(per)) ping.push_back(us);
    for (double us : UnixPingPong(per, /*spin=*/true)) spin_ping.push_back(us);
    for (int c = 0; c < 2; ++c) {
      // Appends: one token a layer, layer by layer, into a fresh sequence every 32.
      uint64_t seq = 0;
      for (int i = 0; i < per; ++i) {
        const uint32_t layer = uint32_t(i) % layers;
        if (layer == 0) {
          if (seq != 0) Check(clients[c]->Free(kModel, seq), "Free");
          seq = Check(clients[c]->CreateSequence(kModel, absl::ZeroDuration()), "Create").id;
        }
        Client::AppendArgs args;
        args.num_tokens = 1;
        args.layer_begin = layer;
        args.layer_end = layer + 1;
        const auto t0 = Clock::now();
        Check(clients[c]->AppendFromRegion(kModel, seq, args, region->Slice(0, kSmall)),
              "AppendFromRegion (4 KiB)");
        append[c].push_back(Seconds(t0, Clock::now()) * 1e6);
      }
      // Fetches: token 0 of layer 0 of the last sequence, into the region.
      Client::FetchArgs fa;
      fa.token_end = 1;
      fa.layer_end = 1;
      for (int i = 0; i < per; ++i) {
        const auto t0 = Clock::now();
        const auto f = Check(clients[c]->FetchToRegion(kModel, seq, fa, region->Slice(0, kSmall)),
                             "FetchToRegion (4 KiB)");
        fetch[c].push_back(Seconds(t0, Clock::now()) * 1e6);
        if (f.payload_bytes != kSmall) Die("FetchToRegion (4 KiB): not 4 KiB");
      }
      Check(clients[c]->Free(kModel, seq), "Free");
    }
  }
  if (frames->ShmControlRequests() - before != uint64_t(2 * (n / rounds) * rounds) ||
      grpc->ShmControlRequests() != 0) {
    Die("4 KiB: the transfers did not take the control path asked for");
  }
  const double floor = Percentile(ping, 0.5);
  std::printf(
      "4 KiB into / out of a registered region, %d each (p50 / p90 us; ratio = p50 / the "
      "Unix-socket ping-pong's p50):\n",
      (n / rounds) * rounds);
  std::printf("  unix ping-pong (64 B)  %7.1f / %7.1f\n", floor, Percentile(ping, 0.9));
  std::printf("  the same, both ends spinning  %7.1f / %7.1f  ratio %5.2f\n",
              Percentile(spin_ping, 0.5), Percentile(spin_ping, 0.9),
              Percentile(spin_ping, 0.5) / floor);
  const char* names[2] = {"frames", "gRPC  "};
  for (int c = 0; c < 2; ++c) {
    std::printf("  fetch  control %s   %7.1f / %7.1f  ratio %5.2f\n", names[c],
                Percentile(fetch[c], 0.5), Percentile(fetch[c], 0.9),
                Percentile(fetch[c], 0.5) / floor);
    std::printf("  append control %s   %7.1f / %7.1f  ratio %5.2f\n", names[c],
                Percentile(append[c], 0.5), Percentile(append[c], 0.9),
                Percentile(append[c], 0.5) / floor);
  }
}

// Transfers over memory larger than the caches, as a server's pool and an engine's buffers
// are: per size, K = 128 MiB / size transfers a repetition (at least 1), each between a
// different pool sequence and a different slice of a 128 MiB region; the baseline is K
// memcpys of the same size, each between different slices of two 256 MiB buffers (the caches
// hold neither). `lanes` threads at once (each its own slices and sequences; the baseline as
// many threads copying at once). ratio = the baseline's seconds / the transfers', per
// repetition; medians.
void Rotating(Client* client, uint64_t per_token, const std::vector<uint64_t>& sizes, int lanes,
              int reps) {
  const uint64_t span = 128 * kMiB;
  std::unique_ptr<ShmRegion> region = Check(client->RegisterRegion(span), "RegisterRegion (rot)");
  std::vector<uint8_t> src(2 * span), dst(2 * span);
  for (uint64_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>((i * 131) >> 3);
  Touch(dst.data(), dst.size());
  std::memcpy(region->data(), src.data(), span);
  std::printf(
      "rotating over memory larger than the caches, %d in flight (ratio = memcpy's "
      "seconds / the transfer's, median of %d):\n",
      lanes, reps);
  for (uint64_t size : sizes) {
    const uint64_t k = std::max<uint64_t>(1, span / size / uint64_t(lanes));
    if (size * uint64_t(lanes) > span) continue;
    const uint64_t tokens = size / per_token;
    std::vector<double> ra, rf, ga, gf;
    for (int rep = 0; rep <= reps; ++rep) {
      std::vector<std::vector<uint64_t>> seqs(lanes);
      for (int t = 0; t < lanes; ++t) {
        for (uint64_t i = 0; i < k; ++i) {
          seqs[t].push_back(
              Check(client->CreateSequence(kModel, absl::ZeroDuration()), "Create").id);
        }
      }
      auto slice = [&](int t, uint64_t i) { return (uint64_t(t) * k + i) * size; };
      auto copies = [&](int t) {
        for (uint64_t i = 0; i < k; ++i) {
          const uint64_t at = (slice(t, i) * 7 + uint64_t(rep) * size) % (src.size() - size + 1);
          std::memcpy(dst.data() + (slice(t, i) * 3) % (dst.size() - size + 1), src.data() + at,
                      size);
        }
      };
      Client::AppendArgs args;
      args.num_tokens = tokens;
      const double m0 = TimedThreads(lanes, copies);
      const double ta = TimedThreads(lanes, [&](int t) {
        for (uint64_t i = 0; i < k; ++i) {
          Check(
              client->AppendFromRegion(kModel, seqs[t][i], args, region->Slice(slice(t, i), size)),
              "AppendFromRegion (rot)");
        }
      });
      const double m1 = TimedThreads(lanes, copies);
      const double tf = TimedThreads(lanes, [&](int t) {
        // Another lane's sequences into this lane's slices: nothing read is where it was written.
        const int from = (t + 1) % lanes;
        for (uint64_t i = 0; i < k; ++i) {
          const auto f = Check(client->FetchToRegion(kModel, seqs[from][(i + 1) % k], {},
                                                     region->Slice(slice(t, i), size)),
                               "FetchToRegion (rot)");
          if (f.payload_bytes != size) Die("FetchToRegion (rot): short payload");
        }
      });
      for (auto& v : seqs) {
        for (uint64_t id : v) Check(client->Free(kModel, id), "Free");
      }
      if (rep == 0) continue;  // warm-up
      const double bytes = double(size) * double(k) * lanes;
      ra.push_back(m0 / ta);
      rf.push_back(m1 / tf);
      ga.push_back(bytes / ta / 1e9);
      gf.push_back(bytes / tf / 1e9);
    }
    std::printf(
        "  %4llu MiB x%llu a lane: shm append %6.2f GB/s ratio %5.2f | shm fetch %6.2f "
        "GB/s ratio %5.2f\n",
        static_cast<unsigned long long>(size / kMiB), static_cast<unsigned long long>(k),
        Median(ga), Median(ra), Median(gf), Median(rf));
  }
}

struct Row {
  std::vector<double> memcpy_gbs;
  std::vector<double> us[4];             // microseconds a call
  std::vector<double> gbs[4], ratio[4];  // shm append, shm fetch, grpc append, grpc fetch
};

// Ends the run: the client's region and connection, then kvbankd, then its folder.
int Stop(std::unique_ptr<ShmRegion> region, std::unique_ptr<Client> client, pid_t server,
         const std::string& dir) {
  region.reset();
  client.reset();
  kill(server, SIGTERM);
  int status = 0;
  waitpid(server, &status, 0);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return 0;
}

int Main(int argc, char** argv) {
  bool quick = false;
  int reps = 7;
  int in_flight = 4, in_flight_iters = 16;
  std::vector<uint64_t> sizes = {2 * kMiB, 16 * kMiB, 128 * kMiB};
  std::string kvbankd = KVBANK_KVBANKD_PATH;
  std::vector<std::string> server_args;  // --server-arg: passed on to kvbankd
  int small_only = 0;                    // --small-only N: the 4 KiB rows alone, N calls each
  absl::Duration client_spin = ClientOptions().shm_control_spin;  // --client-spin-us N
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--kvbankd" && i + 1 < argc) {
      kvbankd = argv[++i];
    } else if (a == "--mib" && i + 1 < argc) {
      sizes = {uint64_t(std::max(1, std::atoi(argv[++i]))) * kMiB};
    } else if (a == "--in-flight" && i + 1 < argc) {
      in_flight = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--in-flight-iters" && i + 1 < argc) {
      in_flight_iters = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--small-only" && i + 1 < argc) {
      small_only = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--server-arg" && i + 1 < argc) {
      server_args.push_back(argv[++i]);
    } else if (a == "--client-spin-us" && i + 1 < argc) {
      client_spin = absl::Microseconds(std::max(0, std::atoi(argv[++i])));
    } else {
      Die("usage: shm_bench [--quick] [--reps N] [--kvbankd PATH] [--mib N] [--in-flight N] "
          "[--in-flight-iters N] [--server-arg FLAG]... [--small-only N] [--client-spin-us N]");
    }
  }
  if (quick) {
    reps = 2;
    sizes = {2 * kMiB};
  }
  signal(SIGPIPE, SIG_IGN);
  const uint64_t max_bytes = *std::max_element(sizes.begin(), sizes.end());

  char templ[] = "/tmp/shm_bench-XXXXXX";
  if (mkdtemp(templ) == nullptr) Die("mkdtemp");
  const std::string dir = templ;
  const std::string log = dir + "/kvbankd.log", port_file = dir + "/port";
  const std::string socket = dir + "/kvbankd.sock";
  std::vector<std::string> command = {kvbankd,
                                      "--listen=127.0.0.1:0",
                                      "--port-file=" + port_file,
                                      "--no-auth",
                                      "--device=host",
                                      "--models=llama-3.1-8b",
                                      "--pool-bytes=1GiB",
                                      "--shm-socket=" + socket};
  command.insert(command.end(), server_args.begin(), server_args.end());
  const pid_t server = SpawnServer(command, log);
  const int port = WaitForPortFile(server, port_file, log);
  ClientOptions options;
  options.shm_socket = socket;
  options.shm_control_spin = client_spin;
  auto client = Check(Client::Connect("127.0.0.1:" + std::to_string(port), options), "Connect");
  if (absl::Status s = client->CheckServing(absl::Seconds(10)); !s.ok()) Die(s.ToString());
  const Client::ModelInfo model = Check(client->GetModel(kModel), "GetModel");
  std::unique_ptr<ShmRegion> region = Check(client->RegisterRegion(max_bytes), "RegisterRegion");
  if (small_only > 0) {
    SmallTransfers(client.get(), "127.0.0.1:" + std::to_string(port), socket, region.get(),
                   small_only);
    return Stop(std::move(region), std::move(client), server, dir);
  }

  std::vector<uint8_t> payload(max_bytes), into(max_bytes), a(max_bytes), b(max_bytes);
  for (uint64_t i = 0; i < max_bytes; ++i) payload[i] = static_cast<uint8_t>((i * 131) >> 3);
  Touch(into.data(), max_bytes);
  Touch(a.data(), max_bytes);
  std::memcpy(b.data(), payload.data(), max_bytes);
  Touch(region->data(), max_bytes);

  std::vector<Row> rows(sizes.size());
  // The control plane's floor: a unary call on the same connection (GetSequence).
  std::vector<double> unary_us;
  const auto probe = Check(client->CreateSequence(kModel, absl::ZeroDuration()), "Create");
  for (int rep = 0; rep <= reps; ++rep) {
    for (size_t si = 0; si < sizes.size(); ++si) {
      const uint64_t bytes = sizes[si];
      const uint64_t tokens = bytes / model.payload_bytes_per_token;
      Client::AppendArgs args;
      args.num_tokens = tokens;
      double t[4], m[4];
      // shm append
      std::memcpy(region->data(), payload.data(), bytes);
      const auto s1 = Check(client->CreateSequence(kModel, absl::ZeroDuration()), "Create");
      m[0] = MemcpySeconds(a.data(), b.data(), bytes);
      auto t0 = Clock::now();
      Check(client->AppendFromRegion(kModel, s1.id, args, region->Slice(0, bytes)),
            "AppendFromRegion");
      t[0] = Seconds(t0, Clock::now());
      // shm fetch
      if (rep == 0) std::memset(region->data(), 0, bytes);
      m[1] = MemcpySeconds(a.data(), b.data(), bytes);
      t0 = Clock::now();
      const auto f =
          Check(client->FetchToRegion(kModel, s1.id, {}, region->Slice(0, bytes)), "FetchToRegion");
      t[1] = Seconds(t0, Clock::now());
      if (f.payload_bytes != bytes ||
          (rep == 0 && std::memcmp(region->data(), payload.data(), bytes) != 0)) {
        Die("FetchToRegion returned other bytes than AppendFromRegion stored");
      }
      // grpc append
      const auto s2 = Check(client->CreateSequence(kModel, absl::ZeroDuration()), "Create");
      m[2] = MemcpySeconds(a.data(), b.data(), bytes);
      t0 = Clock::now();
      Check(client->Append(kModel, s2.id, args, absl::MakeConstSpan(payload.data(), bytes)),
            "Append");
      t[2] = Seconds(t0, Clock::now());
      // grpc fetch into
      if (rep == 0) std::memset(into.data(), 0, bytes);
      m[3] = MemcpySeconds(a.data(), b.data(), bytes);
      t0 = Clock::now();
      const auto g =
          Check(client->FetchInto(kModel, s2.id, {}, absl::MakeSpan(into.data(), bytes)), "Fetch");
      t[3] = Seconds(t0, Clock::now());
      if (g.payload_bytes != bytes ||
          (rep == 0 && std::memcmp(into.data(), payload.data(), bytes) != 0)) {
        Die("FetchInto returned other bytes than Append stored");
      }
      Check(client->Free(kModel, s1.id), "Free");
      Check(client->Free(kModel, s2.id), "Free");
      t0 = Clock::now();
      Check(client->GetSequence(kModel, probe.id), "GetSequence");
      const double unary = Seconds(t0, Clock::now());
      if (rep == 0) continue;  // warm-up
      unary_us.push_back(unary * 1e6);
      Row& r = rows[si];
      for (int k = 0; k < 4; ++k) {
        r.gbs[k].push_back(double(bytes) / t[k] / 1e9);
        r.us[k].push_back(t[k] * 1e6);
        r.ratio[k].push_back(m[k] / t[k]);
        r.memcpy_gbs.push_back(double(bytes) / m[k] / 1e9);
      }
    }
  }

  std::printf("shm_bench: kvbankd pid %d (--device=host, llama-3.1-8b bf16), %d repetitions\n",
              static_cast<int>(server), reps);
  std::printf("%-8s %8s | %18s | %18s | %18s | %18s\n", "size", "memcpy", "shm append", "shm fetch",
              "grpc append", "grpc fetch into");
  std::printf("%-8s %8s | %9s %8s | %9s %8s | %9s %8s | %9s %8s\n", "", "GB/s", "GB/s", "ratio",
              "GB/s", "ratio", "GB/s", "ratio", "GB/s", "ratio");
  for (size_t si = 0; si < sizes.size(); ++si) {
    const Row& r = rows[si];
    std::printf("%-8s %8.2f", (std::to_string(sizes[si] / kMiB) + " MiB").c_str(),
                Median(r.memcpy_gbs));
    for (int k = 0; k < 4; ++k) {
      std::printf(" | %9.2f %8.2f", Median(r.gbs[k]), Median(r.ratio[k]));
    }
    std::printf("\n");
  }
  std::printf("microseconds a call (median):\n");
  for (size_t si = 0; si < sizes.size(); ++si) {
    const Row& r = rows[si];
    std::printf(
        "%-8s memcpy %8.0f | shm append %8.0f | shm fetch %8.0f | grpc append %8.0f | "
        "grpc fetch into %8.0f\n",
        (std::to_string(sizes[si] / kMiB) + " MiB").c_str(),
        double(sizes[si]) / Median(r.memcpy_gbs) / 1e3, Median(r.us[0]), Median(r.us[1]),
        Median(r.us[2]), Median(r.us[3]));
  }
  std::printf("control plane floor: a unary GetSequence takes %.0f us (median)\n",
              Median(unary_us));

  // ---- 2 MiB transfers, several in flight ----
  if (quick) in_flight_iters = std::min(in_flight_iters, 4);
  const uint64_t small = 2 * kMiB;
  const uint64_t small_tokens = small / model.payload_bytes_per_token;
  std::unique_ptr<ShmRegion> lanes =
      Check(client->RegisterRegion(small * in_flight), "RegisterRegion (in flight)");
  // The baseline copies as the fetches do: from a different 2 MiB each time (the transfers'
  // pool blocks: a sequence each) into the thread's one destination (its region slice).
  std::vector<std::vector<uint8_t>> src(size_t(in_flight) * in_flight_iters), dst(in_flight);
  for (auto& b : src) b.assign(payload.begin(), payload.begin() + small);
  for (int t = 0; t < in_flight; ++t) {
    dst[t].assign(small, 0);
    std::memcpy(lanes->data() + t * small, payload.data(), small);
  }
  auto copies = [&](int t) {
    for (int i = 0; i < in_flight_iters; ++i) {
      std::memcpy(dst[t].data(), src[size_t(t) * in_flight_iters + i].data(), small);
    }
  };
  std::vector<double> agg[3], ratio[2];  // GB/s of memcpy, shm append, shm fetch
  for (int rep = 0; rep <= reps; ++rep) {
    // Each thread's sequences: in_flight_iters fresh ones to append to, then fetched back.
    std::vector<std::vector<uint64_t>> seqs(in_flight);
    for (int t = 0; t < in_flight; ++t) {
      for (int i = 0; i < in_flight_iters; ++i) {
        seqs[t].push_back(Check(client->CreateSequence(kModel, absl::ZeroDuration()), "Create").id);
      }
    }
    const double total = double(small) * in_flight * in_flight_iters;
    const double m0 = TimedThreads(in_flight, copies);
    Client::AppendArgs args;
    args.num_tokens = small_tokens;
    const double ta = TimedThreads(in_flight, [&](int t) {
      for (int i = 0; i < in_flight_iters; ++i) {
        Check(client->AppendFromRegion(kModel, seqs[t][i], args, lanes->Slice(t * small, small)),
              "AppendFromRegion (in flight)");
      }
    });
    const double m1 = TimedThreads(in_flight, copies);
    const double tf = TimedThreads(in_flight, [&](int t) {
      for (int i = 0; i < in_flight_iters; ++i) {
        const auto f =
            Check(client->FetchToRegion(kModel, seqs[t][i], {}, lanes->Slice(t * small, small)),
                  "FetchToRegion (in flight)");
        if (f.payload_bytes != small) Die("FetchToRegion (in flight): short payload");
      }
    });
    for (int t = 0; t < in_flight; ++t) {
      if (std::memcmp(lanes->data() + t * small, payload.data(), small) != 0) {
        Die("in flight: a fetch returned other bytes than were appended");
      }
      for (uint64_t id : seqs[t]) Check(client->Free(kModel, id), "Free");
    }
    if (rep == 0) continue;  // warm-up
    agg[0].push_back(total / ((m0 + m1) / 2) / 1e9);
    agg[1].push_back(total / ta / 1e9);
    agg[2].push_back(total / tf / 1e9);
    ratio[0].push_back(m0 / ta);
    ratio[1].push_back(m1 / tf);
  }
  std::printf("2 MiB transfers, %d in flight (%d a thread a repetition), aggregate GB/s:\n",
              in_flight, in_flight_iters);
  std::printf("  memcpy x%d %8.2f | shm append %8.2f  ratio %5.2f | shm fetch %8.2f  ratio %5.2f\n",
              in_flight, Median(agg[0]), Median(agg[1]), Median(ratio[0]), Median(agg[2]),
              Median(ratio[1]));
  lanes.reset();

  // ---- Over memory larger than the caches: 1 and 4 in flight ----
  Rotating(client.get(), model.payload_bytes_per_token, sizes, 1, quick ? 1 : reps);
  Rotating(client.get(), model.payload_bytes_per_token, {2 * kMiB}, in_flight, quick ? 1 : reps);

  // ---- 4 KiB transfers: the control path's cost ----
  SmallTransfers(client.get(), "127.0.0.1:" + std::to_string(port), socket, region.get(),
                 quick ? 300 : 3000);
  return Stop(std::move(region), std::move(client), server, dir);
}

}  // namespace
}  // namespace kvbank

int main(int argc, char** argv) { return kvbank::Main(argc, argv); }
