// quant_bench: KV codec throughput against memcpy, bytes per token of each storage dtype, and the
// error each storage dtype puts into K, V and an attention output.
//
//   quant_bench [--quick] [--reps N] [--no-scalar]
//
// 1. Throughput. Each codec call covers one (K/V, head, block) segment as the store makes it: 16
//    token rows of head_dim 128 (2048 elements), over a buffer of `size` input bytes (fp16 or
//    bf16). int8 quantize/dequantize rows; fp8 encode = AbsMax + Fp8ScaleFor + EncodeFp8 per
//    segment, decode = DecodeFp8 back to the input dtype; convert = fp16 <-> bf16; validate =
//    FindNonFinite. The baseline, measured in the same run and interleaved with the codec (pairs
//    back to back), is memcpy of the same number of *uncompressed* bytes; ratio = codec GB/s /
//    memcpy GB/s (1.0 = as fast as copying the fp16 data once), the median of per-pair ratios.
//    GB/s = 1e9 uncompressed bytes per second. Both CPU paths (AVX2 and scalar) are measured.
// 2. Bytes per token of llama-3.1-8b for each storage dtype (block_bytes / block_tokens from
//    ComputeBlockLayout, scales included) relative to fp16.
// 3. Quality: one layer of 8 KV heads x `context` tokens x head_dim 128, K and V, fp32
//    originals; each storage dtype stores and loads them block by block (16 tokens, fp8: one
//    scale per head per block). Two data sets: Gaussian N(0, 1), and the same with outlier
//    channels in K (4 of 128 channels x20, x40, x70, x100; V unchanged). Reported: relative RMS
//    error sqrt(sum (x'-x)^2 / sum x^2) and max |x'-x| / max |x| for K and V, and the error of a
//    decode attention output softmax(q K^T / sqrt(d)) V computed in fp64 from the loaded K, V
//    against the same from the originals: ||o' - o|| / ||o||, mean and max over 16 random
//    N(0, 1) queries per head, and the mean largest softmax probability of the reference (with
//    outlier channels the logits spread widely and attention is nearly one-hot, so small K
//    errors that swap the top tokens dominate the attention error).
// With --quick everything is small (a smoke test); the run also checks that the AVX2 and scalar
// paths wrote the same bytes and that every error is finite and below a loose ceiling, and exits
// 1 otherwise.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/quant.h"
#include "kvbank/layout.h"

namespace kvbank::kernels {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kSeed = 20261130;
constexpr uint32_t kHeadDim = 128;
constexpr uint32_t kBlockTokens = 16;
constexpr size_t kSegment = size_t{kBlockTokens} * kHeadDim;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "quant_bench: %s\n", what.c_str());
  std::exit(1);
}

// ---- throughput -------------------------------------------------------------------------------

// Buffers for one input dtype and size, touched before timing.
struct Buffers {
  DType in;
  size_t n = 0;  // elements; a multiple of kSegment
  std::vector<uint8_t> src, copy, out, q, zp, conv;
  std::vector<float> scales;
};

Buffers MakeBuffers(DType in, size_t bytes, std::mt19937_64& rng) {
  Buffers b;
  b.in = in;
  b.n = std::max<size_t>(1, bytes / DTypeBytes(in) / kSegment) * kSegment;
  std::vector<float> f(b.n);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  for (float& x : f) x = gauss(rng);
  b.src.resize(b.n * DTypeBytes(in));
  ConvertElements(f.data(), DType::kFp32, b.src.data(), in, b.n);
  b.copy.assign(b.src.size(), 1);
  b.out.assign(b.src.size(), 2);
  b.conv.assign(b.src.size(), 3);
  b.q.assign(b.n, 4);
  b.zp.assign(b.n / kHeadDim, 5);
  b.scales.assign(b.n / kHeadDim, 1.0f);
  return b;
}

enum class Op { kInt8Quant, kInt8Dequant, kE4M3Enc, kE4M3Dec, kE5M2Enc, kE5M2Dec, kConvert, kFind };
const Op kOps[] = {Op::kInt8Quant, Op::kInt8Dequant, Op::kE4M3Enc, Op::kE4M3Dec,
                   Op::kE5M2Enc,   Op::kE5M2Dec,     Op::kConvert, Op::kFind};
