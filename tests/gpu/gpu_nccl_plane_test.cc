// The NCCL plane's core (server/plane/nccl_plane.h) on real NCCL, without gRPC, as far as one
// GPU allows. NCCL cannot put two ranks of one communicator on the same GPU, so:
//   one GPU   a single-rank communicator whose rank sends to itself (ncclSend + ncclRecv in one
//             group, the test's half issued through PeerOps): a payload received into a cuda:0
//             SequenceStore (fp16 storage: bit-exact; int8: the same bytes as the host path, and
//             within int8's bound) and sent back out of it; the refusals (foreign or unknown
//             communicator, bad sizes and ranks); a join whose other rank never comes (its
//             timeout aborts the communicator); a NaN payload refused with the communicator still
//             usable after.
//   two GPUs  (cudaGetDeviceCount() >= 2, skipped otherwise) the real client arrangement: the
//             test is rank 0 on device 1 (blocking ncclCommInitRank, ncclSend / ncclRecv on its
//             own thread), the plane rank 1 on device 0.
// The gRPC side (NcclConnect, the "ready" handshake, the SDK) needs two GPUs as well and is not
// tested here. Skips every case, saying so, without a CUDA device. Fixed seed, printed.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/quant_math.h"
#include "server/core/block_pool.h"
#include "server/core/sequence_store.h"
#include "server/plane/nccl_plane.h"
#include "tests/gpu/gpu_testing.h"
#include "tests/unit/store_testing.h"

namespace kvbank {
namespace {

constexpr uint64_t kSeed = 4242;

#define KVBANK_ASSERT_OK(expr)                   \
  do {                                           \
    const absl::Status s_ = (expr);              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_; \
  } while (0)

using store_testing::RandomFp16;

std::string UniqueId() {
  ncclUniqueId id;
  EXPECT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  return std::string(id.internal, sizeof(id.internal));
}

// A device buffer, freed at the end.
struct DeviceBuffer {
  explicit DeviceBuffer(uint64_t n) : bytes(n) { ok = cudaMalloc(&data, n) == cudaSuccess; }
  ~DeviceBuffer() {
    if (ok) cudaFree(data);
  }
  void* data = nullptr;
  uint64_t bytes = 0;
  bool ok = false;
};

class NcclPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVBANK_SKIP_WITHOUT_CUDA(kSeed);
    CUDA_OK(cudaSetDevice(0));
    plane::NcclOptions o;
    o.device = 0;
    o.max_comms = 4;
    o.init_timeout = absl::Seconds(5);
    o.transfer_timeout = absl::Seconds(10);
    o.max_transfer_bytes = uint64_t{256} << 20;
    auto p = plane::NcclPlane::Create(o);
    ASSERT_TRUE(p.ok()) << p.status();
    plane_ = *std::move(p);
  }
  void Make(DType stored) {
    DeviceSpec cuda;
    cuda.kind = MemoryKind::kCuda;
    cuda.cuda_device = 0;
    PoolOptions po;
    po.staging_bytes = 64 << 10;  // several pieces per payload
    auto store = store_testing::CreateStore(
        store_testing::GqaLayout("nccl", 5, 4, 64, 16, stored, DType::kFp16), 256, cuda, po);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }
  // A sequence of tenant "t", whose appends and fetches these are.
  uint64_t NewSeq() {
    CreateOptions o = WithLease(absl::ZeroDuration());
    o.tenant = "t";
    auto seq = store_->Create(o);
    EXPECT_TRUE(seq.ok()) << seq.status();
    return seq.ok() ? seq->id : 0;
  }
  AppendSpec Spec(uint64_t id, uint64_t tokens) {
    AppendSpec a;
    a.tenant = "t";
    a.sequence_id = id;
    a.num_tokens = tokens;
    a.dtype = DType::kFp16;
    return a;
  }
  // Payload bytes of `tokens` tokens of every layer.
  uint64_t PayloadBytes(uint64_t tokens) const {
    return store_testing::Fp16PayloadBytes(store_->layout(), tokens);
  }
  // A single-rank communicator of tenant "t".
  uint64_t SelfComm() {
    auto id = plane_->Connect("t", UniqueId(), 1, 0);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : 0;
  }
  // Appends `payload` to `seq` over `comm`: the plane receives what this rank sends itself.
  absl::Status AppendOverSelf(uint64_t comm, uint64_t seq, const std::vector<uint8_t>& payload,
                              uint64_t tokens) {
    DeviceBuffer src(payload.size());
    if (!src.ok) return absl::InternalError("cudaMalloc");
    // The plane's stream sends it: the copy (its DMA may outlast cudaMemcpy) must have landed.
    if (cudaMemcpy(src.data, payload.data(), payload.size(), cudaMemcpyHostToDevice) !=
            cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess) {
      return absl::InternalError("cudaMemcpy");
    }
    auto txn = store_->BeginAppend(Spec(seq, tokens));
    if (!txn.ok()) return txn.status();
    absl::Status s = plane_->Receive(
        "t", comm, 0, payload.size(),
        [&](const uint8_t* device, uint64_t) { return (*txn)->WriteFromDevice(device); },
        [&](void* c, void* stream) {
          return ncclSend(src.data, payload.size(), ncclUint8, 0, static_cast<ncclComm_t>(c),
                          static_cast<cudaStream_t>(stream)) == ncclSuccess
                     ? absl::OkStatus()
                     : absl::InternalError("ncclSend");
        });
    if (!s.ok()) return s;
    return (*txn)->Commit().status();
  }
  // Fetches all of `seq` in `dtype` over `comm` into host memory.
  absl::StatusOr<std::vector<uint8_t>> FetchOverSelf(uint64_t comm, uint64_t seq, DType dtype) {
    FetchSpec f;
    f.tenant = "t";
    f.sequence_id = seq;
    f.dtype = dtype;
    auto reader = store_->BeginFetch(f);
    if (!reader.ok()) return reader.status();
    const uint64_t n = (*reader)->payload_bytes();
    DeviceBuffer dst(n);
    if (!dst.ok) return absl::InternalError("cudaMalloc");
    absl::Status s = plane_->Send(
        "t", comm, 0, n, [&](uint8_t* device, uint64_t) { return (*reader)->ReadToDevice(device); },
        [&](void* c, void* stream) {
          return ncclRecv(dst.data, n, ncclUint8, 0, static_cast<ncclComm_t>(c),
                          static_cast<cudaStream_t>(stream)) == ncclSuccess
                     ? absl::OkStatus()
                     : absl::InternalError("ncclRecv");
        });
    if (!s.ok()) return s;
    std::vector<uint8_t> out(n);
    if (cudaMemcpy(out.data(), dst.data, n, cudaMemcpyDeviceToHost) != cudaSuccess) {
      return absl::InternalError("cudaMemcpy");
    }
    return out;
  }
  // The same fetch through the host path.
  std::vector<uint8_t> FetchHost(uint64_t seq, DType dtype) {
    FetchSpec f = store_testing::MakeFetch(seq, 0, std::nullopt, 0, std::nullopt, dtype);
    f.tenant = "t";
    return store_testing::ExpectBytes(store_testing::FetchToHost(*store_, f));
  }

