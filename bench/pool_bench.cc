// pool_bench: the in-process core's put and get throughput against memcpy of the same bytes.
//
//   pool_bench [--quick] [--reps N] [--device host|host-staged|cuda:N|auto]
//
// --device puts the pools there (default host). On cuda:N put and get are the whole device data
// path: the payload staged in page-locked memory, copied to the GPU and scattered (and, for the
// int8 layout, quantized) by kernels; the get gathers, copies back and unstages. The baseline stays
// a host memcpy, so there the ratio includes the PCIe / NVLink-C2C hop.
//
// For each layout and sequence length: put = SequenceStore::Append of the whole sequence (all
// layers) from a dense payload; get = BeginFetch + FetchReader::Read of the same range into another
// buffer. The baseline, measured in the same run and interleaved with the pool calls, is a plain
// memcpy of the same number of bytes src -> dst (put) and dst -> src2 (get). The ratio
// pool / memcpy says how much of the machine's copy bandwidth the gather/scatter through the block
// table keeps (1.0 = as fast as one flat memcpy); it is the median over repetitions of pairs
// measured back to back, GB/s columns are medians. Every buffer and every pool block is touched
// once before timing, so no page faults are timed.
//
// Also reports the cost of Fork (copy-on-write: full blocks shared, the partial block copied),
// and of Stats() at 1,024 and 65,536 live sequences (it reads counters: the ratio should be ~1).
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "kvbank/layout.h"
#include "server/core/block_pool.h"
#include "server/core/sequence_store.h"

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

// Aborts the benchmark on an unexpected error: a benchmark that silently measures a failure path
// is worse than none.
template <typename T>
T Check(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "pool_bench: %s: %s\n", what, v.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(v);
}
void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "pool_bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// A small-head layout: head_dim 64 makes 128-byte rows, so the block-table scatter moves runs of
// only block_tokens * 128 = 2 KiB.
ModelLayout SmallHeadLayout() {
  ModelLayout m;
  m.name = "small-h64";
  m.num_layers = 32;
  m.num_q_heads = 32;
  m.num_kv_heads = 8;
  m.head_dim = 64;
  m.head_dim_v = 64;
  m.block_tokens = 16;
  m.kind = AttentionKind::kGqa;
  m.input_dtype = DType::kBf16;
  m.layer_dtypes.assign(m.num_layers, DType::kBf16);
  return m;
}

ModelLayout Preset(const char* name) {
  ModelLayout m;
  if (!PresetLayout(name, &m, DType::kBf16)) {
    std::fprintf(stderr, "pool_bench: unknown preset %s\n", name);
    std::exit(1);
  }
  return m;
}

ModelLayout Int8Preset(const char* name) {
  ModelLayout m = Preset(name);
  m.name += "-int8";
  m.layer_dtypes.assign(m.num_layers, DType::kInt8);  // bf16 in, int8 stored: a conversion
  return m;
}

