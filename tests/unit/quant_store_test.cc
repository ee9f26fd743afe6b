// Quantized storage in SequenceStore over a host pool: int8, fp8_e4m3, fp8_e5m2 and a mixed model
// (first and last layer fp16, the rest int8), fed fp32 / fp16 / bf16, GQA with odd sizes and MLA.
// Every element fetched back is checked against the bound its scale implies (kernels/quant.h):
//   int8:  |x' - x| <= scale / 2 + eps, scale = (max(mx, 0) - min(mn, 0)) / 255 of x's input row
//   fp8:   |x' - x| <= rel |x| + abs scale, rel 2^-4 / 2^-3, abs 2^-10 / 2^-17 (e4m3 / e5m2),
//          scale the block's: set from the rows at hand when its first row is written
//   fp16:  bit-exact from fp16 input, else half an fp16 ulp
// Also: special values, NaN / Inf refused with nothing changed, bytes per token, copy on write
// under fork and truncate, prefix sharing, and the dtypes a transfer may and may not use.
// Seeds are fixed and printed.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/quant_math.h"
#include "kvbank/layout.h"
#include "kvbank/prefix_hash.h"
#include "server/core/sequence_store.h"

namespace kvbank {
namespace {

namespace qmath = kernels::qmath;
using absl::StatusCode;

enum class Storage { kInt8, kFp8E4M3, kFp8E5M2, kMixed };

const char* StorageName(Storage s) {
  switch (s) {
    case Storage::kInt8:
      return "int8";
    case Storage::kFp8E4M3:
      return "fp8_e4m3";
    case Storage::kFp8E5M2:
      return "fp8_e5m2";
    case Storage::kMixed:
      return "mixed";
  }
  return "?";
}

constexpr uint32_t kLayers = 4;
constexpr uint32_t kBlockTokens = 7;

// GQA: 3 KV heads of 72 (odd sizes on purpose); MLA: a latent of 32 + 8 rope dims, no V.
ModelLayout Layout(Storage s, DType input, bool mla) {
  ModelLayout m;
  m.name = absl::StrCat(mla ? "mla-" : "gqa-", StorageName(s), "-", DTypeName(input));
  m.num_layers = kLayers;
  m.block_tokens = kBlockTokens;
  if (mla) {
    m.kind = AttentionKind::kMla;
    m.num_kv_heads = 1;
    m.num_q_heads = 8;
    m.kv_lora_rank = 32;
    m.rope_dim = 8;
    m.head_dim = 40;
    m.head_dim_v = 32;
  } else {
    m.kind = AttentionKind::kGqa;
    m.num_kv_heads = 3;
    m.num_q_heads = 6;
    m.head_dim = m.head_dim_v = 72;
  }
  m.input_dtype = input;
  switch (s) {
    case Storage::kInt8:
      m.layer_dtypes.assign(kLayers, DType::kInt8);
      break;
    case Storage::kFp8E4M3:
      m.layer_dtypes.assign(kLayers, DType::kFp8E4M3);
      break;
    case Storage::kFp8E5M2:
      m.layer_dtypes.assign(kLayers, DType::kFp8E5M2);
      break;
    case Storage::kMixed:
      m.layer_dtypes = {DType::kFp16, DType::kInt8, DType::kInt8, DType::kFp16};
      break;
  }
  return m;
}

// x as the input dtype holds it (what the store sees).
float RoundTo(DType d, float x) {
  if (d == DType::kFp16) return qmath::HalfToFloat(qmath::FloatToHalf(x, true));
  if (d == DType::kBf16) return qmath::Bf16ToFloat(qmath::FloatToBf16(x, true));
  return x;
}

// The fp8 scale of one (layer, K/V, head, block): exact when the codec saw every row of the
// append that started the block, else the largest it can be.
struct Fp8Scale {
  float scale = 0;
  bool exact = false;
};

// The input values of one sequence (floats exactly representable in the input dtype) and the fp8
// scale of each (layer, K/V, head, block).
class Ref {
 public:
  // gen(layer, kv, head, token, element) before rounding to the input dtype.
  using Gen = std::function<float(uint32_t, uint32_t, uint32_t, uint64_t, uint32_t)>;
  // How an append reaches the codec: in one Write (the codec sees every row of a block it starts),
  // or in chunks (it may see as little as the first row).
  enum class Arrival { kWhole, kChunked };

  explicit Ref(const ModelLayout& m)
      : m_(m), parts_(m.kind == AttentionKind::kMla ? 1 : 2), rows_(Slots()), scale_(Slots()) {}

  uint32_t parts() const { return parts_; }
  uint32_t Dim(uint32_t kv) const { return kv == 0 ? m_.head_dim : m_.head_dim_v; }
  uint64_t length() const { return len_; }
  float X(uint32_t l, uint32_t kv, uint32_t h, uint64_t t, uint32_t i) const {
    return rows_[Slot(l, kv, h)][t * Dim(kv) + i];
  }
  const float* Row(uint32_t l, uint32_t kv, uint32_t h, uint64_t t) const {
    return rows_[Slot(l, kv, h)].data() + t * Dim(kv);
  }
  Fp8Scale Fp8ScaleOf(uint32_t l, uint32_t kv, uint32_t h, uint64_t block) const {
    return scale_[Slot(l, kv, h)][block];
  }

