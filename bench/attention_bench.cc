// attention_bench: CPU decode attention (DecodeAttentionCpu) read bandwidth against memcpy.
//
//   attention_bench [--quick] [--reps N] [--threads N]
//
// One layer shaped like llama-3.1-8b (8 kv heads, 32 q heads, head_dim 128, 16-token blocks),
// stored as fp16 or int8; contexts 1K / 8K / 32K tokens, batch 1 and 16, every item its own
// blocks (shuffled ids, so nothing is shared between items). GB/s = KV bytes the call reads
// (attended tokens x block_bytes / block_tokens: K, V and int8 scales) per second, 1e9 bytes.
// Baseline, measured in the same run and interleaved with the attention call (pairs back to
// back): memcpy of the same number of bytes (capped at 256 MiB) split over the same number of
// threads; ratio = attention GB/s / memcpy GB/s, the median of per-pair ratios. Then, per
// (context, batch): the int8 speedup over fp16 (time ratio) divided by the byte saving (fp16
// bytes / int8 bytes): 1.0 means int8 turns all of its byte saving into speed.
// Before timing, one small case per dtype is checked against DecodeAttentionReference; the run
// exits 1 on a mismatch or a NaN. --quick runs small sizes and few repetitions (a smoke test).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/attention.h"
#include "kernels/quant.h"
#include "kvbank/layout.h"

namespace kvbank::kernels {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kSeed = 20261130;
constexpr uint32_t kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kBlockTokens = 16;
constexpr size_t kMemcpyCap = size_t{256} << 20;
constexpr uint32_t kDistinctBlocks = 256;  // encoded once, then replicated over the pool

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "attention_bench: %s\n", what.c_str());
  std::exit(1);
}

BlockLayout LayerLayout(DType storage) {
  ModelLayout m;
  m.name = "llama-3.1-8b-layer";
  m.num_layers = 1;
  m.num_q_heads = kQHeads;
  m.num_kv_heads = kKvHeads;
  m.head_dim = m.head_dim_v = kHeadDim;
  m.block_tokens = kBlockTokens;
  m.kind = AttentionKind::kGqa;
  m.layer_dtypes = {storage};
  const std::string err = ValidateLayout(m);
  if (!err.empty()) Fail(err);
  return ComputeBlockLayout(m);
}

// A batch of `batch` items of `context` tokens each, in a pool of exactly their blocks.
struct Batch {
  BlockLayout layout;
  std::vector<uint8_t> pool;
  std::vector<LayerView> layers;
  std::vector<int32_t> indptr, indices;
  std::vector<uint32_t> lengths;
  std::vector<float> q, out, lse;
  uint64_t kv_bytes = 0;  // bytes one call reads

  DecodeAttentionParams Params() {
    DecodeAttentionParams p;
    p.kv.pool = pool.data();
    p.kv.block_bytes = layout.block_bytes;
    p.kv.layers = layers.data();
    p.kv.indptr = indptr.data();
    p.kv.indices = indices.data();
    p.kv.lengths = lengths.data();
    p.kv.batch = static_cast<uint32_t>(lengths.size());
    p.num_q_heads = kQHeads;
    p.num_kv_heads = kKvHeads;
    p.head_dim = p.head_dim_v = kHeadDim;
    p.sm_scale = 1.0f / std::sqrt(float(kHeadDim));
    p.q = q.data();
    p.out = out.data();
    p.lse = lse.data();
    return p;
  }
};

