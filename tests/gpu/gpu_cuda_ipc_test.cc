// The CUDA IPC plane's core without gRPC: a child process (this binary, re-executed) cudaMallocs
// a source and a destination buffer, fills the source and hands both IPC handles to the parent
// over a pipe; the parent, with a SequenceStore on cuda:0, opens them through
// plane::CudaIpcRegions, appends from the child's source (AppendTxn::WriteFromDevice) and fetches
// into the child's destination (FetchReader::ReadToDevice), in fp16 and int8 storage, and checks
// the bytes against the host path. DISABLED_FetchVsMemcpy is the plane's benchmark
// (tests/gpu/run_on_device.sh runs it).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kvbank/layout.h"
#include "server/core/block_pool.h"
#include "server/core/pool_memory.h"
#include "server/core/sequence_store.h"
#include "server/plane/cuda_ipc.h"
#include "tests/gpu/gpu_testing.h"
#include "tests/unit/store_testing.h"

namespace kvbank {
namespace {

constexpr uint64_t kSeed = 4242;
constexpr char kChildEnv[] = "KVBANK_CUDA_IPC_CHILD";

// Finite fp16 values of magnitude below 1 (the exponent's top bits clear), from `seed`.
std::vector<uint8_t> Payload(uint64_t bytes, uint64_t seed) {
  std::vector<uint8_t> p(bytes);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (uint64_t i = 0; i + 1 < bytes; i += 2) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    // Sign and mantissa from x, an exponent of 0..14: finite and below 1 (an exponent of 31
    // would be Inf or NaN, which a converted append refuses).
    const uint16_t h = static_cast<uint16_t>((x & 0x83ff) | ((x >> 16) % 15) << 10);
    std::memcpy(&p[i], &h, 2);
  }
  return p;
}

ModelLayout Layout(DType storage) {
  return store_testing::GqaLayout("ipc", 3, 2, 64, 16, storage, DType::kFp16);
}

// The exporting child: KVBANK_CUDA_IPC_CHILD="write_fd,read_fd,bytes,seed". Sends the handles of
// its source (filled) and destination (zeroed) buffers, then keeps them alive until the parent
// writes a byte or closes the pipe.
TEST(CudaIpcChild, Export) {
  const char* env = std::getenv(kChildEnv);
  if (env == nullptr) GTEST_SKIP() << "the exporting child of CudaIpcTest (it runs it)";
  std::vector<std::string> f = absl::StrSplit(env, ',');
  ASSERT_EQ(f.size(), 4u);
  const int wfd = std::stoi(f[0]), rfd = std::stoi(f[1]);
  const uint64_t bytes = std::stoull(f[2]), seed = std::stoull(f[3]);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  void* src = nullptr;
  void* dst = nullptr;
  ASSERT_EQ(cudaMalloc(&src, bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dst, bytes), cudaSuccess);
  const std::vector<uint8_t> p = Payload(bytes, seed);
  ASSERT_EQ(cudaMemcpy(src, p.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dst, 0, bytes), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // landed before the parent's streams read it
  cudaIpcMemHandle_t h[2];
  ASSERT_EQ(cudaIpcGetMemHandle(&h[0], src), cudaSuccess);
  ASSERT_EQ(cudaIpcGetMemHandle(&h[1], dst), cudaSuccess);
  ASSERT_EQ(write(wfd, h, sizeof(h)), static_cast<ssize_t>(sizeof(h)));
  char done = 0;
  (void)read(rfd, &done, 1);
  cudaFree(src);
  cudaFree(dst);
}

// The child, running: its handles, and the pipe that ends it.
struct Child {
  pid_t pid = -1;
  int to_child = -1;
  std::string src, dst;  // handles

  ~Child() { End(); }
  int End() {
    if (pid < 0) return -1;
    close(to_child);
    int st = 0;
    waitpid(pid, &st, 0);
    pid = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
  }
};

void Spawn(uint64_t bytes, Child* c) {
  int up[2], down[2];
  ASSERT_EQ(pipe(up), 0);
  ASSERT_EQ(pipe(down), 0);
  const std::string env = absl::StrCat(up[1], ",", down[0], ",", bytes, ",", kSeed);
  c->pid = fork();
  ASSERT_GE(c->pid, 0);
  if (c->pid == 0) {
    // The child keeps only its ends: holding the write end of its own pipe, it would never see
    // the parent close it, and never exit.
    close(up[0]);
    close(down[1]);
    // A fresh process image: CUDA state does not survive fork.
    setenv(kChildEnv, env.c_str(), 1);
    execl("/proc/self/exe", "gpu_cuda_ipc_test", "--gtest_filter=CudaIpcChild.Export",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(up[1]);
  close(down[0]);
  c->to_child = down[1];
  char h[2 * plane::kCudaIpcHandleBytes];
  uint64_t got = 0;
  while (got < sizeof(h)) {
    const ssize_t n = read(up[0], h + got, sizeof(h) - got);
    ASSERT_GT(n, 0) << "the child exited before sending its handles";
    got += n;
  }
  close(up[0]);
  c->src.assign(h, plane::kCudaIpcHandleBytes);
  c->dst.assign(h + plane::kCudaIpcHandleBytes, plane::kCudaIpcHandleBytes);
}

std::unique_ptr<SequenceStore> CudaStore(const ModelLayout& m, uint64_t blocks) {
  DeviceSpec d;
  d.kind = MemoryKind::kCuda;
  StoreOptions o;
  o.default_lease = absl::ZeroDuration();
  auto store = store_testing::CreateStore(m, blocks, d, PoolOptions{}, o);
  return store.ok() ? *std::move(store) : nullptr;
}

std::vector<uint8_t> HostFetch(SequenceStore& store, uint64_t id) {
  const FetchSpec f = store_testing::MakeFetch(id, 0, std::nullopt, 0, std::nullopt, DType::kFp16);
  return store_testing::FetchToHost(store, f).value_or(std::vector<uint8_t>());
}

class CudaIpcTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { KVBANK_SKIP_WITHOUT_CUDA(kSeed); }
};

TEST_P(CudaIpcTest, AppendFromAndFetchIntoAnotherProcessesBuffersEqualTheHostPath) {
  const DType storage = GetParam();
  const ModelLayout m = Layout(storage);
  std::unique_ptr<SequenceStore> store = CudaStore(m, 64);
  ASSERT_NE(store, nullptr);
  constexpr uint64_t kTokens = 37;  // odd: a partial last block
  AppendSpec spec;
  spec.num_tokens = kTokens;
  spec.dtype = DType::kFp16;
  auto host_seq = store->Create(WithLease(std::nullopt));
  auto dev_seq = store->Create(WithLease(std::nullopt));
  ASSERT_TRUE(host_seq.ok() && dev_seq.ok());
  spec.sequence_id = host_seq->id;
  auto probe = store->BeginAppend(spec);
  ASSERT_TRUE(probe.ok()) << probe.status();
  const uint64_t bytes = (*probe)->payload_bytes();
  const std::vector<uint8_t> payload = Payload(bytes, kSeed);
  const absl::Status written = (*probe)->Write(payload);
  ASSERT_TRUE(written.ok()) << written;
  ASSERT_TRUE((*probe)->Commit().ok());

  Child child;
  ASSERT_NO_FATAL_FAILURE(Spawn(bytes, &child));
  plane::CudaIpcRegions regions(plane::CudaIpcOptions{});
  auto src = regions.Register("t", child.src, 0, bytes);
  ASSERT_TRUE(src.ok()) << src.status();
  auto dst = regions.Register("t", child.dst, 0, bytes);
  ASSERT_TRUE(dst.ok()) << dst.status();
  // Past the allocation: refused by the real size check.
  EXPECT_EQ(regions.Register("t", child.src, 1, bytes).status().code(),
            absl::StatusCode::kInvalidArgument);

  auto in = regions.Resolve("t", *src, 0, bytes, "header.device_source");
  ASSERT_TRUE(in.ok()) << in.status();
  spec.sequence_id = dev_seq->id;
  auto txn = store->BeginAppend(spec);
  ASSERT_TRUE(txn.ok()) << txn.status();
  ASSERT_TRUE((*txn)->WriteFromDevice(in->data).ok());
  ASSERT_TRUE((*txn)->Commit().ok());

  const std::vector<uint8_t> want = HostFetch(*store, host_seq->id);
  ASSERT_EQ(want.size(), bytes);
  EXPECT_EQ(HostFetch(*store, dev_seq->id), want) << "appended from device memory";
  if (storage == DType::kFp16) {
    EXPECT_EQ(want, payload) << "fp16 storage is a copy";
  }

  auto out = regions.Resolve("t", *dst, 0, bytes, "device_dest");
  ASSERT_TRUE(out.ok()) << out.status();
  FetchSpec f;
  f.sequence_id = dev_seq->id;
  f.dtype = DType::kFp16;
  f.device_dest = true;
  auto reader = store->BeginFetch(f);
  ASSERT_TRUE(reader.ok()) << reader.status();
  ASSERT_TRUE((*reader)->ReadToDevice(out->data).ok());
  std::vector<uint8_t> got(bytes);
  ASSERT_EQ(cudaMemcpy(got.data(), out->data, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, want) << "fetched into device memory";

  // A NaN in the source: INVALID_ARGUMENT for a converted append, nothing stored.
  if (storage != DType::kFp16) {
    const uint16_t nan = 0x7e00;
    ASSERT_EQ(cudaMemcpy(in->data + 2 * 101, &nan, 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto bad_seq = store->Create(WithLease(std::nullopt));
    spec.sequence_id = bad_seq->id;
    auto bad = store->BeginAppend(spec);
    ASSERT_TRUE(bad.ok());
    EXPECT_EQ((*bad)->WriteFromDevice(in->data).code(), absl::StatusCode::kInvalidArgument);
  }
  in = absl::StatusOr<plane::DeviceBytes>(absl::CancelledError("released"));
  out = in;
  reader->reset();
  EXPECT_TRUE(regions.Unregister("t", *src).ok());
  EXPECT_TRUE(regions.Unregister("t", *dst).ok());
  EXPECT_EQ(child.End(), 0);
}

INSTANTIATE_TEST_SUITE_P(Storage, CudaIpcTest, ::testing::Values(DType::kFp16, DType::kInt8),
                         [](const auto& i) { return std::string(DTypeName(i.param)); });

// The plane's benchmark: a pool -> device buffer fetch (FetchReader::ReadToDevice, fp16 storage)
// against cudaMemcpy device to device of the same bytes, at 2, 16 and 128 MiB. The buffer is this
// process's own cudaMalloc memory (an IPC-opened buffer is the same device memory).
TEST(CudaIpcBench, DISABLED_FetchVsMemcpy) {
  KVBANK_SKIP_WITHOUT_CUDA(kSeed);
  for (uint64_t mib : {2, 16, 128}) {
    ModelLayout m = Layout(DType::kFp16);
    const BlockLayout b = ComputeBlockLayout(m);
    const uint64_t per_token = PayloadLayout::Make(b, 0, m.num_layers, 1).total_bytes;
    const uint64_t tokens = (mib << 20) / per_token;
    std::unique_ptr<SequenceStore> store = CudaStore(m, tokens / m.block_tokens + 2);
    ASSERT_NE(store, nullptr);
    auto seq = store->Create(WithLease(std::nullopt));
    AppendSpec spec;
    spec.sequence_id = seq->id;
    spec.num_tokens = tokens;
    spec.dtype = DType::kFp16;
    const std::vector<uint8_t> payload = Payload(tokens * per_token, kSeed);
    ASSERT_TRUE(store->Append(spec, payload).ok());
    uint8_t* dst = nullptr;
    uint8_t* src = nullptr;
    ASSERT_EQ(cudaMalloc(&dst, payload.size()), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&src, payload.size()), cudaSuccess);
    FetchSpec f;
    f.sequence_id = seq->id;
    f.dtype = DType::kFp16;
    f.device_dest = true;
    auto time_it = [](int reps, const std::function<void()>& fn) {
      fn();  // warm
      const absl::Time t0 = absl::Now();
      for (int i = 0; i < reps; ++i) fn();
      return absl::ToDoubleSeconds(absl::Now() - t0) / reps;
    };
    const double fetch_s = time_it(20, [&] {
      auto r = store->BeginFetch(f);
      ASSERT_TRUE(r.ok());
      ASSERT_TRUE((*r)->ReadToDevice(dst).ok());
    });
    const double copy_s = time_it(20, [&] {
      cudaMemcpy(dst, src, payload.size(), cudaMemcpyDeviceToDevice);
      cudaDeviceSynchronize();
    });
    const double gbs = payload.size() / 1e9;
    std::printf(
        "cuda_ipc_bench %3llu MiB: fetch to device %.1f GB/s, cudaMemcpy D2D %.1f GB/s, "
        "ratio %.2f (goal >= 0.8)\n",
        static_cast<unsigned long long>(mib), gbs / fetch_s, gbs / copy_s, copy_s / fetch_s);
    cudaFree(dst);
    cudaFree(src);
  }
}

}  // namespace
}  // namespace kvbank
