// The CUDA IPC plane end to end on a GPU: the real kvbankd with its pools on cuda:0, the real
// SDK, and payloads in this process's cudaMalloc memory that kvbankd opens by IPC handle. Region
// transfers go as control frames on kvbankd's shm socket, or (KVBANK_TEST_SHM_CONTROL=0: ctest's
// integ_gpu_planes_test_grpc_control) as gRPC calls: every case runs both ways. What a device
// region moves is checked byte for byte against the host path (Append / Fetch over gRPC) of the
// same server. Skips, with the reason, without a CUDA device or when kvbankd cannot open cuda:0.
// The refusals on a server without a GPU: integ_cuda_ipc_test.cc.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tests/gpu/gpu_testing.h"
#include "tests/integration/prefix_support.h"

namespace kvbank::integ {
namespace {

// A cudaMalloc buffer of this process, with the IPC handle kvbankd opens it by.
class DeviceBuffer {
 public:
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  // Empty on failure, with the CUDA error in *why.
  bool Allocate(uint64_t bytes, std::string* why) {
    cudaError_t e = cudaMalloc(&ptr_, bytes);
    if (e == cudaSuccess) e = cudaMemset(ptr_, 0xa5, bytes);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaIpcGetMemHandle(&handle_, ptr_);
    if (e != cudaSuccess) {
      *why = cudaGetErrorString(e);
      return false;
    }
    size_ = bytes;
    return true;
  }
  absl::Span<const uint8_t> Handle() const {
    return {reinterpret_cast<const uint8_t*>(&handle_), sizeof(handle_)};
  }
  uint64_t size() const { return size_; }
  // NOTE: kvbankd reads and writes the buffer on its own streams, in another process: what this
  // process wrote must have landed first. A copy from pageable memory may return before its DMA
  // is done, and a memset is asynchronous, so each ends with a device synchronization (an
  // engine synchronizes the stream that produced its KV before it asks for an append).
  bool Write(uint64_t offset, const std::vector<uint8_t>& bytes) {
    return cudaMemcpy(static_cast<uint8_t*>(ptr_) + offset, bytes.data(), bytes.size(),
                      cudaMemcpyHostToDevice) == cudaSuccess &&
           cudaDeviceSynchronize() == cudaSuccess;
  }
  std::vector<uint8_t> Read(uint64_t offset, uint64_t n) {
    std::vector<uint8_t> out(n);
    EXPECT_EQ(
        cudaMemcpy(out.data(), static_cast<uint8_t*>(ptr_) + offset, n, cudaMemcpyDeviceToHost),
        cudaSuccess);
    return out;
  }
  void Fill(uint8_t value) {
    ASSERT_EQ(cudaMemset(ptr_, value, size_), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }

 private:
  void* ptr_ = nullptr;
  uint64_t size_ = 0;
  cudaIpcMemHandle_t handle_{};
};

class GpuPlanesTest : public KvbankdTest {
 protected:
  static constexpr uint64_t kRegionBytes = 64 * kMiB;

  void SetUp() override {
    KVBANK_SKIP_WITHOUT_CUDA(0);
    char dir[] = "/tmp/kvbank-gpu-integ-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    socket_ = dir_ + "/kvbankd.sock";
    ASSERT_NO_FATAL_FAILURE(
        StartServer({"--models=", "--device=cuda:0", "--shm-socket=" + socket_}));
    ClientOptions o;
    o.shm_socket = socket_;
    o.shm_control = Frames();
    client_ = NewClient(o);
    auto info = client_->GetServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    if (!info->cuda_ipc_device.has_value()) {
      GTEST_SKIP() << "kvbankd serves no CUDA IPC plane on cuda:0 (built without CUDA?)";
    }
    model_ = SmallLayout("m");
    model_.num_layers = 4;
    model_.num_q_heads = 32;
    model_.num_kv_heads = 8;
    model_.head_dim = model_.head_dim_v = 128;
    model_.layer_dtypes.assign(model_.num_layers, DType::kFp16);
    auto m = client_->EnsureModel(model_, 256 * BlockBytes(model_));
    ASSERT_TRUE(m.ok()) << m.status();
    per_token_ = m->payload_bytes_per_token;
    std::string why;
    ASSERT_TRUE(buffer_.Allocate(kRegionBytes, &why)) << why;
    auto region = client_->RegisterDeviceRegion(buffer_.Handle(), 0, kRegionBytes);
    ASSERT_TRUE(region.ok()) << region.status();
    EXPECT_EQ(region->size, kRegionBytes);
    EXPECT_EQ(region->device, 0);
    region_ = region->region_id;
  }
  void TearDown() override {
    KvbankdTest::TearDown();
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }
  static bool Frames() {
    const char* v = std::getenv("KVBANK_TEST_SHM_CONTROL");
    return v == nullptr || std::string(v) != "0";
  }
  // The requests that went as control frames: some with frames, none without.
  void ExpectControlPath(uint64_t before) {
    if (Frames()) {
      EXPECT_GT(client_->ShmControlRequests(), before) << "no region transfer went as a frame";
    } else {
      EXPECT_EQ(client_->ShmControlRequests(), before) << "a transfer went as a frame";
    }
  }
  uint64_t NewSequence() {
    auto seq = client_->CreateSequence("m");
    EXPECT_TRUE(seq.ok()) << seq.status();
    return seq.ok() ? seq->id : 0;
  }
  // n tokens of every layer appended from the device region at `offset`, mirrored in `ref`; the
  // payload returned.
  std::vector<uint8_t> AppendFromDevice(uint64_t seq, KvReference& ref, uint64_t offset, uint64_t n,
                                        Random& rng, std::vector<uint32_t> token_ids = {}) {
    std::vector<uint8_t> payload = ref.Append(0, model_.num_layers, n, rng);
    EXPECT_TRUE(buffer_.Write(offset, payload));
    Client::AppendArgs args;
    args.num_tokens = n;
    args.token_ids = std::move(token_ids);
    auto info = client_->AppendFromDevice("m", seq, args, {region_, offset, payload.size()});
    EXPECT_TRUE(info.ok()) << info.status();
    return payload;
  }

