// Retention policies against simple reference models: a sliding window (last W tokens plus S
// sinks; blocks holding neither are released) and heavy hitters (H2O: the first token, the most
// attended and the recent ones, compacted into fresh blocks; shared blocks are never written).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "server/core/sequence_store.h"
#include "tests/unit/store_testing.h"
#include "tests/unit/test_memory.h"

namespace kvbank {
namespace {

using absl::StatusCode;

constexpr uint32_t kLayers = 2, kKv = 2, kQ = 4, kDim = 8, kBt = 4;

ModelLayout Layout() {
  return store_testing::GqaLayout("r", kLayers, kKv, kDim, kBt, DType::kFp32, DType::kFp32);
}

// The reference KV of one sequence: k[l][h][t][d], v likewise, one token appended at a time.
struct Kv {
  std::vector<std::vector<std::vector<std::vector<float>>>> k, v;
  Kv() : k(kLayers, std::vector<std::vector<std::vector<float>>>(kKv)), v(k) {}
  uint64_t size() const { return k[0][0].size(); }
};

class RetentionTest : public testing::Test {
 protected:
  void SetUp() override {
    StoreOptions o;
    o.default_lease = absl::ZeroDuration();
    auto store = testenv::CreateTestStore(Layout(), 256, o);
    ASSERT_TRUE(store.ok());
    store_ = *std::move(store);
  }

  // Appends n random tokens (ids from `first_id`) to `id` and to the reference.
  void Append(uint64_t id, Kv& ref, uint64_t n, uint32_t first_id = 0) {
    std::vector<float> payload;
    Kv add;
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (int part = 0; part < 2; ++part) {
        for (uint32_t h = 0; h < kKv; ++h) {
          for (uint64_t t = 0; t < n; ++t) {
            std::vector<float> row(kDim);
            for (float& x : row) x = g_(rng_);
            payload.insert(payload.end(), row.begin(), row.end());
            (part == 0 ? ref.k : ref.v)[l][h].push_back(row);
          }
        }
      }
    }
    AppendSpec a;
    a.sequence_id = id;
    a.num_tokens = n;
    for (uint64_t t = 0; t < n; ++t) a.token_ids.push_back(first_id + uint32_t(t));
    auto r = store_->Append(a, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()),
                                                   payload.size() * 4));
    ASSERT_TRUE(r.ok()) << r.status();
  }

  // Fetched K row of layer l, head h, token t.
  std::vector<float> FetchK(uint64_t id, uint32_t l, uint32_t h, uint64_t t) {
    FetchSpec f;
    f.sequence_id = id;
    f.token_begin = t;
    f.token_end = t + 1;
    f.layer_begin = l;
    f.layer_end = l + 1;
    auto r = store_->BeginFetch(f);
    EXPECT_TRUE(r.ok()) << r.status();
    std::vector<float> out(kDim);
    if (r.ok()) {
      EXPECT_TRUE((*r)->Read(uint64_t{h} * kDim * 4,
                             absl::MakeSpan(reinterpret_cast<uint8_t*>(out.data()), kDim * 4))
                      .ok());
    }
    return out;
  }

  // Reference attention for q [kQ][kDim] over the given token positions of layer l.
  static void Attention(const Kv& ref, uint32_t l, const std::vector<float>& q,
                        const std::vector<uint64_t>& tokens, std::vector<double>* out,
                        std::vector<double>* probs) {
    const double scale = 1.0 / std::sqrt(double(kDim));
    out->assign(kQ * kDim, 0);
    probs->assign(ref.size(), 0);
    for (uint32_t h = 0; h < kQ; ++h) {
      const uint32_t g = h / (kQ / kKv);
      std::vector<double> s;
      double mx = -INFINITY;
      for (uint64_t t : tokens) {
        double d = 0;
        for (uint32_t i = 0; i < kDim; ++i) d += double(q[h * kDim + i]) * ref.k[l][g][t][i];
        s.push_back(d * scale);
        mx = std::max(mx, s.back());
      }
      double sum = 0;
      for (double x : s) sum += std::exp(x - mx);
      for (size_t j = 0; j < tokens.size(); ++j) {
        const double p = std::exp(s[j] - mx) / sum;
        (*probs)[tokens[j]] += p;
        for (uint32_t i = 0; i < kDim; ++i) (*out)[h * kDim + i] += p * ref.v[l][g][tokens[j]][i];
      }
    }
  }

  std::vector<float> Query() {
    std::vector<float> q(kQ * kDim);
    for (float& x : q) x = g_(rng_);
    return q;
  }

  std::unique_ptr<SequenceStore> store_;
  std::mt19937_64 rng_{2026};
  std::normal_distribution<float> g_{0.f, 1.f};
};

