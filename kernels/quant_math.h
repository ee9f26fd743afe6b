// Scalar codec math shared by the CPU codec (quant_cpu.cc) and the CUDA kernels (quant.cu).
//
// Every function here is KVBANK_HD, so host and device run the same bit manipulation and the same
// IEEE single/double operations in the same order; that is what makes the CUDA codec bit-identical
// to the CPU one. The AVX2 path in quant_cpu.cc re-implements these in vector registers and is
// tested against them bit for bit.
//
// NOTE: keep every expression free of a multiply feeding an add (a * b + c): nvcc (and gcc with
// -mfma) would contract it into an FMA on one side only and the codecs would drift apart. Device
// code spells the roundings out with __fmul_rn / __fdiv_rn / __frcp_rn.
//
// Formats:
//   fp16      IEEE binary16, max 65504.
//   bf16      the top half of an fp32, max 3.3895314e38.
//   fp8_e4m3  OCP E4M3FN: bias 7, no Inf, NaN = S.1111.111 (0x7f / 0xff), max 448, smallest
//             normal 2^-6, subnormal step 2^-9.
//   fp8_e5m2  OCP E5M2: bias 15, IEEE-like (Inf 0x7c, NaN 0x7d..0x7f), max 57344, smallest
//             normal 2^-14, subnormal step 2^-16. It is the top byte of an fp16.
// All narrowing conversions round to nearest, ties to even. NaN stays NaN (quieted, with the
// payload's top bits, as x86 F16C does); Inf stays Inf where the format has one.
#ifndef KVBANK_KERNELS_QUANT_MATH_H_
#define KVBANK_KERNELS_QUANT_MATH_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvbank/layout.h"

namespace kvbank::kernels::qmath {

constexpr float kFp16Max = 65504.0f;
constexpr float kBf16Max = 3.38953139e38f;          // bits 0x7f7f0000
constexpr float kFloatMinNormal = 1.17549435e-38f;  // FLT_MIN
constexpr float kFloatMax = 3.40282347e38f;         // FLT_MAX

KVBANK_HD inline uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

KVBANK_HD inline float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

KVBANK_HD inline float MulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

KVBANK_HD inline float DivRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

KVBANK_HD inline float RecipRn(float a) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

// Round to nearest integer, ties to even (the default rounding mode on both sides).
KVBANK_HD inline float RintF(float x) { return rintf(x); }

// ---- fp16 -------------------------------------------------------------------------------------

KVBANK_HD inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0x1f) {
    // Inf, or NaN quieted with its payload kept (what F16C's vcvtph2ps does).
    return BitsFloat(sign | 0x7f800000u | (m != 0 ? 0x400000u : 0u) | (m << 13));
  }
  if (e != 0) return BitsFloat(sign | ((e + 112u) << 23) | (m << 13));
  // Zero or subnormal: m * 2^-24, exact in fp32.
  return BitsFloat(sign | FloatBits(MulRn(float(m), 0x1p-24f)));
}

// fp32 -> fp16, ties to even. `saturate`: finite values past the fp16 range become +-65504
// instead of +-Inf (the codecs use this so that finite input never turns into Inf).
KVBANK_HD inline uint16_t FloatToHalf(float f, bool saturate) {
  const uint32_t x = FloatBits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));   // NaN
  if (a == 0x7f800000u) return uint16_t(sign | 0x7c00u);                         // Inf
  if (a >= 0x477ff000u) return uint16_t(sign | (saturate ? 0x7bffu : 0x7c00u));  // >= 65520
  if (a >= 0x38800000u) {                                                        // >= 2^-14
    const uint32_t u = a - (112u << 23);  // rebias the exponent from 127 to 15
    return uint16_t(sign | ((u + 0xfffu + ((u >> 13) & 1u)) >> 13));
  }
  // Subnormal fp16 m * 2^-24: m = RNE(|f| * 2^24) in [0, 1024]; 1024 is the smallest normal.
  return uint16_t(sign | uint32_t(RintF(MulRn(BitsFloat(a), 16777216.0f))));
}

// ---- bf16 -------------------------------------------------------------------------------------

KVBANK_HD inline float Bf16ToFloat(uint16_t b) { return BitsFloat(uint32_t(b) << 16); }

