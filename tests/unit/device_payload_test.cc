// Payloads handed to the store on the pool's device (AppendTxn::WriteFromDevice,
// FetchReader::ReadToDevice): what the NCCL plane uses, without a host copy. Run on host-staged
// memory (ctest device_payload_test_staged), whose "device" is the host, so the device path's
// logic (pieces, the NaN / Inf scan, refusals) is checked on any machine; plain host memory
// (device_payload_test) must refuse it. On a GPU tests/gpu/gpu_nccl_plane_test.cc drives the
// same calls with device pointers. Fixed seed, printed.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/quant_math.h"
#include "kvbank/prefix_hash.h"
#include "server/core/sequence_store.h"
#include "tests/unit/store_testing.h"
#include "tests/unit/test_memory.h"

namespace kvbank {
namespace {

using store_testing::RandomFp16;

constexpr uint32_t kSeed = 20261201;

ModelLayout Layout(DType stored) {
  return store_testing::GqaLayout("dev", 5, 3, 24, 4, stored, DType::kFp16);
}

class DevicePayloadTest : public ::testing::Test {
 protected:
  void Make(DType stored) {
    auto store = testenv::CreateTestStore(Layout(stored), 64);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }
  bool OnDevicePath() const { return store_->pool().memory().kind() != MemoryKind::kHost; }
  uint64_t NewSeq() { return store_testing::NewSequence(*store_); }
  AppendSpec Spec(uint64_t id, uint64_t tokens, std::optional<DType> dtype = DType::kFp16) {
    AppendSpec a;
    a.sequence_id = id;
    a.num_tokens = tokens;
    a.dtype = dtype;
    return a;
  }
  // Fetches every token, in `dtype`, through ReadToDevice (device) or Read.
  std::vector<uint8_t> Fetch(uint64_t id, DType dtype, bool device) {
    FetchSpec f;
    f.sequence_id = id;
    f.dtype = dtype;
    auto r = store_->BeginFetch(f);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    std::vector<uint8_t> out((*r)->payload_bytes(), 0xa5);
    const absl::Status s =
        device ? (*r)->ReadToDevice(out.data()) : (*r)->Read(0, absl::MakeSpan(out));
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }

  std::unique_ptr<SequenceStore> store_;
};

TEST_F(DevicePayloadTest, Fp16RoundTripIsBitExactAcrossPieces) {
  std::printf("seed %u\n", kSeed);
  Make(DType::kFp16);
  const uint64_t id = NewSeq();
  for (uint64_t tokens : {11u, 6u}) {  // the second continues a partial block
    auto txn = store_->BeginAppend(Spec(id, tokens));
    ASSERT_TRUE(txn.ok()) << txn.status();
    const std::vector<uint8_t> payload = RandomFp16((*txn)->payload_bytes(), kSeed + tokens);
    const absl::Status w = (*txn)->WriteFromDevice(payload.data());
    if (!OnDevicePath()) {
      EXPECT_EQ(w.code(), absl::StatusCode::kFailedPrecondition) << w;
      return;
    }
    ASSERT_TRUE(w.ok()) << w;
    ASSERT_TRUE((*txn)->Commit().ok());
  }
  // Both ways out give the same bytes, and the same as a plain append of them would.
  const std::vector<uint8_t> dev = Fetch(id, DType::kFp16, true);
  const std::vector<uint8_t> host = Fetch(id, DType::kFp16, false);
  EXPECT_EQ(dev, host);
  const uint64_t ref = NewSeq();
  for (uint64_t tokens : {11u, 6u}) {
    auto txn = store_->BeginAppend(Spec(ref, tokens));
    ASSERT_TRUE(txn.ok());
    const std::vector<uint8_t> payload = RandomFp16((*txn)->payload_bytes(), kSeed + tokens);
    ASSERT_TRUE((*txn)->Write(payload).ok());
    ASSERT_TRUE((*txn)->Commit().ok());
  }
  EXPECT_EQ(dev, Fetch(ref, DType::kFp16, false));
  EXPECT_EQ(store_->CheckInvariants(), "");
}

TEST_F(DevicePayloadTest, Int8StorageMatchesTheHostPathBitForBit) {
  Make(DType::kInt8);
  if (!OnDevicePath()) GTEST_SKIP() << "host memory has no device path (checked by Fp16 case)";
  const uint64_t dev_id = NewSeq(), ref_id = NewSeq();
  auto dev = store_->BeginAppend(Spec(dev_id, 13));
  auto ref = store_->BeginAppend(Spec(ref_id, 13));
  ASSERT_TRUE(dev.ok() && ref.ok());
  const std::vector<uint8_t> payload = RandomFp16((*dev)->payload_bytes(), kSeed);
  ASSERT_TRUE((*dev)->WriteFromDevice(payload.data()).ok());
  ASSERT_TRUE((*ref)->Write(payload).ok());
  ASSERT_TRUE((*dev)->Commit().ok());
  ASSERT_TRUE((*ref)->Commit().ok());
  // Storage format (codes and scales) and dequantized: identical, through either way out.
  EXPECT_EQ(Fetch(dev_id, DType::kInt8, true), Fetch(ref_id, DType::kInt8, false));
  const std::vector<uint8_t> out = Fetch(dev_id, DType::kFp16, true);
  EXPECT_EQ(out, Fetch(ref_id, DType::kFp16, false));
  // And within int8's bound of what went in (scale = range / 255 per row; |x| < 6 here).
  double worst = 0;
  for (uint64_t i = 0; i + 1 < out.size(); i += 2) {
    uint16_t a, b;
    std::memcpy(&a, payload.data() + i, 2);
    std::memcpy(&b, out.data() + i, 2);
    worst = std::max(worst, std::fabs(double(kernels::qmath::HalfToFloat(a)) -
                                      double(kernels::qmath::HalfToFloat(b))));
  }
  EXPECT_LT(worst, 12.0 / 255.0) << "int8 round trip error";
}

TEST_F(DevicePayloadTest, NonFiniteIsRefusedNamingTheRowAndNothingIsStored) {
  Make(DType::kInt8);
  if (!OnDevicePath()) GTEST_SKIP() << "host memory has no device path (checked by Fp16 case)";
  const uint64_t id = NewSeq();
  auto txn = store_->BeginAppend(Spec(id, 9));
  ASSERT_TRUE(txn.ok());
  std::vector<uint8_t> payload = RandomFp16((*txn)->payload_bytes(), kSeed);
  const uint16_t nan = 0x7e00;
  std::memcpy(payload.data() + payload.size() - 10, &nan, 2);  // in the last layer's V
  const absl::Status w = (*txn)->WriteFromDevice(payload.data());
  EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument) << w;
  EXPECT_NE(w.message().find("layer 4, V, head 2, token 8, element 19"), absl::string_view::npos)
      << w;
  txn->reset();
  auto info = store_->Get(id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->length, 0u);
  EXPECT_EQ(store_->CheckInvariants(), "");
}

TEST_F(DevicePayloadTest, StorageFormatAndPartWrittenAppendsAreRefused) {
  Make(DType::kInt8);
  const uint64_t id = NewSeq();
  auto storage = store_->BeginAppend(Spec(id, 4, DType::kInt8));
  ASSERT_TRUE(storage.ok()) << storage.status();
  std::vector<uint8_t> bytes((*storage)->payload_bytes());
  EXPECT_EQ((*storage)->WriteFromDevice(bytes.data()).code(),
            absl::StatusCode::kFailedPrecondition);
  storage->reset();
  auto txn = store_->BeginAppend(Spec(id, 4));
  ASSERT_TRUE(txn.ok());
  const std::vector<uint8_t> payload = RandomFp16((*txn)->payload_bytes(), kSeed);
  ASSERT_TRUE((*txn)->Write(absl::MakeConstSpan(payload).subspan(0, 2)).ok());
  EXPECT_EQ((*txn)->WriteFromDevice(payload.data()).code(), absl::StatusCode::kFailedPrecondition);
}

// FetchBlocks with device_dest (FetchBlocksRequest.device_dest, the CUDA IPC plane): the cached
// blocks ReadToDevice writes equal a plain FetchBlocks' Read, dequantized on the device side;
// plain host memory refuses the device path.
TEST_F(DevicePayloadTest, FetchBlocksToTheDeviceEqualsTheHostRead) {
  Make(DType::kInt8);
  std::vector<uint32_t> ids(12);  // three full blocks of 4 tokens
  std::iota(ids.begin(), ids.end(), 100u);
  const uint64_t id = NewSeq();
  AppendSpec a = Spec(id, ids.size());
  a.token_ids = ids;
  auto txn = store_->BeginAppend(a);
  ASSERT_TRUE(txn.ok()) << txn.status();
  ASSERT_TRUE((*txn)->Write(RandomFp16((*txn)->payload_bytes(), kSeed)).ok());
  ASSERT_TRUE((*txn)->Commit().ok());
  const std::vector<BlockHash> hashes = PrefixHashes(
      store_->options().hash, store_->prefix().Root("", ""), ids, store_->layout().block_tokens);
  ASSERT_EQ(hashes.size(), 3u);

  auto host = store_->prefix().FetchBlocks("", hashes, 0, std::nullopt, DType::kFp16);
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ((*host)->num_tokens(), 12u);
  std::vector<uint8_t> want((*host)->payload_bytes());
  ASSERT_TRUE((*host)->Read(0, absl::MakeSpan(want)).ok());

  auto dev =
      store_->prefix().FetchBlocks("", hashes, 0, std::nullopt, DType::kFp16, 0, std::nullopt,
                                   /*device_dest=*/true);
  ASSERT_TRUE(dev.ok()) << dev.status();
  ASSERT_EQ((*dev)->payload_bytes(), want.size());
  std::vector<uint8_t> got(want.size(), 0xa5);
  const absl::Status s = (*dev)->ReadToDevice(got.data());
  if (!OnDevicePath()) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    return;
  }
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(got, want);
  dev->reset();
  host->reset();
  EXPECT_EQ(store_->CheckInvariants(), "");
}

}  // namespace
}  // namespace kvbank