Batch MakeBatch(DType storage, uint32_t context, uint32_t batch, std::mt19937_64& rng) {
  Batch b;
  b.layout = LayerLayout(storage);
  const LayerView& v = b.layout.layers[0];
  const uint32_t per_item = (context + kBlockTokens - 1) / kBlockTokens;
  const size_t blocks = size_t{per_item} * batch;
  const uint64_t bb = b.layout.block_bytes;
  b.pool.resize(blocks * bb);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::vector<float> rows(size_t{kBlockTokens} * kHeadDim);
  const size_t distinct = std::min<size_t>(kDistinctBlocks, blocks);
  for (size_t blk = 0; blk < distinct; ++blk) {
    uint8_t* base = b.pool.data() + blk * bb;
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t h = 0; h < kKvHeads; ++h) {
        for (float& x : rows) x = gauss(rng);
        uint8_t* dst = base + (kv == 0 ? v.KRow(h, 0) : v.VRow(h, 0));
        if (storage == DType::kInt8) {
          QuantizeInt8Rows(rows.data(), DType::kFp32, kBlockTokens, kHeadDim, dst,
                           reinterpret_cast<float*>(base + v.Int8Scale(kv, h, 0)),
                           base + v.Int8ZeroPoint(kv, h, 0));
        } else {
          ConvertElements(rows.data(), DType::kFp32, dst, storage, rows.size());
        }
      }
    }
  }
  for (size_t blk = distinct; blk < blocks; ++blk) {
    std::memcpy(b.pool.data() + blk * bb, b.pool.data() + (blk % distinct) * bb, bb);
  }
  std::vector<int32_t> ids(blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  b.indptr.push_back(0);
  for (uint32_t i = 0; i < batch; ++i) {
    b.indices.insert(b.indices.end(), ids.begin() + size_t{i} * per_item,
                     ids.begin() + size_t{i + 1} * per_item);
    b.indptr.push_back(static_cast<int32_t>(b.indices.size()));
    b.lengths.push_back(context);
    b.layers.push_back(v);
  }
  b.q.resize(size_t{batch} * kQHeads * kHeadDim);
  for (float& x : b.q) x = gauss(rng);
  b.out.resize(size_t{batch} * kQHeads * kHeadDim);
  b.lse.resize(size_t{batch} * kQHeads);
  b.kv_bytes = uint64_t{context} * batch * bb / kBlockTokens;
  return b;
}

// Same-run check: the kernel against the reference on one small batch.
void CheckAgainstReference(DType storage, uint32_t threads, std::mt19937_64& rng) {
  Batch b = MakeBatch(storage, 777, 3, rng);
  b.lengths = {777, 1, 300};
  DecodeAttentionParams p = b.Params();
  const std::string err = ValidateDecodeAttention(p);
  if (!err.empty()) Fail(err);
  std::vector<float> ref_out(b.out.size()), ref_lse(b.lse.size());
  DecodeAttentionParams pr = p;
  pr.out = ref_out.data();
  pr.lse = ref_lse.data();
  DecodeAttentionReference(pr);
  DecodeAttentionCpu(p, threads);
  double worst = 0;
  for (size_t i = 0; i < ref_out.size(); ++i) {
    if (std::isnan(b.out[i])) Fail("NaN in the output");
    worst = std::max(worst, std::fabs(double(b.out[i]) - ref_out[i]));
  }
  for (size_t i = 0; i < ref_lse.size(); ++i) {
    worst = std::max(worst, std::fabs(double(b.lse[i]) - ref_lse[i]));
  }
  std::printf("check %s: max |cpu - reference| = %.2e\n", DTypeName(storage), worst);
  if (!(worst < 1e-4)) Fail("CPU kernel differs from the reference");
}

void ParallelMemcpy(uint8_t* dst, const uint8_t* src, size_t n, uint32_t threads) {
  if (threads <= 1) {
    std::memcpy(dst, src, n);
    return;
  }
  std::vector<std::thread> pool;
  const size_t per = (n + threads - 1) / threads;
  for (uint32_t t = 1; t < threads; ++t) {
    const size_t a = std::min(n, per * t), e = std::min(n, per * (t + 1));
    pool.emplace_back([=] { std::memcpy(dst + a, src + a, e - a); });
  }
  std::memcpy(dst, src, std::min(n, per));
  for (std::thread& t : pool) t.join();
}

struct Row {
  double seconds = 0, gbs = 0, memcpy_gbs = 0, ratio = 0;
  uint64_t bytes = 0;
};

