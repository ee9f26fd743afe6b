// gpu_attention_bench: CUDA decode attention (DecodeAttentionCuda) KV read bandwidth against a
// read-only streaming kernel over the same number of bytes, measured in the same run.
//
//   gpu_attention_bench [--reps N] [--csv PATH] [--quick]
//
// Shapes: batch {1, 16, 64} x context {512, 2048, 8192, 32768} x GQA ratio {1, 8} (32 q heads,
// 32 or 4 kv heads, head_dim 128, 16-token blocks) in fp16; then the GQA-8 set again in int8 and
// fp8_e4m3. Every item has its own blocks: a random block table (a shuffled permutation of the
// pool), 256 distinct encoded blocks replicated over the pool. GB/s = KV bytes one call reads
// (attended tokens x block_bytes / block_tokens: K, V and scales) per second, 1e9 bytes.
// Baseline: a grid-stride sum of uint4 loads over the same number of contiguous pool bytes.
// Timing: CUDA events around each launch, a warm-up pair first, then `reps` pairs (decode,
// stream) back to back; the L2 is flushed (a 256 MiB memset, untimed) before every timed launch
// so that small shapes are not served from the 50 MB L2; the floor of this method (an empty launch
// timed the same way) is printed first. ratio = the median of per-pair ratios of
// decode GB/s to stream GB/s. Then, per shape, the int8 / fp8 speedup over fp16 (time ratio)
// divided by the byte saving (fp16 bytes / quantized bytes): 1.0 means the format turns all of
// its byte saving into speed.
// --csv writes one line per shape (torch_sdpa_compare.py reads the shapes and times back).
// Without a CUDA device it prints "no CUDA device: skipped" and exits 0. Exits 1 on a CUDA error
// or a NaN in any output. No Abseil: it links kvbank_kernels_cuda only.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/attention.h"
#include "kernels/attention_cuda.h"
#include "kernels/quant.h"
#include "kvbank/layout.h"

namespace kvbank::kernels {
namespace {

constexpr uint64_t kSeed = 20261201;
constexpr uint32_t kQHeads = 32, kHeadDim = 128, kBlockTokens = 16;
constexpr uint32_t kDistinctBlocks = 256;  // encoded on the host, replicated over the pool
constexpr size_t kFlushBytes = size_t{256} << 20;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "gpu_attention_bench: %s\n", what.c_str());
  std::exit(1);
}

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) Fail(std::string(what) + ": " + cudaGetErrorString(e));
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The baseline: every thread sums its uint4 words; one word per block is written so the loads
// cannot be dropped. src: [n] 16-byte words; sink: [gridDim.x].
__global__ void StreamKernel(const uint4* __restrict__ src, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint4 w = __ldg(src + i);
    acc ^= w.x + w.y + w.z + w.w;
  }
  for (int off = 16; off > 0; off >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, off);
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;  // practically never; keeps the loads live
}

__global__ void EmptyKernel() {}

// The floor of the timing method: an empty launch between the same events, after the same flush.
// No decode time below can be shorter.
double EmptyLaunchMs(int reps, void* flush) {
  cudaEvent_t e0, e1;
  Check(cudaEventCreate(&e0), "cudaEventCreate");
  Check(cudaEventCreate(&e1), "cudaEventCreate");
  std::vector<double> t;
  for (int r = -1; r < reps; ++r) {
    Check(cudaMemsetAsync(flush, r & 0xff, kFlushBytes, 0), "flush");
    Check(cudaEventRecord(e0, 0), "event");
    EmptyKernel<<<1, 32>>>();
    Check(cudaGetLastError(), "EmptyKernel");
    Check(cudaEventRecord(e1, 0), "event");
    Check(cudaEventSynchronize(e1), "sync");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    if (r >= 0) t.push_back(ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return Median(t);
}

BlockLayout LayerLayout(DType storage, uint32_t kv_heads) {
  ModelLayout m;
  m.name = "bench-layer";
  m.num_layers = 1;
  m.num_q_heads = kQHeads;
  m.num_kv_heads = kv_heads;
  m.head_dim = m.head_dim_v = kHeadDim;
  m.block_tokens = kBlockTokens;
  m.kind = AttentionKind::kGqa;
  m.layer_dtypes = {storage};
  const std::string err = ValidateLayout(m);
  if (!err.empty()) Fail(err);
  return ComputeBlockLayout(m);
}

// Host: kDistinctBlocks blocks of Gaussian K/V encoded by the CPU codecs (the same bytes the
// service stores). [kDistinctBlocks][block_bytes].
std::vector<uint8_t> EncodeBlocks(const BlockLayout& layout, std::mt19937_64& rng) {
  const LayerView& v = layout.layers[0];
  const uint64_t bb = layout.block_bytes;
  std::vector<uint8_t> out(kDistinctBlocks * bb, 0);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::vector<float> rows(size_t{kBlockTokens} * kHeadDim);
  for (uint32_t blk = 0; blk < kDistinctBlocks; ++blk) {
    uint8_t* base = out.data() + blk * bb;
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
        for (float& x : rows) x = gauss(rng);
        uint8_t* dst = base + (kv == 0 ? v.KRow(h, 0) : v.VRow(h, 0));
        if (v.dtype == DType::kInt8) {
          QuantizeInt8Rows(rows.data(), DType::kFp32, kBlockTokens, kHeadDim, dst,
                           reinterpret_cast<float*>(base + v.Int8Scale(kv, h, 0)),
                           base + v.Int8ZeroPoint(kv, h, 0));
        } else if (IsQuantized(v.dtype)) {
          const float scale = Fp8ScaleFor(AbsMax(rows.data(), DType::kFp32, rows.size()), v.dtype);
          std::memcpy(base + v.Fp8Scale(kv, h), &scale, sizeof(scale));
          EncodeFp8(rows.data(), DType::kFp32, rows.size(), scale, v.dtype, dst);
        } else {
          ConvertElements(rows.data(), DType::kFp32, dst, v.dtype, rows.size());
        }
      }
    }
  }
  return out;
}

