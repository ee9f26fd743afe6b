// CPU codec tests: exhaustive fp16 / bf16 / fp8 conversions against references built from ldexp
// and brute-force nearest search, round trips of every storage dtype within the bound its scale
// implies (odd dims, special rows: constant, zero, huge, subnormal), never NaN or Inf from finite
// input, FindNonFinite, the AVX2 path against the scalar one bit for bit, and a block quantized
// through the layout function's offsets. Seeds are fixed and printed.
#include "kernels/quant.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/quant_math.h"
#include "kvbank/layout.h"

namespace kvbank::kernels {
namespace {

using qmath::BitsFloat;
using qmath::FloatBits;

constexpr uint64_t kSeed = 20261130;
const uint32_t kDims[] = {1, 3, 7, 64, 72, 128, 576};
const DType kElem[] = {DType::kFp32, DType::kFp16, DType::kBf16};
const DType kFp8[] = {DType::kFp8E4M3, DType::kFp8E5M2};

// ---- references -------------------------------------------------------------------------------

// Exact value of an fp16 / bf16 / fp8 bit pattern from its fields (finite patterns only).
double RefValue(uint32_t bits, int exp_bits, int mant_bits) {
  const int bias = (1 << (exp_bits - 1)) - 1;
  const uint32_t m = bits & ((1u << mant_bits) - 1);
  const uint32_t e = (bits >> mant_bits) & ((1u << exp_bits) - 1);
  const bool neg = (bits >> (exp_bits + mant_bits)) & 1;
  const double v = e == 0 ? std::ldexp(double(m), 1 - bias - mant_bits)
                          : std::ldexp(double(m + (1u << mant_bits)), int(e) - bias - mant_bits);
  return neg ? -v : v;
}

// Positive finite values of a format, ascending, with their codes.
struct Grid {
  std::vector<double> value;
  std::vector<uint32_t> code;
};
Grid PositiveGrid(int exp_bits, int mant_bits, uint32_t max_code) {
  Grid g;
  for (uint32_t c = 0; c <= max_code; ++c) {
    g.value.push_back(RefValue(c, exp_bits, mant_bits));
    g.code.push_back(c);
  }
  return g;
}

// Nearest code (ties to the even code), saturating at the top of the grid. Positive x only.
uint32_t RefNearest(const Grid& g, double x) {
  if (x >= g.value.back()) return g.code.back();
  const size_t hi = std::upper_bound(g.value.begin(), g.value.end(), x) - g.value.begin();
  if (hi == 0) return g.code[0];
  const size_t lo = hi - 1;
  if (g.value[lo] == x) return g.code[lo];
  const double dlo = x - g.value[lo], dhi = g.value[hi] - x;
  if (dlo < dhi) return g.code[lo];
  if (dhi < dlo) return g.code[hi];
  return (g.code[lo] & 1) == 0 ? g.code[lo] : g.code[hi];
}

float RandomFloatBits(std::mt19937_64& rng) { return BitsFloat(static_cast<uint32_t>(rng())); }

// Log-uniform magnitudes over [2^lo, 2^hi), random sign.
float RandomLogUniform(std::mt19937_64& rng, int lo, int hi) {
  std::uniform_real_distribution<double> e(lo, hi);
  const double v = std::exp2(e(rng));
  return static_cast<float>(rng() & 1 ? -v : v);
}

// ---- exhaustive element conversions ----------------------------------------------------------

TEST(QuantConvert, Fp16AllPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = qmath::HalfToFloat(static_cast<uint16_t>(h));
    const bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
    const bool inf = (h & 0x7fff) == 0x7c00;
    if (nan) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      const uint16_t back = qmath::FloatToHalf(f, false);
      ASSERT_EQ(back, h | 0x200) << std::hex << h;  // quieted, payload kept
      continue;
    }
    if (inf) {
      ASSERT_TRUE(std::isinf(f) && std::signbit(f) == bool(h & 0x8000)) << std::hex << h;
    } else {
      ASSERT_EQ(double(f), RefValue(h, 5, 10)) << std::hex << h;
    }
    ASSERT_EQ(qmath::FloatToHalf(f, false), h) << std::hex << h;
    ASSERT_EQ(qmath::FloatToHalf(f, true), h) << std::hex << h;  // Inf stays Inf
  }
}

TEST(QuantConvert, Fp16RoundingBoundaries) {
  // Every midpoint between neighbouring fp16 values, and the floats just beside it.
  for (uint32_t h = 0; h < 0x7bff; ++h) {
    const double lo = RefValue(h, 5, 10), hi = RefValue(h + 1, 5, 10);
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(double(mid), (lo + hi) / 2);  // 12 significant bits: exact in fp32
    for (uint32_t sign : {0u, 0x8000u}) {
      const float s = sign ? -1.0f : 1.0f;
      ASSERT_EQ(qmath::FloatToHalf(s * mid, false), sign | ((h & 1) == 0 ? h : h + 1)) << h;
      ASSERT_EQ(qmath::FloatToHalf(s * std::nextafter(mid, 1e9f), false), sign | (h + 1)) << h;
      ASSERT_EQ(qmath::FloatToHalf(s * std::nextafter(mid, 0.0f), false), sign | h) << h;
    }
  }
  // Past the top: 65520 is the tie between 65504 and 2^16 (Inf).
  EXPECT_EQ(qmath::FloatToHalf(65520.0f, false), 0x7c00);
  EXPECT_EQ(qmath::FloatToHalf(65520.0f, true), 0x7bff);
  EXPECT_EQ(qmath::FloatToHalf(std::nextafter(65520.0f, 0.0f), false), 0x7bff);
  EXPECT_EQ(qmath::FloatToHalf(-1e30f, true), 0xfbff);
  EXPECT_EQ(qmath::FloatToHalf(-1e30f, false), 0xfc00);
  EXPECT_EQ(qmath::FloatToHalf(-INFINITY, true), 0xfc00);
  EXPECT_EQ(qmath::FloatToHalf(1e-30f, false), 0x0000);
  EXPECT_EQ(qmath::FloatToHalf(-1e-30f, false), 0x8000);
}

