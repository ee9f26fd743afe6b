// Prefix-sharing benchmark.
//
// 1. A synthetic multi-turn chat trace replayed on the core (SequenceStore): conversations share
//    a few system prompts; each turn's prompt is the whole history so far. Reports blocks written
//    with prefix sharing ÷ without, and the hit rate (cached prompt tokens ÷ prompt tokens) ÷ the
//    hit rate of an unbounded cache replaying the same trace.
// 2. Match latency for 2k- and 32k-token prompts through the real service on loopback gRPC ÷ a
//    loopback ping-pong (a raw TCP 1-byte round trip, and an empty gRPC call) in the same run.
//
//   prefix_bench [--quick]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/time/clock.h"
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

ModelLayout SmallLayout() {
  ModelLayout m;
  m.name = "trace";
  m.num_layers = 2;
  m.num_q_heads = 2;
  m.num_kv_heads = 2;
  m.head_dim = 16;
  m.head_dim_v = 16;
  m.block_tokens = 16;
  m.kind = AttentionKind::kMha;
  m.input_dtype = DType::kFp16;
  m.layer_dtypes.assign(2, DType::kFp16);
  return m;
}

struct Turn {
  int conversation;
  std::vector<uint32_t> prompt;    // the whole history: system prompt + previous turns + user
  std::vector<uint32_t> response;  // generated; part of the next turn's history
};

// Conversations over a few shared system prompts, turns interleaved at random.
std::vector<Turn> MakeTrace(int conversations, int turns, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int kSystemPrompts = 4;
  std::vector<std::vector<uint32_t>> system(kSystemPrompts);
  for (auto& s : system) {
    s.resize(400 + rng() % 400);
    for (auto& t : s) t = rng() % 100000;
  }
  std::vector<std::vector<uint32_t>> history(conversations);
  std::vector<int> left(conversations, turns);
  for (int c = 0; c < conversations; ++c) history[c] = system[rng() % kSystemPrompts];
  std::vector<Turn> trace;
  int active = conversations;
  while (active > 0) {
    int c = int(rng() % conversations);
    if (left[c] == 0) continue;
    std::vector<uint32_t>& h = history[c];
    const uint32_t user = 20 + rng() % 200;
    for (uint32_t i = 0; i < user; ++i) h.push_back(rng() % 100000);
    Turn t{c, h, {}};
    t.response.resize(50 + rng() % 250);
    for (auto& id : t.response) id = rng() % 100000;
    h.insert(h.end(), t.response.begin(), t.response.end());
    trace.push_back(std::move(t));
    if (--left[c] == 0) --active;
  }
  return trace;
}

struct TraceResult {
  uint64_t prompt_tokens = 0, cached_tokens = 0, blocks_written = 0;
};

// Replays the trace: create with the prompt (attaching what is cached), append the rest of the
// prompt and the response, free. Blocks written = blocks allocated for new KV.
TraceResult Replay(const std::vector<Turn>& trace, bool sharing, uint64_t pool_blocks) {
  const ModelLayout m = SmallLayout();
  const BlockLayout b = ComputeBlockLayout(m);
  PoolOptions po;
  po.enable_prefix_caching = sharing;
  auto pool = BlockPool::CreateHost(b, pool_blocks * b.block_bytes, po);
  StoreOptions so;
  so.max_tokens_per_sequence = 1 << 20;
  SequenceStore store(m, *std::move(pool), so);
  TraceResult r;
  std::vector<uint8_t> payload;
  for (const Turn& t : trace) {
    CreateOptions co;
    co.lease = absl::ZeroDuration();
    co.prompt = t.prompt;  // the response's ids come with its append, as decode makes them
    auto info = store.Create(co);
    if (!info.ok()) {
      std::fprintf(stderr, "create: %s\n", info.status().ToString().c_str());
      std::exit(1);
    }
    r.prompt_tokens += t.prompt.size();
    r.cached_tokens += info->cached_tokens;
    const uint64_t before = store.pool().Stats().used;
    const uint64_t rest = t.prompt.size() - info->cached_tokens + t.response.size();
    AppendSpec a;
    a.sequence_id = info->id;
    a.num_tokens = rest;
    payload.assign(b.PayloadBytes(0, m.num_layers, rest), 0x5a);
    a.token_ids.assign(t.prompt.begin() + info->cached_tokens, t.prompt.end());
    a.token_ids.insert(a.token_ids.end(), t.response.begin(), t.response.end());
    auto ap = store.Append(a, payload);
    if (!ap.ok()) {
      std::fprintf(stderr, "append: %s\n", ap.status().ToString().c_str());
      std::exit(1);
    }
    r.blocks_written += store.pool().Stats().used - before;
    (void)store.Free(info->id);
  }
  return r;
}

// Unbounded cache: every full block ever seen stays.
double UnboundedHitRate(const std::vector<Turn>& trace) {
  const BlockHash root = RootHash(HashAlgorithm::kSha256, PrefixRoot{"x", "", ""});
  absl::flat_hash_set<BlockHash> seen;
  uint64_t prompt = 0, hit = 0;
  for (const Turn& t : trace) {
    std::vector<BlockHash> hashes = PrefixHashes(HashAlgorithm::kSha256, root, t.prompt, 16);
    size_t i = 0;
    while (i < hashes.size() && seen.contains(hashes[i])) ++i;
    prompt += t.prompt.size();
    hit += i * 16;
    // What the replay publishes: every full block of prompt + response.
    std::vector<uint32_t> all = t.prompt;
    all.insert(all.end(), t.response.begin(), t.response.end());
    for (const BlockHash& h : PrefixHashes(HashAlgorithm::kSha256, root, all, 16)) seen.insert(h);
  }
  return double(hit) / double(prompt);
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
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int conversations = quick ? 40 : 300, turns = quick ? 4 : 8;
  const uint64_t seed = 20261130;
  std::printf("prefix_bench: seed %llu, %d conversations x %d turns\n", (unsigned long long)seed,
              conversations, turns);

  // 1. Trace replay.
  const std::vector<Turn> trace = MakeTrace(conversations, turns, seed);
  uint64_t unique_blocks = 0;
  {
    absl::flat_hash_set<BlockHash> all;
    const BlockHash root = RootHash(HashAlgorithm::kSha256, PrefixRoot{"x", "", ""});
    for (const Turn& t : trace) {
      std::vector<uint32_t> tokens = t.prompt;
      tokens.insert(tokens.end(), t.response.begin(), t.response.end());
      for (const BlockHash& h : PrefixHashes(HashAlgorithm::kSha256, root, tokens, 16)) {
        all.insert(h);
      }
    }
    unique_blocks = all.size();
  }
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
    const double hit = double(with.cached_tokens) / double(with.prompt_tokens);
    std::printf("%-28s %12.3f %12.3f %10llu %16.3f\n",
                (std::to_string(blocks) + " (" + std::to_string(frac).substr(0, 4) + "x)").c_str(),
                hit, hit / unbounded, (unsigned long long)with.blocks_written,
                double(with.blocks_written) / double(without.blocks_written));
  }

  // 2. Match latency through the service on loopback.
  auto registry = std::make_shared<ModelRegistry>(uint64_t{1} << 34);
  ModelConfig mc;
  mc.layout = SmallLayout();
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