std::unique_ptr<SequenceStore> MakeStore(const ModelLayout& layout, uint64_t pool_bytes,
                                         const DeviceSpec& device) {
  BlockLayout b = ComputeBlockLayout(layout);
  auto pool = Check(BlockPool::Create(std::move(b), pool_bytes, device), "BlockPool::Create");
  // Touches every block once so the timed loops never take a page fault in the pool (device
  // memory is touched when it is allocated).
  if (pool->memory().kind() != MemoryKind::kCuda) std::memset(pool->base(), 0, pool->pool_bytes());
  StoreOptions opts;
  return std::make_unique<SequenceStore>(layout, std::move(pool), opts);
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

struct Row {
  std::string layout;
  uint64_t tokens = 0;
  uint64_t bytes = 0;
  double put_gbs = 0, put_memcpy_gbs = 0, get_gbs = 0, get_memcpy_gbs = 0;  // median GB/s
  // Median over repetitions of pool / memcpy throughput, each pair measured back to back.
  double put_ratio = 0, get_ratio = 0;
};

Row RunCase(SequenceStore& store, uint64_t tokens, int reps) {
  const ModelLayout& m = store.layout();
  const DType wire = DefaultWireDType(m, 0, m.num_layers);
  const uint64_t bytes =
      PayloadLayout::Make(store.pool().layout(), 0, m.num_layers, tokens, wire).total_bytes;
  std::vector<uint8_t> src = Pattern(bytes, static_cast<uint32_t>(tokens));
  if (wire == DType::kBf16 && m.layer_dtypes[0] != wire) {
    // Quantized on the way in: finite values only (random bits hold NaN and Inf patterns).
    for (uint64_t i = 0; i + 1 < bytes; i += 2) src[i + 1] = (src[i + 1] & 0x80) | 0x3f;
  }
  std::vector<uint8_t> dst(bytes, 1), src2(bytes, 2);
  std::vector<double> put, put_ref, get, get_ref, put_ratio, get_ratio;
  // Rep 0 is a warm-up and is not recorded.
  for (int r = 0; r <= reps; ++r) {
    auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    auto t1 = Clock::now();
    std::memcpy(src2.data(), dst.data(), bytes);
    auto t2 = Clock::now();
    const double ref_put = Seconds(t0, t1), ref_get = Seconds(t1, t2);

    const SequenceInfo seq = Check(store.Create(WithLease(absl::ZeroDuration())), "Create");
    AppendSpec a;
    a.sequence_id = seq.id;
    a.num_tokens = tokens;
    t0 = Clock::now();
    Check(store.Append(a, absl::MakeConstSpan(src)), "Append");
    t1 = Clock::now();
    FetchSpec f;
    f.sequence_id = seq.id;
    auto reader = Check(store.BeginFetch(f), "BeginFetch");
    Check(reader->Read(0, absl::MakeSpan(src2)), "Read");
    t2 = Clock::now();
    reader.reset();
    Check(store.Free(seq.id), "Free");
    if (r == 0 && store.layout().layer_dtypes[0] == store.layout().input_dtype &&
        std::memcmp(src.data(), src2.data(), bytes) != 0) {
      std::fprintf(stderr, "pool_bench: %s %" PRIu64 " tokens: fetched bytes differ\n",
                   store.layout().name.c_str(), tokens);
      std::exit(1);
    }
    if (r == 0) continue;
    put_ref.push_back(ref_put);
    get_ref.push_back(ref_get);
    put.push_back(Seconds(t0, t1));
    get.push_back(Seconds(t1, t2));
    put_ratio.push_back(ref_put / Seconds(t0, t1));
    get_ratio.push_back(ref_get / Seconds(t1, t2));
  }
  Row row;
  row.layout = store.layout().name;
  row.tokens = tokens;
  row.bytes = bytes;
  const double gb = double(bytes) / 1e9;
  row.put_gbs = gb / Median(put);
  row.put_memcpy_gbs = gb / Median(put_ref);
  row.get_gbs = gb / Median(get);
  row.get_memcpy_gbs = gb / Median(get_ref);
  row.put_ratio = Median(put_ratio);
  row.get_ratio = Median(get_ratio);
  return row;
}

// Fork of a `tokens`-long sequence: median microseconds and the blocks it had to copy.
void RunFork(SequenceStore& store, uint64_t tokens, int reps) {
  const uint64_t per_token = store.pool().layout().PayloadBytesPerToken();
  const uint64_t piece_tokens = std::min<uint64_t>(tokens, 1024);
  const std::vector<uint8_t> src = Pattern(piece_tokens * per_token, 7);
  const SequenceInfo parent = Check(store.Create(WithLease(absl::ZeroDuration())), "Create");
  for (uint64_t done = 0; done < tokens;) {
    AppendSpec a;
    a.sequence_id = parent.id;
    a.num_tokens = std::min(piece_tokens, tokens - done);
    Check(store.Append(a, absl::MakeConstSpan(src.data(), a.num_tokens * per_token)), "Append");
    done += a.num_tokens;
  }
  std::vector<double> us;
  uint64_t copied = 0, shared = 0;
  for (int r = 0; r <= reps; ++r) {
    const uint64_t used_before = store.pool().Stats().used;
    const auto t0 = Clock::now();
    const SequenceInfo child = Check(store.Fork(parent.id, absl::ZeroDuration()), "Fork");
    const auto t1 = Clock::now();
    copied = store.pool().Stats().used - used_before;
    shared = child.num_blocks - copied;
    Check(store.Free(child.id), "Free");
    if (r > 0) us.push_back(Seconds(t0, t1) * 1e6);
  }
  Check(store.Free(parent.id), "Free");
  std::printf("| %s | %" PRIu64 " | %.1f | %" PRIu64 " | %" PRIu64 " | %.2f |\n",
              store.layout().name.c_str(), tokens, Median(us), shared, copied,
              double(copied * store.pool().layout().block_bytes) / (1 << 20));
}

// Median microseconds of one Stats() call (the admin's view, and one tenant's) with `n` live
// sequences spread over 4 tenants. Stats reads counters, so the time should not grow with n.
struct StatsRow {
  uint64_t sequences = 0;
  double admin_us = 0;
  double tenant_us = 0;
};
StatsRow RunStats(const DeviceSpec& device, uint64_t n, int reps) {
  const ModelLayout layout = SmallHeadLayout();
  BlockLayout b = ComputeBlockLayout(layout);
  const uint64_t block_bytes = b.block_bytes;
  auto pool = Check(BlockPool::Create(std::move(b), 4 * block_bytes, device), "BlockPool::Create");
  StoreOptions opts;
  opts.max_sequences = n;
  SequenceStore store(layout, std::move(pool), opts);
  const std::string tenants[] = {"t0", "t1", "t2", "t3"};
  for (uint64_t i = 0; i < n; ++i) {
    CreateOptions o;
    o.lease = absl::ZeroDuration();
    o.tenant = tenants[i % 4];
    Check(store.Create(o), "Create");
  }
  auto time_us = [&](const std::string* tenant) {
    std::vector<double> us;
    constexpr int kCalls = 100;  // per repetition: one call is too short to time alone
    for (int r = 0; r < reps + 1; ++r) {
      uint64_t sink = 0;
      const auto t0 = Clock::now();
      for (int c = 0; c < kCalls; ++c) sink += store.Stats(tenant).sequences;
      const auto t1 = Clock::now();
      if (sink != kCalls * (tenant == nullptr ? n : n / 4)) {
        std::fprintf(stderr, "pool_bench: Stats counted %" PRIu64 " sequences\n", sink / kCalls);
        std::exit(1);
      }
      if (r > 0) us.push_back(Seconds(t0, t1) * 1e6 / kCalls);  // the first is a warm-up
    }
    return Median(us);
  };
  StatsRow row;
  row.sequences = n;
  row.admin_us = time_us(nullptr);
  row.tenant_us = time_us(&tenants[1]);
  return row;
}

int Main(int argc, char** argv) {
  bool quick = false;
  int reps = 0;
  std::string device_flag = "host";
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--device") == 0 && i + 1 < argc) {
      device_flag = argv[++i];
    } else {
      std::fprintf(stderr, "usage: pool_bench [--quick] [--reps N] [--device SPEC]\n");
      return 2;
    }
  }
  if (reps <= 0) reps = quick ? 3 : 9;
  const std::vector<uint64_t> tokens =
      quick ? std::vector<uint64_t>{16, 100} : std::vector<uint64_t>{16, 250, 2048};
  const uint64_t pool_bytes = quick ? (uint64_t{64} << 20) : (uint64_t{1} << 30);

  const DeviceSpec device = Check(ResolveDevice(device_flag), "--device");
  std::printf("pool_bench: %s, %d reps (median), pools on %s memory, GB/s = 1e9 bytes/s\n\n",
              quick ? "quick" : "full", reps, device.Name().c_str());
  std::printf(
      "| layout | tokens | payload MiB | put GB/s | memcpy GB/s | put ratio | get GB/s | "
      "memcpy GB/s | get ratio |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  const ModelLayout layouts[] = {Preset("llama-3.1-8b"), Preset("deepseek-v3"), SmallHeadLayout(),
                                 Int8Preset("llama-3.1-8b")};
  for (const ModelLayout& layout : layouts) {
    auto store = MakeStore(layout, pool_bytes, device);
    for (uint64_t t : tokens) {
      const Row r = RunCase(*store, t, reps);
      std::printf("| %s | %" PRIu64 " | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n",
                  r.layout.c_str(), r.tokens, double(r.bytes) / (1 << 20), r.put_gbs,
                  r.put_memcpy_gbs, r.put_ratio, r.get_gbs, r.get_memcpy_gbs, r.get_ratio);
      std::fflush(stdout);
    }
  }

  std::printf("\nfork (copy-on-write), %d reps (median)\n\n", reps);
  std::printf("| layout | tokens | fork us | blocks shared | blocks copied | MiB copied |\n");
  std::printf("|---|---:|---:|---:|---:|---:|\n");
  {
    const ModelLayout llama = Preset("llama-3.1-8b");
    const uint64_t fork_tokens = quick ? 256 : 4096;
    auto store = MakeStore(llama, quick ? (uint64_t{64} << 20) : (uint64_t{1} << 30), device);
    RunFork(*store, fork_tokens, reps);
    RunFork(*store, fork_tokens + 5, reps);
  }

  std::printf("\nStats() against live sequences (4 tenants), %d reps (median of 100 calls)\n\n",
              reps);
  std::printf("| sequences | admin us | tenant us | admin ratio to the first row |\n");
  std::printf("|---:|---:|---:|---:|\n");
  {
    const std::vector<uint64_t> counts =
        quick ? std::vector<uint64_t>{1024, 16384} : std::vector<uint64_t>{1024, 65536};
    double first = 0;
    for (uint64_t n : counts) {
      const StatsRow r = RunStats(device, n, reps);
      if (first == 0) first = r.admin_us;
      std::printf("| %" PRIu64 " | %.2f | %.2f | %.2f |\n", r.sequences, r.admin_us, r.tenant_us,
                  r.admin_us / first);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace kvbank

int main(int argc, char** argv) { return kvbank::Main(argc, argv); }
