// Payloads already on the GPU (what the NCCL plane receives and sends) through a cuda:0 store
// (AppendTxn::WriteFromDevice, FetchReader::ReadToDevice: PoolMemory::WritePayloadFromDevice /
// ReadPayloadToDevice, no host copy) against the same payloads through a host-staged store's
// host path: the same bytes back, fp16 bit-exact and int8 (codes, scales, dequantized)
// identical, over several staging pieces and partial blocks; a NaN / Inf payload refused by the
// device scan naming the same element as the host check, nothing stored. Needs no NCCL. Skips
// itself where no CUDA device is present. Fixed seed, printed.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "server/core/block_pool.h"
#include "server/core/sequence_store.h"
#include "tests/gpu/gpu_testing.h"
#include "tests/unit/store_testing.h"

namespace kvbank {
namespace {

constexpr uint64_t kSeed = 9917;

using store_testing::ExpectBytes;
using store_testing::Fp16PayloadBytes;
using store_testing::MakeAppend;
using store_testing::MakeFetch;
using store_testing::RandomFp16;

std::unique_ptr<SequenceStore> MakeStore(DType stored, MemoryKind kind) {
  DeviceSpec d;
  d.kind = kind;
  PoolOptions po;
  po.staging_bytes = 4 << 10;  // several pieces per payload
  auto store = store_testing::CreateStore(
      store_testing::GqaLayout("devpay", 3, 3, 40, 5, stored, DType::kFp16), 64, d, po);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

AppendSpec Spec(uint64_t id, uint64_t tokens) {
  return MakeAppend(id, 0, std::nullopt, tokens, DType::kFp16);
}

class GpuDevicePayloadTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    KVBANK_SKIP_WITHOUT_CUDA(kSeed);
    gpu_ = MakeStore(GetParam(), MemoryKind::kCuda);
    host_ = MakeStore(GetParam(), MemoryKind::kHostStaged);
    ASSERT_TRUE(gpu_ != nullptr && host_ != nullptr);
  }
  void TearDown() override {
    if (dev_ != nullptr) cudaFree(dev_);
  }
  // A device buffer of `bytes` (grown as needed).
  uint8_t* Device(uint64_t bytes) {
    if (bytes > dev_bytes_) {
      if (dev_ != nullptr) cudaFree(dev_);
      dev_ = nullptr;
      EXPECT_EQ(cudaMalloc(&dev_, bytes), cudaSuccess);
      dev_bytes_ = bytes;
    }
    return static_cast<uint8_t*>(dev_);
  }
  // Appends `payload` to gpu sequence `g` from the device and to host sequence `h` from the
  // host; the two statuses.
  std::pair<absl::Status, absl::Status> AppendBoth(uint64_t g, uint64_t h,
                                                   const std::vector<uint8_t>& payload,
                                                   uint64_t tokens) {
    uint8_t* d = Device(payload.size());
    EXPECT_EQ(cudaMemcpy(d, payload.data(), payload.size(), cudaMemcpyHostToDevice), cudaSuccess);
    // The store reads on its own non-blocking stream: the copy (pageable: its DMA may still be
    // running when cudaMemcpy returns) must have landed.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto gt = gpu_->BeginAppend(Spec(g, tokens));
    auto ht = host_->BeginAppend(Spec(h, tokens));
    EXPECT_TRUE(gt.ok() && ht.ok());
    if (!gt.ok() || !ht.ok()) return {absl::InternalError("begin"), absl::InternalError("begin")};
    absl::Status gs = (*gt)->WriteFromDevice(d);
    if (gs.ok()) gs = (*gt)->Commit().status();
    absl::Status hs = (*ht)->Write(payload);
    if (hs.ok()) hs = (*ht)->Commit().status();
    return {gs, hs};
  }
  std::vector<uint8_t> FetchGpu(uint64_t id, DType dtype) {
    FetchSpec f;
    f.sequence_id = id;
    f.dtype = dtype;
    auto r = gpu_->BeginFetch(f);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    const uint64_t n = (*r)->payload_bytes();
    uint8_t* d = Device(n);
    EXPECT_EQ(cudaMemset(d, 0xa5, n), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // before the store's stream writes d
    const absl::Status s = (*r)->ReadToDevice(d);
    EXPECT_TRUE(s.ok()) << s;
    std::vector<uint8_t> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), d, n, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  std::vector<uint8_t> FetchHost(uint64_t id, DType dtype) {
    return ExpectBytes(
        store_testing::FetchToHost(*host_, MakeFetch(id, 0, std::nullopt, 0, std::nullopt, dtype)));
  }
  uint64_t Bytes(uint64_t tokens) const { return Fp16PayloadBytes(gpu_->layout(), tokens); }

  std::unique_ptr<SequenceStore> gpu_, host_;
  void* dev_ = nullptr;
  uint64_t dev_bytes_ = 0;
};

TEST_P(GpuDevicePayloadTest, DevicePathEqualsTheHostPath) {
  auto g = gpu_->Create(WithLease(absl::ZeroDuration()));
  auto h = host_->Create(WithLease(absl::ZeroDuration()));
  ASSERT_TRUE(g.ok() && h.ok());
  for (uint64_t tokens : {13u, 2u, 9u}) {
    const std::vector<uint8_t> payload = RandomFp16(Bytes(tokens), kSeed + tokens);
    auto [gs, hs] = AppendBoth(g->id, h->id, payload, tokens);
    ASSERT_TRUE(gs.ok()) << gs;
    ASSERT_TRUE(hs.ok()) << hs;
  }
  for (DType d : {GetParam(), DType::kFp16, DType::kFp32}) {
    EXPECT_EQ(FetchGpu(g->id, d), FetchHost(h->id, d)) << DTypeName(d);
  }
  EXPECT_EQ(gpu_->CheckInvariants(), "");
}

TEST_P(GpuDevicePayloadTest, NonFiniteIsRefusedByTheDeviceScanAsByTheHostCheck) {
  if (GetParam() == DType::kFp16) GTEST_SKIP() << "a plain copy is not scanned, as on the host";
  auto g = gpu_->Create(WithLease(absl::ZeroDuration()));
  auto h = host_->Create(WithLease(absl::ZeroDuration()));
  ASSERT_TRUE(g.ok() && h.ok());
  std::vector<uint8_t> payload = RandomFp16(Bytes(11), kSeed);
  const uint16_t nan = 0x7e00;
  std::memcpy(payload.data() + 2 * 1234, &nan, 2);
  auto [gs, hs] = AppendBoth(g->id, h->id, payload, 11);
  EXPECT_EQ(gs.code(), absl::StatusCode::kInvalidArgument) << gs;
  EXPECT_EQ(gs, hs) << "the device scan names what the host check names";
  auto info = gpu_->Get(g->id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->length, 0u);
}

INSTANTIATE_TEST_SUITE_P(Storage, GpuDevicePayloadTest,
                         ::testing::Values(DType::kFp16, DType::kInt8, DType::kFp8E4M3),
                         [](const ::testing::TestParamInfo<DType>& i) {
                           return std::string(DTypeName(i.param));
                         });

}  // namespace
}  // namespace kvbank