  std::string dir_, socket_;
  std::unique_ptr<Client> client_;
  ModelLayout model_;
  uint64_t per_token_ = 0;
  DeviceBuffer buffer_;
  uint64_t region_ = 0;
};

TEST_F(GpuPlanesTest, AppendFromDeviceAndFetchToDeviceMatchTheHostPath) {
  const uint64_t before = client_->ShmControlRequests();
  const uint64_t seq = NewSequence();
  // 37 tokens (two full blocks and a partial one) from 4 KiB into the region, then 20 more.
  KvReference ref(model_);
  Random rng(1);
  AppendFromDevice(seq, ref, 4096, 37, rng);
  AppendFromDevice(seq, ref, 8 * kMiB, 20, rng);
  auto info = client_->GetSequence("m", seq);
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->length, 57u);

  // The host path's view of the whole sequence and of a slice of it.
  auto whole = client_->Fetch("m", seq, {});
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_EQ(whole->payload.size(), 57 * per_token_);
  Client::FetchArgs part;
  part.token_begin = 5;
  part.token_end = 50;
  part.layer_begin = 1;
  part.layer_end = 3;
  auto host_part = client_->Fetch("m", seq, part);
  ASSERT_TRUE(host_part.ok()) << host_part.status();

  // Into the device region: the same bytes, nothing written past them.
  buffer_.Fill(0x5a);
  const uint64_t at = 16 * kMiB + 512;
  auto got = client_->FetchToDevice("m", seq, {}, {region_, at, whole->payload.size() + 4096});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->payload_bytes, whole->payload.size());
  EXPECT_EQ(got->num_tokens, 57u);
  EXPECT_TRUE(BytesEqual(buffer_.Read(at, whole->payload.size()), whole->payload));
  const std::vector<uint8_t> after = buffer_.Read(at + whole->payload.size(), 4096);
  EXPECT_EQ(std::count(after.begin(), after.end(), 0x5a), 4096) << "written past the payload";

  auto got_part = client_->FetchToDevice("m", seq, part, {region_, 0, host_part->payload.size()});
  ASSERT_TRUE(got_part.ok()) << got_part.status();
  EXPECT_EQ(got_part->token_begin, 5u);
  EXPECT_EQ(got_part->layer_begin, 1u);
  EXPECT_EQ(got_part->layer_end, 3u);
  EXPECT_TRUE(BytesEqual(buffer_.Read(0, host_part->payload.size()), host_part->payload));

  // What went in from the device is what the host path reads back.
  EXPECT_TRUE(BytesEqual(whole->payload, ref.Payload(0, model_.num_layers, 0, 57)));
  ExpectControlPath(before);
}

TEST_F(GpuPlanesTest, FetchBlocksToDeviceMatchesFetchBlocks) {
  const uint64_t before = client_->ShmControlRequests();
  const uint64_t seq = NewSequence();
  const std::vector<uint32_t> tokens = Tokens(31, 4 * kBt);
  KvReference ref(model_);
  Random rng(31);
  AppendFromDevice(seq, ref, 0, tokens.size(), rng, tokens);
  auto root = client_->GetPrefixRoot("m");
  ASSERT_TRUE(root.ok()) << root.status();
  const std::vector<BlockHash> hashes =
      PrefixHashes(root->algorithm, root->root, tokens, root->block_tokens);
  auto want = client_->FetchBlocks("m", hashes);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(want->payload.size(), tokens.size() * per_token_);
  buffer_.Fill(0);
  auto got = client_->FetchBlocksToDevice("m", hashes, {}, {region_, 32 * kMiB, kMiB});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->payload_bytes, want->payload.size());
  EXPECT_TRUE(BytesEqual(buffer_.Read(32 * kMiB, want->payload.size()), want->payload));
  // One layer of the same blocks.
  Client::FetchArgs one;
  one.layer_begin = 2;
  one.layer_end = 3;
  auto want_one = client_->FetchBlocks("m", hashes, one);
  ASSERT_TRUE(want_one.ok()) << want_one.status();
  auto got_one = client_->FetchBlocksToDevice("m", hashes, one, {region_, 0, kMiB});
  ASSERT_TRUE(got_one.ok()) << got_one.status();
  EXPECT_TRUE(BytesEqual(buffer_.Read(0, want_one->payload.size()), want_one->payload));
  ExpectControlPath(before);
}

