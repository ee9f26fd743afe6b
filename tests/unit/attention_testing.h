// Test fixtures for decode attention, shared by the CPU test (attention_test.cc) and the GPU test
// (tests/gpu/gpu_attention_test.cc): a pool of blocks laid out by the one layout function and
// filled through the codecs, a batch of items over shuffled block ids, and the comparison of two
// results with tolerances. Header-only; needs GoogleTest, the kernels and the layout (no Abseil).
#ifndef KVBANK_TESTS_UNIT_ATTENTION_TESTING_H_
#define KVBANK_TESTS_UNIT_ATTENTION_TESTING_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.h"
#include "kernels/quant.h"
#include "kvbank/layout.h"

namespace kvbank::kernels::testing {

struct AttnCase {
  DType dtype = DType::kFp16;  // storage dtype of layer 1 (what most items attend)
  DType dtype0 =
      DType::kFp16;  // storage dtype of layer 0 (items with odd index attend it if mixed)
  bool mixed = false;
  uint32_t head_dim = 128, head_dim_v = 128, num_q_heads = 8, num_kv_heads = 2;
  uint32_t block_tokens = 16;
  bool mla = false;
  std::vector<uint32_t> lengths = {1, 2, 17, 100, 1000};
  uint32_t window = 0, sinks = 0;