  // Adds n tokens; returns their payload in `wire` (kvbank/layout.h order).
  std::vector<uint8_t> Add(uint64_t n, const Gen& gen, Arrival arrival) {
    const uint64_t t0 = len_, t1 = len_ + n, bt = m_.block_tokens;
    for (uint32_t l = 0; l < m_.num_layers; ++l) {
      const DType stored = m_.layer_dtypes[l];
      for (uint32_t kv = 0; kv < parts_; ++kv) {
        for (uint32_t h = 0; h < m_.num_kv_heads; ++h) {
          std::vector<float>& rows = rows_[Slot(l, kv, h)];
          for (uint64_t t = t0; t < t1; ++t) {
            for (uint32_t i = 0; i < Dim(kv); ++i) {
              rows.push_back(RoundTo(m_.input_dtype, gen(l, kv, h, t, i)));
            }
          }
          if (!qmath::IsFp8DType(stored)) continue;
          // Blocks this append starts get their scale from its rows (kernels/quant.h,
          // server/core/row_codec.cc): exact when the codec sees the whole block, else from the
          // rows at hand times a headroom of 4 (as few as the first row).
          std::vector<Fp8Scale>& scales = scale_[Slot(l, kv, h)];
          for (uint64_t b = (t0 + bt - 1) / bt; b * bt < t1; ++b) {
            const uint64_t r0 = b * bt, r1 = std::min(t1, r0 + bt);
            float amax = 0;
            for (const float* x = Row(l, kv, h, r0); x < Row(l, kv, h, r0) + (r1 - r0) * Dim(kv);
                 ++x) {
              amax = std::max(amax, std::fabs(*x));
            }
            Fp8Scale s;
            if (arrival == Arrival::kWhole) {
              s.scale = qmath::Fp8ScaleFor(r1 - r0 < bt ? amax * 4 : amax, stored);
              s.exact = true;
            } else {
              s.scale = qmath::Fp8ScaleFor(amax * 4, stored);
              float first = 0;
              for (uint32_t i = 0; i < Dim(kv); ++i) {
                first = std::max(first, std::fabs(Row(l, kv, h, r0)[i]));
              }
              if (first == 0) s.scale = std::max(s.scale, 1.0f);  // zero rows at hand: scale 1
            }
            scales.resize(b + 1);
            scales[b] = s;
          }
        }
      }
    }
    len_ = t1;
    return Payload(t0, t1, m_.input_dtype);
  }

  // Payload of tokens [t0, t1), every layer, in `wire`.
  std::vector<uint8_t> Payload(uint64_t t0, uint64_t t1, DType wire) const {
    std::vector<uint8_t> out;
    const uint32_t eb = DTypeBytes(wire);
    for (uint32_t l = 0; l < m_.num_layers; ++l) {
      for (uint32_t kv = 0; kv < parts_; ++kv) {
        for (uint32_t h = 0; h < m_.num_kv_heads; ++h) {
          for (uint64_t t = t0; t < t1; ++t) {
            for (uint32_t i = 0; i < Dim(kv); ++i) {
              out.resize(out.size() + eb);
              qmath::StoreFromFloat(out.data() + out.size() - eb, wire, 0, X(l, kv, h, t, i));
            }
          }
        }
      }
    }
    return out;
  }

  // The store keeps a cut block and its scales; the rows past n go.
  void Truncate(uint64_t n) {
    for (uint32_t l = 0; l < m_.num_layers; ++l) {
      for (uint32_t kv = 0; kv < parts_; ++kv) {
        for (uint32_t h = 0; h < m_.num_kv_heads; ++h) {
          rows_[Slot(l, kv, h)].resize(n * Dim(kv));
          std::vector<Fp8Scale>& s = scale_[Slot(l, kv, h)];
          s.resize(std::min<size_t>(s.size(), (n + m_.block_tokens - 1) / m_.block_tokens));
        }
      }
    }
    len_ = n;
  }

 private:
  size_t Slots() const { return size_t{m_.num_layers} * parts_ * m_.num_kv_heads; }
  size_t Slot(uint32_t l, uint32_t kv, uint32_t h) const {
    return (size_t{l} * parts_ + kv) * m_.num_kv_heads + h;
  }

  ModelLayout m_;
  uint32_t parts_;
  uint64_t len_ = 0;
  std::vector<std::vector<float>> rows_;      // [slot]: [token][dim]
  std::vector<std::vector<Fp8Scale>> scale_;  // [slot]: per block
};

// The most |x' - x| may be for element i of an input row (`row`, `dim` values) stored as `stored`.
// `want` is row[i], or for fp8 the value it saturates to.
double Bound(DType stored, DType input, const float* row, uint32_t dim, uint32_t i, float fp8_scale,
             double want) {
  const double x = std::fabs(want);
  switch (stored) {
    case DType::kInt8: {
      float mn = row[0], mx = row[0];
      for (uint32_t j = 1; j < dim; ++j) {
        mn = std::min(mn, row[j]);
        mx = std::max(mx, row[j]);
      }
      if (mn == mx) return 0;  // constant rows are exact
      const double range = double(std::max(mx, 0.0f)) - double(std::min(mn, 0.0f));
      const double scale = std::max(double(float(range / 255.0)), double(FLT_MIN));
      // eps: 1 / scale and x / scale are rounded to fp32 (x / scale <= 255), then (q - zp) * scale.
      return scale / 2 + scale * 0x1p-12 + x * 0x1p-22;
    }
    case DType::kFp8E4M3:
      return x * 0x1p-4 + double(fp8_scale) * 0x1p-10 + x * 0x1p-20;
    case DType::kFp8E5M2:
      return x * 0x1p-3 + double(fp8_scale) * 0x1p-17 + x * 0x1p-20;
    case DType::kFp16:
      return input == DType::kFp16 ? 0 : x * 0x1p-11 + 0x1p-25;
    default:
      return input == stored ? 0 : x * 0x1p-8;
  }
}

AppendSpec MakeAppend(uint64_t id, uint64_t n, std::optional<DType> dtype = std::nullopt,
                      std::vector<uint32_t> ids = {}) {
  AppendSpec s;
  s.sequence_id = id;
  s.num_tokens = n;
  s.dtype = dtype;
  s.token_ids = std::move(ids);
  return s;
}
FetchSpec MakeFetch(uint64_t id, std::optional<DType> dtype, uint32_t l0 = 0,
                    std::optional<uint32_t> l1 = std::nullopt) {
  FetchSpec s;
  s.sequence_id = id;
  s.layer_begin = l0;
  s.layer_end = l1;
  s.dtype = dtype;
  return s;
}

bool SamePool(const PoolStats& a, const PoolStats& b) {
  return a.total == b.total && a.free == b.free && a.cached == b.cached && a.used == b.used &&
         a.pinned == b.pinned && a.evictions == b.evictions;
}

class QuantStore {
 public:
  explicit QuantStore(const ModelLayout& m, uint64_t blocks = 96) : m_(m) {
    const BlockLayout b = ComputeBlockLayout(m);
    auto pool = BlockPool::CreateHost(b, blocks * b.block_bytes);
    EXPECT_TRUE(pool.ok()) << pool.status();
    if (pool.ok()) store_ = std::make_unique<SequenceStore>(m, *std::move(pool), StoreOptions{});
  }
  SequenceStore& operator*() { return *store_; }
  SequenceStore* operator->() { return store_.get(); }
  const ModelLayout& layout() const { return m_; }