const char* OpName(Op op) {
  switch (op) {
    case Op::kInt8Quant:
      return "int8 quantize";
    case Op::kInt8Dequant:
      return "int8 dequantize";
    case Op::kE4M3Enc:
      return "fp8_e4m3 encode";
    case Op::kE4M3Dec:
      return "fp8_e4m3 decode";
    case Op::kE5M2Enc:
      return "fp8_e5m2 encode";
    case Op::kE5M2Dec:
      return "fp8_e5m2 decode";
    case Op::kConvert:
      return "convert fp16<->bf16";
    case Op::kFind:
      return "FindNonFinite";
  }
  return "?";
}

// Runs `op` over the whole buffer, one segment per call. Decoders read what the matching encoder
// left in b.q / b.scales (the first, untimed repetition fills them).
int64_t RunOp(const CodecOps& ops, Op op, Buffers& b) {
  const size_t w = DTypeBytes(b.in);
  const size_t segs = b.n / kSegment;
  const DType other = b.in == DType::kFp16 ? DType::kBf16 : DType::kFp16;
  int64_t found = 0;
  for (size_t s = 0; s < segs; ++s) {
    const size_t e = s * kSegment, r = e / kHeadDim;
    const uint8_t* src = b.src.data() + e * w;
    switch (op) {
      case Op::kInt8Quant:
        ops.quantize_int8_rows(src, b.in, kBlockTokens, kHeadDim, b.q.data() + e,
                               b.scales.data() + r, b.zp.data() + r);
        break;
      case Op::kInt8Dequant:
        ops.dequantize_int8_rows(b.q.data() + e, b.scales.data() + r, b.zp.data() + r, kBlockTokens,
                                 kHeadDim, b.out.data() + e * w, b.in);
        break;
      case Op::kE4M3Enc:
      case Op::kE5M2Enc: {
        const DType fp8 = op == Op::kE4M3Enc ? DType::kFp8E4M3 : DType::kFp8E5M2;
        const float scale = Fp8ScaleFor(ops.abs_max(src, b.in, kSegment), fp8);
        b.scales[s] = scale;
        ops.encode_fp8(src, b.in, kSegment, scale, fp8, b.q.data() + e);
        break;
      }
      case Op::kE4M3Dec:
      case Op::kE5M2Dec: {
        const DType fp8 = op == Op::kE4M3Dec ? DType::kFp8E4M3 : DType::kFp8E5M2;
        ops.decode_fp8(b.q.data() + e, fp8, kSegment, b.scales[s], b.out.data() + e * w, b.in);
        break;
      }
      case Op::kConvert:
        ops.convert(src, b.in, b.conv.data() + e * w, other, kSegment);
        break;
      case Op::kFind:
        found += ops.find_non_finite(src, b.in, kSegment);
        break;
    }
  }
  return found;
}

// The encoder whose output a decoder reads.
Op EncoderOf(Op op) {
  return op == Op::kInt8Dequant ? Op::kInt8Quant
         : op == Op::kE4M3Dec   ? Op::kE4M3Enc
         : op == Op::kE5M2Dec   ? Op::kE5M2Enc
                                : op;
}

struct Timing {
  double gbs = 0, memcpy_gbs = 0, ratio = 0;
};

Timing Measure(const CodecOps& ops, Op op, Buffers& b, int reps) {
  if (EncoderOf(op) != op) RunOp(ops, EncoderOf(op), b);
  std::vector<double> t_op, t_ref, ratio;
  const size_t bytes = b.src.size();
  for (int r = 0; r <= reps; ++r) {  // rep 0 warms up and is not recorded
    const auto t0 = Clock::now();
    std::memcpy(b.copy.data(), b.src.data(), bytes);
    const auto t1 = Clock::now();
    const int64_t found = RunOp(ops, op, b);
    const auto t2 = Clock::now();
    if (op == Op::kFind && found != -int64_t(b.n / kSegment)) {
      Fail("FindNonFinite found a non-finite value in finite data");
    }
    if (r == 0) continue;
    t_ref.push_back(Seconds(t0, t1));
    t_op.push_back(Seconds(t1, t2));
    ratio.push_back(Seconds(t0, t1) / Seconds(t1, t2));
  }
  Timing t;
  t.gbs = double(bytes) / 1e9 / Median(t_op);
  t.memcpy_gbs = double(bytes) / 1e9 / Median(t_ref);
  t.ratio = Median(ratio);
  return t;
}