TEST(QuantConvert, Fp16RandomAgainstNearestSearch) {
  std::mt19937_64 rng(kSeed);
  std::printf("seed=%llu\n", static_cast<unsigned long long>(kSeed));
  const Grid g = PositiveGrid(5, 10, 0x7bff);
  for (int i = 0; i < 200000; ++i) {
    const float f = RandomLogUniform(rng, -30, 17);
    const uint32_t want = (f < 0 ? 0x8000u : 0u) | RefNearest(g, std::fabs(double(f)));
    ASSERT_EQ(qmath::FloatToHalf(f, true), want) << f;
  }
}

TEST(QuantConvert, Bf16AllPatterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = qmath::Bf16ToFloat(static_cast<uint16_t>(b));
    ASSERT_EQ(FloatBits(f), b << 16);
    if (std::isnan(f)) {
      ASSERT_EQ(qmath::FloatToBf16(f, true), b | 0x40) << std::hex << b;
    } else {
      ASSERT_EQ(double(f), (b & 0x7fff) == 0x7f80 ? double(f) : RefValue(b, 8, 7));
      ASSERT_EQ(qmath::FloatToBf16(f, false), b) << std::hex << b;
      ASSERT_EQ(qmath::FloatToBf16(f, true), b) << std::hex << b;
    }
  }
  for (uint32_t b = 0; b < 0x7f7f; ++b) {
    const double lo = RefValue(b, 8, 7), hi = RefValue(b + 1, 8, 7);
    const float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(double(mid), (lo + hi) / 2);
    ASSERT_EQ(qmath::FloatToBf16(mid, false), (b & 1) == 0 ? b : b + 1) << b;
    ASSERT_EQ(qmath::FloatToBf16(std::nextafter(mid, INFINITY), false), b + 1) << b;
    ASSERT_EQ(qmath::FloatToBf16(std::nextafter(mid, 0.0f), false), b) << b;
  }
  EXPECT_EQ(qmath::FloatToBf16(FLT_MAX, false), 0x7f80);  // rounds to Inf
  EXPECT_EQ(qmath::FloatToBf16(FLT_MAX, true), 0x7f7f);
  EXPECT_EQ(qmath::FloatToBf16(-FLT_MAX, true), 0xff7f);
  EXPECT_EQ(qmath::FloatToBf16(-INFINITY, true), 0xff80);
}

TEST(QuantConvert, Fp8AllCodes) {
  for (DType fp8 : kFp8) {
    const bool e4 = fp8 == DType::kFp8E4M3;
    const int eb = e4 ? 4 : 5, mb = e4 ? 3 : 2;
    for (uint32_t c = 0; c < 256; ++c) {
      const float f = e4 ? qmath::Fp8E4M3ToFloat(uint8_t(c)) : qmath::Fp8E5M2ToFloat(uint8_t(c));
      const uint32_t mag = c & 0x7f;
      const bool nan = e4 ? mag == 0x7f : mag > 0x7c;
      const bool inf = !e4 && mag == 0x7c;
      const uint8_t back = e4 ? qmath::FloatToFp8E4M3(f) : qmath::FloatToFp8E5M2(f);
      if (nan) {
        ASSERT_TRUE(std::isnan(f)) << c;
        ASSERT_EQ(back & 0x7f, e4 ? 0x7f : 0x7e) << c;
        continue;
      }
      if (inf) {
        ASSERT_TRUE(std::isinf(f)) << c;
      } else {
        ASSERT_EQ(double(f), RefValue(c, eb, mb)) << DTypeName(fp8) << " " << c;
      }
      if (!e4) {
        ASSERT_EQ(FloatBits(f), FloatBits(qmath::HalfToFloat(uint16_t(c << 8))));
      }
      ASSERT_EQ(back, c) << DTypeName(fp8) << " " << c;
    }
    EXPECT_EQ(qmath::Fp8Max(fp8), e4 ? 448.0f : 57344.0f);
  }
}