  uint64_t NewSeq(std::vector<uint32_t> prompt = {}) {
    CreateOptions o;
    o.lease = absl::ZeroDuration();
    o.prompt = std::move(prompt);
    auto s = store_->Create(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->id : 0;
  }

  // Appends `payload` (n tokens, the model's input dtype) through one transaction written in
  // chunks of `chunk` bytes (0: one Write).
  absl::Status Append(uint64_t id, uint64_t n, const std::vector<uint8_t>& payload, size_t chunk,
                      std::vector<uint32_t> ids = {}) {
    auto txn = store_->BeginAppend(MakeAppend(id, n, std::nullopt, std::move(ids)));
    if (!txn.ok()) return txn.status();
    EXPECT_EQ((*txn)->dtype(), m_.input_dtype);
    EXPECT_EQ((*txn)->payload_bytes(), payload.size());
    const size_t step = chunk == 0 ? payload.size() : chunk;
    for (size_t off = 0; off < payload.size(); off += step) {
      const size_t len = std::min(step, payload.size() - off);
      if (absl::Status s = (*txn)->Write(absl::MakeConstSpan(payload.data() + off, len)); !s.ok()) {
        return s;
      }
    }
    auto info = (*txn)->Commit();
    return info.status();
  }

  // The whole sequence in `dtype`; also read back in odd 1000-byte pieces, which must agree.
  std::vector<uint8_t> Fetch(uint64_t id, DType dtype) {
    auto r = store_->BeginFetch(MakeFetch(id, dtype));
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    EXPECT_EQ((*r)->dtype(), dtype);
    std::vector<uint8_t> whole((*r)->payload_bytes()), pieces(whole.size());
    (*r)->Read(0, absl::MakeSpan(whole));
    for (uint64_t off = 0; off < pieces.size(); off += 1000) {
      (*r)->Read(
          off, absl::MakeSpan(pieces.data() + off, std::min<uint64_t>(1000, pieces.size() - off)));
    }
    EXPECT_TRUE(whole == pieces) << "reads in pieces differ from one whole read";
    return whole;
  }

  // Fetches the sequence as fp32 and checks every element against its bound; fp16 and bf16
  // fetches must be finite too, and fp16 layers fed fp16 come back bit-exact.
  void ExpectWithinBounds(uint64_t id, const Ref& ref) {
    auto info = store_->Get(id);
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->length, ref.length());
    const std::vector<uint8_t> got = Fetch(id, DType::kFp32);
    const float* f = reinterpret_cast<const float*>(got.data());
    size_t at = 0, bad = 0, nonfinite = 0, saturated = 0;
    double worst = 0;  // largest error / bound seen, for the log
    for (uint32_t l = 0; l < m_.num_layers; ++l) {
      const DType stored = m_.layer_dtypes[l];
      for (uint32_t kv = 0; kv < ref.parts(); ++kv) {
        for (uint32_t h = 0; h < m_.num_kv_heads; ++h) {
          for (uint64_t t = 0; t < ref.length(); ++t) {
            const float* row = ref.Row(l, kv, h, t);
            Fp8Scale scale;
            if (qmath::IsFp8DType(stored)) scale = ref.Fp8ScaleOf(l, kv, h, t / m_.block_tokens);
            // With the scale known, values past scale * fmax must saturate to it exactly.
            const double limit = scale.exact ? double(scale.scale) * qmath::Fp8Max(stored)
                                             : std::numeric_limits<double>::infinity();
            for (uint32_t i = 0; i < ref.Dim(kv); ++i, ++at) {
              ASSERT_LT(at * 4, got.size()) << "fetch too short";
              const float y = f[at];
              if (!std::isfinite(y)) ++nonfinite;
              const double want = std::clamp(double(row[i]), -limit, limit);
              if (std::fabs(row[i]) > limit * (1 + 0x1p-20)) ++saturated;
              const double err = std::fabs(double(y) - want);
              const double bound =
                  Bound(stored, m_.input_dtype, row, ref.Dim(kv), i, scale.scale, want);
              if (bound > 0) worst = std::max(worst, err / bound);
              if (!(err <= bound) && ++bad <= 5) {
                ADD_FAILURE() << "layer " << l << " (" << DTypeName(stored) << ") "
                              << (kv ? "V" : "K") << " head " << h << " token " << t << " element "
                              << i << ": stored " << row[i] << ", fetched " << y << ", error "
                              << err << " > bound " << bound;
              }
            }
          }
        }
      }
    }
    EXPECT_EQ(at * 4, got.size());
    EXPECT_EQ(bad, 0u) << "elements out of bounds";
    EXPECT_EQ(nonfinite, 0u) << "NaN / Inf fetched from finite input";
    std::printf("  %s: %zu elements (%zu saturated fp8), worst error / bound %.3f\n",
                m_.name.c_str(), at, saturated, worst);
    for (DType d : {DType::kFp16, DType::kBf16}) {
      const std::vector<uint8_t> narrow = Fetch(id, d);
      ASSERT_EQ(narrow.size(), got.size() / 2);
      for (size_t i = 0; i < narrow.size() / 2; ++i) {
        if (qmath::IsNonFinite(narrow.data(), d, i)) {
          ADD_FAILURE() << DTypeName(d) << " fetch: element " << i << " is NaN / Inf";
          break;
        }
      }
      if (d != m_.input_dtype) continue;
      // Layers that store the input dtype travel unchanged.
      const std::vector<uint8_t> sent = ref.Payload(0, ref.length(), d);
      const PayloadLayout p =
          PayloadLayout::Make(store_->block_layout(), 0, m_.num_layers, ref.length(), d);
      for (uint32_t l = 0; l < m_.num_layers; ++l) {
        if (m_.layer_dtypes[l] != d) continue;
        const uint64_t off = p.layer_offset[l];
        const uint64_t len =
            p.KPartBytes(store_->block_layout(), l) + p.VPartBytes(store_->block_layout(), l);
        EXPECT_TRUE(std::equal(sent.begin() + off, sent.begin() + off + len, narrow.begin() + off))
            << "layer " << l << " stores " << DTypeName(d) << " and is not bit-exact";
      }
    }
  }