// A device pool of `blocks` blocks for one (dtype, kv heads), filled once and shared by every
// (batch, context) of that configuration.
struct Pool {
  BlockLayout layout;
  uint8_t* data = nullptr;  // [blocks][block_bytes]
  size_t blocks = 0;

  Pool(DType storage, uint32_t kv_heads, size_t num_blocks, std::mt19937_64& rng) {
    layout = LayerLayout(storage, kv_heads);
    blocks = num_blocks;
    const uint64_t bb = layout.block_bytes;
    Check(cudaMalloc(&data, blocks * bb), "cudaMalloc(pool)");
    const std::vector<uint8_t> host = EncodeBlocks(layout, rng);
    size_t filled = std::min<size_t>(kDistinctBlocks, blocks);
    Check(cudaMemcpy(data, host.data(), filled * bb, cudaMemcpyHostToDevice), "fill pool");
    while (filled < blocks) {  // doubling device copies
      const size_t n = std::min(filled, blocks - filled);
      Check(cudaMemcpy(data + filled * bb, data, n * bb, cudaMemcpyDeviceToDevice), "fill pool");
      filled += n;
    }
  }
  ~Pool() { cudaFree(data); }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
};

template <typename T>
T* ToDevice(const std::vector<T>& v) {
  T* d = nullptr;
  Check(cudaMalloc(&d, v.size() * sizeof(T)), "cudaMalloc");
  Check(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  return d;
}

struct Row {
  DType dtype = DType::kFp16;
  uint32_t batch = 0, context = 0, kv_heads = 0;
  uint64_t kv_bytes = 0;
  double decode_ms = 0, stream_ms = 0, decode_gbs = 0, stream_gbs = 0, ratio = 0;
};

// Times one (batch, context) over `pool`. flush: [kFlushBytes] device scratch; sink: [grid].
Row Measure(const Pool& pool, uint32_t batch, uint32_t context, int reps, std::mt19937_64& rng,
            void* flush, uint32_t* sink, int stream_grid) {
  const LayerView& v = pool.layout.layers[0];
  const uint32_t per_item = (context + kBlockTokens - 1) / kBlockTokens;
  const size_t need = size_t{per_item} * batch;
  if (need > pool.blocks) Fail("pool too small");
  std::vector<int32_t> ids(pool.blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> indptr{0}, indices(ids.begin(), ids.begin() + need);
  for (uint32_t i = 0; i < batch; ++i) indptr.push_back(int32_t((i + 1) * per_item));
  const std::vector<uint32_t> lengths(batch, context);
  const std::vector<LayerView> layers(batch, v);
  std::vector<float> q(size_t{batch} * kQHeads * kHeadDim);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  for (float& x : q) x = gauss(rng);

  DecodeAttentionParams p;
  p.kv.pool = pool.data;
  p.kv.block_bytes = pool.layout.block_bytes;
  p.kv.layers = ToDevice(layers);
  p.kv.indptr = ToDevice(indptr);
  p.kv.indices = ToDevice(indices);
  p.kv.lengths = ToDevice(lengths);
  p.kv.batch = batch;
  p.num_q_heads = kQHeads;
  p.num_kv_heads = v.num_kv_heads;
  p.head_dim = p.head_dim_v = kHeadDim;
  p.sm_scale = 1.0f / std::sqrt(float(kHeadDim));
  p.q = ToDevice(q);
  float *out = nullptr, *lse = nullptr;
  Check(cudaMalloc(&out, sizeof(float) * batch * kQHeads * kHeadDim), "cudaMalloc(out)");
  Check(cudaMalloc(&lse, sizeof(float) * batch * kQHeads), "cudaMalloc(lse)");
  p.out = out;
  p.lse = lse;
  const size_t ws_bytes = DecodeAttentionWorkspaceBytes(p, context);
  void* ws = nullptr;
  Check(cudaMalloc(&ws, std::max<size_t>(ws_bytes, 16)), "cudaMalloc(workspace)");

  Row row;
  row.dtype = v.dtype;
  row.batch = batch;
  row.context = context;
  row.kv_heads = v.num_kv_heads;
  row.kv_bytes = uint64_t{context} * batch * pool.layout.block_bytes / kBlockTokens;
  const size_t words = row.kv_bytes / sizeof(uint4);

  cudaEvent_t e0, e1, e2, e3;
  for (cudaEvent_t* e : {&e0, &e1, &e2, &e3}) Check(cudaEventCreate(e), "cudaEventCreate");
  std::vector<double> t_dec, t_str, ratio;
  for (int r = -1; r < reps; ++r) {  // r == -1: warm-up
    Check(cudaMemsetAsync(flush, r & 0xff, kFlushBytes, 0), "flush");
    Check(cudaEventRecord(e0, 0), "event");
    Check(DecodeAttentionCuda(p, context, ws, ws_bytes, 0), "DecodeAttentionCuda");
    Check(cudaEventRecord(e1, 0), "event");
    Check(cudaMemsetAsync(flush, r & 0xff, kFlushBytes, 0), "flush");
    Check(cudaEventRecord(e2, 0), "event");
    StreamKernel<<<stream_grid, 256>>>(reinterpret_cast<const uint4*>(pool.data), words, sink);
    Check(cudaGetLastError(), "StreamKernel");
    Check(cudaEventRecord(e3, 0), "event");
    Check(cudaEventSynchronize(e3), "sync");
    if (r < 0) continue;
    float ms_dec = 0, ms_str = 0;
    Check(cudaEventElapsedTime(&ms_dec, e0, e1), "elapsed");
    Check(cudaEventElapsedTime(&ms_str, e2, e3), "elapsed");
    t_dec.push_back(ms_dec);
    t_str.push_back(ms_str);
    ratio.push_back(double(ms_str) / double(ms_dec));  // same bytes: GB/s ratio = time ratio
  }
  for (cudaEvent_t e : {e0, e1, e2, e3}) cudaEventDestroy(e);

  std::vector<float> host_out(size_t{batch} * kQHeads * kHeadDim);
  Check(cudaMemcpy(host_out.data(), out, host_out.size() * sizeof(float), cudaMemcpyDeviceToHost),
        "copy out");
  for (float x : host_out) {
    if (!std::isfinite(x)) Fail("non-finite value in the output");
  }
  for (const void* d :
       {static_cast<const void*>(p.kv.layers), static_cast<const void*>(p.kv.indptr),
        static_cast<const void*>(p.kv.indices), static_cast<const void*>(p.kv.lengths),
        static_cast<const void*>(p.q), static_cast<const void*>(out), static_cast<const void*>(lse),
        static_cast<const void*>(ws)}) {
    cudaFree(const_cast<void*>(d));
  }

  row.decode_ms = Median(t_dec);
  row.stream_ms = Median(t_str);
  row.decode_gbs = double(row.kv_bytes) / 1e6 / row.decode_ms;
  row.stream_gbs = double(row.kv_bytes) / 1e6 / row.stream_ms;
  row.ratio = Median(ratio);
  return row;
}

}  // namespace
}  // namespace kvbank::kernels

