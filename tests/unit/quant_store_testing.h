// Support for the quantized-storage tests (quant_store_test.cc, quant_store_ops_test.cc): the
// layouts, a reference model of what each element may come back as, a store wrapper and the
// parameter cases.
#ifndef KVBANK_TESTS_UNIT_QUANT_STORE_TESTING_H_
#define KVBANK_TESTS_UNIT_QUANT_STORE_TESTING_H_

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
#include "tests/unit/test_memory.h"

namespace kvbank::quant_testing {

namespace qmath = kernels::qmath;
using absl::StatusCode;

enum class Storage { kInt8, kFp8E4M3, kFp8E5M2, kMixed };

inline const char* StorageName(Storage s) {
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

inline constexpr uint32_t kLayers = 4;
inline constexpr uint32_t kBlockTokens = 7;

// GQA: 3 KV heads of 72 (odd sizes on purpose); MLA: a latent of 32 + 8 rope dims, no V.
inline ModelLayout Layout(Storage s, DType input, bool mla) {
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
inline float RoundTo(DType d, float x) {
  if (d == DType::kFp16) return qmath::HalfToFloat(qmath::FloatToHalf(x, true));
  if (d == DType::kBf16) return qmath::Bf16ToFloat(qmath::FloatToBf16(x, true));
  return x;
}

// The fp8 scale of one (layer, K/V, head, block), and the scale that bounds its rows' error: the
// same, or after a rescale the sum of every scale the block had (each requantization of a row may
// add half a step of the new scale, on top of the error it had).
struct Fp8Scale {
  float scale = 0;
  double bound = 0;
};

// The input values of one sequence (floats exactly representable in the input dtype) and the fp8
// scale of each (layer, K/V, head, block).
class Ref {
 public:
  // gen(layer, kv, head, token, element) before rounding to the input dtype.
  using Gen = std::function<float(uint32_t, uint32_t, uint32_t, uint64_t, uint32_t)>;
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
  std::vector<uint8_t> Add(uint64_t n, const Gen& gen) {
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
          // Every block this append touches, by the store's rule (kernels/quant_math.h), however
          // the payload is cut: a block it starts gets the scale of its rows there, exact when
          // they fill the block, else with a headroom of 4; a block it continues keeps its scale
          // while that covers the new rows, else the scale doubles until it reaches what the
          // rows so far would get.
          std::vector<Fp8Scale>& scales = scale_[Slot(l, kv, h)];
          for (uint64_t b = t0 / bt; b * bt < t1; ++b) {
            const uint64_t r0 = std::max(t0, b * bt), r1 = std::min(t1, b * bt + bt);
            float amax = 0;
            for (const float* x = Row(l, kv, h, r0); x < Row(l, kv, h, r0) + (r1 - r0) * Dim(kv);
                 ++x) {
              amax = std::max(amax, std::fabs(*x));
            }
            const float want = qmath::Fp8ScaleFor(r1 - b * bt < bt ? amax * 4 : amax, stored);
            scales.resize(b + 1);
            Fp8Scale& s = scales[b];
            if (r0 == b * bt) {
              s.scale = want;
              s.bound = want;
            } else if (qmath::Fp8ScaleFor(amax, stored) > s.scale) {
              while (s.scale < want) s.scale *= 2;
              s.bound += s.scale;
            }
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
double Bound(DType stored, DType input, const float* row, uint32_t dim, uint32_t i,
             double fp8_scale, double want) {
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
      return x * 0x1p-4 + fp8_scale * 0x1p-10 + x * 0x1p-20;
    case DType::kFp8E5M2:
      return x * 0x1p-3 + fp8_scale * 0x1p-17 + x * 0x1p-20;
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

inline bool SamePool(const PoolStats& a, const PoolStats& b) {
  return a.total == b.total && a.free == b.free && a.cached == b.cached && a.used == b.used &&
         a.pinned == b.pinned && a.evictions == b.evictions;
}

class QuantStore {
 public:
  explicit QuantStore(const ModelLayout& m, uint64_t blocks = 96) : m_(m) {
    const BlockLayout b = ComputeBlockLayout(m);
    auto pool = testenv::CreateTestPool(b, blocks * b.block_bytes);
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
    EXPECT_TRUE((*r)->Read(0, absl::MakeSpan(whole)).ok());
    // Backwards too: on staged memory each piece may have to be read again.
    for (uint64_t off = 0; off < pieces.size(); off += 1000) {
      const uint64_t back = pieces.size() - std::min<uint64_t>(pieces.size(), off + 1000);
      EXPECT_TRUE((*r)->Read(back, absl::MakeSpan(pieces.data() + back,
                                                  std::min<uint64_t>(1000, pieces.size() - off)))
                      .ok());
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
            double limit = std::numeric_limits<double>::infinity();
            if (qmath::IsFp8DType(stored)) {
              scale = ref.Fp8ScaleOf(l, kv, h, t / m_.block_tokens);
              // Values past scale * fmax would saturate to it: none may (counted below).
              limit = double(scale.scale) * qmath::Fp8Max(stored);
            }
            for (uint32_t i = 0; i < ref.Dim(kv); ++i, ++at) {
              ASSERT_LT(at * 4, got.size()) << "fetch too short";
              const float y = f[at];
              if (!std::isfinite(y)) ++nonfinite;
              const double want = std::clamp(double(row[i]), -limit, limit);
              if (std::fabs(row[i]) > limit * (1 + 0x1p-20)) ++saturated;
              const double err = std::fabs(double(y) - want);
              const double bound =
                  Bound(stored, m_.input_dtype, row, ref.Dim(kv), i, scale.bound, want);
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
    EXPECT_EQ(saturated, 0u) << "finite values past their block's fp8 range";
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
          PayloadLayout::Make(store_->pool().layout(), 0, m_.num_layers, ref.length(), d);
      for (uint32_t l = 0; l < m_.num_layers; ++l) {
        if (m_.layer_dtypes[l] != d) continue;
        const uint64_t off = p.layer_offset[l];
        const uint64_t len =
            p.KPartBytes(store_->pool().layout(), l) + p.VPartBytes(store_->pool().layout(), l);
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
inline Ref::Gen Uniform(uint32_t seed, float scale = 1.0f) {
  auto rng = std::make_shared<std::mt19937>(seed);
  return [rng, scale](uint32_t l, uint32_t kv, uint32_t h, uint64_t, uint32_t i) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const float mag = scale * (0.25f + 0.5f * l + 0.3f * h + 0.1f * kv) * (i == 3 ? 2.5f : 1.0f);
    return u(*rng) * mag;
  };
}

struct Case {
  Storage storage;
  DType input;
  bool mla;
};
inline void PrintTo(const Case& c, std::ostream* os) {
  *os << (c.mla ? "MLA " : "GQA ") << StorageName(c.storage) << " from " << DTypeName(c.input);
}
inline std::string CaseName(const testing::TestParamInfo<Case>& info) {
  return absl::StrCat(info.param.mla ? "Mla_" : "Gqa_", StorageName(info.param.storage), "_",
                      DTypeName(info.param.input));
}
inline std::vector<Case> AllCases() {
  std::vector<Case> out;
  for (Storage s : {Storage::kInt8, Storage::kFp8E4M3, Storage::kFp8E5M2, Storage::kMixed}) {
    for (DType in : {DType::kFp32, DType::kFp16, DType::kBf16}) {
      for (bool mla : {false, true}) out.push_back({s, in, mla});
    }
  }
  return out;
}
inline uint32_t SeedOf(const Case& c, uint32_t salt) {
  return 1000u * (uint32_t(c.storage) + 1) + 100u * uint32_t(c.input) + 10u * c.mla + salt;
}

}  // namespace kvbank::quant_testing

#endif  // KVBANK_TESTS_UNIT_QUANT_STORE_TESTING_H_
