// Prefix-sharing benchmark.
//
// 1. A synthetic multi-turn chat trace replayed on the core (SequenceStore): conversations share
//    a few system prompts; each turn's prompt is the whole history so far. Reports blocks written
//    with prefix sharing ÷ without, and the hit rate (cached prompt tokens ÷ prompt tokens) ÷ the
//    hit rate of an unbounded cache replaying the same trace. Then the same trace on a pool of
//    0.25x the working set with a host tier (and, in a folder under --dir, a disk tier) of 1x
//    below it.
// 2. Match latency for 2k- and 32k-token prompts through the real service on loopback gRPC ÷ a
//    loopback ping-pong (a raw TCP 1-byte round trip, and an empty gRPC call) in the same run.
//
//   prefix_bench [--quick] [--dir=FOLDER]   (FOLDER: where the disk tier row puts its file)
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/time/clock.h"
#include "bench/trace.h"
#include "grpcpp/grpcpp.h"
#include "kvbank/client.h"
#include "server/core/model_registry.h"
#include "server/rpc/service.h"
#include "server/rpc/serving.h"

namespace kvbank {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

using bench::DistinctBlocks;
using bench::MakeTrace;
using bench::OpenTraceStore;
using bench::ReplayOn;
using bench::TraceResult;
using bench::Turn;
using bench::UnboundedHitRate;

// Replays the whole trace on a pool of `pool_blocks` (no tiers).
TraceResult Replay(const std::vector<Turn>& trace, bool sharing, uint64_t pool_blocks) {
  std::unique_ptr<SequenceStore> store = OpenTraceStore(pool_blocks, sharing);
  return ReplayOn(*store, trace, 0, trace.size());
}

// A temp folder for a disk tier under `parent`; empty when it cannot be made.
std::string MakeTempDir(const std::string& parent) {
  std::string tmpl = parent + "/prefix-bench-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) return "";
  return tmpl;
}

// Raw TCP 1-byte ping-pong on loopback: median round-trip microseconds.
double TcpPingPongMicros(int rounds) {
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(ls, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(ls, reinterpret_cast<sockaddr*>(&addr), &len);
  listen(ls, 1);
  std::thread server([&] {
    int c = accept(ls, nullptr, nullptr);
    int one = 1;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    char b;
    while (read(c, &b, 1) == 1) {
      if (write(c, &b, 1) != 1) break;
    }
    close(c);
  });
  int s = socket(AF_INET, SOCK_STREAM, 0);
  connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int one = 1;
  setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::vector<double> us;
  char b = 'x';
  for (int i = 0; i < rounds; ++i) {
    const absl::Time t0 = absl::Now();
    if (write(s, &b, 1) != 1 || read(s, &b, 1) != 1) break;
    us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  close(s);
  server.join();
  close(ls);
  return Median(us);
}

int Main(int argc, char** argv) {
  bool quick = false;
  std::string dir_parent = KVBANK_BENCH_TMPDIR;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strncmp(argv[i], "--dir=", 6) == 0) {
      dir_parent = argv[i] + 6;
    } else {
      std::fprintf(stderr, "usage: prefix_bench [--quick] [--dir=FOLDER]\n");
      return 2;
    }
  }
  const int conversations = quick ? 40 : 300, turns = quick ? 4 : 8;
  const uint64_t seed = 20261130;
  std::printf("prefix_bench: seed %llu, %d conversations x %d turns\n", (unsigned long long)seed,
              conversations, turns);

  // 1. Trace replay.
  const std::vector<Turn> trace = MakeTrace(conversations, turns, seed);
  const uint64_t unique_blocks = DistinctBlocks(trace);
  const double unbounded = UnboundedHitRate(trace);
  std::printf(
      "\ntrace: %zu turns, %llu distinct blocks (prompts + responses); unbounded-cache hit rate "
      "%.3f\n",
      trace.size(), (unsigned long long)unique_blocks, unbounded);
  std::printf("%-28s %12s %12s %10s %16s\n", "pool (blocks)", "hit rate", "÷ unbounded", "written",
              "shared ÷ unshared");
  for (double frac : {0.25, 0.5, 1.0, 2.0}) {
    const uint64_t blocks = std::max<uint64_t>(uint64_t(unique_blocks * frac), 256);
    const TraceResult with = Replay(trace, true, blocks);
    const TraceResult without = Replay(trace, false, blocks);
    const double hit = with.hit_rate();
    std::printf("%-28s %12.3f %12.3f %10llu %16.3f\n",
                (std::to_string(blocks) + " (" + std::to_string(frac).substr(0, 4) + "x)").c_str(),
                hit, hit / unbounded, (unsigned long long)with.blocks_written,
                double(with.blocks_written) / double(without.blocks_written));
  }

  // 1b. The same trace on a pool of 0.25x with a tier below it the size of the working set:
  // evicted cached blocks move down, and a prompt that finds them there promotes them back.
  const BlockLayout tb = ComputeBlockLayout(bench::TraceLayout());
  const uint64_t small_pool = std::max<uint64_t>(uint64_t(unique_blocks * 0.25), 256);
  std::printf("\n%-34s %12s %12s %10s %16s\n", "pool 0.25x + tier 1x (blocks)", "hit rate",
              "÷ unbounded", "written", "from the tier");
  {
    TierOptions to;
    to.host_bytes = unique_blocks * tb.block_bytes;
    std::unique_ptr<SequenceStore> store = OpenTraceStore(small_pool, true, &to);
    const TraceResult r = ReplayOn(*store, trace, 0, trace.size());
    const TierStats ts = store->prefix().tiers()->Stats();
    std::printf(
        "%-34s %12.3f %12.3f %10llu %16llu\n",
        (std::to_string(small_pool) + " + host " + std::to_string(ts.host_capacity)).c_str(),
        r.hit_rate(), r.hit_rate() / unbounded, (unsigned long long)r.blocks_written,
        (unsigned long long)ts.promoted_from_host);
  }
  if (const std::string dir = MakeTempDir(dir_parent); dir.empty()) {
    std::printf("disk tier row skipped: cannot make a folder under %s\n", dir_parent.c_str());
  } else {
    TierOptions to;
    to.disk_path = dir;
    to.disk_bytes = 0;
    std::string probe_file;
    {
      // The disk tier's slot (a 4 KiB-aligned header, then the block 4 KiB-aligned), from a
      // tier of one slot.
      TierOptions one = to;
      one.disk_bytes = uint64_t{1} << 20;
      auto opened = TierCache::Open(tb, "probe", "probe", one);
      if (opened.ok()) {
        to.disk_bytes = unique_blocks * (*opened)->slot_bytes();
        probe_file = (*opened)->disk_file();
      }
    }
    if (!probe_file.empty()) std::filesystem::remove(probe_file);
    if (to.disk_bytes == 0) {
      std::printf("disk tier row skipped: no disk tier in %s\n", dir.c_str());
    } else {
      // Spills wait in a write queue (max_queued_bytes, 256 MiB by default) that promotions
      // read from too; the second row bounds it to 4 MiB, so nearly every block it serves comes
      // off the disk and a spill that finds the queue full is dropped.
      for (const uint64_t queue : {to.max_queued_bytes, uint64_t{4} << 20}) {
        TierOptions q = to;
        q.max_queued_bytes = queue;
        const absl::Time t0 = absl::Now();
        TraceResult r;
        TierStats ts;
        {
          std::unique_ptr<SequenceStore> store = OpenTraceStore(small_pool, true, &q);
          r = ReplayOn(*store, trace, 0, trace.size());
          ts = store->prefix().tiers()->Stats();
        }
        const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
        std::filesystem::remove_all(dir);
        std::printf("%-34s %12.3f %12.3f %10llu %16llu\n",
                    (std::to_string(small_pool) + " + disk " + std::to_string(ts.disk_capacity) +
                     ", queue " + std::to_string(queue >> 20) + "M")
                        .c_str(),
                    r.hit_rate(), r.hit_rate() / unbounded, (unsigned long long)r.blocks_written,
                    (unsigned long long)ts.promoted_from_disk);
        std::printf(
            "  disk tier: %s, replay %.1f s; spills written %llu, queued at the end %llu, dropped "
            "(queue full) %llu; blocks read off the disk %llu\n",
            ts.direct_io ? "O_DIRECT" : "buffered", secs, (unsigned long long)ts.spilled_to_disk,
            (unsigned long long)ts.queued, (unsigned long long)ts.spill_dropped,
            (unsigned long long)(ts.disk_bytes_read /
                                 std::max<uint64_t>(1, to.disk_bytes / unique_blocks)));
      }
      std::filesystem::remove_all(dir);
    }
  }

  // 2. Match latency through the service on loopback.
  auto registry = std::make_shared<ModelRegistry>(uint64_t{1} << 34);
  ModelConfig mc;
  mc.layout = bench::TraceLayout();
  mc.pool_bytes = uint64_t{256} << 20;
  mc.store.max_tokens_per_sequence = 1 << 20;
  auto model = registry->Ensure(mc);
  if (!model.ok()) return 1;
  rpc::KvBankService service(registry, rpc::ServiceOptions{});
  auto serving = rpc::Serving::Start(&service, rpc::ServingOptions{});  // as kvbankd serves
  if (!serving.ok()) return 1;
  auto client = Client::Connect("127.0.0.1:" + std::to_string((*serving)->port()));
  if (!client.ok() || !(*client)->WaitForServing(absl::Seconds(10))) return 1;

  const int rounds = quick ? 50 : 400;
  const double tcp = TcpPingPongMicros(rounds);
  std::vector<double> rpc_us;
  for (int i = 0; i < rounds; ++i) {
    const absl::Time t0 = absl::Now();
    auto s = (*client)->Match("trace", {});
    if (!s.ok()) return 1;
    rpc_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  const double empty_rpc = Median(rpc_us);
  std::printf("\nloopback ping-pong: raw TCP 1 byte %.1f us, empty gRPC Match %.1f us\n", tcp,
              empty_rpc);
  std::printf("%-14s %10s %12s %14s %12s\n", "prompt tokens", "cached", "match us", "÷ tcp rtt",
              "÷ empty rpc");
  std::mt19937_64 rng(seed);
  for (uint32_t n : {2048u, 32768u}) {
    // Store the prompt so the match walks the whole chain (the worst case).
    std::vector<uint32_t> prompt(n);
    for (auto& t : prompt) t = rng() % 100000;
    CreateOptions co;
    co.lease = absl::ZeroDuration();
    auto seq = (*model).model->Create(co);
    AppendSpec a;
    a.sequence_id = seq->id;
    a.num_tokens = n;
    a.token_ids = prompt;
    std::vector<uint8_t> payload(ComputeBlockLayout(mc.layout).PayloadBytes(0, 2, n), 1);
    if (!(*model).model->Append(a, payload).ok()) return 1;
    std::vector<double> us;
    uint64_t cached = 0;
    for (int i = 0; i < rounds / 4; ++i) {
      Client::MatchQuery q;
      q.tokens = prompt;
      const absl::Time t0 = absl::Now();
      auto r = (*client)->Match("trace", {q});
      us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
      if (!r.ok()) return 1;
      cached = (*r)[0];
    }
    const double med = Median(us);
    std::printf("%-14u %10llu %12.1f %14.1f %12.1f\n", n, (unsigned long long)cached, med,
                med / tcp, med / empty_rpc);
  }
  (*serving)->Stop();
  return 0;
}

}  // namespace
}  // namespace kvbank

int main(int argc, char** argv) { return kvbank::Main(argc, argv); }
