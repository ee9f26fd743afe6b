// Shared by the GPU tests: a CUDA status assertion and the device check they skip on.
#ifndef KVBANK_TESTS_GPU_GPU_TESTING_H_
#define KVBANK_TESTS_GPU_GPU_TESTING_H_

#include <cuda_runtime.h>

#include <string>

#include "gtest/gtest.h"

#define CUDA_OK(expr)                                                      \
  do {                                                                     \
    const cudaError_t e_ = (expr);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

namespace kvbank::gpu_testing {

// The number of CUDA devices; 0 with the reason in `why` when there is none to test on.
inline int CudaDevices(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    *why = cudaGetErrorString(e);
    return 0;
  }
  if (n == 0) *why = "device count is 0";
  return n;
}

}  // namespace kvbank::gpu_testing

// In a fixture's SetUp: skips the test, with the reason, on a machine without a CUDA device, and
// otherwise prints the seed and the device count.
#define KVBANK_SKIP_WITHOUT_CUDA(seed)                                                \
  do {                                                                                \
    std::string why_;                                                                 \
    const int n_ = ::kvbank::gpu_testing::CudaDevices(&why_);                         \
    if (n_ == 0) GTEST_SKIP() << "no CUDA device: " << why_;                          \
    std::printf("seed=%llu devices=%d\n", static_cast<unsigned long long>(seed), n_); \
  } while (0)

#endif  // KVBANK_TESTS_GPU_GPU_TESTING_H_
