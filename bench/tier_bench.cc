// The tiers below a model's pool (server/core/tiers.h), each against a baseline measured in the
// same run.
//
// 1. Host-tier promotion: a Create whose prompt's N blocks sit in the host tier only (none in
//    the pool) promotes them into the pool. GB/s ÷ memcpy of the same bytes from one host buffer
//    into another, measured right before each Create.
// 2. Disk-tier promotion: the same prompt's blocks on the disk tier only, after FlushToDisk and a
//    reopen (a restart: nothing in the pool, the page cache of the file dropped, the disk tier on
//    O_DIRECT where the filesystem takes it). GB/s ÷ fio's sequential read rate of the same
//    number of bytes in the same folder (1 MiB reads, O_DIRECT, psync), run right before each
//    Create. Without fio the ratio is skipped.
// 3. Warm restart: prefix_bench's chat trace on a pool of 0.25x the working set with a disk tier
//    of 1x. The hit rate over a window of turns before a restart (FlushToDisk, the store
//    destroyed and reopened on the same folder) ÷ the hit rate over the next window of as many
//    turns after it; also against the same window with no restart, and after a cold restart.
//
//   tier_bench [--quick] [--reps N] [--layers N] [--blocks N] [--dir=FOLDER]
//
// Layout: llama-3.1-8b-like (8 kv heads, head_dim 128, 16 tokens a block, fp16), 32 layers by
// default: 2 MiB blocks. FOLDER (default: the build folder) gets a temp folder for the disk
// tier's file and fio's, removed at the end.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/trace.h"
#include "server/core/sequence_store.h"
#include "server/core/tiers.h"