// The one table of fp8 constants (qmath::Fp8FormatOf) against the formats' codes: the max and
// its bits and code, NaN's code, the smallest normal, the subnormal step, the exponent rebias.
// Fp8IsNonFinite flags exactly the codes that decode to NaN or Inf.
TEST(QuantConvert, Fp8FormatTableMatchesTheCodes) {
  for (DType fp8 : kFp8) {
    SCOPED_TRACE(DTypeName(fp8));
    const bool e4 = fp8 == DType::kFp8E4M3;
    const qmath::Fp8Format f = qmath::Fp8FormatOf(fp8);
    auto dec = [&](uint32_t c) {
      return e4 ? qmath::Fp8E4M3ToFloat(uint8_t(c)) : qmath::Fp8E5M2ToFloat(uint8_t(c));
    };
    const uint32_t mant_bits = 23 - f.mant_shift;
    EXPECT_EQ(mant_bits, e4 ? 3u : 2u);
    EXPECT_EQ(dec(f.max_code), f.max);
    EXPECT_EQ(FloatBits(f.max), f.max_bits);
    EXPECT_TRUE(std::isfinite(dec(f.max_code)));
    EXPECT_FALSE(std::isfinite(dec(f.max_code + 1)));  // the next code is Inf or NaN
    EXPECT_TRUE(std::isnan(dec(f.nan_code)));
    EXPECT_EQ(FloatBits(dec(1u << mant_bits)), f.min_normal_bits);  // exponent field 1
    EXPECT_EQ(dec(1), 1.0f / f.subnormal_scale);                    // the subnormal step
    // Exponent field e holds 2^(e - bias); fp32 holds it at e + 127 - bias: rebias = 127 - bias.
    EXPECT_EQ(FloatBits(dec(1u << mant_bits)) - (1u << 23), f.rebias);
    EXPECT_EQ(qmath::Fp8Max(fp8), f.max);
    for (uint32_t c = 0; c < 256; ++c) {
      ASSERT_EQ(Fp8IsNonFinite(uint8_t(c), fp8), !std::isfinite(dec(c))) << c;
    }
  }
  EXPECT_EQ(qmath::QuantizeInt8(1e30f, 1.0f, 0.0f), uint8_t(qmath::kInt8CodeMax));
  EXPECT_EQ(qmath::Int8ParamsFor(0.0f, qmath::kInt8CodeMax).scale, 1.0f);
}

TEST(QuantConvert, Fp8RoundingAndSaturation) {
  std::mt19937_64 rng(kSeed + 1);
  for (DType fp8 : kFp8) {
    const bool e4 = fp8 == DType::kFp8E4M3;
    const Grid g = PositiveGrid(e4 ? 4 : 5, e4 ? 3 : 2, e4 ? 0x7e : 0x7b);
    auto enc = [&](float f) { return e4 ? qmath::FloatToFp8E4M3(f) : qmath::FloatToFp8E5M2(f); };
    for (size_t k = 0; k + 1 < g.value.size(); ++k) {
      const float mid = static_cast<float>((g.value[k] + g.value[k + 1]) / 2);
      ASSERT_EQ(enc(mid), RefNearest(g, mid)) << DTypeName(fp8) << " " << mid;
      ASSERT_EQ(enc(-mid), 0x80 | RefNearest(g, mid));
      ASSERT_EQ(enc(std::nextafter(mid, INFINITY)), g.code[k + 1]);
      ASSERT_EQ(enc(std::nextafter(mid, 0.0f)), g.code[k]);
    }
    for (int i = 0; i < 100000; ++i) {
      const float f = RandomLogUniform(rng, e4 ? -14 : -22, e4 ? 12 : 20);
      ASSERT_EQ(enc(f), (f < 0 ? 0x80u : 0u) | RefNearest(g, std::fabs(double(f)))) << f;
    }
    // Saturation to max finite; Inf -> NaN (e4m3) or Inf (e5m2); NaN -> NaN.
    EXPECT_EQ(enc(1e30f), e4 ? 0x7e : 0x7b);
    EXPECT_EQ(enc(-FLT_MAX), e4 ? 0xfe : 0xfb);
    EXPECT_EQ(enc(INFINITY), e4 ? 0x7f : 0x7c);
    EXPECT_EQ(enc(-INFINITY), e4 ? 0xff : 0xfc);
    EXPECT_EQ(enc(NAN) & 0x7f, e4 ? 0x7f : 0x7e);
    EXPECT_EQ(enc(-0.0f), 0x80);
    EXPECT_EQ(enc(1e-30f), 0x00);
  }
}