  std::unique_ptr<plane::NcclPlane> plane_;
  std::unique_ptr<SequenceStore> store_;
};

TEST_F(NcclPlaneTest, SelfSendRecvIntoFp16StoreIsBitExact) {
  ASSERT_NO_FATAL_FAILURE(Make(DType::kFp16));
  const uint64_t comm = SelfComm();
  const uint64_t seq = NewSeq();
  // The same appends over NCCL and by host, partial blocks and odd counts.
  const uint64_t ref = NewSeq();
  for (uint64_t tokens : {37u, 5u, 70u}) {
    const std::vector<uint8_t> payload = RandomFp16(PayloadBytes(tokens), kSeed + tokens);
    KVBANK_ASSERT_OK(AppendOverSelf(comm, seq, payload, tokens));
    ASSERT_TRUE(store_->Append(Spec(ref, tokens), payload).ok());
  }
  auto out = FetchOverSelf(comm, seq, DType::kFp16);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, FetchHost(ref, DType::kFp16)) << "NCCL append + fetch differ from the host's";
  EXPECT_EQ(store_->CheckInvariants(), "");
  KVBANK_ASSERT_OK(plane_->Disconnect("t", comm));
}

TEST_F(NcclPlaneTest, SelfRoundTripFp16PayloadComesBackAsSent) {
  ASSERT_NO_FATAL_FAILURE(Make(DType::kFp16));
  const uint64_t comm = SelfComm();
  const uint64_t seq = NewSeq();
  const std::vector<uint8_t> payload = RandomFp16(PayloadBytes(45), kSeed);
  KVBANK_ASSERT_OK(AppendOverSelf(comm, seq, payload, 45));
  auto out = FetchOverSelf(comm, seq, DType::kFp16);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, payload);
}

