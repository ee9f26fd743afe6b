// CUDA launchers for the KV codecs (see quant.h for the semantics and the error bounds). For
// finite input they write the same bytes as the CPU codec: both run the scalar math of
// quant_math.h. (NaN payloads may differ: the GPU's arithmetic returns its canonical NaN.)
//
// Launchers return cudaError_t (the launch status; kernel faults surface at the next sync) and
// take the stream last. Every pointer is device memory. An unsupported dtype returns
// cudaErrorInvalidValue and launches nothing. Zero-sized calls launch nothing.
//
// fp8 works on `segments` equal runs of `segment_len` elements with one scale each: for the block
// layout, one segment is one (K/V, head) of one block, i.e. [block_tokens][head_dim] contiguous.
#ifndef KVBANK_KERNELS_QUANT_CUDA_H_
#define KVBANK_KERNELS_QUANT_CUDA_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvbank/layout.h"

namespace kvbank::kernels {

// ConvertElements on the device. src: [n] of src_dtype; dst: [n] of dst_dtype (no overlap
// unless src == dst with dtypes of the same width).
cudaError_t ConvertElementsCuda(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                                size_t n, cudaStream_t stream);

// QuantizeInt8Rows on the device. src: [rows][dim] of src_dtype; q: [rows][dim];
// scales: [rows] f32; zero_points: [rows] u8. One warp per row.
cudaError_t QuantizeInt8RowsCuda(const void* src, DType src_dtype, size_t rows, uint32_t dim,
                                 uint8_t* q, float* scales, uint8_t* zero_points,
                                 cudaStream_t stream);

// DequantizeInt8Rows on the device. q: [rows][dim]; scales, zero_points: [rows];
// dst: [rows][dim] of dst_dtype.
cudaError_t DequantizeInt8RowsCuda(const uint8_t* q, const float* scales,
                                   const uint8_t* zero_points, size_t rows, uint32_t dim, void* dst,
                                   DType dst_dtype, cudaStream_t stream);

// scales[s] = Fp8ScaleFor(AbsMax(segment s), fp8). src: [segments][segment_len] of src_dtype;
// scales: [segments] f32.
cudaError_t Fp8ScalesCuda(const void* src, DType src_dtype, size_t segments, size_t segment_len,
                          DType fp8, float* scales, cudaStream_t stream);

// EncodeFp8 of each segment with its scale. src: [segments][segment_len] of src_dtype;
// scales: [segments] f32, or nullptr for scale 1 (scale-free e5m2); dst: [segments][segment_len].
cudaError_t EncodeFp8Cuda(const void* src, DType src_dtype, size_t segments, size_t segment_len,
                          const float* scales, DType fp8, uint8_t* dst, cudaStream_t stream);

// DecodeFp8 of each segment with its scale. src: [segments][segment_len] bytes; scales:
// [segments] f32 or nullptr for 1; dst: [segments][segment_len] of dst_dtype.
cudaError_t DecodeFp8Cuda(const uint8_t* src, DType fp8, size_t segments, size_t segment_len,
                          const float* scales, void* dst, DType dst_dtype, cudaStream_t stream);

}  // namespace kvbank::kernels

#endif  // KVBANK_KERNELS_QUANT_CUDA_H_