TEST(QuantConvert, PublicConvertRoundTripsAndSaturates) {
  // Every fp16 / bf16 pattern through fp32 and back, and across to the other 16-bit type.
  std::vector<uint16_t> all(65536), back(65536);
  std::vector<float> f32(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  for (DType d : {DType::kFp16, DType::kBf16}) {
    ConvertElements(all.data(), d, f32.data(), DType::kFp32, all.size());
    ConvertElements(f32.data(), DType::kFp32, back.data(), d, all.size());
    for (uint32_t i = 0; i < 65536; ++i) {
      const bool nan = std::isnan(f32[i]);
      ASSERT_EQ(back[i], nan ? (i | (d == DType::kFp16 ? 0x200 : 0x40)) : i) << DTypeName(d) << i;
    }
  }
  // Finite values past fp16's range saturate; Inf and NaN pass.
  const float big[] = {1e5f, -1e30f, FLT_MAX, INFINITY, -INFINITY, NAN, 65519.0f, 65520.0f};
  uint16_t h[8];
  ConvertElements(big, DType::kFp32, h, DType::kFp16, 8);
  const uint16_t want[] = {0x7bff, 0xfbff, 0x7bff, 0x7c00, 0xfc00, 0x7e00, 0x7bff, 0x7bff};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(h[i], want[i]) << i;
  // bf16 -> fp16 of a value past 65504 saturates too.
  uint16_t b = qmath::FloatToBf16(1e10f, false), o = 0;
  ConvertElements(&b, DType::kBf16, &o, DType::kFp16, 1);
  EXPECT_EQ(o, 0x7bff);
  // In place, same width.
  std::vector<uint16_t> inplace = {qmath::FloatToHalf(1.5f, false),
                                   qmath::FloatToHalf(-2.0f, false)};
  ConvertElements(inplace.data(), DType::kFp16, inplace.data(), DType::kBf16, inplace.size());
  EXPECT_EQ(qmath::Bf16ToFloat(inplace[0]), 1.5f);
  EXPECT_EQ(qmath::Bf16ToFloat(inplace[1]), -2.0f);
}

// ---- FindNonFinite ----------------------------------------------------------------------------

std::vector<uint8_t> Encode(const std::vector<float>& v, DType d) {
  std::vector<uint8_t> out(v.size() * DTypeBytes(d));
  for (size_t i = 0; i < v.size(); ++i) {
    if (d == DType::kFp32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      // Saturating, as the input path would: values past the dtype's range become its max.
      const uint16_t b =
          d == DType::kFp16 ? qmath::FloatToHalf(v[i], true) : qmath::FloatToBf16(v[i], true);
      std::memcpy(out.data() + 2 * i, &b, 2);
    }
  }
  return out;
}

TEST(QuantValidate, FindNonFiniteFindsTheFirst) {
  for (DType d : kElem) {
    for (size_t n :
         {size_t{0}, size_t{1}, size_t{7}, size_t{33}, size_t{64}, size_t{65}, size_t{1000}}) {
      std::vector<float> v(n, 1.0f);
      if (n > 0) v[n - 1] = d == DType::kFp16 ? 65504.0f : FLT_MAX / 2;  // largest finite-ish
      EXPECT_EQ(FindNonFinite(Encode(v, d).data(), d, n), -1) << DTypeName(d) << " " << n;
      for (float bad : {NAN, INFINITY, -INFINITY}) {
        for (size_t at : {size_t{0}, n / 2, n > 0 ? n - 1 : 0}) {
          if (at >= n) continue;
          std::vector<float> w = v;
          w[at] = bad;
          if (at + 3 < n) w[at + 3] = NAN;  // a later one must not win
          EXPECT_EQ(FindNonFinite(Encode(w, d).data(), d, n), int64_t(at))
              << DTypeName(d) << " n=" << n << " at=" << at << " bad=" << bad;
        }
      }
    }
  }
  // Past fp16's range in fp32 is still finite (the codecs saturate it).
  const float f = 1e30f;
  EXPECT_EQ(FindNonFinite(&f, DType::kFp32, 1), -1);
}

// ---- round trips within bounds ----------------------------------------------------------------

// Storage kinds the tests and the bench sweep.
enum class Storage { kFp32, kFp16, kBf16, kInt8, kE4M3, kE5M2, kE5M2NoScale };
const Storage kStorages[] = {Storage::kFp32, Storage::kFp16, Storage::kBf16,       Storage::kInt8,
                             Storage::kE4M3, Storage::kE5M2, Storage::kE5M2NoScale};
const char* StorageName(Storage s) {
  switch (s) {
    case Storage::kFp32:
      return "fp32";
    case Storage::kFp16:
      return "fp16";
    case Storage::kBf16:
      return "bf16";
    case Storage::kInt8:
      return "int8";
    case Storage::kE4M3:
      return "fp8_e4m3";
    case Storage::kE5M2:
      return "fp8_e5m2";
    case Storage::kE5M2NoScale:
      return "fp8_e5m2 scale-free";
  }
  return "?";
}

// Half an ulp of |v| in an element dtype (0 for fp32: the tests' reference is fp32).
double HalfUlp(double v, DType d) {
  if (d == DType::kFp32) return 0;
  const int mant = d == DType::kFp16 ? 10 : 7;
  const int min_exp = d == DType::kFp16 ? -14 : -126;
  int e = std::ilogb(std::max(std::fabs(v), std::ldexp(1.0, min_exp)));
  return std::ldexp(1.0, e - mant - 1);
}

// Quantizes `rows` x `dim` values of `in` (given as fp32, stored in `in_dtype`) with storage `s`
// as one block (fp8: one scale over all rows), decodes to `in_dtype`, and checks every element
// against the bound. Returns the decoded values as fp32.
std::vector<float> RoundTripAndCheck(const std::vector<float>& in, DType in_dtype, size_t rows,
                                     uint32_t dim, Storage s, const std::string& what) {
  const size_t n = rows * dim;
  // The original values as the codec sees them (after rounding to in_dtype).
  const std::vector<uint8_t> src = Encode(in, in_dtype);
  std::vector<float> x(n);
  ConvertElements(src.data(), in_dtype, x.data(), DType::kFp32, n);
  std::vector<uint8_t> dec(n * DTypeBytes(in_dtype));
  std::vector<float> row_bound_abs(rows, 0.0f);
  double rel = 0;
  switch (s) {
    case Storage::kFp32:
    case Storage::kFp16:
    case Storage::kBf16: {
      const DType sd = s == Storage::kFp32   ? DType::kFp32
                       : s == Storage::kFp16 ? DType::kFp16
                                             : DType::kBf16;
      std::vector<uint8_t> stored(n * DTypeBytes(sd));
      ConvertElements(src.data(), in_dtype, stored.data(), sd, n);
      ConvertElements(stored.data(), sd, dec.data(), in_dtype, n);
      if (sd == in_dtype) {
        EXPECT_EQ(dec, src) << what << ": same dtype must be bit-identical";
      }
      rel = sd == DType::kFp32   ? 0
            : sd == DType::kFp16 ? std::ldexp(1.0, -11)
                                 : std::ldexp(1.0, -8);
      // Half the subnormal step of the storage dtype.
      if (sd != DType::kFp32) {
        std::fill(row_bound_abs.begin(), row_bound_abs.end(),
                  sd == DType::kFp16 ? 0x1p-25f : 0x1p-134f);
      }
      break;
    }
    case Storage::kInt8: {
      std::vector<uint8_t> q(n), zp(rows);
      std::vector<float> scales(rows);
      QuantizeInt8Rows(src.data(), in_dtype, rows, dim, q.data(), scales.data(), zp.data());
      DequantizeInt8Rows(q.data(), scales.data(), zp.data(), rows, dim, dec.data(), in_dtype);
      for (size_t r = 0; r < rows; ++r) {
        EXPECT_TRUE(std::isfinite(scales[r]) && scales[r] >= 0) << what << " row " << r;
        row_bound_abs[r] = scales[r] * 0.5f * (1 + 1e-5f);
      }
      rel = std::ldexp(1.0, -21);
      break;
    }
    case Storage::kE4M3:
    case Storage::kE5M2:
    case Storage::kE5M2NoScale: {
      const DType fp8 = s == Storage::kE4M3 ? DType::kFp8E4M3 : DType::kFp8E5M2;
      const float scale =
          s == Storage::kE5M2NoScale ? 1.0f : Fp8ScaleFor(AbsMax(src.data(), in_dtype, n), fp8);
      EXPECT_TRUE(std::isfinite(scale) && scale > 0) << what;
      std::vector<uint8_t> q(n);
      EncodeFp8(src.data(), in_dtype, n, scale, fp8, q.data());
      DecodeFp8(q.data(), fp8, n, scale, dec.data(), in_dtype);
      const double sub = s == Storage::kE4M3 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -17);
      rel =
          (s == Storage::kE4M3 ? std::ldexp(1.0, -4) : std::ldexp(1.0, -3)) + std::ldexp(1.0, -20);
      std::fill(row_bound_abs.begin(), row_bound_abs.end(), static_cast<float>(sub * scale));
      break;
    }
  }
  std::vector<float> y(n);
  ConvertElements(dec.data(), in_dtype, y.data(), DType::kFp32, n);
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(y[i])) {
      ADD_FAILURE() << what << ": non-finite " << y[i] << " at " << i << " from " << x[i];
      break;
    }
    // Storage formats with a fixed range (fp16, scale-free e5m2) saturate: the expected value is
    // x clamped to that range.
    const double cap = s == Storage::kFp16          ? 65504.0
                       : s == Storage::kE5M2NoScale ? 57344.0
                                                    : INFINITY;
    const double want = std::max(-cap, std::min(cap, double(x[i])));
    const double m = std::max(std::fabs(want), std::fabs(double(y[i])));
    const double bound = row_bound_abs[i / dim] + rel * std::fabs(want) + HalfUlp(m, in_dtype);
    const double err = std::fabs(double(y[i]) - want);
    if (!(err <= bound)) {
      ADD_FAILURE() << what << ": element " << i << " (row " << i / dim << ") x=" << x[i]
                    << " y=" << y[i] << " err=" << err << " bound=" << bound;
      break;
    }
  }
  return y;
}

