// The cuda:N pool memory against the host-staged one (the same calls run by the CPU kernels):
// both start from the same bytes, take the same calls, and must end with the same pool, bit for
// bit, and give back the same payloads: plain, storage-format (int8 and fp8 scale sections) and
// converted (wire fp32 / fp16 / bf16 to and from int8, fp8, bf16, fp16, fp32 layers) transfers
// over odd block sizes and partial blocks, whole-block copies, token-row copies, and decode
// attention (outputs within 1e-4 of the CPU kernel's). Also the memory's own contract: staging
// buffers, errors, concurrent callers. Skips itself where no CUDA device is present.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/block_copy.h"
#include "kernels/quant.h"
#include "kvbank/layout.h"
#include "server/core/cuda_memory.h"
#include "server/core/pool_memory.h"
#include "tests/gpu/gpu_testing.h"
#include "tests/unit/attention_testing.h"
#include "tests/unit/payload_codec_testing.h"

namespace kvbank {
namespace {

constexpr uint64_t kSeed = 7312024;

#define KVBANK_ASSERT_OK(expr)                   \
  do {                                           \
    const absl::Status s_ = (expr);              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)

// The codec tests' shapes, with DeepSeek's 64-wide rope part for MLA and 2 q heads per KV head.
ModelLayout Shape(AttentionKind kind, uint32_t kv_heads, uint32_t head_dim, uint32_t block_tokens,
                  std::vector<DType> dtypes) {
  return kernels::testing::CodecShape(kind, kv_heads, head_dim, block_tokens, std::move(dtypes),
                                      /*rope_dim=*/64, /*q_per_kv=*/2);
}

std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, uint64_t n) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// n values in `wire` (fp32 / fp16 / bf16), finite: gaussian with a per-row offset now and then.
std::vector<uint8_t> WireValues(std::mt19937_64& rng, DType wire, uint64_t n) {
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::vector<float> f(n);
  float offset = 0.0f;
  for (uint64_t i = 0; i < n; ++i) {
    if (i % 64 == 0) offset = 0.5f * gauss(rng);
    f[i] = 2.0f * gauss(rng) + offset;
  }
  std::vector<uint8_t> out(n * DTypeBytes(wire));
  kernels::ConvertElements(f.data(), DType::kFp32, out.data(), wire, n);
  return out;
}

std::vector<uint8_t> PoolBytes(const PoolMemory& m) {
  std::vector<uint8_t> v(m.bytes());
  if (m.kind() == MemoryKind::kCuda) {
    EXPECT_EQ(cudaMemcpy(v.data(), m.base(), v.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  } else {
    std::memcpy(v.data(), m.base(), v.size());
  }
  return v;
}

void SetPool(PoolMemory& m, const std::vector<uint8_t>& bytes) {
  ASSERT_EQ(bytes.size(), m.bytes());
  if (m.kind() == MemoryKind::kCuda) {
    CUDA_OK(cudaMemcpy(m.base(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
    // NOTE: from pageable memory cudaMemcpy may return before the DMA lands, and the memory's
    // own stream is non-blocking (not ordered after the legacy default stream): wait for it.
    CUDA_OK(cudaDeviceSynchronize());
  } else {
    std::memcpy(m.base(), bytes.data(), bytes.size());
  }
}

// Expects equal bytes; names the first difference (block and offset in it) and the count.
void ExpectSameBytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                     uint64_t block_bytes, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  uint64_t diffs = 0, first = 0;
  for (uint64_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && diffs++ == 0) first = i;
  }
  EXPECT_EQ(diffs, 0u) << what << ": " << diffs << " bytes differ, the first at byte " << first
                       << " (block " << first / block_bytes << " + " << first % block_bytes
                       << "): cuda " << int(got[first]) << ", host-staged " << int(want[first]);
}

// A cuda:0 memory and a host-staged one of the same size, starting from the same bytes.
struct Pair {
  std::unique_ptr<PoolMemory> cuda;
  std::unique_ptr<PoolMemory> host;
  uint64_t block_bytes = 0;

  void ExpectSamePools(const std::string& what) const {
    ExpectSameBytes(PoolBytes(*cuda), PoolBytes(*host), block_bytes, what);
  }
};

void MakePair(uint64_t num_blocks, uint64_t block_bytes, std::mt19937_64& rng, Pair* p) {
  const uint64_t bytes = num_blocks * block_bytes;
  absl::StatusOr<std::unique_ptr<PoolMemory>> cuda = CreateCudaMemory(0, bytes);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  absl::StatusOr<std::unique_ptr<PoolMemory>> host =
      CreateHostMemory(bytes, /*prefault=*/true, /*staged=*/true);
  ASSERT_TRUE(host.ok()) << host.status();
  p->cuda = std::move(*cuda);
  p->host = std::move(*host);
  p->block_bytes = block_bytes;
  // Random bytes everywhere, so a stray write (or a missed one) shows.
  const std::vector<uint8_t> fill = RandomBytes(rng, bytes);
  SetPool(*p->cuda, fill);
  SetPool(*p->host, fill);
}

// What SequenceStore::Configure builds for a transfer of layers [l0, l1), tokens
// [pos, pos + payload.num_tokens) of a sequence whose blocks are `table`.
PayloadJob MakeJob(const BlockLayout& b, const PayloadLayout& pl, const PoolMemory& m,
                   const std::vector<int32_t>& table, uint64_t pos, std::optional<DType> convert) {
  PayloadJob j;
  j.map.pool = m.base();
  j.map.block_bytes = b.block_bytes;
  j.map.layers = b.layers.data() + pl.layer_begin;
  j.map.layer_offset = pl.layer_offset.data();
  j.map.num_layers = pl.layer_end - pl.layer_begin;
  j.map.block_table = table.data();
  j.map.token_begin = pos;
  j.map.num_tokens = pl.num_tokens;
  j.map.total_bytes = pl.total_bytes;
  if (pl.storage_format()) {
    j.map.scale_offset = pl.scale_offset.data();
    j.map.first_block = pl.first_block;
  }
  j.convert = convert;
  return j;
}

enum class Format { kPlain, kStorage, kConvert };

class GpuPoolMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override { KVBANK_SKIP_WITHOUT_CUDA(kSeed); }

  // Writes `payload` through both memories (the CUDA one from one of its staging buffers when
  // `staged`), expects equal pools, then reads the same range back from both and expects equal
  // payloads; a plain or storage-format payload must come back as it went in.
  void RoundTrip(Pair& pair, const BlockLayout& b, const PayloadLayout& pl,
                 const std::vector<int32_t>& table, uint64_t pos, std::optional<DType> convert,
                 const std::vector<uint8_t>& payload, bool staged, const std::string& what) {
    SCOPED_TRACE(what);
    ASSERT_EQ(payload.size(), pl.total_bytes);
    const PayloadJob cj = MakeJob(b, pl, *pair.cuda, table, pos, convert);
    const PayloadJob hj = MakeJob(b, pl, *pair.host, table, pos, convert);
    std::unique_ptr<StagingBuffer> stage;
    const uint8_t* src = payload.data();
    if (staged) {
      absl::StatusOr<std::unique_ptr<StagingBuffer>> s = pair.cuda->Stage(pl.total_bytes);
      ASSERT_TRUE(s.ok()) << s.status();
      stage = std::move(*s);
      ASSERT_EQ(stage->size(), pl.total_bytes);
      if (!payload.empty()) std::memcpy(stage->data(), payload.data(), payload.size());
      src = stage->data();
    }
    KVBANK_ASSERT_OK(pair.cuda->WritePayload(cj, src));
    KVBANK_ASSERT_OK(pair.host->WritePayload(hj, payload.data()));
    pair.ExpectSamePools("after the write");

    std::vector<uint8_t> from_host(pl.total_bytes, 0xa5);
    KVBANK_ASSERT_OK(pair.host->ReadPayload(hj, from_host.data()));
    std::vector<uint8_t> from_cuda(pl.total_bytes, 0x5a);
    if (staged) {
      std::memset(stage->data(), 0x5a, pl.total_bytes);
      KVBANK_ASSERT_OK(pair.cuda->ReadPayload(cj, stage->data()));
      if (!from_cuda.empty()) std::memcpy(from_cuda.data(), stage->data(), from_cuda.size());
    } else {
      KVBANK_ASSERT_OK(pair.cuda->ReadPayload(cj, from_cuda.data()));
    }
    ExpectSameBytes(from_cuda, from_host, ~uint64_t{0}, "the payload read back");
    if (!convert) ExpectSameBytes(from_cuda, payload, ~uint64_t{0}, "the plain round trip");
    pair.ExpectSamePools("after the read");
  }

  // Two transfers into one sequence: layers [0, L) x tokens [0, n1) (ending inside a block),
  // then layers [l0, L) x [n1, n1 + n2) (starting inside that block: fp8 rows there use the
  // scale the first one set).
  void CheckTransfers(const ModelLayout& m, Format format, std::optional<DType> wire,
                      std::mt19937_64& rng) {
    ASSERT_EQ(ValidateLayout(m), "");
    const BlockLayout b = ComputeBlockLayout(m);
    const uint32_t bt = b.block_tokens;
    const uint32_t layers = b.num_layers();
    const uint64_t n1 = 2 * bt + 1 + (bt > 2 ? 1 : 0), n2 = bt + 2;
    const uint64_t logical = (n1 + n2 + bt - 1) / bt;
    std::vector<int32_t> table(logical + 5);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    table.resize(logical);
    Pair pair;
    ASSERT_NO_FATAL_FAILURE(MakePair(logical + 5, b.block_bytes, rng, &pair));

    struct Step {
      uint32_t l0;
      uint64_t pos, n;
    };
    const Step steps[] = {{0, 0, n1}, {layers > 1 ? 1u : 0u, n1, n2}};
    int i = 0;
    for (const Step& s : steps) {
      PayloadLayout pl;
      std::vector<uint8_t> payload;
      switch (format) {
        case Format::kPlain:
          pl = PayloadLayout::Make(b, s.l0, layers, s.n);
          payload = RandomBytes(rng, pl.total_bytes);
          break;
        case Format::kStorage:
          pl = PayloadLayout::MakeStorage(b, s.l0, layers, s.pos, s.n);
          payload = RandomBytes(rng, pl.total_bytes);
          break;
        case Format::kConvert:
          pl = PayloadLayout::Make(b, s.l0, layers, s.n, *wire);
          payload = WireValues(rng, *wire, pl.total_bytes / DTypeBytes(*wire));
          break;
      }
      const std::string what = LayoutFingerprint(m) + " format " +
                               std::to_string(static_cast<int>(format)) + " wire " +
                               (wire ? DTypeName(*wire) : "-") + " step " + std::to_string(i);
      ASSERT_NO_FATAL_FAILURE(RoundTrip(pair, b, pl, table, s.pos,
                                        format == Format::kConvert ? wire : std::nullopt, payload,
                                        /*staged=*/i % 2 == 0, what));
      ++i;
    }
  }
};

const DType kMixed[] = {DType::kFp16, DType::kBf16,    DType::kFp32,
                        DType::kInt8, DType::kFp8E4M3, DType::kFp8E5M2};

TEST_F(GpuPoolMemoryTest, DescribesItself) {
  absl::StatusOr<std::unique_ptr<PoolMemory>> m = CreateCudaMemory(0, 1 << 20);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->kind(), MemoryKind::kCuda);
  EXPECT_EQ((*m)->name(), "cuda:0");
  EXPECT_EQ((*m)->bytes(), uint64_t{1} << 20);
  EXPECT_TRUE(CudaBuiltIn());
  const std::vector<uint8_t> zero(1 << 20, 0);
  ExpectSameBytes(PoolBytes(**m), zero, 1 << 20, "a new pool is zeroed");

  uint64_t free_bytes = 0, total_bytes = 0;
  KVBANK_ASSERT_OK(CudaMemoryInfo(0, &free_bytes, &total_bytes));
  EXPECT_GT(total_bytes, 0u);
  EXPECT_LE(free_bytes, total_bytes);
  EXPECT_EQ(CudaMemoryInfo(CudaDeviceCount(), &free_bytes, &total_bytes).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CreateCudaMemory(CudaDeviceCount(), 1 << 20).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CreateCudaMemory(-1, 1 << 20).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CreateCudaMemory(0, total_bytes * 2).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_F(GpuPoolMemoryTest, StagingBuffersAreReusedAndWritable) {
  absl::StatusOr<std::unique_ptr<PoolMemory>> m = CreateCudaMemory(0, 1 << 20);
  ASSERT_TRUE(m.ok()) << m.status();
  for (uint64_t bytes : {uint64_t{0}, uint64_t{1}, uint64_t{4097}, uint64_t{3} << 20, uint64_t{1},
                         uint64_t{3} << 20}) {
    absl::StatusOr<std::unique_ptr<StagingBuffer>> s = (*m)->Stage(bytes);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_EQ((*s)->size(), bytes);
    if (bytes != 0) {
      ASSERT_NE((*s)->data(), nullptr);
      std::memset((*s)->data(), 0x11, bytes);
    }
  }
  // A staging buffer may outlive its memory.
  absl::StatusOr<std::unique_ptr<StagingBuffer>> s = (*m)->Stage(100);
  ASSERT_TRUE(s.ok()) << s.status();
  m->reset();
  std::memset((*s)->data(), 0x22, 100);
}

TEST_F(GpuPoolMemoryTest, PlainAndStorageTransfersMatchHostStaged) {
  std::mt19937_64 rng(kSeed);
  for (uint32_t bt : {1u, 3u, 7u, 16u, 17u}) {
    const std::vector<DType> mixed(std::begin(kMixed), std::end(kMixed));
    for (const ModelLayout& m :
         {Shape(AttentionKind::kGqa, 3, 72, bt, mixed), Shape(AttentionKind::kGqa, 1, 5, bt, mixed),
          Shape(AttentionKind::kMla, 1, 576, bt, {DType::kBf16, DType::kInt8, DType::kFp8E4M3})}) {
      ASSERT_NO_FATAL_FAILURE(CheckTransfers(m, Format::kPlain, std::nullopt, rng));
      ASSERT_NO_FATAL_FAILURE(CheckTransfers(m, Format::kStorage, std::nullopt, rng));
    }
    for (DType q : {DType::kInt8, DType::kFp8E4M3, DType::kFp8E5M2}) {
      ASSERT_NO_FATAL_FAILURE(CheckTransfers(Shape(AttentionKind::kGqa, 2, 64, bt, {q, q}),
                                             Format::kStorage, std::nullopt, rng));
    }
  }
}

TEST_F(GpuPoolMemoryTest, ConvertedTransfersMatchHostStaged) {
  std::mt19937_64 rng(kSeed + 1);
  for (uint32_t bt : {1u, 3u, 7u, 16u, 17u}) {
    const std::vector<DType> mixed(std::begin(kMixed), std::end(kMixed));
    for (DType wire : {DType::kFp32, DType::kFp16, DType::kBf16}) {
      for (const ModelLayout& m :
           {Shape(AttentionKind::kGqa, 3, 72, bt, mixed),
            Shape(AttentionKind::kGqa, 2, 128, bt, {DType::kInt8, DType::kInt8}),
            Shape(AttentionKind::kGqa, 2, 128, bt, {DType::kFp8E4M3, DType::kFp8E5M2}),
            Shape(AttentionKind::kGqa, 1, 3, bt, {DType::kBf16, DType::kFp8E4M3}),
            Shape(AttentionKind::kMla, 1, 576, bt,
                  {DType::kBf16, DType::kInt8, DType::kFp8E4M3})}) {
        ASSERT_NO_FATAL_FAILURE(CheckTransfers(m, Format::kConvert, wire, rng));
      }
    }
  }
}

TEST_F(GpuPoolMemoryTest, RejectsAForeignMapAndEmptyCallsAreNoOps) {
  std::mt19937_64 rng(kSeed + 2);
  const BlockLayout b =
      ComputeBlockLayout(Shape(AttentionKind::kGqa, 2, 8, 4, {DType::kFp16, DType::kInt8}));
  Pair pair;
  ASSERT_NO_FATAL_FAILURE(MakePair(8, b.block_bytes, rng, &pair));
  const std::vector<int32_t> table = {3, 1};
  const PayloadLayout pl = PayloadLayout::Make(b, 0, 2, 6);
  std::vector<uint8_t> payload(pl.total_bytes);
  PayloadJob j = MakeJob(b, pl, *pair.host, table, 0, std::nullopt);  // the other pool
  EXPECT_EQ(pair.cuda->WritePayload(j, payload.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pair.cuda->ReadPayload(j, payload.data()).code(), absl::StatusCode::kInvalidArgument);
  const PayloadLayout empty = PayloadLayout::Make(b, 0, 2, 0);
  j = MakeJob(b, empty, *pair.cuda, table, 0, std::nullopt);
  KVBANK_ASSERT_OK(pair.cuda->WritePayload(j, payload.data()));
  KVBANK_ASSERT_OK(pair.cuda->ReadPayload(j, payload.data()));
  KVBANK_ASSERT_OK(pair.cuda->CopyBlocks({}, {}, b.block_bytes));
  KVBANK_ASSERT_OK(pair.cuda->CopyRows(b, {}));
  const int32_t one[] = {1};
  EXPECT_EQ(pair.cuda->CopyBlocks(one, {}, b.block_bytes).code(),
            absl::StatusCode::kInvalidArgument);
  pair.ExpectSamePools("after calls that move nothing");
}

TEST_F(GpuPoolMemoryTest, CopyBlocksMatchesHostStaged) {
  std::mt19937_64 rng(kSeed + 3);
  for (uint32_t bt : {1u, 3u, 17u}) {
    const std::vector<DType> mixed(std::begin(kMixed), std::end(kMixed));
    const BlockLayout b = ComputeBlockLayout(Shape(AttentionKind::kGqa, 3, 72, bt, mixed));
    const uint64_t num_blocks = 41;
    Pair pair;
    ASSERT_NO_FATAL_FAILURE(MakePair(num_blocks, b.block_bytes, rng, &pair));
    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (size_t n : {size_t{1}, size_t{7}, size_t{20}}) {
      const std::vector<int32_t> src(ids.begin(), ids.begin() + n);
      const std::vector<int32_t> dst(ids.begin() + 20, ids.begin() + 20 + n);
      KVBANK_ASSERT_OK(pair.cuda->CopyBlocks(src, dst, b.block_bytes));
      KVBANK_ASSERT_OK(pair.host->CopyBlocks(src, dst, b.block_bytes));
      pair.ExpectSamePools("bt " + std::to_string(bt) + ": " + std::to_string(n) + " blocks");
      std::shuffle(ids.begin(), ids.end(), rng);
    }
  }
}

TEST_F(GpuPoolMemoryTest, CopyRowsMatchesHostStaged) {
  std::mt19937_64 rng(kSeed + 4);
  for (uint32_t bt : {1u, 3u, 7u, 17u}) {
    for (const ModelLayout& m :
         {Shape(AttentionKind::kGqa, 3, 72, bt,
                std::vector<DType>(std::begin(kMixed), std::end(kMixed))),
          Shape(AttentionKind::kMla, 1, 576, bt, {DType::kBf16, DType::kInt8, DType::kFp8E4M3})}) {
      const BlockLayout b = ComputeBlockLayout(m);
      const uint32_t num_blocks = 24;
      Pair pair;
      ASSERT_NO_FATAL_FAILURE(MakePair(num_blocks, b.block_bytes, rng, &pair));
      std::vector<int32_t> ids(num_blocks);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      // Sources: ids [0, 8); destinations: ids [8, 24). Every destination block takes all its
      // rows from one source block (what fp8 scales need: one scale per block).
      std::vector<kernels::RowCopy> copies;
      for (uint32_t d = 8; d < num_blocks; ++d) {
        const int32_t src = ids[rng() % 8];
        for (uint32_t layer = 0; layer < b.num_layers(); ++layer) {
          for (uint32_t row = 0; row < bt; ++row) {
            if (rng() % 3 == 0) continue;
            kernels::RowCopy c;
            c.src_block = src;
            c.dst_block = ids[d];
            c.src_row = static_cast<uint32_t>(rng() % bt);
            c.dst_row = row;
            c.layer = layer;
            copies.push_back(c);
          }
        }
      }
      std::shuffle(copies.begin(), copies.end(), rng);
      KVBANK_ASSERT_OK(pair.cuda->CopyRows(b, copies));
      KVBANK_ASSERT_OK(pair.host->CopyRows(b, copies));
      pair.ExpectSamePools(LayoutFingerprint(m) + ": " + std::to_string(copies.size()) +
                           " row copies");
    }
  }
}

// Several threads at once, each on its own blocks, staged: every round trip exact, and the pool
// what the same calls made of a host-staged pool.
TEST_F(GpuPoolMemoryTest, ConcurrentCallersOnDisjointBlocks) {
  std::mt19937_64 rng(kSeed + 5);
  const BlockLayout b = ComputeBlockLayout(
      Shape(AttentionKind::kGqa, 4, 64, 16, {DType::kFp16, DType::kInt8, DType::kFp8E4M3}));
  constexpr int kThreads = 4, kRounds = 6;
  constexpr uint64_t kBlocksEach = 6, kTokens = kBlocksEach * 16 - 5;
  Pair pair;
  ASSERT_NO_FATAL_FAILURE(MakePair(kThreads * kBlocksEach, b.block_bytes, rng, &pair));
  std::vector<int32_t> ids(kThreads * kBlocksEach);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<std::vector<int32_t>> tables(kThreads);
  std::vector<std::vector<std::vector<uint8_t>>> payloads(kThreads);
  const PayloadLayout pl = PayloadLayout::Make(b, 0, b.num_layers(), kTokens, DType::kFp32);
  for (int t = 0; t < kThreads; ++t) {
    tables[t].assign(ids.begin() + t * kBlocksEach, ids.begin() + (t + 1) * kBlocksEach);
    for (int r = 0; r < kRounds; ++r)
      payloads[t].push_back(WireValues(rng, DType::kFp32, pl.total_bytes / 4));
  }
  std::vector<std::string> errors(kThreads);
  std::vector<std::vector<uint8_t>> last_read(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const PayloadJob j = MakeJob(b, pl, *pair.cuda, tables[t], 0, DType::kFp32);
      for (int r = 0; r < kRounds; ++r) {
        absl::StatusOr<std::unique_ptr<StagingBuffer>> s = pair.cuda->Stage(pl.total_bytes);
        if (!s.ok()) {
          errors[t] = s.status().ToString();
          return;
        }
        std::memcpy((*s)->data(), payloads[t][r].data(), pl.total_bytes);
        absl::Status st = pair.cuda->WritePayload(j, (*s)->data());
        if (st.ok()) st = pair.cuda->ReadPayload(j, (*s)->data());
        if (!st.ok()) {
          errors[t] = st.ToString();
          return;
        }
        last_read[t].assign((*s)->data(), (*s)->data() + pl.total_bytes);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(errors[t], "") << "thread " << t;
    const PayloadJob j = MakeJob(b, pl, *pair.host, tables[t], 0, DType::kFp32);
    for (int r = 0; r < kRounds; ++r) {
      KVBANK_ASSERT_OK(pair.host->WritePayload(j, payloads[t][r].data()));
    }
    std::vector<uint8_t> want(pl.total_bytes);
    KVBANK_ASSERT_OK(pair.host->ReadPayload(j, want.data()));
    ExpectSameBytes(last_read[t], want, ~uint64_t{0}, "thread " + std::to_string(t));
  }
  pair.ExpectSamePools("after the concurrent calls");
}

// Decode attention through both memories over the same pool: outputs, lse and token
// probabilities within 1e-4 (relative) of the CPU kernel's.
class GpuPoolMemoryAttendTest : public GpuPoolMemoryTest {
 protected:
  void CheckCase(const kernels::testing::AttnCase& c, uint64_t seed) {
    using kernels::testing::AttnOutputs;
    const kernels::testing::AttnBatch batch = kernels::testing::MakeBatch(c, seed);
    const std::string what = c.Name() + " seed " + std::to_string(seed);
    SCOPED_TRACE(what);
    std::mt19937_64 rng(seed);
    Pair pair;
    ASSERT_NO_FATAL_FAILURE(MakePair(batch.num_blocks, batch.layout.block_bytes, rng, &pair));
    SetPool(*pair.cuda, batch.pool);
    SetPool(*pair.host, batch.pool);
    const uint32_t max_length = *std::max_element(c.lengths.begin(), c.lengths.end());

    AttnOutputs ref, got;
    kernels::testing::AllocOutputs(c, true, &ref);
    kernels::testing::AllocOutputs(c, true, &got);
    kernels::DecodeAttentionParams pr = kernels::testing::HostParams(c, batch, &ref);
    pr.kv.pool = pair.host->base();
    ASSERT_EQ(kernels::ValidateDecodeAttention(pr), "");
    KVBANK_ASSERT_OK(pair.host->Attend(pr, max_length, 0));
    kernels::DecodeAttentionParams pg = kernels::testing::HostParams(c, batch, &got);
    pg.kv.pool = pair.cuda->base();
    KVBANK_ASSERT_OK(pair.cuda->Attend(pg, max_length, 0));
    kernels::testing::Tolerance tol;
    tol.out_rel = tol.lse_abs = tol.prob_abs = 1e-4;
    kernels::testing::ExpectMatches(c, got, ref, tol, what);
    if (::testing::Test::HasFatalFailure()) return;

    // Without token probabilities, and with them for some items only: the rest is untouched.
    AttnOutputs none;
    kernels::testing::AllocOutputs(c, false, &none);
    kernels::DecodeAttentionParams pn = kernels::testing::HostParams(c, batch, &none);
    pn.kv.pool = pair.cuda->base();
    KVBANK_ASSERT_OK(pair.cuda->Attend(pn, max_length, 0));
    EXPECT_EQ(none.lse.size(), got.lse.size());
    for (size_t i = 0; i < none.lse.size(); ++i) {
      const float a = none.lse[i], g = got.lse[i];
      EXPECT_TRUE(a == g || std::fabs(a - g) <= 1e-4 * std::max(1.0f, std::fabs(g)))
          << "lse " << i << ": " << a << " vs " << g;
    }
    AttnOutputs some;
    kernels::testing::AllocOutputs(c, true, &some);
    for (size_t i = 1; i < some.probs_ptrs.size(); i += 2) some.probs_ptrs[i] = nullptr;
    kernels::DecodeAttentionParams ps = kernels::testing::HostParams(c, batch, &some);
    ps.kv.pool = pair.cuda->base();
    KVBANK_ASSERT_OK(pair.cuda->Attend(ps, max_length, 0));
    for (size_t i = 0; i < some.probs.size(); ++i) {
      for (size_t t = 0; t < some.probs[i].size(); ++t) {
        const float g = some.probs[i][t], r = ref.probs[i][t];
        if (i % 2 == 1) {
          ASSERT_EQ(g, -7.0f) << "item " << i << " token " << t << ": not asked for";
        } else {
          ASSERT_LE(std::fabs(double(g) - r), 1e-4 * std::max(1.0, double(r)))
              << "item " << i << " token " << t << ": " << g << " vs " << r;
        }
      }
    }
    pair.ExpectSamePools("attention reads only");
  }
};

TEST_F(GpuPoolMemoryAttendTest, SweepMatchesCpu) {
  kernels::testing::ForEachSweepCase(
      kSeed + 100, [&](const kernels::testing::AttnCase& c, uint64_t seed) { CheckCase(c, seed); });
}

TEST_F(GpuPoolMemoryAttendTest, WindowsMixedLayersEmptyItemsAndMlaMatchCpu) {
  uint64_t seed = kSeed + 1000;
  kernels::testing::AttnCase c;
  c.lengths = {0, 5, 33, 0, 1000, 17};
  c.mixed = true;
  c.dtype = DType::kInt8;
  c.dtype0 = DType::kFp8E4M3;
  c.block_tokens = 7;
  ASSERT_NO_FATAL_FAILURE(CheckCase(c, ++seed));
  c.window = 64;
  c.sinks = 4;
  ASSERT_NO_FATAL_FAILURE(CheckCase(c, ++seed));
  kernels::testing::AttnCase mla;
  mla.mla = true;
  mla.head_dim = 576;
  mla.head_dim_v = 512;
  mla.num_q_heads = 16;
  mla.num_kv_heads = 1;
  mla.block_tokens = 17;
  for (DType d : {DType::kBf16, DType::kInt8, DType::kFp8E4M3}) {
    mla.dtype = d;
    ASSERT_NO_FATAL_FAILURE(CheckCase(mla, ++seed));
  }
}

}  // namespace
}  // namespace kvbank
