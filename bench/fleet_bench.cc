// kvbank::Fleet placement over real kvbankd replicas (child processes on loopback): counts, not
// timings. For 3 and 8 replicas, each trace runs placed by key only (the baseline: every prompt
// that shares a first block on one replica) and with bounded load (the default), and once on a
// single replica with the fleet's total pool:
//   - spread: the busiest and the idlest replica's sequences over the mean;
//   - hit rate: cached tokens / prompt tokens, over that of one replica with the same total pool;
//   - copies: bytes copied between replicas for a new hot prefix under 64 concurrent creates,
//     over (replicas - 1) x the prefix's bytes;
//   - two SDK instances placing the same trace at once (each learns the other's sequences only
//     from the replicas' reports): their spread;
//   - movement: the share of 3000 placement keys that move when one replica is added, times
//     (N + 1) (1.0 = exactly its share).
//
//   fleet_bench [--quick] [--kvbankd PATH]
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "bench/child_process.h"
#include "kvbank/client.h"
#include "kvbank/fleet.h"

#ifndef KVBANK_KVBANKD_PATH
#error "KVBANK_KVBANKD_PATH must name the kvbankd binary (bench/CMakeLists.txt)"
#endif

namespace kvbank {
namespace {

constexpr char kModel[] = "bench";
constexpr uint32_t kBt = 16;
constexpr uint64_t kPoolPerReplica = 48ull << 20;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "fleet_bench: %s\n", what.c_str());
  std::exit(1);
}
template <typename T>
T Ok(absl::StatusOr<T> r, const std::string& what) {
  if (!r.ok()) Die(absl::StrCat(what, ": ", r.status().ToString()));
  return *std::move(r);
}
void Ok(const absl::Status& s, const std::string& what) {
  if (!s.ok()) Die(absl::StrCat(what, ": ", s.ToString()));
}

ModelLayout Layout() {
  ModelLayout m;
  m.name = kModel;
  m.num_layers = 2;
  m.num_q_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 16;
  m.head_dim_v = 16;
  m.block_tokens = kBt;
  m.input_dtype = DType::kFp16;
  m.layer_dtypes.assign(m.num_layers, DType::kFp16);
  return m;
}