// The AVX2 and scalar paths must leave the same bytes behind for every op.
void CheckPathsAgree(const CodecOps& a, const CodecOps& s, Buffers& b) {
  for (Op op : kOps) {
    if (EncoderOf(op) != op) continue;
    RunOp(a, op, b);
    const std::vector<uint8_t> q = b.q, conv = b.conv;
    const std::vector<float> scales = b.scales;
    RunOp(s, op, b);
    if (q != b.q || conv != b.conv ||
        std::memcmp(scales.data(), b.scales.data(), scales.size() * 4) != 0) {
      Fail(std::string("avx2 and scalar differ: ") + OpName(op));
    }
    for (Op dec : kOps) {
      if (EncoderOf(dec) != op || dec == op) continue;
      RunOp(a, dec, b);
      const std::vector<uint8_t> out = b.out;
      RunOp(s, dec, b);
      if (out != b.out) Fail(std::string("avx2 and scalar differ: ") + OpName(dec));
    }
  }
}

void Throughput(bool quick, int reps, bool scalar) {
  std::mt19937_64 rng(kSeed);
  const CodecOps* avx2 = Avx2CodecOps();
  std::vector<const CodecOps*> paths;
  if (avx2 != nullptr) paths.push_back(avx2);
  if (scalar || avx2 == nullptr) paths.push_back(&ScalarCodecOps());
  const std::vector<size_t> sizes = quick
                                        ? std::vector<size_t>{size_t{256} << 10}
                                        : std::vector<size_t>{size_t{512} << 10, size_t{64} << 20};
  std::printf("## Codec throughput (%d reps, median; GB/s of uncompressed input bytes)\n\n", reps);
  std::printf("| op | input | size | path | GB/s | memcpy GB/s | ratio |\n");
  std::printf("|---|---|---:|---|---:|---:|---:|\n");
  for (size_t size : sizes) {
    for (DType in : {DType::kFp16, DType::kBf16}) {
      Buffers b = MakeBuffers(in, size, rng);
      if (avx2 != nullptr) CheckPathsAgree(*avx2, ScalarCodecOps(), b);
      for (Op op : kOps) {
        for (const CodecOps* ops : paths) {
          // The scalar path is slow; at the large size it gets fewer repetitions.
          const int r = ops == avx2 || size < (size_t{8} << 20) ? reps : std::max(3, reps / 3);
          const Timing t = Measure(*ops, op, b, r);
          std::printf("| %s | %s | %s | %s | %.2f | %.2f | %.2f |\n", OpName(op), DTypeName(in),
                      size >= (size_t{1} << 20) ? (std::to_string(size >> 20) + " MiB").c_str()
                                                : (std::to_string(size >> 10) + " KiB").c_str(),
                      ops->name, t.gbs, t.memcpy_gbs, t.ratio);
          std::fflush(stdout);
        }
      }
    }
  }
}

// ---- bytes per token --------------------------------------------------------------------------

void BytesPerToken() {
  std::printf("\n## Bytes per token, llama-3.1-8b (32 layers, 8 KV heads, head_dim 128)\n\n");
  std::printf("| storage | block bytes | bytes/token | / fp16 |\n|---|---:|---:|---:|\n");
  ModelLayout m;
  PresetLayout("llama-3.1-8b", &m, DType::kFp16);
  const double fp16 = double(ComputeBlockLayout(m).block_bytes) / m.block_tokens;
  struct Row {
    const char* name;
    std::vector<DType> dtypes;
  };
  std::vector<Row> rows;
  for (DType d :
       {DType::kFp32, DType::kFp16, DType::kBf16, DType::kInt8, DType::kFp8E4M3, DType::kFp8E5M2}) {
    rows.push_back({DTypeName(d), std::vector<DType>(m.num_layers, d)});
  }
  std::vector<DType> mixed(m.num_layers, DType::kInt8);
  for (uint32_t l = 0; l < 3; ++l) mixed[l] = mixed[m.num_layers - 1 - l] = DType::kFp16;
  rows.push_back({"int8, first/last 3 layers fp16", mixed});
  for (const Row& r : rows) {
    ModelLayout x = m;
    x.layer_dtypes = r.dtypes;
    if (!ValidateLayout(x).empty()) Fail("invalid layout " + ValidateLayout(x));
    const BlockLayout b = ComputeBlockLayout(x);
    const double per_token = double(b.block_bytes) / b.block_tokens;
    std::printf("| %s | %" PRIu64 " | %.0f | %.3f |\n", r.name, b.block_bytes, per_token,
                per_token / fp16);
  }
}

// ---- quality ----------------------------------------------------------------------------------