std::string Describe(DType in, Storage s, uint32_t dim, const char* data) {
  return std::string(DTypeName(in)) + "->" + StorageName(s) + " dim=" + std::to_string(dim) + " " +
         data;
}

TEST(QuantRoundTrip, GaussianEveryDtypeAndDim) {
  std::mt19937_64 rng(kSeed + 2);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  const size_t rows = 17;
  for (DType in : kElem) {
    for (Storage s : kStorages) {
      for (uint32_t dim : kDims) {
        std::vector<float> v(rows * dim);
        // Rows of different magnitudes, some with an outlier channel, one all-positive row.
        for (size_t r = 0; r < rows; ++r) {
          const float mag = std::ldexp(1.0f, int(r % 9) - 4);
          for (uint32_t i = 0; i < dim; ++i) v[r * dim + i] = gauss(rng) * mag;
          if (r % 4 == 1) v[r * dim + (r % dim)] *= 60.0f;
          if (r == 5) {
            for (uint32_t i = 0; i < dim; ++i) v[r * dim + i] = 3.0f + std::fabs(v[r * dim + i]);
          }
        }
        RoundTripAndCheck(v, in, rows, dim, s, Describe(in, s, dim, "gaussian"));
      }
    }
  }
}

TEST(QuantRoundTrip, SpecialRows) {
  struct Case {
    const char* name;
    float a, b;  // row values alternate a, b (a == b: constant)
  };
  const Case cases[] = {
      {"zero", 0.0f, 0.0f},
      {"signed zeros", -0.0f, 0.0f},
      {"constant", 0.3f, 0.3f},
      {"negative constant", -7.25f, -7.25f},
      {"huge constant", 3.0e38f, 3.0e38f},
      {"tiny constant", 1.4e-45f, 1.4e-45f},
      {"fp16 max", -65504.0f, 65504.0f},
      {"fp16 max positive", 65504.0f, 65000.0f},
      {"fp32 1e30", -1e30f, 1e30f},
      {"fp32 max", -FLT_MAX, FLT_MAX},
      {"fp32 max one-sided", FLT_MAX, 1.0f},
      {"fp16 subnormal", 5.96e-8f, -1.2e-6f},
      {"fp32 subnormal", 1.4e-45f, -3.0e-40f},
      {"mixed tiny", 1e-38f, 2e-39f},
  };
  for (const Case& c : cases) {
    for (DType in : kElem) {
      // The fp16 input cannot hold the fp32-range cases; they saturate before the codec.
      for (Storage s : kStorages) {
        for (uint32_t dim : {1u, 7u, 72u}) {
          const size_t rows = 3;
          std::vector<float> v(rows * dim);
          for (size_t i = 0; i < v.size(); ++i) v[i] = (i % 2) ? c.b : c.a;
          const std::string what = Describe(in, s, dim, c.name);
          const std::vector<float> y = RoundTripAndCheck(v, in, rows, dim, s, what);
          if (c.a == c.b && s == Storage::kInt8 && in == DType::kFp32) {
            for (float f : y) ASSERT_EQ(f, c.a) << what << ": constant rows are exact";
          }
        }
      }
    }
  }
}