TEST_F(NcclPlaneTest, Int8StorageEqualsTheHostPath) {
  ASSERT_NO_FATAL_FAILURE(Make(DType::kInt8));
  const uint64_t comm = SelfComm();
  const uint64_t over_nccl = NewSeq(), over_host = NewSeq();
  const std::vector<uint8_t> payload = RandomFp16(PayloadBytes(29), kSeed + 1);
  KVBANK_ASSERT_OK(AppendOverSelf(comm, over_nccl, payload, 29));
  auto ref = store_->Append(Spec(over_host, 29), payload);
  ASSERT_TRUE(ref.ok()) << ref.status();
  // The storage format (codes and scales), and dequantized to fp16, over NCCL and by host.
  for (DType d : {DType::kInt8, DType::kFp16}) {
    auto got = FetchOverSelf(comm, over_nccl, d);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, FetchHost(over_host, d)) << DTypeName(d);
  }
  auto back = FetchOverSelf(comm, over_nccl, DType::kFp16);
  ASSERT_TRUE(back.ok());
  double worst = 0;
  for (uint64_t i = 0; i + 1 < back->size(); i += 2) {
    uint16_t a, b;
    std::memcpy(&a, payload.data() + i, 2);
    std::memcpy(&b, back->data() + i, 2);
    worst = std::max(worst, std::fabs(double(kernels::qmath::HalfToFloat(a)) -
                                      double(kernels::qmath::HalfToFloat(b))));
  }
  EXPECT_LT(worst, 12.0 / 255.0);
}

TEST_F(NcclPlaneTest, NanIsRefusedAndTheCommunicatorStaysUsable) {
  ASSERT_NO_FATAL_FAILURE(Make(DType::kInt8));
  const uint64_t comm = SelfComm();
  const uint64_t seq = NewSeq();
  const uint64_t bytes = PayloadBytes(9);
  std::vector<uint8_t> payload = RandomFp16(bytes, kSeed + 2);
  const uint16_t inf = 0x7c00;
  std::memcpy(payload.data() + bytes / 2, &inf, 2);
  const absl::Status s = AppendOverSelf(comm, seq, payload, 9);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  auto info = store_->Get(seq, "t");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->length, 0u);
  payload = RandomFp16(bytes, kSeed + 3);
  KVBANK_ASSERT_OK(AppendOverSelf(comm, seq, payload, 9));
}

