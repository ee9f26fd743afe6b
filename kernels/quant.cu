// CUDA KV codecs. Per-element math is quant_math.h, shared with the CPU codec, so results match
// it bit for bit; these kernels only decide who computes which element.
#include <cstdint>

#include "kernels/quant_cuda.h"
#include "kernels/quant_math.h"
#include "kernels/quant_warp.cuh"

namespace kvbank::kernels {

namespace {

using namespace qmath;  // NOLINT: the codec math is this file's vocabulary

constexpr int kThreads = 256;
constexpr unsigned kMaxGrid = 65535;
constexpr unsigned kFullMask = 0xffffffffu;

unsigned GridFor(size_t work_items, unsigned per_block) {
  const size_t g = (work_items + per_block - 1) / per_block;
  return g < kMaxGrid ? static_cast<unsigned>(g == 0 ? 1 : g) : kMaxGrid;
}

__global__ void ConvertKernel(const void* src, DType sd, void* dst, DType dd, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    StoreFromFloat(dst, dd, i, LoadAsFloat(src, sd, i));
  }
}

// One warp per row: min/max by shuffles (order does not matter: min/max of finite values is
// exact, and +-0 ties do not change Int8ParamsFor's result), then every lane computes the same
// parameters and quantizes a strided share of the row.
__global__ void QuantizeInt8RowsKernel(const void* src, DType sd, size_t rows, uint32_t dim,
                                       uint8_t* q, float* scales, uint8_t* zero_points) {
  const unsigned lane = threadIdx.x & 31u;
  const size_t warps = size_t{gridDim.x} * (blockDim.x / 32);
  for (size_t r = blockIdx.x * size_t{blockDim.x / 32} + threadIdx.x / 32; r < rows; r += warps) {
    const size_t base = r * dim;
    const void* row = static_cast<const uint8_t*>(src) + base * DTypeBytes(sd);
    const Int8RowParams p = WarpInt8Params(row, sd, dim, lane);
    if (lane == 0) {
      scales[r] = p.scale;
      zero_points[r] = p.zero_point;
    }
    for (uint32_t i = lane; i < dim; i += 32) {
      q[base + i] = QuantizeInt8(LoadAsFloat(src, sd, base + i), p);
    }
  }
}

__global__ void DequantizeInt8RowsKernel(const uint8_t* q, const float* scales,
                                         const uint8_t* zero_points, size_t rows, uint32_t dim,
                                         void* dst, DType dd) {
  const size_t n = rows * dim;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const size_t r = i / dim;
    StoreFromFloat(dst, dd, i, DequantizeInt8(q[i], zero_points[r], scales[r]));
  }
}

// One block per segment; max |x| is order-independent, so any reduction tree matches the CPU.
__global__ void Fp8ScalesKernel(const void* src, DType sd, size_t segments, size_t segment_len,
                                DType fp8, float* scales) {
  __shared__ float warp_max[kThreads / 32];
  for (size_t s = blockIdx.x; s < segments; s += gridDim.x) {
    const size_t base = s * segment_len;
    float m = 0.0f;
    for (size_t i = threadIdx.x; i < segment_len; i += blockDim.x) {
      const float a = fabsf(LoadAsFloat(src, sd, base + i));
      m = a > m ? a : m;
    }
    for (int off = 16; off > 0; off >>= 1) {
      const float o = __shfl_xor_sync(kFullMask, m, off);
      m = o > m ? o : m;
    }
    if ((threadIdx.x & 31u) == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      float r = 0.0f;
      for (unsigned w = 0; w < blockDim.x / 32; ++w) r = warp_max[w] > r ? warp_max[w] : r;
      scales[s] = Fp8ScaleFor(r, fp8);
    }
    __syncthreads();  // warp_max is reused by the next segment
  }
}

__global__ void EncodeFp8Kernel(const void* src, DType sd, size_t segments, size_t segment_len,
                                const float* scales, DType fp8, uint8_t* dst) {
  const size_t n = segments * segment_len;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const float inv = scales != nullptr ? RecipRn(scales[i / segment_len]) : 1.0f;
    dst[i] = EncodeFp8(LoadAsFloat(src, sd, i), inv, fp8);
  }
}