// Bad slices are refused naming the problem; the sequence and the region's bytes do not change.
TEST_F(GpuPlanesTest, BadSlicesAreRefusedAndChangeNothing) {
  const uint64_t seq = NewSequence();
  KvReference ref(model_);
  Random rng(7);
  std::vector<uint8_t> payload = AppendFromDevice(seq, ref, 0, 10, rng);
  const uint64_t bytes = payload.size();
  Client::AppendArgs args;
  args.num_tokens = 3;
  struct Case {
    RegionSlice slice;
    absl::StatusCode code;
    const char* names;
  };
  const std::vector<Case> appends = {
      {{region_, kRegionBytes - 100, 3 * per_token_},
       absl::StatusCode::kInvalidArgument,
       "runs past the device region's"},
      {{region_ + 1000, 0, 3 * per_token_},
       absl::StatusCode::kNotFound,
       "names no device region of this tenant"},
      {{region_, 0, 2 * per_token_}, absl::StatusCode::kInvalidArgument, "is not the payload's"},
      {{region_, 0, 0, 512, {0, 1024}},
       absl::StatusCode::kInvalidArgument,
       "are for shared-memory regions only"},
  };
  for (const Case& k : appends) {
    auto r = client_->AppendFromDevice("m", seq, args, k.slice);
    EXPECT_EQ(r.status().code(), k.code) << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), k.names)) << r.status();
  }
  auto info = client_->GetSequence("m", seq);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->length, 10u) << "a refused append changed the sequence";

  buffer_.Fill(0x77);
  const std::vector<Case> fetches = {
      {{region_, 0, bytes - 1}, absl::StatusCode::kInvalidArgument, "is less than the payload's"},
      {{region_, kRegionBytes - 16, bytes},
       absl::StatusCode::kInvalidArgument,
       "runs past the device region's"},
      {{region_ + 1000, 0, bytes},
       absl::StatusCode::kNotFound,
       "names no device region of this tenant"},
  };
  for (const Case& k : fetches) {
    auto r = client_->FetchToDevice("m", seq, {}, k.slice);
    EXPECT_EQ(r.status().code(), k.code) << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), k.names)) << r.status();
  }
  const std::vector<uint8_t> head = buffer_.Read(0, bytes);
  EXPECT_EQ(std::count(head.begin(), head.end(), 0x77), int64_t(bytes)) << "a refused fetch wrote";

  // Gone once unregistered.
  ASSERT_TRUE(client_->UnregisterDeviceRegion(region_).ok());
  auto gone = client_->FetchToDevice("m", seq, {}, {region_, 0, bytes});
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
}

// Four threads append and fetch through the one region at once, each in its own slices; every
// payload comes back exact.
TEST_F(GpuPlanesTest, ConcurrentTransfersStayExact) {
  constexpr int kThreads = 4, kRounds = 12;
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto c = [&] {
        ClientOptions o;
        o.shm_socket = socket_;
        o.shm_control = Frames();
        return NewClient(o);
      }();
      const uint64_t base = uint64_t(t) * (kRegionBytes / kThreads);
      for (int round = 0; round < kRounds; ++round) {
        auto seq = c->CreateSequence("m");
        if (!seq.ok()) {
          ++bad;
          continue;
        }
        const uint64_t n = 1 + (t * 7 + round * 13) % 90;
        KvReference ref(model_);
        Random rng(1000 * t + round);
        std::vector<uint8_t> payload = ref.Append(0, model_.num_layers, n, rng);
        if (!buffer_.Write(base, payload)) ++bad;
        Client::AppendArgs args;
        args.num_tokens = n;
        auto a = c->AppendFromDevice("m", seq->id, args, {region_, base, payload.size()});
        if (!a.ok()) {
          ADD_FAILURE() << "thread " << t << " round " << round << ": append: " << a.status();
          ++bad;
        }
        const uint64_t back = base + kRegionBytes / kThreads / 2;
        auto f = c->FetchToDevice("m", seq->id, {}, {region_, back, payload.size()});
        if (!f.ok()) {
          ADD_FAILURE() << "thread " << t << " round " << round << ": fetch: " << f.status();
          ++bad;
        } else if (buffer_.Read(back, payload.size()) != payload) {
          ADD_FAILURE() << "thread " << t << " round " << round << ": " << n
                        << " tokens came back different";
          ++bad;
        }
        if (!c->Free("m", seq->id).ok()) ++bad;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace
}  // namespace kvbank::integ