 private:
  ModelLayout m_;
  std::unique_ptr<SequenceStore> store_;
};

// Uniform values whose magnitude varies by layer and head, with one outlier channel.
Ref::Gen Uniform(uint32_t seed, float scale = 1.0f) {
  auto rng = std::make_shared<std::mt19937>(seed);
  return [rng, scale](uint32_t l, uint32_t kv, uint32_t h, uint64_t, uint32_t i) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    // The outlier stays within fp8's headroom of 4 over any row's largest value (see Arrival).
    const float mag = scale * (0.25f + 0.5f * l + 0.3f * h + 0.1f * kv) * (i == 3 ? 2.5f : 1.0f);
    return u(*rng) * mag;
  };
}

struct Case {
  Storage storage;
  DType input;
  bool mla;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << (c.mla ? "MLA " : "GQA ") << StorageName(c.storage) << " from " << DTypeName(c.input);
}
std::string CaseName(const testing::TestParamInfo<Case>& info) {
  return absl::StrCat(info.param.mla ? "Mla_" : "Gqa_", StorageName(info.param.storage), "_",
                      DTypeName(info.param.input));
}
std::vector<Case> AllCases() {
  std::vector<Case> out;
  for (Storage s : {Storage::kInt8, Storage::kFp8E4M3, Storage::kFp8E5M2, Storage::kMixed}) {
    for (DType in : {DType::kFp32, DType::kFp16, DType::kBf16}) {
      for (bool mla : {false, true}) out.push_back({s, in, mla});
    }
  }
  return out;
}
uint32_t SeedOf(const Case& c, uint32_t salt) {
  return 1000u * (uint32_t(c.storage) + 1) + 100u * uint32_t(c.input) + 10u * c.mla + salt;
}

class QuantRoundTrip : public testing::TestWithParam<Case> {};

// A whole prompt then decode steps on one sequence; chunked appends (1, 7, 1000 bytes) on another.
TEST_P(QuantRoundTrip, EveryElementWithinItsBound) {
  const Case c = GetParam();
  QuantStore store(Layout(c.storage, c.input, c.mla));
  const uint32_t seed = SeedOf(c, 1);
  std::printf("seed %u\n", seed);

  const uint64_t a = store.NewSeq();
  Ref ra(store.layout());
  ASSERT_TRUE(store.Append(a, 23, ra.Add(23, Uniform(seed), Ref::Arrival::kWhole), 0).ok());
  ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(a, ra));
  for (int step = 0; step < 10; ++step) {  // decode: one token per append
    const std::vector<uint8_t> p = ra.Add(1, Uniform(seed + 100 + step), Ref::Arrival::kWhole);
    ASSERT_TRUE(store.Append(a, 1, p, 0).ok()) << "decode step " << step;
  }
  ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(a, ra));

  const uint64_t b = store.NewSeq();
  Ref rb(store.layout());
  struct Step {
    uint64_t tokens;
    size_t chunk;
  };
  for (const Step& s : {Step{5, 1}, Step{9, 7}, Step{16, 1000}, Step{1, 7}, Step{3, 1}}) {
    SCOPED_TRACE(testing::Message() << s.tokens << " tokens in chunks of " << s.chunk);
    const std::vector<uint8_t> p =
        rb.Add(s.tokens, Uniform(seed + 7 * s.chunk + s.tokens), Ref::Arrival::kChunked);
    absl::Status st = store.Append(b, s.tokens, p, s.chunk);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(b, rb));
  }
  EXPECT_EQ(store->CheckInvariants(), "");
}