KVBANK_HD inline uint16_t FloatToBf16(float f, bool saturate) {
  const uint32_t x = FloatBits(f);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // NaN, quieted
  if (saturate && a < 0x7f800000u && a >= 0x7f7f8000u) {
    return uint16_t(((x >> 16) & 0x8000u) | 0x7f7fu);  // would round to Inf
  }
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// ---- fp8 --------------------------------------------------------------------------------------

// The constants of an fp8 format, written once: the scalar conversions here and the AVX2 ones in
// quant_cpu.cc read them from this table. Codes are given with the sign bit clear.
struct Fp8Format {
  float max;                 // largest finite value (448, 57344)
  uint32_t max_bits;         // FloatBits(max): a magnitude at or past it saturates
  uint8_t max_code;          // the code of max
  uint8_t nan_code;          // what NaN encodes to
  uint32_t min_normal_bits;  // FloatBits of the smallest normal (2^-6, 2^-14)
  uint32_t rebias;           // (127 - bias) << 23: moves an fp32 exponent to the format's
  uint32_t mant_shift;       // 23 - the format's mantissa bits
  float subnormal_scale;     // 1 / the subnormal step (2^9, 2^16): code = rint(|x| * it)
};
KVBANK_HD constexpr Fp8Format Fp8FormatOf(DType fp8) {
  return fp8 == DType::kFp8E4M3
             ? Fp8Format{448.0f, 0x43e00000u, 0x7eu, 0x7fu, 0x3c800000u, 120u << 23, 20, 512.0f}
             : Fp8Format{57344.0f,    0x47600000u, 0x7bu, 0x7eu,
                         0x38800000u, 112u << 23,  21,    65536.0f};
}
constexpr float kFp8E4M3Max = Fp8FormatOf(DType::kFp8E4M3).max;
constexpr float kFp8E5M2Max = Fp8FormatOf(DType::kFp8E5M2).max;
// E5M2's Inf code (E4M3FN has none).
constexpr uint8_t kFp8E5M2InfCode = 0x7cu;

KVBANK_HD inline float Fp8E4M3ToFloat(uint8_t c) {
  constexpr Fp8Format f = Fp8FormatOf(DType::kFp8E4M3);
  constexpr float kStep = 1.0f / f.subnormal_scale;  // 2^-9, exact
  const uint32_t sign = uint32_t(c & 0x80u) << 24;
  const uint32_t m7 = c & 0x7fu;
  if (m7 == f.nan_code) return BitsFloat(sign | 0x7fc00000u);
  // Normal (exponent field != 0): rebias the exponent from 7 to 127. Subnormal: m * 2^-9, exact.
  // (No float subnormal appears on the way: x86 would take a slow microcode assist on one.)
  const uint32_t mag = m7 >= (1u << (23 - f.mant_shift)) ? (m7 << f.mant_shift) + f.rebias
                                                         : FloatBits(MulRn(float(m7), kStep));
  return BitsFloat(sign | mag);
}

KVBANK_HD constexpr bool IsElementDType(DType d) {
  return d == DType::kFp32 || d == DType::kFp16 || d == DType::kBf16;
}
KVBANK_HD constexpr bool IsFp8DType(DType d) {
  return d == DType::kFp8E4M3 || d == DType::kFp8E5M2;
}

KVBANK_HD inline float Fp8E5M2ToFloat(uint8_t c) { return HalfToFloat(uint16_t(uint16_t(c) << 8)); }

// Saturating: finite values past +-448 become +-448. NaN and Inf become NaN (no Inf in E4M3FN).
KVBANK_HD inline uint8_t FloatToFp8E4M3(float x) {
  constexpr Fp8Format f = Fp8FormatOf(DType::kFp8E4M3);
  const uint32_t bits = FloatBits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t a = bits & 0x7fffffffu;
  if (a >= 0x7f800000u) return uint8_t(sign | f.nan_code);
  if (a >= f.max_bits) return uint8_t(sign | f.max_code);
  if (a < f.min_normal_bits) {  // subnormal m * 2^-9, m in [0, 8]
    return uint8_t(sign | uint32_t(RintF(MulRn(BitsFloat(a), f.subnormal_scale))));
  }
  const uint32_t u = a - f.rebias;
  const uint32_t half = (1u << (f.mant_shift - 1)) - 1;
  return uint8_t(sign | ((u + half + ((u >> f.mant_shift) & 1u)) >> f.mant_shift));
}

// Saturating: finite values past +-57344 become +-57344; Inf stays Inf, NaN becomes 0x7e.
KVBANK_HD inline uint8_t FloatToFp8E5M2(float x) {
  constexpr Fp8Format f = Fp8FormatOf(DType::kFp8E5M2);
  const uint32_t bits = FloatBits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) return uint8_t(sign | f.nan_code);
  if (a == 0x7f800000u) return uint8_t(sign | kFp8E5M2InfCode);
  if (a >= f.max_bits) return uint8_t(sign | f.max_code);
  if (a < f.min_normal_bits) {  // subnormal m * 2^-16, m in [0, 4]
    return uint8_t(sign | uint32_t(RintF(MulRn(BitsFloat(a), f.subnormal_scale))));
  }
  const uint32_t u = a - f.rebias;
  const uint32_t half = (1u << (f.mant_shift - 1)) - 1;
  return uint8_t(sign | ((u + half + ((u >> f.mant_shift) & 1u)) >> f.mant_shift));
}

