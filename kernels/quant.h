// KV codecs on the CPU: element conversions (fp32 / fp16 / bf16), int8 rows (asymmetric uint8
// with a scale and zero point per row) and fp8 (E4M3FN, E5M2) with one scale per segment, plus
// input validation. The CUDA launchers (quant_cuda.h) produce the same bytes; both share the
// scalar math in quant_math.h, where the formats and the rounding are spelled out.
//
// Shapes follow the block layout (kvbank/layout.h): the rows of one head of K (or V) in one block
// are contiguous, [block_tokens][head_dim], and so are its int8 scales and zero points
// ([block_tokens] each, at LayerView::Int8Scale(kv, h, 0) / Int8ZeroPoint(kv, h, 0)). So one call
// covers one (layer, K/V, head, block) run of rows; e.g. for int8 K of head h, tokens [t0, t1):
//   QuantizeInt8Rows(src, in_dtype, t1 - t0, v.head_dim, block + v.KRow(h, t0),
//                    (float*)(block + v.Int8Scale(0, h, t0)), block + v.Int8ZeroPoint(0, h, t0));
// and for fp8 (one scale per (K/V, head) per block, over all the block's rows of that head):
//   scale = Fp8ScaleFor(AbsMax(src, in_dtype, rows * head_dim), fp8);
//   EncodeFp8(src, in_dtype, rows * head_dim, scale, fp8, block + v.KRow(h, 0));
// NOTE: values past scale * fmax saturate; a block filled by several appends needs its scale
// revised as rows come (qmath::Fp8GroupScale, which the block codecs of payload_codec.h follow).
// The "scale-free" e5m2 mode (vLLM's fp8_e5m2 without scales) is EncodeFp8 with scale 1.
//
// Rounding is round-to-nearest-even everywhere. The codecs never produce NaN or Inf from finite
// input: narrowing to fp16 / bf16 saturates at the format's max finite value, and so does fp8.
// Non-finite input is the caller's to refuse (FindNonFinite); the codecs pass it through as
// NaN/Inf where the format can hold it and never crash on it.
//
// Error bounds (x the input, x' the round trip, before the final store to the output dtype):
//   int8:      |x' - x| <= scale / 2 (+ a few fp32 ulps)
//   fp8_e4m3:  |x' - x| <= 2^-4 |x| + 2^-10 scale   (half an ulp; subnormal step 2^-9)
//   fp8_e5m2:  |x' - x| <= 2^-3 |x| + 2^-17 scale   (half an ulp; subnormal step 2^-16)
// plus half an ulp of the output dtype when decoding to fp16 / bf16.
//
// Every function is thread-compatible: it touches only the memory passed in, so concurrent calls
// on disjoint buffers are safe. The caller owns all buffers; nothing is retained. Element dtypes
// are fp32, fp16 and bf16; `fp8` is kFp8E4M3 or kFp8E5M2. A dtype outside those is a caller bug
// (asserted in debug builds, a no-op otherwise).
#ifndef KVBANK_KERNELS_QUANT_H_
#define KVBANK_KERNELS_QUANT_H_

#include <cstddef>
#include <cstdint>

#include "kernels/quant_math.h"
#include "kvbank/layout.h"

namespace kvbank::kernels {

// dst[i] = src[i] converted, i in [0, n). src: [n] of src_dtype, dst: [n] of dst_dtype; they may
// not overlap unless src == dst and both dtypes have the same width. Same dtype: a plain copy
// (bit-identical, NaN payloads included).
void ConvertElements(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n);

// Index of the first NaN or Inf in src [n] of `dtype` (fp32 / fp16 / bf16), or -1 if all are
// finite.
int64_t FindNonFinite(const void* src, DType dtype, size_t n);

// max |src[i]| over [0, n); 0 for n == 0. REQUIRES: finite input (NaN is skipped or not).
float AbsMax(const void* src, DType dtype, size_t n);

// int8 rows. src: [rows][dim] of src_dtype; q: [rows][dim]; scales, zero_points: [rows].
// Row r gets min/max over its dim values and the parameters of qmath::Int8ParamsFor.
void QuantizeInt8Rows(const void* src, DType src_dtype, size_t rows, uint32_t dim, uint8_t* q,
                      float* scales, uint8_t* zero_points);

// dst[r][i] = (q[r][i] - zero_points[r]) * scales[r], stored as dst_dtype (saturating).
// q: [rows][dim]; scales, zero_points: [rows]; dst: [rows][dim].
void DequantizeInt8Rows(const uint8_t* q, const float* scales, const uint8_t* zero_points,
                        size_t rows, uint32_t dim, void* dst, DType dst_dtype);

// The fp8 scale for a block whose largest magnitude is `amax`: amax / fmax (448 for e4m3, 57344
// for e5m2); 1 for amax == 0; never below FLT_MIN.
float Fp8ScaleFor(float amax, DType fp8);

// Whether an fp8 code is NaN (E4M3FN: S.1111.111) or Inf / NaN (E5M2: exponent 11111).
using qmath::Fp8IsNonFinite;

// The largest finite value of an fp8 format (448 or 57344).
float Fp8Max(DType fp8);

// dst[i] = fp8(src[i] * (1 / scale)), saturating. src: [n] of src_dtype; dst: [n] bytes.
// REQUIRES: scale > 0 and finite (Fp8ScaleFor's result, or 1 for scale-free e5m2).
void EncodeFp8(const void* src, DType src_dtype, size_t n, float scale, DType fp8, uint8_t* dst);

// dst[i] = float(src[i]) * scale, stored as dst_dtype (saturating). src: [n] bytes.
void DecodeFp8(const uint8_t* src, DType fp8, size_t n, float scale, void* dst, DType dst_dtype);

// ---- implementations, for tests and benchmarks --------------------------------------------------
//
// The functions above dispatch once (on first use) to the fastest implementation the CPU runs:
// AVX2 + F16C where present, else portable scalar code. Both produce the same bytes for every
// input (finite or not); these tables let tests and benchmarks call each one directly.
struct CodecOps {
  const char* name;  // "scalar" or "avx2"
  void (*convert)(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n);
  int64_t (*find_non_finite)(const void* src, DType dtype, size_t n);
  float (*abs_max)(const void* src, DType dtype, size_t n);
  void (*quantize_int8_rows)(const void* src, DType src_dtype, size_t rows, uint32_t dim,
                             uint8_t* q, float* scales, uint8_t* zero_points);
  void (*dequantize_int8_rows)(const uint8_t* q, const float* scales, const uint8_t* zero_points,
                               size_t rows, uint32_t dim, void* dst, DType dst_dtype);
  void (*encode_fp8)(const void* src, DType src_dtype, size_t n, float scale, DType fp8,
                     uint8_t* dst);
  void (*decode_fp8)(const uint8_t* src, DType fp8, size_t n, float scale, void* dst,
                     DType dst_dtype);
};

const CodecOps& ScalarCodecOps();
// nullptr where the build is not x86-64 or the CPU lacks AVX2 or F16C.
const CodecOps* Avx2CodecOps();
// What the functions above use: Avx2CodecOps() if available, else ScalarCodecOps().
const CodecOps& ActiveCodecOps();

}  // namespace kvbank::kernels

#endif  // KVBANK_KERNELS_QUANT_H_
