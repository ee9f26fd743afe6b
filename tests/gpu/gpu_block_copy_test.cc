// CUDA copy kernels against the CPU ones, bit for bit: payload scatter and gather on a device
// pool through a shuffled block table (odd shapes, partial windows, unaligned buffers) and
// whole-block copies. Skips itself where no CUDA device is present. Needs neither Abseil nor the
// core: the kernels and the layout function only.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/block_copy.h"
#include "kernels/block_copy_cuda.h"
#include "kvbank/layout.h"
#include "tests/gpu/gpu_testing.h"

namespace kvbank::kernels {
namespace {

constexpr uint64_t kSeed = 424242;

class GpuBlockCopyTest : public ::testing::Test {
 protected:
  void SetUp() override { KVBANK_SKIP_WITHOUT_CUDA(kSeed); }
  void TearDown() override {
    for (void* p : allocations_) cudaFree(p);
  }
  template <typename T>
  T* Device(const std::vector<T>& host, size_t extra_bytes = 0) {
    void* p = nullptr;
    const size_t bytes = host.size() * sizeof(T) + extra_bytes;
    EXPECT_EQ(cudaMalloc(&p, bytes == 0 ? 1 : bytes), cudaSuccess);
    allocations_.push_back(p);
    if (!host.empty()) {
      EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    return static_cast<T*>(p);
  }
  std::vector<void*> allocations_;
};

ModelLayout Shape(AttentionKind kind, uint32_t kv_heads, uint32_t head_dim, uint32_t block_tokens,
                  std::vector<DType> dtypes) {
  ModelLayout m;
  m.name = "gpu";
  m.kind = kind;
  m.num_layers = static_cast<uint32_t>(dtypes.size());
  m.num_kv_heads = kv_heads;
  m.num_q_heads = kv_heads * 2;
  m.head_dim = m.head_dim_v = head_dim;
  m.block_tokens = block_tokens;
  if (kind == AttentionKind::kMla) {
    m.rope_dim = head_dim / 9;
    m.kv_lora_rank = head_dim - m.rope_dim;
    m.head_dim_v = m.kv_lora_rank;
  }
  m.layer_dtypes = std::move(dtypes);
  return m;
}

std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, uint64_t n) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

struct Case {
  ModelLayout layout;
  uint32_t l0, l1;
  uint64_t pos, n;
};

TEST_F(GpuBlockCopyTest, PayloadScatterGatherMatchesCpu) {
  std::mt19937_64 rng(kSeed);
  std::vector<Case> cases;
  const std::vector<DType> mixed = {DType::kFp16, DType::kBf16, DType::kFp32, DType::kInt8};
  for (uint32_t bt : {1u, 3u, 7u, 16u, 17u}) {
    for (uint32_t hd : {1u, 3u, 72u, 128u}) {
      cases.push_back({Shape(AttentionKind::kGqa, 3, hd, bt, mixed), 0, 4, 0, 3 * bt + 2});
      cases.push_back({Shape(AttentionKind::kGqa, 8, hd, bt, mixed), 1, 3, bt + 1, 2 * bt});
    }
    cases.push_back(
        {Shape(AttentionKind::kMla, 1, 576, bt, {DType::kBf16, DType::kBf16}), 0, 2, bt / 2, 40});
  }
  for (const Case& c : cases) {
    ASSERT_EQ(ValidateLayout(c.layout), "");
    SCOPED_TRACE(LayoutFingerprint(c.layout) + " pos=" + std::to_string(c.pos) +
                 " n=" + std::to_string(c.n));
    const BlockLayout b = ComputeBlockLayout(c.layout);
    const uint64_t logical = (c.pos + c.n + b.block_tokens - 1) / b.block_tokens;
    const uint64_t physical = logical + 5;
    std::vector<int32_t> table(physical);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    table.resize(logical);
    const PayloadLayout pl = PayloadLayout::Make(b, c.l0, c.l1, c.n);
    std::vector<LayerView> views(b.layers.begin() + c.l0, b.layers.begin() + c.l1);

    std::vector<uint8_t> host_pool = RandomBytes(rng, physical * b.block_bytes);
    const std::vector<uint8_t> payload = RandomBytes(rng, pl.total_bytes);
    PayloadMap hmap;
    hmap.pool = host_pool.data();
    hmap.block_bytes = b.block_bytes;
    hmap.layers = views.data();
    hmap.layer_offset = pl.layer_offset.data();
    hmap.num_layers = c.l1 - c.l0;
    hmap.block_table = table.data();
    hmap.token_begin = c.pos;
    hmap.num_tokens = c.n;
    hmap.total_bytes = pl.total_bytes;
    PayloadMap dmap = hmap;
    dmap.pool = Device(host_pool);
    dmap.layers = Device(views);
    dmap.layer_offset = Device(pl.layer_offset);
    dmap.block_table = Device(table);
    // One spare byte so the payload can sit at an odd address too.
    uint8_t* dpayload = Device(payload, 1);
    uint8_t* dodd = dpayload + 1;
    CUDA_OK(cudaMemcpy(dodd, payload.data(), payload.size(), cudaMemcpyHostToDevice));

    // Scatter in chunks of varying size from an unaligned device buffer, then whole.
    for (uint64_t off = 0; off < payload.size();) {
      const uint64_t len = std::min<uint64_t>(1 + rng() % 5000, payload.size() - off);
      PayloadCopyCpu(hmap, CopyDirection::kPayloadToPool, off,
                     const_cast<uint8_t*>(payload.data()) + off, len);
      CUDA_OK(PayloadCopyCuda(dmap, CopyDirection::kPayloadToPool, off, dodd + off, len, 0));
      off += len;
    }
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> got(host_pool.size());
    CUDA_OK(cudaMemcpy(got.data(), dmap.pool, got.size(), cudaMemcpyDeviceToHost));
    ASSERT_TRUE(got == host_pool) << "device scatter differs from the CPU scatter";

    // Gather the whole payload (aligned buffer) and random windows (offset/len) of it.
    CUDA_OK(cudaMemset(dpayload, 0xEE, payload.size() + 1));
    CUDA_OK(PayloadCopyCuda(dmap, CopyDirection::kPoolToPayload, 0, dpayload, payload.size(), 0));
    std::vector<uint8_t> back(payload.size());
    CUDA_OK(cudaMemcpy(back.data(), dpayload, back.size(), cudaMemcpyDeviceToHost));
    ASSERT_TRUE(back == payload) << "device gather does not return the payload";
    for (int w = 0; w < 8; ++w) {
      const uint64_t off = rng() % payload.size();
      const uint64_t len = 1 + rng() % (payload.size() - off);
      const uint64_t shift = w % 2;  // odd device addresses on every other window
      CUDA_OK(cudaMemset(dpayload, 0xEE, payload.size() + 1));
      CUDA_OK(PayloadCopyCuda(dmap, CopyDirection::kPoolToPayload, off, dpayload + shift, len, 0));
      std::vector<uint8_t> dev(len + 1 - shift), cpu(len, 0);
      CUDA_OK(cudaMemcpy(dev.data(), dpayload + shift, dev.size(), cudaMemcpyDeviceToHost));
      PayloadCopyCpu(hmap, CopyDirection::kPoolToPayload, off, cpu.data(), len);
      ASSERT_TRUE(std::equal(cpu.begin(), cpu.end(), dev.begin()))
          << "window [" << off << ", " << off + len << ") differs";
      if (shift == 0) {
        ASSERT_EQ(dev[len], 0xEE) << "wrote past the window";
      }
    }
    for (void* p : allocations_) cudaFree(p);
    allocations_.clear();
  }
}

TEST_F(GpuBlockCopyTest, CopyBlocksMatchesCpu) {
  std::mt19937_64 rng(kSeed + 1);
  for (uint32_t bt : {1u, 3u, 16u, 17u}) {
    const BlockLayout b = ComputeBlockLayout(
        Shape(AttentionKind::kGqa, 3, 72, bt, {DType::kFp16, DType::kInt8, DType::kFp8E4M3}));
    const int32_t blocks = 97;
    std::vector<uint8_t> host = RandomBytes(rng, blocks * b.block_bytes);
    std::vector<int32_t> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    // Disjoint sources and destinations, as the store issues them.
    const std::vector<int32_t> src(ids.begin(), ids.begin() + 40),
        dst(ids.begin() + 40, ids.begin() + 80);
    uint8_t* dpool = Device(host);
    CUDA_OK(CopyBlocksCuda(dpool, b.block_bytes, Device(src), Device(dst), src.size(), 0));
    CUDA_OK(CopyBlocksCuda(dpool, b.block_bytes, nullptr, nullptr, 0, 0));
    CopyBlocksCpu(host.data(), b.block_bytes, src.data(), dst.data(), src.size());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> got(host.size());
    CUDA_OK(cudaMemcpy(got.data(), dpool, got.size(), cudaMemcpyDeviceToHost));
    ASSERT_TRUE(got == host) << "bt=" << bt;
  }
}

}  // namespace
}  // namespace kvbank::kernels