TEST_F(NcclPlaneTest, Refusals) {
  EXPECT_EQ(plane_->Connect("t", "short", 1, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plane_->Connect("t", UniqueId(), 0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plane_->Connect("t", UniqueId(), 2, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  const uint64_t comm = SelfComm();
  auto noop = [](const uint8_t*, uint64_t) { return absl::OkStatus(); };
  // Another tenant's communicator, or none: NOT_FOUND, for every call.
  EXPECT_EQ(plane_->Check("u", comm, 0, 16).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(plane_->Receive("u", comm, 0, 16, noop).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(plane_->Disconnect("u", comm).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(plane_->Check("t", comm + 100, 0, 16).code(), absl::StatusCode::kNotFound);
  // Sizes and ranks.
  EXPECT_EQ(plane_->Check("t", comm, 0, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plane_->Check("t", comm, 0, (uint64_t{256} << 20) + 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plane_->Check("t", comm, 1, 16).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plane_->Check("t", comm, -1, 16).code(), absl::StatusCode::kInvalidArgument);
  KVBANK_ASSERT_OK(plane_->Check("t", comm, 0, 16));
  KVBANK_ASSERT_OK(plane_->Disconnect("t", comm));
  EXPECT_EQ(plane_->Check("t", comm, 0, 16).code(), absl::StatusCode::kNotFound);
  // The limit on communicators.
  std::vector<uint64_t> held;
  for (int i = 0; i < 4; ++i) held.push_back(SelfComm());
  EXPECT_EQ(plane_->Connect("t", UniqueId(), 1, 0).status().code(),
            absl::StatusCode::kResourceExhausted);
  for (uint64_t id : held) KVBANK_ASSERT_OK(plane_->Disconnect("t", id));
}

TEST_F(NcclPlaneTest, AJoinWhoseOtherRankNeverComesTimesOut) {
  // Rank 1 of 2; rank 0 never joins: after init_timeout (5 s) the communicator is aborted.
  auto comm = plane_->Connect("t", UniqueId(), 2, 1);
  ASSERT_TRUE(comm.ok()) << comm.status();
  const absl::Time start = absl::Now();
  const absl::Status s =
      plane_->Receive("t", *comm, 0, 64, [](const uint8_t*, uint64_t) { return absl::OkStatus(); });
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("did not form"), absl::string_view::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  // Its place is free at once, without a Disconnect (not at the idle timeout); calls naming it
  // still say why it went.
  const absl::Time gone_by = absl::Now() + absl::Seconds(5);
  while (plane_->num_comms() > 0 && absl::Now() < gone_by) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(plane_->num_comms(), 0u);
  const absl::Status why = plane_->Check("t", *comm, 0, 64);
  EXPECT_NE(why.message().find("did not form"), absl::string_view::npos) << why;
  KVBANK_ASSERT_OK(plane_->Disconnect("t", *comm));
}

TEST_F(NcclPlaneTest, EachTenantHasAShareOfTheCommunicators) {
  plane::NcclOptions o = plane_->options();
  o.ledger = TenantLedger::Create();
  o.ledger->SetCap(Resource::kNcclComms, 4);
  o.ledger->SetTenants({"t", "u"});
  plane_.reset();
  auto p = plane::NcclPlane::Create(o);
  ASSERT_TRUE(p.ok()) << p.status();
  plane_ = *std::move(p);
  std::vector<uint64_t> held = {SelfComm(), SelfComm()};
  auto over = plane_->Connect("t", UniqueId(), 1, 0);
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_NE(over.status().message().find("share of 2 nccl_communicators"), absl::string_view::npos)
      << over.status();
  auto other = plane_->Connect("u", UniqueId(), 1, 0);
  ASSERT_TRUE(other.ok()) << other.status();
  for (uint64_t id : held) KVBANK_ASSERT_OK(plane_->Disconnect("t", id));
  KVBANK_ASSERT_OK(plane_->Disconnect("u", *other));
}

TEST_F(NcclPlaneTest, TwoRanksOnTwoGpus) {
  int n = 0;
  CUDA_OK(cudaGetDeviceCount(&n));
  if (n < 2) GTEST_SKIP() << "two-rank transfers need two GPUs; this machine has " << n;
  ASSERT_NO_FATAL_FAILURE(Make(DType::kFp16));
  const std::string uid = UniqueId();
  ncclUniqueId id;
  std::memcpy(id.internal, uid.data(), sizeof(id.internal));
  // The client: rank 0 on device 1, joining while the plane joins as rank 1.
  ncclComm_t client = nullptr;
  cudaStream_t stream = nullptr;
  ncclResult_t joined = ncclInternalError;
  std::thread join([&] {
    cudaSetDevice(1);
    cudaStreamCreate(&stream);
    joined = ncclCommInitRank(&client, 2, id, 0);
  });
  auto comm = plane_->Connect("t", uid, 2, 1);
  join.join();
  ASSERT_TRUE(comm.ok()) << comm.status();
  ASSERT_EQ(joined, ncclSuccess);
  const uint64_t seq = NewSeq();
  auto txn = store_->BeginAppend(Spec(seq, 53));
  ASSERT_TRUE(txn.ok());
  const uint64_t bytes = (*txn)->payload_bytes();
  const std::vector<uint8_t> payload = RandomFp16(bytes, kSeed + 4);
  void* src = nullptr;
  void* dst = nullptr;
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaMalloc(&src, bytes));
  CUDA_OK(cudaMalloc(&dst, bytes));
  CUDA_OK(cudaMemcpy(src, payload.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaDeviceSynchronize());
  ncclResult_t sent = ncclInternalError;
  std::thread sender([&] {
    cudaSetDevice(1);
    sent = ncclSend(src, bytes, ncclUint8, 1, client, stream);
    if (sent == ncclSuccess && cudaStreamSynchronize(stream) != cudaSuccess) {
      sent = ncclUnhandledCudaError;
    }
  });
  KVBANK_ASSERT_OK(plane_->Receive("t", *comm, 0, bytes, [&](const uint8_t* device, uint64_t) {
    return (*txn)->WriteFromDevice(device);
  }));
  sender.join();
  ASSERT_EQ(sent, ncclSuccess);
  ASSERT_TRUE((*txn)->Commit().ok());
  // And back.
  FetchSpec f;
  f.tenant = "t";
  f.sequence_id = seq;
  f.dtype = DType::kFp16;
  auto reader = store_->BeginFetch(f);
  ASSERT_TRUE(reader.ok());
  ncclResult_t received = ncclInternalError;
  std::thread receiver([&] {
    cudaSetDevice(1);
    received = ncclRecv(dst, bytes, ncclUint8, 1, client, stream);
    if (received == ncclSuccess && cudaStreamSynchronize(stream) != cudaSuccess) {
      received = ncclUnhandledCudaError;
    }
  });
  KVBANK_ASSERT_OK(plane_->Send("t", *comm, 0, bytes, [&](uint8_t* device, uint64_t) {
    return (*reader)->ReadToDevice(device);
  }));
  receiver.join();
  ASSERT_EQ(received, ncclSuccess);
  std::vector<uint8_t> back(bytes);
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaMemcpy(back.data(), dst, bytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(back, payload);
  KVBANK_ASSERT_OK(plane_->Disconnect("t", *comm));
  ncclCommDestroy(client);
  cudaFree(src);
  cudaFree(dst);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace kvbank