KVBANK_HD inline float Fp8Max(DType fp8) { return Fp8FormatOf(fp8).max; }

// Whether an fp8 code is NaN (E4M3FN: S.1111.111) or Inf / NaN (E5M2: exponent 11111).
KVBANK_HD inline bool Fp8IsNonFinite(uint8_t code, DType fp8) {
  return fp8 == DType::kFp8E4M3 ? (code & 0x7fu) == Fp8FormatOf(fp8).nan_code
                                : (code & kFp8E5M2InfCode) == kFp8E5M2InfCode;
}

// scale = amax / fmax, so the block's largest magnitude maps to the format's max. Zero (or NaN)
// amax gives 1 (any scale encodes zeros exactly); Inf is treated as FLT_MAX. The result is at
// least FLT_MIN, so 1 / scale is finite.
KVBANK_HD inline float Fp8ScaleFor(float amax, DType fp8) {
  if (!(amax > 0.0f)) return 1.0f;
  const float a = amax < kFloatMax ? amax : kFloatMax;
  const float s = DivRn(a, Fp8Max(fp8));
  return s > kFloatMinNormal ? s : kFloatMinNormal;
}

// The fp8 scale rule, one for every codec that writes blocks (the host RowCodec, the whole-payload
// codecs on the CPU and the GPU). A group is one (layer, K/V part, kv head, block): its rows share
// one scale. An append brings rows [row, row + rows) of a group, `amax` their largest magnitude;
// `stored` is the group's scale when row > 0 (earlier appends brought rows [0, row)). The target
// is Fp8ScaleFor(amax) when the block's rows are all in (row + rows == block_tokens), else
// Fp8ScaleFor(amax * kFp8ScaleHeadroom), room for decode rows to come.
//   row == 0:  the target; so a block that one append fills gets its exact scale.
//   row > 0:   `stored` while it covers amax (Fp8ScaleFor(amax) <= stored); else the smallest
//              stored * 2^k that reaches the target, and the caller requantizes rows [0, row)
//              to it: a power-of-two ratio moves their codes by whole exponents, exactly unless
//              they fall below the normal range. So no finite row ever saturates.
// The result is finite and positive.
constexpr float kFp8ScaleHeadroom = 4.0f;

KVBANK_HD inline float Fp8GroupScale(float amax, float stored, uint64_t row, uint64_t rows,
                                     uint64_t block_tokens, DType fp8) {
  const float target =
      Fp8ScaleFor(row + rows < block_tokens ? MulRn(amax, kFp8ScaleHeadroom) : amax, fp8);
  // A stored scale that is not a positive finite float (a block no transfer has filled) is
  // replaced, never doubled.
  if (row == 0 || !(stored > 0.0f && stored <= kFloatMax)) return target;
  if (Fp8ScaleFor(amax, fp8) <= stored) return stored;
  float s = stored;
  while (s < target) s = MulRn(s, 2.0f);  // at most ~280 doublings: both are finite floats
  return s;
}

// x * inv_scale encoded; inv_scale = RecipRn(scale).
KVBANK_HD inline uint8_t EncodeFp8(float x, float inv_scale, DType fp8) {
  const float y = MulRn(x, inv_scale);
  return fp8 == DType::kFp8E4M3 ? FloatToFp8E4M3(y) : FloatToFp8E5M2(y);
}

// Finite values past the fp32 range become +-FLT_MAX; NaN stays NaN. Written as x86's
// maxps(-max, v) / minps(max, v) evaluate, NaN falling through to v.
KVBANK_HD inline float ClampToFloatRange(float v) {
  v = -kFloatMax > v ? -kFloatMax : v;
  return kFloatMax < v ? kFloatMax : v;
}

// fp8 value * scale. NOTE: fmax * scale can round past FLT_MAX when amax is near it, so a finite
// code's product is clamped to the fp32 range; Inf and NaN codes pass through.
KVBANK_HD inline float DecodeFp8(uint8_t c, float scale, DType fp8) {
  const float f = fp8 == DType::kFp8E4M3 ? Fp8E4M3ToFloat(c) : Fp8E5M2ToFloat(c);
  const float v = MulRn(f, scale);
  return (FloatBits(f) & 0x7f800000u) == 0x7f800000u ? v : ClampToFloatRange(v);
}

// ---- int8 (asymmetric uint8 per row) ----------------------------------------------------------
//
// For a row with minimum mn and maximum mx:
//   constant row (mn == mx == c): exact. c == 0: scale 0, zero point 0, q 0. c != 0: scale |c|,
//     and (zero point, q) = (0, 1) for c > 0 or (1, 0) for c < 0, so (q - zp) * scale == c.
//   otherwise: the range is widened to hold 0 (lo = min(mn, 0), hi = max(mx, 0)) so that the
//     uint8 zero point always fits; for rows that straddle 0 (KV rows do) this is exactly
//     scale = (mx - mn) / 255, zp = round(-mn / scale). scale and zp are computed in fp64 and
//     scale is kept >= FLT_MIN so 1 / scale is finite; then
//       q  = clamp(rint(x * (1 / scale)) + zp, 0, 255)
//       x' = (q - zp) * scale
//     |x' - x| <= scale / 2 (plus a few fp32 ulps of x).
// uint8 codes run over [0, kInt8CodeMax]: 255 steps of `scale` span the row's range.
constexpr float kInt8CodeMax = 255.0f;

struct Int8RowParams {
  float scale = 0.0f;
  float inv_scale = 0.0f;  // 0 for constant rows (unused there)
  uint8_t zero_point = 0;
  bool constant = false;
  uint8_t constant_code = 0;  // the q of every element of a constant row
};

KVBANK_HD inline Int8RowParams Int8ParamsFor(float mn, float mx) {
  Int8RowParams p;
  if (mx == mn) {
    p.constant = true;
    p.scale = fabsf(mn);
    p.zero_point = mn < 0.0f ? 1 : 0;
    p.constant_code = mn > 0.0f ? 1 : 0;
    return p;
  }
  const double lo = mn < 0.0f ? double(mn) : 0.0;
  const double hi = mx > 0.0f ? double(mx) : 0.0;
  const double code_max = kInt8CodeMax;
  float scale = float((hi - lo) / code_max);
  if (!(scale >= kFloatMinNormal)) scale = kFloatMinNormal;  // tiny ranges (and NaN rows)
  double z = rint(-lo / double(scale));
  z = z < code_max ? z : code_max;
  p.scale = scale;
  p.inv_scale = RecipRn(scale);
  p.zero_point = uint8_t(z > 0.0 ? z : 0.0);
  return p;
}

// The comparisons are written as x86's maxps/minps evaluate them (NaN -> the bound), so the
// scalar, AVX2 and CUDA paths agree on every input and no float-to-int conversion is undefined.
KVBANK_HD inline uint8_t QuantizeInt8(float x, float inv_scale, float zero_point) {
  float t = RintF(MulRn(x, inv_scale)) + zero_point;
  t = t > 0.0f ? t : 0.0f;
  t = t < kInt8CodeMax ? t : kInt8CodeMax;
  return uint8_t(t);
}

// x quantized with its row's parameters (every element of a constant row has the row's code).
KVBANK_HD inline uint8_t QuantizeInt8(float x, const Int8RowParams& p) {
  return p.constant ? p.constant_code : QuantizeInt8(x, p.inv_scale, float(p.zero_point));
}

// NOTE: (q - zp) * scale can exceed FLT_MAX by up to scale / 2 for rows reaching +-FLT_MAX, so
// the product is clamped to the fp32 range (finite input never dequantizes to Inf).
KVBANK_HD inline float DequantizeInt8(uint8_t q, uint8_t zero_point, float scale) {
  return ClampToFloatRange(MulRn(float(int(q) - int(zero_point)), scale));
}

// ---- element access ---------------------------------------------------------------------------

// REQUIRES: d is fp32, fp16 or bf16.
// Element i of a payload. On the host a payload may sit at any address (the server writes
// appended bytes straight from gRPC's slices), so it is read with memcpy: one plain unaligned
// load on x86. Device buffers are aligned.
template <typename T>
KVBANK_HD inline T LoadElement(const void* p, size_t i) {
#ifdef __CUDA_ARCH__
  return static_cast<const T*>(p)[i];
#else
  T v;
  std::memcpy(&v, static_cast<const unsigned char*>(p) + i * sizeof(T), sizeof(T));
  return v;
#endif
}
template <typename T>
KVBANK_HD inline void StoreElement(void* p, size_t i, T v) {
#ifdef __CUDA_ARCH__
  static_cast<T*>(p)[i] = v;
#else
  std::memcpy(static_cast<unsigned char*>(p) + i * sizeof(T), &v, sizeof(T));
#endif
}

KVBANK_HD inline float LoadAsFloat(const void* p, DType d, size_t i) {
  if (d == DType::kFp32) return LoadElement<float>(p, i);
  const uint16_t b = LoadElement<uint16_t>(p, i);
  return d == DType::kFp16 ? HalfToFloat(b) : Bf16ToFloat(b);
}

// Stores with saturation: finite values never become Inf. REQUIRES: d is fp32, fp16 or bf16.
KVBANK_HD inline void StoreFromFloat(void* p, DType d, size_t i, float v) {
  if (d == DType::kFp32) {
    StoreElement<float>(p, i, v);
  } else {
    StoreElement<uint16_t>(p, i, d == DType::kFp16 ? FloatToHalf(v, true) : FloatToBf16(v, true));
  }
}

KVBANK_HD inline bool IsNonFinite(const void* p, DType d, size_t i) {
  if (d == DType::kFp32) {
    return (FloatBits(LoadElement<float>(p, i)) & 0x7f800000u) == 0x7f800000u;
  }
  const uint16_t b = LoadElement<uint16_t>(p, i);
  const uint16_t e = d == DType::kFp16 ? 0x7c00u : 0x7f80u;
  return (b & e) == e;
}

// ---- one element of a stored row ---------------------------------------------------------------
//
// What every decoder and encoder of block rows computes per element, whatever the layer's storage
// dtype; the CUDA row kernels call these, and the CPU codecs (quant_cpu.cc) compute the same
// bytes in bulk.

// Element i of a stored row of `storage` as a float: int8 with the row's scale and zero point,
// fp8 with its group's scale, fp32 / fp16 / bf16 as stored (scale and zero_point unused).
KVBANK_HD inline float DecodeStored(const uint8_t* row, DType storage, size_t i, float scale,
                                    uint8_t zero_point) {
  if (storage == DType::kInt8) return DequantizeInt8(row[i], zero_point, scale);
  if (IsFp8DType(storage)) return DecodeFp8(row[i], scale, storage);
  return LoadAsFloat(row, storage, i);
}

// x stored as element i of a row of `storage`: int8 with the row's parameters, fp8 with
// fp8_inv_scale (RecipRn of its group's scale), fp32 / fp16 / bf16 converted (saturating).
KVBANK_HD inline void EncodeStored(uint8_t* row, DType storage, size_t i, float x,
                                   const Int8RowParams& int8, float fp8_inv_scale) {
  if (storage == DType::kInt8) {
    row[i] = QuantizeInt8(x, int8);
  } else if (IsFp8DType(storage)) {
    row[i] = EncodeFp8(x, fp8_inv_scale, storage);
  } else {
    StoreFromFloat(row, storage, i, x);
  }
}

}  // namespace kvbank::kernels::qmath

#endif  // KVBANK_KERNELS_QUANT_MATH_H_