TEST(QuantRoundTrip, Int8ConstantRowsAreExactWithoutDivision) {
  for (float c : {0.0f, -0.0f, 1.0f, -1.0f, 3.0f, 1e-45f, -1e-45f, 3.4e38f, -FLT_MAX, 0.1f}) {
    std::vector<float> v(9, c), y(9);
    std::vector<uint8_t> q(9);
    float scale = -1;
    uint8_t zp = 99;
    QuantizeInt8Rows(v.data(), DType::kFp32, 1, 9, q.data(), &scale, &zp);
    EXPECT_EQ(scale, std::fabs(c)) << c;
    DequantizeInt8Rows(q.data(), &scale, &zp, 1, 9, y.data(), DType::kFp32);
    for (float f : y) EXPECT_EQ(f, c) << c;  // -0 comes back as +0, which compares equal
  }
}

TEST(QuantRoundTrip, ScaleFreeE5M2SaturatesOutOfRange) {
  const float v[] = {1e5f, -1e30f, 57344.0f, 60000.0f, 1.0f, 3e-5f};
  uint8_t q[6];
  float y[6];
  EncodeFp8(v, DType::kFp32, 6, 1.0f, DType::kFp8E5M2, q);
  DecodeFp8(q, DType::kFp8E5M2, 6, 1.0f, y, DType::kFp32);
  EXPECT_EQ(y[0], 57344.0f);
  EXPECT_EQ(y[1], -57344.0f);
  EXPECT_EQ(y[2], 57344.0f);
  EXPECT_EQ(y[3], 57344.0f);
  EXPECT_EQ(y[4], 1.0f);
  EXPECT_NEAR(y[5], 3e-5f, std::ldexp(1.0, -17));
}

TEST(QuantRoundTrip, Fp8ScaleFor) {
  EXPECT_EQ(Fp8ScaleFor(0.0f, DType::kFp8E4M3), 1.0f);
  EXPECT_EQ(Fp8ScaleFor(448.0f, DType::kFp8E4M3), 1.0f);
  EXPECT_EQ(Fp8ScaleFor(57344.0f, DType::kFp8E5M2), 1.0f);
  EXPECT_EQ(Fp8ScaleFor(896.0f, DType::kFp8E4M3), 2.0f);
  EXPECT_EQ(Fp8ScaleFor(1e-45f, DType::kFp8E4M3), FLT_MIN);
  EXPECT_TRUE(std::isfinite(Fp8ScaleFor(INFINITY, DType::kFp8E4M3)));
  EXPECT_TRUE(std::isfinite(1.0f / Fp8ScaleFor(FLT_MAX, DType::kFp8E5M2)));
}