std::vector<uint32_t> Tokens(uint32_t seed, size_t n) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = seed * 100003u + static_cast<uint32_t>(i) + 1;
  return t;
}
std::vector<uint32_t> Concat(std::vector<uint32_t> a, const std::vector<uint32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

using Trace = std::vector<std::vector<uint32_t>>;

// One shared 64-token system prompt, then a distinct 200-token user turn per request.
Trace SystemPrompt(size_t requests) {
  Trace out;
  for (size_t i = 0; i < requests; ++i) out.push_back(Concat(Tokens(1, 64), Tokens(1000 + i, 200)));
  return out;
}
// Three tenants' system prompts: two hot ones each (70 % of requests), many cold ones.
Trace HotAndCold(size_t requests) {
  std::mt19937 rng(7);
  Trace out;
  for (size_t i = 0; i < requests; ++i) {
    const uint32_t tenant = rng() % 3;
    const bool hot = rng() % 10 < 7;
    const uint32_t prefix = hot ? 10 + tenant * 2 + rng() % 2 : 100 + rng() % 150;
    out.push_back(Concat(Tokens(prefix, hot ? 96 : 48), Tokens(5000 + i, 80)));
  }
  return out;
}

// kvbankd replicas as child processes.
class Replicas {
 public:
  Replicas(std::string kvbankd, std::string dir)
      : kvbankd_(std::move(kvbankd)), dir_(std::move(dir)) {}
  ~Replicas() { StopAll(); }
  std::string Start(const std::string& name) {
    const std::string log = absl::StrCat(dir_, "/", name, ".log");
    const std::string port_file = absl::StrCat(dir_, "/", name, ".port");
    std::remove(port_file.c_str());
    const pid_t pid =
        bench::SpawnServer({kvbankd_, "--listen=127.0.0.1:0", "--port-file=" + port_file,
                            "--models=", "--no-auth", "--shm-socket=", "--replica-name=" + name},
                           log);
    const int port = bench::WaitForPortFile(pid, port_file, log);
    pids_.push_back(pid);
    const std::string target = absl::StrCat("127.0.0.1:", port);
    auto c = Ok(Client::Connect(target), "connect " + name);
    Ok(c->WaitForServing(absl::Seconds(20)) ? absl::OkStatus()
                                            : absl::UnavailableError("not serving"),
       name);
    return target;
  }
  void StopAll() {
    for (pid_t p : pids_) kill(p, SIGKILL);
    for (pid_t p : pids_) waitpid(p, nullptr, 0);
    pids_.clear();
  }

 private:
  std::string kvbankd_, dir_;
  std::vector<pid_t> pids_;
};

FleetOptions Options(bool bounded) {
  FleetOptions o;
  o.probe_interval = absl::Milliseconds(100);
  if (!bounded) o.load_epsilon.reset();
  return o;
}

struct Result {
  std::map<std::string, uint64_t> placed;
  uint64_t prompt_tokens = 0, cached_tokens = 0;
  double HitRate() const { return prompt_tokens ? double(cached_tokens) / prompt_tokens : 0; }
};

// The trace's requests in order; each appends its uncached KV; the last `live` stay alive
// (0: all).
void Run(Fleet& fleet, const Client::ModelInfo& m, const Trace& trace, size_t live, Result* out) {
  std::deque<Fleet::Sequence> running;
  for (const auto& prompt : trace) {
    Client::CreateArgs args;
    args.prompt = prompt;
    const Fleet::Sequence seq = Ok(fleet.CreateSequence(kModel, args), "create");
    ++out->placed[seq.replica];
    out->prompt_tokens += prompt.size();
    out->cached_tokens += seq.info.cached_tokens;
    const uint64_t rest = prompt.size() - seq.info.cached_tokens;
    if (rest > 0) {
      Client::AppendArgs a;
      a.num_tokens = rest;
      a.token_ids.assign(prompt.begin() + seq.info.cached_tokens, prompt.end());
      std::vector<uint8_t> payload(rest * m.payload_bytes_per_token, 0x3c);
      Ok(fleet.Append(seq, a, payload), "append");
    }
    running.push_back(seq);
    if (live > 0 && running.size() > live) {
      Ok(fleet.Free(running.front()), "free");
      running.pop_front();
    }
  }
}

std::pair<double, double> Spread(const Result& r, int n) {
  uint64_t total = 0, hi = 0, lo = UINT64_MAX;
  for (const auto& [name, c] : r.placed) {
    total += c;
    hi = std::max(hi, c);
    lo = std::min(lo, c);
  }
  if (int(r.placed.size()) < n) lo = 0;
  const double mean = double(total) / n;
  return {hi / mean, lo / mean};
}

struct Setup {
  std::unique_ptr<Replicas> replicas;
  std::vector<std::string> targets;
};

Setup StartFleet(const std::string& kvbankd, const std::string& dir, int n,
                 const std::string& tag) {
  Setup s;
  s.replicas = std::make_unique<Replicas>(kvbankd, dir);
  for (int i = 0; i < n; ++i) s.targets.push_back(s.replicas->Start(absl::StrCat(tag, "-", i)));
  return s;
}

std::unique_ptr<Fleet> Connect(const std::vector<std::string>& targets, bool bounded, uint64_t pool,
                               Client::ModelInfo* m) {
  auto fleet = Ok(Fleet::Connect(absl::StrJoin(targets, ","), Options(bounded)), "fleet");
  *m = Ok(fleet->EnsureModel(Layout(), pool), "ensure model");
  return fleet;
}

void TraceRows(const std::string& kvbankd, const std::string& dir, int n, const std::string& name,
               const Trace& trace, size_t live) {
  Client::ModelInfo m;
  double one = 0;
  {
    Setup single = StartFleet(kvbankd, dir, 1, "one");
    auto fleet = Connect(single.targets, true, kPoolPerReplica * n, &m);
    Result r;
    Run(*fleet, m, trace, live, &r);
    one = r.HitRate();
  }
  for (bool bounded : {false, true}) {
    Setup s = StartFleet(kvbankd, dir, n, "r");
    auto fleet = Connect(s.targets, bounded, kPoolPerReplica, &m);
    Result r;
    Run(*fleet, m, trace, live, &r);
    const auto [hi, lo] = Spread(r, n);
    const Fleet::Stats st = fleet->GetStats();
    std::printf("| %d | %s | %s | %.2f | %.2f | %.3f | %.3f | %.3f | %llu | %llu |\n", n,
                name.c_str(), bounded ? "bounded (0.15)" : "by key", hi, lo, r.HitRate(), one,
                one > 0 ? r.HitRate() / one : 0, (unsigned long long)st.prefix_copies,
                (unsigned long long)st.copied_bytes);
  }
}

void CopyRow(const std::string& kvbankd, const std::string& dir, int n) {
  Setup s = StartFleet(kvbankd, dir, n, "c");
  Client::ModelInfo m;
  auto fleet = Connect(s.targets, true, kPoolPerReplica, &m);
  const std::vector<uint32_t> system = Tokens(2, 128);
  Result first;
  Run(*fleet, m, {Concat(system, Tokens(3, 40))}, 0, &first);
  std::vector<std::thread> threads;
  absl::Mutex mu;
  std::map<std::string, int> where;
  uint64_t cached = 0;
  for (int i = 0; i < 64; ++i) {
    threads.emplace_back([&, i] {
      Client::CreateArgs args;
      args.prompt = Concat(system, Tokens(4000 + i, 40));
      const Fleet::Sequence seq = Ok(fleet->CreateSequence(kModel, args), "create");
      absl::MutexLock lock(&mu);
      ++where[seq.replica];
      cached += seq.info.cached_tokens;
    });
  }
  for (auto& t : threads) t.join();
  const Fleet::Stats st = fleet->GetStats();
  const uint64_t size = system.size() * m.payload_bytes_per_token;
  std::printf("| %d | %zu | %llu | %llu | %.3f | %llu | %.3f |\n", n, where.size(),
              (unsigned long long)st.prefix_copies, (unsigned long long)st.copied_bytes,
              double(st.copied_bytes) / double((n - 1) * size),
              (unsigned long long)st.copies_joined, double(cached) / double(64 * system.size()));
}

void TwoSdkRow(const std::string& kvbankd, const std::string& dir, int n) {
  Setup s = StartFleet(kvbankd, dir, n, "t");
  Client::ModelInfo m;
  auto a = Connect(s.targets, true, kPoolPerReplica, &m);
  auto b = Connect(s.targets, true, kPoolPerReplica, &m);
  const Trace trace = SystemPrompt(300);
  Trace ta, tb;
  for (size_t i = 0; i < trace.size(); ++i) (i % 2 ? tb : ta).push_back(trace[i]);
  Result ra, rb;
  std::thread x([&] { Run(*a, m, ta, 0, &ra); });
  std::thread y([&] { Run(*b, m, tb, 0, &rb); });
  x.join();
  y.join();
  Result both;
  for (const auto* r : {&ra, &rb}) {
    for (const auto& [k, v] : r->placed) both.placed[k] += v;
    both.prompt_tokens += r->prompt_tokens;
    both.cached_tokens += r->cached_tokens;
  }
  const auto [hi, lo] = Spread(both, n);
  std::printf("| %d | %.2f | %.2f | %.3f | %llu |\n", n, hi, lo, both.HitRate(),
              (unsigned long long)(a->GetStats().prefix_copies + b->GetStats().prefix_copies));
}

void MoveRow(const std::string& kvbankd, const std::string& dir, int n) {
  Setup s = StartFleet(kvbankd, dir, n + 1, "m");
  absl::Mutex mu;
  size_t members = n;
  FleetOptions o = Options(true);
  o.resolver = [&]() -> absl::StatusOr<std::vector<std::string>> {
    absl::MutexLock lock(&mu);
    return std::vector<std::string>(s.targets.begin(), s.targets.begin() + members);
  };
  auto fleet = Ok(Fleet::Connect("bench", o), "fleet");
  Ok(fleet->EnsureModel(Layout(), kPoolPerReplica).status(), "ensure");
  constexpr int kKeys = 3000;
  std::vector<std::string> before;
  for (int i = 0; i < kKeys; ++i) {
    const BlockHash key = Ok(fleet->PlacementKey(kModel, Tokens(7000 + i, 32)), "key");
    before.push_back(Ok(fleet->ReplicaFor(key), "replica"));
  }
  {
    absl::MutexLock lock(&mu);
    members = n + 1;
  }
  Ok(fleet->Refresh(), "refresh");
  int moved = 0, to_new = 0;
  for (int i = 0; i < kKeys; ++i) {
    const BlockHash key = Ok(fleet->PlacementKey(kModel, Tokens(7000 + i, 32)), "key");
    const std::string now = Ok(fleet->ReplicaFor(key), "replica");
    if (now != before[i]) {
      ++moved;
      if (now == absl::StrCat("m-", n)) ++to_new;
    }
  }
  std::printf("| %d -> %d | %d | %.3f | %.2f | %d |\n", n, n + 1, moved, double(moved) / kKeys,
              double(moved) / kKeys * (n + 1), moved - to_new);
}

}  // namespace
}  // namespace kvbank

