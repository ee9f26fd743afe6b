// kernels/non_finite_cuda.h: one grid-stride pass, the lowest bad index kept by atomicMin.
#include "kernels/non_finite_cuda.h"
#include "kernels/quant_math.h"

namespace kvbank::kernels {

namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxGrid = 4096;

__global__ void FindNonFiniteKernel(const void* src, DType dtype, uint64_t n,
                                    unsigned long long* first) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    if (qmath::IsNonFinite(src, dtype, i)) atomicMin(first, static_cast<unsigned long long>(i));
  }
}

}  // namespace

cudaError_t FindNonFiniteCuda(const void* src, DType dtype, uint64_t n, unsigned long long* first,
                              cudaStream_t stream) {
  if (dtype != DType::kFp32 && dtype != DType::kFp16 && dtype != DType::kBf16) {
    return cudaErrorInvalidValue;
  }
  if (cudaError_t e = cudaMemsetAsync(first, 0xff, sizeof(*first), stream); e != cudaSuccess) {
    return e;
  }
  if (n == 0) return cudaSuccess;
  const uint64_t blocks = (n + kThreads - 1) / kThreads;
  const unsigned grid = blocks < kMaxGrid ? static_cast<unsigned>(blocks) : kMaxGrid;
  FindNonFiniteKernel<<<grid, kThreads, 0, stream>>>(src, dtype, n, first);
  return cudaGetLastError();
}

}  // namespace kvbank::kernels
