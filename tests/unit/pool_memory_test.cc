// PoolMemory: --device spellings, host memory, and the host-staged kind's calls against the CPU
// kernels they stand for (the calls the cuda:N memory implements with CUDA kernels).
#include "server/core/pool_memory.h"

#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/block_copy.h"
#include "kernels/payload_codec.h"
#include "kvbank/layout.h"
#include "server/core/cuda_memory.h"

namespace kvbank {
namespace {

using absl::StatusCode;

TEST(ResolveDeviceTest, Spellings) {
  EXPECT_EQ(ResolveDevice("host")->kind, MemoryKind::kHost);
  EXPECT_EQ(ResolveDevice("cpu")->kind, MemoryKind::kHost);
  EXPECT_EQ(ResolveDevice("host-staged")->kind, MemoryKind::kHostStaged);
  EXPECT_EQ(ResolveDevice("host-staged")->Name(), "host-staged");
  // auto: a GPU when one is visible, else host.
  auto a = ResolveDevice("auto");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->kind, CudaDeviceCount() > 0 ? MemoryKind::kCuda : MemoryKind::kHost);
  if (a->kind == MemoryKind::kCuda) {
    EXPECT_EQ(a->Name(), "cuda:0");
  }

  for (const char* bad : {"", "gpu", "tpu:0", "CUDA", "host-staged2"}) {
    auto d = ResolveDevice(bad);
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(d.status().message().find("expected auto, host"), std::string::npos) << d.status();
  }
  for (const char* bad : {"cuda:", "cuda:x", "cuda:1x"}) {
    EXPECT_EQ(ResolveDevice(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
  // A device that is not there: FAILED_PRECONDITION naming it (built without CUDA: saying so).
  auto missing = ResolveDevice("cuda:4096");
  EXPECT_EQ(missing.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(missing.status().message().find("cuda:4096"), std::string::npos) << missing.status();
  if (CudaDeviceCount() == 0) {
    EXPECT_EQ(ResolveDevice("cuda").status().code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(CreateCudaMemory(0, 1 << 20).status().code(), StatusCode::kFailedPrecondition);
  }
}

TEST(HostMemoryTest, KindsAndStaging) {
  auto host = CreateHostMemory(1 << 20, /*prefault=*/true);
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ((*host)->kind(), MemoryKind::kHost);
  EXPECT_EQ((*host)->name(), "host");
  EXPECT_EQ((*host)->bytes(), 1u << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*host)->base()) % BlockLayout::kBlockAlign, 0u);
  EXPECT_EQ(CreateHostMemory(0, false).status().code(), StatusCode::kInvalidArgument);

  auto staged = CreateHostMemory(1 << 20, /*prefault=*/false, /*staged=*/true);
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ((*staged)->kind(), MemoryKind::kHostStaged);
  // A released staging buffer serves the next transfer of a similar size.
  uint8_t* first = nullptr;
  {
    auto b = (*staged)->Stage(3 << 20);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ((*b)->size(), 3u << 20);
    std::memset((*b)->data(), 7, (*b)->size());  // all of it is writable
    first = (*b)->data();
  }
  auto again = (*staged)->Stage((3 << 20) - 100);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->data(), first);
  auto zero = (*staged)->Stage(0);
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ((*zero)->size(), 0u);
}

// WritePayload / ReadPayload / CopyBlocks / CopyRows of the host-staged memory do what the CPU
// kernels do on a copy of the same pool.
TEST(HostMemoryTest, StagedCallsMatchTheCpuKernels) {
  ModelLayout m;
  m.name = "t";
  m.num_layers = 3;
  m.num_q_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 8;
  m.head_dim_v = 8;
  m.block_tokens = 4;
  m.input_dtype = DType::kFp16;
  m.layer_dtypes = {DType::kFp16, DType::kInt8, DType::kFp8E4M3};
  const BlockLayout b = ComputeBlockLayout(m);
  const uint64_t blocks = 8;
  auto mem = CreateHostMemory(blocks * b.block_bytes, true, /*staged=*/true);
  ASSERT_TRUE(mem.ok());
  std::vector<uint8_t> expect(blocks * b.block_bytes, 0);
  std::memset((*mem)->base(), 0, expect.size());

  const std::vector<int32_t> table = {5, 2, 7};
  const uint64_t n = 10, begin = 1;  // tokens [1, 11): blocks 0..2, starting mid-block
  const PayloadLayout p = PayloadLayout::Make(b, 0, m.num_layers, n, DType::kFp32);
  std::vector<uint8_t> payload(p.total_bytes);
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0.f, 1.f);
  for (uint64_t i = 0; i + 4 <= payload.size(); i += 4) {
    const float x = g(rng);
    std::memcpy(payload.data() + i, &x, 4);
  }
  PayloadJob job;
  job.map.pool = (*mem)->base();
  job.map.block_bytes = b.block_bytes;
  job.map.layers = b.layers.data();
  job.map.layer_offset = p.layer_offset.data();
  job.map.num_layers = m.num_layers;
  job.map.block_table = table.data();
  job.map.token_begin = begin;
  job.map.num_tokens = n;
  job.map.total_bytes = p.total_bytes;
  job.convert = DType::kFp32;
  ASSERT_TRUE((*mem)->WritePayload(job, payload.data()).ok());
  kernels::PayloadMap cpu = job.map;
  cpu.pool = expect.data();
  kernels::EncodePayloadCpu(cpu, DType::kFp32, payload.data());
  ASSERT_EQ(std::memcmp((*mem)->base(), expect.data(), expect.size()), 0);

  std::vector<uint8_t> back(p.total_bytes, 0xee), back_cpu(p.total_bytes, 0xdd);
  ASSERT_TRUE((*mem)->ReadPayload(job, back.data()).ok());
  kernels::DecodePayloadCpu(cpu, DType::kFp32, back_cpu.data());
  EXPECT_EQ(back, back_cpu);

  const std::vector<int32_t> src = {5, 2}, dst = {0, 1};
  ASSERT_TRUE((*mem)->CopyBlocks(src, dst, b.block_bytes).ok());
  kernels::CopyBlocksCpu(expect.data(), b.block_bytes, src.data(), dst.data(), src.size());
  EXPECT_EQ(std::memcmp((*mem)->base(), expect.data(), expect.size()), 0);

  std::vector<kernels::RowCopy> rows;
  for (uint32_t l = 0; l < 2; ++l) rows.push_back({7, 3, 1, 2, l});  // not the fp8 layer
  ASSERT_TRUE((*mem)->CopyRows(b, rows).ok());
  kernels::CopyRowsCpu(expect.data(), b.block_bytes, b.layers.data(), rows.data(), rows.size());
  EXPECT_EQ(std::memcmp((*mem)->base(), expect.data(), expect.size()), 0);
}

}  // namespace
}  // namespace kvbank