// Constant, zero, huge (the fp16 maximum) and subnormal rows, side by side in the same blocks.
// The decode steps after the prompt put huge rows into fp8 blocks whose scale came from smaller
// ones: those saturate, to exactly +-scale * fmax (the scale is known: one row at hand, x 4).
TEST_P(QuantRoundTrip, SpecialRowsStayFiniteAndWithinBounds) {
  const Case c = GetParam();
  QuantStore store(Layout(c.storage, c.input, c.mla));
  const uint32_t seed = SeedOf(c, 2);
  std::printf("seed %u\n", seed);
  // The largest value every input dtype holds that fp16 holds too (bf16 rounds 65504 up).
  const float huge = c.input == DType::kBf16 ? 65280.0f : 65504.0f;
  // Subnormal in the input dtype: fp16 2^-24 steps; bf16 and fp32 below FLT_MIN.
  const float tiny = c.input == DType::kFp16 ? 0x1p-24f : 0x1p-130f;
  auto rng = std::make_shared<std::mt19937>(seed);
  const Ref::Gen gen = [&, rng](uint32_t l, uint32_t kv, uint32_t h, uint64_t t, uint32_t i) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    switch ((t + l + h + kv) % 6) {
      case 0:
        return 0.375f;  // constant row
      case 1:
        return 0.0f;  // zero row
      case 2:
        return i == 0 ? huge : (i == 1 ? -huge : u(*rng) * 100.0f);  // huge, both signs
      case 3:
        return tiny * float(int(i % 9) - 4);  // subnormal, both signs, zeros
      case 4:
        return -2.5f;  // negative constant row
      default:
        return u(*rng);
    }
  };
  const uint64_t id = store.NewSeq();
  Ref ref(store.layout());
  ASSERT_TRUE(store.Append(id, 16, ref.Add(16, gen, Ref::Arrival::kWhole), 0).ok());
  ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(id, ref));
  for (int step = 0; step < 4; ++step) {
    ASSERT_TRUE(store.Append(id, 1, ref.Add(1, gen, Ref::Arrival::kWhole), 0).ok());
  }
  ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(id, ref));
}

INSTANTIATE_TEST_SUITE_P(AllStorage, QuantRoundTrip, testing::ValuesIn(AllCases()), CaseName);

// Everything a refused append could disturb.
struct Snapshot {
  SequenceInfo info;
  std::vector<uint8_t> content;
  PoolStats pool;
};
Snapshot Capture(QuantStore& store, uint64_t id) {
  Snapshot s;
  auto info = store->Get(id);
  EXPECT_TRUE(info.ok()) << info.status();
  if (info.ok()) s.info = *info;
  s.content = store.Fetch(id, DType::kFp32);
  s.pool = store->Stats().pool;
  return s;
}
void ExpectSame(QuantStore& store, const Snapshot& a, const Snapshot& b) {
  EXPECT_EQ(a.info.length, b.info.length);
  EXPECT_EQ(a.info.layer_lengths, b.info.layer_lengths);
  EXPECT_EQ(a.info.num_blocks, b.info.num_blocks);
  EXPECT_EQ(a.info.cached_tokens, b.info.cached_tokens);
  EXPECT_TRUE(a.content == b.content) << "content changed";
  EXPECT_TRUE(SamePool(a.pool, b.pool))
      << "pool before: free " << a.pool.free << " used " << a.pool.used << " cached "
      << a.pool.cached << "; after: free " << b.pool.free << " used " << b.pool.used << " cached "
      << b.pool.cached;
  EXPECT_EQ(store->CheckInvariants(), "");
}

// Byte offset, in a payload of n tokens in `wire`, of element i of (layer l, kv, head h, token t).
uint64_t PayloadOffset(const ModelLayout& m, uint64_t n, DType wire, uint32_t l, uint32_t kv,
                       uint32_t h, uint64_t t, uint32_t i) {
  const BlockLayout b = ComputeBlockLayout(m);
  const PayloadLayout p = PayloadLayout::Make(b, 0, m.num_layers, n, wire);
  const uint32_t dim = kv == 0 ? m.head_dim : m.head_dim_v;
  return p.layer_offset[l] + (kv ? p.KPartBytes(b, l) : 0) +
         ((uint64_t{h} * n + t) * dim + i) * DTypeBytes(wire);
}

// NaN and Inf (either sign), wherever they sit, are refused with INVALID_ARGUMENT naming the value
// and where it is; the sequence, its content and the pool stay exactly as they were, and the
// sequence takes a clean append afterwards.
TEST(QuantStoreTest, NonFiniteInputIsRefusedAndChangesNothing) {
  struct Where {
    const char* what;
    uint64_t tokens;  // in the append
    uint64_t token;   // of the bad value, within the append
    uint32_t layer;   // of the bad value
    size_t chunk;     // write size; 0: one Write
  };
  // The sequence holds one full block first, so each append starts a block at its row 0.
  const Where kWhere[] = {
      {"the first row of a block", 9, 0, 1, 0},
      {"a later row of a block whose scale the rows at hand set", 9, 4, 2, 0},
      {"a row split across 1000-byte writes, late in the payload", 9, 5, 3, 1000},
      {"a decode step written 7 bytes at a time", 1, 0, 0, 7},
  };
  const float kBad[] = {std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity()};
  const uint32_t seed = 77;
  std::printf("seed %u\n", seed);
  for (Storage st : {Storage::kInt8, Storage::kFp8E4M3, Storage::kFp8E5M2, Storage::kMixed}) {
    for (DType in : {DType::kFp32, DType::kFp16, DType::kBf16}) {
      for (bool mla : {false, true}) {
        const ModelLayout m = Layout(st, in, mla);
        for (const Where& w : kWhere) {
          for (float bad : kBad) {
            SCOPED_TRACE(testing::Message() << m.name << ": " << bad << " in " << w.what);
            QuantStore store(m);
            const uint64_t id = store.NewSeq();
            Ref ref(m);
            ASSERT_TRUE(
                store.Append(id, 7, ref.Add(7, Uniform(seed), Ref::Arrival::kWhole), 0).ok());
            const Snapshot before = Capture(store, id);

            Ref next = ref;
            std::vector<uint8_t> payload =
                next.Add(w.tokens, Uniform(seed + 1), Ref::Arrival::kWhole);
            const uint32_t kv = next.parts() - 1, h = m.num_kv_heads - 1, i = 5;
            const uint64_t at = PayloadOffset(m, w.tokens, in, w.layer, kv, h, w.token, i);
            qmath::StoreFromFloat(payload.data() + at, in, 0, bad);
            {
              auto txn = store->BeginAppend(MakeAppend(id, w.tokens));
              ASSERT_TRUE(txn.ok()) << txn.status();
              const size_t step = w.chunk ? w.chunk : payload.size();
              absl::Status s;
              size_t off = 0;
              for (; off < payload.size() && s.ok(); off += step) {
                s = (*txn)->Write(absl::MakeConstSpan(payload.data() + off,
                                                      std::min(step, payload.size() - off)));
              }
              EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
              EXPECT_GT(off, at) << "refused before the bad value arrived";
              const std::string msg(s.message());
              EXPECT_NE(msg.find("NaN or Inf"), std::string::npos) << msg;
              EXPECT_NE(msg.find(absl::StrCat("layer ", w.layer, ",")), std::string::npos) << msg;
              EXPECT_NE(msg.find(absl::StrCat("head ", h, ",")), std::string::npos) << msg;
              EXPECT_NE(msg.find(absl::StrCat("token ", w.token, ",")), std::string::npos) << msg;
              EXPECT_NE(msg.find(absl::StrCat("element ", i, ")")), std::string::npos) << msg;
            }  // the transaction is dropped here
            ExpectSame(store, before, Capture(store, id));
            auto once = store->Append(MakeAppend(id, w.tokens), payload);
            EXPECT_EQ(once.status().code(), StatusCode::kInvalidArgument) << once.status();
            ExpectSame(store, before, Capture(store, id));

            // Still usable: the clean payload goes in and reads back within bounds.
            const std::vector<uint8_t> clean =
                ref.Add(w.tokens, Uniform(seed + 1),
                        w.chunk ? Ref::Arrival::kChunked : Ref::Arrival::kWhole);
            ASSERT_TRUE(store.Append(id, w.tokens, clean, w.chunk).ok());
            ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(id, ref));
            if (testing::Test::HasFailure()) return;  // one case's messages are enough
          }
        }
      }
    }
  }
}