enum class Storage { kFp16, kBf16, kInt8, kE4M3, kE5M2, kE5M2NoScale };
const Storage kStorages[] = {Storage::kFp16, Storage::kBf16, Storage::kInt8,
                             Storage::kE4M3, Storage::kE5M2, Storage::kE5M2NoScale};
const char* StorageName(Storage s) {
  switch (s) {
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

// Stores and loads x ([heads][tokens][head_dim] fp32) block by block with storage `s`.
std::vector<float> StoreLoad(const std::vector<float>& x, Storage s, uint32_t heads,
                             uint32_t tokens) {
  std::vector<float> y(x.size());
  std::vector<uint8_t> stored(kSegment * 4), zp(kBlockTokens);
  std::vector<float> scales(kBlockTokens);
  for (uint32_t h = 0; h < heads; ++h) {
    for (uint32_t t0 = 0; t0 < tokens; t0 += kBlockTokens) {
      const uint32_t rows = std::min(kBlockTokens, tokens - t0);
      const size_t at = (size_t{h} * tokens + t0) * kHeadDim, n = size_t{rows} * kHeadDim;
      const float* src = x.data() + at;
      float* dst = y.data() + at;
      switch (s) {
        case Storage::kFp16:
        case Storage::kBf16: {
          const DType d = s == Storage::kFp16 ? DType::kFp16 : DType::kBf16;
          ConvertElements(src, DType::kFp32, stored.data(), d, n);
          ConvertElements(stored.data(), d, dst, DType::kFp32, n);
          break;
        }
        case Storage::kInt8:
          QuantizeInt8Rows(src, DType::kFp32, rows, kHeadDim, stored.data(), scales.data(),
                           zp.data());
          DequantizeInt8Rows(stored.data(), scales.data(), zp.data(), rows, kHeadDim, dst,
                             DType::kFp32);
          break;
        case Storage::kE4M3:
        case Storage::kE5M2:
        case Storage::kE5M2NoScale: {
          const DType fp8 = s == Storage::kE4M3 ? DType::kFp8E4M3 : DType::kFp8E5M2;
          const float scale =
              s == Storage::kE5M2NoScale ? 1.0f : Fp8ScaleFor(AbsMax(src, DType::kFp32, n), fp8);
          EncodeFp8(src, DType::kFp32, n, scale, fp8, stored.data());
          DecodeFp8(stored.data(), fp8, n, scale, dst, DType::kFp32);
          break;
        }
      }
    }
  }
  return y;
}

struct ErrorStats {
  double rel_rms = 0, rel_max = 0;
};

// Over elements whose channel passes `keep` (all when null).
ErrorStats Errors(const std::vector<float>& x, const std::vector<float>& y,
                  const std::vector<bool>* keep) {
  double se = 0, sx = 0, me = 0, mx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (keep != nullptr && !(*keep)[i % kHeadDim]) continue;
    const double e = double(y[i]) - double(x[i]);
    if (!std::isfinite(y[i])) Fail("non-finite value loaded");
    se += e * e;
    sx += double(x[i]) * x[i];
    me = std::max(me, std::fabs(e));
    mx = std::max(mx, std::fabs(double(x[i])));
  }
  return {std::sqrt(se / sx), me / mx};
}

// softmax(q K^T / sqrt(d)) V for one head, in fp64. k, v: [tokens][head_dim] at the head's base.
// *top gets the largest softmax probability (how close to one-hot the attention is).
std::vector<double> Attend(const double* q, const float* k, const float* v, uint32_t tokens,
                           double* top) {
  std::vector<double> s(tokens);
  double mx = -INFINITY;
  for (uint32_t t = 0; t < tokens; ++t) {
    double dot = 0;
    for (uint32_t i = 0; i < kHeadDim; ++i) dot += q[i] * double(k[size_t{t} * kHeadDim + i]);
    s[t] = dot / std::sqrt(double(kHeadDim));
    mx = std::max(mx, s[t]);
  }
  double z = 0;
  for (double& e : s) z += (e = std::exp(e - mx));
  *top = 1.0 / z;  // the largest term is exp(0)
  std::vector<double> o(kHeadDim, 0.0);
  for (uint32_t t = 0; t < tokens; ++t) {
    for (uint32_t i = 0; i < kHeadDim; ++i) o[i] += s[t] / z * double(v[size_t{t} * kHeadDim + i]);
  }
  return o;
}

void Quality(bool quick) {
  const uint32_t heads = quick ? 2 : 8, tokens = quick ? 256 : 1024, queries = quick ? 4 : 16;
  std::printf(
      "\n## Storage error: %u KV heads x %u tokens x head_dim %u, fp32 originals, seed %llu\n\n",
      heads, tokens, kHeadDim, static_cast<unsigned long long>(kSeed));
  std::mt19937_64 rng(kSeed + 1);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  const size_t n = size_t{heads} * tokens * kHeadDim;
  std::vector<float> k(n), v(n);
  for (float& x : k) x = gauss(rng);
  for (float& x : v) x = gauss(rng);
  std::vector<double> q(size_t{heads} * queries * kHeadDim);
  for (double& x : q) x = gauss(rng);
  // Outlier channels of K, as real keys have.
  const uint32_t channels[] = {3, 17, 64, 101};
  const float factors[] = {20, 40, 70, 100};
  std::vector<float> k_out = k;
  std::vector<bool> normal(kHeadDim, true);
  for (int c = 0; c < 4; ++c) {
    normal[channels[c]] = false;
    for (size_t i = channels[c]; i < n; i += kHeadDim) k_out[i] *= factors[c];
  }
  std::printf(
      "| data | storage | K rel RMS | K rel max | K rel RMS (normal channels) | V rel RMS | V rel "
      "max | attn rel err mean | attn rel err max | top softmax p (mean) |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int set = 0; set < 2; ++set) {
    const std::vector<float>& kk = set == 0 ? k : k_out;
    for (Storage s : kStorages) {
      const std::vector<float> ky = StoreLoad(kk, s, heads, tokens);
      const std::vector<float> vy = StoreLoad(v, s, heads, tokens);
      const ErrorStats ke = Errors(kk, ky, nullptr), kn = Errors(kk, ky, &normal),
                       ve = Errors(v, vy, nullptr);
      double sum = 0, worst = 0, top_sum = 0, top;
      for (uint32_t h = 0; h < heads; ++h) {
        const size_t base = size_t{h} * tokens * kHeadDim;
        for (uint32_t j = 0; j < queries; ++j) {
          const double* qq = q.data() + (size_t{h} * queries + j) * kHeadDim;
          const std::vector<double> o2 =
              Attend(qq, ky.data() + base, vy.data() + base, tokens, &top);
          const std::vector<double> o = Attend(qq, kk.data() + base, v.data() + base, tokens, &top);
          top_sum += top;
          double de = 0, dn = 0;
          for (uint32_t i = 0; i < kHeadDim; ++i) {
            de += (o2[i] - o[i]) * (o2[i] - o[i]);
            dn += o[i] * o[i];
          }
          const double rel = std::sqrt(de / dn);
          if (!std::isfinite(rel)) Fail("non-finite attention error");
          sum += rel;
          worst = std::max(worst, rel);
        }
      }
      // A loose ceiling that only a broken codec crosses (e5m2 scale-free on outliers is ~0.1).
      if (ke.rel_rms > 0.3 || ve.rel_rms > 0.3) {
        Fail(std::string("error out of range for ") + StorageName(s));
      }
      char normal_rms[32] = "-";
      if (set == 1) std::snprintf(normal_rms, sizeof(normal_rms), "%.2e", kn.rel_rms);
      const double nq = double(heads) * queries;
      std::printf("| %s | %s | %.2e | %.2e | %s | %.2e | %.2e | %.2e | %.2e | %.2f |\n",
                  set == 0 ? "gaussian" : "K outlier channels", StorageName(s), ke.rel_rms,
                  ke.rel_max, normal_rms, ve.rel_rms, ve.rel_max, sum / nq, worst, top_sum / nq);
      std::fflush(stdout);
    }
  }
}

int Main(int argc, char** argv) {
  bool quick = false, scalar = true;
  int reps = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--no-scalar") == 0) {
      scalar = false;
    } else if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: quant_bench [--quick] [--reps N] [--no-scalar]\n");
      return 2;
    }
  }
  if (reps <= 0) reps = quick ? 3 : 9;
  std::printf("quant_bench: %s, active CPU codec path: %s\n\n", quick ? "quick" : "full",
              ActiveCodecOps().name);
  Throughput(quick, reps, scalar);
  BytesPerToken();
  Quality(quick);
  return 0;
}

}  // namespace
}  // namespace kvbank::kernels

int main(int argc, char** argv) { return kvbank::kernels::Main(argc, argv); }