int main(int argc, char** argv) {
  using namespace kvbank;
  using namespace kvbank::kernels;
  int reps = 0;
  bool quick = false;
  const char* csv_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--csv") == 0 && i + 1 < argc) {
      csv_path = argv[++i];
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: gpu_attention_bench [--reps N] [--csv PATH] [--quick]\n");
      return 2;
    }
  }
  if (reps <= 0) reps = quick ? 3 : 15;
  reps = std::min(reps, 200);  // NOTE: the largest shape reads 32 GiB per call (~10 ms)

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("gpu_attention_bench: no CUDA device: skipped\n");
    return 0;
  }
  cudaDeviceProp prop;
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("gpu_attention_bench: %s (sm_%d%d, %d SMs, L2 %d MiB), %d reps, seed %llu\n",
              prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize >> 20,
              reps, static_cast<unsigned long long>(kSeed));

  const std::vector<uint32_t> batches =
      quick ? std::vector<uint32_t>{1, 16} : std::vector<uint32_t>{1, 16, 64};
  const std::vector<uint32_t> contexts =
      quick ? std::vector<uint32_t>{512, 2048} : std::vector<uint32_t>{512, 2048, 8192, 32768};
  const uint32_t max_blocks =
      *std::max_element(batches.begin(), batches.end()) *
      ((*std::max_element(contexts.begin(), contexts.end()) + kBlockTokens - 1) / kBlockTokens);
  // (dtype, kv heads): fp16 at GQA 1 and 8, then int8 and fp8 at GQA 8.
  const std::vector<std::pair<DType, uint32_t>> configs = {
      {DType::kFp16, 32}, {DType::kFp16, 4}, {DType::kInt8, 4}, {DType::kFp8E4M3, 4}};

  void* flush = nullptr;
  Check(cudaMalloc(&flush, kFlushBytes), "cudaMalloc(flush)");
  const int stream_grid = prop.multiProcessorCount * 8;
  uint32_t* sink = nullptr;
  Check(cudaMalloc(&sink, sizeof(uint32_t) * stream_grid), "cudaMalloc(sink)");

  std::FILE* csv = nullptr;
  if (csv_path != nullptr) {
    csv = std::fopen(csv_path, "w");
    if (csv == nullptr) Fail(std::string("cannot write ") + csv_path);
    std::fprintf(csv,
                 "dtype,batch,context,num_q_heads,num_kv_heads,head_dim,block_tokens,kv_bytes,"
                 "decode_ms,stream_ms,decode_gbs,stream_gbs,ratio\n");
  }

  std::printf("timing floor: an empty launch between the events, after a flush: %.4f ms\n",
              EmptyLaunchMs(reps, flush));

  std::mt19937_64 rng(kSeed);
  std::map<std::tuple<DType, uint32_t, uint32_t, uint32_t>, Row> rows;
  std::printf(
      "\n| dtype | kv heads | batch | context | KV MiB | decode ms | decode GB/s |"
      " stream GB/s | ratio |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& [dtype, kv_heads] : configs) {
    const Pool pool(dtype, kv_heads, max_blocks, rng);
    for (uint32_t ctx : contexts) {
      for (uint32_t bs : batches) {
        const Row r = Measure(pool, bs, ctx, reps, rng, flush, sink, stream_grid);
        rows[{dtype, kv_heads, bs, ctx}] = r;
        std::printf("| %s | %u | %u | %u | %.1f | %.4f | %.1f | %.1f | %.2f |\n", DTypeName(dtype),
                    kv_heads, bs, ctx, double(r.kv_bytes) / (1 << 20), r.decode_ms, r.decode_gbs,
                    r.stream_gbs, r.ratio);
        if (csv != nullptr) {
          std::fprintf(csv, "%s,%u,%u,%u,%u,%u,%u,%llu,%.6f,%.6f,%.3f,%.3f,%.4f\n",
                       DTypeName(dtype), bs, ctx, kQHeads, kv_heads, kHeadDim, kBlockTokens,
                       static_cast<unsigned long long>(r.kv_bytes), r.decode_ms, r.stream_ms,
                       r.decode_gbs, r.stream_gbs, r.ratio);
        }
        std::fflush(stdout);
      }
    }
  }
  if (csv != nullptr) std::fclose(csv);
  cudaFree(flush);
  cudaFree(sink);

  std::printf(
      "\n| dtype | kv heads | batch | context | speedup vs fp16 | byte saving |"
      " speedup / saving |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& [key, r] : rows) {
    const auto& [dtype, kv_heads, bs, ctx] = key;
    if (dtype == DType::kFp16) continue;
    const auto base = rows.find({DType::kFp16, kv_heads, bs, ctx});
    if (base == rows.end()) continue;
    const double speedup = base->second.decode_ms / r.decode_ms;
    const double saving = double(base->second.kv_bytes) / double(r.kv_bytes);
    std::printf("| %s | %u | %u | %u | %.2f | %.2f | %.2f |\n", DTypeName(dtype), kv_heads, bs, ctx,
                speedup, saving, speedup / saving);
  }
  return 0;
}