int main(int argc, char** argv) {
  bool quick = false;
  std::string kvbankd = KVBANK_KVBANKD_PATH;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "--kvbankd" && i + 1 < argc) {
      kvbankd = argv[++i];
    } else {
      kvbank::Die("usage: fleet_bench [--quick] [--kvbankd PATH]");
    }
  }
  char templ[] = "/tmp/kvbank-fleet-bench-XXXXXX";
  if (mkdtemp(templ) == nullptr) kvbank::Die("mkdtemp");
  const std::string dir = templ;
  const std::vector<int> sizes = quick ? std::vector<int>{3} : std::vector<int>{3, 8};
  const size_t requests = quick ? 60 : 300;

  std::printf("## Traces: spread of sequences and hit rate\n\n");
  std::printf(
      "| replicas | trace | placement | busiest / mean | idlest / mean | hit rate | "
      "one replica | ratio | copies | bytes copied |\n|---|---|---|---|---|---|---|---|---|---|\n");
  for (int n : sizes) {
    kvbank::TraceRows(kvbankd, dir, n, "system prompt", kvbank::SystemPrompt(requests), 0);
    kvbank::TraceRows(kvbankd, dir, n, "hot + cold", kvbank::HotAndCold(2 * requests), 12 * n);
  }
  std::printf("\n## A new hot prefix (8 blocks), 64 concurrent creates\n\n");
  std::printf(
      "| replicas | replicas used | copies | bytes copied | ÷ (N-1) x prefix | joined | "
      "cached ÷ prefix |\n|---|---|---|---|---|---|---|\n");
  for (int n : sizes) kvbank::CopyRow(kvbankd, dir, n);
  std::printf("\n## Two SDK instances, the system-prompt trace split between them\n\n");
  std::printf(
      "| replicas | busiest / mean | idlest / mean | hit rate | copies |\n"
      "|---|---|---|---|---|\n");
  for (int n : sizes) kvbank::TwoSdkRow(kvbankd, dir, n);
  std::printf("\n## Adding a replica: placement keys moved (3000 keys)\n\n");
  std::printf(
      "| replicas | moved | share | share x (N+1) | moved between old replicas |\n"
      "|---|---|---|---|---|\n");
  for (int n : sizes) kvbank::MoveRow(kvbankd, dir, n);
  std::string rm = "rm -rf " + dir;
  if (std::system(rm.c_str()) != 0)
    std::fprintf(stderr, "fleet_bench: could not remove %s\n", dir.c_str());
  return 0;
}