Row Measure(Batch& b, uint32_t threads, int reps) {
  DecodeAttentionParams p = b.Params();
  const size_t mbytes = std::min<size_t>(b.kv_bytes, kMemcpyCap);
  std::vector<uint8_t> src(mbytes, 1), dst(mbytes, 0);
  std::vector<double> t_att, t_cpy, ratio;
  for (int r = -1; r < reps; ++r) {  // r == -1: warm-up
    const auto a0 = Clock::now();
    DecodeAttentionCpu(p, threads);
    const auto a1 = Clock::now();
    ParallelMemcpy(dst.data(), src.data(), mbytes, threads);
    const auto a2 = Clock::now();
    if (r < 0) continue;
    const double ta = std::chrono::duration<double>(a1 - a0).count();
    const double tc = std::chrono::duration<double>(a2 - a1).count();
    t_att.push_back(ta);
    t_cpy.push_back(tc);
    ratio.push_back((double(b.kv_bytes) / ta) / (double(mbytes) / tc));
  }
  for (float x : b.out) {
    if (std::isnan(x)) Fail("NaN in the output");
  }
  Row row;
  row.bytes = b.kv_bytes;
  row.seconds = Median(t_att);
  row.gbs = double(b.kv_bytes) / 1e9 / row.seconds;
  row.memcpy_gbs = double(mbytes) / 1e9 / Median(t_cpy);
  row.ratio = Median(ratio);
  return row;
}

}  // namespace
}  // namespace kvbank::kernels

int main(int argc, char** argv) {
  using namespace kvbank;
  using namespace kvbank::kernels;
  bool quick = false;
  int reps = 0;
  uint32_t threads = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = static_cast<uint32_t>(std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: attention_bench [--quick] [--reps N] [--threads N]\n");
      return 2;
    }
  }
  if (reps <= 0) reps = quick ? 3 : 7;
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  std::printf("attention_bench: %s, %u threads, seed %llu, codec path %s\n",
              quick ? "quick" : "full", threads, static_cast<unsigned long long>(kSeed),
              ActiveCodecOps().name);
  std::mt19937_64 rng(kSeed);
  for (DType d : {DType::kFp16, DType::kInt8}) CheckAgainstReference(d, threads, rng);

  const std::vector<uint32_t> contexts =
      quick ? std::vector<uint32_t>{256, 1024} : std::vector<uint32_t>{1024, 8192, 32768};
  const std::vector<uint32_t> batches =
      quick ? std::vector<uint32_t>{1, 2} : std::vector<uint32_t>{1, 16};
  std::map<std::pair<uint32_t, uint32_t>, Row> fp16, int8;
  std::printf("\n| context | batch | dtype | KV MiB | ms | GB/s | memcpy GB/s | ratio |\n");
  std::printf("|---:|---:|---|---:|---:|---:|---:|---:|\n");
  for (uint32_t ctx : contexts) {
    for (uint32_t bs : batches) {
      for (DType d : {DType::kFp16, DType::kInt8}) {
        Batch b = MakeBatch(d, ctx, bs, rng);
        const Row row = Measure(b, threads, reps);
        (d == DType::kFp16 ? fp16 : int8)[{ctx, bs}] = row;
        std::printf("| %u | %u | %s | %.1f | %.3f | %.2f | %.2f | %.2f |\n", ctx, bs, DTypeName(d),
                    double(row.bytes) / (1 << 20), row.seconds * 1e3, row.gbs, row.memcpy_gbs,
                    row.ratio);
        std::fflush(stdout);
      }
    }
  }
  std::printf("\n| context | batch | int8 speedup | byte saving | speedup / saving |\n");
  std::printf("|---:|---:|---:|---:|---:|\n");
  for (const auto& [key, f] : fp16) {
    const Row& q = int8[key];
    const double speedup = f.seconds / q.seconds, saving = double(f.bytes) / double(q.bytes);
    std::printf("| %u | %u | %.2f | %.2f | %.2f |\n", key.first, key.second, speedup, saving,
                speedup / saving);
  }
  return 0;
}