// No NaN or Inf ever comes out of finite input, whatever its bits (random finite patterns cover
// subnormals, huge values and everything between).
TEST(QuantRoundTrip, NeverNonFiniteFromFiniteInput) {
  std::mt19937_64 rng(kSeed + 3);
  for (DType in : kElem) {
    for (uint32_t dim : {5u, 64u, 128u}) {
      const size_t rows = 64, n = rows * dim;
      std::vector<uint8_t> src(n * DTypeBytes(in));
      for (size_t i = 0; i < n; ++i) {
        uint32_t b;
        do {
          b = static_cast<uint32_t>(rng());
          if (in != DType::kFp32) b &= 0xffff;
        } while (in == DType::kFp32   ? (b & 0x7f800000u) == 0x7f800000u
                 : in == DType::kFp16 ? (b & 0x7c00u) == 0x7c00u
                                      : (b & 0x7f80u) == 0x7f80u);
        std::memcpy(src.data() + i * DTypeBytes(in), &b, DTypeBytes(in));
      }
      ASSERT_EQ(FindNonFinite(src.data(), in, n), -1);
      std::vector<uint8_t> q(n), zp(rows), out(n * DTypeBytes(in));
      std::vector<float> scales(rows);
      QuantizeInt8Rows(src.data(), in, rows, dim, q.data(), scales.data(), zp.data());
      DequantizeInt8Rows(q.data(), scales.data(), zp.data(), rows, dim, out.data(), in);
      EXPECT_EQ(FindNonFinite(out.data(), in, n), -1) << "int8 " << DTypeName(in);
      for (DType fp8 : kFp8) {
        for (bool scale_free : {false, true}) {
          if (scale_free && fp8 == DType::kFp8E4M3) continue;
          const float scale = scale_free ? 1.0f : Fp8ScaleFor(AbsMax(src.data(), in, n), fp8);
          EncodeFp8(src.data(), in, n, scale, fp8, q.data());
          DecodeFp8(q.data(), fp8, n, scale, out.data(), in);
          EXPECT_EQ(FindNonFinite(out.data(), in, n), -1) << DTypeName(fp8) << " " << DTypeName(in);
        }
      }
      for (DType to : kElem) {
        std::vector<uint8_t> conv(n * DTypeBytes(to));
        ConvertElements(src.data(), in, conv.data(), to, n);
        EXPECT_EQ(FindNonFinite(conv.data(), to, n), -1) << DTypeName(in) << "->" << DTypeName(to);
      }
    }
  }
}

// ---- AVX2 == scalar ---------------------------------------------------------------------------

TEST(QuantVector, Avx2MatchesScalarBitForBit) {
  const CodecOps* v = Avx2CodecOps();
  if (v == nullptr) GTEST_SKIP() << "no AVX2 + F16C on this machine (or not x86-64)";
  const CodecOps& s = ScalarCodecOps();
  EXPECT_EQ(&ActiveCodecOps(), v);
  std::mt19937_64 rng(kSeed + 4);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  const size_t lens[] = {0, 1, 7, 8, 9, 31, 63, 64, 65, 200, 1031};
  for (int mode = 0; mode < 2; ++mode) {  // 0: Gaussian values, 1: random bits (NaN, Inf, all)
    for (DType in : kElem) {
      for (size_t n : lens) {
        std::vector<float> f(n);
        for (float& x : f) x = mode == 0 ? gauss(rng) * 3.0f : RandomFloatBits(rng);
        std::vector<uint8_t> src = Encode(f, in);
        if (mode == 1 && in != DType::kFp32) {
          for (uint8_t& b : src) b = static_cast<uint8_t>(rng());
        }
        const std::string what = std::string(DTypeName(in)) + " n=" + std::to_string(n) +
                                 (mode ? " random bits" : " gaussian");
        for (DType to : kElem) {
          std::vector<uint8_t> a(n * DTypeBytes(to) + 1, 0xAA), b(a);
          s.convert(src.data(), in, a.data(), to, n);
          v->convert(src.data(), in, b.data(), to, n);
          ASSERT_EQ(a, b) << "convert " << what << " -> " << DTypeName(to);
        }
        ASSERT_EQ(s.find_non_finite(src.data(), in, n), v->find_non_finite(src.data(), in, n))
            << what;
        ASSERT_EQ(FloatBits(s.abs_max(src.data(), in, n)), FloatBits(v->abs_max(src.data(), in, n)))
            << what;
        for (DType fp8 : kFp8) {
          for (float scale : {1.0f, 0.0123f, Fp8ScaleFor(s.abs_max(src.data(), in, n), fp8)}) {
            std::vector<uint8_t> a(n + 1, 0xAA), b(a);
            s.encode_fp8(src.data(), in, n, scale, fp8, a.data());
            v->encode_fp8(src.data(), in, n, scale, fp8, b.data());
            ASSERT_EQ(a, b) << "encode " << what << " " << DTypeName(fp8) << " scale " << scale;
            std::vector<uint8_t> codes(n);
            for (uint8_t& c : codes) c = static_cast<uint8_t>(rng());
            for (DType to : kElem) {
              std::vector<uint8_t> da(n * DTypeBytes(to) + 1, 0xAA), db(da);
              s.decode_fp8(codes.data(), fp8, n, scale, da.data(), to);
              v->decode_fp8(codes.data(), fp8, n, scale, db.data(), to);
              ASSERT_EQ(da, db) << "decode " << DTypeName(fp8) << " -> " << DTypeName(to);
            }
          }
        }
      }
      for (uint32_t dim : kDims) {
        const size_t rows = 9, n = rows * dim;
        std::vector<float> f(n);
        for (float& x : f) x = mode == 0 ? gauss(rng) : RandomFloatBits(rng);
        for (uint32_t i = 0; i < dim; ++i) f[2 * dim + i] = 0.5f;  // a constant row
        const std::vector<uint8_t> src = Encode(f, in);
        std::vector<uint8_t> qa(n), qb(n), za(rows), zb(rows);
        std::vector<float> sa(rows), sb(rows);
        s.quantize_int8_rows(src.data(), in, rows, dim, qa.data(), sa.data(), za.data());
        v->quantize_int8_rows(src.data(), in, rows, dim, qb.data(), sb.data(), zb.data());
        ASSERT_EQ(qa, qb) << "int8 q " << DTypeName(in) << " dim " << dim;
        ASSERT_EQ(za, zb) << "int8 zp " << DTypeName(in) << " dim " << dim;
        ASSERT_EQ(0, std::memcmp(sa.data(), sb.data(), rows * 4)) << "int8 scale " << dim;
        for (DType to : kElem) {
          std::vector<uint8_t> da(n * DTypeBytes(to)), db(da.size());
          s.dequantize_int8_rows(qa.data(), sa.data(), za.data(), rows, dim, da.data(), to);
          v->dequantize_int8_rows(qa.data(), sa.data(), za.data(), rows, dim, db.data(), to);
          ASSERT_EQ(da, db) << "int8 dequant dim " << dim << " -> " << DTypeName(to);
        }
      }
    }
  }
}

