// CPU codecs: a portable scalar implementation (the reference: the per-element math of
// quant_math.h in plain loops) and an AVX2 + F16C one that computes the same bytes eight
// elements at a time, chosen once at run time (quant.h: ActiveCodecOps).
#include <cassert>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/quant.h"
#include "kernels/quant_math.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVBANK_QUANT_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define KVBANK_QUANT_X86 0
#endif

namespace kvbank::kernels {

namespace {

using namespace qmath;  // NOLINT: the codec math is this file's vocabulary

template <DType D>
using DTypeC = std::integral_constant<DType, D>;

// Calls f(DTypeC<d>) for an element dtype; false (and nothing called) for any other.
template <typename F>
bool VisitElem(DType d, F&& f) {
  switch (d) {
    case DType::kFp32:
      f(DTypeC<DType::kFp32>());
      return true;
    case DType::kFp16:
      f(DTypeC<DType::kFp16>());
      return true;
    case DType::kBf16:
      f(DTypeC<DType::kBf16>());
      return true;
    default:
      assert(false && "not an fp32/fp16/bf16 dtype");
      return false;
  }
}

template <typename F>
bool VisitFp8(DType d, F&& f) {
  switch (d) {
    case DType::kFp8E4M3:
      f(DTypeC<DType::kFp8E4M3>());
      return true;
    case DType::kFp8E5M2:
      f(DTypeC<DType::kFp8E5M2>());
      return true;
    default:
      assert(false && "not an fp8 dtype");
      return false;
  }
}

// Same dtype: a copy (memmove, since src == dst is allowed). Returns true when it handled it.
bool SameDTypeCopy(const void* src, DType sd, void* dst, DType dd, size_t n) {
  if (sd != dd || !IsElementDType(sd)) return false;
  if (src != dst && n != 0) std::memmove(dst, src, n * DTypeBytes(sd));
  return true;
}

// ---- scalar -----------------------------------------------------------------------------------

void ConvertScalar(const void* src, DType sd, void* dst, DType dd, size_t n) {
  if (SameDTypeCopy(src, sd, dst, dd, n)) return;
  VisitElem(sd, [&](auto s) {
    VisitElem(dd, [&](auto d) {
      for (size_t i = 0; i < n; ++i) StoreFromFloat(dst, d.value, i, LoadAsFloat(src, s.value, i));
    });
  });
}

int64_t FindNonFiniteScalar(const void* src, DType dtype, size_t n) {
  int64_t found = -1;
  VisitElem(dtype, [&](auto s) {
    for (size_t i = 0; i < n; ++i) {
      if (IsNonFinite(src, s.value, i)) {
        found = static_cast<int64_t>(i);
        return;
      }
    }
  });
  return found;
}

float AbsMaxScalar(const void* src, DType dtype, size_t n) {
  float m = 0.0f;
  VisitElem(dtype, [&](auto s) {
    for (size_t i = 0; i < n; ++i) {
      const float a = fabsf(LoadAsFloat(src, s.value, i));
      m = a > m ? a : m;
    }
  });
  return m;
}

// Quantizes elements [i, end) of the row starting at `base` (the row's parameters are known).
template <DType S>
inline void QuantizeSpanScalar(const void* src, size_t base, uint32_t i, uint32_t end,
                               const Int8RowParams& p, uint8_t* q) {
  for (; i < end; ++i) q[base + i] = QuantizeInt8(LoadAsFloat(src, S, base + i), p);
}

void QuantizeInt8RowsScalar(const void* src, DType sd, size_t rows, uint32_t dim, uint8_t* q,
                            float* scales, uint8_t* zero_points) {
  VisitElem(sd, [&](auto s) {
    for (size_t r = 0; r < rows; ++r) {
      const size_t base = r * dim;
      float mn = INFINITY, mx = -INFINITY;
      for (uint32_t i = 0; i < dim; ++i) {
        const float x = LoadAsFloat(src, s.value, base + i);
        mn = x < mn ? x : mn;
        mx = x > mx ? x : mx;
      }
      const Int8RowParams p = Int8ParamsFor(mn, mx);
      scales[r] = p.scale;
      zero_points[r] = p.zero_point;
      QuantizeSpanScalar<s.value>(src, base, 0, dim, p, q);
    }
  });
}

void DequantizeInt8RowsScalar(const uint8_t* q, const float* scales, const uint8_t* zero_points,
                              size_t rows, uint32_t dim, void* dst, DType dd) {
  VisitElem(dd, [&](auto d) {
    for (size_t r = 0; r < rows; ++r) {
      const size_t base = r * dim;
      for (uint32_t i = 0; i < dim; ++i) {
        StoreFromFloat(dst, d.value, base + i,
                       DequantizeInt8(q[base + i], zero_points[r], scales[r]));
      }
    }
  });
}

void EncodeFp8Scalar(const void* src, DType sd, size_t n, float scale, DType fp8, uint8_t* dst) {
  const float inv = RecipRn(scale);
  VisitElem(sd, [&](auto s) {
    VisitFp8(fp8, [&](auto f) {
      for (size_t i = 0; i < n; ++i) dst[i] = EncodeFp8(LoadAsFloat(src, s.value, i), inv, f.value);
    });
  });
}

void DecodeFp8Scalar(const uint8_t* src, DType fp8, size_t n, float scale, void* dst, DType dd) {
  VisitFp8(fp8, [&](auto f) {
    VisitElem(dd, [&](auto d) {
      for (size_t i = 0; i < n; ++i)
        StoreFromFloat(dst, d.value, i, DecodeFp8(src[i], scale, f.value));
    });
  });
}

constexpr CodecOps kScalarOps = {
    "scalar",        ConvertScalar,          FindNonFiniteScalar,
    AbsMaxScalar,    QuantizeInt8RowsScalar, DequantizeInt8RowsScalar,
    EncodeFp8Scalar, DecodeFp8Scalar,
};

// ---- AVX2 + F16C ------------------------------------------------------------------------------
//
// Each vector helper mirrors one scalar function of quant_math.h operation for operation (the
// same IEEE roundings, the same integer bit tricks, comparisons ordered as maxps/minps order
// them), so the two paths agree bit for bit; the tails run the scalar code itself.
#if KVBANK_QUANT_X86

#define KVBANK_AVX2 __attribute__((target("avx2,f16c")))

KVBANK_AVX2 inline __m256i I32(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }

template <DType D>
KVBANK_AVX2 inline __m256 Load8(const void* p, size_t i) {
  if constexpr (D == DType::kFp32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (D == DType::kFp16) return _mm256_cvtph_ps(h);  // exact; quiets NaN as scalar
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Eight int32 lanes holding values in [0, 255] -> eight bytes at p.
KVBANK_AVX2 inline void StoreBytes8(uint8_t* p, __m256i v) {
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
}

KVBANK_AVX2 inline __m256i LoadBytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// FloatToBf16(v, saturate = true) on eight lanes.
KVBANK_AVX2 inline __m128i FloatToBf16x8(__m256 v) {
  __m256i x = _mm256_castps_si256(v);
  const __m256i a = _mm256_and_si256(x, I32(0x7fffffffu));
  const __m256i over = _mm256_and_si256(_mm256_cmpgt_epi32(a, I32(0x7f7f7fffu)),
                                        _mm256_cmpgt_epi32(I32(0x7f800000u), a));
  // A finite value that would round to Inf becomes sign | 0x7f7f0000, which rounds to 0x7f7f.
  x = _mm256_blendv_epi8(
      x, _mm256_or_si256(_mm256_and_si256(x, I32(0x80000000u)), I32(0x7f7f0000u)), over);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), I32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, I32(0x7fffu)), lsb), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(x, 16), I32(0x40u));
  const __m256i r = _mm256_blendv_epi8(rounded, nan, _mm256_cmpgt_epi32(a, I32(0x7f800000u)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// FloatToHalf(v, saturate = true) on eight lanes: clamp finite lanes to +-65504 (which rounds
// exactly as the scalar saturation does), leave Inf/NaN to vcvtps2ph.
KVBANK_AVX2 inline __m128i FloatToHalfx8(__m256 v) {
  const __m256 abs =
      _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(v), I32(0x7fffffffu)));
  const __m256 nonfinite = _mm256_cmp_ps(abs, _mm256_set1_ps(kFloatMax), _CMP_NLE_UQ);
  const __m256 clamped =
      _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-kFp16Max)), _mm256_set1_ps(kFp16Max));
  return _mm256_cvtps_ph(_mm256_blendv_ps(clamped, v, nonfinite), _MM_FROUND_TO_NEAREST_INT);
}