// One block's bytes, from the layout rules (kvbank/layout.h), worked out by hand for GQA 4 layers
// x 3 heads x 72 dims x 7 tokens and MLA 4 layers x 40 dims x 7 tokens.
TEST(QuantStoreTest, BytesPerToken) {
  struct Want {
    Storage storage;
    bool mla;
    uint64_t block_bytes;
  };
  // fp16 GQA: per layer K and V of 3 x 7 x 72 x 2 = 3024 bytes each: 4 x 6048 = 24192.
  const uint64_t fp16_gqa = 24192, fp16_mla = 4 * 7 * 40 * 2;  // MLA: K only, 560 per layer
  const Want kWant[] = {
      // int8: K 1512 bytes, V at 1520 (16-aligned) to 3032; scales at 3040: f32 [2][3][7] = 168
      // (176 aligned) + u8 zero points 42 = 218, to 3258; the next layer at 3264. 3 x 3264 + 3258
      // = 13050, 64-aligned 13056 = fp16 / 2 (12096) + 4 x 210 scale bytes + 120 padding.
      {Storage::kInt8, false, 13056},
      // fp8: the scales are f32 [2][3] = 24 bytes per layer: to 3064, next at 3072; 12288.
      {Storage::kFp8E4M3, false, 12288},
      {Storage::kFp8E5M2, false, 12288},
      // fp16, int8, int8, fp16: 6048; int8 from 6048 to 9306; from 9312 to 12570; fp16 from 12576
      // to 18624 (a multiple of 64).
      {Storage::kMixed, false, 18624},
      // MLA int8: K 280, scales at 288: f32 [1][1][7] (32 aligned) + 7 = 39, to 327; next at 336.
      // 3 x 336 + 327 = 1335, 64-aligned 1344.
      {Storage::kInt8, true, 1344},
      // MLA fp8: K 280, scale at 288 (4 bytes) to 292; next at 304; 3 x 304 + 292 = 1204 -> 1216.
      {Storage::kFp8E4M3, true, 1216},
  };
  EXPECT_EQ(ComputeBlockLayout(Layout(Storage::kMixed, DType::kFp16, false)).layers[0].elem_bytes,
            2u);
  ModelLayout fp16 = Layout(Storage::kInt8, DType::kFp16, false);
  fp16.layer_dtypes.assign(kLayers, DType::kFp16);
  EXPECT_EQ(ComputeBlockLayout(fp16).block_bytes, fp16_gqa);
  fp16 = Layout(Storage::kInt8, DType::kFp16, true);
  fp16.layer_dtypes.assign(kLayers, DType::kFp16);
  EXPECT_EQ(ComputeBlockLayout(fp16).block_bytes, fp16_mla);
  for (const Want& w : kWant) {
    const ModelLayout m = Layout(w.storage, DType::kFp16, w.mla);
    SCOPED_TRACE(m.name);
    EXPECT_EQ(ComputeBlockLayout(m).block_bytes, w.block_bytes);
    // The pool holds as many blocks of this size as fit: the store's capacity follows.
    QuantStore store(m, 10);
    EXPECT_EQ(store->pool().num_blocks(), 10u);
    EXPECT_EQ(store->block_layout().block_bytes, w.block_bytes);
  }
  // Per token: int8 GQA 13056 / 7 = 1865.1 bytes against fp16's 3456, 0.54x; a pool of the same
  // size holds 24192 / 13056 = 1.85x the tokens.
  const double ratio = double(fp16_gqa) / 13056;
  std::printf("int8 / fp16 bytes per token: %.4f; tokens per pool: %.4fx\n", 1 / ratio, ratio);
  EXPECT_NEAR(ratio, 1.853, 0.001);

  // A real shape: llama-3.1-8b (32 layers, 8 KV heads of 128, 16 tokens) int8 against bf16.
  // Per layer int8 = 2 x 8 x 16 x 128 + 2 x 8 x 16 x (4 + 1) = 32768 + 1280 = 34048.
  ModelLayout llama;
  ASSERT_TRUE(PresetLayout("llama-3.1-8b", &llama, DType::kInt8));
  ModelLayout llama16;
  ASSERT_TRUE(PresetLayout("llama-3.1-8b", &llama16, DType::kBf16));
  EXPECT_EQ(ComputeBlockLayout(llama).block_bytes, 32u * 34048);
  EXPECT_EQ(ComputeBlockLayout(llama16).block_bytes, 32u * 65536);
  EXPECT_EQ(ComputeBlockLayout(llama).block_bytes / 16, 68096u);  // bytes per token
  std::printf("llama-3.1-8b int8: %.4fx the tokens of bf16 per pool byte\n",
              double(32 * 65536) / (32 * 34048));
}