namespace kvbank {
namespace {

using bench::OpenStore;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

ModelLayout LlamaLike(uint32_t layers) {
  ModelLayout m;
  m.name = "llama-like";
  m.num_layers = layers;
  m.num_q_heads = 32;
  m.num_kv_heads = 8;
  m.head_dim = 128;
  m.head_dim_v = 128;
  m.block_tokens = 16;
  m.kind = AttentionKind::kMha;
  m.input_dtype = DType::kFp16;
  m.layer_dtypes.assign(layers, DType::kFp16);
  return m;
}

std::vector<uint32_t> PromptIds(uint64_t tokens, uint32_t salt) {
  std::vector<uint32_t> p(tokens);
  for (uint64_t t = 0; t < tokens; ++t) p[t] = salt * 1000003u + uint32_t(t) + 1;
  return p;
}

std::vector<uint8_t> RandomBytes(uint64_t n, uint64_t seed) {
  std::vector<uint8_t> out(n);
  std::mt19937_64 rng(seed);
  for (uint64_t i = 0; i + 8 <= n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(out.data() + i, &v, 8);
  }
  return out;
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "tier_bench: %s\n", what.c_str());
  std::exit(1);
}

// Writes the prompt's KV as a sequence and frees it: its blocks stay cached in the pool.
void Write(SequenceStore& store, const std::vector<uint32_t>& prompt,
           const std::vector<uint8_t>& payload) {
  CreateOptions co;
  co.lease = absl::ZeroDuration();
  auto info = store.Create(co);
  if (!info.ok()) Fail("create: " + info.status().ToString());
  AppendSpec a;
  a.sequence_id = info->id;
  a.num_tokens = prompt.size();
  a.dtype = DType::kFp16;
  a.token_ids = prompt;
  if (auto s = store.Append(a, payload); !s.ok()) Fail("append: " + s.status().ToString());
  (void)store.Free(info->id);
}

// A Create with the prompt: answers the sequence's id and cached tokens.
SequenceInfo CreateWith(SequenceStore& store, const std::vector<uint32_t>& prompt) {
  CreateOptions co;
  co.lease = absl::ZeroDuration();
  co.prompt = prompt;
  auto info = store.Create(co);
  if (!info.ok()) Fail("create: " + info.status().ToString());
  return *info;
}

// True when the sequence's bytes read back equal `payload`.
bool SameBytes(SequenceStore& store, uint64_t id, const std::vector<uint8_t>& payload) {
  FetchSpec f;
  f.sequence_id = id;
  f.dtype = DType::kFp16;
  auto r = store.BeginFetch(f);
  if (!r.ok()) return false;
  std::vector<uint8_t> out((*r)->payload_bytes());
  if (!(*r)->Read(0, absl::MakeSpan(out)).ok()) return false;
  return out == payload;
}

// memcpy GB/s of `src` into `dst` (both touched already).
double MemcpyGBs(std::vector<uint8_t>& dst, const std::vector<uint8_t>& src) {
  const absl::Time t0 = absl::Now();
  std::memcpy(dst.data(), src.data(), src.size());
  const double s = absl::ToDoubleSeconds(absl::Now() - t0);
  return double(src.size()) / s / 1e9;
}

void DropPageCache(const std::string& file) {
  const int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  fdatasync(fd);
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  close(fd);
}

bool HaveFio() { return std::system("command -v fio >/dev/null 2>&1") == 0; }

// fio's sequential read rate (GB/s) of `bytes` in `dir`: 1 MiB reads, O_DIRECT; one read at a
// time (psync) for iodepth 1, else that many in flight (libaio), as many as the tier's I/O
// threads read at once. 0 when fio failed.
double FioReadGBs(const std::string& dir, uint64_t bytes, uint32_t iodepth) {
  const uint64_t mib = std::max<uint64_t>(1, (bytes + (1 << 20) - 1) >> 20);
  const std::string engine =
      iodepth <= 1 ? "--ioengine=psync" : "--ioengine=libaio --iodepth=" + std::to_string(iodepth);
  const std::string cmd = "fio --name=seqread --rw=read --bs=1M --size=" + std::to_string(mib) +
                          "M --direct=1 " + engine + " --filename=" + dir +
                          "/fio.dat --output-format=json 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return 0;
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  if (pclose(p) != 0) return 0;
  // "read" : { "io_bytes" : ..., "io_kbytes" : ..., "bw_bytes" : N, ...
  const size_t r = out.find("\"read\"");
  if (r == std::string::npos) return 0;
  const size_t b = out.find("\"bw_bytes\"", r);
  if (b == std::string::npos) return 0;
  const size_t colon = out.find(':', b);
  if (colon == std::string::npos) return 0;
  return std::strtod(out.c_str() + colon + 1, nullptr) / 1e9;
}

struct Args {
  bool quick = false;
  int reps = 0;
  uint32_t layers = 0;
  uint64_t blocks = 0;
  uint32_t io_threads = TierOptions().io_threads;
  std::string only;  // host, disk or restart: that part alone
  std::string dir = KVBANK_BENCH_TMPDIR;
};

// 1. Host tier -> pool against memcpy.
void HostPromotion(const Args& a, const ModelLayout& m) {
  const BlockLayout bl = ComputeBlockLayout(m);
  const uint64_t n = a.blocks, bytes = n * bl.block_bytes, tokens = n * m.block_tokens;
  // A pool of N blocks, a host tier of 2N: prompts A and B take turns, each Create promoting
  // its N blocks from the host tier while the other's N go back down (already there: inclusive,
  // nothing copied).
  TierOptions to;
  to.host_bytes = 2 * bytes;
  std::unique_ptr<SequenceStore> store = OpenStore(m, n, true, &to);
  const std::vector<uint32_t> prompt[2] = {PromptIds(tokens, 1), PromptIds(tokens, 2)};
  const std::vector<uint8_t> payload[2] = {RandomBytes(bytes, 1), RandomBytes(bytes, 2)};
  Write(*store, prompt[0], payload[0]);
  Write(*store, prompt[1], payload[1]);  // evicts A to the host tier
  std::vector<uint8_t> src = RandomBytes(bytes, 3), dst(bytes, 1);
  std::vector<double> tier_gbs, copy_gbs, ratio;
  bool same = true;
  // Two warm-up turns (A promoted, B copied down once; B promoted), then the timed ones.
  for (int rep = -2; rep < a.reps; ++rep) {
    const int which = (rep + 2) % 2;
    const double copy = MemcpyGBs(dst, src);
    const uint64_t before = store->prefix().tiers()->Stats().promoted_from_host;
    const absl::Time t0 = absl::Now();
    const SequenceInfo info = CreateWith(*store, prompt[which]);
    const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
    const uint64_t promoted = store->prefix().tiers()->Stats().promoted_from_host - before;
    if (info.cached_tokens != tokens || promoted != n) {
      Fail("host promotion: " + std::to_string(info.cached_tokens) + " tokens cached, " +
           std::to_string(promoted) + " blocks promoted of " + std::to_string(n));
    }
    if (rep < 0) same = same && SameBytes(*store, info.id, payload[which]);
    (void)store->Free(info.id);
    if (rep < 0) continue;
    tier_gbs.push_back(double(bytes) / secs / 1e9);
    copy_gbs.push_back(copy);
    ratio.push_back(tier_gbs.back() / copy);
  }
  std::printf("\n1. host tier -> pool: %llu blocks of %llu KiB (%.1f MiB) per Create, %d reps\n",
              (unsigned long long)n, (unsigned long long)(bl.block_bytes >> 10),
              double(bytes) / (1 << 20), a.reps);
  std::printf("   bytes promoted equal the bytes appended: %s\n", same ? "yes" : "NO");
  std::printf("%-28s %12s %12s %10s\n", "", "tier GB/s", "memcpy GB/s", "ratio");
  std::printf("%-28s %12.2f %12.2f %10.3f\n", "promote (Create)", Median(tier_gbs),
              Median(copy_gbs), Median(ratio));
  if (!same) Fail("promoted bytes differ");
}

// 2. Disk tier -> pool against fio.
void DiskPromotion(const Args& a, const ModelLayout& m, const std::string& dir) {
  const BlockLayout bl = ComputeBlockLayout(m);
  const uint64_t n = a.blocks, bytes = n * bl.block_bytes, tokens = n * m.block_tokens;
  TierOptions to;
  to.disk_path = dir + "/disk";
  to.io_threads = a.io_threads;
  to.disk_bytes = (n + 1) * (bl.block_bytes + (uint64_t{64} << 10));  // N slots and some
  const std::vector<uint32_t> prompt = PromptIds(tokens, 7);
  const std::vector<uint8_t> payload = RandomBytes(bytes, 7);
  std::string file;
  uint64_t flushed = 0;
  {
    std::unique_ptr<SequenceStore> store = OpenStore(m, n, true, &to);
    Write(*store, prompt, payload);
    flushed = store->prefix().FlushToDisk(absl::InfiniteFuture());
    file = store->prefix().tiers()->disk_file();
  }
  const bool fio = HaveFio();
  std::printf(
      "\n2. disk tier -> pool: %llu blocks of %llu KiB (%.1f MiB) per Create, %d reps, %u I/O "
      "threads, in %s\n",
      (unsigned long long)n, (unsigned long long)(bl.block_bytes >> 10), double(bytes) / (1 << 20),
      a.reps, a.io_threads, dir.c_str());
  if (!fio) std::printf("   fio not found on PATH: its column and the ratio are skipped\n");
  std::vector<double> tier_gbs, fio_gbs, ratio, open_s, fio_qd_gbs, ratio_qd;
  bool same = true, direct = false;
  uint64_t slot = 0;
  for (int rep = -1; rep < a.reps; ++rep) {
    const double f = fio ? FioReadGBs(dir, bytes, 1) : 0;
    const double fq = fio ? FioReadGBs(dir, bytes, a.io_threads) : 0;
    // A restart: the page cache of the file dropped, the store reopened (the disk tier indexes
    // its slots), nothing of the prompt in the pool.
    DropPageCache(file);
    const absl::Time o0 = absl::Now();
    std::unique_ptr<SequenceStore> store = OpenStore(m, n, true, &to);
    const double opened = absl::ToDoubleSeconds(absl::Now() - o0);
    const TierStats ts = store->prefix().tiers()->Stats();
    direct = ts.direct_io;
    slot = store->prefix().tiers()->slot_bytes();
    if (ts.loaded != n) Fail("disk tier reopened with " + std::to_string(ts.loaded) + " blocks");
    const absl::Time t0 = absl::Now();
    const SequenceInfo info = CreateWith(*store, prompt);
    const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
    const uint64_t promoted = store->prefix().tiers()->Stats().promoted_from_disk;
    if (info.cached_tokens != tokens || promoted != n) {
      Fail("disk promotion: " + std::to_string(info.cached_tokens) + " tokens cached, " +
           std::to_string(promoted) + " blocks promoted of " + std::to_string(n));
    }
    if (rep < 0) same = SameBytes(*store, info.id, payload);
    (void)store->Free(info.id);
    if (rep < 0) continue;
    tier_gbs.push_back(double(bytes) / secs / 1e9);
    open_s.push_back(opened);
    if (f > 0) {
      fio_gbs.push_back(f);
      ratio.push_back(tier_gbs.back() / f);
    }
    if (fq > 0) {
      fio_qd_gbs.push_back(fq);
      ratio_qd.push_back(tier_gbs.back() / fq);
    }
  }
  std::printf(
      "   flushed %llu blocks; disk tier file on %s, slots of %llu KiB (header + block); "
      "reopen (index the slots) %.3f s\n",
      (unsigned long long)flushed, direct ? "O_DIRECT" : "buffered I/O (no O_DIRECT)",
      (unsigned long long)(slot >> 10), Median(open_s));
  std::printf("   bytes promoted equal the bytes appended: %s\n", same ? "yes" : "NO");
  std::printf("   per rep, tier GB/s / fio GB/s (1 read in flight) / fio GB/s (%u in flight):",
              a.io_threads);
  for (size_t i = 0; i < tier_gbs.size(); ++i) {
    std::printf(" %.2f/%.2f/%.2f", tier_gbs[i], i < fio_gbs.size() ? fio_gbs[i] : 0.0,
                i < fio_qd_gbs.size() ? fio_qd_gbs[i] : 0.0);
  }
  std::printf("\n%-28s %12s %12s %10s\n", "", "tier GB/s", "fio GB/s", "ratio");
  if (fio && !ratio.empty()) {
    std::printf("%-28s %12.3f %12.3f %10.3f\n", "promote ÷ fio, 1 in flight", Median(tier_gbs),
                Median(fio_gbs), Median(ratio));
  }
  if (fio && !ratio_qd.empty()) {
    const std::string label = "promote ÷ fio, " + std::to_string(a.io_threads) + " in flight";
    std::printf("%-28s %12.3f %12.3f %10.3f\n", label.c_str(), Median(tier_gbs), Median(fio_qd_gbs),
                Median(ratio_qd));
  }
  if (!fio || (ratio.empty() && ratio_qd.empty())) {
    std::printf("%-28s %12.3f %12s %10s\n", "promote (Create)", Median(tier_gbs), "-", "-");
  }
  if (!same) Fail("promoted bytes differ");
}

// 3. Warm restart on the chat trace.
void WarmRestart(const Args& a, const std::string& dir) {
  const int conversations = a.quick ? 40 : 300, turns = a.quick ? 4 : 8;
  const std::vector<bench::Turn> trace = bench::MakeTrace(conversations, turns, 20261130);
  const uint64_t unique = bench::DistinctBlocks(trace);
  const uint64_t pool = std::max<uint64_t>(uint64_t(unique * 0.25), 256);
  const size_t half = trace.size() / 2, window = trace.size() / 8;
  TierOptions to;
  to.disk_path = dir + "/restart";
  {
    // Slot size from a tier of one slot.
    TierOptions one = to;
    one.disk_path = dir + "/probe";
    one.disk_bytes = uint64_t{1} << 20;
    auto probe = TierCache::Open(ComputeBlockLayout(bench::TraceLayout()), "probe", "probe", one);
    if (!probe.ok()) Fail("disk tier: " + probe.status().ToString());
    to.disk_bytes = unique * (*probe)->slot_bytes();
  }
  std::filesystem::remove_all(dir + "/probe");
  std::printf(
      "\n3. warm restart: chat trace of %zu turns, %llu distinct blocks; pool %llu blocks "
      "(0.25x) + disk tier 1x\n",
      trace.size(), (unsigned long long)unique, (unsigned long long)pool);
  std::printf("   window: %zu turns; before = turns [%zu, %zu), after = turns [%zu, %zu)\n", window,
              half - window, half, half, half + window);

  // The same turns with no restart (the control) and with an empty store (a cold restart).
  double control = 0;
  {
    TierOptions c = to;
    c.disk_path = dir + "/control";
    std::unique_ptr<SequenceStore> store = OpenStore(bench::TraceLayout(), pool, true, &c);
    bench::ReplayOn(*store, trace, 0, half);
    control = bench::ReplayOn(*store, trace, half, half + window).hit_rate();
  }
  std::filesystem::remove_all(dir + "/control");
  double cold = 0;
  {
    std::unique_ptr<SequenceStore> store = OpenStore(bench::TraceLayout(), pool, true, nullptr);
    cold = bench::ReplayOn(*store, trace, half, half + window).hit_rate();
  }

  double before = 0, after = 0, flush_s = 0, reopen_s = 0;
  uint64_t flushed = 0, loaded = 0, from_disk = 0;
  {
    std::unique_ptr<SequenceStore> store = OpenStore(bench::TraceLayout(), pool, true, &to);
    bench::ReplayOn(*store, trace, 0, half - window);
    before = bench::ReplayOn(*store, trace, half - window, half).hit_rate();
    const absl::Time f0 = absl::Now();
    flushed = store->prefix().FlushToDisk(absl::InfiniteFuture());
    store.reset();  // the restart
    flush_s = absl::ToDoubleSeconds(absl::Now() - f0);
  }
  {
    const absl::Time o0 = absl::Now();
    std::unique_ptr<SequenceStore> store = OpenStore(bench::TraceLayout(), pool, true, &to);
    reopen_s = absl::ToDoubleSeconds(absl::Now() - o0);
    loaded = store->prefix().tiers()->Stats().loaded;
    after = bench::ReplayOn(*store, trace, half, half + window).hit_rate();
    from_disk = store->prefix().tiers()->Stats().promoted_from_disk;
  }
  std::printf(
      "   restart: FlushToDisk wrote %llu blocks, flush + close %.2f s; reopen indexed "
      "%llu blocks in %.2f s; %llu promoted from the disk after it\n",
      (unsigned long long)flushed, flush_s, (unsigned long long)loaded, reopen_s,
      (unsigned long long)from_disk);
  std::printf("%-40s %12s\n", "hit rate", "");
  std::printf("%-40s %12.3f\n", "before the restart", before);
  std::printf("%-40s %12.3f\n", "after the restart (warm, disk tier)", after);
  std::printf("%-40s %12.3f\n", "same turns, no restart", control);
  std::printf("%-40s %12.3f\n", "same turns, cold restart (no tier)", cold);
  std::printf("%-40s %12.3f\n", "after ÷ before", before > 0 ? after / before : 0);
  std::printf("%-40s %12.3f\n", "after ÷ no restart", control > 0 ? after / control : 0);
}

int Main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--quick") {
      a.quick = true;
    } else if (s == "--reps" && i + 1 < argc) {
      a.reps = std::atoi(argv[++i]);
    } else if (s == "--layers" && i + 1 < argc) {
      a.layers = uint32_t(std::atoi(argv[++i]));
    } else if (s == "--blocks" && i + 1 < argc) {
      a.blocks = uint64_t(std::atoll(argv[++i]));
    } else if (s == "--io-threads" && i + 1 < argc) {
      a.io_threads = uint32_t(std::atoi(argv[++i]));
    } else if (s == "--only" && i + 1 < argc) {
      a.only = argv[++i];
    } else if (s.rfind("--dir=", 0) == 0) {
      a.dir = s.substr(6);
    } else {
      std::fprintf(stderr,
                   "usage: tier_bench [--quick] [--reps N] [--layers N] [--blocks N] "
                   "[--io-threads N] [--only host|disk|restart] [--dir=FOLDER]\n");
      return 2;
    }
  }
  if (a.reps <= 0) a.reps = a.quick ? 2 : 7;
  if (a.layers == 0) a.layers = a.quick ? 4 : 32;
  if (a.blocks == 0) a.blocks = a.quick ? 16 : 128;
  std::string dir = a.dir + "/tier-bench-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) Fail("cannot make a folder under " + a.dir);
  const ModelLayout m = LlamaLike(a.layers);
  std::printf(
      "tier_bench: %u layers x 8 kv heads x head_dim 128 x 16 tokens, fp16: %llu KiB "
      "blocks%s\n",
      a.layers, (unsigned long long)(ComputeBlockLayout(m).block_bytes >> 10),
      a.quick ? " (quick)" : "");
  if (a.only.empty() || a.only == "host") HostPromotion(a, m);
  if (a.only.empty() || a.only == "disk") DiskPromotion(a, m, dir);
  if (a.only.empty() || a.only == "restart") WarmRestart(a, dir);
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace kvbank

int main(int argc, char** argv) { return kvbank::Main(argc, argv); }