  std::string Name() const {
    std::string s = std::string(DTypeName(dtype)) +
                    (mixed ? std::string("+") + DTypeName(dtype0) : "") + " d" +
                    std::to_string(head_dim) + "/" + std::to_string(head_dim_v) + " q" +
                    std::to_string(num_q_heads) + " kv" + std::to_string(num_kv_heads) + " bt" +
                    std::to_string(block_tokens) + (mla ? " mla" : "");
    if (window) s += " window " + std::to_string(window) + " sinks " + std::to_string(sinks);
    return s;
  }
};

// Host data of one batch. Block ids are a shuffled permutation with unused blocks in between.
struct AttnBatch {
  BlockLayout layout;
  std::vector<uint8_t> pool;
  std::vector<LayerView> layers;  // [batch]
  std::vector<int32_t> indptr, indices;
  std::vector<uint32_t> lengths;
  std::vector<float> q;
  uint32_t num_blocks = 0;
};

struct AttnOutputs {
  std::vector<float> out, lse;
  std::vector<std::vector<float>> probs;
  std::vector<float*> probs_ptrs;
};

inline void StoreRows(const std::vector<float>& src, DType d, uint8_t* blk, const LayerView& v,
                      uint32_t kv, uint32_t h, uint32_t dim) {
  const uint32_t rows = v.block_tokens;
  uint8_t* dst = blk + (kv == 0 ? v.KRow(h, 0) : v.VRow(h, 0));
  if (d == DType::kInt8) {
    QuantizeInt8Rows(src.data(), DType::kFp32, rows, dim, dst,
                     reinterpret_cast<float*>(blk + v.Int8Scale(kv, h, 0)),
                     blk + v.Int8ZeroPoint(kv, h, 0));
  } else if (d == DType::kFp8E4M3 || d == DType::kFp8E5M2) {
    const float scale = Fp8ScaleFor(AbsMax(src.data(), DType::kFp32, src.size()), d);
    std::memcpy(blk + v.Fp8Scale(kv, h), &scale, 4);
    EncodeFp8(src.data(), DType::kFp32, src.size(), scale, d, dst);
  } else {
    ConvertElements(src.data(), DType::kFp32, dst, d, src.size());
  }
}

inline AttnBatch MakeBatch(const AttnCase& c, uint64_t seed) {
  AttnBatch b;
  ModelLayout m;
  m.name = "attn-test";
  m.num_layers = 2;
  m.num_q_heads = c.num_q_heads;
  m.num_kv_heads = c.num_kv_heads;
  m.head_dim = c.head_dim;
  m.head_dim_v = c.head_dim_v;
  m.block_tokens = c.block_tokens;
  m.kind = c.mla ? AttentionKind::kMla : AttentionKind::kGqa;
  if (c.mla) {
    m.kv_lora_rank = c.head_dim_v;
    m.rope_dim = c.head_dim - c.head_dim_v;
  }
  m.layer_dtypes = {c.mixed ? c.dtype0 : c.dtype, c.dtype};
  const std::string err = ValidateLayout(m);
  EXPECT_TRUE(err.empty()) << err;
  b.layout = ComputeBlockLayout(m);

  std::mt19937_64 rng(seed);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  const uint32_t bt = c.block_tokens;
  uint32_t used = 0;
  for (uint32_t len : c.lengths) used += (len + bt - 1) / bt;
  b.num_blocks = used + used / 3 + 1;
  b.pool.assign(size_t{b.num_blocks} * b.layout.block_bytes, 0);
  std::vector<int32_t> ids(b.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);

  // Fill every block of the pool (used or not) in both layers: K rows get a per-row offset and a
  // per-head magnitude so int8 zero points and fp8 scales vary.
  std::vector<float> rows;
  for (uint32_t blk = 0; blk < b.num_blocks; ++blk) {
    uint8_t* base = b.pool.data() + size_t{blk} * b.layout.block_bytes;
    for (uint32_t l = 0; l < 2; ++l) {
      const LayerView& v = b.layout.layers[l];
      for (uint32_t kv = 0; kv < v.KvParts(); ++kv) {
        const uint32_t dim = kv == 0 ? v.head_dim : v.head_dim_v;
        for (uint32_t h = 0; h < v.num_kv_heads; ++h) {
          rows.assign(size_t{bt} * dim, 0.0f);
          const float mag = 0.5f + 0.25f * float(h % 4);
          for (uint32_t t = 0; t < bt; ++t) {
            const float off = 0.3f * gauss(rng);
            for (uint32_t i = 0; i < dim; ++i) rows[size_t{t} * dim + i] = mag * gauss(rng) + off;
          }
          StoreRows(rows, v.dtype, base, v, kv, h, dim);
        }
      }
    }
  }

  b.indptr.push_back(0);
  uint32_t next = 0;
  for (size_t i = 0; i < c.lengths.size(); ++i) {
    const uint32_t nb = (c.lengths[i] + bt - 1) / bt;
    for (uint32_t k = 0; k < nb; ++k) b.indices.push_back(ids[next++]);
    b.indptr.push_back(static_cast<int32_t>(b.indices.size()));
    b.lengths.push_back(c.lengths[i]);
    b.layers.push_back(b.layout.layers[c.mixed && i % 2 == 1 ? 0 : 1]);
  }
  b.q.resize(c.lengths.size() * c.num_q_heads * c.head_dim);
  for (float& x : b.q) x = gauss(rng);
  return b;
}

inline void AllocOutputs(const AttnCase& c, bool probs, AttnOutputs* o) {
  const size_t batch = c.lengths.size();
  o->out.assign(batch * c.num_q_heads * c.head_dim_v, -7.0f);  // poison: every value is written
  o->lse.assign(batch * c.num_q_heads, -7.0f);
  o->probs.clear();
  o->probs_ptrs.clear();
  if (!probs) return;
  for (uint32_t len : c.lengths) o->probs.emplace_back(len, -7.0f);
  for (auto& p : o->probs) o->probs_ptrs.push_back(p.data());
}

// Params over host memory.
inline DecodeAttentionParams HostParams(const AttnCase& c, const AttnBatch& b, AttnOutputs* o) {
  DecodeAttentionParams p;
  p.kv.pool = b.pool.data();
  p.kv.block_bytes = b.layout.block_bytes;
  p.kv.layers = b.layers.data();
  p.kv.indptr = b.indptr.data();
  p.kv.indices = b.indices.data();
  p.kv.lengths = b.lengths.data();
  p.kv.batch = static_cast<uint32_t>(b.lengths.size());
  p.num_q_heads = c.num_q_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.head_dim = c.head_dim;
  p.head_dim_v = c.head_dim_v;
  p.sm_scale = 1.0f / std::sqrt(float(c.head_dim));
  p.window = c.window;
  p.sinks = c.sinks;
  p.q = b.q.data();
  p.out = o->out.data();
  p.lse = o->lse.data();
  p.token_probs = o->probs_ptrs.empty() ? nullptr : o->probs_ptrs.data();
  return p;
}

// Tolerances: both sides decode the same stored values, so what differs is the order and the
// precision of the accumulation (fp32 against fp64): relative 1e-5-ish, scaled by the largest V
// magnitude for the output (a convex combination of V rows).
struct Tolerance {
  double out_rel = 2e-5;
  double lse_abs = 2e-5;
  double prob_abs = 2e-5;
};

inline void ExpectMatches(const AttnCase& c, const AttnOutputs& got, const AttnOutputs& ref,
                          const Tolerance& tol, const std::string& what) {
  const uint32_t dv = c.head_dim_v, hq = c.num_q_heads;
  size_t bad = 0;
  double vmax = 1e-30;
  for (float r : ref.out) vmax = std::max(vmax, double(std::fabs(r)));
  for (size_t i = 0; i < c.lengths.size(); ++i) {
    for (uint32_t h = 0; h < hq; ++h) {
      const size_t li = i * hq + h;
      const float gl = got.lse[li], rl = ref.lse[li];
      ASSERT_FALSE(std::isnan(gl)) << what << " item " << i << " head " << h << " lse NaN";
      if (c.lengths[i] == 0) {
        EXPECT_TRUE(std::isinf(gl) && gl < 0) << what << " item " << i << " lse " << gl;
      } else if (std::fabs(double(gl) - rl) > tol.lse_abs * std::max(1.0, std::fabs(double(rl)))) {
        if (bad++ < 5)
          ADD_FAILURE() << what << " item " << i << " head " << h << " lse " << gl << " ref " << rl;
      }
      for (uint32_t d = 0; d < dv; ++d) {
        const float g = got.out[li * dv + d], r = ref.out[li * dv + d];
        ASSERT_FALSE(std::isnan(g)) << what << " item " << i << " head " << h << " out NaN";
        if (std::fabs(double(g) - r) > tol.out_rel * (vmax + std::fabs(double(r)))) {
          if (bad++ < 5)
            ADD_FAILURE() << what << " item " << i << " (len " << c.lengths[i] << ") head " << h
                          << " dim " << d << ": " << g << " ref " << r << " (|V| max " << vmax
                          << ")";
        }
      }
    }
    if (got.probs.empty()) continue;
    double sum = 0;
    for (uint32_t t = 0; t < c.lengths[i]; ++t) {
      const float g = got.probs[i][t], r = ref.probs[i][t];
      ASSERT_FALSE(std::isnan(g)) << what;
      ASSERT_GE(g, 0.0f) << what;
      sum += g;
      if (std::fabs(double(g) - r) > tol.prob_abs * std::max(1.0, double(r))) {
        if (bad++ < 5)
          ADD_FAILURE() << what << " item " << i << " token " << t << " prob " << g << " ref " << r;
      }
      const AttendSpan span = MakeAttendSpan(c.lengths[i], c.window, c.sinks);
      if (!span.Attends(t)) {
        EXPECT_EQ(g, 0.0f) << what << " item " << i << " token " << t << " outside the window";
      }
    }
    if (c.lengths[i] > 0) {
      EXPECT_NEAR(sum, double(hq), 1e-4 * hq) << what << " item " << i << ": probabilities sum";
    }
  }
}

// The dtype x block size x heads sweep both the CPU and the GPU test run: calls check(case, seed)
// for each case, seeds counting up from `seed`; stops at a fatal failure.
// Every storage dtype the kernels read.
inline constexpr DType kAllDTypes[] = {DType::kFp32, DType::kFp16,    DType::kBf16,
                                       DType::kInt8, DType::kFp8E4M3, DType::kFp8E5M2};

template <typename Check>
void ForEachSweepCase(uint64_t seed, Check check) {
  struct Heads {
    uint32_t d, hq, hkv;
  };
  // GQA ratio 1 (MHA), 4, 8, and MQA (one kv head).
  const Heads heads[] = {{64, 4, 4}, {128, 8, 2}, {256, 8, 1}, {128, 32, 4}, {128, 4, 1}};
  for (DType d : kAllDTypes) {
    for (uint32_t bt : {1u, 3u, 16u, 17u}) {
      for (const Heads& h : heads) {
        AttnCase c;
        c.dtype = d;
        c.block_tokens = bt;
        c.head_dim = c.head_dim_v = h.d;
        c.num_q_heads = h.hq;
        c.num_kv_heads = h.hkv;
        check(c, ++seed);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

}  // namespace kvbank::kernels::testing

#endif  // KVBANK_TESTS_UNIT_ATTENTION_TESTING_H_
