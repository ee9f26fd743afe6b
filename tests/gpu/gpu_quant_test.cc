// CUDA codecs against the CPU codecs, bit for bit: element conversions (every fp16 / bf16
// pattern), int8 rows (odd dims, constant, zero, huge and subnormal rows), fp8 scales, encode and
// decode (every code), and grids large enough to take the grid-stride loops. NaN results are
// compared as "both NaN" (the GPU's arithmetic returns its canonical NaN). Skips itself where no
// CUDA device is present. Needs neither Abseil nor the core: the kernels and the layout only.
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/quant.h"
#include "kernels/quant_cuda.h"
#include "kernels/quant_math.h"
#include "kvbank/layout.h"
#include "tests/gpu/gpu_testing.h"

namespace kvbank::kernels {
namespace {

constexpr uint64_t kSeed = 777001;
const DType kElem[] = {DType::kFp32, DType::kFp16, DType::kBf16};
const DType kFp8[] = {DType::kFp8E4M3, DType::kFp8E5M2};

class GpuQuantTest : public ::testing::Test {
 protected:
  void SetUp() override { KVBANK_SKIP_WITHOUT_CUDA(kSeed); }
  void TearDown() override {
    for (void* p : allocations_) cudaFree(p);
  }
  // A device copy of `host` (or `bytes` uninitialised bytes when host is empty).
  void* Device(const std::vector<uint8_t>& host, size_t bytes = 0) {
    void* p = nullptr;
    const size_t n = host.empty() ? bytes : host.size();
    EXPECT_EQ(cudaMalloc(&p, n == 0 ? 1 : n), cudaSuccess);
    allocations_.push_back(p);
    if (!host.empty()) {
      EXPECT_EQ(cudaMemcpy(p, host.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
    }
    return p;
  }
  std::vector<uint8_t> Host(const void* dev, size_t bytes) {
    std::vector<uint8_t> h(bytes);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(h.data(), dev, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  std::vector<void*> allocations_;
};

std::vector<uint8_t> Bytes(const void* p, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  return std::vector<uint8_t>(b, b + n);
}

// Values of `n` elements of dtype `d`: Gaussian with per-row magnitudes from 2^-20 to 2^20.
std::vector<uint8_t> RandomElements(std::mt19937_64& rng, DType d, size_t n, uint32_t row) {
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) {
    f[i] = gauss(rng) * std::ldexp(1.0f, int((i / row) % 41) - 20);
  }
  std::vector<uint8_t> out(n * DTypeBytes(d));
  ConvertElements(f.data(), DType::kFp32, out.data(), d, n);
  return out;
}

// Element-wise equality where NaN matches any NaN of the same dtype.
void ExpectSameElements(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, DType d,
                        const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  const size_t w = DTypeBytes(d), n = a.size() / w;
  size_t bad = 0;
  for (size_t i = 0; i < n && bad < 5; ++i) {
    if (std::memcmp(a.data() + i * w, b.data() + i * w, w) == 0) continue;
    float fa, fb;
    ConvertElements(a.data() + i * w, d, &fa, DType::kFp32, 1);
    ConvertElements(b.data() + i * w, d, &fb, DType::kFp32, 1);
    if (std::isnan(fa) && std::isnan(fb)) continue;
    ADD_FAILURE() << what << ": element " << i << " cpu " << fa << " gpu " << fb;
    ++bad;
  }
}

TEST_F(GpuQuantTest, ConvertMatchesCpu) {
  std::vector<uint8_t> all(65536 * 2);
  for (uint32_t i = 0; i < 65536; ++i) std::memcpy(all.data() + 2 * i, &i, 2);
  std::mt19937_64 rng(kSeed);
  for (DType from : kElem) {
    const std::vector<uint8_t> src =
        from == DType::kFp32 ? RandomElements(rng, from, 100003, 97) : all;
    const size_t n = src.size() / DTypeBytes(from);
    void* d_src = Device(src);
    for (DType to : kElem) {
      std::vector<uint8_t> cpu(n * DTypeBytes(to));
      ConvertElements(src.data(), from, cpu.data(), to, n);
      void* d_dst = Device({}, cpu.size());
      CUDA_OK(ConvertElementsCuda(d_src, from, d_dst, to, n, nullptr));
      ExpectSameElements(cpu, Host(d_dst, cpu.size()), to,
                         std::string(DTypeName(from)) + "->" + DTypeName(to));
    }
  }
  EXPECT_EQ(ConvertElementsCuda(nullptr, DType::kInt8, nullptr, DType::kFp16, 1, nullptr),
            cudaErrorInvalidValue);
}

TEST_F(GpuQuantTest, Int8RowsMatchCpu) {
  std::mt19937_64 rng(kSeed + 1);
  for (DType in : kElem) {
    for (uint32_t dim : {1u, 3u, 7u, 64u, 72u, 128u, 576u}) {
      const size_t rows = 333, n = rows * dim;
      std::vector<uint8_t> src = RandomElements(rng, in, n, dim);
      // Special rows: zero, constant, negative constant, huge, subnormal, all positive.
      const float specials[][2] = {{0.0f, 0.0f},      {0.3f, 0.3f},     {-7.0f, -7.0f},
                                   {-65504, 65504},   {-1e30f, 1e30f},  {-FLT_MAX, FLT_MAX},
                                   {1e-45f, -3e-40f}, {5.9e-8f, 1e-7f}, {3.0f, 4.0f}};
      for (size_t k = 0; k < sizeof(specials) / sizeof(specials[0]); ++k) {
        for (uint32_t i = 0; i < dim; ++i) {
          const float v = specials[k][i % 2];
          ConvertElements(&v, DType::kFp32, src.data() + ((k * 7 + 1) * dim + i) * DTypeBytes(in),
                          in, 1);
        }
      }
      std::vector<uint8_t> q(n), zp(rows);
      std::vector<float> scales(rows);
      QuantizeInt8Rows(src.data(), in, rows, dim, q.data(), scales.data(), zp.data());
      void* d_src = Device(src);
      auto* d_q = static_cast<uint8_t*>(Device({}, n));
      auto* d_s = static_cast<float*>(Device({}, rows * 4));
      auto* d_z = static_cast<uint8_t*>(Device({}, rows));
      CUDA_OK(QuantizeInt8RowsCuda(d_src, in, rows, dim, d_q, d_s, d_z, nullptr));
      const std::string what = std::string(DTypeName(in)) + " dim " + std::to_string(dim);
      ASSERT_EQ(Host(d_q, n), q) << what;
      ASSERT_EQ(Host(d_z, rows), zp) << what;
      ASSERT_EQ(Host(d_s, rows * 4), Bytes(scales.data(), rows * 4)) << what;
      for (DType to : kElem) {
        std::vector<uint8_t> cpu(n * DTypeBytes(to));
        DequantizeInt8Rows(q.data(), scales.data(), zp.data(), rows, dim, cpu.data(), to);
        void* d_out = Device({}, cpu.size());
        CUDA_OK(DequantizeInt8RowsCuda(d_q, d_s, d_z, rows, dim, d_out, to, nullptr));
        ASSERT_EQ(Host(d_out, cpu.size()), cpu) << what << " -> " << DTypeName(to);
      }
    }
  }
}

TEST_F(GpuQuantTest, Int8ManyRowsTakeTheGridStride) {
  std::mt19937_64 rng(kSeed + 2);
  const size_t rows = 600000;  // more warps than the 65535-block grid holds
  const uint32_t dim = 3;
  const std::vector<uint8_t> src = RandomElements(rng, DType::kBf16, rows * dim, dim);
  std::vector<uint8_t> q(rows * dim), zp(rows);
  std::vector<float> scales(rows);
  QuantizeInt8Rows(src.data(), DType::kBf16, rows, dim, q.data(), scales.data(), zp.data());
  void* d_src = Device(src);
  auto* d_q = static_cast<uint8_t*>(Device({}, q.size()));
  auto* d_s = static_cast<float*>(Device({}, rows * 4));
  auto* d_z = static_cast<uint8_t*>(Device({}, rows));
  CUDA_OK(QuantizeInt8RowsCuda(d_src, DType::kBf16, rows, dim, d_q, d_s, d_z, nullptr));
  EXPECT_EQ(Host(d_q, q.size()), q);
  EXPECT_EQ(Host(d_s, rows * 4), Bytes(scales.data(), rows * 4));
}

TEST_F(GpuQuantTest, Fp8MatchesCpu) {
  std::mt19937_64 rng(kSeed + 3);
  for (DType in : kElem) {
    for (DType fp8 : kFp8) {
      for (size_t seg_len : {size_t{1}, size_t{7}, size_t{16 * 72}, size_t{16 * 128}}) {
        const size_t segments = 37, n = segments * seg_len;
        std::vector<uint8_t> src = RandomElements(rng, in, n, static_cast<uint32_t>(seg_len));
        // One all-zero segment (scale 1).
        std::memset(src.data() + 3 * seg_len * DTypeBytes(in), 0, seg_len * DTypeBytes(in));
        std::vector<float> scales(segments);
        std::vector<uint8_t> codes(n), free_codes(n);
        const size_t w = DTypeBytes(in);
        for (size_t s = 0; s < segments; ++s) {
          scales[s] = Fp8ScaleFor(AbsMax(src.data() + s * seg_len * w, in, seg_len), fp8);
          EncodeFp8(src.data() + s * seg_len * w, in, seg_len, scales[s], fp8,
                    codes.data() + s * seg_len);
        }
        EncodeFp8(src.data(), in, n, 1.0f, fp8, free_codes.data());
        void* d_src = Device(src);
        auto* d_s = static_cast<float*>(Device({}, segments * 4));
        auto* d_c = static_cast<uint8_t*>(Device({}, n));
        const std::string what = std::string(DTypeName(in)) + "->" + DTypeName(fp8) + " segment " +
                                 std::to_string(seg_len);
        CUDA_OK(Fp8ScalesCuda(d_src, in, segments, seg_len, fp8, d_s, nullptr));
        ASSERT_EQ(Host(d_s, segments * 4), Bytes(scales.data(), segments * 4)) << what;
        CUDA_OK(EncodeFp8Cuda(d_src, in, segments, seg_len, d_s, fp8, d_c, nullptr));
        ASSERT_EQ(Host(d_c, n), codes) << what;
        CUDA_OK(EncodeFp8Cuda(d_src, in, segments, seg_len, nullptr, fp8, d_c, nullptr));
        ASSERT_EQ(Host(d_c, n), free_codes) << what << " scale-free";
      }
    }
  }
}

TEST_F(GpuQuantTest, Fp8DecodeEveryCode) {
  std::vector<uint8_t> codes(256 * 5);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i);
  const std::vector<float> scales = {1.0f, 0.0123f, 3.0e35f, FLT_MAX / 448, 1.17549435e-38f};
  void* d_codes = Device(codes);
  void* d_scales = Device(Bytes(scales.data(), scales.size() * 4));
  for (DType fp8 : kFp8) {
    for (DType to : kElem) {
      std::vector<uint8_t> cpu(codes.size() * DTypeBytes(to));
      for (size_t s = 0; s < scales.size(); ++s) {
        DecodeFp8(codes.data() + 256 * s, fp8, 256, scales[s],
                  cpu.data() + 256 * s * DTypeBytes(to), to);
      }
      void* d_out = Device({}, cpu.size());
      CUDA_OK(DecodeFp8Cuda(static_cast<const uint8_t*>(d_codes), fp8, scales.size(), 256,
                            static_cast<const float*>(d_scales), d_out, to, nullptr));
      ExpectSameElements(cpu, Host(d_out, cpu.size()), to,
                         std::string(DTypeName(fp8)) + "->" + DTypeName(to));
    }
  }
}

TEST_F(GpuQuantTest, LargeEncodeTakesTheGridStride) {
  std::mt19937_64 rng(kSeed + 4);
  const size_t n = size_t{17} << 20;  // more than 65535 blocks x 256 threads
  const std::vector<uint8_t> src = RandomElements(rng, DType::kFp16, n, 4096);
  std::vector<uint8_t> codes(n);
  const float scale = 0.37f;
  EncodeFp8(src.data(), DType::kFp16, n, scale, DType::kFp8E4M3, codes.data());
  void* d_src = Device(src);
  void* d_scale = Device(Bytes(&scale, 4));
  auto* d_c = static_cast<uint8_t*>(Device({}, n));
  CUDA_OK(EncodeFp8Cuda(d_src, DType::kFp16, 1, n, static_cast<const float*>(d_scale),
                        DType::kFp8E4M3, d_c, nullptr));
  EXPECT_EQ(Host(d_c, n), codes);
}

}  // namespace
}  // namespace kvbank::kernels