__global__ void DecodeFp8Kernel(const uint8_t* src, DType fp8, size_t segments, size_t segment_len,
                                const float* scales, void* dst, DType dd) {
  const size_t n = segments * segment_len;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const float scale = scales != nullptr ? scales[i / segment_len] : 1.0f;
    StoreFromFloat(dst, dd, i, DecodeFp8(src[i], scale, fp8));
  }
}

}  // namespace

cudaError_t ConvertElementsCuda(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                                size_t n, cudaStream_t stream) {
  if (!IsElementDType(src_dtype) || !IsElementDType(dst_dtype)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (src_dtype == dst_dtype) {
    // A plain copy keeps NaN payloads, as on the CPU.
    if (src == dst) return cudaSuccess;
    return cudaMemcpyAsync(dst, src, n * DTypeBytes(src_dtype), cudaMemcpyDeviceToDevice, stream);
  }
  ConvertKernel<<<GridFor(n, kThreads), kThreads, 0, stream>>>(src, src_dtype, dst, dst_dtype, n);
  return cudaGetLastError();
}

cudaError_t QuantizeInt8RowsCuda(const void* src, DType src_dtype, size_t rows, uint32_t dim,
                                 uint8_t* q, float* scales, uint8_t* zero_points,
                                 cudaStream_t stream) {
  if (!IsElementDType(src_dtype)) return cudaErrorInvalidValue;
  if (rows == 0 || dim == 0) return cudaSuccess;
  QuantizeInt8RowsKernel<<<GridFor(rows, kThreads / 32), kThreads, 0, stream>>>(
      src, src_dtype, rows, dim, q, scales, zero_points);
  return cudaGetLastError();
}

cudaError_t DequantizeInt8RowsCuda(const uint8_t* q, const float* scales,
                                   const uint8_t* zero_points, size_t rows, uint32_t dim, void* dst,
                                   DType dst_dtype, cudaStream_t stream) {
  if (!IsElementDType(dst_dtype)) return cudaErrorInvalidValue;
  if (rows == 0 || dim == 0) return cudaSuccess;
  DequantizeInt8RowsKernel<<<GridFor(rows * dim, kThreads), kThreads, 0, stream>>>(
      q, scales, zero_points, rows, dim, dst, dst_dtype);
  return cudaGetLastError();
}

cudaError_t Fp8ScalesCuda(const void* src, DType src_dtype, size_t segments, size_t segment_len,
                          DType fp8, float* scales, cudaStream_t stream) {
  if (!IsElementDType(src_dtype) || !IsFp8DType(fp8)) return cudaErrorInvalidValue;
  if (segments == 0) return cudaSuccess;
  Fp8ScalesKernel<<<GridFor(segments, 1), kThreads, 0, stream>>>(src, src_dtype, segments,
                                                                 segment_len, fp8, scales);
  return cudaGetLastError();
}

cudaError_t EncodeFp8Cuda(const void* src, DType src_dtype, size_t segments, size_t segment_len,
                          const float* scales, DType fp8, uint8_t* dst, cudaStream_t stream) {
  if (!IsElementDType(src_dtype) || !IsFp8DType(fp8)) return cudaErrorInvalidValue;
  const size_t n = segments * segment_len;
  if (n == 0) return cudaSuccess;
  EncodeFp8Kernel<<<GridFor(n, kThreads), kThreads, 0, stream>>>(src, src_dtype, segments,
                                                                 segment_len, scales, fp8, dst);
  return cudaGetLastError();
}

cudaError_t DecodeFp8Cuda(const uint8_t* src, DType fp8, size_t segments, size_t segment_len,
                          const float* scales, void* dst, DType dst_dtype, cudaStream_t stream) {
  if (!IsElementDType(dst_dtype) || !IsFp8DType(fp8)) return cudaErrorInvalidValue;
  const size_t n = segments * segment_len;
  if (n == 0) return cudaSuccess;
  DecodeFp8Kernel<<<GridFor(n, kThreads), kThreads, 0, stream>>>(src, fp8, segments, segment_len,
                                                                 scales, dst, dst_dtype);
  return cudaGetLastError();
}

}  // namespace kvbank::kernels
