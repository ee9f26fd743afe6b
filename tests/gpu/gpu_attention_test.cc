// CUDA decode attention against the CPU reference on the cases of the CPU test: every storage
// dtype, odd block sizes, GQA / MQA / MLA, odd and long lengths (the split and merge path),
// mixed-dtype batches with empty items, sliding windows with sinks, and the per-token probability
// sums; then the kernel's own paths (one split, wide GQA groups, odd and wide head dims). Skips
// itself where no CUDA device is present. Needs neither Abseil nor the core.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/attention_cuda.h"
#include "kvbank/layout.h"
#include "tests/gpu/gpu_testing.h"
#include "tests/unit/attention_testing.h"

namespace kvbank::kernels {
namespace {

using testing::AllocOutputs;
using testing::AttnBatch;
using testing::AttnCase;
using testing::AttnOutputs;
using testing::ExpectMatches;
using testing::HostParams;
using testing::MakeBatch;
using testing::Tolerance;

constexpr uint64_t kSeed = 5105001;
using testing::ForEachSweepCase;
constexpr const auto& kAll = testing::kAllDTypes;

class GpuAttentionTest : public ::testing::Test {
 protected:
  void SetUp() override { KVBANK_SKIP_WITHOUT_CUDA(kSeed); }
  void TearDown() override {
    for (void* p : allocations_) cudaFree(p);
    allocations_.clear();
  }
  template <typename T>
  T* Device(const std::vector<T>& host) {
    void* p = nullptr;
    const size_t bytes = host.size() * sizeof(T);
    EXPECT_EQ(cudaMalloc(&p, bytes == 0 ? 1 : bytes), cudaSuccess);
    allocations_.push_back(p);
    if (bytes != 0) {
      EXPECT_EQ(cudaMemcpy(p, host.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
    }
    return static_cast<T*>(p);
  }
  template <typename T>
  void Back(const T* dev, std::vector<T>* host) {
    ASSERT_EQ(cudaMemcpy(host->data(), dev, host->size() * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
  }

  // Reference on the host, the CUDA kernel on a device copy; compares the two.
  void CheckCase(const AttnCase& c, uint64_t seed) {
    const AttnBatch b = MakeBatch(c, seed);
    const std::string what = c.Name() + " seed " + std::to_string(seed);
    AttnOutputs ref, got;
    AllocOutputs(c, true, &ref);
    AllocOutputs(c, true, &got);
    DecodeAttentionParams pr = HostParams(c, b, &ref);
    ASSERT_EQ(ValidateDecodeAttention(pr), "") << what;
    DecodeAttentionReference(pr);

    DecodeAttentionParams pd = HostParams(c, b, &got);
    pd.kv.pool = Device(b.pool);
    pd.kv.layers = Device(b.layers);
    pd.kv.indptr = Device(b.indptr);
    pd.kv.indices = Device(b.indices);
    pd.kv.lengths = Device(b.lengths);
    pd.q = Device(b.q);
    float* d_out = Device(got.out);
    float* d_lse = Device(got.lse);
    pd.out = d_out;
    pd.lse = d_lse;
    std::vector<float*> d_probs;
    for (const auto& v : got.probs) d_probs.push_back(Device(v));
    pd.token_probs = Device(d_probs);
    uint32_t max_len = 0;
    for (uint32_t len : c.lengths) max_len = std::max(max_len, len);
    const size_t ws_bytes = DecodeAttentionWorkspaceBytes(pd, max_len);
    ASSERT_GT(ws_bytes, 0u) << what;
    uint8_t* ws = Device(std::vector<uint8_t>(ws_bytes));
    CUDA_OK(DecodeAttentionCuda(pd, max_len, ws, ws_bytes, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    Back(d_out, &got.out);
    Back(d_lse, &got.lse);
    for (size_t i = 0; i < got.probs.size(); ++i) Back(d_probs[i], &got.probs[i]);
    Tolerance tol;
    tol.out_rel = tol.lse_abs = tol.prob_abs = 5e-5;  // __expf, a different summation order
    ExpectMatches(c, got, ref, tol, what);
    TearDown();
  }

  std::vector<void*> allocations_;
};

TEST_F(GpuAttentionTest, SweepDtypesBlockSizesHeads) {
  ForEachSweepCase(kSeed, [&](const AttnCase& c, uint64_t seed) { CheckCase(c, seed); });
}

TEST_F(GpuAttentionTest, MlaWithManyQHeads) {
  uint64_t seed = kSeed + 1000;
  for (DType d : kAll) {
    for (uint32_t hq : {16u, 20u}) {  // 20: a partial q-head tile
      AttnCase c;
      c.dtype = d;
      c.mla = true;
      c.head_dim = 576;
      c.head_dim_v = 512;
      c.num_q_heads = hq;
      c.num_kv_heads = 1;
      c.block_tokens = hq == 16 ? 16 : 3;
      CheckCase(c, ++seed);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(GpuAttentionTest, LongContextsSplit) {
  AttnCase c;
  c.dtype = DType::kFp16;
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.lengths = {32768};
  CheckCase(c, kSeed + 2000);
  c.dtype = DType::kInt8;
  c.lengths = {8192, 1, 5000, 0, 8191};
  CheckCase(c, kSeed + 2001);
}

TEST_F(GpuAttentionTest, SlidingWindowMixedAndEmpty) {
  uint64_t seed = kSeed + 3000;
  const uint32_t cfg[][2] = {{1, 0}, {16, 4}, {100, 1}, {999, 1}, {50, 60}, {4096, 4}};
  for (DType d : {DType::kFp16, DType::kInt8, DType::kFp8E4M3}) {
    for (const auto& wc : cfg) {
      AttnCase c;
      c.dtype = d;
      c.block_tokens = 3;
      c.window = wc[0];
      c.sinks = wc[1];
      c.lengths = {1, 2, 17, 100, 1000, 1500};
      CheckCase(c, ++seed);
      if (HasFatalFailure()) return;
    }
  }
  AttnCase c;
  c.mixed = true;
  c.dtype0 = DType::kFp32;
  c.dtype = DType::kFp8E5M2;
  c.lengths = {0, 1000, 17, 0, 3};
  c.block_tokens = 17;
  CheckCase(c, ++seed);
}

// The cases that pick the kernel's other paths: one split (the split kernel writes out and lse
// itself), GQA groups wider than a block's 8 q heads, head dims whose rows are not whole 16-byte
// chunks (byte loads), a V row wider than 512 (one q head per block), and lengths around the
// split and lane-group boundaries.
TEST_F(GpuAttentionTest, OneSplitWideGroupsOddDims) {
  uint64_t seed = kSeed + 4000;
  for (DType d : kAll) {
    AttnCase c;
    c.dtype = d;
    c.lengths = {0, 1, 5, 33, 64};  // max 64: one split
    CheckCase(c, ++seed);
    if (HasFatalFailure()) return;
    c.num_q_heads = 64;  // group 16: two q-head tiles
    c.num_kv_heads = 4;
    c.block_tokens = 7;
    c.lengths = {63, 64, 65, 127, 129, 2047};
    CheckCase(c, ++seed);
    if (HasFatalFailure()) return;
    for (uint32_t dim : {1u, 12u, 36u, 100u, 200u}) {
      c.head_dim = c.head_dim_v = dim;
      c.num_q_heads = 6;
      c.num_kv_heads = 2;
      c.block_tokens = 3;
      c.lengths = {1, 31, 200};
      CheckCase(c, ++seed);
      if (HasFatalFailure()) return;
    }
    c.head_dim = c.head_dim_v = 1024;
    c.num_q_heads = 3;
    c.num_kv_heads = 1;
    c.block_tokens = 5;
    c.lengths = {1, 90};
    CheckCase(c, ++seed);
    if (HasFatalFailure()) return;
  }
}

TEST_F(GpuAttentionTest, RejectsBadScalars) {
  DecodeAttentionParams p;
  p.kv.batch = 1;
  p.num_q_heads = 3;
  p.num_kv_heads = 2;
  EXPECT_EQ(DecodeAttentionCuda(p, 1, nullptr, 0, nullptr), cudaErrorInvalidValue);
  p.kv.batch = 0;
  EXPECT_EQ(DecodeAttentionCuda(p, 1, nullptr, 0, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace kvbank::kernels