// Fork and truncate + append on quantized sequences: each writer copies a shared block first, so
// the other sequence keeps its values (and, for fp8, the block scales they were encoded with).
TEST(QuantStoreTest, ForkAndTruncateCopyOnWrite) {
  const uint32_t seed = 500;
  std::printf("seed %u\n", seed);
  for (Storage st : {Storage::kInt8, Storage::kFp8E4M3, Storage::kFp8E5M2, Storage::kMixed}) {
    for (bool mla : {false, true}) {
      const ModelLayout m = Layout(st, DType::kFp16, mla);
      SCOPED_TRACE(m.name);
      QuantStore store(m);
      const uint64_t a = store.NewSeq();
      Ref ra(m);
      ASSERT_TRUE(store.Append(a, 17, ra.Add(17, Uniform(seed), Ref::Arrival::kWhole), 0).ok());
      const Snapshot parent = Capture(store, a);
      auto forked = store->Fork(a, absl::ZeroDuration());
      ASSERT_TRUE(forked.ok()) << forked.status();
      const uint64_t b = forked->id;
      Ref rb = ra;
      EXPECT_TRUE(store.Fetch(b, DType::kFp32) == parent.content) << "the fork reads differently";
      // Blocks 0 and 1 are shared, the partial block 2 copied.
      EXPECT_EQ(store->Stats().pool.used, 4u);

      ASSERT_TRUE(store.Append(b, 5, rb.Add(5, Uniform(seed + 1), Ref::Arrival::kWhole), 0).ok());
      ASSERT_TRUE(store.Append(a, 4, ra.Add(4, Uniform(seed + 2), Ref::Arrival::kWhole), 0).ok());
      ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(a, ra));
      ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(b, rb));
      EXPECT_EQ(store->Stats().pool.used, 2u + 1 + 2);

      // Cut A inside shared block 1 and write there: A gets a copy; B's block 1 stays. The new
      // values stay inside the range the block's scales were set for (fp8 saturates past it).
      const std::vector<uint8_t> b_before = store.Fetch(b, DType::kFp32);
      ASSERT_TRUE(store->Truncate(a, 10).ok());
      ra.Truncate(10);
      ASSERT_TRUE(
          store.Append(a, 6, ra.Add(6, Uniform(seed + 3, 0.5f), Ref::Arrival::kWhole), 0).ok());
      ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(a, ra));
      EXPECT_TRUE(store.Fetch(b, DType::kFp32) == b_before) << "B changed under A's write";

      // And the other way: B cut inside block 0, still shared with A.
      const std::vector<uint8_t> a_before = store.Fetch(a, DType::kFp32);
      ASSERT_TRUE(store->Truncate(b, 3).ok());
      rb.Truncate(3);
      ASSERT_TRUE(
          store.Append(b, 10, rb.Add(10, Uniform(seed + 4, 0.5f), Ref::Arrival::kChunked), 1000)
              .ok());
      ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(b, rb));
      EXPECT_TRUE(store.Fetch(a, DType::kFp32) == a_before) << "A changed under B's write";
      EXPECT_EQ(store->CheckInvariants(), "");
    }
  }
}