TEST_F(RetentionTest, SlidingWindowReleasesBlocksAndAttendsOnlyWhatItKeeps) {
  std::printf("seed=2026\n");
  CreateOptions co;
  co.retention.kind = RetentionPolicy::Kind::kSlidingWindow;
  co.retention.window = 6;
  co.retention.sinks = 2;
  auto seq = store_->Create(co);
  ASSERT_TRUE(seq.ok());
  Kv ref;
  ASSERT_NO_FATAL_FAILURE(Append(seq->id, ref, 30));
  // Blocks 1..5 (tokens 4..23) hold neither a sink (0, 1) nor a recent token (24..29).
  EXPECT_EQ(store_->Get(seq->id)->num_blocks, 3u);
  EXPECT_EQ(store_->pool().Stats().used, 3u);
  EXPECT_EQ(FetchK(seq->id, 1, 1, 1), ref.k[1][1][1]);
  EXPECT_EQ(FetchK(seq->id, 0, 0, 27), ref.k[0][0][27]);
  FetchSpec gone;
  gone.sequence_id = seq->id;
  gone.token_begin = 8;
  gone.token_end = 12;
  EXPECT_EQ(store_->BeginFetch(gone).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_->Truncate(seq->id, 10).status().code(), StatusCode::kFailedPrecondition);

  // Decode: one token at a time; the pool never holds more than the window needs.
  for (int step = 0; step < 20; ++step) {
    ASSERT_NO_FATAL_FAILURE(Append(seq->id, ref, 1, 100 + step));
    EXPECT_LE(store_->pool().Stats().used, 4u) << "step " << step;
    // Attend (even asking for every token) sees the sinks and the window only.
    const std::vector<float> q = Query();
    std::vector<float> out(kQ * kDim), lse(kQ);
    SequenceStore::AttendItem item{seq->id, uint32_t(step % kLayers), q};
    ASSERT_TRUE(store_->Attend({}, {&item, 1}, absl::MakeSpan(out), absl::MakeSpan(lse)).ok());
    const uint64_t n = ref.size();
    std::vector<uint64_t> kept{0, 1};
    for (uint64_t t = n - 6; t < n; ++t) kept.push_back(t);
    std::vector<double> want, probs;
    Attention(ref, step % kLayers, q, kept, &want, &probs);
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(out[i], want[i], 1e-5) << i;
  }
  // A fork keeps the same tokens, and both stay consistent.
  auto fork = store_->Fork(seq->id, std::nullopt);
  ASSERT_TRUE(fork.ok());
  EXPECT_EQ(FetchK(fork->id, 0, 1, ref.size() - 1), ref.k[0][1][ref.size() - 1]);
  EXPECT_EQ(store_->CheckInvariants(), "");
}