// ---- through the layout function --------------------------------------------------------------

// One block of a two-layer model (int8 layer, fp8 layer), written head by head at the offsets the
// layout function gives, then read back: the codec's shapes are the block's.
TEST(QuantLayout, QuantizesABlockInPlace) {
  ModelLayout m;
  m.name = "quant";
  m.num_layers = 2;
  m.num_q_heads = 6;
  m.num_kv_heads = 3;
  m.head_dim = m.head_dim_v = 72;
  m.block_tokens = 7;
  m.input_dtype = DType::kBf16;
  m.layer_dtypes = {DType::kInt8, DType::kFp8E4M3};
  ASSERT_EQ(ValidateLayout(m), "");
  const BlockLayout b = ComputeBlockLayout(m);
  std::vector<uint8_t> block(b.block_bytes, 0xCD);
  std::mt19937_64 rng(kSeed + 5);
  std::normal_distribution<float> gauss(0.0f, 2.0f);
  const size_t head_elems = size_t{m.block_tokens} * m.head_dim;
  // src[layer][kv][head]: [block_tokens][head_dim] bf16.
  std::vector<std::vector<uint16_t>> src;
  for (uint32_t l = 0; l < 2; ++l) {
    const LayerView& v = b.layers[l];
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
        std::vector<uint16_t> x(head_elems);
        for (uint16_t& e : x) e = qmath::FloatToBf16(gauss(rng), false);
        uint8_t* rows = block.data() + (kv == 0 ? v.KRow(h, 0) : v.VRow(h, 0));
        if (v.dtype == DType::kInt8) {
          QuantizeInt8Rows(x.data(), DType::kBf16, m.block_tokens, m.head_dim, rows,
                           reinterpret_cast<float*>(block.data() + v.Int8Scale(kv, h, 0)),
                           block.data() + v.Int8ZeroPoint(kv, h, 0));
        } else {
          const float scale = Fp8ScaleFor(AbsMax(x.data(), DType::kBf16, head_elems), v.dtype);
          std::memcpy(block.data() + v.Fp8Scale(kv, h), &scale, 4);
          EncodeFp8(x.data(), DType::kBf16, head_elems, scale, v.dtype, rows);
        }
        src.push_back(std::move(x));
      }
    }
  }
  size_t k = 0;
  for (uint32_t l = 0; l < 2; ++l) {
    const LayerView& v = b.layers[l];
    for (uint32_t kv = 0; kv < 2; ++kv) {
      for (uint32_t h = 0; h < v.num_kv_heads; ++h, ++k) {
        const uint8_t* rows = block.data() + (kv == 0 ? v.KRow(h, 0) : v.VRow(h, 0));
        std::vector<float> y(head_elems);
        double bound_abs = 0, rel = 0;
        if (v.dtype == DType::kInt8) {
          const float* scales =
              reinterpret_cast<const float*>(block.data() + v.Int8Scale(kv, h, 0));
          DequantizeInt8Rows(rows, scales, block.data() + v.Int8ZeroPoint(kv, h, 0), m.block_tokens,
                             m.head_dim, y.data(), DType::kFp32);
          bound_abs = *std::max_element(scales, scales + m.block_tokens) * 0.50001;
        } else {
          float scale;
          std::memcpy(&scale, block.data() + v.Fp8Scale(kv, h), 4);
          DecodeFp8(rows, v.dtype, head_elems, scale, y.data(), DType::kFp32);
          bound_abs = scale * std::ldexp(1.0, -10);
          rel = std::ldexp(1.0, -4) + 1e-6;
        }
        for (size_t i = 0; i < head_elems; ++i) {
          const double x = qmath::Bf16ToFloat(src[k][i]);
          ASSERT_LE(std::fabs(y[i] - x), bound_abs + rel * std::fabs(x))
              << "layer " << l << " kv " << kv << " head " << h << " element " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvbank::kernels