// Two sequences with the same prompt share its full quantized blocks; a quantized layout has its
// own prefix root, so its blocks never match an fp16 model's.
TEST(QuantStoreTest, PrefixSharingAndRoots) {
  const uint32_t seed = 600;
  std::printf("seed %u\n", seed);
  std::vector<uint32_t> prompt(23);
  for (uint32_t i = 0; i < prompt.size(); ++i) prompt[i] = 1000 + 7 * i;
  for (Storage st : {Storage::kInt8, Storage::kFp8E4M3, Storage::kMixed}) {
    const ModelLayout m = Layout(st, DType::kBf16, false);
    SCOPED_TRACE(m.name);
    QuantStore store(m);
    const uint64_t a = store.NewSeq(prompt);
    Ref ref(m);
    const std::vector<uint8_t> payload = ref.Add(23, Uniform(seed), Ref::Arrival::kWhole);
    ASSERT_TRUE(store.Append(a, 23, payload, 0, prompt).ok());
    ASSERT_NO_FATAL_FAILURE(store.ExpectWithinBounds(a, ref));
    EXPECT_EQ(store->Stats().pool.used, 4u);

    CreateOptions o;
    o.lease = absl::ZeroDuration();
    o.prompt = prompt;
    auto b = store->Create(o);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->cached_tokens, 21u);  // three full blocks of 7
    EXPECT_EQ(store->Stats().pool.used, 4u) << "the cached blocks are shared, not copied";
    // B sends only what is not cached: tokens [21, 23).
    const std::vector<uint8_t> rest = ref.Payload(21, 23, m.input_dtype);
    auto appended =
        store->Append(MakeAppend(b->id, 2, std::nullopt, {prompt[21], prompt[22]}), rest);
    ASSERT_TRUE(appended.ok()) << appended.status();
    EXPECT_TRUE(store.Fetch(b->id, DType::kFp32) == store.Fetch(a, DType::kFp32))
        << "B reads other values than A";
    EXPECT_EQ(store->Stats().pool.used, 5u);
    std::vector<MatchQuery> q(1);
    q[0].tokens = prompt;
    EXPECT_EQ(store->Match("", q), std::vector<uint64_t>{21});

    // Read by hash: the same values.
    const std::vector<BlockHash> hashes =
        PrefixHashes(store->options().hash, store->Root("", ""), prompt, kBlockTokens, {});
    auto blocks = store->FetchBlocks("", hashes, 0, std::nullopt, DType::kFp32);
    ASSERT_TRUE(blocks.ok()) << blocks.status();
    EXPECT_EQ((*blocks)->num_tokens(), 21u);
    std::vector<uint8_t> by_hash((*blocks)->payload_bytes());
    (*blocks)->Read(0, absl::MakeSpan(by_hash));
    auto prefix = store->BeginFetch([&] {
      FetchSpec f = MakeFetch(a, DType::kFp32);
      f.token_end = 21;
      return f;
    }());
    ASSERT_TRUE(prefix.ok()) << prefix.status();
    std::vector<uint8_t> by_seq((*prefix)->payload_bytes());
    (*prefix)->Read(0, absl::MakeSpan(by_seq));
    EXPECT_TRUE(by_hash == by_seq);

    // Same shape stored as bf16: another fingerprint, another root, no shared hash.
    ModelLayout plain = m;
    plain.layer_dtypes.assign(kLayers, DType::kBf16);
    EXPECT_NE(LayoutFingerprint(plain), LayoutFingerprint(m));
    QuantStore other(plain);
    EXPECT_NE(other->Root("", ""), store->Root("", ""));
    EXPECT_NE(PrefixHashes(other->options().hash, other->Root("", ""), prompt, kBlockTokens, {}),
              hashes);
  }
  // int8 and fp8 of the same shape differ too.
  EXPECT_NE(LayoutFingerprint(Layout(Storage::kInt8, DType::kFp16, false)),
            LayoutFingerprint(Layout(Storage::kFp8E4M3, DType::kFp16, false)));
  EXPECT_NE(LayoutFingerprint(Layout(Storage::kFp8E4M3, DType::kFp16, false)),
            LayoutFingerprint(Layout(Storage::kFp8E5M2, DType::kFp16, false)));
}

// Payloads travel as the input dtype (converted) or as a layer's own storage dtype; a quantized
// dtype only as the storage format of a range that stores exactly it.
TEST(QuantStoreTest, TransferDTypes) {
  const uint32_t seed = 700;
  std::printf("seed %u\n", seed);
  for (Storage st : {Storage::kInt8, Storage::kFp8E4M3, Storage::kMixed}) {
    const ModelLayout m = Layout(st, DType::kFp32, false);
    SCOPED_TRACE(m.name);
    QuantStore store(m);
    const uint64_t id = store.NewSeq();
    Ref ref(m);
    ASSERT_TRUE(store.Append(id, 9, ref.Add(9, Uniform(seed), Ref::Arrival::kWhole), 0).ok());
    const Snapshot before = Capture(store, id);

    // Fetch: fp32 / fp16 / bf16 always; another quantized dtype than the range stores never.
    for (DType d : {DType::kFp32, DType::kFp16, DType::kBf16}) {
      EXPECT_TRUE(store->BeginFetch(MakeFetch(id, d)).ok()) << DTypeName(d);
    }
    const DType other_q = st == Storage::kFp8E4M3 ? DType::kInt8 : DType::kFp8E4M3;
    for (DType d : {other_q, DType::kFp8E5M2}) {
      auto r = store->BeginFetch(MakeFetch(id, d));
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << DTypeName(d);
      EXPECT_NE(r.status().message().find("storage format"), std::string::npos) << r.status();
      auto a = store->BeginAppend(MakeAppend(id, 1, d));
      EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument) << DTypeName(d);
      EXPECT_NE(a.status().message().find("storage format"), std::string::npos) << a.status();
    }
    if (st == Storage::kMixed) {  // int8 over fp16 and int8 layers
      auto r = store->BeginFetch(MakeFetch(id, DType::kInt8));
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(r.status().message().find("storage format"), std::string::npos) << r.status();
    }
    // Append: neither the input dtype (fp32) nor the storage dtype.
    for (DType d : {DType::kFp16, DType::kBf16}) {
      if (st == Storage::kMixed && d == DType::kFp16) continue;  // checked below
      auto a = store->BeginAppend(MakeAppend(id, 1, d));
      EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument) << DTypeName(d);
      EXPECT_NE(a.status().message().find("input dtype"), std::string::npos) << a.status();
    }
    if (st == Storage::kMixed) {
      // fp16 is layer 0's own dtype: fine for layer 0 alone, not with the int8 layer 1.
      AppendSpec both = MakeAppend(id, 1, DType::kFp16);
      both.layer_end = 2;
      auto a = store->BeginAppend(both);
      EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument) << a.status();
      EXPECT_NE(a.status().message().find("layer 1"), std::string::npos) << a.status();
      AppendSpec first = both;
      first.layer_end = 1;
      auto ok = store->BeginAppend(first);
      EXPECT_TRUE(ok.ok()) << ok.status();
      if (ok.ok()) {
        EXPECT_EQ((*ok)->dtype(), DType::kFp16);
      }
    }
    ExpectSame(store, before, Capture(store, id));
    // Unspecified: the input dtype in, the input dtype out.
    auto r = store->BeginFetch(MakeFetch(id, std::nullopt));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)->dtype(), DType::kFp32);
    EXPECT_EQ(DefaultWireDType(m, 0, kLayers), DType::kFp32);
  }
}

}  // namespace
}  // namespace kvbank