TEST_F(RetentionTest, HeavyHittersKeepTheFirstTheMostAttendedAndTheRecent) {
  std::printf("seed=2026\n");
  // A, with full retention, publishes a 8-token prompt; B shares it and keeps heavy hitters.
  CreateOptions full;
  auto a = store_->Create(full);
  Kv ref_a;
  ASSERT_NO_FATAL_FAILURE(Append(a->id, ref_a, 8, 500));
  CreateOptions h2o;
  h2o.retention.kind = RetentionPolicy::Kind::kHeavyHitter;
  h2o.retention.budget = 8;
  h2o.retention.window = 3;
  for (uint32_t t = 0; t < 8; ++t) h2o.prompt.push_back(500 + t);
  auto b = store_->Create(h2o);
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(b->cached_tokens, 8u);  // shares A's two blocks
  Kv ref = ref_a;                   // B's reference: the shared prompt, then its own tokens
  std::vector<double> score(8, 0);
  std::vector<uint64_t> positions(8);  // B's reference position of each kept token
  for (uint64_t t = 0; t < 8; ++t) positions[t] = t;

  // Decode until the first compaction (length 8 + 4 = 12), attending every step.
  uint64_t compactions = 0;
  for (int step = 0; compactions == 0; ++step) {
    ASSERT_LT(step, 10);
    ASSERT_NO_FATAL_FAILURE(Append(b->id, ref, 1, 900 + step));
    auto info = store_->Get(b->id);
    compactions = info->compactions;
    if (compactions > 0) break;
    score.resize(ref.size(), 0);
    for (uint32_t l = 0; l < kLayers; ++l) {
      const std::vector<float> q = Query();
      std::vector<float> out(kQ * kDim), lse(kQ);
      SequenceStore::AttendItem item{b->id, l, q};
      ASSERT_TRUE(store_->Attend({}, {&item, 1}, absl::MakeSpan(out), absl::MakeSpan(lse)).ok());
      std::vector<uint64_t> all(ref.size());
      for (uint64_t t = 0; t < ref.size(); ++t) all[t] = t;
      std::vector<double> want, probs;
      Attention(ref, l, q, all, &want, &probs);
      for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(out[i], want[i], 1e-5);
      for (uint64_t t = 0; t < probs.size(); ++t) score[t] += probs[t];
    }
  }
  // The reference rule: token 0, the (8 - 1 - 3) heaviest of 1 .. n-4, the last 3.
  const uint64_t n = ref.size();
  ASSERT_EQ(n, 12u);
  std::vector<uint64_t> middle;
  for (uint64_t t = 1; t < n - 3; ++t) middle.push_back(t);
  std::stable_sort(middle.begin(), middle.end(),
                   [&](uint64_t x, uint64_t y) { return score[x] > score[y]; });
  middle.resize(4);
  std::vector<uint64_t> keep{0};
  keep.insert(keep.end(), middle.begin(), middle.end());
  for (uint64_t t = n - 3; t < n; ++t) keep.push_back(t);
  std::sort(keep.begin(), keep.end());
  auto info = store_->Get(b->id);
  EXPECT_EQ(info->length, 8u);
  for (size_t j = 0; j < keep.size(); ++j) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t h = 0; h < kKv; ++h) {
        ASSERT_EQ(FetchK(b->id, l, h, j), ref.k[l][h][keep[j]]) << "kept " << j;
      }
    }
  }
  // A's blocks were shared, never written: A reads exactly what it appended.
  for (uint64_t t = 0; t < 8; ++t) EXPECT_EQ(FetchK(a->id, 1, 0, t), ref_a.k[1][0][t]);
  EXPECT_EQ(store_->CheckInvariants(), "");
}

TEST_F(RetentionTest, BadPoliciesAreRefused) {
  CreateOptions o;
  o.retention.kind = RetentionPolicy::Kind::kSlidingWindow;
  EXPECT_EQ(store_->Create(o).status().code(), StatusCode::kInvalidArgument);
  o.retention.kind = RetentionPolicy::Kind::kHeavyHitter;
  o.retention.budget = 4;
  o.retention.window = 3;
  EXPECT_EQ(store_->Create(o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvbank
