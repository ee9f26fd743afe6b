// Self send/recv throughput of a single-rank NCCL communicator on one GPU (ncclSend + ncclRecv
// to itself in one group: the copy the NCCL plane's one-GPU tests make) against cudaMemcpyAsync
// device to device, for payloads of 1 MiB to 256 MiB. Not a ctest: tests/gpu/run_on_device.sh
// runs it after the gpu tests. What it says about two GPUs or two hosts: nothing (that needs
// NVLink / InfiniBand peers).
//
//   gpu_nccl_bench [--reps N]
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

#define CHECK_CUDA(expr)                                               \
  do {                                                                 \
    const cudaError_t e_ = (expr);                                     \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)
#define CHECK_NCCL(expr)                                               \
  do {                                                                 \
    const ncclResult_t r_ = (expr);                                    \
    if (r_ != ncclSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #expr, ncclGetErrorString(r_)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::atoi(argv[i + 1]);
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device: nothing measured\n");
    return 0;
  }
  CHECK_CUDA(cudaSetDevice(0));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  int version = 0;
  CHECK_NCCL(ncclGetVersion(&version));
  std::printf("device %s, NCCL %d, reps %d\n", prop.name, version, reps);
  ncclUniqueId id;
  CHECK_NCCL(ncclGetUniqueId(&id));
  ncclComm_t comm;
  CHECK_NCCL(ncclCommInitRank(&comm, 1, id, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  const uint64_t max_bytes = uint64_t{256} << 20;
  void *src = nullptr, *dst = nullptr;
  CHECK_CUDA(cudaMalloc(&src, max_bytes));
  CHECK_CUDA(cudaMalloc(&dst, max_bytes));
  CHECK_CUDA(cudaMemset(src, 1, max_bytes));
  std::printf("%12s %14s %14s\n", "bytes", "nccl_self_GBps", "memcpy_d2d_GBps");
  for (uint64_t bytes = uint64_t{1} << 20; bytes <= max_bytes; bytes *= 4) {
    auto self = [&] {
      CHECK_NCCL(ncclGroupStart());
      CHECK_NCCL(ncclSend(src, bytes, ncclUint8, 0, comm, stream));
      CHECK_NCCL(ncclRecv(dst, bytes, ncclUint8, 0, comm, stream));
      CHECK_NCCL(ncclGroupEnd());
    };
    self();  // warm up
    CHECK_CUDA(cudaStreamSynchronize(stream));
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) self();
    CHECK_CUDA(cudaStreamSynchronize(stream));
    auto t1 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) {
      CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    auto t2 = std::chrono::steady_clock::now();
    const double moved = double(bytes) * reps / 1e9;
    std::printf("%12llu %14.1f %14.1f\n", static_cast<unsigned long long>(bytes),
                moved / Seconds(t0, t1), moved / Seconds(t1, t2));
  }
  CHECK_NCCL(ncclCommDestroy(comm));
  cudaFree(src);
  cudaFree(dst);
  cudaStreamDestroy(stream);
  return 0;
}