template <DType D>
KVBANK_AVX2 inline void Store8(void* p, size_t i, __m256 v) {
  if constexpr (D == DType::kFp32) {
    _mm256_storeu_ps(static_cast<float*>(p) + i, v);
  } else {
    const __m128i h = D == DType::kFp16 ? FloatToHalfx8(v) : FloatToBf16x8(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), h);
  }
}

// FloatToFp8E4M3 / FloatToFp8E5M2 on eight lanes (int32 codes in [0, 255]).
template <DType F>
KVBANK_AVX2 inline __m256i FloatToFp8x8(__m256 y) {
  constexpr Fp8Format f = Fp8FormatOf(F);
  const __m256i x = _mm256_castps_si256(y);
  const __m256i a = _mm256_and_si256(x, I32(0x7fffffffu));
  const __m256i sign = _mm256_srli_epi32(_mm256_and_si256(x, I32(0x80000000u)), 24);
  const __m256i u = _mm256_sub_epi32(a, I32(f.rebias));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, f.mant_shift), I32(1));
  const __m256i normal = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, I32((1u << (f.mant_shift - 1)) - 1)), lsb),
      f.mant_shift);
  const __m256 sub_f =
      _mm256_round_ps(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(f.subnormal_scale)),
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256i code = _mm256_blendv_epi8(normal, _mm256_cvttps_epi32(sub_f),
                                    _mm256_cmpgt_epi32(I32(f.min_normal_bits), a));
  code = _mm256_blendv_epi8(code, I32(f.max_code), _mm256_cmpgt_epi32(a, I32(f.max_bits - 1)));
  if constexpr (F == DType::kFp8E4M3) {  // Inf and NaN: NaN
    code = _mm256_blendv_epi8(code, I32(f.nan_code), _mm256_cmpgt_epi32(a, I32(0x7f7fffffu)));
  } else {
    code = _mm256_blendv_epi8(code, I32(kFp8E5M2InfCode), _mm256_cmpeq_epi32(a, I32(0x7f800000u)));
    code = _mm256_blendv_epi8(code, I32(f.nan_code), _mm256_cmpgt_epi32(a, I32(0x7f800000u)));
  }
  return _mm256_or_si256(code, sign);
}

// Fp8E4M3ToFloat / Fp8E5M2ToFloat on eight bytes.
template <DType F>
KVBANK_AVX2 inline __m256 Fp8ToFloatx8(const uint8_t* p) {
  if constexpr (F == DType::kFp8E5M2) {
    const __m128i h =
        _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8);
    return _mm256_cvtph_ps(h);
  } else {
    constexpr Fp8Format f = Fp8FormatOf(F);
    const __m256i c = LoadBytes8(p);
    const __m256i m7 = _mm256_and_si256(c, I32(0x7fu));
    const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(m7, f.mant_shift), I32(f.rebias));
    const __m256 sub =
        _mm256_mul_ps(_mm256_cvtepi32_ps(m7), _mm256_set1_ps(1.0f / f.subnormal_scale));
    __m256i bits = _mm256_blendv_epi8(normal, _mm256_castps_si256(sub),
                                      _mm256_cmpgt_epi32(I32(1u << (23 - f.mant_shift)), m7));
    bits = _mm256_blendv_epi8(bits, I32(0x7fc00000u), _mm256_cmpeq_epi32(m7, I32(f.nan_code)));
    return _mm256_castsi256_ps(
        _mm256_or_si256(bits, _mm256_slli_epi32(_mm256_and_si256(c, I32(0x80u)), 24)));
  }
}

// ClampToFloatRange on eight lanes.
KVBANK_AVX2 inline __m256 ClampToFloatRangex8(__m256 v) {
  v = _mm256_max_ps(_mm256_set1_ps(-kFloatMax), v);    // -max > v ? -max : v
  return _mm256_min_ps(_mm256_set1_ps(kFloatMax), v);  // max < v ? max : v
}

// DecodeFp8 on eight bytes.
template <DType F>
KVBANK_AVX2 inline __m256 DecodeFp8x8(const uint8_t* p, __m256 scale) {
  const __m256 f = Fp8ToFloatx8<F>(p);
  const __m256 v = _mm256_mul_ps(f, scale);
  const __m256i e = I32(0x7f800000u);
  const __m256i nonfinite = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(f), e), e);
  return _mm256_blendv_ps(ClampToFloatRangex8(v), v, _mm256_castsi256_ps(nonfinite));
}

KVBANK_AVX2 inline float HorizontalMin(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_min_ss(m, _mm_shuffle_ps(m, m, 1)));
}

KVBANK_AVX2 inline float HorizontalMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

template <DType S, DType D>
KVBANK_AVX2 void ConvertAvx2T(const void* src, void* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) Store8<D>(dst, i, Load8<S>(src, i));
  for (; i < n; ++i) StoreFromFloat(dst, D, i, LoadAsFloat(src, S, i));
}

void ConvertAvx2(const void* src, DType sd, void* dst, DType dd, size_t n) {
  if (SameDTypeCopy(src, sd, dst, dd, n)) return;
  VisitElem(sd, [&](auto s) {
    VisitElem(dd, [&](auto d) { ConvertAvx2T<s.value, d.value>(src, dst, n); });
  });
}

KVBANK_AVX2 int64_t FindNonFiniteAvx2(const void* src, DType dtype, size_t n) {
  size_t i = 0;
  if (dtype == DType::kFp32) {
    const uint32_t* p = static_cast<const uint32_t*>(src);
    const __m256i e = I32(0x7f800000u);
    for (; i + 32 <= n; i += 32) {
      __m256i any = _mm256_setzero_si256();
      for (int k = 0; k < 4; ++k) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 8 * k));
        any = _mm256_or_si256(any, _mm256_cmpeq_epi32(_mm256_and_si256(v, e), e));
      }
      if (!_mm256_testz_si256(any, any)) break;  // the scalar tail finds the exact index
    }
  } else if (dtype == DType::kFp16 || dtype == DType::kBf16) {
    const uint16_t* p = static_cast<const uint16_t*>(src);
    const __m256i e =
        _mm256_set1_epi16(static_cast<short>(dtype == DType::kFp16 ? 0x7c00 : 0x7f80));
    for (; i + 64 <= n; i += 64) {
      __m256i any = _mm256_setzero_si256();
      for (int k = 0; k < 4; ++k) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 16 * k));
        any = _mm256_or_si256(any, _mm256_cmpeq_epi16(_mm256_and_si256(v, e), e));
      }
      if (!_mm256_testz_si256(any, any)) break;
    }
  }
  const int64_t rest =
      FindNonFiniteScalar(static_cast<const uint8_t*>(src) + i * DTypeBytes(dtype), dtype, n - i);
  return rest < 0 ? -1 : static_cast<int64_t>(i) + rest;
}

template <DType S>
KVBANK_AVX2 float AbsMaxAvx2T(const void* src, size_t n) {
  __m256 m = _mm256_setzero_ps();
  const __m256i abs_mask = I32(0x7fffffffu);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a =
        _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(Load8<S>(src, i)), abs_mask));
    m = _mm256_max_ps(a, m);  // a > m ? a : m, as the scalar loop
  }
  float r = HorizontalMax(m);
  for (; i < n; ++i) {
    const float a = fabsf(LoadAsFloat(src, S, i));
    r = a > r ? a : r;
  }
  return r;
}

float AbsMaxAvx2(const void* src, DType dtype, size_t n) {
  float r = 0.0f;
  VisitElem(dtype, [&](auto s) { r = AbsMaxAvx2T<s.value>(src, n); });
  return r;
}

// min and max of one row (tail lanes by the scalar rule).
template <DType S>
KVBANK_AVX2 inline void RowMinMax(const void* src, size_t base, uint32_t dim, float* mn_out,
                                  float* mx_out) {
  // Two accumulators each halve the dependency chain; min/max are exact, so the order of the
  // reduction cannot change the result (+-0 ties aside, which Int8ParamsFor treats alike).
  __m256 mn0 = _mm256_set1_ps(INFINITY), mn1 = mn0;
  __m256 mx0 = _mm256_set1_ps(-INFINITY), mx1 = mx0;
  uint32_t i = 0;
  for (; i + 16 <= dim; i += 16) {
    const __m256 a = Load8<S>(src, base + i), b = Load8<S>(src, base + i + 8);
    mn0 = _mm256_min_ps(a, mn0);  // x < mn ? x : mn (NaN lanes keep mn), as the scalar loop
    mn1 = _mm256_min_ps(b, mn1);
    mx0 = _mm256_max_ps(a, mx0);
    mx1 = _mm256_max_ps(b, mx1);
  }
  for (; i + 8 <= dim; i += 8) {
    const __m256 a = Load8<S>(src, base + i);
    mn0 = _mm256_min_ps(a, mn0);
    mx0 = _mm256_max_ps(a, mx0);
  }
  float mn = HorizontalMin(_mm256_min_ps(mn0, mn1)), mx = HorizontalMax(_mm256_max_ps(mx0, mx1));
  for (; i < dim; ++i) {
    const float x = LoadAsFloat(src, S, base + i);
    mn = x < mn ? x : mn;
    mx = x > mx ? x : mx;
  }
  *mn_out = mn;
  *mx_out = mx;
}

// QuantizeInt8(x, inv, zp) on eight lanes, as int32 in [0, 255].
KVBANK_AVX2 inline __m256i QuantizeInt8x8(__m256 x, __m256 inv, __m256 zp) {
  __m256 t = _mm256_round_ps(_mm256_mul_ps(x, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  t = _mm256_add_ps(t, zp);
  t = _mm256_max_ps(t, _mm256_setzero_ps());           // t > 0 ? t : 0
  t = _mm256_min_ps(t, _mm256_set1_ps(kInt8CodeMax));  // t < max ? t : max
  return _mm256_cvttps_epi32(t);
}

template <DType S>
KVBANK_AVX2 void QuantizeInt8RowsAvx2T(const void* src, size_t rows, uint32_t dim, uint8_t* q,
                                       float* scales, uint8_t* zero_points) {
  // Rows go in batches: the min/max of every row, then every row's parameters (the fp64
  // divisions of independent rows overlap instead of stalling each row), then the codes.
  constexpr size_t kBatch = 16;
  float mn[kBatch], mx[kBatch];
  Int8RowParams p[kBatch];
  for (size_t r0 = 0; r0 < rows; r0 += kBatch) {
    const size_t nb = rows - r0 < kBatch ? rows - r0 : kBatch;
    for (size_t j = 0; j < nb; ++j) RowMinMax<S>(src, (r0 + j) * dim, dim, &mn[j], &mx[j]);
    for (size_t j = 0; j < nb; ++j) p[j] = Int8ParamsFor(mn[j], mx[j]);
    for (size_t j = 0; j < nb; ++j) {
      const size_t r = r0 + j, base = r * dim;
      scales[r] = p[j].scale;
      zero_points[r] = p[j].zero_point;
      if (p[j].constant) {
        std::memset(q + base, p[j].constant_code, dim);
        continue;
      }
      const __m256 inv = _mm256_set1_ps(p[j].inv_scale);
      const __m256 zp = _mm256_set1_ps(float(p[j].zero_point));
      uint32_t i = 0;
      for (; i + 32 <= dim; i += 32) {
        const __m256i a = QuantizeInt8x8(Load8<S>(src, base + i), inv, zp);
        const __m256i b = QuantizeInt8x8(Load8<S>(src, base + i + 8), inv, zp);
        const __m256i c = QuantizeInt8x8(Load8<S>(src, base + i + 16), inv, zp);
        const __m256i d = QuantizeInt8x8(Load8<S>(src, base + i + 24), inv, zp);
        // packs work within 128-bit lanes: bytes come out as a0 b0 c0 d0 a1 b1 c1 d1 (4 each).
        const __m256i bytes =
            _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(q + base + i),
            _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      }
      for (; i + 8 <= dim; i += 8) {
        StoreBytes8(q + base + i, QuantizeInt8x8(Load8<S>(src, base + i), inv, zp));
      }
      QuantizeSpanScalar<S>(src, base, i, dim, p[j], q);
    }
  }
}

void QuantizeInt8RowsAvx2(const void* src, DType sd, size_t rows, uint32_t dim, uint8_t* q,
                          float* scales, uint8_t* zero_points) {
  VisitElem(
      sd, [&](auto s) { QuantizeInt8RowsAvx2T<s.value>(src, rows, dim, q, scales, zero_points); });
}

template <DType D>
KVBANK_AVX2 void DequantizeInt8RowsAvx2T(const uint8_t* q, const float* scales,
                                         const uint8_t* zero_points, size_t rows, uint32_t dim,
                                         void* dst) {
  for (size_t r = 0; r < rows; ++r) {
    const size_t base = r * dim;
    const __m256i zp = I32(zero_points[r]);
    const __m256 scale = _mm256_set1_ps(scales[r]);
    uint32_t i = 0;
    for (; i + 8 <= dim; i += 8) {
      const __m256i d = _mm256_sub_epi32(LoadBytes8(q + base + i), zp);
      Store8<D>(dst, base + i, ClampToFloatRangex8(_mm256_mul_ps(_mm256_cvtepi32_ps(d), scale)));
    }
    for (; i < dim; ++i) {
      StoreFromFloat(dst, D, base + i, DequantizeInt8(q[base + i], zero_points[r], scales[r]));
    }
  }
}

void DequantizeInt8RowsAvx2(const uint8_t* q, const float* scales, const uint8_t* zero_points,
                            size_t rows, uint32_t dim, void* dst, DType dd) {
  VisitElem(dd, [&](auto d) {
    DequantizeInt8RowsAvx2T<d.value>(q, scales, zero_points, rows, dim, dst);
  });
}

template <DType S, DType F>
KVBANK_AVX2 void EncodeFp8Avx2T(const void* src, size_t n, float scale, uint8_t* dst) {
  const float inv = RecipRn(scale);
  const __m256 vinv = _mm256_set1_ps(inv);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    StoreBytes8(dst + i, FloatToFp8x8<F>(_mm256_mul_ps(Load8<S>(src, i), vinv)));
  }
  for (; i < n; ++i) dst[i] = EncodeFp8(LoadAsFloat(src, S, i), inv, F);
}

void EncodeFp8Avx2(const void* src, DType sd, size_t n, float scale, DType fp8, uint8_t* dst) {
  VisitElem(sd, [&](auto s) {
    VisitFp8(fp8, [&](auto f) { EncodeFp8Avx2T<s.value, f.value>(src, n, scale, dst); });
  });
}

template <DType F, DType D>
KVBANK_AVX2 void DecodeFp8Avx2T(const uint8_t* src, size_t n, float scale, void* dst) {
  const __m256 vs = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) Store8<D>(dst, i, DecodeFp8x8<F>(src + i, vs));
  for (; i < n; ++i) StoreFromFloat(dst, D, i, DecodeFp8(src[i], scale, F));
}

void DecodeFp8Avx2(const uint8_t* src, DType fp8, size_t n, float scale, void* dst, DType dd) {
  VisitFp8(fp8, [&](auto f) {
    VisitElem(dd, [&](auto d) { DecodeFp8Avx2T<f.value, d.value>(src, n, scale, dst); });
  });
}

constexpr CodecOps kAvx2Ops = {
    "avx2",        ConvertAvx2,          FindNonFiniteAvx2,
    AbsMaxAvx2,    QuantizeInt8RowsAvx2, DequantizeInt8RowsAvx2,
    EncodeFp8Avx2, DecodeFp8Avx2,
};

#endif  // KVBANK_QUANT_X86

}  // namespace

const CodecOps& ScalarCodecOps() { return kScalarOps; }

const CodecOps* Avx2CodecOps() {
#if KVBANK_QUANT_X86
  static const bool supported = [] {
    __builtin_cpu_init();
    // clang does not know "f16c" in __builtin_cpu_supports; CPUID leaf 1 says it directly.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
    return __builtin_cpu_supports("avx2") && f16c;
  }();
  return supported ? &kAvx2Ops : nullptr;
#else
  return nullptr;
#endif
}

const CodecOps& ActiveCodecOps() {
  static const CodecOps* const ops = Avx2CodecOps() != nullptr ? Avx2CodecOps() : &kScalarOps;
  return *ops;
}

void ConvertElements(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n) {
  ActiveCodecOps().convert(src, src_dtype, dst, dst_dtype, n);
}

int64_t FindNonFinite(const void* src, DType dtype, size_t n) {
  return ActiveCodecOps().find_non_finite(src, dtype, n);
}

float AbsMax(const void* src, DType dtype, size_t n) {
  return ActiveCodecOps().abs_max(src, dtype, n);
}

void QuantizeInt8Rows(const void* src, DType src_dtype, size_t rows, uint32_t dim, uint8_t* q,
                      float* scales, uint8_t* zero_points) {
  ActiveCodecOps().quantize_int8_rows(src, src_dtype, rows, dim, q, scales, zero_points);
}

void DequantizeInt8Rows(const uint8_t* q, const float* scales, const uint8_t* zero_points,
                        size_t rows, uint32_t dim, void* dst, DType dst_dtype) {
  ActiveCodecOps().dequantize_int8_rows(q, scales, zero_points, rows, dim, dst, dst_dtype);
}

float Fp8ScaleFor(float amax, DType fp8) { return qmath::Fp8ScaleFor(amax, fp8); }

float Fp8Max(DType fp8) { return qmath::Fp8Max(fp8); }

void EncodeFp8(const void* src, DType src_dtype, size_t n, float scale, DType fp8, uint8_t* dst) {
  ActiveCodecOps().encode_fp8(src, src_dtype, n, scale, fp8, dst);
}

void DecodeFp8(const uint8_t* src, DType fp8, size_t n, float scale, void* dst, DType dst_dtype) {
  ActiveCodecOps().decode_fp8(src, fp8, n, scale, dst, dst_dtype);
}

}  // namespace kvbank::kernels
