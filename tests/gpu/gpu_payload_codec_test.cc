// CUDA whole-payload codec and copies against the CPU ones, bit for bit: EncodePayloadCuda /
// DecodePayloadCuda vs EncodePayloadCpu / DecodePayloadCpu over the sweep of payload_codec_test
// (int8, fp8, conversions, mixed layers; GQA, MQA, MLA; starts at 0, on a boundary, mid-block
// after an earlier transfer), ScaleCopyCuda vs ScaleCopyCpu on storage-format payloads in odd
// windows, and CopyRowsCuda vs CopyRowsCpu. Skips itself where no CUDA device is present. Needs
// neither Abseil nor the core: the kernels and the layout function only.
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
#include "kernels/payload_codec.h"
#include "kernels/payload_codec_cuda.h"
#include "kvbank/layout.h"
#include "tests/gpu/gpu_testing.h"
#include "tests/unit/payload_codec_testing.h"

namespace kvbank::kernels {
namespace {

using testing::CodecCase;
using testing::CodecCases;
using testing::CodecMap;
using testing::CodecPayload;
using testing::CodecPool;
using testing::CodecShape;
using testing::MakeCodecPool;

constexpr uint64_t kSeed = 777013;

class GpuPayloadCodecTest : public ::testing::Test {
 protected:
  void SetUp() override { KVBANK_SKIP_WITHOUT_CUDA(kSeed); }
  void TearDown() override { FreeAll(); }
  void FreeAll() {
    for (void* p : allocations_) cudaFree(p);
    allocations_.clear();
  }
  template <typename T>
  T* Device(const std::vector<T>& host) {
    void* p = nullptr;
    const size_t bytes = host.size() * sizeof(T);
    EXPECT_EQ(cudaMalloc(&p, bytes == 0 ? 1 : bytes), cudaSuccess);
    allocations_.push_back(p);
    if (!host.empty()) {
      EXPECT_EQ(cudaMemcpy(p, host.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
    }
    return static_cast<T*>(p);
  }
  template <typename T>
  std::vector<T> Host(const T* device, size_t n) {
    std::vector<T> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  std::vector<void*> allocations_;
};

// Index of the first differing byte, or -1.
int64_t FirstDiff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

TEST_F(GpuPayloadCodecTest, EncodeDecodeMatchCpu) {
  std::mt19937_64 rng(kSeed);
  int cases = 0;
  for (const CodecCase& c : CodecCases()) {
    SCOPED_TRACE(c.Describe());
    ASSERT_EQ(ValidateLayout(c.layout), "");
    const CodecPool p = MakeCodecPool(c, rng);
    std::vector<uint8_t> host_pool = p.bytes;
    uint8_t* dpool = Device(p.bytes);
    const std::vector<LayerView> views(p.b.layers.begin() + c.l0, p.b.layers.begin() + c.l1);
    const LayerView* dviews = Device(views);
    const int32_t* dtable = Device(p.table);
    // [0, pos) first when pos > 0 (the mid-block start then uses the scales it set), then
    // [pos, pos + n).
    std::vector<std::pair<uint64_t, uint64_t>> transfers;
    if (c.pos > 0) transfers.push_back({0, c.pos});
    transfers.push_back({c.pos, c.n});
    for (auto [pos, n] : transfers) {
      SCOPED_TRACE("transfer [" + std::to_string(pos) + ", " + std::to_string(pos + n) + ")");
      const PayloadLayout pl = PayloadLayout::Make(p.b, c.l0, c.l1, n, c.wire);
      const std::vector<uint8_t> payload = CodecPayload(p.b, pl, c.wire, rng);
      EncodePayloadCpu(CodecMap(p, pl, pos, host_pool.data(), views.data(), pl.layer_offset.data(),
                                p.table.data()),
                       c.wire, payload.data());
      const PayloadMap dmap = CodecMap(p, pl, pos, dpool, dviews, Device(pl.layer_offset), dtable);
      CUDA_OK(EncodePayloadCuda(dmap, c.wire, Device(payload), 0));
      CUDA_OK(cudaDeviceSynchronize());
      const int64_t at = FirstDiff(Host(dpool, host_pool.size()), host_pool);
      ASSERT_EQ(at, -1) << "device pool differs at block " << at / int64_t(p.b.block_bytes)
                        << " byte " << at % int64_t(p.b.block_bytes);
    }
    for (auto [pos, n] : {std::pair<uint64_t, uint64_t>{c.pos, c.n}, {0, c.pos + c.n}}) {
      SCOPED_TRACE("decode [" + std::to_string(pos) + ", " + std::to_string(pos + n) + ")");
      const PayloadLayout pl = PayloadLayout::Make(p.b, c.l0, c.l1, n, c.wire);
      std::vector<uint8_t> want(pl.total_bytes, 0x5A);
      DecodePayloadCpu(CodecMap(p, pl, pos, host_pool.data(), views.data(), pl.layer_offset.data(),
                                p.table.data()),
                       c.wire, want.data());
      uint8_t* dout = Device(std::vector<uint8_t>(pl.total_bytes, 0xA5));
      const PayloadMap dmap = CodecMap(p, pl, pos, dpool, dviews, Device(pl.layer_offset), dtable);
      CUDA_OK(DecodePayloadCuda(dmap, c.wire, dout, 0));
      CUDA_OK(cudaDeviceSynchronize());
      const int64_t at = FirstDiff(Host(dout, want.size()), want);
      ASSERT_EQ(at, -1) << "device decode differs at payload byte " << at;
    }
    FreeAll();
    ++cases;
  }
  EXPECT_GT(cases, 300);
}

TEST_F(GpuPayloadCodecTest, LaunchContract) {
  PayloadMap m;
  m.num_tokens = 0;
  m.num_layers = 1;
  CUDA_OK(EncodePayloadCuda(m, DType::kFp16, nullptr, 0));
  CUDA_OK(DecodePayloadCuda(m, DType::kFp16, nullptr, 0));
  m.num_tokens = 4;
  EXPECT_EQ(EncodePayloadCuda(m, DType::kInt8, nullptr, 0), cudaErrorInvalidValue);
  EXPECT_EQ(DecodePayloadCuda(m, DType::kFp8E4M3, nullptr, 0), cudaErrorInvalidValue);
  CUDA_OK(ScaleCopyCuda(m, CopyDirection::kPayloadToPool, 0, nullptr, 16, 0));  // no sections
  CUDA_OK(CopyRowsCuda(nullptr, 64, nullptr, nullptr, 0, 0));
}

// Storage-format payloads (MakeStorage): the scale sections moved by ScaleCopyCuda in windows
// that split scales, both directions, against ScaleCopyCpu.
TEST_F(GpuPayloadCodecTest, ScaleCopyMatchesCpu) {
  std::mt19937_64 rng(kSeed + 1);
  const DType i8 = DType::kInt8, e4 = DType::kFp8E4M3, e5 = DType::kFp8E5M2, f16 = DType::kFp16;
  int checked = 0;
  for (uint32_t bt : {1u, 3u, 16u, 17u}) {
    for (const ModelLayout& layout :
         {CodecShape(AttentionKind::kGqa, 3, 5, bt, {f16, i8, e4, e5, i8}),
          CodecShape(AttentionKind::kMla, 1, 9, bt, {i8, e5, f16}),
          CodecShape(AttentionKind::kGqa, 8, 128, bt, {e4, i8})}) {
      ASSERT_EQ(ValidateLayout(layout), "");
      const uint32_t nl = layout.num_layers;
      for (auto [pos, n] : {std::pair<uint64_t, uint64_t>{0, 2 * bt + 1}, {bt / 2 + 1, bt + 4}}) {
        const CodecCase c{"scales", layout, f16, 0, nl, pos, n};
        SCOPED_TRACE(c.Describe());
        const CodecPool p = MakeCodecPool(c, rng);
        const PayloadLayout pl = PayloadLayout::MakeStorage(p.b, 0, nl, pos, n);
        std::vector<uint8_t> host_pool = p.bytes;
        PayloadMap hmap = CodecMap(p, pl, pos, host_pool.data(), p.b.layers.data(),
                                   pl.layer_offset.data(), p.table.data());
        hmap.scale_offset = pl.scale_offset.data();
        hmap.first_block = pl.first_block;
        PayloadMap dmap = CodecMap(p, pl, pos, Device(p.bytes), Device(p.b.layers),
                                   Device(pl.layer_offset), Device(p.table));
        dmap.scale_offset = Device(pl.scale_offset);
        dmap.first_block = pl.first_block;

        // Scatter in windows of 1 .. 40 bytes (most split a scale or a row).
        std::vector<uint8_t> payload(pl.total_bytes);
        for (auto& x : payload) x = static_cast<uint8_t>(rng());
        uint8_t* dpayload = Device(payload);
        for (uint64_t off = 0; off < payload.size();) {
          const uint64_t len = std::min<uint64_t>(1 + rng() % 40, payload.size() - off);
          ScaleCopyCpu(hmap, CopyDirection::kPayloadToPool, off, payload.data() + off, len);
          CUDA_OK(ScaleCopyCuda(dmap, CopyDirection::kPayloadToPool, off, dpayload + off, len, 0));
          off += len;
        }
        CUDA_OK(cudaDeviceSynchronize());
        const int64_t at = FirstDiff(Host(dmap.pool, host_pool.size()), host_pool);
        ASSERT_EQ(at, -1) << "device scatter differs at pool byte " << at;

        // Gather the whole payload and random windows into sentinel-filled buffers.
        for (int w = 0; w < 9; ++w) {
          const uint64_t off = w == 0 ? 0 : rng() % payload.size();
          const uint64_t len = w == 0 ? payload.size() : 1 + rng() % (payload.size() - off);
          std::vector<uint8_t> want(len, 0xEE);
          ScaleCopyCpu(hmap, CopyDirection::kPoolToPayload, off, want.data(), len);
          uint8_t* dbuf = Device(std::vector<uint8_t>(len, 0xEE));
          CUDA_OK(ScaleCopyCuda(dmap, CopyDirection::kPoolToPayload, off, dbuf, len, 0));
          CUDA_OK(cudaDeviceSynchronize());
          const int64_t bad = FirstDiff(Host(dbuf, len), want);
          ASSERT_EQ(bad, -1) << "window [" << off << ", " << off + len << ") differs at " << bad;
        }
        FreeAll();
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 4 * 3 * 2);
}

TEST_F(GpuPayloadCodecTest, CopyRowsMatchesCpu) {
  std::mt19937_64 rng(kSeed + 2);
  const std::vector<DType> all = {DType::kFp16, DType::kInt8, DType::kFp8E5M2,
                                  DType::kFp32, DType::kBf16, DType::kFp8E4M3};
  for (uint32_t bt : {1u, 3u, 7u, 16u, 17u}) {
    for (const ModelLayout& m : {CodecShape(AttentionKind::kGqa, 3, 3, bt, all),
                                 CodecShape(AttentionKind::kGqa, 8, 128, bt, all),
                                 CodecShape(AttentionKind::kMqa, 1, 72, bt, all),
                                 CodecShape(AttentionKind::kMla, 1, 576, bt, all)}) {
      ASSERT_EQ(ValidateLayout(m), "");
      SCOPED_TRACE(LayoutFingerprint(m));
      const BlockLayout b = ComputeBlockLayout(m);
      const int32_t blocks = 9;
      std::vector<uint8_t> host(blocks * b.block_bytes);
      for (auto& x : host) x = static_cast<uint8_t>(rng());
      uint8_t* dpool = Device(host);
      const LayerView* dlayers = Device(b.layers);
      std::vector<uint32_t> rows(b.num_layers());
      for (uint32_t& r : rows) r = static_cast<uint32_t>(rng() % (bt + 1));
      for (const std::vector<RowCopy>& copies :
           {testing::PermutationCopies(b, blocks, rng), testing::ForkCopies(b, rows, 0, 8)}) {
        CopyRowsCpu(host.data(), b.block_bytes, b.layers.data(), copies.data(), copies.size());
        CUDA_OK(CopyRowsCuda(dpool, b.block_bytes, dlayers, Device(copies), copies.size(), 0));
        CUDA_OK(cudaDeviceSynchronize());
        const int64_t at = FirstDiff(Host(dpool, host.size()), host);
        ASSERT_EQ(at, -1) << "device pool differs at block " << at / int64_t(b.block_bytes)
                          << " byte " << at % int64_t(b.block_bytes) << " (" << copies.size()
                          << " copies)";
      }
      FreeAll();
    }
  }
}

}  // namespace
}  // namespace kvbank::kernels
